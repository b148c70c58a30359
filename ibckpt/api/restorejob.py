"""RestoreJob: bring a job back from a Checkpoint, on the same nodes or others."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import ConfigDict, Field, model_validator

from ibckpt.api.base import ApiModel, KindInfo, PrinterColumn
from ibckpt.api.checkpointjob import PodRow, WorkloadReference
from ibckpt.api.common import (
    NAME_PATTERN,
    PHASE_TIMINGS_DESCRIPTION,
    Conditions,
    ObservedGeneration,
    PhaseTiming,
)
from ibckpt.vocabulary import DEFAULT_BOUNDS as B


class RestorePhase(StrEnum):
    """Where a RestoreJob is; docs/crds.md draws the machine."""

    PENDING = "Pending"
    ADMITTED = "Admitted"
    DOWNLOADING = "Downloading"
    RESTORING = "Restoring"
    REBUILDING = "Rebuilding"
    RESUMING = "Resuming"
    CLEANING_UP = "CleaningUp"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class PodCreator(StrEnum):
    """Who creates the restored pods. RestoreJob: the restore creates them from the recorded templates.
    Controller: the pods' own controller (a StatefulSet, which keeps pod names) creates them again, and
    the operator's admission webhook binds each new pod of a checkpointed name to the node its images
    were staged on (docs/drains.md)."""

    RESTORE_JOB = "RestoreJob"
    CONTROLLER = "Controller"


class RestoreTimeouts(ApiModel):
    """The bound on each phase, in seconds. One that runs out fails the restore and removes what it
    restored; the Checkpoint stays valid for another try."""

    admit_seconds: int = Field(
        default=B.admit, ge=1, description="Pending and Admitted: placed and admitted."
    )
    download_seconds: int = Field(default=B.download, ge=1)
    restore_seconds: int = Field(default=B.restore, ge=1)
    rebuild_seconds: int = Field(default=B.rebuild, ge=1)
    resume_seconds: int = Field(default=B.resume, ge=1)
    cleanup_seconds: int = Field(
        default=B.cleanup, ge=1, description="CleaningUp: restored ranks are removed."
    )


class LatestCheckpoint(ApiModel):
    """The checkpoints "the latest" is chosen among: those a schedule's jobs took, or a workload's."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["schedule"]}, {"required": ["workload"]}]}
    )

    schedule: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=NAME_PATTERN,
        description="A CheckpointSchedule here: the Checkpoints labelled ibckpt.io/schedule with its name.",
    )  # fmt: skip
    workload: WorkloadReference | None = Field(
        default=None, description="The Checkpoints whose spec.source is this workload."
    )

    @model_validator(mode="after")
    def _one_group(self) -> LatestCheckpoint:
        if (self.schedule is None) == (self.workload is None):
            raise ValueError("latestOf names exactly one of schedule and workload")
        return self


class RestoreJobSpec(ApiModel):
    """Which Checkpoint to restore, and where the pods may go: checkpointName, or latestOf (the operator
    then writes the Checkpoint it chose into checkpointName once, as a claim's volumeName is bound)."""

    model_config = ConfigDict(
        json_schema_extra={"anyOf": [{"required": ["checkpointName"]}, {"required": ["latestOf"]}]}
    )

    checkpoint_name: str | None = Field(default=None, min_length=1, max_length=253, pattern=NAME_PATTERN)
    latest_of: LatestCheckpoint | None = Field(
        default=None,
        description="Restore the newest restorable Checkpoint of a schedule or a workload; newer ones that "
        "cannot be restored are passed over and listed in status.skippedCheckpoints.",
    )
    node_selector: dict[str, str] | None = Field(
        default=None, description="Labels a destination node must have."
    )
    avoid_nodes: list[str] | None = Field(default=None, description="Nodes that must not receive a pod.")
    avoid_source_nodes: bool = Field(
        default=False, description="Keep every pod off the nodes it was checkpointed on (moving off a drain)."
    )
    pods_created_by: PodCreator = Field(
        default=PodCreator.RESTORE_JOB,
        description="RestoreJob: the restore creates the pods. Controller: their StatefulSet creates them "
        "again under the same names, and the operator binds them to the staged nodes.",
    )
    timeouts: RestoreTimeouts = RestoreTimeouts()
    active_deadline_seconds: int = Field(default=3600, ge=1, description="Bound on the whole restore.")
    device_map: dict[str, str] | None = Field(
        default=None,
        description="RDMA device names, checkpointed -> on the destination, that win over the rule (the "
        "same name, else the same position among the devices the pod is given): docs/rdma-pods.md.",
    )

    @model_validator(mode="after")
    def _a_checkpoint(self) -> RestoreJobSpec:
        if self.checkpoint_name is None and self.latest_of is None:
            raise ValueError("give checkpointName or latestOf")
        return self


class SkippedCheckpoint(ApiModel):
    name: str
    reason: str = Field(description="Why it was passed over.")


class MemoryReads(ApiModel):
    """What the restore read from memory copies of the checkpoint instead of S3 (docs/recovery.md)."""

    chunks: int = Field(default=0, ge=0)
    bytes: int = Field(default=0, ge=0, description="Stored bytes read from memory.")
    holders: list[str] | None = Field(default=None, description="The nodes whose agents served them.")


class RestoreJobStatus(ApiModel):
    """What the operator did; `attempt` is written before each side effect (see CheckpointJob)."""

    phase: RestorePhase | None = None
    reason: str | None = None
    message: str | None = None
    observed_generation: ObservedGeneration = None
    conditions: Conditions = None
    attempt: str | None = None
    step: str | None = None
    failed_from: RestorePhase | None = Field(default=None, description="The phase the restore failed in.")
    skipped_checkpoints: list[SkippedCheckpoint] | None = Field(
        default=None, description="latestOf: the newer Checkpoints passed over, newest first, and why."
    )
    pods: list[PodRow] | None = Field(default=None, description="One row per pod; node is the destination.")
    memory_reads: MemoryReads | None = Field(default=None, description="Unset: every chunk came from S3.")
    phase_timings: list[PhaseTiming] | None = Field(default=None, description=PHASE_TIMINGS_DESCRIPTION)
    start_time: datetime | None = None
    phase_start_time: datetime | None = None
    step_start_time: datetime | None = None
    completion_time: datetime | None = None


RESTORE_JOB = KindInfo(
    kind="RestoreJob",
    plural="restorejobs",
    short_names=("rsj",),
    scope="Namespaced",
    summary="Bring a job back from a Checkpoint, on the same or other nodes.",
    spec=RestoreJobSpec,
    status=RestoreJobStatus,
    printer_columns=(
        PrinterColumn("Phase", ".status.phase"),
        PrinterColumn("Checkpoint", ".spec.checkpointName"),
        PrinterColumn("Reason", ".status.reason", priority=1),
        PrinterColumn("Age", ".metadata.creationTimestamp", "date"),
    ),
)
