"""A real two-node Kubernetes cluster: the Soft-RoCE guests are its nodes.

The control plane (etcd, apiserver, controller-manager, scheduler, and the egress proxy the
apiserver reaches kubelets through) runs on the host's 127.0.0.1. Each of the two linked qemu
guests runs containerd, runc, CNI and a kubelet with a node identity of its own (a client cert
for system:node:node-N, as kubeadm gives them), joins the apiserver at 10.0.2.100 (qemu's
forward) and registers as node-1 / node-2 with an RDMA label. Pods with /dev/infiniband on the
two nodes talk RDMA over the guests' private link (rxe0, 10.77.0.N), and over a second link of their
own for the second HCA (rxe1, 10.78.0.N): two HCAs per node, as multi-rail nodes have. Pods get the
RDMA devices as on real clusters, from a device plugin (devices.py) that every node runs once it is
Ready.

CLI (for a person at the keyboard): python -m testbed.cluster up
    prints a kubeconfig path, keeps the cluster until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testbed import images as image_builds
from testbed.devices import NodesStalled, install_device_plugin
from testbed.dns import install_cluster_dns
from testbed.guest import GUEST_USER_ADDR, HERE, GuestPair, GuestSpec, cache_dir
from testbed.kube import (
    KUBERNETES_SERVICE_IP,
    ControlPlane,
    issue_cert,
    kube_bin,
    start_control_plane,
    write_kubeconfig,
)
from testbed.ports import free_port

NODE_NAMES = ("node-1", "node-2")
WEBHOOK_NODE = "node-2"
KUBELET_PORT = 10250
RDMA_LABEL = "ibckpt.io/rdma"
# A joining guest is stalled when its first health line (node-init.sh) has not come this long after
# it booted, or its last one is this old (it writes one every 30 s).
HEALTH_FIRST_S = 300.0
HEALTH_STALE_S = 150.0


def node_ip(index: int) -> str:
    return f"10.77.0.{index}"


@dataclass
class Cluster:
    plane: ControlPlane
    guests: GuestPair
    node_dirs: dict[str, Path]
    images: dict[str, image_builds.Image]
    started: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)
    # 127.0.0.1:<port> reaches that port on WEBHOOK_NODE (the apiserver cannot reach pod IPs in the
    # guests): a pod there publishing it as a hostPort serves the apiserver's webhook calls.
    webhook_port: int = 0

    @property
    def kubeconfig(self) -> Path:
        return self.plane.kubeconfig

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 180.0, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl as the cluster admin, the way a user at the keyboard would."""
        proc = subprocess.run(
            [str(kubectl_bin()), f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}):\n"
                f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}{self.diagnose()}"
            )
        return proc

    def node_log(self, node: str, name: str = "kubelet.log", tail: int = 40) -> str:
        path = self.node_dirs[node] / name
        if not path.exists():
            return f"({path} missing)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-tail:])

    def diagnose(self) -> str:
        """What a failing test should show: dead guests, and each kubelet's last lines."""
        parts = [f"\n--- {d}" for d in self.guests.dead()]
        for i, node in enumerate(NODE_NAMES, 1):
            console = "\n".join(self.guests.console(i).splitlines()[-12:])
            parts.append(f"\n--- {node} console (tail)\n{console}")
            parts.append(f"\n--- {node} kubelet.log (tail)\n{self.node_log(node, tail=15)}")
        # Last, as a long report is cut in its middle: each guest's health (node-init.sh).
        for node in NODE_NAMES:
            health = self.node_dirs[node] / "health.log"
            age = f"{time.time() - health.stat().st_mtime:.0f}s ago" if health.exists() else "never"
            parts.append(f"\n--- {node} health (written {age})\n{self.node_log(node, 'health.log', 4)}")
        return "".join(parts)

    def wait_nodes_ready(self, timeout: float = 600.0, may_reboot: Collection[str] = ()) -> None:
        """Wait until every node is Ready with its images. A guest in may_reboot whose kernel stalls
        (qemu TCG on a loaded host can lock a guest's CPUs for minutes) is booted afresh, once."""
        deadline = time.monotonic() + timeout
        ready: set[str] = set()
        rebooted = False
        while time.monotonic() < deadline:
            if self.guests.dead():
                raise RuntimeError(f"testbed: a node guest died while joining{self.diagnose()}")
            proc = self.kubectl("get", "nodes", "-o", "json", check=False)
            if proc.returncode == 0:
                for item in json.loads(proc.stdout)["items"]:
                    conds = {c["type"]: c["status"] for c in item["status"].get("conditions", [])}
                    taints = [t["key"] for t in item["spec"].get("taints", [])]
                    name = item["metadata"]["name"]
                    if conds.get("Ready") == "True" and "node.kubernetes.io/not-ready" not in taints:
                        if name not in ready:
                            self.timings[f"{name} ready"] = time.monotonic() - self.started
                        ready.add(name)
            imported = {n for n in NODE_NAMES if (self.node_dirs[n] / "images.done").exists()}
            for name in {f"{n} images" for n in imported} - set(self.timings):
                self.timings[name] = time.monotonic() - self.started
            if ready >= set(NODE_NAMES) and imported >= set(NODE_NAMES):
                return
            stalled = [n for n in NODE_NAMES if n not in ready and self.stalled(n)]
            if stalled and not rebooted and set(stalled) <= set(may_reboot):
                print(f"testbed: {', '.join(stalled)} stalled while joining, booting afresh{self.diagnose()}")
                self._reboot(stalled)
                rebooted, ready = True, set()
                deadline = time.monotonic() + timeout
            time.sleep(2)
        raise RuntimeError(
            f"testbed: nodes {sorted(set(NODE_NAMES) - ready)} not Ready in {timeout:g}s{self.diagnose()}"
        )

    def stalled(self, node: str) -> bool:
        """The guest's health line (every 30 s, node-init.sh) stopped, or never came since it booted."""
        booted_at = time.time() - (time.monotonic() - self.guests.started(NODE_NAMES.index(node) + 1))
        health = self.node_dirs[node] / "health.log"
        written = health.stat().st_mtime if health.exists() else 0.0
        if written < booted_at:
            return time.time() - booted_at > HEALTH_FIRST_S
        return time.time() - written > HEALTH_STALE_S

    def _reboot(self, stalled: list[str]) -> None:
        alone = stalled == ["node-1"]  # node-2 holds the link: it boots again only with node-1
        for node in ["node-1"] if alone else NODE_NAMES:
            (self.node_dirs[node] / "images.done").unlink(missing_ok=True)
            for what in ("ready", "images"):
                self.timings.pop(f"{node} {what}", None)
        if alone:
            self.guests.replace(1)
        else:
            self.guests.reboot()

    def kill_node(self, name: str) -> None:
        """Kill a node's guest hard (qemu SIGKILL): its kubelet, containers and memory vanish at once."""
        self.guests.kill(NODE_NAMES.index(name) + 1)

    def replace_node(self, name: str) -> None:
        """Boot a fresh guest for a killed node (an empty node of the same name, as a cloud's
        replacement VM): returns once it is Ready with its images and advertises its RDMA devices."""
        (self.node_dirs[name] / "images.done").unlink(missing_ok=True)
        self.guests.replace(NODE_NAMES.index(name) + 1)
        self.wait_nodes_ready(may_reboot=[name])
        self.advertise_devices(may_reboot=[name])

    def advertise_devices(self, may_reboot: Collection[str] = ()) -> None:
        """install_device_plugin; a node in may_reboot whose guest stalls meanwhile (as in
        wait_nodes_ready, it happens right after a node turns Ready too) is booted afresh, once."""
        try:
            install_device_plugin(self)
        except NodesStalled as stall:
            if not set(stall.nodes) <= set(may_reboot):
                raise
            print(f"{stall}\ntestbed: booting {', '.join(stall.nodes)} afresh")
            self._reboot(stall.nodes)
            self.wait_nodes_ready()
            install_device_plugin(self)

    def stop(self) -> None:
        self.guests.stop()
        self.plane.stop()


def delete_vanished_node(cluster: Cluster, name: str) -> None:
    """The cloud provider's part: once a node's VM is gone, its node lifecycle controller deletes the Node
    (the cloud-controller-manager does so for an instance that no longer exists)."""
    if cluster.guests.running(NODE_NAMES.index(name) + 1):
        raise RuntimeError(f"testbed: {name}'s guest still runs: the cloud would not delete its Node")
    cluster.kubectl("delete", "node", name, "--wait=false")


def kubectl_bin() -> Path:
    path = cache_dir() / "helm" / "kubectl"
    if not path.exists():
        raise RuntimeError(f"{path} missing: run tests/testbed/fetch-helm.sh (make helm)")
    return path


def kubectl_ibckpt(
    kubeconfig: Path, namespace: str, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`kubectl ibckpt -n NAMESPACE ARGS...`: kubectl finds the plugin on PATH, as it does for a user."""
    path = os.pathsep.join([str(Path(sys.executable).parent), str(kubectl_bin().parent), os.environ["PATH"]])
    env = {**os.environ, "PATH": path, "KUBECONFIG": str(kubeconfig)}
    return subprocess.run(
        [str(kubectl_bin()), "ibckpt", "-n", namespace, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _kubelet_config(node_dir: Path, address: str) -> str:
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {GUEST_USER_ADDR}
port: {KUBELET_PORT}
readOnlyPort: 0
tlsCertFile: {node_dir / "kubelet.crt"}
tlsPrivateKeyFile: {node_dir / "kubelet.key"}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {node_dir / "ca.crt"}}}
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
failSwapOn: false
makeIPTablesUtilChains: false
# The node's disks are tmpfs: disk-pressure evictions would fire at once.
evictionHard: {{}}
enforceNodeAllocatable: []
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
clusterDomain: cluster.local
# The testbed's cluster DNS (dns.py) serves on every node's own address.
clusterDNS: [{address}]
# A deleted pod's object went a minute or more after its containers and volumes were gone (the next
# resync of its pod worker, which is syncFrequency, 1m by default); every restore of a pod of the same
# name waits for that.
syncFrequency: 10s
# Emulated nodes pay dearly for the kubelet's idle work. Without QoS cgroups (the tests set no limits)
# it stops listing every pod cgroup of every controller each 2 s: about a fifth of its idle CPU, profiled.
cgroupsPerQOS: false
"""


def _prepare_node(plane: ControlPlane, root: Path, index: int, store: Path) -> Path:
    name = NODE_NAMES[index - 1]
    node_dir = root / name
    node_dir.mkdir(parents=True)
    pki = plane.workdir / "pki"
    # The kubelet's client identity (Node authorizer) and its serving cert for the apiserver.
    issue_cert(pki, f"{name}-client", f"/O=system:nodes/CN=system:node:{name}", client=True)
    issue_cert(
        pki, f"{name}-serving", f"/CN={name}", sans=f"IP:{node_ip(index)},IP:{GUEST_USER_ADDR},DNS:{name}"
    )
    for src, dst in (
        ("ca.crt", "ca.crt"),
        (f"{name}-client.crt", "client.crt"),
        (f"{name}-client.key", "client.key"),
        (f"{name}-serving.crt", "kubelet.crt"),
        (f"{name}-serving.key", "kubelet.key"),
    ):
        shutil.copy2(pki / src, node_dir / dst)
    api_port = plane.url.rsplit(":", 1)[1]
    write_kubeconfig(
        node_dir / "kubelet.kubeconfig",
        f"https://10.0.2.100:{api_port}",
        node_dir / "ca.crt",
        user=f"system:node:{name}",
        cert=(node_dir / "client.crt", node_dir / "client.key"),
    )
    (node_dir / "kubelet-config.yaml").write_text(_kubelet_config(node_dir, node_ip(index)))
    env = {
        "NODE_NAME": name,
        "NODE_IP": node_ip(index),
        "NODE_LABELS": f"{RDMA_LABEL}=rxe",
        "API_PORT": api_port,
        "NODE_STORE": str(store),
        "KUBELET": str(kube_bin("kubelet")),
        "PAUSE_IMAGE": image_builds.PAUSE_IMAGE,
        "POD_SUBNET": f"10.88.{index}.0/24",
        "CLUSTER_API_IP": KUBERNETES_SERVICE_IP,
        # the other nodes' pod subnets, as a CNI's routes would give them: "subnet via node-ip" pairs
        "POD_ROUTES": " ".join(
            f"10.88.{i}.0/24,{node_ip(i)}" for i in range(1, len(NODE_NAMES) + 1) if i != index
        ),
    }
    (node_dir / "node.env").write_text("".join(f"{k}='{v}'\n" for k, v in env.items()))
    return node_dir


def start_cluster(
    workdir: Path | None = None,
    forward_ports: Sequence[int] = (),
    memory_mb: int = 3072,
    cpus: int = 2,
    echo: bool = False,
    devices: int = 2,
) -> Cluster:
    """Control plane on the host, two node guests; returns once both nodes are Ready.

    forward_ports: host services (S3, ...) that pods and nodes reach at 10.0.2.100:<port>.
    devices: HCAs per node: rxe0 on the nodes' link, and with 2 rxe1 on a second link of its own.
    The nodes' containerd starts with a stock configuration: the chart's agents add the ibckpt handler.
    """
    root = Path(workdir or tempfile.mkdtemp(prefix="ibckpt-cluster-"))
    built = image_builds.build()
    store = image_builds.node_store(built)
    kubelet_ports = {name: free_port() for name in NODE_NAMES}
    webhook_port = free_port()
    started = time.monotonic()
    plane = start_control_plane(
        root / "control-plane",
        kubelets={f"{node_ip(i)}:{KUBELET_PORT}": kubelet_ports[n] for i, n in enumerate(NODE_NAMES, 1)},
    )
    try:
        api_port = int(plane.url.rsplit(":", 1)[1])
        node_dirs = {name: _prepare_node(plane, root, i, store) for i, name in enumerate(NODE_NAMES, 1)}
        specs = [
            GuestSpec(
                command=f"bash {HERE / 'node-init.sh'} {node_dirs[n]}",
                cpus=cpus,
                memory_mb=memory_mb,
                devices=devices,
                writable=[node_dirs[n]],
                forward_ports=[api_port, *forward_ports],
                host_forwards=[
                    (kubelet_ports[n], KUBELET_PORT),
                    *([(webhook_port, webhook_port)] if n == WEBHOOK_NODE else []),
                ],
            )
            for n in NODE_NAMES
        ]
        guests = GuestPair(specs[0], specs[1], echo=echo)
        cluster = Cluster(plane, guests, node_dirs, built, started, webhook_port=webhook_port)
    except BaseException:
        plane.stop()
        raise
    try:
        cluster.timings["control plane"] = time.monotonic() - started
        cluster.wait_nodes_ready(may_reboot=NODE_NAMES)
        # Pods get a service account token only once the namespace's default account exists.
        cluster.kubectl("wait", "--for=condition=Ready", "node", "--all", "--timeout=60s")
        install_cluster_dns(cluster)  # starts while the device plugin does; tests that resolve wait for it
        cluster.advertise_devices(may_reboot=NODE_NAMES)
        cluster.timings["device plugin"] = time.monotonic() - started
    except BaseException:
        cluster.stop()
        raise
    return cluster


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up"])
    parser.add_argument("--echo", action="store_true", help="show both guests' consoles")
    args = parser.parse_args(argv)
    cluster = start_cluster(echo=args.echo)
    print(f"cluster up: export KUBECONFIG={cluster.kubeconfig}")
    for what, seconds in cluster.timings.items():
        print(f"  {what}: {seconds:.1f}s")
    try:
        while not cluster.guests.dead():
            time.sleep(5)
        print("\n".join(cluster.guests.dead()))
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
