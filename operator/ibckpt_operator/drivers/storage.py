"""A CheckpointStorage's upkeep, after each check of its bucket: an import asked for (cluster/imports.py),
its retention applied to the Checkpoints that name it (machine/retention.py decides; a deleted
Checkpoint's finalizer deletes its manifest), and, every `store_sweep_seconds`, a sweep of the chunks and
parts no checkpoint uses. Returns the status it measured: the import's result, how many checkpoints
remain and their bytes, how many retention deleted, the last sweep."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

from ibckpt.api import CHECKPOINT, Checkpoint, CheckpointStorageSpec, ObjectMeta, StorageImport
from ibckpt.store import StoreConfig, StoreError
from ibckpt_operator import metrics
from ibckpt_operator.cluster import imports, retention, schedules, storage
from ibckpt_operator.cluster.kube import Body
from ibckpt_operator.config import current
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.machine.retention import decide

log = logging.getLogger(__name__)


async def import_asked(rt: Runtime, body: Body, config: StoreConfig, now: float) -> Body:
    """Make the Checkpoint objects of the bucket's checkpoints of this namespace that have none, when the
    import annotation holds a value not answered yet: the status patch that answers it, else {}."""
    meta, status = body["metadata"], body.get("status") or {}
    asked = (meta.get("annotations") or {}).get(imports.IMPORT_ANNOTATION)
    if not asked or (status.get("lastImport") or {}).get("requested") == asked:
        return {}
    namespace, name = meta["namespace"], meta["name"]
    existing = {
        c["metadata"]["name"] for c in await schedules.list_namespaced(rt.kube, CHECKPOINT.plural, namespace)
    }
    answer = StorageImport(requested=asked, time=datetime.fromtimestamp(now, UTC))
    try:
        found = await asyncio.to_thread(imports.survey, config, namespace, name, existing)
    except (storage.StorageProblem, StoreError) as error:
        answer.message = f"nothing imported: {error}"
        await rt.kube.post_event(body, "Warning", "ImportFailed", answer.message)
        return {"lastImport": answer.to_wire()}
    for item in found.found:
        checkpoint = Checkpoint(
            metadata=ObjectMeta(name=item.name, namespace=namespace, labels=item.labels), spec=item.spec
        )
        if await rt.kube.create_custom(CHECKPOINT.plural, namespace, checkpoint.to_wire()):
            with contextlib.suppress(Exception):  # verified just now; the periodic check may say otherwise
                await rt.kube.patch_status(CHECKPOINT.plural, namespace, item.name, {"readyToRestore": True})
            answer.imported.append(item.name)
    answer.skipped = [f"{cid}: {why}" for cid, why in sorted(found.skipped.items())]
    message = f"imported {len(answer.imported)} checkpoint(s) from the bucket" + (
        f", skipped {len(answer.skipped)}: {'; '.join(answer.skipped)[:500]}" if answer.skipped else ""
    )
    log.info("CheckpointStorage %s/%s: %s", namespace, name, message)
    await rt.kube.post_event(body, "Warning" if answer.skipped else "Normal", "CheckpointsImported", message)
    return {"lastImport": answer.to_wire()}


async def upkeep(
    rt: Runtime, body: Body, spec: CheckpointStorageSpec, config: StoreConfig, now: float
) -> Body:
    meta, status = body["metadata"], body.get("status") or {}
    namespace, name = meta["namespace"], meta["name"]
    rules = spec.retention
    by_chunks = rules is not None and rules.max_total_bytes is not None
    checkpoints = await retention.storage_view(rt.kube, namespace, name, config if by_chunks else None)
    pruned = int(status.get("prunedCount") or 0)
    dropped: set[str] = set()
    for decision in decide(checkpoints, rules, now) if rules is not None else ():
        if decision.keep:
            continue
        dropped.add(decision.name)
        if await schedules.delete_checkpoint(rt.kube, namespace, decision.name):
            pruned += 1
            metrics.STORAGE_PRUNED.labels(f"{namespace}/{name}").inc()
            message = f"{decision.name}: {decision.reason}"
            log.info("CheckpointStorage %s/%s pruned %s", namespace, name, message)
            await rt.kube.post_event(body, "Normal", "CheckpointPruned", message)
    kept = [c for c in checkpoints if c.name not in dropped]
    patch: dict[str, Any] = {
        "checkpointCount": len(kept),
        "storedBytes": sum(c.bytes for c in kept),
        "prunedCount": pruned,
    }
    last = schedules.timestamp(status.get("lastSweepTime"))
    settings = current()
    if last is None or now - last >= settings.store_sweep_seconds:
        try:
            swept = await asyncio.to_thread(retention.sweep, config, settings.gc_grace_seconds)
        except (storage.StorageProblem, StoreError) as error:
            log.warning("CheckpointStorage %s/%s: sweep failed: %s", namespace, name, error)
            await rt.kube.post_event(body, "Warning", "SweepFailed", f"the bucket was not swept: {error}")
            return patch
        patch["lastSweepTime"] = datetime.fromtimestamp(now, UTC).isoformat()
        log.info("CheckpointStorage %s/%s: %s", namespace, name, swept.message)
        if swept.removed:
            await rt.kube.post_event(body, "Normal", "StoreSwept", swept.message)
    return patch
