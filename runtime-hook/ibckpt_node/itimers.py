"""One-shot interval timers a restore loses, armed again through the shim.

CRIU before 4.1 dumps ITIMER_REAL, ITIMER_VIRTUAL and ITIMER_PROF with their remaining time but
restores only those that have an interval: an `alarm()` pending at the dump never fires after the
restore (perftest `-D` sent on past its duration). So before a restored rank rebuilds, the agent reads
that process's dumped timers from its core image and asks its shim to arm each one-shot timer that
is not armed (`itimer WHICH US`, native/src/itimer.c). A CRIU that restored the timer left it armed,
and the shim then leaves it alone; the agent asks only where the node's CRIU is older than 4.1.

The core image is read here, not with `crit` (a Python start per rank on a slow node): the three
fields on the way to the timers are plain protobuf (CRIU's images/core.proto, timer.proto).
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

from ibckpt_node.criu import parse_version

FIXED_IN = (4, 1, 0)  # CRIU restores one-shot itimers from this version on
WHICH = ("real", "virt", "prof")  # the shim's `itimer` numbers: 0, 1, 2
# core_entry.tc = 3 -> task_core_entry.timers = 7 -> task_timers_entry.{real, virt, prof} = 1, 2, 3
_TC, _TIMERS = 3, 7
_HEADER = 8  # two magic words before the entry's size


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("a truncated varint")
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            return value, i
        shift += 7


def _fields(data: bytes) -> dict[int, int | bytes]:
    """A message's fields: varints as int, length-delimited as bytes (the last of a number wins)."""
    fields: dict[int, int | bytes] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields[number], i = _varint(data, i)
        elif wire == 2:
            size, i = _varint(data, i)
            if i + size > len(data):
                raise ValueError("a field runs past its message")
            fields[number], i = data[i : i + size], i + size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire} in a core image")
    return fields


def _message(fields: dict[int, int | bytes], number: int) -> dict[int, int | bytes]:
    value = fields.get(number, b"")
    return _fields(value) if isinstance(value, bytes) else {}


def one_shots(core_image: Path) -> dict[int, int]:
    """{which: remaining microseconds} of the one-shot interval timers dumped in a process's core
    image (a thread's has none); ValueError for an image that is not a core entry."""
    data = core_image.read_bytes()
    if len(data) < _HEADER + 4:
        raise ValueError(f"{core_image}: too short for a CRIU image")
    (size,) = struct.unpack_from("<I", data, _HEADER)
    core = _fields(data[_HEADER + 4 : _HEADER + 4 + size])
    timers = _message(_message(core, _TC), _TIMERS)
    found: dict[int, int] = {}
    for which in range(len(WHICH)):
        t = _message(timers, which + 1)
        isec, iusec, vsec, vusec = (int(t.get(n, 0)) for n in (1, 2, 3, 4))
        if not isec and not iusec and (vsec or vusec):
            found[which] = vsec * 1_000_000 + vusec
    return found


def criu_drops_one_shots(criu: str = "criu") -> bool:
    """Whether this node's CRIU restores one-shot itimers as nothing (unknown: it does)."""
    try:
        proc = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    found = parse_version(proc.stdout)
    return found is None or found < FIXED_IN
