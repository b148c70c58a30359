"""perftest with a duration, moved to the other nodes through the product, ends on time (issue 29).

`ib_write_bw -D` ends its run with a chain of one-shot `alarm()`s. Checkpointed by a Stop CheckpointJob and
brought back by a RestoreJob onto the swapped nodes, its client used to write for ever: the pending alarm
was lost across the restore. Here the server (perf-0, node-1) and the client (perf-1, node-2) are two
hostNetwork pods of the `ibckpt` class, their devices from the device plugin, as a user runs perftest.
The restore remaps the nodes' addresses in both images, so perftest's TCP control connection follows.
Both must then end by themselves, exit 0, and the client's report must come about DURATION seconds of
running after it started, the time it spent checkpointed not counted.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pytest
from helm.conftest import Release

from testbed import pods, ring
from testbed.cluster import Cluster, node_ip
from testbed.images import APPS_IMAGE

# budget: what it may take on the slowest machine seen (tests/testbed/budget.py)
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400), pytest.mark.budget(minutes=14)]

DURATION = 240  # seconds of writes: long enough that the checkpoint comes while the client writes
LABELS = {"app": "perf"}
PERFTEST = f"ib_write_bw -d rxe0 -x 1 -F -s 1024 -D {DURATION} -p 18515"
SLACK = 90.0  # on emulated nodes: the pods' starts, the restore's last steps, the report


def perf_pod(name: str, node: str, command: str) -> dict[str, Any]:
    pod = pods.rdma_pod(name, node, ["sh", "-c", f'{command}; echo "perftest-exit $?"'], APPS_IMAGE,
                        labels=LABELS)  # fmt: skip
    pod["spec"]["runtimeClassName"] = "ibckpt"
    return pod


def stamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def container_state(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    pod = pods.get(cluster, namespace, "pod", name)
    return dict(pod["status"]["containerStatuses"][0]["state"])


def test_ib_write_bw_with_a_duration_restored_on_the_other_nodes_ends_on_time(
    installed: Release, job_ns: str
) -> None:
    cluster = installed.cluster
    pods.apply(cluster, job_ns, perf_pod("perf-0", "node-1", PERFTEST))
    pods.wait_pod(cluster, job_ns, "perf-0", {"Running"})
    time.sleep(3)  # its server listens once the container runs
    pods.apply(cluster, job_ns, perf_pod("perf-1", "node-2", f"{PERFTEST} {node_ip(1)}"))
    pods.wait_pod(cluster, job_ns, "perf-1", {"Running"})
    began = stamp(container_state(cluster, job_ns, "perf-1")["running"]["startedAt"])
    time.sleep(20)  # connected, and writing
    assert "perftest-exit" not in cluster.kubectl("logs", "-n", job_ns, "perf-1").stdout

    job = {"apiVersion": "ibckpt.io/v1alpha1", "kind": "CheckpointJob", "metadata": {"name": "perf-stop"},
           "spec": {**ring.job_template("Stop"), "selector": {"matchLabels": LABELS}}}  # fmt: skip
    pods.apply(cluster, job_ns, job)
    stopped = ring.wait_phase(cluster, job_ns, "checkpointjob", "perf-stop", "Succeeded", 900)
    frozen = next(t for t in stopped["status"]["phaseTimings"] if t["phase"] == "Quiescing")
    cut = stamp(frozen["startedAt"])
    assert cut < began + DURATION - 30, f"the checkpoint came {cut - began:.0f}s after perftest began"
    name = stopped["status"]["checkpointName"]

    pods.apply(cluster, job_ns, ring.restore_job("perf-back", name))
    restored = ring.wait_phase(cluster, job_ns, "restorejob", "perf-back", "Succeeded", 900)
    back = stamp(restored["status"]["completionTime"])
    assert ring.placement(cluster, job_ns) == {"perf-0": "node-2", "perf-1": "node-1"}
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
          f"{ended - back:.0f}s after the restore); checkpointed {back - cut:.0f}s")  # fmt: skip
    assert DURATION - SLACK <= ran <= DURATION + SLACK, ran
