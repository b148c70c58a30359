"""The node driver against fake shims on the host: many ranks per node, and the abort path.

Each fake shim serves the control protocol on a unix socket. Its `rebuild` blocks until every
rank of the node has been told to rebuild, as a real one does when its peers are on the same
node (it waits for their records). So these tests fail if the driver runs a phase on fewer
ranks at a time than the node has, which is what a small default thread pool does.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from node.fake_shim import FakeShimSocket

from ibckpt.agentapi import Milestone, Mode, PhaseTimeouts
from ibckpt.coordination.client import CoordinatorClient
from ibckpt.coordination.ranks import RankId
from ibckpt_node import criu, failpoints
from ibckpt_node.driver import CutOptions, NodeDriver, NodeSettings
from ibckpt_node.errors import CheckpointFailed, CheckpointRefused
from ibckpt_node.procfs import node_addresses, process_gone, process_tree
from ibckpt_node.ranks import LocalRank
from ibckpt_node.trees import TREE_MANIFEST, ProcessTree, read_tree_manifest
from testbed.coordinator import ThreadedCoordinator

RANKS = 12  # more than asyncio's default pool on a 2-core node (cpus + 4)


class FakeShim(FakeShimSocket):
    """Every rank's rebuild waits for all the others', as real QP reconnection does."""

    def __init__(self, path: Path, everyone: threading.Barrier) -> None:
        super().__init__(path)
        self.everyone = everyone

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "abort" and self.state == "released":
            return False, {"phase": "abort", "ok": False, "state": "released"}
        if verb == "rebuild":
            try:
                self.everyone.wait(timeout=5)
            except threading.BrokenBarrierError:
                return False, {"phase": "rebuild", "ok": False, "error": "peers never rebuilt"}
        return super().answer(verb)


S = TypeVar("S", bound=FakeShim)


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A real process with no device fds, standing in for every rank's pid."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _first_rank_served_by(shims: list[FakeShim], ranks: list[LocalRank], shim: FakeShim, pid: int) -> None:
    """Rank 0 answered by `shim` (a variant that fails its own way) as process `pid`."""
    shims[0].sock.close()
    shims[0] = shim
    ranks[0] = LocalRank(ranks[0].rank, pid, shim.path)


def _setup(tmp_path: Path, pid: int, kind: type[S]) -> tuple[list[S], list[LocalRank]]:
    everyone = threading.Barrier(RANKS)
    shims = [kind(tmp_path / f"r{i}.ctl", everyone) for i in range(RANKS)]
    ranks = [LocalRank(RankId.parse(f"job/rank-{i}/main/0"), pid, s.path) for i, s in enumerate(shims)]
    return shims, ranks


async def _driver(coordinator: ThreadedCoordinator, ranks: list[LocalRank]) -> NodeDriver:
    session, token = coordinator.create_session({"node-1"})
    client = await CoordinatorClient.connect("127.0.0.1", coordinator.port, session, "node-1", token)
    return NodeDriver("node-1", client, ranks, PhaseTimeouts(rebuild_seconds=20))


async def test_restore_rebuilds_every_held_rank_at_once(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = _setup(tmp_path, sleeper, FakeShim)
    for s in shims:
        s.state = "released"
    driver = await _driver(coordinator, [])
    try:
        report = await asyncio.wait_for(driver.restore({}, {}, epoch=2, rejoin=ranks), 30)
    finally:
        await driver.client.close()
    assert report.outcome == "Succeeded"
    assert all(s.commands == ["status", "rebuild", "resume"] for s in shims), [s.commands for s in shims]
    assert all(reply["ok"] for reply in report.shim["rebuild"].values())


async def test_failed_dump_aborts_and_rebuilds_every_released_rank(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = _setup(tmp_path, sleeper, FakeShim)
    images = tmp_path / "images"
    # An image dir that is not empty makes the dump fail before CRIU touches any process.
    (images / ranks[0].rank.key().replace("/", "_")).mkdir(parents=True)
    (images / ranks[0].rank.key().replace("/", "_") / "stale").write_text("x")
    driver = await _driver(coordinator, ranks)
    try:
        with pytest.raises(CheckpointFailed, match="not empty"):
            await asyncio.wait_for(driver.checkpoint(Mode.LEAVE_RUNNING, images, epoch=2), 30)
    finally:
        await driver.client.close()
    assert driver.report.outcome == "Aborted"
    for s in shims:
        # status: preflight. Released when the dump failed: abort is refused, so the driver
        # rebuilt and resumed it.
        expected = ["status", "quiesce", "drain", "release", "abort", "rebuild", "resume"]
        assert s.commands == expected, s.commands
        assert s.state == "running"


class SlowRelease(FakeShim):
    """A rank whose release takes a while, as a big one does: the renewals must go on meanwhile."""

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "release":
            threading.Event().wait(0.6)
        return super().answer(verb)


async def test_leases_are_renewed_while_the_ranks_are_held_and_stop_after(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = _setup(tmp_path, sleeper, SlowRelease)
    session, token = coordinator.create_session({"node-1"})
    client = await CoordinatorClient.connect("127.0.0.1", coordinator.port, session, "node-1", token)
    leases = NodeSettings(lease_s=2.0, lease_renew_s=0.1)
    driver = NodeDriver("node-1", client, ranks, PhaseTimeouts(rebuild_seconds=20), leases)
    try:
        with pytest.raises(CheckpointFailed, match="not empty"):
            await asyncio.wait_for(driver.checkpoint(Mode.STOP, _unwritable_images(tmp_path, ranks), 2), 30)
        assert driver.report.outcome == "Aborted"
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
        await client.close()


async def test_no_lease_renewal_reaches_a_rank_while_criu_dumps_it(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal's socket open in a rank at CRIU's freeze failed the dump ("Unix socket not found": the
    accepted end belongs to the agent's network namespace); the ranks not being dumped keep theirs."""
    shims, ranks = _setup(tmp_path, sleeper, FakeShim)
    by_dir = {r.rank.key().replace("/", "_"): i for i, r in enumerate(ranks)}
    during: dict[int, list[int]] = {}

    def slow_dump(pid: int, images: Path, options: object, timeout: float) -> None:
        before = [len(s.leases) for s in shims]
        time.sleep(0.5)
        during[by_dir[images.name]] = [len(s.leases) - n for s, n in zip(shims, before, strict=True)]
        images.mkdir(parents=True)

    monkeypatch.setattr(criu, "dump", slow_dump)
    session, token = coordinator.create_session({"node-1"})
    client = await CoordinatorClient.connect("127.0.0.1", coordinator.port, session, "node-1", token)
    leases = NodeSettings(lease_s=2.0, lease_renew_s=0.05)
    driver = NodeDriver("node-1", client, ranks, PhaseTimeouts(rebuild_seconds=20), leases)
    try:
        report = await asyncio.wait_for(driver.checkpoint(Mode.LEAVE_RUNNING, tmp_path / "images", 2), 60)
    finally:
        await client.close()
    assert report.outcome == "Succeeded"
    assert sorted(during) == list(range(RANKS))
    for dumped, renewed in during.items():
        assert renewed[dumped] == 0, during  # none while its own dump ran
        others = [n for i, n in enumerate(renewed) if i != dumped]
        assert all(n >= 1 for n in others), during  # the other held ranks kept their leases


class FailingQuiesce(FakeShim):
    """A rank whose quiesce times out (an app thread never leaves verbs)."""

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "quiesce":
            return False, {"phase": "quiesce", "ok": False, "error": "threads still inside verbs"}
        return super().answer(verb)


def _unwritable_images(tmp_path: Path, ranks: list[LocalRank]) -> Path:
    """An image dir that makes the dump fail before CRIU touches a process: the cut is what these
    tests look at."""
    images = tmp_path / "images"
    (images / ranks[0].rank.key().replace("/", "_")).mkdir(parents=True)
    (images / ranks[0].rank.key().replace("/", "_") / "stale").write_text("x")
    return images


async def test_the_fast_cut_drains_each_rank_right_after_its_quiesce(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = _setup(tmp_path, sleeper, FakeShim)
    driver = await _driver(coordinator, ranks)
    try:
        with pytest.raises(CheckpointFailed, match="not empty"):
            await asyncio.wait_for(driver.checkpoint(Mode.STOP, _unwritable_images(tmp_path, ranks), 2), 30)
    finally:
        await driver.client.close()
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
    shims, ranks = _setup(tmp_path, sleeper, FakeShim)
    session, token = coordinator.create_session({"node-1"})
    client = await CoordinatorClient.connect("127.0.0.1", coordinator.port, session, "node-1", token)
    cut = CutOptions(quiesce_barrier=True, release_quiet=True)
    driver = NodeDriver("node-1", client, ranks, settings=NodeSettings(drain_stall_ms=100), cut=cut)
    try:
        with pytest.raises(CheckpointFailed, match="not empty"):
            await asyncio.wait_for(driver.checkpoint(Mode.STOP, _unwritable_images(tmp_path, ranks), 2), 30)
    finally:
        await client.close()
    report = driver.report
    assert {Milestone.QUIESCED, Milestone.DRAINED, Milestone.RELEASED} <= report.phases.keys(), report.phases
    for s in shims:
        assert s.lines[2].split()[2] == "100" and s.lines[3].endswith(" quiet"), s.lines


async def test_a_failed_quiesce_in_the_fast_cut_brings_every_rank_back(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = _setup(tmp_path, sleeper, FakeShim)
    shims[0].sock.close()
    everyone = shims[1].everyone
    shims[0] = FailingQuiesce(tmp_path / "r0-failing.ctl", everyone)
    ranks[0] = LocalRank(ranks[0].rank, sleeper, shims[0].path)
    driver = await _driver(coordinator, ranks)
    try:
        with pytest.raises(CheckpointFailed, match="threads still inside verbs"):
            await asyncio.wait_for(driver.checkpoint(Mode.STOP, tmp_path / "images", epoch=2), 30)
    finally:
        await driver.client.close()
    assert driver.report.outcome == "Aborted"
    assert shims[0].commands == ["status", "quiesce", "abort"], shims[0].commands
    for s in shims[1:]:
        # the others quiesced (and maybe drained) on their own; none was released, all resumed
        assert "release" not in s.commands and s.commands[-1] == "abort", s.commands
        assert s.state == "running"


class DiesAtQuiesce(FakeShim):
    """A rank whose process dies as it is told to quiesce: its connection closes with no answer."""

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "quiesce":
            self.sock.close()
            raise ConnectionAbortedError("the rank's process died")
        return super().answer(verb)


async def test_a_rank_that_dies_mid_cut_is_named_and_every_other_rank_comes_back(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = _setup(tmp_path, sleeper, FakeShim)
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid no longer exists, as a killed rank's
    _first_rank_served_by(shims, ranks, DiesAtQuiesce(tmp_path / "r0-dies.ctl", shims[1].everyone), gone.pid)
    driver = await _driver(coordinator, ranks)
    try:
        with pytest.raises(CheckpointFailed, match=r"quiesce of job/rank-0/main/0 .*its process is gone"):
            await asyncio.wait_for(driver.checkpoint(Mode.LEAVE_RUNNING, tmp_path / "images", epoch=2), 30)
    finally:
        await driver.client.close()
    assert driver.report.outcome == "Aborted"
    for s in shims[1:]:
        assert "release" not in s.commands and s.commands[-1] == "abort", s.commands
        assert s.state == "running"


class KilledAtRelease(FakeShim):
    """A rank whose process is killed right after its release answered."""

    victim: subprocess.Popen[bytes] | None = None

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        said = super().answer(verb)
        if verb == "release" and self.victim is not None:
            self.victim.kill()
            self.victim.wait()
        return said


async def test_a_rank_killed_after_its_release_is_named_and_every_other_rank_comes_back(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = _setup(tmp_path, sleeper, FakeShim)
    dies = KilledAtRelease(tmp_path / "r0-dies.ctl", shims[1].everyone)
    dies.victim = subprocess.Popen(["sleep", "60"])
    _first_rank_served_by(shims, ranks, dies, dies.victim.pid)
    driver = await _driver(coordinator, ranks)
    try:
        with pytest.raises(CheckpointFailed, match=r"job/rank-0/main/0 \(pid [0-9]+\): its process is gone"):
            await asyncio.wait_for(driver.checkpoint(Mode.LEAVE_RUNNING, tmp_path / "images", epoch=2), 30)
    finally:
        await driver.client.close()
    assert driver.report.outcome == "Aborted"
    for s in shims[1:]:  # released when their peer died: rebuilt and resumed
        assert s.commands[-2:] == ["rebuild", "resume"] and s.state == "running", s.commands


def test_a_zombie_counts_as_gone_and_a_sleeping_process_does_not(sleeper: int) -> None:
    """A killed rank resets its control connection while it exits; the message must still say it is gone
    when its parent has not reaped it yet."""
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while not process_gone(zombie.pid):  # exited, not yet reaped: a zombie
        assert time.monotonic() < deadline, Path(f"/proc/{zombie.pid}/stat").read_text()
        time.sleep(0.01)
    assert Path(f"/proc/{zombie.pid}").exists()
    zombie.wait()
    assert process_gone(zombie.pid) and not process_gone(sleeper)


class HangingRelease(FakeShim):
    """A rank whose release never answers in time (a control thread stuck in the driver)."""

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "release":
            threading.Event().wait(5)
        return super().answer(verb)


async def test_a_release_that_times_out_says_where_each_control_thread_waits(
    coordinator: ThreadedCoordinator, tmp_path: Path, named_sleeper: tuple[int, int]
) -> None:
    pid, control_tid = named_sleeper
    shims, ranks = _setup(tmp_path, pid, FakeShim)
    shims[0].sock.close()
    shims[0] = HangingRelease(tmp_path / "r0-hanging.ctl", shims[1].everyone)
    ranks = [LocalRank(r.rank, pid, s.path) for r, s in zip(ranks, shims, strict=True)]
    session, token = coordinator.create_session({"node-1"})
    client = await CoordinatorClient.connect("127.0.0.1", coordinator.port, session, "node-1", token)
    bounds = PhaseTimeouts(release_seconds=1, rebuild_seconds=20)
    driver = NodeDriver("node-1", client, ranks, bounds, boost_nice=None)
    try:
        with pytest.raises(CheckpointFailed) as failed:
            await asyncio.wait_for(driver.checkpoint(Mode.STOP, tmp_path / "images", epoch=2), 30)
    finally:
        await client.close()
    message = str(failed.value)
    assert "Released did not finish within 1s" in message, message
    assert f"job/rank-0/main/0 pid {pid}: ibk-control/{control_tid} S in " in message, message
    assert driver.report.outcome == "Aborted"


@pytest.fixture
def launcher() -> Iterator[tuple[int, int]]:
    """A real process tree, launcher -> shell -> rank: (root pid, rank pid)."""
    proc = subprocess.Popen(
        ["sh", "-c", "sh -c 'sleep 60 & echo $!; wait'; :"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    rank_pid = int(proc.stdout.readline())
    yield proc.pid, rank_pid
    subprocess.run(["pkill", "-P", str(proc.pid)], check=False)
    proc.kill()
    proc.wait()


def test_a_process_tree_holds_its_grandchildren(launcher: tuple[int, int]) -> None:
    root, rank = launcher
    assert {root, rank} <= set(process_tree(root))
    assert root not in process_tree(rank)


async def test_a_rank_outside_every_process_tree_is_refused_before_it_is_touched(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int, launcher: tuple[int, int]
) -> None:
    root, rank_pid = launcher
    inside = FakeShimSocket(tmp_path / "in.ctl")
    outside = FakeShimSocket(tmp_path / "out.ctl")
    ranks = [
        LocalRank(RankId.parse("job/rank-0/main/0"), rank_pid, inside.path),
        LocalRank(RankId.parse("job/rank-1/main/0"), sleeper, outside.path),
    ]
    session, token = coordinator.create_session({"node-1"})
    client = await CoordinatorClient.connect("127.0.0.1", coordinator.port, session, "node-1", token)
    driver = NodeDriver("node-1", client, ranks, trees=[ProcessTree("launcher", root)])
    try:
        with pytest.raises(CheckpointRefused, match=rf"job/rank-1/main/0 \(pid {sleeper}\) is in none"):
            await asyncio.wait_for(driver.checkpoint(Mode.STOP, tmp_path / "images", epoch=2), 30)
    finally:
        await client.close()
    assert driver.report.outcome == "Refused"
    assert inside.commands == ["status"] and outside.commands == ["status"]
    assert not (tmp_path / "images").exists()


def test_a_restore_refuses_an_image_dir_without_a_tree_manifest(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFailed, match="not a dumped process tree"):
        read_tree_manifest(tmp_path)
    (tmp_path / TREE_MANIFEST).write_text(
        '{"root_pid": 7, "ranks": [{"key": "a/b/c/d", "pid": 8, "control": "/x"}]}'
    )
    assert read_tree_manifest(tmp_path) == (7, [(RankId.parse("a/b/c/d"), 8, Path("/x"))])


async def test_a_process_trees_own_connection_outside_the_job_is_refused(
    coordinator: ThreadedCoordinator, tmp_path: Path
) -> None:
    # The launcher (not the rank) holds a TCP connection to an address that is not the job's.
    own = sorted(str(a) for a in node_addresses() if a.version == 4)
    assert own, "the host needs a non-loopback IPv4 address for this test"
    listener = socket.create_server((own[0], 0))
    port = listener.getsockname()[1]
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import socket, subprocess, sys, time\n"
         f"s = socket.create_connection(({own[0]!r}, {port}))\n"
         "child = subprocess.Popen(['sleep', '60'])\n"
         "print(child.pid, flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert launcher.stdout is not None
    try:
        rank_pid = int(launcher.stdout.readline())
        shim = FakeShimSocket(tmp_path / "r.ctl")
        rank = LocalRank(RankId.parse("job/rank-0/main/0"), rank_pid, shim.path)
        session, token = coordinator.create_session({"node-1"})
        client = await CoordinatorClient.connect("127.0.0.1", coordinator.port, session, "node-1", token)
        tree = ProcessTree("launcher", launcher.pid)
        driver = NodeDriver("node-1", client, [rank], job_addrs=["10.77.0.1"], trees=[tree])
        try:
            refused = rf"process tree launcher \(pid {launcher.pid}\).*{own[0]}:{port}.*leads outside the job"
            with pytest.raises(CheckpointRefused, match=refused):
                await asyncio.wait_for(driver.checkpoint(Mode.STOP, tmp_path / "images", epoch=2), 30)
        finally:
            await client.close()
        assert shim.commands == ["status"]
    finally:
        subprocess.run(["pkill", "-P", str(launcher.pid)], check=False)
        launcher.kill()
        launcher.wait()
        listener.close()


class LostDuringRelease(FakeShim):
    """The operator restarts while the ranks release: the agent is told the coordinator is gone."""

    client: CoordinatorClient | None = None

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "release" and self.client is not None:
            self.client.lose("the operator restarted")  # what the agent's abort with a rejoin does
        return super().answer(verb)


async def test_released_ranks_rejoin_the_next_operators_coordinator_to_rebuild(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = _setup(tmp_path, sleeper, LostDuringRelease)
    session, token = coordinator.create_session({"node-1"})
    first = await CoordinatorClient.connect("127.0.0.1", coordinator.port, session, "node-1", token)
    shims[0].client = first
    rejoined: list[CoordinatorClient] = []

    async def rejoin() -> CoordinatorClient | None:
        # the next operator opens a session of the same id in its own coordinator
        again, new_token = coordinator.create_session({"node-1"}, session_id=session)
        client = await CoordinatorClient.connect("127.0.0.1", coordinator.port, again, "node-1", new_token)
        rejoined.append(client)
        return client

    driver = NodeDriver("node-1", first, ranks, PhaseTimeouts(rebuild_seconds=20), rejoin=rejoin)
    try:
        with pytest.raises(CheckpointFailed, match=r"operator restarted|lost the coordinator"):
            await asyncio.wait_for(driver.checkpoint(Mode.LEAVE_RUNNING, tmp_path / "images", 2), 30)
    finally:
        await first.close()
        for client in rejoined:
            await client.close()
    assert driver.report.outcome == "Aborted"
    assert len(rejoined) == 1 and driver.client is rejoined[0]
    for s in shims:
        assert s.commands[-3:] == ["abort", "rebuild", "resume"], s.commands
        assert s.state == "running"


async def test_without_a_rejoin_released_ranks_are_left_for_a_rebuild_and_the_driver_ends(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = _setup(tmp_path, sleeper, LostDuringRelease)
    session, token = coordinator.create_session({"node-1"})
    client = await CoordinatorClient.connect("127.0.0.1", coordinator.port, session, "node-1", token)
    shims[0].client = client
    driver = NodeDriver("node-1", client, ranks, PhaseTimeouts(rebuild_seconds=20))
    try:
        with pytest.raises(CheckpointFailed):
            await asyncio.wait_for(driver.checkpoint(Mode.LEAVE_RUNNING, tmp_path / "images", 2), 30)
    finally:
        await client.close()
    assert all(s.commands[-1] == "abort" and s.state == "released" for s in shims), [
        s.commands[-2:] for s in shims
    ]


async def test_an_armed_failpoint_holds_one_rank_between_its_quiesce_and_drain_once(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = _setup(tmp_path, sleeper, FakeShim)
    armed = tmp_path / "failpoints"
    failpoints.enable(armed)
    (armed / "after-quiesce").write_text("1.5\n")
    driver = await _driver(coordinator, ranks)
    try:
        with pytest.raises(CheckpointFailed, match="not empty"):
            await asyncio.wait_for(driver.checkpoint(Mode.STOP, _unwritable_images(tmp_path, ranks), 2), 30)
    finally:
        failpoints.disable()
        await driver.client.close()
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
