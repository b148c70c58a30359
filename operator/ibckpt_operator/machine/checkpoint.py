"""The CheckpointJob state machine: (state, event, now) -> (state, actions). Pure: no I/O, no clock.

    Pending -> Admitted [-> PreDumping: spec.preDump] -> Quiescing -> Draining -> Releasing -> Dumping
      -> Uploading -> Committed                       (commitOn Memory: Uploading keeps and commits in memory)
      -> Rebuilding -> Resuming -> Succeeded          (LeaveRunning)
      -> Stopped -> Succeeded                         (Stop: sources killed only now)
    any failure, deadline, lost pod or cancel before Committed -> Aborting (ResumeAll) -> Failed
    before any rank is touched (Pending, Admitted)             -> Failed

The rules it encodes (tests/operator/test_checkpoint_machine.py shows each):
- every member is admitted before any member is touched; the members are pinned by UID at selection;
- the manifest is committed only after every member uploaded, so a partial set is never published; with
  commitOn Memory, after every member's part is kept on its buddy, or (a copy failed) on S3 as without;
- Stop kills the sources only once the checkpoint is committed and its Checkpoint object exists;
- each side effect gets a new attempt id, recorded in the state the handler writes to status before it acts;
  a result for another attempt is stale and ignored; after an operator restart a step with an unknown
  outcome is run again only when that is safe (Unknown.REISSUE), looked up (VERIFY) or given up (ABORT);
- two jobs never hold the same pod: the claim is granted, or the job waits (bounded) or fails, saying who
  holds the pods;
- a node's agent busy with another job's session (it runs one at a time) refuses the job's session before
  any rank is gated: the job takes its session back from the other nodes and asks again (a new session)
  until agent_wait_seconds after it started, unless its concurrency policy is Fail.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from ibckpt.api import CheckpointJobSpec, CheckpointMode, ConcurrencyPolicy, JobPhase, StorageTier
from ibckpt.vocabulary import Milestone
from ibckpt_operator.machine.actions import (
    AdmitPods,
    AwaitMilestone,
    ClaimPods,
    CloseSession,
    CommitInMemory,
    CommitManifest,
    DiscardUpload,
    KillSources,
    OpenSession,
    PublishCheckpoint,
    QuiesceRanks,
    ReleaseClaim,
    ResumeAll,
    SelectPods,
    VerifyManifest,
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
    PodRefused,
    PodsBusy,
    PodsClaimed,
    PodsSelected,
    PodStepDone,
    RunState,
    SessionAborted,
    SessionOpened,
    StepAction,
    StepFailed,
    StepRecord,
    StepRule,
    Tick,
    Transition,
    Unknown,
    all_marked,
    attempt_id,
    enter,
    finish,
    issue,
    late_note,
    names_not_at,
    overdue,
    wake_at,
    with_progress,
)


class JobStep(StrEnum):
    SELECT = "select"
    CLAIM = "claim"
    ADMIT = "admit"
    OPEN_SESSION = "open-session"
    PRE_DUMP = "pre-dump"  # spec.preDump: the agents start here, and cut once every node pre-dumped
    QUIESCE = "quiesce"
    QUIESCE_AFTER_PRE_DUMP = "quiesce-after-pre-dump"  # the agents go on from their pre-dumps
    DRAIN = "drain"
    RELEASE = "release"
    DUMP = "dump"
    UPLOAD = "upload"
    KEEP = "keep-in-memory"  # commitOn Memory: every part and its manifest sealed on its buddy
    COMMIT = "commit"
    COMMIT_IN_MEMORY = "commit-in-memory"
    VERIFY_COMMIT = "verify-commit"
    PUBLISH = "publish"
    REBUILD = "rebuild"
    RESUME = "resume"
    KILL = "kill"
    RESUME_ALL = "resume-all"


# Per step: what the driver does, the label a member gets when it finishes it, and what a restarted operator
# does when it finds the step in flight (core.StepRule).
STEPS: Mapping[JobStep, StepRule] = {
    JobStep.SELECT: StepRule(SelectPods, None, Unknown.REISSUE),  # reads pods
    # in the operator's memory, rebuilt from statuses
    JobStep.CLAIM: StepRule(ClaimPods, None, Unknown.REISSUE),
    JobStep.ADMIT: StepRule(AdmitPods, Milestone.ADMITTED, Unknown.REISSUE),  # read-only checks
    # a coordinator session touches no rank
    JobStep.OPEN_SESSION: StepRule(OpenSession, None, Unknown.REISSUE),
    JobStep.PRE_DUMP: StepRule(QuiesceRanks, Milestone.PRE_DUMPED, Unknown.ABORT),
    JobStep.QUIESCE: StepRule(QuiesceRanks, Milestone.QUIESCED, Unknown.ABORT),
    JobStep.QUIESCE_AFTER_PRE_DUMP: StepRule(AwaitMilestone, Milestone.QUIESCED, Unknown.ABORT),
    JobStep.DRAIN: StepRule(AwaitMilestone, Milestone.DRAINED, Unknown.ABORT),
    JobStep.RELEASE: StepRule(AwaitMilestone, Milestone.RELEASED, Unknown.ABORT),
    JobStep.DUMP: StepRule(AwaitMilestone, Milestone.DUMPED, Unknown.ABORT),
    JobStep.UPLOAD: StepRule(AwaitMilestone, Milestone.UPLOADED, Unknown.ABORT),
    # the agents' reports of their copies were in the last operator's memory: abort, as for an upload
    JobStep.KEEP: StepRule(AwaitMilestone, Milestone.MEMORY_KEPT, Unknown.ABORT),
    JobStep.COMMIT_IN_MEMORY: StepRule(CommitInMemory, None, Unknown.ABORT),
    # one PUT: the manifest is there or not
    JobStep.COMMIT: StepRule(CommitManifest, None, Unknown.VERIFY),
    JobStep.VERIFY_COMMIT: StepRule(VerifyManifest, None, Unknown.REISSUE),
    JobStep.PUBLISH: StepRule(PublishCheckpoint, None, Unknown.REISSUE),  # create-if-absent by name
    # after the commit, ABORT means: resume every rank (see _restarted)
    JobStep.REBUILD: StepRule(AwaitMilestone, Milestone.REBUILT, Unknown.ABORT),
    # opening a gate twice is harmless
    JobStep.RESUME: StepRule(AwaitMilestone, Milestone.RESUMED, Unknown.REISSUE),
    JobStep.KILL: StepRule(KillSources, Mark.KILLED, Unknown.REISSUE),  # by UID: a dead pod stays dead
    # brings each rank to running from wherever it is
    JobStep.RESUME_ALL: StepRule(ResumeAll, Milestone.RESUMED, Unknown.REISSUE),
}
STEP_LABEL: Mapping[JobStep, Label | None] = {step: rule.label for step, rule in STEPS.items()}
ON_UNKNOWN: Mapping[JobStep, Unknown] = {step: rule.on_unknown for step, rule in STEPS.items()}
NEXT_STEP: Mapping[JobStep, tuple[JobStep, JobPhase]] = {
    JobStep.ADMIT: (JobStep.OPEN_SESSION, JobPhase.ADMITTED),
    JobStep.PRE_DUMP: (JobStep.QUIESCE_AFTER_PRE_DUMP, JobPhase.QUIESCING),
    JobStep.QUIESCE: (JobStep.DRAIN, JobPhase.DRAINING),
    JobStep.QUIESCE_AFTER_PRE_DUMP: (JobStep.DRAIN, JobPhase.DRAINING),
    JobStep.DRAIN: (JobStep.RELEASE, JobPhase.RELEASING),
    JobStep.RELEASE: (JobStep.DUMP, JobPhase.DUMPING),
    JobStep.DUMP: (JobStep.UPLOAD, JobPhase.UPLOADING),
    JobStep.UPLOAD: (JobStep.COMMIT, JobPhase.UPLOADING),
    JobStep.KEEP: (JobStep.COMMIT_IN_MEMORY, JobPhase.UPLOADING),
    JobStep.REBUILD: (JobStep.RESUME, JobPhase.RESUMING),
}
# commitOn Memory: after the dump, every part is kept on its buddy, then committed there.
AFTER_DUMP_IN_MEMORY = (JobStep.KEEP, JobPhase.UPLOADING)
COMMIT_STEPS = frozenset({JobStep.COMMIT, JobStep.VERIFY_COMMIT, JobStep.COMMIT_IN_MEMORY})
TERMINAL = frozenset({JobPhase.SUCCEEDED, JobPhase.FAILED})
# Phases in which no rank has been touched: a failure ends the job, nothing to bring back.
UNTOUCHED = frozenset({JobPhase.PENDING, JobPhase.ADMITTED})
# Phases after the manifest commit: the checkpoint exists whatever happens next.
AFTER_COMMIT = frozenset({JobPhase.COMMITTED, JobPhase.REBUILDING, JobPhase.RESUMING, JobPhase.STOPPED})
# Where the agents start: a busy agent refuses the session here, before any rank is gated.
FIRST_CUT_PHASES = frozenset({JobPhase.PRE_DUMPING, JobPhase.QUIESCING})
# A node's agent refused the session as busy with another one; `waiting_for` while the job waits for it.
AGENT_BUSY = "AgentBusy"
BUSY_AGENT = "a busy node's agent"


# Job-specific events.


@dataclass(frozen=True)
class ManifestCommitted(Event):
    attempt: str
    manifest_key: str
    tier: StorageTier = StorageTier.S3


@dataclass(frozen=True)
class MemoryCopyMissed(Event):
    """commitOn Memory: a node's part was not kept on its buddy (its agent said why)."""

    attempt: str
    node: str
    message: str


@dataclass(frozen=True)
class ManifestMissing(Event):
    """A verify found no manifest: the interrupted commit did not happen."""

    attempt: str


@dataclass(frozen=True)
class CheckpointPublished(Event):
    attempt: str


@dataclass(frozen=True)
class JobConfig:
    """What the machine needs of the spec."""

    checkpoint_name: str
    mode: CheckpointMode = CheckpointMode.LEAVE_RUNNING
    concurrency: ConcurrencyPolicy = ConcurrencyPolicy.WAIT
    pre_dump: bool = False
    commit_on: StorageTier = StorageTier.S3
    timeouts: Mapping[JobPhase, float] = field(default_factory=dict)
    active_deadline: float = 3600.0
    retry_seconds: float = 5.0  # how often a waiting job asks for its pods again
    agent_wait_seconds: float = 600.0  # a busy agent is asked again until this long after the job started
    agent_retry_seconds: float = 10.0  # how often

    @classmethod
    def from_spec(
        cls, spec: CheckpointJobSpec, checkpoint_name: str, agent_wait_seconds: float = 600.0
    ) -> JobConfig:
        t = spec.timeouts
        return cls(
            checkpoint_name=spec.checkpoint_name or checkpoint_name,
            mode=spec.mode,
            concurrency=spec.concurrency_policy,
            pre_dump=spec.pre_dump,
            commit_on=spec.commit_on,
            agent_wait_seconds=agent_wait_seconds,
            timeouts={
                JobPhase.PENDING: t.admit_seconds,
                JobPhase.ADMITTED: t.admit_seconds,
                JobPhase.PRE_DUMPING: t.dump_seconds,
                JobPhase.QUIESCING: t.quiesce_seconds,
                JobPhase.DRAINING: t.drain_seconds,
                JobPhase.RELEASING: t.release_seconds,
                JobPhase.DUMPING: t.dump_seconds,
                JobPhase.UPLOADING: t.upload_seconds,
                JobPhase.COMMITTED: t.publish_seconds,
                JobPhase.REBUILDING: t.rebuild_seconds,
                JobPhase.RESUMING: t.resume_seconds,
                JobPhase.STOPPED: t.stop_seconds,
                JobPhase.ABORTING: t.abort_seconds,
            },
            active_deadline=spec.active_deadline_seconds,
        )


@dataclass(frozen=True)
class JobState(RunState[JobPhase]):
    """Everything the machine knows (RunState's fields, and these); all of it goes to status."""

    claimed: bool = False
    aborted_from: JobPhase | None = None
    waiting_for: str | None = None
    retry_at: float | None = None
    manifest_key: str | None = None
    committed_on: StorageTier | None = None
    session_turn: int = 0  # sessions opened again after a busy agent: each needs its own id


JobTransition = Transition[JobState]


class CheckpointMachine:
    """The rules of one CheckpointJob; `start` once, then `handle` every event."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config

    def start(self, run: str, now: float) -> JobTransition:
        state = JobState(phase=JobPhase.PENDING, run=run, seq=0, started_at=now, phase_since=now)
        state, actions = self._issue(state, JobStep.SELECT, now)
        return self._done(state, [EmitEvent("Normal", "Pending", "selecting the job's pods"), *actions], now)

    def handle(self, state: JobState, event: Event, now: float) -> JobTransition:
        if state.phase in TERMINAL:
            return Transition(state)
        if isinstance(event, OperatorRestarted):
            # before any deadline: the bound ran on while no operator could act (a rollout takes
            # minutes), and an abort only ends once the new operator has asked the agents again
            return self._restarted(state, now)
        expired = self._deadline(state, now)
        if expired is not None:
            return expired
        if isinstance(event, Cancelled):
            if state.phase in AFTER_COMMIT or state.phase == JobPhase.ABORTING:
                return self._done(state, [], now)  # the checkpoint exists: finish what was started
            return self._abort(state, "Cancelled", "the CheckpointJob was deleted", now)
        if isinstance(event, PodLost):
            return self._pod_lost(state, event, now)
        if isinstance(event, SessionAborted):
            return self._abort(state, event.reason, event.message, now)
        if isinstance(event, Tick):
            if state.waiting_for and state.retry_at is not None and now >= state.retry_at:
                state, actions = self._issue(state, JobStep.CLAIM, now)
                return self._done(replace(state, retry_at=None), actions, now)
            return self._done(state, [], now)
        if getattr(event, "attempt", None) != state.attempt:
            return self._done(state, [], now)  # a stale result: its attempt was given up
        return self._result(state, event, now)

    # -- results of the step in flight

    def _result(self, state: JobState, event: Event, now: float) -> JobTransition:
        step = JobStep(state.step.kind) if state.step else None
        if isinstance(event, StepFailed):
            return self._step_failed(state, event, now)
        if isinstance(event, PodsSelected) and step == JobStep.SELECT:
            if not event.pods:
                return self._fail(state, "NoPods", "no pod matches the job's selector or workload", now)
            members = tuple(Member(pod) for pod in event.pods)
            state = replace(state, members=members)
            state, actions = self._issue(state, JobStep.CLAIM, now)
            return self._done(state, actions, now)
        if isinstance(event, PodsClaimed) and step == JobStep.CLAIM:
            state = replace(state, claimed=True, waiting_for=None, retry_at=None, reason=None, message=None)
            state, actions = self._issue(state, JobStep.ADMIT, now)
            return self._done(state, actions, now)
        if isinstance(event, PodsBusy) and step == JobStep.CLAIM:
            return self._busy(state, event, now)
        if isinstance(event, PodAdmitted) and step == JobStep.ADMIT:
            return self._member_done(state, event.pod, None, None, now)
        if isinstance(event, PodRefused) and step == JobStep.ADMIT:
            name = self._name(state, event.pod)
            state = replace(
                state, members=with_progress(state.members, event.pod, Mark.REFUSED, message=event.message)
            )
            return self._fail(state, "AdmissionRefused", f"{name}: {event.message}", now)
        if isinstance(event, SessionOpened) and step == JobStep.OPEN_SESSION:
            if self.config.pre_dump:
                state, actions = self._issue(state, JobStep.PRE_DUMP, now, JobPhase.PRE_DUMPING)
            else:
                state, actions = self._issue(state, JobStep.QUIESCE, now, JobPhase.QUIESCING)
            return self._done(state, actions, now)
        if isinstance(event, PodStepDone) and step not in (None, JobStep.ADMIT):
            return self._member_done(state, event.pod, event.bytes, event.seconds, now)
        if isinstance(event, MemoryCopyMissed) and step == JobStep.KEEP:
            return self._copy_missed(state, event, now)
        if isinstance(event, ManifestCommitted) and step in COMMIT_STEPS:
            state = replace(state, manifest_key=event.manifest_key, committed_on=event.tier)
            state, actions = self._issue(state, JobStep.PUBLISH, now, JobPhase.COMMITTED)
            return self._done(state, actions, now)
        if isinstance(event, ManifestMissing) and step == JobStep.VERIFY_COMMIT:
            return self._abort(
                state,
                "OperatorRestarted",
                "the operator restarted while committing the manifest, and no manifest was written",
                now,
            )
        if isinstance(event, CheckpointPublished) and step == JobStep.PUBLISH:
            if self.config.mode == CheckpointMode.STOP:
                state, actions = self._issue(state, JobStep.KILL, now, JobPhase.STOPPED)
            else:
                state, actions = self._issue(state, JobStep.REBUILD, now, JobPhase.REBUILDING)
            return self._done(state, actions, now)
        return self._done(state, [], now)  # an event this step does not expect

    def _member_done(
        self, state: JobState, key: str, size: int | None, seconds: float | None, now: float
    ) -> JobTransition:
        assert state.step is not None
        label = STEP_LABEL[JobStep(state.step.kind)]
        if label is None or all(member.key != key for member in state.members):
            return self._done(state, [], now)  # not a member: another pod of the same name, say
        members = with_progress(state.members, key, label, bytes=size, seconds=seconds)
        return self._maybe_advance(replace(state, members=members), now)

    def _maybe_advance(self, state: JobState, now: float) -> JobTransition:
        """The next step once every member finished this one; lost (and, in an abort, failed) members
        no longer count."""
        assert state.step is not None
        step = JobStep(state.step.kind)
        label = STEP_LABEL[step]
        if label is None or names_not_at(state.members, label, Mark.RESUME_FAILED):
            return self._done(state, [], now)
        if step in NEXT_STEP:
            next_step, phase = NEXT_STEP[step]
            if step == JobStep.DUMP and self.config.commit_on == StorageTier.MEMORY:
                next_step, phase = AFTER_DUMP_IN_MEMORY
            state, actions = self._issue(state, next_step, now, phase)
            return self._done(state, actions, now)
        if step == JobStep.RESUME_ALL and state.phase == JobPhase.ABORTING:
            return self._aborted(state, now)
        return self._succeed(state, now)  # RESUME, KILL, or RESUME_ALL after a restart past the commit

    def _copy_missed(self, state: JobState, event: MemoryCopyMissed, now: float) -> JobTransition:
        """A part not kept in memory: the checkpoint commits on S3 instead, once every part is uploaded
        (the agents upload after their copy whatever became of it), and says why."""
        message = f"node {event.node}'s part was not kept in memory ({event.message}): committing on S3"
        state = replace(state, message=message)
        state, actions = self._issue(state, JobStep.UPLOAD, now)
        return self._done(state, [EmitEvent("Warning", "CommitOnS3", message), *actions], now)

    def _busy(self, state: JobState, event: PodsBusy, now: float) -> JobTransition:
        message = f"pods of this job are being checkpointed by {event.holder}"
        if self.config.concurrency == ConcurrencyPolicy.FAIL:
            return self._fail(state, "PodsBusy", message, now)
        actions: list[Action] = []
        if state.waiting_for != event.holder:
            actions.append(EmitEvent("Normal", "WaitingForPods", message))
        state = replace(
            state,
            waiting_for=event.holder,
            retry_at=now + self.config.retry_seconds,
            reason="WaitingForPods",
            message=message,
        )
        return self._done(state, actions, now)

    def _step_failed(self, state: JobState, event: StepFailed, now: float) -> JobTransition:
        where = f"{self._name(state, event.pod)}: " if event.pod else ""
        if state.phase == JobPhase.ABORTING:
            if event.pod is None:
                return self._aborted(state, now, f"resuming failed: {event.message}")
            members = with_progress(state.members, event.pod, Mark.RESUME_FAILED, message=event.message)
            return self._maybe_advance(replace(state, members=members), now)
        return self._abort(state, event.reason, where + event.message, now)

    def _pod_lost(self, state: JobState, event: PodLost, now: float) -> JobTransition:
        if all(member.key != event.pod for member in state.members):
            return self._done(state, [], now)
        name = self._name(state, event.pod)
        if state.phase == JobPhase.STOPPED and state.step is not None:
            return self._member_done(state, event.pod, None, None, now)  # killing it is what Stop does
        members = with_progress(state.members, event.pod, Mark.LOST, message=event.message)
        state = replace(state, members=members)
        if state.phase == JobPhase.ABORTING and state.step is not None:
            return self._maybe_advance(state, now)
        return self._abort(state, "PodLost", f"{name}: {event.message}", now)

    # -- deadlines and restarts

    def _deadline(self, state: JobState, now: float) -> JobTransition | None:
        limit = overdue(state, self.config.timeouts, now)
        if limit is not None:
            if state.phase == JobPhase.PENDING and state.waiting_for == BUSY_AGENT:
                return self._fail(state, AGENT_BUSY, f"waited {limit:g}s to ask {BUSY_AGENT} again", now)
            if state.phase == JobPhase.PENDING and state.waiting_for:
                message = f"waited {limit:g}s for pods held by {state.waiting_for}"
                return self._fail(state, "PodsBusy", message, now)
            if state.phase == JobPhase.ABORTING:
                return self._aborted(state, now, f"not confirmed within {limit:g}s")
            message = f"{state.phase} did not finish within {limit:g}s{late_note(state, STEP_LABEL)}"
            return self._abort(state, f"{state.phase}Timeout", message, now)
        if state.phase != JobPhase.ABORTING and now >= state.started_at + self.config.active_deadline:
            message = f"the job did not finish within activeDeadlineSeconds={self.config.active_deadline:g}"
            return self._abort(state, "DeadlineExceeded", message, now)
        return None

    def _restarted(self, state: JobState, now: float) -> JobTransition:
        if state.step is None:
            return self._done(state, [], now)
        step = JobStep(state.step.kind)
        policy = ON_UNKNOWN[step]
        if policy == Unknown.REISSUE:
            if step == JobStep.ADMIT:  # admit again from scratch: an agent may have gone meanwhile
                state = all_marked(state, Mark.SELECTED)
            state, actions = self._issue(state, step, now)
            if state.phase == JobPhase.ABORTING:
                # the whole bound again: the last operator's coordinator went with it, and the ranks
                # it left released rebuild only through the one this abort opens
                state = replace(state, phase_since=now)
            return self._done(replace(state, retry_at=None), actions, now)
        if policy == Unknown.VERIFY:
            state, actions = self._issue(state, JobStep.VERIFY_COMMIT, now)
            return self._done(state, actions, now)
        if state.phase in (JobPhase.REBUILDING, JobPhase.RESUMING):
            # Past the commit the checkpoint is good: only the ranks need to run again.
            state, actions = self._issue(state, JobStep.RESUME_ALL, now, JobPhase.RESUMING)
            return self._done(state, actions, now)
        message = (
            f"the operator restarted during {step}; its outcome is unknown, so the checkpoint is aborted"
        )
        return self._abort(state, "OperatorRestarted", message, now)

    # -- endings

    def _abort(self, state: JobState, reason: str, message: str, now: float) -> JobTransition:
        """The one abort path: before any rank is touched the job just fails; after, every rank resumes."""
        if state.phase in UNTOUCHED:
            return self._fail(state, reason, message, now)
        if state.phase == JobPhase.STOPPED:
            committed = f"; checkpoint {self.config.checkpoint_name} is committed, some sources may still run"
            return self._fail(state, reason, message + committed, now)
        if state.phase == JobPhase.ABORTING:
            return self._done(state, [], now)
        aborted_from = state.phase
        warning = EmitEvent("Warning", reason, f"{message}: resuming every rank")
        if reason == AGENT_BUSY and self._may_wait_for_agent(state, now):
            retry = self.config.agent_retry_seconds
            note = f"{message}; the other nodes take the session back and the job asks again in {retry:g}s"
            warning = EmitEvent("Normal", "WaitingForAgent", note)
        state = replace(state, reason=reason, message=message, aborted_from=aborted_from)
        state, actions = self._issue(state, JobStep.RESUME_ALL, now, JobPhase.ABORTING)
        if aborted_from == JobPhase.UPLOADING:
            # Same attempt as the resume: one recorded step, two idempotent effects.
            attempt = actions[-1].attempt if isinstance(actions[-1], StepAction) else ""
            actions.append(DiscardUpload(attempt, state.live_pods, self.config.checkpoint_name))
        return self._done(state, [warning, *actions], now)

    def _may_wait_for_agent(self, state: JobState, now: float) -> bool:
        """Whether a busy agent is asked again: only for the session's start (no rank gated yet), while
        the policy lets the job wait and the next ask is within agent_wait_seconds of its start."""
        return (
            self.config.concurrency == ConcurrencyPolicy.WAIT
            and (state.phase in FIRST_CUT_PHASES or state.aborted_from in FIRST_CUT_PHASES)
            and now + self.config.agent_retry_seconds <= state.started_at + self.config.agent_wait_seconds
        )

    def _wait_for_agent(self, state: JobState, now: float) -> JobTransition:
        """Back to Pending, still holding the pods, to open a new session at retry_at. The step is a claim
        no action carries yet: the abort's late results are stale, and a restarted operator claims again."""
        seq = state.seq + 1
        state = enter(
            all_marked(state, Mark.SELECTED),
            JobPhase.PENDING,
            now,
            seq=seq,
            step=StepRecord(str(JobStep.CLAIM), attempt_id(state.run, seq), now),
            aborted_from=None,
            waiting_for=BUSY_AGENT,
            retry_at=now + self.config.agent_retry_seconds,
            reason="WaitingForAgent",
            session_turn=state.session_turn + 1,
        )
        return self._done(state, [CloseSession()], now)

    def _aborted(self, state: JobState, now: float, note: str | None = None) -> JobTransition:
        unconfirmed = names_not_at(state.members, Milestone.RESUMED)
        if state.reason == AGENT_BUSY and not unconfirmed and self._may_wait_for_agent(state, now):
            return self._wait_for_agent(state, now)
        message = state.message or "aborted"
        if state.aborted_from in AFTER_COMMIT:
            message += f"; checkpoint {self.config.checkpoint_name} is committed and restorable"
        if unconfirmed:
            message += (
                f"; {note or 'resume failed'} for {', '.join(unconfirmed)} (a quiesced or drained rank "
                "resumes when its shim's lease runs out; a released one waits for a rebuild, and the last "
                "checkpoint is still restorable)"
            )
        waits = self.config.concurrency == ConcurrencyPolicy.WAIT
        if state.reason == AGENT_BUSY and state.aborted_from in FIRST_CUT_PHASES and waits:
            waited, bound = now - state.started_at, self.config.agent_wait_seconds
            message += f"; asked for {waited:.0f}s of the {bound:g}s a job waits for it"
        return self._fail(state, state.reason or "Aborted", message, now)

    def _fail(self, state: JobState, reason: str, message: str, now: float) -> JobTransition:
        actions: list[Action] = [EmitEvent("Warning", reason, message)]
        if state.phase != JobPhase.PENDING:
            actions.append(CloseSession())
        if state.claimed:
            actions.append(ReleaseClaim())
        state = finish(state, JobPhase.FAILED, reason, message, now, claimed=False, retry_at=None)
        return Transition(state, tuple(actions))

    def _succeed(self, state: JobState, now: float) -> JobTransition:
        done = "moved out (sources stopped)" if self.config.mode == CheckpointMode.STOP else "job resumed"
        message = f"checkpoint {self.config.checkpoint_name} committed; {done}"
        actions: list[Action] = [EmitEvent("Normal", "Succeeded", message), CloseSession(), ReleaseClaim()]
        state = finish(state, JobPhase.SUCCEEDED, None, message, now, claimed=False, retry_at=None)
        return Transition(state, tuple(actions))

    # -- plumbing

    def _issue(
        self, state: JobState, step: JobStep, now: float, phase: JobPhase | None = None
    ) -> tuple[JobState, list[Action]]:
        kind = STEPS[step].action
        pods = () if kind is SelectPods else state.live_pods
        label = STEP_LABEL[step]
        name = self.config.checkpoint_name

        def action(attempt: str) -> StepAction:
            if kind is AwaitMilestone:
                assert isinstance(label, Milestone)
                return AwaitMilestone(attempt, pods, milestone=label)
            if kind is PublishCheckpoint:
                in_memory = state.committed_on == StorageTier.MEMORY
                return PublishCheckpoint(attempt, pods, name, state.manifest_key or "", in_memory)
            if kind in (CommitManifest, CommitInMemory, VerifyManifest):
                return kind(attempt, pods, name)
            return kind(attempt, pods)

        return issue(state, str(step), now, phase, action)

    def _done(self, state: JobState, actions: list[Action], now: float) -> JobTransition:
        if state.phase in TERMINAL:
            return Transition(state, tuple(actions))
        timeouts, deadline = self.config.timeouts, self.config.active_deadline
        return Transition(
            state, tuple(actions), wake_at(state, timeouts, deadline, JobPhase.ABORTING, state.retry_at)
        )

    @staticmethod
    def _name(state: JobState, key: str | None) -> str:
        return next((m.pod.name for m in state.members if m.key == key), key or "?")
