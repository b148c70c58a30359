"""Failpoints: named places in the node driver where a test can make the agent wait, so that a fault
(a hung or killed agent) lands in a state that otherwise lasts milliseconds.

Off unless the agent runs with `--failpoints` (chart value `agent.failpoints`, false by default). When
on, a point `NAME` is armed by a file `<dir>/NAME` holding a number of seconds; the first rank to reach
the point takes the file (deletes it) and waits that long, so each arming fires once. The wait is
logged as a warning: a held agent is never silent.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# The longest wait a file may ask for: an armed point must never hold a session forever.
MAX_HOLD_S = 600.0

_directory: Path | None = None


def enable(directory: Path) -> None:
    """Honour armed points under `directory` from now on (created if missing)."""
    global _directory
    directory.mkdir(parents=True, exist_ok=True)
    _directory = directory
    log.warning("failpoints are on: a file in %s makes the agent wait there (tests only)", directory)


def disable() -> None:
    global _directory
    _directory = None


def _take(name: str) -> float | None:
    """The seconds armed for `name`, disarming it; None when not armed (or failpoints are off)."""
    if _directory is None:
        return None
    path = _directory / name
    try:
        text = path.read_text()
        path.unlink()
    except FileNotFoundError:  # not armed, or another rank took it first
        return None
    try:
        seconds = float(text.strip() or "0")
    except ValueError:
        log.error("failpoint %s: %r is not a number of seconds; not holding", name, text[:40])
        return None
    return min(max(seconds, 0.0), MAX_HOLD_S)


async def reached(name: str, where: str = "") -> None:
    """Wait here if the point `name` is armed."""
    seconds = _take(name)
    if seconds is None:
        return
    at = f"{name} ({where})" if where else name
    log.warning("failpoint %s: holding for %gs", at, seconds)
    await asyncio.sleep(seconds)
    log.warning("failpoint %s: going on", at)
