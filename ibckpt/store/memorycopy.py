"""The memory tier's copy of a node's part of a checkpoint (docs/recovery.md, "Tiers"): the part's chunks
as the store keeps them (compressed, and encrypted when the storage encrypts client-side), rebuilt from
the node's own images, so that another node's agent can hold them and a restore can read them there
before S3 (download.restore's `chunk_source`). Rebuilt rather than kept from the upload: the upload
skips chunks the bucket already holds, and a copy must hold them all."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from ibckpt.store import codec
from ibckpt.store.context import StoreContext, seal_chunk
from ibckpt.store.download import Placement, placements
from ibckpt.store.errors import StoreError
from ibckpt.store.manifest import FileRecord


def stored_chunks(
    context: StoreContext, files: Sequence[FileRecord], root: Path, *, level: int | None = None
) -> Iterator[tuple[str, bytes]]:
    """Each distinct chunk of `files` (paths relative to `root`) as the store keeps it, one at a time.
    `level`: the zstd level the chunks were stored at (the part's); None, the configuration's, as uploads
    use. A file that changed since it was stored raises StoreError naming it."""
    if level is None:
        level = context.connection.config.compression_level
    for cid, use in placements(list(files)).items():
        plain = bytearray(use.extent)
        for place in use.places:
            plain[place.start : place.start + place.length] = _read(root, place, cid)
        if codec.chunk_id(hashlib.sha256(plain).digest(), context.keys) != cid:
            names = ", ".join(sorted({str(root / place.path) for place in use.places}))
            raise StoreError(f"{names} changed since it was stored (chunk {cid})")
        yield cid, seal_chunk(bytes(plain), cid, level, context.keys)


def _read(root: Path, place: Placement, cid: str) -> bytes:
    path = root / place.path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, place.length, place.offset)
        finally:
            os.close(fd)
    except OSError as error:
        raise StoreError(f"cannot read {path} for the memory copy: {error}") from error
    if len(data) != place.length:  # a regular file's pread is short only at its end
        raise StoreError(f"{path} changed since it was stored: it is shorter (chunk {cid})")
    return data
