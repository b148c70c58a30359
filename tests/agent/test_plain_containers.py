"""A checkpoint of containers whose verbs processes come and go (issue 30, item 5), as the agent resolves
it: stale control sockets are dropped with one log line each, and a container with no live verbs process
becomes one entry (RankId.plain) dumped as a plain container; restore waits for its container only."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from ibckpt.agentapi import models as api
from ibckpt.coordination.ranks import RankId
from ibckpt_node.agent.restoring import ContainerRestore, wait_for_ranks
from ibckpt_node.agent.session import container_ranks, finish_failed, report_entries
from ibckpt_node.agent.sessions import Sessions
from ibckpt_node.hook import client as registry_client
from ibckpt_node.ranks import LocalRank
from ibckpt_node.registry import ContainerRegistry, RegisteredContainer
from testbed.tlsfiles import make_pki


@pytest.fixture
def sleeper() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def entry_of(ctl: Path, pid: int, first: str = "1.sock") -> RegisteredContainer:
    return RegisteredContainer(
        container_id="c1",
        namespace="ml",
        pod="pod-0",
        pod_uid="uid-0",
        container="main",
        pid=pid,
        pid_start=registry_client.process_start(pid),
        control_dir=str(ctl),
        control_socket=str(ctl / first),
        shim=True,
        registered_at=time.time(),
    )


def bound(path: Path, listen: bool) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listen:
        sock.listen(4)
    else:
        sock.close()  # its file stays, as a killed attempt's did
    return sock


def test_stale_sockets_are_dropped_and_logged_and_the_live_one_is_the_rank(
    tmp_path: Path, sleeper: int, caplog: pytest.LogCaptureFixture
) -> None:
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    live = bound(ctl / "1.sock", listen=True)
    # this test's own pid lives in the namespace but nobody listens; 4194000 is no process at all
    for name in (f"{os.getpid()}.sock", "4194000.sock"):
        bound(ctl / name, listen=False)
    try:
        with caplog.at_level(logging.INFO, logger="ibckpt_node.agent.session"):
            ranks = container_ranks("job", entry_of(ctl, sleeper))
    finally:
        live.close()
    assert ranks == [LocalRank(RankId("job", "pod-0", "main", "1"), sleeper, ctl / "1.sock")]
    assert sorted(p.name for p in ctl.iterdir()) == ["1.sock"]
    dropped = [r.getMessage() for r in caplog.records if "dropped stale control socket" in r.getMessage()]
    assert len(dropped) == 2 and all(r.levelno == logging.INFO for r in caplog.records), dropped
    assert any("process 4194000 is gone from the container" in m for m in dropped), dropped
    assert any("nobody listens on it" in m for m in dropped), dropped


def test_a_container_with_no_live_rank_is_one_plain_entry(tmp_path: Path, sleeper: int) -> None:
    entry = entry_of(tmp_path, sleeper)
    (plain,) = report_entries("job", entry, [])
    assert plain.rank_key == "job/pod-0/main/plain" and RankId.parse(plain.rank_key).plain
    assert (plain.pid, plain.pod_uid, plain.container) == (sleeper, "uid-0", "main")
    ranks = [LocalRank(RankId("job", "pod-0", "main", p), 10 + int(p), tmp_path / f"{p}.sock") for p in "12"]
    keys = [(e.rank_key, e.pid) for e in report_entries("job", entry, ranks)]
    assert keys == [("job/pod-0/main/1", 11), ("job/pod-0/main/2", 12)]
    assert not RankId.parse(keys[0][0]).plain


def request(container: str = "main") -> api.CheckpointRequest:
    return api.CheckpointRequest(
        session_id="s-1",
        coordinator="127.0.0.1:1",
        session_token=SecretStr("t" * 32),
        job="job",
        ranks=[api.RankRef(pod_uid="uid-0", container=container)],
    )


def test_a_retried_programs_container_resolves_to_a_plain_tree(tmp_path: Path, sleeper: int) -> None:
    """Every attempt ended (sockets left by SIGKILL): the checkpoint goes on, the container alone."""
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    for pid in range(4194000, 4194060):
        bound(ctl / f"{pid}.sock", listen=False)
    registry = ContainerRegistry(tmp_path / "state")
    registry.add(entry_of(ctl, sleeper, first="1.sock"))
    sessions = Sessions("node-1", registry, tmp_path / "work", coordinator_tls=make_pki().client)
    resolved = sessions._resolve(request())
    assert resolved.ranks == [] and list(ctl.iterdir()) == []
    assert [(t.name, t.root_pid) for t in resolved.trees] == [("pod-0.main", sleeper)]
    assert resolved.tree_keys == {"pod-0.main": ["job/pod-0/main/plain"]}
    assert [p.rank_key for p in resolved.progress] == ["job/pod-0/main/plain"]


def test_a_failed_session_says_a_plain_container_runs_while_its_process_lives(sleeper: int) -> None:
    from ibckpt_node.agent.session import Session

    report = api.SessionReport(
        session_id="s-1",
        kind=api.SessionKind.CHECKPOINT,
        node="node-1",
        started_at=time.time(),
        ranks=[
            api.RankProgress(rank_key="job/pod-0/main/plain", pod_uid="u0", container="main", pid=sleeper),
            api.RankProgress(rank_key="job/pod-1/main/plain", pod_uid="u1", container="main", pid=4194001),
        ],
    )
    session = Session(request(), report, [], [], {})
    finish_failed(session, api.SessionState.FAILED, "the dump failed")
    assert [p.phase for p in report.ranks] == [api.RankPhase.RESUMED, api.RankPhase.FAILED]


async def test_a_restored_plain_container_needs_no_control_socket(tmp_path: Path, sleeper: int) -> None:
    registry = ContainerRegistry(tmp_path / "state")
    registry.add(entry_of(tmp_path, sleeper))
    item = ContainerRestore("uid-0", "ml", "pod-0", "main", "node-1/pod-0.main", ("job/pod-0/main/plain",))
    uids: dict[str, str] = {}
    ranks = await wait_for_ranks(registry, [item], lambda c, n: c, 2.0, 0.0, uids)
    assert ranks == [] and uids == {"job/pod-0/main/plain": "uid-0"}
