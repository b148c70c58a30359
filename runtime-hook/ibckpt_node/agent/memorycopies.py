"""This agent's use of the other agents' memory tier (docs/recovery.md, "Tiers"; the holder's side is
memorytier.py): after its part of a checkpoint is staged in S3, it keeps a copy in the memory of the
agent the operator named; a restore reads its chunks from the living copies before S3. Neither ever
fails its session: a copy not made leaves that part in S3 alone, a copy not read is read from S3.

When the job commits on the memory tier (MemoryCopyTarget.first) the copy comes first, written straight
from the images as the upload would store them and sealed with the part's signed manifest
(keep_first); a restore of such a checkpoint may read memory alone (restoring.py, memory_only)."""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ibckpt.agentapi import models as api
from ibckpt.agentapi.client import AgentError
from ibckpt.agentapi.memory import PIECE_BYTES, HeldCopy, MemoryClient, MemorySeal
from ibckpt.store import ImageStore
from ibckpt.store.download import TransferReport
from ibckpt.store.errors import StoreError
from ibckpt.store.layout import CheckpointRef
from ibckpt.store.manifest import Manifest
from ibckpt_node.agent.session import Agent
from ibckpt_node.agent.staging import StagedPart, seal_part

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

    from ibckpt.store import ManifestKeys, StoreConfig
    from ibckpt_node.agent.memorytier import MemoryShelf

log = logging.getLogger(__name__)


class Holder(Protocol):
    """Where a restore reads a copy: another agent (MemoryClient) or this one's own shelf (OwnShelf)."""

    def chunk(self, job: str, checkpoint: str, part: str, chunk_id: str) -> bytes | None: ...

    def part_manifest(self, job: str, checkpoint: str, part: str) -> bytes | None: ...

    def manifest(self, job: str, checkpoint: str) -> bytes | None: ...


CALL_TIMEOUT_S = 30.0
# A piece's call that failed on its way may have left the holder without it: it is asked, and the piece
# sent once more. 0: no answer (reset, timeout); 408: the holder did not get the whole piece in time.
RESENDABLE = frozenset({0, 408})


def client(address: str, token_file: Path, tls: ssl.SSLContext) -> MemoryClient:
    """A client of the agent at host:port (an IPv6 host in brackets), with this agent's token as it is now
    (the kubelet renews the file)."""
    host, _, port = address.rpartition(":")
    token = token_file.read_text().strip()
    return MemoryClient(host.strip("[]"), int(port), tls=tls, token=token, timeout_s=CALL_TIMEOUT_S)


async def keep_within(
    agent: Agent, target: api.MemoryCopyTarget, staged: StagedPart, images: Path, deadline: float
) -> api.MemoryCopyReport:
    """keep(), for a session's upload, from the event loop: bounded by `deadline` (time.monotonic)."""
    if agent.memory_token_file is None:
        return api.MemoryCopyReport(node=target.node, part=agent.node, message="no memory-tier token here")
    work = asyncio.to_thread(
        keep, staged.store, staged.part, images, agent.node, target, agent.memory_token_file,
        agent.coordinator_tls(), deadline, staged.released,
    )  # fmt: skip
    return await _bounded(work, agent, target, deadline)


async def _bounded(
    work: Awaitable[api.MemoryCopyReport], agent: Agent, target: api.MemoryCopyTarget, deadline: float
) -> api.MemoryCopyReport:
    """A copy's thread, waited for until `deadline` and one call's timeout more (its last call's)."""
    try:
        return await asyncio.wait_for(work, max(1.0, deadline - time.monotonic()) + CALL_TIMEOUT_S)
    except TimeoutError:
        return api.MemoryCopyReport(node=target.node, part=agent.node, message="not kept: the bound passed")


def keep(
    store: ImageStore,
    part: Manifest,
    images: Path,
    node: str,
    target: api.MemoryCopyTarget,
    token_file: Path,
    tls: ssl.SSLContext,
    deadline: float,
    released: Collection[str] = (),
) -> api.MemoryCopyReport:
    """Send this node's part (its chunks as stored, rebuilt from `images`, or read from S3 if `released`
    from the disk during the dump) to `target` in pieces, then seal it. Bounded by `deadline`
    (time.monotonic). Returns what the holder kept, or why it kept nothing."""
    started = time.monotonic()
    job, checkpoint = part.ref.job, part.ref.checkpoint_id
    report = api.MemoryCopyReport(node=target.node, part=node)
    try:
        pieces = Pieces(client(target.address, token_file, tls), (job, checkpoint, node), deadline)
        for cid, stored in store.stored_chunks(part, images, node, released):
            pieces.add(cid, stored)
        held = pieces.seal(None)
    except (AgentError, StoreError, OSError, ValueError) as error:  # TimeoutError is an OSError
        return _not_kept(report, error, f"{job}/{checkpoint}: this node's part is in S3 only")
    return _kept(report, held, started)


class Pieces:
    """A copy on its way to the holder: chunks appended as they come (from several threads), sent in
    pieces of PIECE_BYTES, then sealed with their index. Holds at most one piece besides the chunk."""

    def __init__(self, holder: MemoryClient, key: tuple[str, str, str], deadline: float) -> None:
        self.holder, self.key, self.deadline = holder, key, deadline
        self.index: dict[str, tuple[int, int]] = {}
        self.pending = bytearray()
        self.sent = 0  # pieces
        self.offset = 0  # the bytes of the pieces sent
        self.size = 0
        self.lock = threading.Lock()

    def add(self, cid: str, stored: bytes) -> None:
        with self.lock:  # in order: the holder takes piece n after n-1
            if cid in self.index:
                return
            self.index[cid] = (self.size, len(stored))
            self.size += len(stored)
            self.pending += stored
            while len(self.pending) >= PIECE_BYTES:
                self._send(bytes(self.pending[:PIECE_BYTES]))
                del self.pending[:PIECE_BYTES]

    def seal(self, manifest: str | None) -> HeldCopy:
        with self.lock:
            if self.pending or self.sent == 0:
                self._send(bytes(self.pending))
                self.pending.clear()
            return self.holder.seal(
                *self.key, MemorySeal(chunks=self.index, bytes=self.size, manifest=manifest)
            )

    def _send(self, piece: bytes) -> None:
        if time.monotonic() > self.deadline:
            raise TimeoutError("the upload's bound passed")
        try:
            self.holder.put_piece(*self.key, self.sent, piece)
        except AgentError as error:
            if error.status not in RESENDABLE or not self._resend(piece):
                raise
        self.sent += 1
        self.offset += len(piece)

    def _resend(self, piece: bytes) -> bool:
        """After a piece's call failed on the way (a holder slow to read it, under load, answers 408):
        True once the holder has it, asking what it holds and sending it once more if it has not."""
        job, checkpoint, part = self.key
        try:
            held = next(
                (c for c in self.holder.copies().copies
                 if (c.job, c.checkpoint, c.part) == self.key and not c.sealed),
                None,
            )  # fmt: skip
        except AgentError:
            return False
        got = 0 if held is None else held.bytes
        if got == self.offset + len(piece) and held is not None:
            return True  # it arrived; its answer was lost
        if got != self.offset and self.sent > 0:
            return False  # not where this copy left it (dropped for room, or sent again by another)
        if time.monotonic() > self.deadline:
            return False
        log.info("%s/%s/%s: piece %d sent again", job, checkpoint, part, self.sent)
        self.holder.put_piece(*self.key, self.sent, piece)
        return True


def _kept(report: api.MemoryCopyReport, held: HeldCopy, started: float) -> api.MemoryCopyReport:
    report.kept, report.chunks, report.bytes = True, held.chunks, held.bytes
    report.seconds = round(time.monotonic() - started, 3)
    report.message = f"kept on {report.node}: {held.chunks} chunks, {held.bytes} bytes"
    return report


def _not_kept(report: api.MemoryCopyReport, error: BaseException, then: str) -> api.MemoryCopyReport:
    report.message = f"not kept on {report.node}: {error}"[:1000]
    log.warning("%s: %s", then, report.message)
    return report


async def keep_first_within(
    agent: Agent,
    target: api.MemoryCopyTarget,
    config: StoreConfig,
    destination: api.ImageDestination,
    images: Path,
    trees: Sequence[tuple[str, str]],
    keys: ManifestKeys,
    devices: Mapping[str, Mapping[str, Any]] | None,
    deadline: float,
) -> api.MemoryCopyReport:
    """keep_first, for a session's upload, from the event loop: bounded by `deadline` (time.monotonic)."""
    if agent.memory_token_file is None:
        return api.MemoryCopyReport(node=target.node, part=agent.node, message="no memory-tier token here")
    work = asyncio.to_thread(
        keep_first, config, destination, agent.node, images, trees, keys, devices, target,
        agent.memory_token_file, agent.coordinator_tls(), deadline,
    )  # fmt: skip
    return await _bounded(work, agent, target, deadline)


def keep_first(
    config: StoreConfig,
    destination: api.ImageDestination,
    node: str,
    images: Path,
    trees: Sequence[tuple[str, str]],
    keys: ManifestKeys,
    devices: Mapping[str, Mapping[str, Any]] | None,
    target: api.MemoryCopyTarget,
    token_file: Path,
    tls: ssl.SSLContext,
    deadline: float,
) -> api.MemoryCopyReport:
    """This node's part written straight to `target`, before (and without) S3: every distinct chunk as the
    upload would store it, streamed in pieces as the writer seals them, then the copy sealed with the
    part's signed manifest, which lets the operator commit the checkpoint from the holders' memory.
    Bounded by `deadline`; returns what the holder kept, or why it kept nothing."""
    started = time.monotonic()
    report = api.MemoryCopyReport(node=target.node, part=node)
    try:
        key = (destination.job, destination.checkpoint_id, node)
        pieces = Pieces(client(target.address, token_file, tls), key, deadline)
        part = seal_part(config, destination, node, images, trees, keys, pieces.add, devices)
        held = pieces.seal(part.data.decode())
    except (AgentError, StoreError, OSError, ValueError) as error:  # TimeoutError is an OSError
        where = f"{destination.job}/{destination.checkpoint_id}"
        return _not_kept(report, error, f"{where}: no copy before the upload, which goes on")
    return _kept(report, held, started)


@dataclass
class CopyReader:
    """A restore's chunk source (download.restore's chunk_source): each chunk is asked of the copies in turn;
    a copy whose holder failed is not asked again. Called from the download's threads."""

    job: str
    checkpoint: str
    copies: list[tuple[api.MemoryCopySource, Holder]]
    failed: set[str] = field(default_factory=set)
    served: dict[str, int] = field(default_factory=dict)  # holder -> chunks it gave
    lock: threading.Lock = field(default_factory=threading.Lock)
    # what the store accepted, over every container restored (tally)
    chunks: int = 0
    stored_bytes: int = 0
    rejected: int = 0
    fetched: int = 0  # every chunk the restores read, from memory or S3

    def tally(self, restored: TransferReport) -> None:
        self.fetched += restored.chunks
        self.chunks += restored.source_chunks
        self.stored_bytes += restored.source_bytes
        self.rejected += restored.source_rejected

    def __call__(self, chunk_id: str) -> bytes | None:
        for source, holder in self.copies:
            if source.node in self.failed:
                continue
            try:
                stored = holder.chunk(self.job, self.checkpoint, source.part, chunk_id)
            except AgentError as error:
                with self.lock:
                    self.failed.add(source.node)
                log.warning(
                    "memory copy of part %s on %s: %s; reading S3 instead", source.part, source.node, error
                )
                continue
            if stored is not None:
                with self.lock:
                    self.served[source.node] = self.served.get(source.node, 0) + 1
                return stored
        return None

    def report(self) -> api.MemoryCopyReport:
        """What the restore took from memory (the store's counts: verified chunks and their bytes)."""
        holders = sorted(self.served)
        parts = sorted({s.part for s, _ in self.copies if s.node in self.served})
        from_s3 = max(0, self.fetched - self.chunks)
        message = f"{self.chunks} chunks from memory, {from_s3} from S3, {self.rejected} rejected"
        if self.failed:
            message += f"; not reachable: {', '.join(sorted(self.failed))}"
        return api.MemoryCopyReport(node=",".join(holders), part=",".join(parts), kept=self.chunks > 0,
                                    chunks=self.chunks, bytes=self.stored_bytes, message=message)  # fmt: skip


def read_manifest(store: ImageStore, ref: CheckpointRef, copies: CopyReader) -> Manifest:
    """The checkpoint's signed manifest from the first holder that keeps it, verified as one read from S3
    is (StoreError otherwise: a forged one is refused, not passed over). StoreError when none has it."""
    asked: list[str] = []
    for source, holder in copies.copies:
        if source.node in asked:
            continue
        asked.append(source.node)
        try:
            data = holder.manifest(ref.job, ref.checkpoint_id)
        except AgentError as error:
            log.warning("the manifest of %s on %s: %s", ref, source.node, error)
            continue
        if data is not None:
            return store.manifest_from(ref, data, f"the memory of {source.node}")
    raise StoreError(f"no holder keeps the manifest of {ref} (asked {', '.join(asked) or 'none'})")


class OwnShelf:
    """This agent's own copies, read in-process as a MemoryClient reads another agent's: a restore onto the
    node that holds the copy (a recovery's usual case: the buddy of the dead node) goes through no TLS and
    no HTTP of its own server. The chunks are verified by their ids as any other's."""

    def __init__(self, shelf: MemoryShelf) -> None:
        self.shelf = shelf

    def chunk(self, job: str, checkpoint: str, part: str, chunk_id: str) -> bytes | None:
        view = self.shelf.chunk((job, checkpoint, part), chunk_id)
        return None if view is None else bytes(view)

    def part_manifest(self, job: str, checkpoint: str, part: str) -> bytes | None:
        return self.shelf.part_manifest((job, checkpoint, part))

    def manifest(self, job: str, checkpoint: str) -> bytes | None:
        return self.shelf.manifest(job, checkpoint)


def reader_for(
    request: api.RestoreRequest,
    token_file: Path | None,
    tls: Callable[[], ssl.SSLContext],
    agent: Agent | None = None,
) -> CopyReader | None:
    """The restore's chunk source, or None without copies or without a token to read them with. The copies
    `agent` holds itself are read from its shelf."""
    if not request.memory_copies or token_file is None:
        return None
    own = agent.shelf if agent is not None else None

    def holder(source: api.MemoryCopySource, context: ssl.SSLContext) -> Holder:
        if own is not None and agent is not None and source.node == agent.node:
            return OwnShelf(own)
        return client(source.address, token_file, context)

    try:
        context = tls()
        copies = [(s, holder(s, context)) for s in request.memory_copies]
        return CopyReader(request.images.job, request.images.checkpoint_id, copies)
    except (OSError, ValueError) as error:
        log.warning("session %s: memory copies not read: %s", request.session_id, error)
        return None
