"""A CheckpointStorage's retention and bucket sweep.

Unit tests of the pure decision (machine/retention.py), then the whole path against the real apiserver and
the real S3: three real CheckpointJobs of one schedule write to a CheckpointStorage, one Checkpoint is
pinned, and the storage is given `keepLast: 1`: the unpinned older one is deleted (object and manifest),
the pinned one and the newest stay, status counts them, an Event names what went and why. An orphan chunk
left in the bucket by a failed writer is swept. Node agents are fakes (conftest.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ibckpt.api import GROUP, VERSION
from ibckpt.api.storage import Retention
from ibckpt.store import ImageStore
from ibckpt_operator.machine.retention import StoredCheckpoint, decide
from testbed.s3 import S3Server

Agents = Cluster = Any  # conftest.py's fixtures
JOBS, CHECKPOINTS, STORAGES = "checkpointjobs", "checkpoints", "checkpointstorages"
NOW = 1_000_000.0


def kept(decisions: Any) -> dict[str, bool]:
    return {d.name: d.keep for d in decisions}


def test_keep_last_counts_each_group_and_spares_pinned_and_restoring() -> None:
    checkpoints = [
        StoredCheckpoint("a1", "schedule a", NOW - 40),
        StoredCheckpoint("a2", "schedule a", NOW - 30, pinned=True),
        StoredCheckpoint("a3", "schedule a", NOW - 20, used_by="back"),
        StoredCheckpoint("a4", "schedule a", NOW - 10),
        StoredCheckpoint("a5", "schedule a", NOW - 5),
        StoredCheckpoint("b1", "job ns/b", NOW - 50),
    ]
    decisions = decide(checkpoints, Retention(keep_last=1, min_keep=0), NOW)
    assert kept(decisions) == {"a5": True, "a4": False, "a3": True, "a2": True, "a1": False, "b1": True}
    why = {d.name: d.reason for d in decisions}
    assert why["a4"] == "not among the 1 newest" and why["a3"] == "in use by RestoreJob back"


def test_age_spares_the_min_keep_newest_and_incomplete_ones_go_by_age_only() -> None:
    checkpoints = [
        StoredCheckpoint("old", "job j", NOW - 500),
        StoredCheckpoint("older", "job j", NOW - 600),
        StoredCheckpoint("partial", "job j", NOW - 700, complete=False),
        StoredCheckpoint("young-partial", "job j", NOW - 1, complete=False),
    ]
    decisions = decide(checkpoints, Retention(max_age_seconds=100, min_keep=1), NOW)
    assert kept(decisions) == {"old": True, "older": False, "partial": False, "young-partial": True}
    assert {d.name: d.reason for d in decisions}["older"] == "older than 100s"


def test_total_bytes_counts_a_shared_chunk_once() -> None:
    checkpoints = [
        StoredCheckpoint("new", "job j", NOW - 1, chunk_sizes={"x": 60, "y": 30}),
        StoredCheckpoint("mid", "job j", NOW - 2, chunk_sizes={"x": 60, "z": 5}),  # shares x
        StoredCheckpoint("old", "job j", NOW - 3, chunk_sizes={"w": 10}),
        StoredCheckpoint("bare", "job k", NOW - 3, bytes=200),  # no manifest read: its own bytes
    ]
    decisions = decide(checkpoints, Retention(max_total_bytes=100, min_keep=0), NOW)
    assert kept(decisions) == {"new": True, "mid": True, "old": False, "bare": False}
    assert "105 bytes, over 100" in {d.name: d.reason for d in decisions}["old"]


def complete_job(cluster_ns: Cluster, name: str, template: dict[str, Any]) -> None:
    job = {  # as a schedule `nightly` makes them: its label copied onto the Checkpoint
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CheckpointJob",
        "metadata": {"name": name, "labels": {"ibckpt.io/schedule": "nightly"}},
        "spec": {**template, "checkpointName": name, "copyLabels": ["ibckpt.io/schedule"]},
    }
    cluster_ns.create(JOBS, job)
    cluster_ns.wait(JOBS, name, lambda b: (b.get("status") or {}).get("phase") == "Succeeded", timeout=90)
    cluster_ns.wait(CHECKPOINTS, name, lambda b: bool((b.get("status") or {}).get("readyToRestore")))


def s3_keys(s3: S3Server, bucket: str) -> set[str]:
    return {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])}


@pytest.mark.kube
@pytest.mark.s3
def test_storage_retention_deletes_what_it_drops_and_the_sweep_removes_orphans(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    config = store_config(bucket)
    agent = agents.add(cluster_ns, "node-a", 1, "complete", config)
    cluster_ns.rank_pod(agent, "ring-0", {"app": "ring"})
    cluster_ns.s3_secret(s3_server)
    storage = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CheckpointStorage",
        "metadata": {"name": "store"},
        "spec": {**cluster_ns.s3_location(s3_server, bucket), "prefix": config.prefix},
    }
    template = {"selector": {"matchLabels": {"app": "ring"}}, "storageRef": {"name": "store"}}
    try:
        with operator(store_sweep_seconds=0.0):
            cluster_ns.create(STORAGES, storage)
            for name in ("ck-1", "ck-2", "ck-3"):
                complete_job(cluster_ns, name, template)
                time.sleep(1.1)  # creation timestamps have whole seconds: retention orders by them
            cluster_ns.patch(CHECKPOINTS, "ck-1", {"metadata": {"labels": {"ibckpt.io/pinned": "true"}}})
            dropped = cluster_ns.get(CHECKPOINTS, "ck-2")["spec"]["manifestKey"]  # type: ignore[index]
            assert dropped in s3_keys(s3_server, bucket)

            cluster_ns.patch(STORAGES, "store", {"spec": {"retention": {"keepLast": 1}}})
            body = cluster_ns.wait(
                STORAGES, "store", lambda b: (b.get("status") or {}).get("prunedCount") == 1, timeout=60
            )
            deadline = time.monotonic() + 60
            while cluster_ns.get(CHECKPOINTS, "ck-2") is not None:
                assert time.monotonic() < deadline, "ck-2 was never deleted"
                time.sleep(0.3)
            assert cluster_ns.get(CHECKPOINTS, "ck-1") is not None  # pinned
            assert cluster_ns.get(CHECKPOINTS, "ck-3") is not None  # the newest
            status = body["status"]
            assert status["checkpointCount"] == 2 and status["storedBytes"] > 0, status
            assert status["lastSweepTime"], status
            pruned = cluster_ns.wait_events("store", "CheckpointPruned")
            assert pruned[0].message == "ck-2: not among the 1 newest", pruned[0].message
            deadline = time.monotonic() + 60
            while dropped in s3_keys(s3_server, bucket):  # the finalizer deletes the manifest
                assert time.monotonic() < deadline, f"{dropped} was never deleted"
                time.sleep(0.3)
            # A writer that died after uploading a chunk and before any manifest named it. Put only now:
            # the finalizer's own collection would otherwise take it before a sweep could.
            orphan = ImageStore.open(config).context.layout.chunk_key("ab" * 32)
            s3_server.client().put_object(Bucket=bucket, Key=orphan, Body=b"lost")
            # A sweep (due at every check here) takes the orphan.
            deadline, turn = time.monotonic() + 60, 0
            while orphan in s3_keys(s3_server, bucket):
                assert time.monotonic() < deadline, f"{orphan} was never swept"
                turn += 1  # a change each time, so that each patch is an update the operator handles
                rules = {"keepLast": 1, "minKeep": 1 + turn % 2}
                cluster_ns.patch(STORAGES, "store", {"spec": {"retention": rules}})
                time.sleep(1)
            swept = cluster_ns.wait_events("store", "StoreSwept")
            assert "unreferenced chunk" in swept[-1].message, swept[-1].message
    finally:
        cluster_ns.drop_all(CHECKPOINTS)
        cluster_ns.drop_all(STORAGES)
