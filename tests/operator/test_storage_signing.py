"""The operator's store (cluster/storage.open_store) with the chart's image key set: the commit merges only
parts the agents signed and signs the manifest; without readable keys the storage is refused by name."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from ibckpt.store import Credentials, ImageStore, ManifestKeys, ManifestSignatureError, StoreConfig
from ibckpt.store.layout import CheckpointRef
from ibckpt_operator import config as settings
from ibckpt_operator.cluster.storage import StorageProblem, open_store
from testbed.s3 import S3Server

KEYS = ManifestKeys({"2026-11-30": secrets.token_bytes(32)})


@pytest.fixture
def store_config(s3_server: S3Server) -> StoreConfig:
    bucket = "opsign-" + secrets.token_hex(6)
    s3_server.client().create_bucket(Bucket=bucket)
    credentials = Credentials(
        access_key_id=SecretStr(s3_server.access_key),
        secret_access_key=SecretStr(s3_server.secret_key),
        source="the test fixture",
    )
    return StoreConfig(
        endpoint_url=s3_server.endpoint,
        region=s3_server.region,
        addressing_style="path",
        bucket=bucket,
        credentials=credentials,
    )


@pytest.fixture
def keys_dir(tmp_path: Path) -> Iterator[Path]:
    """The operator configured with KEYS mounted at the returned directory."""
    mounted = tmp_path / "image-keys"
    mounted.mkdir()
    for key_id, secret in KEYS.keys.items():
        (mounted / key_id).write_bytes(secret)
    before = settings.current()
    settings.configure(before.with_(image_keys=str(mounted)))
    try:
        yield mounted
    finally:
        settings.configure(before)


def stage(store: ImageStore, tree: Path, node: str) -> None:
    (tree / node).mkdir(parents=True)
    (tree / node / "pages-1.img").write_bytes(secrets.token_bytes(5000))
    with store.writer("ns/ring", "c1") as writer:
        writer.add_tree(tree / node, under=node)
        writer.stage(node)


@pytest.mark.usefixtures("keys_dir")
def test_the_commit_signs_what_the_agents_signed(store_config: StoreConfig, tmp_path: Path) -> None:
    stage(ImageStore(store_config, signing=KEYS), tmp_path, "node-1")
    manifest = open_store(store_config).commit_parts("ns/ring", "c1", ["node-1"])
    assert manifest.signature is not None and manifest.signature.key_id == "2026-11-30"
    # what an agent with the same key set reads
    assert ImageStore(store_config, signing=KEYS).manifest(CheckpointRef("ns/ring", "c1")) == manifest


@pytest.mark.usefixtures("keys_dir")
def test_a_part_the_tenant_staged_is_not_committed(store_config: StoreConfig, tmp_path: Path) -> None:
    stage(ImageStore(store_config, signing=KEYS), tmp_path, "node-1")
    stage(ImageStore(store_config), tmp_path, "node-2")  # the tenant's S3 keys only
    with pytest.raises(ManifestSignatureError, match=r"node-2\.json is not signed"):
        open_store(store_config).commit_parts("ns/ring", "c1", ["node-1", "node-2"])


def test_keys_configured_but_not_mounted_refuse_the_storage(
    store_config: StoreConfig, tmp_path: Path
) -> None:
    before = settings.current()
    settings.configure(before.with_(image_keys=str(tmp_path / "absent")))
    try:
        with pytest.raises(StorageProblem) as problem:
            open_store(store_config)
    finally:
        settings.configure(before)
    assert problem.value.reason == "ImageKeysUnavailable"
    assert "no image signing keys" in problem.value.message
