"""A token taken from one call is worthless elsewhere (review N2): the operator's tokens are each bound to
one node's agent (agentapi.agent_audience), and each agent reviews tokens for its own node alone.

On the real apiserver (v1.20): the operator's token requests (cluster/agenttokens.py) and the agents'
real TokenReviewer, two real agents on 127.0.0.1 over TLS. The pure parts below it."""

from __future__ import annotations

import asyncio
import secrets
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from agent.agent_harness import Running

from ibckpt.agentapi import AGENT_AUDIENCE, AgentClient, AgentError, agent_audience
from ibckpt_node.agent.auth import TokenReviewer, review_status
from ibckpt_operator.cluster.agenttokens import AgentTokens
from ibckpt_operator.cluster.kube import Kube
from testbed.kube import ControlPlane


def test_each_nodes_agent_has_an_audience_of_its_own() -> None:
    assert agent_audience("node-a") == "ibckpt-agent:node-a" != agent_audience("node-b")
    assert agent_audience("node-a").startswith(AGENT_AUDIENCE + ":")
    with pytest.raises(ValueError):
        agent_audience("")
    with pytest.raises(ValueError):
        agent_audience("node a")


def test_a_review_counts_only_for_the_agents_own_audience() -> None:
    user = {"username": "system:serviceaccount:ibckpt:ibckpt-operator"}
    mine = {"authenticated": True, "user": user, "audiences": ["ibckpt-agent:node-a"]}
    assert review_status(mine, "ibckpt-agent:node-a").authenticated
    # an apiserver that ignored the audience asked for: its answer names another, and is refused
    theirs = {"authenticated": True, "user": user, "audiences": ["ibckpt-agent:node-b"]}
    refused = review_status(theirs, "ibckpt-agent:node-a")
    assert not refused.authenticated and "not for audience ibckpt-agent:node-a" in refused.error
    assert not review_status({"authenticated": True, "user": user}, "ibckpt-agent:node-a").authenticated
    assert not review_status(
        {"authenticated": False, "error": "expired"}, "ibckpt-agent:node-a"
    ).authenticated


async def test_a_nodes_token_is_reused_until_half_its_life_then_requested_again() -> None:
    asked: list[tuple[str, int]] = []
    now = [1000.0]

    async def request(audience: str, seconds: int) -> str:
        asked.append((audience, seconds))
        return f"token-{len(asked)}"

    tokens = AgentTokens(request, seconds=600, clock=lambda: now[0])
    assert await tokens.token("node-a") == "token-1"
    assert await tokens.token("node-b") == "token-2"  # each node its own
    now[0] += 299
    assert await tokens.token("node-a") == "token-1" and tokens.cached("node-a") == "token-1"
    now[0] += 2  # past half of its life: never carried by a call it could expire during
    assert tokens.cached("node-a") is None
    assert await tokens.token("node-a") == "token-3"
    assert asked == [("ibckpt-agent:node-a", 600), ("ibckpt-agent:node-b", 600), ("ibckpt-agent:node-a", 600)]
    # calls at once for one node share one request
    now[0] += 1000
    got = await asyncio.gather(*(tokens.token("node-b") for _ in range(5)))
    assert set(got) == {"token-4"} and len(asked) == 4


async def test_no_token_from_the_apiserver_is_an_agent_error() -> None:
    async def request(audience: str, seconds: int) -> str:
        raise ValueError("no token in the TokenRequest's answer")

    with pytest.raises(AgentError) as failed:
        await AgentTokens(request).token("node-a")
    assert failed.value.status == 0 and "no token for the agent of node node-a" in failed.value.message


@pytest.mark.kube
def test_a_token_for_one_agent_is_refused_by_another_and_by_the_apiserver(
    kube: ControlPlane, kube_api: Any, tmp_path: Path
) -> None:
    import kubernetes

    namespace = "audience-" + secrets.token_hex(3)
    core: Any = kubernetes.client.CoreV1Api(kube_api)  # plain dicts as bodies
    core.create_namespace({"metadata": {"name": namespace}})
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "ibckpt-operator"}})
    operator = f"system:serviceaccount:{namespace}:ibckpt-operator"
    reviewer_token = tmp_path / "reviewer-token"  # the agents' own identity (here: the admin's)
    reviewer_token.write_text(kube.token)
    agents = {
        node: Running(
            tmp_path / node / "state",
            node=node,
            reviewer=TokenReviewer(kube.url, kube.ca_file, reviewer_token, agent_audience(node)),
            allowed=operator,
        )
        for node in ("node-a", "node-b")
    }
    try:
        tokens = AgentTokens.of_account(Kube(kube_api), namespace, "ibckpt-operator")
        token_a, token_b = (asyncio.run(tokens.token(node)) for node in ("node-a", "node-b"))
        assert token_a != token_b

        def call(node: str, token: str) -> int:
            agent = agents[node]
            try:
                AgentClient("127.0.0.1", agent.port, tls=agent.pki.client(), token=token, timeout_s=10).info()
            except AgentError as exc:
                return exc.status
            return 200

        assert call("node-a", token_a) == 200 and call("node-b", token_b) == 200
        # replayed: node-a's token at node-b, and the reverse
        assert call("node-b", token_a) == 401 and call("node-a", token_b) == 401
        # nor does the apiserver take it for the operator's own rights
        request = urllib.request.Request(
            f"{kube.url}/api/v1/namespaces/{namespace}/secrets",
            headers={"Authorization": f"Bearer {token_a}"},
        )
        with pytest.raises(urllib.error.HTTPError) as apiserver:
            urllib.request.urlopen(
                request, context=ssl.create_default_context(cafile=str(kube.ca_file)), timeout=10
            )
        assert apiserver.value.code == 401
    finally:
        for agent in agents.values():
            agent.stop()
        core.delete_namespace(namespace)
