"""The node agent's per-node driver: takes this node's ranks through a checkpoint or a restore.

Checkpoint: quiesce -> drain -> release -> CRIU dump -> (rebuild -> resume | stop), with a
coordinator barrier after each phase so every node is at the same cut. Restore: CRIU restore
-> rebuild -> resume. Any failure before the dump is committed aborts the session; every
node then brings its ranks back to running where they are, and the application continues.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ibckpt.agentapi import Milestone, Mode, PhaseTimeouts
from ibckpt.coordination.client import (
    CoordinationAborted,
    CoordinationTimedOut,
    CoordinatorClient,
    CoordinatorError,
)
from ibckpt.coordination.ranks import RankId
from ibckpt_native.control import ControlError, ShimControl
from ibckpt_node import container_runtime, criu, failpoints, preflight, priority, stuck, tcp_remap

log = logging.getLogger(__name__)

T = TypeVar("T")
REPLY_LIMIT = 64 * 1024 * 1024  # a status or rebuild reply lists every QP of the rank
SHIM_CLOSES_S = 0.2  # after a renewal's reply, time for the shim's control thread to close its end


# A barrier that marks no rank's progress: every node holds its restored TCP connections before any
# node restores a rank (tcp_remap.py).
LOCKED = "locked"


@dataclass(frozen=True)
class NodeSettings:
    """This node's own knobs; the per-phase bounds come with the request (ibckpt.agentapi.PhaseTimeouts)."""

    # How long the shim polls for in-flight sends to complete. A send can stay pending
    # (its receiver is quiesced too and posts no receives); the peers' counters settle it
    # at rebuild, so the drain only needs to catch what completes promptly.
    drain_settle_s: float = 3.0
    # No completion for this long, with only sends the rebuild can settle left, ends the drain.
    drain_stall_ms: int = 20
    barrier_slack_s: float = 30.0  # how long a node waits for the slowest other node
    # Preflight asks whether a key was published once every node has published its own (after
    # a barrier): a key that is not there by then never comes, so the wait can be short.
    preflight_lookup_s: float = 1.0
    # The shim's lease (docs/native-shim.md, "Lease"): while the agent holds a rank out of
    # running it renews it this often, for this long; a rank whose agent died resumes on its
    # own (or, released, says it waits). Renewals go on through a dump of any length.
    lease_s: float = 30.0
    lease_renew_s: float = 5.0


@dataclass(frozen=True)
class CutOptions:
    """How the cut (quiesce, drain, release) runs. The defaults are the fast cut; the others
    reproduce the cut as it was before, so a benchmark can measure both side by side."""

    # A barrier after quiesce. Not needed: a rank that drains while a peer is still running
    # sees that peer's sends complete or stall, and rebuild settles the stalled ones either way.
    # The barrier that matters comes after drain: no QP may go to ERR while a peer still waits
    # on it.
    quiesce_barrier: bool = False
    # Release waits for its CQs to stay quiet for 20 ms instead of counting flushes.
    release_quiet: bool = False


@dataclass
class LocalRank:
    """A process on this node that runs under the shim."""

    rank: RankId
    pid: int
    control_path: Path

    @property
    def control(self) -> ShimControl:
        return ShimControl(str(self.control_path))

    async def command(self, line: str, timeout_s: float = 600.0) -> dict[str, Any]:
        """One control command on a fresh connection, as ShimControl does, but on the event loop.

        No thread per rank: on a small node, creating and scheduling one thread per rank next to
        busy-polling ranks cost more than the shim's own quiesce.
        """
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(self.control_path), limit=REPLY_LIMIT), timeout_s
        )
        try:
            writer.write(line.encode() + b"\n")
            await writer.drain()
            raw = await asyncio.wait_for(reader.readline(), timeout_s)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        status, _, body = raw.decode().strip().partition(" ")
        reply: dict[str, Any] = json.loads(body) if body else {}
        if status != "ok":
            raise ControlError(line, reply)
        return reply


@dataclass
class NodeReport:
    node: str
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase, barrier included
    local: dict[str, float] = field(default_factory=dict)  # seconds until this node's part was done
    shim: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # phase -> rank -> report
    images: dict[str, Path] = field(default_factory=dict)
    restored_pids: dict[str, int] = field(default_factory=dict)
    remapped: dict[str, list[str]] = field(default_factory=dict)  # rank -> socket addresses rewritten
    locked: list[str] = field(default_factory=list)  # TCP connections held until every node restored
    boosted: dict[str, int] = field(default_factory=dict)  # phases -> threads run at a raised priority
    outcome: str = ""


class CheckpointFailed(RuntimeError):
    """This node's part failed or the session was aborted; the ranks were brought back if possible."""


class CheckpointRefused(CheckpointFailed):
    """Preflight found state that cannot be saved; no rank was touched."""


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


TREE_MANIFEST = "ibckpt-tree.json"


@dataclass(frozen=True)
class ProcessTree:
    """A process tree dumped and restored as one: a container's processes, ranks and all.

    An MPI job's ranks are children of mpirun or of an orted daemon, connected to them by
    sockets and pipes; CRIU can only carry those if it dumps the whole tree. CRIU restores every
    pid as it was, so the manifest written beside the images names the ranks to rebuild.
    """

    name: str
    root_pid: int
    # A container's tree is dumped by its runtime (runc checkpoint), and restored by it.
    container: container_runtime.RuntimeContainer | None = None


def read_tree_manifest(images: Path) -> tuple[int, list[tuple[RankId, int, Path]]]:
    """The root pid and the ranks (key, pid, control socket) of a dumped process tree."""
    try:
        data = json.loads((images / TREE_MANIFEST).read_text())
        ranks = [(RankId.parse(r["key"]), int(r["pid"]), Path(r["control"])) for r in data["ranks"]]
        return int(data["root_pid"]), ranks
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointFailed(f"{images}: not a dumped process tree ({TREE_MANIFEST}: {exc})") from exc


def process_gone(pid: int) -> bool:
    """The process has exited: no /proc entry, or a zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] in (["Z"], ["X"])


async def _unanswered(r: LocalRank, exc: BaseException, settle_s: float = 0.5) -> str:
    """Why a rank's shim did not answer; a dead process says so (the application lost a rank). A killed
    process resets its control connection while it exits, a moment before it is a zombie: that moment
    is waited for."""
    deadline = time.monotonic() + settle_s
    while not process_gone(r.pid):
        if time.monotonic() > deadline:
            return str(exc)
        await asyncio.sleep(0.05)
    return f"its process is gone ({exc})"


class NodeDriver:
    def __init__(
        self,
        node: str,
        client: CoordinatorClient,
        ranks: Sequence[LocalRank],
        timeouts: PhaseTimeouts | None = None,
        settings: NodeSettings | None = None,
        job_addrs: Sequence[str] | None = None,
        trees: Sequence[ProcessTree] = (),
        boost_nice: int | None = priority.DEFAULT_BOOST_NICE,
        cut: CutOptions | None = None,
        flush_records: Callable[[], Awaitable[None]] | None = None,
        rejoin: Callable[[], Awaitable[CoordinatorClient | None]] | None = None,
        on_milestone: Callable[[Milestone], None] = lambda milestone: None,
    ) -> None:
        """`job_addrs`: the addresses of the job's nodes, which the ranks' TCP connections may
        lead to. None: every node of the session publishes its own interfaces' addresses.
        `trees`: process trees dumped whole, each holding some of `ranks`; a rank in no tree
        is dumped on its own. `boost_nice`: the nice value of the agent's and the ranks' control
        threads while the agent waits on them (priority.py); None leaves priorities alone.
        `flush_records`: waits until every record the shims published has reached the
        coordinator (the proxy answers PUTs before forwarding them); called before the
        rebuild barrier, after which peers may read them without waiting.
        `rejoin`: when the coordinator is lost during an abort (the operator restarted), waits for the
        coordinator the next operator opens for the recovery and returns a client of it (None: none
        came); released ranks can only be rebuilt with their peers through one.
        `on_milestone`: called with each Milestone once every node has passed it (its barrier)."""
        self.node = node
        self.rejoin = rejoin
        self.boost_nice = boost_nice
        self.client = client
        self.ranks = list(ranks)
        self.trees = list(trees)
        self.timeouts = timeouts or PhaseTimeouts()
        self.settings = settings or NodeSettings()
        self.on_milestone = on_milestone
        self.cut = cut or CutOptions()
        self.flush_records = flush_records
        self.job_addrs = None if job_addrs is None else [ipaddress.ip_address(a) for a in job_addrs]
        self.report = NodeReport(node)
        self._leases: asyncio.Task[None] | None = None
        self._renewals: dict[str, asyncio.Task[None]] = {}  # rank key -> its renewal in flight
        self._unrenewed: set[str] = set()  # rank keys CRIU is dumping: no renewal reaches them

    # -- helpers --------------------------------------------------------------------------

    async def _on_all(self, call: Callable[[LocalRank], Awaitable[T]]) -> list[T]:
        """Run a control call on every local rank at once.

        All must be in flight together: a rank's rebuild blocks until its peers on this node
        have published their records.
        """
        return list(await asyncio.gather(*(call(r) for r in self.ranks)))

    async def _each(self, phase: str, line: str, wait_all: bool = True) -> None:
        """Run one shim phase on every local rank in parallel; a failure raises."""
        await self._each_in_turn([(phase, line)], wait_all)

    async def _each_in_turn(self, steps: Sequence[tuple[str, str]], wait_all: bool = True) -> None:
        """Run shim phases one after another on each local rank, all ranks in parallel: a rank
        starts its next phase as soon as its own previous one is done.

        A failure raises once every rank's call is over (`wait_all`): otherwise the abort that
        follows could reach a rank before its next step does (a quiesce after the abort would
        leave it gated). A rank stops taking steps once any has failed; the phase's bound
        cancels the lot if one hangs. Without `wait_all` the first failure raises at once: a
        rebuild waits for its peers' records, which only the abort cuts short.
        """

        failed = False

        async def run(r: LocalRank) -> None:
            nonlocal failed
            for phase, line in steps:
                if failed:  # another rank failed: take no further step, the abort follows
                    return
                try:
                    reply = await r.command(line)
                except (ControlError, OSError) as exc:
                    failed = True
                    raise CheckpointFailed(
                        f"{phase} of {r.rank.key()} (pid {r.pid}) failed: {await _unanswered(r, exc)}"
                    ) from exc
                except BaseException:
                    failed = True
                    raise
                failed = failed or reply.get("ok") is False
                self.report.shim.setdefault(phase, {})[r.rank.key()] = reply
                if reply.get("ok") is False:
                    raise CheckpointFailed(f"{phase} of {r.rank.key()} (pid {r.pid}) failed: {reply}")
                await failpoints.reached(f"after-{phase}", r.rank.key())

        if not wait_all:
            await self._on_all(run)
            return
        results = await asyncio.gather(*(run(r) for r in self.ranks), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _phase(
        self, name: Milestone | str, work: Callable[[], Awaitable[None]], bound_s: float
    ) -> None:
        """Run this node's part of a phase within its bound, then wait at the barrier `name` for every
        node: once past it, every node has passed milestone `name`."""
        started = time.monotonic()
        try:
            await asyncio.wait_for(work(), bound_s)
        except TimeoutError:
            # The log gets every thread; the message, which every node sees, the shim's threads.
            log.error(
                "%s: %s did not finish within %gs; %s", self.node, name, bound_s, self._where_ranks_wait()
            )
            where = self._where_ranks_wait(priority.SHIM_THREAD_PREFIX)
            raise CheckpointFailed(
                f"{self.node}: {name} did not finish within {bound_s:g}s ({where})"
            ) from None
        except (ControlError, OSError, criu.CriuError, tcp_remap.RemapError) as exc:
            # A failed dump leaves the ranks released (CRIU resumes the frozen tasks): this
            # must take the abort path, which rebuilds them, like any other phase failure.
            raise CheckpointFailed(f"{self.node}: {name} failed: {exc}") from exc
        self.report.local[name] = time.monotonic() - started
        await self.client.barrier(name, timeout=bound_s + self.settings.barrier_slack_s)
        self._passed(name, started)

    def _passed(self, name: Milestone | str, started: float) -> None:
        self.report.phases[name] = time.monotonic() - started
        log.info("%s: %s done in %.3fs", self.node, name, self.report.phases[name])
        if isinstance(name, Milestone):
            self.on_milestone(name)

    def _where_ranks_wait(self, prefix: str = "") -> str:
        """Each local rank's threads (whose names start with `prefix`) and where they wait."""
        return "; ".join(f"{r.rank.key()} {stuck.describe_process(r.pid, prefix)}" for r in self.ranks)

    @contextlib.contextmanager
    def _boosted(self, phases: str) -> Iterator[None]:
        with priority.boosted([r.pid for r in self.ranks], self.boost_nice) as tids:
            self.report.boosted[phases] = len(tids)
            yield

    async def _rebuild_and_resume(self, epoch: int) -> None:
        t = self.timeouts
        with self._boosted("rebuild"):
            await self._phase(Milestone.REBUILT, lambda: self._rebuild_all(epoch), t.rebuild_seconds)
            await self._phase(Milestone.RESUMED, lambda: self._each("resume", "resume"), t.rebuild_seconds)

    async def _rebuild_all(self, epoch: int) -> None:
        line = f"rebuild {epoch} {self._ms(self.timeouts.rebuild_seconds)}"
        await self._each("rebuild", line, wait_all=False)
        if self.flush_records is not None:
            await self.flush_records()

    @staticmethod
    def _ms(seconds: float) -> int:
        return max(1, int(seconds * 1000))

    # -- the shims' leases ----------------------------------------------------------------

    def _start_leases(self) -> None:
        """Renew every held rank's lease until _stop_leases; ranks added later (a restore) too."""
        if self._leases is None or self._leases.done():
            self._leases = asyncio.create_task(self._renew_leases(), name=f"{self.node} leases")

    async def _renew_leases(self) -> None:
        line = f"lease {self._ms(self.settings.lease_s)}"
        # one renewal in flight per rank: a rank busy with a long command (its rebuild) delays
        # only its own, and the shim does not count a command's time against the lease
        inflight = self._renewals

        async def renew(r: LocalRank) -> None:
            try:
                await r.command(line, self.settings.lease_s)
            except (ControlError, OSError, TimeoutError, ValueError) as exc:
                log.warning("%s: lease renewal of %s (pid %d): %s", self.node, r.rank.key(), r.pid, exc)

        try:
            while True:
                await asyncio.sleep(self.settings.lease_renew_s)
                for r in list(self.ranks):
                    task = inflight.get(r.rank.key())
                    if (task is None or task.done()) and r.rank.key() not in self._unrenewed:
                        inflight[r.rank.key()] = asyncio.create_task(renew(r))
        finally:
            for task in inflight.values():
                task.cancel()

    @contextlib.asynccontextmanager
    async def _unrenewed_while_dumped(self, ranks: Sequence[LocalRank]) -> AsyncIterator[None]:
        """No lease renewal reaches these ranks while CRIU dumps them. The shim accepts each renewal on a
        socket of the agent's network namespace (a unix socket's accepted end is made in the connecting
        side's), and CRIU, looking for the container's sockets in the container's, failed the dump with
        `Unix socket ... not found` when one was open at the freeze. A released rank whose lease runs out
        only says so, so a long dump costs nothing."""
        keys = {r.rank.key() for r in ranks}
        self._unrenewed |= keys
        inflight = [t for k, t in self._renewals.items() if k in keys and not t.done()]
        if inflight:
            await asyncio.gather(*inflight, return_exceptions=True)
            await asyncio.sleep(SHIM_CLOSES_S)
        try:
            yield
        finally:
            self._unrenewed -= keys

    async def _stop_leases(self) -> None:
        task, self._leases = self._leases, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def end_leases(self) -> None:
        """The session ends: stop renewing. Ranks left held (a Hold checkpoint) are handed over
        with `lease 0`: they wait, with no bound, for a restore session or a kill."""
        held = self._leases is not None
        await self._stop_leases()
        if not held:
            return

        async def hand_over(r: LocalRank) -> None:
            try:
                await r.command("lease 0", self.settings.lease_s)
            except (ControlError, OSError, TimeoutError, ValueError) as exc:
                log.warning("%s: could not end the lease of %s: %s", self.node, r.rank.key(), exc)

        await self._on_all(hand_over)

    # -- checkpoint -----------------------------------------------------------------------

    async def checkpoint(self, mode: Mode, images_root: Path, epoch: int) -> NodeReport:
        t = self.timeouts
        committed = False
        touched = False
        try:
            # Every node is connected and ready before any rank is gated, so a node that is
            # late (or never comes) does not leave the others' ranks stalled; "checkpoint
            # requested" is measured from here. Before it, each node publishes what preflight
            # asks about: its ranks' QPs and (by default) its addresses.
            # Raised priority for the cut, back to normal before the dump (CRIU saves it).
            with self._boosted("cut"):
                await self._preflight()
                touched = True
                self._start_leases()  # from the first quiesce until resume, abort or the kill
                await self._cut()
            self._check_released()
            await self._phase(Milestone.DUMPED, lambda: self._dump_all(mode, images_root), t.dump_seconds)
            committed = True
            if mode is Mode.STOP:
                self.report.outcome = "Stopped"
                return self.report
            if mode is Mode.HOLD:
                # still held: the renewals go on until the session ends (end_leases)
                self.report.outcome = "Held"
                return self.report
            await self._rebuild_and_resume(epoch)
            self.report.outcome = "Succeeded"
            return self.report
        except (CheckpointFailed, CoordinatorError, OSError) as exc:
            # OSError: whatever else went wrong on this node once ranks were touched must abort too
            if not touched:
                await self._abort_untouched(exc)
                mine = isinstance(exc, CheckpointRefused)
                raise CheckpointRefused(f"{self.node}: {exc}" if mine else str(exc)) from exc
            if not committed:
                await self._abort_and_recover(exc, epoch)
            raise CheckpointFailed(str(exc)) from exc
        finally:
            if self.report.outcome != "Held":
                await self._stop_leases()

    async def _cut(self) -> None:
        """Quiesce, drain and release every local rank, with a barrier after drain and release."""
        t = self.timeouts
        quiesce = ("quiesce", f"quiesce {self._ms(t.quiesce_seconds)}")
        drain = ("drain", f"drain {self._ms(self.settings.drain_settle_s)} {self.settings.drain_stall_ms}")
        if self.cut.quiesce_barrier:
            await self._phase(Milestone.QUIESCED, lambda: self._each(*quiesce), t.quiesce_seconds)
            await self._phase(Milestone.DRAINED, lambda: self._each(*drain), t.drain_seconds)
        else:
            both = t.quiesce_seconds + t.drain_seconds
            await self._phase(Milestone.DRAINED, lambda: self._each_in_turn([quiesce, drain]), both)
        release = f"release {self._ms(t.release_seconds)}" + (" quiet" if self.cut.release_quiet else "")
        await self._phase(Milestone.RELEASED, lambda: self._each("release", release), t.release_seconds)

    # -- preflight ------------------------------------------------------------------------

    async def _preflight(self) -> None:
        """Refuse, before any rank is gated, what a checkpoint cannot carry (see preflight.py)."""
        t = self.timeouts
        started = time.monotonic()
        try:
            statuses = await asyncio.wait_for(
                self._on_all(lambda r: r.command("status", t.quiesce_seconds)), t.quiesce_seconds
            )
        except (ControlError, OSError, TimeoutError) as exc:
            raise CheckpointRefused(f"preflight: a rank's shim did not answer status: {exc}") from exc
        idents = [preflight.ShimIdentity.from_status(s) for s in statuses]
        self._tree_members()  # refuses a rank that no process tree holds
        own_addrs = preflight.node_addresses()
        keys = [k for ident in idents for k in ident.own_keys()]
        if self.job_addrs is None:
            keys += [preflight.addr_key(a) for a in own_addrs]
        await asyncio.gather(*(self.client.put(k, b"1") for k in keys))
        barrier_s = t.quiesce_seconds + self.settings.barrier_slack_s
        await self.client.barrier(Milestone.JOINED, timeout=barrier_s)
        self.on_milestone(Milestone.JOINED)

        problems = await asyncio.gather(
            *(self._rank_problems(r, ident, own_addrs) for r, ident in zip(self.ranks, idents, strict=True))
        )
        refusals = [
            preflight.refusal(r.rank.key(), r.pid, found)
            for r, found in zip(self.ranks, problems, strict=True)
            if found
        ]
        # A process tree is dumped whole: its launcher's or daemon's connections move too.
        for tree in self.trees:
            found = await self._tcp_problems(tree.root_pid, own_addrs)
            if found:
                refusals.append(preflight.refusal(f"process tree {tree.name}", tree.root_pid, found))
        self.report.local[Milestone.ADMITTED] = time.monotonic() - started
        if refusals:
            raise CheckpointRefused(" | ".join(refusals))  # the coordinator's abort adds our name
        await self.client.barrier(Milestone.ADMITTED, timeout=barrier_s)
        self._passed(Milestone.ADMITTED, started)

    async def _published(self, key: str) -> bool:
        try:
            await self.client.get(key, timeout=self.settings.preflight_lookup_s)
        except CoordinationTimedOut:
            return False
        return True

    async def _rank_problems(
        self, r: LocalRank, ident: preflight.ShimIdentity, own_addrs: set[preflight.IPAddress]
    ) -> list[str]:
        found = preflight.shim_problems(ident)
        own = set(ident.own_keys())
        peers = [p for p in ident.peers if preflight.qp_key(p[2], p[3]) not in own]
        known = await asyncio.gather(*(self._published(preflight.qp_key(p[2], p[3])) for p in peers))
        found += [preflight.foreign_peer_problem(*p) for p, ok in zip(peers, known, strict=True) if not ok]
        # UD: every address handle must point at a GID some rank of the job holds.
        ah_gids = [g for g in ident.ah_gids if g not in ident.gids]
        known = await asyncio.gather(*(self._published(preflight.gid_key(g)) for g in ah_gids))
        found += [preflight.foreign_ah_problem(g) for g, ok in zip(ah_gids, known, strict=True) if not ok]
        return found + await self._tcp_problems(r.pid, own_addrs)

    async def _tcp_problems(self, pid: int, own_addrs: set[preflight.IPAddress]) -> list[str]:
        """The TCP connections of the tree rooted at `pid` that lead outside the job."""
        sockets = await asyncio.to_thread(preflight.tcp_sockets_of, pid)
        if self.job_addrs is not None:
            job = list(self.job_addrs)
            outside = preflight.outside_connections((s for _, s in sockets), job)
        else:
            candidates = preflight.outside_connections((s for _, s in sockets), own_addrs)
            remotes = sorted({preflight.unmapped(s.remote) for s in candidates}, key=str)
            published = await asyncio.gather(*(self._published(preflight.addr_key(a)) for a in remotes))
            job = sorted(own_addrs | {a for a, ok in zip(remotes, published, strict=True) if ok}, key=str)
            outside = preflight.outside_connections(candidates, job)
        return [preflight.tcp_problem(s, job) for s in outside]

    async def _abort_untouched(self, cause: Exception) -> None:
        """Refused before any rank was gated: tell every node; the ranks keep running as they were."""
        log.warning("%s: refusing the checkpoint: %s", self.node, cause)
        if not isinstance(cause, CoordinationAborted):
            with contextlib.suppress(CoordinatorError):
                await self.client.abort(str(cause))
        self.report.outcome = "Refused"

    def _tree_members(self) -> dict[str, list[LocalRank]]:
        """Which ranks each process tree holds; a rank outside every tree is refused here."""
        members: dict[str, list[LocalRank]] = {t.name: [] for t in self.trees}
        below = {t.name: set(preflight.process_tree(t.root_pid)) for t in self.trees}
        for r in self.ranks:
            inside = [name for name, pids in below.items() if r.pid in pids]
            if self.trees and not inside:
                raise CheckpointRefused(
                    f"{r.rank.key()} (pid {r.pid}) is in none of the process trees "
                    f"{', '.join(f'{t.name} (root {t.root_pid})' for t in self.trees)}"
                )
            if inside:
                members[inside[0]].append(r)
        return members

    def _check_released(self) -> None:
        # Every process of a tree goes into the image: none may hold the device either.
        processes: dict[int, str] = {}
        for t in self.trees:
            processes |= dict.fromkeys(preflight.process_tree(t.root_pid), f"process tree {t.name}")
        ranks = {r.pid: r.rank.key() for r in self.ranks}
        processes |= ranks  # a rank is named as itself
        for pid, who in processes.items():
            try:
                fds, maps = device_fds_and_maps(pid)
            except OSError as exc:
                if pid in ranks:  # the application lost a rank after its release
                    raise CheckpointFailed(f"{who} (pid {pid}): its process is gone ({exc})") from exc
                continue  # a tree's other process that ended holds nothing
            if fds or maps:
                raise CheckpointFailed(
                    f"{who} (pid {pid}) still holds {fds} device fds and {maps} device "
                    "mappings after release; refusing to dump"
                )

    async def _dump_all(self, mode: Mode, images_root: Path) -> None:
        options = criu.DumpOptions(leave_running=mode is not Mode.STOP)
        members = self._tree_members()
        for t in self.trees:  # one CRIU at a time: each freezes and walks a whole tree
            images = images_root / t.name
            if t.container is not None:
                upper = container_runtime.upper_dir(t.root_pid)  # before Stop's dump ends the container
                shm = container_runtime.shm_dir(t.container)
                dump = functools.partial(container_runtime.checkpoint, t.container)
                try:
                    async with self._unrenewed_while_dumped(members[t.name]):
                        await asyncio.to_thread(dump, images, options, self.timeouts.dump_seconds)
                except criu.CriuError as exc:
                    gone = [r.rank.key() for r in members[t.name] if process_gone(r.pid)]
                    why = f" (the process of {', '.join(gone)} is gone)" if gone else ""
                    raise CheckpointFailed(f"dump of container {t.name}{why} failed: {exc}") from exc
                # after the dump: with Stop nothing writes any more (LeaveRunning: see docs/node-agent.md)
                await asyncio.to_thread(container_runtime.save_rootfs_diff, upper, images)
                await asyncio.to_thread(container_runtime.save_shm, shm, images)
            else:
                async with self._unrenewed_while_dumped(members[t.name]):
                    dump_s = self.timeouts.dump_seconds
                    await asyncio.to_thread(criu.dump, t.root_pid, images, options, dump_s)
            manifest: dict[str, Any] = {
                "root_pid": t.root_pid,
                "ranks": [
                    {"key": r.rank.key(), "pid": r.pid, "control": str(r.control_path)}
                    for r in members[t.name]
                ],
            }
            if t.container is not None:  # the runtime restores it, with matching options
                manifest["runtime"] = "runc"
                manifest["restore_args"] = container_runtime.restore_args(options)
            (images / TREE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            for r in members[t.name]:
                self.report.images[r.rank.key()] = images
        for r in [] if self.trees else self.ranks:  # with trees, preflight put every rank in one
            images = images_root / r.rank.key().replace("/", "_")
            async with self._unrenewed_while_dumped([r]):
                await asyncio.to_thread(criu.dump, r.pid, images, options, self.timeouts.dump_seconds)
            self.report.images[r.rank.key()] = images

    async def _abort_and_recover(self, cause: Exception, epoch: int) -> None:
        """Tell every node, then bring this node's ranks back to running from wherever they are."""
        log.warning("%s: aborting checkpoint: %s", self.node, cause)
        if not isinstance(cause, CoordinationAborted) and not self.client.lost:
            # Already aborted by someone else, or the coordinator is gone: recover regardless.
            with contextlib.suppress(CoordinatorError):
                await self.client.abort(str(cause))

        async def reopen(r: LocalRank) -> tuple[dict[str, Any] | None, bool]:
            """The rank's abort reply, or whether it is released (it needs a rebuild with its peers)."""
            try:
                return await r.command("abort"), False
            except (ControlError, OSError, TimeoutError) as exc:
                if isinstance(exc, ControlError) and exc.reply.get("state") == "released":
                    return None, True
                log.error("%s: could not resume %s: %s", self.node, r.rank.key(), exc)
                return None, False

        first = await self._on_all(reopen)
        replies = [reply for reply, _ in first]
        released = [i for i, (_, is_released) in enumerate(first) if is_released]
        if released and self.client.lost and not await self._rejoin_for([self.ranks[i] for i in released]):
            released = []  # no coordinator to rebuild through: they wait, released, for a restore

        async def rebuild(r: LocalRank) -> dict[str, Any] | None:
            # The real resources are gone: rebuild with the peers (all of this node's released ranks
            # at once: they wait for each other's records).
            try:
                await r.command(f"rebuild {epoch} {self._ms(self.timeouts.rebuild_seconds)}")
                return await r.command("resume")
            except (ControlError, OSError, TimeoutError) as exc:
                log.error("%s: could not rebuild %s: %s", self.node, r.rank.key(), exc)
                return None

        rebuilt = await asyncio.gather(*(rebuild(self.ranks[i]) for i in released))
        for i, reply in zip(released, rebuilt, strict=True):
            replies[i] = reply
        for r, reply in zip(self.ranks, replies, strict=True):
            if reply is not None:
                self.report.shim.setdefault("abort", {})[r.rank.key()] = reply
        self.report.outcome = "Aborted"

    async def recover(self, cause: str, epoch: int) -> NodeReport:
        """The abort of a session whose checkpoint() is over or was never run here: its Stop or Hold
        ranks wait released, or its agent died. Each rank comes back from wherever it is, released
        ones rebuilt with their peers through this driver's coordinator."""
        self._start_leases()
        try:
            await self._abort_and_recover(CheckpointFailed(cause), epoch)
        finally:
            await self._stop_leases()
        return self.report

    async def _rejoin_for(self, released: list[LocalRank]) -> bool:
        """The coordinator is gone and some ranks are released: wait for the one the next operator
        opens for the recovery (their rebuild exchanges records through it). False: none came."""
        keys = ", ".join(r.rank.key() for r in released)
        if self.rejoin is None:
            log.error("%s: %s released and the coordinator is gone: they wait for a rebuild", self.node, keys)
            return False
        log.warning("%s: the coordinator is gone; %s wait for the operator's recovery", self.node, keys)
        client = await self.rejoin()
        if client is None:
            log.error("%s: no coordinator came for the recovery; %s stay released", self.node, keys)
            return False
        self.client = client
        log.info("%s: rejoined the session through the operator's new coordinator", self.node)
        return True

    # -- restore --------------------------------------------------------------------------

    async def rebuild_restored(
        self,
        restored: Callable[[], Awaitable[list[LocalRank]]],
        epoch: int,
        lock: tcp_remap.ConnectionLock | None = None,
    ) -> NodeReport:
        """Ranks whose containers the runtime restores (runc restore, when containerd creates
        them from staged images): wait for `restored` to find them, then rebuild and resume with
        the peers. The barriers are those of restore(), so nodes of either kind meet. `lock` holds
        the restored TCP connections (installed at staging); it is let go once every node restored."""
        t = self.timeouts

        async def arrive() -> None:
            self.ranks.extend(await restored())
            for r in self.ranks:
                self.report.restored_pids[r.rank.key()] = r.pid

        if lock is not None:
            self.report.locked = [c.describe() for c in lock.connections]
        self._start_leases()  # restored ranks come back released
        try:
            await self._phase(LOCKED, lambda: asyncio.sleep(0), t.restore_seconds)
            try:
                await self._phase(Milestone.RESTORED, arrive, t.restore_seconds)
            finally:
                for error in await asyncio.to_thread(lock.unlock) if lock is not None else ():
                    log.error("%s: %s", self.node, error)
            await self._rebuild_and_resume(epoch)
        finally:
            await self._stop_leases()
        self.report.outcome = "Succeeded"
        return self.report

    async def restore(
        self,
        images: dict[str, Path],
        control_paths: dict[str, Path],
        epoch: int,
        rejoin: Sequence[LocalRank] = (),
        remap: tcp_remap.AddressMap | None = None,
        trees: Sequence[Path] = (),
    ) -> NodeReport:
        """Restore this node's ranks from their images, then rebuild toward the peers and resume.

        `rejoin` are ranks that stayed on this node, held released by a Hold checkpoint: they
        rebuild in the same epoch, toward the moved peers' new ids, and resume with them.
        `remap` ({old: new} address, the same on every node) rewrites the images' TCP sockets
        before CRIU restores them, so connections between ranks that moved follow them.
        `trees` are image dirs of whole process trees (ProcessTree); their manifests name the
        ranks inside, which CRIU restores with their pids.
        """
        t = self.timeouts
        for r in rejoin:
            fds, maps = device_fds_and_maps(r.pid)
            state = (await r.command("status", t.quiesce_seconds)).get("state")
            if state != "released" or fds or maps:
                raise CheckpointFailed(
                    f"{r.rank.key()} (pid {r.pid}) cannot rejoin: state {state!r}, "
                    f"{fds} device fds, {maps} device mappings (a Hold checkpoint leaves it released)"
                )
        self.ranks.extend(rejoin)

        lock = tcp_remap.ConnectionLock([])

        manifests = {tree: read_tree_manifest(tree) for tree in trees}

        async def prepare_all() -> None:
            # Rewrite the images' socket addresses, then hold the arriving TCP connections
            # (drop their packets) until every node has restored: see tcp_remap.py.
            for key, image_dir in [*images.items(), *((str(t), t) for t in trees)]:
                prepared = await asyncio.to_thread(tcp_remap.prepare_images, image_dir, remap or {})
                if prepared.changes:
                    self.report.remapped[key] = prepared.changes
                lock.connections += prepared.connections
            self.report.locked = [c.describe() for c in lock.connections]
            await asyncio.to_thread(lock.lock)

        async def restore_all() -> None:
            for key, image_dir in images.items():
                result = await asyncio.to_thread(criu.restore, image_dir, t.restore_seconds)
                self.report.restored_pids[key] = result.pid
                self.ranks.append(LocalRank(RankId.parse(key), result.pid, control_paths[key]))
            for tree, (root_pid, inside) in manifests.items():
                result = await asyncio.to_thread(criu.restore, tree, t.restore_seconds)
                if result.pid != root_pid:
                    raise CheckpointFailed(f"{tree}: CRIU restored root pid {result.pid}, not {root_pid}")
                for rank, pid, control in inside:
                    self.report.restored_pids[rank.key()] = pid
                    self.ranks.append(LocalRank(rank, pid, control))

        self._start_leases()  # the rejoining ranks and, once restored, the others (released)
        try:
            try:
                await self._phase(LOCKED, prepare_all, t.restore_seconds)
                await self._phase(Milestone.RESTORED, restore_all, t.restore_seconds)
            finally:
                for error in await asyncio.to_thread(lock.unlock):
                    log.error("%s: %s", self.node, error)
            await self._rebuild_and_resume(epoch)
        finally:
            await self._stop_leases()
        self.report.outcome = "Succeeded"
        return self.report
