"""The drain-migration machine and the eviction webhook's answer, pure, with fake time."""

from __future__ import annotations

import pytest

from ibckpt.api.schedule import CheckpointScheduleSpec, OnDrainFailure
from ibckpt_operator.machine.core import EmitEvent, Event, OperatorRestarted, PodRef, Tick, Transition
from ibckpt_operator.machine.drain import (
    CancelCheckpointJob,
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointStarted,
    CreateMigrationCheckpoint,
    DrainConfig,
    DrainMachine,
    DrainPhase,
    DrainState,
    EnsurePdb,
    EvictionRequested,
    NodeDraining,
    NodeUncordoned,
    PdbRelaxed,
    RecordMigration,
    RelaxPdb,
    RestoreFailed,
    RestoreSucceeded,
    SourcesStopped,
    StartRestore,
    answer_eviction,
)
from testbed.machines import PODS, T0

HOLD = DrainConfig(deadline_seconds=600, on_failure=OnDrainFailure.KEEP_HOLDING, retry_seconds=60)
LOSE = DrainConfig(deadline_seconds=600, on_failure=OnDrainFailure.PROCEED_AND_LOSE)
# After the hold: committed, sources stopped, PDB gone.
RELEASED: tuple[Event, ...] = (
    CheckpointCommitted("ring-drain-1", "c"),
    SourcesStopped("ring-drain-1"),
    PdbRelaxed(),
)


def reasons(t: Transition[DrainState]) -> list[str]:
    return [action.reason for action in t.of_type(EmitEvent)]


def held(config: DrainConfig = HOLD) -> tuple[DrainMachine, Transition[DrainState]]:
    machine = DrainMachine(config)
    return machine, machine.handle(machine.start("ring").state, NodeDraining("node-1", PODS), T0)


def run(
    machine: DrainMachine, t: Transition[DrainState], *steps: tuple[Event, float]
) -> Transition[DrainState]:
    for event, at in steps:
        t = machine.handle(t.state, event, at)
    return t


def test_config_from_the_spec() -> None:
    spec = CheckpointScheduleSpec.from_wire(
        {"drain": {"onFailure": "ProceedAndLose", "deadlineSeconds": 900},
         "template": {"workloadRef": {"kind": "StatefulSet", "name": "ring"}, "storageRef": {"name": "s3"}}}
    )  # fmt: skip
    assert spec.drain is not None
    config = DrainConfig.from_protection(spec.drain)
    assert config == DrainConfig(900, OnDrainFailure.PROCEED_AND_LOSE, 120, True)


def test_start_keeps_a_pdb() -> None:
    t = DrainMachine(HOLD).start("ring")
    assert t.state.phase is DrainPhase.IDLE and t.actions == (EnsurePdb("ring"),)


def test_the_whole_migration() -> None:
    machine, t = held()
    assert t.state.phase is DrainPhase.HOLDING and t.state.nodes == ("node-1",) and t.state.sources == PODS
    assert t.of_type(CreateMigrationCheckpoint) == [CreateMigrationCheckpoint("ring-drain-1", "ring-drain-1")]
    assert t.of_type(EnsurePdb) and reasons(t) == ["DrainHeld"] and t.wake_at == T0 + 600
    t = machine.handle(t.state, CheckpointStarted("ring-drain-1"), T0 + 5)
    assert t.state.phase is DrainPhase.CHECKPOINTING and t.wake_at == T0 + 600
    t = machine.handle(t.state, CheckpointCommitted("ring-drain-1", "ring-drain-1"), T0 + 100)
    assert t.state.phase is DrainPhase.COMMITTED and reasons(t) == ["MigrationCommitted"]
    assert t.of_type(RelaxPdb) == [] and t.wake_at is None  # the deadline no longer applies
    t = machine.handle(t.state, SourcesStopped("ring-drain-1"), T0 + 110)
    assert t.state.phase is DrainPhase.RELEASING and t.of_type(RelaxPdb) == [RelaxPdb("ring")]
    assert reasons(t) == ["DrainReleased"]
    t = machine.handle(t.state, PdbRelaxed(), T0 + 111)
    assert t.state.phase is DrainPhase.RESTORING
    assert t.of_type(StartRestore) == [StartRestore("ring-restore-1", "ring-drain-1", ("node-1",))]
    t = machine.handle(t.state, RestoreSucceeded("ring-restore-1"), T0 + 200)
    assert t.state.phase is DrainPhase.DONE and t.state.reason == "Migrated"
    assert t.of_type(EnsurePdb) == [EnsurePdb("ring")]  # the restored pods are protected again
    assert t.of_type(RecordMigration) == [RecordMigration("Migrated", 200.0)]


def test_without_restore_it_ends_at_the_release() -> None:
    machine, t = held(DrainConfig(restore=False))
    t = run(
        machine,
        t,
        (CheckpointCommitted("ring-drain-1", "c"), T0 + 1),
        (SourcesStopped("ring-drain-1"), T0 + 2),
    )
    t = machine.handle(t.state, PdbRelaxed(), T0 + 3)
    assert t.state.phase is DrainPhase.DONE and t.of_type(StartRestore) == []
    assert "checkpointName c" in (t.state.message or "")


def test_an_eviction_starts_the_hold_and_more_nodes_join() -> None:
    machine = DrainMachine(HOLD)
    t = machine.handle(machine.start("ring").state, EvictionRequested(PODS[1], PODS), T0)
    assert t.state.phase is DrainPhase.HOLDING and t.state.nodes == ("node-2",)
    again = machine.handle(t.state, EvictionRequested(PODS[1], PODS), T0 + 1)
    assert again.actions == () and again.state.seq == 1  # one migration, not two
    elsewhere = machine.handle(again.state, EvictionRequested(PODS[0], PODS), T0 + 1)
    assert elsewhere.state.nodes == ("node-2",)  # an eviction on node-1 is not a drain of node-1
    t = machine.handle(again.state, NodeDraining("node-1", PODS), T0 + 2)
    assert t.state.nodes == ("node-2", "node-1") and t.actions == ()


def test_deadline_keep_holding_is_loud_and_retries() -> None:
    machine, t = held(HOLD)
    t = machine.handle(t.state, CheckpointStarted("ring-drain-1"), T0 + 1)
    early = machine.handle(t.state, Tick(), T0 + 599)
    assert early.state.phase is DrainPhase.CHECKPOINTING and early.actions == ()
    t = machine.handle(t.state, Tick(), T0 + 600)
    assert t.state.phase is DrainPhase.HELD and t.state.reason == "MigrationDeadlineExceeded"
    assert t.of_type(CancelCheckpointJob) == [CancelCheckpointJob("ring-drain-1")]
    assert reasons(t) == ["DrainHeld"] and t.of_type(RelaxPdb) == [] and t.wake_at == T0 + 660
    # Every retry: a Warning and a new CheckpointJob.
    t = machine.handle(t.state, Tick(), T0 + 660)
    assert t.of_type(CreateMigrationCheckpoint) == [
        CreateMigrationCheckpoint("ring-drain-1-2", "ring-drain-1-2")
    ]
    assert reasons(t) == ["DrainHeld"] and t.state.phase is DrainPhase.HELD
    t = machine.handle(t.state, CheckpointStarted("ring-drain-1-2"), T0 + 661)
    assert t.state.phase is DrainPhase.HELD  # still overdue, still saying so
    t = machine.handle(t.state, Tick(), T0 + 720)  # the retry runs: warn again, start nothing
    assert reasons(t) == ["DrainHeld"] and t.of_type(CreateMigrationCheckpoint) == []
    assert "still running" in t.of_type(EmitEvent)[0].message
    # The retry's commit goes on as usual.
    t = machine.handle(t.state, CheckpointCommitted("ring-drain-1-2", "ring-drain-1-2"), T0 + 730)
    assert t.state.phase is DrainPhase.COMMITTED and t.state.checkpoint == "ring-drain-1-2"


def test_deadline_proceed_and_lose() -> None:
    machine, t = held(LOSE)
    t = machine.handle(t.state, Tick(), T0 + 600)
    assert t.state.phase is DrainPhase.LOST and t.state.reason == "MigrationDeadlineExceeded"
    assert t.of_type(CancelCheckpointJob) == [CancelCheckpointJob("ring-drain-1")]
    assert t.of_type(RelaxPdb) == [RelaxPdb("ring")] and reasons(t) == ["DrainProceededStateLost"]
    assert t.of_type(RecordMigration) == [RecordMigration("Lost", 600.0)]
    assert "running state of ring is lost" in (t.state.message or "")


@pytest.mark.parametrize("config", [HOLD, LOSE], ids=["KeepHolding", "ProceedAndLose"])
def test_a_failed_checkpoint_follows_the_policy(config: DrainConfig) -> None:
    machine, t = held(config)
    t = machine.handle(t.state, CheckpointFailed("ring-drain-1", "PodLost", "ring-1 restarted"), T0 + 50)
    assert t.of_type(CancelCheckpointJob) == []  # it ended by itself
    assert t.state.reason == "PodLost" and "ring-1 restarted" in (t.state.message or "")
    if config is HOLD:
        assert t.state.phase is DrainPhase.HELD and t.wake_at == T0 + 110
        t = machine.handle(t.state, CheckpointFailed("ring-drain-1", "x", "stale"), T0 + 60)
        assert t.actions == () and t.state.reason == "PodLost"  # a result of no running job changes nothing
    else:
        assert t.state.phase is DrainPhase.LOST and t.of_type(RelaxPdb)


def test_a_failed_retry_stays_held() -> None:
    machine, t = held(HOLD)
    t = run(machine, t, (Tick(), T0 + 600), (Tick(), T0 + 660))
    t = machine.handle(t.state, CheckpointFailed("ring-drain-1-2", "DumpFailed", "criu: no space"), T0 + 700)
    assert t.state.phase is DrainPhase.HELD and t.state.reason == "DumpFailed" and t.wake_at == T0 + 760
    assert t.state.checkpoint_job is None


def test_uncordon_cancels_before_the_commit() -> None:
    machine, t = held()
    t = machine.handle(t.state, NodeDraining("node-2", PODS), T0 + 1)
    t = machine.handle(t.state, NodeUncordoned("node-1"), T0 + 2)
    assert t.state.phase is DrainPhase.HOLDING and t.state.nodes == ("node-2",) and t.actions == ()
    t = machine.handle(t.state, NodeUncordoned("node-3"), T0 + 3)  # not one of ours
    assert t.actions == ()
    t = machine.handle(t.state, NodeUncordoned("node-2"), T0 + 4)
    assert t.state.phase is DrainPhase.IDLE and t.state.seq == 1
    assert t.of_type(CancelCheckpointJob) == [CancelCheckpointJob("ring-drain-1")]
    assert reasons(t) == ["DrainCancelled"] and t.of_type(RecordMigration) == [
        RecordMigration("Cancelled", 4.0)
    ]


def test_uncordon_after_the_commit_changes_nothing() -> None:
    machine, t = held()
    t = machine.handle(t.state, CheckpointCommitted("ring-drain-1", "c"), T0 + 1)
    t = machine.handle(t.state, NodeUncordoned("node-1"), T0 + 2)
    assert t.state.phase is DrainPhase.COMMITTED and t.actions == ()


def test_restore_failure_names_the_good_checkpoint() -> None:
    machine, t = held()
    t = run(
        machine,
        t,
        (CheckpointCommitted("ring-drain-1", "ring-drain-1"), T0 + 1),
        (SourcesStopped("ring-drain-1"), T0 + 2),
        (PdbRelaxed(), T0 + 3),
    )
    stale = machine.handle(t.state, RestoreFailed("other", "x"), T0 + 4)
    assert stale.state == t.state and stale.actions == ()
    t = machine.handle(t.state, RestoreFailed("ring-restore-1", "node-3 has no agent"), T0 + 5)
    assert t.state.phase is DrainPhase.FAILED and reasons(t) == ["RestoreFailed"]
    assert "ring-drain-1 is good" in (t.state.message or "")
    assert t.of_type(RecordMigration) == [RecordMigration("Failed", 5.0)]


@pytest.mark.parametrize("phase", ["done", "lost", "failed"])
def test_a_new_drain_starts_a_new_migration_from_rest(phase: str) -> None:
    machine, t = held(LOSE)
    if phase == "lost":
        t = machine.handle(t.state, Tick(), T0 + 600)
    else:
        t = run(machine, t, *zip(RELEASED, (T0 + 1, T0 + 2, T0 + 3), strict=True))
        end = RestoreSucceeded("ring-restore-1") if phase == "done" else RestoreFailed("ring-restore-1", "no")
        t = machine.handle(t.state, end, T0 + 4)
    t = machine.handle(t.state, NodeDraining("node-2", PODS), T0 + 1000)
    assert t.state.phase is DrainPhase.HOLDING and t.state.seq == 2 and t.state.nodes == ("node-2",)
    assert t.of_type(CreateMigrationCheckpoint) == [CreateMigrationCheckpoint("ring-drain-2", "ring-drain-2")]
    assert t.state.deadline == T0 + 1600 and t.state.restore_job is None


def test_stale_and_unrelated_events_change_nothing() -> None:
    machine, t = held()
    for event in (
        CheckpointCommitted("other", "x"),
        CheckpointStarted("other"),
        SourcesStopped("ring-drain-1"),  # not Committed yet
        PdbRelaxed(),  # not Releasing
        RestoreSucceeded("ring-restore-1"),
    ):
        got = machine.handle(t.state, event, T0 + 1)
        assert got.state == t.state and got.actions == (), event


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        (0, [EnsurePdb("ring")]),
        (1, [EnsurePdb("ring"), CreateMigrationCheckpoint("ring-drain-1", "ring-drain-1")]),
        (2, []),
        (3, [RelaxPdb("ring")]),
        (4, [RelaxPdb("ring"), StartRestore("ring-restore-1", "c", ("node-1",))]),
    ],
    ids=["idle", "holding", "committed", "releasing", "restoring"],
)
def test_a_restarted_operator_reissues_the_phase_side_effect(steps: int, expected: list[object]) -> None:
    machine = DrainMachine(HOLD)
    t = machine.start("ring")
    for event in (NodeDraining("node-1", PODS), *RELEASED)[:steps]:
        t = machine.handle(t.state, event, T0)
    r = machine.handle(t.state, OperatorRestarted(), T0 + 1)
    assert list(r.actions) == expected and r.state == t.state


def test_a_restart_past_the_deadline_applies_it() -> None:
    machine, t = held(LOSE)
    r = machine.handle(t.state, OperatorRestarted(), T0 + 700)
    assert r.state.phase is DrainPhase.LOST and r.of_type(RelaxPdb)


def test_eviction_answers_from_the_state() -> None:
    machine = DrainMachine(HOLD)
    idle = machine.start("ring").state
    answer = answer_eviction(idle, "uid-0", T0, HOLD)
    assert (answer.allowed, answer.code) == (False, 429) and "protected" in answer.message
    t = machine.handle(idle, EvictionRequested(PODS[0], PODS), T0)
    answer = answer_eviction(t.state, "uid-0", T0 + 100, HOLD)
    assert (answer.allowed, answer.code, answer.retry_after_seconds) == (False, 429, 10)
    assert "checkpointing ring before it leaves node-1" in answer.message and "500s left" in answer.message
    committed = machine.handle(t.state, CheckpointCommitted("ring-drain-1", "c"), T0 + 200)
    assert not answer_eviction(committed.state, "uid-0", T0 + 200, HOLD).allowed
    releasing = machine.handle(committed.state, SourcesStopped("ring-drain-1"), T0 + 210)
    assert answer_eviction(releasing.state, "uid-0", T0 + 210, HOLD).allowed
    stranger = answer_eviction(releasing.state, "uid-new", T0 + 210, HOLD)
    assert (stranger.allowed, stranger.code) == (False, 429) and "not one it released" in stranger.message
    restoring = machine.handle(releasing.state, PdbRelaxed(), T0 + 211)
    assert answer_eviction(restoring.state, "uid-1", T0 + 211, HOLD).allowed  # a source
    new_pod = answer_eviction(restoring.state, "uid-new", T0 + 211, HOLD)
    assert (new_pod.allowed, new_pod.code) == (False, 429) and "being restored from c" in new_pod.message


def test_eviction_answer_while_held_is_loud() -> None:
    machine, t = held(HOLD)
    t = machine.handle(t.state, Tick(), T0 + 600)
    answer = answer_eviction(t.state, "uid-0", T0 + 601, HOLD)
    assert (answer.allowed, answer.code, answer.retry_after_seconds) == (False, 429, 60)
    assert answer.message.startswith("ibckpt is HOLDING this drain")
    assert "MigrationDeadlineExceeded" in answer.message and "ProceedAndLose" in answer.message


def test_eviction_answer_after_proceed_and_lose_lets_sources_go() -> None:
    machine, t = held(LOSE)
    t = machine.handle(t.state, Tick(), T0 + 600)
    assert answer_eviction(t.state, "uid-0", T0 + 601, LOSE).allowed
    assert not answer_eviction(t.state, "uid-later", T0 + 601, LOSE).allowed  # a new pod is protected again
    # The webhook feeds the eviction first: a source's is what the policy allowed, not a new drain.
    after = machine.handle(t.state, EvictionRequested(PODS[0], PODS), T0 + 601)
    assert after.state == t.state and after.actions == ()
    assert answer_eviction(after.state, "uid-0", T0 + 601, LOSE).allowed
    later = PodRef("ring-0", "uid-later", "node-1")
    assert (
        machine.handle(t.state, EvictionRequested(later, (later,)), T0 + 602).state.phase
        is DrainPhase.HOLDING
    )


def test_a_commit_that_beat_the_cancel_is_migrated() -> None:
    # A CheckpointJob ignores a cancel that comes after its commit and kills the sources: follow it.
    machine, t = held(LOSE)
    t = machine.handle(t.state, Tick(), T0 + 600)
    assert t.state.phase is DrainPhase.LOST and t.state.cancelled_job == "ring-drain-1"
    t = machine.handle(t.state, CheckpointCommitted("ring-drain-1", "ring-drain-1"), T0 + 601)
    assert t.state.phase is DrainPhase.COMMITTED and "migrating after all" in t.of_type(EmitEvent)[0].message
    t = run(machine, t, (SourcesStopped("ring-drain-1"), T0 + 602), (PdbRelaxed(), T0 + 603))
    assert t.of_type(StartRestore) == [StartRestore("ring-restore-1", "ring-drain-1", ("node-1",))]


def test_a_late_commit_while_held_cancels_the_retry() -> None:
    machine, t = held(HOLD)
    t = run(machine, t, (Tick(), T0 + 600), (Tick(), T0 + 660))  # deadline, then retry ring-drain-1-2
    t = machine.handle(t.state, CheckpointCommitted("ring-drain-1", "ring-drain-1"), T0 + 661)
    assert t.state.phase is DrainPhase.COMMITTED and t.state.checkpoint_job == "ring-drain-1"
    assert t.of_type(CancelCheckpointJob) == [CancelCheckpointJob("ring-drain-1-2")]
    t = machine.handle(t.state, SourcesStopped("ring-drain-1"), T0 + 662)
    assert t.state.phase is DrainPhase.RELEASING


def test_a_late_commit_after_an_uncordon_is_migrated() -> None:
    machine, t = held()
    t = machine.handle(t.state, NodeUncordoned("node-1"), T0 + 1)
    assert t.state.phase is DrainPhase.IDLE and t.state.cancelled_job == "ring-drain-1"
    t = machine.handle(t.state, CheckpointCommitted("ring-drain-1", "ring-drain-1"), T0 + 2)
    assert t.state.phase is DrainPhase.COMMITTED
    # A failure or start of a job that is not the one running changes nothing.
    machine2, h = held(HOLD)
    h = machine2.handle(h.state, Tick(), T0 + 600)
    stale = machine2.handle(h.state, CheckpointFailed("ring-drain-1", "Cancelled", "deleted"), T0 + 601)
    assert stale.state == h.state and stale.actions == ()
