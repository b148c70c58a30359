"""The store's half of the memory tier (ibckpt/store/memorycopy.py, download.restore's chunk_source), on
the real S3: a node's part rebuilt from its images as the chunks the store keeps, and a restore that reads
them from such a copy before S3, trusting nothing it is given."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretBytes

from ibckpt.store import EncryptionConfig, ImageStore, RankInfo, StoreError, codec, memorycopy
from ibckpt.store.context import StageTimes, seal_chunk
from ibckpt.store.download import select_subtree
from ibckpt.store.manifest import Manifest

CHUNK = 256 * 1024  # the fixture's chunk size
MARKER = b"PLAINTEXT-MARKER-" * 64


def staged_part(store: ImageStore, root: Path) -> tuple[Manifest, Manifest]:
    """`root` staged as node-1's part of ns/solver and committed: (the part, the manifest)."""
    with store.writer("ns/solver") as writer:
        writer.add_tree(root, under="node-1")
        part = writer.stage("node-1", ranks=[RankInfo(rank=0, pod="solver-0", node="node-1", root="node-1")])
    return part, store.commit_parts("ns/solver", part.ref.checkpoint_id, ["node-1"])


def images(tree_factory: Callable[..., Path], helpers: Any) -> Path:
    """A dump's shape: a page file of several chunks, with a marker in it, and many small packed files."""
    files = {f"fdinfo-{n}.img": helpers.compressible(300 + 211 * n, seed=n) for n in range(30)}
    files["pages-1.img"] = os.urandom(2 * CHUNK) + MARKER + os.urandom(CHUNK // 2)
    return tree_factory(files)


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "client-encrypted"])
def test_a_restore_reads_every_chunk_from_the_copy_and_none_from_s3(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path, encrypted: bool
) -> None:
    key = EncryptionConfig(mode="client", client_key=SecretBytes(os.urandom(32)))
    store = make_store(pack_below=64 * 1024, **({"encryption": key} if encrypted else {}))
    source = images(tree_factory, helpers)
    part, manifest = staged_part(store, source)

    copy = dict(store.stored_chunks(part, source, "node-1"))
    distinct = {chunk.id for record in manifest.files for chunk in record.chunks}
    assert set(copy) == distinct and len(distinct) >= 4  # whole chunks and packs, each once
    stored_sizes = {chunk.id: chunk.stored_size for record in manifest.files for chunk in record.chunks}
    assert {cid: len(stored) for cid, stored in copy.items()} == stored_sizes  # sealed as the upload sealed
    files = select_subtree(part.files, "node-1")
    at_default = memorycopy.stored_chunks(store.context, files, source)  # the configuration's level: the same
    assert {cid: len(stored) for cid, stored in at_default} == stored_sizes
    if encrypted:
        assert not any(MARKER[:32] in stored for stored in copy.values())

    requests = helpers.Requests(store.client)
    restored = tmp_path / "restored"
    report = store.restore(manifest.ref, restored, subtree="node-1", chunk_source=copy.get)
    helpers.assert_same_tree(source, restored)
    assert (report.source_chunks, report.source_rejected) == (len(distinct), 0)
    assert report.source_bytes == sum(len(stored) for stored in copy.values())
    assert requests.named("GetObject", "chunks") == []


def test_what_the_copy_lacks_or_spoils_is_read_from_s3(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path
) -> None:
    store = make_store(pack_below=64 * 1024)
    source = images(tree_factory, helpers)
    part, manifest = staged_part(store, source)
    copy = dict(store.stored_chunks(part, source, "node-1"))
    spoiled, missing, failing, *good = sorted(copy)

    def source_of_chunks(cid: str) -> bytes | None:
        if cid == failing:
            raise ConnectionError("the holder went away")
        if cid == spoiled:
            return copy[cid][:-8] + b"forged!!"
        return None if cid == missing else copy[cid]

    requests = helpers.Requests(store.client)
    restored = tmp_path / "restored"
    report = store.restore(manifest.ref, restored, subtree="node-1", chunk_source=source_of_chunks)
    helpers.assert_same_tree(source, restored)
    assert (report.source_chunks, report.source_rejected) == (len(good), 1)
    fetched = sorted(requests.named("GetObject", "chunks"))
    assert fetched == sorted(store.context.layout.chunk_key(cid) for cid in (spoiled, missing, failing))


def test_a_copy_of_images_that_changed_since_the_upload_is_refused(
    make_store: Any, tree_factory: Any, helpers: Any
) -> None:
    store = make_store(pack_below=64 * 1024)
    source = images(tree_factory, helpers)
    part, _ = staged_part(store, source)
    with open(source / "pages-1.img", "r+b") as file:
        file.seek(CHUNK + 10)
        file.write(b"changed")
    with pytest.raises(StoreError, match=r"pages-1\.img changed since it was stored"):
        dict(store.stored_chunks(part, source, "node-1"))


def test_a_copy_sealed_under_another_key_is_refused_chunk_by_chunk_and_logged_once(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = EncryptionConfig(mode="client", client_key=SecretBytes(os.urandom(32)))
    store = make_store(pack_below=64 * 1024, encryption=key)
    source = images(tree_factory, helpers)
    part, manifest = staged_part(store, source)
    # The same chunks under the same ids, sealed with a key the restore does not have.
    other = codec.ChunkKeys.derive(os.urandom(32))
    foreign = {
        cid: seal_chunk(codec.open_chunk(stored, cid, store.context.keys), cid, 3, other, StageTimes())
        for cid, stored in store.stored_chunks(part, source, "node-1")
    }

    restored = tmp_path / "restored"
    with caplog.at_level(logging.WARNING, logger="ibckpt.store.download"):
        report = store.restore(manifest.ref, restored, subtree="node-1", chunk_source=foreign.get)
    helpers.assert_same_tree(source, restored)
    assert (report.source_chunks, report.source_rejected) == (0, len(foreign))
    assert len([r for r in caplog.records if "reading S3 instead" in r.getMessage()]) == 1
