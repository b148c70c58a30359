"""The record that lets ranks out of running be brought back after their session's driver is over.

Two cases need it. A Stop or Hold checkpoint keeps its ranks released after the dump, until the
operator kills them once the manifest is committed (or a restore rebuilds them); if the job aborts
instead (an upload failed), they must be rebuilt with their peers and resumed. And an agent that
dies mid-session (a crash, an OOM kill) leaves its ranks where they were: quiesced or drained ones
resume on their shim's lease, released ones cannot. The next agent reads the session's request from
this record when the operator's abort reaches it, and brings them back the same way.

The record is the checkpoint request without its coordinator token (the abort brings the token of
the coordinator to rebuild through). It is written before any rank is touched and removed once the
ranks are back or the session ended with every rank running.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from pydantic import ValidationError

from ibckpt.agentapi import models as api

log = logging.getLogger(__name__)

RECORD = "session.json"


def record_path(work_dir: Path, session_id: str) -> Path:
    return work_dir / "sessions" / session_id / RECORD


def save(work_dir: Path, request: api.CheckpointRequest) -> None:
    path = record_path(work_dir, request.session_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = request.model_dump(mode="json", exclude={"session_token"})
    partial = path.with_suffix(".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    partial.replace(path)


def load(work_dir: Path, session_id: str, order: api.AbortRequest) -> api.CheckpointRequest | None:
    """The recorded request, pointed at the coordinator `order` names; None if there is no record
    (or it cannot be read, which is logged)."""
    path = record_path(work_dir, session_id)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.error("session %s: cannot read its record %s: %s", session_id, path, exc)
        return None
    if not order.coordinator or order.session_token is None:
        return None
    data.update(coordinator=order.coordinator, session_token=order.session_token.get_secret_value())
    try:
        return api.CheckpointRequest.model_validate(data)
    except ValidationError as exc:
        log.error("session %s: its record %s is not a checkpoint request: %s", session_id, path, exc)
        return None


def forget(work_dir: Path, session_id: str) -> None:
    record_path(work_dir, session_id).unlink(missing_ok=True)
