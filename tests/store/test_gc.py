"""Garbage collection on the real server: retention keeps exactly the right checkpoints, the sweep deletes
only chunks no kept manifest uses, and it stays out of the way of a checkpoint being written."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ibckpt.store import ImageStore, ManifestKeys, RetentionPolicy
from ibckpt.store.leases import Lease

pytestmark = pytest.mark.s3

NO_GRACE = timedelta(0)


def referenced(store: Any) -> set[str]:
    chunks: set[str] = set()
    for entry in store.checkpoints():
        chunks |= set(store.manifest(entry.ref).chunk_sizes())
    return chunks


def stored_chunk_ids(list_chunks: Any) -> set[str]:
    return {key.rpartition("/")[2] for key in list_chunks()}


def assert_all_kept_checkpoints_verify(store: Any) -> None:
    for entry in store.checkpoints():
        assert store.verify(entry.ref).problems == [], entry.ref


def test_keep_last_per_job(make_store: Any, tree_factory: Any, list_chunks: Any) -> None:
    store = make_store()
    shared = os.urandom(200_000)
    solver = [
        store.upload_tree(tree_factory({"shared.img": shared, "own.img": os.urandom(50_000)}), "solver")
        for _ in range(4)
    ]
    viz = [store.upload_tree(tree_factory({"v.img": os.urandom(1000)}), "viz") for _ in range(2)]

    chunks_before = stored_chunk_ids(list_chunks)
    dry = store.gc(RetentionPolicy(keep_last=2), grace=NO_GRACE, dry_run=True)
    assert set(dry.deleted_checkpoints) == {solver[0].ref, solver[1].ref}
    assert dry.chunks_deleted == 2, "a dry run reports the chunks that the real run will delete"
    assert len(store.checkpoints()) == 6 and stored_chunk_ids(list_chunks) == chunks_before

    report = store.gc(RetentionPolicy(keep_last=2), grace=NO_GRACE)
    assert set(report.deleted_checkpoints) == {solver[0].ref, solver[1].ref}
    assert {entry.ref for entry in store.checkpoints()} == {
        solver[2].ref,
        solver[3].ref,
        viz[0].ref,
        viz[1].ref,
    }
    assert report.swept
    # Exactly the chunks the kept manifests use remain: the two dropped "own" chunks went, "shared" stayed.
    assert stored_chunk_ids(list_chunks) == referenced(store)
    assert report.chunks_deleted == 2
    assert_all_kept_checkpoints_verify(store)


def test_max_size_counts_shared_chunks_once(make_store: Any, tree_factory: Any) -> None:
    store = make_store()
    shared = os.urandom(100_000)
    made = [
        store.upload_tree(tree_factory({"shared.img": shared, "own.img": os.urandom(100_000)}), "solver")
        for _ in range(3)
    ]
    stored = made[0].stats.stored_bytes  # shared + own, ~200 kB
    own = next(record for record in made[0].files if record.path == "own.img").chunks[0].stored_size
    # Room for the newest (shared + own) and one more "own", not two more.
    report = store.gc(RetentionPolicy(max_bytes=stored + own + own // 2), grace=NO_GRACE)
    assert set(report.deleted_checkpoints) == {made[0].ref}
    assert {entry.ref for entry in store.checkpoints()} == {made[1].ref, made[2].ref}
    assert_all_kept_checkpoints_verify(store)


def test_max_age_with_min_keep(make_store: Any, tree_factory: Any) -> None:
    store = make_store()
    old = [store.upload_tree(tree_factory({"a.img": os.urandom(1000)}), "solver") for _ in range(2)]
    time.sleep(3.0)
    new = store.upload_tree(tree_factory({"a.img": os.urandom(1000)}), "solver")
    report = store.gc(RetentionPolicy(max_age=timedelta(seconds=2.0)), grace=NO_GRACE)
    assert set(report.deleted_checkpoints) == {old[0].ref, old[1].ref}
    # Every checkpoint is older than the limit now, but min_keep keeps the newest one.
    time.sleep(1.0)
    report = store.gc(RetentionPolicy(max_age=timedelta(seconds=0.5)), grace=NO_GRACE)
    assert report.deleted_checkpoints == []
    assert [entry.ref for entry in store.checkpoints()] == [new.ref]
    report = store.gc(RetentionPolicy(max_age=timedelta(seconds=0.5), min_keep=0), grace=NO_GRACE)
    assert report.deleted_checkpoints == [new.ref] and store.checkpoints() == []


def test_grace_period_spares_young_orphans(make_store: Any, tree_factory: Any, list_chunks: Any) -> None:
    store = make_store()
    manifest = store.upload_tree(tree_factory({"a.img": os.urandom(1000)}), "solver")
    store.delete(manifest.ref)
    report = store.gc(RetentionPolicy(), grace=timedelta(hours=1))
    assert report.chunks_in_grace == 1 and report.chunks_deleted == 0 and len(list_chunks()) == 1
    report = store.gc(RetentionPolicy(), grace=NO_GRACE)
    assert report.chunks_deleted == 1 and list_chunks() == []


def test_sweep_waits_for_a_checkpoint_being_written(
    make_store: Any, tree_factory: Any, list_chunks: Any, tmp_path: Path
) -> None:
    store = make_store(lease_seconds=30)
    reused = os.urandom(200_000)
    first = store.upload_tree(tree_factory({"reused.img": reused, "gone.img": os.urandom(10_000)}), "solver")
    store.delete(first.ref)  # its chunks are now unreferenced, and older than a zero grace period

    writer = store.writer("solver")
    with writer:
        # The writer finds "reused" already in the bucket and does not send it again...
        records = writer.add_tree(tree_factory({"reused.img": reused, "new.img": os.urandom(10_000)}))
        reused_ids = {
            chunk.id for record in records if record.path == "reused.img" for chunk in record.chunks
        }
        assert reused_ids <= stored_chunk_ids(list_chunks)

        # ...so a sweep now must not delete it: it sees the writer's lease and defers.
        report = store.gc(RetentionPolicy(keep_last=1), grace=NO_GRACE)
        assert not report.swept and report.deferred_by and "writer solver/" in report.deferred_by[0]
        assert reused_ids <= stored_chunk_ids(list_chunks)
        second = writer.commit()

    assert second.stats.uploaded_chunks == 1  # only new.img
    report = store.gc(RetentionPolicy(keep_last=1), grace=NO_GRACE)
    assert report.swept and report.chunks_deleted == 1  # gone.img, used by no manifest
    assert stored_chunk_ids(list_chunks) == referenced(store)
    store.restore(second.ref, tmp_path / "out")
    assert (tmp_path / "out" / "reused.img").read_bytes() == reused


def test_writer_waits_for_a_running_sweep(make_store: Any, tree_factory: Any) -> None:
    store = make_store()
    layout, connection = store.context.layout, store.connection
    sweep = Lease(connection, layout.sweep_key("sweep-held-by-test"), "sweep", lease_seconds=5.0).acquire()
    began = threading.Event()
    writer = store.writer("solver")

    def begin() -> None:
        writer.begin()
        began.set()

    thread = threading.Thread(target=begin)
    thread.start()
    try:
        assert not began.wait(1.5), "the writer must not start while a sweep is live"
    finally:
        sweep.release()
    assert began.wait(10)
    thread.join()
    writer.add_tree(tree_factory({"a.img": b"after the sweep"}))
    writer.commit()
    writer.close()
    assert len(store.checkpoints("solver")) == 1


def test_unreadable_manifest_blocks_the_sweep(make_store: Any, tree_factory: Any, list_chunks: Any) -> None:
    store = make_store()
    manifest = store.upload_tree(tree_factory({"a.img": os.urandom(1000)}), "solver")
    key = store.context.layout.manifest_key(manifest.ref)
    store.client.put_object(Bucket=store.config.bucket, Key=key, Body=b'{"schema_version": 99}')
    report = store.gc(RetentionPolicy(keep_last=1), grace=NO_GRACE)
    assert not report.swept and "unreadable manifests" in (report.skipped_reason or "")
    assert len(list_chunks()) == 1


def test_an_unsigned_manifest_keeps_its_chunks_without_stopping_a_signing_stores_sweep(
    make_store: Any, tree_factory: Any, list_chunks: Any
) -> None:
    """With the image key set, an unsigned manifest (the tenant's) is not restored from, but it is still
    read for its chunks: it keeps them, and it cannot block the sweep of the prefix it shares."""
    plain = make_store()
    forged = plain.upload_tree(tree_factory({"a.img": os.urandom(1000)}), "team-a/solver", "forged")
    signing = ImageStore(plain.config, signing=ManifestKeys({"k1": os.urandom(32)}))
    orphan = signing.upload_tree(tree_factory({"b.img": os.urandom(1000)}), "team-b/solver", "gone")
    signing.delete(orphan.ref)
    report = signing.gc(RetentionPolicy(), grace=NO_GRACE)
    assert report.swept and report.chunks_deleted == 1, report
    assert stored_chunk_ids(list_chunks) == set(forged.chunk_sizes())


def test_listings_follow_every_page_without_botocore_paginators(s3_server: Any, bucket: str) -> None:
    """s3.pages, on the real server, a few keys per page: every object and every multipart upload comes
    back once, in order (sweeps list chunks, leases and stale uploads this way)."""
    from ibckpt.store.s3 import pages

    client = s3_server.client()
    keys = [f"paged/{i:02d}" for i in range(7)]
    for key in keys:
        client.put_object(Bucket=bucket, Key=key, Body=b"x")
    listed = pages(client.list_objects_v2, Bucket=bucket, Prefix="paged/", MaxKeys=3)
    got = [[item["Key"] for item in page.get("Contents", [])] for page in listed]
    assert len(got) == 3 and [key for page in got for key in page] == keys, got
    uploads = {
        client.create_multipart_upload(Bucket=bucket, Key=f"paged/up-{i}")["UploadId"] for i in range(3)
    }
    seen = [
        upload["UploadId"]
        for page in pages(client.list_multipart_uploads, Bucket=bucket, Prefix="paged/up-", MaxUploads=1)
        for upload in page.get("Uploads", [])
    ]
    assert sorted(seen) == sorted(uploads), (seen, uploads)
