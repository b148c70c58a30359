"""perftest with a duration and sibling processes, checkpointed in place, then moved (issue 29).

`ib_write_bw -D` ends its run with a chain of one-shot `alarm()`s. Checkpointed by a Stop CheckpointJob and
brought back by a RestoreJob onto the swapped nodes, its client used to write for ever: the pending alarm
was lost across the restore. Here the server (perf-0, node-1) and the client (perf-1, node-2) are two
hostNetwork pods of the `ibckpt` class, their devices from the device plugin, as a user runs perftest.
Beside them run two pods per node of four verbs processes each (tests/testbed/sibling_ids.py), in the
same job: sixteen processes whose virtual QP numbers must stay apart from their siblings' over the cycles.

1. A LeaveRunning CheckpointJob checkpoints all six pods where they run (queue pairs released and rebuilt
   in place; the same processes go on). Every many_qps process then makes new QPs.
2. A Stop CheckpointJob cuts them all, and a RestoreJob brings every pod back on the other node. The
   restore remaps the nodes' addresses in the images, so perftest's TCP control connection follows.
   Every many_qps process makes new QPs again, now beside the siblings it was checkpointed with.
After each cycle no two processes of one source node hold one virtual QPN, and each was told its
siblings' numbers before it rebuilt. perftest must end by itself, exit 0, and the client's report must
come about DURATION seconds of running after it started, the time it spent checkpointed by the Stop not
counted (a LeaveRunning freeze counts: `alarm()` runs on the wall clock).
This story replaced the two-guest `tests/node/test_perftest_migrate.py`, which moved perftest through the
node agents alone; it is the cluster form of the two-guest sibling check in tests/node/test_mixed_restart.py.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pytest
from helm.conftest import Release

from testbed import pods, ring, sibling_ids
from testbed.cluster import Cluster, node_ip
from testbed.images import APPS_IMAGE

# budget: what it may take on the slowest machine seen; first of the long stories (tests/testbed/budget.py)
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400), pytest.mark.budget(minutes=12, first=True)]

DURATION = 240  # seconds of writes: long enough that both checkpoints come while the client writes
LABELS = {"app": "perf"}
IDS_PODS = {"ids-0": "node-1", "ids-1": "node-1", "ids-2": "node-2", "ids-3": "node-2"}
SOURCES = {"node-1": ("perf-0", "ids-0", "ids-1"), "node-2": ("perf-1", "ids-2", "ids-3")}
LABELLED = ("perf-0", "perf-1", *IDS_PODS)
PERFTEST = f"ib_write_bw -d rxe0 -x 1 -F -s 1024 -D {DURATION} -p 18515"
SLACK = 90.0  # on emulated nodes: the pods' starts, the restore's last steps, the report


def perf_pod(name: str, node: str, command: str) -> dict[str, Any]:
    pod = pods.rdma_pod(name, node, ["sh", "-c", f'{command}; echo "perftest-exit $?"'], APPS_IMAGE,
                        labels=LABELS)  # fmt: skip
    pod["spec"]["runtimeClassName"] = "ibckpt"
    return pod


def job_spec(mode: str) -> dict[str, Any]:
    """All six pods; eighteen ranks on two emulated nodes overran the default 30 s quiesce (2026-12-02)."""
    spec = {**ring.job_template(mode), "selector": {"matchLabels": LABELS}}
    spec["timeouts"] = {**spec["timeouts"], "quiesceSeconds": 180, "drainSeconds": 180, "releaseSeconds": 180}
    return spec


def stamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def container_state(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    pod = pods.get(cluster, namespace, "pod", name)
    return dict(pod["status"]["containerStatuses"][0]["state"])


def siblings_apart(cluster: Cluster, job_ns: str, cycle: str) -> int:
    """Each source node's processes after `cycle`: apart, told, and new QPs at their real numbers. Returns
    how many times a shim had to ask again for a QPN (its log line), to show the check had work."""
    before, after = sibling_ids.statuses(cluster, job_ns, [*LABELLED], more=IDS_PODS)
    made = 0
    for node, names in SOURCES.items():
        group = {k: v for k, v in before.items() if k.split("/")[0] in names}
        assert len(group) == 1 + 2 * sibling_ids.PROCESSES, (cycle, node, sorted(group))  # perftest, many_qps
        made += sibling_ids.assert_apart(f"{cycle}, from {node}", group, {k: after[k] for k in group})
    processes = len(IDS_PODS) * sibling_ids.PROCESSES
    assert made == processes * sibling_ids.MORE_QPS, made
    logs = "".join(cluster.kubectl("logs", "-n", job_ns, name).stdout for name in IDS_PODS)
    return logs.count(sibling_ids.TAKEN)


def test_ib_write_bw_with_a_duration_restored_on_the_other_nodes_ends_on_time(
    installed: Release, job_ns: str
) -> None:
    cluster = installed.cluster
    for name, node in IDS_PODS.items():
        pods.apply(cluster, job_ns, sibling_ids.pod(name, node, LABELS))
    for name in IDS_PODS:
        pods.wait_pod(cluster, job_ns, name, {"Running"})
    pods.apply(cluster, job_ns, perf_pod("perf-0", "node-1", PERFTEST))
    pods.wait_pod(cluster, job_ns, "perf-0", {"Running"})
    time.sleep(3)  # its server listens once the container runs
    pods.apply(cluster, job_ns, perf_pod("perf-1", "node-2", f"{PERFTEST} {node_ip(1)}"))
    pods.wait_pod(cluster, job_ns, "perf-1", {"Running"})
    began = stamp(container_state(cluster, job_ns, "perf-1")["running"]["startedAt"])
    deadline = time.monotonic() + 120
    while not all(sibling_ids.ready(cluster, job_ns, name) for name in IDS_PODS):
        logs = {n: cluster.kubectl("logs", "-n", job_ns, n).stdout for n in IDS_PODS}
        assert time.monotonic() < deadline, logs
        time.sleep(2)
    assert "perftest-exit" not in cluster.kubectl("logs", "-n", job_ns, "perf-1").stdout
    uids = {name: pods.get(cluster, job_ns, "pod", name)["metadata"]["uid"] for name in LABELLED}

    # 1. In place: all are checkpointed, and the same processes go on.
    kept = {"apiVersion": "ibckpt.io/v1alpha1", "kind": "CheckpointJob", "metadata": {"name": "perf-keep"},
            "spec": job_spec("LeaveRunning")}  # fmt: skip
    pods.apply(cluster, job_ns, kept)
    done = ring.wait_phase(cluster, job_ns, "checkpointjob", "perf-keep", "Succeeded", 900)
    checkpoint = pods.get(cluster, job_ns, "checkpoint", done["status"]["checkpointName"])
    assert checkpoint["status"].get("readyToRestore") is True, checkpoint["status"]
    assert {p["name"] for p in checkpoint["spec"]["pods"]} == set(uids), checkpoint["spec"]["pods"]
    for name, uid in uids.items():
        pod = pods.get(cluster, job_ns, "pod", name)
        (container,) = pod["status"]["containerStatuses"]
        assert pod["metadata"]["uid"] == uid and container["restartCount"] == 0, pod["status"]
        assert "running" in container["state"], pod["status"]
    assert "perftest-exit" not in cluster.kubectl("logs", "-n", job_ns, "perf-1").stdout
    taken = siblings_apart(cluster, job_ns, "after the LeaveRunning checkpoint")

    # 2. Moved: a Stop checkpoint, and a RestoreJob onto the other nodes.
    job = {"apiVersion": "ibckpt.io/v1alpha1", "kind": "CheckpointJob", "metadata": {"name": "perf-stop"},
           "spec": job_spec("Stop")}  # fmt: skip
    pods.apply(cluster, job_ns, job)
    stopped = ring.wait_phase(cluster, job_ns, "checkpointjob", "perf-stop", "Succeeded", 900)
    frozen = next(t for t in stopped["status"]["phaseTimings"] if t["phase"] == "Quiescing")
    cut = stamp(frozen["startedAt"])
    assert cut < began + DURATION - 30, f"the checkpoint came {cut - began:.0f}s after perftest began"
    name = stopped["status"]["checkpointName"]

    pods.apply(cluster, job_ns, ring.restore_job("perf-back", name))
    restored = ring.wait_phase(cluster, job_ns, "restorejob", "perf-back", "Succeeded", 900)
    back = stamp(restored["status"]["completionTime"])
    other = {"node-1": "node-2", "node-2": "node-1"}
    moved = {"perf-0": "node-2", "perf-1": "node-1"} | {n: other[v] for n, v in IDS_PODS.items()}
    assert ring.placement(cluster, job_ns) == moved
    taken += siblings_apart(cluster, job_ns, "after the restore")

    # it was still writing when it was cut: the time it had left runs from its restore
    left = began + DURATION - cut
    for name in ("perf-0", "perf-1"):
        pods.wait_pod(cluster, job_ns, name, {"Succeeded"}, timeout=left + 2 * SLACK)
    ended = stamp(container_state(cluster, job_ns, "perf-1")["terminated"]["finishedAt"])
    client = cluster.kubectl("logs", "-n", job_ns, "perf-1").stdout
    server = cluster.kubectl("logs", "-n", job_ns, "perf-0").stdout
    assert "perftest-exit 0" in client and "BW average" in client, client[-3000:]
    assert "perftest-exit 0" in server, server[-3000:]
    # on time: it wrote for DURATION seconds, before the cut and after the restore
    ran = (cut - began) + (ended - back)
    print(f"perftest -D {DURATION}: ran {ran:.0f}s ({cut - began:.0f}s before the cut, "
          f"{ended - back:.0f}s after the restore); LeaveRunning {ring.seconds(done):.0f}s, "
          f"Stop and restore {back - cut:.0f}s; QPNs asked again {taken} times")  # fmt: skip
    assert DURATION - SLACK <= ran <= DURATION + SLACK, ran
