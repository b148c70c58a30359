"""The agent's proxy between the shims' key-value lines and the job coordinator, on the host."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path

import pytest

from ibckpt.coordination.client import CoordinationTimedOut, CoordinatorClient, CoordinatorError
from ibckpt_node import coord_proxy
from ibckpt_node.coord_proxy import Channel, ShimCoordinatorProxy, channels_for
from testbed.coordinator import ThreadedCoordinator
from testbed.tlsfiles import shared_pki

G = "fe800000000000000000000000000001"  # a virtual GID, as the shim writes it (native/src/records.c)
H = "fe800000000000000000000000000002"


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
    session, tokens = coordinator.create_session({node})
    token = tokens[node]
    return await CoordinatorClient.connect(
        "127.0.0.1", coordinator.port, session, node, token, tls=shared_pki().client()
    )


def _container(tmp_path: Path, cid: str) -> Path:
    """A container's directory as the hook leaves it: ctl (the container's) and coord (root's)."""
    cdir = tmp_path / "containers" / cid
    (cdir / "ctl").mkdir(parents=True)
    (cdir / "coord").mkdir()
    return cdir


async def test_every_record_reaches_the_coordinator_once_published(
    coordinator: ThreadedCoordinator, tmp_path: Path
) -> None:
    client = await _client(coordinator)
    sock = tmp_path / "coord.sock"
    try:
        async with ShimCoordinatorProxy(client, [Channel(sock)]) as proxy:
            # as many shims' rebuilds do: many connections at once, answered before forwarding
            puts = [_request(sock, f"PUT e2/qp/{G}/{i} rec-{i} 5 0") for i in range(200)]
            assert await asyncio.gather(*puts) == ["OK"] * 200
            assert await _request(sock, f"PUT map/{G}/7 real 1 99") == "OK"
            await asyncio.wait_for(proxy.published(), 10)  # what the driver waits for before its barrier
            assert proxy.failed is None
            for i in range(200):  # there already: no waiting
                assert (await client.get(f"e2/qp/{G}/{i}", timeout=0.01)) == f"rec-{i} 5 0".encode()
            assert await _request(sock, f"GET map/{G}/7 0") == "VAL real 1 99"
            assert await _request(sock, f"GET e2/qp/{G}/3 1000") == "VAL rec-3 5 0"
            assert await _request(sock, f"GET e2/qp/{H}/3 100") == "NONE"
            # one connection carrying many requests, as a shim's rebuild publishes its records
            lines = [f"PUT e4/qp/{G}/{i} rec-{i}" for i in range(300)] + [f"GET e4/qp/{G}/299 5000"]
            assert await _requests(sock, lines) == ["OK"] * 300 + ["VAL rec-299"]
            await asyncio.wait_for(proxy.published(), 10)
            assert (await client.get(f"e4/qp/{G}/0", timeout=0.01)) == b"rec-0"
    finally:
        await client.close()
    assert not sock.exists()


async def test_a_failed_background_put_fails_every_later_request(
    coordinator: ThreadedCoordinator, tmp_path: Path
) -> None:
    client = await _client(coordinator)
    sock = tmp_path / "coord.sock"
    async with ShimCoordinatorProxy(client, [Channel(sock)]) as proxy:
        await client.close()  # the coordinator connection is gone
        assert await _request(sock, f"PUT e3/qp/{G}/1 rec") == "OK"  # answered before it was sent
        with pytest.raises(CoordinatorError, match=f"PUT e3/qp/{G}/1 failed"):
            await asyncio.wait_for(proxy.published(), 10)  # the driver's rebuild phase fails
        # the shim's rebuild then fails at once instead of waiting for records that never come
        assert (await _request(sock, f"GET e3/qp/{G}/2 60000")).startswith(f"ERR PUT e3/qp/{G}/1 failed")
        assert (await _request(sock, f"PUT e3/qp/{G}/2 rec")).startswith("ERR")


async def test_a_container_on_another_node_cannot_overwrite_a_record_through_its_agent(
    coordinator: ThreadedCoordinator, tmp_path: Path
) -> None:
    """The review's forgery across nodes (N21, N22): node-2's agent forwards its container's PUT of the
    record node-1's rank published. The coordinator refuses it: node-1's record is what readers get, and
    node-2's proxy fails the way a lost coordinator makes it fail, so its rebuild aborts."""
    session, tokens = coordinator.create_session({"node-1", "node-2"})
    one = await CoordinatorClient.connect(
        "127.0.0.1", coordinator.port, session, "node-1", tokens["node-1"], tls=shared_pki().client()
    )
    two = await CoordinatorClient.connect(
        "127.0.0.1", coordinator.port, session, "node-2", tokens["node-2"], tls=shared_pki().client()
    )
    sock_1, sock_2 = tmp_path / "one.sock", tmp_path / "two.sock"
    try:
        async with (
            ShimCoordinatorProxy(one, [Channel(sock_1)]) as proxy_1,
            ShimCoordinatorProxy(two, [Channel(sock_2)]) as proxy_2,
        ):
            assert await _request(sock_1, f"PUT e5/qp/{G}/9 real-1") == "OK"
            await asyncio.wait_for(proxy_1.published(), 10)
            assert await _request(sock_2, f"PUT e5/qp/{G}/9 forged") == "OK"  # answered, then forwarded
            with pytest.raises(CoordinatorError, match="node-2 may not write another participant's keys"):
                await asyncio.wait_for(proxy_2.published(), 10)
            assert await _request(sock_1, f"GET e5/qp/{G}/9 1000") == "VAL real-1"
            assert (await _request(sock_2, f"PUT e5/qp/{H}/9 own")).startswith("ERR PUT e5/qp/")
    finally:
        await one.close()
        await two.close()


async def test_each_container_has_its_own_socket_and_cannot_touch_anothers_records(
    coordinator: ThreadedCoordinator, tmp_path: Path
) -> None:
    """Two containers of a session: each is served in its own directory, owned as its ctl is; neither
    reads nor writes keys that are not shim records."""
    a, b = _container(tmp_path, "a"), _container(tmp_path, "b")
    me = os.getpid()
    ranks = [(a / "ctl" / "1.sock", me), (a / "ctl" / "7.sock", me), (b / "ctl" / "1.sock", me)]
    channels = channels_for(ranks)
    assert [c.path for c in channels] == [a / "coord" / "coord.sock", b / "coord" / "coord.sock"]
    assert channels[0].owner == (os.getuid(), os.getgid())
    client = await _client(coordinator)
    try:
        await client.put("preflight/addr/10.0.0.1", b"the agent's own")
        async with ShimCoordinatorProxy(client, channels) as proxy:
            sock_a, sock_b = (c.path for c in channels)
            assert sock_a.stat().st_mode & 0o777 == 0o600
            assert await _request(sock_a, f"PUT e5/qp/{G}/9 rank-a") == "OK"
            assert await _request(sock_a, f"PUT map/{G}/9 real-a") == "OK"
            assert await _request(sock_b, f"PUT e5/qp/{G}/10 rank-b") == "OK"  # its own QP, same GID
            assert await _request(sock_b, "GET preflight/addr/10.0.0.1 0") == "ERR not a shim record key"
            assert await _request(sock_b, "PUT barrier/x y") == "ERR not a shim record key"
            await asyncio.wait_for(proxy.published(), 10)
            assert await _request(sock_b, f"GET e5/qp/{G}/9 1000") == "VAL rank-a"  # peers read it
        assert (await client.get(f"map/{G}/9", timeout=0.01)) == b"real-a"
    finally:
        await client.close()


async def test_a_peer_outside_the_containers_pid_namespace_is_refused(
    coordinator: ThreadedCoordinator, tmp_path: Path
) -> None:
    cdir = _container(tmp_path, "c")
    rank_pid = 4194301  # a rank's host pid; the test process plays a stranger or the rank itself
    namespaces = {rank_pid: "pid:[4026532001]", os.getpid(): "pid:[4026531836]"}
    (channel,) = channels_for([(cdir / "ctl" / "1.sock", rank_pid)])
    client = await _client(coordinator)
    try:
        async with ShimCoordinatorProxy(client, [channel], ns_of=lambda pid: namespaces[pid]):
            refused = await _request(channel.path, f"PUT e1/qp/{G}/1 forged")
            assert refused == f"ERR refused: pid {os.getpid()} is not in the container's pid namespace"
            namespaces[os.getpid()] = namespaces[rank_pid]  # now a process of the container
            assert await _request(channel.path, f"PUT e1/qp/{G}/1 real") == "OK"
    finally:
        await client.close()


async def test_idle_connections_are_capped_and_dropped_and_the_proxy_still_serves(
    coordinator: ThreadedCoordinator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slow-loris on a container's socket: the connections over the cap are refused at once, the
    idle ones dropped after IDLE_S, and the shim's requests answered meanwhile."""
    monkeypatch.setattr(coord_proxy, "IDLE_S", 0.5)
    monkeypatch.setattr(coord_proxy, "MAX_CONNECTIONS", 8)
    sock = tmp_path / "coord.sock"
    client = await _client(coordinator)
    try:
        async with ShimCoordinatorProxy(client, [Channel(sock)]):
            idle = [await asyncio.open_unix_connection(str(sock)) for _ in range(8)]
            for _, writer in idle:
                writer.write(b"PUT map/")  # half a line, never finished
            await asyncio.sleep(0.1)
            assert (await _request(sock, f"PUT map/{G}/1 x")).startswith("ERR refused: 8 connections open")
            for reader, _ in idle:  # dropped within the bound, not held
                assert await asyncio.wait_for(reader.read(), 3) == b""
            assert await _request(sock, f"PUT map/{G}/1 x") == "OK"
            for _, writer in idle:
                writer.close()
    finally:
        await client.close()


def test_a_channel_deeper_than_a_socket_address_allows_is_bound_through_its_directory(tmp_path: Path) -> None:
    """STATE_DIR/containers/<64-hex id>/coord/coord.sock on a node is over the 107 bytes of sun_path."""
    directory = tmp_path / ("c" * 64) / "coord"
    directory.mkdir(parents=True)
    path = directory / "coord.sock"
    assert len(str(path).encode()) > 107
    listener = coord_proxy.bind_in_directory(path)
    try:
        listener.listen(1)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
            try:
                client.connect(f"/proc/self/fd/{fd}/coord.sock")
            finally:
                os.close(fd)
    finally:
        listener.close()


async def _never_stored(client: CoordinatorClient, *keys: str) -> None:
    """None of `keys` reached the coordinator."""
    for key in keys:
        with pytest.raises(CoordinationTimedOut):
            await client.get(key, timeout=0.05)


async def test_a_container_may_write_only_its_own_ranks_gids(
    coordinator: ThreadedCoordinator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two containers of one job, on one node: once the agent learned each one's GIDs, a PUT through a
    container's socket naming the other's GID is refused, said so, logged once, and never stored. GID 0
    is anyone's; reads are not confined."""
    a, b = _container(tmp_path, "a"), _container(tmp_path, "b")
    me = os.getpid()
    channels = channels_for([(a / "ctl" / "1.sock", me), (b / "ctl" / "1.sock", me)])
    sock_a, sock_b = (c.path for c in channels)
    zero = "0" * 32
    client = await _client(coordinator)
    try:
        async with ShimCoordinatorProxy(client, channels) as proxy:
            proxy.confine(a / "ctl" / "1.sock", [G], [9])
            proxy.confine(b / "ctl" / "1.sock", [H.upper()], [10, 3])  # as a status may spell it
            assert await _request(sock_a, f"PUT map/{G}/9 real-a") == "OK"
            assert await _request(sock_b, f"PUT e5/qp/{H}/10 rank-b") == "OK"
            forged = [f"PUT e5/qp/{G}/9 forged", f"PUT map/{G}/11 forged"]
            refused = f"ERR refused: GID {G} is not one of this container's ranks' GIDs"
            assert await _requests(sock_b, forged) == [refused, refused]
            assert await _request(sock_a, f"PUT e5/qp/{H}/10 forged") == refused.replace(G, H)
            assert await _request(sock_b, f"PUT e5/qp/{zero}/3 unset-b") == "OK"  # GID 0: as before
            assert await _request(sock_a, f"PUT e5/qp/{zero}/3 unset-a") == "OK"
            await asyncio.wait_for(proxy.published(), 10)
            assert proxy.failed is None  # a refusal is the writer's, not the session's
            assert await _request(sock_b, f"GET map/{G}/9 0") == "VAL real-a"  # peers still read it
        assert (await client.get(f"map/{G}/9", timeout=0.01)) == b"real-a"
        assert (await client.get(f"e5/qp/{H}/10", timeout=0.01)) == b"rank-b"
        assert (await client.get(f"e5/qp/{zero}/3", timeout=0.01)) == b"unset-a"
        await _never_stored(client, f"e5/qp/{G}/9", f"map/{G}/11")
    finally:
        await client.close()
    logged = [r.getMessage() for r in caplog.records if "refused PUT" in r.getMessage()]
    why = refused.removeprefix("ERR refused: ")
    assert logged == [  # once per container, the first key it was refused
        f"{sock_b}: refused PUT e5/qp/{G}/9: {why}",
        f"{sock_a}: refused PUT e5/qp/{H}/10: {why.replace(G, H)}",
    ]


async def test_containers_sharing_a_gid_may_write_only_their_own_qps(
    coordinator: ThreadedCoordinator, tmp_path: Path
) -> None:
    """Ranks restored from one node keep its GID: two containers both hold G, with QPs 9 and 12.
    Each may write its own QPs' records under G, not the other's, nor a QP that neither holds."""
    a, b = _container(tmp_path, "a"), _container(tmp_path, "b")
    me = os.getpid()
    channels = channels_for([(a / "ctl" / "1.sock", me), (b / "ctl" / "1.sock", me)])
    sock_a, sock_b = (c.path for c in channels)
    client = await _client(coordinator)
    try:
        async with ShimCoordinatorProxy(client, channels) as proxy:
            proxy.confine(a / "ctl" / "1.sock", [G], [9])
            proxy.confine(b / "ctl" / "1.sock", [G, H], [12])
            assert await _request(sock_a, f"PUT map/{G}/9 real-a") == "OK"
            assert await _request(sock_b, f"PUT map/{G}/12 real-b") == "OK"
            assert await _request(sock_b, f"PUT map/{H}/12 real-b-h") == "OK"  # its other GID
            refused = f"ERR refused: QP 9 of GID {G} is not one of this container's ranks' QPs"
            assert await _request(sock_b, f"PUT e5/qp/{G}/9 forged") == refused
            assert await _request(sock_a, f"PUT map/{G}/12 forged") == refused.replace("QP 9", "QP 12")
            assert await _request(sock_a, f"PUT map/{G}/13 new") == refused.replace("QP 9", "QP 13")
            await asyncio.wait_for(proxy.published(), 10)
        assert (await client.get(f"map/{G}/9", timeout=0.01)) == b"real-a"
        assert (await client.get(f"map/{G}/12", timeout=0.01)) == b"real-b"
        await _never_stored(client, f"e5/qp/{G}/9", f"map/{G}/13")
    finally:
        await client.close()


async def test_a_container_whose_gids_are_not_learned_yet_is_not_confined(
    coordinator: ThreadedCoordinator, tmp_path: Path
) -> None:
    """Before any rank of it was asked to rebuild (the agent learns its GIDs then), a container's PUTs
    pass as before: confining it to nothing would refuse its first legitimate record."""
    a = _container(tmp_path, "a")
    (channel,) = channels_for([(a / "ctl" / "1.sock", os.getpid())])
    client = await _client(coordinator)
    try:
        async with ShimCoordinatorProxy(client, [channel]) as proxy:
            assert await _request(channel.path, f"PUT map/{H}/1 before") == "OK"
            proxy.confine(tmp_path / "elsewhere.sock", [G], [1])  # not a container's rank: confines nothing
            assert await _request(channel.path, f"PUT map/{H}/2 still") == "OK"
            await asyncio.wait_for(proxy.published(), 10)
        assert (await client.get(f"map/{H}/2", timeout=0.01)) == b"still"
    finally:
        await client.close()


async def test_a_record_a_confined_rank_of_this_node_put_is_read_without_the_coordinator(
    coordinator: ThreadedCoordinator, tmp_path: Path
) -> None:
    """Ranks whose QPs connect on one node: a GET of the epoch record of a QP that a confined rank
    here PUT is answered from the proxy's copy, never asking the coordinator. Records of containers
    not confined yet, of GID 0, and `map/` records are still read from the coordinator, and a
    replaced coordinator drops the copies."""
    a, b = _container(tmp_path, "a"), _container(tmp_path, "b")
    me, zero = os.getpid(), "0" * 32
    channels = channels_for([(a / "ctl" / "1.sock", me), (b / "ctl" / "1.sock", me)])
    sock_a, sock_b = (c.path for c in channels)
    client = await _client(coordinator)
    asked: list[str] = []
    real_get = client.get

    async def get(key: str, timeout: float) -> bytes:
        asked.append(key)
        return await real_get(key, timeout)

    client.get = get  # type: ignore[method-assign]
    try:
        async with ShimCoordinatorProxy(client, channels) as proxy:
            proxy.confine(a / "ctl" / "1.sock", [G], [9])
            lines = [f"PUT e6/qp/{G}/9 rec-a 1 0", f"PUT map/{G}/9 real-a", f"PUT e6/qp/{zero}/4 z"]
            assert await _requests(sock_a, lines) == ["OK"] * 3
            assert await _request(sock_b, f"PUT e6/qp/{H}/10 rec-b") == "OK"  # b is not confined
            # at once, before the background PUT need have reached the coordinator
            assert await _request(sock_b, f"GET e6/qp/{G}/9 5000") == "VAL rec-a 1 0"
            assert asked == []
            assert await _request(sock_a, f"GET e6/qp/{H}/10 5000") == "VAL rec-b"
            assert await _request(sock_a, f"GET e6/qp/{zero}/4 5000") == "VAL z"
            assert await _request(sock_a, f"GET map/{G}/9 5000") == "VAL real-a"
            assert asked == [f"e6/qp/{H}/10", f"e6/qp/{zero}/4", f"map/{G}/9"]
            await asyncio.wait_for(proxy.published(), 10)
            assert (await real_get(f"e6/qp/{G}/9", timeout=0.01)) == b"rec-a 1 0"  # forwarded as well
            proxy.use(client)  # as after a lost coordinator: the copies go
            assert await _request(sock_b, f"GET e6/qp/{G}/9 5000") == "VAL rec-a 1 0"
            assert asked[-1] == f"e6/qp/{G}/9"
    finally:
        await client.close()
