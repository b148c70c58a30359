"""The ibckpt.io/v1alpha1 API, defined once: the operator, the CLI and the agent read and write these types,
and crds/*.yaml is generated from them (`python -m ibckpt.api.crdgen`). docs/crds.md describes each kind.

Pure: pydantic only, no Kubernetes client.
"""

from ibckpt.api.base import API_VERSION, CATEGORY, GROUP, VERSION, ApiModel, KindInfo, PrinterColumn
from ibckpt.api.checkpoint import (
    CHECKPOINT,
    CheckpointPod,
    CheckpointSize,
    CheckpointSpec,
    CheckpointStatus,
    CheckpointTimings,
    JobReference,
    RequiredVersions,
)
from ibckpt.api.checkpointjob import (
    CHECKPOINT_JOB,
    CheckpointJobSpec,
    CheckpointJobStatus,
    CheckpointMode,
    ConcurrencyPolicy,
    JobPhase,
    JobTimeouts,
    PodRow,
    WorkloadReference,
)
from ibckpt.api.common import (
    Condition,
    ConditionStatus,
    ConditionType,
    LabelSelector,
    LabelSelectorRequirement,
    LocalObjectReference,
    SecretKeyReference,
)
from ibckpt.api.kinds import KINDS
from ibckpt.api.restorejob import RESTORE_JOB, RestoreJobSpec, RestoreJobStatus, RestorePhase, RestoreTimeouts
from ibckpt.api.schedule import CHECKPOINT_SCHEDULE, CheckpointScheduleSpec, CheckpointScheduleStatus
from ibckpt.api.storage import (
    CHECKPOINT_STORAGE,
    CheckpointStorageSpec,
    CheckpointStorageStatus,
    Encryption,
    EncryptionMode,
    Retention,
    S3Location,
)

__all__ = [
    "API_VERSION",
    "CATEGORY",
    "CHECKPOINT",
    "CHECKPOINT_JOB",
    "CHECKPOINT_SCHEDULE",
    "CHECKPOINT_STORAGE",
    "GROUP",
    "KINDS",
    "RESTORE_JOB",
    "VERSION",
    "ApiModel",
    "CheckpointJobSpec",
    "CheckpointJobStatus",
    "CheckpointMode",
    "CheckpointPod",
    "CheckpointScheduleSpec",
    "CheckpointScheduleStatus",
    "CheckpointSize",
    "CheckpointSpec",
    "CheckpointStatus",
    "CheckpointStorageSpec",
    "CheckpointStorageStatus",
    "CheckpointTimings",
    "ConcurrencyPolicy",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "Encryption",
    "EncryptionMode",
    "JobPhase",
    "JobReference",
    "JobTimeouts",
    "KindInfo",
    "LabelSelector",
    "LabelSelectorRequirement",
    "LocalObjectReference",
    "PodRow",
    "PrinterColumn",
    "RequiredVersions",
    "RestoreJobSpec",
    "RestoreJobStatus",
    "RestorePhase",
    "RestoreTimeouts",
    "Retention",
    "S3Location",
    "SecretKeyReference",
    "WorkloadReference",
]
