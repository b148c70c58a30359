"""CheckpointSchedule: periodic CheckpointJobs with retention (issue 17 fills in the controller)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from ibckpt.api.base import ApiModel, KindInfo, PrinterColumn
from ibckpt.api.checkpointjob import CheckpointJobSpec
from ibckpt.api.common import CONDITIONS_SCHEMA_EXTRA, Condition
from ibckpt.api.storage import Retention


class CheckpointScheduleSpec(ApiModel):
    interval_seconds: int = Field(ge=60, description="Seconds between the starts of two CheckpointJobs.")
    suspend: bool = False
    retention: Retention = Retention(keep_last=3)
    template: CheckpointJobSpec = Field(description="The spec of each CheckpointJob it creates.")


class CheckpointScheduleStatus(ApiModel):
    last_checkpoint_time: datetime | None = None
    last_checkpoint_job: str | None = None
    message: str | None = None
    observed_generation: int | None = Field(default=None, ge=0)
    conditions: list[Condition] | None = Field(default=None, json_schema_extra=CONDITIONS_SCHEMA_EXTRA)


CHECKPOINT_SCHEDULE = KindInfo(
    kind="CheckpointSchedule",
    plural="checkpointschedules",
    short_names=("ckps",),
    scope="Namespaced",
    summary="Periodic CheckpointJobs with retention.",
    spec=CheckpointScheduleSpec,
    status=CheckpointScheduleStatus,
    printer_columns=(
        PrinterColumn("Every", ".spec.intervalSeconds", "integer"),
        PrinterColumn("Suspend", ".spec.suspend", "boolean"),
        PrinterColumn("Last", ".status.lastCheckpointTime", "date"),
    ),
)
