"""The coordinator over real TCP on 127.0.0.1, TLS only: auth, barriers, key-value, abort, and scale; plain
TCP and a peer of another CA refused."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct

import pytest

from ibckpt.coordination.client import (
    CoordinationAborted,
    CoordinationTimedOut,
    CoordinatorClient,
    CoordinatorError,
)
from ibckpt.coordination.wire import PROTOCOL_VERSION, Frame, Kind
from ibckpt.tls import COORDINATOR_SERVER_NAME
from ibckpt_operator.coordinator import server as coordinator_server
from ibckpt_operator.coordinator.server import CoordinatorServer
from testbed.simulated_job import check_received, run_exchange
from testbed.tlsfiles import make_pki, shared_pki


async def connect_all(srv: CoordinatorServer, names: list[str]) -> tuple[str, list[CoordinatorClient]]:
    session, tokens = srv.create_session(set(names), deadline_s=60)
    clients = [
        await CoordinatorClient.connect(
            "127.0.0.1", srv.port, session, n, tokens[n], tls=shared_pki().client()
        )
        for n in names
    ]
    return session, clients


async def test_listens_on_loopback_only(server: CoordinatorServer) -> None:
    assert server.sockets
    assert {s.getsockname()[0] for s in server.sockets} == {"127.0.0.1"}


async def test_wrong_token_or_stranger_is_refused(server: CoordinatorServer) -> None:
    session, tokens = server.create_session({"node-a"}, deadline_s=60)
    token = tokens["node-a"]
    with pytest.raises(CoordinatorError, match="refused node-a"):
        await CoordinatorClient.connect(
            "127.0.0.1", server.port, session, "node-a", token + "x", tls=shared_pki().client()
        )
    with pytest.raises(CoordinatorError, match="refused node-z"):
        await CoordinatorClient.connect(
            "127.0.0.1", server.port, session, "node-z", token, tls=shared_pki().client()
        )
    with pytest.raises(CoordinatorError, match="refused"):
        await CoordinatorClient.connect(
            "127.0.0.1", server.port, "no-such-session", "node-a", token, tls=shared_pki().client()
        )
    good = await CoordinatorClient.connect(
        "127.0.0.1", server.port, session, "node-a", token, tls=shared_pki().client()
    )
    await good.close()


async def test_unreachable_coordinator_is_a_clear_error() -> None:
    srv = CoordinatorServer(shared_pki().coordinator())
    await srv.start()
    port = srv.port
    await srv.stop()
    with pytest.raises(CoordinatorError, match=f"cannot reach the coordinator at 127.0.0.1:{port}"):
        await CoordinatorClient.connect("127.0.0.1", port, "s", "p", "t", tls=shared_pki().client())


async def test_put_many_publishes_every_key_in_one_request(server: CoordinatorServer) -> None:
    _, (a, b) = await connect_all(server, ["node-a", "node-b"])
    waiting = asyncio.ensure_future(b.get("e2/qp/g/999", timeout=5))
    records = {f"e2/qp/g/{i}": f"rec-{i}".encode() * (i % 7) for i in range(1000)}
    await a.put_many(records)
    await a.put_many({})  # nothing to send
    assert await waiting == records["e2/qp/g/999"]
    for key in ("e2/qp/g/0", "e2/qp/g/1", "e2/qp/g/500"):  # empty values too
        assert await b.get(key, timeout=0.1) == records[key]
    await a.close()
    await b.close()


async def test_barrier_put_get_and_exchange(server: CoordinatorServer) -> None:
    _, (a, b) = await connect_all(server, ["node-a", "node-b"])
    getter = asyncio.ensure_future(b.get("node-a/ids", timeout=5))
    first = asyncio.ensure_future(a.barrier("quiesced", timeout=5))
    await asyncio.sleep(0.05)
    assert not first.done()
    await b.barrier("quiesced", timeout=5)
    await first
    await a.put("node-a/ids", b"\x00\x01\x02")
    assert await getter == b"\x00\x01\x02"
    got_a, got_b = await asyncio.gather(
        a.exchange("r", {"node-b": b"to b"}, timeout=5), b.exchange("r", {"node-a": b"to a"}, timeout=5)
    )
    assert got_a == {"node-b": b"to a"} and got_b == {"node-a": b"to b"}
    with pytest.raises(CoordinationTimedOut, match="missing: node-b"):
        await a.barrier("alone", timeout=0.2)
    await a.close()
    await b.close()


async def test_abort_reaches_every_participant(server: CoordinatorServer) -> None:
    session, (a, b, c) = await connect_all(server, ["node-a", "node-b", "node-c"])
    waiting = asyncio.ensure_future(a.barrier("drained", timeout=30))
    idle_c_heard = asyncio.ensure_future(c.aborted.wait())
    await asyncio.sleep(0.05)
    await b.abort("drain of rank 3 timed out after 60s")
    with pytest.raises(CoordinationAborted, match="node-b: drain of rank 3 timed out"):
        await waiting
    await asyncio.wait_for(idle_c_heard, 2)  # pushed, without c asking anything
    assert c.abort_reason == "node-b: drain of rank 3 timed out after 60s"
    assert not server.sessions[session].refused  # a failure, not a preflight refusal
    # Operator-side abort (e.g. a phase deadline) reaches them the same way; the first reason stays.
    server.sessions[session].abort("operator: checkpoint deleted")
    with pytest.raises(CoordinationAborted, match="drain of rank 3"):
        await c.barrier("later", timeout=5)
    for cl in (a, b, c):
        await cl.close()


async def test_a_connection_given_up_fails_its_waiting_request_at_once(server: CoordinatorServer) -> None:
    """What an agent does when the operator says the coordinator is gone: a barrier that waits for a
    peer (here one that never comes) fails now, not when its bound runs out, and so does the next."""
    session, tokens = server.create_session({"node-1", "node-2"}, deadline_s=600)
    client = await CoordinatorClient.connect(
        "127.0.0.1", server.port, session, "node-1", tokens["node-1"], tls=shared_pki().client()
    )
    try:
        assert not client.lost
        waiting = asyncio.ensure_future(client.barrier("dumped", timeout=600))
        await asyncio.sleep(0.2)
        client.lose("the operator restarted")
        with pytest.raises(CoordinationAborted, match="the operator restarted"):
            await asyncio.wait_for(waiting, 2)
        assert client.lost
        with pytest.raises(CoordinatorError, match="lost the coordinator"):
            await client.put("k", b"v")
    finally:
        await client.close()


async def test_a_coordinator_that_goes_away_is_noticed() -> None:
    srv = CoordinatorServer(shared_pki().coordinator())
    await srv.start()
    session, tokens = srv.create_session({"node-1", "node-2"}, deadline_s=600)
    client = await CoordinatorClient.connect(
        "127.0.0.1", srv.port, session, "node-1", tokens["node-1"], tls=shared_pki().client()
    )
    try:
        waiting = asyncio.ensure_future(client.barrier("dumped", timeout=600))
        await asyncio.sleep(0.2)
        await srv.stop()
        with pytest.raises(CoordinatorError):
            await asyncio.wait_for(waiting, 5)
        assert client.lost
    finally:
        await client.close()


async def test_simulated_2048_ranks_on_128_nodes_all_to_all() -> None:
    """~4M QP records routed so each node gets exactly those addressed to its 16 ranks."""
    nodes, per_node = 128, 16
    results, _ = await run_exchange(nodes, per_node)
    total = sum(check_received(n, nodes, per_node, got) for n, got in enumerate(results))
    ranks = nodes * per_node
    assert total == ranks * (ranks - per_node)  # every cross-node QP end, exactly once


# -- what a hostile peer can make the operator hold (review rows N21, 22b) --------------------------------


def _raw(port: int, tls: bool = True) -> socket.socket:
    """A blocking connection: over TLS as a participant's (frames written by hand), or plain TCP."""
    sock = socket.socket()
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    if tls:
        return shared_pki().client().wrap_socket(sock, server_hostname=COORDINATOR_SERVER_NAME)
    return sock


def _reply(sock: socket.socket) -> Frame:
    """One frame read off a blocking socket (the wire's prefix is length, kind, header length)."""
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    _, kind, head_len = struct.unpack("!IBI", data[:9])
    return Frame(Kind(kind), json.loads(data[9 : 9 + head_len]))


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, ssl.SSLEOFError, ssl.SSLZeroReturnError):
        return True


async def test_malformed_requests_get_a_clear_error_not_silence(server: CoordinatorServer) -> None:
    session, tokens = server.create_session({"node-a"}, deadline_s=60)
    hello = {
        "version": PROTOCOL_VERSION,
        "session": session,
        "participant": "node-a",
        "token": tokens["node-a"],
    }

    def exchange() -> list[Frame]:
        with _raw(server.port) as listed:  # a HELLO whose header is a list: refused, not a crash
            listed.sendall(Frame(Kind.HELLO, [hello]).encode())  # type: ignore[arg-type]
            refused = _reply(listed)
        with _raw(server.port) as sock:
            sock.sendall(Frame(Kind.HELLO, hello).encode())
            assert _reply(sock).kind == Kind.OK
            replies = [refused]
            bad = ({"id": 1, "key": "k", "timeout": "abc"}, {"id": 2, "key": "k", "timeout": float("nan")},
                   {"id": 3, "key": "k", "timeout": -1}, [4, "k"])  # fmt: skip
            for header in bad:
                sock.sendall(Frame(Kind.GET, header).encode())  # type: ignore[arg-type]
                replies.append(_reply(sock))
            return replies

    refused, *replies = await asyncio.to_thread(exchange)
    assert refused.kind == Kind.ERROR and refused.header["error"] == "auth", refused.header
    assert [r.header.get("id") for r in replies] == [1, 2, 3, 0]
    for reply in replies:
        assert reply.kind == Kind.ERROR and reply.header["error"] == "request", reply.header
        assert reply.header["message"].startswith("bad request: "), reply.header


async def test_idle_strangers_are_capped_and_never_keep_a_participant_out(
    server: CoordinatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coordinator_server, "MAX_GREETING", 24)
    session, tokens = server.create_session({"node-a", "node-b"}, deadline_s=60)
    # half never start the TLS handshake, half finish it and say nothing
    idle = await asyncio.to_thread(lambda: [_raw(server.port, tls=i % 2 == 0) for i in range(40)])
    try:
        await asyncio.sleep(0.5)
        assert len(server._greeting) <= 24  # what the strangers hold is bounded
        # the oldest were dropped to make room: the server closed them
        assert await asyncio.to_thread(lambda: [_closed_by_server(s) for s in idle[:16]]) == [True] * 16
        # A participant still gets in while strangers fill every slot, up to its own cap of connections.
        clients = [
            await CoordinatorClient.connect(
                "127.0.0.1", server.port, session, "node-a", tokens["node-a"], tls=shared_pki().client()
            )
            for _ in range(coordinator_server.MAX_PER_PARTICIPANT)
        ]
        with pytest.raises(CoordinatorError, match="already has 4 connections open"):
            await CoordinatorClient.connect(
                "127.0.0.1", server.port, session, "node-a", tokens["node-a"], tls=shared_pki().client()
            )
        other = await CoordinatorClient.connect(
            "127.0.0.1", server.port, session, "node-b", tokens["node-b"], tls=shared_pki().client()
        )
        for client in [*clients, other]:
            await client.close()
    finally:
        for sock in idle:
            sock.close()


async def test_slow_loris_strangers_are_dropped_at_the_hello_bound_while_jobs_go_on(
    server: CoordinatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Strangers that drip a HELLO a byte at a time hold nothing past HELLO_TIMEOUT_S in all (the bound
    is on the whole frame, not between bytes), and a participant works meanwhile."""
    monkeypatch.setattr(coordinator_server, "HELLO_TIMEOUT_S", 0.5)
    session, tokens = server.create_session({"node-a"}, deadline_s=60)
    slow = await asyncio.to_thread(lambda: [_raw(server.port) for _ in range(20)])
    client = await CoordinatorClient.connect(
        "127.0.0.1", server.port, session, "node-a", tokens["node-a"], tls=shared_pki().client()
    )
    try:
        started = asyncio.get_running_loop().time()
        dropped: set[int] = set()
        while len(dropped) < len(slow) and asyncio.get_running_loop().time() - started < 3:
            for i, sock in enumerate(slow):
                if i not in dropped:
                    try:
                        sock.send(b"\x00")  # a length prefix that never ends
                    except OSError:
                        dropped.add(i)
            await client.put("k", b"v")  # the job's own requests are answered meanwhile
            await asyncio.sleep(0.1)
        assert len(dropped) == len(slow), f"{len(slow) - len(dropped)} slow strangers still held"
        assert not server._greeting
        assert await client.get("k", timeout=1) == b"v"
    finally:
        await client.close()
        for sock in slow:
            sock.close()


async def test_a_preflight_refusal_is_told_apart_from_a_failure(server: CoordinatorServer) -> None:
    """The operator names the job's failure PreflightRefused when the first abort was a node's refusal
    (no rank gated), whichever arrives first: the abort or the agents' reports."""
    session, (a, b) = await connect_all(server, ["node-a", "node-b"])
    heard: list[tuple[str, bool]] = []
    server.sessions[session].abort_listeners.append(
        lambda reason: heard.append((reason, server.sessions[session].refused))
    )
    await a.abort("refusing to checkpoint on this node: no room", refused=True)
    await b.abort("later failure")  # the first abort stays
    assert heard == [("node-a: refusing to checkpoint on this node: no room", True)]
    for cl in (a, b):
        await cl.close()


async def test_plain_tcp_is_refused_and_a_peer_of_another_ca_is_not_trusted(
    server: CoordinatorServer,
) -> None:
    session, tokens = server.create_session({"node-a"}, deadline_s=60)
    hello = {
        "version": PROTOCOL_VERSION,
        "session": session,
        "participant": "node-a",
        "token": tokens["node-a"],
    }

    def plain() -> bool:  # the right credential, in clear: no answer, the connection closed
        with _raw(server.port, tls=False) as sock:
            sock.sendall(Frame(Kind.HELLO, hello).encode())
            return _closed_by_server(sock)

    assert await asyncio.to_thread(plain)
    assert not server._connections[session]
    # a client that trusts another CA does not send its credential to this coordinator
    with pytest.raises(CoordinatorError, match="CERTIFICATE_VERIFY_FAILED"):
        await CoordinatorClient.connect(
            "127.0.0.1", server.port, session, "node-a", tokens["node-a"], tls=make_pki().client()
        )
    # nor to a server whose name is not the coordinator's (an agent's certificate, say)
    with pytest.raises(CoordinatorError, match="CERTIFICATE_VERIFY_FAILED"):
        await CoordinatorClient.connect(
            "127.0.0.1", server.port, session, "node-a", tokens["node-a"], tls=shared_pki().client(),
            server_name="ibckpt-agent",
        )  # fmt: skip
    impostor = CoordinatorServer(make_pki().coordinator())  # another CA's coordinator
    await impostor.start()
    try:
        with pytest.raises(CoordinatorError, match="CERTIFICATE_VERIFY_FAILED"):
            await CoordinatorClient.connect(
                "127.0.0.1", impostor.port, session, "node-a", tokens["node-a"], tls=shared_pki().client()
            )
    finally:
        await impostor.stop()
    client = await CoordinatorClient.connect(
        "127.0.0.1", server.port, session, "node-a", tokens["node-a"], tls=shared_pki().client()
    )
    await client.put("k", b"v")
    await client.close()
