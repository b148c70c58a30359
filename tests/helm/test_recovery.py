"""Automatic recovery on the real cluster: the two-pod RDMA ring protected by a CheckpointSchedule with
`recovery`, in one story of two failures. Nobody applies anything in between; each time the operator stops
the whole job and restores it from the schedule's latest checkpoint, and the ring finishes at the end with
every message delivered exactly once.

1. Once a periodic checkpoint has committed, ring-1's container dies (its processes killed from the node,
   exit 137, as a crashed rank's would): the job comes back on the same nodes.
2. After a newer checkpoint, node-1's guest is killed hard (qemu SIGKILL). The node goes NotReady; the
   recovery starts but replaces nothing while node-1 might still run ring-0 (fencing, docs/recovery.md).
   The testbed then plays the cloud and deletes the vanished node's Node: the job comes back on node-2.
   A fresh guest then takes node-1's place, so the session's cluster goes on with two nodes.

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
from helm.conftest import Release

from testbed import pods, ring
from testbed.cluster import delete_vanished_node

# budget (tests/testbed/budget.py): 9.8 min in a CI-like run of 2026-12-04, 24.3 alone at the slowest pace
# seen. Kept at 25 so that, when time is short, this story (it runs before test_uninstall) is the one left
# out: at 20 a run whose perftest story passed reached test_uninstall at 60 min and skipped it.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400), pytest.mark.budget(minutes=25)]

SCHEDULE = "ring"
PERIODIC = 2  # checkpoints the schedule takes before the first failure: one more than it keeps
KEEP_LAST = 1  # the schedule's retention
HOST_DIR = "/var/lib/ibckpt"  # the chart's agent.hostDir


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
LEFT_ON_DISK = """
import os, sys
def size(top, only=None):
    total = 0
    for root, dirs, files in os.walk(top):
        if "kept.json" in files:
            dirs.clear()
            continue
        if only is None or only in root.split(os.sep):
            total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    return total
print(size(sys.argv[1] + "/sessions", "images"), size(sys.argv[1] + "/restore"))
"""


def _left_on_disk(installed: Release) -> dict[str, tuple[int, int]]:
    """Each node's (image bytes, restore staging bytes) under the agents' host dir (of running agents)."""
    found = {}
    for agent in installed.agent_pods():
        if agent["status"].get("phase") != "Running":
            continue
        out = installed.cluster.kubectl(
            "exec", "-n", installed.namespace, agent["metadata"]["name"], "--",
            "/opt/ibckpt/venv/bin/python", "-c", LEFT_ON_DISK, HOST_DIR,
        ).stdout.split()  # fmt: skip
        found[agent["spec"]["nodeName"]] = (int(out[0]), int(out[1]))
    return found


def _nothing_left_on_disk(installed: Release) -> None:
    deadline = time.monotonic() + 120
    while any(sum(left) for left in _left_on_disk(installed).values()):
        assert time.monotonic() < deadline, (
            f"(image, staging) bytes left per node: {_left_on_disk(installed)}"
        )
        time.sleep(5)


def _periodic_checkpoints_keep_the_disks_bounded(installed: Release, namespace: str) -> None:
    """Step 0: the schedule's first PERIODIC checkpoints. Sampled all along, no node's images and staging
    ever hold more than about two checkpoints' worth (one being dumped or uploaded, one just staged, and
    their logs). (With 2 periodic checkpoints this bound alone would not see images that are never
    deleted; `_nothing_left_on_disk`, after the recovery, does. There were 4 until 2026-12-01: CI's time.)"""
    cluster = installed.cluster
    seen: dict[str, dict[str, Any]] = {}
    peak: dict[str, int] = {}
    deadline = time.monotonic() + 900
    while len(seen) < PERIODIC:
        assert time.monotonic() < deadline, f"{len(seen)} checkpoints\n{ring.diagnose(cluster, namespace)}"
        seen |= {c["metadata"]["name"]: c for c in _checkpoints(installed, namespace)}
        for node, left in _left_on_disk(installed).items():
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


def _uids(cluster: Any, namespace: str) -> dict[str, str]:
    return {name: pods.get(cluster, namespace, "pod", name)["metadata"]["uid"] for name in ring.MEMBERS}


def test_a_dead_rank_then_a_dead_node_bring_the_job_back_from_its_last_checkpoint_by_itself(
    installed: Release, job_ns: str
) -> None:
    cluster = installed.cluster
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
    restore = pods.get(cluster, job_ns, "restorejob", recovery["restoreJob"])
    assert restore["status"]["phase"] == "Succeeded", restore["status"]
    assert restore["metadata"]["ownerReferences"][0]["kind"] == "CheckpointSchedule"
    # the memory tier: each node's part was kept by the other node's agent, and read there
    assert _memory_copies(installed, job_ns, latest["metadata"]["name"]) == {
        "node-1": "node-2",
        "node-2": "node-1",
    }
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
    assert ring.placement(cluster, job_ns) == {"ring-0": "node-1", "ring-1": "node-2"}
    ring.running(cluster, job_ns)
    # a checkpoint and a restore went through both nodes: neither keeps their images or staging
    _nothing_left_on_disk(installed)
    _a_dead_node(installed, job_ns, {c["metadata"]["name"] for c in _checkpoints(installed, job_ns)})
    _nothing_left_on_disk(installed)  # a second checkpoint and a restore onto node-2 alone
    ring.finish(cluster, job_ns)
    cluster.kubectl("delete", "checkpointschedule", SCHEDULE, "-n", job_ns, "--wait=false")


def _memory_copies(installed: Release, namespace: str, checkpoint: str) -> dict[str, str]:
    """Which node's agent kept each part of the Checkpoint in memory (its status, docs/recovery.md)."""
    status = pods.get(installed.cluster, namespace, "checkpoint", checkpoint)["status"]
    assert status["tiers"] == ["S3", "Memory"], status
    return {copy["part"]: copy["node"] for copy in status["memoryCopies"]}


def _a_dead_node(installed: Release, job_ns: str, known: set[str]) -> None:
    """Step 2: a newer checkpoint, then node-1 killed hard; fencing holds until its Node is deleted."""
    cluster = installed.cluster
    cluster.kubectl("patch", "checkpointschedule", SCHEDULE, "-n", job_ns, "--type=merge",
                    "-p", json.dumps({"spec": {"suspend": False}}))  # fmt: skip
    deadline = time.monotonic() + 600
    while not {c["metadata"]["name"] for c in _checkpoints(installed, job_ns)} - known:
        assert time.monotonic() < deadline, ring.diagnose(cluster, job_ns)
        time.sleep(5)
    latest = _newest_checkpoint(installed, job_ns)
    assert latest["metadata"]["name"] not in known
    before = _uids(cluster, job_ns)
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
            time.sleep(5)
        delete_vanished_node(cluster, "node-1")
        done = ring.wait_phase(cluster, job_ns, "checkpointschedule", SCHEDULE, "Recovered", 900,
                               "recoveryPhase")  # fmt: skip
        recovery = done["status"]["recovery"]
        assert recovery["seq"] == 2 and recovery["checkpoint"] == latest["metadata"]["name"], recovery
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
        assert ring.placement(cluster, job_ns) == {"ring-0": "node-2", "ring-1": "node-2"}
    finally:
        # the session's cluster goes on with two nodes: a fresh guest (an empty node) for node-1
        cluster.kubectl("delete", "node", "node-1", "--wait=false", check=False)
        cluster.replace_node("node-1")
        installed.rollout(f"daemonset/{installed.name}-agent")
