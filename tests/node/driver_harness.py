"""The node driver against fake shims on the host: many ranks per node, their shims and the driver.

Each fake shim serves the control protocol on a unix socket. Its `rebuild` blocks until every
rank of the node has been told to rebuild, as a real one does when its peers are on the same
node (it waits for their records). So the tests fail if the driver runs a phase on fewer
ranks at a time than the node has, which is what a small default thread pool does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
from node.fake_shim import FakeShimSocket

from ibckpt.coordination.client import CoordinatorClient
from ibckpt.coordination.ranks import RankId
from ibckpt.vocabulary import Mode, PhaseSeconds
from ibckpt_node.driver import NodeDriver
from ibckpt_node.errors import CheckpointFailed
from ibckpt_node.ranks import LocalRank
from testbed.coordinator import ThreadedCoordinator
from testbed.tlsfiles import shared_pki

RANKS = 12  # more than asyncio's default pool on a 2-core node (cpus + 4)
REBUILD_20S = PhaseSeconds(rebuild_seconds=20)


class FakeShim(FakeShimSocket):
    """Every rank's rebuild waits for all the others', as real QP reconnection does; like the real
    shim, it refuses abort once released and release unless drained."""

    def __init__(self, path: Path, everyone: threading.Barrier) -> None:
        super().__init__(path)
        self.everyone = everyone

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "abort" and self.state == "released":
            return False, {"phase": "abort", "ok": False, "state": "released"}
        if verb == "release" and self.state != "drained":
            return False, {"phase": "release", "ok": False, "error": "not drained", "state": self.state}
        if verb == "rebuild":
            try:
                self.everyone.wait(timeout=5)
            except threading.BrokenBarrierError:
                return False, {"phase": "rebuild", "ok": False, "error": "peers never rebuilt"}
        return super().answer(verb)


S = TypeVar("S", bound=FakeShim)


def fake_ranks(tmp_path: Path, pid: int, kind: type[S]) -> tuple[list[S], list[LocalRank]]:
    """RANKS shims of `kind` and their ranks, every one as process `pid`."""
    everyone = threading.Barrier(RANKS)
    shims = [kind(tmp_path / f"r{i}.ctl", everyone) for i in range(RANKS)]
    ranks = [LocalRank(RankId.parse(f"job/rank-{i}/main/0"), pid, s.path) for i, s in enumerate(shims)]
    return shims, ranks


def first_rank_served_by(shims: list[FakeShim], ranks: list[LocalRank], shim: FakeShim, pid: int) -> None:
    """Rank 0 answered by `shim` (a variant that fails its own way) as process `pid`."""
    shims[0].sock.close()
    shims[0] = shim
    ranks[0] = LocalRank(ranks[0].rank, pid, shim.path)


def unwritable_images(tmp_path: Path, ranks: list[LocalRank]) -> Path:
    """An image dir that makes the dump fail before CRIU touches a process: the cut is what these
    tests look at."""
    images = tmp_path / "images"
    (images / ranks[0].rank.key().replace("/", "_")).mkdir(parents=True)
    (images / ranks[0].rank.key().replace("/", "_") / "stale").write_text("x")
    return images


async def connected_driver(
    coordinator: ThreadedCoordinator,
    ranks: list[LocalRank],
    timeouts: PhaseSeconds | None = REBUILD_20S,
    **options: Any,
) -> NodeDriver:
    """node-1's driver over `ranks`, connected to a new session of `coordinator` (node-1 alone)."""
    session, tokens = coordinator.create_session({"node-1"})
    token = tokens["node-1"]
    client = await CoordinatorClient.connect(
        "127.0.0.1", coordinator.port, session, "node-1", token, tls=shared_pki().client()
    )
    return NodeDriver("node-1", client, ranks, timeouts, **options)


async def session_clients(coordinator: ThreadedCoordinator, nodes: Sequence[str]) -> list[CoordinatorClient]:
    """A client for each of `nodes`, connected to one new session of `coordinator`."""
    session, tokens = coordinator.create_session(set(nodes))
    return [
        await CoordinatorClient.connect(
            "127.0.0.1", coordinator.port, session, node, tokens[node], tls=shared_pki().client()
        )
        for node in nodes
    ]


async def gather_closing(
    clients: Sequence[CoordinatorClient], *runs: Awaitable[Any], timeout: float
) -> list[Any]:
    """Each run's result, or what it raised, within `timeout`; `clients` are closed after."""
    try:
        return await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), timeout)
    finally:
        for client in clients:
            await client.close()


async def failed_checkpoint(
    driver: NodeDriver,
    mode: Mode,
    images: Path,
    match: str | None = None,
    failure: type[Exception] = CheckpointFailed,
) -> pytest.ExceptionInfo[Exception]:
    """Checkpoint (epoch 2) and expect it to fail with `failure`; the driver's connection closes after."""
    try:
        with pytest.raises(failure, match=match) as failed:
            await asyncio.wait_for(driver.checkpoint(mode, images, epoch=2), 30)
    finally:
        await driver.client.close()
    return failed


async def failed_dump(
    coordinator: ThreadedCoordinator, tmp_path: Path, pid: int, mode: Mode
) -> tuple[list[FakeShim], NodeDriver]:
    """node-1's fake ranks through a checkpoint whose dump fails (unwritable_images): the cut and the way
    back are what the caller looks at."""
    shims, ranks = fake_ranks(tmp_path, pid, FakeShim)
    driver = await connected_driver(coordinator, ranks)
    await failed_checkpoint(driver, mode, unwritable_images(tmp_path, ranks), "not empty")
    return shims, driver
