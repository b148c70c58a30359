"""The agent API (ibckpt.agentapi) over the agent's own HTTPS server, with the registry and the sessions."""

from __future__ import annotations

import hashlib
import logging
import re
import ssl
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import ValidationError

import ibckpt
from ibckpt.agentapi import models as api
from ibckpt.agentapi.memory import COPIES, MANIFESTS, MEMORY
from ibckpt_node import rdma_devices
from ibckpt_node.agent import memoryroutes
from ibckpt_node.agent.auth import Authenticator, AuthError, FirstAccepting
from ibckpt_node.agent.disk import DEFAULT_KEEP_FAILED_S
from ibckpt_node.agent.fence import Fenced, LeaderFence
from ibckpt_node.agent.httpserver import HttpServer, Request, Response, TlsContext
from ibckpt_node.agent.kubesecrets import SecretReader
from ibckpt_node.agent.memorytier import MemoryShelf
from ibckpt_node.agent.session import SessionError
from ibckpt_node.agent.sessions import Sessions
from ibckpt_node.registry import ContainerRegistry, RegisteredContainer

log = logging.getLogger(__name__)

SESSION_PATH = re.compile(r"^/v1/sessions/([a-z0-9][-a-z0-9.]{0,127})(/abort)?$")


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "ibckpt_agent_requests", "API calls answered", ["route", "code"], registry=registry
        )
        self.containers = Gauge(
            "ibckpt_agent_registered_containers", "Live registered containers", ["shim"], registry=registry
        )
        self.sessions = Counter(
            "ibckpt_agent_sessions", "Sessions finished on this node", ["kind", "state"], registry=registry
        )
        self.session_bytes = Counter(
            "ibckpt_agent_session_image_bytes", "Image bytes written by finished sessions", registry=registry
        )
        self.running = Gauge("ibckpt_agent_sessions_running", "Sessions running now", registry=registry)


def error(status: int, message: str) -> Response:
    return Response(status, api.ErrorReply(error=message).to_json())


def ok(model: api.AgentModel, status: int = 200) -> Response:
    return Response(status, model.to_json())


def wire_entry(entry: RegisteredContainer) -> api.RegisteredContainer:
    return api.RegisteredContainer(
        container_id=entry.container_id,
        namespace=entry.namespace,
        pod=entry.pod,
        pod_uid=entry.pod_uid,
        container=entry.container,
        pid=entry.pid,
        control_socket=entry.control_socket,
        sockets=entry.sockets(),
        shim=entry.shim,
        shim_build=entry.shim_build,
        reason=entry.reason,
    )


class AgentServer:
    def __init__(
        self,
        node: str,
        host: str,
        port: int,
        registry: ContainerRegistry,
        authenticator: Authenticator,
        tls: TlsContext,
        coordinator_tls: Callable[[], ssl.SSLContext],
        work_dir: Path,
        shim_path: str,
        shim_present_path: Path | None = None,
        metrics: CollectorRegistry | None = None,
        secrets: SecretReader | None = None,
        keep_failed_images_s: float = DEFAULT_KEEP_FAILED_S,
        readiness: Callable[[], tuple[bool, str]] | None = None,
        image_keys: Path | None = None,
        disk_reserve_bytes: int = 0,
        pre_upload: bool = True,
        shim_builds: Callable[[], list[str]] | None = None,
        criu_plugins: str = "",
        memory_budget: int = 0,
        memory_authenticator: Authenticator | None = None,
        memory_token_file: Path | None = None,
        disk_window_bytes: int = 0,
    ) -> None:
        self.node = node
        # the node's own readiness (nodesetup: prerequisites, runtime handler), on top of serving
        self.readiness = readiness or (lambda: (True, ""))
        self.registry = registry
        self.auth = authenticator
        # the memory tier (memorytier.py): what this agent holds for the others; the agents' own tokens
        # (memory_authenticator) open its routes, as the operator's do
        self.shelf = MemoryShelf(node, memory_budget)
        others = (memory_authenticator,) if memory_authenticator is not None else ()
        self.memory_auth = FirstAccepting(*others, authenticator)
        self.agent_identities = memory_authenticator.allowed if memory_authenticator else frozenset()
        self.shim_path = shim_path
        self.shim_present_path = shim_present_path or Path(shim_path)
        self._shim_digest: tuple[tuple[int, int, int], str] | None = None
        # every shim build the node keeps (a restore mounts its checkpoint's); by default the current one
        self.shim_builds = shim_builds or (lambda: [d] if (d := self.shim_digest()) else [])
        self.metrics = Metrics(metrics or CollectorRegistry())
        self.sessions = Sessions(
            node,
            registry,
            work_dir,
            self._finished,
            secrets,
            keep_failed_images_s,
            image_keys,
            disk_reserve_bytes,
            pre_upload,
            coordinator_tls=coordinator_tls,
            criu_plugins=criu_plugins,
            memory_token_file=memory_token_file,
            shelf=self.shelf,
            disk_window_bytes=disk_window_bytes,
        )
        self.fence = LeaderFence(work_dir / "leader-epoch")
        self.http = HttpServer(host, port, self.handle, error, tls)
        self.ready = False

    @property
    def address(self) -> str:
        host = f"[{self.http.host}]" if ":" in self.http.host else self.http.host
        return f"{host}:{self.http.port}"

    async def start(self) -> None:
        await self.registry.start()
        self.sessions.start_sweeping()  # what earlier sessions left on the disk, first of all
        await self.http.start()
        self.ready = True
        log.info("node agent for %s serving %s", self.node, self.address)

    async def close(self, stop_timeout_s: float = 30.0) -> None:
        """Stop: the API is served until the sessions ended. A `helm upgrade` rolls the operator with
        the agents, and a session that lost its coordinator mid-abort brings its released ranks back
        only through the abort naming the next operator's; new sessions are refused meanwhile."""
        self.ready = False
        await self.sessions.close(stop_timeout_s)
        await self.http.close()
        await self.registry.close()

    def _finished(self, report: api.SessionReport) -> None:
        self.metrics.sessions.labels(report.kind.value, report.state.value).inc()
        self.metrics.session_bytes.inc(report.bytes)
        self.metrics.running.set(len(self.sessions.running()))

    def containers(self) -> list[api.RegisteredContainer]:
        entries = [wire_entry(e) for e in self.registry.entries()]
        for shim in (True, False):
            self.metrics.containers.labels(str(shim).lower()).set(sum(e.shim is shim for e in entries))
        return entries

    async def handle(self, request: Request) -> Response:
        route = request.path if not request.path.startswith("/v1/sessions/") else "/v1/sessions/{id}"
        if request.path.startswith(COPIES + "/"):
            route = memoryroutes.ROUTE
        elif request.path.startswith(MANIFESTS + "/"):
            route = memoryroutes.MANIFEST_ROUTE
        response = await self._route(request)
        self.metrics.requests.labels(route if response.status != 404 else "other", str(response.status)).inc()
        return response

    async def _route(self, request: Request) -> Response:
        method, path = request.method, request.path
        if path == "/healthz" and method == "GET":
            if self.ready:
                return Response(200, b"ok\n", "text/plain")
            return Response(503, b"starting\n", "text/plain")
        if path == "/readyz" and method == "GET":
            node_ready, reason = self.readiness()
            if self.ready and node_ready:
                return Response(200, b"ok\n", "text/plain")
            return Response(503, ((reason or "starting") + "\n").encode(), "text/plain")
        if not path.startswith(api.API_PREFIX + "/"):
            return error(404, f"no such path {path}")
        if path.startswith(MEMORY + "/"):
            return await self._memory(request)
        try:
            await self.auth.check(request.headers.get("authorization"))
        except AuthError as exc:
            headers = {"WWW-Authenticate": 'Bearer realm="ibckpt-agent"'} if exc.status == 401 else {}
            response = error(exc.status, str(exc))
            response.headers.update(headers)
            return response
        try:  # after the token: a stranger's epoch never moves the fence
            self.fence.check(request.headers.get(api.LEADER_EPOCH_HEADER.lower()))
        except Fenced as exc:
            log.warning("refused %s %s: %s", method, path, exc)
            return error(409, str(exc))
        try:
            return await self._api(method, path, request.body)
        except SessionError as exc:
            return error(exc.status, str(exc))
        except ValidationError as exc:
            return error(422, f"bad request body: {exc}")

    async def _memory(self, request: Request) -> Response:
        """The memory tier's routes: the agents call them too, with no leader epoch, so the fence is for the
        operator's calls alone (it lists and drops copies as the leader it is)."""
        try:
            caller = await self.memory_auth.check(request.headers.get("authorization"))
        except AuthError as exc:
            return error(exc.status, str(exc))
        if caller not in self.agent_identities:
            try:
                self.fence.check(request.headers.get(api.LEADER_EPOCH_HEADER.lower()))
            except Fenced as exc:
                log.warning("refused %s %s: %s", request.method, request.path, exc)
                return error(409, str(exc))
        return memoryroutes.handle(self.shelf, request.method, request.path, request.body)

    def shim_digest(self) -> str | None:
        """sha256 of the node's shim file: a restored process maps it again, so a checkpoint records it
        (hashed again only when the file changed)."""
        try:
            info = self.shim_present_path.stat()
        except OSError:
            return None
        stamp = (info.st_ino, info.st_size, info.st_mtime_ns)
        if self._shim_digest is None or self._shim_digest[0] != stamp:
            digest = hashlib.sha256(self.shim_present_path.read_bytes()).hexdigest()
            self._shim_digest = (stamp, digest)
        return self._shim_digest[1]

    async def _api(self, method: str, path: str, body: bytes) -> Response:
        if path == "/v1/info" and method == "GET":
            return ok(
                api.AgentInfo(
                    node=self.node,
                    version=ibckpt.__version__,
                    formats=api.AgentFormats.this_release(),
                    ready=self.ready,
                    address=self.address,
                    shim_path=self.shim_path,
                    shim_present=self.shim_present_path.is_file(),
                    shim_sha256=self.shim_digest(),
                    shim_builds=self.shim_builds(),
                    containers=self.containers(),
                    sessions=self.sessions.running(),
                    rdma_devices=rdma_devices.node_devices(),
                )
            )
        if path == "/v1/containers" and method == "GET":
            return ok(api.ContainerList(node=self.node, containers=self.containers()))
        if path == "/v1/sessions/checkpoint" and method == "POST":
            report = self.sessions.start_checkpoint(api.CheckpointRequest.from_json(body))
            self.metrics.running.set(len(self.sessions.running()))
            return ok(report, 202)
        if path == "/v1/sessions/restore" and method == "POST":
            report = self.sessions.start_restore(api.RestoreRequest.from_json(body))
            self.metrics.running.set(len(self.sessions.running()))
            return ok(report, 202)
        match = SESSION_PATH.match(path)
        if match and match.group(1) not in ("checkpoint", "restore"):
            if match.group(2) and method == "POST":
                abort = api.AbortRequest.from_json(body)
                return ok(await self.sessions.abort(match.group(1), abort.reason, abort))
            if not match.group(2) and method == "GET":
                return ok(self.sessions.get(match.group(1)))
        if path.startswith("/v1/"):
            return error(405 if self._known(path) else 404, f"{method} {path} is not part of the agent API")
        return error(404, f"no such path {path}")

    @staticmethod
    def _known(path: str) -> bool:
        return path in ("/v1/info", "/v1/containers") or bool(SESSION_PATH.match(path))
