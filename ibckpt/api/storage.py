"""CheckpointStorage: where checkpoints of a namespace are written, with which credentials, kept how long.

Namespaced, not cluster-scoped: a checkpoint holds the whole memory of the job's processes (keys, data),
so who may write or restore it must follow the namespace's RBAC, and the credentials Secret it names must
live beside it (a Kubernetes reference cannot cross namespaces without granting the operator every
namespace's Secrets). A platform team that wants one bucket for all creates one CheckpointStorage per
namespace, each with its own prefix.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import Field, model_validator

from ibckpt.api.base import ApiModel, KindInfo, PrinterColumn
from ibckpt.api.common import Conditions, ObservedGeneration, SecretKeyReference


class EncryptionMode(StrEnum):
    """none; sse-s3 and sse-kms: the server encrypts; client: ibckpt encrypts before upload (AES-256-GCM)."""

    NONE = "none"
    SSE_S3 = "sse-s3"
    SSE_KMS = "sse-kms"
    CLIENT = "client"


class Encryption(ApiModel):
    """Encryption at rest, as the image store does it (docs/image-store.md)."""

    mode: EncryptionMode = EncryptionMode.NONE
    kms_key_id: str | None = Field(default=None, min_length=1, description="The KMS key, for mode sse-kms.")
    key_secret_ref: SecretKeyReference | None = Field(
        default=None,
        description="For mode client: a Secret holding base64 of 32 random bytes "
        "(key IBCKPT_ENCRYPTION_KEY unless `key` says otherwise).",
    )

    @model_validator(mode="after")
    def _mode_has_its_key(self) -> Encryption:
        if self.mode == EncryptionMode.SSE_KMS and not self.kms_key_id:
            raise ValueError("encryption mode sse-kms needs kmsKeyId")
        if self.mode == EncryptionMode.CLIENT and self.key_secret_ref is None:
            raise ValueError("encryption mode client needs keySecretRef")
        return self


class S3Location(ApiModel):
    """An S3 (or S3-compatible) bucket and prefix, and how to reach it."""

    endpoint: str | None = Field(
        default=None, description="S3 endpoint URL, e.g. https://s3.example:9000; empty means AWS."
    )
    region: str = "us-east-1"
    bucket: str = Field(min_length=3, max_length=63)
    prefix: str = Field(default="ibckpt", description="Key prefix in the bucket; every object goes below it.")
    addressing_style: Literal["auto", "path", "virtual"] = "path"
    credentials_secret_ref: SecretKeyReference = Field(
        description="A Secret of this namespace, any name, with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
        "(or accessKey/secretKey); the operator and the node agents read it (the operator grants the agents "
        "get on it by name)."
    )
    ca_bundle_secret_ref: SecretKeyReference | None = Field(
        default=None,
        description="A Secret of this namespace holding the PEM CA bundle that signs the endpoint's "
        "certificate (key ca.crt unless `key` says otherwise); the operator and the node agents verify the "
        "endpoint with it.",
    )
    encryption: Encryption | None = None


class Retention(ApiModel):
    """Which checkpoints of a job to keep; one that any set rule would drop is deleted. The newest
    `minKeep` are always kept."""

    keep_last: int | None = Field(default=None, ge=1, description="Keep the job's N newest checkpoints.")
    max_age_seconds: int | None = Field(default=None, ge=0, description="Drop checkpoints older than this.")
    max_total_bytes: int | None = Field(
        default=None, ge=0, description="Keep the newest checkpoints that fit in this many stored bytes."
    )
    min_keep: int = Field(default=1, ge=0, description="Never drop the job's N newest, whatever the rules.")


class CheckpointStorageSpec(S3Location):
    """Where the checkpoints that name this storage are written, and how long they are kept."""

    retention: Retention | None = Field(default=None, description="Unset: keep every checkpoint.")


class StorageImport(ApiModel):
    """The last import of this storage's bucket (`kubectl ibckpt import`): the Checkpoints it made again."""

    requested: str = Field(description="The value of the ibckpt.io/import annotation it answered.")
    time: datetime
    imported: list[str] = Field(default_factory=list, description="Checkpoints made from the bucket.")
    skipped: list[str] = Field(
        default_factory=list, description="Checkpoints of the bucket not imported: `id: why`."
    )
    message: str | None = Field(default=None, description="Why nothing was imported, if so.")


class CheckpointStorageStatus(ApiModel):
    """Whether the operator could reach the bucket with the given credentials."""

    observed_generation: ObservedGeneration = None
    conditions: Conditions = None
    last_checked_time: datetime | None = None
    checkpoint_count: int | None = Field(default=None, ge=0, description="Checkpoints naming this storage.")
    stored_bytes: int | None = Field(default=None, ge=0, description="Their stored bytes, as recorded.")
    pruned_count: int | None = Field(default=None, ge=0, description="Checkpoints deleted by its retention.")
    last_sweep_time: datetime | None = Field(
        default=None, description="When the bucket was last swept of chunks and parts no checkpoint uses."
    )
    last_import: StorageImport | None = None


CHECKPOINT_STORAGE = KindInfo(
    kind="CheckpointStorage",
    plural="checkpointstorages",
    short_names=("ckst",),
    scope="Namespaced",
    summary="Where checkpoints are written (an S3 bucket and prefix), with which credentials, kept how long.",
    spec=CheckpointStorageSpec,
    status=CheckpointStorageStatus,
    printer_columns=(
        PrinterColumn("Endpoint", ".spec.endpoint"),
        PrinterColumn("Bucket", ".spec.bucket"),
        PrinterColumn("Prefix", ".spec.prefix"),
        PrinterColumn("Ready", '.status.conditions[?(@.type=="Ready")].status'),
        PrinterColumn("Age", ".metadata.creationTimestamp", "date"),
    ),
)
