"""A pod of the `ibckpt` RuntimeClass whose restore annotation names another namespace's checkpoint is
refused by the runtime wrapper on its node, and its container never starts: a tenant cannot restore
another tenant's images into its own pod. A checkpoint the tenant wrote itself into its own prefix (with
its storage's S3 keys, but not the chart's image keys) is refused by the agents, through a RestoreJob, before
they stage anything, and no pod is restored. On the real cluster with the chart installed.

(The agent-level move of one pod that the file this replaces also ran, a stand-in driving the agent
the way the operator does, was dropped to keep CI within its time: every operator story moves pods
through the same agent API; the wrapper's rootfs diff and /dev/shm carry-over are checked by
tests/hook/test_restore_check.py, a plain container of the class left alone by test_runc_wrapper.py.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helm.conftest import Release
from pydantic import SecretStr

from ibckpt.store import Credentials, ImageStore, RankInfo, StoreConfig
from testbed import pods, ring
from testbed.images import APPS_IMAGE
from testbed.s3 import S3Server

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900), pytest.mark.budget(minutes=4)]

APP_NS = "ring-app"


@pytest.fixture
def app_ns(installed: Release) -> Iterator[str]:
    cluster = installed.cluster
    pods.namespace(cluster, APP_NS)
    try:
        yield APP_NS
    finally:
        pods.delete_namespace(cluster, APP_NS)


def test_a_restore_annotation_for_another_namespace_is_refused(installed: Release, app_ns: str) -> None:
    cluster = installed.cluster
    forged = pods.rdma_pod("forged", "node-1", ["sh", "-c", "echo never"], APPS_IMAGE, host_network=False)
    forged["spec"]["runtimeClassName"] = "ibckpt"
    forged["metadata"]["annotations"] = {"ibckpt.io/restore-from": "kube-system/someone-elses"}
    pods.apply(cluster, app_ns, forged)
    deadline = time.monotonic() + 300
    message = ""
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        statuses = pods.get(cluster, app_ns, "pod", "forged")["status"].get("containerStatuses") or []
        status = statuses[0] if statuses else {}
        state = status.get("state", {})
        assert "running" not in state, status
        # the refused create: waiting to be retried, or (restartPolicy Never) terminated without a start
        message = (state.get("waiting") or state.get("terminated") or {}).get("message", "")
        if "refusing to restore" in message:
            break
        time.sleep(2)
    assert "belongs to namespace 'kube-system', the pod is in 'ring-app'" in message, message
    assert status["started"] is False, status  # the process never ran


def test_a_checkpoint_the_tenant_wrote_itself_is_refused_by_the_agents(
    installed: Release, job_ns: str, s3_server: S3Server, tmp_path: Any
) -> None:
    """The tenant holds its storage's S3 keys: it writes a whole checkpoint of its own making (a part and
    a committed manifest, unsigned) under its namespace's job in its prefix, and a Checkpoint object that
    names it. The RestoreJob fails with the agent's reason, and the pod it names never runs."""
    cluster = installed.cluster
    storage = pods.get(cluster, job_ns, "checkpointstorage", "store")["spec"]
    tenant = ImageStore.open(
        StoreConfig(
            endpoint_url=s3_server.endpoint,
            region=s3_server.region,
            addressing_style="path",
            bucket=storage["bucket"],
            prefix=storage.get("prefix", "ibckpt"),
            credentials=Credentials(
                access_key_id=SecretStr(s3_server.access_key),
                secret_access_key=SecretStr(s3_server.secret_key),
                source="the tenant's storage Secret",
            ),
        )
    )
    job = f"{job_ns}/forged"
    tree = tmp_path / "forged.main"
    tree.mkdir()
    (tree / "inventory.img").write_bytes(b"whatever the tenant likes")
    with tenant.writer(job, "c1") as writer:
        writer.add_tree(tree, under="node-1/forged.main")
        writer.stage("node-1", [RankInfo(rank=0, pod="forged-0", node="node-1", root="node-1/forged.main")])
    manifest = tenant.commit_parts(job, "c1", ["node-1"])
    assert manifest.signature is None
    main = {"name": "main", "image": APPS_IMAGE, "command": ["sh", "-c", "echo never"]}
    spec = {"restartPolicy": "Never", "runtimeClassName": "ibckpt", "containers": [main]}
    recorded = {
        "name": "forged-0",
        "uid": "old-forged-0",
        "node": "node-1",
        "ranks": ["forged/forged-0/main/1"],
        "template": {"labels": {"app": "forged"}, "spec": spec},
    }
    location = {key: storage[key] for key in ("endpoint", "bucket", "credentialsSecretRef")}
    checkpoint = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "forged-c1", "annotations": {"ibckpt.io/retain-images": "true"}},
        "spec": {
            "manifestKey": tenant.context.layout.manifest_key(manifest.ref),
            "storage": location,
            "jobName": job,
            "checkpointId": "c1",
            "mode": "Stop",
            "pods": [recorded],
        },
    }
    restore = ring.restore_job("forged-back", "forged-c1")
    restore["spec"]["avoidSourceNodes"] = False
    pods.apply(cluster, job_ns, checkpoint, restore)
    failed = ring.wait_phase(cluster, job_ns, "restorejob", "forged-back", "Failed", 600)
    status = failed["status"]
    assert status["reason"] == "AgentFailed", status
    assert f"manifest {job}/c1" in status["message"] and "is not signed: refused" in status["message"], status
    running = cluster.kubectl("get", "pod", "forged-0", "-n", job_ns, "-o", "json", check=False)
    if running.returncode == 0:  # made, then removed by the failed restore: never started
        statuses = json.loads(running.stdout)["status"].get("containerStatuses") or [{}]
        container = statuses[0]
        assert "running" not in container.get("state", {}) and not container.get("started"), container
