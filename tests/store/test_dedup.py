"""Deduplication: a second checkpoint of a mostly unchanged tree uploads only the changed chunks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.s3


class PutCounter:
    """Counts the PUT-like requests the store's client sends, by key area (botocore event hooks)."""

    def __init__(self, client: Any) -> None:
        self.keys: list[str] = []
        for operation in ("PutObject", "CreateMultipartUpload", "UploadPart", "CopyObject"):
            client.meta.events.register(f"before-parameter-build.s3.{operation}", self._seen)

    def _seen(self, params: dict[str, Any], **_: Any) -> None:
        self.keys.append(params["Key"])

    def under(self, area: str) -> list[str]:
        return [key for key in self.keys if f"/v1/{area}/" in key]


def hundred_files(root: Path, changed: int | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for index in range(100):
        seed = index if index != changed else 10_000 + index
        (root / f"pages-{index:03}.img").write_bytes(seed.to_bytes(4, "big") * 12_000)
    return root


# The one-chunk-per-file layout, with a HEAD before every PUT (packing has its own tests in test_packs.py).
OLD_LAYOUT = {"pack_below": 0, "blind_put_below": 0}


def test_second_upload_sends_only_the_changed_chunk(make_store: Any, tmp_path: Path) -> None:
    store = make_store(**OLD_LAYOUT)
    first_tree = hundred_files(tmp_path / "first")
    puts = PutCounter(store.client)
    first = store.upload_tree(first_tree, "solver")
    assert len(puts.under("chunks")) == 100
    assert first.stats.uploaded_chunks == 100

    second_tree = hundred_files(tmp_path / "second", changed=42)
    puts.keys.clear()
    second = store.upload_tree(second_tree, "solver")
    assert len(puts.under("chunks")) == 1, puts.under("chunks")
    assert len(puts.under("manifests")) == 1
    assert second.stats.uploaded_chunks == 1
    changed = next(record for record in second.files if record.path == "pages-042.img")
    assert puts.under("chunks")[0].endswith(changed.chunks[0].id)
    unchanged = {record.path: record.chunks for record in first.files if record.path != "pages-042.img"}
    assert all(record.chunks == unchanged[record.path] for record in second.files if record.path in unchanged)


def test_chunks_of_other_jobs_are_found_by_lookup(make_store: Any, tree_factory: Any) -> None:
    # No previous checkpoint of this job: the existence check (HEAD) still avoids re-sending shared chunks.
    store = make_store(**OLD_LAYOUT)
    data = {"a.img": os.urandom(300_000), "b.img": os.urandom(10_000)}
    store.upload_tree(tree_factory(data), "job-one")
    puts = PutCounter(store.client)
    manifest = store.upload_tree(tree_factory(data | {"c.img": b"new"}), "job-two")
    assert len(puts.under("chunks")) == 1
    assert manifest.stats.uploaded_chunks == 1


def test_repeated_chunk_within_one_checkpoint_is_stored_once(make_store: Any, tree_factory: Any) -> None:
    store = make_store()
    block = os.urandom(256 * 1024)
    puts = PutCounter(store.client)
    manifest = store.upload_tree(tree_factory({"a.img": block * 4, "b.img": block}), "repeat")
    assert manifest.stats.chunks == 5 and manifest.stats.distinct_chunks == 1
    assert len(puts.under("chunks")) == 1
