"""One session on this node, and what its runs share: the checkpoint run (checkpointing.py), the restore
run (restoring.py) and the recovery run (recovery.py).

A session is the agent's record of one request: its report (ibckpt.agentapi.SessionReport), its ranks,
its coordinator connection and the driver running them. `Agent` is what the runs need of the agent:
this node's name, its registry and places, and whom to tell when a session ends. The report follows
the driver's milestones (`passed`) and says how a failed session left each rank (`finish_failed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ibckpt.agentapi import Milestone
from ibckpt.agentapi import models as api
from ibckpt.coordination.client import CoordinatorClient
from ibckpt.coordination.ranks import PLAIN_CONTAINER, RankId
from ibckpt_node import control_sockets, driver
from ibckpt_node.agent.disk import DEFAULT_KEEP_FAILED_S
from ibckpt_node.agent.kubesecrets import SecretReader
from ibckpt_node.agent.memorytier import MemoryShelf
from ibckpt_node.coord_proxy import Channel, ShimCoordinatorProxy, channels_for
from ibckpt_node.procfs import process_gone
from ibckpt_node.ranks import LocalRank
from ibckpt_node.registry import ContainerRegistry, RegisteredContainer
from ibckpt_node.trees import ProcessTree

log = logging.getLogger(__name__)

# The milestone a rank passed last -> the phase it is in now (present tense, for people reading status).
PHASE_AFTER = {
    Milestone.JOINED: api.RankPhase.PREFLIGHT,
    Milestone.ADMITTED: api.RankPhase.QUIESCING,  # PreDumping when the session pre-dumps (passed)
    Milestone.PRE_DUMPED: api.RankPhase.QUIESCING,
    Milestone.QUIESCED: api.RankPhase.DRAINING,
    Milestone.DRAINED: api.RankPhase.RELEASING,
    Milestone.RELEASED: api.RankPhase.DUMPING,
    Milestone.DUMPED: api.RankPhase.REBUILDING,
    Milestone.DOWNLOADED: api.RankPhase.RESTORING,
    Milestone.RESTORED: api.RankPhase.REBUILDING,
    Milestone.REBUILT: api.RankPhase.RESUMING,
    Milestone.RESUMED: api.RankPhase.DONE,
}
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
    """One rank per control socket of a live process in the container (one per process that opened a
    device). Stale sockets (control_sockets.py) are dropped, one log line each: never a rank."""
    paths = entry.sockets()
    if not paths:
        return []
    # the first process's socket is the registered pid's (the registry checks it lives)
    first = control_sockets.ns_pid_of(entry.control_socket) if entry.control_socket else None
    pids: dict[int, int] = {}
    if any(control_sockets.ns_pid_of(p) != first for p in paths):
        try:
            pids = control_sockets.namespace_pids(entry.pid)
        except OSError as exc:  # not "every socket is stale": nothing is removed on a failed read
            raise SessionError(422, f"the pid namespace of {entry.pid} cannot be read: {exc}") from exc
    if first is not None:
        pids[first] = entry.pid
    live, stale = control_sockets.classify(paths, pids, control_sockets.listening)
    for s in stale:
        removed = control_sockets.remove(s.path)
        log.info(
            "%s/%s container %s: dropped stale control socket %s%s: %s",
            entry.namespace,
            entry.pod,
            entry.container,
            s.path,
            "" if removed else " (not removed: gone already, or it listens again)",
            s.reason,
        )
    return [
        LocalRank(RankId(job, entry.pod, entry.container, str(s.ns_pid)), s.host_pid, Path(s.path))
        for s in live
    ]


def report_entries(job: str, entry: RegisteredContainer, ranks: list[LocalRank]) -> list[api.RankProgress]:
    """A checkpointed container's entries in the session report: one per rank; a container with no
    live verbs process has one entry (RankId.plain), for the container dumped and restored as it is."""
    if not ranks:
        key = RankId(job, entry.pod, entry.container, PLAIN_CONTAINER).key()
        return [
            api.RankProgress(rank_key=key, pod_uid=entry.pod_uid, container=entry.container, pid=entry.pid)
        ]
    return [
        api.RankProgress(rank_key=r.rank.key(), pod_uid=entry.pod_uid, container=entry.container, pid=r.pid)
        for r in ranks
    ]


@dataclass(frozen=True)
class Agent:
    """What a session's run needs of the agent that runs it."""

    node: str
    registry: ContainerRegistry
    work_dir: Path
    on_finished: Callable[[api.SessionReport], None]
    secrets: SecretReader | None  # None: this agent cannot stage images
    coordinator_tls: Callable[[], ssl.SSLContext]  # trusts the operator's CA (read again at each connect)
    keep_failed_images_s: float = DEFAULT_KEEP_FAILED_S  # how long a failed checkpoint's images stay
    # The image key set (a mounted Secret, ibckpt/store/signing.py): parts are signed with it, and only
    # manifests that verify with it are restored. Read at each use, so a rotated Secret is picked up.
    image_keys: Path | None = None  # None: this agent neither stages nor restores images
    disk_reserve_bytes: int = 0  # what a checkpoint's images leave free on the node's disk
    pre_upload: bool = True  # upload the dump's whole chunks while CRIU writes them (store/follow.py)
    criu_plugins: str = ""  # CRIU's plugin dir on the node, for a request's pre-dumps (settings.NodeSettings)
    # this agent's own token for the other agents' memory tier (a projected token the kubelet renews, read
    # at each use); None: it keeps no copies elsewhere and reads none (memorycopies.py)
    memory_token_file: Path | None = None
    # what this agent holds for the others (memorytier.py): a restore here reads its own copies in-process
    shelf: MemoryShelf | None = None
    # what a Stop or Hold dump's images may hold on the disk while they upload (diskwindow.py); 0: all
    disk_window_bytes: int = 0


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
    copying: bool = False  # finished, and its part still going to its buddy's memory (checkpointing.py)

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


async def connect(agent: Agent, session_id: str, coordinator: str, token: str) -> CoordinatorClient:
    """This node's connection to the coordinator at `coordinator` (host:port) for the session."""
    host, _, port = coordinator.rpartition(":")
    return await CoordinatorClient.connect(
        host, int(port), session_id, agent.node, token, tls=agent.coordinator_tls()
    )


def shim_channels(ranks: Sequence[LocalRank]) -> list[Channel]:
    """The coordinator sockets of the ranks' containers, one each (coord_proxy.py)."""
    return channels_for((r.control_path, r.pid) for r in ranks)


@contextlib.asynccontextmanager
async def coordinated(
    agent: Agent, session: Session
) -> AsyncIterator[tuple[CoordinatorClient, ShimCoordinatorProxy]]:
    """The session's connection to its coordinator (session.client) and the shims' coordinator socket
    served through it, while the driver runs; then the connection the session uses by then closes (a
    rejoin may have replaced the first)."""
    request = session.request
    token = request.session_token.get_secret_value()
    client = session.client = await connect(agent, request.session_id, request.coordinator, token)
    try:
        async with ShimCoordinatorProxy(client, shim_channels(session.ranks)) as proxy:
            yield client, proxy
    finally:
        await session.client.close()


def set_phase(session: Session, phase: api.RankPhase) -> None:
    session.report.phase = phase.value
    for progress in session.report.ranks:
        progress.phase = phase
        progress.seconds = round(time.time() - session.report.started_at, 3)


def passed(session: Session, milestone: Milestone) -> None:
    """The driver's callback: every node has passed `milestone`, and the report says so at once."""
    report = session.report
    if session.engine is not None:
        report.phases.update(session.engine.report.phases)
    phase = PHASE_AFTER[milestone]
    if milestone == Milestone.ADMITTED and session.engine is not None and session.engine.settings.pre_dump:
        phase = api.RankPhase.PRE_DUMPING
    report.phase = phase.value
    for progress in report.ranks:
        if not progress.error:
            progress.done = milestone
            progress.phase = phase
            progress.seconds = round(time.time() - report.started_at, 3)


def finish_failed(session: Session, state: api.SessionState, message: str) -> None:
    report = session.report
    engine = session.engine
    if engine is not None:  # the agent's own (MemoryKept before a failed upload) stay
        report.phases.update(engine.report.phases)
    report.state = state
    report.message = message
    # Ranks that run again (LeaveRunning resumed them before a failed upload, or the driver's abort
    # brought them back) say so: the operator counts the others as lost.
    # a refusal came before any rank was touched: they never stopped running
    all_back = engine is not None and engine.report.outcome in ("Succeeded", "Refused")
    recovered = engine.report.shim.get("abort", {}) if engine is not None else {}
    for progress in report.ranks:
        back = all_back or progress.rank_key in recovered
        if RankId.parse(progress.rank_key).plain:  # nothing in it was touched but by CRIU
            back = all_back or (progress.pid is not None and not process_gone(progress.pid))
        progress.phase = api.RankPhase.RESUMED if back else api.RankPhase.FAILED
        progress.error = message
