"""Into the pods, on the real cluster with the chart installed: an unmodified verbs program in a pod of the
`ibckpt` RuntimeClass runs under the shim the runtime wrapper preloaded and the agent lists it; a plain pod
of the same class is untouched; the pod is checkpointed through its node's agent (quiesce, drain,
release, `runc checkpoint`, images staged to S3) and restored as a new pod of the same name on the other
node (the agent stages its images, the wrapper turns containerd's create into `runc restore`, the agent
rebuilds its queue pairs), where it finishes with every message delivered exactly once. A restore
annotation naming another namespace's checkpoint is refused and the container does not start.

The agent is driven the way the operator drives it (tests/helm/operator_stand_in.py, in a pod, with the
operator's token and a coordinator on the pod network), never by calling agent internals.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helm.conftest import NAMESPACE, OPERATOR_SA, STORAGE_SECRET, Release, sa_token

from testbed import pods
from testbed.cluster import Cluster, node_ip
from testbed.images import APPS_IMAGE, PRODUCT_IMAGE
from testbed.ring import PACE, assert_exactly_once, results
from testbed.s3 import S3Server

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400)]

APP_NS = "ring-app"
BUCKET = "pod-migration"
AGENT_PORT = 9478
STAND_IN = Path(__file__).with_name("operator_stand_in.py")
# Two ranks in one pod: an rc_seq server and client over rxe0, exchanging checked messages until
# /tmp/stop appears; each prints its RESULT to the container's stdout. The shell keeps a file of the
# pod's /dev/shm open (fd 3), as a shared-memory transport keeps its segment: its restore needs the file.
RING = (
    "mkdir -p /tmp/session && echo written-before-the-cut >/tmp/session/ready && rm /etc/debian_version; "
    "echo shm-before-the-cut >/dev/shm/probe && exec 3</dev/shm/probe; "
    f"rc_seq -f /tmp/stop -p 18515 {PACE} & sleep 2; rc_seq -c 127.0.0.1 -f /tmp/stop -p 18515 {PACE}; wait; "
    "cat <&3; echo ring-done"
)


def ring_pod(name: str, node: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    pod = pods.rdma_pod(name, node, ["sh", "-c", RING], APPS_IMAGE, host_network=False)
    pod["spec"]["runtimeClassName"] = "ibckpt"
    if annotations:
        pod["metadata"]["annotations"] = annotations
    return pod


@pytest.fixture
def app_ns(installed: Release) -> Iterator[str]:
    cluster = installed.cluster
    pods.namespace(cluster, APP_NS)
    try:
        yield APP_NS
    finally:
        pods.delete_namespace(cluster, APP_NS)


@pytest.fixture
def stand_in(installed: Release, s3_server: S3Server) -> Iterator[Any]:
    """Runs operator_stand_in.py in a pod on the pod network; returns its RESULT."""
    cluster = installed.cluster
    bucket = f"{BUCKET}-{secrets.token_hex(3)}"
    s3_server.create_bucket(bucket)
    token = sa_token(cluster, NAMESPACE, OPERATOR_SA)
    port = s3_server.endpoint.rsplit(":", 1)[1]
    caller = pods.product_pod("stand-in", "node-1", PRODUCT_IMAGE)
    pods.apply(cluster, NAMESPACE, caller)
    pods.wait_pod(cluster, NAMESPACE, "stand-in", {"Running"})

    def run(action: str, node: int, **config: Any) -> dict[str, Any]:
        config |= {
            "action": action,
            "node": f"node-{node}",
            "agent": node_ip(node),
            "port": AGENT_PORT,
            "token": token,
            "location": {
                "endpoint": f"http://10.0.2.100:{port}",
                "bucket": bucket,
                "prefix": "ibckpt",
                "credentialsSecretRef": {"name": STORAGE_SECRET},
            },
            "secret_namespace": NAMESPACE,
            "secret_name": STORAGE_SECRET,
            "secret_data": {  # as Secret.data holds them
                "AWS_ACCESS_KEY_ID": base64.b64encode(s3_server.access_key.encode()).decode(),
                "AWS_SECRET_ACCESS_KEY": base64.b64encode(s3_server.secret_key.encode()).decode(),
            },
        }
        script = f"CONFIG = {json.dumps(json.dumps(config))}\n{STAND_IN.read_text()}"
        proc = cluster.kubectl(
            "exec", "-i", "-n", NAMESPACE, "stand-in", "--", "python3", "-",
            stdin=script, timeout=900, check=False,
        )  # fmt: skip
        if "RESULT " not in proc.stdout:
            raise AssertionError(f"{action} on node-{node}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return dict(json.loads(proc.stdout.split("RESULT ", 1)[1]))

    try:
        yield run
    finally:
        cluster.kubectl("delete", "pod", "-n", NAMESPACE, "stand-in", "--wait=false", check=False)


def process_env(cluster: Cluster, ns: str, pod: str) -> str:
    return cluster.kubectl("exec", "-n", ns, pod, "--", "sh", "-c", "tr '\\0' '\\n' </proc/1/environ").stdout


def agent_logs(cluster: Cluster, node: int) -> str:
    """The last lines of the node agent's log on node-N: what a failing session shows first."""
    listed = cluster.kubectl(
        "get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=agent",
        "--field-selector", f"spec.nodeName=node-{node}", "-o", "name", check=False,
    ).stdout.split()  # fmt: skip
    logs = [cluster.kubectl("logs", "-n", NAMESPACE, p, "--tail=60", check=False).stdout for p in listed]
    return f"\n--- agent on node-{node} (tail)\n" + "\n".join(logs)


def wait_registered(run: Any, node: int, pod_uid: str, ranks: int) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while True:
        listed = run("containers", node)["containers"]
        mine = [c for c in listed if c["podUid"] == pod_uid]
        if mine and len(mine[0]["sockets"]) >= ranks:
            return dict(mine[0])
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {pod_uid} not registered with {ranks} ranks on node-{node}: {listed}")
        time.sleep(2)


def test_a_pod_moves_to_the_other_node_and_finishes_exactly_once(
    installed: Release, app_ns: str, stand_in: Any, s3_server: S3Server
) -> None:
    cluster = installed.cluster
    plain = pods.rdma_pod("plain", "node-1", ["sleep", "600"], APPS_IMAGE, host_network=False)
    plain["spec"]["runtimeClassName"] = "ibckpt"
    plain["spec"]["containers"][0]["securityContext"] = {}
    plain["spec"]["containers"][0]["volumeMounts"] = []
    plain["spec"]["volumes"] = []
    pods.apply(cluster, app_ns, ring_pod("ring", "node-1"), plain)
    source = pods.wait_pod(cluster, app_ns, "ring", {"Running"})
    pods.wait_pod(cluster, app_ns, "plain", {"Running"})

    # the unmodified program runs under the shim; the plain pod of the same class does not
    assert "LD_PRELOAD=/run/ibckpt/lib/libibckpt.so" in process_env(cluster, app_ns, "ring")
    assert "LD_PRELOAD" not in process_env(cluster, app_ns, "plain")
    entry = wait_registered(stand_in, 1, source["metadata"]["uid"], ranks=2)
    assert (entry["namespace"], entry["pod"], entry["container"], entry["shim"]) == (
        app_ns,
        "ring",
        "main",
        True,
    )
    listed = stand_in("containers", 1)["containers"]
    assert not [c for c in listed if c["pod"] == "plain"], listed
    time.sleep(5)  # let the ring exchange messages before the cut

    checkpoint = stand_in(
        "checkpoint", 1,
        job="ring", mode="Stop", pod_uid=source["metadata"]["uid"],
        store_job=f"{app_ns}/ring", checkpoint_id="c1",
    )  # fmt: skip
    report = checkpoint["report"]
    assert report["state"] == "Succeeded", f"{json.dumps(report, indent=1)}{agent_logs(cluster, 1)}"
    assert report["phase"] == "Stopped" and len(report["ranks"]) == 2, report
    assert checkpoint["committed"]["bytes"] > 0
    rank_keys = sorted(r["rankKey"] for r in report["ranks"])
    assert all(k.startswith("ring/ring/main/") for k in rank_keys), rank_keys
    print(f"pod checkpoint: {checkpoint['seconds']:.1f}s, phases {report['phases']}, {report['bytes']} bytes")
    assert not results(cluster.kubectl("logs", "-n", app_ns, "ring").stdout), "the ring ended before the cut"

    # the source is gone (Stop); a new pod of the same name on the other node restores from the images
    cluster.kubectl("delete", "pod", "-n", app_ns, "ring", "--timeout=120s", timeout=150)
    # as the operator does: the agent stages the images first, then the pod is created (by the stand-in)
    restored = ring_pod("ring", "node-2", {"ibckpt.io/restore-from": f"{app_ns}/ring-c1"})
    restored["metadata"]["namespace"] = app_ns
    restore = stand_in(
        "restore", 2,
        job="ring", checkpoint=f"{app_ns}/ring-c1", namespace=app_ns, pod="ring", create=restored,
        api_ca=cluster.plane.ca_file.read_text(), rank_keys=rank_keys, store_job=f"{app_ns}/ring",
        checkpoint_id="c1",
    )  # fmt: skip
    report = restore["report"]
    assert report["state"] == "Succeeded", (
        f"{json.dumps(report, indent=1)}{agent_logs(cluster, 2)}{cluster.diagnose()}"
    )
    assert sorted(r["rankKey"] for r in report["ranks"]) == rank_keys
    print(f"pod restore: {restore['seconds']:.1f}s, phases {report['phases']}, {report['bytes']} bytes")
    moved = pods.wait_pod(cluster, app_ns, "ring", {"Running"})
    assert moved["spec"]["nodeName"] == "node-2" and moved["metadata"]["uid"] == restore["created"]
    assert {r["podUid"] for r in report["ranks"]} == {restore["created"]}  # the agent bound them
    [state] = moved["status"]["containerStatuses"]
    assert "running" in state["state"] and state["restartCount"] == 0, state
    # what the container wrote to, and deleted from, its own filesystem came along, and its /dev/shm
    files = (
        "cat /tmp/session/ready; test -e /etc/debian_version && echo still-there || echo deleted; "
        "cat /dev/shm/probe"
    )
    shown = cluster.kubectl("exec", "-n", app_ns, "ring", "--", "sh", "-c", files).stdout.split()
    assert shown == ["written-before-the-cut", "deleted", "shm-before-the-cut"], shown
    time.sleep(5)  # messages flow again on the rebuilt queue pairs
    cluster.kubectl("exec", "-n", app_ns, "ring", "--", "touch", "/tmp/stop")
    pods.wait_pod(cluster, app_ns, "ring", {"Succeeded"}, timeout=300)
    log = cluster.kubectl("logs", "-n", app_ns, "ring").stdout
    assert "ring-done" in log, log[-3000:]
    assert "shm-before-the-cut" in log, log[-3000:]  # read through the restored descriptor
    assert_exactly_once(log)
    agents = cluster.kubectl("logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=agent", "--tail=-1")
    assert "staged" in agents.stdout and s3_server.access_key not in agents.stdout


def test_a_restore_annotation_for_another_namespace_is_refused(installed: Release, app_ns: str) -> None:
    cluster = installed.cluster
    forged = ring_pod("forged", "node-1", {"ibckpt.io/restore-from": "kube-system/someone-elses"})
    pods.apply(cluster, app_ns, forged)
    deadline = time.monotonic() + 300
    message = ""
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        statuses = pods.get(cluster, app_ns, "pod", "forged")["status"].get("containerStatuses") or []
        status = statuses[0] if statuses else {}
        state = status.get("state", {})
        assert "running" not in state, status
        # the refused create: waiting to be retried, or (restartPolicy Never) terminated without a start
        message = (state.get("waiting") or state.get("terminated") or {}).get("message", "")
        if "refusing to restore" in message:
            break
        time.sleep(2)
    assert "belongs to namespace 'kube-system', the pod is in 'ring-app'" in message, message
    assert status["started"] is False, status  # the process never ran
