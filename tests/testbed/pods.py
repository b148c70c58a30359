"""Pods for tests on the real cluster, applied and watched through kubectl as a user would."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from testbed.cluster import NODE_NAMES, Cluster, kubectl_bin
from testbed.devices import rdma_resources


def rdma_pod(
    name: str,
    node: str,
    command: list[str],
    image: str,
    *,
    host_network: bool = True,
    labels: dict[str, str] | None = None,
    restart: str = "Never",
    devices: str = "plugin",
) -> dict[str, Any]:
    """An unprivileged pod pinned to node whose one container gets the node's RDMA devices from the
    device plugin (RDMA_RESOURCE) and IPC_LOCK to pin its buffers, running image's command.
    devices="hostPath" gives the lab shape the tests used before the plugin (privileged, /dev/infiniband
    mounted), kept only for bench/device_plugin_cost.py to compare against."""
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": {
            "nodeName": node,
            "hostNetwork": host_network,
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": command,
                    "resources": rdma_resources(),
                    "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                }
            ],
        },
    }
    if devices == "hostPath":
        container = pod["spec"]["containers"][0]
        del container["resources"]
        container["securityContext"] = {"privileged": True}
        container["volumeMounts"] = [{"name": "infiniband", "mountPath": "/dev/infiniband"}]
        pod["spec"]["volumes"] = [{"name": "infiniband", "hostPath": {"path": "/dev/infiniband"}}]
    elif devices != "plugin":
        raise ValueError(f"devices must be plugin or hostPath, not {devices!r}")
    return pod


def _pod(name: str, node: str, container: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """A pod of one container, "main", on `node`; it runs once and uses only the node's images."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            **spec,
            "containers": [{"name": "main", "imagePullPolicy": "Never", **container}],
        },
    }


def product_pod(name: str, node: str, image: str) -> dict[str, Any]:
    """A pod that idles in `image` on `node`, for running the product's own clients with `kubectl exec`;
    it gets no service-account token (a test hands it the token it should use)."""
    container = {"image": image, "command": ["sleep", "3600"]}
    return _pod(name, node, container, terminationGracePeriodSeconds=1, automountServiceAccountToken=False)


def image_pod(name: str, node: str, image: str, args: list[str]) -> dict[str, Any]:
    """A pod on `node` that runs `image`'s own entrypoint with `args`."""
    return _pod(name, node, {"image": image, "args": args})


def apply(cluster: Cluster, namespace: str, *objects: dict[str, Any]) -> None:
    doc = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(doc))


def get(cluster: Cluster, namespace: str, kind: str, name: str | None = None, **selectors: str) -> Any:
    args = ["get", kind, "-n", namespace, "-o", "json"]
    if name:
        args.insert(2, name)
    if selectors:
        args += ["-l", ",".join(f"{k}={v}" for k, v in selectors.items())]
    return json.loads(cluster.kubectl(*args).stdout)


def watch_status(
    cluster: Cluster,
    namespace: str,
    kind: str,
    name: str,
    field: str,
    until: Callable[[str], bool],
    timeout: float = 900.0,
) -> list[str]:
    """Every value status.<field> of the object takes, through `kubectl get --watch`, until `until` accepts
    one: a watch sees each update, where a poll misses the phases that last less than its period."""
    template = "jsonpath={.status." + field + '}{"\\n"}'
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # a watch the server ends starts again, from the current state
        watch = subprocess.Popen(
            [str(kubectl_bin()), f"--kubeconfig={cluster.kubeconfig}", "get", kind, name, "-n", namespace,
             "--watch", "-o", template],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), watch.kill)
        timer.start()
        try:
            assert watch.stdout is not None
            for line in watch.stdout:
                value = line.strip()
                if not seen or seen[-1] != value:
                    seen.append(value)
                if until(value):
                    return seen
        finally:
            timer.cancel()
            watch.kill()
            watch.wait()
        time.sleep(1)
    raise AssertionError(f"{kind} {namespace}/{name}: status.{field} went {seen} in {timeout:.0f} s")


def wait_pod(
    cluster: Cluster, namespace: str, name: str, phases: set[str], timeout: float = 480.0
) -> dict[str, Any]:
    """Wait until the pod's phase is one of phases; fail early if it ends in another."""
    deadline = time.monotonic() + timeout
    pod: dict[str, Any] = {}
    while time.monotonic() < deadline:
        pod = get(cluster, namespace, "pod", name)
        phase = pod["status"].get("phase", "")
        if phase in phases:
            return pod
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(2)
    logs = cluster.kubectl("logs", "-n", namespace, name, "--all-containers", check=False)
    raise AssertionError(
        f"pod {namespace}/{name} is {pod.get('status', {}).get('phase')!r}, wanted {sorted(phases)}:\n"
        f"{json.dumps(pod.get('status', {}), indent=1)[-3000:]}\n"
        f"logs:\n{logs.stdout[-2000:]}{logs.stderr[-500:]}{cluster.diagnose()}"
    )


def namespace(cluster: Cluster, name: str) -> str:
    """A fresh namespace whose default service account exists (pods need it for their token). A namespace
    of the same name that an earlier test deleted may still be terminating (its pods' teardown, a
    Checkpoint's finalizer): it is waited for."""
    cluster.kubectl("wait", "--for=delete", f"namespace/{name}", "--timeout=300s", check=False, timeout=320)
    cluster.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 60
    while cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"namespace {name}: no default service account after 60 s")
        time.sleep(0.5)
    return name


def delete_namespace(cluster: Cluster, name: str) -> None:
    """Delete and wait until it is gone: the next test (a drain, say) must not meet its pods.

    The namespace controller retries with a growing backoff while the pods terminate, and on the emulated
    nodes its next look came a minute or more after the last pod went. So the pods are deleted here too
    (a terminating namespace admits no new ones) and the namespace is touched once they are gone: an update
    makes the controller look again at once. They are deleted without waiting for their kubelet, whose
    confirmation can come long after the containers stopped on these nodes (docs/testbed.md,
    syncFrequency): a teardown needs the objects gone, and the kubelet's own cleanup then follows."""
    started = time.monotonic()
    # Checkpoints first, while their CheckpointStorage and Secret exist: deleted with the namespace, their
    # finalizer would find those gone, retry for 40 s and leave the images in S3 (docs/api/checkpoint.md)
    checkpoints = ("delete", "checkpoints.ibckpt.io", "--all", "-n", name, "--timeout=120s")
    cluster.kubectl(*checkpoints, check=False, timeout=150)
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
    force = ("--grace-period=0", "--force")
    cluster.kubectl("delete", "pods", "--all", "-n", name, *force, "--timeout=150s", check=False, timeout=170)
    pods_gone = time.monotonic() - started
    cluster.kubectl("annotate", "namespace", name, "ibckpt.io/pods-gone=true", "--overwrite", check=False)
    stopped = wait_kubelets_stopped(cluster, name) - started
    cluster.kubectl("wait", "--for=delete", f"namespace/{name}", "--timeout=180s", check=False, timeout=200)
    gone = time.monotonic() - started
    print(
        f"namespace {name}: its pods gone after {pods_gone:.1f}s, stopped on the nodes after {stopped:.1f}s, "
        f"the namespace after {gone:.1f}s"
    )


def wait_kubelets_stopped(cluster: Cluster, namespace: str, timeout: float = 240.0) -> float:
    """Wait until no kubelet runs a pod of `namespace` any more; when that was (time.monotonic()).

    A force-deleted pod's sandbox keeps running on its node until the kubelet has torn it down, and
    until then the kubelet answers `kubectl exec` and `kubectl logs` for a new pod of the same name
    from the old sandbox (it finds runtime pods by name first): the next test's exec then meets an
    exited container. The kubelet's /runningpods lists exactly what it would search."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for node in NODE_NAMES:
            raw = cluster.kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/runningpods/", check=False)
            if raw.returncode != 0:
                continue  # a node that does not answer runs nothing a test can reach
            items = json.loads(raw.stdout or "{}").get("items") or []
            left += [
                f"{node}/{p['metadata']['name']}"
                for p in items
                if p["metadata"].get("namespace") == namespace
            ]
        if not left or time.monotonic() > deadline:
            if left:
                print(f"namespace {namespace}: still running after {timeout:g}s: {left}")
            return time.monotonic()
        time.sleep(2)
