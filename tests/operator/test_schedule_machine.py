"""The CheckpointSchedule machine, pure, with fake time: the interval formula, firing, overlap, retention."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from ibckpt.api.schedule import CheckpointScheduleSpec, OverlapPolicy
from ibckpt.api.schema import apply_defaults, structural_schema
from ibckpt_operator.machine.core import EmitEvent, OperatorRestarted, Tick
from ibckpt_operator.machine.schedule import (
    CheckpointInfo,
    CreateCheckpointJob,
    DeleteCheckpoint,
    DeleteCheckpointJob,
    JobFinished,
    JobInfo,
    ScheduleMachine,
    SchedulePolicy,
    decide,
    estimate_cost,
    young_daly,
)
from testbed.machines import T0

TEMPLATE = {"selector": {"matchLabels": {"app": "ring"}}, "storageRef": {"name": "s3"}}


def test_young_daly_formula() -> None:
    assert young_daly(50.0, 3600.0) == pytest.approx(600.0)  # sqrt(2 * 50 * 3600)
    assert young_daly(0.0, 3600.0) == 0.0
    assert young_daly(8.0, 10_000.0) == pytest.approx(math.sqrt(160_000.0))
    with pytest.raises(ValueError):
        young_daly(-1.0, 10.0)
    with pytest.raises(ValueError):
        young_daly(1.0, 0.0)


def test_cost_is_the_mean_of_the_last_window() -> None:
    assert estimate_cost([], 3) is None
    assert estimate_cost([100.0, 10.0, 20.0, 30.0], 3) == pytest.approx(20.0)
    assert estimate_cost([7.0], 5) == 7.0


def test_interval_fixed_computed_and_clamped() -> None:
    fixed = SchedulePolicy(interval_seconds=900)
    assert fixed.interval([1000.0]) == (900.0, 1000.0)
    daly = SchedulePolicy(
        mtbf_seconds=3600, min_interval_seconds=60, max_interval_seconds=7200, cost_window=2
    )
    assert daly.interval([]) == (60.0, None)  # nothing measured: measure early
    interval, cost = daly.interval([999.0, 40.0, 60.0])  # mean of the last two: 50 s
    assert cost == pytest.approx(50.0) and interval == pytest.approx(600.0)
    assert daly.interval([0.1])[0] == 60.0  # clamped up
    assert daly.interval([100_000.0])[0] == 7200.0  # clamped down
    assert SchedulePolicy(interval_seconds=900, suspend=True).interval([1.0]) == (None, None)
    assert SchedulePolicy().interval([]) == (None, None)  # drain protection only


def test_policy_from_the_spec() -> None:
    spec = CheckpointScheduleSpec.from_wire(
        {"mtbfSeconds": 86400, "overlapPolicy": "Queue", "retention": {"keepLast": 5, "maxAgeSeconds": 600},
         "template": TEMPLATE}
    )  # fmt: skip
    policy = SchedulePolicy.from_spec(spec)
    assert policy.mtbf_seconds == 86400 and policy.overlap is OverlapPolicy.QUEUE
    assert (policy.keep_last, policy.max_age_seconds, policy.min_keep) == (5, 600, 1)
    assert spec.periodic and spec.to_wire()["costWindow"] == 5


@pytest.mark.parametrize(
    "spec",
    [
        {"mtbfSeconds": 3600, "template": TEMPLATE},
        {"drain": {}, "template": TEMPLATE},
        {"intervalSeconds": 600, "retention": {"maxAgeSeconds": 60}, "template": TEMPLATE},
    ],
)
def test_server_defaults_match_the_model(spec: dict[str, object]) -> None:
    # What the apiserver's defaulting makes of the generated schema is what the operator reads.
    schema = structural_schema(CheckpointScheduleSpec)
    assert apply_defaults(spec, schema) == CheckpointScheduleSpec.from_wire(spec).to_wire()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "give intervalSeconds, mtbfSeconds, drain or recovery"),
        ({"intervalSeconds": 600, "mtbfSeconds": 3600}, "at most one of intervalSeconds and mtbfSeconds"),
        ({"mtbfSeconds": 3600, "minIntervalSeconds": 900, "maxIntervalSeconds": 600}, "must not exceed"),
        ({"intervalSeconds": 5}, "greater than or equal to 60"),
    ],
)
def test_spec_rejects(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        CheckpointScheduleSpec.from_wire({**extra, "template": TEMPLATE})
    assert message in str(info.value)


def test_drain_alone_is_a_protection_without_periodic_checkpoints() -> None:
    spec = CheckpointScheduleSpec.from_wire({"drain": {}, "template": TEMPLATE})
    assert not spec.periodic and spec.drain is not None and spec.drain.deadline_seconds == 1800
    machine = ScheduleMachine(SchedulePolicy.from_spec(spec))
    t = machine.start("ring", T0)
    assert t.wake_at is None and t.actions == ()
    assert machine.handle(t.state, Tick(), T0 + 10**6).actions == ()


def test_fires_every_interval_and_names_jobs_in_sequence() -> None:
    machine = ScheduleMachine(SchedulePolicy(interval_seconds=600))
    t = machine.start("ring", T0)
    assert t.actions == () and t.wake_at == T0 + 600
    t = machine.handle(t.state, Tick(), T0 + 599)
    assert t.actions == () and t.wake_at == T0 + 600
    t = machine.handle(t.state, Tick(), T0 + 600)
    assert t.of_type(CreateCheckpointJob) == [CreateCheckpointJob("ring-1")]
    assert t.state.active_job == "ring-1" and t.wake_at == T0 + 1200
    t = machine.handle(t.state, JobFinished("ring-1", True, 42.0), T0 + 650)
    assert t.state.active_job is None and t.state.durations == (42.0,) and t.actions == ()
    t = machine.handle(t.state, Tick(), T0 + 1200)
    assert t.of_type(CreateCheckpointJob) == [CreateCheckpointJob("ring-2")]
    assert t.state.last_start == T0 + 1200


def test_a_late_tick_fires_once_and_counts_from_the_fire() -> None:
    machine = ScheduleMachine(SchedulePolicy(interval_seconds=600))
    t = machine.handle(machine.start("ring", T0).state, Tick(), T0 + 5000)  # operator was down
    assert len(t.of_type(CreateCheckpointJob)) == 1 and t.wake_at == T0 + 5600


def test_young_daly_interval_follows_measured_cost() -> None:
    machine = ScheduleMachine(SchedulePolicy(mtbf_seconds=3600, min_interval_seconds=60, cost_window=2))
    t = machine.start("ring", T0)
    assert t.wake_at == T0 + 60  # no cost yet: the lower clamp
    t = machine.handle(t.state, Tick(), T0 + 60)
    t = machine.handle(t.state, JobFinished("ring-1", True, 50.0), T0 + 110)
    assert t.state.interval == pytest.approx(600.0) and t.state.cost == pytest.approx(50.0)
    assert t.wake_at == pytest.approx(T0 + 660)
    t = machine.handle(t.state, Tick(), T0 + 660)
    t = machine.handle(t.state, JobFinished("ring-2", True, 200.0), T0 + 860)  # mean 125
    assert t.state.interval == pytest.approx(math.sqrt(2 * 125 * 3600))


def test_failed_and_stale_results() -> None:
    machine = ScheduleMachine(SchedulePolicy(interval_seconds=600))
    t = machine.handle(machine.start("ring", T0).state, Tick(), T0 + 600)
    stale = machine.handle(t.state, JobFinished("ring-0", True, 1.0), T0 + 610)
    assert stale.state == t.state and stale.actions == ()
    t = machine.handle(t.state, JobFinished("ring-1", False), T0 + 620)
    assert t.state.active_job is None and t.state.durations == ()  # a failure measures nothing
    assert [a.reason for a in t.of_type(EmitEvent)] == ["CheckpointFailed"]


def test_overlap_skip() -> None:
    machine = ScheduleMachine(SchedulePolicy(interval_seconds=600, overlap=OverlapPolicy.SKIP))
    t = machine.handle(machine.start("ring", T0).state, Tick(), T0 + 600)
    t = machine.handle(t.state, Tick(), T0 + 1200)  # ring-1 still runs
    assert t.of_type(CreateCheckpointJob) == []
    assert [a.reason for a in t.of_type(EmitEvent)] == ["CheckpointSkipped"]
    assert t.wake_at == T0 + 1800
    t = machine.handle(t.state, JobFinished("ring-1", True, 700.0), T0 + 1300)
    assert t.of_type(CreateCheckpointJob) == []  # skipped, not queued
    t = machine.handle(t.state, Tick(), T0 + 1800)
    assert t.of_type(CreateCheckpointJob) == [CreateCheckpointJob("ring-2")]


def test_overlap_queue_holds_one_run() -> None:
    machine = ScheduleMachine(SchedulePolicy(interval_seconds=600, overlap=OverlapPolicy.QUEUE))
    t = machine.handle(machine.start("ring", T0).state, Tick(), T0 + 600)
    t = machine.handle(t.state, Tick(), T0 + 1200)
    assert t.state.queued and [a.reason for a in t.of_type(EmitEvent)] == ["CheckpointQueued"]
    t = machine.handle(t.state, Tick(), T0 + 1800)  # still running: still one queued, no second event
    assert t.state.queued and t.actions == ()
    t = machine.handle(t.state, JobFinished("ring-1", True, 1500.0), T0 + 2000)
    assert t.of_type(CreateCheckpointJob) == [CreateCheckpointJob("ring-2")]
    assert not t.state.queued and t.state.active_job == "ring-2" and t.wake_at == T0 + 2600


def test_suspend_and_restart() -> None:
    running = ScheduleMachine(SchedulePolicy(interval_seconds=600))
    t = running.handle(running.start("ring", T0).state, Tick(), T0 + 600)
    suspended = ScheduleMachine(SchedulePolicy(interval_seconds=600, suspend=True))
    s = suspended.handle(t.state, Tick(), T0 + 5000)
    assert s.actions == () and s.wake_at is None and s.state.next_fire is None
    # The running job still finishes into the state while suspended.
    s = suspended.handle(s.state, JobFinished("ring-1", True, 30.0), T0 + 5001)
    assert s.state.active_job is None and s.state.durations == (30.0,)
    # A restarted operator reads the state back; nothing is created twice.
    r = running.handle(t.state, OperatorRestarted(), T0 + 700)
    assert r.actions == () and r.state.active_job == "ring-1"


def _ckpt(name: str, age: float, **kw: object) -> CheckpointInfo:
    return CheckpointInfo(name, T0 - age, **kw)  # type: ignore[arg-type]


def test_retention_keep_last_and_age() -> None:
    checkpoints = [_ckpt(f"c{i}", i * 100.0) for i in range(6)]  # c0 newest
    got = {d.name: d.keep for d in decide(checkpoints, SchedulePolicy(keep_last=3), T0)}
    assert got == {"c0": True, "c1": True, "c2": True, "c3": False, "c4": False, "c5": False}
    aged = decide(checkpoints, SchedulePolicy(keep_last=None, max_age_seconds=250), T0)
    assert [d.name for d in aged if not d.keep] == ["c3", "c4", "c5"]


def test_retention_never_prunes_pinned_in_use_or_newest_complete() -> None:
    checkpoints = [
        _ckpt("new-broken", 0.0, complete=False),
        _ckpt("newest-good", 100.0),
        _ckpt("pinned", 200.0, pinned=True),
        _ckpt("restoring", 300.0, used_by="back"),
        _ckpt("plain", 400.0),
        _ckpt("old-broken", 9000.0, complete=False),
    ]
    policy = SchedulePolicy(keep_last=1, max_age_seconds=1000, min_keep=0)
    got = {d.name: (d.keep, d.reason) for d in decide(checkpoints, policy, T0)}
    assert got["newest-good"] == (True, "the newest complete checkpoint")
    assert got["pinned"] == (True, "pinned")
    assert got["restoring"] == (True, "in use by RestoreJob back")
    assert got["plain"] == (False, "not among the 1 newest")
    assert got["new-broken"][0] is True and got["old-broken"][0] is False
    # Even keepLast and maxAge that would drop everything keep the newest complete one.
    everything = decide([_ckpt("a", 10_000.0), _ckpt("b", 20_000.0)], policy, T0)
    assert [(d.name, d.keep) for d in everything] == [("a", True), ("b", False)]


def test_retention_min_keep_and_prune_actions() -> None:
    checkpoints = [_ckpt(f"c{i}", i * 1000.0) for i in range(4)]
    policy = SchedulePolicy(keep_last=None, max_age_seconds=10, min_keep=2)
    assert [d.name for d in decide(checkpoints, policy, T0) if not d.keep] == ["c2", "c3"]
    actions = ScheduleMachine(policy).prune(checkpoints, T0)
    deletes = [a for a in actions if isinstance(a, DeleteCheckpoint)]
    assert [d.name for d in deletes] == ["c2", "c3"] and "older than 10s" in deletes[0].reason
    assert [a.reason for a in actions if isinstance(a, EmitEvent)] == ["CheckpointPruned"] * 2


def test_job_history_keeps_the_newest_of_each_outcome_and_what_is_in_use() -> None:
    jobs = [JobInfo(f"ok-{i}", i * 10.0, "Succeeded") for i in range(5)]
    jobs += [JobInfo(f"bad-{i}", i * 10.0 + 1, "Failed") for i in range(3)]
    jobs += [JobInfo("running", 0.0, "Running"), JobInfo("new", 0.0, "")]
    machine = ScheduleMachine(SchedulePolicy(successful_jobs_kept=2, failed_jobs_kept=1))
    actions = machine.prune_jobs(jobs, in_use=frozenset({"ok-0"}))  # a migration's job, say
    deletes = [a for a in actions if isinstance(a, DeleteCheckpointJob)]
    assert [d.name for d in deletes] == ["ok-1", "ok-2", "bad-0", "bad-1"]  # oldest first
    assert deletes[0].reason == "succeeded, beyond the 2 newest kept"
    assert [a.reason for a in actions if isinstance(a, EmitEvent)] == ["CheckpointJobPruned"] * 4
    keep_all = ScheduleMachine(SchedulePolicy(successful_jobs_kept=10, failed_jobs_kept=10))
    assert keep_all.prune_jobs(jobs, frozenset()) == ()
