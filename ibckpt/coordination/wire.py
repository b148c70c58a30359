"""Framing of the coordinator protocol (the version is PROTOCOL_VERSION, below).

A frame is `u32 length | u8 kind | u32 header_length | header | payload`, big-endian,
where `length` counts everything after itself, the header is a small JSON object and the
payload is raw bytes. Bulk data (id tables, counters) travels in the payload, never in
JSON, so 2,048 ranks in all-to-all (~4M QP records) cost one copy, not 4M objects.
Every request header carries an `id` that its response echoes, so a client can keep
several requests in flight (a barrier wait while it publishes, say). Both ends read and
write frames over TLS on plain non-blocking sockets (channel.TlsChannel, SocketFrameReader),
not streams.
"""

from __future__ import annotations

import asyncio
import enum
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ibckpt.coordination.channel import TlsChannel

PROTOCOL_VERSION = 2  # 2: PUT_MANY
MAX_FRAME = 512 * 1024 * 1024
MAX_HELLO = 64 * 1024  # before authentication a peer gets no large buffer
_PREFIX = struct.Struct("!IBI")


class Kind(enum.IntEnum):
    HELLO = 1
    OK = 2
    ERROR = 3
    BARRIER = 4
    PUT = 5
    GET = 6
    VALUE = 7
    ROUTE = 8
    GATHER = 9
    SEGMENTS = 10
    ABORT = 11
    ABORTED = 12  # pushed by the server to every participant
    PUT_MANY = 13  # many keys in one frame: header "index" [[key, size], ...], the values as payload


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


# A refused request's ERROR header names why in "error": one of these.
ERROR_AUTH = "auth"  # the HELLO was refused
ERROR_REQUEST = "request"  # malformed
ERROR_FORBIDDEN = "forbidden"  # a write of a key another participant owns
ERROR_ABORTED = "aborted"
ERROR_TIMEOUT = "timeout"


@dataclass(frozen=True)
class Frame:
    kind: Kind
    header: dict[str, Any] = field(default_factory=dict)
    payload: bytes | memoryview = b""  # a view when read by SocketFrameReader

    payload_parts: tuple[bytes | memoryview, ...] = ()  # sent after payload, without joining

    def buffers(self) -> list[bytes | memoryview]:
        """The frame as buffers for writelines(): bulk payloads are never copied to be sent."""
        head = json.dumps(self.header, separators=(",", ":")).encode()
        length = 1 + 4 + len(head) + len(self.payload) + sum(len(p) for p in self.payload_parts)
        if length > MAX_FRAME:
            raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
        return [_PREFIX.pack(length, self.kind, len(head)), head, self.payload, *self.payload_parts]

    def encode(self) -> bytes:
        return b"".join(self.buffers())

    async def send(self, channel: TlsChannel) -> None:
        """Send the frame; one sender at a time per channel."""
        await channel.send(self.buffers())

    @classmethod
    def of_segments(
        cls, kind: Kind, segments: Mapping[str, bytes | memoryview], header: dict[str, Any] | None = None
    ) -> Frame:
        """A frame carrying named segments: their index in the header, their bytes sent as they are."""
        return cls(kind, {**(header or {}), "index": segment_index(segments)}, b"", tuple(segments.values()))

    def segments(self) -> dict[str, memoryview]:
        """The named segments this frame carries, as views of its payload."""
        return unpack_segments(self.header["index"], self.payload)


@dataclass(frozen=True)
class Hello:
    """A participant's first frame: the session, who it says it is, and the credential the operator
    gave that participant alone (the coordinator checks that the two match)."""

    session: str
    participant: str
    token: str = field(repr=False)

    def frame(self) -> Frame:
        header = {"version": PROTOCOL_VERSION, "session": self.session, "participant": self.participant}
        return Frame(Kind.HELLO, {**header, "token": self.token})

    @classmethod
    def parse(cls, frame: Frame) -> Hello:
        head = frame.header
        if frame.kind != Kind.HELLO or not isinstance(head, dict) or head.get("version") != PROTOCOL_VERSION:
            raise ProtocolError(f"expected HELLO with protocol version {PROTOCOL_VERSION}")
        session, participant, token = head.get("session"), head.get("participant"), head.get("token")
        if not (isinstance(session, str) and isinstance(participant, str) and isinstance(token, str)):
            raise ProtocolError("a HELLO's session, participant and token must be strings")
        return cls(session, participant, token)


def _decode(kind: int, head: bytes) -> tuple[Kind, dict[str, Any]]:
    try:
        header = json.loads(head) if len(head) else {}
        return Kind(kind), header
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc


class SocketFrameReader:
    """Reads frames from a channel.

    Small frames come out of one scratch buffer; a frame's body is decrypted straight into a
    buffer of its own exact size, which the returned payload is a view of (a StreamReader
    copies a large body two or three times more).
    """

    _SCRATCH = 64 * 1024

    def __init__(self, channel: TlsChannel) -> None:
        self._channel = channel
        self._scratch = bytearray(self._SCRATCH)
        self._view = memoryview(self._scratch)
        self._start = self._end = 0

    async def _recv_into(self, view: memoryview) -> int:
        n = await self._channel.recv_into(view)
        if n == 0:
            raise asyncio.IncompleteReadError(b"", len(view))
        return n

    async def read(self, max_frame: int = MAX_FRAME) -> Frame:
        """Read one frame; raises asyncio.IncompleteReadError at end of stream."""
        while self._end - self._start < _PREFIX.size:
            if self._start:
                left = self._end - self._start
                self._view[:left] = self._view[self._start : self._end]
                self._start, self._end = 0, left
            self._end += await self._recv_into(self._view[self._end :])
        length, kind, head_len = _PREFIX.unpack_from(self._scratch, self._start)
        if length > max_frame or length < 5 or head_len > length - 5:
            raise ProtocolError(f"bad frame lengths ({length}, {head_len})")
        self._start += _PREFIX.size
        size = length - 5
        buffered = min(size, self._end - self._start)
        if size <= self._SCRATCH // 4 and buffered == size:
            body = bytes(self._view[self._start : self._start + size])  # small and here: no recv
            self._start += size
            kind_, header = _decode(kind, body[:head_len])
            return Frame(kind_, header, body[head_len:])
        whole = bytearray(size)
        view = memoryview(whole)
        view[:buffered] = self._view[self._start : self._start + buffered]
        self._start += buffered
        got = buffered
        while got < size:
            got += await self._recv_into(view[got:])
        kind_, header = _decode(kind, bytes(view[:head_len]))
        return Frame(kind_, header, view[head_len:])


def segment_index(segments: Mapping[str, bytes | memoryview]) -> list[list[Any]]:
    """The JSON index of segments addressed to (or coming from) named participants."""
    return [[name, len(data)] for name, data in segments.items()]


def unpack_segments(index: list[list[Any]], payload: bytes | memoryview) -> dict[str, memoryview]:
    """Split a payload by its index, as views (no copy: 4M records must not be copied per hop)."""
    out: dict[str, memoryview] = {}
    view = memoryview(payload)
    offset = 0
    for name, size in index:
        out[str(name)] = view[offset : offset + int(size)]
        offset += int(size)
    if offset != len(payload):
        raise ProtocolError(f"segment index covers {offset} of {len(payload)} payload bytes")
    return out
