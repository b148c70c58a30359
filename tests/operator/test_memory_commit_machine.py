"""commitOn Memory in the CheckpointJob machine, pure, with fake time: after the dump it awaits every
part kept on its buddy (MemoryKept), commits in memory and publishes a Checkpoint said to be in memory;
a part not kept sends it back to the S3 path (await Uploaded, commit on S3); a restart while keeping or
committing in memory aborts, as one during the upload does."""

from __future__ import annotations

from ibckpt.api import CheckpointMode, JobPhase, StorageTier
from ibckpt.vocabulary import Milestone
from ibckpt_operator.machine import JobStep
from ibckpt_operator.machine.actions import (
    CommitInMemory,
    CommitManifest,
    DiscardUpload,
    PublishCheckpoint,
    ResumeAll,
)
from ibckpt_operator.machine.checkpoint import MemoryCopyMissed
from ibckpt_operator.machine.core import EmitEvent, OperatorRestarted, PodStepDone
from ibckpt_operator.machine.status import job_state, job_status
from testbed.checkpoint_machine import CheckpointDriver as Driver

MEMORY = StorageTier.MEMORY


def test_the_commit_follows_every_part_kept_in_memory_never_the_upload() -> None:
    job = Driver(commit_on=MEMORY)
    job.to_phase(JobPhase.SUCCEEDED)
    assert job.awaited() == [
        Milestone.DRAINED, Milestone.RELEASED, Milestone.DUMPED, Milestone.MEMORY_KEPT,
        Milestone.REBUILT, Milestone.RESUMED,
    ]  # fmt: skip
    assert Milestone.UPLOADED not in job.awaited() and not job.of_type(CommitManifest)
    (commit,) = job.of_type(CommitInMemory)
    assert commit.checkpoint_name == "ring-ckpt" and {p.uid for p in commit.pods} == {
        "uid-0",
        "uid-1",
        "uid-2",
    }
    (publish,) = job.of_type(PublishCheckpoint)
    assert publish.in_memory and publish.manifest_key == "ibckpt/v1/manifests/ns/ring/c1.json"
    assert job.state.committed_on == MEMORY
    # a restarted operator reads the tier back from status (a PUBLISH issued again says memory)
    status = job_status(job.state, checkpoint_name="ring-ckpt", now=job.now)
    assert status.committed_on == MEMORY and job_state(status).committed_on == MEMORY


def test_no_commit_before_every_part_is_kept() -> None:
    job = Driver(commit_on=MEMORY)
    job.to_step(JobStep.KEEP)
    assert job.state.phase == JobPhase.UPLOADING
    job.send(PodStepDone(job.attempt, "uid-0"))
    job.send(PodStepDone(job.attempt, "uid-1"))
    assert job.step == JobStep.KEEP and not job.of_type(CommitInMemory)
    job.send(PodStepDone(job.attempt, "uid-2"))
    assert job.step == JobStep.COMMIT_IN_MEMORY


def test_a_part_not_kept_commits_on_s3_once_every_part_is_uploaded() -> None:
    job = Driver(CheckpointMode.STOP, commit_on=MEMORY)
    job.to_step(JobStep.KEEP)
    job.send(PodStepDone(job.attempt, "uid-0"))
    job.send(MemoryCopyMissed(job.attempt, "node-2", "not kept on node-1: over its budget"))
    assert job.step == JobStep.UPLOAD and job.awaited()[-1] == Milestone.UPLOADED
    warning = [a for a in job.actions if isinstance(a, EmitEvent) and a.reason == "CommitOnS3"]
    assert warning and "node node-2's part was not kept in memory (not kept on node-1" in warning[0].message
    job.to_phase(JobPhase.SUCCEEDED)
    assert job.of_type(CommitManifest) and not job.of_type(CommitInMemory)
    (publish,) = job.of_type(PublishCheckpoint)
    assert not publish.in_memory and job.state.committed_on == StorageTier.S3


def test_commit_on_s3_never_waits_for_memory() -> None:
    job = Driver()
    job.to_phase(JobPhase.SUCCEEDED)
    assert Milestone.MEMORY_KEPT not in job.awaited() and not job.of_type(CommitInMemory)


def test_a_restart_while_keeping_or_committing_in_memory_aborts_and_discards_the_parts() -> None:
    for step in (JobStep.KEEP, JobStep.COMMIT_IN_MEMORY):
        job = Driver(commit_on=MEMORY)
        job.to_step(step)
        job.send(OperatorRestarted())
        assert job.state.phase == JobPhase.ABORTING and job.state.reason == "OperatorRestarted"
        assert f"during {step}" in (job.state.message or "")
        assert job.of_type(ResumeAll) and job.of_type(DiscardUpload)
