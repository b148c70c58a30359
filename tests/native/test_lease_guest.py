"""The shim's lease in the Soft-RoCE guest: an rc_seq pair under traffic is quiesced (and drained)
and nobody renews its lease, as when the agent dies: each rank resumes on its own within a bound,
says so on stderr, and every message still arrives exactly once. A renewed lease holds the ranks
past the first deadline; a released rank whose lease expired waits (loudly) for its rebuild."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ibckpt.coordination.client import CoordinatorClient, CoordinatorError
from shimtest import TESTS_DIR
from shimtest.coordinator import Coordinator
from shimtest.harness import ShimProc, _each, checkpoint, parse_result, start_server_then_client
from testbed.tlsfiles import shared_pki, write_test_ca

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("built")]

LEASE_MS = 1500
# the watchdog acts within 250 ms of the deadline; the rest is a loaded TCG guest
BOUND_S = LEASE_MS / 1000 + 5.0


def _states(procs: list[ShimProc]) -> dict[str, str]:
    states = {}
    for p in procs:
        try:
            states[p.name] = str(p.ctl.status()["state"])
        except OSError as error:  # its control socket is gone: the process died, and says why
            raise AssertionError(f"{p.name}: {error}; {p.outputs()}") from error
    return states


def _until_running(procs: list[ShimProc], since: float) -> float:
    """Seconds from `since` until every rank is running again on its own."""
    while time.monotonic() - since < BOUND_S * 3:
        if set(_states(procs).values()) == {"running"}:
            return time.monotonic() - since
        time.sleep(0.05)
    raise AssertionError(f"still held {time.monotonic() - since:.1f} s after the cut: {_states(procs)}")


def assert_exactly_once(procs: list[ShimProc], codes: list[int]) -> None:
    """Both rc_seq ranks ended well, and every message arrived exactly once, identical, both ways."""
    assert codes == [0, 0], [p.outputs() for p in procs]
    srv, cli = (parse_result(p.out.read_text()) for p in procs)
    assert srv["bad"] == 0 and cli["bad"] == 0
    assert srv["sent"] == cli["received"] and cli["sent"] == srv["received"]
    assert srv["send_sum"] == cli["recv_sum"] and cli["send_sum"] == srv["recv_sum"]


def _rc_seq_pair(tmp_path: Path, env: dict[str, str], port: int, *flags: str) -> list[ShimProc]:
    """A started rc_seq server and client under the shim (stop file tmp_path/stop), both READY."""
    argv = [str(TESTS_DIR / "rc_seq"), "-f", str(tmp_path / "stop"), "-p", str(port), *flags]
    server = ShimProc("server", argv, tmp_path, env)
    client = ShimProc("client", [*argv, "-c", "127.0.0.1"], tmp_path, env)
    try:
        start_server_then_client(server, client)
        for p in (server, client):
            p.wait_for_output("READY", 120)
    except BaseException:  # the caller only gets the pair, to stop, once both are up
        server.kill()
        client.kill()
        raise
    return [server, client]


def test_unrenewed_lease_resumes_under_traffic(tmp_path: Path, coord: Coordinator) -> None:
    stop = tmp_path / "stop"
    env = {**coord.env, "IBCKPT_LEASE_MS": str(LEASE_MS)}
    procs: list[ShimProc] = []
    try:
        procs = _rc_seq_pair(tmp_path, env, 18631, "-u", "2")

        def sent() -> int:
            return sum(int(p.ctl.status()["qps"][0]["sends_posted"]) for p in procs)

        # 1. quiesced, the agent gone: the default lease of the quiesce (IBCKPT_LEASE_MS) runs out
        t0 = time.monotonic()
        _each(procs, lambda p: p.ctl.quiesce(20000))
        took = _until_running(procs, t0)
        assert LEASE_MS / 1000 - 0.1 <= took < BOUND_S, took
        for p in procs:
            assert "while quiesced: resuming on my own" in p.err.read_text(), p.outputs()
        before = sent()
        time.sleep(0.5)
        assert sent() > before, "no traffic after resuming on its own"

        # 2. drained, a shorter lease from the agent, then nothing
        t0 = time.monotonic()
        _each(procs, lambda p: p.ctl.quiesce(20000))
        _each(procs, lambda p: p.ctl.drain(3000))
        _each(procs, lambda p: p.ctl.command("lease 1000"))
        took = _until_running(procs, t0)
        assert 0.9 <= took < BOUND_S, took
        for p in procs:
            line = "lease expired (no renewal from the agent for 1000 ms) while drained: resuming on my own"
            assert line in p.err.read_text(), p.outputs()

        # 3. renewed: held well past the first deadline, then let go
        _each(procs, lambda p: p.ctl.quiesce(20000))
        _each(procs, lambda p: p.ctl.drain(3000))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * LEASE_MS / 1000:
            _each(procs, lambda p: p.ctl.command(f"lease {LEASE_MS}"))
            time.sleep(0.3)
        assert set(_states(procs).values()) == {"drained"}
        left = [int(p.ctl.status()["lease_left_ms"]) for p in procs]
        assert all(0 < n <= LEASE_MS for n in left), left
        took = _until_running(procs, time.monotonic())
        assert took < BOUND_S, took

        # 4. released: the QPs are gone, so the shim waits for its rebuild and says so
        _each(procs, lambda p: p.ctl.quiesce(20000))
        _each(procs, lambda p: p.ctl.drain(3000))
        _each(procs, lambda p: p.ctl.release(10000))
        time.sleep(LEASE_MS / 1000 + 1.5)
        assert set(_states(procs).values()) == {"released"}
        for p in procs:
            err = p.err.read_text()
            assert err.count("while released: the QPs are gone") == 1, err[-2000:]
        _each(procs, lambda p: p.ctl.rebuild(1, 60000))
        _each(procs, lambda p: p.ctl.resume())

        # 5. a whole checkpoint with the lease running: rebuild and resume end it quietly
        checkpoint(procs, 2)
        time.sleep(LEASE_MS / 1000 + 1.0)
        for p in procs:
            err = p.err.read_text()
            assert err.count("lease expired") == 4, err[-2000:]  # 1-4 above, none since
            assert p.ctl.status()["lease_ms"] == 0
        stop.touch()
        codes = [p.wait(300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert_exactly_once(procs, codes)


async def test_an_agent_killed_after_its_cut_leaves_no_rank_gated(coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The real node agent (ibckpt_node.agent_cli) quiesces and drains an rc_seq pair, then waits
    at its barrier for a second node, which is this test and never comes; the agent is killed
    there (SIGKILL). Both ranks resume on their own: after the quiesce's lease (IBCKPT_LEASE_MS)
    if the agent died before its first renewal, else after the agent's 30 s lease."""
    stop = tmp_path / "stop"
    env = {"IBCKPT_LEASE_MS": "3000"}
    argv = [str(TESTS_DIR / "rc_seq"), "-f", str(stop), "-u", "2", "-p", "18632"]
    server = ShimProc("server", argv, tmp_path, env)
    client = ShimProc("client", [*argv, "-c", "127.0.0.1"], tmp_path, env)
    procs = [server, client]
    session, tokens = coordinator.create_session({"node-1", "node-2"})
    node2 = await CoordinatorClient.connect(
        "127.0.0.1", coordinator.port, session, "node-2", tokens["node-2"], tls=shared_pki().client()
    )
    agent: subprocess.Popen[bytes] | None = None
    agent_log = (tmp_path / "agent.log").open("wb")
    try:
        server.start()
        await asyncio.sleep(1.0)
        client.start()
        for p in procs:
            await asyncio.to_thread(p.wait_for_output, "READY", 120)
        ranks = [f"--rank=ring/rank-{i}/main/0={p.pid}:{p.ctl_path}" for i, p in enumerate(procs)]
        where = ["--coordinator", f"127.0.0.1:{coordinator.port}", "--session", session, "--node", "node-1",
                 "--ca-file", str(write_test_ca(tmp_path))]  # fmt: skip
        agent = subprocess.Popen(
            [sys.executable, "-m", "ibckpt_node.agent_cli", "checkpoint", *ranks, *where,
             "--shim-socket", str(tmp_path / "coord.sock"), "--images", str(tmp_path / "img")],
            env={**os.environ, "IBCKPT_SESSION_TOKEN": tokens["node-1"]},
            stdout=agent_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        # node-2 joins the preflight, never the cut: node-1's agent waits with its ranks drained
        await node2.barrier("Joined", 120)
        await node2.barrier("Admitted", 120)
        t0 = time.monotonic()
        while set((await asyncio.to_thread(_states, procs)).values()) != {"drained"}:
            said = (tmp_path / "agent.log").read_text(errors="replace")[-3000:]
            assert time.monotonic() - t0 < 60 and agent.poll() is None, (_states(procs), said)
            await asyncio.sleep(0.05)
        agent.kill()
        agent.wait()
        killed = time.monotonic()
        while set((await asyncio.to_thread(_states, procs)).values()) != {"running"}:
            assert time.monotonic() - killed < 30 + BOUND_S, _states(procs)
            await asyncio.sleep(0.1)
        for p in procs:
            assert "while drained: resuming on my own" in p.err.read_text(), p.outputs()
        await asyncio.sleep(1.0)
        stop.touch()
        codes = [await asyncio.to_thread(p.wait, 300) for p in procs]
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
        agent_log.close()
        for p in procs:
            p.kill()
        with contextlib.suppress(CoordinatorError):
            await node2.abort("test over")
        await node2.close()
    assert_exactly_once(procs, codes)


def test_drained_then_resumed_on_its_own_again_and_again(tmp_path: Path, coord: Coordinator) -> None:
    """Forty cuts that end the way a dead agent leaves them: quiesced, drained (with sends stalled
    at the gated peer, and often the drain's flag WR behind them), then the lease runs out. The
    app must keep the whole send queue the shim granted it: the flag WR has a slot of its own. (It
    once took one of the app's, and a full window after such a resume failed its post with
    ENOMEM.) Unsignaled sends (-u 4) make the flag WR likely."""
    env = {**coord.env, "IBCKPT_LEASE_MS": str(LEASE_MS)}
    procs: list[ShimProc] = []
    flags = 0
    try:
        procs = _rc_seq_pair(tmp_path, env, 18633, "-u", "4")
        for _ in range(40):
            t0 = time.monotonic()
            _each(procs, lambda p: p.ctl.quiesce(20000))
            drained = _each(procs, lambda p: p.ctl.drain(3000))
            flags += sum(int(r["flag_wrs"]) for r in drained.values())
            _each(procs, lambda p: p.ctl.command("lease 500"))
            _until_running(procs, t0)
            time.sleep(0.2)  # traffic again: a full window on the way before the next cut
        (tmp_path / "stop").touch()
        codes = [p.wait(300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert flags > 0, "no drain posted a flag WR: the case was not exercised"
    for p in procs:
        assert p.err.read_text().count("while drained: resuming on my own") == 40, p.outputs()
    assert_exactly_once(procs, codes)
