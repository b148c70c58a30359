"""Signed manifests on the real S3 server: whoever holds a prefix's S3 keys can write manifests, parts and
chunks there, but a store with the image key set restores only what was signed with it, for the place it is
read from, and refuses anything else before a file is written."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest
from store.conftest import StoreFactory, write_tree

from ibckpt.store import ImageStore, ManifestKeys, ManifestSignatureError, load_keys
from ibckpt.store.errors import ChunkCorruptError, ConfigError, StoreError
from ibckpt.store.layout import CheckpointRef
from ibckpt.store.manifest import SCHEMA_VERSION, parse_manifest

JOB = "team-a/solver"


def key_set(*ids: str) -> ManifestKeys:
    return ManifestKeys({key_id: secrets.token_bytes(32) for key_id in ids})


def tree(root: Path, seed: int = 0) -> Path:
    return write_tree(
        root,
        {
            "rank0/pages-1.img": secrets.token_bytes(700 * 1024),
            "rank0/inventory.img": f"inventory {seed}".encode(),
            "rank0/sub/core.img": secrets.token_bytes(300 * 1024),
        },
    )


def empty_destination(tmp_path: Path) -> Path:
    where = tmp_path / "restore"
    where.mkdir()
    (where / "dest").mkdir()
    return where / "dest"


def nothing_written(destination: Path) -> None:
    # The destination is still empty and no partial tree is left beside it.
    assert list(destination.iterdir()) == []
    assert list(destination.parent.iterdir()) == [destination]


def raw_object(store: ImageStore, key: str) -> bytes:
    body: bytes = store.client.get_object(Bucket=store.config.bucket, Key=key)["Body"].read()
    return body


def put_object(store: ImageStore, key: str, body: bytes) -> None:
    store.client.put_object(Bucket=store.config.bucket, Key=key, Body=body)


def test_a_signed_checkpoint_restores_and_its_signature_names_the_key(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    keys = key_set("k1")
    store = make_store()
    signing = ImageStore(store.config, store.connection, signing=keys)
    manifest = signing.upload_tree(tree(tmp_path / "src"), JOB, "c1")
    assert manifest.schema_version == SCHEMA_VERSION
    assert manifest.signature is not None and manifest.signature.key_id == "k1"
    stored = raw_object(store, store.context.layout.manifest_key(manifest.ref))
    assert parse_manifest(
        stored, "here", keys=keys, object_key=store.context.layout.manifest_key(manifest.ref)
    )
    destination = empty_destination(tmp_path)
    signing.restore(manifest.ref, destination)
    assert (destination / "rank0/sub/core.img").read_bytes() == (
        tmp_path / "src/rank0/sub/core.img"
    ).read_bytes()


def test_an_unsigned_manifest_is_refused_before_anything_is_written(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    tenant = make_store()  # holds the S3 keys, not the image keys
    manifest = tenant.upload_tree(tree(tmp_path / "src"), JOB, "forged")
    assert manifest.signature is None
    agent = ImageStore(tenant.config, signing=key_set("k1"))
    destination = empty_destination(tmp_path)
    with pytest.raises(ManifestSignatureError, match=r"team-a/solver/forged .* is not signed: refused"):
        agent.restore(manifest.ref, destination)
    nothing_written(destination)
    with pytest.raises(ManifestSignatureError, match="not signed"):
        agent.manifest(manifest.ref)


def test_a_manifest_signed_with_a_key_not_in_the_set_is_refused(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    config = make_store().config
    elsewhere = ImageStore(config, signing=key_set("k9"))  # another cluster's key, or a made-up one
    manifest = elsewhere.upload_tree(tree(tmp_path / "src"), JOB, "c1")
    agent = ImageStore(config, signing=key_set("k1", "k2"))
    destination = empty_destination(tmp_path)
    with pytest.raises(
        ManifestSignatureError, match=r"signed with key 'k9', which is not in the image key set"
    ):
        agent.restore(manifest.ref, destination)
    nothing_written(destination)


@pytest.mark.parametrize("edit", ["setuid", "label", "chunk", "signature-dropped-to-schema-2"])
def test_a_manifest_edited_after_signing_is_refused(
    make_store: StoreFactory, tmp_path: Path, edit: str
) -> None:
    keys = key_set("k1")
    store = ImageStore(make_store().config, signing=keys)
    manifest = store.upload_tree(tree(tmp_path / "src"), JOB, "c1")
    key = store.context.layout.manifest_key(manifest.ref)
    raw = json.loads(raw_object(store, key))
    if edit == "setuid":
        raw["files"][-1]["mode"] = 0o6755
    elif edit == "label":
        raw["labels"] = {"tampered": "yes"}
    elif edit == "chunk":  # points a file at another chunk id
        raw["files"][-1]["chunks"][0]["id"] = "ab" * 32
    else:
        del raw["signature"]
        raw["schema_version"] = 2
    put_object(store, key, json.dumps(raw, indent=1).encode())
    destination = empty_destination(tmp_path)
    with pytest.raises(ManifestSignatureError, match=r"does not match its signature|is not signed"):
        store.restore(manifest.ref, destination)
    nothing_written(destination)


@pytest.mark.parametrize(
    "target", ["team-a/solver/c2", "team-a/other/c1", "team-b/solver/c1", "prefix:team-b"]
)
def test_a_signed_manifest_copied_elsewhere_does_not_verify(
    make_store: StoreFactory, tmp_path: Path, target: str
) -> None:
    """A genuine manifest copied to another checkpoint, job, namespace or prefix (where its chunks may be
    uploaded too) is refused there: its object key is inside the signature."""
    keys = key_set("k1")
    config = make_store().config
    store = ImageStore(config, signing=keys)
    manifest = store.upload_tree(tree(tmp_path / "src"), JOB, "c1")
    body = raw_object(store, store.context.layout.manifest_key(manifest.ref))
    if target.startswith("prefix:"):
        reader = ImageStore(config.with_overrides(prefix=target.removeprefix("prefix:")), signing=keys)
        ref = manifest.ref
        reader.upload_tree(tmp_path / "src", JOB, "c0")  # the same chunks exist under that prefix
    else:
        reader = store
        job, _, checkpoint = target.rpartition("/")
        ref = CheckpointRef(job, checkpoint)
    put_object(reader, reader.context.layout.manifest_key(ref), body)
    destination = empty_destination(tmp_path)
    with pytest.raises(ManifestSignatureError, match="copied from another checkpoint"):
        reader.restore(ref, destination)
    nothing_written(destination)


def test_a_chunk_spliced_from_another_checkpoint_is_refused_and_nothing_is_left(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    """The signed manifest names each chunk by its hash: bytes of another checkpoint's chunk put under one
    of this checkpoint's chunk keys fail the hash before they are written, and the restore leaves nothing."""
    keys = key_set("k1")
    store = ImageStore(make_store().config, signing=keys)
    mine = store.upload_tree(tree(tmp_path / "mine", 1), JOB, "c1")
    theirs = store.upload_tree(tree(tmp_path / "theirs", 2), "team-b/solver", "c1")
    layout = store.context.layout
    victim = mine.files[-1].chunks[0].id
    donor = next(chunk.id for chunk in theirs.chunk_refs() if chunk.id not in mine.chunk_sizes())
    put_object(store, layout.chunk_key(victim), raw_object(store, layout.chunk_key(donor)))
    destination = empty_destination(tmp_path)
    with pytest.raises(ChunkCorruptError, match=rf"chunk {victim} of checkpoint team-a/solver/c1 is corrupt"):
        store.restore(mine.ref, destination)
    nothing_written(destination)


def test_a_forged_part_is_refused_at_the_commit(make_store: StoreFactory, tmp_path: Path) -> None:
    """Parts are signed by the agents that stage them; the committer (the operator) merges only verified
    parts, so a part the tenant slips in never becomes part of a signed manifest."""
    keys = key_set("k1")
    config = make_store().config
    agent = ImageStore(config, signing=keys)
    with agent.writer(JOB, "c1") as writer:
        writer.add_tree(tree(tmp_path / "a"), under="node-1")
        writer.stage("node-1")
    with ImageStore(config).writer(JOB, "c1") as tenant:  # no image key: an unsigned part
        tenant.add_tree(tree(tmp_path / "b"), under="node-2")
        tenant.stage("node-2")
    with pytest.raises(ManifestSignatureError, match=r"parts/team-a/solver/c1/node-2.json is not signed"):
        agent.commit_parts(JOB, "c1", ["node-1", "node-2"])
    with pytest.raises(StoreError, match="does not exist"):
        agent.manifest(CheckpointRef(JOB, "c1"))


def test_rotation_the_newest_key_signs_and_every_key_in_the_set_verifies(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    old = key_set("2026-01-01")
    config = make_store().config
    before = ImageStore(config, signing=old).upload_tree(tree(tmp_path / "src"), JOB, "before")
    rotated = ManifestKeys({**old.keys, "2026-12-01": secrets.token_bytes(32)})
    store = ImageStore(config, signing=rotated)
    store.restore(before.ref, empty_destination(tmp_path))  # signed with the old key: still verifies
    after = store.upload_tree(tmp_path / "src", JOB, "after")
    assert after.signature is not None and after.signature.key_id == "2026-12-01"
    # Once the old key is removed from the set, what it alone signed no longer restores.
    retired = ImageStore(config, signing=ManifestKeys({"2026-12-01": rotated.keys["2026-12-01"]}))
    assert retired.manifest(after.ref).signature == after.signature
    with pytest.raises(ManifestSignatureError, match="'2026-01-01', which is not in the image key set"):
        retired.manifest(before.ref)


def test_the_key_set_is_read_from_a_mounted_secret_and_never_shown(tmp_path: Path) -> None:
    mounted = tmp_path / "image-keys"
    data = mounted / "..2026_11_30_data"  # how the kubelet lays a Secret volume out
    data.mkdir(parents=True)
    secret = secrets.token_bytes(48)
    (data / "2026-11-30").write_bytes(secret)
    (mounted / "2026-11-30").symlink_to(data / "2026-11-30")
    (mounted / "..data").symlink_to(data)
    keys = load_keys(mounted)
    assert dict(keys.keys) == {"2026-11-30": secret} and keys.signing_id == "2026-11-30"
    assert secret.hex() not in repr(keys) and "2026-11-30" in repr(keys)
    with pytest.raises(ConfigError, match=r"no image signing keys in .*empty"):
        (tmp_path / "empty").mkdir()
        load_keys(tmp_path / "empty")
    with pytest.raises(ConfigError, match="cannot read"):
        load_keys(tmp_path / "absent")
    with pytest.raises(ConfigError, match="at least 32"):
        ManifestKeys({"short": b"x" * 31})
    with pytest.raises(ConfigError, match="is not a name"):
        ManifestKeys({"../k": b"x" * 32})


def test_the_cli_signs_with_a_key_file_and_says_when_a_manifest_is_unsigned_or_does_not_verify(
    s3_env: dict[str, str], tree_factory: Any, tmp_path: Path, ibckpt: Any
) -> None:
    tree = tree_factory({"pages-1.img": secrets.token_bytes(5000)})
    keys = tmp_path / "image-keys"
    keys.mkdir()
    (keys / "2026-11-30").write_bytes(secrets.token_bytes(32))
    ibckpt(s3_env, "upload", str(tree), "--job", "ns/solver", "--id", "unsigned")
    ibckpt(s3_env, "upload", str(tree), "--job", "ns/solver", "--id", "signed", "--image-keys", str(keys))
    with_keys = s3_env | {"IBCKPT_IMAGE_KEYS": str(keys)}  # the variable works as the flag does

    assert (
        "signature    none: the agents refuse to restore"
        in ibckpt(s3_env, "show", "ns/solver/unsigned").stdout
    )
    shown = ibckpt(s3_env, "show", "ns/solver/signed").stdout
    assert "signature    key 2026-11-30, not verified (give --image-keys to check it)" in shown
    assert "signature    verified (key 2026-11-30)" in ibckpt(with_keys, "show", "ns/solver/signed").stdout

    refused = ibckpt(with_keys, "download", "ns/solver/unsigned", str(tmp_path / "out"), check=False)
    assert refused.returncode == 1 and "manifest ns/solver/unsigned" in refused.stderr
    assert "is not signed: refused" in refused.stderr and not (tmp_path / "out").exists()
    done = ibckpt(with_keys, "download", "ns/solver/signed", str(tmp_path / "back")).stdout
    assert "signature: verified (key 2026-11-30)" in done

    # An admin signs a checkpoint from before manifests were signed: it then restores.
    assert (
        "signed ns/solver/unsigned with key 2026-11-30"
        in ibckpt(with_keys, "sign", "ns/solver/unsigned").stdout
    )
    ibckpt(with_keys, "download", "ns/solver/unsigned", str(tmp_path / "out"))
    no_keys = ibckpt(s3_env, "sign", "ns/solver/signed", check=False)
    assert no_keys.returncode == 2 and "needs the image key set" in no_keys.stderr

    missing = ibckpt(s3_env, "show", "ns/solver/signed", "--image-keys", str(tmp_path / "nope"), check=False)
    assert missing.returncode == 2 and "no image signing keys: cannot read" in missing.stderr
