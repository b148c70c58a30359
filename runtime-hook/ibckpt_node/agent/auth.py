"""Who may call the agent: bearer tokens checked with a TokenReview, one service account accepted.

The operator sends a short-lived token of its service account bound to this node's agent alone
(agentapi.agent_audience(node)); the agent asks the apiserver whose it is for that audience (TokenReview,
which the agent's RBAC allows; a token for any other audience, another node's agent's or a legacy Secret
token among them, is not authenticated) and accepts only the identity the chart names
(`system:serviceaccount:<namespace>:<release>-operator`). No token or an invalid one: 401; a valid token
of anyone else: 403; no answer from the apiserver: 503. A reviewed token is remembered for a short while
(by its hash, never the token), so polling a session does not cost a TokenReview per call.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
CACHE_S = 60.0
MAX_TOKEN = 16 * 1024


@dataclass(frozen=True)
class Review:
    authenticated: bool
    username: str = ""
    error: str = ""
    unavailable: bool = False  # the apiserver could not be asked: no verdict on the token


Reviewer = Callable[[str], Awaitable[Review]]


class AuthError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class TokenReviewer:
    """Asks the apiserver (in-cluster: the kubernetes Service, the pod's own token and CA)."""

    def __init__(
        self, url: str, ca_file: Path, token_file: Path, audience: str, timeout_s: float = 5.0
    ) -> None:
        self.url = url.rstrip("/") + "/apis/authentication.k8s.io/v1/tokenreviews"
        self.audience = audience  # this node's agent's: agentapi.agent_audience(node)
        self.context = ssl.create_default_context(cafile=str(ca_file))
        self.token_file = token_file
        self.timeout_s = timeout_s

    @classmethod
    def in_cluster(cls, audience: str) -> TokenReviewer:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not in a pod: KUBERNETES_SERVICE_HOST is not set")
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", SA_DIR / "ca.crt", SA_DIR / "token", audience)

    async def __call__(self, token: str) -> Review:
        return await asyncio.to_thread(self._review, token)

    def _review(self, token: str) -> Review:
        spec = {"token": token, "audiences": [self.audience]}
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}
        request = urllib.request.Request(
            self.url,
            data=json.dumps(body).encode(),
            method="POST",
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {self.token_file.read_text().strip()}",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.context) as reply:
                status = json.load(reply).get("status", {})
        except urllib.error.HTTPError as exc:
            return Review(False, error=f"TokenReview refused: HTTP {exc.code}", unavailable=True)
        except (OSError, ValueError) as exc:
            return Review(False, error=f"TokenReview failed: {exc}", unavailable=True)
        if not isinstance(status, dict):
            return Review(False, error="TokenReview answered without a status", unavailable=True)
        return review_status(status, self.audience)


def review_status(status: dict[str, Any], audience: str) -> Review:
    """The verdict of a TokenReview's status for a token that must be for `audience`."""
    if not status.get("authenticated"):
        return Review(False, error=status.get("error") or "token not authenticated")
    if audience not in (status.get("audiences") or ()):  # an apiserver that ignored the audience
        return Review(False, error=f"the token is not for audience {audience}")
    return Review(True, username=str((status.get("user") or {}).get("username", "")))


class Authenticator:
    def __init__(self, reviewer: Reviewer, allowed: frozenset[str], cache_s: float = CACHE_S) -> None:
        self.reviewer = reviewer
        self.allowed = allowed
        self.cache_s = cache_s
        self._known: dict[str, tuple[str, float]] = {}  # sha256(token) -> (username, until)

    async def check(self, authorization: str | None) -> str:
        """The caller's identity; raises AuthError(401) or AuthError(403)."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError(401, "a bearer token is required")
        if len(token) > MAX_TOKEN:
            raise AuthError(401, "token too large")
        digest = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        known = self._known.get(digest)
        if known is not None and known[1] > now:
            username = known[0]
        else:
            review = await self.reviewer(token)
            if review.unavailable:
                log.warning("cannot check a caller: %s", review.error)
                raise AuthError(503, "the agent cannot check tokens now (TokenReview failed)")
            if not review.authenticated:
                log.info("refused a call: %s", review.error)
                raise AuthError(401, "the token was not authenticated")
            username = review.username
            self._known = {d: k for d, k in self._known.items() if k[1] > now}
            self._known[digest] = (username, now + self.cache_s)
        if username not in self.allowed:
            log.warning("refused a call from %s (not %s)", username, ", ".join(sorted(self.allowed)))
            raise AuthError(403, f"{username} may not use the node agent")
        return username


class FirstAccepting:
    """Several ways in (the memory tier's routes take the agents' own tokens and the operator's): the first
    authenticator that accepts the caller decides. Refused by all: 403 if one of them knew the caller
    (authenticated, not allowed), else 401; an apiserver that does not answer (503) ends there."""

    def __init__(self, *authenticators: Authenticator) -> None:
        self.authenticators = authenticators

    async def check(self, authorization: str | None) -> str:
        refused = AuthError(401, "the token was not authenticated")
        for authenticator in self.authenticators:
            try:
                return await authenticator.check(authorization)
            except AuthError as exc:
                if exc.status not in (401, 403):
                    raise
                if refused.status == 401:
                    refused = exc
        raise refused
