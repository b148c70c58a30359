"""Preflight: refuse a checkpoint that cannot be saved, before any rank is touched.

A rank cannot be checkpointed and restored faithfully when it holds state that lives outside
the job: a TCP connection to a peer that is not one of the job's nodes (its other end is not
dumped with it), a QP connected to a (GID, QPN) that no rank of the job holds (a storage
server, say: it would never rebuild toward us), or a verb or QP type the shim refused (the
application may rely on what it could not get). The node driver runs these checks on every
local rank before `quiesce`; a refusal names the rank, its pid and the resource, and goes
through the coordinator's abort so that every node refuses.

The parts here are pure (parsing /proc, deciding in or out of the job) except the small
readers at the bottom, which look at /proc for one process tree.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# /proc/net/tcp states (include/net/tcp_states.h)
TCP_STATES = {
    1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
    7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING",
}  # fmt: skip
TCP_LISTEN = 10
TCP_CLOSE = 7

QP_TYPES = {2: "RC", 3: "UC", 4: "UD"}  # the types the shim supports (enum ibv_qp_type)

# Verbs the shim refuses that leave nothing behind in the process: a program that called one
# and carried on holds no state the checkpoint misses (UCX, for one, queries and falls back).
STATELESS_REFUSALS = frozenset({"ibv_query_rt_values_ex", "ibv_get_async_event", "ibv_advise_mr"})


@dataclass(frozen=True)
class TcpSocket:
    local: IPAddress
    local_port: int
    remote: IPAddress
    remote_port: int
    state: int
    inode: int

    def describe(self) -> str:
        state = TCP_STATES.get(self.state, str(self.state))
        return f"{_fmt(self.local, self.local_port)} -> {_fmt(self.remote, self.remote_port)} ({state})"


def _fmt(addr: IPAddress, port: int) -> str:
    return f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"


def _proc_addr(hex_addr: str) -> IPAddress:
    """An address as /proc/net/tcp{,6} prints it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    if len(raw) != 16:
        raise ValueError(f"bad address {hex_addr!r} in /proc/net/tcp")
    return ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def parse_proc_net_tcp(text: str) -> list[TcpSocket]:
    """Parse /proc/net/tcp or /proc/net/tcp6 (the header line is skipped)."""
    sockets = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        local, _, lport = fields[1].partition(":")
        remote, _, rport = fields[2].partition(":")
        sockets.append(
            TcpSocket(
                local=_proc_addr(local),
                local_port=int(lport, 16),
                remote=_proc_addr(remote),
                remote_port=int(rport, 16),
                state=int(fields[3], 16),
                inode=int(fields[9]),
            )
        )
    return sockets


def unmapped(addr: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (::ffff:a.b.c.d, a dual-stack socket) as its IPv4 address."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def parse_fib_trie(text: str) -> set[ipaddress.IPv4Address]:
    """The node's own IPv4 addresses: the /32 LOCAL host entries of /proc/net/fib_trie."""
    found: set[ipaddress.IPv4Address] = set()
    last: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|--"):
            last = stripped[3:].strip()
        elif stripped.startswith("/32 host LOCAL") and last:
            found.add(ipaddress.IPv4Address(last))
    return found


def parse_if_inet6(text: str) -> set[ipaddress.IPv6Address]:
    """The node's own IPv6 addresses, from /proc/net/if_inet6."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    return {ipaddress.IPv6Address(bytes.fromhex(fields[0])) for fields in lines}


def outside_connections(sockets: Iterable[TcpSocket], job_addrs: Iterable[IPAddress]) -> list[TcpSocket]:
    """The sockets connected to a peer that is neither loopback nor one of the job's addresses."""
    allowed = {unmapped(a) for a in job_addrs}
    outside = []
    for s in sockets:
        if s.state in (TCP_LISTEN, TCP_CLOSE):
            continue
        remote = unmapped(s.remote)
        if remote.is_unspecified or remote.is_loopback or remote in allowed:
            continue
        outside.append(s)
    return outside


@dataclass(frozen=True)
class ShimIdentity:
    """What a rank's shim `status` says about its QPs: its own ids and its connected peers'."""

    gids: tuple[str, ...]  # this rank's virtual GIDs, hex
    qpns: tuple[int, ...]  # its QPs' virtual numbers
    qp_types: Mapping[int, int]
    peers: tuple[tuple[int, int, str, int], ...]  # (qpn, type, peer GID hex, peer QPN)
    refused: tuple[str, ...]  # verbs the shim refused
    ah_gids: tuple[str, ...] = ()  # where the rank's UD address handles point, hex

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> ShimIdentity:
        qps = status.get("qps", [])
        return cls(
            # an unset GID table entry reads as all zeros: not an identity
            gids=tuple(str(g) for g in status.get("gids", []) if int(str(g), 16) != 0),
            qpns=tuple(int(q["qpn"]) for q in qps),
            qp_types={int(q["qpn"]): int(q["type"]) for q in qps},
            peers=tuple(
                (int(p["qpn"]), int(p["type"]), str(p["peer_gid"]), int(p["peer_qpn"]))
                for p in status.get("peers", [])
            ),
            refused=tuple(str(v) for v in status.get("unsupported", [])),
            ah_gids=tuple(sorted({str(g) for g in status.get("ah_gids", [])})),
        )

    def own_keys(self) -> list[str]:
        return [qp_key(g, q) for g in self.gids for q in self.qpns] + [gid_key(g) for g in self.gids]


def qp_key(gid_hex: str, qpn: int) -> str:
    """The coordinator key under which a node publishes that one of its ranks holds (GID, QPN)."""
    return f"preflight/qp/{gid_hex}/{qpn}"


def gid_key(gid_hex: str) -> str:
    """The key under which a node publishes that one of its ranks holds a GID (for UD)."""
    return f"preflight/gid/{gid_hex}"


def addr_key(addr: IPAddress) -> str:
    return f"preflight/addr/{unmapped(addr)}"


def gid_text(gid_hex: str) -> str:
    """A GID as an IPv6 address; a RoCEv2 GID of an IPv4 address as ::ffff:a.b.c.d."""
    try:
        gid = ipaddress.IPv6Address(bytes.fromhex(gid_hex))
    except ValueError:
        return gid_hex
    return f"::ffff:{gid.ipv4_mapped}" if gid.ipv4_mapped is not None else str(gid)


def shim_problems(ident: ShimIdentity) -> list[str]:
    """What the shim itself says this rank holds or attempted that a checkpoint cannot carry."""
    problems = [
        f"QP {qpn} has QP type {qp_type}, which the shim does not support"
        for qpn, qp_type in sorted(ident.qp_types.items())
        if qp_type not in QP_TYPES
    ]
    problems += [
        f"the shim refused {verb} (not supported under checkpointing)"
        for verb in ident.refused
        if verb not in STATELESS_REFUSALS
    ]
    return problems


def foreign_ah_problem(gid_hex: str) -> str:
    return f"a UD address handle points to GID {gid_text(gid_hex)}, which no rank of the job holds"


def foreign_peer_problem(qpn: int, qp_type: int, peer_gid: str, peer_qpn: int) -> str:
    return (
        f"{QP_TYPES.get(qp_type, qp_type)} QP {qpn} is connected to GID {gid_text(peer_gid)} QPN {peer_qpn}, "
        "which no rank of the job holds"
    )


def tcp_problem(sock: TcpSocket, job_addrs: Sequence[IPAddress]) -> str:
    addrs = ", ".join(str(a) for a in sorted(job_addrs, key=lambda a: (a.version, int(a)))) or "none"
    return f"TCP connection {sock.describe()} leads outside the job (job addresses: {addrs})"


def refusal(rank_key: str, pid: int, problems: Sequence[str]) -> str:
    return f"refusing to checkpoint {rank_key} (pid {pid}): " + "; ".join(problems)


# -- readers of /proc --------------------------------------------------------------------


def process_tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """`pid` and all its descendants (CRIU dumps the whole tree)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        try:
            tasks = list((proc / str(p) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
    return tree


def socket_inodes(pid: int, proc: Path = Path("/proc")) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = list((proc / str(pid) / "fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def tcp_sockets_of(pid: int, proc: Path = Path("/proc")) -> list[tuple[int, TcpSocket]]:
    """(owning pid, socket) for every TCP socket held by a process of the tree rooted at `pid`."""
    found = []
    for p in process_tree(pid, proc):
        inodes = socket_inodes(p, proc)
        if not inodes:
            continue
        table: list[TcpSocket] = []
        for name in ("tcp", "tcp6"):
            try:
                table += parse_proc_net_tcp((proc / str(p) / "net" / name).read_text())
            except OSError:
                continue
        found += [(p, s) for s in table if s.inode in inodes]
    return found


def node_addresses(proc: Path = Path("/proc")) -> set[IPAddress]:
    """This node's own addresses (all interfaces, loopback excluded)."""
    addrs: set[IPAddress] = set()
    with contextlib.suppress(OSError):
        addrs |= parse_fib_trie((proc / "net" / "fib_trie").read_text())
    with contextlib.suppress(OSError):
        addrs |= parse_if_inet6((proc / "net" / "if_inet6").read_text())
    return {a for a in addrs if not a.is_loopback}
