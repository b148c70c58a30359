"""Unit tests of how the shim follows librdmacm's connection ids (native/src/cmstate.c), through
cffi on the host: the commands librdmacm writes to an event channel and the events read back, laid
out as in the kernel's rdma/rdma_user_cm.h (offsets checked against the installed header by
compiling it), and which states a checkpoint carries."""

from __future__ import annotations

import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shimtest.core import CmIds

# rdma/rdma_user_cm.h: command numbers and the layouts the tests build
CREATE_ID, DESTROY_ID, CONNECT, LISTEN, ACCEPT, REJECT, DISCONNECT, JOIN_IP_MCAST = 0, 1, 6, 7, 8, 9, 10, 16
# rdma/rdma_cma.h: enum rdma_cm_event_type
CONNECT_REQUEST, CONNECT_RESPONSE, REJECTED, ESTABLISHED, DISCONNECTED, ADDR_RESOLVED = 4, 5, 8, 9, 10, 0
LAYOUT = {"connect_id": 272, "accept_id": 280, "event_resp": 336, "join_ip_id": 44}


@pytest.fixture
def ids(lib: Any) -> Iterator[CmIds]:
    c = CmIds(lib)
    yield c
    c.close()


def test_layouts_match_the_installed_header(tmp_path: Path) -> None:
    src = tmp_path / "off.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <rdma/rdma_user_cm.h>\n"
        'int main(void) { printf("%zu %zu %zu %zu", offsetof(struct rdma_ucm_connect, id),'
        " offsetof(struct rdma_ucm_accept, id), sizeof(struct rdma_ucm_event_resp),"
        " offsetof(struct rdma_ucm_join_ip_mcast, id)); return 0; }\n"
    )
    subprocess.run(["gcc", "-o", str(tmp_path / "off"), str(src)], check=True)
    got = subprocess.run([str(tmp_path / "off")], capture_output=True, text=True, check=True).stdout.split()
    assert [int(x) for x in got] == list(LAYOUT.values())


def _state(ids: CmIds, handle: int) -> str:
    got = ids.get(handle)
    assert got is not None, handle
    return got[0]


def _reported(ids: CmIds, handle: int) -> int:
    got = ids.get(handle)
    assert got is not None, handle
    return got[2]


def create(uid: int) -> bytes:
    return struct.pack("<QQHB5x", uid, 0xDEAD, 0x0106, 2)


def at(offset: int, handle: int, size: int, **fields: int) -> bytes:
    body = bytearray(size)
    struct.pack_into("<I", body, offset, handle)
    if "uid" in fields:
        struct.pack_into("<Q", body, 0, fields["uid"])
    return bytes(body)


def event(handle: int, ev: int, uid: int = 0, status: int = 0) -> bytes:
    resp = bytearray(LAYOUT["event_resp"])
    struct.pack_into("<QIII", resp, 0, uid, handle, ev, status)
    return bytes(resp)


def test_active_side_is_connected_once_librdmacm_accepts_the_reply(ids: CmIds) -> None:
    ids.cmd(CREATE_ID, create(0x1000), new_handle=7)
    assert ids.get(7) == ("idle", 0x1000, 0, False) and not ids.carried(7)
    ids.event(event(7, ADDR_RESOLVED, uid=0x1000))
    ids.cmd(CONNECT, at(LAYOUT["connect_id"], 7, 288))
    assert _state(ids, 7) == "connecting" and not ids.carried(7)
    ids.event(event(7, CONNECT_RESPONSE, uid=0x1000))
    assert _state(ids, 7) == "responded" and not ids.carried(7)  # QP to RTR/RTS not done yet
    ids.cmd(ACCEPT, at(LAYOUT["accept_id"], 7, 296))
    assert ids.get(7) == ("connected", 0x1000, 2, False) and ids.carried(7)


def test_passive_side_counts_the_request_on_the_listener(ids: CmIds) -> None:
    ids.cmd(CREATE_ID, create(0x2000), new_handle=1)
    ids.cmd(LISTEN, at(0, 1, 8))
    assert _state(ids, 1) == "listening" and not ids.carried(1)
    ids.event(event(9, CONNECT_REQUEST, uid=0x2000))  # the new id's handle, the listener's uid
    assert _reported(ids, 1) == 1  # the kernel counts the request on the listener
    assert ids.get(9) == ("connecting", 0, 0, False)
    ids.cmd(ACCEPT, at(LAYOUT["accept_id"], 9, 296, uid=0x3000))  # librdmacm names the new id
    assert ids.get(9) == ("connecting", 0x3000, 0, False)
    ids.event(event(9, ESTABLISHED, uid=0x3000))
    assert ids.get(9) == ("connected", 0x3000, 1, False) and ids.carried(9)
    assert ids.forget(1) == 1 and ids.get(1) is None
    assert ids.forget(1) == -1


def test_an_accepted_id_migrates_to_a_channel_of_its_own(ids: CmIds, lib: Any) -> None:
    """rdma_get_request on a synchronous listener moves each new id to its own channel
    (rdma_migrate_id): the id goes on there in the state it had, and its events are followed there."""
    ids.cmd(CREATE_ID, create(0x2000), new_handle=1)
    ids.cmd(LISTEN, at(0, 1, 8))
    ids.event(event(9, CONNECT_REQUEST, uid=0x2000))
    own = CmIds(lib)
    try:
        assert own.take(ids, 9) and ids.get(9) is None
        assert own.get(9) == ("connecting", 0, 0, False)
        assert not own.take(ids, 9)  # gone from the listener's channel
        own.cmd(ACCEPT, at(LAYOUT["accept_id"], 9, 296, uid=0x3000))
        own.event(event(9, ESTABLISHED, uid=0x3000))
        assert own.get(9) == ("connected", 0x3000, 1, False) and own.carried(9)
        assert _state(ids, 1) == "listening" and _reported(ids, 1) == 1
    finally:
        own.close()


def test_disconnect_then_its_event(ids: CmIds) -> None:
    ids.cmd(CREATE_ID, create(0x1000), new_handle=3)
    ids.cmd(CONNECT, at(LAYOUT["connect_id"], 3, 288))
    ids.event(event(3, CONNECT_RESPONSE, uid=0x1000))
    ids.cmd(ACCEPT, at(LAYOUT["accept_id"], 3, 296))
    ids.cmd(DISCONNECT, at(0, 3, 4))
    assert ids.get(3) == ("disconnecting", 0x1000, 1, False) and ids.carried(3)
    ids.cmd(DISCONNECT, at(0, 3, 4))  # again: no change
    assert _state(ids, 3) == "disconnecting"
    ids.event(event(3, DISCONNECTED, uid=0x1000))
    assert ids.get(3) == ("closed", 0x1000, 2, True) and ids.carried(3)
    assert ids.forget(3) == 2


def test_refused_states_and_unknown_or_short_input(ids: CmIds) -> None:
    ids.cmd(CREATE_ID, create(0x1000), new_handle=5)
    ids.cmd(JOIN_IP_MCAST, at(LAYOUT["join_ip_id"], 5, 48))
    assert _state(ids, 5) == "multicast" and not ids.carried(5)
    ids.cmd(CREATE_ID, create(0x1001), new_handle=6)
    ids.cmd(REJECT, at(0, 6, 8))
    assert _state(ids, 6) == "closed"
    # commands too short to name an id, ids nobody created, truncated events: nothing happens
    ids.cmd(CONNECT, b"\x05\x00")
    ids.cmd(LISTEN, at(0, 99, 8))
    ids.event(event(5, ESTABLISHED)[:12])
    ids.event(event(99, ESTABLISHED))
    ids.cmd(CREATE_ID, b"short", new_handle=8)
    assert ids.get(99) is None and ids.get(8) is None and _state(ids, 5) == "multicast"


def test_many_ids_grow_the_table(ids: CmIds) -> None:
    for h in range(1, 200):
        ids.cmd(CREATE_ID, create(0x1000 + h), new_handle=h)
    ids.event(event(150, REJECTED, uid=0x1000 + 150))
    assert ids.get(150) == ("closed", 0x1000 + 150, 1, False)
    for h in range(1, 200, 2):
        assert ids.forget(h) == (1 if h == 150 else 0)
    assert all((ids.get(h) is None) == (h % 2 == 1) for h in range(1, 200))
