"""The node agent's per-node driver: takes this node's ranks through a checkpoint or a restore.

Checkpoint: quiesce -> drain -> release -> CRIU dump -> (rebuild -> resume | stop), with a
coordinator barrier after each phase so every node is at the same cut. Restore: CRIU restore
-> rebuild -> resume. Any failure once a rank was touched (a shim's reply the agent will not act
on included) aborts the session. In a checkpoint every node then brings its ranks back to running
where they are, and the application continues; a restore's ranks are resumed by no one, and the
operator deletes the pods it restored.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ibckpt.coordination import keys
from ibckpt.coordination.client import CoordinationAborted, CoordinatorClient, CoordinatorError
from ibckpt.coordination.ranks import RankId
from ibckpt.vocabulary import GATED, Milestone, Mode, PhaseSeconds
from ibckpt_native.control import ControlError, ShimStatus, lines
from ibckpt_node import abort, criu, failpoints, itimers, priority, qpn_reserve, stuck, tcp_remap
from ibckpt_node.errors import CheckpointFailed, CheckpointRefused
from ibckpt_node.leases import RankLeases, ms
from ibckpt_node.predumps import forget_rounds, pre_dump_all, usable_parents
from ibckpt_node.preflight import Preflight
from ibckpt_node.procfs import device_fds_and_maps
from ibckpt_node.ranks import LocalRank, NodeReport, on_all, unanswered
from ibckpt_node.settings import CutOptions, NodeSettings
from ibckpt_node.trees import ProcessTree, check_released, dump_all, read_tree_manifest

log = logging.getLogger(__name__)

# A barrier that marks no rank's progress: every node holds its restored TCP connections before any
# node restores a rank (tcp_remap.py).
LOCKED = "locked"


Command = Callable[[LocalRank], Awaitable[dict[str, Any]]]  # one control command to one rank
Step = tuple[str, Command]  # a shim phase's name (its report's key) and its command


class NodeDriver:
    def __init__(
        self,
        node: str,
        client: CoordinatorClient,
        ranks: Sequence[LocalRank],
        timeouts: PhaseSeconds | None = None,
        settings: NodeSettings | None = None,
        job_addrs: Sequence[str] | None = None,
        trees: Sequence[ProcessTree] = (),
        boost_nice: int | None = priority.DEFAULT_BOOST_NICE,
        cut: CutOptions | None = None,
        flush_records: Callable[[], Awaitable[None]] | None = None,
        confine: Callable[[Path, Sequence[str], Sequence[int]], None] | None = None,
        rejoin: abort.Rejoin | None = None,
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
        `confine`: told each rank's control socket, virtual GIDs and QPNs (its `status`) just before the
        rank is asked to rebuild, so its container's records are confined to them (coord_proxy.py).
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
        self.timeouts = timeouts or PhaseSeconds()
        self.settings = settings or NodeSettings()
        self.on_milestone = on_milestone
        self.cut = cut or CutOptions()
        self.flush_records = flush_records
        self.confine = confine
        # restored ranks' image dirs, by rank key: their one-shot itimers, which an older CRIU drops,
        # are armed again before they rebuild (itimers.py); set by whoever restored them
        self.itimer_images: dict[str, Path] = {}
        self.job_addrs = None if job_addrs is None else [ipaddress.ip_address(a) for a in job_addrs]
        self.report = NodeReport(node)
        self.leases = RankLeases(node, self.ranks, self.settings.lease_s, self.settings.lease_renew_s)

    # -- helpers --------------------------------------------------------------------------

    async def _each(self, phase: str, command: Command, wait_all: bool = True) -> None:
        """Run one shim phase on every local rank in parallel; a failure raises."""
        await self._each_in_turn([(phase, command)], wait_all)

    async def _each_in_turn(self, steps: Sequence[tuple[str, Command]], wait_all: bool = True) -> None:
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
            for phase, command in steps:
                if failed:  # another rank failed: take no further step, the abort follows
                    return
                try:
                    reply = await command(r)
                except (ControlError, OSError) as exc:
                    failed = True
                    raise CheckpointFailed(
                        f"{phase} of {r.rank.key()} (pid {r.pid}) failed: {await unanswered(r, exc)}"
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
            await on_all(self.ranks, run)
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
        await self._local(name, work, bound_s)
        await self._meet(name, started, bound_s)

    async def _local(
        self, name: Milestone | str, work: Callable[[], Awaitable[None]], bound_s: float
    ) -> None:
        """This node's part of phase `name`, within its bound."""
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

    async def _meet(self, name: Milestone | str, started: float, bound_s: float) -> None:
        """Wait at the barrier `name` for every node (`started`: when this node's part began)."""
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

    async def _rebuild_and_resume(self, epoch: int, cut_started: float | None = None) -> None:
        t = self.timeouts
        with self._boosted("rebuild"):
            await self._phase(Milestone.REBUILT, lambda: self._rebuild_all(epoch), t.rebuild_seconds)
            resume: Command = lambda r: r.shim.resume()  # noqa: E731

            async def resume_all() -> None:
                await self._each("resume", resume)
                # the ranks run again: the Resumed barrier after this is no part of their pause
                if cut_started is not None:
                    self.report.phases[GATED] = round(time.monotonic() - cut_started, 3)

            await self._phase(Milestone.RESUMED, resume_all, t.rebuild_seconds)

    async def _rebuild_all(self, epoch: int) -> None:
        rebuild_ms = ms(self.timeouts.rebuild_seconds)
        statuses = await qpn_reserve.reserve_round(self.node, self.ranks, self.timeouts.quiesce_seconds)

        async def rebuild(r: LocalRank) -> dict[str, Any]:
            await self._rearm_itimers(r)
            await self._confine(r, statuses.get(r.rank.key()))
            return await r.shim.rebuild(epoch, rebuild_ms)

        await self._each("rebuild", rebuild, wait_all=False)
        if self.flush_records is not None:
            await self.flush_records()

    async def _rearm_itimers(self, r: LocalRank) -> None:
        """A restored rank's one-shot itimers that this node's CRIU dropped: armed with the time they
        had left at the dump, before the rank runs again. A timer that cannot be read is logged and
        left as CRIU restored it: the restore goes on."""
        images = self.itimer_images.pop(r.rank.key(), None)
        if images is None:
            return
        key, bound = r.rank.key(), self.timeouts.quiesce_seconds
        pid = (await r.shim.command("hello", bound)).get("pid")  # its own pid: names its core image
        try:
            if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
                raise ValueError(f"its hello names pid {pid!r}")
            lost = await asyncio.to_thread(itimers.one_shots, images / f"core-{pid}.img")
        except (OSError, ValueError) as exc:
            log.warning("%s: %s: itimers not read from the images: %s", self.node, key, exc)
            return
        for which, us in sorted(lost.items()):
            reply = await r.shim.phase(lines.itimer(which, us), bound)
            self.report.shim.setdefault(f"itimer-{itimers.WHICH[which]}", {})[key] = reply
            log.info("%s: %s: one-shot %s itimer, %.3fs left at the dump: armed %s", self.node, key,
                     itimers.WHICH[which], us / 1e6, reply.get("armed"))  # fmt: skip

    async def _confine(self, r: LocalRank, status: ShimStatus | None = None) -> None:
        """Learn the rank's virtual GIDs and QPs from its `status` (the pairs its rebuild publishes
        records under: native/src/rebuild.c) and confine its container's records to them."""
        if self.confine is not None:
            if status is None:
                status = await r.shim.status(self.timeouts.quiesce_seconds)
            self.confine(r.control_path, status.gids, [qpn for qpn, _ in status.qps])

    def _before_abort_rebuild(self) -> Callable[[LocalRank], Awaitable[None]]:
        """An abort's hook before each released rank's rebuild: the first call reserves QPNs in all of
        this node's ranks (qpn_reserve.py), every call confines its rank."""
        once = asyncio.Lock()
        statuses: dict[str, ShimStatus] = {}
        done = False

        async def before(r: LocalRank) -> None:
            nonlocal done
            async with once:
                if not done:
                    done = True
                    bound = self.timeouts.quiesce_seconds
                    statuses.update(await qpn_reserve.reserve_round(self.node, self.ranks, bound))
            await self._confine(r, statuses.get(r.rank.key()))

        return before

    async def end_leases(self) -> None:
        """The session ends: stop renewing; ranks left held (a Hold checkpoint) are handed over."""
        await self.leases.end()

    # -- checkpoint -----------------------------------------------------------------------

    async def checkpoint(self, mode: Mode, images_root: Path, epoch: int) -> NodeReport:
        t = self.timeouts
        touched = False
        released: asyncio.Task[None] | None = None
        try:
            # Every node is connected and ready before any rank is gated, so a node that is
            # late (or never comes) does not leave the others' ranks stalled; "checkpoint
            # requested" is measured from here. Before it, each node publishes what preflight
            # asks about: its ranks' QPs and (by default) its addresses.
            # Raised priority for the cut, back to normal before the dump (CRIU saves it).
            with self._boosted("cut"):
                await self._preflight(images_root)
                touched = True
                parents = await self._pre_dump(images_root)
                self.leases.start()  # from the first quiesce until resume, abort or the kill
                cut_started = time.monotonic()
                # LeaveRunning: the dump may start before every node has released (see _cut)
                released = await self._cut(meet_released_later=mode is Mode.LEAVE_RUNNING)
            check_released(self.trees, self.ranks)
            dump = lambda: self._dump_meeting(released, mode, images_root, parents)  # noqa: E731
            await self._phase(Milestone.DUMPED, dump, t.dump_seconds)
            if mode is Mode.STOP:
                self.report.outcome = "Stopped"
                return self.report
            if mode is Mode.HOLD:
                # still held: the renewals go on until the session ends (end_leases)
                self.report.outcome = "Held"
                return self.report
            await self._rebuild_and_resume(epoch, cut_started)
            self.report.outcome = "Succeeded"
            return self.report
        except Exception as exc:
            if released is not None:
                released.cancel()
            # Whatever went wrong once ranks were touched must abort: an unexpected error too (a shim
            # runs in the tenant's process; nothing it does may leave ranks quiesced)
            if not isinstance(exc, CheckpointFailed | CoordinatorError | OSError):
                log.exception("%s: unexpected error in the checkpoint", self.node)
                exc = CheckpointFailed(f"{type(exc).__name__}: {exc}")
            if not touched:
                await abort.abort_untouched(self.node, self.client, exc, self.report)
                mine = isinstance(exc, CheckpointRefused)
                raise CheckpointRefused(f"{self.node}: {exc}" if mine else str(exc)) from exc
            # After the dump too: a rebuild or resume that failed (a rank answered garbage, say) leaves
            # ranks rebuilt or released, and the session that fails here takes no later abort.
            await self._abort_and_recover(exc, epoch)
            raise CheckpointFailed(str(exc)) from exc
        finally:
            if self.report.outcome != "Held":
                await self.leases.stop()

    async def _cut(self, meet_released_later: bool = False) -> asyncio.Task[None] | None:
        """Quiesce, drain and release every local rank, with a barrier after drain and release.

        `meet_released_later`: the release's barrier is met in the background (the task returned),
        so this node dumps its ranks while the others release theirs. Safe for a LeaveRunning dump:
        after the drain no rank posts, and a released rank's memory has no QP or MR left for a peer's
        NIC to reach; the Dumped barrier still waits for every node, and a failed release elsewhere
        aborts the session, whose ranks CRIU left running. Not for Stop: its dump ends the ranks,
        which an abort would then not bring back."""
        t, s = self.timeouts, self.settings
        quiesce_ms, settle_ms = ms(t.quiesce_seconds), ms(s.drain_settle_s)
        quiesce: Step = ("quiesce", lambda r: r.shim.quiesce(quiesce_ms))
        drain: Step = ("drain", lambda r: r.shim.drain(settle_ms, s.drain_stall_ms))
        if self.cut.quiesce_barrier:
            await self._phase(Milestone.QUIESCED, lambda: self._each(*quiesce), t.quiesce_seconds)
            await self._phase(Milestone.DRAINED, lambda: self._each(*drain), t.drain_seconds)
        else:
            both = t.quiesce_seconds + t.drain_seconds
            await self._phase(Milestone.DRAINED, lambda: self._each_in_turn([quiesce, drain]), both)
        # Past this point a node may release: an abort must then release and rebuild every rank. The
        # coordinator wrote keys.RELEASING as the barrier passed, for a node that did not hear it did.
        release = lambda: self._each("release", self._release)  # noqa: E731
        if not meet_released_later:
            await self._phase(Milestone.RELEASED, release, t.release_seconds)
            return None
        started = time.monotonic()
        await self._local(Milestone.RELEASED, release, t.release_seconds)
        met = asyncio.ensure_future(self._meet(Milestone.RELEASED, started, t.release_seconds))
        # its failure is read by _dump_meeting, or superseded by the one that ended the checkpoint
        met.add_done_callback(lambda task: task.cancelled() or task.exception())
        return met

    async def _release(self, r: LocalRank) -> dict[str, Any]:
        return await r.shim.release(ms(self.timeouts.release_seconds), self.cut.release_quiet)

    async def _releasing(self) -> bool:
        """Whether any node may have released its ranks: every node drained (its DRAINED barrier
        passed), which this node knows, or else reads from the key a node past it wrote."""
        if Milestone.DRAINED in self.report.phases:  # passed the barrier
            return True
        if Milestone.ADMITTED in self.report.local and Milestone.DRAINED not in self.report.local:
            return False  # the cut ran here and this node never drained: no node passed the barrier
        if self.client.lost:
            return False
        try:
            await self.client.get(keys.RELEASING, self.settings.releasing_lookup_s)
        except (CoordinatorError, OSError):
            return False
        return True

    async def _pre_dump(self, images_root: Path) -> dict[str, Path]:
        """Copy the ranks' memory while they run, before the cut (a phase with a barrier, so that no
        node's ranks wait gated for another node's pre-dumps)."""
        parents: dict[str, Path] = {}
        plugins, bound_s = self.settings.criu_plugins, self.timeouts.dump_seconds
        if not self.settings.pre_dump:
            return parents
        if not plugins:
            log.warning("%s: no CRIU plugin dir for pre-dumps: the trees are dumped in full", self.node)
        trees, ranks = (self.trees, self.ranks) if plugins else ([], [])  # none: only the barrier
        work = functools.partial(
            pre_dump_all, trees, ranks, images_root, bound_s, plugins, self.settings.parallel_dumps, parents,
            self.settings.pre_dump_rounds,
        )  # fmt: skip
        await self._phase(Milestone.PRE_DUMPED, work, bound_s)
        return parents

    async def _dump_meeting(
        self, released: asyncio.Task[None] | None, mode: Mode, images_root: Path, parents: dict[str, Path]
    ) -> None:
        """_dump_all, then the Released barrier met meanwhile (`released`, see _cut). When both fail,
        the barrier's failure (a lost coordinator, an aborted session) is the cause and is raised."""
        try:
            await self._dump_all(mode, images_root, parents)
        except BaseException as exc:
            if released is not None:
                cause = released.exception() if released.done() and not released.cancelled() else None
                released.cancel()
                if cause is not None:
                    raise cause from exc
            raise
        if released is not None:
            await released

    async def _dump_all(self, mode: Mode, images_root: Path, parents: dict[str, Path]) -> None:
        usable = usable_parents(self.trees, self.ranks, self.report.shim.get("release", {}), parents)
        await dump_all(
            self.trees, self.ranks, mode, images_root, self.timeouts.dump_seconds, self.leases,
            self.report.images, self.settings.parallel_dumps, usable,
        )  # fmt: skip
        if parents:
            await asyncio.to_thread(forget_rounds, images_root)

    async def _preflight(self, images_root: Path) -> None:
        """Refuse, before any rank is gated, what a checkpoint cannot carry, or what would not fit on
        this node's disk (see preflight.py)."""
        t = self.timeouts
        started = time.monotonic()
        lookup_s = self.settings.preflight_lookup_s
        check = Preflight(
            self.client, self.ranks, self.trees, self.job_addrs, lookup_s, images_root,
            self.settings.disk_reserve_bytes, self.settings.pre_dump,
        )  # fmt: skip
        barrier_s = t.quiesce_seconds + self.settings.barrier_slack_s
        refusals = await check.refusals(
            t.quiesce_seconds, barrier_s, lambda: self.on_milestone(Milestone.JOINED)
        )
        self.report.local[Milestone.ADMITTED] = time.monotonic() - started
        if refusals:
            raise CheckpointRefused(" | ".join(refusals))  # the coordinator's abort adds our name
        await self.client.barrier(Milestone.ADMITTED, timeout=barrier_s)
        self._passed(Milestone.ADMITTED, started)

    # -- abort (abort.py) -----------------------------------------------------------------

    async def _abort_and_recover(self, cause: Exception, epoch: int) -> None:
        """Tell every node, then bring this node's ranks back to running from wherever they are."""
        rebuild_s = self.timeouts.rebuild_seconds
        release = self._release if await self._releasing() else None
        self.client = await abort.abort_and_recover(
            self.node, self.client, self.ranks, cause, epoch, rebuild_s, self.report, self.rejoin,
            self._before_abort_rebuild(), release,
        )  # fmt: skip

    async def recover(self, cause: str, epoch: int) -> NodeReport:
        """The abort of a session whose checkpoint() is over or was never run here: its Stop or Hold
        ranks wait released, or its agent died. Each rank comes back from wherever it is, released
        ones rebuilt with their peers through this driver's coordinator."""
        self.leases.start()
        try:
            await self._abort_and_recover(CheckpointFailed(cause), epoch)
        finally:
            await self.leases.stop()
        return self.report

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

        async def steps() -> None:
            await self._phase(LOCKED, lambda: asyncio.sleep(0), t.restore_seconds)
            try:
                await self._phase(Milestone.RESTORED, arrive, t.restore_seconds)
            finally:
                for error in await asyncio.to_thread(lock.unlock) if lock is not None else ():
                    log.error("%s: %s", self.node, error)
            await self._rebuild_and_resume(epoch)

        return await self._restoring(steps)  # restored ranks come back released

    async def restore(
        self,
        images: dict[str, Path],
        control_paths: dict[str, Path],
        epoch: int,
        rejoin: Sequence[LocalRank] = (),
        remap: tcp_remap.AddressMap | None = None,
        trees: Sequence[Path] = (),
        before_rebuild: Callable[[Sequence[LocalRank]], Awaitable[None]] | None = None,
    ) -> NodeReport:
        """Restore this node's ranks from their images, then rebuild toward the peers and resume.

        `rejoin` are ranks that stayed on this node, held released by a Hold checkpoint: they
        rebuild in the same epoch, toward the moved peers' new ids, and resume with them.
        `remap` ({old: new} address, the same on every node) rewrites the images' TCP sockets
        before CRIU restores them, so connections between ranks that moved follow them.
        `trees` are image dirs of whole process trees (ProcessTree); their manifests name the
        ranks inside, which CRIU restores with their pids. `before_rebuild` gets the restored ranks
        (not the rejoining ones) before any rank rebuilds: say, to send their device maps.
        """
        t = self.timeouts
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
            if await asyncio.to_thread(itimers.criu_drops_one_shots):
                self.itimer_images.update(images)
                for tree, (_, inside) in manifests.items():
                    self.itimer_images.update((rank.key(), tree) for rank, _, _ in inside)
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

        async def steps() -> None:
            for r in rejoin:
                await self._check_rejoins(r)
            self.ranks.extend(rejoin)  # renewed from here on (the leases hold this list)
            try:
                await self._phase(LOCKED, prepare_all, t.restore_seconds)
                await self._phase(Milestone.RESTORED, restore_all, t.restore_seconds)
            finally:
                for error in await asyncio.to_thread(lock.unlock):
                    log.error("%s: %s", self.node, error)
            if before_rebuild is not None:
                await before_rebuild([r for r in self.ranks if r not in rejoin])
            await self._rebuild_and_resume(epoch)

        return await self._restoring(steps)  # the rejoining ranks and, once restored, the others

    async def _check_rejoins(self, r: LocalRank) -> None:
        """A held rank may rejoin only as a Hold checkpoint left it: released, no device left open."""
        fds, maps = device_fds_and_maps(r.pid)
        try:
            state = (await r.shim.status(self.timeouts.quiesce_seconds)).state
        except (ControlError, OSError) as exc:
            raise CheckpointFailed(f"status of {r.rank.key()} (pid {r.pid}) failed: {exc}") from exc
        if state != "released" or fds or maps:
            raise CheckpointFailed(
                f"{r.rank.key()} (pid {r.pid}) cannot rejoin: state {state!r}, "
                f"{fds} device fds, {maps} device mappings (a Hold checkpoint leaves it released)"
            )

    async def _restoring(self, steps: Callable[[], Awaitable[None]]) -> NodeReport:
        """Run a restore's `steps` with this node's ranks' leases renewed. Any failure (a shim's reply
        the agent will not act on included: the shim runs in the tenant's process) aborts the session
        for every node, and is raised as it came; no rank is resumed (abort.abort_restore)."""
        self.leases.start()
        try:
            await self._unless_aborted(steps())
        except Exception as exc:
            await abort.abort_restore(self.node, self.client, exc, self.report)
            raise
        finally:
            await self.leases.stop()
        self.report.outcome = "Succeeded"
        return self.report

    async def _unless_aborted(self, work: Awaitable[None]) -> None:
        """`work`, cut short once the session is aborted (by another node, the operator or its deadline):
        a restored rank's rebuild would otherwise wait out its bound for the records of a peer that
        failed, since the coordinator still answers record reads after an abort."""
        task = asyncio.ensure_future(work)
        aborted = asyncio.ensure_future(self.client.aborted.wait())
        try:
            await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if task.cancelled():
            raise CoordinationAborted(self.client.abort_reason or "the session was aborted")
        task.result()
