"""Faults in the middle of a checkpoint, on the real cluster with the chart installed: each ends with the
job running untouched (or, when its own process died, restorable) and no partial Checkpoint listed, and
says why in the CheckpointJob's status and an Event. One ring (ring-0 on node-1, ring-1 on node-2,
LeaveRunning jobs) lives through them all:

1. S3 goes away after the ranks were cut (a relay between the nodes and S3 is cut once the job is past
   admission), so the upload fails: the session aborts, every rank is rebuilt and resumes.
2. A Stop job's ranks wait released while the images are uploaded (the relay stalls the upload), and
   node-1's agent is killed (SIGKILL, as a crash or an OOM kill). Its restarted successor no longer
   knows the session: the job aborts, the agent on node-2 rebuilds its ranks through the job's
   coordinator, and the new one on node-1 finds its predecessor's session on disk and does the same.
3. node-2's agent hangs (SIGSTOP) while ring-1 is quiesced (a failpoint holds the agent between the
   rank's quiesce and drain, so the state lasts long enough to be hit): no renewal reaches ring-1's
   lease and no successor starts. The job fails; ring-1's shim resumes on its own when the lease runs
   out and says so in its log; the agent, continued, serves the next job.
4. Then a CheckpointJob with nothing in the way succeeds.
5. ring-1's `rc_seq` is killed the moment it is cut (quiesced, drained or released) in the next job: the
   job fails and names ring-1, and step 4's Checkpoint stays the only one listed. The job is restorable
   from it: once the pods are deleted, a RestoreJob brings the ring back on the other nodes, and it
   finishes with every message delivered exactly once: the faults lost and duplicated nothing.

(An operator deleted mid-dump was step 2 until 2026-11-29: a new operator's start takes minutes on these
nodes, and the restart is tested in every phase against the real apiserver in tests/operator.)

The faults of steps 3 and 5 come from watchers started beforehand in node-2's agent pod (hostPID, the
node's ibckpt directory): each polls the rank's `status` on its control socket and acts at once, where a
`kubectl exec` sent when the job is seen cutting lands seconds late (the whole cut lasts about 3 s here).
The test only uses kubectl, the S3 relay, a listing of the bucket, and the agent's failpoint file.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from typing import Any

import pytest
from helm.conftest import Release

from testbed import pods, ring
from testbed.cluster import Cluster, kubectl_bin
from testbed.gate import Gate
from testbed.s3 import S3Server

# budget: at most what it took on the slowest machine seen (tests/testbed/budget.py)
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400), pytest.mark.budget(minutes=20)]

# The phases in which the ranks have been touched and the manifest is not yet committed.
CUT = ("Quiescing", "Draining", "Releasing", "Dumping", "Uploading")


# Python run in a node's agent pod (hostPID: it sees the node's processes): the pids whose program is `name`.
FIND_PROCESSES = """
import os

def processes(name):
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if any(os.path.basename(a) == name for a in argv[:2]):
            yield pid
"""

# Kills the node agent's process from a `kubectl exec` in its pod.
KILL_AGENT = (
    FIND_PROCESSES
    + """
import signal
for pid in processes(b"ibckpt-agent"):
    os.kill(pid, signal.SIGKILL)
"""
)


# Python: a rank's state, asked on its control socket (`status`); None when it does not answer.
RANK_STATE = """
import glob, json, signal, socket, sys, time

def state(path):
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(b"status\\n")
            reply = b""
            while not reply.endswith(b"\\n"):
                chunk = s.recv(65536)
                if not chunk:
                    return None
                reply += chunk
    except OSError:
        return None
    status, _, body = reply.decode().partition(" ")
    return json.loads(body).get("state") if status == "ok" else None
"""

# Started in a node's agent pod before a job: polls the `status` of every rank on the node (their control
# sockets) and SIGKILLs the processes named argv[1] (`rc_seq`, say) the moment one is cut: `quiesced`,
# `drained` (the fast cut drains right after quiesce, and a status waits for the drain to end) or
# `released` (it stops polling before CRIU dumps: a connection open then fails the dump). It says `ready`
# first, and what it saw before it kills.
KILL_WHEN_CUT = (
    FIND_PROCESSES
    + RANK_STATE
    + """
target = sys.argv[1].encode()
print("ready", flush=True)
deadline = time.monotonic() + 900
while time.monotonic() < deadline:
    for sock in glob.glob("/var/lib/ibckpt/containers/*/ctl/*.sock"):
        seen = state(sock)
        if seen in ("quiesced", "drained", "released"):
            victims = list(processes(target))
            print(seen, sock, "killing", target.decode(), victims, flush=True)
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            print("killed", flush=True)
            sys.exit(0 if victims else 1)
    time.sleep(0.05)
print("no rank was cut in 900 s", flush=True)
sys.exit(1)
"""
)


# Started in a node's agent pod before a job: arms the agent's `after-quiesce` failpoint (the chart's
# agent.failpoints is on in the testbed), so the agent holds its rank between quiesce and drain for
# argv[1] seconds, and SIGSTOPs the agent the moment the rank is `quiesced`: a hung agent, which renews
# no lease and has no successor. It waits for the rank to run again (its lease ran out), then SIGCONTs
# the agent. It says `ready` first, and what it saw at each step.
HANG_AGENT_WHEN_QUIESCED = (
    FIND_PROCESSES
    + RANK_STATE
    + """
armed = "/var/lib/ibckpt/failpoints/after-quiesce"
with open(armed, "w") as f:
    f.write(sys.argv[1])
print("ready", flush=True)
try:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        quiesced = [p for p in glob.glob("/var/lib/ibckpt/containers/*/ctl/*.sock") if state(p) == "quiesced"]
        if quiesced:
            break
        time.sleep(0.05)
    else:
        print("no rank was cut in 900 s", flush=True)
        sys.exit(1)
    agents = list(processes(b"ibckpt-agent"))
    for pid in agents:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    print("quiesced", quiesced[0], "stopped the agent", agents, flush=True)
    try:
        while time.monotonic() - stopped < 180 and state(quiesced[0]) != "running":
            time.sleep(0.5)
        print(f"running after {time.monotonic() - stopped:.1f} s: {state(quiesced[0])}", flush=True)
    finally:
        for pid in agents:
            os.kill(pid, signal.SIGCONT)
        print("continued the agent", flush=True)
finally:
    if os.path.exists(armed):
        os.unlink(armed)
"""
)


def in_agent_pod(installed: Release, node: str, script: str, *args: str) -> subprocess.Popen[str]:
    """A watcher script started in `node`'s agent pod, once it says it is ready."""
    agent = agent_on(installed, node)["metadata"]["name"]
    cluster = installed.cluster
    watcher = subprocess.Popen(
        [str(kubectl_bin()), f"--kubeconfig={cluster.kubeconfig}", "exec", "-n", installed.namespace, agent,
         "--", "python3", "-c", script, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert watcher.stdout is not None
    ready = watcher.stdout.readline()
    assert ready.strip() == "ready", ready + watcher.communicate(timeout=30)[0]
    return watcher


def fired(killer: subprocess.Popen[str]) -> str:
    """What the killer said once it ended."""
    said, _ = killer.communicate(timeout=900)
    assert "no rank was cut" not in said, said
    return said


def job(name: str, storage: str, mode: str = "LeaveRunning") -> dict[str, Any]:
    made = ring.checkpoint_job(name, mode)
    made["spec"]["storageRef"] = {"name": storage}
    return made


def wait_for_phase(cluster: Cluster, namespace: str, name: str, phases: tuple[str, ...]) -> str:
    """Watch the job until it is in one of `phases` (a cut's phases last a second or two); fail if it
    ends first."""
    ended = ("Failed", "Succeeded")
    seen = pods.watch_status(
        cluster, namespace, "checkpointjob", name, "phase", lambda p: p in (*phases, *ended)
    )
    assert seen[-1] in phases, f"{name} ended ({seen}) before {phases}\n{ring.diagnose(cluster, namespace)}"
    return seen[-1]


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


def wait_ready(installed: Release, pod: str) -> None:
    installed.cluster.kubectl(
        "wait",
        "-n",
        installed.namespace,
        "--for=condition=Ready",
        f"pod/{pod}",
        "--timeout=300s",
        timeout=320,
    )


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
    # not at Quiescing: the operator's storage check as it starts the agents reads the bucket then
    cut_in = wait_for_phase(cluster, job_ns, "s3-cut", CUT[1:3])
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

    # 2. Stop: node-1's agent is killed while the ranks wait released for the upload to end
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
    wait_ready(installed, agent)

    # 3. node-2's agent hangs (SIGSTOP) while ring-1 is quiesced: it renews no lease and has no successor, so
    #    the job fails, and ring-1's shim resumes it on its own when its lease runs out
    hang = in_agent_pod(installed, "node-2", HANG_AGENT_WHEN_QUIESCED, "20")
    hung = job("agent-hung", "store")
    hung["spec"]["timeouts"] = {"quiesceSeconds": 10, "drainSeconds": 10}  # the abort comes before the lease
    pods.apply(cluster, job_ns, hung)
    said = fired(hang)
    assert "stopped the agent [" in said and "[]" not in said and "running after" in said, said
    assert said.split("running after", 1)[1].split("\n", 1)[0].endswith(": running"), said
    failed = assert_failed_cleanly(cluster, job_ns, "agent-hung", s3_server, bucket)
    print("node-2's agent hung when quiesced:", repr(said.strip()), failed["reason"], failed["message"])
    shim = cluster.kubectl("logs", "-n", job_ns, "ring-1").stdout
    assert "lease expired" in shim and "while quiesced: resuming on my own" in shim, shim[-3000:]
    wait_ready(installed, agent_on(installed, "node-2")["metadata"]["name"])

    # 4. Nothing in the way: the job checkpoints, on pre-dumps (spec.preDump: each pod's memory is copied
    #    while it runs, then only what changed since); step 5 restores it on the swapped nodes
    after = job("after", "store")
    after["spec"]["preDump"] = True
    pods.apply(cluster, job_ns, after)
    assert wait_for_phase(cluster, job_ns, "after", ("PreDumping",)) == "PreDumping"
    done = ring.wait_phase(cluster, job_ns, "checkpointjob", "after", "Succeeded", 900)
    good = done["status"]["checkpointName"]
    assert done["status"]["timings"]["preDumpSeconds"] > 0, done["status"]["timings"]
    assert len(manifests(s3_server, bucket)) == 1, manifests(s3_server, bucket)
    (manifest,) = manifests(s3_server, bucket)
    listed = json.loads(s3_server.client().get_object(Bucket=bucket, Key=manifest)["Body"].read())
    # each pod's container dump names its pre-dump as parent, kept inside its images
    parents = {f["path"].split("/parent/")[0] for f in listed["files"] if "/parent/pages-" in f["path"]}
    assert len(parents) == 2, sorted(f["path"] for f in listed["files"])
    assert [c["metadata"]["name"] for c in pods.get(cluster, job_ns, "checkpoints")["items"]] == [good]
    ring.running(cluster, job_ns)

    # 5. ring-1's process dies while it is cut: the job fails and names it; the ring is restored from
    #    step 4's Checkpoint and finishes exactly once
    killer = in_agent_pod(installed, "node-2", KILL_WHEN_CUT, "rc_seq")
    pods.apply(cluster, job_ns, job("rank-gone", "store"))
    said = fired(killer)
    assert "killing rc_seq [" in said and "killed" in said and "[]" not in said, said
    gone = ring.wait_phase(cluster, job_ns, "checkpointjob", "rank-gone", "Failed", 900)["status"]
    print(f"rc_seq of ring-1 killed while cut ({said.strip()!r}): {gone['reason']}: {gone['message']}")
    assert gone.get("abortedFrom") in CUT and gone.get("reason"), gone
    # its pod is named: by its rank's key (job/pod/container/process), its container (pod.container), or
    # as the pod the cut waited for when the phase's bound came before the agent saw the death
    named = ("/ring-1/", "ring-1.main")
    waited = re.search(r"\(waiting for [^)]*\bring-1\)", gone["message"])  # ring-0 may wait beside it
    assert waited or any(form in gone["message"] for form in named), gone
    assert warning_events(cluster, job_ns, "rank-gone"), pods.get(cluster, job_ns, "events")["items"][-5:]
    listed = [c["metadata"]["name"] for c in pods.get(cluster, job_ns, "checkpoints")["items"]]
    assert listed == [good] and len(manifests(s3_server, bucket)) == 1, listed
    cluster.kubectl("delete", "pod", "-n", job_ns, *ring.MEMBERS, "--timeout=120s", timeout=150)
    pods.apply(cluster, job_ns, ring.restore_job("from-after", good))
    ring.wait_phase(cluster, job_ns, "restorejob", "from-after", "Succeeded", 900)
    assert ring.placement(cluster, job_ns) == {"ring-0": "node-2", "ring-1": "node-1"}
    ring.finish(cluster, job_ns)
