"""The coordinator's TCP server: authenticates participants and serves Session over the wire."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from typing import Any

from ibckpt.coordination.wire import (
    PROTOCOL_VERSION,
    Frame,
    Kind,
    ProtocolError,
    read_frame,
    segment_index,
    unpack_segments,
)
from ibckpt_operator.coordinator.session import (
    CoordinationTimeout,
    NotAParticipant,
    Session,
    SessionAborted,
)

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
MAX_WAIT_S = 3600.0


class _Connection:
    def __init__(self, session: Session, participant: str, writer: asyncio.StreamWriter) -> None:
        self.session = session
        self.participant = participant
        self.writer = writer
        self.lock = asyncio.Lock()

    async def send(self, frame: Frame) -> None:
        async with self.lock:
            self.writer.writelines(frame.buffers())
            await self.writer.drain()


class CoordinatorServer:
    """Hosts any number of sessions on one listening socket (127.0.0.1 unless told otherwise)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.sessions: dict[str, Session] = {}
        self._connections: dict[str, set[_Connection]] = {}
        self._server: asyncio.Server | None = None
        self._pushes: set[asyncio.Task[None]] = set()
        self._handlers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        # Closing the sockets ends each handler at its next read; cancelling would not be
        # clean (asyncio logs a cancelled client_connected_cb as an error).
        for writer in self._handlers.values():
            writer.transport.abort()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5)
        if self._server is not None:
            await self._server.wait_closed()

    def create_session(self, participants: set[str] | frozenset[str], deadline_s: float) -> tuple[str, str]:
        """A new session; returns (session id, token). The token is a secret: never log it."""
        session_id = secrets.token_hex(8)
        token = secrets.token_urlsafe(32)
        session = Session(session_id, token, frozenset(participants), deadline_s)
        self.sessions[session_id] = session
        self._connections[session_id] = set()
        session.abort_listeners.append(lambda reason: self._broadcast_abort(session_id, reason))
        log.info("session %s created for %d participants", session_id, len(participants))
        return session_id, token

    def close_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        for conn in self._connections.pop(session_id, set()):
            conn.writer.close()

    def _broadcast_abort(self, session_id: str, reason: str) -> None:
        log.warning("session %s aborted: %s", session_id, reason)
        for conn in list(self._connections.get(session_id, ())):
            push = asyncio.ensure_future(self._push_quietly(conn, Frame(Kind.ABORTED, {"reason": reason})))
            self._pushes.add(push)
            push.add_done_callback(self._pushes.discard)

    @staticmethod
    async def _push_quietly(conn: _Connection, frame: Frame) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await conn.send(frame)

    # -- connection handling --------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:
            self._handlers[me] = writer
            me.add_done_callback(lambda task: self._handlers.pop(task, None))
        conn: _Connection | None = None
        tasks: set[asyncio.Task[None]] = set()
        try:
            conn = await self._hello(reader, writer)
            if conn is None:
                return
            while True:
                frame = await read_frame(reader)
                task = asyncio.ensure_future(self._handle(conn, frame))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except ProtocolError as exc:
            log.warning("dropping connection: %s", exc)
        finally:
            for task in tasks:
                task.cancel()
            if conn is not None:
                self._connections.get(conn.session.id, set()).discard(conn)
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Connection | None:
        async def refuse(message: str) -> None:
            writer.write(Frame(Kind.ERROR, {"id": 0, "error": "auth", "message": message}).encode())
            await writer.drain()

        try:
            frame = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
        except TimeoutError:
            return None
        head = frame.header
        if frame.kind != Kind.HELLO or head.get("version") != PROTOCOL_VERSION:
            await refuse(f"expected HELLO with protocol version {PROTOCOL_VERSION}")
            return None
        session = self.sessions.get(str(head.get("session")))
        participant = str(head.get("participant"))
        if session is None or not session.authenticate(participant, str(head.get("token", ""))):
            log.warning("refused participant %r for session %r: bad session or token", participant,
                        head.get("session"))  # fmt: skip
            await refuse("unknown session, participant or token")
            return None
        conn = _Connection(session, participant, writer)
        self._connections[session.id].add(conn)
        await conn.send(Frame(Kind.OK, {"id": 0, "aborted": session.abort_reason}))
        return conn

    async def _handle(self, conn: _Connection, frame: Frame) -> None:
        head = frame.header
        request_id = head.get("id", 0)
        session, me = conn.session, conn.participant
        timeout = min(float(head.get("timeout", 60.0)), MAX_WAIT_S)
        reply: Frame
        try:
            reply = await self._dispatch(session, me, frame, timeout)
        except SessionAborted as exc:
            reply = Frame(Kind.ERROR, {"error": "aborted", "message": exc.reason})
        except CoordinationTimeout as exc:
            reply = Frame(Kind.ERROR, {"error": "timeout", "message": str(exc)})
        except (NotAParticipant, ValueError, KeyError, ProtocolError) as exc:
            reply = Frame(Kind.ERROR, {"error": "request", "message": str(exc)})
        reply = dataclasses.replace(reply, header={**reply.header, "id": request_id})
        with contextlib.suppress(ConnectionError, RuntimeError):
            await conn.send(reply)

    async def _dispatch(self, session: Session, me: str, frame: Frame, timeout: float) -> Frame:
        head: dict[str, Any] = frame.header
        match frame.kind:
            case Kind.BARRIER:
                await session.barrier(str(head["name"]), me, timeout)
                return Frame(Kind.OK)
            case Kind.PUT:
                session.put(str(head["key"]), frame.payload, me)
                return Frame(Kind.OK)
            case Kind.GET:
                return Frame(Kind.VALUE, {}, await session.get(str(head["key"]), me, timeout))
            case Kind.ROUTE:
                session.publish(str(head["round"]), me, unpack_segments(head["index"], frame.payload))
                return Frame(Kind.OK)
            case Kind.GATHER:
                got = await session.gather(str(head["round"]), me, timeout)
                return Frame(Kind.SEGMENTS, {"index": segment_index(got)}, b"", tuple(got.values()))
            case Kind.ABORT:
                session.abort(f"{me}: {head.get('reason', 'no reason given')}")
                return Frame(Kind.OK)
            case _:
                raise ProtocolError(f"unexpected frame kind {frame.kind.name}")
