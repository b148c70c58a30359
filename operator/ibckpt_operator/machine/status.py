"""The machines' states as status (and back), with the Ready / Progressing / Failed conditions.

Everything a state holds is written, so an operator that restarts reads the same state back and feeds it
OperatorRestarted.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from ibckpt.api import (
    CheckpointJobStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    JobPhase,
    PodRow,
    RestoreJobStatus,
    RestorePhase,
)
from ibckpt_operator.machine.checkpoint import JobState
from ibckpt_operator.machine.core import Member, PodRef, StepRecord, parse_attempt
from ibckpt_operator.machine.restore import RestoreState


def to_time(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def from_time(moment: datetime | None) -> float | None:
    return None if moment is None else moment.timestamp()


def conditions(
    *,
    terminal: bool,
    succeeded: bool,
    phase: str,
    reason: str | None,
    message: str | None,
    generation: int | None,
    previous: Sequence[Condition] | None,
    now: float,
) -> list[Condition]:
    """Ready, Progressing, Failed; lastTransitionTime moves only when a condition's status changes."""
    wanted = [
        (ConditionType.READY, succeeded, phase if not succeeded else "Succeeded"),
        (ConditionType.PROGRESSING, not terminal, reason or phase if not terminal else phase),
        (ConditionType.FAILED, terminal and not succeeded, reason or phase),
    ]
    before = {condition.type: condition for condition in previous or ()}
    result = []
    for kind, true, why in wanted:
        status = ConditionStatus.TRUE if true else ConditionStatus.FALSE
        old = before.get(kind)
        since = old.last_transition_time if old is not None and old.status == status else to_time(now)
        result.append(
            Condition(
                type=kind,
                status=status,
                reason=why,
                message=message if true else None,
                observed_generation=generation,
                last_transition_time=since,
            )
        )
    return result


def _rows(members: tuple[Member, ...]) -> list[PodRow]:
    return [
        PodRow(
            name=m.pod.name,
            uid=m.pod.uid or None,
            node=m.pod.node or None,
            phase=m.progress,
            bytes=m.bytes,
            seconds=m.seconds,
            message=m.message,
        )
        for m in members
    ]


def _members(rows: list[PodRow] | None) -> tuple[Member, ...]:
    return tuple(
        Member(
            PodRef(row.name, row.uid or "", row.node or ""),
            progress=row.phase or "Selected",
            bytes=row.bytes,
            seconds=row.seconds,
            message=row.message,
        )
        for row in rows or ()
    )


def _step(kind: str | None, attempt: str | None, started: datetime | None) -> StepRecord | None:
    if kind is None or attempt is None:
        return None
    return StepRecord(kind, attempt, from_time(started) or 0.0)


def job_status(
    state: JobState,
    *,
    checkpoint_name: str,
    generation: int | None = None,
    previous: Sequence[Condition] | None = None,
    now: float,
) -> CheckpointJobStatus:
    terminal = state.phase in (JobPhase.SUCCEEDED, JobPhase.FAILED)
    committed = state.manifest_key is not None
    return CheckpointJobStatus(
        phase=state.phase,
        reason=state.reason,
        message=state.message,
        observed_generation=generation,
        conditions=conditions(
            terminal=terminal,
            succeeded=state.phase == JobPhase.SUCCEEDED,
            phase=str(state.phase),
            reason=state.reason,
            message=state.message,
            generation=generation,
            previous=previous,
            now=now,
        ),
        attempt=state.attempt,
        step=state.step.kind if state.step else None,
        aborted_from=state.aborted_from,
        waiting_for=state.waiting_for,
        pod_count=len(state.members),
        pods=_rows(state.members),
        checkpoint_name=checkpoint_name if committed else None,
        manifest_key=state.manifest_key,
        bytes=sum(m.bytes or 0 for m in state.members) if committed else None,
        start_time=to_time(state.started_at),
        phase_start_time=to_time(state.phase_since),
        step_start_time=to_time(state.step.started_at) if state.step else None,
        completion_time=to_time(state.finished_at),
        claimed=state.claimed,
    )


def job_state(status: CheckpointJobStatus) -> JobState:
    """The state a status was written from; the phase, attempt and start time must be there."""
    if status.phase is None or status.attempt is None or status.start_time is None:
        raise ValueError("status has no phase, attempt or start time: the job never started")
    run, seq = parse_attempt(status.attempt)
    return JobState(
        phase=status.phase,
        run=run,
        seq=seq,
        started_at=status.start_time.timestamp(),
        phase_since=from_time(status.phase_start_time) or status.start_time.timestamp(),
        step=_step(status.step, status.attempt, status.step_start_time),
        members=_members(status.pods),
        claimed=bool(status.claimed),
        reason=status.reason,
        message=status.message,
        aborted_from=status.aborted_from,
        waiting_for=status.waiting_for,
        manifest_key=status.manifest_key,
        finished_at=from_time(status.completion_time),
    )


def restore_status(
    state: RestoreState,
    *,
    generation: int | None = None,
    previous: Sequence[Condition] | None = None,
    now: float,
) -> RestoreJobStatus:
    terminal = state.phase in (RestorePhase.SUCCEEDED, RestorePhase.FAILED)
    return RestoreJobStatus(
        phase=state.phase,
        reason=state.reason,
        message=state.message,
        observed_generation=generation,
        conditions=conditions(
            terminal=terminal,
            succeeded=state.phase == RestorePhase.SUCCEEDED,
            phase=str(state.phase),
            reason=state.reason,
            message=state.message,
            generation=generation,
            previous=previous,
            now=now,
        ),
        attempt=state.attempt,
        step=state.step.kind if state.step else None,
        failed_from=state.failed_from,
        pods=_rows(state.members),
        start_time=to_time(state.started_at),
        phase_start_time=to_time(state.phase_since),
        step_start_time=to_time(state.step.started_at) if state.step else None,
        completion_time=to_time(state.finished_at),
    )


def restore_state(status: RestoreJobStatus) -> RestoreState:
    if status.phase is None or status.attempt is None or status.start_time is None:
        raise ValueError("status has no phase, attempt or start time: the restore never started")
    run, seq = parse_attempt(status.attempt)
    return RestoreState(
        phase=status.phase,
        run=run,
        seq=seq,
        started_at=status.start_time.timestamp(),
        phase_since=from_time(status.phase_start_time) or status.start_time.timestamp(),
        step=_step(status.step, status.attempt, status.step_start_time),
        members=_members(status.pods),
        reason=status.reason,
        message=status.message,
        failed_from=status.failed_from,
        finished_at=from_time(status.completion_time),
    )
