"""The agent raises a rank's shim control thread (found by name) and its own thread, then restores both."""

from __future__ import annotations

import os
import threading

from node.named_threads import process_with_named_thread

from ibckpt_node.priority import boosted, control_threads


def test_control_thread_is_found_by_name(named_sleeper: tuple[int, int]) -> None:
    pid, tid = named_sleeper
    assert control_threads(pid) == [tid]
    assert control_threads(os.getpid()) == []


def test_the_device_thread_is_boosted_too() -> None:
    with process_with_named_thread("ibk-device") as (pid, tid):
        assert control_threads(pid) == [tid]
    with process_with_named_thread("ibk-release") as (pid, _):
        assert control_threads(pid) == []  # short-lived, inherits the control thread's nice value


def test_boost_raises_the_control_thread_and_the_caller_then_restores_them(
    named_sleeper: tuple[int, int],
) -> None:
    pid, tid = named_sleeper
    me = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid), os.getpriority(os.PRIO_PROCESS, me)
    with boosted([pid], nice=-7) as raised:
        assert sorted(raised) == sorted([tid, me])
        assert os.getpriority(os.PRIO_PROCESS, tid) == -7
        assert os.getpriority(os.PRIO_PROCESS, me) == -7
        assert os.getpriority(os.PRIO_PROCESS, pid) == before[0]  # the rank's app thread is untouched
    assert (os.getpriority(os.PRIO_PROCESS, tid), os.getpriority(os.PRIO_PROCESS, me)) == before


def test_boost_off_changes_nothing(named_sleeper: tuple[int, int]) -> None:
    pid, tid = named_sleeper
    before = os.getpriority(os.PRIO_PROCESS, tid)
    with boosted([pid], nice=None) as raised:
        assert raised == [] and os.getpriority(os.PRIO_PROCESS, tid) == before
