"""The agent's proxy between the shims' key-value lines and the job coordinator, on the host."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ibckpt.coordination.client import CoordinatorClient, CoordinatorError
from ibckpt_node.coord_proxy import ShimCoordinatorProxy
from testbed.coordinator import ThreadedCoordinator


async def _request(path: Path, line: str) -> str:
    """One request per connection, as the shim sends it (native/src/coord.c)."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(line.encode() + b"\n")
    await writer.drain()
    reply = (await reader.readline()).decode().rstrip("\n")
    writer.close()
    return reply


async def _requests(path: Path, lines: list[str]) -> list[str]:
    """Several requests on one connection, all sent before any reply is read, as a rebuild
    publishes its records."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write("".join(f"{line}\n" for line in lines).encode())
    await writer.drain()
    replies = [(await reader.readline()).decode().rstrip("\n") for _ in lines]
    writer.close()
    return replies


async def _client(coordinator: ThreadedCoordinator, node: str = "node-1") -> CoordinatorClient:
    session, token = coordinator.create_session({node})
    return await CoordinatorClient.connect("127.0.0.1", coordinator.port, session, node, token)


async def test_every_record_reaches_the_coordinator_once_published(
    coordinator: ThreadedCoordinator, tmp_path: Path
) -> None:
    client = await _client(coordinator)
    sock = tmp_path / "coord.sock"
    try:
        async with ShimCoordinatorProxy(sock, client) as proxy:
            # as many shims' rebuilds do: many connections at once, answered before forwarding
            puts = [_request(sock, f"PUT e2/qp/g/{i} rec-{i} 5 0") for i in range(200)]
            assert await asyncio.gather(*puts) == ["OK"] * 200
            assert await _request(sock, "PUT map/g/7 real 1 99") == "OK"
            await asyncio.wait_for(proxy.published(), 10)  # what the driver waits for before its barrier
            assert proxy.failed is None
            for i in range(200):  # there already: no waiting
                assert (await client.get(f"e2/qp/g/{i}", timeout=0.01)) == f"rec-{i} 5 0".encode()
            assert await _request(sock, "GET map/g/7 0") == "VAL real 1 99"
            assert await _request(sock, "GET e2/qp/g/3 1000") == "VAL rec-3 5 0"
            assert await _request(sock, "GET e2/qp/none 100") == "NONE"
            # one connection carrying many requests, as a shim's rebuild publishes its records
            lines = [f"PUT e4/qp/g/{i} rec-{i}" for i in range(300)] + ["GET e4/qp/g/299 5000", "GET none 0"]
            assert await _requests(sock, lines) == ["OK"] * 300 + ["VAL rec-299", "NONE"]
            await asyncio.wait_for(proxy.published(), 10)
            assert (await client.get("e4/qp/g/0", timeout=0.01)) == b"rec-0"
    finally:
        await client.close()
    assert not sock.exists()


async def test_a_failed_background_put_fails_every_later_request(
    coordinator: ThreadedCoordinator, tmp_path: Path
) -> None:
    client = await _client(coordinator)
    sock = tmp_path / "coord.sock"
    async with ShimCoordinatorProxy(sock, client) as proxy:
        await client.close()  # the coordinator connection is gone
        assert await _request(sock, "PUT e3/qp/g/1 rec") == "OK"  # answered before it was sent
        with pytest.raises(CoordinatorError, match="PUT e3/qp/g/1 failed"):
            await asyncio.wait_for(proxy.published(), 10)  # the driver's rebuild phase fails
        # the shim's rebuild then fails at once instead of waiting for records that never come
        assert (await _request(sock, "GET e3/qp/g/2 60000")).startswith("ERR PUT e3/qp/g/1 failed")
        assert (await _request(sock, "PUT e3/qp/g/2 rec")).startswith("ERR")
