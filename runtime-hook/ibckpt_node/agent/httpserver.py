"""A small HTTPS/1.1 server on asyncio streams: one request per connection, bounded in size and time.

The agent's API is a handful of JSON calls from one client (the operator); this keeps it on the same
event loop as the registry and the sessions, with no framework in the node image. It speaks TLS only:
a connection is admitted (counted against the cap) as soon as it is accepted, then upgraded, so a
handshake never finished holds a slot no longer than the read deadline and can be evicted like a slow
request; a peer speaking plain HTTP fails the handshake and is closed unanswered.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024
MAX_BODY = 1024 * 1024
READ_TIMEOUT_S = 10.0  # from accept: the TLS handshake and the whole request
WRITE_TIMEOUT_S = 10.0  # a client that does not read its response does not hold the connection
# At most this many connections, each holding at most MAX_HEAD + MAX_BODY (about 66 MiB in all): a new
# one over the cap evicts the oldest still sending its request, or is closed if every one is being
# answered. The operator's calls are few and short; a flood of strangers only ever displaces itself.
MAX_CONNECTIONS = 64


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    peer: str


@dataclass
class Response:
    status: int
    body: bytes | memoryview = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Response]]
TlsContext = Callable[[], ssl.SSLContext]  # asked at each connection: a renewed certificate is served


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_request(reader: asyncio.StreamReader, peer: str) -> Request:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as exc:
        raise BadRequest(431, "request head too large") from exc
    except asyncio.IncompleteReadError as exc:
        raise BadRequest(400, "incomplete request") from exc
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(400, "bad request line")
    method, target, _ = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest(400, "bad header line")
        headers[name.strip().lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise BadRequest(501, "chunked bodies are not supported: send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError as exc:
        raise BadRequest(400, "bad Content-Length") from exc
    if length < 0 or length > MAX_BODY:
        raise BadRequest(413, f"body larger than {MAX_BODY} bytes")
    try:
        body = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError as exc:
        raise BadRequest(400, "incomplete body") from exc
    path = target.split("?", 1)[0]
    return Request(method, path, headers, body, peer)


def encode_head(response: Response) -> bytes:
    """The status line and headers; the body is written after them as it is (a chunk of a memory copy
    is a view of the holder's bytes: not copied into one buffer with its head)."""
    reason = http.HTTPStatus(response.status).phrase
    head = [
        f"HTTP/1.1 {response.status} {reason}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in response.headers.items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")


class HttpServer:
    """Serves handler on (host, port). Never binds a wildcard address: the caller names one."""

    def __init__(
        self, host: str, port: int, handler: Handler, error: Callable[[int, str], Response], tls: TlsContext
    ) -> None:
        if host in ("", "0.0.0.0", "::"):
            raise ValueError("the agent serves on one address of the node, not on every address")
        self.host = host
        self.port = port
        self.tls = tls
        self.handler = handler
        self.error = error
        self._server: asyncio.AbstractServer | None = None
        self._open = 0  # connections admitted and not yet ended or evicted
        self._counted: set[asyncio.StreamWriter] = set()
        self._reading: dict[asyncio.StreamWriter, None] = {}  # oldest first: not yet a whole request
        self._handlers: set[asyncio.Task[None]] = set()  # each connection's, until it ends

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_HEAD)
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._counted):  # the connections still open end now, not at their deadlines
            writer.transport.abort()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=WRITE_TIMEOUT_S)

    def _admit(self, writer: asyncio.StreamWriter, where: str) -> bool:
        if self._open >= MAX_CONNECTIONS:
            if not self._reading:
                log.warning("%d connections open, all being answered: closing %s", self._open, where)
                return False
            oldest = next(iter(self._reading))
            del self._reading[oldest]
            log.warning("%d connections open: dropping the oldest one still sending its request", self._open)
            oldest.transport.abort()  # its read ends with an error and its handler closes it
            self._release(oldest)  # now: its handler notices the abort only on a later turn of the loop
        self._open += 1
        self._counted.add(writer)
        self._reading[writer] = None
        return True

    def _release(self, writer: asyncio.StreamWriter) -> None:
        if writer in self._counted:
            self._counted.discard(writer)
            self._open -= 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Before any await: bytes read now (the ClientHello) would land in the plain reader, not in TLS.
        transport = writer.transport
        assert isinstance(transport, asyncio.Transport)  # a stream socket's: reads and writes
        transport.pause_reading()
        peer = writer.get_extra_info("peername")
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if not self._admit(writer, where):
            writer.transport.abort()
            return
        handler = asyncio.current_task()
        assert handler is not None  # each connection's callback runs as a task of its own
        self._handlers.add(handler)
        try:
            await self._answer(reader, writer, where)
        finally:
            self._release(writer)
            self._reading.pop(writer, None)
            self._handlers.discard(handler)

    async def _receive(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: str
    ) -> Request:
        plain = writer.transport
        try:
            await writer.start_tls(self.tls(), ssl_handshake_timeout=READ_TIMEOUT_S)
        except AttributeError as exc:
            # asyncio (3.11) fails so when the peer leaves as the handshake ends: the upgrade got no
            # transport back. The socket's own goes back, so that closing the writer closes the socket.
            setattr(writer, "_transport", plain)  # noqa: B010
            raise ConnectionResetError("the peer left as the TLS handshake ended") from exc
        return await read_request(reader, where)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: str) -> None:
        abandoned = False
        try:
            try:
                try:
                    request = await asyncio.wait_for(self._receive(reader, writer, where), READ_TIMEOUT_S)
                finally:
                    self._reading.pop(writer, None)
            except BadRequest as exc:
                response = self.error(exc.status, str(exc))
            except TimeoutError:
                if writer.get_extra_info("sslcontext") is None:  # the handshake never ended: no channel
                    return
                response = self.error(408, "request not received in time")
            else:
                try:
                    response = await self.handler(request)
                except Exception:
                    log.exception("%s %s from %s", request.method, request.path, where)
                    response = self.error(500, "internal error (see the agent's log)")
            writer.write(encode_head(response))
            if response.body:
                writer.write(response.body)
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (OSError, ConnectionError, TimeoutError) as exc:
            log.debug("connection from %s: %s", where, exc)
        except GeneratorExit:  # closed with its loop gone (a stopped server's): nothing can be awaited
            abandoned = True
            raise
        finally:
            if abandoned:
                with contextlib.suppress(Exception):
                    writer.transport.abort()
            else:
                writer.close()  # over TLS: sends close_notify; _closed waits for the peer's
                await self._closed(writer)

    @staticmethod
    async def _closed(writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(writer.wait_closed(), WRITE_TIMEOUT_S)
        except (OSError, ConnectionError, TimeoutError):
            # a TLS transport whose connection is already lost has no protocol left to abort
            # (CPython 3.11 raises AttributeError there): nothing is left to close then
            with contextlib.suppress(AttributeError):
                writer.transport.abort()
