"""CRIU's own account of a dump (its stats-dump image), for tests that check what a dump wrote."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def dump_stats(images: Path) -> dict[str, int]:
    """The dump's counters (pages_written, pages_skipped_parent, frozen_time, ...), decoded by crit."""
    decoded = subprocess.run(
        ["crit", "decode", "-i", str(images / "stats-dump")], capture_output=True, text=True, check=True
    )
    stats: dict[str, int] = json.loads(decoded.stdout)["entries"][0]["dump"]
    return stats
