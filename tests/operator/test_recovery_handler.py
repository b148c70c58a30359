"""Automatic recovery against the real apiserver (v1.20), with fake node agents: a node made NotReady by
patching its status, a pod's container made to exit non-zero the same way (no kubelet runs here). The
fencing rule (docs/recovery.md) is what these show: a pod on an unreachable node is never removed
until its Node is deleted (NodeGone) or tainted out-of-service (OutOfServiceTaint); then the whole job is
stopped and one RestoreJob (latestOf the schedule, off the failed node) restores it. The node kill on the
real cluster is the cluster test's."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ibckpt.api import GROUP, VERSION
from testbed.s3 import S3Server

Agents = Cluster = Any  # conftest.py's fixtures
pytestmark = [pytest.mark.kube, pytest.mark.s3]
SCHEDULES, RESTORES, CHECKPOINTS = "checkpointschedules", "restorejobs", "checkpoints"
NODES = ("rec-a", "rec-b")


def protect(name: str, labels: dict[str, str], where: dict[str, Any], **recovery: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CheckpointSchedule",
        "metadata": {"name": name},
        "spec": {"recovery": recovery, "template": {"selector": {"matchLabels": labels}, "storage": where}},
    }


def checkpoint(cluster: Cluster, name: str, schedule: str, committed: datetime) -> None:
    """A committed Checkpoint of the schedule, as its CheckpointJob would have written it."""
    pods = [{"name": f"ring-{i}", "node": NODES[i], "ranks": [f"ring/ring-{i}/main/1"],
             "template": {"spec": {"containers": [{"name": "main", "image": "ring:test"}]}}}
            for i in (0, 1)]  # fmt: skip
    cluster.create(CHECKPOINTS, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Checkpoint",
        "metadata": {"name": name, "labels": {"ibckpt.io/schedule": schedule}},
        "spec": {"manifestKey": f"ibckpt/{name}/manifest.json", "storageRef": {"name": "nowhere"},
                 "jobName": f"{cluster.namespace}/ring", "checkpointId": name, "pods": pods,
                 "committedTime": committed.isoformat().replace("+00:00", "Z")},
    })  # fmt: skip


def not_ready(cluster: Cluster, node: str, since: datetime) -> None:
    stamp = since.isoformat().replace("+00:00", "Z")
    condition = {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                 "message": "Kubelet stopped posting node status.", "lastTransitionTime": stamp,
                 "lastHeartbeatTime": stamp}  # fmt: skip
    cluster.core.patch_node_status(node, {"status": {"conditions": [condition]}})


def fail(cluster: Cluster, pod: str, exit_code: int) -> None:
    """What a kubelet reports of a pod whose container exited non-zero (restartPolicy Never)."""
    ended = {"terminated": {"exitCode": exit_code, "reason": "Error", "finishedAt": "2026-11-29T12:00:00Z"}}
    statuses = [{"name": "main", "state": ended, "ready": False, "restartCount": 0, "image": "ring:test",
                 "imageID": "", "containerID": "containerd://1"}]  # fmt: skip
    status = {"phase": "Failed", "containerStatuses": statuses}
    cluster.core.patch_namespaced_pod_status(pod, cluster.namespace, {"status": status})


def recovery_phase(*wanted: str) -> Any:
    return lambda body: (body.get("status") or {}).get("recoveryPhase") in wanted


def bound(name: str) -> Any:
    def check(body: dict[str, Any]) -> bool:
        recovery = (body.get("status") or {}).get("recovery") or {}
        return bool(recovery.get("checkpoint") == name and recovery.get("workLostSeconds") is not None)

    return check


def deleting(cluster: Cluster, pod: str) -> bool:
    return cluster.core.read_namespaced_pod(pod, cluster.namespace).metadata.deletion_timestamp is not None


def wait_pod_gone(cluster: Cluster, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while name in cluster.pod_names():
        assert time.monotonic() < deadline, f"{name} is still there"
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def cleanup(cluster_ns: Cluster) -> Any:
    yield
    cluster_ns.drop_all(SCHEDULES)
    for node in NODES:
        cluster_ns.node(node)  # back (created again if deleted), Ready
        cluster_ns.core.patch_node(node, {"spec": {"taints": None}})


def ring(cluster: Cluster, agents: Agents, s3: S3Server, bucket: str) -> dict[str, Any]:
    agents.add(cluster, NODES[0], 1)
    agents.add(cluster, NODES[1], 2)
    for i, node in enumerate(NODES):
        cluster.pod(f"ring-{i}", node, {"app": "ring"})
    cluster.s3_secret(s3)
    return dict(cluster.s3_location(s3, bucket))


def test_an_unreachable_node_is_fenced_by_its_deletion_then_the_job_is_restored_once(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    where = ring(cluster_ns, agents, s3_server, bucket)
    taken = datetime.now(UTC) - timedelta(seconds=100)
    checkpoint(cluster_ns, "ring-old", "ring", taken - timedelta(seconds=500))
    checkpoint(cluster_ns, "ring-new", "ring", taken)
    with operator() as handle:
        schedule = cluster_ns.create(
            SCHEDULES, protect("ring", {"app": "ring"}, where, nodeNotReadySeconds=5)
        )
        body = cluster_ns.wait(SCHEDULES, "ring", recovery_phase("Idle"))
        failed = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=2)
        not_ready(cluster_ns, NODES[0], failed)
        body = cluster_ns.wait(SCHEDULES, "ring", recovery_phase("Fencing"), timeout=30)
        status = body["status"]
        assert status["recoveryReason"] == "NodeNotReady" and status["recovery"]["nodes"] == [NODES[0]]
        assert sorted(s["name"] for s in status["recovery"]["sources"]) == ["ring-0", "ring-1"]
        started = cluster_ns.wait_events("ring", "RecoveryStarted")[0]
        assert started.type == "Warning" and "restoring from ring-new" in started.message
        # The whole job is stopped; ring-1 (a live node) is being deleted, and no kubelet of rec-a can
        # confirm ring-0's kill: it stays, and nothing is restored while it may run.
        assert deleting(cluster_ns, "ring-0") and deleting(cluster_ns, "ring-1")
        cluster_ns.report_killed("ring-1")  # rec-b's kubelet kills its pod
        wait_pod_gone(cluster_ns, "ring-1")
        time.sleep(3)
        body = cluster_ns.get(SCHEDULES, "ring")
        assert body["status"]["recoveryPhase"] == "Fencing" and "ring-0" in cluster_ns.pod_names()
        assert "ring-0 on rec-a is known not to run" in body["status"]["recoveryMessage"]
        assert "delete its Node object" in body["status"]["recoveryMessage"]
        assert cluster_ns.get(RESTORES, "ring-recover-1") is None

        cluster_ns.core.delete_node(NODES[0])  # the node is gone: nothing of ring-0 runs any more
        wait_pod_gone(cluster_ns, "ring-0")
        body = cluster_ns.wait(
            SCHEDULES, "ring", recovery_phase("Restoring", "Recovered", "WaitingForPerson")
        )
        job = cluster_ns.wait(RESTORES, "ring-recover-1", lambda o: bool(o["spec"].get("checkpointName")))
        assert job["spec"]["latestOf"] == {"schedule": "ring"} and job["spec"]["avoidNodes"] == [NODES[0]]
        assert job["spec"]["checkpointName"] == "ring-new"
        [owner] = job["metadata"]["ownerReferences"]
        assert owner["uid"] == schedule["metadata"]["uid"] and owner["kind"] == "CheckpointSchedule"
        body = cluster_ns.wait(SCHEDULES, "ring", bound("ring-new"))
        recovery = body["status"]["recovery"]
        assert recovery["restoreJob"] == "ring-recover-1" and recovery["trigger"] == "NodeNotReady"
        assert abs(recovery["workLostSeconds"] - (failed - taken).total_seconds()) < 1.5
        # The restore of this fake Checkpoint (no images) ends; the recovery follows it to its end, loudly.
        body = cluster_ns.wait(
            SCHEDULES, "ring", recovery_phase("Recovered", "WaitingForPerson"), timeout=180
        )
        if body["status"]["recoveryPhase"] == "WaitingForPerson":
            assert body["status"]["recoveryReason"] == "RestoreFailed"
            assert "RestoreJob ring-recover-1" in body["status"]["recoveryMessage"]
            assert cluster_ns.wait_events("ring", "RecoveryWaiting")[0].type == "Warning"
        outcome = body["status"]["recoveryPhase"]
        assert (
            f'ibckpt_recoveries_total{{outcome="{outcome}",schedule="{cluster_ns.namespace}/ring"}} 1.0'
            in (handle.metrics())
        )
        # One recovery, one RestoreJob: a restarted operator reads the state back and makes no other.
    with operator():
        time.sleep(4)
        body = cluster_ns.get(SCHEDULES, "ring")
        assert body["status"]["recoveryPhase"] == outcome and body["status"]["recovery"]["seq"] == 1
        names = [r["metadata"]["name"] for r in cluster_ns.custom.list_namespaced_custom_object(
            GROUP, VERSION, cluster_ns.namespace, RESTORES)["items"]]  # fmt: skip
        assert names == ["ring-recover-1"]


def test_out_of_service_fences_under_its_policy(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    where = ring(cluster_ns, agents, s3_server, bucket)
    checkpoint(cluster_ns, "ring-1h", "ring", datetime.now(UTC) - timedelta(hours=1))
    spec = protect("ring", {"app": "ring"}, where, nodeNotReadySeconds=0, fencing="OutOfServiceTaint")
    with operator():
        cluster_ns.create(SCHEDULES, spec)
        cluster_ns.wait(SCHEDULES, "ring", recovery_phase("Idle"))
        not_ready(cluster_ns, NODES[0], datetime.now(UTC))
        cluster_ns.wait(SCHEDULES, "ring", recovery_phase("Fencing"), timeout=30)
        cluster_ns.report_killed("ring-1")
        cluster_ns.wait(
            SCHEDULES, "ring", lambda o: "out-of-service" in (o["status"].get("recoveryMessage") or "")
        )
        assert "ring-0" in cluster_ns.pod_names() and cluster_ns.get(RESTORES, "ring-recover-1") is None
        taint = {"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"}
        cluster_ns.core.patch_node(NODES[0], {"spec": {"taints": [taint]}})
        wait_pod_gone(cluster_ns, "ring-0")
        job = cluster_ns.wait(RESTORES, "ring-recover-1", lambda o: True)
        assert job["spec"]["avoidNodes"] == [NODES[0]]


def test_a_failed_rank_without_a_checkpoint_waits_for_a_person_and_touches_nothing(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    where = ring(cluster_ns, agents, s3_server, bucket)
    with operator():
        cluster_ns.create(SCHEDULES, protect("ring", {"app": "ring"}, where))
        cluster_ns.wait(SCHEDULES, "ring", recovery_phase("Idle"))
        fail(cluster_ns, "ring-1", exit_code=1)
        body = cluster_ns.wait(SCHEDULES, "ring", recovery_phase("WaitingForPerson"), timeout=30)
        assert body["status"]["recoveryReason"] == "NoCheckpoint"
        assert body["status"]["recovery"]["trigger"] == "PodFailed"
        assert "pod ring-1 failed (exit code 1)" in body["status"]["recoveryMessage"]
        assert body["status"]["message"] == body["status"]["recoveryMessage"]
        waiting = cluster_ns.wait_events("ring", "RecoveryWaiting")[0]
        assert waiting.type == "Warning" and "RestartFromScratch" in waiting.message
        assert not deleting(cluster_ns, "ring-0") and not deleting(cluster_ns, "ring-1")
        assert cluster_ns.get(RESTORES, "ring-recover-1") is None


def test_bare_pods_without_a_checkpoint_start_again_from_scratch_under_that_policy(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    """No controller would create bare pods again: the operator keeps their templates in status when the
    recovery begins, and creates them itself, only once no source may still run."""
    where = ring(cluster_ns, agents, s3_server, bucket)
    before = {name: cluster_ns.core.read_namespaced_pod(name, cluster_ns.namespace).metadata.uid
              for name in ("ring-0", "ring-1")}  # fmt: skip
    with operator():
        policy = {"noCheckpoint": "RestartFromScratch"}
        cluster_ns.create(SCHEDULES, protect("ring", {"app": "ring"}, where, **policy))
        cluster_ns.wait(SCHEDULES, "ring", recovery_phase("Idle"))
        fail(cluster_ns, "ring-1", exit_code=3)
        body = cluster_ns.wait(SCHEDULES, "ring", recovery_phase("Fencing"), timeout=30)
        kept = body["status"]["recovery"]["scratchPods"]
        assert sorted(p["name"] for p in kept) == ["ring-0", "ring-1"], kept
        assert all(p["template"]["spec"]["containers"][0]["image"] == "ring:test" for p in kept), kept
        assert all("nodeName" not in p["template"]["spec"] for p in kept), kept
        assert "restarting from scratch" in cluster_ns.wait_events("ring", "RecoveryStarted")[0].message
        # ring-1 failed (its kubelet said so): removed; ring-0's kill is not confirmed yet, so neither
        # is created again while it may run
        wait_pod_gone(cluster_ns, "ring-1")
        time.sleep(3)
        assert cluster_ns.pod_names() == ["ring-0"] and deleting(cluster_ns, "ring-0")
        cluster_ns.report_killed("ring-0")
        body = cluster_ns.wait(SCHEDULES, "ring", recovery_phase("RestartedFromScratch"), timeout=60)
        assert body["status"]["recoveryReason"] == "NoCheckpoint"
        assert "the operator created ring-0, ring-1 again from scratch" in body["status"]["recoveryMessage"]
        deadline = time.monotonic() + 30
        while cluster_ns.pod_names() != ["ring-0", "ring-1"]:
            assert time.monotonic() < deadline, cluster_ns.pod_names()
            time.sleep(0.2)
        for name in ("ring-0", "ring-1"):
            pod = cluster_ns.core.read_namespaced_pod(name, cluster_ns.namespace)
            assert pod.metadata.uid != before[name] and pod.metadata.labels == {"app": "ring"}
            assert pod.spec.containers[0].image == "ring:test" and not pod.metadata.owner_references
        assert cluster_ns.get(RESTORES, "ring-recover-1") is None  # nothing to restore was tried
        # once created, the templates leave the schedule's status
        body = cluster_ns.wait(
            SCHEDULES,
            "ring",
            lambda b: "scratchPods" not in ((b.get("status") or {}).get("recovery") or {}),
            timeout=30,
        )
        assert body["status"]["recoveryPhase"] == "RestartedFromScratch"
