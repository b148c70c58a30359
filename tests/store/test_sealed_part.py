"""A part written to a sink instead of S3 (CheckpointWriter's sink mode, the memory tier's copy made before
the upload): every distinct chunk sealed as the bucket keeps it, the signed part manifest `stage` would
PUT, and a restore from that manifest and those chunks with no S3 at all. The store is opened offline: any
S3 call would raise. The same part staged on the real S3 is compared last."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretBytes, SecretStr

from ibckpt.store import EncryptionConfig, ImageStore, RankInfo, StoreConfig, StoreError
from ibckpt.store.config import Credentials
from ibckpt.store.errors import ManifestSignatureError
from ibckpt.store.layout import CheckpointRef
from ibckpt.store.manifest import MANIFEST_KIND, PART_KIND, parse_manifest
from ibckpt.store.signing import ManifestKeys

CHUNK = 256 * 1024
KEYS = ManifestKeys({"k1": bytes(range(32))})
RANKS = [RankInfo(rank=0, pod="solver-0", node="node-1", root="node-1")]


def offline(**overrides: Any) -> ImageStore:
    fields: dict[str, Any] = {
        "endpoint_url": "http://127.0.0.1:9",  # never dialed: the store has no S3 client
        "bucket": "nowhere",
        "credentials": Credentials(
            access_key_id=SecretStr("x"), secret_access_key=SecretStr("y"), source="the test"
        ),
        "chunk_size": CHUNK,
        "pack_below": 64 * 1024,
        "workers": 4,
    }
    return ImageStore.offline(StoreConfig.model_validate(fields | overrides), signing=KEYS)


def images(tmp_path: Path) -> Path:
    """A dump's shape: a page file of several chunks (two of them the same bytes), small packed files."""
    root = tmp_path / "images"
    root.mkdir()
    same = os.urandom(CHUNK)
    (root / "pages-1.img").write_bytes(same + os.urandom(CHUNK) + same + os.urandom(1000))
    for n in range(12):
        (root / f"fdinfo-{n}.img").write_bytes(os.urandom(100 + 37 * n))
    (root / "empty.img").write_bytes(b"")
    return root


def sink_part(store: ImageStore, root: Path) -> tuple[dict[str, bytes], Any]:
    sunk: dict[str, bytes] = {}
    twice: list[str] = []
    lock = threading.Lock()

    def sink(cid: str, stored: bytes) -> None:
        with lock:
            if cid in sunk:
                twice.append(cid)
            sunk[cid] = stored

    with store.sealer("ns/solver", "c1", sink) as writer:
        writer.add_tree(root, under="node-1")
        sealed = writer.sealed_part("node-1", RANKS)
    assert twice == []  # each distinct chunk once
    return sunk, sealed


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "client-encrypted"])
def test_a_part_sealed_to_a_sink_restores_from_its_chunks_with_no_s3(tmp_path: Path, encrypted: bool) -> None:
    key = EncryptionConfig(mode="client", client_key=SecretBytes(os.urandom(32)))
    store = offline(**({"encryption": key} if encrypted else {}))
    root = images(tmp_path)
    sunk, sealed = sink_part(store, root)

    part = sealed.manifest
    distinct = {c.id: c.stored_size for r in part.files for c in r.chunks}
    assert set(sunk) == set(distinct) and len(distinct) == 3  # the repeated chunk once; a pack
    assert {cid: len(stored) for cid, stored in sunk.items()} == distinct
    assert part.kind == PART_KIND and part.ranks == RANKS
    # what stage() would PUT: signed for the part's key, and these bytes parse back to it
    part_key = store.context.layout.part_key(CheckpointRef("ns/solver", "c1"), "node-1")
    assert sealed.data == part.to_json()
    assert parse_manifest(sealed.data, "the sink", keys=KEYS, object_key=part_key) == part
    with pytest.raises(ManifestSignatureError):  # not for another part's key
        parse_manifest(sealed.data, "the sink", keys=KEYS, object_key=part_key.replace("node-1", "node-2"))

    # the part as the checkpoint's whole manifest (one node), verified as from the bucket, then restored
    ref = CheckpointRef("ns/solver", "c1")
    merged = part.model_copy(update={"kind": MANIFEST_KIND, "signature": None})
    data = merged.signed(KEYS, store.context.layout.manifest_key(ref)).to_json()
    verified = store.manifest_from(ref, data, "the test")
    report = store.restore(
        ref, tmp_path / "back", subtree="node-1", chunk_source=sunk.get, manifest=verified, source_only=True
    )
    assert report.source_chunks == len(distinct)
    for path in root.iterdir():
        assert (tmp_path / "back" / path.name).read_bytes() == path.read_bytes()

    # a chunk the source lacks fails the restore: S3 is not read
    lacking = dict(sunk)
    lacking.pop(next(iter(lacking)))
    with pytest.raises(StoreError, match="not given by the chunk source, and S3 is not read"):
        store.restore(ref, tmp_path / "again", subtree="node-1", chunk_source=lacking.get,
                      manifest=verified, source_only=True)  # fmt: skip
    assert not (tmp_path / "again").exists()


def test_a_manifest_not_signed_for_the_checkpoint_is_refused(tmp_path: Path) -> None:
    store = offline()
    _, sealed = sink_part(store, images(tmp_path))
    ref = CheckpointRef("ns/solver", "c1")
    with pytest.raises(ManifestSignatureError):  # a part is signed for its own key, not the checkpoint's
        store.manifest_from(ref, sealed.data, "a holder")
    unsigned = sealed.manifest.model_copy(update={"kind": MANIFEST_KIND, "signature": None}).to_json()
    with pytest.raises(ManifestSignatureError, match="is not signed"):
        store.manifest_from(ref, unsigned, "a holder")
    forged = ManifestKeys({"k9": os.urandom(32)})
    other = sealed.manifest.model_copy(update={"kind": MANIFEST_KIND, "signature": None})
    with pytest.raises(ManifestSignatureError, match="not in the image key set"):
        store.manifest_from(ref, other.signed(forged, store.context.layout.manifest_key(ref)).to_json(), "x")


def test_an_offline_store_never_reaches_s3(tmp_path: Path) -> None:
    store = offline()
    with pytest.raises(StoreError, match="S3 is not used here"):
        store.manifest(CheckpointRef("ns/solver", "c1"))
    with (
        pytest.raises(StoreError, match="with a sink"),
        store.sealer("ns/solver", "c1", lambda c, b: None) as w,
    ):
        w.stage("node-1")


@pytest.mark.s3
def test_the_sealed_part_is_what_stage_writes_to_s3(make_store: Any, tmp_path: Path) -> None:
    store = make_store(chunk_size=CHUNK, pack_below=64 * 1024)
    store = ImageStore(store.config, store.connection, signing=KEYS)
    root = images(tmp_path)
    with store.writer("ns/solver", "c1") as writer:
        writer.add_tree(root, under="node-1")
        staged = writer.stage("node-1", RANKS)
    sunk, sealed = sink_part(ImageStore.offline(store.config, signing=KEYS), root)
    stored = {c.id: c.stored_size for r in staged.files for c in r.chunks}
    assert {cid: len(b) for cid, b in sunk.items()} == stored
    different = {"timings", "created_at", "started_at", "stats", "signature"}
    assert sealed.manifest.model_dump(exclude=different) == staged.model_dump(exclude=different)
    assert sealed.manifest.stats.model_dump(exclude={"uploaded_chunks", "uploaded_bytes"}) == (
        staged.stats.model_dump(exclude={"uploaded_chunks", "uploaded_bytes"})
    )
