"""The node agent on the host for tests/agent: its server in a thread; registrations as the hook does."""

from __future__ import annotations

import asyncio
import http.client
import socket
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ibckpt.agentapi import AgentClient
from ibckpt.store import ManifestKeys
from ibckpt.tls import AGENT_SERVER_NAME
from ibckpt_node.agent.auth import Authenticator, Review, Reviewer
from ibckpt_node.agent.server import AgentServer
from ibckpt_node.agent.servingcert import ServingCertificate
from ibckpt_node.hook import client as registry_client
from ibckpt_node.registry import ContainerRegistry
from testbed.tlsfiles import Pki, shared_pki

OPERATOR = "system:serviceaccount:ibckpt:ibckpt-operator"
AGENTS = "system:serviceaccount:ibckpt:ibckpt-agent"  # the agents' own account (the memory tier)
TOKENS = {"op-token": OPERATOR, "other-token": "system:serviceaccount:default:default", "agent-token": AGENTS}


def stand_in_criu(tmp_path: Path, script: str) -> Path:
    """tmp_path/bin/criu: a Python `script` standing in for CRIU (put its dir first on PATH); its path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    criu = bin_dir / "criu"
    criu.write_text(f"#!{sys.executable}\n{script}")
    criu.chmod(0o755)
    return criu


# The image key set the tests' agents sign and verify with; a test's commit signs with it as the operator.
IMAGE_KEYS = ManifestKeys({"test-key": bytes(range(32))})


def write_image_keys(directory: Path, keys: ManifestKeys = IMAGE_KEYS) -> Path:
    """`keys` as the chart's Secret volume holds them: one file per key id."""
    directory.mkdir(parents=True, exist_ok=True)
    for key_id, secret in keys.keys.items():
        (directory / key_id).write_bytes(secret)
    return directory


class Stub:
    """Plays the apiserver's TokenReview: knows two tokens, counts the reviews."""

    def __init__(self) -> None:
        self.reviews = 0

    async def __call__(self, token: str) -> Review:
        self.reviews += 1
        if token == "apiserver-down":
            return Review(False, error="TokenReview failed: connection refused", unavailable=True)
        user = TOKENS.get(token)
        return Review(True, user) if user else Review(False, error="invalid bearer token")


class Running:
    """`reviewer`: the TokenReview stub by default (a real TokenReviewer in the audience tests)."""

    def __init__(
        self, state: Path, pki: Pki | None = None, *, node: str = "node-x", reviewer: Reviewer | None = None,
        allowed: str = OPERATOR, memory_budget: int = 0, memory_token_file: Path | None = None,
    ) -> None:  # fmt: skip
        self.pki = pki or shared_pki()  # the CA the tests' coordinators serve with
        state.parent.mkdir(parents=True, exist_ok=True)
        tls_dir = Path(tempfile.mkdtemp(prefix="agent-tls-", dir=state.parent))  # one per agent run
        self.certificate = ServingCertificate(self.pki.agent_dir(tls_dir))
        self.reviewer = Stub()
        self.node = node
        self.loop = asyncio.new_event_loop()
        self.server = AgentServer(
            node=node,
            host="127.0.0.1",
            port=0,
            registry=ContainerRegistry(state),
            authenticator=Authenticator(reviewer or self.reviewer, frozenset({allowed})),
            tls=self.certificate.context,
            coordinator_tls=self.pki.client,
            work_dir=state,
            shim_path=str(state / "lib" / "libibckpt.so"),
            image_keys=write_image_keys(state.with_name(state.name + "-image-keys")),
            memory_budget=memory_budget,
            memory_authenticator=Authenticator(reviewer or self.reviewer, frozenset({AGENTS})),
            memory_token_file=memory_token_file,
        )
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.port = self.server.http.port

    def client(self, token: str = "op-token") -> AgentClient:
        return AgentClient("127.0.0.1", self.port, tls=self.pki.client(), token=token, timeout_s=5)

    def tls_socket(self, timeout: float = 5) -> ssl.SSLSocket:
        """A connection that trusts the release's CA and checks the agents' name, as the operator does."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        return self.pki.client().wrap_socket(sock, server_hostname=AGENT_SERVER_NAME)

    def raw(self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b"") -> Any:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        conn.sock = self.tls_socket()
        try:
            conn.request(method, path, body=body or None, headers=headers or {})
            reply = conn.getresponse()
            return reply.status, dict(reply.getheaders()), reply.read()
        finally:
            conn.close()

    def stop(self, stop_timeout_s: float = 30.0) -> None:
        """Stop as on SIGTERM: running sessions are aborted and waited for."""
        closing = self.server.close(stop_timeout_s)
        asyncio.run_coroutine_threadsafe(closing, self.loop).result(stop_timeout_s + 30)
        self.crash()

    def crash(self) -> None:
        """Stop dead, as a killed agent does: nothing is aborted, closed or cleaned up."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def register(
    state: Path, pid: int, cid: str, *, shim: bool = True, sockets: int = 1, shim_build: str | None = None
) -> list[socket.socket]:
    """Register pid as a container the way ibckpt-hook does, with `sockets` control sockets made."""
    ctl = state / "containers" / cid / "ctl"
    ctl.mkdir(parents=True)
    made = []
    for i in range(sockets):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(ctl / f"{1 + i}.sock"))
        made.append(s)
    register_entry(state, pid, cid, shim=shim, shim_build=shim_build)
    return made


def register_entry(
    state: Path, pid: int, cid: str, *, shim: bool = True, shim_build: str | None = None
) -> None:
    ctl = state / "containers" / cid / "ctl"
    entry = {
        "container_id": cid,
        "namespace": "ml",
        "pod": f"pod-{cid}",
        "pod_uid": f"uid-{cid}",
        "container": "main",
        "pid": pid,
        "pid_start": registry_client.process_start(pid),
        "control_dir": str(ctl),
        "control_socket": str(ctl / "1.sock"),
        "shim": shim,
        "reason": "" if shim else "no ibckpt-runc",
        "registered_at": time.time(),
    }
    if shim_build is not None:  # the hook writes it for a container that mounts a content-addressed build
        entry["shim_build"] = shim_build
    # as the hook: on disk for a registry that starts later (or again), and to the one serving
    registry_client.write_json_atomic(str(ctl.parent / "registration.json"), entry)
    registry_client.register(str(state / "registry.sock"), entry, 5.0)
