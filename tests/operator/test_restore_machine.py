"""The RestoreJob state machine, pure, with fake time."""

from __future__ import annotations

import pytest

from ibckpt.api import RestoreJobSpec, RestorePhase
from ibckpt.vocabulary import Milestone
from ibckpt_operator.machine import PodRef, RestoreConfig, RestoreMachine, RestoreState, RestoreStep
from ibckpt_operator.machine.actions import (
    AdmitNodes,
    AwaitMilestone,
    CleanUpRestore,
    CloseSession,
    CreatePods,
    DownloadImages,
    PlacePods,
)
from ibckpt_operator.machine.core import (
    Cancelled,
    EmitEvent,
    OperatorRestarted,
    PodAdmitted,
    PodLost,
    PodRefused,
    PodStepDone,
    SessionOpened,
    StepFailed,
    Tick,
)
from ibckpt_operator.machine.restore import (
    CREATE_LEAD_SECONDS,
    ON_UNKNOWN,
    TERMINAL,
    CheckpointResolved,
    ImagesNearlyStaged,
    PodCreated,
    PodsPlaced,
    staging_seconds_left,
)
from testbed.machines import T0, MachineDriver

SOURCE = (PodRef("ring-0", node="node-1"), PodRef("ring-1", node="node-2"))
SWAP = {"ring-0": "node-2", "ring-1": "node-1"}


class Driver(MachineDriver[RestoreState]):
    """One RestoreJob's machine on the fake clock."""

    def __init__(self, **spec: object) -> None:
        config = RestoreConfig.from_spec(RestoreJobSpec.from_wire({"checkpointName": "ring-ckpt", **spec}))
        super().__init__(RestoreMachine(config), "r1", TERMINAL)

    @property
    def step(self) -> RestoreStep:
        assert self.state.step is not None
        return RestoreStep(self.state.step.kind)

    def awaited(self, milestone: Milestone) -> list[AwaitMilestone]:
        return [action for action in self.of_type(AwaitMilestone) if action.milestone == milestone]

    def advance(self) -> None:
        step = self.step
        if step == RestoreStep.RESOLVE:
            self.send(CheckpointResolved(self.attempt, SOURCE))
        elif step == RestoreStep.PLACE:
            self.send(PodsPlaced(self.attempt, SWAP))
        elif step == RestoreStep.ADMIT:
            for pod in SOURCE:
                self.send(PodAdmitted(self.attempt, pod.name))
        elif step == RestoreStep.OPEN_SESSION:
            self.send(SessionOpened(self.attempt))
        elif step == RestoreStep.CREATE_PODS:
            for pod in SOURCE:
                self.send(PodCreated(self.attempt, pod.name, f"new-{pod.name}"))
        else:
            self.each_done("name", 10, 1.0)


def test_a_restore_goes_through_every_phase_in_order() -> None:
    job = Driver()
    job.to_phase(RestorePhase.SUCCEEDED)
    assert job.phases == [
        RestorePhase.PENDING,
        RestorePhase.ADMITTED,
        RestorePhase.DOWNLOADING,
        RestorePhase.RESTORING,
        RestorePhase.REBUILDING,
        RestorePhase.RESUMING,
        RestorePhase.SUCCEEDED,
    ]
    assert job.side_effects() == [
        "ResolveCheckpoint", "PlacePods", "AdmitNodes", "OpenSession", "DownloadImages", "CreatePods",
        "AwaitMilestone(Restored)", "AwaitMilestone(Rebuilt)", "AwaitMilestone(Resumed)",
    ]  # fmt: skip
    # The images are staged before the pods exist: the agents are told the pods by name, no uid yet.
    (download,) = job.of_type(DownloadImages)
    assert {pod.name: (pod.node, pod.uid) for pod in download.pods} == {"ring-0": ("node-2", ""),
                                                                        "ring-1": ("node-1", "")}  # fmt: skip
    (create,) = job.of_type(CreatePods)
    assert {pod.name: pod.node for pod in create.pods} == SWAP  # the destinations, not the sources
    (restore,) = job.awaited(Milestone.RESTORED)
    assert {pod.name: (pod.node, pod.uid) for pod in restore.pods} == {
        "ring-0": ("node-2", "new-ring-0"),
        "ring-1": ("node-1", "new-ring-1"),
    }  # the created pods' uids, which the agents find the restored containers by
    assert [m.progress for m in job.state.members] == ["Resumed", "Resumed"]
    assert not job.of_type(CleanUpRestore)
    assert isinstance(job.actions[-1], CloseSession)


def test_nothing_is_downloaded_before_every_node_is_admitted() -> None:
    job = Driver()
    job.to_phase(RestorePhase.PENDING)
    job.send(CheckpointResolved(job.attempt, SOURCE))
    job.send(PodsPlaced(job.attempt, SWAP))
    job.send(PodAdmitted(job.attempt, "ring-0"))
    assert not job.of_type(DownloadImages)
    job.send(PodRefused(job.attempt, "ring-1", "node-1 has CRIU 3.17, the checkpoint needs 4.1"))
    assert job.state.phase == RestorePhase.FAILED and job.state.reason == "AdmissionRefused"
    assert not job.of_type(DownloadImages) and not job.of_type(CleanUpRestore)


@pytest.mark.parametrize(
    ("spec", "nodes", "problem"),
    [
        ({"avoidNodes": ["node-2"]}, SWAP, "ring-0: node-2 is in avoidNodes"),
        (
            {"avoidSourceNodes": True},
            {"ring-0": "node-1", "ring-1": "node-3"},
            "ring-0: node-1 is its source",
        ),
        ({}, {"ring-0": "node-3"}, "ring-1: no node"),
    ],
)
def test_a_placement_against_the_spec_is_rejected(
    spec: dict[str, object], nodes: dict[str, str], problem: str
) -> None:
    job = Driver(**spec)
    job.send(CheckpointResolved(job.attempt, SOURCE))
    (place,) = job.of_type(PlacePods)
    assert place.avoid_nodes == tuple(spec.get("avoidNodes", ()))  # type: ignore[arg-type]
    job.send(PodsPlaced(job.attempt, nodes))
    assert job.state.phase == RestorePhase.FAILED and job.state.reason == "PlacementRejected"
    assert problem in (job.state.message or "")
    assert not job.of_type(AdmitNodes)


def test_a_good_placement_away_from_the_sources_is_taken() -> None:
    job = Driver(avoidSourceNodes=True, avoidNodes=["node-9"])
    job.to_phase(RestorePhase.SUCCEEDED)


@pytest.mark.parametrize("phase", [RestorePhase.PENDING, RestorePhase.ADMITTED])
def test_a_deadline_before_anything_is_created_just_fails(phase: RestorePhase) -> None:
    job = Driver()
    job.to_phase(phase)
    limit = job.machine.config.timeouts[phase]
    assert job.last.wake_at == job.state.phase_since + limit
    job.send(Tick(), after=limit - 0.01)
    assert job.state.phase == phase
    job.send(Tick(), after=0.01)
    assert job.state.phase == RestorePhase.FAILED and job.state.reason == f"{phase}Timeout"
    assert not job.of_type(CleanUpRestore) and not job.of_type(CreatePods)


def test_the_pods_are_created_only_once_every_pods_images_are_staged() -> None:
    job = Driver()
    job.to_phase(RestorePhase.DOWNLOADING)
    assert job.step == RestoreStep.DOWNLOAD and not job.of_type(CreatePods)
    job.send(PodCreated(job.attempt, "ring-0", "new-ring-0"))  # not an answer to a download
    job.send(PodStepDone(job.attempt, "ring-0", bytes=10))
    assert job.step == RestoreStep.DOWNLOAD and not job.of_type(CreatePods)
    assert [(m.pod.uid, m.progress) for m in job.state.members] == [("", "Downloaded"), ("", "Admitted")]
    job.send(PodStepDone(job.attempt, "ring-1", bytes=10))
    assert job.step == RestoreStep.CREATE_PODS and job.state.phase == RestorePhase.RESTORING
    (create,) = job.of_type(CreatePods)
    assert [pod.name for pod in create.pods] == ["ring-0", "ring-1"]


def test_the_pods_are_created_while_the_last_bytes_download_once_every_node_is_nearly_done() -> None:
    job = Driver()
    job.to_phase(RestorePhase.DOWNLOADING)
    download = job.attempt
    job.send(ImagesNearlyStaged(download, CREATE_LEAD_SECONDS + 1))  # too far off: the wrapper would give up
    assert job.step == RestoreStep.DOWNLOAD and not job.of_type(CreatePods)
    job.send(PodStepDone(download, "ring-0", bytes=10))
    job.send(ImagesNearlyStaged(download, 12.0))
    assert job.step == RestoreStep.CREATE_PODS and job.state.phase == RestorePhase.RESTORING
    (create,) = job.of_type(CreatePods)
    assert [pod.name for pod in create.pods] == ["ring-0", "ring-1"]  # ring-1 still downloading
    said = [a.message for a in job.of_type(EmitEvent) if a.reason == "CreatingPods"]
    assert said == [
        "every node expects its images staged within 12s: creating the pods while the last bytes arrive"
    ]
    # The download's late answers and estimates change nothing now; the restore goes on as usual.
    job.send(PodStepDone(download, "ring-1", bytes=10))
    job.send(ImagesNearlyStaged(download, 0.0))
    assert len(job.of_type(CreatePods)) == 1
    job.to_phase(RestorePhase.SUCCEEDED)
    assert job.side_effects()[4:7] == ["DownloadImages", "CreatePods", "AwaitMilestone(Restored)"]


def test_a_download_that_fails_after_the_early_creation_removes_the_pods() -> None:
    job = Driver()
    job.to_phase(RestorePhase.DOWNLOADING)
    job.send(ImagesNearlyStaged(job.attempt, 5.0))
    job.send(PodCreated(job.attempt, "ring-0", "new-ring-0"))
    job.send(StepFailed(job.attempt, "AgentFailed", "node-1: fetching ring/c1: chunk 1f2e is missing"))
    assert job.state.phase == RestorePhase.CLEANING_UP and job.state.failed_from == RestorePhase.RESTORING
    (cleanup,) = job.of_type(CleanUpRestore)
    assert {pod.name: pod.uid for pod in cleanup.pods} == {"ring-0": "new-ring-0", "ring-1": ""}


@pytest.mark.parametrize(
    ("done", "planned", "seconds", "left"),
    [
        (0, 100, 5.0, None),  # nothing yet: no rate
        (10, 100, 1.0, None),  # too early to trust the rate
        (25, 100, 10.0, 30.0),  # a quarter in 10 s: three quarters in 30 s more
        (100, 100, 0.0, 0.0),
        (0, 0, 0.0, 0.0),  # nothing to stage on that node
    ],
)
def test_a_nodes_remaining_download_time_comes_from_its_rate_so_far(
    done: int, planned: int, seconds: float, left: float | None
) -> None:
    assert staging_seconds_left(done, planned, seconds) == left


def test_a_failure_while_creating_the_pods_removes_those_created() -> None:
    job = Driver()
    job.to_phase(RestorePhase.RESTORING)
    assert job.step == RestoreStep.CREATE_PODS  # the images are staged, the pods come next
    job.send(PodCreated(job.attempt, "ring-0", "new-ring-0"))
    job.send(PodStepDone(job.attempt, "ring-1"))  # not an answer to a create
    assert not job.awaited(Milestone.RESTORED)
    job.send(StepFailed(job.attempt, "PodExists", "pod ring-1 was created by someone else", pod="ring-1"))
    assert job.state.phase == RestorePhase.CLEANING_UP and job.state.failed_from == RestorePhase.RESTORING
    (cleanup,) = job.of_type(CleanUpRestore)
    assert {pod.name: pod.uid for pod in cleanup.pods} == {"ring-0": "new-ring-0", "ring-1": ""}
    for pod in SOURCE:
        job.send(PodStepDone(job.attempt, pod.name))
    assert job.state.phase == RestorePhase.FAILED and job.state.reason == "PodExists"
    assert job.state.message == "ring-1: pod ring-1 was created by someone else"


def test_a_download_deadline_aborts_the_agents_sessions_before_any_pod_exists() -> None:
    job = Driver()
    job.to_phase(RestorePhase.DOWNLOADING)
    assert job.step == RestoreStep.DOWNLOAD
    job.send(PodStepDone(job.attempt, "ring-0", bytes=10))
    job.send(Tick(), after=job.machine.config.timeouts[RestorePhase.DOWNLOADING])
    assert job.state.phase == RestorePhase.CLEANING_UP and job.state.reason == "DownloadingTimeout"
    assert "(waiting for ring-1)" in (job.state.message or "")
    assert not job.of_type(CreatePods)
    (cleanup,) = job.of_type(CleanUpRestore)  # the agents unstage; no uid: no pod was created
    assert [(pod.name, pod.uid) for pod in cleanup.pods] == [("ring-0", ""), ("ring-1", "")]


def test_the_restore_deadline_covers_the_creation_of_the_pods() -> None:
    job = Driver()
    job.to_phase(RestorePhase.RESTORING)
    assert job.step == RestoreStep.CREATE_PODS
    limit = job.machine.config.timeouts[RestorePhase.RESTORING]
    assert job.last.wake_at == job.state.phase_since + limit
    job.send(PodCreated(job.attempt, "ring-0", "new-ring-0"))
    job.send(Tick(), after=limit)
    assert job.state.phase == RestorePhase.CLEANING_UP and job.state.reason == "RestoringTimeout"
    assert "(waiting for ring-1)" in (job.state.message or "")
    (cleanup,) = job.of_type(CleanUpRestore)
    assert [(pod.name, pod.uid) for pod in cleanup.pods] == [("ring-0", "new-ring-0"), ("ring-1", "")]


@pytest.mark.parametrize("phase", [RestorePhase.RESTORING, RestorePhase.REBUILDING, RestorePhase.RESUMING])
def test_a_deadline_once_ranks_may_exist_removes_every_restored_rank(phase: RestorePhase) -> None:
    job = Driver()
    job.to_phase(phase)
    if job.step == RestoreStep.CREATE_PODS:  # Restoring starts by creating the pods
        job.advance()
    job.send(PodStepDone(job.attempt, "ring-0"))
    job.send(Tick(), after=job.machine.config.timeouts[phase])
    assert job.state.phase == RestorePhase.CLEANING_UP and job.state.failed_from == phase
    assert job.state.message == f"{phase} did not finish within {job.machine.config.timeouts[phase]:g}s " \
        "(waiting for ring-1)"  # fmt: skip
    (cleanup,) = job.of_type(CleanUpRestore)
    assert [pod.name for pod in cleanup.pods] == ["ring-0", "ring-1"]
    for pod in SOURCE:
        job.send(PodStepDone(job.attempt, pod.name))
    assert job.state.phase == RestorePhase.FAILED and job.state.reason == f"{phase}Timeout"


def test_a_clean_up_that_is_not_confirmed_in_time_still_ends() -> None:
    job = Driver()
    job.to_phase(RestorePhase.RESTORING)
    job.send(StepFailed(job.attempt, "RestoreFailed", "criu restore: pid 4242 is busy", pod="ring-1"))
    assert job.state.phase == RestorePhase.CLEANING_UP
    assert job.state.message == "ring-1: criu restore: pid 4242 is busy"
    job.send(PodStepDone(job.attempt, "ring-0"))
    job.send(Tick(), after=job.machine.config.timeouts[RestorePhase.CLEANING_UP])
    assert job.state.phase == RestorePhase.FAILED and job.state.reason == "RestoreFailed"
    assert "clean-up not confirmed within 120s (waiting for ring-1)" in (job.state.message or "")


def test_a_restart_mid_clean_up_asks_again_with_the_whole_bound() -> None:
    """No operator ran for longer than the clean-up's bound (a rollout): the next one cleans up again
    before it judges the bound."""
    job = Driver()
    job.to_phase(RestorePhase.RESTORING)
    job.send(StepFailed(job.attempt, "RestoreFailed", "criu restore: pid 4242 is busy", pod="ring-1"))
    bound = job.machine.config.timeouts[RestorePhase.CLEANING_UP]
    asked = len(job.of_type(CleanUpRestore))
    job.send(OperatorRestarted(), after=bound + 60)
    assert job.state.phase == RestorePhase.CLEANING_UP and len(job.of_type(CleanUpRestore)) == asked + 1
    job.send(Tick(), after=bound - 1)
    assert job.state.phase == RestorePhase.CLEANING_UP
    job.send(Tick(), after=1)
    assert job.state.phase == RestorePhase.FAILED and "clean-up not confirmed" in (job.state.message or "")


def test_the_overall_deadline_applies() -> None:
    job = Driver(activeDeadlineSeconds=50)
    job.to_phase(RestorePhase.ADMITTED)
    job.now = T0 + 50
    job.send(Tick())
    assert job.state.phase == RestorePhase.FAILED and job.state.reason == "DeadlineExceeded"

    late = Driver(activeDeadlineSeconds=50)
    late.to_phase(RestorePhase.DOWNLOADING)  # the agents are staging: their sessions are aborted first
    late.now = T0 + 50
    late.send(Tick())
    assert late.state.phase == RestorePhase.CLEANING_UP and late.state.reason == "DeadlineExceeded"


def test_a_lost_pod_or_a_cancel_after_restoring_cleans_up() -> None:
    job = Driver()
    job.to_phase(RestorePhase.REBUILDING)
    job.send(PodLost("ring-0", "the restored pod was deleted"))
    assert job.state.phase == RestorePhase.CLEANING_UP and job.state.reason == "PodLost"
    (cleanup,) = job.of_type(CleanUpRestore)
    assert [pod.name for pod in cleanup.pods] == ["ring-1"]
    job.send(PodStepDone(job.attempt, "ring-1"))
    assert job.state.phase == RestorePhase.FAILED

    cancelled = Driver()
    cancelled.to_phase(RestorePhase.RESUMING)
    cancelled.send(Cancelled())
    assert cancelled.state.phase == RestorePhase.CLEANING_UP and cancelled.state.reason == "Cancelled"


@pytest.mark.parametrize(
    ("step", "outcome"),
    [
        (RestoreStep.RESOLVE, "reissue"),
        (RestoreStep.PLACE, "reissue"),
        (RestoreStep.ADMIT, "reissue"),
        (RestoreStep.DOWNLOAD, "clean-up"),
        (RestoreStep.CREATE_PODS, "clean-up"),
        (RestoreStep.RESTORE, "clean-up"),
        (RestoreStep.REBUILD, "clean-up"),
        (RestoreStep.RESUME, "reissue"),
    ],
)
def test_a_restart_reissues_safe_steps_and_undoes_the_others(step: RestoreStep, outcome: str) -> None:
    job = Driver()
    for _ in range(30):
        if job.state.step is not None and job.step == step:
            break
        job.advance()
    kind = type(job.actions[-1])
    count, old = len(job.of_type(kind)), job.attempt
    job.send(OperatorRestarted())
    if outcome == "reissue":
        assert len(job.of_type(kind)) == count + 1 and job.attempt != old
        assert ON_UNKNOWN[step].value == "reissue"
        for _ in range(30):
            if job.state.phase == RestorePhase.SUCCEEDED:
                break
            job.advance()
        assert job.state.phase == RestorePhase.SUCCEEDED
    else:
        assert len(job.of_type(kind)) == count  # never replayed
        assert job.state.phase == RestorePhase.CLEANING_UP and job.state.reason == "OperatorRestarted"
        (cleanup,) = job.of_type(CleanUpRestore)  # every member: a pod status does not name is found by name
        assert [pod.name for pod in cleanup.pods] == ["ring-0", "ring-1"]
        if step == RestoreStep.DOWNLOAD:
            assert job.state.failed_from == RestorePhase.DOWNLOADING and not job.of_type(CreatePods)


def test_stale_and_foreign_results_are_ignored() -> None:
    job = Driver()
    job.to_phase(RestorePhase.DOWNLOADING)
    old = job.attempt
    job.send(PodStepDone(job.attempt, "ring-7"))  # not a pod of this checkpoint
    job.send(PodStepDone(old, "ring-0"))
    job.send(OperatorRestarted())
    before = job.state
    job.send(PodStepDone(old, "ring-1"))
    assert job.state == before
    assert not job.awaited(Milestone.REBUILT) and not job.awaited(Milestone.RESUMED)


def test_an_empty_checkpoint_fails() -> None:
    job = Driver()
    job.send(CheckpointResolved(job.attempt, ()))
    assert job.state.phase == RestorePhase.FAILED and job.state.reason == "EmptyCheckpoint"


def test_every_phase_left_is_timed_on_the_machines_clock() -> None:
    job = Driver()
    job.to_phase(RestorePhase.DOWNLOADING)
    job.each_done("name", 10, 1.0, after=2.0)  # each node's images staged 2 s after the last
    job.to_phase(RestorePhase.SUCCEEDED)
    spans = job.state.phase_spans
    assert [span.phase for span in spans] == [str(phase) for phase in job.phases[:-1]]
    assert {span.phase: span.seconds for span in spans}["Downloading"] == 4.0
    assert spans[0].started_at == T0 and spans[-1].phase == "Resuming"
    assert job.state.finished_at is not None
    assert sum(s.seconds for s in spans) == pytest.approx(job.state.finished_at - job.state.started_at)
