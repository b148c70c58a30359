"""Framing of the coordinator protocol (version 1).

A frame is `u32 length | u8 kind | u32 header_length | header | payload`, big-endian,
where `length` counts everything after itself, the header is a small JSON object and the
payload is raw bytes. Bulk data (id tables, counters) travels in the payload, never in
JSON, so 2,048 ranks in all-to-all (~4M QP records) cost one copy, not 4M objects.
Every request header carries an `id` that its response echoes, so a client can keep
several requests in flight (a barrier wait while it publishes, say).
"""

from __future__ import annotations

import asyncio
import enum
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 1
MAX_FRAME = 512 * 1024 * 1024
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


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


@dataclass(frozen=True)
class Frame:
    kind: Kind
    header: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""

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


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    """Read one frame; raises asyncio.IncompleteReadError at end of stream."""
    prefix = await reader.readexactly(_PREFIX.size)
    length, kind, head_len = _PREFIX.unpack(prefix)
    if length > MAX_FRAME or head_len > length - 5:
        raise ProtocolError(f"bad frame lengths ({length}, {head_len})")
    body = await reader.readexactly(length - 5)
    try:
        header = json.loads(body[:head_len]) if head_len else {}
        return Frame(Kind(kind), header, body[head_len:])
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc


def segment_index(segments: Mapping[str, bytes | memoryview]) -> list[list[Any]]:
    """The JSON index of segments addressed to (or coming from) named participants."""
    return [[name, len(data)] for name, data in segments.items()]


def unpack_segments(index: list[list[Any]], payload: bytes) -> dict[str, memoryview]:
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
