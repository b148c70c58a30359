"""What every job's daemon shares: the wait that ends a driver's loop, and the one body of a job's
daemon (the CheckpointJob's, the RestoreJob's; the schedule's daemon uses only the wait)."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from ibckpt.api import Condition, ConditionStatus, ConditionType
from ibckpt_operator import metrics
from ibckpt_operator.drivers import runtime
from ibckpt_operator.drivers.base import Driver, UnreadableStatus
from ibckpt_operator.machine.status import to_time


def stop_waiter(stopped: kopf.DaemonStopped, rt: runtime.Runtime) -> Any:
    """What ends the driver's loop: the Lease lost or the operator leaving ("exit"), the job deleted."""

    async def wait() -> str | None:
        lease_lost = asyncio.ensure_future(rt.lost.wait())
        stop = asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait({lease_lost, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lease_lost.cancel()
            stop.cancel()
        if rt.lost.is_set():
            return "exit"
        reason = stopped.reason
        if reason is not None and kopf.DaemonStoppingReason.RESOURCE_DELETED in reason:
            return "deleted"
        return "exit"

    return wait


async def fail_invalid(
    rt: runtime.Runtime, body: dict[str, Any], plural: str, message: str, reason: str = "InvalidSpec"
) -> None:
    """A spec (or a status) the models refuse: Failed at once, nothing touched."""
    now = time.time()
    generation = body["metadata"].get("generation")
    conditions = [
        Condition(type=ConditionType.READY, status=ConditionStatus.FALSE, reason=reason,
                  observed_generation=generation, last_transition_time=to_time(now)),
        Condition(type=ConditionType.PROGRESSING, status=ConditionStatus.FALSE, reason=reason,
                  observed_generation=generation, last_transition_time=to_time(now)),
        Condition(type=ConditionType.FAILED, status=ConditionStatus.TRUE, reason=reason,
                  message=message, observed_generation=generation, last_transition_time=to_time(now)),
    ]  # fmt: skip
    status = {
        "phase": "Failed",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "conditions": [c.to_wire() for c in conditions],
        "completionTime": datetime.fromtimestamp(now, UTC).isoformat(),
    }
    meta = body["metadata"]
    await rt.kube.patch_status(plural, meta["namespace"], meta["name"], status)
    await rt.kube.post_event(body, "Warning", reason, message)
    metrics.ended(body.get("kind", plural), "Failed", reason)


async def drive_job(
    body: Mapping[str, Any],
    stopped: kopf.DaemonStopped,
    plural: str,
    make_driver: Callable[[runtime.Runtime, dict[str, Any]], Driver[Any]],
    ended: tuple[str, ...],
) -> None:
    """A job's daemon, for both kinds: an ended job is left alone; a spec or a status the models refuse
    fails it once (a retry would read the same); otherwise its driver runs it from its status."""
    rt = runtime.get()
    raw = copy.deepcopy(dict(body))
    if (raw.get("status") or {}).get("phase") in ended:
        return
    try:
        driver = make_driver(rt, raw)
    except ValueError as error:
        await fail_invalid(rt, raw, plural, f"invalid spec: {error}")
        return
    try:
        await driver.run(stop_waiter(stopped, rt))
    except UnreadableStatus as error:
        await fail_invalid(rt, raw, plural, str(error), reason="InvalidStatus")
