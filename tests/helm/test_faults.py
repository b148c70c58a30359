"""Faults in the middle of a checkpoint, on the real cluster with the chart installed: each ends with the
job running untouched and no partial Checkpoint listed, and says why in the CheckpointJob's status and
an Event. One ring (ring-0 on node-1, ring-1 on node-2, LeaveRunning jobs) lives through them all:

1. S3 goes away after the ranks were cut (a relay between the nodes and S3 is cut once the job is past
   admission), so the upload fails: the session aborts, every rank is rebuilt and resumes.
2. The operator's pod is deleted while the ranks are dumped (released: their QPs are gone), and the
   job's coordinator with it: the next operator finds the job mid-step, never replays it blindly, and
   aborts through a coordinator it opens for the recovery; the agents rejoin it, rebuild the ranks
   with their peers, and they resume.
3. A Stop job's ranks wait released while the images are uploaded (the relay stalls the upload), and
   node-1's agent is killed (SIGKILL, as a crash or an OOM kill). Its restarted successor no longer
   knows the session: the job aborts, the agent on node-2 rebuilds its ranks through the job's
   coordinator, and the new one on node-1 finds its predecessor's session on disk and does the same.
4. Then a CheckpointJob with nothing in the way succeeds, and the ring finishes with every message
   delivered exactly once: the faults lost and duplicated nothing.

The test only uses kubectl, the S3 relay, and a listing of the bucket.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from helm.conftest import Release

from testbed import pods, ring
from testbed.cluster import Cluster
from testbed.gate import Gate
from testbed.s3 import S3Server

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400)]

# The phases in which the ranks have been touched and the manifest is not yet committed.
CUT = ("Quiescing", "Draining", "Releasing", "Dumping", "Uploading")


# Kills the node agent's process from a `kubectl exec` in its pod (hostPID: it sees the node's processes).
KILL_AGENT = """
import os, signal
me = {os.getpid(), os.getppid()}
for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in me]:
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
    except OSError:
        continue
    if any(os.path.basename(a) == b"ibckpt-agent" for a in argv[:2]):
        os.kill(pid, signal.SIGKILL)
"""


def job(name: str, storage: str, mode: str = "LeaveRunning") -> dict[str, Any]:
    made = ring.checkpoint_job(name, mode)
    made["spec"]["storageRef"] = {"name": storage}
    return made


def wait_for_phase(cluster: Cluster, namespace: str, name: str, phases: tuple[str, ...]) -> str:
    """Poll the job closely until it is in one of `phases`; fail if it ends first."""
    deadline = time.monotonic() + 900
    phase = None
    while time.monotonic() < deadline:
        phase = (pods.get(cluster, namespace, "checkpointjob", name).get("status") or {}).get("phase")
        if phase in phases:
            return str(phase)
        assert phase not in ("Failed", "Succeeded"), f"{name} ended ({phase}) before {phases}"
        time.sleep(0.5)
    raise AssertionError(f"{name} never reached {phases}; last {phase}\n{ring.diagnose(cluster, namespace)}")


def manifests(s3: S3Server, bucket: str) -> list[str]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [o["Key"] for page in pages for o in page.get("Contents", []) if "/manifests/" in o["Key"]]


def warning_events(cluster: Cluster, namespace: str, name: str) -> list[str]:
    found = pods.get(cluster, namespace, "events")["items"]
    return [
        f"{e['reason']}: {e['message']}"
        for e in found
        if e["involvedObject"].get("name") == name and e["type"] == "Warning"
    ]


def agent_on(installed: Release, node: str) -> dict[str, Any]:
    [agent] = [p for p in installed.agent_pods() if p["spec"]["nodeName"] == node]
    return agent


def restarts(pod: dict[str, Any]) -> int:
    return int(pod["status"]["containerStatuses"][0]["restartCount"])


def kill_agent(installed: Release, node: str) -> tuple[str, int]:
    """SIGKILL the agent on `node`; its pod's name and restart count before."""
    agent = agent_on(installed, node)
    name = agent["metadata"]["name"]
    before = restarts(agent)
    # the exec may die with the container: whether the kill happened is read from the restart count
    installed.cluster.kubectl(
        "exec", "-n", installed.namespace, name, "--", "python3", "-c", KILL_AGENT, check=False
    )
    deadline = time.monotonic() + 120
    while restarts(pods.get(installed.cluster, installed.namespace, "pod", name)) == before:
        assert time.monotonic() < deadline, f"the agent {name} was not restarted after the kill"
        time.sleep(1)
    return name, before


def assert_failed_cleanly(
    cluster: Cluster, namespace: str, name: str, s3: S3Server, bucket: str
) -> dict[str, Any]:
    """The job failed after an abort, said why, listed nothing, stored no manifest; the ring runs on."""
    failed = ring.wait_phase(cluster, namespace, "checkpointjob", name, "Failed", 900)["status"]
    assert failed.get("abortedFrom") in CUT, failed
    assert failed.get("reason") and failed.get("message"), failed
    assert warning_events(cluster, namespace, name), pods.get(cluster, namespace, "events")["items"][-5:]
    assert not pods.get(cluster, namespace, "checkpoints")["items"], "a failed job's Checkpoint is listed"
    assert not manifests(s3, bucket), "a failed job committed a manifest"
    time.sleep(20)  # the ranks must keep running after the abort, not merely be running at its end
    ring.running(cluster, namespace)
    return dict(failed)


def test_faults_mid_checkpoint_leave_the_ring_running_and_list_nothing(
    installed: Release, job_ns: str, s3_server: S3Server, s3_gate: Gate
) -> None:
    cluster = installed.cluster
    bucket = pods.get(cluster, job_ns, "checkpointstorage", "store")["spec"]["bucket"]
    gated = ring.storage(f"http://127.0.0.1:{s3_gate.port}", bucket)
    gated["metadata"]["name"] = "gated"
    pods.apply(cluster, job_ns, gated)
    ring.start(cluster, job_ns)

    # 1. S3 unreachable once the ranks are cut: the upload fails, the session aborts
    pods.apply(cluster, job_ns, job("s3-cut", "gated"))
    cut_in = wait_for_phase(cluster, job_ns, "s3-cut", CUT[:3])
    s3_gate.cut()
    try:
        failed = assert_failed_cleanly(cluster, job_ns, "s3-cut", s3_server, bucket)
        print(f"S3 cut in {cut_in}: {failed['reason']}: {failed['message'][:300]}; {s3_gate.refused} refused")
        assert failed["abortedFrom"] in ("Dumping", "Uploading"), failed  # the first S3 write after the cut
        # every agent confirmed its ranks' resume
        assert "resume failed" not in failed["message"] and "not confirmed" not in failed["message"], failed
        if failed["abortedFrom"] == "Uploading":  # the staged parts cannot be dropped either: said, not fatal
            # the discard runs beside the resume and gives up only after the store's own retries, so
            # S3 stays cut until it has (mended earlier, a late retry would drop the parts silently)
            deadline = time.monotonic() + 180
            while not any("PartsNotDiscarded" in w for w in warning_events(cluster, job_ns, "s3-cut")):
                assert time.monotonic() < deadline, warning_events(cluster, job_ns, "s3-cut")
                time.sleep(3)
    finally:
        s3_gate.mend()
    assert s3_gate.refused > 0, "no connection to S3 was attempted after the cut"

    # 2. The operator's pod deleted mid-dump: the next operator aborts the job and the ranks resume
    pods.apply(cluster, job_ns, job("operator-gone", "store"))
    wait_for_phase(cluster, job_ns, "operator-gone", ("Dumping",))
    operator = "app.kubernetes.io/component=operator"
    cluster.kubectl("delete", "pod", "-n", installed.namespace, "-l", operator, "--wait=false")
    failed = assert_failed_cleanly(cluster, job_ns, "operator-gone", s3_server, bucket)
    print(f"operator deleted in Dumping: {failed['reason']}: {failed['message'][:300]}")
    assert failed["reason"] == "OperatorRestarted", failed
    # the ranks were released when the coordinator went with the operator: every agent rejoined the
    # next one's coordinator, rebuilt them with their peers, and confirmed their resume
    assert "resume failed" not in failed["message"] and "not confirmed" not in failed["message"], failed
    installed.rollout(f"deployment/{installed.name}-operator")

    # 3. Stop: node-1's agent is killed while the ranks wait released for the upload to end
    pods.apply(cluster, job_ns, job("agent-gone", "gated", "Stop"))
    wait_for_phase(cluster, job_ns, "agent-gone", CUT)
    s3_gate.stall()  # the uploads hang: the ranks stay released (dumped, held for the commit)
    try:
        wait_for_phase(cluster, job_ns, "agent-gone", ("Uploading",))
        agent, _ = kill_agent(installed, "node-1")
        failed = assert_failed_cleanly(cluster, job_ns, "agent-gone", s3_server, bucket)
    finally:
        s3_gate.mend()
    print(f"agent {agent} killed in Uploading: {failed['reason']}: {failed['message'][:300]}")
    # the new agent answers but knows nothing of the session (or, restarting, did not answer)
    assert failed["reason"] in ("AgentLostSession", "AgentUnreachable"), failed
    assert "resume failed" not in failed["message"] and "not confirmed" not in failed["message"], failed
    rows = {row["name"]: row["phase"] for row in failed.get("pods", [])}
    assert rows and set(rows.values()) == {"Resumed"}, failed  # both ranks rebuilt and running again
    installed.cluster.kubectl(
        "wait",
        "-n",
        installed.namespace,
        "--for=condition=Ready",
        f"pod/{agent}",
        "--timeout=300s",
        timeout=320,
    )

    # 4. Nothing in the way: the job checkpoints, and the ring finishes exactly once
    pods.apply(cluster, job_ns, job("after", "store"))
    done = ring.wait_phase(cluster, job_ns, "checkpointjob", "after", "Succeeded", 900)
    assert len(manifests(s3_server, bucket)) == 1, manifests(s3_server, bucket)
    assert [c["metadata"]["name"] for c in pods.get(cluster, job_ns, "checkpoints")["items"]] == [
        done["status"]["checkpointName"]
    ]
    ring.running(cluster, job_ns)
    ring.finish(cluster, job_ns)
