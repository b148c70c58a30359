"""The agent's table of sessions, and the calls the agent API makes on it: start a checkpoint or a
restore, read a session's report, abort it, and stop them all when the agent stops.

The operator starts a session (CheckpointRequest), the agent resolves the request's containers to the
ranks the registry knows (each control socket the shim made in a container is one rank) and runs the
session by phase: checkpointing.py (connect to the job's coordinator, serve the shims' coordinator
socket, run the driver, upload), restoring.py (download, wait for the runtime's restore, rebuild) and
recovery.py (bring back ranks a finished driver, or a previous agent, left released). The report
(ibckpt.agentapi.SessionReport) follows the driver's milestones while it runs.

One session at a time per node: the shims find the coordinator at one fixed path. While the agent
runs, `sweeping` keeps what sessions leave on the node's disk within its bound (disk.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ibckpt.agentapi import models as api
from ibckpt.coordination.client import CoordinatorError
from ibckpt_node.agent import checkpointing, disk, recovery, restoring
from ibckpt_node.agent.kubesecrets import SecretReader
from ibckpt_node.agent.memorytier import MemoryShelf
from ibckpt_node.agent.session import Agent, Session, SessionError, container_ranks, report_entries
from ibckpt_node.container_runtime import RuntimeContainer
from ibckpt_node.criu import CriuError
from ibckpt_node.ranks import LocalRank
from ibckpt_node.registry import ContainerRegistry, RegisteredContainer
from ibckpt_node.trees import ProcessTree

log = logging.getLogger(__name__)


@dataclass
class Resolved:
    """A checkpoint request's containers on this node, as the session runs them."""

    ranks: list[LocalRank] = field(default_factory=list)
    progress: list[api.RankProgress] = field(default_factory=list)  # the report's: ranks, plain containers
    trees: list[ProcessTree] = field(default_factory=list)
    tree_keys: dict[str, list[str]] = field(default_factory=dict)  # tree name -> the keys of its entries


class Sessions:
    def __init__(
        self,
        node: str,
        registry: ContainerRegistry,
        work_dir: Path,
        on_finished: Callable[[api.SessionReport], None] = lambda report: None,
        secrets: SecretReader | None = None,
        keep_failed_images_s: float = disk.DEFAULT_KEEP_FAILED_S,
        image_keys: Path | None = None,
        disk_reserve_bytes: int = 0,
        pre_upload: bool = True,
        *,
        coordinator_tls: Callable[[], ssl.SSLContext],
        criu_plugins: str = "",
        memory_token_file: Path | None = None,
        shelf: MemoryShelf | None = None,
        disk_window_bytes: int = 0,
    ) -> None:
        self.agent = Agent(
            node,
            registry,
            work_dir,
            on_finished,
            secrets,
            coordinator_tls,
            keep_failed_images_s,
            image_keys,
            disk_reserve_bytes,
            pre_upload,
            criu_plugins,
            memory_token_file,
            shelf,
            disk_window_bytes,
        )
        self.sessions: dict[str, Session] = {}
        self.sweeper: asyncio.Task[None] | None = None
        self.stopping = False  # close() runs: aborts are served, no session starts

    def running(self) -> list[str]:
        return [sid for sid, s in self.sessions.items() if not s.report.state.finished]

    def get(self, session_id: str) -> api.SessionReport:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(404, f"no session {session_id!r} on {self.agent.node}")
        return session.report

    def _resolve(self, request: api.CheckpointRequest) -> Resolved:
        """The ranks, one process tree per container, and the report's entries: one per rank, and one
        (RankId.plain) for a container with no live verbs process, dumped as a plain container."""
        entries = {(e.pod_uid, e.container): e for e in self.agent.registry.entries()}
        resolved = Resolved()
        for ref in request.ranks:
            entry = entries.get((ref.pod_uid, ref.container))
            if entry is None:
                pod = f"{ref.pod} (uid {ref.pod_uid})" if ref.pod else ref.pod_uid
                raise SessionError(
                    422,
                    f"container {ref.container} of pod {pod} is not registered on {self.agent.node}: "
                    "it has ended, or it never ran under the ibckpt RuntimeClass here",
                )
            if not entry.shim:
                raise SessionError(
                    422,
                    f"{entry.namespace}/{entry.pod} container {entry.container} runs without the shim"
                    + (f" ({entry.reason})" if entry.reason else ""),
                )
            found = container_ranks(request.job, entry)
            progress = report_entries(request.job, entry, found)
            if not found:
                log.info(
                    "%s/%s container %s: no live process under the shim; checkpointed as a plain container",
                    entry.namespace,
                    entry.pod,
                    entry.container,
                )
            resolved.ranks += found
            resolved.progress += progress
            # the container's whole process tree is one image: its ranks' pipes and sockets go with it
            name = f"{entry.pod}.{entry.container}"
            resolved.trees.append(ProcessTree(name, entry.pid, self._runtime_container(entry)))
            resolved.tree_keys[name] = [p.rank_key for p in progress]
        return resolved

    def _check_free(self, session_id: str) -> None:
        if self.stopping:
            raise SessionError(503, f"the node agent on {self.agent.node} is stopping: ask its successor")
        if session_id in self.sessions:
            raise SessionError(409, f"session {session_id!r} exists on {self.agent.node}")
        busy = self.running()
        if busy:
            raise SessionError(api.BUSY_STATUS, f"{self.agent.node} is busy with session {busy[0]!r}")

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
        resolved = self._resolve(request)
        recovery.save(self.agent.work_dir, request)  # before any rank is touched: a next agent needs it
        session = self._checkpoint_session(request, resolved)
        session.task = asyncio.create_task(
            checkpointing.run(self.agent, session), name=f"session {request.session_id}"
        )
        return session.report

    def _checkpoint_session(self, request: api.CheckpointRequest, resolved: Resolved) -> Session:
        report = api.SessionReport(
            session_id=request.session_id,
            kind=api.SessionKind.CHECKPOINT,
            node=self.agent.node,
            phase="Pending",
            started_at=time.time(),
            ranks=resolved.progress,
        )
        session = Session(request, report, resolved.ranks, resolved.trees, resolved.tree_keys)
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
            node=self.agent.node,
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
        session.task = asyncio.create_task(
            restoring.run(self.agent, session), name=f"session {request.session_id}"
        )
        return report

    async def abort(
        self, session_id: str, reason: str, request: api.AbortRequest | None = None
    ) -> api.SessionReport:
        """`request.coordinator`: the coordinator to rebuild released ranks through. A new one (a new
        token) replaces a coordinator lost with a restarted operator."""
        session = self.sessions.get(session_id)
        if session is None:
            session = self._adopt(session_id, request)  # a previous agent's session, or 404
            recovery.start(self.agent, session, reason, request)
            return session.report
        if session.recovering:
            return session.report
        if session.held:
            # the driver is over and left the ranks released: they come back through a coordinator
            recovery.start(self.agent, session, reason, request)
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
        missing = SessionError(404, f"no session {session_id!r} on {self.agent.node}")
        if order is None or not order.coordinator:
            raise missing
        request = recovery.load(self.agent.work_dir, session_id, order)
        if request is None:
            raise missing
        registered = {(e.pod_uid, e.container) for e in self.agent.registry.entries() if e.shim}
        alive = [ref for ref in request.ranks if (ref.pod_uid, ref.container) in registered]
        if not alive:
            log.warning("session %s: a previous agent's; none of its containers runs here now", session_id)
            recovery.forget(self.agent.work_dir, session_id)
            raise missing
        self._check_free(session_id)  # the shims' coordinator socket is one per node
        request = request.model_copy(update={"ranks": alive})
        resolved = self._resolve(request)
        session = self._checkpoint_session(request, resolved)
        log.warning(
            "session %s: left by a previous agent of this node; bringing its %d rank(s) back",
            session_id,
            len(resolved.ranks),
        )
        return session

    def start_sweeping(self) -> None:
        """Sweep now (what an earlier agent left too), then every disk.SWEEP_EVERY_S until close."""
        self.sweeper = asyncio.create_task(self._sweeping(), name="disk sweep")

    async def _sweeping(self) -> None:
        trash = self.agent.work_dir / disk.TRASH
        await self.sweep(disk.in_trash(trash))
        while True:
            await asyncio.sleep(disk.SWEEP_EVERY_S)
            await self.sweep()

    async def sweep(self, also: list[disk.Leftover] | None = None) -> None:
        """Remove what outlived its bound on the node's disk, never what a session of this agent runs
        or recovers with. The decision and the move into the trash happen here, on the event loop,
        where sessions start; the removal on a thread. An error is logged, never raised."""
        agent = self.agent
        try:
            busy = {
                sid
                for sid, s in self.sessions.items()
                if s.recovering or s.copying or not s.report.state.finished
            }
            restoring = any(
                isinstance(s.request, api.RestoreRequest) and not s.report.state.finished
                for s in self.sessions.values()
            )
            restore_root = Path(agent.registry.config.state_dir) / "restore"  # NodeConfig.restore_dir's
            found = disk.expired(agent.work_dir, restore_root, agent.keep_failed_images_s, busy, restoring)
            taken = (also or []) + disk.take(found, agent.work_dir / disk.TRASH)
            if taken:
                await asyncio.to_thread(disk.dispose, taken)
        except Exception:
            log.exception("sweeping the node's disk")

    async def close(self, timeout_s: float = 30.0) -> None:
        """Abort what runs and wait up to `timeout_s` for it to end (its ranks running again). What is
        still going then is left to the next agent of this node, which adopts it (`_adopt`)."""
        self.stopping = True
        if self.sweeper is not None:
            self.sweeper.cancel()
            await asyncio.wait([self.sweeper])
        for session in self.sessions.values():
            # a finished session still copying its part to a buddy is not aborted (its held ranks are
            # the operator's to kill or bring back); its copy gets the wait below
            if session.task is not None and not session.task.done() and not session.copying:
                await self.abort(session.report.session_id, "the node agent is stopping")
        tasks = [s.task for s in self.sessions.values() if s.task is not None and not s.task.done()]
        if tasks:
            log.info("waiting up to %.0f s for %d session(s) to end", timeout_s, len(tasks))
            _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            if pending:
                left = len(pending)
                log.warning("%d session(s) still going after %.0f s: left to the next agent", left, timeout_s)
