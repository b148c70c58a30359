"""Small files share pack chunks: against the real SeaweedFS server, round trips, requests, deduplication,
damage, garbage collection, multi-node parts, and manifests of the layout before packs (schema 1)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretBytes

from ibckpt.store import ChunkCorruptError, EncryptionConfig, RankInfo, RetentionPolicy

pytestmark = pytest.mark.s3

CHUNK = 256 * 1024  # the fixture's chunk size
BELOW = 64 * 1024


def criu_like(tree_factory: Any, helpers: Any, seed: int = 0, count: int = 40) -> Path:
    """Many small image files, an empty one, one exactly at the pack threshold, one bigger than a chunk
    whose tail is packed, a subdirectory, odd modes and a symlink."""
    files = {f"fdinfo-{n}.img": helpers.compressible(200 + 397 * n, seed=seed + n) for n in range(count)}
    files |= {
        "core-1.img": os.urandom(3000),
        "empty.img": b"",
        "exact.img": os.urandom(BELOW),
        "pages-1.img": os.urandom(CHUNK + 5000),
        "sub/mm-1.img": helpers.compressible(900, seed=seed),
    }
    root: Path = tree_factory(files, modes={"core-1.img": 0o600, "exact.img": 0o640, "sub/mm-1.img": 0o751})
    os.chmod(root / "sub", 0o750)
    os.utime(root / "core-1.img", ns=(1_700_000_000_123_456_789, 1_600_000_000_987_654_321))
    os.symlink("pages-1.img", root / "pages.link")
    return root


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "client-encrypted"])
def test_round_trip_with_packs(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path, encrypted: bool
) -> None:
    encryption = (
        EncryptionConfig(mode="client", client_key=SecretBytes(os.urandom(32))) if encrypted else None
    )
    store = make_store(pack_below=BELOW, **({"encryption": encryption} if encryption else {}))
    source = criu_like(tree_factory, helpers)
    requests = helpers.Requests(store.client)
    manifest = store.upload_tree(source, "ns/solver")

    assert manifest.schema_version == 2
    records = {record.path: record for record in manifest.files}
    exact, pages, core = records["exact.img"], records["pages-1.img"], records["core-1.img"]
    assert len(exact.chunks) == 1 and exact.chunks[0].size == BELOW  # at the threshold: a chunk of its own
    assert [chunk.size for chunk in pages.chunks] == [CHUNK, 5000]  # its tail shares a pack
    assert records["empty.img"].chunks == []
    packs = {chunk.id for record in records.values() for chunk in record.chunks if chunk.offset}
    assert pages.chunks[1].id in packs and core.chunks[0].id in packs
    own = {exact.chunks[0].id, pages.chunks[0].id}
    assert manifest.stats.distinct_chunks == len(own | packs) == manifest.stats.uploaded_chunks
    assert manifest.stats.files == 45 and manifest.stats.chunks == 45
    # Packs, and chunks below 1 MiB, are PUT without a HEAD first.
    assert requests.named("HeadObject") == []
    assert len(requests.named("PutObject", "chunks")) == manifest.stats.distinct_chunks

    requests.sent.clear()
    restored = tmp_path / "restored"
    report = store.restore(manifest.ref, restored)
    helpers.assert_same_tree(source, restored)
    assert report.logical_bytes == manifest.stats.logical_bytes
    assert sorted(requests.named("GetObject", "chunks")) == sorted(
        store.context.layout.chunk_key(cid) for cid in own | packs
    ), "each pack is fetched once"
    assert store.verify(manifest.ref).problems == []


def test_requests_of_a_small_checkpoint(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path
) -> None:
    """A tree that fits one pack: lease, sweep check, the pack, the manifest, lease release."""
    store = make_store()
    tree = tree_factory({f"f-{n}.img": helpers.compressible(100 + 50 * n, seed=n) for n in range(60)})
    requests = helpers.Requests(store.client)
    manifest = store.upload_tree(tree, "solver")
    assert manifest.stats.distinct_chunks == 1
    assert [name for name, _ in requests.sent] == [
        "PutObject",  # lease
        "ListObjectsV2",  # sweeps
        "PutObject",  # the pack
        "PutObject",  # the manifest
        "DeleteObject",  # lease
    ]
    requests.sent.clear()
    store.restore(manifest.ref, tmp_path / "out")
    assert [name for name, _ in requests.sent] == [
        "PutObject",  # lease
        "ListObjectsV2",  # sweeps
        "GetObject",  # the manifest
        "GetObject",  # the pack
        "DeleteObject",  # lease
    ]
    helpers.assert_same_tree(tree, tmp_path / "out")


def test_an_unchanged_tree_stores_no_new_chunk(
    make_store: Any, tree_factory: Any, helpers: Any, list_chunks: Any
) -> None:
    store = make_store(pack_below=BELOW)
    tree = criu_like(tree_factory, helpers)
    first = store.upload_tree(tree, "solver")
    chunks = sorted(list_chunks())
    requests = helpers.Requests(store.client)
    second = store.upload_tree(tree, "solver")
    # Enough chunks that reading the latest manifest pays: it names every one, so none is sent or looked up.
    assert requests.named("PutObject", "chunks") == [] and requests.named("HeadObject") == []
    assert second.stats.uploaded_chunks == 0 and sorted(list_chunks()) == chunks
    assert [record.chunks for record in second.files] == [record.chunks for record in first.files]


def test_an_unchanged_single_pack_is_refused_not_replaced(
    make_store: Any, tree_factory: Any, helpers: Any, list_chunks: Any
) -> None:
    # One chunk: the latest manifest is not read (two requests to save one), so the pack is PUT only if
    # absent; the server refuses it and the stored object stays as it was.
    store = make_store()
    tree = tree_factory({f"f-{n}.img": os.urandom(100 + n) for n in range(10)})
    first = store.upload_tree(tree, "solver")
    (cid,) = first.chunk_sizes()
    key = store.context.layout.chunk_key(cid)
    before = store.client.head_object(Bucket=store.config.bucket, Key=key)
    requests = helpers.Requests(store.client)
    second = store.upload_tree(tree, "solver")
    assert requests.named("PutObject", "chunks") == [key] and requests.named("HeadObject") == [key]
    assert second.stats.uploaded_chunks == 0 and second.chunk_sizes() == first.chunk_sizes()
    after = store.client.head_object(Bucket=store.config.bucket, Key=key)
    assert (after["ETag"], after["LastModified"]) == (before["ETag"], before["LastModified"])
    assert list_chunks() == [key]


def test_one_changed_small_file_sends_one_pack(make_store: Any, tmp_path: Path, helpers: Any) -> None:
    store = make_store(pack_below=BELOW)

    def tree(name: str, changed: int | None = None) -> Path:
        root = tmp_path / name
        root.mkdir()
        for index in range(100):  # 48 000 bytes each: five to a pack
            seed = index if index != changed else 10_000 + index
            (root / f"pages-{index:03}.img").write_bytes(seed.to_bytes(4, "big") * 12_000)
        return root

    first = store.upload_tree(tree("first"), "solver")
    assert first.stats.distinct_chunks == 20
    requests = helpers.Requests(store.client)
    second = store.upload_tree(tree("second", changed=42), "solver")
    changed = next(record for record in second.files if record.path == "pages-042.img")
    assert requests.named("PutObject", "chunks") == [store.context.layout.chunk_key(changed.chunks[0].id)]
    assert second.stats.uploaded_chunks == 1


def test_a_corrupt_pack_is_named_on_restore_and_by_verify(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path
) -> None:
    store = make_store(pack_below=BELOW)
    manifest = store.upload_tree(criu_like(tree_factory, helpers), "solver")
    victim = next(record for record in manifest.files if record.path == "core-1.img").chunks[0].id
    key = store.context.layout.chunk_key(victim)
    body = bytearray(store.client.get_object(Bucket=store.config.bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x01
    store.client.put_object(Bucket=store.config.bucket, Key=key, Body=bytes(body))

    with pytest.raises(ChunkCorruptError) as info:
        store.restore(manifest.ref, tmp_path / "restore" / "out")
    assert info.value.chunk_id == victim and str(manifest.ref) in str(info.value)
    assert list((tmp_path / "restore").iterdir()) == []
    # Many files share the pack; it is checked, and reported, once.
    assert [problem.chunk_id for problem in store.verify(manifest.ref).problems] == [victim]


def test_gc_keeps_packs_any_manifest_uses(
    make_store: Any, tree_factory: Any, helpers: Any, list_chunks: Any, tmp_path: Path
) -> None:
    store = make_store(pack_below=BELOW)
    tree_1 = tree_factory({f"a-{n}.img": os.urandom(500) for n in range(20)})
    tree_2 = tree_factory({f"a-{n}.img": os.urandom(500) for n in range(20)})
    old = store.upload_tree(tree_1, "x")
    shared = store.upload_tree(tree_1, "y")  # the same pack, under another job
    new = store.upload_tree(tree_2, "x")
    assert old.chunk_sizes() == shared.chunk_sizes() and len(list_chunks()) == 2

    report = store.gc(RetentionPolicy(keep_last=1), grace=timedelta(0))
    assert report.deleted_checkpoints == [old.ref] and report.chunks_deleted == 0
    store.delete(shared.ref)
    report = store.gc(RetentionPolicy(), grace=timedelta(0))
    assert report.chunks_deleted == 1
    assert [key.rpartition("/")[2] for key in list_chunks()] == list(new.chunk_sizes())
    store.restore(new.ref, tmp_path / "new")
    helpers.assert_same_tree(tree_2, tmp_path / "new")


def test_parts_with_packs_merge_and_restore_per_subtree(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path
) -> None:
    store = make_store(pack_below=BELOW)
    trees = [criu_like(tree_factory, helpers, seed=rank * 100, count=10 + rank) for rank in range(2)]
    staged = []
    for rank, tree in enumerate(trees):
        with store.writer("ns/ring", "c1") as writer:
            writer.add_tree(tree, under=f"rank-{rank}")
            staged.append(writer.stage(f"node-{rank}", ranks=[RankInfo(rank=rank, root=f"rank-{rank}")]))
    assert all(part.schema_version == 2 for part in staged)
    requests = helpers.Requests(store.client)
    manifest = store.commit_parts("ns/ring", "c1", expected=["node-0", "node-1"])
    assert manifest.schema_version == 2
    # The merged parts go in one request, without listing them again.
    assert [name for name, _ in requests.sent] == [
        "PutObject",  # lease
        "ListObjectsV2",  # sweeps
        "ListObjectsV2",  # parts
        "GetObject",
        "GetObject",
        "HeadObject",  # no manifest yet: a commit never replaces one
        "PutObject",  # the manifest
        "DeleteObjects",  # the parts
        "DeleteObject",  # lease
    ]
    assert (
        store.client.list_objects_v2(Bucket=store.config.bucket, Prefix="ibckpt/v1/parts/")["KeyCount"] == 0
    )
    # Each node made its own packs: no chunk is shared between the two parts.
    assert not set(staged[0].chunk_sizes()) & set(staged[1].chunk_sizes())

    for rank, tree in enumerate(trees):
        requests.sent.clear()
        store.restore(manifest.ref, tmp_path / f"rank-{rank}", subtree=f"rank-{rank}")
        helpers.assert_same_tree(tree, tmp_path / f"rank-{rank}")
        fetched = {key.rpartition("/")[2] for key in requests.named("GetObject", "chunks")}
        assert fetched == set(staged[rank].chunk_sizes()), "a node fetches only its own part's chunks"


def test_schema_1_manifests_still_restore(
    make_store: Any, tree_factory: Any, helpers: Any, s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    # Packing off writes the layout before packs, as schema 1, which readers of schema 1 read.
    old = make_store(pack_below=0, blind_put_below=0)
    source = criu_like(tree_factory, helpers)
    manifest = old.upload_tree(source, "solver")
    assert manifest.schema_version == 1 and manifest.stats.distinct_chunks == manifest.stats.chunks == 45
    raw = s3_server.client().get_object(Bucket=bucket, Key=old.context.layout.manifest_key(manifest.ref))
    stored = json.loads(raw["Body"].read())
    assert stored["schema_version"] == 1
    assert all(set(chunk) == {"id", "size", "stored_size"} for f in stored["files"] for chunk in f["chunks"])

    new = make_store()
    new.restore(manifest.ref, tmp_path / "out")
    helpers.assert_same_tree(source, tmp_path / "out")
    assert new.verify(manifest.ref).problems == []
    # A packed checkpoint of the same job on top of it reuses its chunks where they are the same.
    again = new.upload_tree(source, "solver")
    assert again.schema_version == 2 and again.stats.uploaded_chunks < again.stats.distinct_chunks


def test_a_pack_too_big_for_one_put_is_looked_up_and_sent_in_parts(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path
) -> None:
    mib = 1024 * 1024
    store = make_store(
        chunk_size=6 * mib, pack_below=6 * mib, multipart_threshold=5 * mib, compression_level=0
    )
    tree = tree_factory({f"pages-{n}.img": os.urandom(2 * mib - n) for n in range(3)})
    requests = helpers.Requests(store.client)
    manifest = store.upload_tree(tree, "big")
    (cid,) = manifest.chunk_sizes()
    key = store.context.layout.chunk_key(cid)
    assert requests.named("HeadObject") == [key] and requests.named("CreateMultipartUpload") == [key]
    store.restore(manifest.ref, tmp_path / "out")
    helpers.assert_same_tree(tree, tmp_path / "out")
