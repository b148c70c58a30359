"""A drain whose checkpoint fails, on the real cluster with the chart installed: the job's storage is
unreachable (its CheckpointStorage names a port where nothing listens), so every migration CheckpointJob
fails before any pod is touched. Under `onFailure: KeepHolding` the drain stays held and says so: kubectl
drain gives up with ibckpt's HOLDING answer, the schedule's status and a Warning Event name the failure,
and the job's pod still runs on the cordoned node. Switched to `ProceedAndLose`, the next failed retry lets
the drain go on: kubectl drain completes, the status and an Event say the running state is lost, and the
pod is gone from the node. The test only runs kubectl. (The job's pods need no RDMA here: the checkpoint
fails at its storage check, before admission.)
"""

from __future__ import annotations

import json
import time

import pytest
from helm.conftest import Release

from testbed import pods, ring
from testbed.cluster import Cluster
from testbed.images import APPS_IMAGE

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]

SCHEDULE = "ring"
RETRY_SECONDS = 20
DOWN_PORT = 9  # discard: nothing listens there on the host


def warnings(cluster: Cluster, namespace: str, reason: str) -> list[str]:
    found = pods.get(cluster, namespace, "events")["items"]
    return [
        e["message"]
        for e in found
        if e["involvedObject"].get("name") == SCHEDULE and e["reason"] == reason and e["type"] == "Warning"
    ]


def test_a_failing_checkpoint_keeps_holding_the_drain_loudly_then_proceeds_and_loses_when_told(
    installed: Release, job_ns: str
) -> None:
    cluster = installed.cluster
    for name, node in (("ring-0", "node-1"), ("ring-1", "node-2")):
        command = ["sleep", "100000"]
        pod = pods.rdma_pod(name, node, command, APPS_IMAGE, host_network=False, labels=ring.LABELS)
        pod["spec"]["containers"][0].pop("volumeMounts")
        pod["spec"].pop("volumes")
        pods.apply(cluster, job_ns, pod)
    for name in ring.MEMBERS:
        pods.wait_pod(cluster, job_ns, name, {"Running"})
    down = ring.storage(f"http://127.0.0.1:{DOWN_PORT}", "unreachable")
    down["metadata"]["name"] = "down"
    pods.apply(cluster, job_ns, down)
    template = {**ring.job_template("Stop"), "storageRef": {"name": "down"}}
    drain = {"deadlineSeconds": 900, "onFailure": "KeepHolding", "retrySeconds": RETRY_SECONDS}
    schedule = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointSchedule",
        "metadata": {"name": SCHEDULE},
        "spec": {"drain": drain, "template": template},
    }
    pods.apply(cluster, job_ns, schedule)
    ring.wait_phase(cluster, job_ns, "checkpointschedule", SCHEDULE, f"policy/v1beta1/ibckpt-{SCHEDULE}", 300,
                    "protectedBy")  # fmt: skip

    try:
        # the cordon starts the migration; its CheckpointJob fails at the storage check: Held
        cluster.kubectl("cordon", "node-1")
        ring.wait_phase(cluster, job_ns, "checkpointschedule", SCHEDULE, "Held", 300, "drainPhase")
        held = cluster.kubectl(
            "drain", "node-1", "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=40s",
            timeout=100, check=False,
        )  # fmt: skip
        said = held.stdout + held.stderr
        # KeepHolding: kubectl gives up on its own timeout, having been told why by ibckpt
        assert held.returncode != 0, said[-4000:]
        assert "ibckpt is HOLDING this drain" in said and "ProceedAndLose" in said, said[-4000:]
        status = pods.get(cluster, job_ns, "checkpointschedule", SCHEDULE)["status"]
        assert status["drainPhase"] == "Held" and status["drainNodes"] == ["node-1"], status
        assert "still holding the drain of node-1" in status["drainMessage"], status
        assert "StorageUnreachable" in status["drainReason"] + status["drainMessage"], status
        assert warnings(cluster, job_ns, "DrainHeld"), pods.get(cluster, job_ns, "events")["items"][-5:]
        jobs = pods.get(cluster, job_ns, "checkpointjobs")["items"]
        phases = [(j.get("status") or {}).get("phase") for j in jobs]
        # none got past its storage check; a retry may have just started (no status written yet)
        assert phases and set(phases) <= {"Failed", "Pending", None}, phases
        # nothing was lost: the job's pod still runs where it ran
        kept = pods.get(cluster, job_ns, "pod", "ring-0")
        assert kept["spec"]["nodeName"] == "node-1" and kept["status"]["phase"] == "Running", kept["status"]
        assert kept["status"]["containerStatuses"][0]["restartCount"] == 0

        patch = {"spec": {"drain": {"onFailure": "ProceedAndLose"}}}
        cluster.kubectl("patch", "checkpointschedule", SCHEDULE, "-n", job_ns, "--type=merge", "-p",
                        json.dumps(patch))  # fmt: skip
        began = time.monotonic()
        proceeded = cluster.kubectl(
            "drain", "node-1", "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=300s",
            timeout=360, check=False,
        )  # fmt: skip
        said = proceeded.stdout + proceeded.stderr
        assert proceeded.returncode == 0, f"{said[-4000:]}\n{ring.diagnose(cluster, job_ns)}"
        print(f"ProceedAndLose let the drain go on {time.monotonic() - began:.1f}s after the switch")
    finally:
        cluster.kubectl("uncordon", "node-1", check=False)

    status = pods.get(cluster, job_ns, "checkpointschedule", SCHEDULE)["status"]
    assert status["drainPhase"] == "Lost", status
    assert "the running state of ring is lost" in status["drainMessage"], status
    lost = warnings(cluster, job_ns, "DrainProceededStateLost")
    assert lost and "is lost" in lost[0], lost
    gone = cluster.kubectl("get", "pod", "ring-0", "-n", job_ns, "-o", "json", check=False)
    assert gone.returncode != 0 or json.loads(gone.stdout)["metadata"].get("deletionTimestamp"), gone.stdout
