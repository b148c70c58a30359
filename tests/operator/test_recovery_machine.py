"""The recovery machine (pure): every trigger, every fencing decision, the deadline and every policy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ibckpt.api import PodTemplate
from ibckpt.api.schedule import (
    CheckpointScheduleStatus,
    FencingPolicy,
    NoCheckpointPolicy,
    RecoveryProtection,
)
from ibckpt_operator.cluster.recovery import recovery_state, recovery_status, scratch_templates
from ibckpt_operator.machine.core import EmitEvent, OperatorRestarted, PodRef, Tick
from ibckpt_operator.machine.recovery import (
    BarePodsCreated,
    CancelRestore,
    CheckpointHint,
    NodeHealth,
    Observation,
    PodHealth,
    RecordRecovery,
    RecoveryConfig,
    RecoveryMachine,
    RecoveryPhase,
    RecoveryState,
    RecreatePods,
    RemovePods,
    RestoreBound,
    RestoreEnded,
    StartRecoveryRestore,
    StopPods,
    Trigger,
    fenced,
)

A, B = PodRef("ring-0", "u0", "node-a"), PodRef("ring-1", "u1", "node-b")
HINT = CheckpointHint("ring-7", 900.0)
CONFIG = RecoveryConfig(node_not_ready_seconds=60, deadline_seconds=600)


def healthy(pod: PodRef, **more: object) -> PodHealth:
    return PodHealth(pod, **more)  # type: ignore[arg-type]


def seen(*pods: PodHealth, nodes: tuple[NodeHealth, ...] = (), hint: CheckpointHint | None = HINT,
         busy: bool = False) -> Observation:  # fmt: skip
    names = {node.name for node in nodes}
    rest = tuple(NodeHealth(p.pod.node) for p in pods if p.pod.node not in names)
    return Observation(pods, (*nodes, *rest), hint, busy)


def down(name: str = "node-a", since: float = 1000.0, **more: object) -> NodeHealth:
    return NodeHealth(name, ready=False, since=since, **more)  # type: ignore[arg-type]


def machine(**config: object) -> RecoveryMachine:
    return RecoveryMachine(replace(CONFIG, **config))  # type: ignore[arg-type]


def events(transition: object) -> list[tuple[str, str]]:
    return [(a.type, a.reason) for a in transition.actions if isinstance(a, EmitEvent)]  # type: ignore[attr-defined]


def started(transition: object) -> str:
    [text] = [
        a.message for a in transition.actions if isinstance(a, EmitEvent) and a.reason == "RecoveryStarted"
    ]  # type: ignore[attr-defined]
    return str(text)


IDLE = RecoveryState("ring")


# -- triggers


def test_a_node_not_ready_triggers_only_once_the_bound_has_passed() -> None:
    m = machine()
    early = m.handle(IDLE, seen(healthy(A), healthy(B), nodes=(down(),)), 1030.0)
    assert early.state.phase is RecoveryPhase.IDLE and early.actions == ()
    assert early.wake_at == 1060.0  # the driver looks again exactly when the bound is reached
    late = m.handle(IDLE, seen(healthy(A), healthy(B), nodes=(down(),)), 1060.0)
    state = late.state
    assert state.phase is RecoveryPhase.FENCING and state.trigger is Trigger.NODE_NOT_READY
    assert state.nodes == ("node-a",) and state.sources == (A, B) and state.seq == 1
    assert state.failed_at == 1000.0 and state.detected_at == 1060.0 and state.deadline == 1660.0
    assert state.checkpoint == "ring-7" and state.work_lost == 100.0
    assert late.actions[0] == StopPods((A, B))
    assert events(late) == [("Warning", "RecoveryStarted")]
    assert "node node-a not ready for 60s" in started(late)


def test_an_unknown_node_counts_as_not_ready_and_a_missing_since_starts_now() -> None:
    unknown = NodeHealth("node-a", ready=False, since=None)  # Ready Unknown with no transition time
    m = machine(node_not_ready_seconds=0)
    t = m.handle(IDLE, seen(healthy(A), nodes=(unknown,)), 5.0)
    assert t.state.trigger is Trigger.NODE_NOT_READY and t.state.failed_at == 5.0


def test_a_deleted_node_triggers_at_once() -> None:
    t = machine().handle(
        IDLE, seen(healthy(A), healthy(B), nodes=(NodeHealth("node-a", exists=False),)), 10.0
    )
    assert t.state.trigger is Trigger.NODE_GONE and t.state.nodes == ("node-a",)


@pytest.mark.parametrize(
    "pod",
    [
        healthy(B, phase="Failed", running=False),
        healthy(B, failed_exit=1, failed_at=950.0),
        healthy(B, failed_exit=137, running=True),  # restarted in place: its rank started from scratch
    ],
)
def test_a_failed_pod_triggers_without_avoiding_its_node(pod: PodHealth) -> None:
    t = machine().handle(IDLE, seen(healthy(A), pod), 1000.0)
    assert t.state.trigger is Trigger.POD_FAILED and t.state.nodes == ()
    assert t.state.failed_at == (950.0 if pod.failed_at else 1000.0)
    assert "pod ring-1 failed" in started(t)


def test_pod_failures_can_be_left_out_and_deleted_pods_never_trigger() -> None:
    failed = healthy(B, failed_exit=1)
    assert (
        machine(pod_failure=False).handle(IDLE, seen(healthy(A), failed), 1.0).state.phase
        is RecoveryPhase.IDLE
    )
    stopping = healthy(B, phase="Failed", deleting=True)  # someone stops it on purpose
    assert machine().handle(IDLE, seen(healthy(A), stopping), 1.0).state.phase is RecoveryPhase.IDLE


def test_nothing_triggers_while_a_drain_moves_the_job_or_on_the_last_recoverys_pods() -> None:
    failed = seen(healthy(A), healthy(B, phase="Failed"), busy=True)
    assert machine().handle(IDLE, failed, 1.0).state == IDLE
    rest = RecoveryState("ring", RecoveryPhase.WAITING, seq=1, sources=(A, B))
    again = machine().handle(rest, seen(healthy(A), healthy(B, phase="Failed")), 2.0)
    assert again.state == rest and again.actions == ()
    new = PodRef("ring-1", "u9", "node-b")  # a new pod of the job fails: the next recovery
    nxt = machine().handle(rest, seen(healthy(new, phase="Failed")), 3.0)
    assert nxt.state.seq == 2 and nxt.state.phase is RecoveryPhase.FENCING and nxt.state.sources == (new,)


def test_a_healthy_job_stays_idle() -> None:
    t = machine().handle(IDLE, seen(healthy(A), healthy(B)), 1.0)
    assert t == type(t)(IDLE, (), None)
    assert machine().handle(IDLE, Tick(), 1.0).state == IDLE


# -- fencing


@pytest.mark.parametrize(
    ("pod", "node", "policy", "why"),
    [
        (healthy(A, phase="Failed"), down(), FencingPolicy.NODE_GONE, "its kubelet reported it Failed"),
        (healthy(A, phase="Succeeded"), down(), FencingPolicy.NODE_GONE, "its kubelet reported it Succeeded"),
        (healthy(A), NodeHealth("node-a", exists=False), FencingPolicy.NODE_GONE, "node node-a is gone"),
        (healthy(A), None, FencingPolicy.NODE_GONE, "node node-a is gone"),
        (healthy(A, deleting=True, running=False), NodeHealth("node-a"), FencingPolicy.NODE_GONE,
         "its kubelet killed it"),
        # a live kubelet still running it, or not yet asked
        (healthy(A, deleting=True), NodeHealth("node-a"), FencingPolicy.NODE_GONE, None),
        (healthy(A, running=False), NodeHealth("node-a"), FencingPolicy.NODE_GONE, None),
        # an unreachable node's report is stale: its kubelet may restart it
        (healthy(A, deleting=True, running=False), down(), FencingPolicy.NODE_GONE, None),
        (healthy(A, deleting=True), down(), FencingPolicy.NODE_GONE, None),
        # the out-of-service taint counts only under its policy
        (healthy(A), down(out_of_service=True), FencingPolicy.NODE_GONE, None),
        (healthy(A), down(out_of_service=True), FencingPolicy.OUT_OF_SERVICE_TAINT,
         "node node-a is tainted node.kubernetes.io/out-of-service"),
        (healthy(A), down(), FencingPolicy.OUT_OF_SERVICE_TAINT, None),
    ],
)  # fmt: skip
def test_each_fencing_decision(
    pod: PodHealth, node: NodeHealth | None, policy: FencingPolicy, why: str | None
) -> None:
    assert fenced(pod, node, replace(CONFIG, fencing=policy)) == why


def fencing_state(**more: object) -> RecoveryState:
    t = machine().handle(IDLE, seen(healthy(A), healthy(B), nodes=(down(),)), 1060.0)
    return replace(t.state, **more)  # type: ignore[arg-type]


def test_the_unreachable_pod_is_waited_for_until_its_node_is_deleted() -> None:
    m, state = machine(), fencing_state()
    # ring-1 (live node) was killed and is gone; ring-0 on the dead node is still "Running"
    t = m.handle(state, seen(healthy(A, deleting=True), nodes=(down(),)), 1070.0)
    assert t.state.phase is RecoveryPhase.FENCING and t.actions == () and t.wake_at == 1660.0
    assert "ring-0 on node-a is known not to run" in (t.state.message or "")
    assert "delete its Node object" in (t.state.message or "") and "out-of-service" not in (
        t.state.message or ""
    )
    gone = m.handle(
        state, seen(healthy(A, deleting=True), nodes=(NodeHealth("node-a", exists=False),)), 1080.0
    )
    assert gone.actions == (RemovePods((A,)),) and gone.state.phase is RecoveryPhase.FENCING
    done = m.handle(gone.state, seen(nodes=(NodeHealth("node-a", exists=False),)), 1081.0)
    assert done.state.phase is RecoveryPhase.RESTORING and done.state.restore_job == "ring-recover-1"
    assert done.actions == (StartRecoveryRestore("ring-recover-1", ("node-a",), "ring-7"),)


def test_out_of_service_fences_under_its_policy_only() -> None:
    tainted = seen(healthy(A, deleting=True), nodes=(down(out_of_service=True),))
    assert machine().handle(fencing_state(), tainted, 1070.0).actions == ()
    t = machine(fencing=FencingPolicy.OUT_OF_SERVICE_TAINT).handle(fencing_state(), tainted, 1070.0)
    assert t.actions == (RemovePods((A,)),)
    waiting = machine(fencing=FencingPolicy.OUT_OF_SERVICE_TAINT).handle(
        fencing_state(), seen(healthy(A, deleting=True), nodes=(down(),)), 1070.0
    )
    assert "taint it node.kubernetes.io/out-of-service" in (waiting.state.message or "")


def test_a_live_kubelets_kill_is_its_confirmation() -> None:
    state = replace(fencing_state(), nodes=(), trigger=Trigger.POD_FAILED)
    killed = healthy(A, deleting=True, running=False)
    t = machine().handle(state, seen(killed, healthy(B, deleting=True)), 1070.0)
    assert t.actions == (RemovePods((A,)),) and t.state.phase is RecoveryPhase.FENCING


# -- the end of a restore


def restoring() -> RecoveryState:
    return replace(fencing_state(), phase=RecoveryPhase.RESTORING, restore_job="ring-recover-1")


def test_the_bound_checkpoint_sets_the_work_lost_and_success_records_it() -> None:
    m = machine()
    bound = m.handle(restoring(), RestoreBound("ring-recover-1", "ring-8", 960.0), 1100.0).state
    assert (bound.checkpoint, bound.work_lost) == ("ring-8", 40.0)
    assert m.handle(restoring(), RestoreBound("other", "x", 1.0), 1100.0).state == restoring()
    t = m.handle(bound, RestoreEnded("ring-recover-1", True), 1160.0)
    assert t.state.phase is RecoveryPhase.RECOVERED and t.state.reason == "Recovered"
    assert t.state.ended_at == 1160.0
    assert events(t) == [("Normal", "Recovered")]
    assert RecordRecovery("Recovered", 100.0, 40.0) in t.actions
    assert "restored from ring-8 in 100s, 40s of work lost" in (t.state.message or "")


def test_a_failed_restore_waits_for_a_person_by_default() -> None:
    t = machine().handle(restoring(), RestoreEnded("ring-recover-1", False, "PodExists: ring-0"), 1100.0)
    assert t.state.phase is RecoveryPhase.WAITING and t.state.reason == "RestoreFailed"
    assert events(t) == [("Warning", "RecoveryWaiting")]
    assert RecordRecovery("WaitingForPerson", 40.0, None) in t.actions


def test_a_failed_restore_restarts_from_scratch_under_that_policy() -> None:
    m = machine(no_checkpoint=NoCheckpointPolicy.RESTART_FROM_SCRATCH)
    state = replace(restoring(), restartable=True, bare=(B,))
    t = m.handle(state, RestoreEnded("ring-recover-1", False, "bad"), 1100.0)
    assert t.state.phase is RecoveryPhase.FENCING and t.state.from_scratch
    done = m.handle(t.state, seen(), 1101.0)
    assert done.state.phase is RecoveryPhase.RESTARTED and events(done) == [
        ("Warning", "RestartedFromScratch")
    ]
    assert done.of_type(RecreatePods) == [RecreatePods((B,))]
    none_left = m.handle(
        replace(restoring(), restartable=False), RestoreEnded("ring-recover-1", False, "x"), 1100.0
    )
    assert none_left.state.phase is RecoveryPhase.WAITING


# -- no checkpoint


def test_no_checkpoint_waits_for_a_person_and_touches_nothing() -> None:
    t = machine().handle(IDLE, seen(healthy(A), healthy(B, failed_exit=2), hint=None), 10.0)
    assert t.state.phase is RecoveryPhase.WAITING and t.state.reason == "NoCheckpoint"
    assert not t.of_type(StopPods) and events(t) == [("Warning", "RecoveryWaiting")]
    assert "RestartFromScratch" in (t.state.message or "")


def test_no_checkpoint_restarts_a_controlled_job_from_scratch() -> None:
    m = machine(no_checkpoint=NoCheckpointPolicy.RESTART_FROM_SCRATCH)
    pods = (healthy(A, controlled=True), healthy(B, controlled=True, failed_exit=2))
    t = m.handle(IDLE, seen(*pods, hint=None), 10.0)
    assert t.state.phase is RecoveryPhase.FENCING and t.state.from_scratch and t.state.restartable
    assert t.actions[0] == StopPods((A, B))
    done = m.handle(t.state, seen(), 20.0)
    assert done.state.phase is RecoveryPhase.RESTARTED and not done.of_type(StartRecoveryRestore)
    assert RecordRecovery("RestartedFromScratch", 10.0, None) in done.actions


def test_no_checkpoint_creates_bare_pods_again_once_every_source_is_gone() -> None:
    """Bare pods have no controller: their templates are kept from the recovery's start (the driver
    writes them to status before the pods are stopped) and the operator creates them again, only once
    no source is left (never two copies of a rank)."""
    m = machine(no_checkpoint=NoCheckpointPolicy.RESTART_FROM_SCRATCH)
    t = m.handle(IDLE, seen(healthy(A, controlled=True), healthy(B, failed_exit=2), hint=None), 10.0)
    assert t.state.phase is RecoveryPhase.FENCING and t.state.from_scratch and t.state.restartable
    assert t.state.bare == (B,) and t.actions[0] == StopPods((A, B))
    waiting = m.handle(t.state, seen(healthy(B, deleting=True), nodes=(down("node-b"),)), 15.0)
    assert waiting.state.phase is RecoveryPhase.FENCING and not waiting.of_type(RecreatePods)
    done = m.handle(t.state, seen(), 20.0)
    assert done.state.phase is RecoveryPhase.RESTARTED and done.of_type(RecreatePods) == [RecreatePods((B,))]
    message = done.state.message or ""
    assert "the operator created ring-1 again from scratch" in message, message
    assert "their controllers start the others" in message, message
    alone = m.handle(IDLE, seen(healthy(A), healthy(B, failed_exit=2), hint=None), 10.0).state
    assert alone.bare == (A, B)
    assert "controllers" not in (m.handle(alone, seen(), 20.0).state.message or "")


def test_bare_pods_not_yet_created_when_the_operator_stopped_are_created_after_its_restart() -> None:
    """The status says RestartedFromScratch before the driver creates the bare pods: an operator that
    stopped in between creates them (if absent) when it starts again; once created, the templates
    leave the state and a later restart creates nothing."""
    m = machine(no_checkpoint=NoCheckpointPolicy.RESTART_FROM_SCRATCH)
    fencing = m.handle(IDLE, seen(healthy(A, controlled=True), healthy(B, failed_exit=2), hint=None), 10.0)
    ended = m.handle(fencing.state, seen(), 20.0).state
    assert ended.phase is RecoveryPhase.RESTARTED and ended.bare == (B,)
    again = m.handle(ended, OperatorRestarted(), 30.0)
    assert again.of_type(RecreatePods) == [RecreatePods((B,))] and again.state == ended
    created = m.handle(ended, BarePodsCreated(), 21.0).state
    assert created.bare == () and created.phase is RecoveryPhase.RESTARTED
    assert created.message == ended.message
    assert not m.handle(created, OperatorRestarted(), 30.0).actions


def test_templates_are_kept_only_under_restart_from_scratch() -> None:
    t = machine().handle(IDLE, seen(healthy(A), healthy(B, failed_exit=2)), 10.0)
    assert t.state.phase is RecoveryPhase.FENCING and t.state.bare == ()


# -- the deadline, restarts


def test_fencing_past_the_deadline_fails_loudly() -> None:
    state = fencing_state()
    t = machine().handle(state, seen(healthy(A, deleting=True), nodes=(down(),)), 1660.0)
    assert t.state.phase is RecoveryPhase.FAILED and t.state.reason == "RecoveryDeadlineExceeded"
    assert events(t) == [("Warning", "RecoveryFailed")]
    assert "not recovered after 600s (Fencing)" in (t.state.message or "")
    assert machine().handle(state, Tick(), 1659.0).wake_at == 1660.0


def test_restoring_past_the_deadline_cancels_the_restore() -> None:
    t = machine().handle(restoring(), Tick(), 1700.0)
    assert t.state.phase is RecoveryPhase.FAILED and t.actions[0] == CancelRestore("ring-recover-1")
    late = machine().handle(t.state, RestoreEnded("ring-recover-1", True), 1701.0)
    assert late.state.phase is RecoveryPhase.FAILED  # a late end changes nothing


def test_a_restarted_operator_issues_the_phases_side_effect_again() -> None:
    m = machine()
    assert m.handle(fencing_state(), OperatorRestarted(), 1070.0).actions == (StopPods((A, B)),)
    again = m.handle(restoring(), OperatorRestarted(), 1070.0)
    assert again.actions == (StartRecoveryRestore("ring-recover-1", ("node-a",), "ring-7"),)
    assert m.handle(IDLE, OperatorRestarted(), 1.0).actions == ()


# -- the bound on recoveries in a row


def crashes(m: RecoveryMachine, state: RecoveryState, n: int, now: float) -> RecoveryState:
    """The job's rank `n` (a new pod each time: the restored one) fails at `now`; the recovery that
    starts runs to a successful restore."""
    pod = PodRef(f"ring-{n}", f"new-{n}", "node-b")
    t = m.handle(state, seen(healthy(pod, failed_exit=139)), now)
    if t.state.phase is not RecoveryPhase.FENCING:
        return t.state
    restoring = m.handle(t.state, seen(), now + 1).state
    return m.handle(restoring, RestoreEnded(restoring.restore_job or "", True), now + 2).state


def test_a_job_that_fails_after_every_restore_is_recovered_max_recoveries_times_then_waits() -> None:
    m = machine(max_recoveries=2, window_seconds=3600)
    state = crashes(m, IDLE, 1, 100.0)
    state = crashes(m, state, 2, 200.0)
    assert state.phase is RecoveryPhase.RECOVERED and state.recent == (100.0, 200.0)
    third = PodRef("ring-3", "new-3", "node-b")
    t = m.handle(state, seen(healthy(third, failed_exit=139)), 300.0)
    assert t.state.phase is RecoveryPhase.WAITING and t.state.reason == "TooManyRecoveries"
    assert not t.of_type(StopPods) and not t.of_type(StartRecoveryRestore)  # nothing touched
    assert events(t) == [("Warning", "RecoveryWaiting")]
    assert RecordRecovery("WaitingForPerson", 0.0, None) in t.actions
    message = t.state.message or ""
    assert "pod ring-3 failed (exit code 139)" in message
    assert "2 recoveries of ring began within the last 3600s (recovery.maxRecoveries: 2)" in message
    assert "nothing was touched; waiting for a person" in message
    assert t.state.seq == 3 and t.state.sources == (third,) and t.state.recent == (100.0, 200.0)
    # the failed pod stays as it is and triggers nothing more
    again = m.handle(t.state, seen(healthy(third, failed_exit=139)), 400.0)
    assert again.state == t.state and again.actions == ()


def test_recoveries_older_than_the_window_no_longer_count() -> None:
    m = machine(max_recoveries=2, window_seconds=3600)
    state = replace(IDLE, phase=RecoveryPhase.RECOVERED, seq=2, recent=(100.0, 200.0))
    t = m.handle(state, seen(healthy(A, failed_exit=1)), 3700.0)
    assert t.state.phase is RecoveryPhase.FENCING and t.state.recent == (200.0, 3700.0)
    inside = m.handle(state, seen(healthy(A, failed_exit=1)), 3699.0)
    assert inside.state.reason == "TooManyRecoveries"


def test_only_recoveries_that_stopped_the_job_count() -> None:
    m = machine(max_recoveries=1)
    waited = m.handle(IDLE, seen(healthy(A, failed_exit=2), hint=None), 10.0)  # NoCheckpoint: untouched
    assert waited.state.reason == "NoCheckpoint" and waited.state.recent == ()
    scratch = machine(max_recoveries=1, no_checkpoint=NoCheckpointPolicy.RESTART_FROM_SCRATCH)
    pods = (healthy(A, controlled=True, failed_exit=2),)
    restarted = scratch.handle(IDLE, seen(*pods, hint=None), 10.0)
    assert restarted.state.from_scratch and restarted.state.recent == (10.0,)  # stopped: it counts
    new = healthy(PodRef("ring-0", "u7", "node-a"), controlled=True, failed_exit=2)
    done = replace(restarted.state, phase=RecoveryPhase.RESTARTED)
    assert scratch.handle(done, seen(new, hint=None), 20.0).state.reason == "TooManyRecoveries"


def test_the_bound_defaults_to_three_an_hour_and_survives_a_restart() -> None:
    assert (RecoveryConfig().max_recoveries, RecoveryConfig().window_seconds) == (3, 3600.0)
    spec = RecoveryConfig.from_protection(RecoveryProtection.from_wire({"maxRecoveries": 5}))
    assert (spec.max_recoveries, spec.window_seconds) == (5, 3600)
    state = replace(IDLE, phase=RecoveryPhase.RECOVERED, seq=2, recent=(100.0, 200.5))
    status = CheckpointScheduleStatus(**recovery_status(state, {}))
    wire = status.to_wire()
    assert wire["recovery"]["recentStarts"] == ["1970-01-01T00:01:40Z", "1970-01-01T00:03:20.500000Z"]
    assert recovery_state("ring", CheckpointScheduleStatus.from_wire(wire)) == state


def test_the_bare_sources_and_their_templates_survive_a_restart() -> None:
    template = PodTemplate(labels={"app": "ring"}, spec={"containers": [{"name": "main", "image": "ring"}]})
    state = replace(fencing_state(), from_scratch=True, restartable=True, bare=(B,))
    status = CheckpointScheduleStatus(**recovery_status(state, {}, {B.uid: template, "gone": template}))
    wire = CheckpointScheduleStatus.from_wire(status.to_wire())
    assert [p.name for p in wire.recovery.scratch_pods or ()] == [B.name]  # type: ignore[union-attr]
    assert recovery_state("ring", wire) == state
    assert scratch_templates(wire) == {B.uid: template}
