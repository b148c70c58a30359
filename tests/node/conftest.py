"""Fixtures shared by the node agent's host tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# A process whose second thread renames itself, as the shim's control thread does, then sleeps.
NAMED_SLEEPER = """
import threading, time
def control():
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
        comm.write("ibk-control")
    print(threading.get_native_id(), flush=True)
    time.sleep(60)
threading.Thread(target=control, daemon=True).start()
time.sleep(60)
"""


@pytest.fixture
def named_sleeper() -> Iterator[tuple[int, int]]:
    """(pid, tid of its thread named ibk-control)."""
    proc = subprocess.Popen([sys.executable, "-c", NAMED_SLEEPER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    tid = int(proc.stdout.readline())
    stat = Path(f"/proc/{proc.pid}/task/{tid}/stat")
    deadline = time.monotonic() + 10
    while stat.read_text().rpartition(")")[2].split()[0] != "S":  # it printed, now let it sleep
        assert time.monotonic() < deadline, "the named thread never went to sleep"
        time.sleep(0.01)
    yield proc.pid, tid
    proc.kill()
    proc.wait()
