"""The operator's tokens for the agents: one per node, short-lived, bound to that node's agent alone.

Each comes from the TokenRequest API for the operator's own service account (the chart lets it create
tokens of that account only) with the audience agentapi.agent_audience(node). An agent reviews tokens for
its own node's audience, so a token taken from a call to one agent is refused by every other agent
(401), and the apiserver does not take it either. A node's token is reused until half its life is gone:
a call never carries one that expires during it, and a request a minute per node at most reaches the
apiserver however often the agents are polled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ibckpt.agentapi import AgentError, agent_audience
from ibckpt_operator.cluster.kube import ApiException, Kube

TOKEN_SECONDS = 600  # the shortest life the apiserver grants
REUSE_FOR = 0.5  # of a token's life
Requester = Callable[[str, int], Awaitable[str]]  # (audience, seconds) -> token


@dataclass(frozen=True)
class CachedToken:
    token: str
    until: float  # monotonic seconds: used before this, requested again after


class AgentTokens:
    def __init__(
        self, request: Requester, seconds: int = TOKEN_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._request = request
        self._seconds = seconds
        self._clock = clock
        self._cache: dict[str, CachedToken] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    @classmethod
    def of_account(cls, kube: Kube, namespace: str, account: str) -> AgentTokens:
        """Tokens of the service account `namespace`/`account` (the operator's own), from the apiserver."""
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"

        async def request(audience: str, seconds: int) -> str:
            spec = {"audiences": [audience], "expirationSeconds": seconds}
            body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
            reply: Any = await kube.request("POST", path, body)
            token = ((reply or {}).get("status") or {}).get("token")
            if not isinstance(token, str) or not token:
                raise ValueError(f"no token in the TokenRequest's answer for {namespace}/{account}")
            return token

        return cls(request)

    def cached(self, node: str) -> str | None:
        """The node's token while it may still be used, else None (token() gets a new one)."""
        held = self._cache.get(node)
        return held.token if held is not None and self._clock() < held.until else None

    async def token(self, node: str) -> str:
        """A token only `node`'s agent accepts; AgentError(0) if the apiserver gives none."""
        async with self._locks.setdefault(node, asyncio.Lock()):  # one request per node at a time
            held = self.cached(node)
            if held is not None:
                return held
            asked = self._clock()
            try:
                token = await self._request(agent_audience(node), self._seconds)
            except (ApiException, OSError, ValueError) as error:
                raise AgentError(0, f"no token for the agent of node {node}: {error}") from error
            self._cache[node] = CachedToken(token, asked + self._seconds * REUSE_FOR)
            return token
