"""A CheckpointSchedule against the real apiserver and the real S3: it fires (once, after an operator that
was down past its due time), measures the cost of the real CheckpointJob it made (the seconds its ranks
were paused), computes its Young/Daly interval from that cost, and prunes the schedule's Checkpoints to
its retention: a pinned one survives, the pruned one is gone from the apiserver and its manifest from S3.
Its finished CheckpointJobs beyond the history limits are deleted too. Node agents are fakes
(conftest.py)."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ibckpt.api import GROUP, VERSION
from testbed.s3 import S3Server

Agents = Cluster = Any  # conftest.py's fixtures
pytestmark = [pytest.mark.kube, pytest.mark.s3]
SCHEDULES, JOBS, CHECKPOINTS = "checkpointschedules", "checkpointjobs", "checkpoints"


def schedule_body(name: str, template: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CheckpointSchedule",
        "metadata": {"name": name},
        "spec": {"template": template, **spec},
    }


@pytest.fixture(autouse=True)
def schedules_removed(cluster_ns: Cluster) -> Any:
    """No schedule of a test may run under the next test's operator."""
    yield
    cluster_ns.drop_all(SCHEDULES)


def failed(body: dict[str, Any]) -> bool:
    return bool((body.get("status") or {}).get("phase") == "Failed")


def s3_keys(s3: S3Server, bucket: str) -> list[str]:
    return [o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_schedule_fires_measures_its_cost_and_prunes(
    cluster_ns: Cluster,
    s3_server: S3Server,
    bucket: str,
    agents: Agents,
    operator: Any,
    store_config: Any,
) -> None:
    config = store_config(bucket)
    agent = agents.add(cluster_ns, "node-a", 1, "complete", config)
    cluster_ns.rank_pod(agent, "ring-0", {"app": "ring"})
    cluster_ns.s3_secret(s3_server)
    template = {
        "selector": {"matchLabels": {"app": "ring"}},
        "storage": cluster_ns.s3_location(s3_server, bucket),
    }
    mtbf = 86400

    # Three older checkpoints of the workload, made by real jobs labelled as the schedule's: the first
    # pinned, the second will be pruned (keepLast 2 counts the schedule's own new one and the third).
    with operator():
        for index in (1, 2, 3):
            job = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "CheckpointJob",
                "metadata": {"name": f"old-{index}", "labels": {"ibckpt.io/schedule": "ring"}},
                "spec": {**template, "checkpointName": f"old-{index}", "copyLabels": ["ibckpt.io/schedule"]},
            }
            cluster_ns.create(JOBS, job)
            cluster_ns.wait(
                JOBS,
                f"old-{index}",
                lambda b: (b.get("status") or {}).get("phase") == "Succeeded",
                timeout=90,
            )
            cluster_ns.wait(
                CHECKPOINTS, f"old-{index}", lambda b: bool((b.get("status") or {}).get("readyToRestore"))
            )
            time.sleep(1.1)  # creation timestamps have whole seconds: retention orders by them
        # Two failed jobs of the schedule (their selector matches no pod): the job history keeps one.
        for index in (1, 2):
            job = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "CheckpointJob",
                "metadata": {"name": f"failed-{index}", "labels": {"ibckpt.io/schedule": "ring"}},
                "spec": {**template, "selector": {"matchLabels": {"app": "none"}}},
            }
            cluster_ns.create(JOBS, job)
            ended = cluster_ns.wait(JOBS, f"failed-{index}", failed)
            assert ended["status"]["reason"] == "NoPods", ended["status"]
            time.sleep(1.1)
    cluster_ns.patch(CHECKPOINTS, "old-1", {"metadata": {"labels": {"ibckpt.io/pinned": "true"}}})
    pruned_manifest = cluster_ns.get(CHECKPOINTS, "old-2")["spec"]["manifestKey"]  # type: ignore[index]
    assert pruned_manifest in s3_keys(s3_server, bucket)

    # The schedule, as an operator that was down for two hours left it: due long ago, never fired.
    cluster_ns.create(
        SCHEDULES,
        schedule_body("ring", template, mtbfSeconds=mtbf, minIntervalSeconds=60, retention={"keepLast": 2}),
    )
    overdue = (datetime.now(UTC) - timedelta(hours=2)).isoformat()
    cluster_ns.patch_status(SCHEDULES, "ring", {"lastFireTime": overdue, "seq": 0})
    with operator() as handle:
        body = cluster_ns.wait(
            SCHEDULES, "ring", lambda b: (b.get("status") or {}).get("costSeconds") is not None, timeout=120
        )
        status = body["status"]
        # One fire for the missed intervals, named after the schedule and its sequence.
        assert status["lastCheckpointJob"] == "ring-1" and status["seq"] == 1 and not status.get("activeJob")
        job = cluster_ns.get(JOBS, "ring-1")
        assert job is not None and job["status"]["phase"] == "Succeeded"
        assert job["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
        assert job["metadata"]["labels"]["ibckpt.io/schedule"] == "ring"
        # The cost is the time from the cut to the commit on the job's tier (the Checkpoint's timings,
        # measured by the operator; the ranks' pause is the agents' own measure, 1.1 s); the interval is
        # Young/Daly's from it.
        made = cluster_ns.get(CHECKPOINTS, job["status"]["checkpointName"])
        assert made is not None and made["spec"]["timings"]["pauseSeconds"] == pytest.approx(1.1)
        commit = made["spec"]["timings"]["commitSeconds"]
        assert commit > 0, made["spec"]["timings"]
        assert status["costSeconds"] == pytest.approx(commit, abs=1e-3)
        assert status["recentCosts"] == [status["costSeconds"]]
        expected = math.sqrt(2 * status["costSeconds"] * mtbf)
        assert 60 < expected < 86400
        assert (
            status["intervalSeconds"] == pytest.approx(expected) and status["intervalSource"] == "YoungDaly"
        )
        fired = datetime.fromisoformat(status["lastFireTime"].replace("Z", "+00:00"))
        following = datetime.fromisoformat(status["nextCheckpointTime"].replace("Z", "+00:00"))
        assert (following - fired).total_seconds() == pytest.approx(expected, abs=1e-3)
        assert fired > datetime.now(UTC) - timedelta(minutes=5)  # fired now, not back then

        # Retention: old-2 is pruned (not among the 2 newest complete); old-1 is pinned; the Checkpoint's
        # finalizer deletes its manifest from S3.
        deadline = time.monotonic() + 60
        while cluster_ns.get(CHECKPOINTS, "old-2") is not None:
            assert time.monotonic() < deadline, "old-2 was never pruned"
            time.sleep(0.3)
        new_checkpoint = job["status"]["checkpointName"]
        for kept in ("old-1", "old-3", new_checkpoint):
            assert cluster_ns.get(CHECKPOINTS, kept) is not None, kept
        assert pruned_manifest not in s3_keys(s3_server, bucket)
        # The job history (3 succeeded, 1 failed by default): the oldest of each goes, not its Checkpoint.
        deadline = time.monotonic() + 60
        while {"old-1", "failed-1"} & {cluster_ns.get(JOBS, n) and n for n in ("old-1", "failed-1")}:
            assert time.monotonic() < deadline, "old-1 and failed-1 were never pruned"
            time.sleep(0.3)
        for kept in ("old-2", "old-3", "ring-1", "failed-2"):
            assert cluster_ns.get(JOBS, kept) is not None, kept
        pruned_jobs = {e.message for e in cluster_ns.wait_events("ring", "CheckpointJobPruned", count=2)}
        assert pruned_jobs == {
            "old-1: succeeded, beyond the 3 newest kept",
            "failed-1: failed, beyond the 1 newest kept",
        }, pruned_jobs
        body = cluster_ns.wait(SCHEDULES, "ring", lambda b: (b.get("status") or {}).get("prunedCount") == 1)
        assert body["status"]["keptCount"] == 3
        pruned = cluster_ns.wait_events("ring", "CheckpointPruned")
        assert "old-2" in pruned[0].message and "not among the 2 newest" in pruned[0].message
        assert cluster_ns.wait_events("ring", "CheckpointStarted")[0].message == "ring-1"
        assert "interval now" in cluster_ns.wait_events("ring", "CheckpointSucceeded")[0].message
        ready = {c["type"]: c for c in body["status"]["conditions"]}
        assert ready["Ready"]["status"] == "True" and ready["Progressing"]["status"] == "False"
        text = handle.metrics()
    key = f'schedule="{cluster_ns.namespace}/ring"'
    assert f"ibckpt_schedule_interval_seconds{{{key}}} {expected}" in text
    assert f"ibckpt_schedule_pruned_total{{{key}}} 1.0" in text


def test_a_fire_while_the_job_runs_is_skipped(
    cluster_ns: Cluster,
    s3_server: S3Server,
    bucket: str,
    agents: Agents,
    operator: Any,
) -> None:
    """Skip: the previous job still runs (its agent never finishes), so the due fire starts nothing."""
    agent = agents.add(cluster_ns, "node-a", 1)  # "hang": the job stays Quiescing
    cluster_ns.rank_pod(agent, "ring-0", {"app": "ring"})
    cluster_ns.s3_secret(s3_server)
    template = {
        "selector": {"matchLabels": {"app": "ring"}},
        "storage": cluster_ns.s3_location(s3_server, bucket),
    }
    cluster_ns.create(SCHEDULES, schedule_body("ring", template, intervalSeconds=60))
    overdue = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    long_ago = (datetime.now(UTC) - timedelta(minutes=10)).isoformat()
    cluster_ns.patch_status(
        SCHEDULES, "ring", {"lastFireTime": overdue, "seq": 1, "activeJob": "ring-1", "activeSince": long_ago}
    )
    job = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CheckpointJob",
        "metadata": {"name": "ring-1", "labels": {"ibckpt.io/schedule": "ring"}},
        "spec": template,
    }
    cluster_ns.create(JOBS, job)
    with operator():
        skipped = cluster_ns.wait_events("ring", "CheckpointSkipped", timeout=60)
        assert "ring-1 still runs" in skipped[0].message
        body = cluster_ns.get(SCHEDULES, "ring")
        assert body is not None and body["status"]["activeJob"] == "ring-1" and body["status"]["seq"] == 1
        assert body["status"]["intervalSource"] == "Fixed" and body["status"]["intervalSeconds"] == 60
        assert cluster_ns.get(JOBS, "ring-2") is None
        progressing = {c["type"]: c for c in body["status"]["conditions"]}["Progressing"]
        assert progressing["status"] == "True" and progressing["reason"] == "CheckpointRunning"
