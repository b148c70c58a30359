"""CheckpointSchedule: one daemon per schedule runs its controller (drivers/schedule.py); the watches
on its CheckpointJobs and RestoreJobs poke it, so a job that ends is seen at once, not at the next tick."""

from __future__ import annotations

from typing import Any

import kopf

from ibckpt.api import CHECKPOINT_JOB, CHECKPOINT_SCHEDULE, GROUP, RESTORE_JOB, VERSION
from ibckpt.api.schedule import SCHEDULE_LABEL
from ibckpt_operator.drivers import runtime
from ibckpt_operator.drivers.schedule import CONTROLLERS, ScheduleController
from ibckpt_operator.handlers.jobs import stop_waiter


# An exiting operator or a deleted schedule stops the loop after the pass in flight; the state is in
# status and the PDB is owned by the schedule (the garbage collector removes it with the schedule).
@kopf.daemon(GROUP, VERSION, CHECKPOINT_SCHEDULE.plural, cancellation_backoff=2.0, cancellation_timeout=60.0)
async def run_schedule(body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any) -> None:
    rt = runtime.get()
    await ScheduleController(rt, body).run(stop_waiter(stopped, rt))


def poke_owner(body: kopf.Body) -> None:
    meta = body.get("metadata") or {}
    controller = CONTROLLERS.get(f"{meta.get('namespace')}/{(meta.get('labels') or {}).get(SCHEDULE_LABEL)}")
    if controller is not None:
        controller.poke()


@kopf.on.event(GROUP, VERSION, CHECKPOINT_JOB.plural, labels={SCHEDULE_LABEL: kopf.PRESENT})
async def checkpoint_job_changed(body: kopf.Body, **_: Any) -> None:
    poke_owner(body)


@kopf.on.event(GROUP, VERSION, RESTORE_JOB.plural, labels={SCHEDULE_LABEL: kopf.PRESENT})
async def restore_job_changed(body: kopf.Body, **_: Any) -> None:
    poke_owner(body)
