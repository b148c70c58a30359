"""commitOn Memory through the operator, against the real apiserver and the real S3, with the fake agents
of testbed/fake_agent.py keeping each part (chunks and signed part manifest) on the next node's shelf
before their S3 upload: the job commits once every part is kept, the Checkpoint says [Memory] while the
upload goes on, then [S3, Memory] once the S3 parts are merged, by a restarted operator too; a
memory-only Checkpoint whose copy is lost is not restorable; and without the tier the job fails before
touching a pod."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from ibckpt.store import CheckpointRef, ImageStore
from testbed.gate import Gate
from testbed.s3 import S3Server
from testbed.status import phase

Agents = Cluster = Any  # conftest.py's fixtures
pytestmark = [pytest.mark.kube, pytest.mark.s3, pytest.mark.usefixtures("runtime_class")]

API = "ibckpt.io/v1alpha1"
RING = {"app": "ring"}


def memory_job(cluster: Cluster, s3: S3Server, bucket: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "CheckpointJob", "metadata": {"name": "fast"},
            "spec": {"selector": {"matchLabels": RING}, "storage": cluster.s3_location(s3, bucket),
                     "mode": "Stop", "checkpointName": "ring-m1", "commitOn": "Memory", **spec}}  # fmt: skip


def ring(cluster: Cluster, agents: Agents, config: Any) -> tuple[Any, Any, Any]:
    a = agents.add(cluster, "node-a", 1, "complete", config)
    b = agents.add(cluster, "node-b", 2, "complete", config)
    c = agents.add(cluster, "node-c", 3, "complete", config)  # holds node-b's part only
    cluster.rank_pod(a, "ring-0", RING)
    cluster.rank_pod(b, "ring-1", RING)
    return a, b, c


def ring_without_s3(cluster: Cluster, agents: Agents, config: Any, s3: S3Server) -> tuple[Any, Any, Any]:
    """ring(), whose agents' S3 uploads all fail: the durable tier never comes."""
    a, b, c = ring(cluster, agents, config)
    a.upload_failure = b.upload_failure = "S3 unreachable"
    cluster.s3_secret(s3)
    return a, b, c


def restore_back(cluster: Cluster) -> None:
    """The Stop job's sources gone, a RestoreJob `back` of ring-m1."""
    for name in ("ring-0", "ring-1"):
        cluster.report_killed(name)
        cluster.core.delete_namespaced_pod(name, cluster.namespace, grace_period_seconds=0)
    back = {"apiVersion": API, "kind": "RestoreJob", "metadata": {"name": "back"},
            "spec": {"checkpointName": "ring-m1"}}  # fmt: skip
    cluster.create("restorejobs", back)


def test_the_job_commits_in_memory_and_the_checkpoint_reaches_s3_in_the_background(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    config = store_config(bucket)
    a, b, c = ring(cluster_ns, agents, config)
    gate = threading.Event()  # the S3 uploads wait until the memory commit is seen
    a.upload_gate = b.upload_gate = gate
    cluster_ns.s3_secret(s3_server)
    with operator(memory_tier=True):
        cluster_ns.create("checkpointjobs", memory_job(cluster_ns, s3_server, bucket))
        job = cluster_ns.wait("checkpointjobs", "fast", phase("Succeeded"), timeout=90)
        assert job["status"]["committedOn"] == "Memory"
        assert [agent.requests[-1].memory_copy.first for agent in (a, b)] == [True, True]
        status = (cluster_ns.get("checkpoints", "ring-m1") or {})["status"]
        # committed with no part in S3 yet: memory only, restorable, and saying the upload goes on
        assert status["tiers"] == ["Memory"] and status["readyToRestore"] is True
        assert "S3 upload is in progress" in status["message"]
        assert [(m["part"], m["node"]) for m in status["memoryCopies"]] == [
            ("node-a", "node-b"),
            ("node-b", "node-c"),
        ]
        store = ImageStore.open(config)
        # every holder keeps the merged manifest, verified for the checkpoint's bucket key
        ref = CheckpointRef(f"{cluster_ns.namespace}/fast", "ring-m1")  # the job's name in the store
        for holder in (b, c):
            held = store.manifest_from(ref, holder.shelf.manifests[(ref.job, "ring-m1")], "the holder")
            assert sorted(r.node for r in held.ranks) == ["node-a", "node-b"]
        gate.set()
        body = cluster_ns.wait(
            "checkpoints", "ring-m1", lambda b_: (b_.get("status") or {}).get("tiers") == ["S3", "Memory"]
        )
        assert body["status"]["readyToRestore"] is True
        [done] = cluster_ns.wait_events("ring-m1", "UploadedToS3")
        assert "merged" in done.message
        merged = store.manifest(ref)
        assert sorted(r.node for r in merged.ranks) == ["node-a", "node-b"]


def test_a_restarted_operator_takes_the_s3_commit_up_again(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    config = store_config(bucket)
    a, b, _ = ring(cluster_ns, agents, config)
    gate = threading.Event()  # no S3 part is staged while the first operator runs
    a.upload_gate = b.upload_gate = gate
    cluster_ns.s3_secret(s3_server)
    with operator(memory_tier=True):
        cluster_ns.create("checkpointjobs", memory_job(cluster_ns, s3_server, bucket))
        cluster_ns.wait("checkpointjobs", "fast", phase("Succeeded"), timeout=90)
        status = (cluster_ns.get("checkpoints", "ring-m1") or {})["status"]
        assert status["tiers"] == ["Memory"] and status["upload"]["state"] == "InProgress"
        deadline = status["upload"]["deadline"]
    gate.set()  # the parts reach S3 with no operator running
    ref = CheckpointRef(f"{cluster_ns.namespace}/fast", "ring-m1")
    store = ImageStore.open(config)
    with operator(memory_tier=True):
        body = cluster_ns.wait(
            "checkpoints", "ring-m1", lambda b_: (b_.get("status") or {}).get("tiers") == ["S3", "Memory"]
        )
        assert body["status"]["upload"] == {"state": "Merged", "deadline": deadline}
        [done] = cluster_ns.wait_events("ring-m1", "UploadedToS3")
        assert "merged" in done.message
    merged = store.manifest(ref)
    assert sorted(r.node for r in merged.ranks) == ["node-a", "node-b"]
    # the restore record the memory commit signed, byte for byte: the holders' manifest's
    held = store.manifest_from(ref, b.shelf.manifests[(ref.job, "ring-m1")], "the holder")
    assert merged.labels == held.labels and merged.labels


def test_an_operator_started_past_the_deadline_says_the_upload_did_not_finish(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    config = store_config(bucket)
    a, b, _ = ring(cluster_ns, agents, config)
    gate = threading.Event()
    a.upload_gate = b.upload_gate = gate
    cluster_ns.s3_secret(s3_server)
    with operator(memory_tier=True):
        job = memory_job(cluster_ns, s3_server, bucket, timeouts={"uploadSeconds": 20})
        cluster_ns.create("checkpointjobs", job)
        cluster_ns.wait("checkpointjobs", "fast", phase("Succeeded"), timeout=90)
    deadline = (cluster_ns.get("checkpoints", "ring-m1") or {})["status"]["upload"]["deadline"]
    left = datetime.fromisoformat(deadline) - datetime.now(UTC)
    assert left.total_seconds() > 0, "the first operator stopped past the deadline: the test says nothing"
    time.sleep(left.total_seconds() + 0.5)
    gate.set()  # too late: the parts reach S3 past the deadline
    with operator(memory_tier=True):
        [late] = cluster_ns.wait_events("ring-m1", "UploadNotFinished", timeout=30)
        assert "did not finish by its deadline" in late.message, late.message
        status = (cluster_ns.get("checkpoints", "ring-m1") or {})["status"]
        assert status["tiers"] == ["Memory"] and status["upload"]["state"] == "NotFinished"


def test_a_memory_only_checkpoint_whose_copy_is_lost_is_not_restorable(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    a, b, c = ring_without_s3(cluster_ns, agents, store_config(bucket), s3_server)
    with operator(memory_tier=True):
        job = memory_job(cluster_ns, s3_server, bucket, timeouts={"uploadSeconds": 4})
        cluster_ns.create("checkpointjobs", job)
        cluster_ns.wait("checkpointjobs", "fast", phase("Succeeded"), timeout=90)
        [late] = cluster_ns.wait_events("ring-m1", "UploadNotFinished", timeout=30)
        assert "did not finish within 4s" in late.message, late.message
        status = (cluster_ns.get("checkpoints", "ring-m1") or {})["status"]
        assert status["tiers"] == ["Memory"] and status["readyToRestore"] is True
        c.restart_shelf()  # node-b's part was on node-c: gone
        restore_back(cluster_ns)
        body = cluster_ns.wait("restorejobs", "back", phase("Failed"), timeout=90)
        assert "node-b" in body["status"]["message"], body["status"]
        status = (cluster_ns.get("checkpoints", "ring-m1") or {})["status"]
        assert status["readyToRestore"] is False and status["tiers"] == []
        assert "memory copy of part node-b is lost" in status["message"]
        assert not any(r.memory_only is False for agent in (a, b) for r in agent.restores)


def test_a_memory_only_checkpoint_restores_while_s3_is_unreachable(
    cluster_ns: Cluster,
    s3_server: S3Server,
    s3_gate: Gate,
    bucket: str,
    agents: Agents,
    operator: Any,
    store_config: Any,
) -> None:
    """Held in memory only, every part on a live holder: the restore reads nothing from S3, so the
    operator does not ask S3 to answer first (its storage check keeps to the Secrets)."""
    a, b, _ = ring_without_s3(cluster_ns, agents, store_config(bucket), s3_server)
    with operator(memory_tier=True):
        job = memory_job(cluster_ns, s3_server, bucket, timeouts={"uploadSeconds": 4})
        job["spec"]["storage"]["endpoint"] = f"http://127.0.0.1:{s3_gate.port}"  # the operator's S3
        cluster_ns.create("checkpointjobs", job)
        cluster_ns.wait("checkpointjobs", "fast", phase("Succeeded"), timeout=90)
        s3_gate.cut()
        try:
            cluster_ns.wait_events("ring-m1", "UploadNotFinished", timeout=30)
            refused = s3_gate.refused
            restore_back(cluster_ns)
            body = cluster_ns.wait("restorejobs", "back", phase("Succeeded"), timeout=90)
            assert body["status"]["memoryReads"]["holders"], body["status"]
            restores = [r for agent in (a, b) for r in agent.restores]
            assert restores and all(r.memory_only for r in restores), restores
            assert s3_gate.refused == refused, "the restore tried S3"
        finally:
            s3_gate.mend()


def test_commit_on_memory_without_the_tier_fails_before_any_pod(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    config = store_config(bucket)
    a, b, _ = ring(cluster_ns, agents, config)
    cluster_ns.s3_secret(s3_server)
    with operator():
        cluster_ns.create("checkpointjobs", memory_job(cluster_ns, s3_server, bucket))
        body = cluster_ns.wait("checkpointjobs", "fast", phase("Failed"), timeout=60)
        assert body["status"]["reason"] == "MemoryTierUnavailable"
        assert "memory tier" in body["status"]["message"]
        time.sleep(0.5)
        assert not a.requests and not b.requests
