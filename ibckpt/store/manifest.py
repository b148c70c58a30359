"""The manifest: the one object that makes a checkpoint exist. Versioned JSON, written after every chunk.

Readers accept schema versions they know (SUPPORTED_SCHEMAS) and refuse newer ones with a clear message
instead of guessing at fields.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from ibckpt.store.chunking import EntryKind, TreeError, check_relative, check_tree
from ibckpt.store.errors import ManifestError
from ibckpt.store.layout import CheckpointRef, check_checkpoint_id, check_job
from ibckpt.store.signing import ManifestKeys

# 2: a chunk may be a pack of several files' bytes; ChunkRef.offset says where a file's slice starts.
# Writers that made no pack write 1, which readers of schema 1 still read.
# 3: a signature (signing.py), so that older readers refuse it by its number. Unsigned writers (the CLI
# without a key) write 1 or 2.
# 4: a rank may record its RDMA devices (RankInfo.devices), which readers of 3 reject as an unknown
# field: every manifest the agents and the operator sign is schema 4 (the devices are recorded only by
# them), so that older readers refuse it by its number.
PACKED_SCHEMA_VERSION = 2
SIGNED_SCHEMA_VERSION = 3
SCHEMA_VERSION = 4
SUPPORTED_SCHEMAS = frozenset({1, 2, 3, 4})
ManifestKind = Literal["ibckpt.dev/CheckpointManifest", "ibckpt.dev/CheckpointPart"]
MANIFEST_KIND: ManifestKind = "ibckpt.dev/CheckpointManifest"
# A part is what one node wrote of a multi-node checkpoint, staged until the manifest merges all parts.
PART_KIND: ManifestKind = "ibckpt.dev/CheckpointPart"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChunkRef(_Model):
    """One piece of a file, in file order: bytes [offset, offset + size) of the chunk's plain bytes (the
    whole chunk, or a file's slice of a pack). `id` is the hash (see codec.chunk_id) restore re-computes."""

    id: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0, description="plain bytes of this file in the chunk")
    stored_size: int = Field(ge=0, description="bytes in the bucket, after compression and encryption")
    offset: int = Field(default=0, ge=0, description="where this file's bytes start in the chunk (schema 2)")


class FileRecord(_Model):
    path: str
    kind: EntryKind
    mode: int = Field(ge=0, le=0o7777)
    size: int = Field(default=0, ge=0)
    mtime_ns: int = 0
    target: str | None = None
    chunks: list[ChunkRef] = Field(default_factory=list)

    @field_validator("path")
    @classmethod
    def _safe_path(cls, path: str) -> str:
        return check_relative(path)

    @model_validator(mode="after")
    def _consistent(self) -> FileRecord:
        if self.kind == "file" and sum(chunk.size for chunk in self.chunks) != self.size:
            raise ValueError(f"{self.path}: chunk sizes do not add up to the file size")
        if self.kind != "file" and self.chunks:
            raise ValueError(f"{self.path}: only files have chunks")
        if (self.kind == "symlink") != (self.target is not None):
            raise ValueError(f"{self.path}: a symlink, and only a symlink, has a target")
        return self


DeviceName = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[^\s/]+$")]


class ContainerDevices(_Model):
    """The RDMA devices (HCA names, sysfs `ibdev`) of a checkpointed container: what a restore maps
    onto the devices of the new one (ibckpt/devicemap.py)."""

    allocated: list[DeviceName] = Field(
        default_factory=list,
        description="given to the container, in the order of its OCI config's /dev/infiniband/uverbs* nodes",
    )
    whole_node: bool = Field(
        default=False,
        description="it saw every device of its node (a hostPath /dev/infiniband): `allocated` is the node's",
    )
    used: dict[str, list[DeviceName]] = Field(
        default_factory=dict, description="each verbs rank's devices (by rank key), in its contexts' order"
    )


class RankInfo(_Model):
    """One process (or container) of the job and where it ran; `root` is its subtree in `files`."""

    rank: int = Field(ge=0)
    pod: str | None = None
    node: str | None = None
    root: str = ""
    devices: ContainerDevices | None = None

    @model_serializer(mode="wrap")
    def _without_unknown_devices(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # No key at all when nothing was recorded: a reader from before the field (extra="forbid")
        # still reads what a checkpoint without devices records.
        data: dict[str, Any] = handler(self)
        if data.get("devices") is None:
            data.pop("devices", None)
        return data


class Versions(_Model):
    ibckpt: str | None = None
    shim: str | None = None
    criu: str | None = None
    kernel: str | None = None


class Compression(_Model):
    codec: Literal["zstd", "none"]
    level: int = Field(ge=0, le=22)
    chunk_size: int = Field(gt=0)


class Encryption(_Model):
    mode: Literal["none", "sse-s3", "sse-kms", "client"]
    kms_key_id: str | None = None
    key_fingerprint: str | None = Field(default=None, description="of the client-side key, never the key")


class Stats(_Model):
    files: int = 0
    logical_bytes: int = 0
    stored_bytes: int = Field(default=0, description="sum over this checkpoint's distinct chunks")
    chunks: int = 0
    distinct_chunks: int = 0
    uploaded_chunks: int = 0
    uploaded_bytes: int = 0


class Signature(_Model):
    """Who signed a manifest (an image key id) and the HMAC-SHA256 (signing.py) over it and its object key."""

    key_id: str
    mac: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(_Model):
    schema_version: int = PACKED_SCHEMA_VERSION
    kind: ManifestKind = MANIFEST_KIND
    job: str
    checkpoint_id: str
    created_at: datetime
    started_at: datetime
    ranks: list[RankInfo] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    versions: Versions = Versions()
    compression: Compression
    encryption: Encryption
    files: list[FileRecord]
    stats: Stats
    timings: dict[str, float] = Field(default_factory=dict, description="seconds, per phase")
    signature: Signature | None = None

    @field_validator("job")
    @classmethod
    def _job(cls, job: str) -> str:
        return check_job(job)

    @field_validator("checkpoint_id")
    @classmethod
    def _checkpoint_id(cls, checkpoint_id: str) -> str:
        return check_checkpoint_id(checkpoint_id)

    @field_validator("created_at", "started_at")
    @classmethod
    def _aware(cls, moment: datetime) -> datetime:
        return moment if moment.tzinfo else moment.replace(tzinfo=UTC)

    @model_validator(mode="after")
    def _unique_paths(self) -> Manifest:
        seen: set[str] = set()
        for record in self.files:
            if record.path in seen:
                raise ValueError(f"duplicate path in files: {record.path!r}")
            seen.add(record.path)
        if self.schema_version == 1 and any(chunk.offset for chunk in self.chunk_refs()):
            raise ValueError("schema_version 1 has no chunk offsets")
        if self.signature is not None and self.schema_version < SIGNED_SCHEMA_VERSION:
            raise ValueError(f"only schema_version {SIGNED_SCHEMA_VERSION} and later carry a signature")
        return self

    @property
    def ref(self) -> CheckpointRef:
        return CheckpointRef(self.job, self.checkpoint_id)

    def chunk_refs(self) -> list[ChunkRef]:
        return [chunk for record in self.files for chunk in record.chunks]

    def chunk_sizes(self) -> dict[str, int]:
        """Distinct chunk id -> stored size."""
        return {chunk.id: chunk.stored_size for chunk in self.chunk_refs()}

    def to_json(self) -> bytes:
        if self.schema_version == 1:  # as readers of schema 1 expect it: no offset field at all
            no_offsets: dict[str, Any] = {
                "files": {"__all__": {"chunks": {"__all__": {"offset"}}}},
                "signature": True,
            }
            return self.model_dump_json(indent=1, exclude=no_offsets).encode()
        if self.signature is None:  # as readers of schema 2 expect it: no signature field
            return self.model_dump_json(indent=1, exclude={"signature"}).encode()
        return self.model_dump_json(indent=1).encode()

    def signed(self, keys: ManifestKeys, object_key: str) -> Manifest:
        """This manifest signed with the newest key for the object at `object_key` (where it is written)."""
        unsigned = self.model_copy(update={"schema_version": SCHEMA_VERSION, "signature": None})
        raw = json.loads(unsigned.model_dump_json())
        return unsigned.model_copy(update={"signature": Signature(**keys.sign(raw, object_key))})


def parse_manifest(
    data: bytes, where: str, *, keys: ManifestKeys | None = None, object_key: str = ""
) -> Manifest:
    """Bytes of a manifest object -> Manifest, or ManifestError naming `where`. With `keys`, the manifest
    must carry a signature by one of them for `object_key` (ManifestSignatureError otherwise)."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ManifestError(f"manifest {where} is not JSON: {error}") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version not in SUPPORTED_SCHEMAS:
        raise ManifestError(
            f"manifest {where} has schema_version {version!r}; this ibckpt reads {sorted(SUPPORTED_SCHEMAS)}"
        )
    if keys is not None:  # before anything else of it is looked at
        keys.verify(raw, object_key, where)
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as error:
        raise ManifestError(f"manifest {where} is invalid: {error}") from None
    check_restorable(manifest.files, f"manifest {where}")
    return manifest


def check_restorable(files: list[FileRecord], what: str) -> None:
    """ManifestError unless `files` rebuild into a tree with nothing, link targets included, outside it
    (chunking.check_tree). Whoever holds a prefix's keys writes its manifests; the agent restores as root."""
    try:
        check_tree((record.path, record.kind, record.target) for record in files)
    except TreeError as error:
        raise ManifestError(f"{what} is unsafe to restore: {error}") from None
