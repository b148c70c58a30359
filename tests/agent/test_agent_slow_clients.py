"""Idle and slow-loris connections to the agent's API (review N3): capped, dropped after the bound,
and the operator's calls answered meanwhile, over TLS; a handshake never finished counts the same.
Host-level: the real server on 127.0.0.1."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from agent.agent_harness import Running

from ibckpt_node.agent import httpserver

AUTH = {"Authorization": "Bearer op-token"}


def _slow_client(agent: Running) -> socket.socket:
    """A client that finishes the handshake, sends half a request head, then nothing."""
    sock = agent.tls_socket()
    sock.sendall(b"POST /v1/sessions/checkpoint HTTP/1.1\r\nContent-Length: 1000000\r\n")
    return sock


def _silent_client(port: int) -> socket.socket:
    """A client that connects and never starts the TLS handshake."""
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server ended the connection (an answer then end of stream, or a reset) in time."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def test_slow_clients_are_capped_and_dropped_and_the_operator_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(httpserver, "READ_TIMEOUT_S", 1.0)
    monkeypatch.setattr(httpserver, "MAX_CONNECTIONS", 8)
    agent = Running(tmp_path / "state")
    try:
        slow = [_slow_client(agent) for _ in range(4)] + [_silent_client(agent.port) for _ in range(4)]
        time.sleep(0.2)
        # over the cap: the operator's call displaces the oldest slow client and is answered
        status, _, _ = agent.raw("GET", "/v1/info", AUTH)
        assert status == 200
        assert _closed_within(slow[0], 2)
        more = [_silent_client(agent.port) for _ in range(10)]  # a flood only displaces itself
        more += [_slow_client(agent) for _ in range(10)]
        status, _, _ = agent.raw("GET", "/v1/info", AUTH)
        assert status == 200
        assert agent.server.http._open <= 8
        # every slow client is gone within the read bound (408 or a reset), none is held
        for sock in [*slow[1:], *more]:
            assert _closed_within(sock, 3)
            sock.close()
        # its handler thread counts the connection out just after closing it: a moment later, none held
        deadline = time.monotonic() + 2
        while agent.server.http._open and time.monotonic() < deadline:
            time.sleep(0.02)
        assert agent.server.http._open == 0
        status, _, _ = agent.raw("GET", "/v1/info", AUTH)
        assert status == 200
    finally:
        agent.stop()
