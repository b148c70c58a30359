"""The cluster side of a CheckpointStorage's retention and store sweep (docs/storage.md): the Checkpoints
that name the storage as retention sees them, and the periodic sweep of what no checkpoint uses. The
decisions are machine/retention.py's; deleting a Checkpoint goes through its finalizer
(handlers/checkpoint.py), which deletes the manifest."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import timedelta

from ibckpt.api import CHECKPOINT
from ibckpt.api.schedule import PIN_LABEL, SCHEDULE_LABEL
from ibckpt.store import CheckpointNotFoundError, RetentionPolicy, StoreConfig, StoreError
from ibckpt_operator.cluster import storage
from ibckpt_operator.cluster.kube import Body, Kube
from ibckpt_operator.cluster.schedules import list_namespaced, restores_in_use, timestamp
from ibckpt_operator.machine.retention import StoredCheckpoint

log = logging.getLogger(__name__)


def _stored_bytes(spec: Body) -> int:
    size = spec.get("size") or {}
    if size.get("storedBytes") is not None:
        return int(size["storedBytes"])
    if size.get("bytes") is not None:
        return int(size["bytes"])
    return sum(int(pod.get("bytes") or 0) for pod in spec.get("pods") or ())


async def storage_view(
    kube: Kube, namespace: str, storage_name: str, config: StoreConfig | None
) -> list[StoredCheckpoint]:
    """The namespace's Checkpoints whose storageRef names `storage_name`. With `config`, each one's chunk
    sizes come from its manifest (for maxTotalBytes), read from the store."""
    in_use = await restores_in_use(kube, namespace)
    found: list[tuple[Body, StoredCheckpoint]] = []
    for body in await list_namespaced(kube, CHECKPOINT.plural, namespace):
        meta, spec = body["metadata"], body.get("spec") or {}
        if meta.get("deletionTimestamp") or (spec.get("storageRef") or {}).get("name") != storage_name:
            continue
        labels = meta.get("labels") or {}
        schedule = labels.get(SCHEDULE_LABEL)
        group = f"schedule {schedule}" if schedule else f"job {spec.get('jobName') or meta['name']}"
        checkpoint = StoredCheckpoint(
            name=meta["name"],
            group=group,
            created_at=timestamp(meta.get("creationTimestamp")) or 0.0,
            complete=bool((body.get("status") or {}).get("readyToRestore")),
            pinned=labels.get(PIN_LABEL) == "true",
            used_by=in_use.get(meta["name"]),
            bytes=_stored_bytes(spec),
        )
        found.append((body, checkpoint))
    if config is None:
        return [checkpoint for _, checkpoint in found]
    keys = {checkpoint.name: (body.get("spec") or {}).get("manifestKey") for body, checkpoint in found}
    sizes = await asyncio.to_thread(_chunk_sizes, config, keys)
    return [
        StoredCheckpoint(**{**checkpoint.__dict__, "chunk_sizes": sizes.get(checkpoint.name, {})})
        for _, checkpoint in found
    ]


def _chunk_sizes(config: StoreConfig, manifest_keys: dict[str, str | None]) -> dict[str, dict[str, int]]:
    """Checkpoint name -> its manifest's chunk sizes; a manifest that cannot be read gives none (blocking)."""
    image_store = storage.open_store(config)
    sizes: dict[str, dict[str, int]] = {}
    for name, key in manifest_keys.items():
        ref = image_store.context.layout.ref_from_manifest_key(key) if key else None
        if ref is None:
            continue
        try:
            sizes[name] = image_store.manifest(ref).chunk_sizes()
        except (CheckpointNotFoundError, StoreError) as error:
            log.info("checkpoint %s: no chunk sizes (%s)", name, error)
    return sizes


@dataclass(frozen=True)
class Swept:
    removed: int  # chunks, abandoned parts and stale leases deleted
    message: str


def sweep(config: StoreConfig, grace_seconds: float) -> Swept:
    """Delete the chunks no manifest references (older than the grace), stale leases and abandoned parts
    (blocking). Retention is not applied here: the Checkpoint objects decide which manifests exist."""
    image_store = storage.open_store(config)
    report = image_store.gc(RetentionPolicy(), grace=timedelta(seconds=grace_seconds))
    removed = report.chunks_deleted + report.abandoned_parts_removed + report.stale_leases_removed
    if not report.swept:
        return Swept(removed, f"sweep deferred: {report.skipped_reason}")
    return Swept(
        removed,
        f"swept {report.chunks_deleted} unreferenced chunk(s) ({report.bytes_deleted} bytes), "
        f"{report.abandoned_parts_removed} abandoned part(s), {report.stale_leases_removed} stale lease(s); "
        f"{report.chunks_in_grace} chunk(s) younger than the grace kept",
    )
