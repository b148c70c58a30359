"""The disk window's rules (diskwindow.WindowGate) alone, and DiskWindow pausing a real process named criu
below this one while a directory holds more than the window, then letting it run when the bytes leave or
the window gives way."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ibckpt_node.agent.diskwindow import (
    LOOKAHEAD_LOOKS,
    LOW_WATER,
    STALL_SECONDS,
    DiskWindow,
    Step,
    WindowGate,
    criu_descendants,
)
from ibckpt_node.agent.diskwindow import held_bytes as held_on_disk

MIB = 1 << 20


def test_criu_pauses_past_the_window_and_runs_again_under_its_low_water() -> None:
    gate = WindowGate(window=100, give_way_at=1000.0)
    assert gate.step(100, True, 0.0) is None  # the first look knows no pace yet
    assert gate.step(100, True, 0.5) is None
    assert gate.step(101, True, 1.0) is Step.PAUSE
    assert gate.step(90, True, 2.0) is None  # above the low water still
    assert gate.step(int(100 * LOW_WATER), True, 3.0) is Step.RESUME
    assert gate.step(101, True, 4.0) is Step.PAUSE  # and again
    assert not gate.gave_way


def test_criu_pauses_before_the_window_when_it_writes_fast() -> None:
    """At its last pace it would pass the window within LOOKAHEAD_LOOKS more looks: paused now."""
    gate = WindowGate(window=100, give_way_at=1000.0)
    assert gate.step(10, True, 0.0) is None
    assert gate.step(30, True, 0.05) is None  # 30 + 3 * 20 = 90
    assert LOOKAHEAD_LOOKS == 3
    assert gate.step(50, True, 0.1) is Step.PAUSE  # 50 + 3 * 20 = 110, before it passed the window


def test_the_window_gives_way_when_nothing_leaves_the_disk() -> None:
    gate = WindowGate(window=100, give_way_at=1000.0)
    assert gate.step(150, True, 0.0) is Step.PAUSE
    assert gate.step(140, True, STALL_SECONDS - 1) is None  # progress: the stall counts from here
    assert gate.step(140, True, 2 * STALL_SECONDS - 2) is None
    assert gate.step(140, True, 2 * STALL_SECONDS) is Step.RESUME
    assert "no byte left the disk" in gate.gave_way
    assert gate.step(500, True, 2 * STALL_SECONDS + 1) is None  # never paused again


@pytest.mark.parametrize(
    ("following", "now", "why"),
    [(False, 1.0, "the upload during the dump stopped"), (True, 10.0, "half the dump's bound has passed")],
)
def test_the_window_gives_way_to_a_stopped_upload_and_to_the_dumps_bound(
    following: bool, now: float, why: str
) -> None:
    gate = WindowGate(window=100, give_way_at=10.0)
    assert gate.step(150, True, 0.0) is Step.PAUSE
    assert gate.step(150, following, now) is Step.RESUME
    assert gate.gave_way == why
    fresh = WindowGate(window=100, give_way_at=10.0)
    assert fresh.step(150, following, now) is None  # past it, not even a first pause
    assert fresh.gave_way == why


@pytest.fixture
def criu(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`sleep` run as `criu` under a shell: a grandchild of this process, as runc's CRIU is the agent's."""
    named = tmp_path / "criu"
    named.symlink_to("/bin/sleep")
    shell = subprocess.Popen(["/bin/sh", "-c", f"{named} 60; true"])
    deadline = time.monotonic() + 10
    while not criu_descendants():
        assert time.monotonic() < deadline, "criu never started"
        time.sleep(0.05)
    yield shell
    shell.kill()
    for pid in criu_descendants():
        os.kill(pid, 9)
    shell.wait()


def state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_real_criu_is_paused_while_the_images_hold_too_much(
    criu: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    [pid] = criu_descendants()
    assert criu.pid not in criu_descendants()  # the shell is not CRIU
    images = tmp_path / "images"
    images.mkdir()
    window = DiskWindow(images, 4 * MIB, lambda: True, give_way_after=600, chunk_size=MIB).start()
    try:
        big = images / "pages-1.img"
        big.write_bytes(os.urandom(6 * MIB))
        wait_for(lambda: state(pid) == "T")
        assert held_on_disk(images, MIB) >= 6 * MIB
        (images / "core-1.img").write_bytes(os.urandom(8 * MIB))  # not a page file: never counted
        assert held_on_disk(images, MIB) < 7 * MIB
        with big.open("r+b") as file:  # as the follower releases: a hole, the size kept
            os.truncate(file.fileno(), 0)
            os.truncate(file.fileno(), 6 * MIB)
        wait_for(lambda: state(pid) != "T")
        big.write_bytes(os.urandom(6 * MIB))
        wait_for(lambda: state(pid) == "T")
    finally:
        stats = window.stop()
    assert state(pid) != "T"  # stop() lets it run, whatever the window
    assert stats.pauses == 2 and stats.peak_bytes >= 6 * MIB and stats.paused_seconds > 0
