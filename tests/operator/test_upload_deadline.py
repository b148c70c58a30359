"""The deadline of a memory commit's background commit to S3 (drivers/durable.py): recorded in
status.upload at the publish, and what a restarted operator has left of it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from ibckpt.api import CheckpointStatus, CheckpointUpload, UploadState
from ibckpt_operator.drivers.durable import deadline_after, seconds_left

NOW = datetime(2026, 12, 4, 12, 0, 0, 250000, tzinfo=UTC)


def test_the_deadline_is_the_publish_plus_the_upload_timeout() -> None:
    assert deadline_after(1800, NOW) == NOW + timedelta(seconds=1800)
    assert seconds_left(deadline_after(1800, NOW), NOW) == 1800


def test_a_resumed_upload_waits_only_for_the_time_left() -> None:
    deadline = deadline_after(60, NOW)
    assert seconds_left(deadline, NOW + timedelta(seconds=45)) == 15
    assert seconds_left(deadline, NOW + timedelta(seconds=60)) == 0
    assert seconds_left(deadline, NOW + timedelta(hours=2)) == 0  # past it: NotFinished at once


def test_the_deadline_survives_the_status_round_trip() -> None:
    upload = CheckpointUpload(state=UploadState.IN_PROGRESS, deadline=deadline_after(30, NOW))
    wire = CheckpointStatus(upload=upload).to_wire()
    assert wire["upload"]["state"] == "InProgress"
    back = CheckpointStatus.from_wire(wire).upload
    assert back is not None and seconds_left(back.deadline, NOW) == 30


def test_a_deadline_without_a_zone_is_utc() -> None:
    naive = datetime(2026, 12, 4, 12, 1, 0)
    assert seconds_left(naive, datetime(2026, 12, 4, 12, 0, 0, tzinfo=UTC)) == 60
