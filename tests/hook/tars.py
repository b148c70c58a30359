"""Tar archives as the agent writes them (PAX), built member by member: hostile ones included."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

Member = tuple[str, bytes, bytes, dict[str, Any]]  # name, tar type, data, TarInfo fields


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **fields: Any) -> Member:
    return name, kind, data, fields


def write_tar(path: Path, members: list[Member]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data, fields in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            for key, value in fields.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(data) if info.size else None)
    return path


def snapshot(top: Path) -> dict[str, tuple[int, bytes]]:
    """Every path under `top` (links not followed): its mode and its bytes (a link's target)."""
    seen: dict[str, tuple[int, bytes]] = {}
    for path in sorted(top.rglob("*")):
        st = path.lstat()
        if path.is_symlink():
            body = str(path.readlink()).encode()
        elif path.is_file():
            body = path.read_bytes()
        else:
            body = b""
        seen[str(path.relative_to(top))] = (st.st_mode, body)
    return seen
