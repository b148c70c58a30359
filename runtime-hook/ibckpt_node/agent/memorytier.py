"""The memory tier's shelf: the copies of other nodes' parts this agent holds in memory, within a budget
(docs/recovery.md, "Tiers"; the wire is ibckpt/agentapi/memory.py). Pure and single-threaded: the
agent's event loop calls it.

A copy grows piece by piece, then is sealed with its index; only a sealed copy is served. Newer copies
matter more than older ones: sealing a copy drops the older ones of the same job and part, and a piece
that would pass the budget first drops the oldest sealed copies of any job. A copy that is left
unsealed for UNSEALED_S is dropped (its sender died or gave up).

A copy made before the upload carries its part's signed manifest (the seal's), and the operator writes the
checkpoint's signed manifest here once it merged the parts. Both count in the budget; a checkpoint's
manifest is kept while some copy of that checkpoint is, and goes with the last one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ibckpt.agentapi.memory import CHUNK_ID, FULL_STATUS, HeldCopies, HeldCopy, MemorySeal

UNSEALED_S = 600.0
Key = tuple[str, str, str]  # job, checkpoint, part


def mib(size: int) -> str:
    """Sizes in messages; not the store's format_size, which would import the whole store at start."""
    return f"{size / (1024 * 1024):.1f} MiB"


class ShelfError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Copy:
    key: Key
    started: float  # the clock's, for expiry
    created_at: float  # unix time, for people
    data: bytearray = field(default_factory=bytearray)
    pieces: int = 0
    index: dict[str, tuple[int, int]] | None = None  # set by the seal
    manifest: bytes | None = None  # the part's signed manifest, when the seal carried one

    @property
    def size(self) -> int:
        return len(self.data) + len(self.manifest or b"")

    def held(self) -> HeldCopy:
        job, checkpoint, part = self.key
        return HeldCopy(job=job, checkpoint=checkpoint, part=part, bytes=len(self.data),
                        chunks=len(self.index or {}), sealed=self.index is not None,
                        created_at=self.created_at)  # fmt: skip


class MemoryShelf:
    def __init__(self, node: str, budget: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.budget = budget
        self.clock = clock
        self.copies: dict[Key, Copy] = {}  # in arrival order: the oldest first
        self.manifests: dict[tuple[str, str], bytes] = {}  # (job, checkpoint) -> its signed manifest

    @property
    def used(self) -> int:
        return sum(c.size for c in self.copies.values()) + sum(len(m) for m in self.manifests.values())

    def put_piece(self, key: Key, index: int, data: bytes) -> None:
        self._expire()
        if self.budget <= 0:
            raise ShelfError(FULL_STATUS, f"node {self.node} keeps no memory tier (its budget is 0)")
        copy = self.copies.get(key)
        if index == 0:  # a new copy, or one sent again from the start
            self.copies.pop(key, None)
            copy = self.copies[key] = Copy(key, self.clock(), time.time())
        if copy is None or copy.index is not None or index != copy.pieces:
            expected = "piece 0" if copy is None or copy.index is not None else f"piece {copy.pieces}"
            raise ShelfError(409, f"copy {'/'.join(key)}: piece {index} out of order (expected {expected})")
        if not self._make_room(len(data), keep=lambda k: k == key):
            del self.copies[key]
            self._tidy()
            need = mib(len(copy.data) + len(data))
            raise ShelfError(
                FULL_STATUS,
                f"node {self.node}'s memory tier is full: {mib(self.budget)} budget, "
                f"{mib(self.used)} held by other copies, and this copy needs over {need}",
            )
        copy.data += data
        copy.pieces += 1

    def seal(self, key: Key, seal: MemorySeal) -> HeldCopy:
        copy = self.copies.get(key)
        if copy is None or copy.index is not None:
            raise ShelfError(404, f"no copy {'/'.join(key)} being received")
        if seal.bytes != len(copy.data):
            del self.copies[key]
            self._tidy()
            raise ShelfError(
                400, f"copy {'/'.join(key)}: {len(copy.data)} bytes arrived, the seal says {seal.bytes}"
            )
        for cid, (offset, length) in seal.chunks.items():
            if not CHUNK_ID.match(cid) or offset < 0 or length < 0 or offset + length > len(copy.data):
                del self.copies[key]
                self._tidy()
                raise ShelfError(400, f"copy {'/'.join(key)}: chunk {cid[:70]} is not inside the copy")
        manifest = seal.manifest.encode() if seal.manifest is not None else None
        if manifest and not self._make_room(len(manifest), keep=lambda k: k == key):
            del self.copies[key]
            self._tidy()
            raise ShelfError(FULL_STATUS, self._full(f"its part manifest needs {mib(len(manifest))} more"))
        copy.index, copy.manifest = dict(seal.chunks), manifest
        job, _, part = key
        for other in [k for k, c in self.copies.items() if c is not copy and (k[0], k[2]) == (job, part)]:
            del self.copies[other]  # a newer checkpoint of the same part: the older is no use
        self._tidy()
        return copy.held()

    def part_manifest(self, key: Key) -> bytes | None:
        copy = self.copies.get(key)
        return copy.manifest if copy is not None and copy.index is not None else None

    def put_manifest(self, job: str, checkpoint: str, data: bytes) -> None:
        """Keep the checkpoint's signed manifest (replacing one kept before) beside its copies."""
        self._expire()
        if not any(k[:2] == (job, checkpoint) for k in self.copies):
            raise ShelfError(404, f"node {self.node} holds no copy of {job}/{checkpoint}")
        old = self.manifests.pop((job, checkpoint), b"")
        # the checkpoint's own copies stay: its manifest is no use without them
        if not self._make_room(len(data), keep=lambda k: k[:2] == (job, checkpoint)):
            self.manifests[(job, checkpoint)] = old
            raise ShelfError(
                FULL_STATUS, self._full(f"the manifest of {job}/{checkpoint} needs {mib(len(data))}")
            )
        self.manifests[(job, checkpoint)] = data

    def manifest(self, job: str, checkpoint: str) -> bytes | None:
        return self.manifests.get((job, checkpoint))

    def chunk(self, key: Key, chunk_id: str) -> memoryview | None:
        """A view of the chunk's bytes, not a copy: a sealed copy's data never changes size (a copy sent
        again is a new one), and a dropped copy lives on until its last view is written."""
        copy = self.copies.get(key)
        if copy is None or copy.index is None or chunk_id not in copy.index:
            return None
        offset, length = copy.index[chunk_id]
        return memoryview(copy.data)[offset : offset + length]

    def drop(self, job: str, checkpoint: str) -> int:
        gone = [k for k in self.copies if k[:2] == (job, checkpoint)]
        for key in gone:
            del self.copies[key]
        self._tidy()
        return len(gone)

    def listing(self) -> HeldCopies:
        self._expire()
        return HeldCopies(node=self.node, budget=self.budget, used=self.used,
                          copies=[c.held() for c in self.copies.values()])  # fmt: skip

    def _full(self, need: str) -> str:
        return f"node {self.node}'s memory tier is full: {mib(self.budget)} budget, {need}"

    def _make_room(self, size: int, keep: Callable[[Key], bool]) -> bool:
        """Drop the oldest sealed copies (but those `keep` names) until `size` more bytes fit; False if
        they cannot."""
        while self.used + size > self.budget:
            oldest = next((k for k, c in self.copies.items() if c.index is not None and not keep(k)), None)
            if oldest is None:
                return False
            del self.copies[oldest]
            self._tidy()
        return True

    def _tidy(self) -> None:
        """A checkpoint's manifest goes with its last copy."""
        held = {k[:2] for k in self.copies}
        for gone in [m for m in self.manifests if m not in held]:
            del self.manifests[gone]

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, c in self.copies.items() if c.index is None and now - c.started > UNSEALED_S]:
            del self.copies[key]
        self._tidy()
