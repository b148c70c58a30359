"""Listing, resolving and deleting committed checkpoints (their manifests)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from datetime import datetime

from ibckpt.store.context import StoreContext
from ibckpt.store.errors import CheckpointNotFoundError, ManifestError
from ibckpt.store.layout import CheckpointRef
from ibckpt.store.manifest import Manifest
from ibckpt.store.s3 import list_objects, missing_as, s3_errors


@dataclass(frozen=True)
class CheckpointEntry:
    """A committed checkpoint as the listing shows it; `committed_at` is the manifest's server timestamp."""

    ref: CheckpointRef
    committed_at: datetime
    manifest_size: int


def list_checkpoints(context: StoreContext, job: str | None = None) -> list[CheckpointEntry]:
    """Committed checkpoints, oldest first. Only manifests count: chunks alone are not a checkpoint."""
    layout = context.layout
    prefix = layout.job_manifests(job) if job else layout.manifests
    listed, _ = list_objects(context.connection, prefix, "listing checkpoints")
    entries = []
    for item in listed:
        ref = layout.ref_from_manifest_key(item.key)
        if ref is not None and (job is None or ref.job == job):
            entries.append(CheckpointEntry(ref, item.last_modified, item.size))
    return sorted(entries, key=lambda entry: (entry.committed_at, entry.ref.job, entry.ref.checkpoint_id))


def latest_ref(context: StoreContext, job: str) -> CheckpointRef:
    """The job's most recently committed checkpoint."""
    entries = list_checkpoints(context, job)
    if not entries:
        raise CheckpointNotFoundError(f"job {job!r} has no checkpoint ({context.connection.where()})")
    # Servers may keep LastModified in whole seconds: among commits that close, ask the manifests.
    newest = entries[-1].committed_at
    close = [entry.ref for entry in entries if (newest - entry.committed_at).total_seconds() <= 1.0]
    if len(close) == 1:
        return close[0]
    loaded = load_many(context, close, len(close))
    readable = [
        (manifest.created_at, ref) for ref, manifest in loaded.items() if isinstance(manifest, Manifest)
    ]
    return max(readable, key=lambda pair: pair[0])[1] if readable else entries[-1].ref


def resolve(context: StoreContext, job: str, checkpoint_id: str) -> CheckpointRef:
    """`latest` -> the newest committed checkpoint of the job; anything else is taken as it is."""
    return latest_ref(context, job) if checkpoint_id == "latest" else CheckpointRef(job, checkpoint_id)


def load_many(
    context: StoreContext, refs: list[CheckpointRef], workers: int, *, verified: bool = True
) -> dict[CheckpointRef, Manifest | ManifestError]:
    """Manifests of many checkpoints in parallel. A manifest that vanished meanwhile is left out; one that
    cannot be read (or verified, unless `verified` is False) is returned as its error, so callers can
    refuse to act on what they cannot see."""
    found: dict[CheckpointRef, Manifest | ManifestError] = {}

    def load(ref: CheckpointRef) -> None:
        try:
            found[ref] = context.load_manifest(ref, verified=verified)
        except CheckpointNotFoundError:
            pass
        except ManifestError as error:
            found[ref] = error

    with concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix="ibckpt-ls") as pool:
        for future in [pool.submit(load, ref) for ref in refs]:
            future.result()
    return found


def delete_checkpoint(context: StoreContext, ref: CheckpointRef) -> None:
    """Remove the manifest: the checkpoint is gone at once; its chunks go at the next garbage collection."""
    key = context.layout.manifest_key(ref)
    with s3_errors(context.connection, f"deleting checkpoint {ref}"):
        with missing_as(lambda: context.not_found(ref)):
            context.client.head_object(Bucket=context.bucket, Key=key)
        context.client.delete_object(Bucket=context.bucket, Key=key)
