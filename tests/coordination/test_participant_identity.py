"""Each participant speaks only as itself: a credential of its own.

The real coordinator over its real socket, real clients: no part of the coordinator is stubbed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator

import pytest

from ibckpt.coordination.client import CoordinatorClient, CoordinatorError
from ibckpt.coordination.wire import PROTOCOL_VERSION, Frame, Kind, SocketFrameReader, send_buffers
from ibckpt_operator.coordinator.server import CoordinatorServer


@pytest.fixture
async def server() -> AsyncIterator[CoordinatorServer]:
    srv = CoordinatorServer()
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def _raw_hello(port: int, header: object) -> Frame:
    """The coordinator's reply to one HELLO frame, sent as it is."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await send_buffers(sock, Frame(Kind.HELLO, header).buffers())  # type: ignore[arg-type]
        return await asyncio.wait_for(SocketFrameReader(sock).read(), 5)
    finally:
        sock.close()


async def test_each_participant_has_its_own_credential_and_anothers_is_refused(
    server: CoordinatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    session, tokens = server.create_session({"node-a", "node-b"}, deadline_s=60)
    _, later = server.create_session({"node-a", "node-b"}, deadline_s=60)
    assert len({tokens["node-a"], tokens["node-b"], later["node-a"], later["node-b"]}) == 4
    caplog.set_level(logging.WARNING, "ibckpt_operator.coordinator.server")

    # node-b's agent (or whoever learned its credential) says it is node-a
    with pytest.raises(CoordinatorError, match=r"refused node-a: .*the credential is not 'node-a''s"):
        await CoordinatorClient.connect("127.0.0.1", server.port, session, "node-a", tokens["node-b"])
    # node-a's own credential of another session is no better
    with pytest.raises(CoordinatorError, match="refused node-a"):
        await CoordinatorClient.connect("127.0.0.1", server.port, session, "node-a", later["node-a"])
    assert "the credential is not this participant's" in caplog.text
    assert tokens["node-b"] not in caplog.text and later["node-a"] not in caplog.text
    # a HELLO whose fields are not strings is refused, not turned into names by str()
    bad = {
        "version": PROTOCOL_VERSION,
        "session": session,
        "participant": ["node-a"],
        "token": tokens["node-a"],
    }
    refused = await _raw_hello(server.port, bad)
    assert refused.kind == Kind.ERROR and refused.header["error"] == "auth", refused.header
    for name, token in (("node-a", "\ud800"), ("\ud800", tokens["node-a"])):  # lone surrogates: refused
        refused = await _raw_hello(server.port, {**bad, "participant": name, "token": token})
        assert refused.kind == Kind.ERROR and refused.header["error"] == "auth", refused.header
    assert not any(server._connections[session])  # nothing above got in

    # with its own credential, each is itself: its barrier arrival counts for it alone
    a = await CoordinatorClient.connect("127.0.0.1", server.port, session, "node-a", tokens["node-a"])
    b = await CoordinatorClient.connect("127.0.0.1", server.port, session, "node-b", tokens["node-b"])
    try:
        waiting = asyncio.ensure_future(a.barrier("joined", 10))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await b.barrier("joined", 10)
        await waiting
    finally:
        await a.close()
        await b.close()
