"""CheckpointStorage: its Ready condition says whether the bucket answered with these credentials,
checked when it is created or changed and every few minutes (a rotated key shows up before a job fails).
After a check that passed, its retention is applied and its bucket swept when due (drivers/storage.py)."""

from __future__ import annotations

import copy
import logging
import time
from datetime import UTC, datetime
from typing import Any

import kopf

from ibckpt.api import (
    CHECKPOINT_STORAGE,
    GROUP,
    VERSION,
    CheckpointStorageSpec,
    Condition,
    ConditionStatus,
    ConditionType,
    LocalObjectReference,
)
from ibckpt_operator.cluster import storage
from ibckpt_operator.cluster.imports import IMPORT_ANNOTATION
from ibckpt_operator.drivers import runtime
from ibckpt_operator.drivers.storage import import_asked, upkeep
from ibckpt_operator.machine.status import to_time

log = logging.getLogger(__name__)
RECHECK_SECONDS = 300.0


async def check_storage(body: dict[str, Any]) -> None:
    rt = runtime.get()
    meta = body["metadata"]
    resolved, spec = None, None
    try:
        spec = CheckpointStorageSpec.from_wire(body.get("spec") or {})
        own = LocalObjectReference(name=meta["name"])
        resolved = await storage.check(rt.kube, meta["namespace"], own, None)
        status, reason, message = (
            ConditionStatus.TRUE,
            "BucketAnswered",
            "the bucket answered with these credentials",
        )
    except storage.StorageProblem as problem:
        status, reason, message = ConditionStatus.FALSE, problem.reason, problem.message
    except ValueError as error:
        status, reason, message = ConditionStatus.FALSE, "InvalidStorage", str(error)
    previous: dict[str, Any] = next(
        (
            c
            for c in (body.get("status") or {}).get("conditions") or ()
            if c.get("type") == ConditionType.READY
        ),
        {},
    )
    now = time.time()
    changed = previous.get("status") != status
    since = to_time(now) if changed or not previous.get("lastTransitionTime") else None
    condition = Condition(
        type=ConditionType.READY,
        status=status,
        reason=reason,
        message=message,
        observed_generation=meta.get("generation"),
        last_transition_time=since,
    ).to_wire()
    if since is None:
        condition["lastTransitionTime"] = previous["lastTransitionTime"]
    patch = {
        "observedGeneration": meta.get("generation"),
        "conditions": [condition],
        "lastCheckedTime": datetime.fromtimestamp(now, UTC).isoformat(),
    }
    if resolved is not None and spec is not None:
        try:
            patch.update(await import_asked(rt, body, resolved.config, now))
            patch.update(await upkeep(rt, body, spec, resolved.config, now))
        except Exception as error:  # the check's result is written anyway; the next check tries again
            log.exception("CheckpointStorage %s/%s: upkeep failed", meta["namespace"], meta["name"])
            await rt.kube.post_event(body, "Warning", "UpkeepFailed", f"retention and sweep not run: {error}")
    await rt.kube.patch_status(CHECKPOINT_STORAGE.plural, meta["namespace"], meta["name"], patch)
    if changed:
        kind = "Normal" if status == ConditionStatus.TRUE else "Warning"
        await rt.kube.post_event(body, kind, reason, message)


@kopf.on.resume(GROUP, VERSION, CHECKPOINT_STORAGE.plural)
@kopf.on.create(GROUP, VERSION, CHECKPOINT_STORAGE.plural)
@kopf.on.update(GROUP, VERSION, CHECKPOINT_STORAGE.plural, field="spec")
async def checked(body: kopf.Body, **_: Any) -> None:
    await check_storage(copy.deepcopy(dict(body)))


@kopf.on.field(
    GROUP, VERSION, CHECKPOINT_STORAGE.plural, field=("metadata", "annotations", IMPORT_ANNOTATION)
)
async def import_annotated(body: kopf.Body, new: Any, **_: Any) -> None:
    """`kubectl ibckpt import` sets the annotation: checked, and imported, at once."""
    if new:
        await check_storage(copy.deepcopy(dict(body)))


@kopf.timer(
    GROUP, VERSION, CHECKPOINT_STORAGE.plural, interval=RECHECK_SECONDS, initial_delay=RECHECK_SECONDS
)
async def rechecked(body: kopf.Body, **_: Any) -> None:
    await check_storage(copy.deepcopy(dict(body)))
