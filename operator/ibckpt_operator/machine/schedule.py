"""The CheckpointSchedule machine: when to start the next CheckpointJob, and which Checkpoints to prune.
Pure: no I/O, no clock (docs/schedules.md).

- The interval is fixed (intervalSeconds), or Young/Daly: sqrt(2 * cost * MTBF), where the cost is the mean
  duration of the last `costWindow` successful checkpoints, clamped to [min, max]. With no measurement yet
  the lower clamp is used, so the first cost is measured early.
- The next fire is one interval after the last fire (started, skipped or queued), recomputed from the
  current policy and costs on every event, so a spec change or a new measurement applies at once.
- Runs never overlap: a fire while the previous CheckpointJob runs is skipped, or queued (at most one).
- Retention: pinned, in use by a RestoreJob, the newest complete one and the `minKeep` newest are never
  pruned; otherwise keepLast and maxAgeSeconds drop. maxTotalBytes needs the chunk sets, so the store's gc
  applies it, not this machine.
- Job history: of the finished CheckpointJobs, the `successfulJobsHistoryLimit` newest that succeeded and
  the `failedJobsHistoryLimit` newest that failed stay; older ones are deleted (their Checkpoints stay:
  retention decides over those). A job still running, or one a migration names, is never deleted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ibckpt.api.schedule import CheckpointScheduleSpec, OverlapPolicy
from ibckpt_operator.machine.core import (
    Action,
    EmitEvent,
    Event,
    OperatorRestarted,
    Tick,
    Transition,
)


def young_daly(cost_seconds: float, mtbf_seconds: float) -> float:
    """The first-order optimal checkpoint interval (Young 1974, Daly 2006)."""
    if cost_seconds < 0 or mtbf_seconds <= 0:
        raise ValueError("cost must be >= 0 and MTBF > 0")
    return math.sqrt(2.0 * cost_seconds * mtbf_seconds)


def estimate_cost(durations: Sequence[float], window: int) -> float | None:
    """Mean of the last `window` durations; None before the first measurement."""
    recent = list(durations)[-window:]
    return sum(recent) / len(recent) if recent else None


@dataclass(frozen=True)
class SchedulePolicy:
    interval_seconds: float | None = None
    mtbf_seconds: float | None = None
    min_interval_seconds: float = 300.0
    max_interval_seconds: float = 86400.0
    cost_window: int = 5
    overlap: OverlapPolicy = OverlapPolicy.SKIP
    suspend: bool = False
    keep_last: int | None = 3
    max_age_seconds: float | None = None
    min_keep: int = 1
    successful_jobs_kept: int = 3
    failed_jobs_kept: int = 1

    @classmethod
    def from_spec(cls, spec: CheckpointScheduleSpec) -> SchedulePolicy:
        return cls(
            interval_seconds=spec.interval_seconds,
            mtbf_seconds=spec.mtbf_seconds,
            min_interval_seconds=spec.min_interval_seconds,
            max_interval_seconds=spec.max_interval_seconds,
            cost_window=spec.cost_window,
            overlap=spec.overlap_policy,
            suspend=spec.suspend,
            keep_last=spec.retention.keep_last,
            max_age_seconds=spec.retention.max_age_seconds,
            min_keep=spec.retention.min_keep,
            successful_jobs_kept=spec.successful_jobs_history_limit,
            failed_jobs_kept=spec.failed_jobs_history_limit,
        )

    @property
    def periodic(self) -> bool:
        return not self.suspend and (self.interval_seconds is not None or self.mtbf_seconds is not None)

    def interval(self, durations: Sequence[float]) -> tuple[float | None, float | None]:
        """(interval, cost it came from); (None, None) when not periodic."""
        if not self.periodic:
            return None, None
        if self.interval_seconds is not None:
            return float(self.interval_seconds), estimate_cost(durations, self.cost_window)
        assert self.mtbf_seconds is not None
        cost = estimate_cost(durations, self.cost_window)
        if cost is None:
            return self.min_interval_seconds, None
        raw = young_daly(cost, self.mtbf_seconds)
        return min(max(raw, self.min_interval_seconds), self.max_interval_seconds), cost


@dataclass(frozen=True)
class ScheduleState:
    """What status keeps: `anchor` is the last fire (started, skipped or queued); `seq` names the jobs."""

    name: str
    anchor: float
    seq: int = 0
    active_job: str | None = None
    active_since: float | None = None
    queued: bool = False
    durations: tuple[float, ...] = ()
    last_job: str | None = None
    last_start: float | None = None
    interval: float | None = None
    cost: float | None = None
    next_fire: float | None = None


# Events.


@dataclass(frozen=True)
class JobFinished(Event):
    """A CheckpointJob of this schedule ended; `seconds` is its measured cost (Checkpoint timings)."""

    name: str
    succeeded: bool
    seconds: float | None = None


# Actions.


@dataclass(frozen=True)
class CreateCheckpointJob(Action):
    """Create (if absent, by name) a CheckpointJob from the schedule's template."""

    name: str


@dataclass(frozen=True)
class DeleteCheckpoint(Action):
    """Delete the Checkpoint object and its manifest; the store's gc sweeps the chunks no manifest uses."""

    name: str
    reason: str


@dataclass(frozen=True)
class CheckpointInfo:
    """What retention needs of one Checkpoint of this schedule."""

    name: str
    created_at: float
    complete: bool = True  # readyToRestore: its manifest is committed and verified
    pinned: bool = False  # label ibckpt.io/pinned=true
    used_by: str | None = None  # a RestoreJob that has not ended names it


@dataclass(frozen=True)
class DeleteCheckpointJob(Action):
    """Delete a finished CheckpointJob the job history no longer keeps (not its Checkpoint)."""

    name: str
    reason: str


@dataclass(frozen=True)
class JobInfo:
    """What the job history needs of one CheckpointJob of this schedule."""

    name: str
    created_at: float
    phase: str  # the job's status.phase; only Succeeded and Failed are finished


@dataclass(frozen=True)
class Decision:
    name: str
    keep: bool
    reason: str


def decide(checkpoints: Iterable[CheckpointInfo], policy: SchedulePolicy, now: float) -> list[Decision]:
    """One decision per checkpoint, newest first. Only complete, unpinned checkpoints count for keepLast
    and minKeep; an incomplete one is useless and goes by age only."""
    newest_first = sorted(checkpoints, key=lambda info: (info.created_at, info.name), reverse=True)
    newest_complete = next((info.name for info in newest_first if info.complete), None)
    decisions: list[Decision] = []
    position = 0
    for info in newest_first:
        too_old = policy.max_age_seconds is not None and now - info.created_at > policy.max_age_seconds
        if info.pinned:
            decisions.append(Decision(info.name, True, "pinned"))
            continue
        if info.used_by is not None:
            decisions.append(Decision(info.name, True, f"in use by RestoreJob {info.used_by}"))
            continue
        if not info.complete:
            keep = not too_old
            decisions.append(Decision(info.name, keep, "incomplete" + (", too old" if too_old else "")))
            continue
        mine, position = position, position + 1
        if info.name == newest_complete:
            decisions.append(Decision(info.name, True, "the newest complete checkpoint"))
        elif mine < policy.min_keep:
            decisions.append(Decision(info.name, True, f"one of the {policy.min_keep} newest (minKeep)"))
        elif policy.keep_last is not None and mine >= policy.keep_last:
            decisions.append(Decision(info.name, False, f"not among the {policy.keep_last} newest"))
        elif too_old:
            decisions.append(Decision(info.name, False, f"older than {policy.max_age_seconds:g}s"))
        else:
            decisions.append(Decision(info.name, True, "within every rule"))
    return decisions


class ScheduleMachine:
    def __init__(self, policy: SchedulePolicy) -> None:
        self.policy = policy

    def start(self, name: str, now: float) -> Transition[ScheduleState]:
        """A new schedule: the first fire is one interval from now."""
        return self._settle(ScheduleState(name=name, anchor=now), now, [])

    def handle(self, state: ScheduleState, event: Event, now: float) -> Transition[ScheduleState]:
        actions: list[Action] = []
        if isinstance(event, JobFinished) and event.name == state.active_job:
            durations = state.durations
            if event.succeeded and event.seconds is not None:
                durations = (*durations, event.seconds)[-max(self.policy.cost_window, 1) :]
            else:
                actions.append(EmitEvent("Warning", "CheckpointFailed", f"{event.name} failed"))
            state = replace(state, active_job=None, active_since=None, durations=durations)
            if state.queued:
                state = replace(state, queued=False)
                state, started = self._fire(state, now)
                actions += started
        elif not isinstance(event, (Tick, OperatorRestarted, JobFinished)):
            return Transition(state, (), state.next_fire)
        return self._settle(state, now, actions)

    def prune(self, checkpoints: Iterable[CheckpointInfo], now: float) -> tuple[Action, ...]:
        actions: list[Action] = []
        for decision in decide(checkpoints, self.policy, now):
            if not decision.keep:
                actions.append(DeleteCheckpoint(decision.name, decision.reason))
                actions.append(EmitEvent("Normal", "CheckpointPruned", f"{decision.name}: {decision.reason}"))
        return tuple(actions)

    def prune_jobs(self, jobs: Iterable[JobInfo], in_use: frozenset[str]) -> tuple[Action, ...]:
        """Delete the finished jobs beyond the history limits, oldest first; never one in `in_use`."""
        limits = {"Succeeded": self.policy.successful_jobs_kept, "Failed": self.policy.failed_jobs_kept}
        actions: list[Action] = []
        for phase, limit in limits.items():
            finished = [j for j in jobs if j.phase == phase and j.name not in in_use]
            newest_first = sorted(finished, key=lambda j: (j.created_at, j.name), reverse=True)
            for job in reversed(newest_first[limit:]):
                reason = f"{phase.lower()}, beyond the {limit} newest kept"
                actions.append(DeleteCheckpointJob(job.name, reason))
                actions.append(EmitEvent("Normal", "CheckpointJobPruned", f"{job.name}: {reason}"))
        return tuple(actions)

    def _fire(self, state: ScheduleState, now: float) -> tuple[ScheduleState, list[Action]]:
        seq = state.seq + 1
        job = f"{state.name}-{seq}"
        state = replace(
            state, seq=seq, anchor=now, active_job=job, active_since=now, last_job=job, last_start=now
        )
        return state, [CreateCheckpointJob(job), EmitEvent("Normal", "CheckpointStarted", job)]

    def _settle(self, state: ScheduleState, now: float, actions: list[Action]) -> Transition[ScheduleState]:
        """Recompute the interval, fire if due, and say when to wake."""
        interval, cost = self.policy.interval(state.durations)
        if interval is None:
            state = replace(state, interval=None, cost=cost, next_fire=None, queued=False)
            return Transition(state, tuple(actions), None)
        due = state.anchor + interval
        if now >= due:
            if state.active_job is None:
                state, started = self._fire(state, now)
                actions += started
            elif self.policy.overlap is OverlapPolicy.QUEUE:
                if not state.queued:
                    message = f"{state.active_job} still runs: the next checkpoint starts when it ends"
                    actions.append(EmitEvent("Normal", "CheckpointQueued", message))
                state = replace(state, anchor=now, queued=True)
            else:
                message = f"{state.active_job} still runs: this checkpoint is skipped"
                actions.append(EmitEvent("Warning", "CheckpointSkipped", message))
                state = replace(state, anchor=now)
            due = state.anchor + interval
        state = replace(state, interval=interval, cost=cost, next_fire=due)
        return Transition(state, tuple(actions), due)
