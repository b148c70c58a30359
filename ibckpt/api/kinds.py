"""Every kind of the ibckpt.io API, in the order the CRDs are written."""

from __future__ import annotations

from ibckpt.api.base import KindInfo
from ibckpt.api.checkpoint import CHECKPOINT
from ibckpt.api.checkpointjob import CHECKPOINT_JOB
from ibckpt.api.restorejob import RESTORE_JOB
from ibckpt.api.schedule import CHECKPOINT_SCHEDULE
from ibckpt.api.storage import CHECKPOINT_STORAGE

KINDS: tuple[KindInfo, ...] = (
    CHECKPOINT_JOB,
    CHECKPOINT,
    RESTORE_JOB,
    CHECKPOINT_STORAGE,
    CHECKPOINT_SCHEDULE,
)
