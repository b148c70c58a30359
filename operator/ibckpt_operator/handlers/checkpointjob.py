"""CheckpointJob: one daemon per job drives it (checkpointjob.CheckpointJobDriver) from its status."""

from __future__ import annotations

from typing import Any

import kopf

from ibckpt.api import CHECKPOINT_JOB, GROUP, VERSION, JobPhase
from ibckpt_operator.drivers.checkpointjob import CheckpointJobDriver
from ibckpt_operator.handlers.jobs import drive_job


# A deleted job first brings its ranks back (bounded by its abort timeout); an exiting operator leaves at
# once (the state is in status). kopf cancels the daemon only past these bounds.
@kopf.daemon(GROUP, VERSION, CHECKPOINT_JOB.plural, cancellation_backoff=2.0, cancellation_timeout=600.0)
async def drive(body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any) -> None:
    await drive_job(
        body, stopped, CHECKPOINT_JOB.plural, CheckpointJobDriver, (JobPhase.SUCCEEDED, JobPhase.FAILED)
    )


__all__ = ["drive"]
