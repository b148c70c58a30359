"""A hostile rank in a restore (review N24): restored ranks come back released, the agent rebuilds and
resumes them, and rank 0 (the real control wire: fake_shim.py) answers garbage to one of those. The
restore fails naming rank 0 and its reply, the coordinator session is aborted for every node (node-2
here, waiting at the next barrier, sees the abort), and no rank is resumed after the failure: a
failed restore's pods are the operator's to delete (docs/failures.md, RestoreJob)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from node.driver_harness import REBUILD_20S, FakeShim, fake_ranks
from node.fake_shim import FakeShimSocket
from node.test_hostile_shim import garbage

from ibckpt.coordination.client import CoordinationAborted, CoordinatorClient
from ibckpt.coordination.ranks import RankId
from ibckpt.vocabulary import Milestone
from ibckpt_node.driver import LOCKED, NodeDriver
from ibckpt_node.errors import CheckpointFailed
from ibckpt_node.ranks import LocalRank
from testbed.coordinator import ThreadedCoordinator
from testbed.tlsfiles import shared_pki

CASES = [
    pytest.param(phase, line, id=f"{phase}-{kind}")
    for phase in ("rebuild", "resume")
    for kind, line in garbage(phase).items()
]
# The barriers node-2 passes before it waits at the one the garbage keeps node-1 from.
BEFORE = {"rebuild": [LOCKED, Milestone.RESTORED], "resume": [LOCKED, Milestone.RESTORED, Milestone.REBUILT]}
Restore = Callable[[NodeDriver, list[LocalRank]], Awaitable[object]]


async def restored_by_runtime(driver: NodeDriver, ranks: list[LocalRank]) -> object:
    """The agent's restore: the runtime restored the containers, the driver finds their ranks."""

    async def restored() -> list[LocalRank]:
        return ranks

    return await driver.rebuild_restored(restored, epoch=2)


async def held_ranks_rejoining(driver: NodeDriver, ranks: list[LocalRank]) -> object:
    """`ibckpt-node restore`: ranks a Hold checkpoint left released rejoin (nothing for CRIU)."""
    return await driver.restore({}, {}, epoch=2, rejoin=ranks)


async def client_of(
    coordinator: ThreadedCoordinator, session: str, tokens: dict[str, str], node: str
) -> CoordinatorClient:
    port, tls = coordinator.port, shared_pki().client()
    return await CoordinatorClient.connect("127.0.0.1", port, session, node, tokens[node], tls=tls)


async def hostile_restore(
    coordinator: ThreadedCoordinator, ranks: list[LocalRank], restore: Restore, before: list[str]
) -> tuple[NodeDriver, str, pytest.ExceptionInfo[CheckpointFailed], BaseException]:
    """node-1 restores `ranks`, which fails; node-2 passes `before`, then waits at the next barrier.
    (node-1's driver, the session, node-1's failure, what node-2's wait raised.)"""
    session, tokens = coordinator.create_session({"node-1", "node-2"})
    node1, node2 = [await client_of(coordinator, session, tokens, node) for node in ("node-1", "node-2")]
    driver = NodeDriver("node-1", node1, [], REBUILD_20S)

    async def other_node() -> BaseException:
        for name in before:
            await node2.barrier(name, timeout=20)
        with pytest.raises(CoordinationAborted) as aborted:
            await node2.barrier("the next one", timeout=20)
        return aborted.value

    try:
        waiting = asyncio.ensure_future(other_node())
        with pytest.raises(CheckpointFailed) as failed:
            await asyncio.wait_for(restore(driver, ranks), 30)
        seen = await asyncio.wait_for(waiting, 10)
    finally:
        await node1.close()
        await node2.close()
    return driver, session, failed, seen


def released(tmp_path: Path, pid: int) -> tuple[list[FakeShim], list[LocalRank]]:
    shims, ranks = fake_ranks(tmp_path, pid, FakeShim)
    for s in shims:
        s.state = "released"  # as a restore brings every rank back
    return shims, ranks


@pytest.mark.parametrize("phase,line", CASES)
async def test_a_rank_answering_garbage_in_a_restore_aborts_it_for_every_node(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int, phase: str, line: str
) -> None:
    shims, ranks = released(tmp_path, sleeper)
    shims[0].raw_replies[phase] = line
    driver, session, failed, seen = await hostile_restore(
        coordinator, ranks, restored_by_runtime, BEFORE[phase]
    )
    reason = rf"{phase} of job/rank-0/main/0 \(pid {sleeper}\) failed: {phase}.*: malformed reply"
    assert failed.match(reason)
    assert driver.report.outcome == "Aborted"
    assert coordinator.server.sessions[session].abort_reason
    assert "job/rank-0/main/0" in str(seen) and "malformed reply" in str(seen)
    # What a failed restore gives the others: nothing after the phase that failed (no resume after a
    # bad rebuild, no abort that would run the application beside a peer that never came back).
    expected = ["status", "reserve", "rebuild"] + ([] if phase == "rebuild" else ["resume"])
    for s in shims:
        assert s.commands == expected, s.commands
    for s in shims[1:]:
        assert s.state == ("rebuilt" if phase == "rebuild" else "running")


@pytest.mark.parametrize("phase", ["rebuild", "resume"])
async def test_a_held_rank_answering_garbage_as_it_rejoins_aborts_the_restore(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int, phase: str
) -> None:
    shims, ranks = released(tmp_path, sleeper)
    shims[0].raw_replies[phase] = garbage(phase)["cut-json"]
    driver, session, failed, _ = await hostile_restore(
        coordinator, ranks, held_ranks_rejoining, BEFORE[phase]
    )
    assert failed.match(rf"{phase} of job/rank-0/main/0 \(pid {sleeper}\) failed: .*malformed reply")
    assert driver.report.outcome == "Aborted"
    assert coordinator.server.sessions[session].abort_reason
    expected = ["status", "status", "reserve", "rebuild"] + ([] if phase == "rebuild" else ["resume"])
    assert all(s.commands == expected for s in shims), [s.commands for s in shims]


class GarbageStatus(FakeShimSocket):
    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        return (True, {"state": "dumped"}) if verb == "status" else super().answer(verb)


async def test_a_held_rank_whose_status_is_garbage_aborts_before_any_rank_is_rebuilt(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    hostile = GarbageStatus(tmp_path / "hostile.ctl")
    shims, ranks = released(tmp_path, sleeper)
    ranks = [LocalRank(ranks[0].rank, sleeper, hostile.path), *ranks[1:]]
    driver, session, failed, _ = await hostile_restore(coordinator, ranks, held_ranks_rejoining, [])
    assert failed.match(rf"status of job/rank-0/main/0 \(pid {sleeper}\) failed: .*state 'dumped'")
    assert "state 'dumped'" in (coordinator.server.sessions[session].abort_reason or "")
    assert driver.report.outcome == "Aborted"
    assert hostile.commands == ["status"]
    assert all(s.commands == [] for s in shims[1:]), [s.commands for s in shims]


class WaitingRebuild(FakeShimSocket):
    """node-2's rank, whose rebuild waits for records of a peer on node-1 (up to 30 s, as the real
    shim's GETs do: the coordinator answers record reads after an abort too)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.state = "released"
        self.records = threading.Event()

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "rebuild" and not self.records.wait(timeout=30):
            return False, {"phase": "rebuild", "ok": False, "state": "released", "error": "no records"}
        return super().answer(verb)


async def test_a_node_whose_ranks_wait_in_their_rebuild_ends_once_another_node_aborts(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = released(tmp_path, sleeper)
    shims[0].raw_replies["rebuild"] = garbage("rebuild")["not-an-object"]
    waiting = WaitingRebuild(tmp_path / "node-2.ctl")
    session, tokens = coordinator.create_session({"node-1", "node-2"})
    drivers = [
        NodeDriver(node, await client_of(coordinator, session, tokens, node), [], REBUILD_20S)
        for node in ("node-1", "node-2")
    ]
    node2_rank = [LocalRank(RankId.parse("job/rank-12/main/0"), sleeper, waiting.path)]
    started = time.monotonic()
    try:
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                restored_by_runtime(drivers[0], ranks),
                restored_by_runtime(drivers[1], node2_rank),
                return_exceptions=True,
            ),
            25,
        )
    finally:
        waiting.records.set()
        for driver in drivers:
            await driver.client.close()
    assert isinstance(outcomes[0], CheckpointFailed), outcomes
    assert isinstance(outcomes[1], CoordinationAborted), outcomes
    assert "rebuild of job/rank-0/main/0" in str(outcomes[1])
    assert time.monotonic() - started < 10  # not node-2's rebuild bound (20 s) nor its shim's wait
    assert drivers[1].report.outcome == "Aborted"
    assert waiting.commands == [
        "status",
        "reserve",
        "rebuild",
    ]  # told nothing after: its pod is the operator's to delete
