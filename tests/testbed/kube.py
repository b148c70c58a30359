"""A real Kubernetes control plane for tests: etcd + kube-apiserver (+ controller-manager).

Built from Debian's source package by build-kube.sh (v1.20). Everything listens on
127.0.0.1 only. The apiserver has its own CA and serving cert, a static admin token,
RBAC authorization and a service-account signing key. Without nodes, tests play the kubelet
by patching pod and node status, as envtest does; testbed.cluster adds real kubelets.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.guest import cache_dir
from testbed.ports import free_port
from testbed.reaper import die_with_parent


def kube_bin(name: str) -> Path:
    path = cache_dir() / "kube" / name
    if not path.exists():
        raise RuntimeError(f"{path} missing: run tests/testbed/build-kube.sh (make kube)")
    return path


@dataclass
class ControlPlane:
    url: str
    token: str
    ca_file: Path
    kubeconfig: Path
    workdir: Path
    pids: list[int] = field(default_factory=list)

    @property
    def webhook_client_ca(self) -> Path:
        """The CA of the client certificate this apiserver presents to webhooks."""
        return self.workdir / "pki" / WEBHOOK_CLIENT_CA

    def stop(self) -> None:
        for pid in reversed(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.pids.clear()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


# Addresses the apiserver is reached at: the host, a guest (qemu's forward) and pods (the
# kubernetes Service's first IP, DNAT'd to the forward by each node).
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
APISERVER_SANS = (
    "IP:127.0.0.1,IP:10.0.2.100,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
    "DNS:kubernetes.default.svc"
)


def issue_cert(pki: Path, name: str, subject: str, *, sans: str | None = None, client: bool = False) -> None:
    """name.key and name.crt signed by the test CA (client auth or server auth)."""
    ext = pki / f"{name}.ext"
    usage = "clientAuth" if client else "serverAuth"
    ext.write_text(f"extendedKeyUsage={usage}\n" + (f"subjectAltName={sans}\n" if sans else ""))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=pki)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "7", "-extfile", ext.name, "-out", f"{name}.crt", cwd=pki)  # fmt: skip
    (pki / f"{name}.key").chmod(0o600)


def _make_pki(pki: Path) -> None:
    pki.mkdir(parents=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "7", "-subj", "/CN=ibckpt-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=pki)  # fmt: skip
    issue_cert(pki, "apiserver", "/CN=kube-apiserver", sans=APISERVER_SANS)
    # How the apiserver proves itself to kubelets (logs, exec): a kubeadm-style identity.
    issue_cert(
        pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", client=True
    )
    issue_cert(pki, "scheduler", "/CN=system:kube-scheduler", client=True)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    for key in pki.glob("*.key"):
        key.chmod(0o600)


# The apiserver's client certificate for webhook calls, from a CA of its own (not the cluster's, whose
# client certificates name users): what an admin configures so that an admission server can tell the
# apiserver's calls from anyone else's (docs/security.md, "Admission caller").
WEBHOOK_CLIENT_CA = "webhook-client/ca.crt"


def _webhook_client(pki: Path, root: Path) -> str:
    """Make the webhook client CA and certificate, and the admission configuration that has the
    apiserver present it to every webhook; returns the apiserver's flag for it."""
    ca = pki / "webhook-client"
    ca.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "7", "-subj",
             "/CN=ibckpt-test-webhook-client-ca", "-keyout", "ca.key", "-out", "ca.crt", cwd=ca)  # fmt: skip
    (ca / "ca.key").chmod(0o600)
    issue_cert(ca, "apiserver", "/CN=kube-apiserver-webhook-client", client=True)
    kubeconfig = root / "webhook-client.kubeconfig"
    # "*": every webhook the apiserver calls gets this certificate (one that asks for none ignores it)
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nusers:\n- name: '*'\n"
        f"  user: {{client-certificate: {ca / 'apiserver.crt'}, client-key: {ca / 'apiserver.key'}}}\n"
    )
    webhook = (
        "    configuration:\n      apiVersion: apiserver.config.k8s.io/v1alpha1\n"
        f"      kind: WebhookAdmission\n      kubeConfigFile: {kubeconfig}\n"
    )
    admission = root / "admission.yaml"
    admission.write_text(
        "apiVersion: apiserver.k8s.io/v1alpha1\nkind: AdmissionConfiguration\nplugins:\n"
        f"  - name: ValidatingAdmissionWebhook\n{webhook}  - name: MutatingAdmissionWebhook\n{webhook}"
    )
    return f"--admission-control-config-file={admission}"


def write_kubeconfig(
    path: Path,
    url: str,
    ca_file: Path,
    token: str | None = None,
    user: str = "admin",
    cert: tuple[Path, Path] | None = None,
) -> None:
    """A kubeconfig that trusts ca_file and authenticates with a token or a client cert."""
    if cert is not None:
        creds = f'{{client-certificate: "{cert[0]}", client-key: "{cert[1]}"}}'
    else:
        creds = f'{{token: "{token}"}}'
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: ibckpt-test
  cluster: {{server: "{url}", certificate-authority: "{ca_file}"}}
users:
- name: {user}
  user: {creds}
contexts:
- name: ibckpt-test
  context: {{cluster: ibckpt-test, user: {user}}}
current-context: ibckpt-test
"""
    )
    path.chmod(0o600)


def _spawn(args: Sequence[str], log: Path) -> int:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            list(args),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    return proc.pid


def _wait_for_socket(path: Path, pid: int, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(
                f"testbed: {path.name} did not appear ({'exited' if done else 'timed out'})\n{tail}"
            )
        time.sleep(0.05)


def _wait_ready(url: str, ca_file: Path, token: str, timeout: float, log: Path) -> None:
    ctx = ssl.create_default_context(cafile=str(ca_file))
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"{url}/readyz", headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise RuntimeError(f"kube-apiserver not ready at {url} within {timeout}s ({last})\n{tail}")


# Controllers a real cluster runs for workloads and drains. nodelifecycle lifts the not-ready
# taint a kubelet registers with (nothing schedules without it).
NODE_CONTROLLERS = (
    "garbagecollector,namespace,serviceaccount,serviceaccount-token,nodelifecycle,replicaset,deployment,"
    "statefulset,daemonset,job,disruption,endpoint,podgc,ttl"
)


def start_control_plane(
    workdir: Path | None = None,
    controller_manager: bool = True,
    kubelets: dict[str, int] | None = None,
) -> ControlPlane:
    """etcd + apiserver (+ controller-manager) on 127.0.0.1.

    kubelets, for a cluster with real nodes: each node's "ip:port" of its kubelet, mapped to the
    loopback port qemu forwards it to. The apiserver then authorizes nodes (Node, RBAC,
    NodeRestriction), mounts service-account tokens into pods, reaches kubelets through the
    egress proxy, and a kube-scheduler and the workload controllers run too.
    """
    root = Path(workdir or tempfile.mkdtemp(prefix="ibckpt-kube-"))
    pki = root / "pki"
    _make_pki(pki)
    token = secrets.token_hex(16)
    tokens = root / "tokens.csv"
    tokens.write_text(f'{token},admin,admin-uid,"system:masters"\n')
    tokens.chmod(0o600)

    etcd_client, etcd_peer, api_port = free_port(), free_port(), free_port()
    plane = ControlPlane(f"https://127.0.0.1:{api_port}", token, pki / "ca.crt", root / "kubeconfig", root)
    if kubelets is None:
        mode = ["--authorization-mode=RBAC", "--disable-admission-plugins=ServiceAccount"]
    else:
        egress_sock = root / "egress.sock"
        (root / "egress.yaml").write_text(
            "apiVersion: apiserver.k8s.io/v1beta1\nkind: EgressSelectorConfiguration\negressSelections:\n"
            "- name: cluster\n  connection:\n    proxyProtocol: HTTPConnect\n"
            f"    transport:\n      uds:\n        udsName: {egress_sock}\n"
        )
        mode = [
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            f"--egress-selector-config-file={root / 'egress.yaml'}",
            # The node's IP is what the egress proxy routes and the kubelet's cert names.
            "--kubelet-preferred-address-types=InternalIP",
        ]
    try:
        if kubelets is not None:
            maps = [f"--map={node}=127.0.0.1:{port}" for node, port in kubelets.items()]
            # Run as a file: the child has neither pytest's sys.path nor its cwd.
            egress = Path(__file__).with_name("egress.py")
            plane.pids.append(
                _spawn([sys.executable, str(egress), f"--socket={egress_sock}", *maps], root / "egress.log")
            )
            _wait_for_socket(egress_sock, plane.pids[-1], root / "egress.log")
        plane.pids.append(
            _spawn(
                [
                    str(kube_bin("etcd")),
                    f"--data-dir={root / 'etcd'}",
                    f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                    "--unsafe-no-fsync",
                ],
                root / "etcd.log",
            )
        )
        api_log = root / "apiserver.log"
        plane.pids.append(
            _spawn(
                [
                    str(kube_bin("kube-apiserver")),
                    f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={api_port}",
                    "--insecure-port=0",
                    f"--tls-cert-file={pki / 'apiserver.crt'}",
                    f"--tls-private-key-file={pki / 'apiserver.key'}",
                    f"--client-ca-file={pki / 'ca.crt'}",
                    f"--token-auth-file={tokens}",
                    *mode,
                    _webhook_client(pki, root),
                    # Real clusters allow privileged pods (the node agent is one).
                    "--allow-privileged=true",
                    f"--service-account-key-file={pki / 'sa.pub'}",
                    f"--service-account-signing-key-file={pki / 'sa.key'}",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    "--api-audiences=https://kubernetes.default.svc",
                    # Service IPs are only allocated; each node DNATs kubernetes.default itself.
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--endpoint-reconciler-type=none",
                    f"--cert-dir={root / 'certs'}",
                ],
                api_log,
            )
        )
        _wait_ready(plane.url, plane.ca_file, token, 60.0, api_log)
        write_kubeconfig(plane.kubeconfig, plane.url, plane.ca_file, token)
        if controller_manager:
            controllers = NODE_CONTROLLERS if kubelets is not None else _API_ONLY_CONTROLLERS
            plane.pids.append(
                _spawn(
                    [
                        str(kube_bin("kube-controller-manager")),
                        f"--kubeconfig={plane.kubeconfig}",
                        f"--controllers={controllers}",
                        f"--service-account-private-key-file={pki / 'sa.key'}",
                        f"--root-ca-file={pki / 'ca.crt'}",
                        "--leader-elect=false",
                        "--port=0",
                        "--secure-port=0",
                        # TCG guests are slow: a busy kubelet must not be taken for a dead one.
                        "--node-monitor-grace-period=60s",
                        "--pod-eviction-timeout=60s",
                    ],
                    root / "controller-manager.log",
                )
            )
        if kubelets is not None:
            scheduler_kc = root / "scheduler.kubeconfig"
            write_kubeconfig(
                scheduler_kc, plane.url, plane.ca_file, user="system:kube-scheduler",
                cert=(pki / "scheduler.crt", pki / "scheduler.key"),
            )  # fmt: skip
            plane.pids.append(
                _spawn(
                    [
                        str(kube_bin("kube-scheduler")),
                        f"--kubeconfig={scheduler_kc}",
                        f"--authentication-kubeconfig={scheduler_kc}",
                        f"--authorization-kubeconfig={scheduler_kc}",
                        "--leader-elect=false",
                        "--bind-address=127.0.0.1",
                        "--port=0",
                        f"--secure-port={free_port()}",
                    ],
                    root / "scheduler.log",
                )
            )
    except BaseException:
        plane.stop()
        raise
    return plane


_API_ONLY_CONTROLLERS = "garbagecollector,namespace,serviceaccount-token"


def establish_crds(api: Any, bodies: Iterable[dict[str, Any]], *, replace: bool = False) -> None:
    """Create CustomResourceDefinitions through `api` (a kubernetes.client.ApiClient) and wait until the
    apiserver serves them. One that exists is kept, or with `replace` overwritten by the given body."""
    import kubernetes

    ext: Any = kubernetes.client.ApiextensionsV1Api(api)  # given plain dicts, not its typed models
    names = []
    for body in bodies:
        name = body["metadata"]["name"]
        names.append(name)
        try:
            ext.create_custom_resource_definition(body)
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
            if replace:
                current = ext.read_custom_resource_definition(name)
                body["metadata"]["resourceVersion"] = current.metadata.resource_version
                ext.replace_custom_resource_definition(name, body)
    deadline = time.monotonic() + 30
    for name in names:
        while True:
            got = ext.read_custom_resource_definition(name)
            conditions = {c.type: c.status for c in (got.status.conditions or [])}
            if conditions.get("Established") == "True":
                break
            assert time.monotonic() < deadline, f"CRD {name} not established: {conditions}"
            time.sleep(0.2)
