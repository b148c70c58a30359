"""The follower (ibckpt/store/follow.py) against the real SeaweedFS: it uploads the whole chunks of a file
while another thread appends to it, and the upload after it skips them and writes the same manifest a
plain upload writes, hashing none of them again; what changed after the follower read it (its CRC32
differs), or what it failed to store, is hashed and uploaded by the pass as usual; it stops when told or
when its time is up, leaving no thread."""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretBytes
from store.conftest import Requests, StoreFactory, compressible, config_for

from ibckpt.store import CheckpointRef, EncryptionConfig, ImageStore, Manifest, RetentionPolicy
from ibckpt.store import upload as upload_module
from ibckpt.store.errors import ChunkMissingError
from ibckpt.store.follow import GIVE_UP_AFTER, Follower, FollowStats
from testbed.gate import Gate
from testbed.s3 import S3Server

pytestmark = pytest.mark.s3

CHUNK = 256 * 1024  # config_for's chunk size


def pages(chunks: int, tail: int = 0) -> bytes:
    """Incompressible and compressible chunks in turn (so that both of the codec's outcomes are
    checked), then a tail shorter than a chunk (which goes into a pack)."""
    parts = [os.urandom(CHUNK) if i % 2 == 0 else compressible(CHUNK, seed=i) for i in range(chunks)]
    return b"".join(parts) + os.urandom(tail)


def append_slowly(path: Path, data: bytes, pause: float = 0.05, piece: int = 96 * 1024) -> None:
    """As CRIU writes a pages file: front to back, in writes that do not line up with chunks."""
    with path.open("wb") as file:
        for offset in range(0, len(data), piece):
            file.write(data[offset : offset + piece])
            file.flush()
            time.sleep(pause * piece / CHUNK)


def wait_until(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def follower_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ibckpt-follow")]


def upload(
    store: ImageStore, root: Path, checkpoint: str = "c1", followed: FollowStats | None = None
) -> Manifest:
    with store.writer("ns/solver", checkpoint, followed=followed.spans if followed else None) as writer:
        writer.add_tree(root)
        return writer.commit()


class Sha256Count:
    """hashlib for upload.py, counting the SHA-256 passes its writer makes."""

    def __init__(self) -> None:
        self.calls = 0

    def sha256(self, data: bytes | memoryview) -> Any:
        self.calls += 1
        return hashlib.sha256(data)


def chunk_lists(manifest: Manifest) -> dict[str, list[tuple[str, int, int, int]]]:
    return {
        record.path: [(c.id, c.size, c.stored_size, c.offset) for c in record.chunks]
        for record in manifest.files
    }


def fresh_bucket(s3_server: S3Server) -> str:
    name = "follow-" + secrets.token_hex(6)
    s3_server.client().create_bucket(Bucket=name)
    return name


@pytest.mark.parametrize("encryption", ["none", "client"])
def test_the_pass_after_the_follower_skips_its_chunks_and_writes_the_same_manifest(
    encryption: str,
    make_store: StoreFactory,
    s3_server: S3Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # big chunks are looked up before they are PUT, as with the defaults (8 MiB chunks, 1 MiB)
    settings: dict[str, object] = {"blind_put_below": CHUNK // 2}
    if encryption == "client":
        settings["encryption"] = EncryptionConfig(mode="client", client_key=SecretBytes(os.urandom(32)))
    followed = make_store(**settings)
    plain = make_store(bucket=fresh_bucket(s3_server), **settings)
    data = pages(12, tail=100_000)
    root = tmp_path / "dump"
    root.mkdir()
    (root / "core-1.img").write_bytes(b"core" * 1000)  # a small file: packed with the tail
    with followed.follow(root, "ns/solver") as follower:
        append_slowly(root / "pages-1.img", data)
        during = follower.stats.stored_chunks  # before the "dump" ended
        wait_until(lambda: follower.stats.stored_chunks == 12)
    assert during >= 1, "nothing was uploaded while the file grew"
    assert not follower_threads()
    warm_requests, cold_requests = Requests(followed.client), Requests(plain.client)
    assert len(follower.stats.spans) == 12, follower.stats.spans
    hashed = Sha256Count()
    monkeypatch.setattr(upload_module, "hashlib", hashed)
    warm = upload(followed, root, followed=follower.stats)
    assert hashed.calls == 1  # only the pack: the 12 spans matched the follower's CRC32s
    cold = upload(plain, root)

    assert chunk_lists(warm) == chunk_lists(cold)
    assert (warm.stats.distinct_chunks, cold.stats.uploaded_chunks) == (13, 13)  # 12 + one pack
    assert warm.stats.uploaded_chunks == 1  # only the pack: the follower's 12 were found stored
    puts = [len(sent.named("PutObject", "chunks")) for sent in (warm_requests, cold_requests)]
    assert puts == [1, 13]  # the requests, not only the stats
    assert warm.stats.stored_bytes == cold.stats.stored_bytes
    back = tmp_path / "back"
    followed.restore(CheckpointRef("ns/solver", "c1"), back)
    assert (back / "pages-1.img").read_bytes() == data
    assert (back / "core-1.img").read_bytes() == b"core" * 1000


def test_a_file_renamed_after_the_follower_read_it_keeps_its_spans(
    make_store: StoreFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a pre-dump that the dump takes in as its `parent`: the follower read it under one path, and
    neither it nor the upload hashes it again under the new one."""
    store = make_store()
    data = pages(6)
    root = tmp_path / "images"
    first = root / ".pre-dumps" / "pod.main" / "round-1"
    first.mkdir(parents=True)
    with store.follow(root, "ns/solver", timeout=60) as follower:
        append_slowly(first / "pages-1.img", data, pause=0.0)
        wait_until(lambda: follower.stats.stored_chunks == 6)
        (root / "pod.main").mkdir()
        first.rename(root / "pod.main" / "parent")
        time.sleep(1.0)  # scans of the tree under its new names
    assert follower.stats.present_chunks == 0, follower.stats  # not read again under the new path
    hashed = Sha256Count()
    monkeypatch.setattr(upload_module, "hashlib", hashed)
    with store.writer("ns/solver", "c1", followed=follower.stats.spans) as writer:
        writer.add_tree(root / "pod.main")
        manifest = writer.commit()
    assert hashed.calls == 0 and manifest.stats.uploaded_chunks == 0  # the follower's ids, taken
    back = tmp_path / "back"
    store.restore(CheckpointRef("ns/solver", "c1"), back)
    assert (back / "parent" / "pages-1.img").read_bytes() == data


def test_a_span_rewritten_after_the_follower_read_it_is_restored_as_it_is_now(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    store = make_store()
    data = pages(4)
    root = tmp_path / "dump"
    root.mkdir()
    path = root / "pages-1.img"
    with store.follow(root, "ns/solver") as follower:
        append_slowly(path, data, pause=0.01)
        wait_until(lambda: follower.stats.stored_chunks == 4)
        newer = os.urandom(CHUNK)
        with path.open("r+b") as file:  # chunk 1 changes once the follower has stored it
            file.seek(CHUNK)
            file.write(newer)
    manifest = upload(store, root, followed=follower.stats)  # its CRC32 differs now: hashed again
    assert manifest.stats.uploaded_chunks == 1  # the rewritten span, under its new id
    back = tmp_path / "back"
    store.restore(CheckpointRef("ns/solver", "c1"), back)
    assert (back / "pages-1.img").read_bytes() == data[:CHUNK] + newer + data[2 * CHUNK :]


def test_a_follower_whose_s3_fails_does_not_fail_the_checkpoint(
    make_store: StoreFactory, s3_server: S3Server, s3_gate: Gate, bucket: str, tmp_path: Path
) -> None:
    store = make_store()
    # the same bucket through a relay that resets every connection
    gated = ImageStore(config_for(s3_server, bucket=bucket, endpoint_url=f"http://127.0.0.1:{s3_gate.port}"))
    data = pages(10)
    root = tmp_path / "dump"
    root.mkdir()
    s3_gate.cut()
    try:
        follower = gated.follow(root, "ns/solver").start()
        append_slowly(root / "pages-1.img", data, pause=0.01)
        wait_until(lambda: follower.stats.gave_up)
        started = time.monotonic()
        stats = follower.stop()
        assert time.monotonic() - started < 10
    finally:
        s3_gate.mend()
    assert not follower_threads()
    # it gave up after a few failures in a row, not after trying every span
    assert (stats.stored_chunks, stats.gave_up) == (0, True)
    assert GIVE_UP_AFTER <= stats.failed_chunks < 10
    manifest = upload(store, root)
    assert manifest.stats.uploaded_chunks == 10
    back = tmp_path / "back"
    store.restore(CheckpointRef("ns/solver", "c1"), back)
    assert (back / "pages-1.img").read_bytes() == data


def test_the_follower_stops_when_told_and_when_its_time_is_up(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    store = make_store()
    root = tmp_path / "dump"
    root.mkdir()
    path = root / "pages-1.img"
    follower = store.follow(root, "ns/solver").start()
    assert follower.running and follower_threads()
    writer = threading.Thread(target=append_slowly, args=(path, pages(8)))
    writer.start()
    wait_until(lambda: follower.stats.stored_chunks >= 1)
    follower.stop()  # the dump is still writing
    assert not follower.running and not follower_threads()
    stored = follower.stats.stored_chunks
    writer.join()
    time.sleep(0.3)
    assert follower.stats.stored_chunks == stored  # nothing after stop()
    follower.stop()  # twice is fine

    timed = Follower(store.context, tmp_path / "not-yet", timeout=0.3).start()
    wait_until(lambda: not timed.running, timeout=5)
    assert timed.stats.timed_out and not follower_threads()
    timed.stop()


def test_the_follower_keeps_to_the_rate_limit_and_a_stop_cuts_its_wait_short(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    store = make_store(max_rate=CHUNK)  # a chunk a second, after a burst of one
    root = tmp_path / "dump"
    root.mkdir()
    (root / "pages-1.img").write_bytes(pages(24))  # all there at once: only the limit holds it back
    follower = store.follow(root).start()
    wait_until(lambda: follower.stats.stored_chunks >= 1)
    time.sleep(1.0)
    # at most the burst, one a second since and the workers' in flight; unlimited, all 24 go in ~1 s
    assert follower.stats.stored_chunks <= 1 + 2 + 4
    started = time.monotonic()
    follower.stop()  # four workers wait their turn, about 4 s for the last: not for stop()
    assert time.monotonic() - started < 1.5
    assert not follower_threads()


def allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_released_spans_leave_the_disk_under_a_lease_and_the_upload_takes_them_from_the_bucket(
    make_store: StoreFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk window: each page span the bucket has is punched out of the file (which keeps its
    size), only page files are, no sweep runs while the bytes are only in the bucket, and the upload
    neither reads nor uploads them again: the checkpoint restores the bytes as they were written."""
    store = make_store(blind_put_below=CHUNK // 2)
    data, other = pages(12, tail=100_000), os.urandom(4 * CHUNK)
    root = tmp_path / "dump"
    root.mkdir()
    (root / "core-1.img").write_bytes(b"core" * 1000)
    (root / "other.img").write_bytes(other)  # big, but not a page file: stays whole
    path = root / "pages-1.img"
    with store.follow(root, "ns/solver", release_for="c1") as follower:
        append_slowly(path, data)
        wait_until(lambda: follower.stats.stored_chunks == 16)
        wait_until(lambda: follower.stats.released_bytes == 12 * CHUNK)
    stats = follower.stats
    assert path.stat().st_size == len(data)
    assert allocated(path) <= CHUNK, allocated(path)  # the tail, not yet in a chunk, stays
    assert allocated(root / "other.img") >= len(other)
    assert path.read_bytes()[: 12 * CHUNK] == bytes(12 * CHUNK)  # holes
    assert sum(span.released for span in stats.spans.values()) == 12
    assert stats.lease is not None
    swept = store.gc(RetentionPolicy(), grace=timedelta(0))  # would delete every chunk: none is in a manifest
    assert swept.deferred_by and "writer" in swept.skipped_reason, swept

    hashed = Sha256Count()
    monkeypatch.setattr(upload_module, "hashlib", hashed)
    manifest = upload(store, root, followed=stats)
    stats.end_lease()
    assert hashed.calls == 1  # the pack only: other.img matched its CRC32s, the pages were not read
    assert manifest.stats.uploaded_chunks == 1
    back = tmp_path / "back"
    store.restore(CheckpointRef("ns/solver", "c1"), back)
    assert (back / "pages-1.img").read_bytes() == data
    assert (back / "other.img").read_bytes() == other


def test_a_released_span_gone_from_the_bucket_fails_the_upload_and_nothing_is_listed(
    make_store: StoreFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    store = make_store()
    root = tmp_path / "dump"
    root.mkdir()
    with store.follow(root, "ns/solver", release_for="c1") as follower:
        append_slowly(root / "pages-1.img", pages(3), pause=0.0)
        wait_until(lambda: follower.stats.released_bytes == 3 * CHUNK)
    gone = next(span.chunk_id for span in follower.stats.spans.values())
    s3_server.client().delete_object(Bucket=bucket, Key=store.context.layout.chunk_key(gone))
    with pytest.raises(ChunkMissingError, match="released from the node's disk, is no longer in the bucket"):
        upload(store, root, followed=follower.stats)  # never a chunk of zeros in its place
    follower.stats.end_lease()
    assert store.checkpoints("ns/solver") == []
