"""The cluster side of a CheckpointSchedule's periodic checkpoints (docs/schedules.md): the CheckpointJob a
fire creates, the measured cost of a finished one, the Checkpoints retention decides over, the pruning,
and ScheduleState <-> status. The machine (machine/schedule.py) decides; this reads and writes."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from ibckpt.api import (
    API_VERSION,
    CHECKPOINT,
    CHECKPOINT_JOB,
    CHECKPOINT_SCHEDULE,
    GROUP,
    RESTORE_JOB,
    VERSION,
    CheckpointScheduleSpec,
    CheckpointScheduleStatus,
    JobPhase,
    PodCreator,
    RestorePhase,
)
from ibckpt.api.schedule import PIN_LABEL, SCHEDULE_LABEL
from ibckpt_operator.cluster.bindings import NAME_KEEPING_KINDS
from ibckpt_operator.cluster.kube import ApiException, Body, Kube
from ibckpt_operator.machine.schedule import CheckpointInfo, JobFinished, JobInfo, ScheduleState


def owner_reference(owner: Body) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": owner.get("apiVersion", API_VERSION),
        "kind": owner.get("kind", CHECKPOINT_SCHEDULE.kind),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }


def _owned_by(schedule: Body, kind: str, name: str, spec: dict[str, Any]) -> Body:
    """An object of one of the operator's kinds, owned by the schedule and labelled with it."""
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": {
            "name": name,
            "labels": {SCHEDULE_LABEL: schedule["metadata"]["name"]},
            "ownerReferences": [owner_reference(schedule)],
        },
        "spec": spec,
    }


def checkpoint_job_body(
    schedule: Body, spec: CheckpointScheduleSpec, name: str, *, stop_into: str | None = None
) -> Body:
    """A CheckpointJob from the template, owned by the schedule and labelled with it. `stop_into`: a drain
    migration's job, mode Stop, writing the Checkpoint of that name."""
    template = spec.template.to_wire()
    keys = list(template.get("copyLabels") or [])
    if "*" not in keys and SCHEDULE_LABEL not in keys:
        keys.append(SCHEDULE_LABEL)
    template["copyLabels"] = keys
    if stop_into is not None:
        template["mode"] = "Stop"
        template["checkpointName"] = stop_into
    else:
        template.pop("checkpointName", None)  # one name for every fire would collide: <job>-<run>
    return _owned_by(schedule, CHECKPOINT_JOB.kind, name, template)


# The phases a restore shares with a checkpoint: a drain's RestoreJob bounds them as the template does (a
# cluster slow to admit a checkpoint is as slow to admit its restore).
SHARED_TIMEOUTS = ("admitSeconds", "rebuildSeconds", "resumeSeconds")


def restored_by_controller(checkpoint: Mapping[str, Any] | None) -> bool:
    """Whether every pod of a Checkpoint belongs to a controller that creates it again under its name
    (a StatefulSet): then that controller creates the restored pods (podsCreatedBy: Controller)."""
    pods = ((checkpoint or {}).get("spec") or {}).get("pods") or ()
    kinds = [((pod.get("template") or {}).get("controller") or {}).get("kind") for pod in pods]
    return bool(kinds) and all(kind in NAME_KEEPING_KINDS for kind in kinds)


def restore_job_body(
    schedule: Body, name: str, checkpoint: str, avoid_nodes: tuple[str, ...], by_controller: bool = False
) -> Body:
    timeouts = ((schedule.get("spec") or {}).get("template") or {}).get("timeouts") or {}
    spec: dict[str, Any] = {"checkpointName": checkpoint, "avoidNodes": list(avoid_nodes)}
    if by_controller:
        spec["podsCreatedBy"] = PodCreator.CONTROLLER.value
    shared = {key: timeouts[key] for key in SHARED_TIMEOUTS if key in timeouts}
    if shared:
        spec["timeouts"] = shared
    return _owned_by(schedule, RESTORE_JOB.kind, name, spec)


def timestamp(value: Any) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def measured_seconds(job: Mapping[str, Any], checkpoint: Mapping[str, Any] | None) -> float | None:
    """The cost of one checkpoint: the Checkpoint's commitSeconds (from the cut to the commit on the tier
    the job commits on: with commitOn Memory, the copies, not the S3 upload after them), else its
    pauseSeconds (what the ranks were gated), else its totalSeconds, else the job's start to completion."""
    timings = ((checkpoint or {}).get("spec") or {}).get("timings") or {}
    for key in ("commitSeconds", "pauseSeconds", "totalSeconds"):
        if timings.get(key) is not None:
            return float(timings[key])
    status = job.get("status") or {}
    start, end = timestamp(status.get("startTime")), timestamp(status.get("completionTime"))
    if start is None or end is None:
        return None
    return max(0.0, end - start)


async def job_outcome(kube: Kube, namespace: str, name: str) -> JobFinished | None:
    """JobFinished if the schedule's job has ended (or vanished), None while it runs."""
    job = await kube.get_custom(CHECKPOINT_JOB.plural, namespace, name)
    if job is None:
        return JobFinished(name, False)
    status = job.get("status") or {}
    if status.get("phase") == JobPhase.SUCCEEDED:
        checkpoint = None
        if status.get("checkpointName"):
            checkpoint = await kube.get_custom(CHECKPOINT.plural, namespace, status["checkpointName"])
        return JobFinished(name, True, measured_seconds(job, checkpoint))
    if status.get("phase") == JobPhase.FAILED:
        return JobFinished(name, False)
    return None


async def list_namespaced(kube: Kube, plural: str, namespace: str, selector: str | None = None) -> list[Body]:
    kwargs = {"label_selector": selector} if selector else {}
    lister: Any = kube.custom.list_namespaced_custom_object
    result = await asyncio.to_thread(lister, GROUP, VERSION, namespace, plural, **kwargs)
    return list(result.get("items", []))


async def restores_in_use(kube: Kube, namespace: str) -> dict[str, str]:
    """Checkpoint name -> the RestoreJob that has not ended and names it."""
    in_use: dict[str, str] = {}
    for restore in await list_namespaced(kube, RESTORE_JOB.plural, namespace):
        phase = (restore.get("status") or {}).get("phase")
        if phase not in (RestorePhase.SUCCEEDED, RestorePhase.FAILED):
            in_use[(restore.get("spec") or {}).get("checkpointName", "")] = restore["metadata"]["name"]
    return in_use


async def retention_view(kube: Kube, namespace: str, schedule: str) -> list[CheckpointInfo]:
    """The schedule's Checkpoints as retention sees them: age, complete, pinned, in use by a restore."""
    in_use = await restores_in_use(kube, namespace)
    infos = []
    for body in await list_namespaced(kube, CHECKPOINT.plural, namespace, f"{SCHEDULE_LABEL}={schedule}"):
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            continue  # being pruned already
        infos.append(
            CheckpointInfo(
                name=meta["name"],
                created_at=timestamp(meta.get("creationTimestamp")) or 0.0,
                complete=bool((body.get("status") or {}).get("readyToRestore")),
                pinned=(meta.get("labels") or {}).get(PIN_LABEL) == "true",
                used_by=in_use.get(meta["name"]),
            )
        )
    return infos


async def job_history(kube: Kube, namespace: str, schedule: str) -> list[JobInfo]:
    """The schedule's CheckpointJobs as the job history sees them."""
    jobs = []
    for body in await list_namespaced(kube, CHECKPOINT_JOB.plural, namespace, f"{SCHEDULE_LABEL}={schedule}"):
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        created = timestamp(meta.get("creationTimestamp")) or 0.0
        jobs.append(JobInfo(meta["name"], created, str((body.get("status") or {}).get("phase") or "")))
    return jobs


async def delete_checkpoint(kube: Kube, namespace: str, name: str) -> bool:
    """Delete the Checkpoint object; its finalizer (handlers/checkpoint.py) deletes the manifest and sweeps
    the chunks no other manifest references. False if it was gone."""
    try:
        await asyncio.to_thread(
            kube.custom.delete_namespaced_custom_object, GROUP, VERSION, namespace, CHECKPOINT.plural, name
        )
        return True
    except ApiException as error:
        if error.status == 404:
            return False
        raise


async def delete_custom(kube: Kube, plural: str, namespace: str, name: str) -> None:
    try:
        await asyncio.to_thread(
            kube.custom.delete_namespaced_custom_object, GROUP, VERSION, namespace, plural, name
        )
    except ApiException as error:
        if error.status != 404:
            raise


# -- status


def _time(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def _seconds(moment: datetime | None) -> float | None:
    return None if moment is None else moment.timestamp()


def interval_source(spec: CheckpointScheduleSpec, state: ScheduleState) -> str | None:
    if state.interval is None:
        return None
    if spec.interval_seconds is not None:
        return "Fixed"
    if state.cost is None:
        return "Unmeasured"  # the lower clamp, until the first cost is measured
    if state.interval in (spec.min_interval_seconds, spec.max_interval_seconds):
        return "YoungDalyClamped"
    return "YoungDaly"


def schedule_status(spec: CheckpointScheduleSpec, state: ScheduleState) -> dict[str, Any]:
    return {
        "last_fire_time": _time(state.anchor),
        "seq": state.seq,
        "active_job": state.active_job,
        "active_since": _time(state.active_since),
        "queued": state.queued,
        "recent_costs": list(state.durations) or None,
        "last_checkpoint_job": state.last_job,
        "last_checkpoint_time": _time(state.last_start),
        "interval_seconds": state.interval,
        "cost_seconds": state.cost,
        "interval_source": interval_source(spec, state),
        "next_checkpoint_time": _time(state.next_fire),
    }


def schedule_state(name: str, status: CheckpointScheduleStatus) -> ScheduleState | None:
    """The state a previous operator wrote, or None for a new schedule."""
    if status.last_fire_time is None:
        return None
    return ScheduleState(
        name=name,
        anchor=status.last_fire_time.timestamp(),
        seq=status.seq or 0,
        active_job=status.active_job,
        active_since=_seconds(status.active_since),
        queued=bool(status.queued),
        durations=tuple(status.recent_costs or ()),
        last_job=status.last_checkpoint_job,
        last_start=_seconds(status.last_checkpoint_time),
        interval=status.interval_seconds,
        cost=status.cost_seconds,
        next_fire=_seconds(status.next_checkpoint_time),
    )


def status_patch(status: CheckpointScheduleStatus) -> Body:
    """A merge patch for the whole status: fields now unset are removed (null), in the objects it
    holds too (a merge patch merges them: `recovery.scratchPods` once the pods are created)."""
    body = status.to_wire()
    _null_unset(status, body)
    return copy.deepcopy(body)


def _null_unset(model: BaseModel, body: dict[str, Any]) -> None:
    for field_name, info in type(model).model_fields.items():
        key = info.alias or field_name
        value = getattr(model, field_name)
        if isinstance(value, BaseModel) and isinstance(body.get(key), dict):
            _null_unset(value, body[key])
        else:
            body.setdefault(key, None)
