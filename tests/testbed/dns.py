"""Cluster DNS for the testbed's nodes: cluster_dns.py (the part CoreDNS plays on a real cluster) runs as a
DaemonSet on each node's own address, which the kubelets give pods as their nameserver (clusterDNS)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed.devices import node_daemonset
from testbed.images import APPS_IMAGE

if TYPE_CHECKING:
    from testbed.cluster import Cluster

DNS_NS = "kube-system"
DNS_NAME = "testbed-cluster-dns"
_SCRIPT = Path(__file__).with_name("cluster_dns.py")


def dns_objects() -> list[dict[str, Any]]:
    meta = {"name": DNS_NAME, "namespace": DNS_NS}
    script = {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"dns.py": _SCRIPT.read_text()}
    }  # fmt: skip
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
    # what CoreDNS's kubernetes plugin reads, less: Services and Endpoints
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": DNS_NAME},
        "rules": [{"apiGroups": [""], "resources": ["services", "endpoints"], "verbs": ["list"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": DNS_NAME},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": DNS_NAME},
        "subjects": [{"kind": "ServiceAccount", "name": DNS_NAME, "namespace": DNS_NS}],
    }
    pod = {
        "serviceAccountName": DNS_NAME,
        "containers": [
            {
                "name": "dns",
                "image": APPS_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["python3", "-u", "/dns/dns.py"],
                "env": [{"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}],
                # port 53 only: it reads the API with its own account
                "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}},
                "volumeMounts": [{"name": "script", "mountPath": "/dns"}],
            }
        ],
        "volumes": [{"name": "script", "configMap": {"name": DNS_NAME}}],
    }
    daemonset = node_daemonset(DNS_NAME, DNS_NS, pod)
    return [script, account, role, binding, daemonset]


def install_cluster_dns(cluster: Cluster) -> None:
    """Start the DNS on every node; does not wait (wait_cluster_dns does)."""
    doc = {"apiVersion": "v1", "kind": "List", "items": dns_objects()}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(doc))


def wait_cluster_dns(cluster: Cluster, timeout: float = 600.0) -> None:
    """Until the DNS serves on every node (its pods say so in their log)."""
    deadline = time.monotonic() + timeout
    while True:
        pods = json.loads(
            cluster.kubectl("get", "pods", "-n", DNS_NS, "-l", f"app={DNS_NAME}", "-o", "json").stdout
        )["items"]
        serving = [
            p
            for p in pods
            if "cluster-dns: serving"
            in cluster.kubectl("logs", "-n", DNS_NS, p["metadata"]["name"], check=False).stdout
        ]
        nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        if pods and len(serving) >= len(nodes):
            return
        if time.monotonic() > deadline:
            selector = f"app={DNS_NAME}"
            described = cluster.kubectl("describe", "pods", "-n", DNS_NS, "-l", selector, check=False)
            raise RuntimeError(
                f"testbed: the cluster DNS serves on {len(serving)} of {len(nodes)} nodes after "
                f"{timeout:g}s\n"
                f"{described.stdout[-4000:]}{cluster.diagnose()}"
            )
        time.sleep(3)
