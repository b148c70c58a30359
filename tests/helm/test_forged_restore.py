"""A pod of the `ibckpt` RuntimeClass whose restore annotation names another namespace's checkpoint is
refused by the runtime wrapper on its node, and its container never starts: a tenant cannot restore
another tenant's images into its own pod. On the real cluster with the chart installed; kubectl only.

(The agent-level move of one pod that the file this replaces also ran, a stand-in driving the agent
the way the operator does, was dropped to keep CI within its time: every operator story moves pods
through the same agent API; the wrapper's rootfs diff and /dev/shm carry-over are checked by
tests/hook/test_restore_check.py, a plain container of the class left alone by test_runc_wrapper.py.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from helm.conftest import Release

from testbed import pods
from testbed.images import APPS_IMAGE

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

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
