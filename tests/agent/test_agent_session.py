"""A checkpoint session through the agent API on the host: real server, registry, coordinator and driver;
the rank's shim is a fake control socket, and CRIU is made unavailable so the dump fails for certain.

What it proves: the request is resolved to the registered container's rank, the driver runs every
phase up to the dump against the shim through the session's coordinator, the failed dump takes the
abort path (the released rank is rebuilt and resumed) and the report says so, per rank.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest
from agent.agent_harness import Running, register_entry
from node.fake_shim import FakeShimSocket
from pydantic import SecretStr

from ibckpt.agentapi import (
    BUSY_STATUS,
    AgentClient,
    AgentError,
    CheckpointRequest,
    Milestone,
    Mode,
    PhaseTimeouts,
    RankRef,
    SessionReport,
)
from ibckpt_node.agent import disk, recovery
from testbed.coordinator import ThreadedCoordinator


class Shim(FakeShimSocket):
    """As the real shim: once released, `abort` is refused (only a rebuild brings it back)."""

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "abort" and self.state == "released":
            return False, {"phase": "abort", "ok": False, "state": "released"}
        if verb == "release" and self.state != "drained":
            return False, {"phase": "release", "ok": False, "error": "not drained", "state": self.state}
        return super().answer(verb)


def registered_shim(state: Path, pid: int) -> Shim:
    """A fake shim's control socket in container c1 of `pid`, registered as the hook does."""
    ctl = state / "containers" / "c1" / "ctl"
    ctl.mkdir(parents=True)
    shim = Shim(ctl / "1.sock")
    register_entry(state, pid, "c1")
    return shim


def wait_finished(client: AgentClient, session: str, timeout_s: float = 60) -> SessionReport:
    deadline = time.monotonic() + timeout_s
    report = client.session(session)
    while not report.state.finished and time.monotonic() < deadline:
        time.sleep(0.2)
        report = client.session(session)
    return report


def checkpoint_request(
    coordinator: ThreadedCoordinator, session: str, token: str, mode: Mode = Mode.LEAVE_RUNNING
) -> CheckpointRequest:
    """A checkpoint of the one registered rank (container c1), through `coordinator`."""
    return CheckpointRequest(
        session_id=session,
        coordinator=f"127.0.0.1:{coordinator.port}",
        session_token=SecretStr(token),
        job="ring",
        mode=mode,
        ranks=[RankRef(pod_uid="uid-c1", container="main")],
        timeouts=PhaseTimeouts(rebuild_seconds=20),
    )


def test_a_checkpoint_whose_dump_fails_recovers_the_rank_and_reports_it(
    agent: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    monkeypatch: pytest.MonkeyPatch,
    sleeper: subprocess.Popen[bytes],
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no criu: the dump fails after the cut
    shim = registered_shim(tmp_path / "state", sleeper.pid)
    session, tokens = coordinator.create_session({"node-x"})
    token = tokens["node-x"]
    client = agent.client()
    started = client.checkpoint(checkpoint_request(coordinator, session, token))
    assert (started.state, started.node) == ("Running", "node-x")
    [rank] = started.ranks
    assert (rank.rank_key, rank.pod_uid, rank.pid) == ("ring/pod-c1/main/1", "uid-c1", sleeper.pid)
    report = wait_finished(client, session)
    assert report.state == "Failed", report
    assert "criu binary is not installed" in report.message
    # the fast cut has no Quiesced barrier
    cut = {Milestone.ADMITTED, Milestone.DRAINED, Milestone.RELEASED}
    assert cut <= set(report.phases), report.phases
    [rank] = report.ranks
    assert rank.phase == "Resumed" and "criu" in rank.error  # the session failed, the rank runs again
    # cut, then brought back from released: asked to release (every node had drained; it says it is
    # released already), rebuilt and resumed
    verbs = shim.commands
    assert [v for v in verbs if v in ("quiesce", "drain", "release", "rebuild", "resume")] == [
        "quiesce", "drain", "release", "release", "rebuild", "resume",
    ], verbs  # fmt: skip
    assert shim.state == "running"
    assert client.info().sessions == []
    # the session token is in no report
    assert token not in report.to_json().decode()


@pytest.mark.usefixtures("fake_criu")
def test_an_abort_after_a_stop_dump_rebuilds_the_released_rank_and_resumes_it(
    agent: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
) -> None:
    state = tmp_path / "state"
    shim = registered_shim(state, sleeper.pid)
    session, tokens = coordinator.create_session({"node-x"})
    token = tokens["node-x"]
    client = agent.client()
    client.checkpoint(checkpoint_request(coordinator, session, token, Mode.STOP))
    stopped = wait_finished(client, session)
    # dumped with Stop: the rank waits released for the kill that follows the commit
    assert (stopped.state, stopped.phase) == ("Succeeded", "Stopped"), stopped
    assert shim.state == "released"
    record = recovery.record_path(state, session)
    assert record.exists() and token not in record.read_text()
    # the images hold the job's memory: root's alone on the node
    modes = {p.name: p.stat().st_mode & 0o777 for p in (record.parent.parent, record.parent, record)}
    assert modes == {"sessions": 0o700, session: 0o700, record.name: 0o600}, modes

    # the job aborts instead (another node's upload failed): the rank is rebuilt and runs again
    aborting = client.abort(session, "node-y: upload failed", (f"127.0.0.1:{coordinator.port}", token))
    assert aborting.state == "Running"
    report = wait_finished(client, session)
    assert report.state == "Aborted", report
    assert "node-y: upload failed" in report.message and "1 of 1 rank(s) brought back" in report.message
    [rank] = report.ranks
    assert rank.phase == "Resumed", rank
    # its GIDs are learned (status) before it may publish records (coord_proxy.py, confine)
    assert shim.commands[-5:] == ["release", "status", "reserve", "rebuild", "resume"], shim.commands
    assert shim.state == "running"
    assert not record.exists()  # nothing left for a next agent
    assert Milestone.DUMPED in report.phases  # the checkpoint's phases are kept


@pytest.mark.usefixtures("fake_criu")
def test_a_restarted_agent_brings_back_the_ranks_its_dead_predecessor_left_released(
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
) -> None:
    state = tmp_path / "state"
    first = Running(state)
    second: Running | None = None
    try:
        shim = registered_shim(state, sleeper.pid)
        session, tokens = coordinator.create_session({"node-x"})
        token = tokens["node-x"]
        first.client().checkpoint(checkpoint_request(coordinator, session, token, Mode.STOP))
        assert wait_finished(first.client(), session).phase == "Stopped"
        first.crash()  # killed while its ranks wait released (an upload, say)
        # ... and before it settled the images it dumped: they are on the disk, unmarked
        images = disk.session_dir(state, session) / "images"
        (images / "pod-c1.main").mkdir(parents=True, exist_ok=True)
        (images / "pod-c1.main" / "pages-1.img").write_bytes(b"\0" * 4096)
        (disk.session_dir(state, session) / disk.KEPT).unlink(missing_ok=True)

        second = Running(state)
        client = second.client()
        # an abort naming no coordinator, or a session never recorded here: nothing to bring back
        for sid, rejoin in ((session, None), ("ckj-other", (f"127.0.0.1:{coordinator.port}", token))):
            with pytest.raises(AgentError) as refused:
                client.abort(sid, "operator: aborted", rejoin)
            assert refused.value.status == 404
        assert shim.state == "released"

        client.abort(session, "operator: AgentLostSession", (f"127.0.0.1:{coordinator.port}", token))
        report = wait_finished(client, session)
        assert report.state == "Aborted", report
        [rank] = report.ranks
        assert (rank.rank_key, rank.phase, rank.pid) == ("ring/pod-c1/main/1", "Resumed", sleeper.pid)
        # its GIDs are learned (status) before it may publish records (coord_proxy.py, confine)
        assert shim.commands[-5:] == ["release", "status", "reserve", "rebuild", "resume"], shim.commands
        assert shim.state == "running"
        assert not recovery.record_path(state, session).exists()
        # the predecessor's images are kept as an aborted checkpoint's: the sweep's bound counts from now
        marker = disk.kept(state, session)
        assert marker is not None and marker[0] == "aborted" and time.time() - marker[1] < 60, marker
        assert (images / "pod-c1.main" / "pages-1.img").exists()
    finally:
        if second is not None:
            second.stop()


def test_a_stopping_agent_aborts_its_session_and_exits_only_once_the_rank_runs_again(
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM mid-dump (a `helm upgrade` rolls the DaemonSet): the agent aborts the session and waits,
    within its stop timeout (the chart's grace period less a margin), until its rank runs again, so no
    rank is left cut. The dump itself is not interrupted: it runs to its end (here 5 s) first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started = tmp_path / "dump-started"
    criu = bin_dir / "criu"
    criu.write_text(f"#!/bin/sh\ntouch {started}\nexec sleep 5\n")  # a dump that takes its time
    criu.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    state = tmp_path / "state"
    agent = Running(state)
    shim = registered_shim(state, sleeper.pid)
    session, tokens = coordinator.create_session({"node-x"})
    token = tokens["node-x"]
    agent.client().checkpoint(checkpoint_request(coordinator, session, token))
    deadline = time.monotonic() + 60
    while not started.exists():
        assert time.monotonic() < deadline, f"the dump never started: {shim.commands}"
        time.sleep(0.2)
    assert shim.state != "running", shim.state  # cut for the dump

    began = time.monotonic()
    agent.stop(stop_timeout_s=60)
    took = time.monotonic() - began
    assert took < 50, f"the agent took {took:.0f} s to stop"
    assert shim.state == "running", shim.commands
    assert shim.commands[-2:] == ["rebuild", "resume"], shim.commands


def test_a_stopping_agent_whose_coordinator_went_with_the_operator_takes_the_next_ones_abort(
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `helm upgrade` rolls the operator and the agents at once: the agent is stopping while its rank
    waits released mid-dump, and the session's coordinator is gone with the old operator. The agent
    still serves the API until its session ends, so the next operator's abort, naming its own
    coordinator, reaches it and the rank is rebuilt and runs before the agent exits; no new session
    starts meanwhile."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started = tmp_path / "dump-started"
    criu = bin_dir / "criu"
    criu.write_text(f"#!/bin/sh\ntouch {started}\nexec sleep 3\n")
    criu.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    state = tmp_path / "state"
    agent = Running(state)
    shim = registered_shim(state, sleeper.pid)
    old = ThreadedCoordinator()
    old.start()
    session, tokens = old.create_session({"node-x"})
    agent.client().checkpoint(checkpoint_request(old, session, tokens["node-x"]))
    deadline = time.monotonic() + 60
    while not started.exists():
        assert time.monotonic() < deadline, f"the dump never started: {shim.commands}"
        time.sleep(0.2)
    # one session at a time (its dump runs 3 s): another job's is refused as busy, to be asked again
    with pytest.raises(AgentError) as busy:
        agent.client().checkpoint(checkpoint_request(old, "ckj-other", "t"))
    assert busy.value.status == BUSY_STATUS, busy.value
    assert f"busy with session {session!r}" in busy.value.message, busy.value
    old.stop()  # the operator and its coordinator are gone
    assert shim.state == "released", shim.commands

    stopping = threading.Thread(target=agent.stop, kwargs={"stop_timeout_s": 60})
    began = time.monotonic()
    stopping.start()
    client = agent.client()
    while True:  # a stopping agent starts nothing
        try:
            client.checkpoint(checkpoint_request(coordinator, "ckj-later", "t"))
        except AgentError as refused:
            if refused.status == 503:
                assert "is stopping" in str(refused), refused
                break
            raise
        assert time.monotonic() < deadline, "the agent never said it was stopping"
        time.sleep(0.2)
    _, recovery_tokens = coordinator.create_session({"node-x"}, session_id=session)
    client.abort(
        session, "operator: OperatorRestarted", (f"127.0.0.1:{coordinator.port}", recovery_tokens["node-x"])
    )
    stopping.join(90)
    took = time.monotonic() - began
    assert not stopping.is_alive() and took < 50, f"the agent took {took:.0f} s to stop"
    assert shim.state == "running", shim.commands
    assert shim.commands[-2:] == ["rebuild", "resume"], shim.commands
    assert not recovery.record_path(state, session).exists()


class ShimWithoutItsPeer(Shim):
    """A rebuild that fails until `peer_back` (its peer's agent was away: a stopping agent mid-cut)."""

    peer_back = False

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "rebuild" and not self.peer_back:
            return False, {"phase": "rebuild", "ok": False, "error": "no record of peer"}
        return super().answer(verb)


def test_a_rank_the_abort_could_not_rebuild_keeps_its_record_for_the_next_agent(
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dump fails after the release and the rebuild finds no peer: the rank stays released, the
    session says so, and its record stays, so the node's next agent (a rollout) brings it back on the
    operator's abort once the peer is there."""
    monkeypatch.setenv("PATH", "/nonexistent")  # no criu: the dump fails after the cut
    state = tmp_path / "state"
    first = Running(state)
    second: Running | None = None
    try:
        ctl = state / "containers" / "c1" / "ctl"
        ctl.mkdir(parents=True)
        shim = ShimWithoutItsPeer(ctl / "1.sock")
        register_entry(state, sleeper.pid, "c1")
        session, tokens = coordinator.create_session({"node-x"})
        token = tokens["node-x"]
        first.client().checkpoint(checkpoint_request(coordinator, session, token))
        report = wait_finished(first.client(), session)
        [rank] = report.ranks
        assert (report.state, rank.phase) == ("Failed", "Failed"), report
        assert shim.state == "released"
        assert recovery.record_path(state, session).exists()
        first.crash()  # a rollout replaces it

        shim.peer_back = True
        second = Running(state)
        second.client().abort(
            session, "operator: OperatorRestarted", (f"127.0.0.1:{coordinator.port}", token)
        )
        report = wait_finished(second.client(), session)
        [rank] = report.ranks
        assert (report.state, rank.phase) == ("Aborted", "Resumed"), report
        assert shim.state == "running" and shim.commands[-2:] == ["rebuild", "resume"], shim.commands
        assert not recovery.record_path(state, session).exists()
    finally:
        if second is not None:
            second.stop()
