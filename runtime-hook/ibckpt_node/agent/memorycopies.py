"""This agent's use of the other agents' memory tier (docs/recovery.md, "Tiers"; the holder's side is
memorytier.py): after its part of a checkpoint is staged in S3, it keeps a copy in the memory of the
agent the operator named; a restore reads its chunks from the living copies before S3. Neither ever
fails its session: a copy not made leaves that part in S3 alone, a copy not read is read from S3."""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ibckpt.agentapi import models as api
from ibckpt.agentapi.client import AgentError
from ibckpt.agentapi.memory import PIECE_BYTES, MemoryClient, MemorySeal
from ibckpt.store import ImageStore
from ibckpt.store.download import TransferReport
from ibckpt.store.errors import StoreError
from ibckpt.store.manifest import Manifest
from ibckpt_node.agent.session import Agent
from ibckpt_node.agent.staging import StagedPart

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0


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
        agent.coordinator_tls(), deadline,
    )  # fmt: skip
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
) -> api.MemoryCopyReport:
    """Send this node's part (its chunks as stored, rebuilt from `images`) to `target` in pieces, then seal
    it. Bounded by `deadline` (time.monotonic). Returns what the holder kept, or why it kept nothing."""
    started = time.monotonic()
    job, checkpoint = part.ref.job, part.ref.checkpoint_id
    report = api.MemoryCopyReport(node=target.node, part=node)
    try:
        holder = client(target.address, token_file, tls)
        index: dict[str, tuple[int, int]] = {}
        pending = bytearray()
        sent = 0  # pieces
        size = 0

        def send(piece: bytes) -> None:
            nonlocal sent
            if time.monotonic() > deadline:
                raise TimeoutError("the upload's bound passed")
            holder.put_piece(job, checkpoint, node, sent, piece)
            sent += 1

        for cid, stored in store.stored_chunks(part, images, node):
            index[cid] = (size, len(stored))
            size += len(stored)
            pending += stored
            while len(pending) >= PIECE_BYTES:
                send(bytes(pending[:PIECE_BYTES]))
                del pending[:PIECE_BYTES]
        if pending or sent == 0:
            send(bytes(pending))
        held = holder.seal(job, checkpoint, node, MemorySeal(chunks=index, bytes=size))
    except (AgentError, StoreError, OSError, ValueError) as error:  # TimeoutError is an OSError
        report.message = f"not kept on {target.node}: {error}"[:1000]
        log.warning("%s/%s: this node's part is in S3 only: %s", job, checkpoint, report.message)
        return report
    report.kept, report.chunks, report.bytes = True, held.chunks, held.bytes
    report.seconds = round(time.monotonic() - started, 3)
    report.message = f"kept on {target.node}: {held.chunks} chunks, {held.bytes} bytes"
    return report


@dataclass
class CopyReader:
    """A restore's chunk source (download.restore's chunk_source): each chunk is asked of the copies in turn;
    a copy whose holder failed is not asked again. Called from the download's threads."""

    job: str
    checkpoint: str
    copies: list[tuple[api.MemoryCopySource, MemoryClient]]
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


def reader_for(
    request: api.RestoreRequest, token_file: Path | None, tls: Callable[[], ssl.SSLContext]
) -> CopyReader | None:
    """The restore's chunk source, or None without copies or without a token to read them with."""
    if not request.memory_copies or token_file is None:
        return None
    try:
        context = tls()
        copies = [(s, client(s.address, token_file, context)) for s in request.memory_copies]
        return CopyReader(request.images.job, request.images.checkpoint_id, copies)
    except (OSError, ValueError) as error:
        log.warning("session %s: memory copies not read: %s", request.session_id, error)
        return None
