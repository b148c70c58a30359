"""The one client of the node agent API (the operator's). Standard library HTTPS, every call bounded.

    client = AgentClient("10.77.0.1", tls=client_context(ca_pem), token=token_for_that_node)
    info = client.info()
    report = client.checkpoint(CheckpointRequest(...))

Synchronous: from asyncio code, call it through `asyncio.to_thread` (each call holds a thread for at
most its timeout). The token must be for that node's agent alone (agent_audience; the operator's
cluster/agenttokens.py requests them): it is sent only once the TLS handshake has verified the agent.

The agent serves TLS only: the client trusts the release's CA alone (`tls`) and checks the agents' fixed
name (ibckpt.tls.AGENT_SERVER_NAME), not the node address it dials.
"""

from __future__ import annotations

import http.client
import json
import ssl
from typing import TypeVar
from urllib.parse import quote

from pydantic import ValidationError

from ibckpt.agentapi.models import (
    API_PREFIX,
    DEFAULT_PORT,
    LEADER_EPOCH_HEADER,
    AbortRequest,
    AgentInfo,
    AgentModel,
    CheckpointRequest,
    ContainerList,
    LeaderEpoch,
    RestoreRequest,
    SessionReport,
    format_epoch,
)
from ibckpt.tls import AGENT_SERVER_NAME

MAX_REPLY = 16 * 1024 * 1024
M = TypeVar("M", bound=AgentModel)


class AgentError(Exception):
    """A call failed: status is the HTTP status (0 when the agent could not be reached or answered badly)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message


class _NamedTlsConnection(http.client.HTTPConnection):
    """HTTPS to an address, the certificate checked against a name the address does not carry."""

    def __init__(self, host: str, port: int, timeout: float, context: ssl.SSLContext, name: str) -> None:
        super().__init__(host, port, timeout=timeout)
        self._context = context
        self._name = name

    def connect(self) -> None:
        super().connect()
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._name)


class AgentClient:
    def __init__(
        self,
        host: str,
        port: int = DEFAULT_PORT,
        *,
        tls: ssl.SSLContext,
        server_name: str = AGENT_SERVER_NAME,
        token: str,
        timeout_s: float = 10.0,
        leader_epoch: LeaderEpoch | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.tls = tls
        self.server_name = server_name
        self.leader_epoch = leader_epoch  # None: a caller that does not elect (tests, the CLI)
        self._token = token

    def __repr__(self) -> str:  # never the token
        return f"AgentClient({self.host}:{self.port})"

    # -- the endpoints -----------------------------------------------------------------------------------

    def healthy(self) -> bool:
        try:
            status, _ = self._call("GET", "/healthz", None, auth=False)
        except AgentError:
            return False
        return status == 200

    def info(self) -> AgentInfo:
        return self._get(f"{API_PREFIX}/info", AgentInfo)

    def containers(self) -> ContainerList:
        return self._get(f"{API_PREFIX}/containers", ContainerList)

    def checkpoint(self, request: CheckpointRequest) -> SessionReport:
        return self._post(f"{API_PREFIX}/sessions/checkpoint", request, SessionReport)

    def restore(self, request: RestoreRequest) -> SessionReport:
        return self._post(f"{API_PREFIX}/sessions/restore", request, SessionReport)

    def session(self, session_id: str) -> SessionReport:
        return self._get(f"{API_PREFIX}/sessions/{quote(session_id, safe='')}", SessionReport)

    def abort(self, session_id: str, reason: str, rejoin: tuple[str, str] | None = None) -> SessionReport:
        """`rejoin`: (host:port, token) of the coordinator to rebuild released ranks through (the session's
        own, or the one replacing it after an operator restart)."""
        path = f"{API_PREFIX}/sessions/{quote(session_id, safe='')}/abort"
        request = AbortRequest(reason=reason)
        if rejoin is not None:
            request = AbortRequest(reason=reason, coordinator=rejoin[0], session_token=rejoin[1])  # type: ignore[arg-type]
        return self._post(path, request, SessionReport)

    # -- plumbing ----------------------------------------------------------------------------------------

    def _get(self, path: str, reply: type[M]) -> M:
        _, body = self._call("GET", path, None)
        return self._parse(path, body, reply)

    def _post(self, path: str, request: AgentModel, reply: type[M]) -> M:
        _, body = self._call("POST", path, request.to_json())
        return self._parse(path, body, reply)

    def _parse(self, path: str, body: bytes, reply: type[M]) -> M:
        try:
            return reply.from_json(body)
        except ValidationError as exc:
            raise AgentError(0, f"agent {self.host}:{self.port}{path}: bad reply: {exc}") from exc

    def _call(
        self,
        method: str,
        path: str,
        body: bytes | None,
        auth: bool = True,
        content_type: str = "application/json",
    ) -> tuple[int, bytes]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        if auth:
            headers["Authorization"] = f"Bearer {self._token}"
            if self.leader_epoch is not None:
                headers[LEADER_EPOCH_HEADER] = format_epoch(self.leader_epoch)
        where = f"agent {self.host}:{self.port}"
        conn = _NamedTlsConnection(self.host, self.port, self.timeout_s, self.tls, self.server_name)
        try:
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read(MAX_REPLY + 1)
        except (OSError, http.client.HTTPException) as exc:  # TimeoutError, ssl.SSLError are OSErrors
            raise AgentError(0, f"{where}: {method} {path}: {exc}") from exc
        finally:
            conn.close()
        if len(data) > MAX_REPLY:
            raise AgentError(0, f"{where}: {method} {path}: reply larger than {MAX_REPLY} bytes")
        if response.status >= 400:
            raise AgentError(response.status, f"{where}: {method} {path}: {_error_text(data)}")
        return response.status, data


def _error_text(data: bytes) -> str:
    try:
        parsed = json.loads(data)
    except ValueError:
        return data[:500].decode(errors="replace")
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, str):
        return error
    return data[:500].decode(errors="replace")
