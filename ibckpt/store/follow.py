"""Uploading a dump's big files while they grow, so that the upload after the dump finds them stored.

CRIU writes each pages-*.img from start to end. While it runs, a Follower polls the images directory and,
for every file that has grown past a whole chunk_size span, reads that span, hashes it and PUTs it,
content-addressed, exactly as the upload will cut it: packing.py gives every full span, at a multiple of
chunk_size, a chunk of its own (only tails smaller than pack_below go into packs, and tails are not read
here). The chunk id and the sealed bytes come from the same config and keys as the upload's.

What it stored is checked afterwards, not trusted. For each span it records the chunk id, the stored size
and a CRC32 of the bytes it hashed (`spans`). The upload re-reads every file; a span whose CRC32 still
matches takes the recorded id instead of a second SHA-256 (the costliest pass over a dump: about twice a
CRC32 on the host, 26 times on the testbed's emulated CPUs), and one that changed after it was read here
is hashed and uploaded as usual. The upload still HEADs each chunk under its own lease, so the follower
holds none (a sweep may remove what it stored; young chunks are kept for the sweep's grace anyway), and
its errors are logged and dropped.

With `release` (the node's disk window), a span of a file CRIU writes once and never reads back while it
dumps (`pages-*.img`) leaves the node's disk as soon as the bucket has it: its bytes are punched out of the
file (a hole; the file keeps its size). The upload cannot check such a span, so it takes its id and only
makes sure the bucket still has the chunk. The bucket's copy is then the only one, so a follower that
releases holds a writer lease from before its first PUT until `FollowStats.end_lease()`, which the caller
calls once the upload holds its own: no sweep runs in between.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import fnmatch
import hashlib
import logging
import os
import stat
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import botocore.exceptions

from ibckpt.store import codec
from ibckpt.store.catalog import latest_ref
from ibckpt.store.context import FollowedSpan, RateLimiter, SpanKey, StoreContext, seal_framed_chunk, span_key
from ibckpt.store.errors import StoreError
from ibckpt.store.leases import Lease, holder_lease, wait_for_sweeps
from ibckpt.store.s3 import connect, error_code, is_not_found

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
# A store that fails this many spans in a row is not tried again until the next dump: the upload after
# the dump will meet (and report) the same failure.
GIVE_UP_AFTER = 3
# One retry only: a request the follower loses costs nothing but a warm chunk, and stop() waits for the
# requests under way.
FOLLOW_ATTEMPTS = 2
FOLLOW_READ_TIMEOUT = 20.0
_REFUSED = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
# Room for the chunk header, a nonce and a tag: a sealed span never exceeds chunk_size plus this.
_SEAL_OVERHEAD = codec.HEADER_SIZE + codec.NONCE_SIZE + codec.TAG_SIZE
# What CRIU writes front to back and never reads again during the dump (its page data): releasable.
RELEASABLE = "pages-*.img"
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free a file's blocks in [offset, offset + length) and keep its size: the range reads as zeros."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


class _Dropped(Exception):
    """A span not stored because the follower is stopping."""


@dataclass
class FollowStats:
    stored_chunks: int = 0  # PUT here
    stored_bytes: int = 0
    present_chunks: int = 0  # in the bucket already, or named by the job's latest checkpoint
    failed_chunks: int = 0
    gave_up: bool = False
    timed_out: bool = False
    spans: dict[SpanKey, FollowedSpan] = dataclasses.field(default_factory=dict)  # for the upload
    released_bytes: int = 0  # punched out of the node's disk once stored (`release`)
    # Held while released spans are only in the bucket: end it once the upload holds its own.
    lease: Lease | None = dataclasses.field(default=None, repr=False, compare=False)

    def end_lease(self) -> None:
        """Give up the follower's writer lease (safe to call more than once)."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()


def follow_context(context: StoreContext) -> StoreContext:
    """The same bucket, keys and PUT arguments on a client of its own that gives up sooner."""
    config = context.connection.config
    quick = config.with_overrides(
        max_attempts=min(config.max_attempts, FOLLOW_ATTEMPTS),
        read_timeout=min(config.read_timeout, FOLLOW_READ_TIMEOUT),
    )
    return dataclasses.replace(context, connection=connect(quick))


class Follower:
    """`with store.follow(root, job): <run the dump>`, or start() and stop(). stop() returns once the
    polling thread and every upload under way have ended (at most a HEAD and a PUT per worker)."""

    def __init__(
        self,
        context: StoreContext,
        root: Path,
        job: str | None = None,
        *,
        timeout: float | None = None,
        poll_seconds: float = POLL_SECONDS,
        release_for: str | None = None,
    ) -> None:
        """`release_for`: the id of the checkpoint being written, to release stored spans from the disk
        under a writer lease of that checkpoint (needs `job`); None keeps every byte on the disk."""
        self._context = context
        self._release_for = release_for if job is not None else None
        self._releasing = False
        self._config = context.connection.config
        self._root = str(root)
        self._job = job
        self._timeout = timeout
        self._deadline = float("inf")
        self._poll = poll_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._slots = threading.BoundedSemaphore(self._config.workers)
        self._limiter = RateLimiter(self._config.max_rate)
        self._lock = threading.Lock()
        self._next: dict[tuple[int, int], int] = {}  # (device, inode) -> offset of its next span
        # chunk ids stored, found, or being stored here -> their stored size (None: being stored, or unknown)
        self._seen: dict[str, int | None] = {}
        self._failures_in_a_row = 0
        self.stats = FollowStats()

    def __enter__(self) -> Follower:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> Follower:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ibckpt-follow", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> FollowStats:
        """Stop following and wait for the requests under way; safe to call more than once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.stats.released_bytes:  # every byte is still on the disk: nothing to keep safe
            self.stats.end_lease()
        return self.stats

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the polling thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        if self._timeout is not None:
            self._deadline = time.monotonic() + self._timeout
        if self._config.chunk_size + _SEAL_OVERHEAD >= self._config.multipart_threshold:
            return  # such chunks take the upload's multipart path; not copied here
        try:
            self._take_lease()
            self._learn_latest()
            with concurrent.futures.ThreadPoolExecutor(
                self._config.workers, thread_name_prefix="ibckpt-follow-up"
            ) as pool:
                while not self._stop.is_set() and not self.stats.gave_up:
                    if time.monotonic() >= self._deadline:
                        self.stats.timed_out = True
                        log.warning("stopped following %s after %gs", self._root, self._timeout)
                        break
                    self._scan(pool)
                    self._stop.wait(self._poll)
                self._stop.set()  # spans not begun yet are dropped; the pool waits for those under way
        except Exception:  # never out of the thread: the upload after the dump does everything anyway
            log.exception("following %s", self._root)

    def _take_lease(self) -> None:
        # Before the first PUT, as the upload's: what is released is in no manifest yet, nor on the disk.
        if self._release_for is None or self._job is None:
            return
        context = self._context
        lease = holder_lease(context.connection, context.layout, "writer", self._job, self._release_for)
        try:
            lease.acquire()
            wait_for_sweeps(context.connection, context.layout, lease)
        except StoreError as error:
            lease.release()
            log.warning("no lease to release %s's pages with (they stay on disk): %s", self._root, error)
            return
        self.stats.lease = lease
        self._releasing = True

    def _learn_latest(self) -> None:
        # The job's latest checkpoint names the chunks an unchanged span will hash to: not sent again.
        if self._job is None:
            return
        try:
            manifest = self._context.load_manifest(latest_ref(self._context, self._job))
        except StoreError:  # none yet, or unreadable: everything is new
            return
        self._seen.update(manifest.chunk_sizes())

    def _files(self) -> Iterator[tuple[str, os.stat_result]]:
        """Regular files under the root at least one span long (symlinks not followed)."""
        pending = [self._root]
        while pending:
            try:
                with os.scandir(pending.pop()) as listing:
                    children = list(listing)
            except OSError:  # not created yet, or removed under us
                continue
            for child in children:
                try:
                    info = child.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(info.st_mode):
                    pending.append(child.path)
                elif stat.S_ISREG(info.st_mode) and info.st_size >= self._config.chunk_size:
                    yield child.path, info

    def _scan(self, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        size = self._config.chunk_size
        for path, info in self._files():
            key = (info.st_dev, info.st_ino)  # a file renamed meanwhile goes on where it was
            while True:
                with self._lock:
                    offset = self._next.get(key, 0)
                    if offset + size > info.st_size:
                        break
                    self._next[key] = offset + size
                if not self._slot():
                    with self._lock:
                        self._next[key] = min(self._next[key], offset)
                    return
                pool.submit(self._span, path, info, offset)

    def _slot(self) -> bool:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            if self._slots.acquire(timeout=self._poll):
                return True
        return False

    # -- the upload threads ----------------------------------------------------------------------------
    def _span(self, path: str, info: os.stat_result, offset: int) -> None:
        try:
            if not self._stop.is_set() and not self.stats.gave_up:
                self._store_span(path, info, offset)
                with self._lock:
                    self._failures_in_a_row = 0
        except _Dropped:
            pass
        except Exception as error:
            with self._lock:
                self.stats.failed_chunks += 1
                self._failures_in_a_row += 1
                if self._failures_in_a_row >= GIVE_UP_AFTER and not self.stats.gave_up:
                    self.stats.gave_up = True
                    log.warning("stopped uploading during the dump of %s: %s", self._root, error)
        finally:
            self._slots.release()

    def _store_span(self, path: str, info: os.stat_result, offset: int) -> None:
        size = self._config.chunk_size
        # Read after room for the header, as the upload reads: a chunk stored raw is sent from this buffer.
        buffer = codec.framed_buffer(size)
        plain = memoryview(buffer)[codec.HEADER_SIZE :]
        try:
            file = open(path, "rb", buffering=0)  # noqa: SIM115 (closed below)
        except FileNotFoundError:  # renamed since the scan: the next scan finds it under its new path
            with self._lock:
                file_key = (info.st_dev, info.st_ino)
                self._next[file_key] = min(self._next.get(file_key, offset), offset)
            return
        with file:
            now = os.fstat(file.fileno())
            if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
                return  # replaced: the upload sees what it is now
            got = os.preadv(file.fileno(), [plain], offset)
        if got < size:  # shrank: the upload sees what it is now
            return
        cid = codec.chunk_id(hashlib.sha256(plain).digest(), self._context.keys)
        key, crc = span_key(info, offset), zlib.crc32(plain)
        with self._lock:
            if cid in self._seen:
                self.stats.present_chunks += 1
                if (known := self._seen[cid]) is not None:
                    self.stats.spans[key] = FollowedSpan(cid, known, crc)
                    self._release(path, info, offset)
                return
            self._seen[cid] = None
        try:
            stored, stored_size = self._put(cid, buffer)
        except BaseException:
            with self._lock:
                del self._seen[cid]
            raise
        with self._lock:
            if stored_size is not None:
                self._seen[cid] = stored_size
                self.stats.spans[key] = FollowedSpan(cid, stored_size, crc)
                self._release(path, info, offset)
            if stored:
                self.stats.stored_chunks += 1
                self.stats.stored_bytes += stored_size or 0
            else:
                self.stats.present_chunks += 1

    def _release(self, path: str, info: os.stat_result, offset: int) -> None:
        """(Under self._lock, its span just recorded.) Punch a stored span of a page file out of the disk
        while the lease holds; a span that stays is uploaded as usual (checked against its CRC32)."""
        lease = self.stats.lease
        if not self._releasing or lease is None or not fnmatch.fnmatch(os.path.basename(path), RELEASABLE):
            return
        key = span_key(info, offset)
        try:
            lease.check()
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                if (now := os.fstat(fd)) and (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
                    return
                punch_hole(fd, offset, self._config.chunk_size)
            finally:
                os.close(fd)
        except (OSError, StoreError) as error:  # no hole punching on this file system, or no lease
            self._releasing = False
            log.warning("stopped releasing %s's pages from the disk: %s", self._root, error)
            return
        self.stats.spans[key] = dataclasses.replace(self.stats.spans[key], released=True)
        self.stats.released_bytes += self._config.chunk_size

    def _put(self, cid: str, buffer: bytearray) -> tuple[bool, int | None]:
        """As the upload's non-blind path: a HEAD, then a PUT that never replaces a stored chunk (whose
        size other manifests recorded). Whether it was PUT here, and its stored size when known."""
        client, bucket = self._context.client, self._context.bucket
        key = self._context.layout.chunk_key(cid)
        try:
            head = client.head_object(Bucket=bucket, Key=key)
            return False, int(head["ContentLength"])
        except botocore.exceptions.ClientError as error:
            if not (is_not_found(error) or error_code(error) == "403"):
                raise
        level = self._config.compression_level
        stored = seal_framed_chunk(buffer, cid, level, self._context.keys)  # a bytearray: see upload._put
        self._limiter.take(len(stored), wait=self._stop.wait)  # a stop cuts the wait short
        if self._stop.is_set():
            raise _Dropped
        try:
            client.put_object(
                Bucket=bucket,
                Key=key,
                Body=stored,
                ContentType="application/octet-stream",
                IfNoneMatch="*",
                **self._context.put_args,
            )
        except botocore.exceptions.ClientError as error:
            if error_code(error) in _REFUSED:
                return False, None  # stored meanwhile by another writer: its size is the upload's to learn
            raise
        return True, len(stored)
