"""What the recovery machine (machine/recovery.py) needs from the cluster, and its state in status.

- The members' health: each pod of the workload in the API (failed and terminating ones too) and its
  node's Ready condition, existence and out-of-service taint, as the machine's observations.
- The newest restorable Checkpoint of the schedule (machine/latest.py, as the RestoreJob will choose).
- The RestoreJob of a recovery: `latestOf: {schedule}`, off the failed nodes, owned by the schedule.
- RecoveryState <-> the schedule's status (recoveryPhase, recoveryReason, recoveryMessage, recovery).
- Which new pods a recovery under way refuses (the webhook's answer, through bindings.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from ibckpt.api import CHECKPOINT, Checkpoint, LatestCheckpoint, PodTemplate, RestorePhase
from ibckpt.api.schedule import CheckpointScheduleStatus, RecoveryStatus, ScratchPod
from ibckpt_operator.cluster import bindings, schedules
from ibckpt_operator.cluster.drains import migration_sources
from ibckpt_operator.cluster.kube import Body, Kube
from ibckpt_operator.cluster.selection import pod_ref
from ibckpt_operator.machine.core import Event, PodRef
from ibckpt_operator.machine.latest import choose_latest, taken_at
from ibckpt_operator.machine.podtemplate import controller_reference
from ibckpt_operator.machine.recovery import (
    ACTIVE,
    OUT_OF_SERVICE,
    CheckpointHint,
    NodeHealth,
    PodHealth,
    RecoveryPhase,
    RecoveryState,
    RestoreBound,
    RestoreEnded,
    Trigger,
)
from ibckpt_operator.machine.status import from_time, to_time

log = logging.getLogger(__name__)


def _stamp(value: Any) -> float | None:
    return schedules.timestamp(value)


def node_health(name: str, node: Mapping[str, Any] | None) -> NodeHealth:
    if node is None:
        return NodeHealth(name, exists=False, ready=False)
    status = node.get("status") or {}
    ready = next((c for c in status.get("conditions") or () if c.get("type") == "Ready"), None)
    taints = (node.get("spec") or {}).get("taints") or ()
    return NodeHealth(
        name,
        ready=ready is not None and ready.get("status") == "True",
        since=_stamp((ready or {}).get("lastTransitionTime")),
        out_of_service=any(t.get("key") == OUT_OF_SERVICE for t in taints),
    )


def pod_health(pod: Mapping[str, Any]) -> PodHealth:
    """A failure is the pod Failed, or a container that terminated non-zero now or before a restart (its
    rank's process died: the restarted one starts from scratch)."""
    status = pod.get("status") or {}
    containers = [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]
    exit_code, finished = None, None
    for container in containers:
        for key in ("state", "lastState"):
            ended = (container.get(key) or {}).get("terminated") or {}
            if ended.get("exitCode") not in (None, 0):
                exit_code, finished = int(ended["exitCode"]), _stamp(ended.get("finishedAt"))
    return PodHealth(
        pod_ref(dict(pod)),
        phase=str(status.get("phase") or "Pending"),
        deleting=bool((pod.get("metadata") or {}).get("deletionTimestamp")),
        # Until the kubelet reports every container terminated, one may run or be starting.
        running=not containers or any("terminated" not in (c.get("state") or {}) for c in containers),
        failed_exit=exit_code,
        failed_at=finished,
        controlled=controller_reference(dict(pod)) is not None,
    )


async def observe(kube: Kube, pods: list[Body]) -> tuple[tuple[PodHealth, ...], tuple[NodeHealth, ...]]:
    health = tuple(sorted((pod_health(pod) for pod in pods), key=lambda h: h.pod.name))
    names = sorted({h.pod.node for h in health if h.pod.node})
    nodes = tuple([node_health(name, await kube.request("GET", f"/api/v1/nodes/{name}")) for name in names])
    return health, nodes


async def latest_checkpoint(kube: Kube, namespace: str, schedule: str) -> CheckpointHint | None:
    """The Checkpoint a RestoreJob `latestOf: {schedule}` would restore now, if any."""
    checkpoints: list[Checkpoint] = []
    for item in await schedules.list_namespaced(kube, CHECKPOINT.plural, namespace):
        try:
            checkpoints.append(Checkpoint.from_wire(item))
        except ValueError:
            continue  # not a candidate (the RestoreJob's choice says why)
    choice = choose_latest(checkpoints, namespace, LatestCheckpoint(schedule=schedule))
    if choice.name is None:
        return None
    chosen = next(c for c in checkpoints if c.metadata.name == choice.name)
    return CheckpointHint(choice.name, taken_at(chosen))


def restore_job_body(schedule: Body, name: str, avoid: tuple[str, ...], by_controller: bool) -> Body:
    """The recovery's RestoreJob: the newest restorable Checkpoint of the schedule (the RestoreJob chooses
    and records it), off the failed nodes; create-if-absent by this name, so one per recovery."""
    body = schedules.restore_job_body(schedule, name, "", avoid, by_controller=by_controller)
    del body["spec"]["checkpointName"]
    body["spec"]["latestOf"] = {"schedule": schedule["metadata"]["name"]}
    return body


async def restore_events(kube: Kube, namespace: str, name: str, job: Mapping[str, Any] | None) -> list[Event]:
    if job is None:
        return []
    events: list[Event] = []
    bound = (job.get("spec") or {}).get("checkpointName")
    if bound:
        checkpoint = await kube.get_custom(CHECKPOINT.plural, namespace, bound)
        when = None
        if checkpoint is not None:
            try:
                when = taken_at(Checkpoint.from_wire(checkpoint)) or None
            except ValueError:
                when = None
        events.append(RestoreBound(name, bound, when))
    status = job.get("status") or {}
    if status.get("phase") == RestorePhase.SUCCEEDED:
        events.append(RestoreEnded(name, True))
    elif status.get("phase") == RestorePhase.FAILED:
        reason = status.get("reason") or "Failed"
        events.append(
            RestoreEnded(name, False, f"RestoreJob {name}: {reason}: {status.get('message') or ''}")
        )
    return events


# -- status


def recovery_status(
    state: RecoveryState, controllers: dict[str, str], templates: Mapping[str, PodTemplate] | None = None
) -> dict[str, Any]:
    """The status fields of a RecoveryState; `templates`: the bare sources' templates by pod uid."""
    sources = migration_sources(state.sources, controllers)
    kept = templates or {}
    scratch = [ScratchPod(name=p.name, uid=p.uid, template=kept[p.uid]) for p in state.bare if p.uid in kept]
    recovery = RecoveryStatus(
        seq=state.seq,
        trigger=state.trigger.value if state.trigger else None,
        nodes=list(state.nodes) or None,
        sources=sources or None,
        from_scratch=state.from_scratch or None,
        restartable=state.restartable or None,
        scratch_pods=scratch or None,
        failed_at=to_time(state.failed_at),
        detected_at=to_time(state.detected_at),
        deadline=to_time(state.deadline),
        ended_at=to_time(state.ended_at),
        restore_job=state.restore_job,
        checkpoint=state.checkpoint,
        checkpoint_time=to_time(state.checkpoint_time),
        work_lost_seconds=None if state.work_lost is None else round(state.work_lost, 1),
        recent_starts=[datetime.fromtimestamp(t, UTC) for t in state.recent] or None,
    )
    return {
        "recovery_phase": state.phase.value,
        "recovery_reason": state.reason,
        "recovery_message": state.message,
        "recovery": recovery,
    }


def recovery_state(name: str, status: CheckpointScheduleStatus) -> RecoveryState | None:
    if status.recovery_phase is None:
        return None
    r = status.recovery or RecoveryStatus()
    node_of = {s.uid: s.node or "" for s in r.sources or () if s.uid}
    return RecoveryState(
        name=name,
        phase=RecoveryPhase(status.recovery_phase),
        seq=r.seq,
        trigger=Trigger(r.trigger) if r.trigger else None,
        nodes=tuple(r.nodes or ()),
        sources=tuple(PodRef(s.name, s.uid or "", s.node or "") for s in r.sources or ()),
        from_scratch=bool(r.from_scratch),
        restartable=bool(r.restartable),
        bare=tuple(PodRef(p.name, p.uid or "", node_of.get(p.uid or "", "")) for p in r.scratch_pods or ()),
        failed_at=from_time(r.failed_at),
        detected_at=from_time(r.detected_at),
        deadline=from_time(r.deadline),
        ended_at=from_time(r.ended_at),
        restore_job=r.restore_job,
        checkpoint=r.checkpoint,
        checkpoint_time=from_time(r.checkpoint_time),
        reason=status.recovery_reason,
        message=status.recovery_message,
        recent=tuple(t.timestamp() for t in r.recent_starts or ()),
    )


def scratch_templates(status: CheckpointScheduleStatus) -> dict[str, PodTemplate]:
    """The bare sources' templates a recovery kept, by pod uid."""
    pods = (status.recovery.scratch_pods if status.recovery else None) or ()
    return {p.uid: p.template for p in pods if p.uid}


def source_controllers(status: CheckpointScheduleStatus) -> dict[str, str]:
    sources = (status.recovery.sources if status.recovery else None) or ()
    return {s.uid: s.controller_uid for s in sources if s.uid and s.controller_uid}


def refusal(
    state: RecoveryState, pod: bindings.NewPod, namespace: str, schedule: str, controllers: dict[str, str]
) -> bindings.Waiting | None:
    """While a recovery stops and restores the job, its controllers may start no pod of their own: a new
    pod named as a source (a StatefulSet's) or of a source's renaming controller (a Job's) would run a
    rank from scratch, maybe beside its old copy on an unreachable node."""
    if state.phase not in ACTIVE or pod.namespace != namespace:
        return None
    named = pod.name and any(source.name == pod.name for source in state.sources)
    owned = pod.controller_uid and pod.controller_uid in {controllers.get(s.uid) for s in state.sources}
    if not (named or owned):
        return None
    return bindings.Waiting(
        f"ibckpt: CheckpointSchedule {schedule} is recovering this job ({state.phase}: {state.message}); "
        "its pods come back restored from the latest checkpoint, not from scratch"
    )
