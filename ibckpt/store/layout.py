"""Where each kind of object lives in the bucket, and the names that are allowed for jobs and checkpoints.

    <prefix>/v1/manifests/<job>/<checkpoint>.json   committed checkpoints (written last)
    <prefix>/v1/parts/<job>/<checkpoint>/<part>.json what each node wrote, until the manifest merges them
    <prefix>/v1/chunks/<id[:2]>/<id>                  content-addressed chunks, shared by all checkpoints
    <prefix>/v1/leases/<holder>.json                  live writers and readers (garbage collection waits)
    <prefix>/v1/sweeps/<sweep>.json                   a running chunk sweep (writers wait)

Jobs may be `name` or `namespace/name`; the two-hex fan-out of chunks spreads load over S3 partitions.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

LAYOUT_VERSION = "v1"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}"
_JOB = re.compile(rf"^{_NAME}(/{_NAME})?$")
_CHECKPOINT_ID = re.compile(rf"^{_NAME}$")
_CHUNK_ID = re.compile(r"^[0-9a-f]{64}$")


def check_job(job: str) -> str:
    if not _JOB.match(job):
        raise ValueError(
            f"invalid job name {job!r}: use letters, digits, '.', '_', '-', optionally 'namespace/name'"
        )
    return job


def check_checkpoint_id(checkpoint_id: str) -> str:
    if not _CHECKPOINT_ID.match(checkpoint_id) or checkpoint_id == "latest":
        raise ValueError(f"invalid checkpoint id {checkpoint_id!r}: use letters, digits, '.', '_', '-'")
    return checkpoint_id


def new_checkpoint_id(now: datetime | None = None) -> str:
    """Sortable by time, unique without coordination: 20261122T073000.123Z-3f9a1c."""
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    return moment.strftime("%Y%m%dT%H%M%S.") + f"{moment.microsecond // 1000:03d}Z-" + secrets.token_hex(3)


@dataclass(frozen=True)
class CheckpointRef:
    job: str
    checkpoint_id: str

    def __str__(self) -> str:
        return f"{self.job}/{self.checkpoint_id}"


def parse_checkpoint_ref(text: str) -> tuple[str, str]:
    """`job/id`, `namespace/name/id` or `job/latest` -> (job, id-or-latest)."""
    job, sep, checkpoint_id = text.rpartition("/")
    if not sep or not job or not checkpoint_id:
        raise ValueError(f"not a checkpoint reference: {text!r} (expected JOB/ID or JOB/latest)")
    check_job(job)
    if checkpoint_id != "latest":
        check_checkpoint_id(checkpoint_id)
    return job, checkpoint_id


@dataclass(frozen=True)
class Layout:
    prefix: str

    @property
    def root(self) -> str:
        return f"{self.prefix}/{LAYOUT_VERSION}/" if self.prefix else f"{LAYOUT_VERSION}/"

    @property
    def manifests(self) -> str:
        return self.root + "manifests/"

    @property
    def chunks(self) -> str:
        return self.root + "chunks/"

    @property
    def parts(self) -> str:
        return self.root + "parts/"

    def checkpoint_parts(self, ref: CheckpointRef) -> str:
        return f"{self.parts}{ref.job}/{ref.checkpoint_id}/"

    def part_key(self, ref: CheckpointRef, part: str) -> str:
        return f"{self.checkpoint_parts(ref)}{part}.json"

    @property
    def leases(self) -> str:
        return self.root + "leases/"

    @property
    def sweeps(self) -> str:
        return self.root + "sweeps/"

    def manifest_key(self, ref: CheckpointRef) -> str:
        return f"{self.manifests}{ref.job}/{ref.checkpoint_id}.json"

    def job_manifests(self, job: str) -> str:
        return f"{self.manifests}{job}/"

    def chunk_key(self, chunk_id: str) -> str:
        return f"{self.chunks}{chunk_id[:2]}/{chunk_id}"

    def lease_key(self, holder: str) -> str:
        return f"{self.leases}{holder}.json"

    def sweep_key(self, sweep: str) -> str:
        return f"{self.sweeps}{sweep}.json"

    def ref_from_manifest_key(self, key: str) -> CheckpointRef | None:
        """The checkpoint a manifest key names, or None for anything else under manifests/."""
        if not key.startswith(self.manifests) or not key.endswith(".json"):
            return None
        job, sep, name = key[len(self.manifests) : -len(".json")].rpartition("/")
        if not sep or not _JOB.match(job) or not _CHECKPOINT_ID.match(name):
            return None
        return CheckpointRef(job, name)

    def chunk_id_from_key(self, key: str) -> str | None:
        if not key.startswith(self.chunks):
            return None
        chunk_id = key.rpartition("/")[2]
        return chunk_id if _CHUNK_ID.match(chunk_id) else None
