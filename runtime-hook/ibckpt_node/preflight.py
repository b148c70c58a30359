"""Preflight: refuse a checkpoint that cannot be saved, before any rank is touched.

A rank cannot be checkpointed and restored faithfully when it holds state that lives outside
the job: a TCP connection to a peer that is not one of the job's nodes (its other end is not
dumped with it), a QP connected to a (GID, QPN) that no rank of the job holds (a storage
server, say: it would never rebuild toward us), or a verb or QP type the shim refused (the
application may rely on what it could not get). The node driver runs these checks on every
local rank before `quiesce`; a refusal names the rank, its pid and the resource, and goes
through the coordinator's abort so that every node refuses.

And a checkpoint whose images would not fit on this node's disk is refused too, rather than failing
its dump after the cut: the images of a process are about its resident memory, so the estimate is
the sum of VmRSS over every process dumped (each tree's, or each lone rank's), plus a margin
(`image_estimate`), against the free space where the images go; twice the resident memory with
pre-dumps, whose images stay until the final dump, which may hold every page again. Where the images go
is a tmpfs (a diskless node's root), their pages count in the agent's own memory cgroup and cannot be
written back: they must also fit in what its limit leaves, or the agent is killed mid-dump. A restore's
staging is held to the same rules before it fetches anything (`restore_room_problem`), the size being
that of the checkpoint's files it stages.

The decisions here are pure (in or out of the job, fits or not; procfs.py reads /proc); Preflight, at
the bottom, runs them on this node's ranks with the other nodes, through the coordinator.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ibckpt.coordination.client import CoordinationTimedOut, CoordinatorClient
from ibckpt.coordination.keys import gid_key, qp_key
from ibckpt.vocabulary import Milestone
from ibckpt_native.control import ControlError, ShimStatus
from ibckpt_node import qpn_reserve
from ibckpt_node.errors import CheckpointRefused
from ibckpt_node.procfs import (
    TCP_CLOSE,
    TCP_LISTEN,
    IPAddress,
    TcpSocket,
    node_addresses,
    process_tree,
    tcp_sockets_of,
    unmapped,
)
from ibckpt_node.ranks import LocalRank, on_all
from ibckpt_node.trees import ProcessTree, tree_members

if TYPE_CHECKING:  # the store (boto3) is imported only where a restore stages
    from ibckpt.store.manifest import FileRecord

log = logging.getLogger(__name__)

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
    def from_status(cls, status: ShimStatus) -> ShimIdentity:
        return cls(
            # an unset GID table entry reads as all zeros: not an identity
            gids=tuple(g for g in status.gids if int(g, 16) != 0),
            qpns=tuple(qpn for qpn, _ in status.qps),
            qp_types=dict(status.qps),
            peers=status.peers,
            refused=status.unsupported,
            ah_gids=tuple(sorted(set(status.ah_gids))),
        )

    def key_count(self) -> int:
        """How many keys own_keys() publishes, counted before they are made."""
        return len(self.gids) * (len(self.qpns) + 1)

    def own_keys(self) -> list[str]:
        return [qp_key(g, q) for g in self.gids for q in self.qpns] + [gid_key(g) for g in self.gids]


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


def not_running(r: LocalRank, status: ShimStatus) -> str | None:
    """The refusal of a rank an earlier session left out of running: gating it again would fail at
    quiesce, after its healthy peers were gated for nothing. A released one waits for a rebuild its
    peers never joined (docs/failures.md)."""
    if status.state in (None, "running"):
        return None
    why = f"its shim is {status.state}, not running, since an earlier session"
    if status.state == "released":
        why += "; it waits for a rebuild with its peers that may never come: restore the job from its last"
        why += " checkpoint"
    return refusal(r.rank.key(), r.pid, [why])


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


SHOWN_PROBLEMS = 8  # per rank in a refusal: it ends up in a status and an Event


def refusal(rank_key: str, pid: int, problems: Sequence[str]) -> str:
    shown = list(problems[:SHOWN_PROBLEMS])
    if len(problems) > SHOWN_PROBLEMS:
        shown.append(f"and {len(problems) - SHOWN_PROBLEMS} more")
    return f"refusing to checkpoint {rank_key} (pid {pid}): " + "; ".join(shown)


# Coordinator keys one node's preflight may publish (a rank's GIDs x its QPs, and its GIDs): a busy
# node (8 ranks x 4 GIDs x 8,192 QPs) stays under it; a shim's claim of more is refused, not sent.
MAX_PREFLIGHT_KEYS = 1 << 18


def too_many_keys(ranks: Sequence[LocalRank], idents: Sequence[ShimIdentity]) -> str | None:
    """Why this node's ranks would publish too many preflight keys, naming the rank that lists most;
    None when they would not."""
    counts = [ident.key_count() for ident in idents]
    if sum(counts) <= MAX_PREFLIGHT_KEYS:
        return None
    most = max(range(len(counts)), key=counts.__getitem__)
    ident, r = idents[most], ranks[most]
    return (
        f"refusing to checkpoint on this node: its ranks' shims list GIDs and QPs for {sum(counts)} "
        f"preflight keys, more than {MAX_PREFLIGHT_KEYS}; most from {r.rank.key()} (pid {r.pid}): "
        f"{len(ident.gids)} GIDs x {len(ident.qpns)} QPs"
    )


# -- room on the disk for the images ----------------------------------------------------------

MARGIN_FRACTION = 0.10  # CRIU's own files, page alignment, what the processes touch meanwhile
MARGIN_BYTES = 64 * 1024 * 1024  # the tree manifests, the rootfs diff and /dev/shm archives of small pods


def image_estimate(resident: int) -> int:
    """The bytes the images of processes with `resident` bytes of resident memory may need."""
    return resident + int(resident * MARGIN_FRACTION) + MARGIN_BYTES


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def disk_problem(
    resident: int, processes: int, free: int, where: Path, reserve: int = 0, copies: int = 1
) -> str | None:
    """Why images of `resident` bytes of memory in `processes` processes, `copies` times (2: a pre-dump
    and the final dump), do not fit in `free` bytes at `where` while leaving `reserve` bytes free; None
    when they do."""
    processes_text = f"{processes} process{'' if processes == 1 else 'es'}"
    processes_text += ", twice (a pre-dump and the final dump)" if copies == 2 else ""
    basis = f"{size_text(resident)} resident in {processes_text}"
    return short_of_disk("checkpoint", image_estimate(resident * copies), basis, free, where, reserve)


def short_of_disk(verb: str, need: int, basis: str, free: int, where: Path, reserve: int = 0) -> str | None:
    """Why images of `need` bytes (`basis` and the margin) do not fit in `free` bytes at `where` while
    leaving `reserve` bytes free, for a `verb` ("checkpoint", "restore"); None when they do."""
    if need + reserve <= free:
        return None
    kept = (
        f", of which the agent leaves {size_text(reserve)} ({reserve} bytes) to the node" if reserve else ""
    )
    return (
        f"refusing to {verb} on this node: its images would need about {size_text(need)} ({need} "
        f"bytes: {basis}, plus {MARGIN_FRACTION:.0%} and {MARGIN_BYTES >> 20} MiB) and {where} has "
        f"{size_text(free)} ({free} bytes) free{kept}"
    )


def resident_bytes(pid: int, proc: Path = Path("/proc")) -> int:
    """VmRSS of `pid` (0: it is gone, or a kernel thread)."""
    try:
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            fields = line.split()  # VmRSS:  123456 kB
            return int(fields[1]) * 1024 if len(fields) > 1 and fields[1].isdigit() else 0
    return 0


def dumped_processes(trees: Sequence[ProcessTree], ranks: Sequence[LocalRank]) -> set[int]:
    """Every process the dump will save: each tree's, or without trees each rank's own (trees.dump_all)."""
    roots = [t.root_pid for t in trees] if trees else [r.pid for r in ranks]
    return {pid for root in roots for pid in process_tree(root)}


def existing(path: Path) -> Path:
    """`path` or its nearest parent that exists (the images' directory is made by the dump)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a number near 2**63
PROBE_BYTES = 4 << 20


@dataclass(frozen=True)
class MemoryCgroup:
    """This process's memory cgroup: its limit file (v2's memory.max, v1's memory.limit_in_bytes) and
    the memory.stat key of its anonymous pages (v2's anon, v1's rss); shmem is named alike in both."""

    group: Path
    limit_file: str
    anon_key: str

    def stat(self) -> dict[str, int]:
        lines = (self.group / "memory.stat").read_text().splitlines()
        return {f[0]: int(f[1]) for f in (line.split() for line in lines) if len(f) >= 2 and f[1].isdigit()}

    def limit(self) -> int | None:
        text = (self.group / self.limit_file).read_text().strip()
        return int(text) if text.isdigit() and int(text) < UNLIMITED else None  # "max", v1's huge number

    def held(self) -> int:
        """Its pages no reclaim frees: anonymous memory and tmpfs files."""
        stat = self.stat()
        return stat.get(self.anon_key, 0) + stat.get("shmem", 0)


def memory_cgroup(cgroup_root: Path, self_cgroup: str) -> MemoryCgroup | None:
    """This process's memory cgroup, named in `self_cgroup` (/proc/self/cgroup) under `cgroup_root`:
    v1's "N:memory:/path" under memory/, else v2's "0::/path". A container may see its own cgroup at
    the root instead of at its path. None when there is none to read."""
    lines = self_cgroup.splitlines()
    v1 = next((line.split(":", 2)[2] for line in lines if ":memory:" in line), None)
    v2 = next((line[3:] for line in lines if line.startswith("0::")), None)
    if v1 is not None:
        base, limit_file, anon_key, path = cgroup_root / "memory", "memory.limit_in_bytes", "rss", v1
    elif v2 is not None:
        base, limit_file, anon_key, path = cgroup_root, "memory.max", "anon", v2
    else:
        return None
    for group in (base / path.strip().lstrip("/"), base):
        if (group / limit_file).is_file() and (group / "memory.stat").is_file():
            return MemoryCgroup(group, limit_file, anon_key)
    return None


def written_as_memory(where: Path, cgroup: MemoryCgroup, probe_bytes: int = PROBE_BYTES) -> bool:
    """Whether the files written in `where` are pages of `cgroup`'s shmem: a tmpfs, or an overlay whose
    upper dir is one (the mounts a container sees may not show that). Measured: a probe file is written
    there, the cgroup's shmem read before and after, and the file removed."""
    probe = where / f".ibckpt-memory-probe-{os.getpid()}"
    before = cgroup.stat().get("shmem", 0)
    try:
        with open(probe, "wb") as f:
            f.write(bytes(probe_bytes))
            f.flush()
            grew = cgroup.stat().get("shmem", 0) - before
    finally:
        probe.unlink(missing_ok=True)
    return grew >= probe_bytes // 2


def memory_problem(need: int, limit: int, used: int, where: Path, verb: str = "checkpoint") -> str | None:
    """Why images of `need` bytes on `where`, whose files count in the agent's memory, do not fit in
    what its `limit` leaves after `used`; None when they do."""
    if used + need <= limit:
        return None
    return (
        f"refusing to {verb} on this node: its images would need about {size_text(need)} ({need} bytes) "
        f"on {where}, whose files count in the agent's memory (a tmpfs), and the agent holds "
        f"{size_text(used)} of its {size_text(limit)} limit: raise the chart's "
        "agent.resources.limits.memory or give agent.hostDir a disk (docs/node-agent.md)"
    )


def memory_room_problem(
    need: int, where: Path, verb: str, proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> str | None:
    """Why images of `need` bytes on `where` (it exists) do not fit in the agent's memory limit, when
    that is where its files count (a tmpfs); None when they do, or count elsewhere."""
    cgroup = memory_cgroup(cgroup_root, (proc / "self" / "cgroup").read_text())
    limit = cgroup.limit() if cgroup is not None else None
    if cgroup is None or limit is None or not written_as_memory(where, cgroup):
        return None
    return memory_problem(need, limit, cgroup.held(), where, verb)


def room_problem(
    trees: Sequence[ProcessTree],
    ranks: Sequence[LocalRank],
    images_root: Path,
    reserve: int = 0,
    pre_dumped: bool = False,
    proc: Path = Path("/proc"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> str | None:
    """This node's images would not fit where they go, `reserve` bytes left free, or (on a tmpfs) in
    the agent's memory limit: why, else None."""
    pids = dumped_processes(trees, ranks)
    resident = sum(resident_bytes(pid) for pid in pids)
    where = existing(images_root)
    copies = 2 if pre_dumped else 1
    problem = disk_problem(resident, len(pids), shutil.disk_usage(where).free, where, reserve, copies)
    return problem or memory_room_problem(
        image_estimate(resident * copies), where, "checkpoint", proc, cgroup_root
    )


def restore_bytes(files: Iterable[FileRecord], trees: Iterable[str]) -> int:
    """The bytes a restore stages: the sizes of the checkpoint's files under each of `trees` (a
    container's directory in the checkpoint, picked as download.select_subtree does), once per tree."""
    prefixes = [tree.strip("/") + "/" for tree in trees]
    return sum(r.size for r in files if r.kind == "file" for p in prefixes if r.path.startswith(p))


def restore_room_problem(
    files: Iterable[FileRecord],
    trees: Sequence[str],
    staging: Path,
    proc: Path = Path("/proc"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> str | None:
    """Why the images of `trees` would not fit where they are staged (on its disk, and on a tmpfs in the
    agent's memory limit), with a checkpoint's margin; None when they fit. No disk reserve: they are removed
    once restored."""
    size = restore_bytes(files, trees)
    need, where = image_estimate(size), existing(staging)
    basis = f"{size_text(size)} in the files of {len(trees)} container{'' if len(trees) == 1 else 's'}"
    problem = short_of_disk("restore", need, basis, shutil.disk_usage(where).free, where)
    if problem:
        return f"{problem}: free space there or give agent.hostDir a larger disk (docs/node-agent.md)"
    return memory_room_problem(need, where, "restore", proc, cgroup_root)


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
        images_root: Path | None = None,
        disk_reserve: int = 0,
        pre_dumped: bool = False,
    ) -> None:
        """`images_root`: where this node's images will be written, to check they fit, `disk_reserve`
        bytes left free (None: not on this node's disk, not checked); `pre_dumped`: pre-dump images
        will be there too."""
        self.client = client
        self.ranks = ranks
        self.trees = trees
        self.job_addrs = job_addrs
        self.lookup_s = lookup_s
        self.images_root = images_root
        self.disk_reserve = disk_reserve
        self.pre_dumped = pre_dumped

    async def refusals(self, bound_s: float, barrier_s: float, joined: Callable[[], None]) -> list[str]:
        """What this node refuses (nothing: it may go on), once every node has joined."""
        try:
            answers = await asyncio.wait_for(on_all(self.ranks, lambda r: self._status(r, bound_s)), bound_s)
        except (OSError, TimeoutError) as exc:
            raise CheckpointRefused(f"preflight: a rank's shim did not answer status: {exc}") from exc
        checked = (
            answer if isinstance(answer, str) else not_running(r, answer)
            for r, answer in zip(self.ranks, answers, strict=True)
        )
        bad = [problem for problem in checked if problem]
        if bad:
            raise CheckpointRefused(" | ".join(bad))
        idents = [ShimIdentity.from_status(a) for a in answers if not isinstance(a, str)]
        crowded = too_many_keys(self.ranks, idents)
        if crowded:
            raise CheckpointRefused(crowded)
        said = {r.rank.key(): a for r, a in zip(self.ranks, answers, strict=True) if not isinstance(a, str)}
        clashes = qpn_reserve.plan(said).clashes
        if clashes:
            raise CheckpointRefused(
                f"refusing to checkpoint on this node: {'; '.join(clashes[:3])} (a rebuild would give their "
                "peers one record for both)"
            )
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
        if self.images_root is not None:
            try:
                room = await asyncio.to_thread(
                    room_problem, self.trees, self.ranks, self.images_root, self.disk_reserve, self.pre_dumped
                )
            except OSError as exc:  # not known to be short: the dump says so if it is
                log.warning("preflight: the room for %s is unknown: %s", self.images_root, exc)
                room = None
            if room:
                refusals.append(room)
        return refusals

    @staticmethod
    async def _status(r: LocalRank, bound_s: float) -> ShimStatus | str:
        """The rank's checked status, or the refusal its reply earns (ControlError: an `err`, or a reply
        of the wrong shape or over the bounds)."""
        try:
            return await r.shim.status(bound_s)
        except ControlError as exc:
            return refusal(r.rank.key(), r.pid, [f"its shim's status: {exc}"])

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
