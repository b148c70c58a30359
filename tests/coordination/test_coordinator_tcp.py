"""The coordinator over real TCP on 127.0.0.1: auth, barriers, key-value, abort, and scale."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from ibckpt.coordination.client import (
    CoordinationAborted,
    CoordinationTimedOut,
    CoordinatorClient,
    CoordinatorError,
)
from ibckpt_operator.coordinator.server import CoordinatorServer
from testbed.simulated_job import check_received, run_exchange


@pytest.fixture
async def server() -> AsyncIterator[CoordinatorServer]:
    srv = CoordinatorServer()
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def connect_all(srv: CoordinatorServer, names: list[str]) -> tuple[str, list[CoordinatorClient]]:
    session, token = srv.create_session(set(names), deadline_s=60)
    clients = [await CoordinatorClient.connect("127.0.0.1", srv.port, session, n, token) for n in names]
    return session, clients


async def test_listens_on_loopback_only(server: CoordinatorServer) -> None:
    assert server.sockets
    assert {s.getsockname()[0] for s in server.sockets} == {"127.0.0.1"}


async def test_wrong_token_or_stranger_is_refused(server: CoordinatorServer) -> None:
    session, token = server.create_session({"node-a"}, deadline_s=60)
    with pytest.raises(CoordinatorError, match="refused node-a"):
        await CoordinatorClient.connect("127.0.0.1", server.port, session, "node-a", token + "x")
    with pytest.raises(CoordinatorError, match="refused node-z"):
        await CoordinatorClient.connect("127.0.0.1", server.port, session, "node-z", token)
    with pytest.raises(CoordinatorError, match="refused"):
        await CoordinatorClient.connect("127.0.0.1", server.port, "no-such-session", "node-a", token)
    good = await CoordinatorClient.connect("127.0.0.1", server.port, session, "node-a", token)
    await good.close()


async def test_unreachable_coordinator_is_a_clear_error() -> None:
    srv = CoordinatorServer()
    await srv.start()
    port = srv.port
    await srv.stop()
    with pytest.raises(CoordinatorError, match=f"cannot reach the coordinator at 127.0.0.1:{port}"):
        await CoordinatorClient.connect("127.0.0.1", port, "s", "p", "t")


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
    # Operator-side abort (e.g. a phase deadline) reaches them the same way; the first reason stays.
    server.sessions[session].abort("operator: checkpoint deleted")
    with pytest.raises(CoordinationAborted, match="drain of rank 3"):
        await c.barrier("later", timeout=5)
    for cl in (a, b, c):
        await cl.close()


async def test_a_connection_given_up_fails_its_waiting_request_at_once(server: CoordinatorServer) -> None:
    """What an agent does when the operator says the coordinator is gone: a barrier that waits for a
    peer (here one that never comes) fails now, not when its bound runs out, and so does the next."""
    session, token = server.create_session({"node-1", "node-2"}, deadline_s=600)
    client = await CoordinatorClient.connect("127.0.0.1", server.port, session, "node-1", token)
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
    srv = CoordinatorServer()
    await srv.start()
    session, token = srv.create_session({"node-1", "node-2"}, deadline_s=600)
    client = await CoordinatorClient.connect("127.0.0.1", srv.port, session, "node-1", token)
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
