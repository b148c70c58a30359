"""RestoreJob: one daemon per job drives it (restorejob.RestoreJobDriver) from its status."""

from __future__ import annotations

import copy
from typing import Any

import kopf

from ibckpt.api import RestorePhase
from ibckpt_operator import runtime
from ibckpt_operator.config import GROUP, VERSION
from ibckpt_operator.handlers.checkpointjob import fail_invalid, stop_waiter
from ibckpt_operator.restorejob import PLURAL, RestoreJobDriver


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=None)
async def drive(body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any) -> None:
    rt = runtime.get()
    raw = copy.deepcopy(dict(body))
    if (raw.get("status") or {}).get("phase") in (RestorePhase.SUCCEEDED, RestorePhase.FAILED):
        return
    try:
        driver = RestoreJobDriver(rt, raw)
    except ValueError as error:
        await fail_invalid(rt, raw, PLURAL, f"invalid spec: {error}")
        return
    await driver.run(stop_waiter(stopped, rt))
