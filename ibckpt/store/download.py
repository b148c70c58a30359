"""Reading a checkpoint: fetch chunks in parallel, verify each one's hash before use, rebuild the tree.

The tree is rebuilt in a hidden sibling directory and renamed into place only when every chunk has been
verified and written, so a failed restore never leaves a plausible-looking partial tree behind. The manifest
is untrusted input rebuilt as root: see build_tree for what keeps the rebuild inside the tree.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path

from ibckpt.store import codec
from ibckpt.store.context import ProgressCallback, StageTimes, StoreContext
from ibckpt.store.errors import ChunkCorruptError, ChunkError, ChunkMissingError, EncryptionError, StoreError
from ibckpt.store.layout import CheckpointRef
from ibckpt.store.leases import holder_lease, wait_for_sweeps
from ibckpt.store.manifest import FileRecord, Manifest, check_restorable
from ibckpt.store.s3 import missing_as, s3_errors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where bytes of one chunk go: `length` bytes from `start` in the chunk's plain bytes (all of them, or
    one file's slice of a pack) to `offset` in the file at `path` (relative)."""

    path: str
    offset: int
    start: int
    length: int
    whole: bool = False  # the file's only piece: the write creates it (one open instead of two)


@dataclass
class ChunkUse:
    """Every place one chunk's bytes go; a chunk is fetched once however many files share it."""

    places: list[Placement] = field(default_factory=list)

    @property
    def extent(self) -> int:
        """The plain bytes the chunk must have at least."""
        return max(place.start + place.length for place in self.places)

    @property
    def written(self) -> int:
        return sum(place.length for place in self.places)


# A chunk's stored bytes from somewhere other than S3 (the memory tier's copies), or None where it is not
# held. Untrusted: its bytes are verified as S3's are, and a chunk it fails on is read from S3.
ChunkSource = Callable[[str], bytes | None]


@dataclass
class TransferReport:
    ref: CheckpointRef
    logical_bytes: int = 0
    chunks: int = 0
    seconds: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)
    problems: list[ChunkError] = field(default_factory=list)
    source_chunks: int = 0  # read from the chunk source and verified
    source_bytes: int = 0  # their stored bytes
    source_rejected: int = 0  # offered by the source but corrupt: read from S3


@contextmanager
def reading(context: StoreContext, ref: CheckpointRef) -> Iterator[Manifest]:
    """The manifest of `ref`, its encryption key checked, under a reader lease held for the block: no
    chunk sweep runs while the chunks are being fetched."""
    lease = holder_lease(context.connection, context.layout, "reader", ref.job, ref.checkpoint_id)
    with lease:
        wait_for_sweeps(context.connection, context.layout, lease)
        manifest = context.load_manifest(ref)
        _check_key(context, manifest)
        yield manifest


def _check_key(context: StoreContext, manifest: Manifest) -> None:
    wanted = manifest.encryption.key_fingerprint
    have = context.keys.fingerprint if context.keys else None
    if wanted is not None and wanted != have:
        raise EncryptionError(
            f"checkpoint {manifest.ref} was encrypted client-side with key fingerprint {wanted}; "
            + (f"the configured key has fingerprint {have}" if have else "no encryption key is configured")
        )


def select_subtree(files: list[FileRecord], subtree: str | None) -> list[FileRecord]:
    """The records under `subtree` (a directory in the checkpoint), their paths made relative to it."""
    if not subtree:
        return list(files)
    prefix = subtree.strip("/") + "/"
    inside = [r for r in files if r.path.startswith(prefix)]
    chosen = [r.model_copy(update={"path": r.path[len(prefix) :]}) for r in inside]
    if not chosen:
        raise StoreError(f"the checkpoint has no files under {subtree!r}")
    return chosen


def placements(files: list[FileRecord]) -> dict[str, ChunkUse]:
    """chunk id -> every place its bytes go."""
    where: dict[str, ChunkUse] = {}
    for record in files:
        offset = 0
        whole = len(record.chunks) == 1
        for chunk in record.chunks:
            place = Placement(record.path, offset, chunk.offset, chunk.size, whole)
            where.setdefault(chunk.id, ChunkUse()).places.append(place)
            offset += chunk.size
    return where


def _missing(ref: CheckpointRef, cid: str, where: str) -> ChunkMissingError:
    return ChunkMissingError(
        f"chunk {cid} of checkpoint {ref} is missing ({where})", chunk_id=cid, checkpoint=str(ref)
    )


def fetch_chunk(
    context: StoreContext, ref: CheckpointRef, cid: str, size: int, times: StageTimes
) -> bytes | memoryview:
    """One chunk's plain bytes, verified against its id and at least `size` long; ChunkError names the chunk
    and the checkpoint. No CRC32 of the response (s3.connect): the id check below covers every byte."""
    key = context.layout.chunk_key(cid)
    with (
        times.timed("get"),
        s3_errors(context.connection, f"fetching chunk {cid} of {ref}"),
        missing_as(lambda: _missing(ref, cid, f"{context.connection.where()}, key {key}")),
    ):
        stored = context.client.get_object(Bucket=context.bucket, Key=key)["Body"].read()
    return open_verified(context, ref, cid, size, stored, times, f"key {key}")


def open_verified(
    context: StoreContext,
    ref: CheckpointRef,
    cid: str,
    size: int,
    stored: bytes,
    times: StageTimes,
    where: str,
) -> bytes | memoryview:
    """A chunk's plain bytes from its stored bytes, verified against its id and at least `size` long;
    ChunkCorruptError names the chunk, the checkpoint and `where` the bytes came from."""
    try:
        with times.timed("decode"):
            plain = codec.open_chunk(stored, cid, context.keys)
    except codec.CodecError as error:
        raise ChunkCorruptError(
            f"chunk {cid} of checkpoint {ref} is corrupt: {error} ({where})",
            chunk_id=cid,
            checkpoint=str(ref),
        ) from None
    with times.timed("hash"):
        actual = codec.chunk_id(hashlib.sha256(plain).digest(), context.keys)
    if actual != cid or len(plain) < size:
        raise ChunkCorruptError(
            f"chunk {cid} of checkpoint {ref} is corrupt: its content hashes to {actual} "
            f"({len(plain)} bytes, {size} needed) ({where})",
            chunk_id=cid,
            checkpoint=str(ref),
        )
    return plain


def restore(
    context: StoreContext,
    ref: CheckpointRef,
    destination: Path,
    *,
    progress: ProgressCallback | None = None,
    subtree: str | None = None,
    chunk_source: ChunkSource | None = None,
    manifest: Manifest | None = None,
    source_only: bool = False,
) -> TransferReport:
    """Rebuild checkpoint `ref` at `destination`, which must not exist or be an empty directory.
    `subtree`: only that directory of the checkpoint (a node's part of it), as the destination's root.
    `chunk_source`: asked for each chunk before S3 (the memory tier). `manifest`: the checkpoint's,
    already verified by the caller (it came from elsewhere than S3), read from S3 otherwise, under a reader
    lease. `source_only`: S3 is not read at all: a chunk the source does not give fails the restore."""
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise StoreError(f"restore destination {destination} exists and is not an empty directory")
    if source_only and (manifest is None or chunk_source is None):
        raise StoreError("a restore without S3 needs the manifest and a chunk source")
    workers = context.connection.config.workers
    report = TransferReport(ref)
    times = StageTimes()
    started = time.perf_counter()
    given: AbstractContextManager[Manifest] | None = None
    if manifest is not None:
        _check_key(context, manifest)
        given = nullcontext(manifest)
    with given or reading(context, ref) as manifest:
        staging = destination.parent / f".{destination.name}.partial-{secrets.token_hex(4)}"
        files = select_subtree(manifest.files, subtree)
        # Again for the subtree: a link that stays inside the checkpoint may leave the part restored.
        check_restorable(files, f"checkpoint {ref}" + (f" (subtree {subtree!r})" if subtree else ""))
        uses = placements(files)
        staging.mkdir(parents=True)
        try:
            sourced = _SourceCounts(chunk_source, report)

            def fetch_and_write(root_fd: int, cid: str) -> int:
                use = uses[cid]
                found = sourced.plain(context, ref, cid, use.extent, times)
                if found is None and source_only:
                    raise _missing(ref, cid, "not given by the chunk source, and S3 is not read")
                plain = memoryview(
                    found if found is not None else fetch_chunk(context, ref, cid, use.extent, times)
                )
                with times.timed("write"):
                    for place in use.places:
                        piece = plain[place.start : place.start + place.length]
                        _write_at(root_fd, place.path, place.offset, piece, create=place.whole)
                if progress is not None:
                    progress(use.written)
                return use.written

            def fill(root_fd: int) -> None:
                with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ibckpt-down") as pool:
                    futures = [pool.submit(fetch_and_write, root_fd, cid) for cid in uses]
                    try:
                        for future in concurrent.futures.as_completed(futures):
                            report.logical_bytes += future.result()
                    except BaseException:
                        for future in futures:
                            future.cancel()
                        raise

            build_tree(staging, files, fill)
            if destination.exists():
                destination.rmdir()
            staging.rename(destination)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    report.chunks = len(uses)
    report.seconds = time.perf_counter() - started
    report.stages = dict(times.seconds)
    return report


class _SourceCounts:
    """A restore's chunk source, asked from the download threads, and what it gave (into the report).
    A failure and a rejection are each logged once per restore: a copy sealed with another key, or a
    holder gone, would otherwise log every chunk."""

    def __init__(self, source: ChunkSource | None, report: TransferReport) -> None:
        self.source = source
        self.report = report
        self.lock = threading.Lock()
        self.warned: set[str] = set()

    def _warn_once(self, kind: str, ref: CheckpointRef, problem: object) -> None:
        with self.lock:
            first = kind not in self.warned
            self.warned.add(kind)
        if first:
            log.warning("restore of %s: %s; reading S3 instead (logged once)", ref, problem)

    def plain(
        self, context: StoreContext, ref: CheckpointRef, cid: str, size: int, times: StageTimes
    ) -> bytes | memoryview | None:
        if self.source is None:
            return None
        try:
            with times.timed("source"):
                stored = self.source(cid)
        except Exception as error:  # a source that failed is a source that does not have it
            self._warn_once("failed", ref, f"the chunk source failed ({error!r})")
            return None
        if stored is None:
            return None
        try:
            plain = open_verified(context, ref, cid, size, stored, times, "from the chunk source")
        except ChunkCorruptError as error:
            self._warn_once("rejected", ref, error)
            with self.lock:
                self.report.source_rejected += 1
            return None
        with self.lock:
            self.report.source_chunks += 1
            self.report.source_bytes += len(stored)
        return plain


# Every path of the tree is reached one component at a time from the tree's own directory fd, never through
# a symlink: not one from the manifest (check_restorable refuses those anyway), nor one on disk (a race, a
# pre-existing tree). A symlink where a directory or file is expected fails with ELOOP or ENOTDIR.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# No setuid, setgid or sticky bit, no group or other write: the tree is rebuilt as root from bucket bytes.
MODE_MASK = 0o777 & ~0o022


def open_root(root: Path) -> int:
    """An fd of the (new) restore directory, the anchor for every other path of the tree."""
    return os.open(root, _DIR_FLAGS)


def _open_dir(root_fd: int, rel: str, *, create: bool) -> int:
    """An fd of directory `rel` ('' for the root), made (0o700 until its mode is set) if `create`."""
    fd = os.dup(root_fd)
    try:
        for name in rel.split("/") if rel else ():
            if create:
                # Something already there is opened below without following: it must be a directory.
                with suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as error:
                raise StoreError(
                    f"restore: {name!r} on the way to {rel!r} is not a directory: {error}"
                ) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _in_parent(root_fd: int, path: str, *, create: bool) -> tuple[int, str]:
    """(fd of the directory of `path`, its last component); the caller closes the fd."""
    parent, _, name = path.rpartition("/")
    return _open_dir(root_fd, parent, create=create), name


def _make_skeleton(root_fd: int, records: list[FileRecord]) -> None:
    """Directories, and empty files of the right size for the files written in several pieces (or none);
    contents come later, symlinks after them. A file in one piece is made by the write of that piece."""
    made = {""}
    for record in records:
        if record.kind == "dir" and record.path not in made:
            os.close(_open_dir(root_fd, record.path, create=True))
            made.add(record.path)
        elif record.kind == "file":
            parent = record.path.rpartition("/")[0]
            if parent not in made:
                os.close(_open_dir(root_fd, parent, create=True))
                made.add(parent)
            if len(record.chunks) != 1:
                parent_fd, name = _in_parent(root_fd, record.path, create=False)
                try:
                    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                    fd = os.open(name, flags, 0o600, dir_fd=parent_fd)
                finally:
                    os.close(parent_fd)
                try:
                    os.ftruncate(fd, record.size)
                finally:
                    os.close(fd)


def _make_symlinks(root_fd: int, records: list[FileRecord]) -> None:
    # After every write. Nothing is written through a link anyway (no path is followed); their targets were
    # checked to stay inside the tree.
    for record in records:
        if record.kind == "symlink":
            parent_fd, name = _in_parent(root_fd, record.path, create=True)
            try:
                os.symlink(record.target or "", name, dir_fd=parent_fd)
            finally:
                os.close(parent_fd)


def _write_at(root_fd: int, path: str, offset: int, data: bytes | memoryview, *, create: bool) -> None:
    parent_fd, name = _in_parent(root_fd, path, create=False)
    try:
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(name, flags, 0o600, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)
    try:
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, offset)
            view = view[written:]
            offset += written
    finally:
        os.close(fd)


def _finish_metadata(root_fd: int, records: list[FileRecord]) -> None:
    """Modes (masked) and mtimes, deepest paths first so that a read-only directory is closed after its
    children; last of all, so that making links does not change their directories' mtimes. Set through an
    fd opened without following (Linux has no chmod that refuses a link), and never on a link."""
    for record in sorted(records, key=lambda record: record.path.count("/"), reverse=True):
        if record.kind == "symlink":
            continue
        parent_fd, name = _in_parent(root_fd, record.path, create=False)
        try:
            flags = (
                _DIR_FLAGS
                if record.kind == "dir"
                else os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            )
            fd = os.open(name, flags, dir_fd=parent_fd)
        except OSError as error:
            raise StoreError(
                f"restore: {record.path!r} is not the {record.kind} it was made as: {error}"
            ) from None
        finally:
            os.close(parent_fd)
        try:
            if record.kind == "file" and not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StoreError(f"restore: {record.path!r} is not the file it was made as")
            os.fchmod(fd, record.mode & MODE_MASK)
            if record.mtime_ns:
                os.utime(fd, ns=(record.mtime_ns, record.mtime_ns))
        finally:
            os.close(fd)


def build_tree(root: Path, records: list[FileRecord], fill: Callable[[int], None]) -> None:
    """Rebuild `records` in the empty directory `root`: check them, make directories and files, let
    `fill(root_fd)` write the files' bytes (_write_at), then make the links and set modes and mtimes."""
    check_restorable(records, f"the tree for {root}")
    root_fd = open_root(root)
    try:
        _make_skeleton(root_fd, records)
        fill(root_fd)
        _make_symlinks(root_fd, records)
        _finish_metadata(root_fd, records)
    finally:
        os.close(root_fd)


def verify(
    context: StoreContext, ref: CheckpointRef, *, deep: bool = True, progress: ProgressCallback | None = None
) -> TransferReport:
    """Check every chunk of a checkpoint. deep: fetch and hash each; otherwise only that each exists with the
    recorded size. Problems are collected (not raised), so one run lists all of them."""
    report = TransferReport(ref)
    times = StageTimes()
    started = time.perf_counter()
    with reading(context, ref) as manifest:
        uses = placements(manifest.files)
        stored_sizes = manifest.chunk_sizes()

        def check(cid: str) -> int:
            use = uses[cid]
            try:
                if deep:
                    fetch_chunk(context, ref, cid, use.extent, times)
                else:
                    _check_exists(context, ref, cid, stored_sizes[cid])
            except ChunkError as problem:
                report.problems.append(problem)
            if progress is not None:
                progress(use.written)
            return use.written

        with concurrent.futures.ThreadPoolExecutor(
            context.connection.config.workers, thread_name_prefix="ibckpt-verify"
        ) as pool:
            for future in [pool.submit(check, cid) for cid in uses]:
                report.logical_bytes += future.result()
    report.chunks = len(uses)
    report.seconds = time.perf_counter() - started
    report.stages = dict(times.seconds)
    report.problems.sort(key=lambda problem: problem.chunk_id)
    return report


def _check_exists(context: StoreContext, ref: CheckpointRef, cid: str, stored_size: int) -> None:
    key = context.layout.chunk_key(cid)
    with (
        s3_errors(context.connection, f"looking up chunk {cid} of {ref}"),
        missing_as(lambda: _missing(ref, cid, f"key {key}")),
    ):
        head = context.client.head_object(Bucket=context.bucket, Key=key)
    if int(head["ContentLength"]) != stored_size:
        raise ChunkCorruptError(
            f"chunk {cid} of checkpoint {ref} has {head['ContentLength']} bytes stored, "
            f"{stored_size} expected",
            chunk_id=cid,
            checkpoint=str(ref),
        )
