"""What both job machines share: members pinned by key, the step in flight and how a step is issued,
deadlines, transitions, events and actions as plain data.

Time is a float (seconds, the caller's clock): the machines never read a clock, so tests drive them with
fake time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Generic, TypeVar

from ibckpt.vocabulary import Milestone


class Unknown(StrEnum):
    """What a restarted operator does with a step whose outcome it does not know."""

    REISSUE = "reissue"  # read-only or idempotent: run it again under a new attempt id
    VERIFY = "verify"  # look whether it happened, then go on or abort
    ABORT = "abort"  # neither: give up the attempt and bring every rank back


class Mark(StrEnum):
    """A member's label that is no rank milestone: what the operator did to the pod, or what went wrong."""

    SELECTED = "Selected"
    PLACED = "Placed"
    CREATED = "Created"
    KILLED = "Killed"
    REMOVED = "Removed"
    REFUSED = "Refused"
    LOST = "Lost"
    RESUME_FAILED = "ResumeFailed"


# The label a member gets when it finishes a step (status writes it as the pod's phase).
Label = Milestone | Mark


@dataclass(frozen=True)
class PodRef:
    """A pod as the side effects address it. In a CheckpointJob the UID pins it: a pod of the same name
    that is not this UID is another pod."""

    name: str
    uid: str = ""
    node: str = ""


@dataclass(frozen=True)
class Member:
    """One pod of the job and how far it got. `progress` is the label of the last step it finished
    (Admitted, Quiesced, ...) or what went wrong (Refused, Lost, ResumeFailed): a Label, or the same
    string read back from status."""

    pod: PodRef
    progress: str = Mark.SELECTED
    bytes: int | None = None
    seconds: float | None = None
    message: str | None = None

    @property
    def key(self) -> str:
        return self.pod.uid or self.pod.name


@dataclass(frozen=True)
class StepRecord:
    """The side effect in flight: written to status before the actions run."""

    kind: str
    attempt: str
    started_at: float


def attempt_id(run: str, seq: int) -> str:
    return f"{run}-{seq}"


def parse_attempt(attempt: str) -> tuple[str, int]:
    run, _, seq = attempt.rpartition("-")
    if not run or not seq.isdigit():
        raise ValueError(f"not an attempt id: {attempt!r} (expected RUN-N)")
    return run, int(seq)


def with_progress(
    members: tuple[Member, ...],
    key: str,
    progress: str,
    *,
    message: str | None = None,
    bytes: int | None = None,
    seconds: float | None = None,
) -> tuple[Member, ...]:
    """The members with one of them moved on; its facts are kept unless new ones are given."""
    return tuple(
        replace(
            member,
            progress=progress,
            message=message if message is not None else member.message,
            bytes=bytes if bytes is not None else member.bytes,
            seconds=seconds if seconds is not None else member.seconds,
        )
        if member.key == key
        else member
        for member in members
    )


def names_not_at(members: tuple[Member, ...], label: str, *excused: str) -> list[str]:
    """The members that have not finished the step labelled `label`; the lost (and `excused`) do not count."""
    passed = (label, Mark.LOST, *excused)
    return [member.pod.name for member in members if member.progress not in passed]


@dataclass(frozen=True)
class PhaseSpan:
    """A phase the job has left: when it began and how long it lasted (the caller's clock), so status
    says where the time went."""

    phase: str
    started_at: float
    seconds: float


P = TypeVar("P", bound=StrEnum)


@dataclass(frozen=True)
class RunState(Generic[P]):
    """What every job's state holds; all of it goes to status (machine/status.py), so a restarted operator
    reads it back."""

    phase: P
    run: str  # attempt ids are RUN-N
    seq: int
    started_at: float
    phase_since: float
    step: StepRecord | None = None
    members: tuple[Member, ...] = ()
    reason: str | None = None
    message: str | None = None
    finished_at: float | None = None
    phase_spans: tuple[PhaseSpan, ...] = ()  # the phases it left, in order

    @property
    def attempt(self) -> str | None:
        return self.step.attempt if self.step else None

    @property
    def live_pods(self) -> tuple[PodRef, ...]:
        return tuple(member.pod for member in self.members if member.progress != Mark.LOST)


R = TypeVar("R", bound=RunState[Any])


def enter(state: R, phase: StrEnum, now: float, **more: Any) -> R:
    """The state in `phase` from `now` on; the phase it leaves is timed into phase_spans."""
    span = PhaseSpan(str(state.phase), state.phase_since, round(max(0.0, now - state.phase_since), 3))
    return replace(state, phase=phase, phase_since=now, phase_spans=(*state.phase_spans, span), **more)


def issue(
    state: R, step: str, now: float, phase: StrEnum | None, action: Callable[[str], StepAction]
) -> tuple[R, list[Action]]:
    """A new attempt id, recorded in the state before the action that carries it (`action(attempt)`); an
    event when the phase changes."""
    seq = state.seq + 1
    attempt = attempt_id(state.run, seq)
    actions: list[Action] = []
    if phase is not None and phase != state.phase:
        actions.append(EmitEvent("Normal", str(phase), f"{phase}: attempt {attempt}"))
        state = enter(state, phase, now)
    actions.append(action(attempt))
    return replace(state, seq=seq, step=StepRecord(step, attempt, now)), actions


def finish(state: R, phase: StrEnum, reason: str | None, message: str, now: float, **more: Any) -> R:
    """The state at the job's end: `phase` (Succeeded or Failed) from now on, saying why."""
    return enter(state, phase, now, reason=reason, message=message, finished_at=now, **more)


def overdue(state: RunState[P], timeouts: Mapping[P, float], now: float) -> float | None:
    """The bound of the state's phase once `now` is past it; None while within it (or when unbounded)."""
    limit = timeouts.get(state.phase)
    return limit if limit is not None and now >= state.phase_since + limit else None


def late_note(state: RunState[Any], labels: Mapping[Any, str | None]) -> str:
    """For a timeout's message: " (waiting for a, b)", the members that have not passed the step in
    flight (`labels` maps a step to the mark its members reach), or "" when none is late."""
    label = labels[state.step.kind] if state.step else None
    late = names_not_at(state.members, label) if label else []
    return f" (waiting for {', '.join(late)})" if late else ""


def all_marked(state: R, mark: str) -> R:
    """Every member back at `mark`: a step that is run again from scratch (an admission after a
    restart) counts no member as done."""
    return replace(state, members=tuple(replace(m, progress=mark) for m in state.members))


def wake_at(
    state: RunState[P], timeouts: Mapping[P, float], active_deadline: float, ending: P, *more: float | None
) -> float | None:
    """The next deadline: the phase's bound, the job's active deadline (not while `ending`, the phase
    that brings the ranks back), or one of `more` (a retry)."""
    times = [moment for moment in more if moment is not None]
    limit = timeouts.get(state.phase)
    if limit is not None:
        times.append(state.phase_since + limit)
    if state.phase != ending:
        times.append(state.started_at + active_deadline)
    return min(times) if times else None


# Events: what the operator observed. `attempt` says which side effect a result belongs to; a result for
# another attempt is stale and changes nothing.


@dataclass(frozen=True)
class Event:
    pass


@dataclass(frozen=True)
class Tick(Event):
    """Time passed (a timer fired); deadlines are checked on every event, this one carries nothing else."""


@dataclass(frozen=True)
class OperatorRestarted(Event):
    """The operator read this state back from status after a restart: the step in flight has an unknown
    outcome."""


@dataclass(frozen=True)
class Cancelled(Event):
    """The user deleted the job."""


@dataclass(frozen=True)
class PodsSelected(Event):
    attempt: str
    pods: tuple[PodRef, ...]


@dataclass(frozen=True)
class PodsClaimed(Event):
    attempt: str


@dataclass(frozen=True)
class PodsBusy(Event):
    attempt: str
    holder: str


@dataclass(frozen=True)
class PodAdmitted(Event):
    attempt: str
    pod: str  # the member's key: UID in a CheckpointJob, pod name in a RestoreJob


@dataclass(frozen=True)
class PodRefused(Event):
    attempt: str
    pod: str
    message: str


@dataclass(frozen=True)
class SessionOpened(Event):
    attempt: str


@dataclass(frozen=True)
class PodStepDone(Event):
    """One member finished the step in flight."""

    attempt: str
    pod: str
    bytes: int | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class StepFailed(Event):
    """The step in flight failed (an agent's error, a coordinator abort); `pod` if one member is to blame."""

    attempt: str
    reason: str
    message: str
    pod: str | None = None


@dataclass(frozen=True)
class SessionAborted(Event):
    """The job's coordinator session was aborted (a node refused, failed or is stopping). Not the result
    of one step: it aborts whichever is in flight, so it is never stale."""

    reason: str
    message: str


@dataclass(frozen=True)
class PodLost(Event):
    """A member pod is gone or is no longer the pod that was admitted (deleted, restarted, other UID)."""

    pod: str
    message: str


# Actions: what the operator must do, as data. The handler writes the new state to status first, then runs
# the actions in order; every action with a side effect carries the attempt id the state recorded.


@dataclass(frozen=True)
class Action:
    pass


@dataclass(frozen=True)
class EmitEvent(Action):
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class StepAction(Action):
    """A side effect on the member pods, under one attempt id."""

    attempt: str
    pods: tuple[PodRef, ...] = field(default=())


@dataclass(frozen=True)
class StepRule:
    """One row of a machine's step table: the side effect the driver runs for the step (AwaitMilestone:
    none, the agents go on by themselves), the label a member gets when it finishes it (None: the step is
    not per member), and what a restarted operator does when it finds the step in flight."""

    action: type[StepAction]
    label: Label | None
    on_unknown: Unknown


S = TypeVar("S")
A = TypeVar("A", bound=Action)


@dataclass(frozen=True)
class Transition(Generic[S]):
    state: S
    actions: tuple[Action, ...] = ()
    wake_at: float | None = None  # the next deadline or retry: call again with Tick by then

    def of_type(self, kind: type[A]) -> list[A]:
        return [action for action in self.actions if isinstance(action, kind)]
