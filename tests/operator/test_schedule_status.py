"""The schedule's cluster side, without a cluster: the CheckpointJob a fire creates from the template, the
measured cost of a finished job, how the interval was chosen, and the ScheduleState through status."""

from __future__ import annotations

from ibckpt.api import CheckpointScheduleSpec, CheckpointScheduleStatus, JobPhase, StorageTier
from ibckpt_operator.cluster import schedules
from ibckpt_operator.machine.core import Tick
from ibckpt_operator.machine.schedule import JobFinished, ScheduleMachine, SchedulePolicy

OWNER = {
    "apiVersion": "ibckpt.io/v1alpha1",
    "kind": "CheckpointSchedule",
    "metadata": {"name": "ring", "namespace": "hpc", "uid": "u-1"},
}
TEMPLATE = {
    "selector": {"matchLabels": {"app": "ring"}},
    "storageRef": {"name": "s3"},
    "checkpointName": "fixed",
    "copyLabels": ["team"],
}


def spec(**fields: object) -> CheckpointScheduleSpec:
    return CheckpointScheduleSpec.from_wire({"template": TEMPLATE, **fields})


def test_a_fire_makes_a_labelled_owned_job_from_the_template() -> None:
    body = schedules.checkpoint_job_body(OWNER, spec(intervalSeconds=600), "ring-3")
    assert body["metadata"]["name"] == "ring-3"
    assert body["metadata"]["labels"] == {"ibckpt.io/schedule": "ring"}
    owner = body["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "u-1" and owner["kind"] == "CheckpointSchedule" and owner["controller"] is True
    assert body["spec"]["copyLabels"] == ["team", "ibckpt.io/schedule"]  # its Checkpoint carries the label
    assert "checkpointName" not in body["spec"]  # one fixed name would collide on the second fire
    assert (
        body["spec"]["selector"] == {"matchLabels": {"app": "ring"}}
        and body["spec"]["mode"] == "LeaveRunning"
    )


def test_a_migration_job_is_stop_and_names_its_checkpoint() -> None:
    body = schedules.checkpoint_job_body(OWNER, spec(drain={}), "ring-drain-1", stop_into="ring-drain-1")
    assert body["spec"]["mode"] == "Stop" and body["spec"]["checkpointName"] == "ring-drain-1"


def test_fires_and_migrations_keep_the_templates_compression() -> None:
    template = {**TEMPLATE, "compression": "none"}
    both = CheckpointScheduleSpec.from_wire({"template": template, "intervalSeconds": 600, "drain": {}})
    fire = schedules.checkpoint_job_body(OWNER, both, "r-1")
    migration = schedules.checkpoint_job_body(OWNER, both, "r-drain-1", stop_into="r-drain-1")
    assert fire["spec"]["compression"] == migration["spec"]["compression"] == "none"


def test_a_migration_restore_is_bounded_like_its_checkpoint() -> None:
    timeouts = {"admitSeconds": 300, "dumpSeconds": 900, "resumeSeconds": 45}
    owner = {**OWNER, "spec": {"drain": {}, "template": {**TEMPLATE, "timeouts": timeouts}}}
    body = schedules.restore_job_body(owner, "ring-restore-1", "ring-drain-1", ("node-1",))
    assert body["spec"]["checkpointName"] == "ring-drain-1" and body["spec"]["avoidNodes"] == ["node-1"]
    assert body["spec"]["timeouts"] == {"admitSeconds": 300, "resumeSeconds": 45}  # restores have no dump
    assert "timeouts" not in schedules.restore_job_body(OWNER, "r", "c", ())["spec"]


def test_the_measured_cost() -> None:
    job = {"status": {"startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:00:42.5Z"}}
    assert schedules.measured_seconds(job, None) == 42.5
    assert schedules.measured_seconds(job, {"spec": {"timings": {"totalSeconds": 30}}}) == 30.0
    timings = {"pauseSeconds": 4.0, "totalSeconds": 30}
    assert schedules.measured_seconds(job, {"spec": {"timings": timings}}) == 4.0
    assert schedules.measured_seconds({"status": {}}, None) is None
    # the time to commit on the job's tier, when the Checkpoint has it: memory's, not the S3 upload after
    timings = {"commitSeconds": 2.5, "pauseSeconds": 4.0, "uploadSeconds": 60.0, "totalSeconds": 70}
    assert schedules.measured_seconds(job, {"spec": {"timings": timings}}) == 2.5


def test_the_commit_is_timed_from_the_cut_to_the_commit_on_the_jobs_tier() -> None:
    from ibckpt_operator.machine.timings import commit_seconds
    from testbed.checkpoint_machine import CheckpointDriver

    for tier, took in ((StorageTier.S3, 60.0), (StorageTier.MEMORY, 3.0)):
        job = CheckpointDriver(commit_on=tier)
        job.to_phase(JobPhase.UPLOADING)
        assert commit_seconds(job.state.phase_spans, job.state.phase, job.state.phase_since) is None
        job.now += took  # the upload, or the copies and their commit in memory
        job.to_phase(JobPhase.COMMITTED)
        cut = next(s.started_at for s in job.state.phase_spans if s.phase == JobPhase.QUIESCING)
        measured = commit_seconds(job.state.phase_spans, job.state.phase, job.state.phase_since)
        assert measured == round(job.state.phase_since - cut, 3) and took <= measured < took + 5
        job.to_phase(JobPhase.SUCCEEDED)  # still the commit's, not the end's
        assert commit_seconds(job.state.phase_spans, job.state.phase, job.state.phase_since) == measured


def test_how_the_interval_was_chosen_and_the_state_through_status() -> None:
    young_daly = spec(mtbfSeconds=3600, minIntervalSeconds=60)
    machine = ScheduleMachine(SchedulePolicy.from_spec(young_daly))
    state = machine.start("ring", 1_700_000_000.25).state
    assert schedules.interval_source(young_daly, state) == "Unmeasured" and state.interval == 60
    state = machine.handle(state, Tick(), 1_700_000_061).state
    assert state.active_job == "ring-1"
    state = machine.handle(state, JobFinished("ring-1", True, 50.0), 1_700_000_100).state
    assert schedules.interval_source(young_daly, state) == "YoungDaly" and state.cost == 50.0
    assert state.interval == (2 * 50.0 * 3600) ** 0.5
    fixed = spec(intervalSeconds=600)
    assert (
        schedules.interval_source(fixed, ScheduleMachine(SchedulePolicy.from_spec(fixed)).start("r", 0).state)
        == "Fixed"
    )
    wire = CheckpointScheduleStatus(**schedules.schedule_status(young_daly, state)).to_wire()
    back = schedules.schedule_state("ring", CheckpointScheduleStatus.from_wire(wire))
    assert back == state
    assert schedules.schedule_state("ring", CheckpointScheduleStatus()) is None
