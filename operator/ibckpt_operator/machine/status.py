"""The machines' states as status (and back), with the Ready / Progressing / Failed conditions.

Everything a state holds is written, so an operator that restarts reads the same state back and feeds it
OperatorRestarted.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from ibckpt.api import (
    CheckpointJobStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    JobPhase,
    PhaseTiming,
    PodRow,
    RestoreJobStatus,
    RestorePhase,
)
from ibckpt_operator.machine.checkpoint import JobState
from ibckpt_operator.machine.core import Member, PhaseSpan, PodRef, StepRecord, parse_attempt
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
    return [
        condition(
            kind, true, why, message if true else None, generation=generation, previous=previous, now=now
        )
        for kind, true, why in wanted
    ]


def condition(
    kind: str,
    true: bool,
    reason: str,
    message: str | None = None,
    *,
    generation: int | None,
    previous: Sequence[Condition] | None,
    now: float,
) -> Condition:
    """One condition; its lastTransitionTime is the previous one's while its status stays the same."""
    status = ConditionStatus.TRUE if true else ConditionStatus.FALSE
    old = next((c for c in previous or () if c.type == kind), None)
    since = old.last_transition_time if old is not None and old.status == status else None
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        observed_generation=generation,
        last_transition_time=since or to_time(now),
    )


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


def _timings(spans: tuple[PhaseSpan, ...]) -> list[PhaseTiming] | None:
    return [
        PhaseTiming(phase=s.phase, started_at=datetime.fromtimestamp(s.started_at, UTC), seconds=s.seconds)
        for s in spans
    ] or None


def _spans(timings: list[PhaseTiming] | None) -> tuple[PhaseSpan, ...]:
    return tuple(PhaseSpan(t.phase, t.started_at.timestamp(), t.seconds) for t in timings or ())


def _step(kind: str | None, attempt: str | None, started: datetime | None) -> StepRecord | None:
    if kind is None or attempt is None:
        return None
    return StepRecord(kind, attempt, from_time(started) or 0.0)


class _Progress(Protocol):
    """What both machines' states have (JobState, RestoreState)."""

    @property
    def phase(self) -> str: ...
    @property
    def run(self) -> str: ...
    @property
    def started_at(self) -> float: ...
    @property
    def phase_since(self) -> float: ...
    @property
    def step(self) -> StepRecord | None: ...
    @property
    def members(self) -> tuple[Member, ...]: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def message(self) -> str | None: ...
    @property
    def finished_at(self) -> float | None: ...
    @property
    def phase_spans(self) -> tuple[PhaseSpan, ...]: ...
    @property
    def attempt(self) -> str | None: ...


def _status_fields(
    state: _Progress,
    *,
    succeeded: str,
    failed: str,
    generation: int | None,
    previous: Sequence[Condition] | None,
    now: float,
) -> dict[str, Any]:
    """The status fields both kinds write the same way (by field name)."""
    return {
        "phase": state.phase,
        "reason": state.reason,
        "message": state.message,
        "observed_generation": generation,
        "conditions": conditions(
            terminal=state.phase in (succeeded, failed),
            succeeded=state.phase == succeeded,
            phase=str(state.phase),
            reason=state.reason,
            message=state.message,
            generation=generation,
            previous=previous,
            now=now,
        ),
        "attempt": state.attempt,
        "step": state.step.kind if state.step else None,
        "pods": _rows(state.members),
        "phase_timings": _timings(state.phase_spans),
        "start_time": to_time(state.started_at),
        "phase_start_time": to_time(state.phase_since),
        "step_start_time": to_time(state.step.started_at) if state.step else None,
        "completion_time": to_time(state.finished_at),
    }


def _state_fields(status: CheckpointJobStatus | RestoreJobStatus, what: str) -> dict[str, Any]:
    """The state fields both kinds read back the same way; the phase, attempt and start time must be
    there (`what` names the kind's work in the error)."""
    if status.phase is None or status.attempt is None or status.start_time is None:
        raise ValueError(f"status has no phase, attempt or start time: the {what} never started")
    run, seq = parse_attempt(status.attempt)
    return {
        "phase": status.phase,
        "run": run,
        "seq": seq,
        "started_at": status.start_time.timestamp(),
        "phase_since": from_time(status.phase_start_time) or status.start_time.timestamp(),
        "step": _step(status.step, status.attempt, status.step_start_time),
        "members": _members(status.pods),
        "reason": status.reason,
        "message": status.message,
        "finished_at": from_time(status.completion_time),
        "phase_spans": _spans(status.phase_timings),
    }


def job_status(
    state: JobState,
    *,
    checkpoint_name: str,
    generation: int | None = None,
    previous: Sequence[Condition] | None = None,
    now: float,
) -> CheckpointJobStatus:
    committed = state.manifest_key is not None
    return CheckpointJobStatus(
        **_status_fields(
            state, succeeded=JobPhase.SUCCEEDED, failed=JobPhase.FAILED, generation=generation,
            previous=previous, now=now,
        ),
        aborted_from=state.aborted_from,
        waiting_for=state.waiting_for,
        session_turn=state.session_turn or None,
        pod_count=len(state.members),
        checkpoint_name=checkpoint_name if committed else None,
        manifest_key=state.manifest_key,
        committed_on=state.committed_on,
        bytes=sum(m.bytes or 0 for m in state.members) if committed else None,
        claimed=state.claimed,
    )  # fmt: skip


def job_state(status: CheckpointJobStatus) -> JobState:
    """The state a status was written from."""
    return JobState(
        **_state_fields(status, "job"),
        claimed=bool(status.claimed),
        aborted_from=status.aborted_from,
        waiting_for=status.waiting_for,
        session_turn=status.session_turn or 0,
        manifest_key=status.manifest_key,
        committed_on=status.committed_on,
    )


def restore_status(
    state: RestoreState,
    *,
    generation: int | None = None,
    previous: Sequence[Condition] | None = None,
    now: float,
) -> RestoreJobStatus:
    return RestoreJobStatus(
        **_status_fields(
            state, succeeded=RestorePhase.SUCCEEDED, failed=RestorePhase.FAILED, generation=generation,
            previous=previous, now=now,
        ),
        failed_from=state.failed_from,
    )  # fmt: skip


def restore_state(status: RestoreJobStatus) -> RestoreState:
    return RestoreState(**_state_fields(status, "restore"), failed_from=status.failed_from)
