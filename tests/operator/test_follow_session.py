"""How the operator follows a node's session: late answers are waited for, silence past the bound fails
the step, and a finished session ends the follow with the right reason (pure logic, a scripted agent)."""

from __future__ import annotations

import asyncio
import ssl
import threading
import time
from typing import Any

import pytest

from ibckpt.agentapi import AgentError, SessionKind, SessionReport, SessionState
from ibckpt_operator import config as settings
from ibckpt_operator.cluster.agents import Agent, AgentGateway, agent_fate, each_agent, follow_session

AGENT = Agent("node-a", "ibckpt-agent-x", "127.0.0.1", True)


def report(state: SessionState, message: str = "") -> SessionReport:
    return SessionReport(
        session_id="s1",
        kind=SessionKind.CHECKPOINT,
        node="node-a",
        state=state,
        message=message,
        started_at=time.time(),
    )


class ScriptedGateway(AgentGateway):
    """Answers each poll with the next entry: a report, None (unknown session) or an AgentError."""

    def __init__(self, answers: list[Any]) -> None:
        super().__init__(ssl.create_default_context(), token="t")  # never dials: scripted
        self.answers = answers
        self.polls = 0

    async def session(self, agent: Agent, session_id: str) -> SessionReport | None:
        self.polls += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, AgentError):
            raise answer
        return answer  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def fast_polls() -> Any:
    saved = settings.current()
    settings.configure(saved.with_(poll_seconds=0.01, agent_unreachable_seconds=0.3))
    yield
    settings.configure(saved)


def follow(answers: list[Any]) -> tuple[Any, list[SessionState], ScriptedGateway]:
    seen: list[SessionState] = []
    gateway = ScriptedGateway(answers)
    end = asyncio.run(follow_session(gateway, AGENT, "s1", lambda r: seen.append(r.state)))
    return end, seen, gateway


def test_an_agent_that_answers_late_is_waited_for() -> None:
    late = AgentError(0, "timed out")
    end, seen, gateway = follow(
        [report(SessionState.RUNNING), late, late, late, report(SessionState.SUCCEEDED)]
    )
    assert end.reason == "" and end.report is not None and end.report.state == SessionState.SUCCEEDED
    assert seen == [SessionState.RUNNING, SessionState.SUCCEEDED]
    assert gateway.polls == 5


def test_an_agent_silent_past_the_bound_fails_the_step() -> None:
    end, seen, _ = follow([report(SessionState.RUNNING), AgentError(0, "timed out")])
    assert end.reason == "AgentUnreachable" and end.report is None
    assert "node node-a: no answer for" in end.message and "timed out" in end.message
    assert seen == [SessionState.RUNNING]


def test_a_forgotten_session_is_lost() -> None:
    end, _, _ = follow([None])
    assert end.reason == "AgentLostSession" and "s1" in end.message


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (SessionState.REFUSED, "PreflightRefused"),
        (SessionState.ABORTED, "SessionAborted"),
        (SessionState.FAILED, "AgentFailed"),
    ],
)
def test_a_session_that_did_not_succeed_names_why(state: SessionState, reason: str) -> None:
    end, seen, _ = follow([report(state, "rank 3: ibv_alloc_dm is not supported")])
    assert end.reason == reason
    assert end.message == "node node-a: rank 3: ibv_alloc_dm is not supported"
    assert seen == []  # a failed session's rank phases are not progress


def test_a_message_that_names_its_node_already_is_not_prefixed_twice() -> None:
    end, _, _ = follow([report(SessionState.FAILED, "node-a: release of job/ring-1/main/19 failed")])
    assert end.message == "node node-a: release of job/ring-1/main/19 failed"


def test_each_agent_calls_all_at_once_and_returns_failures_in_place() -> None:
    started: list[str] = []

    async def call(node: str, fail: bool) -> str:
        started.append(node)
        await asyncio.sleep(0.05)
        if fail:
            raise AgentError(0, f"{node} timed out")
        return node

    async def run() -> tuple[list[Any], float]:
        begin = time.monotonic()
        outcomes = await each_agent([call(f"n{i}", i == 1) for i in range(20)])
        return outcomes, time.monotonic() - begin

    outcomes, seconds = asyncio.run(run())
    assert seconds < 0.5, seconds  # one after another would take 1 s
    assert outcomes[0] == "n0" and isinstance(outcomes[1], AgentError) and outcomes[19] == "n19"

    async def broken() -> str:
        raise RuntimeError("a bug, not an agent's failure")

    with pytest.raises(RuntimeError, match="a bug"):
        asyncio.run(each_agent([broken()]))


class SlowClient:
    """A blocking agent client whose info takes 0.2 s; counts the calls in flight on the gateway's threads."""

    lock = threading.Lock()
    running = 0
    most = 0

    def __init__(self, node: str) -> None:
        self.node = node

    def info(self) -> str:
        with SlowClient.lock:
            SlowClient.running += 1
            SlowClient.most = max(SlowClient.most, SlowClient.running)
        time.sleep(0.2)
        with SlowClient.lock:
            SlowClient.running -= 1
        if self.node == "n3":
            raise AgentError(0, "agent n3: connection refused")
        return self.node


class SlowGateway(AgentGateway):
    def client(self, agent: Agent) -> Any:
        return SlowClient(agent.node)


def test_the_gateway_calls_up_to_its_bound_at_once_whatever_the_default_executor() -> None:
    # 64 agents: the loop's default executor (6 threads on 2 cores) would take 11 rounds of 0.2 s
    agents = [Agent(f"n{i}", f"agent-{i}", "127.0.0.1", True) for i in range(64)]
    gateway = SlowGateway(ssl.create_default_context(), token="t", concurrency=32)
    started = time.monotonic()
    outcomes = asyncio.run(each_agent([gateway.info(a) for a in agents]))
    took = time.monotonic() - started
    assert SlowClient.most == 32
    assert took < 1.0, took  # two rounds, not eleven
    assert [o for o in outcomes if isinstance(o, str)] == [a.node for a in agents if a.node != "n3"]
    failed = [o for o in outcomes if isinstance(o, AgentError)]
    assert [str(f) for f in failed] == [str(AgentError(0, "agent n3: connection refused"))]


def agent_pod(name: str, node: str, terminated: dict[str, Any] | None = None) -> dict[str, Any]:
    status = {"name": "agent", "restartCount": 1 if terminated else 0, "lastState": {}}
    if terminated:
        status["lastState"] = {"terminated": terminated}
    return {"metadata": {"name": name}, "spec": {"nodeName": node}, "status": {"containerStatuses": [status]}}


def test_a_lost_session_names_the_oom_kill_that_restarted_the_agent() -> None:
    began = time.time()
    # ended after any `since` the check below allows (finishedAt has whole seconds; a loaded machine
    # starts the session more than a second after `began`)
    ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began + 6))
    killed = {"reason": "OOMKilled", "exitCode": 137, "finishedAt": ended}
    pods = [agent_pod("ibckpt-agent-x", "node-a", killed), agent_pod("ibckpt-agent-y", "node-b")]

    async def fate(since: float) -> str:
        assert abs(since - began) < 5
        return agent_fate(AGENT, pods, since - 1)

    end = asyncio.run(follow_session(ScriptedGateway([None]), AGENT, "s1", lambda _: None, fate=fate))
    assert end.reason == "AgentLostSession"
    assert end.message == (
        "node node-a: the agent no longer knows session s1; its pod ibckpt-agent-x restarted "
        "(agent: OOMKilled, exit 137): raise the chart's agent.resources.limits.memory (docs/node-agent.md)"
    )


def test_an_agent_fate_tells_only_what_happened_since_the_session_began() -> None:
    old = {"reason": "Error", "exitCode": 1, "finishedAt": "2026-01-01T00:00:00Z"}
    assert agent_fate(AGENT, [agent_pod("ibckpt-agent-x", "node-a", old)], time.time()) == ""
    assert agent_fate(AGENT, [agent_pod("ibckpt-agent-x", "node-a")], 0) == ""
    replaced = [agent_pod("ibckpt-agent-z", "node-a"), agent_pod("ibckpt-agent-y", "node-b")]
    assert agent_fate(AGENT, replaced, 0) == "; its pod ibckpt-agent-x is gone (now ibckpt-agent-z)"
    assert agent_fate(AGENT, [], 0) == "; its pod ibckpt-agent-x is gone"


def test_a_silent_agent_says_nothing_more_when_its_pod_tells_nothing() -> None:
    async def fate(since: float) -> str:
        return agent_fate(AGENT, [agent_pod("ibckpt-agent-x", "node-a")], since)

    gateway = ScriptedGateway([AgentError(0, "timed out")])
    end = asyncio.run(follow_session(gateway, AGENT, "s1", lambda _: None, fate=fate))
    assert end.reason == "AgentUnreachable" and end.message.endswith("(timed out)"), end.message
