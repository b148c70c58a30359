"""Rank identity and record formats."""

from __future__ import annotations

import pytest

from ibckpt.coordination.ranks import QP_RECORD, QpRecord, RankAddress, RankId, pack_records, unpack_records


def test_rank_id_round_trips_and_rejects_partial_keys() -> None:
    rank = RankId("ring", "ring-worker-1", "mpi", "0")
    assert RankId.parse(rank.key()) == rank
    for bad in ("ring/ring-worker-1/mpi", "ring//mpi/0", "a/b/c/d/e"):
        with pytest.raises(ValueError, match="job/pod/container/process"):
            RankId.parse(bad)


def test_qp_records_round_trip() -> None:
    records = [
        QpRecord(1, 0x100002, 2, 0x100001, 0x11, 0xABCDEF, 10, 9, 7),
        QpRecord(3, 4, 5, 6, 7, 8, 2**40, 0, 1),
    ]
    data = pack_records(records)
    assert len(data) == 2 * QP_RECORD.size == 96
    assert list(unpack_records(data)) == records
    with pytest.raises(ValueError, match="whole number"):
        list(unpack_records(data[:-1]))


def test_rank_address_round_trip() -> None:
    addr = RankAddress(5, 0, 1, 1, bytes(10) + b"\xff\xff" + bytes([10, 77, 0, 2]))
    assert RankAddress.unpack(addr.pack()) == addr
