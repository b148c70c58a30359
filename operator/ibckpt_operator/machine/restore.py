"""The RestoreJob state machine: (state, event, now) -> (state, actions). Pure: no I/O, no clock.

    Pending -> Admitted -> Downloading -> Restoring -> Rebuilding -> Resuming -> Succeeded
    failure, deadline, lost pod or cancel in Pending, Admitted                          -> Failed
                                     in Downloading, Restoring, Rebuilding, Resuming -> CleaningUp -> Failed

Downloading asks the agents to download and stage the images (DownloadImages) before any destination
pod exists: the node's runtime wrapper holds a restored container's create only briefly (90 s) while it
waits for staged images, so the pods are created (CreatePods, in Restoring) only once every pod's images
are staged, or about to be (Overlap, below); the agents, told each pod's namespace and name, then
restore the pod of that name.

Overlap: each agent reports its download's bytes so far (StagingProgress). Once every node expects to be
done within CREATE_LEAD_SECONDS at the rate it has had (ImagesNearlyStaged), the pods are created while
the last bytes arrive: their scheduling, sandbox and create run beside the download instead of after it,
and the wrapper's hold covers the rest with room for a slower end. No part of a
job is left running by itself: once an agent session or a destination pod may exist, a failure aborts
the sessions and removes every restored rank and created pod (CleanUpRestore) before the job fails.
The Checkpoint stays valid for another RestoreJob. Placement honours the spec: a pod is never placed on
a node to avoid, nor back on its source node when avoidSourceNodes is set.

Members are keyed by pod name: a member's uid is its destination pod's, once created.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from ibckpt.api import RestoreJobSpec, RestorePhase
from ibckpt.vocabulary import Milestone
from ibckpt_operator.machine.actions import (
    AdmitNodes,
    AwaitMilestone,
    CleanUpRestore,
    CloseSession,
    CreatePods,
    DownloadImages,
    OpenSession,
    PlacePods,
    ResolveCheckpoint,
)
from ibckpt_operator.machine.core import (
    Action,
    Cancelled,
    EmitEvent,
    Event,
    Label,
    Mark,
    Member,
    OperatorRestarted,
    PodAdmitted,
    PodLost,
    PodRef,
    PodRefused,
    PodStepDone,
    RunState,
    SessionOpened,
    StepAction,
    StepFailed,
    StepRule,
    Tick,
    Transition,
    Unknown,
    all_marked,
    finish,
    issue,
    late_note,
    names_not_at,
    overdue,
    wake_at,
    with_progress,
)


def _with_progress(
    members: tuple[Member, ...], name: str, progress: str, **facts: object
) -> tuple[Member, ...]:
    """core.with_progress by pod name (a restore's key: the uid is the destination's, set on creation)."""
    key = next((m.key for m in members if m.pod.name == name), None)
    return members if key is None else with_progress(members, key, progress, **facts)  # type: ignore[arg-type]


class RestoreStep(StrEnum):
    RESOLVE = "resolve"
    PLACE = "place"
    ADMIT = "admit"
    OPEN_SESSION = "open-session"
    DOWNLOAD = "download"
    CREATE_PODS = "create-pods"
    RESTORE = "restore"
    REBUILD = "rebuild"
    RESUME = "resume"
    CLEAN_UP = "clean-up"


# Per step: what the driver does, the label a member gets when it finishes it, and what a restarted operator
# does when it finds the step in flight (core.StepRule). The coordinator session lives in the operator: a
# new operator cannot carry on a session its agents joined (they are staging images from Downloading on),
# and during the creation a pod may exist that status does not name yet (the clean-up finds it by this
# run's marker).
STEPS: Mapping[RestoreStep, StepRule] = {
    RestoreStep.RESOLVE: StepRule(ResolveCheckpoint, None, Unknown.REISSUE),
    RestoreStep.PLACE: StepRule(PlacePods, None, Unknown.REISSUE),
    RestoreStep.ADMIT: StepRule(AdmitNodes, Milestone.ADMITTED, Unknown.REISSUE),
    RestoreStep.OPEN_SESSION: StepRule(OpenSession, None, Unknown.REISSUE),
    RestoreStep.DOWNLOAD: StepRule(DownloadImages, Milestone.DOWNLOADED, Unknown.ABORT),
    RestoreStep.CREATE_PODS: StepRule(CreatePods, Mark.CREATED, Unknown.ABORT),
    # processes may or may not exist
    RestoreStep.RESTORE: StepRule(AwaitMilestone, Milestone.RESTORED, Unknown.ABORT),
    # rebuild publishes ids under an epoch; never twice blindly
    RestoreStep.REBUILD: StepRule(AwaitMilestone, Milestone.REBUILT, Unknown.ABORT),
    # reads the agents' reports of the session: Succeeded or not
    RestoreStep.RESUME: StepRule(AwaitMilestone, Milestone.RESUMED, Unknown.REISSUE),
    RestoreStep.CLEAN_UP: StepRule(CleanUpRestore, Mark.REMOVED, Unknown.REISSUE),
}
STEP_LABEL: Mapping[RestoreStep, Label | None] = {step: rule.label for step, rule in STEPS.items()}
ON_UNKNOWN: Mapping[RestoreStep, Unknown] = {step: rule.on_unknown for step, rule in STEPS.items()}
NEXT_STEP: Mapping[RestoreStep, tuple[RestoreStep, RestorePhase] | None] = {
    RestoreStep.ADMIT: (RestoreStep.OPEN_SESSION, RestorePhase.ADMITTED),
    # The pods are created once every pod's images are staged (or about to be: ImagesNearlyStaged);
    # creating them starts the restore.
    RestoreStep.DOWNLOAD: (RestoreStep.CREATE_PODS, RestorePhase.RESTORING),
    RestoreStep.CREATE_PODS: (RestoreStep.RESTORE, RestorePhase.RESTORING),
    RestoreStep.RESTORE: (RestoreStep.REBUILD, RestorePhase.REBUILDING),
    RestoreStep.REBUILD: (RestoreStep.RESUME, RestorePhase.RESUMING),
    RestoreStep.RESUME: None,  # done
}
TERMINAL = frozenset({RestorePhase.SUCCEEDED, RestorePhase.FAILED})
# Phases before any agent session or destination pod can exist: a failure just fails.
NOTHING_RESTORED = frozenset({RestorePhase.PENDING, RestorePhase.ADMITTED})


@dataclass(frozen=True)
class CheckpointResolved(Event):
    """The Checkpoint exists, is ready, and holds these pods (node: where each was checkpointed)."""

    attempt: str
    pods: tuple[PodRef, ...]


@dataclass(frozen=True)
class PodsPlaced(Event):
    """A destination node for each pod, by pod name."""

    attempt: str
    nodes: Mapping[str, str]


@dataclass(frozen=True)
class PodCreated(Event):
    """The destination pod of member `pod` (its name) exists with this uid."""

    attempt: str
    pod: str
    uid: str


# How soon every node must expect its download to end before the pods are created: well inside the
# wrapper's 90 s hold (hook/oci.py restore_wait_s), so an estimate three times too short still fits.
CREATE_LEAD_SECONDS = 30.0
# A node's rate is trusted only after this much of its download (the first chunks include the slow start).
RATE_SAMPLE_SECONDS = 2.0


@dataclass(frozen=True)
class ImagesNearlyStaged(Event):
    """Every destination node expects its images staged within `seconds_left` (staging_seconds_left)."""

    attempt: str
    seconds_left: float


def staging_seconds_left(done: int, planned: int, seconds: float) -> float | None:
    """The seconds a node's download still needs at the rate it has had so far (`done` of `planned` bytes
    in `seconds`); None while too little is known to say."""
    if done >= planned:
        return 0.0
    if done <= 0 or seconds < RATE_SAMPLE_SECONDS:
        return None
    return seconds * (planned - done) / done


@dataclass(frozen=True)
class RestoreConfig:
    checkpoint_name: str
    node_selector: Mapping[str, str] = field(default_factory=dict)
    avoid_nodes: tuple[str, ...] = ()
    avoid_source_nodes: bool = False
    timeouts: Mapping[RestorePhase, float] = field(default_factory=dict)
    active_deadline: float = 3600.0

    @classmethod
    def from_spec(cls, spec: RestoreJobSpec) -> RestoreConfig:
        if spec.checkpoint_name is None:  # latestOf: the handler binds one before the driver starts
            raise ValueError("no Checkpoint is chosen yet")
        t = spec.timeouts
        return cls(
            checkpoint_name=spec.checkpoint_name,
            node_selector=dict(spec.node_selector or {}),
            avoid_nodes=tuple(spec.avoid_nodes or ()),
            avoid_source_nodes=spec.avoid_source_nodes,
            timeouts={
                RestorePhase.PENDING: t.admit_seconds,
                RestorePhase.ADMITTED: t.admit_seconds,
                RestorePhase.DOWNLOADING: t.download_seconds,
                RestorePhase.RESTORING: t.restore_seconds,
                RestorePhase.REBUILDING: t.rebuild_seconds,
                RestorePhase.RESUMING: t.resume_seconds,
                RestorePhase.CLEANING_UP: t.cleanup_seconds,
            },
            active_deadline=spec.active_deadline_seconds,
        )


@dataclass(frozen=True)
class RestoreState(RunState[RestorePhase]):
    """RunState's fields, members keyed by pod name (node and uid are the destination's), and the phase a
    failure came from."""

    failed_from: RestorePhase | None = None


RestoreTransition = Transition[RestoreState]


class RestoreMachine:
    def __init__(self, config: RestoreConfig) -> None:
        self.config = config

    def start(self, run: str, now: float) -> RestoreTransition:
        state = RestoreState(phase=RestorePhase.PENDING, run=run, seq=0, started_at=now, phase_since=now)
        state, actions = self._issue(state, RestoreStep.RESOLVE, now)
        message = f"restoring checkpoint {self.config.checkpoint_name}"
        return self._done(state, [EmitEvent("Normal", "Pending", message), *actions])

    def handle(self, state: RestoreState, event: Event, now: float) -> RestoreTransition:
        if state.phase in TERMINAL:
            return Transition(state)
        if isinstance(event, OperatorRestarted):  # before any deadline, as a CheckpointJob's
            return self._restarted(state, now)
        expired = self._deadline(state, now)
        if expired is not None:
            return expired
        if isinstance(event, Cancelled):
            return self._abort(state, "Cancelled", "the RestoreJob was deleted", now)
        if isinstance(event, PodLost):
            if all(member.pod.name != event.pod for member in state.members):
                return self._done(state, [])
            members = _with_progress(state.members, event.pod, Mark.LOST, message=event.message)
            state = replace(state, members=members)
            if state.phase == RestorePhase.CLEANING_UP:
                return self._maybe_advance(state, now)
            return self._abort(state, "PodLost", f"{event.pod}: {event.message}", now)
        if isinstance(event, Tick) or getattr(event, "attempt", None) != state.attempt:
            return self._done(state, [])
        return self._result(state, event, now)

    def _result(self, state: RestoreState, event: Event, now: float) -> RestoreTransition:
        assert state.step is not None
        step = RestoreStep(state.step.kind)
        if isinstance(event, StepFailed):
            if state.phase == RestorePhase.CLEANING_UP:
                return self._fail(
                    state, state.reason or event.reason, f"{state.message}; {event.message}", now
                )
            where = f"{event.pod}: " if event.pod else ""
            return self._abort(state, event.reason, where + event.message, now)
        if isinstance(event, CheckpointResolved) and step == RestoreStep.RESOLVE:
            if not event.pods:
                return self._fail(state, "EmptyCheckpoint", "the checkpoint holds no pod", now)
            state = replace(state, members=tuple(Member(pod) for pod in event.pods))
            state, actions = self._issue(state, RestoreStep.PLACE, now)
            return self._done(state, actions)
        if isinstance(event, PodsPlaced) and step == RestoreStep.PLACE:
            problems = self._placement_problems(state, event.nodes)
            if problems:
                return self._fail(state, "PlacementRejected", "; ".join(problems), now)
            members = tuple(
                replace(m, pod=replace(m.pod, node=event.nodes[m.pod.name]), progress=Mark.PLACED)
                for m in state.members
            )
            state, actions = self._issue(replace(state, members=members), RestoreStep.ADMIT, now)
            return self._done(state, actions)
        if isinstance(event, PodRefused) and step == RestoreStep.ADMIT:
            members = _with_progress(state.members, event.pod, Mark.REFUSED, message=event.message)
            return self._fail(
                replace(state, members=members), "AdmissionRefused", f"{event.pod}: {event.message}", now
            )
        if isinstance(event, SessionOpened) and step == RestoreStep.OPEN_SESSION:
            state, actions = self._issue(state, RestoreStep.DOWNLOAD, now, RestorePhase.DOWNLOADING)
            return self._done(state, actions)
        if isinstance(event, ImagesNearlyStaged) and step == RestoreStep.DOWNLOAD:
            if event.seconds_left > CREATE_LEAD_SECONDS:
                return self._done(state, [])
            note = EmitEvent(
                "Normal",
                "CreatingPods",
                f"every node expects its images staged within {event.seconds_left:.0f}s: "
                "creating the pods while the last bytes arrive",
            )
            state, actions = self._issue(state, RestoreStep.CREATE_PODS, now, RestorePhase.RESTORING)
            return self._done(state, [note, *actions])
        if isinstance(event, PodCreated) and step == RestoreStep.CREATE_PODS:
            if all(member.pod.name != event.pod for member in state.members):
                return self._done(state, [])
            members = tuple(
                replace(m, pod=replace(m.pod, uid=event.uid)) if m.pod.name == event.pod else m
                for m in state.members
            )
            members = _with_progress(members, event.pod, STEP_LABEL[step] or "")
            return self._maybe_advance(replace(state, members=members), now)
        if isinstance(event, (PodAdmitted, PodStepDone)) and STEP_LABEL[step] is not None:
            if (
                isinstance(event, PodAdmitted) != (step == RestoreStep.ADMIT)
                or step == RestoreStep.CREATE_PODS
            ):
                return self._done(state, [])
            if all(member.pod.name != event.pod for member in state.members):
                return self._done(state, [])
            size = event.bytes if isinstance(event, PodStepDone) else None
            seconds = event.seconds if isinstance(event, PodStepDone) else None
            label = STEP_LABEL[step] or ""
            members = _with_progress(state.members, event.pod, label, bytes=size, seconds=seconds)
            return self._maybe_advance(replace(state, members=members), now)
        return self._done(state, [])

    def _maybe_advance(self, state: RestoreState, now: float) -> RestoreTransition:
        assert state.step is not None
        step = RestoreStep(state.step.kind)
        label = STEP_LABEL[step]
        if label is None or names_not_at(state.members, label):
            return self._done(state, [])
        if step == RestoreStep.CLEAN_UP:
            return self._fail(state, state.reason or "Failed", state.message or "restore failed", now)
        following = NEXT_STEP[step]
        if following is None:
            return self._succeed(state, now)
        state, actions = self._issue(state, following[0], now, following[1])
        return self._done(state, actions)

    def _placement_problems(self, state: RestoreState, nodes: Mapping[str, str]) -> list[str]:
        problems = []
        for member in state.members:
            node = nodes.get(member.pod.name)
            if node is None:
                problems.append(f"{member.pod.name}: no node")
            elif node in self.config.avoid_nodes:
                problems.append(f"{member.pod.name}: {node} is in avoidNodes")
            elif self.config.avoid_source_nodes and node == member.pod.node:
                problems.append(f"{member.pod.name}: {node} is its source node (avoidSourceNodes)")
        return problems

    def _deadline(self, state: RestoreState, now: float) -> RestoreTransition | None:
        limit = overdue(state, self.config.timeouts, now)
        if limit is not None:
            suffix = late_note(state, STEP_LABEL)
            if state.phase == RestorePhase.CLEANING_UP:
                note = f"; clean-up not confirmed within {limit:g}s{suffix}"
                return self._fail(state, state.reason or "Failed", (state.message or "") + note, now)
            message = f"{state.phase} did not finish within {limit:g}s{suffix}"
            return self._abort(state, f"{state.phase}Timeout", message, now)
        if state.phase != RestorePhase.CLEANING_UP and now >= state.started_at + self.config.active_deadline:
            message = (
                f"the restore did not finish within activeDeadlineSeconds={self.config.active_deadline:g}"
            )
            return self._abort(state, "DeadlineExceeded", message, now)
        return None

    def _restarted(self, state: RestoreState, now: float) -> RestoreTransition:
        if state.step is None:
            return self._done(state, [])
        step = RestoreStep(state.step.kind)
        if ON_UNKNOWN[step] == Unknown.REISSUE:
            if step == RestoreStep.ADMIT:
                state = all_marked(state, Mark.PLACED)
            state, actions = self._issue(state, step, now)
            if state.phase == RestorePhase.CLEANING_UP:  # the clean-up's whole bound again
                state = replace(state, phase_since=now)
            return self._done(state, actions)
        message = f"the operator restarted during {step}; its outcome is unknown, so the restore is undone"
        return self._abort(state, "OperatorRestarted", message, now)

    def _abort(self, state: RestoreState, reason: str, message: str, now: float) -> RestoreTransition:
        if state.phase == RestorePhase.CLEANING_UP:
            return self._done(state, [])
        if state.phase in NOTHING_RESTORED:
            return self._fail(state, reason, message, now)
        warning = EmitEvent("Warning", reason, f"{message}: removing every restored rank")
        state = replace(state, reason=reason, message=message, failed_from=state.phase)
        state, actions = self._issue(state, RestoreStep.CLEAN_UP, now, RestorePhase.CLEANING_UP)
        return self._done(state, [warning, *actions])

    def _fail(self, state: RestoreState, reason: str, message: str, now: float) -> RestoreTransition:
        actions: list[Action] = [EmitEvent("Warning", reason, message)]
        if state.phase != RestorePhase.PENDING:
            actions.append(CloseSession())
        state = finish(
            state, RestorePhase.FAILED, reason, message, now, failed_from=state.failed_from or state.phase
        )
        return Transition(state, tuple(actions))

    def _succeed(self, state: RestoreState, now: float) -> RestoreTransition:
        message = f"checkpoint {self.config.checkpoint_name} restored; the job runs again"
        actions = (EmitEvent("Normal", "Succeeded", message), CloseSession())
        return Transition(finish(state, RestorePhase.SUCCEEDED, state.reason, message, now), actions)

    def _issue(
        self, state: RestoreState, step: RestoreStep, now: float, phase: RestorePhase | None = None
    ) -> tuple[RestoreState, list[Action]]:
        pods, label, name = state.live_pods, STEP_LABEL[step], self.config.checkpoint_name

        def action(attempt: str) -> StepAction:
            if step == RestoreStep.RESOLVE:
                return ResolveCheckpoint(attempt, (), name)
            if step == RestoreStep.PLACE:
                return PlacePods(attempt, pods, dict(self.config.node_selector), self.config.avoid_nodes)
            if step in (RestoreStep.DOWNLOAD, RestoreStep.CREATE_PODS):
                return STEPS[step].action(attempt, pods, name)  # type: ignore[call-arg]
            if STEPS[step].action is AwaitMilestone:
                assert isinstance(label, Milestone)
                return AwaitMilestone(attempt, pods, milestone=label)
            return STEPS[step].action(attempt, pods)

        return issue(state, str(step), now, phase, action)

    def _done(self, state: RestoreState, actions: list[Action]) -> RestoreTransition:
        timeouts, deadline = self.config.timeouts, self.config.active_deadline
        return Transition(state, tuple(actions), wake_at(state, timeouts, deadline, RestorePhase.CLEANING_UP))
