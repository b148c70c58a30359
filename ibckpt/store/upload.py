"""Writing a checkpoint: stream file trees into content-addressed chunks, then commit the manifest last.

Each worker thread takes one chunk, a span of one big file or a pack of small files (packing.py), and does
the whole pipeline for it: read (preadv into the buffer a raw chunk is sent from), sha256, skip if the
chunk is known or already in the bucket, else zstd (when it pays), seal and PUT.
hashlib, zstandard and the network all release the GIL, so the threads overlap on every core. In-flight
chunks are bounded by the worker count, which bounds memory to about workers x 2 x chunk_size.

A writer with a `sink` touches no S3 at all (no lease, no lookup, no PUT): each distinct chunk, sealed as
the bucket would keep it, goes to the sink, and `sealed_part` gives the signed part manifest that `stage`
would PUT. The memory tier's copy made before the upload (docs/recovery.md, "Tiers") is written so: one
definition of chunking, the same chunk ids and bytes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import NamedTuple

import botocore.exceptions

from ibckpt import __version__
from ibckpt.store import codec
from ibckpt.store.catalog import latest_ref
from ibckpt.store.chunking import TreeError, check_relative, walk
from ibckpt.store.context import (
    FollowedSpan,
    ProgressCallback,
    RateLimiter,
    SpanKey,
    StageTimes,
    StoreContext,
    seal_framed_chunk,
    span_key,
)
from ibckpt.store.errors import CheckpointNotFoundError, ChunkMissingError, ManifestError, StoreError
from ibckpt.store.layout import CheckpointRef, check_checkpoint_id, check_job, new_checkpoint_id
from ibckpt.store.leases import Lease, holder_lease, wait_for_sweeps
from ibckpt.store.manifest import (
    MANIFEST_KIND,
    PACKED_SCHEMA_VERSION,
    PART_KIND,
    ChunkRef,
    Compression,
    Encryption,
    FileRecord,
    Manifest,
    ManifestKind,
    RankInfo,
    Stats,
    Versions,
)
from ibckpt.store.packing import Piece, plan
from ibckpt.store.s3 import error_code, is_not_found, s3_errors

# Reading the job's latest manifest costs two requests (list, get) and saves at most one per chunk it
# names: worth it only for trees of at least this many chunks.
LEARN_FROM_CHUNKS = 3

# Takes each distinct chunk (id, stored bytes) of a writer in sink mode, once, from the writer's threads
# (concurrently: the sink serializes what must be).
ChunkSink = Callable[[str, bytes], None]


class SealedPart(NamedTuple):
    """A part manifest as `stage` writes it: the Manifest and its bytes (signed for the part's key)."""

    manifest: Manifest
    data: bytes


@dataclass(frozen=True)
class _Task:
    """One chunk to store: a piece of one file, or a pack of several files' pieces."""

    pieces: tuple[Piece, ...]
    paths: tuple[str, ...]  # the file of each piece
    packed: bool


class CheckpointWriter:
    """One checkpoint being written: `with store.writer(job) as w: w.add_tree(...); w.commit()`.

    Nothing is visible to readers until commit() has written the manifest. Leaving the block without
    committing leaves only unreferenced chunks, which garbage collection removes.
    """

    def __init__(
        self,
        context: StoreContext,
        job: str,
        checkpoint_id: str | None = None,
        *,
        progress: ProgressCallback | None = None,
        reuse_latest: bool = True,
        sink: ChunkSink | None = None,
        followed: Mapping[SpanKey, FollowedSpan] | None = None,
    ) -> None:
        self._context = context
        self._config = context.connection.config
        self.ref = CheckpointRef(check_job(job), check_checkpoint_id(checkpoint_id or new_checkpoint_id()))
        self._progress = progress
        self._sink = sink
        # a sink must have every chunk: none is skipped for being in the job's latest checkpoint
        self._reuse_latest = reuse_latest and sink is None
        self._begun = False
        self._lease: Lease | None = None
        self._learned = False
        self._packed = False  # some file's bytes are in a pack: the manifest needs schema 2
        self._records: list[FileRecord] = []
        self._known: dict[str, int] = {}  # chunk id -> stored size, for chunks known to be in the bucket
        self._pending: dict[str, concurrent.futures.Future[int]] = {}
        self._known_lock = threading.Lock()
        self._buffers = threading.local()  # each worker thread's buffer for full-size chunks (_buffer)
        self._followed = followed or {}  # what a follower hashed during the dump (follow.py)
        self._stats: dict[str, os.stat_result] = {}  # each followed file's, for its spans' keys
        self._uploaded_chunks = 0
        self._uploaded_bytes = 0
        self._times = StageTimes()
        self._limiter = RateLimiter(self._config.max_rate)
        self._started_at = datetime.now(UTC)
        self._wall_start = time.perf_counter()
        self._committed: Manifest | None = None
        from boto3.s3.transfer import TransferConfig  # boto3 loads with the first client (s3.py)

        self._transfer_config = TransferConfig(
            multipart_threshold=self._config.multipart_threshold,
            multipart_chunksize=max(8 * 1024 * 1024, self._config.multipart_threshold // 4),
            max_concurrency=2,
            use_threads=True,
        )

    # -- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self) -> CheckpointWriter:
        self.begin()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def begin(self) -> None:
        """Take the writer lease (before any chunk) and wait out sweeps; with a sink, nothing to take."""
        if self._begun:
            return
        if self._sink is not None:
            self._begun = True
            return
        connection, layout = self._context.connection, self._context.layout
        lease = holder_lease(connection, layout, "writer", self.ref.job, self.ref.checkpoint_id)
        with self._times.timed("lease"):
            self._lease = lease.acquire()
        try:
            with self._times.timed("lease"):
                wait_for_sweeps(connection, layout, lease)
        except BaseException:
            self.close()  # __exit__ does not run when __enter__ fails
            raise
        self._begun = True

    def close(self) -> None:
        self._begun = False
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _check_lease(self) -> None:
        if self._lease is not None:
            self._lease.check()

    def _learn_latest(self) -> None:
        # Chunks of a manifest read while we hold a lease cannot be swept before we release it, so they need
        # no request: only chunks new since the job's last checkpoint are sent or looked up.
        self._learned = True
        with self._times.timed("lease"):
            try:
                latest = latest_ref(self._context, self.ref.job)
                manifest = self._context.load_manifest(latest)
            except CheckpointNotFoundError:
                return
            except ManifestError:  # unreadable or not verified: learn nothing from it, upload everything
                return
        self._known.update(manifest.chunk_sizes())

    # -- writing ---------------------------------------------------------------------------------------
    def add_tree(self, root: Path, under: str = "") -> list[FileRecord]:
        """Upload every file under root; their paths in the checkpoint are prefixed with `under`."""
        if not self._begun:
            raise StoreError("CheckpointWriter.add_tree() before begin()")
        base = PurePosixPath(check_relative(under)) if under else None
        entries = list(walk(root))
        records: list[FileRecord] = []
        if base is not None:
            for depth in range(1, len(base.parts) + 1):
                part = str(PurePosixPath(*base.parts[:depth]))
                if all(record.path != part for record in self._records):
                    records.append(FileRecord(path=part, kind="dir", mode=root.stat().st_mode & 0o7777))
        file_entries = [entry for entry in entries if entry.kind == "file"]
        sizes = [entry.size for entry in file_entries]
        pieces = plan(sizes, self._config.chunk_size, self._config.pack_below)
        if self._reuse_latest and not self._learned and pieces.chunk_count >= LEARN_FROM_CHUNKS:
            self._learn_latest()
        top = str(root)
        paths = [os.path.join(top, entry.path) for entry in file_entries]
        tasks = [_Task((piece,), (paths[piece.file],), False) for piece in pieces.own_chunks]
        for members in pieces.packs:
            tasks.append(_Task(tuple(members), tuple(paths[piece.file] for piece in members), True))
            self._packed = True
        chunk_lists = self._upload_all(tasks, len(file_entries))
        files_seen = 0
        for entry in entries:
            path = str(base / entry.path) if base is not None else entry.path
            chunks: list[ChunkRef] = []
            if entry.kind == "file":
                chunks = chunk_lists[files_seen]
                files_seen += 1
            records.append(
                FileRecord(
                    path=path,
                    kind=entry.kind,
                    mode=entry.mode,
                    size=entry.size,
                    mtime_ns=entry.mtime_ns,
                    target=entry.target,
                    chunks=chunks,
                )
            )
        self._records.extend(records)
        return records

    def _upload_all(self, tasks: list[_Task], file_count: int) -> list[list[ChunkRef]]:
        results: list[dict[int, ChunkRef]] = [{} for _ in range(file_count)]
        slots = threading.BoundedSemaphore(self._config.workers)
        failure: list[BaseException] = []
        with concurrent.futures.ThreadPoolExecutor(
            self._config.workers, thread_name_prefix="ibckpt-up"
        ) as pool:
            futures: list[concurrent.futures.Future[None]] = []

            def run(task: _Task) -> None:
                try:
                    for piece, ref in self._chunk(task):
                        results[piece.file][piece.index] = ref
                except BaseException as error:
                    failure.append(error)
                    raise
                finally:
                    slots.release()

            for task in tasks:
                slots.acquire()
                if failure:
                    slots.release()
                    break
                futures.append(pool.submit(run, task))
            concurrent.futures.wait(futures)
        if failure:
            raise failure[0]
        return [[chunks[index] for index in sorted(chunks)] for chunks in results]

    @staticmethod
    def _read_into(path: str, piece: Piece, into: memoryview) -> None:
        """The piece's bytes into `into` (its length), read in place: no bytes object to copy from."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            done = 0
            while done < piece.length:
                got = os.preadv(fd, [into[done:]], piece.offset + done)
                if not got:
                    raise TreeError(f"{path} shrank while it was being uploaded")
                done += got
        finally:
            os.close(fd)

    def _chunk(self, task: _Task) -> list[tuple[Piece, ChunkRef]]:
        self._check_lease()
        span = self._followed_span(task)
        if span is not None and span.released:
            return self._released_chunk(task, span)
        with self._times.timed("read"):
            # Each piece is read at its place in a buffer that has room for the chunk's header before it:
            # a pack needs no join, and a chunk stored raw is sent from this very buffer (codec.seal_framed).
            size = sum(piece.length for piece in task.pieces)
            buffer = self._buffer(size)
            view, at = memoryview(buffer), codec.HEADER_SIZE
            for path, piece in zip(task.paths, task.pieces, strict=True):
                self._read_into(path, piece, view[at : at + piece.length])
                at += piece.length
        cid, followed = self._chunk_id(task, view[codec.HEADER_SIZE :])
        # A HEAD before the PUT pays only when the chunk is likely there already: a pack changes whenever
        # any of its small files does (CRIU rewrites them all at every dump), and an unchanged one is named
        # by the job's latest manifest. Measured on the host (SeaweedFS): a HEAD costs the client 1.0 ms of
        # CPU, a PUT of 1 MiB 3.3 ms and a refused one 2.8 ms; a new chunk saves a whole request.
        # The multipart upload (boto3's) is not made conditional here: such chunks are looked up first.
        blind_below, single_put = self._config.blind_put_below, size < self._config.multipart_threshold
        # the follower's chunk is most likely there: looked up, not sent again
        blind = blind_below > 0 and single_put and (task.packed or size < blind_below) and not followed
        stored_size = self._ensure_stored(cid, buffer, blind)
        if self._progress is not None:
            self._progress(size)
        return [
            (piece, ChunkRef(id=cid, size=piece.length, stored_size=stored_size, offset=piece.at))
            for piece in task.pieces
        ]

    def _released_chunk(self, task: _Task, span: FollowedSpan) -> list[tuple[Piece, ChunkRef]]:
        """A span the follower punched out of the disk: its bytes are only in the bucket now, so it is
        not read (a hole reads as zeros) and never uploaded from here, only looked up under our lease."""
        if self._sink is not None:
            raise StoreError(f"{task.paths[0]}: a span released from the disk cannot be sealed here")
        with self._known_lock:
            stored_size = self._known.get(span.chunk_id)
        if stored_size is None:
            stored_size = self._existing_size(span.chunk_id)
            if stored_size is None:
                raise ChunkMissingError(
                    f"chunk {span.chunk_id} of {task.paths[0]} at {task.pieces[0].offset}, uploaded during "
                    "the dump and released from the node's disk, is no longer in the bucket",
                    chunk_id=span.chunk_id,
                    checkpoint=f"{self.ref.job}/{self.ref.checkpoint_id}",
                )
            with self._known_lock:
                self._known[span.chunk_id] = stored_size
        piece = task.pieces[0]
        if self._progress is not None:
            self._progress(piece.length)
        return [
            (piece, ChunkRef(id=span.chunk_id, size=piece.length, stored_size=stored_size, offset=piece.at))
        ]

    def _chunk_id(self, task: _Task, plain: memoryview) -> tuple[str, bool]:
        """The id of the task's plain bytes, and whether a follower recorded it: its id is taken while
        the bytes' CRC32 still matches (follow.py), else they are hashed."""
        followed = self._followed_span(task)
        if followed is not None:
            with self._times.timed("verify"):
                if zlib.crc32(plain) == followed.crc32:
                    return followed.chunk_id, True
        with self._times.timed("hash"):
            return codec.chunk_id(hashlib.sha256(plain).digest(), self._context.keys), False

    def _followed_span(self, task: _Task) -> FollowedSpan | None:
        """What the follower recorded for this task's span: whole chunks of one file only."""
        if not self._followed or task.packed or len(task.pieces) != 1:
            return None
        path, piece = task.paths[0], task.pieces[0]
        info = self._stats.get(path)
        if info is None:
            try:
                info = self._stats[path] = os.stat(path)
            except OSError:
                return None
        return self._followed.get(span_key(info, piece.offset))

    def _buffer(self, size: int) -> bytearray:
        """A framed buffer for `size` plain bytes. Full-size chunks (most of them) reuse their thread's: a
        new buffer costs Python's zero fill and the kernel's page faults, two more passes over the chunk.
        Nothing keeps a chunk's buffer once its _chunk returns (a sink gets a copy), so the next may."""
        if size != self._config.chunk_size:
            return codec.framed_buffer(size)
        buffer: bytearray | None = getattr(self._buffers, "full", None)
        if buffer is None:
            buffer = self._buffers.full = codec.framed_buffer(size)
        return buffer

    def _ensure_stored(self, cid: str, buffer: bytearray, blind: bool) -> int:
        """The chunk's stored size, uploading it unless it is known or already in the bucket. `buffer`:
        the chunk's plain bytes after room for its header (codec.framed_buffer)."""
        with self._known_lock:
            if cid in self._known:
                return self._known[cid]
            pending = self._pending.get(cid)
            owner = pending is None
            if pending is None:
                pending = self._pending[cid] = concurrent.futures.Future()
        if not owner:
            return pending.result()  # another thread is storing the same bytes
        try:
            stored_size = self._store(cid, buffer, blind)
        except BaseException as error:
            pending.set_exception(error)
            with self._known_lock:
                del self._pending[cid]
            raise
        with self._known_lock:
            self._known[cid] = stored_size
            del self._pending[cid]
        pending.set_result(stored_size)
        return stored_size

    def _store(self, cid: str, buffer: bytearray, blind: bool) -> int:
        if self._sink is not None:
            stored = bytes(self._seal(cid, buffer))  # the sink keeps it: bytes, which nothing changes
            with self._times.timed("sink"):
                self._sink(cid, stored)
            return len(stored)
        if blind:
            # Conditional: a chunk that is there already keeps its bytes (and the stored size other
            # manifests recorded); only then is it looked up.
            stored_size = self._put(cid, buffer, only_if_absent=True)
            if stored_size is not None:
                return stored_size
        stored_size = self._existing_size(cid)
        if stored_size is None:
            stored_size = self._put(cid, buffer, only_if_absent=False)
        assert stored_size is not None
        return stored_size

    def _existing_size(self, cid: str) -> int | None:
        key = self._context.layout.chunk_key(cid)
        with self._times.timed("exists"), s3_errors(self._context.connection, f"looking up chunk {cid}"):
            try:
                head = self._context.client.head_object(Bucket=self._context.bucket, Key=key)
            except botocore.exceptions.ClientError as error:
                if is_not_found(error) or error_code(error) == "403":
                    # Some servers answer 403 for a missing key when listing is not allowed; upload then.
                    return None
                raise
        return int(head["ContentLength"])

    def _seal(self, cid: str, buffer: bytearray) -> bytearray:
        level = self._config.compression_level
        return seal_framed_chunk(buffer, cid, level, self._context.keys, self._times)

    def _put(self, cid: str, buffer: bytearray, *, only_if_absent: bool) -> int | None:
        """Seal and upload; None if only_if_absent and the bucket has the chunk (or is writing it now)."""
        assert self._lease is not None
        # A bytearray body goes out as it is: botocore hashes it (SigV4, CRC32) and urllib3 sends it in one
        # call. A bytes body is wrapped in a BytesIO that each of the three reads again in copied pieces.
        stored = self._seal(cid, buffer)
        self._limiter.take(len(stored))
        self._lease.check()
        key = self._context.layout.chunk_key(cid)
        with self._times.timed("put"), s3_errors(self._context.connection, f"uploading chunk {cid}"):
            if len(stored) < self._config.multipart_threshold:
                condition = {"IfNoneMatch": "*"} if only_if_absent else {}
                try:
                    self._context.client.put_object(
                        Bucket=self._context.bucket,
                        Key=key,
                        Body=stored,
                        ContentType="application/octet-stream",
                        **condition,
                        **self._context.put_args,
                    )
                except botocore.exceptions.ClientError as error:
                    # a conflict: another writer's conditional PUT of the same key is under way
                    refused = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
                    if only_if_absent and error_code(error) in refused:
                        return None
                    raise
            else:
                self._context.client.upload_fileobj(
                    io.BytesIO(stored),  # chunks this big (a chunk_size set above 64 MiB) are rare
                    self._context.bucket,
                    key,
                    ExtraArgs={"ContentType": "application/octet-stream", **self._context.put_args},
                    Config=self._transfer_config,
                )
        with self._known_lock:
            self._uploaded_chunks += 1
            self._uploaded_bytes += len(stored)
        return len(stored)

    # -- commit ----------------------------------------------------------------------------------------
    def _build(
        self,
        kind: ManifestKind,
        ranks: Iterable[RankInfo],
        versions: Versions | None,
        labels: dict[str, str] | None,
    ) -> Manifest:
        timings = dict(self._times.seconds)
        timings["total"] = time.perf_counter() - self._wall_start
        encryption_mode = self._config.encryption.mode
        return Manifest(
            schema_version=PACKED_SCHEMA_VERSION if self._packed else 1,
            kind=kind,
            job=self.ref.job,
            checkpoint_id=self.ref.checkpoint_id,
            created_at=datetime.now(UTC),
            started_at=self._started_at,
            ranks=list(ranks),
            labels=labels or {},
            versions=(versions or Versions()).model_copy(update={"ibckpt": __version__}),
            compression=Compression(
                codec="zstd" if self._config.compression_level > 0 else "none",
                level=self._config.compression_level,
                chunk_size=self._config.chunk_size,
            ),
            encryption=Encryption(
                mode=encryption_mode,
                kms_key_id=self._config.encryption.kms_key_id if encryption_mode == "sse-kms" else None,
                key_fingerprint=self._context.keys.fingerprint if self._context.keys else None,
            ),
            files=self._records,
            stats=summarize(self._records, self._uploaded_chunks, self._uploaded_bytes),
            timings={stage: round(seconds, 4) for stage, seconds in timings.items()},
        )

    def commit(
        self,
        ranks: Iterable[RankInfo] = (),
        versions: Versions | None = None,
        labels: dict[str, str] | None = None,
    ) -> Manifest:
        """Write the manifest. From this moment the checkpoint exists; before it, it does not."""
        if self._lease is None:
            raise StoreError("CheckpointWriter.commit() before begin(), or with a sink (no S3)")
        if self._committed is None:
            manifest = self._build(MANIFEST_KIND, ranks, versions, labels)
            self._lease.check()
            key = self._context.layout.manifest_key(self.ref)
            self._committed = self._context.put_manifest(key, manifest, f"committing {self.ref}")
        return self._committed

    def stage(self, part: str, ranks: Iterable[RankInfo] = (), versions: Versions | None = None) -> Manifest:
        """Write this writer's files as one part of a checkpoint that several nodes write; the checkpoint
        exists once `ImageStore.commit_parts` has merged the parts into its manifest. Until then the part
        keeps its chunks from garbage collection."""
        if self._lease is None:
            raise StoreError("CheckpointWriter.stage() before begin(), or with a sink (no S3: sealed_part)")
        staged = self._build(PART_KIND, ranks, versions, None)
        self._lease.check()
        key = self._context.layout.part_key(self.ref, check_checkpoint_id(part))
        return self._context.put_manifest(key, staged, f"staging part {part} of {self.ref}")

    def sealed_part(
        self, part: str, ranks: Iterable[RankInfo] = (), versions: Versions | None = None
    ) -> SealedPart:
        """The part manifest `stage` would write, signed for the part's key as it would be, and its bytes;
        written nowhere (a sink's writer has no other way to a part)."""
        if not self._begun:
            raise StoreError("CheckpointWriter.sealed_part() before begin()")
        manifest = self._build(PART_KIND, ranks, versions, None)
        signing = self._context.signing
        if signing is not None:  # as StoreContext.put_manifest signs what it writes
            manifest = manifest.signed(
                signing, self._context.layout.part_key(self.ref, check_checkpoint_id(part))
            )
        return SealedPart(manifest, manifest.to_json())


def summarize(records: list[FileRecord], uploaded_chunks: int, uploaded_bytes: int) -> Stats:
    distinct = {chunk.id: chunk.stored_size for record in records for chunk in record.chunks}
    return Stats(
        files=sum(1 for record in records if record.kind == "file"),
        logical_bytes=sum(record.size for record in records),
        stored_bytes=sum(distinct.values()),
        chunks=sum(len(record.chunks) for record in records),
        distinct_chunks=len(distinct),
        uploaded_chunks=uploaded_chunks,
        uploaded_bytes=uploaded_bytes,
    )
