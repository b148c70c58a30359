"""The node driver's way back against fake shims on the host (driver_harness.py): a failed cut or
dump brings every rank back, a rank that dies is named, held ranks are restored, and released
ranks rejoin the coordinator that replaces a lost one.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest
from node.driver_harness import (
    FakeShim,
    connected_driver,
    failed_checkpoint,
    failed_dump,
    fake_ranks,
    first_rank_served_by,
    gather_closing,
    session_clients,
)

from ibckpt.agentapi import Mode, PhaseTimeouts
from ibckpt.coordination.client import CoordinatorClient
from ibckpt.vocabulary import PhaseSeconds
from ibckpt_node.driver import NodeDriver
from ibckpt_node.errors import CheckpointFailed
from ibckpt_node.procfs import process_gone
from ibckpt_node.ranks import LocalRank
from testbed.coordinator import ThreadedCoordinator
from testbed.tlsfiles import shared_pki

# a rank's commands when the abort releases it a second time (it says it already is), reserves its
# siblings' QPNs (status, reserve) and rebuilds it
RELEASED_TWICE_THEN_REBUILT = [
    "status",
    "quiesce",
    "drain",
    "release",
    "release",
    "status",
    "reserve",
    "rebuild",
    "resume",
]


async def test_restore_rebuilds_every_held_rank_at_once(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = fake_ranks(tmp_path, sleeper, FakeShim)
    for s in shims:
        s.state = "released"
    driver = await connected_driver(coordinator, [])
    try:
        report = await asyncio.wait_for(driver.restore({}, {}, epoch=2, rejoin=ranks), 30)
    finally:
        await driver.client.close()
    assert report.outcome == "Succeeded"
    assert all(s.commands == ["status", "status", "reserve", "rebuild", "resume"] for s in shims), [
        s.commands for s in shims
    ]
    assert all(reply["ok"] for reply in report.shim["rebuild"].values())


async def test_failed_dump_aborts_and_rebuilds_every_released_rank(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, driver = await failed_dump(coordinator, tmp_path, sleeper, Mode.LEAVE_RUNNING)
    assert driver.report.outcome == "Aborted"
    for s in shims:
        # status: preflight. Released when the dump failed; every node had drained, so the abort
        # releases each rank (this one says it already is) and rebuilds and resumes it.
        assert s.commands == RELEASED_TWICE_THEN_REBUILT, s.commands
        assert s.state == "running"


class FailingQuiesce(FakeShim):
    """A rank whose quiesce times out (an app thread never leaves verbs)."""

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "quiesce":
            return False, {"phase": "quiesce", "ok": False, "error": "threads still inside verbs"}
        return super().answer(verb)


async def test_a_failed_quiesce_in_the_fast_cut_brings_every_rank_back(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = fake_ranks(tmp_path, sleeper, FakeShim)
    failing = FailingQuiesce(tmp_path / "r0-failing.ctl", shims[1].everyone)
    first_rank_served_by(shims, ranks, failing, sleeper)
    driver = await connected_driver(coordinator, ranks)
    await failed_checkpoint(driver, Mode.STOP, tmp_path / "images", "threads still inside verbs")
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
    shims, ranks = fake_ranks(tmp_path, sleeper, FakeShim)
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid no longer exists, as a killed rank's
    first_rank_served_by(shims, ranks, DiesAtQuiesce(tmp_path / "r0-dies.ctl", shims[1].everyone), gone.pid)
    driver = await connected_driver(coordinator, ranks)
    dead = r"quiesce of job/rank-0/main/0 .*its process is gone"
    await failed_checkpoint(driver, Mode.LEAVE_RUNNING, tmp_path / "images", dead)
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
    shims, ranks = fake_ranks(tmp_path, sleeper, FakeShim)
    dies = KilledAtRelease(tmp_path / "r0-dies.ctl", shims[1].everyone)
    dies.victim = subprocess.Popen(["sleep", "60"])
    first_rank_served_by(shims, ranks, dies, dies.victim.pid)
    driver = await connected_driver(coordinator, ranks)
    dead = r"job/rank-0/main/0 \(pid [0-9]+\): its process is gone"
    await failed_checkpoint(driver, Mode.LEAVE_RUNNING, tmp_path / "images", dead)
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
    shims, ranks = fake_ranks(tmp_path, sleeper, LostDuringRelease)
    session, tokens = coordinator.create_session({"node-1"})
    token = tokens["node-1"]
    first = await CoordinatorClient.connect(
        "127.0.0.1", coordinator.port, session, "node-1", token, tls=shared_pki().client()
    )
    shims[0].client = first
    rejoined: list[CoordinatorClient] = []

    async def rejoin() -> CoordinatorClient | None:
        # the next operator opens a session of the same id in its own coordinator
        again, new_tokens = coordinator.create_session({"node-1"}, session_id=session)
        new_token = new_tokens["node-1"]
        client = await CoordinatorClient.connect(
            "127.0.0.1", coordinator.port, again, "node-1", new_token, tls=shared_pki().client()
        )
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
        assert s.commands[-5:] == ["release", "status", "reserve", "rebuild", "resume"], s.commands
        assert s.state == "running"


async def test_without_a_rejoin_released_ranks_are_left_for_a_rebuild_and_the_driver_ends(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shims, ranks = fake_ranks(tmp_path, sleeper, LostDuringRelease)
    driver = await connected_driver(coordinator, ranks)
    shims[0].client = driver.client
    await failed_checkpoint(driver, Mode.LEAVE_RUNNING, tmp_path / "images")
    assert all(s.commands[-1] == "release" and s.state == "released" for s in shims), [
        s.commands[-2:] for s in shims
    ]


@pytest.mark.parametrize(
    "garbage",
    ['ok {"phase": "drain", "ok": tr', "ok [1, 2]", 'maybe {"ok": true}', "ok \u00ff"],
    ids=["cut-json", "not-an-object", "unknown-status", "not-json"],
)
async def test_a_malformed_shim_reply_mid_cut_aborts_and_every_rank_comes_back(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int, garbage: str
) -> None:
    """The shim runs in the tenant's process: a drain answered with garbage is a failure like any other,
    and every rank, that one included, is brought back (review N24)."""
    shims, ranks = fake_ranks(tmp_path, sleeper, FakeShim)
    shims[0].raw_replies["drain"] = garbage
    driver = await connected_driver(coordinator, ranks)
    await failed_checkpoint(
        driver, Mode.LEAVE_RUNNING, tmp_path / "images", r"drain of job/rank-0/main/0 .*malformed reply"
    )
    assert driver.report.outcome == "Aborted"
    for s in shims:
        assert "release" not in s.commands and s.commands[-1] == "abort", s.commands
        assert s.state == "running"


class ReleaseFailsOnce(FakeShim):
    """A rank whose first release gives up before it touched the device (a slow node's flush)."""

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "release" and self.commands.count("release") == 1:
            return False, {"phase": "release", "ok": False, "error": "flush gave up", "state": "drained"}
        return super().answer(verb)


async def test_a_release_that_fails_on_one_node_after_others_released_rebuilds_every_rank(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    """Two nodes past the DRAINED barrier; node-1 releases all its ranks, one of node-2's fails its
    release. The abort must not resume node-2's drained ranks on their old QPs: node-1's released peers
    would wait for their records forever. Every rank is released and all rebuild together (the fake
    rebuild waits for all twelve ranks, as QP reconnection waits for the peers)."""
    shims, ranks = fake_ranks(tmp_path, sleeper, FakeShim)
    shims[6].sock.close()
    shims[6] = ReleaseFailsOnce(tmp_path / "r6-failing.ctl", shims[0].everyone)
    ranks[6] = LocalRank(ranks[6].rank, sleeper, shims[6].path)
    clients = await session_clients(coordinator, ("node-1", "node-2"))
    drivers = [
        NodeDriver(node, client, mine, PhaseSeconds(rebuild_seconds=20))
        for node, client, mine in zip(("node-1", "node-2"), clients, (ranks[:6], ranks[6:]), strict=True)
    ]
    outcomes = await gather_closing(
        clients, *(d.checkpoint(Mode.LEAVE_RUNNING, tmp_path / d.node, epoch=2) for d in drivers), timeout=60
    )
    assert all(isinstance(o, CheckpointFailed) for o in outcomes), outcomes
    assert "release of job/rank-6" in str(outcomes[1]) and "flush gave up" in str(outcomes[1]), outcomes
    assert [d.report.outcome for d in drivers] == ["Aborted", "Aborted"]
    for i, s in enumerate(shims):
        # released (again, if it had been), never resumed in place by `abort`; rebuilt and running
        assert "abort" not in s.commands and s.commands[-2:] == ["rebuild", "resume"], (i, s.commands)
        assert s.state == "running"
    assert shims[6].commands == RELEASED_TWICE_THEN_REBUILT
