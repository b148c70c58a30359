"""The testbed's cluster, used the way a user uses one: kubectl against real kubelet/containerd/runc nodes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from testbed import pods
from testbed.cluster import NODE_NAMES, RDMA_LABEL, Cluster, node_ip
from testbed.devices import RDMA_RESOURCE
from testbed.images import APPS_IMAGE

# The session's chart is installed first (tests/conftest.py `installed`): the operator's start, minutes on
# these nodes, overlaps with these tests, which also show that plain pods work beside the product.
# (A plain `kubectl drain` of a Deployment's pod was here until 2026-11-29: tests/helm's drains, with
# the product's webhook and PodDisruptionBudget in the way, cover it. RDMA between pods on the two nodes,
# pod and host networks across nodes, and the product image's logs in kubectl went on 2026-12-01, for
# CI's time: every ring story of tests/helm runs them, with the agents reaching the coordinator's pod.)
pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("installed")]


@pytest.fixture
def ns(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = pods.namespace(cluster, request.node.name.replace("_", "-")[:50].strip("-"))
    try:
        yield name
    finally:
        pods.delete_namespace(cluster, name)


def test_both_nodes_ready_with_rdma(cluster: Cluster) -> None:
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    by_name = {n["metadata"]["name"]: n for n in nodes}
    assert sorted(by_name) == sorted(NODE_NAMES)
    for i, name in enumerate(NODE_NAMES, 1):
        node = by_name[name]
        assert node["metadata"]["labels"][RDMA_LABEL] == "rxe"
        # the testbed's device plugin (the vendor's part) advertises the node's HCAs to the kubelet
        assert int(node["status"]["allocatable"][RDMA_RESOURCE]) >= 8, node["status"]["allocatable"]
        addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
        assert addresses["InternalIP"] == node_ip(i)
        runtime = node["status"]["nodeInfo"]["containerRuntimeVersion"]
        assert runtime.startswith("containerd://"), runtime
    print(f"cluster timings: {cluster.timings}")


def test_kubelets_have_node_identities(cluster: Cluster) -> None:
    """Each kubelet is system:node:<name> (Node authorizer), not an admin: it may not read secrets at will."""
    for name in NODE_NAMES:
        kubeconfig = cluster.node_dirs[name] / "kubelet.kubeconfig"
        # The node's kubeconfig names the guest's view of the host; ask the same questions as the admin.
        as_node = (f"--as=system:node:{name}", "--as-group=system:nodes")
        who = cluster.kubectl("auth", "can-i", "list", "secrets", "--all-namespaces", *as_node, check=False)
        # v1.20 adds why: "no - can only read namespaced object of this type".
        assert who.stdout.strip().split()[0] == "no", who.stdout + who.stderr
        own = cluster.kubectl("auth", "can-i", "get", f"nodes/{name}", *as_node, check=False)
        assert own.stdout.strip() == "yes", own.stdout + own.stderr
        assert f"system:node:{name}" in kubeconfig.read_text()


def test_kubectl_exec_into_an_unprivileged_rdma_pod(cluster: Cluster, ns: str) -> None:
    """An RDMA pod as real clusters run it: not privileged, its devices only those the plugin allocated."""
    pod = pods.rdma_pod("shell", "node-1", ["sleep", "600"], APPS_IMAGE, host_network=False)
    assert "privileged" not in json.dumps(pod) and "hostPath" not in json.dumps(pod)
    pods.apply(cluster, ns, pod)
    pods.wait_pod(cluster, ns, "shell", {"Running"})
    script = "hostname; ibv_devices; echo devices: $(ls /dev/infiniband); grep CapEff /proc/self/status"
    out = cluster.kubectl("exec", "-n", ns, "shell", "--", "sh", "-c", script).stdout
    lines = out.split()
    assert lines[0] == "shell", out  # a pod-network pod has its own UTS namespace
    assert "rxe0" in out and "rxe1" in out, out
    # the plugin's allocation: the node's two uverbs nodes (and rdma_cm where the node loads rdma_ucm)
    given = set(out.split("devices:", 1)[1].split("\n", 1)[0].split())
    assert given - {"rdma_cm"} == {"uverbs0", "uverbs1"}, out
    cap_eff = int(out.rsplit("CapEff:", 1)[1].split()[0], 16)
    assert not cap_eff & (1 << 21), f"CAP_SYS_ADMIN in {cap_eff:x}"  # unprivileged
    assert cap_eff & (1 << 14), f"no CAP_IPC_LOCK in {cap_eff:x}"
