"""Whole objects (apiVersion, kind, metadata, spec, status), for code that reads them from the apiserver
or builds them to create: `CheckpointJob.from_wire(body)`, `Checkpoint(...).to_wire()`."""

from __future__ import annotations

from datetime import datetime
from typing import Generic, Literal, TypeVar

from pydantic import Field

from ibckpt.api.base import API_VERSION, ApiModel
from ibckpt.api.checkpoint import CheckpointSpec, CheckpointStatus
from ibckpt.api.checkpointjob import CheckpointJobSpec, CheckpointJobStatus
from ibckpt.api.restorejob import RestoreJobSpec, RestoreJobStatus
from ibckpt.api.schedule import CheckpointScheduleSpec, CheckpointScheduleStatus
from ibckpt.api.storage import CheckpointStorageSpec, CheckpointStorageStatus

SpecT = TypeVar("SpecT", bound=ApiModel)
StatusT = TypeVar("StatusT", bound=ApiModel)


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


class ApiObject(ApiModel, Generic[SpecT, StatusT]):
    """What every kind's object has; each kind below pins `kind` and the types of spec and status."""

    api_version: Literal["ibckpt.io/v1alpha1"] = API_VERSION
    kind: str
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: SpecT
    status: StatusT | None = None


class CheckpointJob(ApiObject[CheckpointJobSpec, CheckpointJobStatus]):
    kind: Literal["CheckpointJob"] = "CheckpointJob"


class Checkpoint(ApiObject[CheckpointSpec, CheckpointStatus]):
    kind: Literal["Checkpoint"] = "Checkpoint"


class RestoreJob(ApiObject[RestoreJobSpec, RestoreJobStatus]):
    kind: Literal["RestoreJob"] = "RestoreJob"


class CheckpointStorage(ApiObject[CheckpointStorageSpec, CheckpointStorageStatus]):
    kind: Literal["CheckpointStorage"] = "CheckpointStorage"


class CheckpointSchedule(ApiObject[CheckpointScheduleSpec, CheckpointScheduleStatus]):
    kind: Literal["CheckpointSchedule"] = "CheckpointSchedule"
