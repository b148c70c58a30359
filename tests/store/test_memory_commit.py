"""The commit on the memory tier (parts.commit_in_memory): the part manifests as their holders keep them,
merged and signed for the checkpoint's manifest key with no S3 call (the store is offline: any S3 call
would raise), verified as a manifest read from the bucket is; a part signed for another node's key, a
missing or an extra part is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from ibckpt.store import RankInfo, StoreError
from ibckpt.store.errors import ManifestError, ManifestSignatureError
from ibckpt.store.layout import CheckpointRef
from ibckpt.store.manifest import MANIFEST_KIND, parse_manifest
from ibckpt.store.parts import commit_in_memory
from ibckpt.store.signing import ManifestKeys
from tests.store.test_sealed_part import KEYS, images, offline

JOB, CKPT = "ns/solver", "c1"
REF = CheckpointRef(JOB, CKPT)


def held_part(tmp_path: Path, node: str, rank: int) -> bytes:
    """The signed part manifest a node's agent seals on its holder (sealed_part's bytes)."""
    store = offline()
    root = images(tmp_path / node)
    with store.sealer(JOB, CKPT, lambda cid, stored: None) as writer:
        writer.add_tree(root, under=node)
        sealed = writer.sealed_part(node, [RankInfo(rank=rank, pod=f"solver-{rank}", node=node, root=node)])
    return bytes(sealed.data)


@pytest.fixture
def two_parts(tmp_path: Path) -> dict[str, bytes]:
    (tmp_path / "node-1").mkdir()
    (tmp_path / "node-2").mkdir()
    return {"node-1": held_part(tmp_path, "node-1", 0), "node-2": held_part(tmp_path, "node-2", 1)}


def test_the_held_parts_merge_into_a_manifest_signed_for_its_bucket_key(two_parts: dict[str, bytes]) -> None:
    store = offline()
    labels = {"ibckpt.io/restore-record": "{}"}
    manifest, data = commit_in_memory(
        store.context, JOB, CKPT, two_parts, ["node-1", "node-2"], labels=labels
    )
    assert manifest.kind == MANIFEST_KIND and manifest.labels == labels
    assert [rank.rank for rank in manifest.ranks] == [0, 1]
    # verified as one read from S3 (the restore's path: ImageStore.manifest_from), and bound to the key
    again = store.manifest_from(REF, data, "a holder")
    assert again.stats == manifest.stats and {r.path.split("/")[0] for r in again.files} >= {
        "node-1",
        "node-2",
    }
    with pytest.raises(ManifestSignatureError):
        parse_manifest(data, "elsewhere", keys=KEYS, object_key=store.context.layout.manifest_key(
            CheckpointRef(JOB, "c2")))  # fmt: skip


def test_a_missing_or_extra_part_is_refused(two_parts: dict[str, bytes]) -> None:
    store = offline()
    with pytest.raises(StoreError, match=r"missing \['node-2'\]"):
        commit_in_memory(store.context, JOB, CKPT, {"node-1": two_parts["node-1"]}, ["node-1", "node-2"])
    with pytest.raises(StoreError, match=r"unexpected \['node-2'\]"):
        commit_in_memory(store.context, JOB, CKPT, two_parts, ["node-1"])


def test_a_part_passed_off_as_another_nodes_or_signed_by_another_key_is_refused(
    two_parts: dict[str, bytes],
) -> None:
    store = offline()
    swapped = {"node-1": two_parts["node-2"], "node-2": two_parts["node-1"]}
    with pytest.raises(ManifestSignatureError):
        commit_in_memory(store.context, JOB, CKPT, swapped, ["node-1", "node-2"])
    other = offline()
    object.__setattr__(other.context, "signing", ManifestKeys({"k9": bytes(32)}))
    with pytest.raises((ManifestSignatureError, ManifestError)):
        commit_in_memory(other.context, JOB, CKPT, two_parts, ["node-1", "node-2"])
