"""The framing both ends use, over TLS on a socket pair: frames split, merged and large, sent in slices."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator

import pytest

from ibckpt.coordination.channel import TlsChannel
from ibckpt.coordination.wire import (
    MAX_HELLO,
    Frame,
    Kind,
    ProtocolError,
    SocketFrameReader,
    unpack_segments,
)
from ibckpt.tls import COORDINATOR_SERVER_NAME
from testbed.tlsfiles import shared_pki


@pytest.fixture
async def pair() -> AsyncIterator[tuple[TlsChannel, TlsChannel]]:
    """(client's end, coordinator's end), the handshake done."""
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client, server = await asyncio.gather(
        TlsChannel.connect(a, shared_pki().client(), COORDINATOR_SERVER_NAME),
        TlsChannel.accept(b, shared_pki().coordinator()),
    )
    yield client, server
    a.close()
    b.close()


FRAMES = [
    Frame(Kind.BARRIER, {"id": 1, "name": "quiesced"}),
    Frame(Kind.PUT, {"id": 2, "key": "k"}, b"v" * 10),
    Frame(Kind.OK),
    Frame(
        Kind.ROUTE,
        {"id": 3, "index": [["node-b", 5000], ["node-c", 300_000]]},
        b"",
        (b"\x01" * 5000, memoryview(bytes(range(256)) * 1172)[:300_000]),
    ),
    Frame(Kind.GET, {"id": 4, "key": "after the big one"}),
]


async def test_frames_survive_any_split(pair: tuple[TlsChannel, TlsChannel]) -> None:
    a, b = pair
    wire = b"".join(f.encode() for f in FRAMES)
    reader = SocketFrameReader(b)

    async def trickle() -> None:  # odd-sized pieces: prefixes and headers split across reads
        for i in range(0, len(wire), 7919):
            await a.send([wire[i : i + 7919]])

    writer = asyncio.ensure_future(trickle())
    got = [await reader.read() for _ in FRAMES]
    await writer
    for sent, received in zip(FRAMES, got, strict=True):
        assert (received.kind, received.header) == (sent.kind, sent.header)
        assert bytes(received.payload) == bytes(sent.payload) + b"".join(sent.payload_parts)
    segments = unpack_segments(got[3].header["index"], got[3].payload)
    assert bytes(segments["node-c"]) == bytes(FRAMES[3].payload_parts[1])


async def test_send_waits_out_a_full_socket(pair: tuple[TlsChannel, TlsChannel]) -> None:
    a, b = pair
    frames = FRAMES * 3
    reader = SocketFrameReader(b)

    async def send_all() -> None:
        for f in frames:
            await f.send(a)

    sender = asyncio.ensure_future(send_all())
    await asyncio.sleep(0.05)
    assert not sender.done(), "a 4 KiB socket buffer cannot take ~1 MB at once"
    got = [await reader.read() for _ in frames]
    await sender
    assert [g.header for g in got] == [f.header for f in frames]
    assert bytes(got[-2].payload) == b"".join(FRAMES[3].payload_parts)


async def test_end_of_stream_and_bad_lengths(pair: tuple[TlsChannel, TlsChannel]) -> None:
    a, b = pair
    reader = SocketFrameReader(b)
    await a.send([struct.pack("!IBI", MAX_HELLO + 1, Kind.HELLO, 2)])
    with pytest.raises(ProtocolError, match="bad frame lengths"):
        await reader.read(MAX_HELLO)  # before authentication nobody gets a big buffer
    a.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(asyncio.IncompleteReadError):
        await SocketFrameReader(b).read()
