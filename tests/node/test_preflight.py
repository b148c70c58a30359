"""Preflight refusals on the host: parsing /proc, in or out of the job, and the driver's refusal
path with fake shims (no rank is gated; the coordinator session is aborted for every node); a
container's process tree, which is dumped whole and must hold its ranks and lead nowhere else."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from node.driver_harness import connected_driver, failed_checkpoint, gather_closing, session_clients
from node.fake_shim import FakeShimSocket

from ibckpt.agentapi import Mode
from ibckpt.coordination.client import CoordinationAborted
from ibckpt.coordination.ranks import RankId
from ibckpt_native.control import ShimStatus
from ibckpt_node import preflight, procfs
from ibckpt_node.driver import NodeDriver
from ibckpt_node.errors import CheckpointFailed, CheckpointRefused
from ibckpt_node.ranks import LocalRank
from ibckpt_node.trees import TREE_MANIFEST, ProcessTree, read_tree_manifest
from testbed.coordinator import ThreadedCoordinator

TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:484B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 551 1 0 100
   1: 01004D0A:484B 02004D0A:9C40 01 00000000:00000000 00:00000000 00000000     0        0 777 1 0 20
   2: 0F02000A:A000 6402000A:15B3 01 00000000:00000000 00:00000000 00000000     0        0 778 1 0 20
"""
TCP6 = """  sl  local_address                         remote_address                        st tx_queue ...
   0: 0000000000000000FFFF00000F02000A:A001 0000000000000000FFFF00006402000A:15B4 01 00000000:00000000 00:00000000 00000000     0        0 901 1
   1: 00000000000000000000000001000000:1F90 00000000000000000000000001000000:C350 01 00000000:00000000 00:00000000 00000000     0        0 902 1
"""  # noqa: E501
FIB = """Main:
  +-- 0.0.0.0/0 3 0 5
     +-- 10.77.0.0/24 2 0 2
           |-- 10.77.0.1
              /32 host LOCAL
           |-- 10.77.0.255
              /32 link BROADCAST
     +-- 127.0.0.0/8 2 0 2
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
"""
JOB = [ipaddress.ip_address("10.77.0.1"), ipaddress.ip_address("10.77.0.2")]


def test_proc_net_tcp_is_parsed() -> None:
    v4 = procfs.parse_proc_net_tcp(TCP)
    assert [(str(s.local), s.local_port, str(s.remote), s.remote_port, s.state, s.inode) for s in v4] == [
        ("0.0.0.0", 18507, "0.0.0.0", 0, 10, 551),
        ("10.77.0.1", 18507, "10.77.0.2", 40000, 1, 777),
        ("10.0.2.15", 40960, "10.0.2.100", 5555, 1, 778),
    ]
    v6 = procfs.parse_proc_net_tcp(TCP6)
    assert v6[0].remote == ipaddress.ip_address("::ffff:10.0.2.100") and v6[0].remote_port == 5556
    assert str(v6[1].remote) == "::1" and v6[1].inode == 902


def test_only_peers_outside_the_job_and_the_node_are_refused() -> None:
    sockets = procfs.parse_proc_net_tcp(TCP) + procfs.parse_proc_net_tcp(TCP6)
    outside = preflight.outside_connections(sockets, JOB)
    # the listener, the connection to the other job node and the loopback one are fine; the
    # connections to 10.0.2.100 (IPv4 and dual-stack) are not
    assert [s.inode for s in outside] == [778, 901]
    message = preflight.tcp_problem(outside[0], JOB)
    assert message == (
        "TCP connection 10.0.2.15:40960 -> 10.0.2.100:5555 (ESTABLISHED) leads outside the job "
        "(job addresses: 10.77.0.1, 10.77.0.2)"
    )


def test_node_addresses_are_read_from_fib_trie_and_if_inet6() -> None:
    assert procfs.parse_fib_trie(FIB) == {
        ipaddress.IPv4Address("10.77.0.1"),
        ipaddress.IPv4Address("127.0.0.1"),
    }
    six = procfs.parse_if_inet6("fd000000000000000000000000000002 04 40 00 82     eth0\n")
    assert six == {ipaddress.IPv6Address("fd00::2")}


def test_shim_status_problems() -> None:
    ident = preflight.ShimIdentity.from_status(
        ShimStatus.parse(
            {
                "qps": [{"qpn": 17, "type": 2}, {"qpn": 18, "type": 9}],
                "gids": ["fe80000000000000020000fffe000001"],
                "peers": [
                    {"qpn": 17, "type": 2, "peer_gid": "00000000000000000000ffff0a4d0002", "peer_qpn": 99}
                ],
                "unsupported": ["ibv_query_rt_values_ex", "ibv_alloc_mw"],
            }
        )
    )
    assert ident.own_keys() == [
        "preflight/qp/fe80000000000000020000fffe000001/17",
        "preflight/qp/fe80000000000000020000fffe000001/18",
        "preflight/gid/fe80000000000000020000fffe000001",
    ]
    assert preflight.shim_problems(ident) == [
        "QP 18 has QP type 9, which the shim does not support",
        "the shim refused ibv_alloc_mw (not supported under checkpointing)",
    ]
    assert preflight.foreign_peer_problem(*ident.peers[0]) == (
        "RC QP 17 is connected to GID ::ffff:10.77.0.2 QPN 99, which no rank of the job holds"
    )


def test_a_real_connection_of_a_process_tree_is_found() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket,time; s=socket.create_connection(('127.0.0.1',{port})); time.sleep(60)"
        child = subprocess.Popen([sys.executable, "-c", code])
        try:
            conn, _ = server.accept()
            with conn:
                mine = [s for _, s in procfs.tcp_sockets_of(os.getpid()) if s.remote_port != port]
                found = [(p, s) for p, s in procfs.tcp_sockets_of(os.getpid()) if s.remote_port == port]
                assert [p for p, _ in found] == [child.pid], (found, mine)
                assert found[0][1].state == 1
                assert preflight.outside_connections([found[0][1]], JOB) == []  # loopback
        finally:
            child.kill()
            child.wait()


# -- the driver refuses through the coordinator ------------------------------------------


class StatusShim(FakeShimSocket):
    """Answers `status` with a canned report; records every command (only status may come)."""

    def __init__(self, path: Path, status: dict[str, Any]) -> None:
        super().__init__(path)
        self.status = status

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        return (True, self.status) if verb == "status" else super().answer(verb)


GID_A = "00000000000000000000ffff0a4d0001"
GID_B = "00000000000000000000ffff0a4d0002"
GID_OUTSIDE = "00000000000000000000ffff0a4d0063"  # 10.77.0.99: no rank of the job


@pytest.fixture
def outsider_rank() -> Iterator[tuple[int, int]]:
    """A process holding an established TCP connection to this machine's non-loopback address."""
    addrs = sorted(a for a in procfs.node_addresses() if a.version == 4)
    assert addrs, "the host needs a non-loopback IPv4 address for this test"
    with socket.create_server((str(addrs[0]), 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket,time; s=socket.create_connection(('{addrs[0]}',{port})); time.sleep(60)"
        child = subprocess.Popen([sys.executable, "-c", code])
        conn, _ = server.accept()
        try:
            yield child.pid, port
        finally:
            conn.close()
            child.kill()
            child.wait()


async def test_refusal_names_rank_pid_and_resources_and_aborts_every_node(
    coordinator: ThreadedCoordinator, tmp_path: Path, outsider_rank: tuple[int, int], sleeper: int
) -> None:
    pid, port = outsider_rank
    # node-1's rank: an RC QP toward node-2's rank (in the job) and one toward a storage server
    s1 = StatusShim(tmp_path / "r1.ctl", {
        "state": "running", "qps": [{"qpn": 17, "type": 2}, {"qpn": 18, "type": 2}], "gids": [GID_A],
        "peers": [{"qpn": 17, "type": 2, "peer_gid": GID_B, "peer_qpn": 33},
                  {"qpn": 18, "type": 2, "peer_gid": GID_B, "peer_qpn": 900}],
        "unsupported": [], "ah_gids": [GID_B, GID_OUTSIDE, GID_A],
    })  # fmt: skip
    s2 = StatusShim(tmp_path / "r2.ctl", {
        "state": "running", "qps": [{"qpn": 33, "type": 2}], "gids": [GID_B],
        "peers": [{"qpn": 33, "type": 2, "peer_gid": GID_A, "peer_qpn": 17}], "unsupported": [],
        "ah_gids": [GID_A],
    })  # fmt: skip
    clients = await session_clients(coordinator, ("node-1", "node-2"))
    job = ["10.77.0.1", "10.77.0.2"]
    d1 = NodeDriver(
        "node-1", clients[0], [LocalRank(RankId.parse("job/rank-0/main/0"), pid, s1.path)], job_addrs=job
    )
    rank2 = LocalRank(RankId.parse("job/rank-1/main/0"), sleeper, s2.path)
    d2 = NodeDriver("node-2", clients[1], [rank2], job_addrs=job)
    results = await gather_closing(
        clients,
        d1.checkpoint(Mode.STOP, tmp_path / "i1", 2),
        d2.checkpoint(Mode.STOP, tmp_path / "i2", 2),
        timeout=30,
    )
    assert all(isinstance(r, CheckpointRefused) for r in results), results
    message = str(results[0])
    assert message.startswith("node-1: refusing to checkpoint")
    assert f"refusing to checkpoint job/rank-0/main/0 (pid {pid})" in message
    assert "RC QP 18 is connected to GID ::ffff:10.77.0.2 QPN 900, which no rank of the job holds" in message
    assert "QP 17" not in message  # its peer is node-2's rank
    # UD: of its address handles, only the one toward a GID no rank holds is named
    assert "a UD address handle points to GID ::ffff:10.77.0.99, which no rank of the job holds" in message
    assert "GID ::ffff:10.77.0.2," not in message and "GID ::ffff:10.77.0.1" not in message
    assert f":{port} (ESTABLISHED) leads outside the job (job addresses: 10.77.0.1, 10.77.0.2)" in message
    # node-2 found nothing itself, and refused because node-1 aborted the session
    assert isinstance(results[1].__cause__, CoordinationAborted) and "node-1: refusing" in str(results[1])
    # no rank was gated: status was the only command either shim saw
    assert s1.commands == ["status"] and s2.commands == ["status"]
    assert d1.report.outcome == d2.report.outcome == "Refused"
    assert not (tmp_path / "i1").exists() and not (tmp_path / "i2").exists()


async def test_a_rank_an_earlier_abort_left_released_is_refused_before_its_peers_are_gated(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    """node-2's rank still waits, released, for a rebuild its peers never joined: a new checkpoint
    would fail at its quiesce after node-1's healthy rank was gated. Preflight refuses it by name."""
    s1 = StatusShim(tmp_path / "r1.ctl", {"state": "running", "qps": [], "gids": [GID_A], "unsupported": []})
    s2 = StatusShim(tmp_path / "r2.ctl", {"state": "released", "qps": [], "gids": [GID_B], "unsupported": []})
    clients = await session_clients(coordinator, ("node-1", "node-2"))
    drivers = [
        NodeDriver(node, client, [LocalRank(RankId.parse(f"job/rank-{i}/main/0"), sleeper, shim.path)])
        for i, (node, client, shim) in enumerate(zip(("node-1", "node-2"), clients, (s1, s2), strict=True))
    ]
    results = await gather_closing(
        clients, *(d.checkpoint(Mode.STOP, tmp_path / d.node, 2) for d in drivers), timeout=30
    )
    assert all(isinstance(r, CheckpointRefused) for r in results), results
    message = str(results[1])
    assert f"refusing to checkpoint job/rank-1/main/0 (pid {sleeper}): its shim is released" in message
    assert "restore the job from its last checkpoint" in message and "node-2: refusing" in str(results[0])
    assert s1.commands == ["status"] and s2.commands == ["status"]  # nobody was gated


# -- process trees: a container's whole tree is one image ----------------------------------------------


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
    assert {root, rank} <= set(procfs.process_tree(root))
    assert root not in procfs.process_tree(rank)


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
    driver = await connected_driver(coordinator, ranks, None, trees=[ProcessTree("launcher", root)])
    refused = rf"job/rank-1/main/0 \(pid {sleeper}\) is in none"
    await failed_checkpoint(driver, Mode.STOP, tmp_path / "images", refused, CheckpointRefused)
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
    own = sorted(str(a) for a in procfs.node_addresses() if a.version == 4)
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
        tree = ProcessTree("launcher", launcher.pid)
        driver = await connected_driver(coordinator, [rank], None, job_addrs=["10.77.0.1"], trees=[tree])
        refused = rf"process tree launcher \(pid {launcher.pid}\).*{own[0]}:{port}.*leads outside the job"
        await failed_checkpoint(driver, Mode.STOP, tmp_path / "images", refused, CheckpointRefused)
        assert shim.commands == ["status"]
    finally:
        subprocess.run(["pkill", "-P", str(launcher.pid)], check=False)
        launcher.kill()
        launcher.wait()
        listener.close()


def test_ibckpt_node_starts_without_pydantic() -> None:
    # In the emulated guests pydantic and the API models cost seconds at start-up, and a checkpoint
    # taken with `ibckpt-node` began that much later (perftest had finished before it).
    code = "import sys, ibckpt_node.agent_cli; print(sorted(m for m in sys.modules if 'pydantic' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
