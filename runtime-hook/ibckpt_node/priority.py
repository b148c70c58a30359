"""Raise the CPU priority of the threads a checkpoint waits on, for as long as it waits on them.

A rank's shim answers the agent on its control thread, which shares the rank's CPUs with the
application's busy-polling threads; the agent itself may share a CPU with ranks too. At normal
priority each command then waits for the pollers' time slices, on every rank, in every phase.
So for the cut (and for rebuild and resume) the agent raises its own thread and each rank's
control thread (found by its name, IBK_CONTROL_THREAD_NAME in native/src/shim.h) to a higher
priority (a lower nice value), and puts every nice value back afterwards. Without the
privilege to do so (CAP_SYS_NICE) the checkpoint runs as before; that is logged, not refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

CONTROL_THREAD_NAME = "ibk-control"
# The thread a rebuild opens the device on, and that rings doorbells after a CRIU restore.
DEVICE_THREAD_NAME = "ibk-device"
SHIM_THREAD_PREFIX = "ibk-"  # every thread the shim starts (native/src/shim.h)
DEFAULT_BOOST_NICE = -10


def control_threads(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The thread ids of `pid`'s shim threads the agent waits on: the control thread and the
    device thread (none if the shim is not loaded)."""
    found = []
    with contextlib.suppress(OSError):
        for task in (proc / str(pid) / "task").iterdir():
            with contextlib.suppress(OSError):
                if (task / "comm").read_text().strip() in (CONTROL_THREAD_NAME, DEVICE_THREAD_NAME):
                    found.append(int(task.name))
    return found


@contextlib.contextmanager
def boosted(pids: Iterable[int], nice: int | None = DEFAULT_BOOST_NICE) -> Iterator[list[int]]:
    """Run the body with the calling thread and the control threads of `pids` at `nice`.

    Yields the thread ids that were raised. `nice=None` changes nothing. A thread that is
    already at `nice` or lower is left alone; each raised thread gets its own value back.
    """
    if nice is None:
        yield []
        return
    tids = [threading.get_native_id()] + [t for pid in pids for t in control_threads(pid)]
    saved: dict[int, int] = {}
    for tid in tids:
        try:
            before = os.getpriority(os.PRIO_PROCESS, tid)
            if before > nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                saved[tid] = before
        except PermissionError:
            log.info("no privilege to raise thread %d to nice %d: the checkpoint runs unboosted", tid, nice)
            break
        except ProcessLookupError:
            continue
    try:
        yield list(saved)
    finally:
        for tid, before in saved.items():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpriority(os.PRIO_PROCESS, tid, before)
