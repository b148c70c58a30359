"""The memory tier's copy of a node's part of a checkpoint (docs/recovery.md, "Tiers"): the part's chunks
as the store keeps them (compressed, and encrypted when the storage encrypts client-side), rebuilt from
the node's own images, so that another node's agent can hold them and a restore can read them there
before S3 (download.restore's `chunk_source`). Rebuilt rather than kept from the upload: the upload
skips chunks the bucket already holds, and a copy must hold them all."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

from ibckpt.store import codec
from ibckpt.store.context import StoreContext, seal_chunk
from ibckpt.store.download import Placement, placements
from ibckpt.store.errors import StoreError
from ibckpt.store.manifest import FileRecord
from ibckpt.store.s3 import s3_errors


def stored_chunks(
    context: StoreContext,
    files: Sequence[FileRecord],
    root: Path,
    *,
    level: int | None = None,
    from_bucket: Collection[str] = (),
) -> Iterator[tuple[str, bytes]]:
    """Each distinct chunk of `files` (paths relative to `root`) as the store keeps it, one at a time.
    `level`: the zstd level the chunks were stored at (the part's); None, the configuration's, as uploads
    use. `from_bucket`: chunks no longer on the disk (released by the follower), read from the bucket. A
    file that changed since it was stored raises StoreError naming it."""
    if level is None:
        level = context.connection.config.compression_level
    for cid, use in placements(list(files)).items():
        if cid in from_bucket:
            yield cid, _from_bucket(context, cid)
            continue
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


def _from_bucket(context: StoreContext, cid: str) -> bytes:
    """A chunk as stored, checked against its id before it is copied anywhere."""
    key = context.layout.chunk_key(cid)
    with s3_errors(context.connection, f"reading chunk {cid} for the memory copy"):
        stored: bytes = context.client.get_object(Bucket=context.bucket, Key=key)["Body"].read()
    try:
        plain = codec.open_chunk(stored, cid, context.keys)
    except codec.CodecError as error:
        raise StoreError(f"chunk {cid} in the bucket is corrupt: {error}") from None
    if codec.chunk_id(hashlib.sha256(plain).digest(), context.keys) != cid:
        raise StoreError(f"chunk {cid} in the bucket does not hash to its id")
    return stored
