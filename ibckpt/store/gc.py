"""Garbage collection: delete manifests by retention rules, then sweep chunks that no manifest references.

Deleting manifests is always safe (a reader holds the manifest it loaded). Deleting chunks is not, while a
writer may be about to reference an existing chunk: see leases.py for the exclusion that makes the sweep
safe. On top of it, a chunk younger than the grace period is never swept, and the sweep is skipped entirely
if any manifest cannot be read (its chunks would look unreferenced).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import botocore.exceptions

from ibckpt.store.catalog import list_checkpoints, load_many
from ibckpt.store.context import StoreContext
from ibckpt.store.errors import LeaseError, ManifestError
from ibckpt.store.layout import CheckpointRef
from ibckpt.store.leases import Lease, LeaseRecord, read_records
from ibckpt.store.manifest import Manifest, parse_manifest
from ibckpt.store.retention import CheckpointFacts, Decision, RetentionPolicy, decide
from ibckpt.store.s3 import ListedObject, list_objects, pages, s3_errors

DEFAULT_GRACE = timedelta(hours=1)
# Staged parts that nobody committed for this long belong to a checkpoint that failed.
DEFAULT_ABANDONED_AFTER = timedelta(days=1)
SWEEP_LEASE_SECONDS = 120.0
_DELETE_BATCH = 1000  # the S3 DeleteObjects limit


@dataclass
class GcReport:
    decisions: list[Decision] = field(default_factory=list)
    deleted_checkpoints: list[CheckpointRef] = field(default_factory=list)
    swept: bool = False
    deferred_by: list[str] = field(default_factory=list)
    skipped_reason: str | None = None
    chunks_total: int = 0
    chunks_referenced: int = 0
    chunks_deleted: int = 0
    bytes_deleted: int = 0
    chunks_in_grace: int = 0
    stale_leases_removed: int = 0
    abandoned_parts_removed: int = 0
    multipart_aborted: int = 0
    dry_run: bool = False


def collect_garbage(
    context: StoreContext,
    policy: RetentionPolicy,
    *,
    grace: timedelta = DEFAULT_GRACE,
    job: str | None = None,
    dry_run: bool = False,
    sweep: bool = True,
    sweep_lease_seconds: float = SWEEP_LEASE_SECONDS,
    abandoned_after: timedelta = DEFAULT_ABANDONED_AFTER,
) -> GcReport:
    """Apply `policy` (to `job` only, if given), then sweep unreferenced chunks older than `grace`."""
    report = GcReport(dry_run=dry_run)
    workers = context.connection.config.workers
    entries = list_checkpoints(context, job)
    if not policy.empty:
        manifests = load_many(context, [entry.ref for entry in entries], workers)
        unreadable = [ref for ref, loaded in manifests.items() if isinstance(loaded, ManifestError)]
        facts = [
            CheckpointFacts(ref, loaded.created_at, loaded.chunk_sizes())
            for ref, loaded in manifests.items()
            if isinstance(loaded, Manifest)
        ]
        report.decisions = decide(facts, policy, datetime.now(UTC))
        report.decisions += [Decision(ref, True, "manifest unreadable: kept") for ref in unreadable]
        for decision in report.decisions:
            if not decision.keep:
                if not dry_run:
                    with s3_errors(context.connection, f"deleting checkpoint {decision.ref}"):
                        context.client.delete_object(
                            Bucket=context.bucket, Key=context.layout.manifest_key(decision.ref)
                        )
                report.deleted_checkpoints.append(decision.ref)
    if sweep:
        _sweep(context, report, grace, dry_run, sweep_lease_seconds, abandoned_after)
    return report


def _sweep(
    context: StoreContext,
    report: GcReport,
    grace: timedelta,
    dry_run: bool,
    lease_seconds: float,
    abandoned_after: timedelta,
) -> None:
    layout = context.layout
    connection = context.connection
    marker = Lease(connection, layout.sweep_key(f"sweep-{secrets.token_hex(6)}"), "sweep", lease_seconds)
    with marker:
        leases, server_now = read_records(connection, layout.leases, "looking for running checkpoints")
        live = [record for record in leases if record.live_at(server_now)]
        if live:
            report.deferred_by = sorted(_describe(record) for record in live)
            report.skipped_reason = f"{len(live)} checkpoint writer(s)/reader(s) hold a lease"
            return
        if not dry_run:
            report.stale_leases_removed = _delete_keys(context, [record.key for record in leases], marker)
        # Listed after the marker: every manifest committed by a writer whose lease has ended is visible now.
        # A dry run counts as if retention had deleted what it would delete.
        dropped = set(report.deleted_checkpoints) if dry_run else set()
        refs = [entry.ref for entry in list_checkpoints(context) if entry.ref not in dropped]
        # Not verified: an unsigned manifest (the tenant's) keeps its chunks, but cannot stop the sweep.
        manifests = load_many(context, refs, connection.config.workers, verified=False)
        unreadable = [str(ref) for ref, loaded in manifests.items() if isinstance(loaded, ManifestError)]
        if unreadable:
            report.skipped_reason = f"unreadable manifests (their chunks would look unused): {unreadable}"
            return
        referenced: set[str] = set()
        for loaded in manifests.values():
            assert isinstance(loaded, Manifest)
            referenced.update(loaded.chunk_sizes())
        # Staged parts of multi-node checkpoints keep their chunks, unless abandoned.
        parts, parts_now = list_objects(connection, layout.parts, "listing staged parts")
        abandoned = [item.key for item in parts if parts_now - item.last_modified >= abandoned_after]
        try:
            for item in parts:
                if item.key not in abandoned:
                    referenced.update(_load_part(context, item).chunk_sizes())
        except ManifestError as error:
            report.skipped_reason = f"unreadable staged part (its chunks would look unused): {error}"
            return
        if not dry_run:
            report.abandoned_parts_removed = _delete_keys(context, abandoned, marker)
        chunks, server_now = list_objects(connection, layout.chunks, "listing chunks")
        cutoff = server_now - grace
        doomed: list[str] = []
        for item in chunks:
            chunk_id = layout.chunk_id_from_key(item.key)
            report.chunks_total += 1
            if chunk_id in referenced:
                report.chunks_referenced += 1
            elif item.last_modified > cutoff:
                report.chunks_in_grace += 1
            else:
                doomed.append(item.key)
                report.bytes_deleted += item.size
        report.chunks_deleted = len(doomed)
        if not dry_run:
            _delete_keys(context, doomed, marker)
            report.multipart_aborted = _abort_stale_multipart(context, cutoff, marker)
        report.swept = True


def _load_part(context: StoreContext, item: ListedObject) -> Manifest:
    with s3_errors(context.connection, f"reading staged part {item.key}"):
        response = context.client.get_object(Bucket=context.bucket, Key=item.key, ChecksumMode="ENABLED")
        data = response["Body"].read()
    return parse_manifest(data, item.key)


def _describe(record: LeaseRecord) -> str:
    what = f"{record.job}/{record.checkpoint_id}" if record.job else record.key
    return f"{record.kind} {what} ({record.holder})"


def _delete_keys(context: StoreContext, keys: list[str], marker: Lease) -> int:
    deleted = 0
    for start in range(0, len(keys), _DELETE_BATCH):
        marker.check()  # never delete on a lapsed sweep lease: writers may be past their wait by now
        batch = keys[start : start + _DELETE_BATCH]
        with s3_errors(context.connection, "deleting unreferenced objects"):
            response = context.client.delete_objects(
                Bucket=context.bucket, Delete={"Objects": [{"Key": key} for key in batch], "Quiet": True}
            )
        errors = response.get("Errors", [])
        if errors:
            first = errors[0]
            raise LeaseError(
                f"could not delete {len(errors)} object(s) ({context.connection.where()}), "
                f"e.g. {first.get('Key')}: {first.get('Code')} {first.get('Message', '')}"
            )
        deleted += len(batch)
    return deleted


def _abort_stale_multipart(context: StoreContext, cutoff: datetime, marker: Lease) -> int:
    """Multipart uploads of chunks left by killed writers hold storage until aborted."""
    aborted = 0
    try:
        for page in pages(
            context.client.list_multipart_uploads, Bucket=context.bucket, Prefix=context.layout.chunks
        ):
            for upload in page.get("Uploads", []):
                if upload["Initiated"].astimezone(UTC) <= cutoff:
                    marker.check()
                    context.client.abort_multipart_upload(
                        Bucket=context.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    aborted += 1
    except botocore.exceptions.ClientError:
        return aborted  # listing multipart uploads is optional on some servers; not worth failing GC
    return aborted
