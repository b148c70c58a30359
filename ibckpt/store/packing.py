"""The packing plan: which bytes of a tree's files become chunks of their own and which share a pack.

Every S3 request costs a signature and a round trip, whatever its size; a CRIU image directory is dozens of
small files, so one chunk per file made a 1 MB checkpoint cost over a hundred requests. Files (and the tails
of big files) smaller than `pack_below` are instead concatenated, in tree order, into packs of at most
`chunk_size` bytes. A pack is an ordinary content-addressed chunk; a file's slice of it is a ChunkRef with
an offset. The plan is pure and depends only on the sizes in order, so an unchanged tree gives the same
packs, with the same ids, again.

A slice never spans two packs (each is below chunk_size), so a file has at most one piece in a pack: its
last. Inserting a file shifts the packs after it; that costs bytes, not requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ibckpt.store.chunking import spans


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + length) of file number `file`, the `index`-th piece of that file. `pack` is
    None for a chunk of its own, else the pack it is in, at `at` in the pack's bytes."""

    file: int
    index: int
    offset: int
    length: int
    pack: int | None = None
    at: int = 0


@dataclass(frozen=True)
class Plan:
    files: list[list[Piece]]  # per file, in file order
    packs: list[list[Piece]]  # per pack, in pack order

    @property
    def own_chunks(self) -> list[Piece]:
        return [piece for pieces in self.files for piece in pieces if piece.pack is None]

    @property
    def chunk_count(self) -> int:
        """Chunks to store (before deduplication): the pieces of their own plus the packs."""
        return len(self.own_chunks) + len(self.packs)

    @staticmethod
    def pack_size(members: list[Piece]) -> int:
        return members[-1].at + members[-1].length if members else 0


def plan(sizes: Sequence[int], chunk_size: int, pack_below: int) -> Plan:
    """The pieces of files of these sizes (in tree order). pack_below 0 turns packing off; it is capped at
    chunk_size, since a full chunk gains nothing from sharing."""
    threshold = min(pack_below, chunk_size)
    files: list[list[Piece]] = []
    packs: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for number, size in enumerate(sizes):
        pieces: list[Piece] = []
        for span in spans(size, chunk_size):
            if span.length >= threshold:
                pieces.append(Piece(number, span.index, span.offset, span.length))
                continue
            if used + span.length > chunk_size:
                packs.append(current)
                current, used = [], 0
            piece = Piece(number, span.index, span.offset, span.length, len(packs), used)
            current.append(piece)
            used += span.length
            pieces.append(piece)
        files.append(pieces)
    if current:
        packs.append(current)
    return Plan(files, packs)
