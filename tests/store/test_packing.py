"""Pure: the packing plan, and the manifest schema that records packs (2) next to the old one (1)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from store.conftest import sample_manifest

from ibckpt.store.errors import ManifestError
from ibckpt.store.manifest import PART_KIND, ChunkRef, FileRecord, Manifest, parse_manifest
from ibckpt.store.packing import Piece, Plan, plan
from ibckpt.store.parts import merge_parts

CHUNK = 100


def check_covers(sizes: list[int], result: Plan, chunk_size: int) -> None:
    """Every byte of every file is in exactly one piece, and packs are contiguous and within a chunk."""
    for number, (size, pieces) in enumerate(zip(sizes, result.files, strict=True)):
        assert [piece.index for piece in pieces] == list(range(len(pieces)))
        assert all(piece.file == number for piece in pieces)
        assert sum(piece.length for piece in pieces) == size
        assert all(a.offset + a.length == b.offset for a, b in itertools.pairwise(pieces))
        assert all(piece.pack is None for piece in pieces[:-1]), "only a file's last piece is packed"
    for number, members in enumerate(result.packs):
        assert members and all(piece.pack == number for piece in members)
        assert members[0].at == 0
        assert all(a.at + a.length == b.at for a, b in itertools.pairwise(members))
        assert Plan.pack_size(members) <= chunk_size
    packed = [piece for pieces in result.files for piece in pieces if piece.pack is not None]
    assert packed == [piece for members in result.packs for piece in members]


def test_without_packing_every_span_is_its_own_chunk() -> None:
    result = plan([250, 0, 7], CHUNK, pack_below=0)
    assert result.packs == []
    assert result.files == [
        [Piece(0, 0, 0, 100), Piece(0, 1, 100, 100), Piece(0, 2, 200, 50)],
        [],
        [Piece(2, 0, 0, 7)],
    ]
    assert result.chunk_count == 4


def test_small_files_and_tails_share_packs_in_tree_order() -> None:
    # 30: small; 40: exactly at the threshold (own chunk); 0: empty (nothing); 230: two full chunks and a
    # tail of 30 (packed); 90: above the threshold (own chunk); 5: small.
    sizes = [30, 40, 0, 230, 90, 5]
    result = plan(sizes, CHUNK, pack_below=40)
    check_covers(sizes, result, CHUNK)
    assert result.files[0] == [Piece(0, 0, 0, 30, pack=0, at=0)]
    assert result.files[1] == [Piece(1, 0, 0, 40)]
    assert result.files[2] == []
    assert result.files[3] == [Piece(3, 0, 0, 100), Piece(3, 1, 100, 100), Piece(3, 2, 200, 30, 0, 30)]
    assert result.files[4] == [Piece(4, 0, 0, 90)]
    assert result.files[5] == [Piece(5, 0, 0, 5, pack=0, at=60)]
    assert [Plan.pack_size(members) for members in result.packs] == [65]
    assert result.chunk_count == 5  # the 40, two full chunks of the 230, the 90, and one pack


def test_a_pack_closes_before_it_would_outgrow_a_chunk() -> None:
    sizes = [60, 30, 20, 99, 1]
    result = plan(sizes, CHUNK, pack_below=CHUNK)
    check_covers(sizes, result, CHUNK)
    assert [[piece.file for piece in members] for members in result.packs] == [[0, 1], [2], [3, 4]]
    assert [Plan.pack_size(members) for members in result.packs] == [90, 20, 100]


def test_the_threshold_is_capped_at_the_chunk_size() -> None:
    # A whole chunk gains nothing from sharing: a 100-byte file stays alone even with pack_below 1000.
    result = plan([100, 150], CHUNK, pack_below=1000)
    assert result.files[0] == [Piece(0, 0, 0, 100)]
    assert result.files[1] == [Piece(1, 0, 0, 100), Piece(1, 1, 100, 50, pack=0, at=0)]


def test_random_trees_are_covered_and_planned_the_same_way_twice() -> None:
    rng = random.Random(7)
    for _ in range(200):
        sizes = [
            rng.choice([0, 1, rng.randrange(200), rng.randrange(1000)]) for _ in range(rng.randrange(30))
        ]
        below = rng.choice([0, 1, 10, 50, CHUNK, 500])
        result = plan(sizes, CHUNK, below)
        check_covers(sizes, result, CHUNK)
        assert plan(sizes, CHUNK, below) == result
        if below == 0:
            assert result.packs == []


# -- manifest schema --------------------------------------------------------------------------------------

ID_A, ID_B = "ab" * 32, "cd" * 32


def manifest(schema_version: int, files: list[FileRecord], **changes: object) -> Manifest:
    return sample_manifest(schema_version=schema_version, files=files, **changes)


def packed_files() -> list[FileRecord]:
    return [
        FileRecord(
            path="a", kind="file", mode=0o600, size=3, chunks=[ChunkRef(id=ID_A, size=3, stored_size=9)]
        ),
        FileRecord(
            path="b",
            kind="file",
            mode=0o600,
            size=4,
            chunks=[ChunkRef(id=ID_A, size=4, stored_size=9, offset=3)],
        ),
    ]


def test_schema_2_records_offsets_and_round_trips() -> None:
    packed = manifest(2, packed_files())
    assert parse_manifest(packed.to_json(), "here") == packed
    assert packed.chunk_sizes() == {ID_A: 9}
    with pytest.raises(ValueError, match="no chunk offsets"):
        manifest(1, packed_files())


def test_schema_1_is_written_without_offsets_and_read_as_it_always_was() -> None:
    plain = [
        FileRecord(
            path="a", kind="file", mode=0o644, size=5, chunks=[ChunkRef(id=ID_B, size=5, stored_size=7)]
        )
    ]
    old = manifest(1, plain)
    raw = json.loads(old.to_json())
    assert raw["schema_version"] == 1 and "offset" not in raw["files"][0]["chunks"][0]
    assert parse_manifest(old.to_json(), "here") == old
    raw["schema_version"] = 5
    with pytest.raises(ManifestError, match=r"schema_version 5; this ibckpt reads \[1, 2, 3, 4\]"):
        parse_manifest(json.dumps(raw).encode(), "here")


def test_merged_parts_take_the_newest_schema_of_any_part() -> None:
    old = manifest(1, [FileRecord(path="r0", kind="dir", mode=0o755)], kind=PART_KIND)
    new = manifest(2, [FileRecord(path="r1", kind="dir", mode=0o755), *packed_files()], kind=PART_KIND)
    assert merge_parts({"a": old, "b": new}).schema_version == 2
    assert merge_parts({"a": old, "b": old.model_copy(update={"files": []})}).schema_version == 1
