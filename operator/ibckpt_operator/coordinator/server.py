"""The coordinator's TCP server: TLS only, authenticates participants and serves Session over the wire.

Every connection does its TLS handshake (the operator's certificate for ibckpt.tls.COORDINATOR_SERVER_NAME)
before its HELLO, within the same bound and counted among the connections that have not said HELLO
yet: a peer that speaks plain TCP, or never finishes the handshake, holds nothing for long.

A participant says HELLO with its own credential (Session.credential), so a connection speaks for
the one participant named in it: its barrier arrivals, its routed segments, and the keys it writes,
which the session keeps to those it claimed (Session.put_many)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import secrets
import socket
import ssl
from typing import Any

from ibckpt.coordination.channel import TlsChannel
from ibckpt.coordination.wire import (
    ERROR_ABORTED,
    ERROR_AUTH,
    ERROR_FORBIDDEN,
    ERROR_REQUEST,
    ERROR_TIMEOUT,
    MAX_HELLO,
    Frame,
    Hello,
    Kind,
    ProtocolError,
    SocketFrameReader,
)
from ibckpt_operator.coordinator.session import (
    CoordinationTimeout,
    ForeignKeys,
    NotAParticipant,
    Session,
    SessionAborted,
)

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # from accept: the TLS handshake and the HELLO
MAX_WAIT_S = 3600.0
BACKLOG = 1024  # every node agent of a large job connects at once
# Bounds on what a peer can make the operator hold (each connection costs about 70 KiB): connections that
# have not said HELLO yet (past it, the one waiting longest is dropped: an agent says HELLO at once, an
# idle stranger never), an authenticated participant's connections (an agent that reconnects may overlap
# its old one), and one connection's requests in flight (it is read no further meanwhile).
MAX_GREETING = 256
MAX_PER_PARTICIPANT = 4
MAX_IN_FLIGHT = 64


def _timeout(head: dict[str, Any]) -> float:
    """A request's wait, in seconds: a finite number, at most MAX_WAIT_S."""
    value = head.get("timeout", 60.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"timeout must be a finite number of seconds, not {value!r}")
    return min(float(value), MAX_WAIT_S)


class _Connection:
    """One participant's socket. The server uses sockets, not streams: a routed round's payload
    is received into one buffer and sent on from views of it with sendmsg(), never copied."""

    def __init__(
        self, session: Session, participant: str, channel: TlsChannel, reader: SocketFrameReader
    ) -> None:
        self.session = session
        self.participant = participant
        self.channel = channel
        self.reader = reader
        self.sock = channel.sock
        self.lock = asyncio.Lock()

    async def send(self, frame: Frame) -> None:
        async with self.lock:
            await frame.send(self.channel)


def _shutdown(sock: socket.socket) -> None:
    """End a connection: its handler's next (or pending) read sees the end and closes the socket."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class CoordinatorServer:
    """Hosts any number of sessions on one listening socket (127.0.0.1 unless told otherwise), over TLS
    with `tls` (a renewed certificate: assign a new context; connections from then on use it)."""

    def __init__(self, tls: ssl.SSLContext, host: str = "127.0.0.1", port: int = 0) -> None:
        self.tls = tls
        self.host = host
        self.port = port
        self.sessions: dict[str, Session] = {}
        self.sockets: list[socket.socket] = []  # the listening sockets
        self._connections: dict[str, set[_Connection]] = {}
        self._acceptors: list[asyncio.Task[None]] = []
        self._pushes: set[asyncio.Task[None]] = set()
        self._handlers: dict[asyncio.Task[None], socket.socket] = {}
        self._greeting: dict[socket.socket, None] = {}  # not authenticated yet, oldest first

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                self.sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(BACKLOG)
                sock.setblocking(False)
        except OSError:
            for sock in self.sockets:
                sock.close()
            self.sockets.clear()
            raise
        self.port = self.sockets[0].getsockname()[1]
        self._acceptors = [asyncio.ensure_future(self._accept(sock)) for sock in self.sockets]

    async def stop(self) -> None:
        for acceptor in self._acceptors:
            acceptor.cancel()
        for sock in self.sockets:
            sock.close()
        self.sockets.clear()
        for sock in self._handlers.values():
            _shutdown(sock)
        if self._handlers:
            _, late = await asyncio.wait(list(self._handlers), timeout=5)
            for task in late:
                task.cancel()

    def create_session(
        self, participants: set[str] | frozenset[str], deadline_s: float, session_id: str | None = None
    ) -> tuple[str, dict[str, str]]:
        """A new session; returns (session id, each participant's credential). A credential is a secret
        for its participant alone: hand it to that participant only, and never log it.

        The operator names sessions after the job's run, so a restarted operator knows what to abort."""
        session_id = session_id or secrets.token_hex(8)
        if session_id in self.sessions:
            self.close_session(session_id)
        session = Session(session_id, secrets.token_bytes(32), frozenset(participants), deadline_s)
        self.sessions[session_id] = session
        self._connections[session_id] = set()
        session.abort_listeners.append(lambda reason: self._broadcast_abort(session_id, reason))
        log.info("session %s created for %d participants", session_id, len(participants))
        return session_id, {name: session.credential(name) for name in session.participants}

    def close_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        for conn in self._connections.pop(session_id, set()):
            _shutdown(conn.sock)

    def _broadcast_abort(self, session_id: str, reason: str) -> None:
        log.warning("session %s aborted: %s", session_id, reason)
        for conn in list(self._connections.get(session_id, ())):
            push = asyncio.ensure_future(self._push_quietly(conn, Frame(Kind.ABORTED, {"reason": reason})))
            self._pushes.add(push)
            push.add_done_callback(self._pushes.discard)

    @staticmethod
    async def _push_quietly(conn: _Connection, frame: Frame) -> None:
        with contextlib.suppress(OSError):
            await conn.send(frame)

    # -- connection handling --------------------------------------------------------------

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of descriptors, say: keep serving those we have
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            if len(self._greeting) >= MAX_GREETING:
                oldest = next(iter(self._greeting))
                log.warning("%d connections await HELLO: dropping the oldest", len(self._greeting))
                del self._greeting[oldest]
                _shutdown(oldest)  # its handler's read ends
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._greeting[sock] = None  # now: the next accept may not yield to its handler
            handler = asyncio.ensure_future(self._serve(sock))
            self._handlers[handler] = sock
            handler.add_done_callback(lambda task: self._handlers.pop(task, None))

    async def _greet(self, sock: socket.socket) -> tuple[TlsChannel, SocketFrameReader, Frame]:
        """The TLS handshake, then the first frame. A peer that is not TLS (plain TCP) fails here with
        ssl.SSLError, an OSError."""
        channel = await TlsChannel.accept(sock, self.tls)
        reader = SocketFrameReader(channel)
        return channel, reader, await reader.read(MAX_HELLO)

    async def _serve(self, sock: socket.socket) -> None:
        conn: _Connection | None = None
        tasks: set[asyncio.Task[None]] = set()
        try:
            try:
                try:
                    channel, reader, hello = await asyncio.wait_for(self._greet(sock), HELLO_TIMEOUT_S)
                except TimeoutError:
                    return
                conn = await self._hello(hello, reader, channel)
            finally:
                self._greeting.pop(sock, None)
            if conn is None:
                return
            while True:
                if len(tasks) >= MAX_IN_FLIGHT:  # backpressure: read on once one has been answered
                    await asyncio.wait(list(tasks), return_when=asyncio.FIRST_COMPLETED)
                frame = await reader.read()
                task = asyncio.ensure_future(self._handle(conn, frame))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, OSError):
            pass
        except ProtocolError as exc:
            log.warning("dropping connection: %s", exc)
        finally:
            for task in tasks:
                task.cancel()
            if conn is not None:
                self._connections.get(conn.session.id, set()).discard(conn)
            if tasks:  # they stop writing to this socket before it is closed
                await asyncio.wait(list(tasks), timeout=1)
            sock.close()

    async def _hello(
        self, frame: Frame, reader: SocketFrameReader, channel: TlsChannel
    ) -> _Connection | None:
        async def refuse(message: str) -> None:
            await Frame(Kind.ERROR, {"id": 0, "error": ERROR_AUTH, "message": message}).send(channel)

        try:
            hello = Hello.parse(frame)
        except ProtocolError as exc:
            await refuse(str(exc))
            return None
        session, participant = self.sessions.get(hello.session), hello.participant
        if session is None or not session.authenticate(participant, hello.token):
            # The log says which; the peer is not told whether the session or the name exists.
            why = ("no such session" if session is None else
                   "not a participant" if participant not in session.participants else
                   "the credential is not this participant's")  # fmt: skip
            log.warning("refused participant %r for session %r: %s", participant, hello.session, why)
            await refuse(f"unknown session or participant, or the credential is not {participant!r}'s")
            return None
        open_ = sum(1 for c in self._connections.get(session.id, ()) if c.participant == participant)
        if open_ >= MAX_PER_PARTICIPANT:
            log.warning("refused participant %r for session %s: %d connections open", participant, session.id,
                        open_)  # fmt: skip
            await refuse(f"participant {participant} already has {open_} connections open")
            return None
        conn = _Connection(session, participant, channel, reader)
        self._connections[session.id].add(conn)
        await conn.send(Frame(Kind.OK, {"id": 0, "aborted": session.abort_reason}))
        return conn

    async def _handle(self, conn: _Connection, frame: Frame) -> None:
        head = frame.header if isinstance(frame.header, dict) else {}
        request_id = head.get("id", 0)
        session, me = conn.session, conn.participant
        reply: Frame
        try:
            if not isinstance(frame.header, dict):
                raise ValueError("a request's header must be an object")
            reply = await self._dispatch(session, me, frame, _timeout(head))
        except SessionAborted as exc:
            reply = Frame(Kind.ERROR, {"error": ERROR_ABORTED, "message": exc.reason})
        except CoordinationTimeout as exc:
            reply = Frame(Kind.ERROR, {"error": ERROR_TIMEOUT, "message": str(exc)})
        except ForeignKeys as exc:
            log.warning("session %s: refused a write: %s", session.id, exc)  # keys and names, no values
            reply = Frame(Kind.ERROR, {"error": ERROR_FORBIDDEN, "message": str(exc)})
        except (NotAParticipant, ValueError, KeyError, TypeError, ProtocolError) as exc:
            reply = Frame(Kind.ERROR, {"error": ERROR_REQUEST, "message": f"bad request: {exc}"})
        reply = dataclasses.replace(reply, header={**reply.header, "id": request_id})
        with contextlib.suppress(OSError):
            await conn.send(reply)

    async def _dispatch(self, session: Session, me: str, frame: Frame, timeout: float) -> Frame:
        head: dict[str, Any] = frame.header
        match frame.kind:
            case Kind.BARRIER:
                await session.barrier(str(head["name"]), me, timeout)
                return Frame(Kind.OK)
            case Kind.PUT:
                session.put(str(head["key"]), bytes(frame.payload), me)
                return Frame(Kind.OK)
            case Kind.PUT_MANY:
                session.put_many({key: bytes(value) for key, value in frame.segments().items()}, me)
                return Frame(Kind.OK)
            case Kind.GET:
                return Frame(Kind.VALUE, {}, await session.get(str(head["key"]), me, timeout))
            case Kind.ROUTE:
                session.publish(str(head["round"]), me, frame.segments())
                return Frame(Kind.OK)
            case Kind.GATHER:
                got = await session.gather(str(head["round"]), me, timeout)
                return Frame.of_segments(Kind.SEGMENTS, got)
            case Kind.ABORT:
                session.abort(
                    f"{me}: {head.get('reason', 'no reason given')}", refused=head.get("refused") is True
                )
                return Frame(Kind.OK)
            case _:
                raise ProtocolError(f"unexpected frame kind {frame.kind.name}")
