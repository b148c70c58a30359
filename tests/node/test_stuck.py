"""Where a hung rank's threads wait (stuck.py), read from a real process's /proc."""

from __future__ import annotations

import subprocess
import time

from ibckpt_node import stuck


def test_each_thread_says_its_name_state_and_where_it_sleeps(named_sleeper: tuple[int, int]) -> None:
    pid, tid = named_sleeper
    # The kernel reports no wchan for a moment now and then (seen under load: "0" while the
    # stack showed the sleep), so a few reads are allowed; one must name the function.
    deadline = time.monotonic() + 5
    while True:
        states = {s.tid: s for s in stuck.thread_states(pid)}
        assert set(states) >= {pid, tid}
        control = states[tid]
        assert control.name == "ibk-control" and control.state == "S", control
        # readable as root, the innermost frame of the stack is where it waits
        if control.wchan and (not control.stack or control.stack[0] == control.wchan):
            break
        assert time.monotonic() < deadline, control
        time.sleep(0.05)


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


def test_where_falls_back_to_the_innermost_frame() -> None:
    no_wchan = stuck.ThreadState(7, "ibk-control", "D", "", ("__rxe_cleanup", "rxe_destroy_qp"))
    assert no_wchan.describe() == "ibk-control/7 D in __rxe_cleanup [__rxe_cleanup < rxe_destroy_qp]"
    assert stuck.ThreadState(8, "app", "R", "", ()).describe() == "app/8 R in -"


def test_a_command_name_with_parentheses_does_not_shift_the_state() -> None:
    assert stuck._state("123 (a) b) (c) D 1 2 3") == "D"
    assert stuck._frames("[<0>] rxe_cleanup_task+0x5/0x10\n[<0>] rxe_qp_destroy+0x1/0x2\n") == (
        "rxe_cleanup_task",
        "rxe_qp_destroy",
    )
