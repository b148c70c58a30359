"""Node drain of a StatefulSet, the way the issue asks for it, on the real cluster with the chart installed:
the two-pod RDMA ring as StatefulSet `ring` (one pod per node), protected by a CheckpointSchedule's
`drain` naming the StatefulSet; `kubectl drain node-1 --ignore-daemonsets --delete-emptydir-data` (no
--force: every pod has a controller) is held while the operator checkpoints both pods with Stop, and
completes by itself. The StatefulSet creates its pods again under their names: the operator refuses them
until their images are staged, then binds them to node-2 with the restore annotation (its mutating
webhook), the runtime wrapper restores them, and the ring finishes there with every message delivered
exactly once, in pods that kept their names and hostnames and never restarted.
"""

from __future__ import annotations

import time

import pytest
from helm.conftest import Release

from testbed import pods, ring

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400), pytest.mark.budget(minutes=8)]

SCHEDULE = "ring"


def test_kubectl_drain_moves_a_statefulset_through_its_own_controller_exactly_once(
    installed: Release, job_ns: str
) -> None:
    cluster = installed.cluster
    ring.start_statefulset(cluster, job_ns)
    before = ring.placement(cluster, job_ns)
    assert sorted(before.values()) == ["node-1", "node-2"], f"the scheduler did not spread the ring: {before}"
    uids = {name: pods.get(cluster, job_ns, "pod", name)["metadata"]["uid"] for name in ring.MEMBERS}
    template = {
        **ring.job_template(),
        "workloadRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "ring"},
    }
    del template["selector"]
    ring.protect(cluster, job_ns, template, name=SCHEDULE)
    pdb = pods.get(cluster, job_ns, "pdb", f"ibckpt-{SCHEDULE}")
    assert pdb["spec"]["selector"] == {"matchLabels": ring.LABELS}, pdb["spec"]  # the StatefulSet's own

    try:
        began = time.time()
        said = ring.drain_node_1(cluster, job_ns)
        drained = time.time()
        assert "will retry" in said and f"checkpointing {SCHEDULE} before it leaves node-1" in said, said[
            -4000:
        ]
        done = ring.wait_phase(cluster, job_ns, "checkpointschedule", SCHEDULE, "Done", 900, "drainPhase")
        settled = time.time()
    finally:
        cluster.kubectl("uncordon", "node-1", check=False)

    job, checkpoint, restore = ring.migrated(cluster, job_ns, done)
    assert {p["name"]: p["node"] for p in checkpoint["spec"]["pods"]} == before
    assert {p["template"]["controller"]["kind"] for p in checkpoint["spec"]["pods"]} == {"StatefulSet"}
    assert restore["spec"]["podsCreatedBy"] == "Controller", restore["spec"]

    # the StatefulSet's own new pods (new uids, same names and hostnames), bound to node-2 and restored
    assert ring.placement(cluster, job_ns) == {"ring-0": "node-2", "ring-1": "node-2"}
    restored_from = f"{job_ns}/{checkpoint['metadata']['name']}"
    for name in ring.MEMBERS:
        pod = pods.get(cluster, job_ns, "pod", name)
        meta = pod["metadata"]
        assert meta["uid"] != uids[name], f"{name} was not replaced"
        assert [o["kind"] for o in meta["ownerReferences"]] == ["StatefulSet"], meta["ownerReferences"]
        assert meta["annotations"]["ibckpt.io/restore-from"] == restored_from, meta["annotations"]
        hostname = cluster.kubectl("exec", "-n", job_ns, name, "--", "hostname").stdout.strip()
        assert hostname == name
    refused = [
        e for e in pods.get(cluster, job_ns, "events")["items"]
        if e["involvedObject"].get("kind") == "StatefulSet" and "ibckpt: pod ring-" in e.get("message", "")
    ]  # fmt: skip
    ring.finish_statefulset(cluster, job_ns)

    print(
        f"statefulset drain to running elsewhere: {settled - began:.1f}s "
        f"(kubectl drain done at {drained - began:.1f}s); "
        f"CheckpointJob {ring.seconds(job):.1f}s, RestoreJob {ring.seconds(restore):.1f}s; "
        f"ratio {(settled - began) / (ring.seconds(job) + ring.seconds(restore)):.2f}; "
        f"creations refused while the images staged: {sum(e.get('count', 1) for e in refused)}"
    )
