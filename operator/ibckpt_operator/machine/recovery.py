"""The automatic-recovery machine of one protected workload. Pure: no I/O, no clock (docs/recovery.md).

    Idle ─▶ Fencing ─▶ Restoring ─▶ Recovered
    Idle: every pass feeds an Observation (the members, their nodes, the newest restorable Checkpoint).
      A trigger (a member's node NotReady/Unknown longer than the bound, its Node deleted, a member Failed
      or a container exited non-zero) starts a recovery: every member is stopped (deleted by uid).
    Fencing: a source still in the API is removed (grace 0) only once it is known not to run (`fenced`);
      once no source is left, a RestoreJob (latestOf the schedule, off the failed nodes) is created.
    Restoring: the RestoreJob's end is the recovery's.
    No restorable Checkpoint, or the restore failed: noCheckpoint decides:
      WaitForPerson      ─▶ WaitingForPerson (loud; nothing more is touched)
      RestartFromScratch ─▶ Fencing (from scratch) ─▶ RestartedFromScratch (each controller starts its
                            pods again; the operator creates bare pods again from their templates,
                            recorded when the recovery began, and drops them once created; an
                            operator restarted before that creates them again if absent)
    Fencing, Restoring: the deadline ─▶ Failed (the RestoreJob is cancelled).
    maxRecoveries already started within windowSeconds: a trigger ─▶ WaitingForPerson (TooManyRecoveries,
      nothing touched): a job that fails again after every restore is not restored forever.

Recovered, RestartedFromScratch, WaitingForPerson and Failed are at rest: a trigger on a pod that is not
one of the last recovery's sources starts the next one (seq + 1). While the drain machine moves the job
(`busy`), nothing triggers: its own Stop kills look like failures.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from ibckpt.api.schedule import FencingPolicy, NoCheckpointPolicy, RecoveryProtection
from ibckpt_operator.machine.core import Action, EmitEvent, Event, OperatorRestarted, PodRef, Transition

OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


class RecoveryPhase(StrEnum):
    IDLE = "Idle"
    FENCING = "Fencing"
    RESTORING = "Restoring"
    RECOVERED = "Recovered"
    RESTARTED = "RestartedFromScratch"
    WAITING = "WaitingForPerson"
    FAILED = "Failed"


AT_REST = frozenset(
    {RecoveryPhase.IDLE, RecoveryPhase.RECOVERED, RecoveryPhase.RESTARTED, RecoveryPhase.WAITING,
     RecoveryPhase.FAILED}
)  # fmt: skip
ACTIVE = frozenset({RecoveryPhase.FENCING, RecoveryPhase.RESTORING})


class Trigger(StrEnum):
    NODE_NOT_READY = "NodeNotReady"
    NODE_GONE = "NodeGone"
    POD_FAILED = "PodFailed"


@dataclass(frozen=True)
class RecoveryConfig:
    node_not_ready_seconds: float = 60.0
    pod_failure: bool = True
    no_checkpoint: NoCheckpointPolicy = NoCheckpointPolicy.WAIT_FOR_PERSON
    fencing: FencingPolicy = FencingPolicy.NODE_GONE
    deadline_seconds: float = 1800.0
    max_recoveries: int = 3
    window_seconds: float = 3600.0

    @classmethod
    def from_protection(cls, recovery: RecoveryProtection) -> RecoveryConfig:
        return cls(
            recovery.node_not_ready_seconds,
            recovery.pod_failure,
            recovery.no_checkpoint,
            recovery.fencing,
            recovery.deadline_seconds,
            recovery.max_recoveries,
            recovery.window_seconds,
        )


# Observations: what the driver saw on this pass.


@dataclass(frozen=True)
class NodeHealth:
    name: str
    exists: bool = True
    ready: bool = True  # the Ready condition is True (False and Unknown are not ready)
    since: float | None = None  # when Ready last changed (lastTransitionTime)
    out_of_service: bool = False  # carries the node.kubernetes.io/out-of-service taint


@dataclass(frozen=True)
class PodHealth:
    pod: PodRef
    phase: str = "Running"
    deleting: bool = False  # deletionTimestamp set: someone is stopping it on purpose
    running: bool = True  # a container runs or may yet start: not every one reported terminated
    failed_exit: int | None = None  # a container terminated (now or before a restart) with this code != 0
    failed_at: float | None = None  # when (its finishedAt), if known
    controlled: bool = False  # a controller ownerReference: something starts it again from scratch


@dataclass(frozen=True)
class CheckpointHint:
    """The newest restorable Checkpoint of the schedule, as the driver chose it (machine/latest.py)."""

    name: str
    taken_at: float


@dataclass(frozen=True)
class Observation(Event):
    pods: tuple[PodHealth, ...]  # the members still in the API (and, while fencing, the sources left)
    nodes: tuple[NodeHealth, ...] = ()
    checkpoint: CheckpointHint | None = None
    busy: bool = False  # a drain migration moves the job


@dataclass(frozen=True)
class RestoreBound(Event):
    """The RestoreJob chose its Checkpoint (spec.checkpointName written)."""

    job: str
    checkpoint: str
    taken_at: float | None


@dataclass(frozen=True)
class RestoreEnded(Event):
    job: str
    succeeded: bool
    message: str = ""


@dataclass(frozen=True)
class BarePodsCreated(Event):
    """The driver ran RecreatePods: the bare pods' templates have done their work."""


@dataclass(frozen=True)
class RecoveryState:
    name: str  # the schedule: names the RestoreJobs
    phase: RecoveryPhase = RecoveryPhase.IDLE
    seq: int = 0
    trigger: Trigger | None = None
    nodes: tuple[str, ...] = ()  # the failed nodes: the restore avoids them
    sources: tuple[PodRef, ...] = ()  # every member when the recovery began, pinned by uid
    from_scratch: bool = False
    restartable: bool = False  # every source starts again from scratch: by its controller, or bare
    bare: tuple[PodRef, ...] = ()  # sources with no controller (RestartFromScratch): the driver keeps
    # their templates from the recovery's start, and creates them again
    failed_at: float | None = None
    detected_at: float | None = None
    deadline: float | None = None
    ended_at: float | None = None
    restore_job: str | None = None
    checkpoint: str | None = None
    checkpoint_time: float | None = None
    reason: str | None = None
    message: str | None = None
    recent: tuple[float, ...] = ()  # detection times of the recoveries that stopped the job, in the window

    @property
    def work_lost(self) -> float | None:
        if self.failed_at is None or self.checkpoint_time is None:
            return None
        return max(0.0, self.failed_at - self.checkpoint_time)


# Actions.


@dataclass(frozen=True)
class StopPods(Action):
    """Delete these pods (bound to their uids, normal grace): a live kubelet kills them; the kubelet of a
    node that comes back kills them too."""

    pods: tuple[PodRef, ...]


@dataclass(frozen=True)
class RecreatePods(Action):
    """Create these bare pods again from scratch, from the templates kept when the recovery began (under
    their names, if absent)."""

    pods: tuple[PodRef, ...]


@dataclass(frozen=True)
class RemovePods(Action):
    """Complete the deletion of these fenced pods (grace 0, bound to their uids): none of them runs."""

    pods: tuple[PodRef, ...]


@dataclass(frozen=True)
class StartRecoveryRestore(Action):
    """Create (if absent) the RestoreJob `job`: latestOf this schedule, avoiding `avoid_nodes`, owned by it.
    `checkpoint` is the driver's own choice, only to tell whether the workload's controller creates the
    pods (a StatefulSet: podsCreatedBy Controller)."""

    job: str
    avoid_nodes: tuple[str, ...]
    checkpoint: str | None


@dataclass(frozen=True)
class CancelRestore(Action):
    job: str


@dataclass(frozen=True)
class RecordRecovery(Action):
    """A recovery ended: ibckpt_recoveries_total{outcome}, its duration and the work lost."""

    outcome: str  # Recovered, RestartedFromScratch, WaitingForPerson, Failed
    seconds: float
    work_lost: float | None


@dataclass(frozen=True)
class Found:
    """One trigger found in an Observation."""

    trigger: Trigger
    pod: PodRef
    node: str
    since: float
    why: str


@dataclass
class Triggers:
    found: list[Found] = field(default_factory=list)
    wake_at: float | None = None  # a NotReady node that reaches the bound then


def triggers(observation: Observation, config: RecoveryConfig, now: float, ignore: set[str]) -> Triggers:
    """Every trigger among the members (those in `ignore`, by uid, excepted), and when a pending one
    (a node NotReady, not yet for the bound) fires."""
    nodes = {node.name: node for node in observation.nodes}
    result = Triggers()
    for health in observation.pods:
        pod = health.pod
        if pod.uid in ignore or health.deleting:
            continue
        node = nodes.get(pod.node) if pod.node else None
        if pod.node and node is not None and not node.exists:
            result.found.append(Found(Trigger.NODE_GONE, pod, pod.node, now, f"node {pod.node} was deleted"))
        elif node is not None and not node.ready:
            since = node.since if node.since is not None else now
            due = since + config.node_not_ready_seconds
            if now >= due:
                why = f"node {pod.node} not ready for {now - since:.0f}s"
                result.found.append(Found(Trigger.NODE_NOT_READY, pod, pod.node, since, why))
            elif result.wake_at is None or due < result.wake_at:
                result.wake_at = due
        if config.pod_failure and (health.phase == "Failed" or health.failed_exit is not None):
            code = f"exit code {health.failed_exit}" if health.failed_exit is not None else "phase Failed"
            at = health.failed_at if health.failed_at is not None else now
            result.found.append(
                Found(Trigger.POD_FAILED, pod, pod.node, at, f"pod {pod.name} failed ({code})")
            )
    return result


def fenced(health: PodHealth, node: NodeHealth | None, config: RecoveryConfig) -> str | None:
    """Why this pod is known not to run (so its rank may run elsewhere), or None. The rule
    (docs/recovery.md): the kubelet reported it ended for good (phase Failed/Succeeded: never restarted),
    or, on a reachable node, being deleted with every container reported terminated (a kubelet starts no
    container of a pod being deleted); or its Node object is gone; or, under OutOfServiceTaint, the node
    is tainted out-of-service. A NotReady node's stale report of a running or restartable pod never counts."""
    if health.phase in ("Failed", "Succeeded"):
        return f"its kubelet reported it {health.phase}"
    if node is None or not node.exists:
        return f"node {health.pod.node or '?'} is gone"
    if node.ready and health.deleting and not health.running:
        return "its kubelet killed it"
    if config.fencing is FencingPolicy.OUT_OF_SERVICE_TAINT and node.out_of_service:
        return f"node {node.name} is tainted {OUT_OF_SERVICE}"
    return None


class RecoveryMachine:
    def __init__(self, config: RecoveryConfig) -> None:
        self.config = config

    def start(self, name: str) -> Transition[RecoveryState]:
        return Transition(RecoveryState(name=name))

    def handle(self, state: RecoveryState, event: Event, now: float) -> Transition[RecoveryState]:
        if isinstance(event, Observation):
            if state.phase in AT_REST:
                return self._watch(state, event, now)
            if state.phase is RecoveryPhase.FENCING:
                return self._fence(state, event, now)
        elif isinstance(event, RestoreBound) and event.job == state.restore_job:
            if state.phase is RecoveryPhase.RESTORING and event.checkpoint != state.checkpoint:
                state = replace(state, checkpoint=event.checkpoint, checkpoint_time=event.taken_at)
        elif isinstance(event, RestoreEnded) and event.job == state.restore_job:
            if state.phase is RecoveryPhase.RESTORING:
                return self._restored(state, event, now)
        elif isinstance(event, BarePodsCreated):
            if state.phase is RecoveryPhase.RESTARTED:
                return Transition(replace(state, bare=()))
        elif isinstance(event, OperatorRestarted):
            return self._restarted(state, now)
        return self._tick(state, now)

    # Detection.

    def _watch(self, state: RecoveryState, seen: Observation, now: float) -> Transition[RecoveryState]:
        if seen.busy:
            return Transition(state)
        found = triggers(seen, self.config, now, {pod.uid for pod in state.sources})
        if not found.found:
            return Transition(state, (), found.wake_at)
        first = min(found.found, key=lambda f: f.since)
        recent = tuple(t for t in state.recent if t > now - self.config.window_seconds)
        seq = state.seq + 1
        sources = tuple(health.pod for health in seen.pods if not health.deleting)
        failed_nodes = sorted({f.node for f in found.found if f.trigger is not Trigger.POD_FAILED and f.node})
        why = "; ".join(dict.fromkeys(f.why for f in found.found))
        state = RecoveryState(
            name=state.name,
            phase=RecoveryPhase.FENCING,
            seq=seq,
            trigger=first.trigger,
            nodes=tuple(failed_nodes),
            sources=sources,
            failed_at=first.since,
            detected_at=now,
            deadline=now + self.config.deadline_seconds,
            restartable=bool(sources),
            recent=recent,
        )
        if self.config.no_checkpoint is NoCheckpointPolicy.RESTART_FROM_SCRATCH:
            bare = tuple(h.pod for h in seen.pods if not h.deleting and not h.controlled)
            state = replace(state, bare=bare)
        if len(recent) >= self.config.max_recoveries:
            return self._too_many(state, why, now)
        hint = seen.checkpoint
        if hint is None:
            scratch = self.config.no_checkpoint is NoCheckpointPolicy.RESTART_FROM_SCRATCH
            if not (scratch and state.restartable):
                if scratch:
                    text = (
                        f"{why}; no restorable Checkpoint of {state.name}, and none of its pods is left to "
                        "start again from scratch: waiting for a person"
                    )
                    return self._wait_for_person(state, "NoPods", text, now)
                text = (
                    f"{why}; no restorable Checkpoint of {state.name}: nothing was touched, waiting for a "
                    "person (recovery.noCheckpoint: RestartFromScratch would start it again from scratch)"
                )
                return self._wait_for_person(state, "NoCheckpoint", text, now)
            state = replace(state, from_scratch=True)
            target = "restarting from scratch (no restorable Checkpoint)"
        else:
            state = replace(state, checkpoint=hint.name, checkpoint_time=hint.taken_at)
            target = f"restoring from {hint.name}"
        text = f"{why}: stopping every pod of {state.name}, {target}"
        state = replace(state, reason=first.trigger.value, message=text, recent=(*recent, now))
        started = (StopPods(sources), EmitEvent("Warning", "RecoveryStarted", text))
        fencing = self._fence(state, seen, now)
        return Transition(fencing.state, (*started, *fencing.actions), fencing.wake_at)

    def _too_many(self, state: RecoveryState, why: str, now: float) -> Transition[RecoveryState]:
        """The bound on recoveries in a row: the job keeps failing after its restores (a bug, bad input, a
        checkpoint that carries the fault), so another restore would only loop."""
        window = self.config.window_seconds
        text = (
            f"{why}; {len(state.recent)} recoveries of {state.name} began within the last {window:.0f}s "
            f"(recovery.maxRecoveries: {self.config.max_recoveries}): the job fails again after its "
            "restores, so nothing was touched; waiting for a person (a RestoreJob restores it by hand; "
            "a failure of a new pod once the window has passed starts a recovery again; disabling and "
            "enabling recovery resets the count)"
        )
        return self._wait_for_person(state, "TooManyRecoveries", text, now)

    # Fencing: no source may run when its rank starts elsewhere.

    def _fence(self, state: RecoveryState, seen: Observation, now: float) -> Transition[RecoveryState]:
        if self._overdue(state, now):
            return self._tick(state, now)
        present = {health.pod.uid: health for health in seen.pods}
        nodes = {node.name: node for node in seen.nodes}
        remove: list[PodRef] = []
        unfenced: list[str] = []
        for pod in state.sources:
            health = present.get(pod.uid)
            if health is None:
                continue
            if fenced(health, nodes.get(pod.node), self.config) is not None:
                remove.append(pod)
            else:
                unfenced.append(f"{pod.name} on {pod.node or '?'}")
        if unfenced:
            how = "delete its Node object"
            if self.config.fencing is FencingPolicy.OUT_OF_SERVICE_TAINT:
                how += f", or taint it {OUT_OF_SERVICE}"
            verb = "is" if len(unfenced) == 1 else "are"
            text = (
                f"{state.reason}: waiting until {', '.join(unfenced)} {verb} known not to run (its kubelet "
                f"confirms the kill, or {how})"
            )
            state = replace(state, message=text)
            actions: tuple[Action, ...] = (RemovePods(tuple(remove)),) if remove else ()
            return Transition(state, actions, state.deadline)
        if remove:  # fenced but still in the API: their removal frees the names
            return Transition(state, (RemovePods(tuple(remove)),), state.deadline)
        if state.from_scratch:
            return self._start_from_scratch(state, now)
        job = f"{state.name}-recover-{state.seq}"
        state = replace(
            state,
            phase=RecoveryPhase.RESTORING,
            restore_job=job,
            message=f"every pod of {state.name} stopped; restoring the latest checkpoint ({job})",
        )
        return Transition(state, (StartRecoveryRestore(job, state.nodes, state.checkpoint),), state.deadline)

    def _start_from_scratch(self, state: RecoveryState, now: float) -> Transition[RecoveryState]:
        text = f"every pod of {state.name} stopped; "
        controlled = len(state.sources) - len(state.bare)
        if state.bare:
            names = ", ".join(pod.name for pod in state.bare)
            text += f"the operator created {names} again from scratch, from their specs"
            text += "; their controllers start the others" if controlled else ""
        else:
            text += "its controllers start them again from scratch"
        end = self._end(state, RecoveryPhase.RESTARTED, "NoCheckpoint", text, now, "Warning")
        actions = (RecreatePods(state.bare),) if state.bare else ()
        return Transition(end.state, (*actions, *end.actions))

    # The end.

    def _restored(self, state: RecoveryState, event: RestoreEnded, now: float) -> Transition[RecoveryState]:
        if event.succeeded:
            lost = state.work_lost
            note = "" if lost is None else f", {lost:.0f}s of work lost"
            seconds = now - (state.detected_at or now)
            text = f"{state.name} restored from {state.checkpoint} in {seconds:.0f}s{note}"
            return self._end(state, RecoveryPhase.RECOVERED, "Recovered", text, now, "Normal")
        text = f"restore failed: {event.message}"
        if self.config.no_checkpoint is NoCheckpointPolicy.RESTART_FROM_SCRATCH and state.restartable:
            # Its pods were stopped by the failed restore: back to fencing, from scratch this time.
            state = replace(state, phase=RecoveryPhase.FENCING, from_scratch=True, message=text)
            return Transition(state, (EmitEvent("Warning", "RestoreFailed", text),), state.deadline)
        return self._wait_for_person(state, "RestoreFailed", f"{text}; waiting for a person", now)

    def _wait_for_person(
        self, state: RecoveryState, reason: str, text: str, now: float
    ) -> Transition[RecoveryState]:
        return self._end(state, RecoveryPhase.WAITING, reason, text, now, "Warning", event="RecoveryWaiting")

    def _end(
        self,
        state: RecoveryState,
        phase: RecoveryPhase,
        reason: str,
        text: str,
        now: float,
        kind: str,
        event: str | None = None,
    ) -> Transition[RecoveryState]:
        state = replace(state, phase=phase, reason=reason, message=text, ended_at=now)
        seconds = now - (state.detected_at or now)
        lost = state.work_lost if phase is RecoveryPhase.RECOVERED else None
        actions = (
            EmitEvent(kind, event or phase.value, text),
            RecordRecovery(phase.value, seconds, lost),
        )
        return Transition(state, actions)

    def _overdue(self, state: RecoveryState, now: float) -> bool:
        return state.phase in ACTIVE and state.deadline is not None and now >= state.deadline

    def _tick(self, state: RecoveryState, now: float) -> Transition[RecoveryState]:
        if self._overdue(state, now):
            waited = now - (state.detected_at or now)
            text = f"not recovered after {waited:.0f}s ({state.phase.value}): {state.message}"
            actions: tuple[Action, ...] = ()
            if state.phase is RecoveryPhase.RESTORING and state.restore_job is not None:
                actions = (CancelRestore(state.restore_job),)
            end = self._end(state, RecoveryPhase.FAILED, "RecoveryDeadlineExceeded", text, now, "Warning",
                            event="RecoveryFailed")  # fmt: skip
            return Transition(end.state, (*actions, *end.actions))
        return Transition(state, (), state.deadline if state.phase in ACTIVE else None)

    def _restarted(self, state: RecoveryState, now: float) -> Transition[RecoveryState]:
        """Every side effect is idempotent or create-if-absent by name: issue the phase's again."""
        actions: list[Action] = []
        if state.phase is RecoveryPhase.FENCING:
            actions.append(StopPods(state.sources))
        elif state.phase is RecoveryPhase.RESTORING and state.restore_job is not None:
            actions.append(StartRecoveryRestore(state.restore_job, state.nodes, state.checkpoint))
        elif state.phase is RecoveryPhase.RESTARTED and state.bare:  # ended before they were created
            actions.append(RecreatePods(state.bare))
        tick = self._tick(state, now)
        return Transition(tick.state, (*actions, *tick.actions), tick.wake_at)
