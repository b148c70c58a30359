"""This node's part of a checkpoint session, run in the agent with the driver (ibckpt_node.driver).

The operator starts a session (CheckpointRequest), the agent resolves the request's containers to the
ranks the registry knows (each control socket the shim made in a container is one rank), connects to
the job's coordinator, serves the shims' coordinator socket for the session and runs the driver. The
report (ibckpt.agentapi.SessionReport) follows the driver's barriers while it runs.

One session at a time per node: the shims find the coordinator at one fixed path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ibckpt.agentapi import Milestone
from ibckpt.agentapi import models as api
from ibckpt.coordination.client import CoordinationAborted, CoordinatorClient, CoordinatorError
from ibckpt.coordination.ranks import RankId
from ibckpt_node import driver, tcp_remap
from ibckpt_node.agent import recovery, restoring
from ibckpt_node.agent.kubesecrets import SecretReader, StagingError
from ibckpt_node.container_runtime import RuntimeContainer
from ibckpt_node.coord_proxy import ShimCoordinatorProxy
from ibckpt_node.criu import CriuError
from ibckpt_node.errors import CheckpointFailed, CheckpointRefused
from ibckpt_node.ranks import LocalRank
from ibckpt_node.registry import ContainerRegistry, RegisteredContainer
from ibckpt_node.trees import ProcessTree

log = logging.getLogger(__name__)

# The milestone a rank passed last -> the phase it is in now (present tense, for people reading status).
PHASE_AFTER = {
    Milestone.JOINED: api.RankPhase.PREFLIGHT,
    Milestone.ADMITTED: api.RankPhase.QUIESCING,
    Milestone.QUIESCED: api.RankPhase.DRAINING,
    Milestone.DRAINED: api.RankPhase.RELEASING,
    Milestone.RELEASED: api.RankPhase.DUMPING,
    Milestone.DUMPED: api.RankPhase.REBUILDING,
    Milestone.DOWNLOADED: api.RankPhase.RESTORING,
    Milestone.RESTORED: api.RankPhase.REBUILDING,
    Milestone.REBUILT: api.RankPhase.RESUMING,
    Milestone.RESUMED: api.RankPhase.DONE,
}
# How long ranks left released by a lost coordinator wait for the next operator's recovery: its
# Lease handover and start-up (2.5 minutes on the emulated testbed nodes), with room.
REJOIN_WAIT_S = 600.0
# The driver's outcomes that leave the ranks released: until the kill (Stop) or a restore (Hold).
HELD_OUTCOMES = ("Stopped", "Held")


class SessionError(Exception):
    """The request cannot start; status is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def pid_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def host_pid(container_pid: int, ns_pid: int) -> int:
    """The host pid of the process that is ns_pid in the pid namespace of container_pid."""
    want = pid_namespace(container_pid)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{name}/status").read_text()
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if nspid and int(nspid[-1]) == ns_pid and pid_namespace(int(name)) == want:
                return int(name)
    raise SessionError(422, f"no process {ns_pid} in the pid namespace of {container_pid}")


def container_ranks(job: str, entry: RegisteredContainer) -> list[LocalRank]:
    """One rank per control socket the shim made in the container (one per process that opened a device)."""
    ranks = []
    first = Path(entry.control_socket).name
    for path in entry.sockets():
        stem = Path(path).name.removesuffix(".sock")
        if not stem.isdigit():
            continue
        pid = entry.pid if Path(path).name == first else host_pid(entry.pid, int(stem))
        rank = RankId(job, entry.pod, entry.container, stem)
        ranks.append(LocalRank(rank, pid, Path(path)))
    return ranks


def tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


@dataclass
class Session:
    request: api.CheckpointRequest | api.RestoreRequest
    report: api.SessionReport
    ranks: list[LocalRank]
    trees: list[ProcessTree]
    tree_keys: dict[str, list[str]]  # tree name -> its ranks' keys
    task: asyncio.Task[None] | None = None
    client: CoordinatorClient | None = None
    engine: driver.NodeDriver | None = None
    abort_reason: str = ""
    by_key: dict[str, api.RankProgress] = field(default_factory=dict)
    rejoin_to: api.AbortRequest | None = None  # the coordinator that replaces a lost one
    rejoin_ready: asyncio.Event = field(default_factory=asyncio.Event)
    recovering: bool = False  # an abort brings back ranks the driver left (recovery.py)

    @property
    def token(self) -> str:
        """The token of the coordinator the session uses now."""
        order = self.rejoin_to
        if order is not None and order.session_token is not None:
            return order.session_token.get_secret_value()
        return self.request.session_token.get_secret_value()

    @property
    def held(self) -> bool:
        """The driver is over and left its ranks released (a Stop or Hold dump)."""
        return self.engine is not None and self.engine.report.outcome in HELD_OUTCOMES


class Sessions:
    def __init__(
        self,
        node: str,
        registry: ContainerRegistry,
        work_dir: Path,
        shim_socket: Path,
        on_finished: Callable[[api.SessionReport], None] = lambda report: None,
        secrets: SecretReader | None = None,
    ) -> None:
        self.secrets = secrets
        self.node = node
        self.registry = registry
        self.work_dir = work_dir
        self.shim_socket = shim_socket
        self.on_finished = on_finished
        self.sessions: dict[str, Session] = {}

    def running(self) -> list[str]:
        return [sid for sid, s in self.sessions.items() if not s.report.state.finished]

    def get(self, session_id: str) -> api.SessionReport:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(404, f"no session {session_id!r} on {self.node}")
        return session.report

    def _resolve(
        self, request: api.CheckpointRequest
    ) -> tuple[list[tuple[LocalRank, str]], list[ProcessTree], dict[str, list[str]]]:
        """The ranks (with their pod's uid), one process tree per container, and each tree's rank keys."""
        entries = {(e.pod_uid, e.container): e for e in self.registry.entries()}
        ranks: list[tuple[LocalRank, str]] = []
        trees: list[ProcessTree] = []
        tree_keys: dict[str, list[str]] = {}
        for ref in request.ranks:
            entry = entries.get((ref.pod_uid, ref.container))
            if entry is None:
                pod = f"{ref.pod} (uid {ref.pod_uid})" if ref.pod else ref.pod_uid
                raise SessionError(
                    422,
                    f"container {ref.container} of pod {pod} is not registered on {self.node}: "
                    "it has ended, or it never ran under the ibckpt RuntimeClass here",
                )
            if not entry.shim:
                raise SessionError(
                    422,
                    f"{entry.namespace}/{entry.pod} container {entry.container} runs without the shim"
                    + (f" ({entry.reason})" if entry.reason else ""),
                )
            found = container_ranks(request.job, entry)
            if not found:
                raise SessionError(
                    422,
                    f"{entry.namespace}/{entry.pod} container {entry.container} has no process that "
                    "opened an RDMA device (no control socket)",
                )
            ranks += [(r, entry.pod_uid) for r in found]
            # the container's whole process tree is one image: its ranks' pipes and sockets go with it
            name = f"{entry.pod}.{entry.container}"
            trees.append(ProcessTree(name, entry.pid, self._runtime_container(entry)))
            tree_keys[name] = [r.rank.key() for r in found]
        return ranks, trees, tree_keys

    def _check_free(self, session_id: str) -> None:
        if session_id in self.sessions:
            raise SessionError(409, f"session {session_id!r} exists on {self.node}")
        busy = self.running()
        if busy:
            raise SessionError(409, f"{self.node} is busy with session {busy[0]!r}")

    async def _connect(self, request: api.CheckpointRequest | api.RestoreRequest) -> CoordinatorClient:
        host, _, port = request.coordinator.rpartition(":")
        token = request.session_token.get_secret_value()
        return await CoordinatorClient.connect(host, int(port), request.session_id, self.node, token)

    @staticmethod
    def _runtime_container(entry: RegisteredContainer) -> RuntimeContainer | None:
        """The container as its runtime knows it, when the wrapper created it (else plain CRIU)."""
        try:
            return RuntimeContainer.recorded(entry.container_id, Path(entry.control_dir).parent)
        except CriuError as exc:
            log.warning("%s/%s: dumped with plain CRIU: %s", entry.pod, entry.container, exc)
            return None

    def start_checkpoint(self, request: api.CheckpointRequest) -> api.SessionReport:
        self._check_free(request.session_id)
        ranks, trees, tree_keys = self._resolve(request)
        recovery.save(self.work_dir, request)  # before any rank is touched: a next agent needs it
        session = self._checkpoint_session(request, ranks, trees, tree_keys)
        session.task = asyncio.create_task(self._run(session), name=f"session {request.session_id}")
        return session.report

    def _checkpoint_session(
        self,
        request: api.CheckpointRequest,
        ranks: list[tuple[LocalRank, str]],
        trees: list[ProcessTree],
        tree_keys: dict[str, list[str]],
    ) -> Session:
        report = api.SessionReport(
            session_id=request.session_id,
            kind=api.SessionKind.CHECKPOINT,
            node=self.node,
            phase="Pending",
            started_at=time.time(),
            ranks=[
                api.RankProgress(
                    rank_key=r.rank.key(),
                    pod_uid=pod_uid,
                    container=r.rank.container,
                    pid=r.pid,
                )
                for r, pod_uid in ranks
            ],
        )
        session = Session(request, report, [r for r, _ in ranks], trees, tree_keys)
        session.by_key = {p.rank_key: p for p in report.ranks}
        self.sessions[request.session_id] = session
        return session

    def start_restore(self, request: api.RestoreRequest) -> api.SessionReport:
        self._check_free(request.session_id)
        if request.rejoin:
            raise SessionError(422, "rejoining held ranks through the node agent is not supported yet")
        if not request.ranks:
            raise SessionError(422, "the restore request names no rank to restore on this node")
        report = api.SessionReport(
            session_id=request.session_id,
            kind=api.SessionKind.RESTORE,
            node=self.node,
            phase=api.RankPhase.DOWNLOADING.value,
            started_at=time.time(),
            ranks=[
                api.RankProgress(
                    rank_key=r.rank_key,
                    pod_uid=r.pod_uid,
                    container=r.container,
                    phase=api.RankPhase.DOWNLOADING,
                )
                for r in request.ranks
            ],
        )
        session = Session(request, report, [], [], {})
        session.by_key = {p.rank_key: p for p in report.ranks}
        self.sessions[request.session_id] = session
        session.task = asyncio.create_task(self._run_restore(session), name=f"session {request.session_id}")
        return report

    def _set_phase(self, session: Session, phase: api.RankPhase) -> None:
        session.report.phase = phase.value
        for progress in session.report.ranks:
            progress.phase = phase
            progress.seconds = round(time.time() - session.report.started_at, 3)

    async def _run_restore(self, session: Session) -> None:
        request = session.request
        assert isinstance(request, api.RestoreRequest)
        report = session.report
        planned: list[restoring.ContainerRestore] = []
        restore_dir = self.registry.config.restore_dir
        lock = tcp_remap.ConnectionLock([])  # the restored TCP connections, held until every node restored
        try:
            planned = await self._stage_restore(session, request, lock)
            staged_at = time.time()  # a container of these pods registered before is not the restored one
            session.client = await self._connect(request)
            try:
                async with ShimCoordinatorProxy(self.shim_socket, session.client) as proxy:
                    session.engine = driver.NodeDriver(
                        self.node,
                        session.client,
                        [],
                        timeouts=request.timeouts,
                        flush_records=proxy.published,
                        on_milestone=functools.partial(self._passed, session),
                    )
                    self._passed(session, Milestone.DOWNLOADED)

                    async def restored() -> list[LocalRank]:
                        uids: dict[str, str] = {}
                        ranks = await restoring.wait_for_ranks(
                            self.registry,
                            planned,
                            host_pid,
                            request.timeouts.restore_seconds,
                            staged_at,
                            uids,
                        )
                        for r in ranks:
                            progress = session.by_key[r.rank.key()]
                            progress.pid = r.pid
                            progress.pod_uid = uids.get(progress.rank_key, progress.pod_uid)
                        return ranks

                    result = await session.engine.rebuild_restored(restored, request.epoch, lock)
            finally:
                await session.client.close()
            report.phases = dict(result.phases)
            self._set_phase(session, api.RankPhase.DONE)
            report.state = api.SessionState.SUCCEEDED
            report.phase = "Succeeded"
            report.message = f"restored {len(planned)} containers on {self.node}"
        except (StagingError, restoring.RestoreError) as exc:
            self._finish_failed(session, api.SessionState.FAILED, str(exc))
        except CoordinationAborted as exc:
            self._finish_failed(session, api.SessionState.ABORTED, str(exc))
        except (CheckpointFailed, CoordinatorError, OSError) as exc:
            state = api.SessionState.ABORTED if session.abort_reason else api.SessionState.FAILED
            self._finish_failed(session, state, str(exc))
        except asyncio.CancelledError:
            self._finish_failed(session, api.SessionState.ABORTED, session.abort_reason or "cancelled")
        except Exception as exc:
            log.exception("session %s", request.session_id)
            self._finish_failed(session, api.SessionState.FAILED, f"agent error: {exc}")
        finally:
            for error in await asyncio.to_thread(lock.unlock):  # a failed restore lets them go too
                log.error("session %s: %s", request.session_id, error)
            if report.state is not api.SessionState.SUCCEEDED:
                failed = restoring.restore_errors(planned, restore_dir)
                for line in failed:
                    log.error("session %s: %s", request.session_id, line)
                if failed:
                    report.message = f"{report.message}; {'; '.join(failed)}"[:4000]
            # staged images are used once (the restored container has read them) or not at all
            restoring.unstage(planned, restore_dir)
            report.finished_at = time.time()
            log.info(
                "session %s: %s (%s) %s", request.session_id, report.state.value, report.phase, report.message
            )
            self.on_finished(report)

    async def _stage_restore(
        self, session: Session, request: api.RestoreRequest, lock: tcp_remap.ConnectionLock
    ) -> list[restoring.ContainerRestore]:
        from ibckpt.store import ImageStore, StoreError  # boto3: only when staging
        from ibckpt.store.layout import CheckpointRef
        from ibckpt_node.agent.staging import store_config

        if self.secrets is None:
            raise StagingError("this agent has no way to read Secrets")
        source = request.images
        data = await self.secrets(source.credentials.namespace, source.credentials.name)
        config = store_config(source.location, source.credentials, data)
        ref = CheckpointRef(source.job, source.checkpoint_id)

        def read_manifest():  # type: ignore[no-untyped-def]
            try:
                return ImageStore.open(config).manifest(ref)
            except StoreError as exc:
                raise StagingError(f"reading {ref} from {config.where()}: {exc}") from exc

        try:
            remap = tcp_remap.parse_map([f"{old}={new}" for old, new in request.remap_ip.items()])
        except ValueError as exc:
            raise restoring.RestoreError(f"the restore request's address map: {exc}") from None
        manifest = await asyncio.to_thread(read_manifest)
        planned = restoring.plan(request, manifest)
        fetched = 0

        def count(size: int) -> None:  # runs on the download's threads
            nonlocal fetched
            fetched += size

        started = time.monotonic()
        download = asyncio.to_thread(
            restoring.stage,
            config,
            source,
            request.checkpoint,
            planned,
            self.registry.config.restore_dir,
            count,
            remap,
            lock,
        )
        try:
            session.report.bytes = await asyncio.wait_for(download, request.timeouts.download_seconds)
        except TimeoutError:
            raise StagingError(
                f"download did not finish within {request.timeouts.download_seconds:g}s"
            ) from None
        for item in planned:
            for key in item.rank_keys:
                session.by_key[key].bytes = session.report.bytes // max(1, len(session.report.ranks))
        session.report.phases[Milestone.DOWNLOADED] = round(time.monotonic() - started, 3)
        if remap or lock.connections:
            log.info(
                "session %s: addresses remapped %s; TCP connections held until every node restored: %s",
                request.session_id,
                ", ".join(f"{a}={b}" for a, b in remap.items()) or "none",
                ", ".join(c.describe() for c in lock.connections) or "none",
            )
        return planned

    async def abort(
        self, session_id: str, reason: str, request: api.AbortRequest | None = None
    ) -> api.SessionReport:
        """`request.coordinator`: the coordinator to rebuild released ranks through. A new one (a new
        token) replaces a coordinator lost with a restarted operator."""
        session = self.sessions.get(session_id)
        if session is None:
            session = self._adopt(session_id, request)  # a previous agent's session, or 404
            self._start_recovery(session, reason, request)
            return session.report
        if session.recovering:
            return session.report
        if session.held:
            # the driver is over and left the ranks released: they come back through a coordinator
            self._start_recovery(session, reason, request)
            return session.report
        if session.report.state.finished:
            return session.report
        session.abort_reason = session.abort_reason or reason
        engine = session.engine
        if engine is not None and engine.report.outcome and session.task is not None:
            # the ranks run again (LeaveRunning) and only the upload is left: it is not wanted now
            session.task.cancel()
            return session.report
        token = request.session_token.get_secret_value() if request and request.session_token else None
        if request is not None and request.coordinator and token != session.token and session.client:
            # The operator restarted: the session's coordinator is gone with it. Give its connection
            # up at once (a request may be waiting on it) and rejoin the recovery's coordinator.
            session.rejoin_to = request
            session.rejoin_ready.set()
            session.client.lose(f"the operator restarted: {reason}")
            return session.report
        if session.client is not None:
            # every node hears it; the driver brings its ranks back from wherever they are
            with contextlib.suppress(CoordinatorError):
                await session.client.abort(reason)
        elif session.task is not None:
            session.task.cancel()
        return session.report

    def _adopt(self, session_id: str, order: api.AbortRequest | None) -> Session:
        """A session this agent never ran: a previous agent's (it died), if its record is here. The
        ranks of its containers that still run under the shim are brought back."""
        missing = SessionError(404, f"no session {session_id!r} on {self.node}")
        if order is None or not order.coordinator:
            raise missing
        request = recovery.load(self.work_dir, session_id, order)
        if request is None:
            raise missing
        registered = {(e.pod_uid, e.container) for e in self.registry.entries() if e.shim}
        alive = [ref for ref in request.ranks if (ref.pod_uid, ref.container) in registered]
        if not alive:
            log.warning("session %s: a previous agent's; none of its containers runs here now", session_id)
            recovery.forget(self.work_dir, session_id)
            raise missing
        self._check_free(session_id)  # the shims' coordinator socket is one per node
        request = request.model_copy(update={"ranks": alive})
        ranks, trees, tree_keys = self._resolve(request)
        session = self._checkpoint_session(request, ranks, trees, tree_keys)
        log.warning(
            "session %s: left by a previous agent of this node; bringing its %d rank(s) back",
            session_id,
            len(ranks),
        )
        return session

    def _start_recovery(self, session: Session, reason: str, order: api.AbortRequest | None) -> None:
        if order is None or not order.coordinator or order.session_token is None:
            # an operator that names no coordinator: nothing to rebuild through
            log.error(
                "session %s: its ranks are released and the abort names no coordinator to rebuild them "
                "through; they wait for a restore or a kill",
                session.report.session_id,
            )
            return
        session.abort_reason = session.abort_reason or reason
        session.recovering = True  # from now on the report says Running until the ranks are back
        session.report.state = api.SessionState.RUNNING
        session.report.phase = "Aborting"
        previous = session.task
        session.task = asyncio.create_task(
            self._recover(session, order, previous), name=f"recovery {session.report.session_id}"
        )

    async def _recover(
        self, session: Session, order: api.AbortRequest, previous: asyncio.Task[None] | None
    ) -> None:
        """Bring back the ranks a held (or a previous agent's) session left out of running."""
        request = session.request
        assert isinstance(request, api.CheckpointRequest)
        assert order.coordinator and order.session_token is not None
        report = session.report
        if previous is not None and not previous.done():
            previous.cancel()  # an upload still running: the checkpoint is aborted
            await asyncio.wait([previous])
        reason = session.abort_reason
        phases = dict(report.phases)
        host, _, port = order.coordinator.rpartition(":")
        token = order.session_token.get_secret_value()
        try:
            client = await CoordinatorClient.connect(host, int(port), request.session_id, self.node, token)
            try:
                async with ShimCoordinatorProxy(self.shim_socket, client) as proxy:
                    session.engine = driver.NodeDriver(
                        self.node,
                        client,
                        session.ranks,
                        timeouts=request.timeouts,
                        flush_records=proxy.published,
                    )
                    await session.engine.recover(reason, request.epoch)
            finally:
                await client.close()
            back = len(session.engine.report.shim.get("abort", {}))
            message = f"aborted: {reason}; {back} of {len(session.ranks)} rank(s) brought back"
            self._finish_failed(session, api.SessionState.ABORTED, message)
        except (CoordinatorError, OSError) as exc:
            message = f"aborted: {reason}; the released ranks could not be rebuilt: {exc}"
            self._finish_failed(session, api.SessionState.ABORTED, message)
        except Exception as exc:
            log.exception("recovery of session %s", request.session_id)
            self._finish_failed(session, api.SessionState.FAILED, f"agent error: {exc}")
        finally:
            session.recovering = False
            report.phases = {**phases, **report.phases}
            if all(p.phase is api.RankPhase.RESUMED for p in report.ranks):
                recovery.forget(self.work_dir, request.session_id)
            report.finished_at = time.time()
            log.info("session %s: %s (recovery) %s", request.session_id, report.state.value, report.message)
            self.on_finished(report)

    async def _rejoin(self, session: Session, proxy: ShimCoordinatorProxy) -> CoordinatorClient | None:
        """Wait (bounded) for an abort naming the coordinator that replaces the lost one; connect to it
        and route the session and its shims' records through it."""
        try:
            await asyncio.wait_for(session.rejoin_ready.wait(), REJOIN_WAIT_S)
        except TimeoutError:
            return None
        order = session.rejoin_to
        assert order is not None and order.coordinator and order.session_token is not None
        host, _, port = order.coordinator.rpartition(":")
        token = order.session_token.get_secret_value()
        try:
            client = await CoordinatorClient.connect(
                host, int(port), session.request.session_id, self.node, token
            )
        except CoordinatorError as exc:
            log.error("session %s: cannot rejoin: %s", session.request.session_id, exc)
            return None
        old, session.client = session.client, client
        proxy.use(client)
        if old is not None:
            await old.close()
        return client

    def _passed(self, session: Session, milestone: Milestone) -> None:
        """The driver's callback: every node has passed `milestone`, and the report says so at once."""
        report = session.report
        if session.engine is not None:
            report.phases.update(session.engine.report.phases)
        phase = PHASE_AFTER[milestone]
        report.phase = phase.value
        for progress in report.ranks:
            if not progress.error:
                progress.done = milestone
                progress.phase = phase
                progress.seconds = round(time.time() - report.started_at, 3)

    async def _run(self, session: Session) -> None:
        request = session.request
        assert isinstance(request, api.CheckpointRequest)
        report = session.report
        images = self.work_dir / "sessions" / request.session_id / "images"
        try:
            session.client = await self._connect(request)
            try:
                async with ShimCoordinatorProxy(self.shim_socket, session.client) as proxy:
                    session.engine = driver.NodeDriver(
                        self.node,
                        session.client,
                        session.ranks,
                        timeouts=request.timeouts,
                        job_addrs=request.job_addresses or None,
                        trees=session.trees,
                        flush_records=proxy.published,
                        rejoin=functools.partial(self._rejoin, session, proxy),
                        on_milestone=functools.partial(self._passed, session),
                    )
                    self._set_phase(session, api.RankPhase.PREFLIGHT)
                    result = await session.engine.checkpoint(request.mode, images, request.epoch)
            finally:
                await session.client.close()
            final = {
                "Stopped": api.RankPhase.STOPPED,
                "Held": api.RankPhase.HELD,
            }.get(result.outcome, api.RankPhase.DONE)
            for tree in session.trees:
                size = tree_bytes(images / tree.name)
                report.bytes += size
                members = [session.by_key[k] for k in session.tree_keys[tree.name]]
                for progress in members:
                    progress.bytes = size // max(1, len(members))
            if request.images is not None:
                await self._stage(session, images)
            for progress in report.ranks:
                progress.phase = final
            report.state = api.SessionState.SUCCEEDED
            report.phase = result.outcome
            if request.images is None:
                report.message = f"images in {images} on {self.node}"
        except StagingError as exc:
            # only the upload failed; the images stay here
            self._finish_failed(session, api.SessionState.FAILED, f"{exc} (images kept in {images})")
        except CheckpointRefused as exc:
            self._finish_failed(session, api.SessionState.REFUSED, str(exc))
        except CoordinationAborted as exc:
            self._finish_failed(session, api.SessionState.ABORTED, str(exc))
        except (CheckpointFailed, CoordinatorError, CriuError, OSError) as exc:
            aborted = bool(session.abort_reason) or (
                session.engine is not None and session.engine.report.outcome == "Aborted"
            )
            state = api.SessionState.ABORTED if aborted and session.abort_reason else api.SessionState.FAILED
            self._finish_failed(session, state, str(exc))
        except asyncio.CancelledError:
            if not session.recovering:  # a recovery reports for itself
                self._finish_failed(session, api.SessionState.ABORTED, session.abort_reason or "cancelled")
        except Exception as exc:
            log.exception("session %s", request.session_id)
            self._finish_failed(session, api.SessionState.FAILED, f"agent error: {exc}")
        finally:
            if session.engine is not None:
                # the renewals went on through the upload; a Held rank is handed over with no lease
                await session.engine.end_leases()
            if not session.held:  # every rank runs again: nothing for a next agent to bring back
                recovery.forget(self.work_dir, request.session_id)
            if not session.recovering:
                report.finished_at = time.time()
                log.info(
                    "session %s: %s (%s) %s",
                    request.session_id,
                    report.state.value,
                    report.phase,
                    report.message,
                )
                self.on_finished(report)

    async def _stage(self, session: Session, images: Path) -> None:
        """Upload this node's images as its part of the checkpoint (the operator commits the parts)."""
        from ibckpt_node.agent.staging import stage_trees, store_config  # boto3: only when staging

        assert isinstance(session.request, api.CheckpointRequest)
        destination = session.request.images
        assert destination is not None
        report = session.report
        report.phase = api.RankPhase.UPLOADING.value
        for rank in report.ranks:
            rank.phase = api.RankPhase.UPLOADING
        if self.secrets is None:
            raise StagingError("this agent has no way to read Secrets")
        data = await self.secrets(destination.credentials.namespace, destination.credentials.name)
        config = store_config(destination.location, destination.credentials, data)
        uploaded = 0

        def count(size: int) -> None:  # runs on the upload's threads
            nonlocal uploaded
            uploaded += size

        # pod names may hold dots: take each tree's pod from its ranks' keys (job/pod/container/process)
        trees = [(t.name, RankId.parse(session.tree_keys[t.name][0]).pod) for t in session.trees]
        started = time.monotonic()
        upload = asyncio.to_thread(stage_trees, config, destination, self.node, images, trees, count)
        try:
            # a thread cannot be cancelled: on timeout the upload may go on, but nothing commits it
            total = await asyncio.wait_for(upload, session.request.timeouts.upload_seconds)
        except TimeoutError:
            raise StagingError(
                f"upload did not finish within {session.request.timeouts.upload_seconds:g}s"
            ) from None
        report.phases[Milestone.UPLOADED] = round(time.monotonic() - started, 3)
        report.message = (
            f"staged {total} bytes ({uploaded} uploaded, the rest already stored) as part {self.node} "
            f"of {destination.job}/{destination.checkpoint_id}"
        )

    def _finish_failed(self, session: Session, state: api.SessionState, message: str) -> None:
        report = session.report
        engine = session.engine
        if engine is not None:
            report.phases = dict(engine.report.phases)
        report.state = state
        report.message = message
        # Ranks that run again (LeaveRunning resumed them before a failed upload, or the driver's abort
        # brought them back) say so: the operator counts the others as lost.
        all_back = engine is not None and engine.report.outcome == "Succeeded"
        recovered = engine.report.shim.get("abort", {}) if engine is not None else {}
        for progress in report.ranks:
            back = all_back or progress.rank_key in recovered
            progress.phase = api.RankPhase.RESUMED if back else api.RankPhase.FAILED
            progress.error = message

    async def close(self) -> None:
        for session in self.sessions.values():
            if session.task is not None and not session.task.done():
                await self.abort(session.report.session_id, "the node agent is stopping")
        tasks = [s.task for s in self.sessions.values() if s.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=30)
