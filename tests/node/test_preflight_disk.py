"""Preflight's room check on the host: the images' size is estimated from the resident memory of every
process the dump saves, and a checkpoint that would not fit where its images go is refused before any
rank is touched. Only the disk's free space is faked (shutil.disk_usage): the processes, /proc, the
driver, its coordinator and the shim's control socket are real or the usual stand-ins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from node.driver_harness import connected_driver, failed_checkpoint, unwritable_images
from node.fake_shim import FakeShimSocket

from ibckpt.coordination.ranks import RankId
from ibckpt.vocabulary import Mode
from ibckpt_node import preflight
from ibckpt_node.errors import CheckpointRefused
from ibckpt_node.ranks import LocalRank
from ibckpt_node.trees import ProcessTree
from testbed.coordinator import ThreadedCoordinator

MIB = 1 << 20


@pytest.fixture
def big() -> Iterator[int]:
    """A process that holds 80 MiB resident (touched, not just mapped); its pid."""
    code = "import time; b = bytearray(80 << 20); b[::4096] = b'x' * (80 << 8); print(1, flush=True); "
    code += "time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "1"
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_the_estimate_is_the_resident_memory_plus_a_margin_and_the_boundary_fits() -> None:
    resident = 1000 * MIB
    need = preflight.image_estimate(resident)
    assert need == resident + resident // 10 + 64 * MIB
    assert preflight.disk_problem(resident, 3, need, Path("/var/lib/ibckpt")) is None
    refused = preflight.disk_problem(resident, 3, need - 1, Path("/var/lib/ibckpt"))
    assert refused is not None
    assert refused == (
        f"refusing to checkpoint on this node: its images would need about 1.1 GiB ({need} bytes: "
        f"1000.0 MiB resident in 3 processes, plus 10% and 64 MiB) and /var/lib/ibckpt has 1.1 GiB "
        f"({need - 1} bytes) free"
    )
    # the agent's --disk-reserve-bytes stays free on top of the images
    reserve = 512 * MIB
    assert preflight.disk_problem(resident, 3, need + reserve, Path("/d"), reserve) is None
    short = preflight.disk_problem(resident, 3, need + reserve - 1, Path("/d"), reserve)
    assert short is not None and short.endswith(
        f"free, of which the agent leaves 512.0 MiB ({reserve} bytes) to the node"
    ), short


def test_resident_memory_is_read_for_every_process_of_a_tree(big: int) -> None:
    assert preflight.resident_bytes(big) >= 80 * MIB
    assert preflight.resident_bytes(2**22 + 7) == 0  # no such process
    # the tree of this test's process holds `big`: its memory counts once, with its parent's
    pids = preflight.dumped_processes([ProcessTree("t", os.getpid())], [])
    assert big in pids
    # without trees, each rank's own process (and its children) is what is dumped
    rank = LocalRank(RankId.parse("job/rank-0/main/0"), big, Path("/nonexistent"))
    assert preflight.dumped_processes([], [rank, rank]) == {big}


def test_the_free_space_is_asked_of_the_nearest_directory_that_exists(tmp_path: Path) -> None:
    assert preflight.existing(tmp_path / "sessions" / "s1" / "images") == tmp_path


def _free(monkeypatch: pytest.MonkeyPatch, free: int) -> list[str]:
    """shutil.disk_usage reports `free` bytes; returns the paths it was asked about."""
    asked: list[str] = []

    def disk_usage(path: str | Path) -> SimpleNamespace:
        asked.append(str(path))
        return SimpleNamespace(total=free * 2, used=free, free=free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    return asked


async def test_a_checkpoint_that_would_not_fit_is_refused_before_any_rank_is_touched(
    coordinator: ThreadedCoordinator, tmp_path: Path, big: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _free(monkeypatch, 50 * MIB)
    monkeypatch.setenv("PATH", "/nonexistent")  # no CRIU reaches the process, whatever happens
    shim = FakeShimSocket(tmp_path / "r.ctl")
    rank = LocalRank(RankId.parse("job/rank-0/main/0"), big, shim.path)
    driver = await connected_driver(coordinator, [rank], None)
    images = tmp_path / "sessions" / "s1" / "images"
    failed = await failed_checkpoint(
        driver,
        Mode.STOP,
        images,
        "refusing to checkpoint on this node: its images would need",
        CheckpointRefused,
    )
    message = str(failed.value)
    assert message.startswith("node-1: refusing to checkpoint on this node"), message
    assert (
        "resident in 1 process," in message and f"{tmp_path} has 50.0 MiB ({50 * MIB} bytes) free" in message
    )
    assert asked == [str(tmp_path)]
    assert shim.commands == ["status"]  # no rank was gated
    assert driver.report.outcome == "Refused"
    assert not images.exists()


async def test_a_checkpoint_that_fits_goes_on_past_preflight(
    coordinator: ThreadedCoordinator, tmp_path: Path, big: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _free(monkeypatch, 1 << 40)
    shim = FakeShimSocket(tmp_path / "r.ctl")
    rank = LocalRank(RankId.parse("job/rank-0/main/0"), big, shim.path)
    driver = await connected_driver(coordinator, [rank])
    # the dump refuses an image dir that is not empty: the cut ran, and the rank came back
    await failed_checkpoint(driver, Mode.LEAVE_RUNNING, unwritable_images(tmp_path, [rank]), "not empty")
    assert asked == [str(tmp_path / "images")]  # the free space was looked at, and sufficed
    assert shim.commands[:3] == ["status", "quiesce", "drain"], shim.commands
    assert driver.report.outcome != "Refused"
