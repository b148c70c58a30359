"""Whole objects (apiVersion, kind, metadata, spec, status), for code that reads them from the apiserver
or builds them to create: `CheckpointJob.from_wire(body)`, `Checkpoint(...).to_wire()`."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from ibckpt.api.base import API_VERSION, ApiModel
from ibckpt.api.checkpoint import CheckpointSpec, CheckpointStatus
from ibckpt.api.checkpointjob import CheckpointJobSpec, CheckpointJobStatus
from ibckpt.api.restorejob import RestoreJobSpec, RestoreJobStatus
from ibckpt.api.schedule import CheckpointScheduleSpec, CheckpointScheduleStatus
from ibckpt.api.storage import CheckpointStorageSpec, CheckpointStorageStatus


class OwnerReference(ApiModel):
    api_version: str
    kind: str
    name: str
    uid: str
    controller: bool | None = None
    block_owner_deletion: bool | None = None


class ObjectMeta(ApiModel):
    """The parts of metav1.ObjectMeta the operator uses; the rest is ignored."""

    name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = None
    creation_timestamp: datetime | None = None
    deletion_timestamp: datetime | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    owner_references: list[OwnerReference] | None = None
    finalizers: list[str] | None = None


class CheckpointJob(ApiModel):
    api_version: Literal["ibckpt.io/v1alpha1"] = API_VERSION
    kind: Literal["CheckpointJob"] = "CheckpointJob"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: CheckpointJobSpec
    status: CheckpointJobStatus | None = None


class Checkpoint(ApiModel):
    api_version: Literal["ibckpt.io/v1alpha1"] = API_VERSION
    kind: Literal["Checkpoint"] = "Checkpoint"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: CheckpointSpec
    status: CheckpointStatus | None = None


class RestoreJob(ApiModel):
    api_version: Literal["ibckpt.io/v1alpha1"] = API_VERSION
    kind: Literal["RestoreJob"] = "RestoreJob"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: RestoreJobSpec
    status: RestoreJobStatus | None = None


class CheckpointStorage(ApiModel):
    api_version: Literal["ibckpt.io/v1alpha1"] = API_VERSION
    kind: Literal["CheckpointStorage"] = "CheckpointStorage"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: CheckpointStorageSpec
    status: CheckpointStorageStatus | None = None


class CheckpointSchedule(ApiModel):
    api_version: Literal["ibckpt.io/v1alpha1"] = API_VERSION
    kind: Literal["CheckpointSchedule"] = "CheckpointSchedule"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: CheckpointScheduleSpec
    status: CheckpointScheduleStatus | None = None
