"""The CheckpointJob state machine, pure, with fake time: every transition, deadline and abort."""

from __future__ import annotations

from itertools import pairwise

import pytest

from ibckpt.api import CheckpointMode, ConcurrencyPolicy, JobPhase
from ibckpt.vocabulary import Milestone
from ibckpt_operator.machine import JobStep, PodClaims
from ibckpt_operator.machine.actions import (
    AdmitPods,
    AwaitMilestone,
    ClaimPods,
    CloseSession,
    CommitManifest,
    DiscardUpload,
    KillSources,
    PublishCheckpoint,
    QuiesceRanks,
    ReleaseClaim,
    ResumeAll,
    SelectPods,
    VerifyManifest,
)
from ibckpt_operator.machine.checkpoint import (
    ON_UNKNOWN,
    ManifestCommitted,
    ManifestMissing,
)
from ibckpt_operator.machine.core import (
    Action,
    Cancelled,
    EmitEvent,
    OperatorRestarted,
    PodAdmitted,
    PodLost,
    PodRefused,
    PodsBusy,
    PodsClaimed,
    PodsSelected,
    PodStepDone,
    SessionAborted,
    SessionOpened,
    StepAction,
    StepFailed,
    Tick,
    Unknown,
)
from testbed.checkpoint_machine import PODS, SPEC
from testbed.checkpoint_machine import CheckpointDriver as Driver
from testbed.machines import T0


def index_of(actions: list[Action], kind: type[Action]) -> int:
    return next(i for i, action in enumerate(actions) if isinstance(action, kind))


def test_leave_running_goes_through_every_phase_in_order() -> None:
    job = Driver()
    job.to_phase(JobPhase.SUCCEEDED)
    assert job.phases == [
        JobPhase.PENDING,
        JobPhase.ADMITTED,
        JobPhase.QUIESCING,
        JobPhase.DRAINING,
        JobPhase.RELEASING,
        JobPhase.DUMPING,
        JobPhase.UPLOADING,
        JobPhase.COMMITTED,
        JobPhase.REBUILDING,
        JobPhase.RESUMING,
        JobPhase.SUCCEEDED,
    ]
    assert job.side_effects() == [
        "SelectPods", "ClaimPods", "AdmitPods", "OpenSession", "QuiesceRanks", "AwaitMilestone(Drained)",
        "AwaitMilestone(Released)", "AwaitMilestone(Dumped)", "AwaitMilestone(Uploaded)", "CommitManifest",
        "PublishCheckpoint", "AwaitMilestone(Rebuilt)", "AwaitMilestone(Resumed)",
    ]  # fmt: skip
    attempts = [a.attempt for a in job.actions if isinstance(a, StepAction)]
    assert len(set(attempts)) == len(attempts)  # a new attempt id for every side effect
    assert not job.of_type(ResumeAll) and not job.of_type(KillSources)
    assert isinstance(job.actions[-1], ReleaseClaim) and job.of_type(CloseSession)
    assert job.state.manifest_key == "ibckpt/v1/manifests/ns/ring/c1.json"
    assert all(m.progress == "Resumed" and m.bytes == 100 for m in job.state.members)
    assert job.last.wake_at is None


def test_a_pre_dump_starts_the_agents_at_pre_dumping_and_the_cut_follows_every_pods_pre_dump() -> None:
    job = Driver(pre_dump=True)
    job.to_phase(JobPhase.PRE_DUMPING)
    assert job.phases == [JobPhase.PENDING, JobPhase.ADMITTED, JobPhase.PRE_DUMPING]
    assert job.side_effects()[-1] == "QuiesceRanks"  # the agents start here: they pre-dump, then cut
    assert job.last.wake_at == job.state.phase_since + SPEC.timeouts.dump_seconds
    job.send(PodStepDone(job.attempt, "uid-0"))
    job.send(PodStepDone(job.attempt, "uid-1"))
    assert job.state.phase == JobPhase.PRE_DUMPING  # no pod is cut before every pod's pre-dump
    job.send(PodStepDone(job.attempt, "uid-2"))
    assert job.state.phase == JobPhase.QUIESCING
    job.to_phase(JobPhase.SUCCEEDED)
    assert job.side_effects().count("QuiesceRanks") == 1  # the quiesce is awaited, not asked again
    assert job.awaited()[:2] == [Milestone.QUIESCED, Milestone.DRAINED]
    assert all(m.progress == "Resumed" for m in job.state.members)


def test_a_pre_dump_that_overruns_dump_seconds_aborts_and_resumes_every_rank() -> None:
    job = Driver(pre_dump=True)
    job.to_phase(JobPhase.PRE_DUMPING)
    job.send(PodStepDone(job.attempt, "uid-0"))
    job.send(Tick(), after=SPEC.timeouts.dump_seconds)
    assert job.state.phase == JobPhase.ABORTING and job.state.reason == "PreDumpingTimeout"
    assert job.state.message == (
        f"PreDumping did not finish within {SPEC.timeouts.dump_seconds}s (waiting for ring-1, ring-2)"
    )
    (resume,) = job.of_type(ResumeAll)
    assert resume.pods == PODS
    job.all_done()
    assert job.state.phase == JobPhase.FAILED and not job.of_type(CommitManifest)


def test_stop_kills_the_sources_only_after_the_commit_and_publish() -> None:
    job = Driver(CheckpointMode.STOP)
    job.to_phase(JobPhase.SUCCEEDED)
    assert job.phases[-3:] == [JobPhase.COMMITTED, JobPhase.STOPPED, JobPhase.SUCCEEDED]
    assert index_of(job.actions, CommitManifest) < index_of(job.actions, PublishCheckpoint)
    assert index_of(job.actions, PublishCheckpoint) < index_of(job.actions, KillSources)
    (kill,) = job.of_type(KillSources)
    assert {pod.uid for pod in kill.pods} == {"uid-0", "uid-1", "uid-2"}  # pinned by UID
    assert Milestone.REBUILT not in job.awaited() and Milestone.RESUMED not in job.awaited()


def test_a_killed_pod_disappearing_counts_as_killed() -> None:
    job = Driver(CheckpointMode.STOP)
    job.to_phase(JobPhase.STOPPED)
    for pod in PODS:
        job.send(PodLost(pod.uid, "deleted"))
    assert job.state.phase == JobPhase.SUCCEEDED


def test_no_member_is_touched_before_every_member_is_admitted() -> None:
    job = Driver()
    job.send(PodsSelected(job.attempt, PODS))
    job.send(PodsClaimed(job.attempt))
    (admit,) = job.of_type(AdmitPods)
    assert admit.pods == PODS
    job.send(PodAdmitted(job.attempt, "uid-0"))
    job.send(PodAdmitted(job.attempt, "uid-1"))
    assert job.state.phase == JobPhase.PENDING
    job.send(PodAdmitted(job.attempt, "uid-1"))  # twice the same pod is still two pods short of three
    assert job.state.phase == JobPhase.PENDING and not job.of_type(QuiesceRanks)
    job.send(PodRefused(job.attempt, "uid-2", "TCP connection to 10.0.2.100 leads outside the job"))
    assert job.state.phase == JobPhase.FAILED
    assert job.state.reason == "AdmissionRefused"
    assert job.state.message == "ring-2: TCP connection to 10.0.2.100 leads outside the job"
    assert not job.of_type(QuiesceRanks) and not job.of_type(ResumeAll)  # nothing touched, nothing to undo
    assert job.of_type(ReleaseClaim)


def test_quiesce_waits_for_the_session_after_admission() -> None:
    job = Driver()
    job.send(PodsSelected(job.attempt, PODS))
    job.send(PodsClaimed(job.attempt))
    for pod in PODS:
        job.send(PodAdmitted(job.attempt, pod.uid))
    assert job.state.phase == JobPhase.ADMITTED and not job.of_type(QuiesceRanks)
    job.send(SessionOpened(job.attempt))
    assert job.state.phase == JobPhase.QUIESCING
    (quiesce,) = job.of_type(QuiesceRanks)
    assert quiesce.pods == PODS


def test_no_pods_fails_at_once() -> None:
    job = Driver()
    job.send(PodsSelected(job.attempt, ()))
    assert (job.state.phase, job.state.reason) == (JobPhase.FAILED, "NoPods")
    assert not job.of_type(ClaimPods)


def test_a_partial_set_is_never_committed() -> None:
    job = Driver()
    job.to_phase(JobPhase.UPLOADING)
    job.send(PodStepDone(job.attempt, "uid-0", bytes=10))
    job.send(PodStepDone(job.attempt, "uid-1", bytes=10))
    assert not job.of_type(CommitManifest)
    job.send(StepFailed(job.attempt, "UploadFailed", "AccessDenied on PutObject", pod="uid-2"))
    assert job.state.phase == JobPhase.ABORTING
    assert job.state.reason == "UploadFailed" and job.state.message == "ring-2: AccessDenied on PutObject"
    assert not job.of_type(CommitManifest) and not job.of_type(PublishCheckpoint)
    (resume,) = job.of_type(ResumeAll)
    (discard,) = job.of_type(DiscardUpload)
    assert resume.pods == PODS and discard.attempt == resume.attempt == job.attempt


def test_commit_follows_only_the_last_upload() -> None:
    job = Driver()
    job.to_phase(JobPhase.UPLOADING)
    for pod in PODS[:-1]:
        job.send(PodStepDone(job.attempt, pod.uid, bytes=10))
    assert not job.of_type(CommitManifest)
    job.send(PodStepDone(job.attempt, PODS[-1].uid, bytes=10))
    (commit,) = job.of_type(CommitManifest)
    assert commit.checkpoint_name == "ring-ckpt" and commit.pods == PODS
    assert job.state.phase == JobPhase.UPLOADING  # committed only when the store says so
    job.send(ManifestCommitted(job.attempt, "key"))
    assert job.state.phase == JobPhase.COMMITTED
    (publish,) = job.of_type(PublishCheckpoint)
    assert publish.manifest_key == "key"


def test_pods_are_pinned_by_uid() -> None:
    job = Driver()
    job.to_phase(JobPhase.QUIESCING)
    job.send(PodStepDone(job.attempt, "uid-0"))
    job.send(PodStepDone(job.attempt, "uid-1"))
    job.send(PodStepDone(job.attempt, "uid-2-replacement"))  # ring-2 again, but another pod
    assert job.state.phase == JobPhase.QUIESCING
    job.send(PodLost("uid-2", "pod ring-2 was deleted"))
    assert job.state.phase == JobPhase.ABORTING and job.state.reason == "PodLost"
    (resume,) = job.of_type(ResumeAll)
    assert [pod.uid for pod in resume.pods] == ["uid-0", "uid-1"]  # the lost pod is not addressed
    for uid in ("uid-0", "uid-1"):
        job.send(PodStepDone(job.attempt, uid))
    assert job.state.phase == JobPhase.FAILED and job.state.reason == "PodLost"


def test_a_pod_lost_before_anything_was_touched_just_fails() -> None:
    job = Driver()
    job.send(PodsSelected(job.attempt, PODS))
    job.send(PodsClaimed(job.attempt))
    job.send(PodLost("uid-1", "evicted"))
    assert job.state.phase == JobPhase.FAILED and not job.of_type(ResumeAll)
    job.send(PodLost("uid-9", "unrelated"))  # terminal: nothing changes
    assert job.state.phase == JobPhase.FAILED


PRE_COMMIT = [JobPhase.QUIESCING, JobPhase.DRAINING, JobPhase.RELEASING, JobPhase.DUMPING, JobPhase.UPLOADING]
TIMEOUT_FIELD = {
    JobPhase.QUIESCING: "quiesce_seconds",
    JobPhase.DRAINING: "drain_seconds",
    JobPhase.RELEASING: "release_seconds",
    JobPhase.DUMPING: "dump_seconds",
    JobPhase.UPLOADING: "upload_seconds",
}


@pytest.mark.parametrize("phase", PRE_COMMIT)
def test_a_phase_deadline_before_the_commit_aborts_and_resumes_every_rank(phase: JobPhase) -> None:
    job = Driver()
    job.to_phase(phase)
    limit = getattr(SPEC.timeouts, TIMEOUT_FIELD[phase])
    entered = job.state.phase_since
    assert job.last.wake_at == entered + limit
    job.send(PodStepDone(job.attempt, "uid-0"))
    job.now = entered + limit - 0.001
    job.send(Tick())
    assert job.state.phase == phase and not job.of_type(ResumeAll)
    job.now = entered + limit
    job.send(Tick())
    assert job.state.phase == JobPhase.ABORTING
    assert job.state.reason == f"{phase}Timeout"
    assert job.state.aborted_from == phase
    assert job.state.message == f"{phase} did not finish within {limit}s (waiting for ring-1, ring-2)"
    (resume,) = job.of_type(ResumeAll)
    assert resume.pods == PODS
    assert (len(job.of_type(DiscardUpload)) == 1) == (phase == JobPhase.UPLOADING)
    job.all_done()
    assert job.state.phase == JobPhase.FAILED and job.state.reason == f"{phase}Timeout"
    assert not job.of_type(CommitManifest) and not job.of_type(KillSources)


@pytest.mark.parametrize("phase", [JobPhase.PENDING, JobPhase.ADMITTED])
def test_an_admission_deadline_fails_without_touching_anything(phase: JobPhase) -> None:
    job = Driver()
    job.to_phase(phase)
    job.send(Tick(), after=SPEC.timeouts.admit_seconds)
    assert job.state.phase == JobPhase.FAILED and job.state.reason == f"{phase}Timeout"
    assert not job.of_type(ResumeAll) and not job.of_type(QuiesceRanks)


def test_the_overall_deadline_aborts() -> None:
    job = Driver(active_deadline=100.0)
    job.to_phase(JobPhase.DUMPING)
    assert job.last.wake_at == T0 + 100.0  # sooner than the dump's own 600 s
    job.now = T0 + 100.0
    job.send(Tick())
    assert job.state.phase == JobPhase.ABORTING and job.state.reason == "DeadlineExceeded"
    # The abort has its own bound, not the overall one that just ran out.
    assert job.last.wake_at == job.now + SPEC.timeouts.abort_seconds


def test_an_abort_that_is_not_confirmed_in_time_still_ends() -> None:
    job = Driver()
    job.to_phase(JobPhase.DRAINING)
    job.send(StepFailed(job.attempt, "DrainFailed", "node-2 agent: drain timed out"))
    job.send(PodStepDone(job.attempt, "uid-0"))
    job.send(StepFailed(job.attempt, "ResumeFailed", "rebuild failed", pod="uid-1"))
    assert job.state.phase == JobPhase.ABORTING
    job.send(Tick(), after=SPEC.timeouts.abort_seconds)
    assert job.state.phase == JobPhase.FAILED and job.state.reason == "DrainFailed"
    assert "not confirmed within 120s for ring-1, ring-2" in (job.state.message or "")


@pytest.mark.parametrize("down_s", [-10, 60], ids=["within-the-bound", "past-the-bound"])
def test_a_restart_mid_abort_asks_again_with_the_whole_abort_bound(down_s: float) -> None:
    """The next operator's abort opens a new coordinator for the released ranks: it gets the whole
    bound, not what the last operator left of it (a helm upgrade rolls the agents meanwhile), even
    when no operator ran for longer than the bound."""
    job = Driver()
    job.to_phase(JobPhase.RELEASING)
    job.send(StepFailed(job.attempt, "SessionAborted", "node-2: the node agent is stopping"))
    first = job.attempt
    job.send(OperatorRestarted(), after=SPEC.timeouts.abort_seconds + down_s)
    assert job.state.phase == JobPhase.ABORTING and job.attempt != first
    assert len(job.of_type(ResumeAll)) == 2
    assert job.last.wake_at == job.now + SPEC.timeouts.abort_seconds
    job.send(Tick(), after=SPEC.timeouts.abort_seconds - 1)
    assert job.state.phase == JobPhase.ABORTING
    job.all_done()
    assert job.state.phase == JobPhase.FAILED and job.state.reason == "SessionAborted"
    assert "not confirmed" not in (job.state.message or "")


def test_a_session_abort_seen_after_the_step_moved_on_still_aborts() -> None:
    """A node's abort (its agent stopping mid-cut) reaches the coordinator while the machine goes on to
    the next step: it is not that step's result, so it aborts whichever step is in flight."""
    job = Driver()
    job.to_phase(JobPhase.QUIESCING)
    job.advance()  # the next step is issued before the abort is handled
    assert job.state.phase != JobPhase.QUIESCING
    job.send(SessionAborted("SessionAborted", "node-1: the node agent is stopping"))
    assert job.state.phase == JobPhase.ABORTING and job.state.reason == "SessionAborted"
    assert job.of_type(ResumeAll)
    job.send(SessionAborted("SessionAborted", "node-2: late"))  # a second one changes nothing
    assert job.state.message == "node-1: the node agent is stopping"


def test_stale_results_are_ignored() -> None:
    job = Driver()
    job.to_phase(JobPhase.DUMPING)
    dump_attempt = job.attempt
    job.send(StepFailed(dump_attempt, "DumpFailed", "criu: Can't handle non-regular mapping"))
    before = job.state
    for pod in PODS:  # the dump's late successes belong to an attempt that was given up
        job.send(PodStepDone(dump_attempt, pod.uid))
    assert job.state == before and not job.last.actions


def test_a_failure_after_the_commit_resumes_the_ranks_and_says_the_checkpoint_is_good() -> None:
    job = Driver()
    job.to_phase(JobPhase.REBUILDING)
    job.send(StepFailed(job.attempt, "RebuildFailed", "ibv_create_qp: ENOMEM", pod="uid-1"))
    assert job.state.phase == JobPhase.ABORTING and job.state.aborted_from == JobPhase.REBUILDING
    job.all_done()
    assert job.state.phase == JobPhase.FAILED
    assert "checkpoint ring-ckpt is committed and restorable" in (job.state.message or "")


def test_a_failed_kill_never_resumes_half_killed_ranks() -> None:
    job = Driver(CheckpointMode.STOP)
    job.to_phase(JobPhase.STOPPED)
    job.send(PodStepDone(job.attempt, "uid-0"))
    job.send(Tick(), after=SPEC.timeouts.stop_seconds)
    assert job.state.phase == JobPhase.FAILED and job.state.reason == "StoppedTimeout"
    assert "is committed, some sources may still run" in (job.state.message or "")
    assert not job.of_type(ResumeAll)


def test_cancel_aborts_before_the_commit_and_is_ignored_after() -> None:
    job = Driver()
    job.to_phase(JobPhase.RELEASING)
    job.send(Cancelled())
    assert job.state.phase == JobPhase.ABORTING and job.state.reason == "Cancelled"
    late = Driver()
    late.to_phase(JobPhase.REBUILDING)
    late.send(Cancelled())
    assert late.state.phase == JobPhase.REBUILDING
    late.to_phase(JobPhase.SUCCEEDED)


@pytest.mark.parametrize(
    "step", [JobStep.QUIESCE, JobStep.DRAIN, JobStep.RELEASE, JobStep.DUMP, JobStep.UPLOAD]
)
def test_a_restart_during_a_rank_step_aborts_and_never_replays_it(step: JobStep) -> None:
    job = Driver()
    while job.state.step is None or job.step != step:
        job.advance()
    replayed = type(job.actions[-1])
    count = len(job.of_type(replayed))
    job.send(OperatorRestarted())
    assert job.state.phase == JobPhase.ABORTING and job.state.reason == "OperatorRestarted"
    assert len(job.of_type(replayed)) == count
    assert job.of_type(ResumeAll)


def test_a_restart_during_the_commit_looks_before_it_goes_on() -> None:
    job = Driver()
    while job.state.step is None or job.step != JobStep.COMMIT:
        job.advance()
    job.send(OperatorRestarted())
    assert len(job.of_type(CommitManifest)) == 1  # not written a second time
    (verify,) = job.of_type(VerifyManifest)
    assert verify.checkpoint_name == "ring-ckpt"
    job.send(ManifestCommitted(job.attempt, "found"))
    assert job.state.phase == JobPhase.COMMITTED and job.state.manifest_key == "found"

    missing = Driver()
    while missing.state.step is None or missing.step != JobStep.COMMIT:
        missing.advance()
    missing.send(OperatorRestarted())
    missing.send(ManifestMissing(missing.attempt))
    assert missing.state.phase == JobPhase.ABORTING and missing.state.reason == "OperatorRestarted"
    assert not missing.of_type(PublishCheckpoint)


def test_a_restart_after_the_commit_resumes_every_rank_and_succeeds() -> None:
    job = Driver()
    job.to_phase(JobPhase.REBUILDING)
    job.send(OperatorRestarted())
    assert job.state.phase == JobPhase.RESUMING and job.step == JobStep.RESUME_ALL
    assert job.awaited().count(Milestone.REBUILT) == 1
    job.all_done()
    assert job.state.phase == JobPhase.SUCCEEDED


@pytest.mark.parametrize(
    ("step", "action"),
    [
        (JobStep.SELECT, SelectPods),
        (JobStep.CLAIM, ClaimPods),
        (JobStep.ADMIT, AdmitPods),
        (JobStep.PUBLISH, PublishCheckpoint),
        (JobStep.RESUME, AwaitMilestone),
    ],
)
def test_a_restart_reissues_a_safe_step_under_a_new_attempt(step: JobStep, action: type[StepAction]) -> None:
    job = Driver()
    while job.state.step is None or job.step != step:
        job.advance()
    if step == JobStep.ADMIT:
        job.send(PodAdmitted(job.attempt, "uid-0"))
    old = job.attempt
    job.send(OperatorRestarted())
    first, again = job.of_type(action)[-2:]
    assert (first.attempt, again.attempt) == (old, job.attempt) and old != job.attempt
    assert ON_UNKNOWN[step] == Unknown.REISSUE
    if step == JobStep.ADMIT:  # admitted again from scratch
        assert all(m.progress == "Selected" for m in job.state.members)
    job.send(PodAdmitted(old, "uid-1"))  # the old attempt's answers no longer count
    assert job.state.step is not None and job.state.step.attempt != old
    job.to_phase(JobPhase.SUCCEEDED)


def test_every_step_has_a_restart_policy() -> None:
    assert set(ON_UNKNOWN) == set(JobStep)
    assert ON_UNKNOWN[JobStep.COMMIT] == Unknown.VERIFY
    assert all(ON_UNKNOWN[s] == Unknown.ABORT for s in (JobStep.QUIESCE, JobStep.DUMP, JobStep.UPLOAD))


def test_a_second_job_for_the_same_pods_waits_then_runs() -> None:
    claims = PodClaims()
    assert claims.claim("ns/first", ["uid-0", "uid-1"]) is None
    job = Driver()
    job.send(PodsSelected(job.attempt, PODS))
    (claim,) = job.of_type(ClaimPods)
    holder = claims.claim("ns/second", [pod.uid for pod in claim.pods])
    assert holder == "ns/first"
    assert claims.holder("uid-2") is None  # all or nothing
    job.send(PodsBusy(job.attempt, holder))
    assert job.state.phase == JobPhase.PENDING
    assert (job.state.reason, job.state.waiting_for) == ("WaitingForPods", "ns/first")
    assert job.state.message == "pods of this job are being checkpointed by ns/first"
    assert job.last.wake_at == job.now + 5.0
    job.send(Tick(), after=4.9)
    assert len(job.of_type(ClaimPods)) == 1
    job.send(Tick(), after=0.1)
    assert len(job.of_type(ClaimPods)) == 2
    claims.release("ns/first")
    assert claims.claim("ns/second", [pod.uid for pod in job.of_type(ClaimPods)[-1].pods]) is None
    job.send(PodsClaimed(job.attempt))
    assert job.state.waiting_for is None and job.state.claimed
    job.to_phase(JobPhase.SUCCEEDED)


def test_a_second_job_waits_only_within_its_admission_deadline() -> None:
    job = Driver()
    job.send(PodsSelected(job.attempt, PODS))
    while job.now < T0 + SPEC.timeouts.admit_seconds:
        job.send(PodsBusy(job.attempt, "ns/first"))
        job.send(Tick(), after=5.0)
    assert job.state.phase == JobPhase.FAILED and job.state.reason == "PodsBusy"
    assert job.state.message == "waited 60s for pods held by ns/first"
    assert sum(isinstance(a, EmitEvent) and a.reason == "WaitingForPods" for a in job.actions) == 1


def test_a_second_job_with_policy_fail_fails_at_once() -> None:
    job = Driver(concurrency=ConcurrencyPolicy.FAIL)
    job.send(PodsSelected(job.attempt, PODS))
    job.send(PodsBusy(job.attempt, "ns/first"))
    assert job.state.phase == JobPhase.FAILED and job.state.reason == "PodsBusy"
    assert "ns/first" in (job.state.message or "")
    assert not job.of_type(ReleaseClaim)  # it never held them


def test_claims_are_rebuilt_from_the_jobs_states() -> None:
    running = Driver()
    running.to_phase(JobPhase.DUMPING)
    finished = Driver()
    finished.to_phase(JobPhase.SUCCEEDED)
    claims = PodClaims.from_jobs([("ns/running", running.state), ("ns/finished", finished.state)])
    assert claims.holder("uid-0") == "ns/running"
    assert claims.claim("ns/new", ["uid-2"]) == "ns/running"


def test_terminal_states_ignore_everything() -> None:
    job = Driver()
    job.to_phase(JobPhase.SUCCEEDED)
    for event in (Tick(), OperatorRestarted(), Cancelled(), PodLost("uid-0", "gone")):
        assert job.send(event, after=10_000).state == job.state
        assert not job.last.actions


def test_dump_then_upload_sizes_are_kept_per_pod() -> None:
    job = Driver()
    job.to_phase(JobPhase.UPLOADING)
    assert job.awaited()[-2:] == [Milestone.DUMPED, Milestone.UPLOADED]
    job.send(PodStepDone(job.attempt, "uid-1", bytes=4096, seconds=2.5))
    member = next(m for m in job.state.members if m.pod.uid == "uid-1")
    assert (member.progress, member.bytes, member.seconds) == ("Uploaded", 4096, 2.5)


# -- where the time went


def test_every_phase_left_is_timed_on_the_machines_clock() -> None:
    job = Driver()
    job.to_phase(JobPhase.SUCCEEDED)  # each pod answers a rank step 0.1 s after the last
    spans = job.state.phase_spans
    assert [span.phase for span in spans] == [str(phase) for phase in job.phases[:-1]]
    seconds = {span.phase: span.seconds for span in spans}
    assert seconds["Quiescing"] == seconds["Dumping"] == seconds["Resuming"] == 0.3  # three pods
    assert seconds["Pending"] == seconds["Admitted"] == seconds["Committed"] == 0.0
    # back to back: each began when the one before ended, and together they are the whole job
    assert spans[0].started_at == T0
    assert all(b.started_at == pytest.approx(a.started_at + a.seconds) for a, b in pairwise(spans))
    assert job.state.finished_at is not None
    assert sum(s.seconds for s in spans) == pytest.approx(job.state.finished_at - job.state.started_at)


def test_an_abort_times_the_phase_it_left_and_the_resume_of_every_rank() -> None:
    job = Driver()
    job.to_phase(JobPhase.DUMPING)
    job.send(StepFailed(job.attempt, "DumpFailed", "criu: no space"), after=2.5)
    job.each_done("uid", 0, 0.1, after=1.0)
    assert job.state.phase == JobPhase.FAILED
    *_, dumping, aborting = job.state.phase_spans
    assert (dumping.phase, dumping.seconds) == ("Dumping", 2.5)
    assert (aborting.phase, aborting.seconds) == ("Aborting", 3.0)
