"""A CheckpointJob whose session a node's agent refuses as busy (an agent runs one session at a time: a
drain that moves several teams' jobs through one node meets another job's session there). No rank is
gated before every node joined its preflight, so the job takes its session back from the other nodes,
waits in Pending holding its pods, and asks again with a new session, until agent_wait_seconds after it
started; with `concurrencyPolicy: Fail` it fails at once."""

from __future__ import annotations

from ibckpt.api import CheckpointJobStatus, ConcurrencyPolicy, JobPhase
from ibckpt_operator.machine.actions import ClaimPods, CloseSession, OpenSession, ReleaseClaim, ResumeAll
from ibckpt_operator.machine.checkpoint import BUSY_AGENT, JobStep
from ibckpt_operator.machine.core import EmitEvent, OperatorRestarted, PodStepDone, StepFailed, Tick
from ibckpt_operator.machine.status import job_state, job_status
from testbed.checkpoint_machine import CheckpointDriver

BUSY = "node node-2: node-2 is busy with session 'ckj-other'"


def refused_as_busy(job: CheckpointDriver) -> None:
    """The job reaches its quiesce step and node-2's agent refuses the session; the others resume."""
    job.to_phase(JobPhase.QUIESCING)
    assert job.step == JobStep.QUIESCE
    job.send(StepFailed(job.attempt, "AgentBusy", BUSY))
    assert job.state.phase == JobPhase.ABORTING and job.step == JobStep.RESUME_ALL
    job.all_done()


def events(job: CheckpointDriver, reason: str) -> list[EmitEvent]:
    return [a for a in job.actions if isinstance(a, EmitEvent) and a.reason == reason]


def test_a_busy_agent_refusing_a_pre_dumping_session_is_asked_again_too() -> None:
    job = CheckpointDriver(pre_dump=True)
    job.to_phase(JobPhase.PRE_DUMPING)
    assert job.step == JobStep.PRE_DUMP
    job.send(StepFailed(job.attempt, "AgentBusy", BUSY))
    job.all_done()
    state = job.state
    assert (state.phase, state.reason, state.session_turn) == (JobPhase.PENDING, "WaitingForAgent", 1)


def test_a_busy_agent_takes_the_session_back_and_the_job_asks_again_with_a_new_session() -> None:
    job = CheckpointDriver()
    refused_as_busy(job)
    state = job.state
    assert state.phase == JobPhase.PENDING and state.claimed  # other jobs still wait for its pods
    assert (state.reason, state.waiting_for, state.session_turn) == ("WaitingForAgent", BUSY_AGENT, 1)
    assert state.message is not None and BUSY in state.message
    assert [type(a) for a in job.last.actions] == [CloseSession]  # this session's id is spent
    assert not job.of_type(ReleaseClaim) and not events(job, "AgentBusy")  # nothing failed
    [waiting] = events(job, "WaitingForAgent")
    assert waiting.type == "Normal" and BUSY in waiting.message and "asks again in 10s" in waiting.message
    assert job.last.wake_at == job.now + 10.0
    # the abort's late answers belong to its attempt, and change nothing
    job.send(PodStepDone(job.of_type(ResumeAll)[-1].attempt, "uid-0"))
    assert job.state.phase == JobPhase.PENDING

    job.send(Tick(), after=9.9)
    assert len(job.of_type(ClaimPods)) == 1
    job.send(Tick(), after=0.1)
    assert len(job.of_type(ClaimPods)) == 2
    job.to_phase(JobPhase.SUCCEEDED)
    assert len(job.of_type(OpenSession)) == 2 and job.state.session_turn == 1
    assert job.state.waiting_for is None and job.state.reason is None


def test_a_restarted_operator_asks_again_at_once_with_the_next_session() -> None:
    job = CheckpointDriver()
    refused_as_busy(job)
    wire = job_status(job.state, checkpoint_name="ring-ckpt", now=job.now).to_wire()
    assert wire["sessionTurn"] == 1 and wire["waitingFor"] == BUSY_AGENT and wire["step"] == "claim"
    read = job_state(CheckpointJobStatus.from_wire(wire))
    assert read.session_turn == 1
    job.state = read
    job.send(OperatorRestarted(), after=1.0)
    assert len(job.of_type(ClaimPods)) == 2 and job.state.retry_at is None
    job.to_phase(JobPhase.SUCCEEDED)


def test_a_busy_agent_is_asked_again_only_within_agent_wait_seconds() -> None:
    job = CheckpointDriver(agent_wait_seconds=60.0)
    for _ in range(20):
        refused_as_busy(job)
        if job.state.phase == JobPhase.FAILED:
            break
        job.send(Tick(), after=10.0)
    state = job.state
    assert state.phase == JobPhase.FAILED and state.reason == "AgentBusy", job.phases
    assert state.message is not None and BUSY in state.message
    assert "of the 60s a job waits for it" in state.message, state.message
    assert 3 <= state.session_turn <= 6, state.session_turn  # about one ask per 10 s and session
    failed = events(job, "AgentBusy")[-1]  # after the abort's own "resuming every rank"
    assert failed.type == "Warning" and failed.message == state.message
    assert job.of_type(ReleaseClaim) and isinstance(job.actions[-2], CloseSession)


def test_with_policy_fail_a_busy_agent_fails_the_job_once_its_ranks_resumed() -> None:
    job = CheckpointDriver(concurrency=ConcurrencyPolicy.FAIL)
    refused_as_busy(job)
    state = job.state
    assert state.phase == JobPhase.FAILED and state.reason == "AgentBusy" and state.session_turn == 0
    assert state.message == BUSY
    assert not events(job, "WaitingForAgent") and len(job.of_type(OpenSession)) == 1


def test_a_busy_refusal_after_the_ranks_were_gated_is_an_ordinary_abort() -> None:
    """Only the session's start is retried: later, a rank may already be drained or dumped."""
    job = CheckpointDriver()
    job.to_phase(JobPhase.DRAINING)
    job.send(StepFailed(job.attempt, "AgentBusy", BUSY))
    job.all_done()
    assert job.state.phase == JobPhase.FAILED and job.state.reason == "AgentBusy"
    assert not events(job, "WaitingForAgent")
