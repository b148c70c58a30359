"""A pod that holds more memory than the node's disk window, stopped by a CheckpointJob and brought back by a
RestoreJob on the other node (issue 31): its page data streams to S3 while CRIU dumps, leaves the node's
disk once the bucket has it, and the restored rank finds every byte it wrote.

`big` runs native/tests/write_mem under the shim, unprivileged, its device from the plugin: RDMA WRITEs into
an 8 MiB region in a loop, beside a buffer of MIB MiB of random bytes of which it rewrites RATE percent of
the pages every second. The session's release runs the agents with a disk window of WINDOW bytes
(tests/testbed/release.py), two of the store's 8 MiB chunks, so the dump's pages (MIB + 8 MiB and more)
cannot all be on the disk at once: node-1's agent says how many bytes left the disk once uploaded, how
often CRIU waited and the most its images held, which must stay well under the whole. The RestoreJob
downloads the part onto node-2; told to stop, the rank checks that its region holds every write it
completed and that every page of its buffer holds what its own dirties made of it (`CHECK ok`): a page
lost or zeroed by the release fails it. The memory tier's copy of the part, made on node-2 after the
commit, reads the released chunks back from the bucket: the Checkpoint must list it.
"""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any

import pytest
from helm.conftest import Release, nothing_left_on_disk

from testbed import pods, ring
from testbed.cluster import Cluster
from testbed.images import APPS_IMAGE
from testbed.release import DISK_WINDOW_BYTES

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1500)]

MIB = 96
RATE = 5
LABELS = {"app": "big"}
# node-1's agent, once the Stop's dump has ended (agent/preupload.py)
WINDOW_LINE = re.compile(
    r"(\d+) bytes left the disk as they were uploaded; the images held at most (\d+) bytes "
    r"\(window (\d+); CRIU paused (\d+) times"
)


def big_pod() -> dict[str, Any]:
    command = f"write_mem -f /tmp/stop -d {MIB} -r {RATE}; echo big-done $?; exec sleep 1000000"
    pod = pods.rdma_pod("big", "node-1", ["sh", "-c", command], APPS_IMAGE, labels=LABELS)
    pod["spec"]["hostNetwork"] = False
    pod["spec"]["runtimeClassName"] = "ibckpt"
    return pod


def wait_log(cluster: Cluster, namespace: str, word: str, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    out = ""
    while time.monotonic() < deadline:
        out = cluster.kubectl("logs", "-n", namespace, "big", check=False).stdout
        if word in out:
            return out
        time.sleep(2)
    raise AssertionError(
        f"big did not print {word} in {timeout:g}s: {out[-2000:]}{cluster.diagnose()[-3000:]}"
    )


def test_a_pod_larger_than_the_disk_window_is_stopped_and_restored_whole(
    installed: Release, job_ns: str
) -> None:
    try:
        stop_and_restore(installed, job_ns)
        nothing_left_on_disk(installed)  # the images went once uploaded and copied; the staging too
    finally:
        # the next story (test_recovery) bounds what the nodes' disks hold from its start: whatever
        # failed here, its images are gone first (the memory copy, after the commit, holds them)
        with contextlib.suppress(AssertionError):
            nothing_left_on_disk(installed)


def stop_and_restore(installed: Release, job_ns: str) -> None:
    cluster = installed.cluster
    pods.apply(cluster, job_ns, big_pod())
    pods.wait_pod(cluster, job_ns, "big", {"Running"})
    wait_log(cluster, job_ns, "READY")

    stop = ring.checkpoint_job("big-stop", "Stop")
    stop["spec"]["selector"] = {"matchLabels": LABELS}
    pods.apply(cluster, job_ns, stop)
    done = ring.wait_phase(cluster, job_ns, "checkpointjob", "big-stop", "Succeeded", 900)
    [row] = [r for r in done["status"]["pods"] if r["name"] == "big"]
    assert int(row["bytes"]) > MIB << 20, row  # the images hold the buffer: more than the window

    said = [m for m in WINDOW_LINE.finditer(installed.logs("agent")) if int(m.group(3)) == DISK_WINDOW_BYTES]
    assert said, installed.logs("agent")[-4000:]
    released, held, _, paused = map(int, said[-1].groups())
    print(f"{released} bytes released, at most {held} held (window {DISK_WINDOW_BYTES}), {paused} pauses")
    assert released >= (MIB << 20) // 2, said[-1].group(0)  # most of the buffer left the disk
    assert paused >= 1, said[-1].group(0)  # CRIU outran the upload and waited for it
    # The window, plus what CRIU writes before the agent's look stops it (CRIU on the node's tmpfs
    # outruns a Python thread on emulated CPUs): 40 MiB of 107 alone on 2026-12-05, 72 in a CI-like run
    # beside other work, before the look ahead. Without the pauses or the release: all of it.
    assert held <= int(row["bytes"]) * 3 // 4, (said[-1].group(0), row)

    checkpoint = done["status"]["checkpointName"]
    # The release runs the memory tier: node-1's part is copied to node-2's agent after the commit, its
    # released chunks read back from the bucket (they are no longer on node-1's disk).
    deadline = time.monotonic() + 120
    while (status := pods.get(cluster, job_ns, "checkpoint", checkpoint)["status"]).get("tiers") != [
        "S3",
        "Memory",
    ]:
        assert time.monotonic() < deadline, status
        time.sleep(2)
    assert {c["part"]: c["node"] for c in status["memoryCopies"]} == {"node-1": "node-2"}, status
    cluster.kubectl("delete", "pod", "-n", job_ns, "big", "--timeout=180s", timeout=200, check=False)
    pods.apply(cluster, job_ns, ring.restore_job("big-back", checkpoint))
    ring.wait_phase(cluster, job_ns, "restorejob", "big-back", "Succeeded", 900)
    assert pods.get(cluster, job_ns, "pod", "big")["spec"]["nodeName"] == "node-2"
    cluster.kubectl("exec", "-n", job_ns, "big", "--", "touch", "/tmp/stop")
    log = wait_log(cluster, job_ns, "big-done")
    assert "CHECK ok" in log and "big-done 0" in log, log[-2000:]
