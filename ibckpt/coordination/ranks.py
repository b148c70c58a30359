"""Rank identity and the fixed-size QP record that ranks exchange through the coordinator."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

# The last part of a container's key when it had no live verbs process at the checkpoint: it is dumped
# and restored as a plain container, and nothing in it is quiesced or rebuilt. Never a pid.
PLAIN_CONTAINER = "plain"


@dataclass(frozen=True, order=True)
class RankId:
    """Who a rank is, independent of host and pid: it survives a restore elsewhere."""

    job: str
    pod: str
    container: str
    process: str  # stable within the container, e.g. the process's ordinal at registration

    def key(self) -> str:
        return f"{self.job}/{self.pod}/{self.container}/{self.process}"

    @property
    def plain(self) -> bool:
        """The key of a container that had no live verbs process: no rank, the container alone."""
        return self.process == PLAIN_CONTAINER

    @classmethod
    def parse(cls, key: str) -> RankId:
        parts = key.split("/")
        if len(parts) != 4 or not all(parts):
            raise ValueError(f"rank key {key!r} is not job/pod/container/process")
        return cls(*parts)


@dataclass(frozen=True)
class QpRecord:
    """One QP end's new real QPN, PSN and exactly-once counters, addressed to its peer's rank.

    `src_*` is the publishing end, `dst_*` the peer that needs it to reconnect. Per-device
    addresses (GID, LID, port) are per rank, not per QP, and travel in RankAddress.
    """

    src_rank: int
    src_vqpn: int
    dst_rank: int
    dst_vqpn: int
    real_qpn: int
    psn: int
    sends_posted: int
    sends_completed: int
    recvs_completed: int


# 48 bytes, little-endian like the shim. All-to-all over 2,048 ranks is ~4M of these.
QP_RECORD = struct.Struct("<6I3Q")


def pack_records(records: Iterable[QpRecord]) -> bytes:
    return b"".join(
        QP_RECORD.pack(
            r.src_rank,
            r.src_vqpn,
            r.dst_rank,
            r.dst_vqpn,
            r.real_qpn,
            r.psn,
            r.sends_posted,
            r.sends_completed,
            r.recvs_completed,
        )
        for r in records
    )


def unpack_records(data: bytes | memoryview) -> Iterator[QpRecord]:
    if len(data) % QP_RECORD.size:
        raise ValueError(f"{len(data)} bytes is not a whole number of {QP_RECORD.size}-byte QP records")
    for fields in QP_RECORD.iter_unpack(data):
        yield QpRecord(*fields)


@dataclass(frozen=True)
class RankAddress:
    """Where a rank's device is after a rebuild: published once per rank."""

    rank: int
    lid: int
    port: int
    gid_index: int
    gid: bytes  # 16 bytes

    _STRUCT: ClassVar[struct.Struct] = struct.Struct("<IHBB16s")

    def pack(self) -> bytes:
        return self._STRUCT.pack(self.rank, self.lid, self.port, self.gid_index, self.gid)

    @classmethod
    def unpack(cls, data: bytes) -> RankAddress:
        return cls(*cls._STRUCT.unpack(data))
