"""Which deleted source pods the restore may remove at once: only those with nothing running, by uid."""

from __future__ import annotations

from typing import Any

from ibckpt_operator.cluster.sources import ended_and_going

UID = "0b6f0c1e-1111-2222-3333-444455556666"
TERMINATED = {"terminated": {"exitCode": 137, "reason": "Error"}}
RUNNING = {"running": {"startedAt": "2026-11-26T10:00:00Z"}}


def pod(*states: dict[str, Any], deleting: bool = True, uid: str = UID, init: tuple[Any, ...] = ()) -> Any:
    meta: dict[str, Any] = {"name": "ring-0", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-26T10:01:00Z"
    return {
        "metadata": meta,
        "status": {
            "phase": "Running",
            "initContainerStatuses": [{"name": f"i{n}", "state": s} for n, s in enumerate(init)],
            "containerStatuses": [{"name": f"c{n}", "state": s} for n, s in enumerate(states)],
        },
    }


def test_a_deleted_pod_whose_containers_all_ended_may_go() -> None:
    assert ended_and_going(pod(TERMINATED, TERMINATED), UID)


def test_a_killed_container_a_1_20_kubelet_reports_waiting_has_ended_too() -> None:
    assert ended_and_going(pod(TERMINATED, {"waiting": {"reason": "ContainerCreating"}}), UID)


def test_a_container_still_running_keeps_it() -> None:
    assert not ended_and_going(pod(TERMINATED, RUNNING), UID)
    assert not ended_and_going(pod(TERMINATED, init=(RUNNING,)), UID)


def test_a_pod_still_reported_ready_keeps_it() -> None:
    ready = pod(TERMINATED)
    ready["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert not ended_and_going(ready, UID)
    ready["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    assert ended_and_going(ready, UID)


def test_a_pod_nobody_deleted_is_never_removed() -> None:
    assert not ended_and_going(pod(TERMINATED, deleting=False), UID)


def test_another_pod_of_the_name_is_not_the_source() -> None:
    assert not ended_and_going(pod(TERMINATED, uid="another"), UID)


def test_a_pod_with_no_reported_containers_is_not_known_to_have_ended() -> None:
    assert not ended_and_going(pod(), UID)
