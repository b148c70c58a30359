"""Checkpoints written by several nodes: each node stages a part, one committer merges them into the manifest.

Staged parts are not checkpoints (no reader sees them), but garbage collection counts their chunks as in use,
so the chunks survive between a node finishing and the commit. Parts that nobody commits are removed by the
collector once they are older than its `abandoned_after`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

import botocore.exceptions

from ibckpt import __version__
from ibckpt.store.context import StoreContext
from ibckpt.store.errors import CheckpointExistsError, ManifestError, StoreError
from ibckpt.store.layout import CheckpointRef, check_checkpoint_id, check_job
from ibckpt.store.leases import holder_lease, wait_for_sweeps
from ibckpt.store.manifest import (
    MANIFEST_KIND,
    PART_KIND,
    FileRecord,
    Manifest,
    Stats,
    Versions,
    parse_manifest,
)
from ibckpt.store.s3 import ListedObject, is_not_found, list_objects, s3_errors


def part_name(key: str) -> str:
    return key.rpartition("/")[2].removesuffix(".json")


def read_parts(context: StoreContext, ref: CheckpointRef) -> dict[str, Manifest]:
    listed, _ = list_objects(
        context.connection, context.layout.checkpoint_parts(ref), f"listing parts of {ref}"
    )
    return {part_name(item.key): _load(context, item) for item in listed if item.key.endswith(".json")}


def _delete_keys(context: StoreContext, ref: CheckpointRef, keys: list[str]) -> None:
    # One DeleteObjects request for up to 1000 parts, not one request per node.
    for start in range(0, len(keys), 1000):
        batch = [{"Key": key} for key in keys[start : start + 1000]]
        with s3_errors(context.connection, f"deleting parts of {ref}"):
            response = context.client.delete_objects(
                Bucket=context.bucket, Delete={"Objects": batch, "Quiet": True}
            )
        errors = response.get("Errors", [])
        if errors:
            raise StoreError(
                f"could not delete {len(errors)} part(s) of {ref} ({context.connection.where()}), "
                f"e.g. {errors[0].get('Key')}: {errors[0].get('Code')}"
            )


def _load(context: StoreContext, item: ListedObject) -> Manifest:
    with s3_errors(context.connection, f"reading part {item.key}"):
        response = context.client.get_object(Bucket=context.bucket, Key=item.key, ChecksumMode="ENABLED")
        data = response["Body"].read()
    part = parse_manifest(data, item.key, keys=context.signing, object_key=item.key)
    if part.kind != PART_KIND:
        raise ManifestError(f"{item.key} is not a checkpoint part")
    return part


def merge_parts(
    parts: dict[str, Manifest],
    versions: Versions | None = None,
    labels: dict[str, str] | None = None,
    now: datetime | None = None,
) -> Manifest:
    """One manifest from the parts of one checkpoint. Pure: the store reads and writes around it."""
    if not parts:
        raise StoreError("no parts to merge")
    ordered = [parts[name] for name in sorted(parts)]
    first = ordered[0]
    for part in ordered[1:]:
        if part.ref != first.ref:
            raise StoreError(f"parts of different checkpoints: {first.ref} and {part.ref}")
        if part.encryption != first.encryption or part.compression.chunk_size != first.compression.chunk_size:
            raise StoreError(f"parts of {first.ref} were written with different encryption or chunk size")
    files: dict[str, FileRecord] = {}
    for name, part in sorted(parts.items()):
        for record in part.files:
            earlier = files.get(record.path)
            if earlier is not None and not (earlier.kind == record.kind == "dir"):
                raise StoreError(
                    f"parts of {first.ref} both contain {record.path!r} (last seen in part {name})"
                )
            files.setdefault(record.path, record)
    records = list(files.values())
    distinct = {chunk.id: chunk.stored_size for record in records for chunk in record.chunks}
    timings: dict[str, float] = {}
    for part in ordered:
        for stage, seconds in part.timings.items():
            if stage != "total":
                timings[stage] = round(timings.get(stage, 0.0) + seconds, 4)
    started = min(part.started_at for part in ordered)
    created = now or datetime.now(UTC)
    timings["total"] = round((created - started).total_seconds(), 4)
    ranks = sorted((rank for part in ordered for rank in part.ranks), key=lambda rank: rank.rank)
    if len({rank.rank for rank in ranks}) != len(ranks):
        raise StoreError(f"parts of {first.ref} claim the same rank twice")
    return first.model_copy(
        update={
            "schema_version": max(part.schema_version for part in ordered),
            "kind": MANIFEST_KIND,
            "signature": None,  # the parts' own; the commit signs the manifest for its key
            "created_at": created,
            "started_at": started,
            "ranks": ranks,
            "labels": labels or {},
            "versions": (versions or first.versions).model_copy(update={"ibckpt": __version__}),
            "files": records,
            "stats": Stats(
                files=sum(1 for record in records if record.kind == "file"),
                logical_bytes=sum(record.size for record in records),
                stored_bytes=sum(distinct.values()),
                chunks=sum(len(record.chunks) for record in records),
                distinct_chunks=len(distinct),
                uploaded_chunks=sum(part.stats.uploaded_chunks for part in ordered),
                uploaded_bytes=sum(part.stats.uploaded_bytes for part in ordered),
            ),
            "timings": timings,
        }
    )


def commit_parts(
    context: StoreContext,
    job: str,
    checkpoint_id: str,
    expected: Sequence[str] | None = None,
    *,
    versions: Versions | None = None,
    labels: dict[str, str] | None = None,
) -> Manifest:
    """Merge the staged parts into the manifest (written last), then delete the parts.

    With `expected`, refuse to commit unless exactly those parts are staged: a checkpoint missing a rank
    must not exist."""
    ref = CheckpointRef(check_job(job), check_checkpoint_id(checkpoint_id))
    lease = holder_lease(context.connection, context.layout, "writer", ref.job, ref.checkpoint_id)
    with lease:
        wait_for_sweeps(context.connection, context.layout, lease)
        parts = read_parts(context, ref)
        if expected is not None and set(expected) != set(parts):
            missing = sorted(set(expected) - set(parts))
            extra = sorted(set(parts) - set(expected))
            raise StoreError(f"cannot commit {ref}: parts missing {missing}, unexpected {extra}")
        manifest = merge_parts(parts, versions, labels)
        lease.check()
        with s3_errors(context.connection, f"committing {ref}"):
            _refuse_if_committed(context, ref)
        manifest = context.put_manifest(context.layout.manifest_key(ref), manifest, f"committing {ref}")
        # The parts just merged: listing them again would cost a request and find the same ones.
        _delete_keys(context, ref, [context.layout.part_key(ref, name) for name in parts])
    return manifest


def commit_in_memory(
    context: StoreContext,
    job: str,
    checkpoint_id: str,
    held: Mapping[str, bytes],
    expected: Sequence[str],
    *,
    versions: Versions | None = None,
    labels: dict[str, str] | None = None,
) -> tuple[Manifest, bytes]:
    """The commit on the memory tier: the part manifests as their holders keep them (`held`: node -> the
    bytes of its signed part manifest) merged as commit_parts merges the staged ones, and the manifest
    signed for the key it will have in the bucket, with its bytes. Pure: no S3 call; the caller hands the
    bytes to the holders. Each part must verify for its own part key (a holder cannot pass one node's part
    as another's), and exactly the `expected` parts must be there: a checkpoint missing a rank must not
    exist on any tier."""
    ref = CheckpointRef(check_job(job), check_checkpoint_id(checkpoint_id))
    if set(expected) != set(held):
        missing = sorted(set(expected) - set(held))
        extra = sorted(set(held) - set(expected))
        raise StoreError(f"cannot commit {ref} in memory: parts missing {missing}, unexpected {extra}")
    parts: dict[str, Manifest] = {}
    for node, data in held.items():
        key = context.layout.part_key(ref, check_checkpoint_id(node))
        part = parse_manifest(data, f"part {node} of {ref} (memory)", keys=context.signing, object_key=key)
        if part.kind != PART_KIND or part.ref != ref:
            raise ManifestError(f"the part {node} held in memory is not a part of {ref}")
        parts[node] = part
    manifest = merge_parts(parts, versions, labels)
    if context.signing is not None:  # as StoreContext.put_manifest signs what it writes
        manifest = manifest.signed(context.signing, context.layout.manifest_key(ref))
    return manifest, manifest.to_json()


def staged_parts(context: StoreContext, ref: CheckpointRef) -> set[str]:
    """The names of the parts staged for `ref` now (one listing, nothing read): the background commit to
    S3 after a commit on the memory tier waits until every node's is there."""
    listed, _ = list_objects(
        context.connection, context.layout.checkpoint_parts(ref), f"listing parts of {ref}"
    )
    return {part_name(item.key) for item in listed if item.key.endswith(".json")}


def _refuse_if_committed(context: StoreContext, ref: CheckpointRef) -> None:
    """A second job under the same checkpoint name must not replace the first one's manifest (and with
    it what restores): it fails instead. The writer lease is held, so no other commit runs meanwhile."""
    key = context.layout.manifest_key(ref)
    try:
        context.client.head_object(Bucket=context.bucket, Key=key)
    except botocore.exceptions.ClientError as error:
        if is_not_found(error):
            return
        raise
    raise CheckpointExistsError(
        f"checkpoint {ref} is already committed (manifest {key}); a commit never replaces one: "
        "give the job another checkpoint name"
    )


def delete_parts(context: StoreContext, ref: CheckpointRef) -> int:
    """Drop the staged parts of a checkpoint (after commit, or to abort it); returns how many."""
    listed, _ = list_objects(
        context.connection, context.layout.checkpoint_parts(ref), f"listing parts of {ref}"
    )
    _delete_keys(context, ref, [item.key for item in listed])
    return len(listed)
