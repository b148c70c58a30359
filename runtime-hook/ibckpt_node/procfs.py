"""What this node's /proc says about a process: its tree, its sockets, its device fds and mappings, and
the node's own addresses. The parsers are pure (tested on captured text); the readers look at /proc."""

from __future__ import annotations

import contextlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# /proc/net/tcp states (include/net/tcp_states.h)
TCP_STATES = {
    1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
    7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING",
}  # fmt: skip
TCP_LISTEN = 10
TCP_CLOSE = 7


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


def device_fds_and_maps(pid: int) -> tuple[int, int]:
    """How many /dev/infiniband fds and mappings `pid` holds (0, 0 after a release)."""
    fds = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            fds += os.readlink(fd).startswith("/dev/infiniband/")
        except OSError:
            continue
    maps = sum("/dev/infiniband/" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    return fds, maps


def process_gone(pid: int) -> bool:
    """The process has exited: no /proc entry, or a zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] in (["Z"], ["X"])
