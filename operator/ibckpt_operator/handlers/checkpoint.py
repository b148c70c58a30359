"""Checkpoint: a finalizer that removes the checkpoint's objects from the store when it is deleted (its
manifest at once; its chunks by a sweep of what no other checkpoint references); and, at the operator's
start, the background commit to S3 of a memory commit that a previous operator left waiting."""

from __future__ import annotations

import asyncio
import copy
import logging
from datetime import timedelta
from typing import Any

import kopf

from ibckpt.api import CHECKPOINT, GROUP, VERSION, Checkpoint
from ibckpt.store import CheckpointNotFoundError, RetentionPolicy, StoreConfig, StoreError
from ibckpt_operator import metrics
from ibckpt_operator.cluster import storage
from ibckpt_operator.config import current
from ibckpt_operator.drivers import durable, memorycopies, runtime

log = logging.getLogger(__name__)
RETAIN_ANNOTATION = "ibckpt.io/retain-images"  # "true": deleting the object leaves the images in place
DELETE_RETRIES = 5
# One try's bound, and the store's own for it: a store that hangs must not hold the Checkpoint (and so its
# namespace's deletion) for the client's default retries of every request (5 x 60 s each).
DELETE_SECONDS = 60.0
DELETE_READ_TIMEOUT = 15.0


def remove_images(config: StoreConfig, manifest_key: str, grace_seconds: float) -> str:
    """Delete the manifest, then sweep unreferenced chunks; returns what happened, for the Event."""
    image_store = storage.open_store(config)
    ref = image_store.context.layout.ref_from_manifest_key(manifest_key)
    if ref is None:
        return f"{manifest_key} is not a manifest under prefix {config.prefix!r}: nothing deleted"
    try:
        image_store.delete(ref)
        said = f"deleted manifest {ref}"
    except CheckpointNotFoundError:
        said = f"manifest {ref} was already gone"
    report = image_store.gc(RetentionPolicy(), grace=timedelta(seconds=grace_seconds))
    if report.swept:
        return f"{said}; swept {report.chunks_deleted} unreferenced chunk(s), {report.bytes_deleted} bytes"
    return f"{said}; chunk sweep deferred ({report.skipped_reason})"


async def drop_memory_copies(rt: runtime.Runtime, raw: dict[str, Any]) -> None:
    """The holders drop the checkpoint's memory copies (once: they are a cache, never worth a retry)."""
    where = f"checkpoint {raw['metadata']['namespace']}/{raw['metadata']['name']}"
    try:
        said = await memorycopies.drop(rt, Checkpoint.from_wire(raw))
    except Exception as error:
        log.warning("%s: memory copies not dropped: %s", where, error)
        await rt.kube.post_event(raw, "Warning", "MemoryCopiesKept", f"memory copies not dropped: {error}")
        return
    if said:
        log.info("%s: %s", where, said)
        await rt.kube.post_event(raw, "Normal", "MemoryCopiesDropped", said)


@kopf.on.delete(GROUP, VERSION, CHECKPOINT.plural)
async def delete_images(body: kopf.Body, retry: int, **_: Any) -> None:
    rt = runtime.get()
    raw = copy.deepcopy(dict(body))
    meta = raw["metadata"]
    if retry == 0:
        await drop_memory_copies(rt, raw)
    if (meta.get("annotations") or {}).get(RETAIN_ANNOTATION) == "true":
        await rt.kube.post_event(
            raw, "Normal", "ImagesRetained", f"{RETAIN_ANNOTATION}: images left in place"
        )
        return
    try:
        checkpoint = Checkpoint.from_wire(raw)
        location = await storage.location_of(
            rt.kube, meta["namespace"], checkpoint.spec.storage_ref, checkpoint.spec.storage
        )
        resolved = await storage.resolve(rt.kube, meta["namespace"], location)
        quick = resolved.config.with_overrides(
            max_attempts=2, read_timeout=min(resolved.config.read_timeout, DELETE_READ_TIMEOUT)
        )
        removing = asyncio.to_thread(
            remove_images, quick, checkpoint.spec.manifest_key, current().gc_grace_seconds
        )
        said = await asyncio.wait_for(removing, DELETE_SECONDS)  # the thread ends on its own timeouts
    except (storage.StorageProblem, StoreError, ValueError, TimeoutError) as error:
        message = str(error) or f"the store did not answer within {DELETE_SECONDS:g}s"
        if retry < DELETE_RETRIES:
            raise kopf.TemporaryError(f"images not deleted yet: {message}", delay=5) from None
        # The object goes anyway: a finalizer that never ends would block the namespace's deletion.
        await rt.kube.post_event(
            raw, "Warning", "ImagesNotDeleted", f"gave up after {retry + 1} tries, images remain: {message}"
        )
        return
    metrics.CHECKPOINTS_DELETED.inc()
    log.info("checkpoint %s/%s: %s", meta["namespace"], meta["name"], said)
    await rt.kube.post_event(raw, "Normal", "ImagesDeleted", said)


@kopf.on.resume(GROUP, VERSION, CHECKPOINT.plural)
async def resume_upload(body: kopf.Body, **_: Any) -> None:
    """status.upload InProgress: the S3 commit went with the operator that started it; taken up again,
    detached (durable.resume). Handlers run only once startup holds the Lease: the leader's alone."""
    await durable.resume(runtime.get(), copy.deepcopy(dict(body)))
