"""Machine state <-> status: a restarted operator reads back the state it wrote, conditions follow the
phase, and the claims registry is rebuilt from statuses."""

from __future__ import annotations

from dataclasses import replace

from ibckpt.api import CheckpointJobSpec, CheckpointJobStatus, ConditionType, JobPhase, RestoreJobSpec
from ibckpt_operator.machine import (
    CheckpointMachine,
    JobConfig,
    JobState,
    PodClaims,
    PodRef,
    RestoreConfig,
    RestoreMachine,
)
from ibckpt_operator.machine.actions import QuiesceRanks, ResumeAll
from ibckpt_operator.machine.core import (
    OperatorRestarted,
    PodAdmitted,
    PodsClaimed,
    PodsSelected,
    PodStepDone,
    SessionOpened,
    StepFailed,
)
from ibckpt_operator.machine.restore import CheckpointResolved, PodCreated, PodsPlaced
from ibckpt_operator.machine.status import job_state, job_status, restore_state, restore_status
from testbed.machines import PODS

T0 = 1_800_000_000.25
SPEC = CheckpointJobSpec.from_wire(
    {"selector": {"matchLabels": {"app": "ring"}}, "storageRef": {"name": "s3"}}
)


def quiescing_job() -> tuple[CheckpointMachine, list[JobState]]:
    machine = CheckpointMachine(JobConfig.from_spec(SPEC, "ring-ckpt"))
    t = machine.start("abc123", T0)
    states: list[JobState] = [t.state]
    for event in ("select", "claim", "admit0", "admit1", "session", "quiesced0"):
        state = t.state
        assert state.attempt is not None
        e = {
            "select": PodsSelected(state.attempt, PODS),
            "claim": PodsClaimed(state.attempt),
            "admit0": PodAdmitted(state.attempt, "uid-0"),
            "admit1": PodAdmitted(state.attempt, "uid-1"),
            "session": SessionOpened(state.attempt),
            "quiesced0": PodStepDone(state.attempt, "uid-0", seconds=0.25),
        }[event]
        t = machine.handle(state, e, T0 + len(states))
        states.append(t.state)
    return machine, states


def test_a_job_state_survives_the_trip_through_status_and_the_apiserver_json() -> None:
    _, states = quiescing_job()
    state = states[-1]
    status = job_status(state, checkpoint_name="ring-ckpt", generation=1, now=T0 + 9)
    wire = status.to_wire()
    assert wire["phase"] == "Quiescing" and wire["claimed"] is True
    assert [row["phase"] for row in wire["pods"]] == ["Quiesced", "Admitted"]
    assert wire["attempt"] == "abc123-5" and wire["step"] == "quiesce"
    # the phases it left, timed on the machine's clock (Pending until the 4th event, Admitted 1 s)
    assert wire["phaseTimings"] == [
        {"phase": "Pending", "startedAt": "2027-01-15T08:00:00.250000Z", "seconds": 4.0},
        {"phase": "Admitted", "startedAt": "2027-01-15T08:00:04.250000Z", "seconds": 1.0},
    ]
    assert job_state(CheckpointJobStatus.from_wire(wire)) == state


def test_a_restarted_operator_aborts_from_what_status_says() -> None:
    machine, states = quiescing_job()
    status = job_status(states[-1], checkpoint_name="ring-ckpt", now=T0 + 9)
    restored = job_state(CheckpointJobStatus.from_wire(status.to_wire()))
    t = machine.handle(restored, OperatorRestarted(), T0 + 10)
    assert t.state.phase == JobPhase.ABORTING
    assert not t.of_type(QuiesceRanks)
    (resume,) = t.of_type(ResumeAll)
    assert resume.pods == PODS and resume.attempt == "abc123-6"  # ids keep counting after the restart
    # The registry of claims comes back from the same status: a second job still cannot take the pods.
    claims = PodClaims.from_jobs([("ns/ring", restored)])
    assert claims.claim("ns/other", ["uid-1"]) == "ns/ring"


def test_conditions_follow_the_phase_and_keep_their_transition_times() -> None:
    machine, states = quiescing_job()
    running = job_status(states[-1], checkpoint_name="c", generation=3, now=T0 + 8)
    by_type = {c.type: c for c in running.conditions or []}
    assert by_type[ConditionType.PROGRESSING].status == "True"
    assert by_type[ConditionType.READY].status == "False"
    assert by_type[ConditionType.FAILED].status == "False"
    assert all(c.observed_generation == 3 for c in by_type.values())
    state = states[-1]
    assert state.attempt is not None
    failed = machine.handle(state, StepFailed(state.attempt, "QuiesceFailed", "gate stuck"), T0 + 10)
    for uid in ("uid-0", "uid-1"):
        attempt = failed.state.attempt
        assert attempt is not None
        failed = machine.handle(failed.state, PodStepDone(attempt, uid), T0 + 11)
    assert failed.state.phase == JobPhase.FAILED
    later = job_status(
        failed.state, checkpoint_name="c", generation=3, previous=running.conditions, now=T0 + 12
    )
    after = {c.type: c for c in later.conditions or []}
    assert (
        after[ConditionType.FAILED].status == "True" and after[ConditionType.FAILED].reason == "QuiesceFailed"
    )
    assert after[ConditionType.FAILED].message == "gate stuck"
    assert after[ConditionType.PROGRESSING].status == "False"
    # Ready was False before and still is: its transition time did not move.
    assert (
        after[ConditionType.READY].last_transition_time == by_type[ConditionType.READY].last_transition_time
    )
    assert (
        after[ConditionType.FAILED].last_transition_time != by_type[ConditionType.FAILED].last_transition_time
    )
    assert later.checkpoint_name is None  # nothing was committed


def test_a_restore_state_survives_the_trip_through_status() -> None:
    machine = RestoreMachine(RestoreConfig.from_spec(RestoreJobSpec(checkpoint_name="ring-ckpt")))
    t = machine.start("r9", T0)
    assert t.state.attempt is not None
    t = machine.handle(t.state, CheckpointResolved(t.state.attempt, PODS), T0 + 1)
    status = restore_status(t.state, now=T0 + 2)
    back = restore_state(type(status).from_wire(status.to_wire()))
    assert back == t.state
    assert replace(back, seq=0) != t.state  # the comparison sees the attempt counter


def test_a_restore_state_keeps_its_created_pods_uids_through_status() -> None:
    """A restarted operator must know which pods it created: the rows carry the destination uids."""
    machine = RestoreMachine(RestoreConfig.from_spec(RestoreJobSpec(checkpoint_name="ring-ckpt")))
    t = machine.start("r9", T0)
    sources = tuple(PodRef(p.name, "", p.node) for p in PODS)
    for event in ("resolve", "place", "admit0", "admit1", "session", "staged0", "staged1", "created0"):
        attempt = t.state.attempt
        assert attempt is not None
        e = {
            "resolve": CheckpointResolved(attempt, sources),
            "place": PodsPlaced(attempt, {"ring-0": "node-2", "ring-1": "node-1"}),
            "admit0": PodAdmitted(attempt, "ring-0"),
            "admit1": PodAdmitted(attempt, "ring-1"),
            "session": SessionOpened(attempt),
            "staged0": PodStepDone(attempt, "ring-0"),  # the images first, then the pods
            "staged1": PodStepDone(attempt, "ring-1"),
            "created0": PodCreated(attempt, "ring-0", "new-0"),
        }[event]
        t = machine.handle(t.state, e, T0 + 1)
    status = restore_status(t.state, now=T0 + 2)
    assert [(row.name, row.uid, row.node, row.phase) for row in status.pods or ()] == [
        ("ring-0", "new-0", "node-2", "Created"),
        ("ring-1", None, "node-1", "Downloaded"),
    ]
    back = restore_state(type(status).from_wire(status.to_wire()))
    assert back == t.state
