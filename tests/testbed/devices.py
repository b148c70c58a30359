"""RDMA devices for pods the way real clusters hand them out: the testbed's device plugin
(rdma_device_plugin.py, the vendor's part) runs as a DaemonSet and each node advertises
RDMA_RESOURCE; a pod that asks for one unit gets the node's uverbs and rdma_cm nodes only."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed.images import APPS_IMAGE

if TYPE_CHECKING:
    from testbed.cluster import Cluster

RDMA_RESOURCE = "rdma/hca"
# node-2's plugin gives a container its HCAs last first (uverbs1, then uverbs0): every restore between
# the nodes meets the same devices in another order, and must map them by name (docs/rdma-pods.md)
REVERSED_ON = ("node-2",)
REVERSE_ARGS = [arg for node in REVERSED_ON for arg in ("--reverse-on", node)]
# each HCA's link between the nodes, by the first two octets of its addresses (guest-init2.sh)
LINKS = {"10.77": "rxe0", "10.78": "rxe1"}
PLUGIN_NS = "kube-system"
PLUGIN_NAME = "testbed-rdma-device-plugin"
_SCRIPT = Path(__file__).with_name("rdma_device_plugin.py")


def rdma_resources() -> dict[str, Any]:
    """What an RDMA container asks for: one share of its node's HCAs."""
    return {"limits": {RDMA_RESOURCE: "1"}, "requests": {RDMA_RESOURCE: "1"}}


def rails(gids: list[str]) -> set[str]:
    """The HCAs whose links the IPv4-mapped GIDs among `gids` (hex, as the shim's status gives them)
    are on: a context's virtual GIDs name the HCA it was opened on, its real ones the HCA it is on now."""
    raw = [bytes.fromhex(g) for g in gids]
    return {LINKS[f"{b[12]}.{b[13]}"] for b in raw if b[:12] == bytes(10) + b"\xff\xff"}


def node_daemonset(name: str, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    """A DaemonSet of the testbed's vendor parts: one pod on every node, on the node's network, on
    tainted nodes too, gone at once when deleted."""
    labels = {"app": name}
    spec = {"hostNetwork": True, "tolerations": [{"operator": "Exists"}], "terminationGracePeriodSeconds": 1}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {**spec, **pod}},
        },
    }


def plugin_objects() -> list[dict[str, Any]]:
    script = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": PLUGIN_NAME, "namespace": PLUGIN_NS},
        "data": {"plugin.py": _SCRIPT.read_text()},
    }
    host = {"/var/lib/kubelet/device-plugins": "plugins", "/dev/infiniband": "infiniband"}
    pod = {
        "automountServiceAccountToken": False,
        "containers": [
            {
                "name": "plugin",
                "image": APPS_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["python3", "-u", "/plugin/plugin.py", *REVERSE_ARGS],
                "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                # A vendor's device plugin reads the node's devices: it is privileged, the
                # RDMA pods it serves are not.
                "securityContext": {"privileged": True},
                "volumeMounts": [
                    {"name": "script", "mountPath": "/plugin"},
                    *({"name": n, "mountPath": p} for p, n in host.items()),
                ],
            }
        ],
        "volumes": [
            {"name": "script", "configMap": {"name": PLUGIN_NAME}},
            *({"name": n, "hostPath": {"path": p}} for p, n in host.items()),
        ],
    }
    daemonset = node_daemonset(PLUGIN_NAME, PLUGIN_NS, pod)
    return [script, daemonset]


class NodesStalled(RuntimeError):
    """Nodes whose guest stalled (Cluster.stalled) before they advertised their devices."""

    def __init__(self, nodes: list[str], report: str) -> None:
        super().__init__(f"testbed: {', '.join(nodes)} stalled before advertising {RDMA_RESOURCE}{report}")
        self.nodes = nodes


def install_device_plugin(cluster: Cluster, timeout: float = 300.0) -> None:
    """Run the plugin on every node and wait until each node advertises RDMA_RESOURCE.
    Raises NodesStalled as soon as a node still missing it has stalled: waiting longer is useless."""
    doc = {"apiVersion": "v1", "kind": "List", "items": plugin_objects()}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(doc))
    deadline = time.monotonic() + timeout
    missing: list[str] = []
    while time.monotonic() < deadline:
        nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        missing = [
            n["metadata"]["name"]
            for n in nodes
            if int(n["status"].get("allocatable", {}).get(RDMA_RESOURCE, "0")) < 1
        ]
        if not missing:
            return
        stalled = [n for n in missing if cluster.stalled(n)]
        if stalled:
            raise NodesStalled(stalled, cluster.diagnose())
        time.sleep(2)
    logs = cluster.kubectl("logs", "-n", PLUGIN_NS, "-l", f"app={PLUGIN_NAME}", "--tail=20", check=False)
    raise RuntimeError(
        f"testbed: nodes {missing} advertise no {RDMA_RESOURCE} after {timeout:g}s\n"
        f"{logs.stdout}{logs.stderr}{cluster.diagnose()}"
    )
