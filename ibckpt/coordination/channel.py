"""TLS on the coordinator's plain non-blocking sockets: ssl's memory BIOs driven by the event loop.

Both ends keep their own socket (the server caps and evicts connections by it, shutdown() wakes a
reader) and read frames into buffers of their choosing (wire.SocketFrameReader); TLS sits between the
socket and those buffers. The server is the coordinator (ibckpt.tls.COORDINATOR_SERVER_NAME); a client
trusts the operator's CA alone. A peer that does not speak TLS fails the handshake: plain TCP is refused.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import cast

RECV_CHUNK = 256 * 1024


class TlsChannel:
    """One TLS connection over `sock`. Reads come from one task at a time, writes from one at a time
    (the callers' locks); a read and a write may interleave, which OpenSSL allows in one thread."""

    def __init__(
        self, sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO
    ) -> None:
        self.sock = sock
        self._tls = tls
        self._incoming = incoming
        self._outgoing = outgoing
        self._loop = asyncio.get_running_loop()
        self._flushing = asyncio.Lock()  # what leaves the outgoing BIO leaves the socket in that order

    @classmethod
    async def accept(cls, sock: socket.socket, context: ssl.SSLContext) -> TlsChannel:
        """The server's side; raises ssl.SSLError (an OSError) or ConnectionError if the handshake fails.
        The caller bounds it in time."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        channel = cls(sock, context.wrap_bio(incoming, outgoing, server_side=True), incoming, outgoing)
        await channel._handshake()
        return channel

    @classmethod
    async def connect(cls, sock: socket.socket, context: ssl.SSLContext, server_name: str) -> TlsChannel:
        """The client's side: the server's certificate must chain to `context`'s CA and name `server_name`."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(incoming, outgoing, server_side=False, server_hostname=server_name)
        channel = cls(sock, tls, incoming, outgoing)
        await channel._handshake()
        return channel

    async def _handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionResetError(
                        "the peer closed the connection in the TLS handshake"
                    ) from None
                continue
            await self._flush()
            return

    async def _fill(self) -> bool:
        """Bytes from the socket into the TLS layer; False at the end of the stream."""
        data = await self._loop.sock_recv(self.sock, RECV_CHUNK)
        if not data:
            self._incoming.write_eof()
            return False
        self._incoming.write(data)
        return True

    async def _flush(self) -> None:
        async with self._flushing:
            data = self._outgoing.read()
            if data:
                await self._loop.sock_sendall(self.sock, data)

    async def recv_into(self, view: memoryview) -> int:
        """Decrypted bytes into `view`; 0 at the end of the stream (closed, with or without close_notify)."""
        while True:
            try:
                return cast(int, self._tls.read(len(view), view))  # into a view: a count, not bytes
            except ssl.SSLWantReadError:
                await self._flush()  # what reading made the TLS layer say (a key update's answer)
                await self._fill()  # at the end, the next read returns what is left, then raises
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    async def send(self, buffers: list[bytes | memoryview]) -> None:
        """Send `buffers` in order, a slice at a time (encrypting copies: TLS has no zero-copy path, and a
        large frame is not held twice in memory)."""
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            for start in range(0, len(view), RECV_CHUNK):
                piece = view[start : start + RECV_CHUNK]
                written = 0
                while written < len(piece):
                    written += self._tls.write(piece[written:])
                await self._flush()
