"""The durable tier after a commit on the memory tier (commitOn Memory, docs/recovery.md "Tiers"): the
agents go on uploading their parts to S3 after their copies; once every node's part is staged, they are
merged (commit_parts, the same restore record) and the Checkpoint says [S3, Memory].

It runs detached from the CheckpointJob (Runtime.detach): the job succeeds at the memory commit and its
ranks run on, while this waits for the uploads, bounded by the job's upload timeout from the commit.
Past it, the Checkpoint stays in memory only and says so (Event UploadNotFinished); the parts left
staged are removed by the store's garbage collection. The Checkpoint's status.upload records it
(InProgress and the deadline): an operator started meanwhile takes it up again (resume), with the time
left to that deadline and the restore record read from the manifest a holder keeps."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from ibckpt.agentapi import AgentError
from ibckpt.api import CHECKPOINT, Checkpoint, CheckpointUpload, UploadState
from ibckpt.store import StoreConfig
from ibckpt_operator.cluster import storage
from ibckpt_operator.drivers import memorycopies
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.machine import memorytier

if TYPE_CHECKING:
    from ibckpt.store import ImageStore

log = logging.getLogger(__name__)

POLL_SECONDS = 2.0


@dataclass(frozen=True)
class Pending:
    """A Checkpoint waiting for its background commit to S3: what its outcome is written into."""

    namespace: str
    name: str  # the Checkpoint object's
    parts: tuple[str, ...]  # the job's nodes: each stages one part
    deadline: datetime  # the commit plus the job's upload timeout (status.upload.deadline)


@dataclass(frozen=True)
class Upload(Pending):
    """One checkpoint's background commit to S3."""

    job: str  # the job in the store
    checkpoint_id: str
    # the restore record, as the memory commit signed it; None: read at the merge from the manifest a
    # holder keeps (a resumed upload: the operator that signed it is gone)
    labels: dict[str, str] | None
    config: StoreConfig
    bound_seconds: float | None = None  # the job's upload timeout, for the message; None: resumed


def deadline_after(seconds: float, now: datetime) -> datetime:
    """status.upload.deadline: `seconds` (the job's upload timeout) from the memory commit's publish."""
    return now + timedelta(seconds=seconds)


def seconds_left(deadline: datetime, now: datetime) -> float:
    """How long a (resumed) upload may still wait; 0 past the deadline. A deadline without a zone is UTC."""
    if deadline.tzinfo is None:
        deadline = deadline.replace(tzinfo=UTC)
    return max(0.0, (deadline - now).total_seconds())


async def commit_when_uploaded(rt: Runtime, upload: Upload, poll: float = POLL_SECONDS) -> None:
    """Merge the staged parts into the manifest in S3 once all are there, then say [S3, Memory]; or, past
    the bound, say the upload did not finish. A failure reading the store is retried until the bound."""
    from ibckpt.store import CheckpointRef
    from ibckpt.store.parts import commit_parts, staged_parts

    ref = CheckpointRef(upload.job, upload.checkpoint_id)
    deadline = time.monotonic() + seconds_left(upload.deadline, datetime.now(UTC))
    problem = ""
    while time.monotonic() < deadline:
        try:
            image_store = await asyncio.to_thread(storage.open_store, upload.config)
            staged = await asyncio.to_thread(staged_parts, image_store.context, ref)
            if set(upload.parts) <= staged:
                labels = (
                    upload.labels if upload.labels is not None else await held_labels(rt, upload, image_store)
                )
                commit = functools.partial(
                    commit_parts, image_store.context, upload.job, upload.checkpoint_id, upload.parts,
                    labels=labels,
                )  # fmt: skip
                await asyncio.to_thread(commit)
                await said(rt, upload, True, "in S3: the background upload was merged")
                return
            problem = f"parts missing in S3: {', '.join(sorted(set(upload.parts) - staged))}"
        except Exception as error:  # the store may come back within the bound
            problem = str(error)
            log.info("checkpoint %s/%s: S3 commit not done yet: %s", upload.namespace, upload.name, error)
        await asyncio.sleep(poll)
    await said(rt, upload, False, not_finished(upload, problem))


def not_finished(upload: Pending, problem: str) -> str:
    seconds = upload.bound_seconds if isinstance(upload, Upload) else None
    bound = f"within {seconds:g}s" if seconds is not None else "by its deadline"
    why = f" ({problem})" if problem else ""
    return f"the S3 upload did not finish {bound}{why}: the checkpoint is held in memory only"


async def held_labels(rt: Runtime, upload: Upload, image_store: ImageStore) -> dict[str, str]:
    """The restore record the memory commit signed, byte for byte: the labels of the merged manifest a
    holder keeps, verified as one read from the bucket (signed for its key). Recomputing it from the
    Checkpoint would not do: the record's timings were taken at the commit, not at the publish."""
    from ibckpt.store import CheckpointRef, StoreError

    body = await rt.kube.get_custom(CHECKPOINT.plural, upload.namespace, upload.name)
    if body is None:
        raise StoreError(f"checkpoint {upload.namespace}/{upload.name} is gone")
    held, agents = await memorycopies.held_now(rt, Checkpoint.from_wire(body))
    ref = CheckpointRef(upload.job, upload.checkpoint_id)
    for holder in sorted({copy.node for copy in held}):
        try:
            data = await rt.gateway.held_manifest(agents[holder], upload.job, upload.checkpoint_id)
            if data is not None:
                return image_store.manifest_from(ref, data, f"the holder {holder}").labels
        except (AgentError, StoreError) as error:  # another holder may keep it
            log.info(
                "checkpoint %s/%s: no manifest from %s: %s", upload.namespace, upload.name, holder, error
            )
    raise StoreError(f"no ready holder keeps the signed manifest of {ref}: its restore record is unknown")


async def resume(rt: Runtime, body: dict[str, Any]) -> None:
    """Operator start: take up the background commit to S3 a previous operator left InProgress, with the
    time left to its deadline (none left: NotFinished at once)."""
    checkpoint = Checkpoint.from_wire(body)
    recorded = checkpoint.status.upload if checkpoint.status else None
    meta, spec = checkpoint.metadata, checkpoint.spec
    if recorded is None or recorded.state != UploadState.IN_PROGRESS or meta is None:
        return
    assert meta.namespace and meta.name
    pending = Pending(meta.namespace, meta.name, tuple(spec.nodes or ()), recorded.deadline)
    if seconds_left(pending.deadline, datetime.now(UTC)) <= 0:
        await said(rt, pending, False, not_finished(pending, "the operator started past it"))
        return
    # the storage as the Checkpoint names it (handlers/checkpoint.py delete_images resolves it the same way)
    location = await storage.location_of(rt.kube, meta.namespace, spec.storage_ref, spec.storage)
    resolved = await storage.resolve(rt.kube, meta.namespace, location)
    upload = Upload(
        **vars(pending), job=spec.job_name or "", checkpoint_id=spec.checkpoint_id or "", labels=None,
        config=resolved.config,
    )  # fmt: skip
    log.info("checkpoint %s/%s: the S3 commit is taken up again", meta.namespace, meta.name)
    rt.detach(commit_when_uploaded(rt, upload), f"s3 commit {meta.namespace}/{meta.name}")


async def said(rt: Runtime, upload: Pending, durable: bool, message: str) -> None:
    """Write the outcome into the Checkpoint's status, and an Event on it."""
    body = await rt.kube.get_custom(CHECKPOINT.plural, upload.namespace, upload.name)
    if body is None:
        log.info("checkpoint %s/%s is gone: %s", upload.namespace, upload.name, message)
        return
    checkpoint = Checkpoint.from_wire(body)
    copies = memorycopies.recorded(checkpoint)
    state = UploadState.MERGED if durable else UploadState.NOT_FINISHED
    status: dict[str, object] = {
        "message": message,
        "upload": CheckpointUpload(state=state, deadline=upload.deadline).to_wire(),
    }
    if durable:  # restorable from S3 whatever became of the copies meanwhile
        status["tiers"] = [t.value for t in memorytier.tiers(copies, upload.parts)]
        status["readyToRestore"] = True
    with contextlib.suppress(Exception):
        await rt.kube.patch_status(CHECKPOINT.plural, upload.namespace, upload.name, status)
        reason = "UploadedToS3" if durable else "UploadNotFinished"
        await rt.kube.post_event(body, "Normal" if durable else "Warning", reason, message)
