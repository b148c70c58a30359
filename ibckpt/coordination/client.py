"""asyncio client of the job coordinator, used by node agents (one per node per session).

TLS only: the coordinator's certificate must chain to the operator's CA (`tls`, ibckpt.tls.client_context)
and name ibckpt.tls.COORDINATOR_SERVER_NAME; the credential is sent only once that holds."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import socket
import ssl
from collections.abc import Mapping

from ibckpt.coordination.channel import TlsChannel
from ibckpt.coordination.wire import (
    ERROR_ABORTED,
    ERROR_FORBIDDEN,
    ERROR_TIMEOUT,
    Frame,
    Hello,
    Kind,
    ProtocolError,
    SocketFrameReader,
)
from ibckpt.tls import COORDINATOR_SERVER_NAME

CONNECT_TIMEOUT_S = 10.0
# Replies may trail the server-side bound a little; this slack keeps the client from
# giving up first and hiding the server's (more precise) message.
REPLY_SLACK_S = 5.0
# A coordinator whose host or pod vanished sends no FIN: keepalive probes find it gone within
# about IDLE + INTERVAL * COUNT seconds, and unacknowledged data within USER_TIMEOUT, instead of
# a request waiting out its whole bound (a dump's barrier waits up to 10 minutes).
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3
USER_TIMEOUT_MS = 30_000


class CoordinatorError(Exception):
    """The coordinator refused a request (bad request or authentication)."""


class CoordinationAborted(CoordinatorError):
    """The session was aborted by a participant, the operator or its deadline."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CoordinationTimedOut(CoordinatorError):
    """A bounded wait on the coordinator ran out."""


class CoordinationForbidden(CoordinatorError):
    """The coordinator refused a write: the key is another participant's."""


async def _open(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to the first of `host`'s addresses that answers."""
    loop = asyncio.get_running_loop()
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keep_alive(sock)
        return sock
    raise error


def _keep_alive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
    ):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class CoordinatorClient:
    """One participant's connection. TLS on a plain socket, like the server: a routed round's reply
    is received into one buffer that the returned segments are views of."""

    def __init__(self, channel: TlsChannel, reader: SocketFrameReader, participant: str) -> None:
        self.participant = participant
        self._channel = channel
        self._sock = channel.sock
        self._reader = reader
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Frame]] = {}
        self._write_lock = asyncio.Lock()
        self.abort_reason: str | None = None
        self.aborted = asyncio.Event()
        self.lost_reason: str | None = None  # why the connection is gone, once it is
        self._reader_task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls, host: str, port: int, session: str, participant: str, token: str, *, tls: ssl.SSLContext,
        server_name: str = COORDINATOR_SERVER_NAME,
    ) -> CoordinatorClient:  # fmt: skip
        """`token`: the credential the operator gave `participant` for the session; no other works.
        `tls`: trusts the operator's CA alone."""
        try:
            sock = await asyncio.wait_for(_open(host, port), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            raise CoordinatorError(f"cannot reach the coordinator at {host}:{port}: {exc}") from exc
        try:
            channel = await asyncio.wait_for(TlsChannel.connect(sock, tls, server_name), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError: not the operator's certificate
            sock.close()
            raise CoordinatorError(f"no TLS with the coordinator at {host}:{port}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        reader = SocketFrameReader(channel)
        try:
            hello = Hello(session, participant, token).frame()
            await asyncio.wait_for(hello.send(channel), CONNECT_TIMEOUT_S)
            reply = await asyncio.wait_for(reader.read(), CONNECT_TIMEOUT_S)
        except (asyncio.IncompleteReadError, TimeoutError, ProtocolError, OSError) as exc:
            sock.close()
            raise CoordinatorError(f"coordinator at {host}:{port} did not answer HELLO: {exc!r}") from exc
        if reply.kind != Kind.OK:
            sock.close()
            raise CoordinatorError(f"coordinator refused {participant}: {reply.header.get('message')}")
        client = cls(channel, reader, participant)
        if reply.header.get("aborted"):
            client._mark_aborted(str(reply.header["aborted"]))
        client._reader_task = asyncio.ensure_future(client._read_loop())
        return client

    async def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a request still sending
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        async with self._write_lock:  # no request is between its sendmsg() and its wait
            self._sock.close()

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def lost(self) -> bool:
        """The connection is gone: closed or reset by the coordinator's side, or given up (lose())."""
        return self.lost_reason is not None

    def lose(self, reason: str) -> None:
        """Give the connection up (the operator says its coordinator is gone): every request waiting on
        it fails now with CoordinationAborted instead of waiting out its bound."""
        self._mark_aborted(reason)
        self._fail_pending(CoordinationAborted(reason), reason)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _fail_pending(self, error: CoordinatorError, why: str) -> None:
        if self.lost_reason is None:
            self.lost_reason = why
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    def _mark_aborted(self, reason: str) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
            self.aborted.set()

    async def _read_loop(self) -> None:
        error: BaseException = ConnectionError("coordinator closed the connection")
        try:
            while True:
                frame = await self._reader.read()
                if frame.kind == Kind.ABORTED:
                    self._mark_aborted(str(frame.header.get("reason")))
                    continue
                future = self._pending.pop(int(frame.header.get("id", 0)), None)
                if future is not None and not future.done():
                    future.set_result(frame)
        except (asyncio.IncompleteReadError, OSError, ProtocolError) as exc:
            error = exc
        finally:
            self._fail_pending(CoordinatorError(f"lost the coordinator: {error!r}"), repr(error))

    async def _request(self, request: Frame, timeout: float = 60.0) -> Frame:
        if self.lost_reason is not None:
            raise CoordinatorError(f"lost the coordinator: {self.lost_reason}")
        request_id = next(self._ids)
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        kind = request.kind
        frame = dataclasses.replace(request, header={**request.header, "id": request_id, "timeout": timeout})
        try:
            async with self._write_lock:
                await frame.send(self._channel)
        except OSError as exc:  # closed, or the coordinator went away
            self._pending.pop(request_id, None)
            raise CoordinatorError(f"cannot send {kind.name} to the coordinator: {exc}") from exc
        try:
            reply = await asyncio.wait_for(future, timeout + REPLY_SLACK_S)
        except TimeoutError:
            self._pending.pop(request_id, None)
            raise CoordinationTimedOut(
                f"no reply to {kind.name} within {timeout + REPLY_SLACK_S:g}s"
            ) from None
        if reply.kind == Kind.ERROR:
            error, message = reply.header.get("error"), str(reply.header.get("message"))
            if error == ERROR_ABORTED:
                self._mark_aborted(message)
                raise CoordinationAborted(message)
            if error == ERROR_TIMEOUT:
                raise CoordinationTimedOut(message)
            if error == ERROR_FORBIDDEN:
                raise CoordinationForbidden(message)
            raise CoordinatorError(message)
        return reply

    # -- the API --------------------------------------------------------------------------

    async def barrier(self, name: str, timeout: float) -> None:
        await self._request(Frame(Kind.BARRIER, {"name": name}), timeout)

    async def put(self, key: str, value: bytes) -> None:
        await self._request(Frame(Kind.PUT, {"key": key}, value))

    async def put_many(self, records: Mapping[str, bytes]) -> None:
        """Publish many keys in one request (a node's rebuild records): one frame, one reply."""
        if records:
            await self._request(Frame.of_segments(Kind.PUT_MANY, records))

    async def get(self, key: str, timeout: float) -> bytes:
        return bytes((await self._request(Frame(Kind.GET, {"key": key}), timeout)).payload)

    async def exchange(
        self, round_name: str, segments: dict[str, bytes], timeout: float
    ) -> dict[str, memoryview]:
        """Publish segments addressed to other participants; return those addressed to us, by sender."""
        await self._request(Frame.of_segments(Kind.ROUTE, segments, {"round": round_name}))
        reply = await self._request(Frame(Kind.GATHER, {"round": round_name}), timeout)
        return reply.segments()

    async def abort(self, reason: str, refused: bool = False) -> None:
        """Abort the session for everyone. `refused`: a preflight refusal, before any rank was gated."""
        head: dict[str, object] = {"reason": reason}
        if refused:
            head["refused"] = True
        await self._request(Frame(Kind.ABORT, head))
