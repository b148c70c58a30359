"""A checkpoint written by several nodes: each stages a part, the committer merges them into one manifest."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ibckpt.store import RankInfo, RetentionPolicy
from ibckpt.store.errors import CheckpointExistsError, StoreError

pytestmark = pytest.mark.s3


def stage_node(store: Any, tree: Path, node: str, rank: int, checkpoint_id: str = "c1") -> None:
    with store.writer("ns/solver", checkpoint_id) as writer:
        writer.add_tree(tree, under=f"rank-{rank}")
        writer.stage(node, ranks=[RankInfo(rank=rank, pod=f"solver-{rank}", node=node, root=f"rank-{rank}")])


def test_two_nodes_one_manifest(make_store: Any, tree_factory: Any, list_chunks: Any, tmp_path: Path) -> None:
    store = make_store()
    shared = os.urandom(100_000)  # e.g. the same library pages in both ranks
    tree_a = tree_factory({"pages-1.img": os.urandom(300_000), "lib.img": shared})
    tree_b = tree_factory({"pages-1.img": os.urandom(200_000), "lib.img": shared})
    stage_node(store, tree_a, "node-a", 0)
    stage_node(store, tree_b, "node-b", 1)

    # Staged, not committed: no reader sees it, and the sweep keeps its chunks.
    assert store.checkpoints() == []
    chunks_before = sorted(list_chunks())
    report = store.gc(RetentionPolicy(), grace=timedelta(0))
    assert report.swept and report.chunks_deleted == 0 and sorted(list_chunks()) == chunks_before

    with pytest.raises(StoreError, match=r"parts missing \['node-c'\]"):
        store.commit_parts("ns/solver", "c1", expected=["node-a", "node-b", "node-c"])
    assert store.checkpoints() == []

    manifest = store.commit_parts("ns/solver", "c1", expected=["node-a", "node-b"])
    assert [(rank.rank, rank.node, rank.root) for rank in manifest.ranks] == [
        (0, "node-a", "rank-0"),
        (1, "node-b", "rank-1"),
    ]
    assert manifest.stats.logical_bytes == 700_000
    assert manifest.stats.distinct_chunks == manifest.stats.chunks - 1  # lib.img stored once
    assert [entry.ref for entry in store.checkpoints()] == [manifest.ref]
    assert (
        store.client.list_objects_v2(Bucket=store.config.bucket, Prefix="ibckpt/v1/parts/")["KeyCount"] == 0
    )

    out = tmp_path / "restored"
    store.restore(manifest.ref, out)
    for rank, tree in ((0, tree_a), (1, tree_b)):
        for name in ("pages-1.img", "lib.img"):
            assert (out / f"rank-{rank}" / name).read_bytes() == (tree / name).read_bytes()


def test_abandoned_parts_are_collected(make_store: Any, tree_factory: Any, list_chunks: Any) -> None:
    store = make_store()
    stage_node(store, tree_factory({"pages.img": os.urandom(50_000)}), "node-a", 0, "failed")
    assert list_chunks()
    report = store.gc(RetentionPolicy(), grace=timedelta(0))
    assert report.abandoned_parts_removed == 0 and list_chunks()
    report = store.gc(RetentionPolicy(), grace=timedelta(0), abandoned_after=timedelta(0))
    assert report.abandoned_parts_removed == 1 and report.chunks_deleted == 1 and list_chunks() == []


def test_abort_drops_parts(make_store: Any, tree_factory: Any) -> None:
    store = make_store()
    stage_node(store, tree_factory({"pages.img": b"x" * 1000}), "node-a", 0, "aborted")
    assert store.abort("ns/solver", "aborted") == 1
    with pytest.raises(StoreError, match="no parts"):
        store.commit_parts("ns/solver", "aborted")


def test_a_second_commit_under_the_same_name_is_refused_and_the_first_still_restores(
    make_store: Any, tree_factory: Any, tmp_path: Path
) -> None:
    store = make_store()
    first = tree_factory({"pages-1.img": os.urandom(50_000)})
    stage_node(store, first, "node-a", 0, checkpoint_id="c7")
    committed = store.commit_parts("ns/solver", "c7", expected=["node-a"])

    # Another job, the same checkpoint name: its parts stage, its commit is refused, nothing replaced.
    second = tree_factory({"pages-1.img": os.urandom(50_000)})
    stage_node(store, second, "node-a", 0, checkpoint_id="c7")
    with pytest.raises(CheckpointExistsError, match=r"ns/solver/c7 is already committed .* never replaces"):
        store.commit_parts("ns/solver", "c7", expected=["node-a"])
    assert store.manifest(committed.ref) == committed
    store.restore(committed.ref, tmp_path / "out")
    assert (tmp_path / "out" / "rank-0" / "pages-1.img").read_bytes() == (first / "pages-1.img").read_bytes()
