"""Containers whose verbs processes come and go (issue 30, item 5): which control sockets still have a
rank behind them (control_sockets.py), and the driver's checkpoint of a container with no live rank.

A verbs program retried in a loop left one socket per ended attempt; every checkpoint of its container
then failed looking for those processes. Stale sockets are dropped, and a container with none left is
dumped as a plain container."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from pathlib import Path

import pytest
from node.driver_harness import connected_driver

from ibckpt.vocabulary import Mode
from ibckpt_node import control_sockets, criu
from ibckpt_node.control_sockets import LiveSocket, StaleSocket, classify
from ibckpt_node.trees import TREE_MANIFEST, ProcessTree
from testbed.coordinator import ThreadedCoordinator


def test_a_socket_whose_process_is_gone_or_that_nobody_listens_on_is_stale() -> None:
    host_pids = {1: 500, 7: 507, 9: 509}  # the container's pid namespace: pid there -> host pid
    refused = {"/c/ctl/9.sock"}
    paths = ["/c/ctl/1.sock", "/c/ctl/7.sock", "/c/ctl/9.sock", "/c/ctl/10.sock", "/c/ctl/11.sock"]
    live, stale = classify(paths, host_pids, lambda p: p not in refused)
    assert live == [LiveSocket("/c/ctl/1.sock", 1, 500), LiveSocket("/c/ctl/7.sock", 7, 507)]
    assert [(s.path, s.ns_pid) for s in stale] == [
        ("/c/ctl/9.sock", 9),
        ("/c/ctl/10.sock", 10),
        ("/c/ctl/11.sock", 11),
    ]
    assert "nobody listens" in stale[0].reason
    assert stale[1].reason == "process 10 is gone from the container"


def test_sixty_ended_attempts_leave_one_rank() -> None:
    """The report's container: 60 attempts ended, the 61st runs; no connect is tried for a gone pid."""
    paths = [f"/c/ctl/{pid}.sock" for pid in range(10, 71)]
    tried: list[str] = []

    def listening(path: str) -> bool:
        tried.append(path)
        return True

    live, stale = classify(paths, {1: 100, 70: 170}, listening)
    assert live == [LiveSocket("/c/ctl/70.sock", 70, 170)]
    assert len(stale) == 60 and tried == ["/c/ctl/70.sock"]


def test_names_the_shim_does_not_make_are_neither_live_nor_stale() -> None:
    paths = ["/c/ctl/x.sock", "/c/ctl/12.sock.new", "/c/ctl/12", "/c/ctl/-3.sock"]
    assert classify(paths, {12: 1}, lambda p: True) == ([], [])
    assert control_sockets.ns_pid_of("/c/ctl/42.sock") == 42
    assert control_sockets.ns_pid_of("/c/ctl/42.sock.new") is None


def test_listening_tells_a_refused_connect_from_a_live_socket(tmp_path: Path) -> None:
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(tmp_path / "1.sock"))
    live.listen(1)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / "2.sock"))  # its file stays once closed, as a killed process's does
    dead.close()
    try:
        assert control_sockets.listening(str(tmp_path / "1.sock"))
        assert not control_sockets.listening(str(tmp_path / "2.sock"))
        assert not control_sockets.listening(str(tmp_path / "3.sock"))  # gone meanwhile
    finally:
        live.close()


def test_a_socket_bound_and_not_yet_listening_is_not_taken_for_stale(tmp_path: Path) -> None:
    """The shim binds at the final name, then listens: a connect between the two is refused once."""
    path = str(tmp_path / "4.sock")
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.bind(path)
    timer = threading.Timer(0.03, early.listen, (1,))
    timer.start()
    try:
        assert control_sockets.listening(path, tries=20, pause_s=0.02)
    finally:
        timer.join()
        early.close()


def test_the_pid_namespace_is_read_once_for_every_process() -> None:
    pids = control_sockets.namespace_pids(os.getpid())
    assert pids[os.getpid()] == os.getpid()  # this test's own namespace: the same numbers
    with pytest.raises(OSError):
        control_sockets.namespace_pids(2**22 + 1)  # above pid_max: no such process


def test_a_socket_made_again_under_the_same_name_is_not_removed(tmp_path: Path) -> None:
    path = tmp_path / "5.sock"
    first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    first.bind(str(path))
    first.close()
    assert control_sockets.remove(str(path)) and not path.exists()
    again = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a new process 5 made its own
    again.bind(str(path))
    again.listen(1)
    try:
        assert not control_sockets.remove(str(path)) and path.exists()
        assert control_sockets.listening(str(path))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["5.sock"]
        assert not control_sockets.remove(str(tmp_path / "6.sock"))  # gone already
    finally:
        again.close()


def test_stale_reasons_say_which_process() -> None:
    _, stale = classify(["/c/ctl/3.sock"], {}, lambda p: True)
    assert stale == [StaleSocket("/c/ctl/3.sock", 3, "process 3 is gone from the container")]


async def test_a_container_with_no_live_rank_is_dumped_as_a_plain_container(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No rank on the node, one container: every phase passes with nothing to quiesce, CRIU dumps the
    container's tree, and its manifest names no rank to rebuild."""
    dumped: list[int] = []

    def dump(pid: int, images: Path, options: object, timeout: float, parent: Path | None) -> None:
        dumped.append(pid)
        images.mkdir(parents=True)

    monkeypatch.setattr(criu, "dump", dump)
    tree = ProcessTree("pod-0.main", sleeper, None)
    driver = await connected_driver(coordinator, [], trees=[tree])
    try:
        report = await asyncio.wait_for(driver.checkpoint(Mode.LEAVE_RUNNING, tmp_path / "images", 2), 60)
    finally:
        await driver.client.close()
    assert report.outcome == "Succeeded" and dumped == [sleeper]
    manifest = json.loads((tmp_path / "images" / "pod-0.main" / TREE_MANIFEST).read_text())
    assert manifest["ranks"] == [] and manifest["root_pid"] == sleeper
