"""Preflight: refuse a checkpoint that cannot be saved, before any rank is touched.

A rank cannot be checkpointed and restored faithfully when it holds state that lives outside
the job: a TCP connection to a peer that is not one of the job's nodes (its other end is not
dumped with it), a QP connected to a (GID, QPN) that no rank of the job holds (a storage
server, say: it would never rebuild toward us), or a verb or QP type the shim refused (the
application may rely on what it could not get). The node driver runs these checks on every
local rank before `quiesce`; a refusal names the rank, its pid and the resource, and goes
through the coordinator's abort so that every node refuses.

The decisions here are pure (in or out of the job; procfs.py reads /proc); Preflight, at the bottom,
runs them on this node's ranks with the other nodes, through the coordinator.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ibckpt.coordination.client import CoordinationTimedOut, CoordinatorClient
from ibckpt.vocabulary import Milestone
from ibckpt_native.control import ControlError
from ibckpt_node.errors import CheckpointRefused
from ibckpt_node.procfs import (
    TCP_CLOSE,
    TCP_LISTEN,
    IPAddress,
    TcpSocket,
    node_addresses,
    tcp_sockets_of,
    unmapped,
)
from ibckpt_node.ranks import LocalRank, on_all
from ibckpt_node.trees import ProcessTree, tree_members

QP_TYPES = {2: "RC", 3: "UC", 4: "UD"}  # the types the shim supports (enum ibv_qp_type)

# Verbs the shim refuses that leave nothing behind in the process: a program that called one
# and carried on holds no state the checkpoint misses (UCX, for one, queries and falls back).
STATELESS_REFUSALS = frozenset({"ibv_query_rt_values_ex", "ibv_get_async_event", "ibv_advise_mr"})


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


# -- the run on this node ----------------------------------------------------------------


class Preflight:
    """Refuse, before any rank is gated, what a checkpoint cannot carry: this node's part, with the
    other nodes' through the coordinator (each publishes what the others ask about)."""

    def __init__(
        self,
        client: CoordinatorClient,
        ranks: Sequence[LocalRank],
        trees: Sequence[ProcessTree],
        job_addrs: list[IPAddress] | None,
        lookup_s: float,
    ) -> None:
        self.client = client
        self.ranks = ranks
        self.trees = trees
        self.job_addrs = job_addrs
        self.lookup_s = lookup_s

    async def refusals(self, bound_s: float, barrier_s: float, joined: Callable[[], None]) -> list[str]:
        """What this node refuses (nothing: it may go on), once every node has joined."""
        try:
            statuses = await asyncio.wait_for(on_all(self.ranks, lambda r: r.shim.status(bound_s)), bound_s)
        except (ControlError, OSError, TimeoutError) as exc:
            raise CheckpointRefused(f"preflight: a rank's shim did not answer status: {exc}") from exc
        idents = [ShimIdentity.from_status(s) for s in statuses]
        tree_members(self.trees, self.ranks)  # refuses a rank that no process tree holds
        own_addrs = node_addresses()
        keys = [k for ident in idents for k in ident.own_keys()]
        if self.job_addrs is None:
            keys += [addr_key(a) for a in own_addrs]
        await asyncio.gather(*(self.client.put(k, b"1") for k in keys))
        await self.client.barrier(Milestone.JOINED, timeout=barrier_s)
        joined()

        problems = await asyncio.gather(
            *(self._rank_problems(r, ident, own_addrs) for r, ident in zip(self.ranks, idents, strict=True))
        )
        refusals = [
            refusal(r.rank.key(), r.pid, found)
            for r, found in zip(self.ranks, problems, strict=True)
            if found
        ]
        # A process tree is dumped whole: its launcher's or daemon's connections move too.
        for tree in self.trees:
            found = await self._tcp_problems(tree.root_pid, own_addrs)
            if found:
                refusals.append(refusal(f"process tree {tree.name}", tree.root_pid, found))
        return refusals

    async def _published(self, key: str) -> bool:
        try:
            await self.client.get(key, timeout=self.lookup_s)
        except CoordinationTimedOut:
            return False
        return True

    async def _rank_problems(self, r: LocalRank, ident: ShimIdentity, own_addrs: set[IPAddress]) -> list[str]:
        found = shim_problems(ident)
        own = set(ident.own_keys())
        peers = [p for p in ident.peers if qp_key(p[2], p[3]) not in own]
        known = await asyncio.gather(*(self._published(qp_key(p[2], p[3])) for p in peers))
        found += [foreign_peer_problem(*p) for p, ok in zip(peers, known, strict=True) if not ok]
        # UD: every address handle must point at a GID some rank of the job holds.
        ah_gids = [g for g in ident.ah_gids if g not in ident.gids]
        known = await asyncio.gather(*(self._published(gid_key(g)) for g in ah_gids))
        found += [foreign_ah_problem(g) for g, ok in zip(ah_gids, known, strict=True) if not ok]
        return found + await self._tcp_problems(r.pid, own_addrs)

    async def _tcp_problems(self, pid: int, own_addrs: set[IPAddress]) -> list[str]:
        """The TCP connections of the tree rooted at `pid` that lead outside the job."""
        sockets = await asyncio.to_thread(tcp_sockets_of, pid)
        if self.job_addrs is not None:
            job = list(self.job_addrs)
            outside = outside_connections((s for _, s in sockets), job)
        else:
            candidates = outside_connections((s for _, s in sockets), own_addrs)
            remotes = sorted({unmapped(s.remote) for s in candidates}, key=str)
            published = await asyncio.gather(*(self._published(addr_key(a)) for a in remotes))
            job = sorted(own_addrs | {a for a, ok in zip(remotes, published, strict=True) if ok}, key=str)
            outside = outside_connections(candidates, job)
        return [tcp_problem(s, job) for s in outside]
