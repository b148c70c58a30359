"""The agent's API speaks TLS only, with the operator's certificate (review N2): the real server on
127.0.0.1, a real CA made in the test, the operator's real client."""

from __future__ import annotations

import asyncio
import http.client
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agent.agent_harness import Running

from ibckpt.agentapi import AgentClient, AgentError
from ibckpt.tls import COORDINATOR_SERVER_NAME
from ibckpt_node.agent.servingcert import ServingCertificate
from testbed.tlsfiles import make_pki


def test_plain_http_is_refused_and_nothing_is_answered_in_clear(agent: Running) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=5)
    with pytest.raises((http.client.HTTPException, ConnectionError)):  # no HTTP answer, whatever ends it
        conn.request("GET", "/healthz")
        conn.getresponse()
    conn.close()
    sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
    sock.sendall(b"GET /v1/info HTTP/1.1\r\nAuthorization: Bearer op-token\r\n\r\n")
    try:
        reply = sock.recv(4096)
    except ConnectionResetError:
        reply = b""
    assert b"HTTP/1.1" not in reply and b"node-x" not in reply
    sock.close()
    assert agent.reviewer.reviews == 0  # the token never reached the agent's check
    assert agent.client().info().node == "node-x"


def test_a_client_that_does_not_trust_the_operators_ca_fails(agent: Running) -> None:
    stranger = make_pki()
    with pytest.raises(AgentError) as refused:
        AgentClient("127.0.0.1", agent.port, tls=stranger.client(), token="op-token", timeout_s=5).info()
    assert refused.value.status == 0 and "CERTIFICATE_VERIFY_FAILED" in refused.value.message
    # nor does the system's trust store know it
    with pytest.raises(AgentError):
        AgentClient("127.0.0.1", agent.port, tls=ssl.create_default_context(), token="op-token").info()
    assert agent.reviewer.reviews == 0


def test_the_operators_client_refuses_another_cas_agent_and_another_name(tmp_path: Path) -> None:
    operator_trusts = make_pki()
    impostor = Running(tmp_path / "state")  # an agent whose certificate another CA signed
    try:
        with pytest.raises(AgentError) as refused:
            AgentClient("127.0.0.1", impostor.port, tls=operator_trusts.client(), token="op-token").info()
        assert "CERTIFICATE_VERIFY_FAILED" in refused.value.message
        assert impostor.reviewer.reviews == 0  # the token was never sent
        # the right CA, the wrong name: the coordinator's name is not the agents'
        wrong_name = AgentClient(
            "127.0.0.1", impostor.port, tls=impostor.pki.client(), server_name=COORDINATOR_SERVER_NAME,
            token="op-token",
        )  # fmt: skip
        with pytest.raises(AgentError) as mismatch:
            wrong_name.info()
        assert (
            "Hostname mismatch" in mismatch.value.message
            or "CERTIFICATE_VERIFY_FAILED" in mismatch.value.message
        )
        assert impostor.client().info().node == "node-x"
    finally:
        impostor.stop()


def test_a_renewed_certificate_is_served_without_a_restart(agent: Running) -> None:
    assert agent.client().info().node == "node-x"
    renewed = make_pki()  # the operator's new CA and certificate, as the kubelet swaps the Secret's files
    time.sleep(0.01)  # a new mtime even on coarse clocks
    renewed.agent_dir(agent.certificate.directory)
    trusting_renewed = AgentClient(
        "127.0.0.1", agent.port, tls=renewed.client(), token="op-token", timeout_s=5
    )
    assert trusting_renewed.info().node == "node-x"
    with pytest.raises(AgentError):
        agent.client().info()  # the old CA no longer signs what the agent serves


def test_the_agent_waits_for_the_operators_certificate_and_serves_it_once_written(tmp_path: Path) -> None:
    """The chart's Secret volume is optional: the kubelet fills it once the operator has issued it."""
    certificate = ServingCertificate(tmp_path / "agent-tls")

    async def later() -> ssl.SSLContext:
        waiting = asyncio.create_task(certificate.wait(30, poll_s=0.05))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        make_pki().agent_dir(tmp_path / "agent-tls")
        return await waiting

    assert isinstance(asyncio.run(later()), ssl.SSLContext)


def test_an_agent_given_no_certificate_in_time_says_so_and_exits(tmp_path: Path) -> None:
    (tmp_path / "agent-tls").mkdir()
    started = time.monotonic()
    ran = subprocess.run(
        [sys.executable, "-m", "ibckpt_node.agent.main", "--node=node-x", "--address=127.0.0.1",
         "--port=0", "--metrics-port=0", "--allow=system:serviceaccount:ibckpt:ibckpt-operator",
         f"--host-dir={tmp_path / 'host'}", f"--tls-dir={tmp_path / 'agent-tls'}",
         "--tls-wait=1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == 2, ran.stderr
    assert "cannot serve the agent API" in ran.stderr
    assert "waited 1 s for the operator to issue it" in ran.stderr
    assert time.monotonic() - started >= 1
