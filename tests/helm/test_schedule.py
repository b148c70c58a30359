"""A CheckpointSchedule on the real cluster with the chart installed: the two-pod RDMA ring is checkpointed
periodically (LeaveRunning, real agents, CRIU and S3); the interval comes from the measured cost of the
first checkpoint and the given MTBF (Young/Daly: sqrt(2 * cost * MTBF)); with `keepLast: 1` the second
checkpoint prunes the first, whose Checkpoint is gone from the apiserver and whose manifest is gone from
S3, while the newest stays; and the ring, checkpointed twice under traffic, finishes exactly once.
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from typing import Any

import pytest
from helm.conftest import Release

from testbed import pods, ring
from testbed.s3 import S3Server

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]

SCHEDULE = "ring-every"
MTBF, MIN_INTERVAL, MAX_INTERVAL = 60, 60, 600  # the API's least MTBF; the testbed's ~150 s cost gives ~135 s


def created(obj: dict[str, Any]) -> float:
    return datetime.fromisoformat(obj["metadata"]["creationTimestamp"].replace("Z", "+00:00")).timestamp()


def s3_keys(s3: S3Server, bucket: str) -> set[str]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {item["Key"] for page in pages for item in page.get("Contents", [])}


def test_a_schedule_fires_at_its_young_daly_interval_and_prunes_to_its_retention(
    installed: Release, job_ns: str, s3_server: S3Server
) -> None:
    cluster = installed.cluster
    ring.start(cluster, job_ns)
    bucket = pods.get(cluster, job_ns, "checkpointstorage", "store")["spec"]["bucket"]
    schedule = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointSchedule",
        "metadata": {"name": SCHEDULE},
        "spec": {
            "mtbfSeconds": MTBF,
            "minIntervalSeconds": MIN_INTERVAL,
            "maxIntervalSeconds": MAX_INTERVAL,
            "retention": {"keepLast": 1},
            "template": ring.job_template(),
        },
    }
    pods.apply(cluster, job_ns, schedule)

    first = ring.wait_phase(cluster, job_ns, "checkpointjob", f"{SCHEDULE}-1", "Succeeded", 900)
    checkpoint = pods.get(cluster, job_ns, "checkpoint", first["status"]["checkpointName"])
    manifest = checkpoint["spec"]["manifestKey"]
    assert manifest in s3_keys(s3_server, bucket)
    # the cost of a checkpoint: the Checkpoint's pause when it records one, else its job's duration
    timings = checkpoint["spec"].get("timings") or {}
    cost = timings.get("pauseSeconds") or timings.get("totalSeconds") or ring.seconds(first)
    deadline = time.monotonic() + 120
    status: dict[str, Any] = {}
    while time.monotonic() < deadline and status.get("costSeconds") is None:
        time.sleep(3)
        status = pods.get(cluster, job_ns, "checkpointschedule", SCHEDULE).get("status") or {}
    # the interval in use is Young/Daly's from the measured cost, within the clamp
    assert status.get("costSeconds") == pytest.approx(cost, abs=1.0), status
    wanted = min(max(math.sqrt(2 * cost * MTBF), MIN_INTERVAL), MAX_INTERVAL)
    assert status["intervalSeconds"] == pytest.approx(wanted, abs=1.0), status

    second = ring.wait_phase(cluster, job_ns, "checkpointjob", f"{SCHEDULE}-2", "Succeeded", 1200)
    fired_apart = created(second) - created(first)
    newest = second["status"]["checkpointName"]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        names = {c["metadata"]["name"] for c in pods.get(cluster, job_ns, "checkpoints")["items"]}
        if names == {newest} and manifest not in s3_keys(s3_server, bucket):
            break
        time.sleep(3)
    assert names == {newest}, f"keepLast 1 should leave only {newest}: {names}"
    assert manifest not in s3_keys(s3_server, bucket), "the pruned checkpoint's manifest is still in S3"
    kept = pods.get(cluster, job_ns, "checkpoint", newest)["spec"]["manifestKey"]
    assert kept in s3_keys(s3_server, bucket)
    schedule_status = pods.get(cluster, job_ns, "checkpointschedule", SCHEDULE)["status"]
    assert schedule_status.get("prunedCount", 0) >= 1, schedule_status

    # it fired one interval after the first fire (as computed once the first cost was known)
    assert fired_apart >= status["intervalSeconds"] - 5, (fired_apart, status)
    cluster.kubectl("delete", "checkpointschedule", SCHEDULE, "-n", job_ns)
    ring.running(cluster, job_ns)
    ring.finish(cluster, job_ns)
    print(
        f"schedule: cost {cost:.1f}s, MTBF {MTBF}s -> interval {status['intervalSeconds']:.0f}s "
        f"(sqrt(2*cost*MTBF) = {math.sqrt(2 * cost * MTBF):.0f}s); fires {fired_apart:.0f}s apart"
    )
