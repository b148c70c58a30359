"""An MPI job in pods, on the real cluster with the chart installed: Open MPI over UCX on rxe, a launcher pod
(mpirun and rank 0) on node-1 and a worker pod (the exec server mpirun starts orted with, and rank 1) on
node-2, both owned by an MPIJob as the MPI Operator creates them (tests/testbed/mpijob.py). One run of
jacobi is moved twice, and must still print exactly the RESULT of an uninterrupted run of the same binary:

1. A CheckpointJob names the MPIJob (workloadRef) and stops it mid-run; once the pods are deleted, a
   RestoreJob brings both back on the other nodes (the launcher on node-2, the worker on node-1): the
   processes restored through the runtime, node addresses mapped in their TCP connections (mpirun to
   orted, the exec server's), queue pairs rebuilt through the operator's coordinator.
2. A CheckpointSchedule protects the job (by the MPI Operator's job-name label) on drains; `kubectl drain
   node-1` completes by itself, and the whole job ends up on node-2, restored from the drain's checkpoint.

The test only uses kubectl. (One run for both, and the reference run beside it, to keep the suite's time:
a job start and the reference run cost about two minutes on the emulated nodes.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from helm.conftest import Release

from testbed import mpijob, pods, ring
from testbed.cluster import Cluster, node_ip

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3000)]

SCHEDULE = "jacobi"


@pytest.fixture
def mpi_crd(installed: Release) -> Iterator[None]:
    mpijob.install_crd(installed.cluster)
    try:
        yield
    finally:
        installed.cluster.kubectl("delete", "crd", f"mpijobs.{mpijob.GROUP}", "--wait=false", check=False)


def test_an_mpijob_moved_by_a_restorejob_then_by_kubectl_drain_prints_the_uninterrupted_result(
    installed: Release, job_ns: str, mpi_crd: None
) -> None:
    cluster = installed.cluster
    mpijob.start_uninterrupted(cluster, job_ns)
    mpijob.start(cluster, job_ns)

    job = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointJob",
        "metadata": {"name": "jacobi-stop"},
        "spec": {
            "workloadRef": {"apiVersion": mpijob.GROUP, "kind": "MPIJob", "name": mpijob.NAME},
            "mode": "Stop",
            "storageRef": {"name": "store"},
            "timeouts": {"admitSeconds": 300},
        },
    }
    pods.apply(cluster, job_ns, job)
    done = ring.wait_phase(cluster, job_ns, "checkpointjob", "jacobi-stop", "Succeeded", 900)
    before = mpijob.log(cluster, job_ns)
    cut_at = max(mpijob.steps(before))
    assert mpijob.result(before) is None and cut_at < mpijob.STEPS - 50, before[-2000:]  # stopped mid-run
    assert {p["name"] for p in done["status"]["pods"]} == set(mpijob.MEMBERS), done["status"]
    checkpoint = pods.get(cluster, job_ns, "checkpoint", done["status"]["checkpointName"])
    spec = checkpoint["spec"]
    assert {p["name"]: p["node"] for p in spec["pods"]} == {
        mpijob.LAUNCHER: "node-1",
        mpijob.WORKER: "node-2",
    }
    assert spec["source"]["kind"] == "MPIJob" and spec["source"]["name"] == mpijob.NAME, spec["source"]
    # rank 0 in the launcher, rank 1 under the worker's orted; mpirun, orted and the exec server are no ranks
    ranks = {p["name"]: len(p.get("ranks") or ()) for p in spec["pods"]}
    assert ranks == {mpijob.LAUNCHER: 1, mpijob.WORKER: 1} and spec["rankCount"] == 2, spec["pods"]

    cluster.kubectl("delete", "pod", "-n", job_ns, *mpijob.MEMBERS, "--timeout=120s", timeout=150)
    pods.apply(cluster, job_ns, ring.restore_job("jacobi-back", checkpoint["metadata"]["name"]))
    restored = ring.wait_phase(cluster, job_ns, "restorejob", "jacobi-back", "Succeeded", 900)
    placed = {p["metadata"]["name"]: p for p in pods.get(cluster, job_ns, "pods")["items"]}
    assert placed[mpijob.LAUNCHER]["spec"]["nodeName"] == "node-2", restored["status"]
    assert placed[mpijob.WORKER]["spec"]["nodeName"] == "node-1", restored["status"]
    assert placed[mpijob.WORKER]["status"]["podIP"] == node_ip(1)
    moved = mpijob.progress(cluster, job_ns, cut_at)
    expected = mpijob.uninterrupted(cluster, job_ns)  # done long ago; its pod must be gone before the drain

    drained = drain_node_1(cluster, job_ns)
    before_drain = max(mpijob.steps(drained["log"]))
    assert before_drain > cut_at and mpijob.result(drained["log"]) is None, drained["log"][-2000:]
    assert placement(cluster, job_ns) == {mpijob.LAUNCHER: "node-2", mpijob.WORKER: "node-2"}

    after = mpijob.finish(cluster, job_ns)
    resumed = mpijob.steps(after)
    assert resumed and min(resumed) > before_drain, f"drained at {before_drain}:\n{after[-3000:]}"
    assert "mpirun-exit=0" in after, after[-3000:]
    assert mpijob.result(after) == expected, f"{after[-3000:]}\nexpected {expected}"
    print(
        f"jacobi: cut at step {cut_at}, ran to {moved} on the swapped nodes, drained at {before_drain} "
        f"of {mpijob.STEPS}; CheckpointJob {ring.seconds(done):.1f}s, "
        f"RestoreJob {ring.seconds(restored):.1f}s; "
        f"drain to running on node-2 {drained['seconds']:.1f}s; {expected}"
    )


def placement(cluster: Cluster, namespace: str) -> dict[str, str]:
    found = pods.get(cluster, namespace, "pods")["items"]
    return {
        p["metadata"]["name"]: p["spec"]["nodeName"] for p in found if p["metadata"]["name"] in mpijob.MEMBERS
    }


def drain_node_1(cluster: Cluster, namespace: str) -> dict[str, Any]:
    """Protect the job with a CheckpointSchedule (drain only), drain node-1 and wait until the migration is
    Done; the launcher's log up to the drain, and how long from the drain to the job running again."""
    template = {
        "selector": {"matchLabels": {"training.kubeflow.org/job-name": mpijob.NAME}},
        "storageRef": {"name": "store"},
        "timeouts": {"admitSeconds": 300},
    }
    ring.protect(cluster, namespace, template, name=SCHEDULE)
    log = mpijob.log(cluster, namespace)
    try:
        began = time.time()
        said = ring.drain_node_1(cluster, namespace, "--force")
        assert "will retry" in said, said[-4000:]  # held while the job was checkpointed
        done = ring.wait_phase(cluster, namespace, "checkpointschedule", SCHEDULE, "Done", 900, "drainPhase")
        seconds = time.time() - began
    finally:
        cluster.kubectl("uncordon", "node-1", check=False)
    _, checkpoint, _ = ring.migrated(cluster, namespace, done)
    recorded = {p["name"]: p["node"] for p in checkpoint["spec"]["pods"]}
    assert recorded == {mpijob.LAUNCHER: "node-2", mpijob.WORKER: "node-1"}, recorded
    return {"log": log, "seconds": seconds}
