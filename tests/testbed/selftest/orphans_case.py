"""Run only by test_reaper.py, in a pytest that it kills: starts real parts, records their pids, waits."""

from __future__ import annotations

import os
import time
from pathlib import Path

from testbed.guest import GuestPair, GuestSpec
from testbed.kube import ControlPlane


def test_start_parts_then_hang(kube: ControlPlane) -> None:
    pair = GuestPair(GuestSpec("sleep 600"), GuestSpec("sleep 600"))
    pids = [*kube.pids, *(g.proc.pid for g in pair.guests)]
    out = Path(os.environ["IBCKPT_ORPHANS_PIDS"])
    out.with_suffix(".tmp").write_text(" ".join(map(str, pids)))
    out.with_suffix(".tmp").rename(out)
    time.sleep(600)
