"""The agent raises a rank's shim control thread (found by name) and its own thread, then restores both."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from ibckpt_node.priority import CONTROL_THREAD_NAME, boosted, control_threads

# A process with a second thread named as the shim names its control thread.
NAMED_THREAD = f"""
import ctypes, threading, time
def control():
    ctypes.CDLL(None).prctl(15, {CONTROL_THREAD_NAME.encode()!r})  # PR_SET_NAME
    print(threading.get_native_id(), flush=True)
    time.sleep(60)
threading.Thread(target=control, daemon=True).start()
time.sleep(60)
"""


@pytest.fixture
def rank() -> Iterator[tuple[int, int]]:
    """(pid, control thread id) of a process shaped like a rank under the shim."""
    proc = subprocess.Popen([sys.executable, "-c", NAMED_THREAD], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    tid = int(proc.stdout.readline())
    yield proc.pid, tid
    proc.kill()
    proc.wait()


def test_control_thread_is_found_by_name(rank: tuple[int, int]) -> None:
    pid, tid = rank
    assert control_threads(pid) == [tid]
    assert control_threads(os.getpid()) == []


def test_boost_raises_the_control_thread_and_the_caller_then_restores_them(rank: tuple[int, int]) -> None:
    pid, tid = rank
    me = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid), os.getpriority(os.PRIO_PROCESS, me)
    with boosted([pid], nice=-7) as raised:
        assert sorted(raised) == sorted([tid, me])
        assert os.getpriority(os.PRIO_PROCESS, tid) == -7
        assert os.getpriority(os.PRIO_PROCESS, me) == -7
        assert os.getpriority(os.PRIO_PROCESS, pid) == before[0]  # the rank's app thread is untouched
    assert (os.getpriority(os.PRIO_PROCESS, tid), os.getpriority(os.PRIO_PROCESS, me)) == before


def test_boost_off_changes_nothing(rank: tuple[int, int]) -> None:
    pid, tid = rank
    before = os.getpriority(os.PRIO_PROCESS, tid)
    with boosted([pid], nice=None) as raised:
        assert raised == [] and os.getpriority(os.PRIO_PROCESS, tid) == before
