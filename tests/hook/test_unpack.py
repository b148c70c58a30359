"""Host tests of the wrapper's confined unpack (hook/unpack.py): hostile archives are refused or masked,
and nothing is written outside the root (asserted on the filesystem, not on the code's word)."""

from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest
from hook.tars import Member, member, snapshot, write_tar

from ibckpt_node.hook.oci import Refused
from ibckpt_node.hook.unpack import Unpack


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the root, with a file in it: what an escape would reach."""
    where = tmp_path / "outside"
    where.mkdir()
    (where / "victim").write_text("the node's file")
    return where


@pytest.fixture
def root(tmp_path: Path, outside: Path) -> Path:
    """The new container's root, holding links to `outside` as an image or a sidecar could."""
    where = tmp_path / "root"
    (where / "etc").mkdir(parents=True)
    (where / "etc" / "shadow").write_text("root:*:")
    (where / "to-outside").symlink_to(outside)
    (where / "to-victim").symlink_to(outside / "victim")
    return where


def unpack(tmp_path: Path, root: Path, members: list[Member]) -> None:
    Unpack(str(root), "the test's archive").run(str(write_tar(tmp_path / "a.tar", members)))


HOSTILE = {
    "file-under-its-own-link": (
        [member("escape", tarfile.SYMTYPE, linkname="../outside"), member("escape/planted", data=b"x")],
        r"'escape' on its way is not a directory \(a symlink is never followed\)",
    ),
    "file-under-a-link-in-the-root": (
        [member("to-outside/planted", data=b"x")],
        r"'to-outside' on its way is not a directory",
    ),
    "dot-dot": ([member("a/../../outside/planted", data=b"x")], r"a '\.\.' component"),
    "absolute": ([member("/tmp/ibckpt-unpack-planted", data=b"x")], "an absolute path"),
    "whiteout-under-a-link": (
        [member("to-outside/victim", tarfile.CHRTYPE, devmajor=0, devminor=0)],
        r"'to-outside' on its way is not a directory",
    ),
    "hard-link-to-a-file-of-the-root": (
        [member("shadow-copy", tarfile.LNKTYPE, linkname="etc/shadow")],
        "a hard link to 'etc/shadow', which the archive did not write",
    ),
    "hard-link-through-a-link": (
        [member("victim-copy", tarfile.LNKTYPE, linkname="to-outside/victim")],
        "which the archive did not write",
    ),
    "owner-out-of-range": ([member("big", data=b"x", uid=1 << 40)], "refusing 'big' in the archive: uid"),
    "device-node": (
        [member("sda", tarfile.BLKTYPE, devmajor=8, devminor=0)],
        "a device node",
    ),
}


@pytest.mark.parametrize("members,refusal", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_archive_is_refused_and_nothing_lands_outside_the_root(
    tmp_path: Path, root: Path, outside: Path, members: list[Member], refusal: str
) -> None:
    before = snapshot(outside)
    with pytest.raises(Refused, match=refusal):
        unpack(tmp_path, root, members)
    assert snapshot(outside) == before
    assert not Path("/tmp/ibckpt-unpack-planted").exists()
    assert {p.name for p in tmp_path.iterdir()} == {"outside", "root", "a.tar"}
    assert not (root / "sda").exists() and not (root / "shadow-copy").exists()


def test_names_that_lead_through_links_replace_the_links_never_follow_them(
    tmp_path: Path, root: Path, outside: Path
) -> None:
    """A file, a directory or a whiteout at a link's own name acts on the link; what it pointed at stays."""
    before = snapshot(outside)
    unpack(
        tmp_path,
        root,
        [
            member("to-victim", data=b"the container's file"),
            member("to-outside", tarfile.DIRTYPE, mode=0o755),
            member("to-outside/inside", data=b"in the root"),
            member("link", tarfile.SYMTYPE, linkname="/etc"),
            member("link", tarfile.CHRTYPE, devmajor=0, devminor=0),
        ],
    )
    assert snapshot(outside) == before
    assert (root / "to-victim").read_bytes() == b"the container's file"
    assert not (root / "to-victim").is_symlink()
    assert (root / "to-outside").is_dir() and not (root / "to-outside").is_symlink()
    assert (root / "to-outside" / "inside").read_bytes() == b"in the root"
    assert not os.path.lexists(root / "link")


def test_a_file_written_again_never_writes_through_its_hard_link(tmp_path: Path, root: Path) -> None:
    unpack(
        tmp_path,
        root,
        [
            member("a", data=b"first"),
            member("b", tarfile.LNKTYPE, linkname="./a"),
            member("b", data=b"second"),
        ],
    )
    assert (root / "a").read_bytes() == b"first" and (root / "b").read_bytes() == b"second"
    unpack(tmp_path, root, [member("c", data=b"third"), member("d", tarfile.LNKTYPE, linkname="c")])
    assert (root / "d").stat().st_ino == (root / "c").stat().st_ino


def test_modes_are_masked_and_owners_are_set_by_number(tmp_path: Path, root: Path) -> None:
    (root / "tmp").mkdir()
    (root / "tmp").chmod(0o1777)
    named: dict[str, Any] = {"uname": "ibckpt-no-such-user", "gname": "ibckpt-no-such-group"}
    unpack(
        tmp_path,
        root,
        [
            member("tmp", tarfile.DIRTYPE, mode=0o700, uid=5, gid=5),  # there already: left as it is
            member("tmp/suid-shell", data=b"#!/bin/sh\n", mode=0o4755, uid=0, gid=0),
            member("sgid", data=b"x", mode=0o2775, uid=1234, gid=5678, **named),
            member("world", data=b"x", mode=0o666, uid=1000, gid=1000),
            member("shared", tarfile.DIRTYPE, mode=0o1777, uid=1000, gid=1000),
            member("shared/fifo", tarfile.FIFOTYPE, mode=0o6777, uid=1000, gid=1000),
            member("shared/link", tarfile.SYMTYPE, linkname="../world", uid=1000, gid=1001),
        ],
    )

    def mode(name: str) -> int:
        return stat.S_IMODE((root / name).lstat().st_mode)

    assert mode("tmp") == 0o1777 and (root / "tmp").stat().st_uid == 0
    assert mode("tmp/suid-shell") == 0o755
    assert mode("sgid") == 0o755 and (root / "sgid").stat()[4:6] == (1234, 5678)
    assert mode("world") == 0o644
    assert mode("shared") == 0o755 and (root / "shared").stat().st_uid == 1000
    assert stat.S_ISFIFO((root / "shared/fifo").lstat().st_mode) and mode("shared/fifo") == 0o755
    assert (root / "shared/link").lstat()[4:6] == (1000, 1001)
    assert os.readlink(root / "shared/link") == "../world"


def test_a_whiteout_removes_a_deep_tree_without_following_its_links(
    tmp_path: Path, root: Path, outside: Path
) -> None:
    deep = root / "old"
    for level in range(60):
        deep = deep / f"d{level}"
        deep.mkdir(parents=True)
        (deep / "f").write_text("x")
        (deep / "out").symlink_to(outside)
    before = snapshot(outside)
    unpack(tmp_path, root, [member("old", tarfile.CHRTYPE, devmajor=0, devminor=0)])
    assert not os.path.lexists(root / "old")
    assert snapshot(outside) == before
    # a whiteout whose directory is not there removes nothing and makes nothing
    unpack(tmp_path, root, [member("gone/too", tarfile.CHRTYPE, devmajor=0, devminor=0)])
    assert not os.path.lexists(root / "gone")


def test_an_archive_that_is_not_a_tar_is_refused(tmp_path: Path, root: Path) -> None:
    (tmp_path / "bad.tar").write_bytes(b"\x00" * 100 + b"not a tar" * 100)
    with pytest.raises(Refused, match="is not a readable tar"):
        Unpack(str(root), "x").run(str(tmp_path / "bad.tar"))
