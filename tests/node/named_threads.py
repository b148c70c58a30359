"""A real process with a thread named as the shim names its threads, for host tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# A process whose second thread renames itself (as the shim names its threads), then sleeps.
NAMED_SLEEPER = """
import sys, threading, time
def named():
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
        comm.write(sys.argv[1])
    print(threading.get_native_id(), flush=True)
    time.sleep(60)
threading.Thread(target=named, daemon=True).start()
time.sleep(60)
"""


@contextlib.contextmanager
def process_with_named_thread(name: str) -> Iterator[tuple[int, int]]:
    """(pid, tid of its thread called `name`), the thread asleep."""
    proc = subprocess.Popen([sys.executable, "-c", NAMED_SLEEPER, name], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        tid = int(proc.stdout.readline())
        stat = Path(f"/proc/{proc.pid}/task/{tid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rpartition(")")[2].split()[0] != "S":  # it printed, now let it sleep
            assert time.monotonic() < deadline, "the named thread never went to sleep"
            time.sleep(0.01)
        yield proc.pid, tid
    finally:
        proc.kill()
        proc.wait()
