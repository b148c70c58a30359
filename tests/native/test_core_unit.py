"""Unit tests of libibckpt's pure core (id tables, completion queue, exactly-once planner),
through cffi on the host. The core library is the same C code the shim is built from."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shimtest.core import (
    ATOMIC,
    CONSUMER,
    DELIVERED,
    FLAG_WR,
    RDMA,
    REPOST,
    SIGNALED,
    UNKNOWN,
    IdMap,
    ffi,
    plan_resend,
)


@pytest.fixture
def idmap(lib: Any) -> Iterator[IdMap]:
    m = IdMap(lib)
    yield m
    m.close()


def test_idmap_put_get_delete(idmap: IdMap) -> None:
    for v in range(1, 2000):
        idmap.put(v, v * 3)
    assert all(idmap.get(v) == v * 3 for v in range(1, 2000))
    assert idmap.live == 1999
    assert idmap.delete(7)
    assert idmap.get(7) is None
    assert not idmap.delete(7)
    assert idmap.was_used(7)  # the tombstone remembers a retired virtual id
    assert idmap.live == 1998


def test_idmap_choose_keeps_real_id_unless_live(idmap: IdMap) -> None:
    assert idmap.choose(17, 0x800000, 0xFFFFFF) == 17
    idmap.put(17, 17)
    # after a rebuild, virtual 17 now points elsewhere; a new QP that gets real 17
    idmap.put(17, 40)
    fresh = idmap.choose(17, 0x800000, 0xFFFFFF)
    assert fresh == 0x800000
    idmap.put(fresh, 17)
    nxt = idmap.choose(17, 0x800000, 0xFFFFFF)
    assert nxt == 0x800001, "a virtual id once handed out is never handed out again"


def test_qpn_choose_also_keeps_clear_of_reserved_qpns(idmap: IdMap, lib: Any) -> None:
    """A sibling's virtual QPNs (reserve.c) are as taken as this process's own live ones."""
    reserved = IdMap(lib)
    try:
        assert not idmap.qpn_taken(17, reserved) and idmap.choose_qpn(17, reserved) == 17
        reserved.put(17, 0)
        idmap.put(0x800000, 40)  # this process's own fresh one
        reserved.put(0x800001, 0)  # a sibling's fresh one
        assert idmap.qpn_taken(17, reserved) and idmap.qpn_taken(0x800000, reserved)
        assert idmap.choose_qpn(17, reserved) == 0x800002
        reserved.delete(17)  # `reserve 0` empties the set: the real QPN is free again
        assert idmap.choose_qpn(17, reserved) == 17
    finally:
        reserved.close()


def test_idmap_choose_wraps_in_mask(idmap: IdMap) -> None:
    idmap.put(5, 5)
    idmap.put(0xFF, 1)
    assert idmap.choose(5, 0xFF, 0xFF) == 1  # 0xff taken, 0 skipped (never a valid id)


def test_wcq_fifo_and_growth(lib: Any) -> None:
    q = ffi.new("struct ibk_wcq *")
    assert lib.ibk_wcq_init(q, 4) == 0
    wc = ffi.new("struct ibv_wc *")
    for i in range(100):  # grows past its initial capacity without losing order
        wc.wr_id = i
        assert lib.ibk_wcq_push(q, wc) == 0
    assert lib.ibk_wcq_count(q) == 100
    out = ffi.new("struct ibv_wc[]", 64)
    got: list[int] = []
    while True:
        n = lib.ibk_wcq_pop(q, out, 64)
        if not n:
            break
        got += [int(out[i].wr_id) for i in range(n)]
    assert got == list(range(100))
    lib.ibk_wcq_fini(q)


S = CONSUMER | SIGNALED  # a signaled send


def test_plan_nothing_delivered_reposts_everything(lib: Any) -> None:
    rc, v = plan_resend(lib, [S, CONSUMER, S], peer_recvs=10, done_consumers=10)
    assert rc == 0
    assert v == [REPOST, REPOST, REPOST]


def test_plan_delivered_prefix_is_never_resent(lib: Any) -> None:
    # the peer completed 2 of our 4 logged sends: the ack was lost in release
    rc, v = plan_resend(lib, [S, CONSUMER, S, S], peer_recvs=12, done_consumers=10)
    assert rc == 0
    assert v == [DELIVERED, DELIVERED, REPOST, REPOST]


def test_plan_writes_between_consumers(lib: Any) -> None:
    # WRITE before a delivered SEND was executed (RC is in order); a WRITE after the last
    # delivered consumer is ambiguous but idempotent, so it is posted again.
    flags = [RDMA, S, RDMA, S]
    rc, v = plan_resend(lib, flags, peer_recvs=1, done_consumers=0)
    assert rc == 0
    assert v == [DELIVERED, DELIVERED, REPOST, REPOST]


def test_plan_ambiguous_atomic_is_reported(lib: Any) -> None:
    rc, v = plan_resend(lib, [S, ATOMIC | SIGNALED], peer_recvs=1, done_consumers=0)
    assert rc == 1
    assert v == [DELIVERED, UNKNOWN]
    # an atomic behind an undelivered send was certainly not executed
    rc, v = plan_resend(lib, [S, ATOMIC | SIGNALED], peer_recvs=0, done_consumers=0)
    assert rc == 0
    assert v == [REPOST, REPOST]


def test_plan_flag_wr_is_dropped(lib: Any) -> None:
    rc, v = plan_resend(lib, [CONSUMER, FLAG_WR | SIGNALED], peer_recvs=0, done_consumers=0)
    assert rc == 0
    assert v == [REPOST, DELIVERED]


def test_plan_rejects_impossible_counts(lib: Any) -> None:
    assert plan_resend(lib, [S], peer_recvs=3, done_consumers=1)[0] == -1  # peer saw more than we sent
    assert plan_resend(lib, [S], peer_recvs=0, done_consumers=1)[0] == -1
