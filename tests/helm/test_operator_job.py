"""The product as a user meets it, on the real cluster with the chart installed: a two-pod RDMA job (one pod
per node) is checkpointed by a CheckpointJob in LeaveRunning mode (it keeps running), then by one in Stop
mode (kubectl apply); its pods are deleted, and a RestoreJob brings it back with the pods swapped between
the nodes; the job finishes with every message delivered exactly once. Everything goes through the
apiserver: the operator hosts the coordinator and drives the agents, the runtime wrapper restores the
containers.
"""

from __future__ import annotations

import json

import pytest
from helm.conftest import Release

from testbed import pods, ring

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400)]


def test_checkpoint_job_then_restore_job_swaps_the_nodes_exactly_once(
    installed: Release, job_ns: str
) -> None:
    cluster = installed.cluster
    ring.start(cluster, job_ns)

    # LeaveRunning: a Checkpoint in S3, and the job goes on where it was
    pods.apply(cluster, job_ns, ring.checkpoint_job("keep", "LeaveRunning"))
    kept = ring.wait_phase(cluster, job_ns, "checkpointjob", "keep", "Succeeded")
    print(f"LeaveRunning job: {ring.seconds(kept):.1f}s, {json.dumps(kept['status'].get('pods'))[:1500]}")
    assert kept["status"]["checkpointName"]
    ring.running(cluster, job_ns)

    # Stop: the processes end only after the whole checkpoint is committed
    pods.apply(cluster, job_ns, ring.checkpoint_job("move", "Stop"))
    done = ring.wait_phase(cluster, job_ns, "checkpointjob", "move", "Succeeded")
    checkpoint_name = done["status"]["checkpointName"]
    checkpoint = pods.get(cluster, job_ns, "checkpoint", checkpoint_name)
    recorded = {p["name"]: p for p in checkpoint["spec"]["pods"]}
    assert {n: p["node"] for n, p in recorded.items()} == {"ring-0": "node-1", "ring-1": "node-2"}
    assert checkpoint["spec"]["size"]["bytes"] > 0
    print(f"Stop job: {ring.seconds(done):.1f}s, {json.dumps(done['status'].get('pods'))[:1500]}")
    for name in ring.MEMBERS:
        log = cluster.kubectl("logs", "-n", job_ns, name).stdout
        assert not ring.results(log), "the ring ended before the cut"

    # Stop: the sources ended after the commit; delete them, then bring the job back swapped
    cluster.kubectl("delete", "pod", "-n", job_ns, *ring.MEMBERS, "--timeout=120s", timeout=150)
    pods.apply(cluster, job_ns, ring.restore_job("back", checkpoint_name))
    restored = ring.wait_phase(cluster, job_ns, "restorejob", "back", "Succeeded")
    print(f"restore job: {ring.seconds(restored):.1f}s, {json.dumps(restored['status'].get('pods'))[:1500]}")
    assert ring.placement(cluster, job_ns) == {"ring-0": "node-2", "ring-1": "node-1"}
    ring.finish(cluster, job_ns)
