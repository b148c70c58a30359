"""The product as a user meets it, on the real cluster with the chart installed: a two-pod RDMA job (one pod
per node) is checkpointed by a CheckpointJob in LeaveRunning mode (it keeps running), then by one in Stop
mode (kubectl apply); its pods are deleted, and a RestoreJob brings it back with the pods swapped between
the nodes; the job finishes with every message delivered exactly once. Everything goes through the
apiserver: the operator hosts the coordinator and drives the agents, the runtime wrapper restores the
containers.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from helm.conftest import NAMESPACE, STORAGE_SECRET, Release
from helm.test_pod_migration import assert_exactly_once, results

from testbed import pods
from testbed.cluster import Cluster
from testbed.images import APPS_IMAGE
from testbed.release import storage_secret
from testbed.s3 import S3Server

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400)]

JOB_NS = "team-ring"
SERVER = "rc_seq -f /tmp/stop -p 18515; echo ring-done"


def ring_member(name: str, node: str, command: str) -> dict[str, Any]:
    pod = pods.rdma_pod(
        name, node, ["sh", "-c", command], APPS_IMAGE, host_network=False, labels={"app": "ring"}
    )
    pod["spec"]["runtimeClassName"] = "ibckpt"
    return pod


def wait_phase(cluster: Cluster, kind: str, name: str, want: str, timeout: float = 900) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    obj: dict[str, Any] = {}
    while time.monotonic() < deadline:
        obj = json.loads(cluster.kubectl("get", kind, name, "-n", JOB_NS, "-o", "json").stdout)
        phase = obj.get("status", {}).get("phase")
        if phase == want:
            return obj
        if phase in ("Failed", "Succeeded"):
            break
        time.sleep(3)
    events = cluster.kubectl("get", "events", "-n", JOB_NS, "--sort-by=.lastTimestamp", check=False).stdout
    logs = cluster.kubectl(
        "logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/component in (operator,agent)", "--tail=40",
        check=False,
    ).stdout  # fmt: skip
    raise AssertionError(
        f"{kind} {name} is {obj.get('status', {}).get('phase')!r}, wanted {want}:\n"
        f"{json.dumps(obj.get('status', {}), indent=1)[-4000:]}\n{events[-3000:]}\n{logs[-6000:]}"
    )


def took(obj: dict[str, Any]) -> str:
    """start to completion of a finished job, from its status."""
    status = obj["status"]
    start, end = (
        datetime.fromisoformat(status[k].replace("Z", "+00:00")) for k in ("startTime", "completionTime")
    )
    return f"{(end - start).total_seconds():.1f}s"


def checkpoint_job(name: str, mode: str) -> dict[str, Any]:
    return {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointJob",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"app": "ring"}},
            "mode": mode,
            "storageRef": {"name": "store"},
            # the testbed's emulated nodes are ~20x slower than real ones: admission took 32 to 60+ s
            "timeouts": {"admitSeconds": 300},
        },
    }


@pytest.fixture
def job_ns(installed: Release, s3_server: S3Server) -> Iterator[str]:
    """A team's namespace with its storage: a CheckpointStorage and its credentials Secret."""
    cluster = installed.cluster
    pods.namespace(cluster, JOB_NS)
    bucket = f"ring-job-{secrets.token_hex(3)}"
    s3_server.create_bucket(bucket)
    storage_secret(cluster, JOB_NS, s3_server.access_key, s3_server.secret_key)
    port = s3_server.endpoint.rsplit(":", 1)[1]
    storage = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointStorage",
        "metadata": {"name": "store"},
        "spec": {
            "endpoint": f"http://10.0.2.100:{port}",
            "bucket": bucket,
            "credentialsSecretRef": {"name": STORAGE_SECRET},
        },
    }
    pods.apply(cluster, JOB_NS, storage)
    try:
        yield JOB_NS
    finally:
        pods.delete_namespace(cluster, JOB_NS)


def test_checkpoint_job_then_restore_job_swaps_the_nodes_exactly_once(
    installed: Release, job_ns: str
) -> None:
    cluster = installed.cluster
    pods.apply(cluster, job_ns, ring_member("ring-0", "node-1", SERVER))
    server_ip = pods.wait_pod(cluster, job_ns, "ring-0", {"Running"})["status"]["podIP"]
    client = f"sleep 3; rc_seq -c {server_ip} -f /tmp/stop -p 18515; echo ring-done"
    pods.apply(cluster, job_ns, ring_member("ring-1", "node-2", client))
    pods.wait_pod(cluster, job_ns, "ring-1", {"Running"})
    deadline = time.monotonic() + 180
    while "READY" not in cluster.kubectl("logs", "-n", job_ns, "ring-1").stdout:
        assert time.monotonic() < deadline, "the ring did not connect"
        time.sleep(3)
    time.sleep(5)

    # LeaveRunning: a Checkpoint in S3, and the job goes on where it was
    pods.apply(cluster, job_ns, checkpoint_job("keep", "LeaveRunning"))
    kept = wait_phase(cluster, "checkpointjob", "keep", "Succeeded")
    print(f"LeaveRunning job: {took(kept)}, {json.dumps(kept['status'].get('pods'), indent=None)[:1500]}")
    assert kept["status"]["checkpointName"]
    for name in ("ring-0", "ring-1"):
        pod = pods.get(cluster, job_ns, "pod", name)
        assert pod["status"]["phase"] == "Running", pod["status"]
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
        assert not results(cluster.kubectl("logs", "-n", job_ns, name).stdout), "the ring ended"

    # Stop: the processes end only after the whole checkpoint is committed
    pods.apply(cluster, job_ns, checkpoint_job("move", "Stop"))
    done = wait_phase(cluster, "checkpointjob", "move", "Succeeded")
    checkpoint_name = done["status"]["checkpointName"]
    checkpoint = json.loads(
        cluster.kubectl("get", "checkpoint", checkpoint_name, "-n", job_ns, "-o", "json").stdout
    )
    recorded = {p["name"]: p for p in checkpoint["spec"]["pods"]}
    assert {n: p["node"] for n, p in recorded.items()} == {"ring-0": "node-1", "ring-1": "node-2"}
    assert checkpoint["spec"]["size"]["bytes"] > 0
    print(f"Stop job: {took(done)}, {json.dumps(done['status'].get('pods'))[:1500]}")
    for name in ("ring-0", "ring-1"):
        assert not results(cluster.kubectl("logs", "-n", job_ns, name).stdout), (
            "the ring ended before the cut"
        )

    # Stop: the sources ended after the commit; delete them, then bring the job back swapped
    cluster.kubectl("delete", "pod", "-n", job_ns, "ring-0", "ring-1", "--timeout=120s", timeout=150)
    restore_job = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "RestoreJob",
        "metadata": {"name": "back"},
        "spec": {
            "checkpointName": checkpoint_name,
            "avoidSourceNodes": True,
            "timeouts": {"admitSeconds": 300},
        },
    }
    pods.apply(cluster, job_ns, restore_job)
    restored = wait_phase(cluster, "restorejob", "back", "Succeeded")
    print(f"restore job: {took(restored)}, {json.dumps(restored['status'].get('pods'), indent=None)[:1500]}")
    placed = {
        p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods.get(cluster, job_ns, "pods")["items"]
    }
    assert placed == {"ring-0": "node-2", "ring-1": "node-1"}, placed
    time.sleep(5)  # messages flow on the rebuilt queue pairs
    for name in ("ring-0", "ring-1"):
        cluster.kubectl("exec", "-n", job_ns, name, "--", "touch", "/tmp/stop")
    for name in ("ring-0", "ring-1"):
        pods.wait_pod(cluster, job_ns, name, {"Succeeded"}, timeout=300)
    log = "".join(cluster.kubectl("logs", "-n", job_ns, n).stdout for n in ("ring-0", "ring-1"))
    assert log.count("ring-done") == 2, log[-3000:]
    assert_exactly_once(log)
