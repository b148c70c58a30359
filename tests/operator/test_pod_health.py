"""What the recovery reads from a pod (cluster/recovery.py pod_health): pure, from pod bodies."""

from __future__ import annotations

from typing import Any

import pytest

from ibckpt_operator.cluster.recovery import pod_health


def _pod(*states: dict[str, Any], deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "ring-0", "namespace": "team", "uid": "u-1"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T09:00:00Z"
    statuses = [{"name": f"c{i}", "state": state} for i, state in enumerate(states)]
    return {
        "metadata": meta,
        "spec": {"nodeName": "node-1"},
        "status": {"phase": "Running", "containerStatuses": statuses},
    }


ENDED = {"terminated": {"exitCode": 143, "reason": "Error"}}


@pytest.mark.parametrize(
    ("states", "running"),
    [
        ((), True),  # nothing reported yet: a container may be starting
        (({"waiting": {"reason": "ContainerCreating"}},), True),
        (({"running": {}},), True),
        ((ENDED, {"running": {}}), True),
        ((ENDED, {"waiting": {"reason": "ContainerCreating"}}), True),
        ((ENDED,), False),
        ((ENDED, {"terminated": {"exitCode": 0}}), False),
    ],
)
def test_a_pod_may_run_until_every_container_is_reported_terminated(
    states: tuple[dict[str, Any], ...], running: bool
) -> None:
    health = pod_health(_pod(*states, deleting=True))
    assert health.deleting and health.running is running
