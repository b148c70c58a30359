"""The one-shot itimers an older CRIU drops, read from core images (ibckpt_node/itimers.py).

`data/core-alarm-pending.img` is the core image CRIU 3.17.1 dumped of perftest's `ib_write_bw -D`
client mid-run, 63.74 s before its pending alarm(); `data/core-thread.img` one of its threads'."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from ibckpt_node import itimers

DATA = Path(__file__).parent / "data"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _core(tmp_path: Path, real: tuple[int, int, int, int], prof: tuple[int, int, int, int]) -> Path:
    """A core image as CRIU writes one: two magics, the entry's size, core_entry{mtype, tc{timers}}."""

    def itimer(isec: int, iusec: int, vsec: int, vusec: int) -> bytes:
        return b"".join(_field(n, v) for n, v in zip((1, 2, 3, 4), (isec, iusec, vsec, vusec), strict=True))

    timers = _field(1, itimer(*real)) + _field(2, itimer(0, 0, 0, 0)) + _field(3, itimer(*prof))
    tc = _field(1, 3) + _field(7, timers) + _field(8, b"ib_write_bw")
    entry = _field(1, 1) + _field(2, b"\x08\x01") + _field(3, tc)
    path = tmp_path / "core-7.img"
    path.write_bytes(struct.pack("<II", 0x54564319, 0x55105940) + struct.pack("<I", len(entry)) + entry)
    return path


def test_the_pending_alarm_of_a_real_dump_is_read_and_a_threads_image_has_none() -> None:
    assert itimers.one_shots(DATA / "core-alarm-pending.img") == {0: 63_739_874}
    assert itimers.one_shots(DATA / "core-thread.img") == {}


def test_only_one_shot_timers_with_time_left_are_named(tmp_path: Path) -> None:
    # real: one-shot, 2.5 s left; prof: periodic (CRIU restores it itself)
    assert itimers.one_shots(_core(tmp_path, (0, 0, 2, 500_000), (1, 0, 0, 300))) == {0: 2_500_000}
    assert itimers.one_shots(_core(tmp_path, (0, 0, 0, 0), (0, 0, 0, 7))) == {2: 7}


def test_an_image_that_is_not_a_core_entry_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "core-9.img"
    for data in (b"short", struct.pack("<III", 1, 2, 4) + b"\x0a\x09ab"):  # a field past its message
        bad.write_bytes(data)
        with pytest.raises(ValueError):
            itimers.one_shots(bad)


VERSIONS = [
    ("Version: 3.17.1", True),
    ("Version: 4.1", False),
    ("Version: 4.2\nGitID: v4.2", False),
    ("?", True),
]


@pytest.mark.parametrize(("printed", "drops"), VERSIONS)
def test_only_a_criu_older_than_4_1_is_taken_to_drop_them(tmp_path: Path, printed: str, drops: bool) -> None:
    criu = tmp_path / "criu"
    criu.write_text(f"#!/bin/sh\nprintf '%s\\n' '{printed}'\n")
    criu.chmod(0o755)
    assert itimers.criu_drops_one_shots(str(criu)) is drops
