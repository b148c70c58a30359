"""CheckpointJob: checkpoint every pod of one workload at one consistent cut, into a storage."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from ibckpt.api.base import ApiModel, KindInfo, PrinterColumn
from ibckpt.api.common import (
    NAME_PATTERN,
    PHASE_TIMINGS_DESCRIPTION,
    Conditions,
    LabelSelector,
    LocalObjectReference,
    ObservedGeneration,
    PhaseTiming,
    StorageTier,
)
from ibckpt.api.storage import S3Location
from ibckpt.vocabulary import DEFAULT_BOUNDS as B

# How a job's chunks are stored; the operator hands it to the node agents (agentapi ImageDestination).
CompressionCodec = Literal["zstd", "none"]


class CheckpointMode(StrEnum):
    """LeaveRunning: the job continues after the dump. Stop: the source processes are killed once the
    checkpoint is committed (to move the job elsewhere with a RestoreJob)."""

    LEAVE_RUNNING = "LeaveRunning"
    STOP = "Stop"


class ConcurrencyPolicy(StrEnum):
    """What a CheckpointJob does while another one holds any of its pods: Wait (within its admission
    deadline) or Fail at once."""

    WAIT = "Wait"
    FAIL = "Fail"


class JobPhase(StrEnum):
    """Where a CheckpointJob is; docs/crds.md draws the machine."""

    PENDING = "Pending"
    ADMITTED = "Admitted"
    PRE_DUMPING = "PreDumping"
    QUIESCING = "Quiescing"
    DRAINING = "Draining"
    RELEASING = "Releasing"
    DUMPING = "Dumping"
    UPLOADING = "Uploading"
    COMMITTED = "Committed"
    REBUILDING = "Rebuilding"
    RESUMING = "Resuming"
    STOPPED = "Stopped"
    ABORTING = "Aborting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class WorkloadReference(ApiModel):
    """The workload whose pods are checkpointed: a Job, StatefulSet, JobSet, MPIJob or any kind that owns
    its pods, directly or through one owner in between (a JobSet's Jobs)."""

    api_version: str | None = Field(
        default=None, description="e.g. batch/v1; unset: any group with this kind."
    )
    kind: str = Field(min_length=1, pattern=r"^[A-Z][A-Za-z0-9]*$")
    name: str = Field(min_length=1, max_length=253, pattern=NAME_PATTERN)


class JobTimeouts(ApiModel):
    """The bound on each phase, in seconds. One that runs out before the checkpoint is committed aborts it,
    and every rank resumes where it was."""

    admit_seconds: int = Field(
        default=B.admit, ge=1, description="Pending and Admitted: pods found, claimed, admitted."
    )
    quiesce_seconds: int = Field(default=B.quiesce, ge=1)
    drain_seconds: int = Field(default=B.drain, ge=1)
    release_seconds: int = Field(default=B.release, ge=1)
    dump_seconds: int = Field(
        default=B.dump, ge=1, description="Dumping, and PreDumping when the job pre-dumps."
    )
    upload_seconds: int = Field(
        default=B.upload, ge=1, description="Uploading, including the manifest commit."
    )
    publish_seconds: int = Field(
        default=B.publish, ge=1, description="Committed: the Checkpoint object is created."
    )
    rebuild_seconds: int = Field(default=B.rebuild, ge=1)
    resume_seconds: int = Field(default=B.resume, ge=1)
    stop_seconds: int = Field(default=B.stop, ge=1, description="Stopped: the source processes are killed.")
    abort_seconds: int = Field(default=B.abort, ge=1, description="Aborting: every rank confirms it resumed.")


class CheckpointJobSpec(ApiModel):
    """What to checkpoint, how, and where to. Exactly one of selector and workloadRef; exactly one of
    storageRef and storage."""

    # Without CEL (v1.20) "exactly one of" is a oneOf of required lists, which structural schemas allow.
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {"oneOf": [{"required": ["selector"]}, {"required": ["workloadRef"]}]},
                {"oneOf": [{"required": ["storageRef"]}, {"required": ["storage"]}]},
            ]
        }
    )

    selector: LabelSelector | None = Field(
        default=None,
        description="The pods of the job, by label (every container with RDMA devices is checkpointed).",
        json_schema_extra={"minProperties": 1},
    )
    workload_ref: WorkloadReference | None = Field(
        default=None, description="The pods of the job, by the workload that owns them."
    )
    mode: CheckpointMode = CheckpointMode.LEAVE_RUNNING
    storage_ref: LocalObjectReference | None = Field(default=None, description="A CheckpointStorage.")
    storage: S3Location | None = Field(default=None, description="An S3 location given in place.")
    timeouts: JobTimeouts = JobTimeouts()
    active_deadline_seconds: int = Field(
        default=3600, ge=1, description="Bound on the whole job, from its start to Succeeded or Failed."
    )
    concurrency_policy: ConcurrencyPolicy = ConcurrencyPolicy.WAIT
    pre_dump: bool = Field(
        default=False,
        description=(
            "Copy the pods' memory while they run (PreDumping), then gate the ranks only while the pages "
            "changed since are dumped. Worth it when a pod holds much more memory than it writes "
            "during one pre-dump (docs/node-agent.md, Pre-dumps)."
        ),
    )
    compression: CompressionCodec = Field(
        default="zstd",
        description="zstd: chunks compressed at the node agents' zstd level; none: stored as they are.",
    )
    checkpoint_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=NAME_PATTERN,
        description="Name of the Checkpoint to create; unset: the job's name and its attempt.",
    )
    copy_labels: list[str] | None = Field(
        default=None, description="Keys of this job's labels to copy onto the Checkpoint ('*': all)."
    )
    commit_on: StorageTier = Field(
        default=StorageTier.S3,
        description=(
            "The tier the checkpoint commits on. S3: once every part is uploaded. Memory: once every part "
            "and its signed manifest is kept in a neighbour agent's memory (needs the memory tier and two "
            "ready agents); the S3 upload then finishes in the background (docs/recovery.md, Tiers)."
        ),
    )

    @model_validator(mode="after")
    def _one_of_each(self) -> CheckpointJobSpec:
        if (self.selector is None) == (self.workload_ref is None):
            raise ValueError("give exactly one of selector and workloadRef")
        if self.selector is not None and self.selector.is_empty():
            raise ValueError("selector must have at least one rule (an empty one would match every pod)")
        if (self.storage is None) == (self.storage_ref is None):
            raise ValueError("give exactly one of storageRef and storage")
        return self


class CheckpointTimings(ApiModel):
    """Seconds each phase took, as the job measured them (the slowest node's: the phases end at barriers);
    pauseSeconds is how long the ranks were gated, from the cut until they ran again (LeaveRunning) or
    until their dump ended (Stop: they run again only where they are restored)."""

    pause_seconds: float | None = Field(default=None, ge=0)
    pre_dump_seconds: float | None = Field(default=None, ge=0)
    quiesce_seconds: float | None = Field(default=None, ge=0)
    drain_seconds: float | None = Field(default=None, ge=0)
    release_seconds: float | None = Field(default=None, ge=0)
    dump_seconds: float | None = Field(default=None, ge=0)
    upload_seconds: float | None = Field(default=None, ge=0)
    commit_seconds: float | None = Field(
        default=None,
        ge=0,
        description="From the cut to the commit on the job's tier (commitOn): a schedule's measured cost.",
    )
    total_seconds: float | None = Field(default=None, ge=0)


class PodRow(ApiModel):
    """One member pod: pinned by UID when the job admits it."""

    name: str
    uid: str | None = None
    node: str | None = None
    phase: str | None = Field(default=None, description="The last step this pod finished, or why it failed.")
    ranks: int | None = Field(default=None, ge=0, description="Processes of this pod under the shim.")
    bytes: int | None = Field(default=None, ge=0, description="Image bytes this pod uploaded.")
    seconds: float | None = Field(default=None, ge=0, description="Seconds this pod spent in the last step.")
    frozen_seconds: float | None = Field(
        default=None, ge=0, description="Seconds its ranks were gated (its node's timings.pauseSeconds)."
    )
    upload_bytes_per_second: int | None = Field(default=None, ge=0, description="Its node's upload rate.")
    message: str | None = None


class CheckpointJobStatus(ApiModel):
    """What the operator did. `attempt` is written before each side effect, so a restarted operator knows
    which step's outcome it does not know."""

    phase: JobPhase | None = None
    reason: str | None = Field(
        default=None, description="Why the job failed or is waiting, one CamelCase word."
    )
    message: str | None = None
    observed_generation: ObservedGeneration = None
    conditions: Conditions = None
    attempt: str | None = Field(default=None, description="Id of the side effect last started.")
    step: str | None = Field(default=None, description="What that side effect is (quiesce, upload, ...).")
    aborted_from: JobPhase | None = Field(default=None, description="The phase an abort started in.")
    waiting_for: str | None = Field(
        default=None, description="The job that holds some of this job's pods, or a busy node's agent."
    )
    session_turn: int | None = Field(
        default=None,
        ge=0,
        description="How many times the job opened its session again after a node's agent was busy.",
    )
    claimed: bool | None = Field(
        default=None,
        description="This job holds its pods: no other CheckpointJob touches them until it ends.",
    )
    pod_count: int | None = Field(default=None, ge=0)
    pods: list[PodRow] | None = None
    checkpoint_name: str | None = None
    manifest_key: str | None = None
    committed_on: StorageTier | None = Field(
        default=None,
        description="The tier the checkpoint committed on: commitOn, or S3 when a memory copy failed.",
    )
    bytes: int | None = Field(default=None, ge=0)
    size: str | None = Field(default=None, description="bytes, for people (printer column).")
    timings: CheckpointTimings | None = None
    phase_timings: list[PhaseTiming] | None = Field(default=None, description=PHASE_TIMINGS_DESCRIPTION)
    start_time: datetime | None = None
    phase_start_time: datetime | None = None
    step_start_time: datetime | None = None
    completion_time: datetime | None = None


CHECKPOINT_JOB = KindInfo(
    kind="CheckpointJob",
    plural="checkpointjobs",
    short_names=("ckj",),
    scope="Namespaced",
    summary="A request to checkpoint every RDMA pod of one workload at one consistent cut.",
    spec=CheckpointJobSpec,
    status=CheckpointJobStatus,
    printer_columns=(
        PrinterColumn("Phase", ".status.phase"),
        PrinterColumn("Mode", ".spec.mode"),
        PrinterColumn("Pods", ".status.podCount", "integer"),
        PrinterColumn("Checkpoint", ".status.checkpointName"),
        PrinterColumn("Size", ".status.size"),
        PrinterColumn("Seconds", ".status.timings.totalSeconds", "number"),
        PrinterColumn("Paused", ".status.timings.pauseSeconds", "number", priority=1),
        PrinterColumn("Reason", ".status.reason", priority=1),
        PrinterColumn("Age", ".metadata.creationTimestamp", "date"),
    ),
)
