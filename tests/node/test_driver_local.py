"""The node driver's cut against fake shims on the host (driver_harness.py): the fast and the old
cut, the leases renewed while ranks are held, a release that times out, failpoints.

The abort path, the restore and the rejoin are test_driver_recovery.py's.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from pathlib import Path

import pytest
from node.driver_harness import (
    RANKS,
    REBUILD_20S,
    FakeShim,
    connected_driver,
    failed_checkpoint,
    failed_dump,
    fake_ranks,
    gather_closing,
    session_clients,
    unwritable_images,
)

from ibckpt.vocabulary import GATED, Milestone, Mode, PhaseSeconds
from ibckpt_node import criu, failpoints
from ibckpt_node.driver import NodeDriver
from ibckpt_node.errors import CheckpointFailed
from ibckpt_node.ranks import LocalRank
from ibckpt_node.settings import CutOptions, NodeSettings
from testbed.coordinator import ThreadedCoordinator


class SlowRelease(FakeShim):
    """A rank whose release takes a while, as a big one does: the renewals must go on meanwhile."""

    release_s = 0.6

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "release":
            threading.Event().wait(self.release_s)
        return super().answer(verb)


async def test_leases_are_renewed_while_the_ranks_are_held_and_stop_after(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = fake_ranks(tmp_path, sleeper, SlowRelease)
    leases = NodeSettings(lease_s=2.0, lease_renew_s=0.1)
    driver = await connected_driver(coordinator, ranks, REBUILD_20S, settings=leases)
    try:
        with pytest.raises(CheckpointFailed, match="not empty"):
            await asyncio.wait_for(driver.checkpoint(Mode.STOP, unwritable_images(tmp_path, ranks), 2), 30)
        assert driver.report.outcome == "Aborted"
        await asyncio.sleep(0.2)  # a renewal sent as the loop stopped may still be on its way in
        renewed = [len(s.leases) for s in shims]
        # every rank, during its slow release, with the driver's lease
        assert all(n >= 2 for n in renewed), renewed
        assert {line for s in shims for line in s.leases} == {"lease 2000"}
        await asyncio.sleep(0.5)
        assert [len(s.leases) for s in shims] == renewed, "renewals after the ranks were resumed"
        # a session that ends with its ranks held (Hold) hands them over: lease 0, then nothing
        driver.leases.start()
        await asyncio.sleep(0.35)
        await driver.end_leases()
        assert all(s.leases[-1] == "lease 0" for s in shims), [s.leases[-3:] for s in shims]
        handed = [len(s.leases) for s in shims]
        await asyncio.sleep(0.3)
        assert [len(s.leases) for s in shims] == handed
    finally:
        await driver.client.close()


async def test_no_lease_renewal_reaches_a_rank_while_criu_dumps_it(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal's socket open in a rank at CRIU's freeze failed the dump ("Unix socket not found": the
    accepted end belongs to the agent's network namespace); the ranks not being dumped keep theirs."""
    shims, ranks = fake_ranks(tmp_path, sleeper, FakeShim)
    by_dir = {r.rank.key().replace("/", "_"): i for i, r in enumerate(ranks)}
    during: dict[int, list[int]] = {}

    def slow_dump(pid: int, images: Path, options: object, timeout: float, parent: Path | None) -> None:
        before = [len(s.leases) for s in shims]
        time.sleep(1.0)  # 20 renewal periods: at least one reaches each other rank on a loaded machine
        during[by_dir[images.name]] = [len(s.leases) - n for s, n in zip(shims, before, strict=True)]
        images.mkdir(parents=True)

    monkeypatch.setattr(criu, "dump", slow_dump)
    leases = NodeSettings(lease_s=2.0, lease_renew_s=0.05)
    driver = await connected_driver(coordinator, ranks, REBUILD_20S, settings=leases)
    try:
        report = await asyncio.wait_for(driver.checkpoint(Mode.LEAVE_RUNNING, tmp_path / "images", 2), 60)
    finally:
        await driver.client.close()
    assert report.outcome == "Succeeded"
    assert sorted(during) == list(range(RANKS))
    for dumped, renewed in during.items():
        assert renewed[dumped] == 0, during  # none while its own dump ran
        others = [n for i, n in enumerate(renewed) if i != dumped]
        assert all(n >= 1 for n in others), during  # the other held ranks kept their leases


async def test_the_fast_cut_drains_each_rank_right_after_its_quiesce(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, driver = await failed_dump(coordinator, tmp_path, sleeper, Mode.STOP)
    report = driver.report
    # no barrier between quiesce and drain: one phase covers both, then release
    assert Milestone.QUIESCED not in report.phases, report.phases
    assert {Milestone.DRAINED, Milestone.RELEASED} <= report.phases.keys(), report.phases
    for s in shims:
        assert [line.split()[0] for line in s.lines[1:4]] == ["quiesce", "drain", "release"], s.lines
        drain, release = s.lines[2].split(), s.lines[3].split()
        assert drain[2] == str(NodeSettings().drain_stall_ms) and len(release) == 2, s.lines


async def test_the_old_cut_keeps_its_barrier_stall_window_and_quiet_release(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = fake_ranks(tmp_path, sleeper, FakeShim)
    cut = CutOptions(quiesce_barrier=True, release_quiet=True)
    settings = NodeSettings(drain_stall_ms=100)
    driver = await connected_driver(coordinator, ranks, None, settings=settings, cut=cut)
    await failed_checkpoint(driver, Mode.STOP, unwritable_images(tmp_path, ranks), "not empty")
    report = driver.report
    assert {Milestone.QUIESCED, Milestone.DRAINED, Milestone.RELEASED} <= report.phases.keys(), report.phases
    for s in shims:
        assert s.lines[2].split()[2] == "100" and s.lines[3].endswith(" quiet"), s.lines


@pytest.mark.parametrize("mode", [Mode.LEAVE_RUNNING, Mode.STOP])
async def test_a_leave_running_node_dumps_while_the_others_release_and_says_how_long_it_was_gated(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int, mode: Mode
) -> None:
    """node-2's ranks release slowly. A LeaveRunning node-1 dumps meanwhile (its ranks are released: no
    peer's NIC reaches them) and meets the Released barrier before its Dumped one; a Stop node-1 waits,
    since its dump ends ranks that an abort could not bring back. CRIU does not run on the host, so the
    dump here only looks at node-2's ranks."""
    shims, ranks = fake_ranks(tmp_path, sleeper, SlowRelease)
    for shim in shims[:6]:
        shim.release_s = 0.0
    clients = await session_clients(coordinator, ("node-1", "node-2"))
    drivers = [
        NodeDriver(node, client, mine, REBUILD_20S)
        for node, client, mine in zip(("node-1", "node-2"), clients, (ranks[:6], ranks[6:]), strict=True)
    ]
    seen: dict[str, list[str]] = {}

    async def dump(driver: NodeDriver, *_: object) -> None:
        seen[driver.node] = [s.state for s in shims[6:]]

    for driver in drivers:
        driver._dump_all = functools.partial(dump, driver)  # type: ignore[method-assign]
    outcomes = await gather_closing(
        clients, *(d.checkpoint(mode, tmp_path / d.node, epoch=2) for d in drivers), timeout=60
    )
    assert [d.report.outcome for d in drivers] == [
        "Succeeded" if mode is Mode.LEAVE_RUNNING else "Stopped"
    ] * 2, outcomes
    released = seen["node-1"].count("released")
    if mode is Mode.LEAVE_RUNNING:
        assert released < 6, seen  # node-2 still releasing
        for d in drivers:
            phases = d.report.phases
            assert {Milestone.RELEASED, Milestone.DUMPED} <= phases.keys(), phases
            # gated from the first quiesce to the last resume, the Resumed barrier after it not counted
            # Released: this node's own part; its barrier was met during the dump
            before = sum(phases[m] for m in (Milestone.DRAINED, Milestone.DUMPED, Milestone.REBUILT))
            before += d.report.local[Milestone.RELEASED]
            # (the phases do not quite tile it: a little runs between two of them)
            assert before - 0.001 <= phases[GATED] <= before + phases[Milestone.RESUMED] + 0.05, phases
    else:
        assert released == 6, seen
        assert all(GATED not in d.report.phases for d in drivers)


class HangingRelease(SlowRelease):
    """A rank whose release never answers in time (a control thread stuck in the driver)."""

    release_s = 5.0


async def test_a_release_that_times_out_says_where_each_control_thread_waits(
    coordinator: ThreadedCoordinator, tmp_path: Path, named_sleeper: tuple[int, int]
) -> None:
    pid, control_tid = named_sleeper
    shims, ranks = fake_ranks(tmp_path, pid, FakeShim)
    shims[0].sock.close()
    shims[0] = HangingRelease(tmp_path / "r0-hanging.ctl", shims[1].everyone)
    ranks = [LocalRank(r.rank, pid, s.path) for r, s in zip(ranks, shims, strict=True)]
    bounds = PhaseSeconds(release_seconds=1, rebuild_seconds=20)
    driver = await connected_driver(coordinator, ranks, bounds, boost_nice=None)
    failed = await failed_checkpoint(driver, Mode.STOP, tmp_path / "images")
    message = str(failed.value)
    assert "Released did not finish within 1s" in message, message
    assert f"job/rank-0/main/0 pid {pid}: ibk-control/{control_tid} S in " in message, message
    assert driver.report.outcome == "Aborted"


async def test_an_armed_failpoint_holds_one_rank_between_its_quiesce_and_drain_once(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = fake_ranks(tmp_path, sleeper, FakeShim)
    armed = tmp_path / "failpoints"
    failpoints.enable(armed)
    (armed / "after-quiesce").write_text("1.5\n")
    driver = await connected_driver(coordinator, ranks)
    try:
        await failed_checkpoint(driver, Mode.STOP, unwritable_images(tmp_path, ranks), "not empty")
    finally:
        failpoints.disable()
    assert not (armed / "after-quiesce").exists(), "the arming was not taken"
    assert driver.report.local[Milestone.DRAINED] >= 1.5, driver.report.local
    for s in shims:  # the held rank went on to drain and release like the others
        assert [line.split()[0] for line in s.lines[1:4]] == ["quiesce", "drain", "release"], s.lines


def test_failpoints_are_ignored_when_off_and_refuse_a_bad_arming(tmp_path: Path) -> None:
    armed = tmp_path / "failpoints"
    armed.mkdir()
    (armed / "after-quiesce").write_text("5")
    started = time.monotonic()
    asyncio.run(failpoints.reached("after-quiesce"))  # off: the file is not even read
    assert (armed / "after-quiesce").exists() and time.monotonic() - started < 1
    failpoints.enable(armed)
    try:
        (armed / "after-quiesce").write_text("soon")
        asyncio.run(failpoints.reached("after-quiesce"))  # not a number: taken, no hold
        assert not (armed / "after-quiesce").exists() and time.monotonic() - started < 1
    finally:
        failpoints.disable()
