"""A checkpoint session through the agent API on the host: real server, registry, coordinator and driver;
the rank's shim is a fake control socket, and CRIU is made unavailable so the dump fails for certain.

What it proves: the request is resolved to the registered container's rank, the driver runs every
phase up to the dump against the shim through the session's coordinator, the failed dump takes the
abort path (the released rank is rebuilt and resumed) and the report says so, per rank.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent.agent_harness import Running, register_entry
from node.fake_shim import FakeShimSocket
from pydantic import SecretStr

from ibckpt.agentapi import CheckpointRequest, PhaseTimeouts, RankRef, SessionReport
from testbed.coordinator import ThreadedCoordinator


class Shim(FakeShimSocket):
    """As the real shim: once released, `abort` is refused (only a rebuild brings it back)."""

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "abort" and self.state == "released":
            return False, {"phase": "abort", "ok": False, "state": "released"}
        return super().answer(verb)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Running]:
    running = Running(tmp_path / "state")
    try:
        yield running
    finally:
        running.stop()


def test_a_checkpoint_whose_dump_fails_recovers_the_rank_and_reports_it(
    agent: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no criu: the dump fails after the cut
    state = tmp_path / "state"
    sleeper = subprocess.Popen(["/bin/sleep", "120"])
    try:
        ctl = state / "containers" / "c1" / "ctl"
        ctl.mkdir(parents=True)
        shim = Shim(ctl / "1.sock")
        register_entry(state, sleeper.pid, "c1")
        session, token = coordinator.create_session({"node-x"})
        request = CheckpointRequest(
            session_id=session,
            coordinator=f"127.0.0.1:{coordinator.port}",
            session_token=SecretStr(token),
            job="ring",
            ranks=[RankRef(pod_uid="uid-c1", container="main")],
            timeouts=PhaseTimeouts(rebuild_seconds=20),
        )
        client = agent.client()
        started = client.checkpoint(request)
        assert (started.state, started.node) == ("Running", "node-x")
        [rank] = started.ranks
        assert (rank.rank_key, rank.pod_uid, rank.pid) == ("ring/pod-c1/main/1", "uid-c1", sleeper.pid)
        report: SessionReport = started
        deadline = time.monotonic() + 60
        while not report.state.finished and time.monotonic() < deadline:
            time.sleep(0.2)
            report = client.session(session)
        assert report.state == "Failed", report
        assert "criu binary is not installed" in report.message
        # the fast cut has no "quiesced" barrier
        assert {"preflight", "drained", "released"} <= set(report.phases), report.phases
        [rank] = report.ranks
        assert rank.phase == "Resumed" and "criu" in rank.error  # the session failed, the rank runs again
        # cut, then brought back from released: rebuild and resume
        verbs = shim.commands
        assert [v for v in verbs if v in ("quiesce", "drain", "release", "rebuild", "resume")] == [
            "quiesce", "drain", "release", "rebuild", "resume",
        ], verbs  # fmt: skip
        assert shim.state == "running"
        assert client.info().sessions == []
        # the session token is in no report
        assert token not in report.to_json().decode()
    finally:
        sleeper.kill()
        sleeper.wait()
