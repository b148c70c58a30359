"""Cutting a file tree into chunks: which files, in what order, and which byte ranges.

Chunks are fixed-size slices at fixed file offsets. Content-defined boundaries would survive insertions, but
cost a per-byte rolling hash that pure Python cannot run at disk speed. CRIU writes memory pages in address
order at stable offsets, so an unchanged page range lands in the same chunk next time; what moves is
re-uploaded, which is the price of reading at memory speed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

EntryKind = Literal["file", "dir", "symlink"]


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

    yield from visit(str(root), "")
