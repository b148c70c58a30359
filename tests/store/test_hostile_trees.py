"""A manifest is written by whoever holds the prefix's keys and rebuilt as root: hostile trees are refused
before anything is written, nothing is ever made through a symlink (the manifest's or one found on disk),
and modes come back without setuid, setgid, sticky or group/other write."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from store.conftest import sample_manifest

from ibckpt.store import download
from ibckpt.store.chunking import TreeError, walk
from ibckpt.store.errors import ManifestError, StoreError
from ibckpt.store.manifest import ChunkRef, FileRecord, parse_manifest


def link(path: str, target: str) -> FileRecord:
    return FileRecord(path=path, kind="symlink", mode=0o777, target=target)


def folder(path: str, mode: int = 0o755) -> FileRecord:
    return FileRecord(path=path, kind="dir", mode=mode)


def file(path: str, mode: int = 0o644, data: bytes = b"x") -> FileRecord:
    # One chunk: the builder's write makes the file (fill below writes it).
    chunk = ChunkRef(id=format(len(path), "064x"), size=len(data), stored_size=len(data))
    return FileRecord(path=path, kind="file", mode=mode, size=len(data), chunks=[chunk])


def writer(records: list[FileRecord], before: Callable[[], None] = lambda: None) -> Callable[[int], None]:
    """A `fill` for build_tree that writes b'x' to each file, after `before` (a stand-in for a race)."""

    def fill(root_fd: int) -> None:
        before()
        for record in records:
            if record.kind == "file":
                download._write_at(root_fd, record.path, 0, b"x" * record.size, create=True)

    return fill


def everything_under(path: Path) -> list[str]:
    return sorted(str(entry.relative_to(path)) for entry in path.rglob("*"))


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside every restore tree: nothing may ever appear in it or change in it."""
    place = tmp_path / "outside"
    place.mkdir()
    return place


HOSTILE: dict[str, tuple[Callable[[str], list[FileRecord]], str]] = {
    # The review's probe: a link to the outside, then a directory and a link made "under" it.
    "record-under-symlink": (
        lambda out: [link("x", out), folder("x/sub"), link("x/sub/ld.so.preload", "../../evil.so")],
        "'x/sub' lies under 'x', which is a symlink",
    ),
    # The same through a link that itself stays inside: only "nothing under a link" stops it.
    "record-under-inner-symlink": (
        lambda out: [folder("d"), link("x", "d"), file("x/f")],
        "'x/f' lies under 'x', which is a symlink",
    ),
    "record-under-file": (lambda out: [file("f"), file("f/g")], "'f/g' lies under 'f', which is a file"),
    "absolute-target": (lambda out: [link("l", out + "/passwd")], "symlink 'l' -> '/.*must be a relative"),
    "dotdot-escape": (
        lambda out: [folder("d"), link("d/l", "../../x")],
        "symlink 'd/l' -> '../../x' points outside",
    ),
    "chain-escape": (
        lambda out: [folder("a"), link("a/up", ".."), link("b", "a/up/../etc")],
        "symlink 'b' -> 'a/up/../etc' points outside",
    ),
    "chain-to-absolute": (
        lambda out: [link("abs", out), link("b", "abs/x")],
        "symlink 'abs' -> '/.*must be a relative|symlink 'b' -> 'abs/x' points outside",
    ),
    "loop": (lambda out: [link("a", "b/x"), link("b", "a/y")], "more than 40 links"),
    "empty-target": (lambda out: [link("l", "")], "symlink 'l' -> ''"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifests_are_refused_when_parsed(case: str, outside: Path) -> None:
    records, message = HOSTILE[case]
    data = sample_manifest(files=records(str(outside))).to_json()
    with pytest.raises(ManifestError, match=rf"manifest here is unsafe to restore: .*({message})"):
        parse_manifest(data, "here")


def test_duplicate_paths_are_refused_and_named() -> None:
    raw = json.loads(sample_manifest().to_json())
    raw["files"].append({"path": "d/pages.img", "kind": "symlink", "mode": 0o777, "target": "x"})
    with pytest.raises(ManifestError, match=r"duplicate path in files: 'd/pages\.img'"):
        parse_manifest(json.dumps(raw).encode(), "here")


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_builder_refuses_hostile_trees_before_writing_anything(
    case: str, tmp_path: Path, outside: Path
) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    records = HOSTILE[case][0](str(outside))
    with pytest.raises(ManifestError, match="unsafe to restore"):
        download.build_tree(root, records, writer(records))
    assert everything_under(root) == []
    assert everything_under(outside) == []


def test_relative_links_inside_the_tree_are_rebuilt(tmp_path: Path) -> None:
    records = [
        file("f"),
        folder("d"),
        link("d/back", "../f"),
        link("d/up", ".."),
        link("through", "d/up/d/./back"),  # followed link by link, it stays inside
        link("dangling", "d/nothing"),
        link("to-dir", "d/"),
    ]
    root = tmp_path / "tree"
    root.mkdir()
    download.build_tree(root, records, writer(records))
    assert os.readlink(root / "through") == "d/up/d/./back"
    assert (root / "through").read_bytes() == b"x"
    assert os.readlink(root / "d" / "back") == "../f"
    assert os.readlink(root / "to-dir") == "d/"
    # walk() reads them back, and a tree of them passes its own check.
    assert {entry.path for entry in walk(root) if entry.kind == "symlink"} == {
        "d/back",
        "d/up",
        "through",
        "dangling",
        "to-dir",
    }


@pytest.mark.parametrize(
    "links",
    [{"l": "/etc"}, {"d/l": "../../outside"}, {"d/up": "..", "m": "d/up/.."}],
    ids=["absolute", "dotdot", "through-a-link"],
)
def test_a_tree_with_a_link_out_of_it_is_not_uploaded(links: dict[str, str], tmp_path: Path) -> None:
    # walk() checks the whole tree before upload sends a chunk: the store never commits what it would refuse.
    (tmp_path / "d").mkdir()
    for path, target in links.items():
        os.symlink(target, tmp_path / path)
    with pytest.raises(TreeError, match=r"symlink .* (must be a relative path|points outside the tree)"):
        list(walk(tmp_path))


def test_modes_come_back_masked(tmp_path: Path) -> None:
    records = [
        file("setuid", mode=0o6755),
        file("shared", mode=0o666),
        file("private", mode=0o600),
        folder("open", mode=0o777),
        folder("sticky", mode=0o1777),
        folder("closed", mode=0o500),
        file("closed/inner", mode=0o444),
    ]
    root = tmp_path / "tree"
    root.mkdir()
    download.build_tree(root, records, writer(records))
    modes = {record.path: stat.S_IMODE(os.lstat(root / record.path).st_mode) for record in records}
    assert modes == {
        "setuid": 0o755,
        "shared": 0o644,
        "private": 0o600,
        "open": 0o755,
        "sticky": 0o755,
        "closed": 0o500,
        "closed/inner": 0o444,
    }


# -- a symlink found on disk (a race, a tree someone else prepared) is never followed --------------------


def swap_for_link(path: Path, target: Path) -> Callable[[], None]:
    def swap() -> None:
        if path.is_dir():
            path.rmdir()
        else:
            path.unlink()
        os.symlink(target, path)

    return swap


def test_a_directory_swapped_for_a_link_is_not_written_through(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    records = [folder("d"), file("d/f")]
    with pytest.raises(StoreError, match="'d' on the way to 'd' is not a directory"):
        download.build_tree(root, records, writer(records, before=swap_for_link(root / "d", outside)))
    assert everything_under(outside) == []


def test_no_link_is_made_through_a_directory_swapped_for_a_link(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    records = [folder("d"), link("d/ld.so.preload", "../evil.so")]
    with pytest.raises(StoreError, match="not a directory"):
        download.build_tree(root, records, writer(records, before=swap_for_link(root / "d", outside)))
    assert everything_under(outside) == []


def test_no_directory_is_made_through_a_link_already_there(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    os.symlink(outside, root / "d")
    records = [folder("d"), folder("d/sub"), file("d/sub/f")]
    with pytest.raises(StoreError, match="not a directory"):
        download.build_tree(root, records, writer(records))
    assert everything_under(outside) == []


def test_modes_are_not_set_through_a_file_swapped_for_a_link(tmp_path: Path, outside: Path) -> None:
    victim = outside / "shadow"
    victim.write_bytes(b"secret")
    os.chmod(victim, 0o600)
    root = tmp_path / "tree"
    root.mkdir()
    records = [file("f", mode=0o644)]

    def fill(root_fd: int) -> None:
        writer(records)(root_fd)
        swap_for_link(root / "f", victim)()

    with pytest.raises(StoreError, match="'f' is not the file it was made as"):
        download.build_tree(root, records, fill)
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o600


# -- through the real store ------------------------------------------------------------------------------


@pytest.mark.s3
def test_a_hostile_manifest_in_the_bucket_is_refused_and_nothing_is_written(
    make_store: Any, tree_factory: Any, tmp_path: Path, outside: Path
) -> None:
    store = make_store()
    source = tree_factory({"n1/pages.img": b"p" * 1000, "n2/core.img": b"c" * 10})
    os.symlink("pages.img", source / "n1" / "pages.link")
    os.symlink("../n2/core.img", source / "n1" / "core.link")
    manifest = store.upload_tree(source, "team/solver")

    # Legitimate relative links come back, whole or as a node's subtree when they stay inside it.
    store.restore(manifest.ref, tmp_path / "whole")
    assert (tmp_path / "whole" / "n1" / "core.link").read_bytes() == b"c" * 10
    with pytest.raises(ManifestError, match=r"subtree 'n1'.*'core.link' -> '../n2/core.img' points outside"):
        store.restore(manifest.ref, tmp_path / "part" / "n1", subtree="n1")
    assert not (tmp_path / "part").exists()

    # The tenant rewrites its manifest: a link out, then a directory and a link "under" it.
    key = store.context.layout.manifest_key(manifest.ref)
    raw = json.loads(manifest.to_json())
    raw["files"] += [
        {"path": "x", "kind": "symlink", "mode": 0o777, "target": str(outside)},
        {"path": "x/sub", "kind": "dir", "mode": 0o755},
        {"path": "x/sub/ld.so.preload", "kind": "symlink", "mode": 0o777, "target": "/evil.so"},
    ]
    store.client.put_object(Bucket=store.config.bucket, Key=key, Body=json.dumps(raw).encode())
    destination = tmp_path / "hostile" / "out"
    refused = (
        rf"{re.escape(str(manifest.ref))}.*unsafe to restore: 'x/sub' lies under 'x', which is a symlink"
    )
    with pytest.raises(ManifestError, match=refused):
        store.restore(manifest.ref, destination)
    assert not destination.parent.exists()
    assert everything_under(outside) == []

    # Setuid and world-writable modes, written into the manifest, come back masked.
    raw = json.loads(manifest.to_json())
    for record in raw["files"]:
        if record["kind"] != "symlink":
            record["mode"] = 0o6777 if record["kind"] == "file" else 0o1777
    store.client.put_object(Bucket=store.config.bucket, Key=key, Body=json.dumps(raw).encode())
    store.restore(manifest.ref, tmp_path / "masked")
    for path in ["n1", "n1/pages.img", "n2", "n2/core.img"]:
        assert stat.S_IMODE(os.lstat(tmp_path / "masked" / path).st_mode) == 0o755, path
