"""The chart's RBAC lets the operator request short-lived tokens of its own service account for the
agents, one per node's audience, and of no other account (cluster/agenttokens.py on the real apiserver,
as the operator's account)."""

from __future__ import annotations

import asyncio
import base64
import json

import kubernetes
import pytest

from ibckpt.agentapi import AgentError
from ibckpt_operator.cluster.agenttokens import AgentTokens
from ibckpt_operator.cluster.kube import Kube
from testbed.operator_account import OPERATOR_ACCOUNT_NS as RELEASE_NS


def _claims(token: str) -> dict[str, object]:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


@pytest.mark.kube
def test_the_operator_gets_node_bound_tokens_of_its_own_account_only(
    kube_api: kubernetes.client.ApiClient, operator_account: tuple[Kube, str, str]
) -> None:
    kube, _, account = operator_account  # the Deployment's name is the account's
    core = kubernetes.client.CoreV1Api(kube_api)
    for name in (account, "someone-else"):
        try:
            core.create_namespaced_service_account(RELEASE_NS, {"metadata": {"name": name}})
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
    token = asyncio.run(AgentTokens.of_account(kube, RELEASE_NS, account).token("node-a"))
    claims = _claims(token)
    assert claims["aud"] == ["ibckpt-agent:node-a"]
    assert claims["sub"] == f"system:serviceaccount:{RELEASE_NS}:{account}"
    life = int(claims["exp"]) - int(claims["iat"])  # type: ignore[call-overload]
    assert 590 <= life <= 610  # short-lived
    with pytest.raises(AgentError) as refused:
        asyncio.run(AgentTokens.of_account(kube, RELEASE_NS, "someone-else").token("node-a"))
    assert "403" in refused.value.message or "Forbidden" in refused.value.message
