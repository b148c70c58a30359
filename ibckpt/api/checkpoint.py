"""Checkpoint: one stored, complete checkpoint (its manifest exists in the store), like
VolumeSnapshotContent. The operator creates it after the manifest commit; a RestoreJob names it."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import ConfigDict, Field, WithJsonSchema, model_validator

from ibckpt.api.base import ApiModel, KindInfo, PrinterColumn
from ibckpt.api.checkpointjob import CheckpointMode, CheckpointTimings, WorkloadReference
from ibckpt.api.common import Conditions, LocalObjectReference, ObservedGeneration, StorageTier
from ibckpt.api.storage import S3Location


class JobReference(ApiModel):
    """The CheckpointJob that made this checkpoint (it may be gone: the checkpoint outlives it)."""

    name: str
    uid: str | None = None


# A pod spec as the apiserver returned it: kept whole (the apiserver validates it again when the restore
# creates the pod), so the CRD does not copy the core API's schema.
FreeFormObject = Annotated[
    dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]


class PodTemplate(ApiModel):
    """What a restore needs to create the pod again, sanitized (docs/crds.md): no node, status, uid,
    owners or admission-added service-account token volume; no Secret's content, only references."""

    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    controller: WorkloadReference | None = Field(
        default=None, description="The source pod's controller; the restored pod is not owned by it."
    )
    spec: FreeFormObject = Field(description="The pod's spec without nodeName and token volumes.")


class CheckpointPod(ApiModel):
    name: str
    uid: str | None = None
    node: str | None = None
    host_ip: str | None = Field(
        default=None,
        alias="hostIP",  # the pod status field's own spelling
        description="The pod's node address (status.hostIP) at the checkpoint: a hostNetwork pod's TCP "
        "connections were made from it, and a restore remaps it to the new node's.",
    )
    ranks: list[str] | None = Field(default=None, description="Rank keys (job/pod/container/process).")
    bytes: int | None = Field(default=None, ge=0)
    template: PodTemplate | None = Field(default=None, description="How to create the pod again.")


class CheckpointSize(ApiModel):
    bytes: int = Field(ge=0, description="Image bytes before compression.")
    stored_bytes: int | None = Field(default=None, ge=0, description="Bytes in the bucket (new chunks only).")
    human: str | None = Field(default=None, description="bytes, for people (printer column).")


class RequiredVersions(ApiModel):
    """The versions the images were taken with; a restore node must be compatible with them."""

    kernel: str | None = None
    rdma_core: str | None = None
    criu: str | None = None
    ibckpt: str | None = Field(default=None, description="The agents' release (recorded; not compared).")
    shim: str | None = Field(
        default=None,
        description="sha256 of the shim file on the job's nodes: a restored process maps the node's shim "
        "again, so a restore node must have the same one.",
    )
    formats: dict[str, int] | None = Field(
        default=None,
        description="The formats the images were written in (manifest, chunks, restore, shimProtocol): a "
        "restore node's agent must read each. Unset: taken before formats were recorded (manifest 2, "
        "the others 1).",
    )


class CheckpointSpec(ApiModel):
    """What the checkpoint holds and where. Written once by the operator; exactly one of storageRef and
    storage."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["storageRef"]}, {"required": ["storage"]}]}
    )

    job_name: str | None = Field(default=None, description="The job's name in the store (namespace/name).")
    checkpoint_job_ref: JobReference | None = None
    source: WorkloadReference | None = Field(default=None, description="The workload that was checkpointed.")
    checkpoint_id: str | None = Field(default=None, description="The checkpoint's id in the store.")
    storage_ref: LocalObjectReference | None = None
    storage: S3Location | None = None
    manifest_key: str = Field(min_length=1, description="Object key of the manifest in the store.")
    mode: CheckpointMode | None = None
    rank_count: int | None = Field(default=None, ge=0)
    pods: list[CheckpointPod] | None = None
    nodes: list[str] | None = None
    size: CheckpointSize | None = None
    timings: CheckpointTimings | None = None
    requires: RequiredVersions | None = None
    committed_time: datetime | None = None

    @model_validator(mode="after")
    def _one_storage(self) -> CheckpointSpec:
        if (self.storage is None) == (self.storage_ref is None):
            raise ValueError("give exactly one of storageRef and storage")
        return self


class MemoryCopy(ApiModel):
    """One node's part of the images, kept in the memory of another node's agent."""

    part: str = Field(description="The node whose part of the images this is (where the pod ran).")
    node: str = Field(description="The node whose agent holds the copy.")
    chunks: int | None = Field(default=None, ge=0)
    bytes: int | None = Field(default=None, ge=0, description="Stored bytes (compressed, encrypted) held.")


class UploadState(StrEnum):
    IN_PROGRESS = "InProgress"
    MERGED = "Merged"
    NOT_FINISHED = "NotFinished"


class CheckpointUpload(ApiModel):
    """commitOn Memory: the background commit to S3 after the memory commit, recorded so that a restarted
    operator takes it up again (docs/recovery.md, "Tiers")."""

    state: UploadState = Field(
        description="InProgress: the operator waits for every node's S3 part to merge them; Merged: in S3 "
        "(tiers list S3); NotFinished: not all parts were staged by the deadline, memory only."
    )
    deadline: datetime = Field(
        description="Until when the operator waits for the parts: the commit plus the job's "
        "timeouts.uploadSeconds. An operator started later than it says NotFinished at once."
    )


class CheckpointStatus(ApiModel):
    ready_to_restore: bool | None = None
    tiers: list[StorageTier] | None = Field(
        default=None,
        description="Where the images are held (unset: S3 only). Memory while every part's copy is held: "
        "the operator drops it when a holder replaced, lost or dropped a copy.",
    )
    memory_copies: list[MemoryCopy] | None = Field(
        default=None,
        description="The parts kept in memory: a restore reads them there while their holder lives, and "
        "S3 for the rest (docs/recovery.md).",
    )
    upload: CheckpointUpload | None = Field(
        default=None, description="commitOn Memory: the background commit to S3 (unset: committed on S3)."
    )
    message: str | None = None
    observed_generation: ObservedGeneration = None
    conditions: Conditions = None
    last_verified_time: datetime | None = None


CHECKPOINT = KindInfo(
    kind="Checkpoint",
    plural="checkpoints",
    short_names=("ckpt",),
    scope="Namespaced",
    summary="One stored, complete checkpoint (its manifest exists in the store). Like VolumeSnapshotContent.",
    spec=CheckpointSpec,
    status=CheckpointStatus,
    printer_columns=(
        PrinterColumn("Job", ".spec.jobName"),
        PrinterColumn("Ranks", ".spec.rankCount", "integer"),
        PrinterColumn("Size", ".spec.size.human"),
        PrinterColumn("Ready", ".status.readyToRestore", "boolean"),
        PrinterColumn("Age", ".metadata.creationTimestamp", "date"),
    ),
)
