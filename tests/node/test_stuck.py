"""Where a hung rank's threads wait (stuck.py), read from a real process's /proc."""

from __future__ import annotations

import subprocess

from ibckpt_node import stuck


def test_each_thread_says_its_name_state_and_where_it_sleeps(named_sleeper: tuple[int, int]) -> None:
    pid, tid = named_sleeper
    states = {s.tid: s for s in stuck.thread_states(pid)}
    assert set(states) >= {pid, tid}
    control = states[tid]
    assert control.name == "ibk-control" and control.state == "S", control
    assert control.wchan, control  # a sleeping thread waits in some kernel function
    if control.stack:  # readable as root: the innermost frame is where it waits
        assert control.stack[0] == control.wchan, control


def test_describing_only_the_shims_threads(named_sleeper: tuple[int, int]) -> None:
    pid, tid = named_sleeper
    line = stuck.describe_process(pid, prefix="ibk-")
    assert line.startswith(f"pid {pid}: ibk-control/{tid} S in "), line
    assert ";" not in line  # the main thread is left out
    assert stuck.describe_process(pid, prefix="nobody") == f"pid {pid}: no thread named nobody*"


def test_a_gone_process_is_said_to_be_gone() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert stuck.describe_process(proc.pid) == f"pid {proc.pid} is gone"


def test_a_command_name_with_parentheses_does_not_shift_the_state() -> None:
    assert stuck._state("123 (a) b) (c) D 1 2 3") == "D"
    assert stuck._frames("[<0>] rxe_cleanup_task+0x5/0x10\n[<0>] rxe_qp_destroy+0x1/0x2\n") == (
        "rxe_cleanup_task",
        "rxe_qp_destroy",
    )
