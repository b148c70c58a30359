"""Each participant speaks only as itself: its own credential, and only the keys it claimed.

The real coordinator over its real socket, real clients: no part of the coordinator is stubbed.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from ibckpt.coordination.channel import TlsChannel
from ibckpt.coordination.client import (
    CoordinationForbidden,
    CoordinationTimedOut,
    CoordinatorClient,
    CoordinatorError,
)
from ibckpt.coordination.keys import ZERO_GID, qp_key
from ibckpt.coordination.wire import PROTOCOL_VERSION, Frame, Kind, SocketFrameReader
from ibckpt.tls import COORDINATOR_SERVER_NAME
from ibckpt_operator.coordinator.server import CoordinatorServer
from testbed.tlsfiles import shared_pki

GID_A = "fe800000000000005054fffe770001aa"  # a rank of node-a's
GID_B = "fe800000000000005054fffe770002bb"


async def _pair(server: CoordinatorServer) -> tuple[CoordinatorClient, CoordinatorClient]:
    session, tokens = server.create_session({"node-a", "node-b"}, deadline_s=60)
    a = await CoordinatorClient.connect(
        "127.0.0.1", server.port, session, "node-a", tokens["node-a"], tls=shared_pki().client()
    )
    b = await CoordinatorClient.connect(
        "127.0.0.1", server.port, session, "node-b", tokens["node-b"], tls=shared_pki().client()
    )
    return a, b


async def _raw_hello(port: int, header: object) -> Frame:
    """The coordinator's reply to one HELLO frame, sent as it is."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        channel = await TlsChannel.connect(sock, shared_pki().client(), COORDINATOR_SERVER_NAME)
        await Frame(Kind.HELLO, header).send(channel)  # type: ignore[arg-type]
        return await asyncio.wait_for(SocketFrameReader(channel).read(), 5)
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
        await CoordinatorClient.connect(
            "127.0.0.1", server.port, session, "node-a", tokens["node-b"], tls=shared_pki().client()
        )
    # node-a's own credential of another session is no better
    with pytest.raises(CoordinatorError, match="refused node-a"):
        await CoordinatorClient.connect(
            "127.0.0.1", server.port, session, "node-a", later["node-a"], tls=shared_pki().client()
        )
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
    a = await CoordinatorClient.connect(
        "127.0.0.1", server.port, session, "node-a", tokens["node-a"], tls=shared_pki().client()
    )
    b = await CoordinatorClient.connect(
        "127.0.0.1", server.port, session, "node-b", tokens["node-b"], tls=shared_pki().client()
    )
    try:
        waiting = asyncio.ensure_future(a.barrier("joined", 10))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await b.barrier("joined", 10)
        await waiting
    finally:
        await a.close()
        await b.close()


async def test_a_write_of_another_participants_key_is_refused_and_changes_nothing(
    server: CoordinatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The review's forgery (N21, row 23): node-b overwrote node-a's rebuild record. Now its write is
    refused, named in the log, and what node-a published is what every reader still gets."""
    a, b = await _pair(server)
    caplog.set_level(logging.WARNING, "ibckpt_operator.coordinator.server")
    try:
        await a.put(qp_key(GID_A, 17), b"1")  # preflight: node-a's rank holds (GID_A, 17)
        await a.put_many({f"map/{GID_A}/17": b"real-a", f"e5/qp/{GID_A}/17": b"epoch5-a"})

        with pytest.raises(CoordinationForbidden, match=f"e5/qp/{GID_A}/17 \\(claimed by node-a\\)"):
            await b.put(f"e5/qp/{GID_A}/17", b"forged")
        # a batch with one forged key stores none of it, not even node-b's own record
        forged = {f"e5/qp/{GID_B}/33": b"epoch5-b", f"map/{GID_A}/17": b"forged", f"e6/qp/{GID_A}/17": b"x"}
        with pytest.raises(CoordinationForbidden, match="node-b may not write another participant's keys"):
            await b.put_many(forged)
        # nor may node-b claim the QP ahead of node-a's next epoch, or rewrite its preflight claim
        with pytest.raises(CoordinationForbidden):
            await b.put(f"e6/qp/{GID_A}/17", b"ahead")
        with pytest.raises(CoordinationForbidden):
            await b.put(qp_key(GID_A, 17), b"0")

        assert await b.get(f"e5/qp/{GID_A}/17", 1) == b"epoch5-a"
        assert await b.get(f"map/{GID_A}/17", 1) == b"real-a"
        assert await a.get(qp_key(GID_A, 17), 1) == b"1"
        for unwritten in (f"e5/qp/{GID_B}/33", f"e6/qp/{GID_A}/17"):
            with pytest.raises(CoordinationTimedOut):
                await a.get(unwritten, 0.2)
        refusals = [r.getMessage() for r in caplog.records if "refused a write" in r.getMessage()]
        assert len(refusals) == 4 and all("node-b may not write" in r for r in refusals), refusals
        assert not any("forged" in r or "ahead" in r for r in refusals)  # keys and names, never values
        # the connection stays usable: a refusal is an answer, not a drop
        await b.put(f"e5/qp/{GID_B}/33", b"epoch5-b")
    finally:
        await a.close()
        await b.close()


async def test_each_participant_writes_its_own_keys_as_before(server: CoordinatorServer) -> None:
    """The normal path: each node publishes and rewrites its own records and reads the other's; records
    two nodes legitimately share still pass."""
    a, b = await _pair(server)
    try:
        await asyncio.gather(
            a.put_many({qp_key(GID_A, 17): b"1", f"preflight/gid/{GID_A}": b"1"}),
            b.put_many({qp_key(GID_B, 33): b"1", f"preflight/gid/{GID_B}": b"1"}),
        )
        # ranks of one first node restored on two: both hold its GID and publish the same claim
        await b.put(f"preflight/gid/{GID_A}", b"1")
        for epoch in (1, 2):  # a rebuild per epoch; map/ is rewritten by its owner each time
            await asyncio.gather(
                a.put_many({f"map/{GID_A}/17": f"a{epoch}".encode(), f"e{epoch}/qp/{GID_A}/17": b"qa"}),
                b.put_many({f"map/{GID_B}/33": f"b{epoch}".encode(), f"e{epoch}/qp/{GID_B}/33": b"qb"}),
            )
            assert await a.get(f"e{epoch}/qp/{GID_B}/33", 1) == b"qb"
            assert await b.get(f"e{epoch}/qp/{GID_A}/17", 1) == b"qa"
        assert await b.get(f"map/{GID_A}/17", 1) == b"a2"
        # GID 0 names nobody: two nodes' ranks may publish the same such record, the last one stays
        zero = f"map/{ZERO_GID}/17"
        await a.put(zero, b"from-a")
        await b.put(zero, b"from-b")
        assert await a.get(zero, 1) == b"from-b"
        got = await asyncio.gather(
            a.exchange("ids", {"node-b": b"a->b"}, 5), b.exchange("ids", {"node-a": b"b->a"}, 5)
        )
        assert [{k: bytes(v) for k, v in g.items()} for g in got] == [
            {"node-b": b"b->a"},
            {"node-a": b"a->b"},
        ]
    finally:
        await a.close()
        await b.close()
