"""What both machines share: members pinned by key, the step in flight, transitions, events and actions
as plain data.

Time is a float (seconds, the caller's clock): the machines never read a clock, so tests drive them with
fake time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Generic, TypeVar


class Unknown(StrEnum):
    """What a restarted operator does with a step whose outcome it does not know."""

    REISSUE = "reissue"  # read-only or idempotent: run it again under a new attempt id
    VERIFY = "verify"  # look whether it happened, then go on or abort
    ABORT = "abort"  # neither: give up the attempt and bring every rank back


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
    (Admitted, Quiesced, ...) or what went wrong (Refused, Lost, Failed)."""

    pod: PodRef
    progress: str = "Selected"
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


def keys_not_at(members: tuple[Member, ...], progress: str) -> list[str]:
    return [member.pod.name for member in members if member.progress != progress]


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


S = TypeVar("S")
A = TypeVar("A", bound=Action)


@dataclass(frozen=True)
class Transition(Generic[S]):
    state: S
    actions: tuple[Action, ...] = ()
    wake_at: float | None = None  # the next deadline or retry: call again with Tick by then

    def of_type(self, kind: type[A]) -> list[A]:
        return [action for action in self.actions if isinstance(action, kind)]
