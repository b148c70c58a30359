"""The testbed's cluster, used the way a user uses one: kubectl against real kubelet/containerd/runc nodes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from testbed import pods
from testbed.cluster import NODE_NAMES, RDMA_LABEL, Cluster, node_ip
from testbed.devices import RDMA_RESOURCE
from testbed.images import APPS_IMAGE, PRODUCT_IMAGE

# The session's chart is installed first (tests/conftest.py `installed`): the operator's start, minutes on
# these nodes, overlaps with these tests, which also show that plain pods work beside the product.
# (A plain `kubectl drain` of a Deployment's pod was here until 2026-11-29: tests/helm's drains, with
# the product's webhook and PodDisruptionBudget in the way, cover it.)
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


def test_rdma_pingpong_between_pods_on_two_nodes(cluster: Cluster, ns: str) -> None:
    iters = "200"
    connect = f"ibv_rc_pingpong -g 1 -n {iters} {node_ip(1)}"
    server = pods.rdma_pod("pp-server", "node-1", ["ibv_rc_pingpong", "-g", "1", "-n", iters], APPS_IMAGE)
    client = pods.rdma_pod(
        "pp-client", "node-2",
        # The server may not listen yet when the client starts: retry the connect.
        ["sh", "-c", f"for i in $(seq 60); do {connect} && exit 0; sleep 1; done; exit 1"],
        APPS_IMAGE,
    )  # fmt: skip
    pods.apply(cluster, ns, server, client)
    for name in ("pp-server", "pp-client"):
        pods.wait_pod(cluster, ns, name, {"Succeeded"}, timeout=480)
    for name in ("pp-server", "pp-client"):
        out = cluster.kubectl("logs", "-n", ns, name).stdout
        assert f"{iters} iters in" in out, out


SERVE_TWICE = """
import socket
server = socket.create_server(("", 7000))
for _ in range(2):
    conn, peer = server.accept()
    conn.sendall(b"hello " + peer[0].encode())
    conn.close()
"""
CALL = """
import socket, sys, time
for _ in range(60):
    try:
        print(socket.create_connection((sys.argv[1], 7000), 20).recv(64).decode())
        break
    except OSError:
        time.sleep(1)
"""


def test_pods_and_host_network_reach_a_pod_on_the_other_node(cluster: Cluster, ns: str) -> None:
    """The operator's coordinator runs in a pod: agents (hostNetwork) and pods on every node connect to it."""
    serve = ["python3", "-c", SERVE_TWICE]
    pods.apply(cluster, ns, pods.rdma_pod("listener", "node-1", serve, APPS_IMAGE, host_network=False))
    ip = pods.wait_pod(cluster, ns, "listener", {"Running"})["status"]["podIP"]
    assert ip.startswith("10.88.1."), ip
    call = ["python3", "-c", CALL, ip]
    pods.apply(cluster, ns, pods.rdma_pod("caller-pod", "node-2", call, APPS_IMAGE, host_network=False))
    pods.wait_pod(cluster, ns, "caller-pod", {"Succeeded"}, timeout=300)
    pod_ip = pods.get(cluster, ns, "pod", "caller-pod")["status"]["podIP"]
    # pod to pod keeps the source address (no masquerade between pod subnets)
    assert cluster.kubectl("logs", "-n", ns, "caller-pod").stdout.strip() == f"hello {pod_ip}"
    pods.apply(cluster, ns, pods.rdma_pod("caller-host", "node-2", call, APPS_IMAGE, host_network=True))
    pods.wait_pod(cluster, ns, "caller-host", {"Succeeded"}, timeout=300)
    assert cluster.kubectl("logs", "-n", ns, "caller-host").stdout.strip() == f"hello {node_ip(2)}"


def test_product_image_runs_and_logs_reach_kubectl(cluster: Cluster, ns: str) -> None:
    pods.apply(cluster, ns, pods.image_pod("version", "node-2", PRODUCT_IMAGE, ["--version"]))
    done = pods.wait_pod(cluster, ns, "version", {"Succeeded"}, timeout=480)
    assert done["spec"]["containers"][0]["image"] == PRODUCT_IMAGE
    out = cluster.kubectl("logs", "-n", ns, "version").stdout
    assert out.startswith("ibckpt "), out


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
    assert "rxe0" in out, out
    # the plugin's allocation: the node's uverbs node (and rdma_cm where the node loads rdma_ucm)
    given = set(out.split("devices:", 1)[1].split("\n", 1)[0].split())
    assert given in ({"uverbs0"}, {"rdma_cm", "uverbs0"}), out
    cap_eff = int(out.rsplit("CapEff:", 1)[1].split()[0], 16)
    assert not cap_eff & (1 << 21), f"CAP_SYS_ADMIN in {cap_eff:x}"  # unprivileged
    assert cap_eff & (1 << 14), f"no CAP_IPC_LOCK in {cap_eff:x}"
