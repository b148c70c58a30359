"""What every store operation needs: the connection, the key layout, encryption settings, shared helpers."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ibckpt.store import codec
from ibckpt.store.codec import ChunkKeys
from ibckpt.store.errors import CheckpointNotFoundError
from ibckpt.store.layout import CheckpointRef, Layout
from ibckpt.store.manifest import Manifest, parse_manifest
from ibckpt.store.s3 import Connection, missing_as, s3_errors
from ibckpt.store.signing import ManifestKeys

ProgressCallback = Callable[[int], None]


@dataclass(frozen=True)
class StoreContext:
    connection: Connection
    layout: Layout
    keys: ChunkKeys | None
    # Extra arguments for every PUT: server-side encryption headers.
    put_args: dict[str, str] = field(default_factory=dict)
    # Set: every manifest and part written is signed, every one read must verify (signing.py). None: what
    # is written is unsigned and what is read is not checked (the CLI without a key).
    signing: ManifestKeys | None = None

    @property
    def bucket(self) -> str:
        return self.connection.config.bucket

    @property
    def client(self) -> Any:
        return self.connection.client

    def not_found(self, ref: CheckpointRef) -> CheckpointNotFoundError:
        return CheckpointNotFoundError(f"checkpoint {ref} does not exist ({self.connection.where()})")

    def load_manifest(self, ref: CheckpointRef, *, verified: bool = True) -> Manifest:
        """`verified=False`: not checked against the key set, for what only counts chunks (garbage
        collection): an unverified manifest may keep chunks, nothing is restored from it."""
        key = self.layout.manifest_key(ref)
        with (
            s3_errors(self.connection, f"reading the manifest of {ref}"),
            missing_as(lambda: self.not_found(ref)),
        ):
            data = self.client.get_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")["Body"].read()
        keys = self.signing if verified else None
        return parse_manifest(data, f"{ref} ({key})", keys=keys, object_key=key)

    def put_manifest(self, key: str, manifest: Manifest, action: str) -> Manifest:
        """Write a manifest or part at `key`, signed for that key if this context signs; returns what was
        written."""
        if self.signing is not None:
            manifest = manifest.signed(self.signing, key)
        with s3_errors(self.connection, action):
            self.client.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=manifest.to_json(),
                ContentType="application/json",
                **self.put_args,
            )
        return manifest


class RateLimiter:
    """A token bucket shared by the upload threads: at most `rate` bytes/s on average, bursts of 1 s."""

    def __init__(self, rate: int | None) -> None:
        self._rate = rate
        self._lock = threading.Lock()
        self._allowance = float(rate or 0)
        self._stamp = time.monotonic()

    def take(self, amount: int, wait: Callable[[float], object] = time.sleep) -> None:
        """Take `amount` bytes, waiting (with `wait`) for as long as that puts the bucket in debt."""
        if not self._rate:
            return
        with self._lock:
            now = time.monotonic()
            self._allowance = min(float(self._rate), self._allowance + (now - self._stamp) * self._rate)
            self._stamp = now
            self._allowance -= amount
            debt = -self._allowance / self._rate if self._allowance < 0 else 0.0
        if debt > 0:
            wait(debt)


class StageTimes:
    """Per stage, summed over threads: elapsed seconds (`stage`) and CPU seconds of the thread
    (`stage_cpu`). Elapsed includes waiting for the network and for a core, so sums exceed the wall time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = {}

    def add(self, stage: str, seconds: float, cpu_seconds: float) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
            self.seconds[stage + "_cpu"] = self.seconds.get(stage + "_cpu", 0.0) + cpu_seconds

    def timed(self, stage: str) -> _Timer:
        return _Timer(self, stage)


class _Timer:
    def __init__(self, times: StageTimes, stage: str) -> None:
        self._times = times
        self._stage = stage
        self._start = 0.0
        self._cpu_start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()
        self._cpu_start = time.thread_time()

    def __exit__(self, *exc: object) -> None:
        self._times.add(self._stage, time.perf_counter() - self._start, time.thread_time() - self._cpu_start)


def seal_chunk(
    plain: bytes | memoryview, cid: str, level: int, keys: ChunkKeys | None, times: StageTimes | None = None
) -> bytes:
    """A chunk as the store keeps it: zstd at `level` where it pays, framed, sealed when `keys` are set.
    The one definition: the upload's (codec.seal_framed: the same bytes, fewer copies), the follower's
    and the memory tier's copies (memorycopy.py) are byte-compatible. `times`: where the upload counts
    its stages."""
    if times is None:
        times = StageTimes()
    with times.timed("compress"):
        payload, chosen = codec.compress(plain, level)
    with times.timed("encrypt" if keys else "frame"):
        return codec.seal(payload, chosen, len(plain), cid, keys)


def seal_framed_chunk(
    buffer: bytearray, cid: str, level: int, keys: ChunkKeys | None, times: StageTimes | None = None
) -> bytearray:
    """seal_chunk of the plain bytes at buffer[HEADER_SIZE:] (codec.framed_buffer), with fewer copies:
    a raw, unencrypted chunk is `buffer` itself with its header written in place (codec.seal_framed)."""
    if times is None:
        times = StageTimes()
    with times.timed("compress"):
        payload, chosen = codec.compress(memoryview(buffer)[codec.HEADER_SIZE :], level)
    with times.timed("encrypt" if keys else "frame"):
        return codec.seal_framed(buffer, payload, chosen, cid, keys)


@dataclass(frozen=True)
class FollowedSpan:
    """A whole chunk the follower hashed, and found or put in the bucket."""

    chunk_id: str
    stored_size: int
    crc32: int  # of its plain bytes: the upload takes chunk_id only while they still match
    # Punched out of the node's disk once stored (follow.py, the disk window): the upload cannot read it
    # back, so it takes chunk_id unchecked and only makes sure the bucket still has it.
    released: bool = False


# A span of a file: (its device, its inode, the span's offset). Not its path: a file renamed after the
# follower read it (a pre-dump the dump takes in as its parent) keeps its spans. The CRC32 of the span's
# bytes, checked before its id is taken, is what says the bytes are still those the follower hashed.
SpanKey = tuple[int, int, int]


def span_key(info: os.stat_result, offset: int) -> SpanKey:
    return info.st_dev, info.st_ino, offset
