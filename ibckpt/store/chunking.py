"""Cutting a file tree into chunks: which files, in what order, and which byte ranges.

Chunks are fixed-size slices at fixed file offsets. Content-defined boundaries would survive insertions, but
cost a per-byte rolling hash that pure Python cannot run at disk speed. CRIU writes memory pages in address
order at stable offsets, so an unchanged page range lands in the same chunk next time; what moves is
re-uploaded, which is the price of reading at memory speed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

EntryKind = Literal["file", "dir", "symlink"]
# Links followed while checking one target before giving up (the kernel's limit for one lookup).
MAX_LINK_HOPS = 40


class TreeError(ValueError):
    """The tree holds something that cannot be stored (a device, a socket, a path escaping the root)."""


@dataclass(frozen=True)
class TreeEntry:
    """One path of a tree, relative to its root, in POSIX form."""

    path: str
    kind: EntryKind
    mode: int
    size: int = 0
    mtime_ns: int = 0
    target: str | None = None


@dataclass(frozen=True)
class Span:
    """Bytes [offset, offset + length) of one file; index counts the file's chunks from 0."""

    index: int
    offset: int
    length: int


def spans(size: int, chunk_size: int) -> list[Span]:
    """The chunk spans of a file of `size` bytes. An empty file has none."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    return [
        Span(index, offset, min(chunk_size, size - offset))
        for index, offset in enumerate(range(0, size, chunk_size))
    ]


def check_relative(path: str) -> str:
    """A stored path must stay inside the tree it is restored into, in one spelling only: no absolute path,
    no empty, '.' or '..' component. String checks: every file of every manifest passes here."""
    if not path or path.startswith("/") or any(part in {"", ".", ".."} for part in path.split("/")):
        raise TreeError(f"unsafe path in tree: {path!r}")
    return path


def check_tree(entries: Iterable[tuple[str, EntryKind, str | None]]) -> None:
    """Refuse (TreeError naming the path) a tree of (path, kind, link target) whose rebuilding could put
    anything outside it, or leave a link that leads out of it: a path listed twice; a path under a symlink
    or a file; a link target that is empty, absolute, or that leaves the tree once its `..` and the tree's
    own links on the way are followed. Paths must already pass check_relative. Pure string checks: a
    manifest is written by whoever holds the bucket's keys, and is rebuilt as root."""
    kinds: dict[str, EntryKind] = {}
    links: dict[str, str] = {}
    for path, kind, target in entries:
        if path in kinds:
            raise TreeError(f"{path!r} is listed twice in the tree")
        kinds[path] = kind
        if kind == "symlink":
            links[path] = target or ""
    for path in kinds:
        parent = path.rpartition("/")[0]
        while parent:
            if kinds.get(parent, "dir") != "dir":
                raise TreeError(
                    f"{path!r} lies under {parent!r}, which is a {kinds[parent]}, not a directory"
                )
            parent = parent.rpartition("/")[0]
    for path, target in links.items():
        if not target or target.startswith("/"):
            raise TreeError(f"symlink {path!r} -> {target!r}: a link target must be a relative path")
        _follow(path.split("/")[:-1], target, links, [MAX_LINK_HOPS], path)


def _follow(start: list[str], target: str, links: dict[str, str], hops: list[int], link: str) -> list[str]:
    """Where `target`, read in directory `start`, leads in the tree (as components); TreeError if it leaves.
    Links met on the way are followed as the kernel would: `a/up -> ..` cannot make `b -> a/up/..` escape."""
    where = list(start)
    for name in target.split("/"):
        if name in {"", "."}:
            continue
        if name == "..":
            if not where:
                raise TreeError(f"symlink {link!r} -> {links[link]!r} points outside the tree")
            where.pop()
            continue
        where.append(name)
        inner = links.get("/".join(where))
        if inner is not None:
            hops[0] -= 1
            if hops[0] < 0:
                raise TreeError(f"symlink {link!r}: more than {MAX_LINK_HOPS} links to follow")
            if not inner or inner.startswith("/"):
                raise TreeError(f"symlink {link!r} -> {links[link]!r} points outside the tree")
            where = _follow(where[:-1], inner, links, hops, link)
    return where


def walk(root: Path) -> Iterator[TreeEntry]:
    """Every directory, regular file and symlink under root (root itself excluded), parents before
    children, siblings sorted by name so that the same tree always gives the same manifest."""
    if not root.is_dir():
        raise TreeError(f"{root} is not a directory")

    # Strings, not paths: pathlib's parsing was most of the CPU an upload of small files spent here.
    def visit(directory: str, prefix: str) -> Iterator[TreeEntry]:
        with os.scandir(directory) as listing:
            children = sorted(listing, key=lambda child: child.name)
        for child in children:
            rel = prefix + child.name
            info = child.stat(follow_symlinks=False)
            mode = stat.S_IMODE(info.st_mode)
            if stat.S_ISLNK(info.st_mode):
                yield TreeEntry(rel, "symlink", mode, target=os.readlink(child.path))
            elif stat.S_ISDIR(info.st_mode):
                yield TreeEntry(rel, "dir", mode, mtime_ns=info.st_mtime_ns)
                yield from visit(child.path, rel + "/")
            elif stat.S_ISREG(info.st_mode):
                yield TreeEntry(rel, "file", mode, size=info.st_size, mtime_ns=info.st_mtime_ns)
            else:
                raise TreeError(f"cannot store {child.path}: not a regular file, directory or symlink")

    # Checked when the walk ends: upload reads the whole walk before it sends a chunk, so a tree that restore
    # would refuse is refused before anything of it is uploaded.
    seen: list[tuple[str, EntryKind, str | None]] = []
    for entry in visit(str(root), ""):
        seen.append((entry.path, entry.kind, entry.target))
        yield entry
    check_tree(seen)
