"""Upload and restore against the real SeaweedFS server: byte-identical trees, modes, encryption."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretBytes

from ibckpt.store import EncryptionConfig
from ibckpt.store.errors import EncryptionError, StoreError

pytestmark = pytest.mark.s3

CHUNK = 256 * 1024


def mixed_tree(tree_factory: Any, helpers: Any) -> Path:
    """Compressible text, random (incompressible) pages, sizes around chunk boundaries, odd modes."""
    root: Path = tree_factory(
        {
            "pages-1.img": os.urandom(3 * CHUNK + 123),
            "pages-2.img": helpers.compressible(2 * CHUNK + 7, seed=2),
            "exact.img": os.urandom(CHUNK),
            "mixed.img": helpers.compressible(CHUNK // 2, seed=3) + os.urandom(CHUNK) + bytes(CHUNK),
            "core-1.img": b"\x01\x02tiny",
            "empty.img": b"",
            "sub/dir/deep.img": helpers.compressible(5000, seed=4),
        },
        modes={"core-1.img": 0o600, "pages-1.img": 0o640, "sub/dir/deep.img": 0o755},
    )
    (root / "empty-dir").mkdir()
    os.chmod(root / "sub", 0o750)
    os.symlink("pages-1.img", root / "pages.link")
    return root


def test_round_trip_is_byte_identical(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path
) -> None:
    store = make_store()
    source = mixed_tree(tree_factory, helpers)
    manifest = store.upload_tree(source, "team/solver", ranks=[], labels={"purpose": "test"})

    records = {record.path: record for record in manifest.files}
    assert records["pages-1.img"].size == 3 * CHUNK + 123
    assert len(records["pages-1.img"].chunks) == 4
    assert records["empty.img"].chunks == []
    assert records["pages.link"].kind == "symlink"
    # Random pages were stored raw (plus the header), text compressed well.
    random_chunk = records["exact.img"].chunks[0]
    assert random_chunk.size < random_chunk.stored_size < random_chunk.size + 64
    text_chunk = records["pages-2.img"].chunks[0]
    assert text_chunk.stored_size < text_chunk.size / 5
    # The zero-filled tail of mixed.img and any other repeated chunk is stored once.
    assert manifest.stats.distinct_chunks <= manifest.stats.chunks

    restored = tmp_path / "restored"
    report = store.restore(manifest.ref, restored)
    assert report.logical_bytes == manifest.stats.logical_bytes
    helpers.assert_same_tree(source, restored)
    assert not any(path.name.startswith(".restored.partial") for path in tmp_path.iterdir())


def test_latest_and_listing(make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path) -> None:
    store = make_store()
    first = store.upload_tree(tree_factory({"a.img": b"first"}), "solver")
    second = store.upload_tree(tree_factory({"a.img": b"second"}), "solver")
    store.upload_tree(tree_factory({"a.img": b"other job"}), "other")
    assert [entry.ref for entry in store.checkpoints("solver")] == [first.ref, second.ref]
    assert {entry.ref.job for entry in store.checkpoints()} == {"solver", "other"}
    assert store.resolve("solver", "latest") == second.ref
    store.restore(store.resolve("solver", "latest"), tmp_path / "out")
    assert (tmp_path / "out" / "a.img").read_bytes() == b"second"


def test_restore_of_one_subtree(make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path) -> None:
    """A node fetches only its part of a checkpoint (one container's tree), rooted at the destination."""
    store = make_store()
    source = mixed_tree(tree_factory, helpers)
    manifest = store.upload_tree(source, "solver")
    report = store.restore(manifest.ref, tmp_path / "part", subtree="sub")
    assert sorted(str(p.relative_to(tmp_path / "part")) for p in (tmp_path / "part").rglob("*")) == [
        "dir",
        "dir/deep.img",
    ]
    assert (tmp_path / "part" / "dir" / "deep.img").read_bytes() == (source / "sub/dir/deep.img").read_bytes()
    assert report.logical_bytes == 5000
    with pytest.raises(StoreError, match="no files under 'nothing'"):
        store.restore(manifest.ref, tmp_path / "none", subtree="nothing")
    assert not (tmp_path / "none").exists()


def test_restore_refuses_a_non_empty_destination(make_store: Any, tree_factory: Any, tmp_path: Path) -> None:
    store = make_store()
    manifest = store.upload_tree(tree_factory({"a.img": b"x"}), "solver")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep").write_text("mine")
    with pytest.raises(StoreError, match="not an empty directory"):
        store.restore(manifest.ref, busy)
    assert (busy / "keep").read_text() == "mine"


def test_client_side_encryption(
    make_store: Any, tree_factory: Any, s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    key = os.urandom(32)
    store = make_store(encryption=EncryptionConfig(mode="client", client_key=SecretBytes(key)))
    secret_text = b"the solver's private state " * 2000
    manifest = store.upload_tree(tree_factory({"pages.img": secret_text}), "secret-job")
    assert manifest.encryption.mode == "client" and manifest.encryption.key_fingerprint

    # Stored chunks reveal neither the plaintext nor its sha256.
    import hashlib

    s3 = s3_server.client()
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="ibckpt/v1/chunks/")["Contents"]
    for item in listed:
        body = s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
        assert b"private state" not in body
    assert hashlib.sha256(secret_text).hexdigest() not in {item["Key"].rpartition("/")[2] for item in listed}

    store.restore(manifest.ref, tmp_path / "ok")
    assert (tmp_path / "ok" / "pages.img").read_bytes() == secret_text

    wrong = make_store(encryption=EncryptionConfig(mode="client", client_key=SecretBytes(os.urandom(32))))
    with pytest.raises(EncryptionError, match="fingerprint"):
        wrong.restore(manifest.ref, tmp_path / "wrong")
    plain = make_store()
    with pytest.raises(EncryptionError, match="no encryption key is configured"):
        plain.restore(manifest.ref, tmp_path / "plain")


def test_uncompressed_and_large_chunks_with_multipart(
    make_store: Any, tree_factory: Any, tmp_path: Path
) -> None:
    # A chunk larger than the multipart threshold goes up in parts; compression off stores bytes as they are.
    store = make_store(chunk_size=6 * 1024 * 1024, multipart_threshold=5 * 1024 * 1024, compression_level=0)
    data = bytes(range(256)) * (6 * 1024 * 1024 // 256) + b"tail"
    manifest = store.upload_tree(tree_factory({"big.img": data}), "big")
    assert manifest.compression.codec == "none"
    assert [chunk.size for chunk in manifest.files[0].chunks] == [6 * 1024 * 1024, 4]
    head = store.client.head_object(
        Bucket=store.config.bucket, Key=store.context.layout.chunk_key(manifest.files[0].chunks[0].id)
    )
    assert re.search(r"-[0-9]+$", head["ETag"].strip('"')), "expected a multipart object"
    store.restore(manifest.ref, tmp_path / "big")
    assert (tmp_path / "big" / "big.img").read_bytes() == data


def test_server_side_encryption_headers(make_store: Any, tree_factory: Any, tmp_path: Path) -> None:
    store = make_store(encryption=EncryptionConfig(mode="sse-s3"))
    data = os.urandom(300_000)
    manifest = store.upload_tree(tree_factory({"a.img": data}), "sse")
    assert manifest.encryption.mode == "sse-s3"
    layout, bucket = store.context.layout, store.config.bucket
    for key in [layout.chunk_key(manifest.files[0].chunks[0].id), layout.manifest_key(manifest.ref)]:
        assert store.client.head_object(Bucket=bucket, Key=key).get("ServerSideEncryption") == "AES256", key
    store.restore(manifest.ref, tmp_path / "out")
    assert (tmp_path / "out" / "a.img").read_bytes() == data


def test_chunks_carry_the_checksums_that_count_and_no_others(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path
) -> None:
    """A chunk PUT keeps its CRC32 (the one check SeaweedFS makes of a body), has no SigV4 payload hash, and
    is sent from the buffer it was read into; a chunk GET asks for no CRC32 (its id is checked instead); a
    manifest GET still does."""
    store = make_store()
    sent: list[tuple[str, str, dict[str, bytes], object]] = []

    def record(request: Any, **_: Any) -> None:
        sent.append((request.method, request.url, dict(request.headers), request.body))

    store.client.meta.events.register("before-send.s3", record)
    source = tree_factory(
        {"pages.img": os.urandom(2 * CHUNK), "text.img": helpers.compressible(CHUNK, seed=5)}
    )
    manifest = store.upload_tree(source, "solver")
    store.restore(manifest.ref, tmp_path / "out")
    helpers.assert_same_tree(source, tmp_path / "out")

    def of(method: str, area: str) -> list[tuple[dict[str, bytes], object]]:
        return [
            (headers, body) for verb, url, headers, body in sent if verb == method and f"/v1/{area}" in url
        ]

    chunk_puts, chunk_gets = of("PUT", "chunks/"), of("GET", "chunks/")
    assert len(chunk_puts) == 3 and len(chunk_gets) == 3
    assert all("x-amz-checksum-crc32" in headers for headers, _ in chunk_puts)
    # not a second SHA-256 of each body for SigV4, over http too: the chunk id covers it
    signed = [{k.lower(): v for k, v in headers.items()}["x-amz-content-sha256"] for headers, _ in chunk_puts]
    assert signed == [b"UNSIGNED-PAYLOAD"] * 3, signed
    assert sum(isinstance(body, bytearray) for _, body in chunk_puts) == 3
    assert not any("x-amz-checksum-mode" in headers for headers, _ in chunk_gets)
    manifest_gets = of("GET", "manifests/")
    assert manifest_gets and all(headers["x-amz-checksum-mode"] == b"ENABLED" for headers, _ in manifest_gets)


def test_a_chunk_changed_on_the_wire_is_refused(make_store: Any, tree_factory: Any) -> None:
    """SeaweedFS does not check the SigV4 payload hash; the CRC32 is what catches a changed body."""
    store = make_store()

    def flip(request: Any, **_: Any) -> None:
        if request.method == "PUT" and "/v1/chunks/" in request.url:
            body = bytearray(request.body)
            body[-1] ^= 1
            request.body = body

    store.client.meta.events.register("before-send.s3", flip)
    with pytest.raises(StoreError, match="BadDigest"):
        store.upload_tree(tree_factory({"pages.img": os.urandom(CHUNK)}), "solver")


def test_one_worker_reusing_its_buffer_stores_every_chunk_intact(
    make_store: Any, tree_factory: Any, helpers: Any, tmp_path: Path
) -> None:
    """Full-size chunks are read into their thread's one buffer: with one worker, every chunk after the
    first, raw or compressed, reuses the buffer the one before was sent from."""
    store = make_store(workers=1)
    pages = b"".join(
        os.urandom(CHUNK) if index % 2 else helpers.compressible(CHUNK, seed=index) for index in range(6)
    )
    source = tree_factory({"pages.img": pages + os.urandom(100), "other.img": os.urandom(CHUNK)})
    manifest = store.upload_tree(source, "solver")
    assert manifest.stats.uploaded_chunks == manifest.stats.distinct_chunks == 8
    store.restore(manifest.ref, tmp_path / "out")
    helpers.assert_same_tree(source, tmp_path / "out")
