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
from ibckpt.store.context import StoreContext
from ibckpt.store.download import placements
from ibckpt.store.errors import StoreError
from ibckpt.store.manifest import FileRecord


def stored_chunks(
    context: StoreContext, files: Sequence[FileRecord], root: Path, level: int
) -> Iterator[tuple[str, bytes]]:
    """Each distinct chunk of `files` (paths relative to `root`) as the store keeps it, sealed at zstd
    `level` (the part's own), one at a time. A file that changed since it was stored raises StoreError."""
    for cid, use in placements(list(files)).items():
        plain = bytearray(use.extent)
        for place in use.places:
            path = root / place.path
            try:
                with open(path, "rb") as file:
                    data = os.pread(file.fileno(), place.length, place.offset)
            except OSError as error:
                raise StoreError(f"cannot read {path} for the memory copy: {error}") from error
            if len(data) != place.length:
                raise StoreError(f"{path} is shorter than when it was stored (chunk {cid})")
            plain[place.start : place.start + place.length] = data
        if codec.chunk_id(hashlib.sha256(plain).digest(), context.keys) != cid:
            names = ", ".join(sorted({place.path for place in use.places}))
            raise StoreError(f"{names} changed since it was stored (chunk {cid})")
        payload, chosen = codec.compress(bytes(plain), level)
        yield cid, codec.seal(payload, chosen, len(plain), cid, context.keys)
