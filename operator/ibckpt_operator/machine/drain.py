"""The drain-migration machine of one protected workload, and the eviction webhook's answer. Pure: no I/O,
no clock (docs/drains.md).

    Idle ─▶ Holding ─▶ Checkpointing ─▶ Committed ─▶ Releasing ─▶ Restoring ─▶ Done
    Idle: the PDB (maxUnavailable 0) is kept. A drained node or an eviction of a member: Holding, a
    CheckpointJob (mode Stop, every pod) is created. Checkpointing: it touches the ranks. Committed: the
    manifest is written; the job publishes the Checkpoint and kills the sources by UID. Releasing: the PDB
    is deleted, evictions of sources are allowed. Restoring: the workload's controller or a RestoreJob
    brings the job back off the drained nodes.
    Holding, Checkpointing: deadline or failed checkpoint ─▶ onFailure:
      ProceedAndLose ─▶ Lost (cancel the job, relax the PDB: the drain evicts, running state is lost)
      KeepHolding    ─▶ Held (429 with a loud message; a Warning and, if none runs, a new CheckpointJob
                        every retry; its commit goes on to Committed)
    Holding, Checkpointing, Held: every drained node uncordoned ─▶ Idle (the CheckpointJob is cancelled)
    Restoring: restore failed ─▶ Failed (the checkpoint is good: the message names it)
    Idle, Held, Lost: a cancelled CheckpointJob that committed anyway ─▶ Committed (it kills the sources)

An eviction is answered from the state (`answer_eviction`): a source pod may go only once its checkpoint is
committed and the hold released; every other answer is 429 with a message saying why and for how long.
Done, Lost and Failed end one migration; the next drain starts another (seq + 1) from any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from ibckpt.api.schedule import DrainProtection, OnDrainFailure
from ibckpt_operator.machine.core import (
    Action,
    EmitEvent,
    Event,
    OperatorRestarted,
    PodRef,
    Tick,
    Transition,
)


class DrainPhase(StrEnum):
    IDLE = "Idle"
    HOLDING = "Holding"
    CHECKPOINTING = "Checkpointing"
    COMMITTED = "Committed"
    RELEASING = "Releasing"
    RESTORING = "Restoring"
    DONE = "Done"
    HELD = "Held"
    LOST = "Lost"
    FAILED = "Failed"


# A new drain may start a migration from these.
AT_REST = frozenset({DrainPhase.IDLE, DrainPhase.DONE, DrainPhase.LOST, DrainPhase.FAILED})
# The checkpoint is not committed yet: the deadline and the failure policy apply, an uncordon cancels.
BEFORE_COMMIT = frozenset({DrainPhase.HOLDING, DrainPhase.CHECKPOINTING, DrainPhase.HELD})
# A cancelled CheckpointJob that commits anyway is followed from these.
LATE_COMMIT = frozenset({DrainPhase.IDLE, DrainPhase.HELD, DrainPhase.LOST})
# Evictions of source pods are answered 429.
HOLDS = BEFORE_COMMIT | {DrainPhase.COMMITTED}


@dataclass(frozen=True)
class DrainConfig:
    deadline_seconds: float = 1800.0
    on_failure: OnDrainFailure = OnDrainFailure.KEEP_HOLDING
    retry_seconds: float = 120.0
    restore: bool = True

    @classmethod
    def from_protection(cls, drain: DrainProtection) -> DrainConfig:
        return cls(drain.deadline_seconds, drain.on_failure, drain.retry_seconds, drain.restore)


@dataclass(frozen=True)
class DrainState:
    name: str  # the schedule (one protected workload): names the PDB and the jobs
    phase: DrainPhase = DrainPhase.IDLE
    seq: int = 0  # migrations started; a retry under KeepHolding is a new CheckpointJob of the same one
    tries: int = 0
    nodes: tuple[str, ...] = ()  # drained nodes to move off
    sources: tuple[PodRef, ...] = ()  # the members when the hold began, pinned by UID
    held_since: float | None = None
    deadline: float | None = None
    next_retry: float | None = None
    checkpoint_job: str | None = None
    # A CheckpointJob ignores a cancel after its commit and kills the sources: one we cancelled may still
    # commit, and then the job must be restored.
    cancelled_job: str | None = None
    checkpoint: str | None = None  # the Checkpoint the job writes (its name is chosen here, in advance)
    restore_job: str | None = None
    reason: str | None = None
    message: str | None = None


# Events: what the operator observed.


@dataclass(frozen=True)
class NodeDraining(Event):
    """A node running a member became unschedulable (cordon, or an autoscaler's drain taint)."""

    node: str
    members: tuple[PodRef, ...]


@dataclass(frozen=True)
class NodeUncordoned(Event):
    node: str


@dataclass(frozen=True)
class EvictionRequested(Event):
    """The webhook saw an eviction of a member (fed before answering, so the answer sees the hold)."""

    pod: PodRef
    members: tuple[PodRef, ...]


@dataclass(frozen=True)
class CheckpointStarted(Event):
    """The CheckpointJob claimed and admitted its pods: ranks are being touched."""

    job: str


@dataclass(frozen=True)
class CheckpointCommitted(Event):
    job: str
    checkpoint: str


@dataclass(frozen=True)
class CheckpointFailed(Event):
    job: str
    reason: str
    message: str


@dataclass(frozen=True)
class SourcesStopped(Event):
    """The CheckpointJob (Stop) ended: every source pod was killed by UID, or is gone."""

    job: str


@dataclass(frozen=True)
class PdbRelaxed(Event):
    """The PDB is gone (deleted, or found absent): the release is done before any restore starts."""


@dataclass(frozen=True)
class RestoreSucceeded(Event):
    job: str


@dataclass(frozen=True)
class RestoreFailed(Event):
    job: str
    message: str


# Actions.


@dataclass(frozen=True)
class EnsurePdb(Action):
    """Keep a PodDisruptionBudget with maxUnavailable 0 over the workload's pods (policy/v1, or v1beta1)."""

    name: str


@dataclass(frozen=True)
class RelaxPdb(Action):
    """Delete that PDB, so the drain's evictions go through."""

    name: str


@dataclass(frozen=True)
class CreateMigrationCheckpoint(Action):
    """Create (if absent) a CheckpointJob from the template with mode Stop, over every pod of the job,
    writing the Checkpoint `checkpoint`."""

    job: str
    checkpoint: str


@dataclass(frozen=True)
class CancelCheckpointJob(Action):
    """Delete the CheckpointJob: before its commit that aborts it and every rank resumes."""

    job: str


@dataclass(frozen=True)
class StartRestore(Action):
    """Bring the job back from `checkpoint` off `avoid_nodes`: through the workload's controller when it
    has one (new pods restore from the checkpoint, names and hostnames kept), else a RestoreJob `job`."""

    job: str
    checkpoint: str
    avoid_nodes: tuple[str, ...]


@dataclass(frozen=True)
class RecordMigration(Action):
    """A migration ended: the metric ibckpt_drain_migrations_total{outcome} and its duration."""

    outcome: str  # Migrated, Lost, Failed, Cancelled
    seconds: float


@dataclass(frozen=True)
class EvictionAnswer:
    allowed: bool
    code: int = 200
    message: str = ""
    retry_after_seconds: int | None = None


def answer_eviction(state: DrainState, pod_uid: str, now: float, config: DrainConfig) -> EvictionAnswer:
    """What the webhook on pods/eviction answers for a member pod, from the state after the request was fed
    to the machine. A source may go once the hold is released; a restored pod is held while it restores."""
    source = any(pod.uid == pod_uid for pod in state.sources)
    if state.phase in (DrainPhase.RELEASING, DrainPhase.RESTORING, DrainPhase.LOST) and source:
        return EvictionAnswer(True)
    if state.phase is DrainPhase.RESTORING:
        return _deny(f"ibckpt: {state.name} is being restored from {state.checkpoint}", 30)
    if state.phase is DrainPhase.HELD:
        return _deny(
            f"ibckpt is HOLDING this drain: migrating {state.name} failed: {state.message}. Fix it, or set "
            f"drain.onFailure: ProceedAndLose on CheckpointSchedule {state.name} to let the drain go on and "
            "lose the running state",
            int(config.retry_seconds),
        )
    if state.phase in HOLDS:
        left = max(0.0, (state.deadline or now) - now)
        return _deny(
            f"ibckpt: checkpointing {state.name} before it leaves {', '.join(state.nodes) or 'its node'} "
            f"({state.phase.value}, {left:.0f}s left of the migration deadline)",
            10,
        )
    if state.phase in AT_REST:  # the handler fed the request first: a migration starts for this pod
        return _deny(f"ibckpt: {state.name} is protected; a migration starts for it", 10)
    return _deny(f"ibckpt: {state.name} is migrating; this pod is not one it released", 10)


def _deny(message: str, retry: int) -> EvictionAnswer:
    return EvictionAnswer(False, 429, message, retry)


class DrainMachine:
    def __init__(self, config: DrainConfig) -> None:
        self.config = config

    def start(self, name: str) -> Transition[DrainState]:
        return Transition(DrainState(name=name), (EnsurePdb(name),))

    def handle(self, state: DrainState, event: Event, now: float) -> Transition[DrainState]:
        if isinstance(event, (NodeDraining, EvictionRequested)):
            return self._drain(state, event, now)
        if isinstance(event, NodeUncordoned):
            return self._uncordon(state, event, now)
        if isinstance(event, OperatorRestarted):
            return self._restarted(state, now)
        if isinstance(event, CheckpointStarted) and self._mine(state, event.job):
            # A retry under Held stays Held: the hold is overdue and keeps saying so.
            if state.phase is DrainPhase.HOLDING:
                state = replace(state, phase=DrainPhase.CHECKPOINTING)
            return self._wake(state)
        if isinstance(event, CheckpointCommitted):
            ours = self._mine(state, event.job) and state.phase in BEFORE_COMMIT
            late = event.job == state.cancelled_job and state.phase in LATE_COMMIT
            if ours or late:
                actions: list[Action] = []
                if late and state.checkpoint_job not in (None, event.job):
                    actions.append(CancelCheckpointJob(str(state.checkpoint_job)))  # a retry: not needed now
                state = replace(
                    state,
                    phase=DrainPhase.COMMITTED,
                    checkpoint_job=event.job,
                    checkpoint=event.checkpoint,
                    reason=None,
                    message=None,
                )
                note = f"{event.checkpoint} committed; stopping the sources, then releasing the drain"
                if late:
                    note = f"{event.checkpoint} committed before the cancel reached it; migrating after all"
                actions.append(EmitEvent("Normal", "MigrationCommitted", note))
                return Transition(state, tuple(actions))
            return self._wake(state)
        if isinstance(event, CheckpointFailed) and self._mine(state, event.job):
            if state.phase in BEFORE_COMMIT:
                return self._give_up(state, event.reason, event.message, now, job_ended=True)
            return self._wake(state)
        if isinstance(event, SourcesStopped) and self._mine(state, event.job):
            if state.phase is DrainPhase.COMMITTED:
                return self._release(state)
            return self._wake(state)
        if isinstance(event, PdbRelaxed) and state.phase is DrainPhase.RELEASING:
            return self._restore(state, now)
        if isinstance(event, (RestoreSucceeded, RestoreFailed)) and event.job == state.restore_job:
            if state.phase is DrainPhase.RESTORING:
                return self._restored(state, event, now)
            return self._wake(state)
        if isinstance(event, Tick):
            return self._tick(state, now)
        return self._wake(state)

    # Entering and leaving a hold.

    def _drain(
        self, state: DrainState, event: NodeDraining | EvictionRequested, now: float
    ) -> Transition[DrainState]:
        node = event.node if isinstance(event, NodeDraining) else event.pod.node
        evicted = event.pod.uid if isinstance(event, EvictionRequested) else None
        if state.phase is DrainPhase.LOST and any(pod.uid == evicted for pod in state.sources):
            # The policy let this drain proceed: its sources' evictions are what it allowed, not a drain.
            return self._wake(state)
        if state.phase in AT_REST:
            seq = state.seq + 1
            job = f"{state.name}-drain-{seq}"
            state = DrainState(
                name=state.name,
                phase=DrainPhase.HOLDING,
                seq=seq,
                tries=1,
                nodes=(node,) if node else (),
                sources=event.members,
                held_since=now,
                deadline=now + self.config.deadline_seconds,
                checkpoint_job=job,
                checkpoint=job,
                reason="DrainHeld",
                message=f"holding the drain of {node or 'a member'}: checkpointing before it moves",
            )
            actions: tuple[Action, ...] = (
                EnsurePdb(state.name),
                CreateMigrationCheckpoint(job, job),
                EmitEvent(
                    "Warning", "DrainHeld", f"{state.message} (deadline {self.config.deadline_seconds:g}s)"
                ),
            )
            return Transition(state, actions, state.deadline)
        # A running migration grows by drained nodes only: an eviction of a member elsewhere does not make
        # its node one to move off (kubectl drain cordons first; the cordon is what joins).
        if isinstance(event, NodeDraining) and node not in state.nodes:
            state = replace(state, nodes=(*state.nodes, node))
        return self._wake(state)

    def _uncordon(self, state: DrainState, event: NodeUncordoned, now: float) -> Transition[DrainState]:
        if event.node not in state.nodes:
            return self._wake(state)
        nodes = tuple(node for node in state.nodes if node != event.node)
        if nodes or state.phase not in BEFORE_COMMIT:
            # After the commit the sources are being stopped: the migration goes on.
            return self._wake(replace(state, nodes=nodes))
        actions: list[Action] = [
            EmitEvent("Normal", "DrainCancelled", "every drained node is schedulable again")
        ]
        if state.checkpoint_job is not None:
            actions.insert(0, CancelCheckpointJob(state.checkpoint_job))
        actions.append(RecordMigration("Cancelled", now - (state.held_since or now)))
        idle = DrainState(
            name=state.name,
            seq=state.seq,
            sources=state.sources,
            held_since=state.held_since,
            cancelled_job=state.checkpoint_job,
            reason="DrainCancelled",
            message="node uncordoned",
        )
        return Transition(idle, tuple(actions))

    def _give_up(
        self, state: DrainState, reason: str, message: str, now: float, *, job_ended: bool
    ) -> Transition[DrainState]:
        """A deadline or a failed checkpoint, before the commit: the user's policy decides."""
        actions: list[Action] = []
        if state.checkpoint_job is not None and not job_ended:
            actions.append(CancelCheckpointJob(state.checkpoint_job))
            state = replace(state, cancelled_job=state.checkpoint_job)
        if self.config.on_failure is OnDrainFailure.PROCEED_AND_LOSE:
            text = (
                f"{reason}: {message}; letting the drain proceed: the running state of {state.name} is lost"
            )
            state = replace(state, phase=DrainPhase.LOST, checkpoint_job=None, reason=reason, message=text)
            actions += [
                RelaxPdb(state.name),
                EmitEvent("Warning", "DrainProceededStateLost", text),
                RecordMigration("Lost", now - (state.held_since or now)),
            ]
            return Transition(state, tuple(actions))
        retry = now + self.config.retry_seconds
        nodes = ", ".join(state.nodes) or "its node"
        every = f"{self.config.retry_seconds:g}s"
        text = f"{reason}: {message}; still holding the drain of {nodes}, retrying every {every}"
        state = replace(
            state, phase=DrainPhase.HELD, checkpoint_job=None, next_retry=retry, reason=reason, message=text
        )
        actions.append(EmitEvent("Warning", "DrainHeld", text))
        return Transition(state, tuple(actions), retry)

    def _tick(self, state: DrainState, now: float) -> Transition[DrainState]:
        overdue = state.deadline is not None and now >= state.deadline
        if state.phase in (DrainPhase.HOLDING, DrainPhase.CHECKPOINTING) and overdue:
            waited = now - (state.held_since or now)
            message = f"no committed checkpoint after {waited:.0f}s"
            return self._give_up(state, "MigrationDeadlineExceeded", message, now, job_ended=False)
        if state.phase is DrainPhase.HELD and state.next_retry is not None and now >= state.next_retry:
            if state.checkpoint_job is not None:  # the retry still runs: say so again, start nothing
                state = replace(state, next_retry=now + self.config.retry_seconds)
                text = f"drain still held ({state.reason}); {state.checkpoint_job} is still running"
                return Transition(state, (EmitEvent("Warning", "DrainHeld", text),), state.next_retry)
            tries = state.tries + 1
            job = f"{state.name}-drain-{state.seq}-{tries}"
            state = replace(
                state,
                tries=tries,
                checkpoint_job=job,
                checkpoint=job,
                next_retry=now + self.config.retry_seconds,
            )
            text = f"drain still held ({state.reason}); checkpoint attempt {tries}: {job}"
            return Transition(
                state,
                (CreateMigrationCheckpoint(job, job), EmitEvent("Warning", "DrainHeld", text)),
                state.next_retry,
            )
        if state.phase is DrainPhase.HELD and state.next_retry is not None:
            return Transition(state, (), state.next_retry)
        return self._wake(state)

    # After the commit.

    def _release(self, state: DrainState) -> Transition[DrainState]:
        state = replace(state, phase=DrainPhase.RELEASING)
        text = f"{state.checkpoint} committed and the sources stopped: the drain may go on"
        return Transition(state, (RelaxPdb(state.name), EmitEvent("Normal", "DrainReleased", text)))

    def _restore(self, state: DrainState, now: float) -> Transition[DrainState]:
        checkpoint = state.checkpoint
        assert checkpoint is not None
        if not self.config.restore:
            text = f"restore left to the user: a RestoreJob with checkpointName {checkpoint}"
            state = replace(state, phase=DrainPhase.DONE, reason="Migrated", message=text)
            return Transition(state, (RecordMigration("Migrated", now - (state.held_since or now)),))
        job = f"{state.name}-restore-{state.seq}"
        state = replace(state, phase=DrainPhase.RESTORING, restore_job=job)
        return Transition(state, (StartRestore(job, checkpoint, state.nodes),))

    def _restored(
        self, state: DrainState, event: RestoreSucceeded | RestoreFailed, now: float
    ) -> Transition[DrainState]:
        seconds = now - (state.held_since or now)
        if isinstance(event, RestoreSucceeded):
            text = f"{state.name} moved off {', '.join(state.nodes)} in {seconds:.0f}s"
            state = replace(state, phase=DrainPhase.DONE, reason="Migrated", message=text)
            actions: tuple[Action, ...] = (
                EnsurePdb(state.name),
                EmitEvent("Normal", "Migrated", text),
                RecordMigration("Migrated", seconds),
            )
            return Transition(state, actions)
        text = f"restore failed: {event.message}; checkpoint {state.checkpoint} is good: restore it by hand"
        state = replace(state, phase=DrainPhase.FAILED, reason="RestoreFailed", message=text)
        return Transition(
            state, (EmitEvent("Warning", "RestoreFailed", text), RecordMigration("Failed", seconds))
        )

    def _restarted(self, state: DrainState, now: float) -> Transition[DrainState]:
        """Every side effect is create-if-absent by name or idempotent: issue the phase's again."""
        actions: list[Action] = []
        if state.phase in AT_REST:
            if state.phase is not DrainPhase.LOST:
                actions.append(EnsurePdb(state.name))
        elif state.phase in (DrainPhase.HOLDING, DrainPhase.CHECKPOINTING):
            assert state.checkpoint_job is not None and state.checkpoint is not None
            actions += [
                EnsurePdb(state.name),
                CreateMigrationCheckpoint(state.checkpoint_job, state.checkpoint),
            ]
        elif state.phase is DrainPhase.HELD:
            actions.append(EnsurePdb(state.name))
        elif state.phase is DrainPhase.RELEASING:
            actions.append(RelaxPdb(state.name))
        elif state.phase is DrainPhase.RESTORING:
            assert state.restore_job is not None and state.checkpoint is not None
            actions += [RelaxPdb(state.name), StartRestore(state.restore_job, state.checkpoint, state.nodes)]
        transition = self._tick(state, now)
        return Transition(transition.state, (*actions, *transition.actions), transition.wake_at)

    def _mine(self, state: DrainState, job: str) -> bool:
        return job == state.checkpoint_job

    def _wake(self, state: DrainState) -> Transition[DrainState]:
        if state.phase in (DrainPhase.HOLDING, DrainPhase.CHECKPOINTING):
            return Transition(state, (), state.deadline)
        if state.phase is DrainPhase.HELD:
            return Transition(state, (), state.next_retry)
        return Transition(state, ())
