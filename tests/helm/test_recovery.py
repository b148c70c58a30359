"""Automatic recovery on the real cluster: the two-pod RDMA ring protected by a CheckpointSchedule with
`recovery`, in one story of two failures. Nobody applies anything in between; each time the operator stops
the whole job and restores it from the schedule's latest checkpoint, and the ring finishes at the end with
every message delivered exactly once.

1. Once a periodic checkpoint has committed, ring-1's container dies (its processes killed from the node,
   exit 137, as a crashed rank's would): the job comes back on the same nodes.
2. A newer checkpoint commits on the memory tier (`commitOn: Memory`) while S3 hangs: its Checkpoint is
   restorable from the buddies' copies alone, then lists S3 as well once S3 answers again. Node-1's guest
   is then killed hard (qemu SIGKILL). The node goes NotReady; the recovery starts but replaces nothing
   while node-1 might still run ring-0 (fencing, docs/recovery.md). The testbed then plays the cloud and
   deletes the vanished node's Node: the job comes back on node-2. A fresh guest then takes node-1's
   place, so the session's cluster goes on with two nodes.

Beside the ring, from the start, a second protected workload that never has a checkpoint: one bare pod,
`lone`, on node-1, under a schedule with recovery alone and `noCheckpoint: RestartFromScratch`. When node-1
dies the same fencing holds it; once the Node is gone the operator creates the pod again from scratch on
node-2, and says so (docs/recovery.md, the policy when no checkpoint exists).

The release runs the memory tier: each node's part is kept by the other node's agent. After step 1 the
restore reads both parts from memory; after step 2 node-1's part from node-2's memory (node-2's copy died
with node-1 and comes from S3).

Before the first, the schedule takes 2 checkpoints (its retention keeps the newest), and no node's
disk ever holds more than about two checkpoints' images. Between the two failures, the nodes' disks:
once its sessions ended, no node keeps checkpoint images or restore staging, but a failed checkpoint's,
kept for a while on purpose (docs/node-agent.md, what stays on a node).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from helm.conftest import Release, left_on_disk, nothing_left_on_disk

from testbed import pods, ring
from testbed.cluster import delete_vanished_node
from testbed.gate import Gate
from testbed.images import APPS_IMAGE

# budget (tests/testbed/budget.py): 9.8 min in a CI-like run of 2026-12-04, 24.3 alone at the slowest pace
# seen. `first`: issue 27 needs CI to run it, so it leads the long stories.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400), pytest.mark.budget(minutes=25, first=True)]

SCHEDULE = "ring"
PERIODIC = 2  # checkpoints the schedule takes before the first failure: one more than it keeps
KEEP_LAST = 1  # the schedule's retention
LONE = "lone"  # the workload with no checkpoint: its schedule, its pod, its label


def _checkpoints(installed: Release, namespace: str) -> list[dict[str, Any]]:
    found = pods.get(installed.cluster, namespace, "checkpoints", **{"ibckpt.io/schedule": SCHEDULE})
    items: list[dict[str, Any]] = found["items"]
    return items


def _ended(cluster: Any, namespace: str, uid: str) -> bool:
    """The killed pod is Failed, or already stopped by the recovery (gone, or replaced by a new uid)."""
    found = cluster.kubectl("get", "pod", "ring-1", "-n", namespace, "-o", "json", check=False)
    if found.returncode != 0:
        return "NotFound" in found.stderr
    pod = json.loads(found.stdout)
    return bool(pod["metadata"]["uid"] != uid or pod["status"].get("phase") == "Failed")


def _newest_checkpoint(installed: Release, namespace: str) -> dict[str, Any]:
    """Once the schedule is suspended and its jobs ended: the Checkpoint a recovery must restore."""
    cluster = installed.cluster
    cluster.kubectl("patch", "checkpointschedule", SCHEDULE, "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"suspend": True}}))  # fmt: skip
    time.sleep(5)
    for job in pods.get(cluster, namespace, "checkpointjobs")["items"]:
        ring.wait_phase(cluster, namespace, "checkpointjob", job["metadata"]["name"], "Succeeded", 600)
    found = sorted(_checkpoints(installed, namespace), key=lambda c: c["metadata"]["creationTimestamp"])
    return found[-1]


# Run in a node's agent: the bytes of checkpoint images and of restore staging in the node's ibckpt dir.
# A failed checkpoint's images stay, marked kept.json, for the chart's keepFailedImages bound: not counted.
# The agent deletes files while this walks them: one gone between the listing and its lstat counts 0.
def _periodic_checkpoints_keep_the_disks_bounded(installed: Release, namespace: str) -> None:
    """Step 0: the schedule's first PERIODIC checkpoints. Sampled all along, no node's images and staging
    ever hold more than about two checkpoints' worth (one being dumped or uploaded, one just staged, and
    their logs). (With 2 periodic checkpoints this bound alone would not see images that are never
    deleted; `nothing_left_on_disk`, after the recovery, does. There were 4 until 2026-12-01: CI's time.)"""
    cluster = installed.cluster
    seen: dict[str, dict[str, Any]] = {}
    peak: dict[str, int] = {}
    deadline = time.monotonic() + 900
    while len(seen) < PERIODIC:
        assert time.monotonic() < deadline, f"{len(seen)} checkpoints\n{ring.diagnose(cluster, namespace)}"
        seen |= {c["metadata"]["name"]: c for c in _checkpoints(installed, namespace)}
        for node, left in left_on_disk(installed).items():
            peak[node] = max(peak.get(node, 0), sum(left))
        time.sleep(3)
    one: dict[str, int] = {}  # a checkpoint's bytes per node, the largest of them
    for checkpoint in seen.values():
        for pod in checkpoint["spec"]["pods"]:
            one[pod["node"]] = max(one.get(pod["node"], 0), int(pod["bytes"]))
    print(f"{len(seen)} periodic checkpoints: peak bytes on disk {peak}, one checkpoint {one}")
    assert set(peak) == set(one), (peak, one)
    for node, most in peak.items():
        assert most <= 3 * one[node] + (1 << 20), f"{node} held {most} bytes; one checkpoint is {one[node]}"


def _ring_placement(cluster: Any, namespace: str) -> dict[str, str]:
    """The ring's pods by node (the lone pod shares the namespace)."""
    return {name: node for name, node in ring.placement(cluster, namespace).items() if name in ring.MEMBERS}


def _uids(cluster: Any, namespace: str) -> dict[str, str]:
    return {name: pods.get(cluster, namespace, "pod", name)["metadata"]["uid"] for name in ring.MEMBERS}


def test_a_dead_rank_then_a_dead_node_bring_the_job_back_from_its_last_checkpoint_by_itself(
    installed: Release, s3_gate: Gate, job_ns: str
) -> None:
    # s3_gate first: torn down after the namespace, whose Checkpoints on the gated storage are deleted
    # (their finalizers delete the images) while the gate still relays
    cluster = installed.cluster
    _protect_the_lone_pod(installed, job_ns)
    ring.start(cluster, job_ns)
    before = _uids(cluster, job_ns)
    schedule = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointSchedule",
        "metadata": {"name": SCHEDULE},
        "spec": {
            "intervalSeconds": 60,
            "retention": {"keepLast": KEEP_LAST},
            "template": ring.job_template(),
            "recovery": {"podFailure": True, "nodeNotReadySeconds": 20, "deadlineSeconds": 900},
        },
    }
    pods.apply(cluster, job_ns, schedule)
    _periodic_checkpoints_keep_the_disks_bounded(installed, job_ns)
    # no more periodic checkpoints: the one to restore is known (recovery stays armed while suspended)
    latest = _newest_checkpoint(installed, job_ns)
    deadline = time.monotonic() + 120
    while len(kept := [c["metadata"]["name"] for c in _checkpoints(installed, job_ns)]) != KEEP_LAST:
        assert time.monotonic() < deadline, f"the schedule's retention keeps {KEEP_LAST}: {kept}"
        time.sleep(3)
    assert latest["metadata"]["name"] in kept, kept
    # the memory tier: each node's part was kept by the other node's agent (copied after the job committed
    # on S3, listed once sealed), and the restore below reads it there
    assert _memory_copies(installed, job_ns, latest["metadata"]["name"]) == {
        "node-1": "node-2",
        "node-2": "node-1",
    }
    ring.running(cluster, job_ns)

    # the pod's end is what counts (an exec through the emulated nodes' kubelet has failed on its own)
    for _ in range(3):
        killed = ring.kill_rank(installed, "node-2")
        if "killed" in killed.stdout or _ended(cluster, job_ns, before["ring-1"]):
            break
        time.sleep(5)
    print("rank killer:", killed.returncode, killed.stdout, killed.stderr[-500:])
    # the operator may stop the failed pod before this loop sees it Failed: its Event names the exit code
    deadline = time.monotonic() + 300
    while not _ended(cluster, job_ns, before["ring-1"]):
        assert time.monotonic() < deadline, ring.diagnose(cluster, job_ns)
        time.sleep(2)

    done = ring.wait_phase(cluster, job_ns, "checkpointschedule", SCHEDULE, "Recovered", 900, "recoveryPhase")
    recovery = done["status"]["recovery"]
    assert recovery["trigger"] == "PodFailed", recovery
    assert recovery["checkpoint"] == latest["metadata"]["name"], recovery
    assert recovery["workLostSeconds"] > 0, recovery
    print(f"recovery 1 (a dead rank): {recovery['workLostSeconds']} s of work lost")
    restore = pods.get(cluster, job_ns, "restorejob", recovery["restoreJob"])
    assert restore["status"]["phase"] == "Succeeded", restore["status"]
    assert restore["metadata"]["ownerReferences"][0]["kind"] == "CheckpointSchedule"
    reads = restore["status"]["memoryReads"]
    assert reads["holders"] == ["node-1", "node-2"] and reads["chunks"] > 0, restore["status"]
    events = cluster.kubectl("get", "events", "-n", job_ns, "--field-selector", "reason=Recovered").stdout
    assert SCHEDULE in events, events
    started = cluster.kubectl("get", "events", "-n", job_ns, "--field-selector", "reason=RecoveryStarted",
                              "-o", "jsonpath={.items[*].message}").stdout  # fmt: skip
    assert "pod ring-1 failed (exit code 137)" in started, started
    # new pods (the old ones were stopped first: never two copies of a rank)
    after = _uids(cluster, job_ns)
    assert not set(after.values()) & set(before.values()), (before, after)
    assert _ring_placement(cluster, job_ns) == {"ring-0": "node-1", "ring-1": "node-2"}
    ring.running(cluster, job_ns)
    # a checkpoint and a restore went through both nodes: neither keeps their images or staging
    nothing_left_on_disk(installed)
    _a_dead_node(installed, job_ns, s3_gate, {c["metadata"]["name"] for c in _checkpoints(installed, job_ns)})
    nothing_left_on_disk(installed)  # a second checkpoint and a restore onto node-2 alone
    ring.finish(cluster, job_ns)
    cluster.kubectl("delete", "checkpointschedule", SCHEDULE, LONE, "-n", job_ns, "--wait=false")
    cluster.kubectl("delete", "pod", LONE, "-n", job_ns, "--wait=false")


def _protect_the_lone_pod(installed: Release, namespace: str) -> None:
    """A bare pod on node-1 whose schedule takes no checkpoint and recovers it from scratch."""
    pod = pods.image_pod(LONE, "node-1", APPS_IMAGE, [])
    pod["metadata"]["labels"] = {"app": LONE}
    pod["spec"]["terminationGracePeriodSeconds"] = 1
    pod["spec"]["containers"][0]["command"] = ["sleep", "1000000"]
    template = ring.job_template() | {"selector": {"matchLabels": {"app": LONE}}}
    recovery = {"nodeNotReadySeconds": 20, "noCheckpoint": "RestartFromScratch", "deadlineSeconds": 900}
    schedule = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointSchedule",
        "metadata": {"name": LONE},
        "spec": {"recovery": recovery, "template": template},
    }
    pods.apply(installed.cluster, namespace, pod, schedule)


def _lone_started_again_from_scratch(installed: Release, namespace: str, uid: str) -> None:
    """Node-1 is gone: the lone pod, with no checkpoint to restore, is created again on node-2."""
    cluster = installed.cluster
    done = ring.wait_phase(cluster, namespace, "checkpointschedule", LONE, "RestartedFromScratch", 600,
                           "recoveryPhase")  # fmt: skip
    status = done["status"]
    assert status["recoveryReason"] == "NoCheckpoint", status
    assert status["recovery"]["trigger"] == "NodeNotReady", status
    assert status["recovery"]["nodes"] == ["node-1"], status
    assert f"the operator created {LONE} again from scratch" in status["recoveryMessage"], status
    started = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                              f"reason=RecoveryStarted,involvedObject.name={LONE}",
                              "-o", "jsonpath={.items[*].message}").stdout  # fmt: skip
    assert "restarting from scratch" in started, started
    again = pods.wait_pod(cluster, namespace, LONE, {"Running"}, timeout=300)
    assert again["metadata"]["uid"] != uid and again["spec"]["nodeName"] == "node-2", again["metadata"]


def _memory_copies(installed: Release, namespace: str, checkpoint: str) -> dict[str, str]:
    """Which node's agent kept each part of the Checkpoint in memory (its status, docs/recovery.md), once
    every part's copy is listed (the copies are made after a commit on S3: usually within 60 s here; one
    CI-like run on 2026-12-05 had one part's copy still unlisted at 60 s, so 120)."""
    deadline = time.monotonic() + 120
    while (status := pods.get(installed.cluster, namespace, "checkpoint", checkpoint)["status"]).get(
        "tiers"
    ) != ["S3", "Memory"]:
        assert time.monotonic() < deadline, status
        time.sleep(2)
    return {copy["part"]: copy["node"] for copy in status["memoryCopies"]}


def _job_names(cluster: Any, namespace: str) -> set[str]:
    return {job["metadata"]["name"] for job in pods.get(cluster, namespace, "checkpointjobs")["items"]}


def _committed_in_memory_while_s3_hangs(
    installed: Release, job_ns: str, s3_gate: Gate, known: set[str]
) -> dict[str, Any]:
    """Step 2's checkpoint commits on the memory tier (`commitOn: Memory`, docs/recovery.md) while S3
    hangs: its Checkpoint is restorable from the buddies' copies before S3 answers, and lists S3 too once
    S3 answers again and the uploads end. The schedule's template goes through the S3 gate for it."""
    cluster = installed.cluster
    bucket = pods.get(cluster, job_ns, "checkpointstorage", "store")["spec"]["bucket"]
    gated = ring.storage(f"http://127.0.0.1:{s3_gate.port}", bucket)
    gated["metadata"]["name"] = "gated"
    pods.apply(cluster, job_ns, gated)
    earlier = _job_names(cluster, job_ns)
    template = ring.job_template() | {"storageRef": {"name": "gated"}, "commitOn": "Memory"}
    cluster.kubectl("patch", "checkpointschedule", SCHEDULE, "-n", job_ns, "--type=merge",
                    "-p", json.dumps({"spec": {"suspend": False, "template": template}}))  # fmt: skip
    deadline = time.monotonic() + 600
    while not (new := sorted(_job_names(cluster, job_ns) - earlier)):
        assert time.monotonic() < deadline, ring.diagnose(cluster, job_ns)
        time.sleep(1)
    # not before the cut: the operator's storage check, as it starts the agents, reads the bucket
    seen = pods.watch_status(cluster, job_ns, "checkpointjob", new[0], "phase",
                             lambda phase: phase not in ("", "Pending", "Admitted"))  # fmt: skip
    assert seen[-1] not in ("Failed", "Succeeded", "Committed"), (seen, ring.diagnose(cluster, job_ns))
    s3_gate.stall()  # every S3 request from now on waits, as on a store that hangs
    try:
        deadline = time.monotonic() + 420
        while True:
            fresh = [c for c in _checkpoints(installed, job_ns) if c["metadata"]["name"] not in known]
            status = fresh[0].get("status", {}) if fresh else {}
            if status.get("tiers"):
                break
            assert time.monotonic() < deadline, ring.diagnose(cluster, job_ns)
            time.sleep(2)
        # committed and restorable on the copies alone, while the uploads wait for S3
        assert status["tiers"] == ["Memory"] and status.get("readyToRestore") is True, status
        assert {copy["part"]: copy["node"] for copy in status["memoryCopies"]} == {
            "node-1": "node-2",
            "node-2": "node-1",
        }, status
    finally:
        s3_gate.mend()
    print(f"committed on memory while S3 hung: {fresh[0]['metadata']['name']} {status}")
    latest = _newest_checkpoint(installed, job_ns)  # suspends the schedule, waits for its jobs
    assert latest["metadata"]["name"] == fresh[0]["metadata"]["name"], (latest, fresh)
    deadline = time.monotonic() + 300
    name = latest["metadata"]["name"]
    # the durable tier, once the uploads reached S3
    while (tiers := pods.get(cluster, job_ns, "checkpoint", name)["status"]["tiers"]) != ["S3", "Memory"]:
        assert time.monotonic() < deadline, (tiers, ring.diagnose(cluster, job_ns))
        time.sleep(3)
    return latest


def _a_dead_node(installed: Release, job_ns: str, s3_gate: Gate, known: set[str]) -> None:
    """Step 2: a newer checkpoint, committed on the memory tier, then node-1 killed hard; fencing holds
    until its Node is deleted."""
    cluster = installed.cluster
    latest = _committed_in_memory_while_s3_hangs(installed, job_ns, s3_gate, known)
    before = _uids(cluster, job_ns)
    lone = pods.get(cluster, job_ns, "pod", LONE)
    assert lone["status"]["phase"] == "Running" and lone["spec"]["nodeName"] == "node-1", lone["status"]
    try:
        cluster.kill_node("node-1")
        fencing = ring.wait_phase(cluster, job_ns, "checkpointschedule", SCHEDULE, "Fencing", 600,
                                  "recoveryPhase")  # fmt: skip
        status = fencing["status"]
        assert status["recovery"]["trigger"] == "NodeNotReady", status
        assert status["recovery"]["nodes"] == ["node-1"], status
        # the rule: a NotReady node may still run ring-0, so nothing takes its place while it stays
        for _ in range(4):
            status = pods.get(cluster, job_ns, "checkpointschedule", SCHEDULE)["status"]
            assert status["recoveryPhase"] == "Fencing", status
            # (ring-1, on the live node, may still be named until its kubelet confirms the kill)
            assert re.match(r"NodeNotReady: waiting until .*ring-0 on node-1", status["recoveryMessage"]), (
                status
            )
            assert pods.get(cluster, job_ns, "pod", "ring-0")["metadata"]["uid"] == before["ring-0"]
            restores = pods.get(cluster, job_ns, "restorejobs")["items"]
            assert all(r["metadata"]["name"] != f"{SCHEDULE}-recover-2" for r in restores), restores
            # the lone pod, with no checkpoint, is fenced the same way before it starts again
            waiting = pods.get(cluster, job_ns, "checkpointschedule", LONE)["status"]
            assert waiting.get("recoveryPhase") in (None, "Idle", "Fencing"), waiting
            assert pods.get(cluster, job_ns, "pod", LONE)["metadata"]["uid"] == lone["metadata"]["uid"]
            time.sleep(5)
        delete_vanished_node(cluster, "node-1")
        done = ring.wait_phase(cluster, job_ns, "checkpointschedule", SCHEDULE, "Recovered", 900,
                               "recoveryPhase")  # fmt: skip
        recovery = done["status"]["recovery"]
        assert recovery["seq"] == 2 and recovery["checkpoint"] == latest["metadata"]["name"], recovery
        print(f"recovery 2 (a dead node): {recovery['workLostSeconds']} s of work lost")
        restore = pods.get(cluster, job_ns, "restorejob", recovery["restoreJob"])
        assert restore["status"]["phase"] == "Succeeded", restore["status"]
        assert restore["spec"]["avoidNodes"] == ["node-1"], restore["spec"]
        # node-1's part was read from node-2's memory; node-2's, kept by the dead node-1, from S3
        copies = _memory_copies(installed, job_ns, latest["metadata"]["name"])
        assert copies == {"node-1": "node-2", "node-2": "node-1"}, copies
        reads = restore["status"]["memoryReads"]
        assert reads["holders"] == ["node-2"] and reads["chunks"] > 0, restore["status"]
        after = _uids(cluster, job_ns)
        assert not set(after.values()) & set(before.values()), (before, after)
        assert _ring_placement(cluster, job_ns) == {"ring-0": "node-2", "ring-1": "node-2"}
        _lone_started_again_from_scratch(installed, job_ns, lone["metadata"]["uid"])
    finally:
        # the session's cluster goes on with two nodes: a fresh guest (an empty node) for node-1
        cluster.kubectl("delete", "node", "node-1", "--wait=false", check=False)
        cluster.replace_node("node-1")
        installed.rollout(f"daemonset/{installed.name}-agent")
