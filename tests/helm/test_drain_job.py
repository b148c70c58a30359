"""Node drain of Jobs, whose controller names each new pod anew, on the real cluster with the chart installed:
the two-pod RDMA ring as batch Jobs `ring-0` (on node-1) and `ring-1` (on node-2), as an MPI launcher is a
Job beside its workers, protected by a CheckpointSchedule's `drain` over their label. `kubectl drain node-1
--ignore-daemonsets --delete-emptydir-data` (no --force: every pod has a controller) is held while the
operator checkpoints both pods with Stop, and completes by itself.

The commit deletes both pods, and each Job at once wants a new pod, which would run the ring from scratch.
The operator's webhook refuses every new pod of those Jobs (by their uid) until the restore is over. The
RestoreJob creates the pods again under their names and labels on node-2, and each Job adopts its pod:
it counts that pod as its own, starts nothing else, and completes when the restored ring finishes
with every message delivered exactly once.
"""

from __future__ import annotations

import time

import pytest
from helm.conftest import Release

from testbed import pods, ring

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400), pytest.mark.budget(minutes=8)]

SCHEDULE = "ring"
REFUSED = "ibckpt: the pods of this controller are being migrated by CheckpointSchedule ring"


def test_kubectl_drain_moves_two_jobs_whose_pods_they_adopt_back_and_complete_exactly_once(
    installed: Release, job_ns: str
) -> None:
    cluster = installed.cluster
    names = ring.start_jobs(cluster, job_ns)
    jobs = {name: pods.get(cluster, job_ns, "job", name) for name in ring.MEMBERS}
    sources = {job: pods.get(cluster, job_ns, "pod", pod) for job, pod in names.items()}
    assert {job: p["spec"]["nodeName"] for job, p in sources.items()} == {
        "ring-0": "node-1",
        "ring-1": "node-2",
    }
    ring.protect(cluster, job_ns, ring.job_template(), name=SCHEDULE)

    try:
        began = time.time()
        said = ring.drain_node_1(cluster, job_ns)
        assert f"checkpointing {SCHEDULE} before it leaves node-1" in said, said[-4000:]
        done = ring.wait_phase(cluster, job_ns, "checkpointschedule", SCHEDULE, "Done", 900, "drainPhase")
        settled = time.time()
    finally:
        cluster.kubectl("uncordon", "node-1", check=False)

    migration = done["status"]["migration"]
    recorded = {s["name"]: s.get("controllerUid") for s in migration["sources"]}
    assert recorded == {names[job]: jobs[job]["metadata"]["uid"] for job in ring.MEMBERS}, migration
    checkpoint = pods.get(cluster, job_ns, "checkpoint", migration["checkpoint"])
    assert {p["template"]["controller"]["kind"] for p in checkpoint["spec"]["pods"]} == {"Job"}
    restore = pods.get(cluster, job_ns, "restorejob", migration["restoreJob"])
    assert restore["status"]["phase"] == "Succeeded" and restore["spec"]["avoidNodes"] == ["node-1"]
    assert restore["spec"].get("podsCreatedBy", "RestoreJob") == "RestoreJob", restore["spec"]

    # Each Job has exactly its source's name back (no pod of its own), on node-2, restored and adopted.
    restored_from = f"{job_ns}/{migration['checkpoint']}"
    for job, found in ring.job_pods(cluster, job_ns).items():
        assert list(found) == [names[job]], f"Job {job} has pods {sorted(found)}, not only {names[job]}"
        pod = found[names[job]]
        meta = pod["metadata"]
        assert meta["uid"] != sources[job]["metadata"]["uid"] and pod["spec"]["nodeName"] == "node-2"
        assert meta["annotations"]["ibckpt.io/restore-from"] == restored_from, meta["annotations"]
        owners = [(o["kind"], o["uid"], o.get("controller")) for o in meta.get("ownerReferences") or ()]
        assert owners == [("Job", jobs[job]["metadata"]["uid"], True)], f"{job}: {owners}"
    refused = [
        e for e in pods.get(cluster, job_ns, "events")["items"]
        if e["involvedObject"].get("kind") == "Job" and REFUSED in e.get("message", "")
    ]  # fmt: skip
    assert refused, "no Job's new pod was refused during the migration"

    time.sleep(5)
    for job in ring.MEMBERS:
        cluster.kubectl("exec", "-n", job_ns, names[job], "--", "touch", "/tmp/stop")
    for job in ring.MEMBERS:
        pods.wait_pod(cluster, job_ns, names[job], {"Succeeded"}, timeout=300)
    log = "".join(cluster.kubectl("logs", "-n", job_ns, names[job]).stdout for job in ring.MEMBERS)
    assert log.count("ring-done") == 2, log[-3000:]
    ring.assert_exactly_once(log)
    deadline = time.monotonic() + 120
    while True:  # each Job counts its adopted pod's success as its own and completes
        states = {job: pods.get(cluster, job_ns, "job", job)["status"] for job in ring.MEMBERS}
        complete = {
            job: any(c["type"] == "Complete" and c["status"] == "True" for c in s.get("conditions") or ())
            for job, s in states.items()
        }
        if all(complete.values()) or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert all(complete.values()) and all(s.get("succeeded") == 1 for s in states.values()), states
    assert all(len(found) == 1 for found in ring.job_pods(cluster, job_ns).values())

    print(
        f"job drain to running elsewhere: {settled - began:.1f}s; "
        f"new pods of the Jobs refused meanwhile: {sum(e.get('count', 1) for e in refused)}"
    )
