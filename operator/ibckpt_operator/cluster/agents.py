"""The node agents as the operator sees them: which node has a ready one (its pod, by label, Ready), and
calls to it through ibckpt.agentapi's client, off the event loop on the gateway's own threads.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from ibckpt.agentapi import (
    BUSY_STATUS,
    AgentClient,
    AgentError,
    AgentInfo,
    CheckpointRequest,
    LeaderEpoch,
    RestoreRequest,
    SessionReport,
    SessionState,
)
from ibckpt.agentapi.memory import HeldCopies, MemoryClient
from ibckpt_operator.cluster.agenttokens import AgentTokens
from ibckpt_operator.cluster.kube import Body, Kube
from ibckpt_operator.cluster.pods import ready_condition
from ibckpt_operator.cluster.schedules import timestamp
from ibckpt_operator.config import current

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Agent:
    node: str
    pod: str
    host: str  # the agent pod's IP (hostNetwork: the node's)
    ready: bool


def agent_address(agent: Agent) -> str:
    """host:port of a node's agent API, as another agent dials it (an IPv6 host in brackets)."""
    host = f"[{agent.host}]" if ":" in agent.host else agent.host
    return f"{host}:{current().agent_port}"


def _ready(pod: Body) -> bool:
    status = pod.get("status", {})
    if pod.get("metadata", {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return ready_condition(pod)


async def agents_by_node(kube: Kube) -> dict[str, Agent]:
    """The agent of each node; a ready one wins over a not-ready one (a DaemonSet rollout has both)."""
    settings = current()
    found: dict[str, Agent] = {}
    for pod in await kube.list_pods(settings.namespace, settings.agent_selector):
        node = pod.get("spec", {}).get("nodeName")
        if not node:
            continue
        agent = Agent(node, pod["metadata"]["name"], pod.get("status", {}).get("podIP") or "", _ready(pod))
        if node not in found or (agent.ready and not found[node].ready):
            found[node] = agent
    return found


# How often the agents are listed again while one is waited for.
AGENT_READY_POLL_S = 2.0


async def ready_agents(kube: Kube) -> dict[str, Agent]:
    """agents_by_node, only the ready agents with an address (those an operator call can reach)."""
    return {node: a for node, a in (await agents_by_node(kube)).items() if a.ready and a.host}


async def agents_once_ready(
    kube: Kube, nodes: Collection[str], on_wait: Callable[[list[str]], Awaitable[None]]
) -> dict[str, Agent]:
    """The agent of each node, once those of `nodes` are Ready or `agent_ready_wait_seconds` passed: an
    agent pod that is there but not Ready (a probe missed under load, a DaemonSet pod still starting) is
    given that long before the pods on its node are refused. A node with no agent pod, or whose kubelet
    is not Ready (the node died), is not waited for. `on_wait` is told the not-Ready agents' pods once,
    before the wait."""
    deadline = time.monotonic() + current().agent_ready_wait_seconds
    told = False
    while True:
        agents = await agents_by_node(kube)
        unready = {n for n in nodes if n in agents and not agents[n].ready}
        if unready:
            alive = {n["metadata"]["name"] for n in await kube.list_nodes() if ready_condition(n)}
            unready &= alive
        left = deadline - time.monotonic()
        if not unready or left <= 0:
            return agents
        if not told:
            await on_wait(sorted(agents[n].pod for n in unready))
            told = True
        await asyncio.sleep(min(AGENT_READY_POLL_S, left))


def agent_fate(agent: Agent, pods: Sequence[Body], since: float) -> str:
    """What the agent pods say of why `agent` forgot a session or went silent after `since` (epoch
    seconds): its container ended and restarted (an OOM kill names the limit to raise), or its pod is
    gone. Empty when they tell nothing."""
    mine = [p for p in pods if p.get("metadata", {}).get("name") == agent.pod]
    if not mine:
        now = [p["metadata"]["name"] for p in pods if p.get("spec", {}).get("nodeName") == agent.node]
        return f"; its pod {agent.pod} is gone" + (f" (now {', '.join(sorted(now))})" if now else "")
    for container in mine[0].get("status", {}).get("containerStatuses", []):
        ended = (container.get("lastState") or {}).get("terminated") or {}
        try:
            when = timestamp(ended.get("finishedAt"))
        except ValueError:
            continue
        if when is None or when < since:
            continue
        reason = ended.get("reason") or "ended"
        exit_code = ended.get("exitCode")
        note = f"; its pod {agent.pod} restarted ({container.get('name')}: {reason}, exit {exit_code})"
        if reason == "OOMKilled":
            note += ": raise the chart's agent.resources.limits.memory (docs/node-agent.md)"
        return note
    return ""


async def agent_fate_now(kube: Kube, agent: Agent, since: float) -> str:
    """agent_fate from the agent pods as they are now; empty when they cannot be read."""
    try:
        pods = await kube.list_pods(current().namespace, current().agent_selector)
    except Exception as exc:  # a note for a message: never the reason a failure is lost
        log.debug("agent pods unreadable for %s: %s", agent.node, exc)
        return ""
    return agent_fate(agent, pods, since)


def no_agent_message(pod: str, node: str, agent: Agent | None) -> str:
    if agent is None:
        return f"pod {pod} is on node {node} which has no ready ibckpt agent (no agent pod there)"
    return f"pod {pod} is on node {node} which has no ready ibckpt agent ({agent.pod} is not Ready)"


# Calls in flight at once: each holds a thread (the client is blocking) for at most its own timeout.
AGENT_CONCURRENCY = 32

R = TypeVar("R")
C = TypeVar("C", bound=AgentClient)


class AgentGateway:
    """Calls to the agents over TLS (`tls` trusts the operator's CA; renewal replaces it), each with a
    token for that node's agent alone (`tokens`); every call bounded by the client's timeout. Tests may
    give one token for every agent instead.

    The calls run on the gateway's own threads, not the loop's default executor: that one has
    min(32, cores + 4) threads (6 on 2 cores), shared with every Kubernetes call, so a fan-out to 128
    agents went out 6 at a time. A call's timeout starts when its thread takes it, not while it waits."""

    def __init__(
        self,
        tls: ssl.SSLContext,
        tokens: AgentTokens | None = None,
        token: str | None = None,
        epoch: Callable[[], LeaderEpoch | None] = lambda: None,
        concurrency: int = AGENT_CONCURRENCY,
    ) -> None:
        if (tokens is None) == (token is None):
            raise ValueError("give exactly one of tokens and token")
        self.tls = tls
        self._tokens = tokens
        self._token = token
        self._epoch = epoch  # the leader's epoch (cluster/leader.py); None without an election
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="agent-call")

    async def _run(self, call: Callable[..., R], *args: object) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(call, *args))

    async def _client(self, agent: Agent) -> AgentClient:
        if self._tokens is not None:
            await self._tokens.token(agent.node)  # now, off the call's thread: client() takes it cached
        return self.client(agent)

    def client(self, agent: Agent) -> AgentClient:
        return self._make(AgentClient, agent)

    def _make(self, kind: type[C], agent: Agent) -> C:
        settings = current()
        token = self._token if self._tokens is None else self._tokens.cached(agent.node)
        if token is None:  # _client() just got it: only a token older than its reuse would be missing
            raise AgentError(0, f"no token for the agent of node {agent.node}")
        return kind(
            agent.host,
            settings.agent_port,
            tls=self.tls,
            token=token,
            timeout_s=settings.agent_timeout,
            leader_epoch=self._epoch(),
        )

    async def _memory(self, agent: Agent) -> MemoryClient:
        await self._client(agent)
        return self._make(MemoryClient, agent)

    async def held_copies(self, agent: Agent) -> HeldCopies:
        """The memory-tier copies this agent holds for the others."""
        return await self._run((await self._memory(agent)).copies)

    async def drop_copies(self, agent: Agent, job: str, checkpoint: str) -> HeldCopies:
        """Drop its copies of one checkpoint; what it holds then."""
        return await self._run((await self._memory(agent)).drop, job, checkpoint)

    async def part_manifest(self, agent: Agent, job: str, checkpoint: str, part: str) -> bytes | None:
        """The signed part manifest a holder keeps with its copy of `part`; None: no sealed copy."""
        return await self._run((await self._memory(agent)).part_manifest, job, checkpoint, part)

    async def put_manifest(self, agent: Agent, job: str, checkpoint: str, data: bytes) -> None:
        """Hand a holder the checkpoint's signed manifest, kept beside its copies."""
        await self._run((await self._memory(agent)).put_manifest, job, checkpoint, data)

    async def held_manifest(self, agent: Agent, job: str, checkpoint: str) -> bytes | None:
        """The checkpoint's signed manifest a holder keeps; None: it keeps none."""
        return await self._run((await self._memory(agent)).manifest, job, checkpoint)

    async def info(self, agent: Agent) -> AgentInfo:
        return await self._run((await self._client(agent)).info)

    async def checkpoint(self, agent: Agent, request: CheckpointRequest) -> SessionReport:
        return await self._run((await self._client(agent)).checkpoint, request)

    async def restore(self, agent: Agent, request: RestoreRequest) -> SessionReport:
        return await self._run((await self._client(agent)).restore, request)

    async def session(self, agent: Agent, session_id: str) -> SessionReport | None:
        try:
            return await self._run((await self._client(agent)).session, session_id)
        except AgentError as error:
            if error.status == 404:
                return None
            raise

    async def abort(
        self, agent: Agent, session_id: str, reason: str, rejoin: tuple[str, str] | None = None
    ) -> SessionReport | None:
        """None if the agent never heard of the session (nothing of it to bring back). `rejoin`: the
        coordinator (host:port, token) replacing the session's lost one."""
        try:
            return await self._run((await self._client(agent)).abort, session_id, reason, rejoin)
        except AgentError as error:
            if error.status == 404:
                return None
            raise


# How often an agent busy with another session is asked again.
AGENT_BUSY_POLL_S = 2.0


async def start_when_free(
    start: Callable[[], Awaitable[SessionReport]],
    node: str,
    still_wanted: Callable[[], bool],
    on_busy: Callable[[str, str], Awaitable[None]],
) -> SessionReport:
    """start(), asked again while the node's agent refuses it as busy (BUSY_STATUS: an agent runs one
    session at a time, and another job's ends within its own bounds), for up to agent_busy_wait_seconds
    and while still_wanted() (the step is still the job's current one). `on_busy(node, refusal)` is told
    once, before the first wait; when the wait is over the last refusal is raised."""
    deadline = time.monotonic() + current().agent_busy_wait_seconds
    told = False
    while True:
        try:
            return await start()
        except AgentError as error:
            if error.status != BUSY_STATUS or time.monotonic() >= deadline or not still_wanted():
                raise
            if not told:
                told = True
                await on_busy(node, error.message)
        await asyncio.sleep(AGENT_BUSY_POLL_S)


def agent_failure(node: str, error: AgentError) -> tuple[str, str]:
    """The reason and message a step fails with when a node's agent refused to start its session."""
    if error.status == BUSY_STATUS:
        wait = current().agent_busy_wait_seconds
        return "AgentBusy", f"node {node}: {error.message} (still, after waiting up to {wait:.0f}s)"
    return "AgentFailed", f"node {node}: {error}"


T = TypeVar("T")


async def each_agent(calls: Sequence[Awaitable[T]]) -> list[T | AgentError]:
    """The calls at once (at 128 agents, one after another would hold a cut back); an agent's failure
    comes back in its call's place, anything else is raised."""
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, AgentError):
            raise outcome
    return [o for o in outcomes if not isinstance(o, BaseException) or isinstance(o, AgentError)]


@dataclass(frozen=True)
class SessionEnd:
    """How following a node's session ended: `reason` is empty when the session succeeded."""

    report: SessionReport | None
    reason: str = ""
    message: str = ""


async def follow_session(
    gateway: AgentGateway,
    agent: Agent,
    session_id: str,
    absorb: Callable[[SessionReport], None],
    refused_reason: str = "PreflightRefused",
    fate: Callable[[float], Awaitable[str]] | None = None,
) -> SessionEnd:
    """Read a node's session report until it ends, handing each running or successful one to `absorb`
    (a failed session's rank phases say nothing of success). Unanswered polls are retried: an agent
    that is busy staging images may answer late; only silence for agent_unreachable_seconds fails.
    When the agent is lost, `fate(since)` may say why (agent_fate_now)."""
    node = agent.node
    last_answer = time.monotonic()
    began = time.time()

    async def why() -> str:
        return await fate(began) if fate is not None else ""

    while True:
        await asyncio.sleep(current().poll_seconds)
        try:
            report = await gateway.session(agent, session_id)
        except AgentError as error:
            silent = time.monotonic() - last_answer
            if silent > current().agent_unreachable_seconds:
                return SessionEnd(
                    None,
                    "AgentUnreachable",
                    f"node {node}: no answer for {silent:.0f}s ({error}){await why()}",
                )
            continue
        last_answer = time.monotonic()
        if report is None:
            return SessionEnd(
                None,
                "AgentLostSession",
                f"node {node}: the agent no longer knows session {session_id}{await why()}",
            )
        if report.state in (SessionState.RUNNING, SessionState.SUCCEEDED):
            absorb(report)
        if report.state.finished:
            if report.state == SessionState.SUCCEEDED:
                return SessionEnd(report)
            reason = {SessionState.REFUSED: refused_reason, SessionState.ABORTED: "SessionAborted"}.get(
                report.state, "AgentFailed"
            )
            said = report.message or report.state.value
            # the agent's own messages often start with its node's name already
            return SessionEnd(report, reason, f"node {node}: {said.removeprefix(f'{node}: ')}")
