"""A damaged or missing chunk stops a restore with an error that names the chunk and the checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ibckpt.store import ChunkCorruptError, ChunkMissingError

pytestmark = pytest.mark.s3


def stored_checkpoint(make_store: Any, tree_factory: Any, helpers: Any) -> tuple[Any, Any]:
    store = make_store()
    tree = tree_factory({"pages.img": os.urandom(600_000), "text.img": helpers.compressible(400_000)})
    return store, store.upload_tree(tree, "solver")


def flip_byte(store: Any, chunk_id: str, position: int) -> None:
    key = store.context.layout.chunk_key(chunk_id)
    s3 = store.client
    body = bytearray(s3.get_object(Bucket=store.config.bucket, Key=key)["Body"].read())
    body[position % len(body)] ^= 0x01
    s3.put_object(Bucket=store.config.bucket, Key=key, Body=bytes(body))


@pytest.mark.parametrize("path", ["pages.img", "text.img"], ids=["raw-chunk", "zstd-chunk"])
def test_flipped_byte_is_detected_and_named(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path, path: str
) -> None:
    store, manifest = stored_checkpoint(make_store, tree_factory, helpers)
    record = next(record for record in manifest.files if record.path == path)
    victim = record.chunks[1].id
    flip_byte(store, victim, position=5000)

    with pytest.raises(ChunkCorruptError) as info:
        store.restore(manifest.ref, tmp_path / "restore" / "out")
    assert info.value.chunk_id == victim
    assert victim in str(info.value) and str(manifest.ref) in str(info.value)
    assert list((tmp_path / "restore").iterdir()) == [], "a failed restore must leave nothing behind"

    report = store.verify(manifest.ref)
    assert [problem.chunk_id for problem in report.problems] == [victim]


def test_flipped_header_byte_is_detected(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path
) -> None:
    store, manifest = stored_checkpoint(make_store, tree_factory, helpers)
    victim = manifest.files[0].chunks[0].id
    flip_byte(store, victim, position=0)
    with pytest.raises(ChunkCorruptError, match=victim):
        store.restore(manifest.ref, tmp_path / "restore" / "out")


def test_missing_chunk_is_detected_and_named(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path
) -> None:
    store, manifest = stored_checkpoint(make_store, tree_factory, helpers)
    victim = manifest.files[-1].chunks[-1].id
    store.client.delete_object(Bucket=store.config.bucket, Key=store.context.layout.chunk_key(victim))

    with pytest.raises(ChunkMissingError) as info:
        store.restore(manifest.ref, tmp_path / "restore" / "out")
    assert info.value.chunk_id == victim
    assert f"chunk {victim} of checkpoint {manifest.ref} is missing" in str(info.value)
    assert list((tmp_path / "restore").iterdir()) == []

    quick = store.verify(manifest.ref, deep=False)
    assert [type(problem) for problem in quick.problems] == [ChunkMissingError]
    assert store.verify(manifest.ref).problems[0].chunk_id == victim
