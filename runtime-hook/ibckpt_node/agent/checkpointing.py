"""This node's part of a checkpoint: the driver's cut and dump of the session's ranks, then the upload.

The run connects to the job's coordinator, serves the shims' coordinator socket and runs the driver
(NodeDriver.checkpoint) over the ranks and their process trees. The images land in
WORK_DIR/sessions/<id>/images; with a store named in the request, `upload` stages them as this node's
part of the checkpoint (the operator commits the parts), and then they are removed from the node (with
the memory tier and a commit on S3, once the part is also copied to its buddy, after the report). Images
that were not staged stay for a bounded time (`settle`, disk.py). A coordinator lost on the way is
replaced through recovery.rejoin; ranks a Stop or Hold dump leaves released wait for recovery.py or a
kill.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ibckpt.agentapi import Milestone
from ibckpt.agentapi import models as api
from ibckpt.coordination.client import CoordinationAborted, CoordinatorError
from ibckpt.coordination.ranks import RankId
from ibckpt_node import driver, rdma_devices, settings
from ibckpt_node.agent import disk, recovery
from ibckpt_node.agent.kubesecrets import StagingError
from ibckpt_node.agent.preupload import PreUpload
from ibckpt_node.agent.session import Agent, Session, coordinated, finish_failed, passed, set_phase
from ibckpt_node.criu import CriuError
from ibckpt_node.errors import CheckpointFailed, CheckpointRefused

if TYPE_CHECKING:
    from ibckpt.store.follow import FollowStats
    from ibckpt_node.agent.staging import StagedPart

log = logging.getLogger(__name__)


async def run(agent: Agent, session: Session) -> None:
    request = session.request
    assert isinstance(request, api.CheckpointRequest)
    report = session.report
    images = agent.work_dir / "sessions" / request.session_id / "images"
    staged = False
    why = ""  # why images that were not staged stay (disk.keep)
    copy: MemoryCopy | None = None  # the memory tier's copy, made once the session has reported
    during: FollowStats | None = None  # what the follower uploaded while CRIU wrote
    try:
        async with coordinated(agent, session) as (client, proxy):
            session.engine = driver.NodeDriver(
                agent.node,
                client,
                session.ranks,
                timeouts=request.timeouts.seconds(),
                job_addrs=request.job_addresses or None,
                trees=session.trees,
                flush_records=proxy.published,
                confine=proxy.confine,
                rejoin=functools.partial(recovery.rejoin, agent, session, proxy),
                on_milestone=functools.partial(passed, session),
                settings=settings.NodeSettings(
                    disk_reserve_bytes=agent.disk_reserve_bytes,
                    pre_dump=request.pre_dump,
                    criu_plugins=agent.criu_plugins,
                ),
            )
            set_phase(session, api.RankPhase.PREFLIGHT)
            devices = await rdma_devices.record(
                [(t.name, t.container) for t in session.trees],
                session.tree_keys,
                session.ranks,
                request.timeouts.seconds().quiesce_seconds,
            )
            early = PreUpload(agent, session, images)
            early.start()
            try:
                result = await session.engine.checkpoint(request.mode, images, request.epoch)
            finally:
                during = await early.stop()
        final = {
            "Stopped": api.RankPhase.STOPPED,
            "Held": api.RankPhase.HELD,
        }.get(result.outcome, api.RankPhase.DONE)
        for tree in session.trees:
            size = disk.tree_bytes(images / tree.name)
            report.bytes += size
            members = [session.by_key[k] for k in session.tree_keys[tree.name]]
            for progress in members:
                progress.bytes = size // max(1, len(members))
        if request.images is not None:
            copy = await upload(agent, session, images, during, devices)
            staged = True
            if early.window is not None and during is not None:
                report.message += (
                    f"; {during.released_bytes} bytes left the disk once uploaded, the images held at most "
                    f"{early.window.peak_bytes} (window {early.window.window})"
                )
        for progress in report.ranks:
            progress.phase = final
        report.state = api.SessionState.SUCCEEDED
        report.phase = result.outcome
        if request.images is None:
            report.message = f"images in {images} on {agent.node}"
    except StagingError as exc:
        # only the upload failed; the images stay here, for a while
        why = disk.UPLOAD_FAILED
        keep_s = agent.keep_failed_images_s
        kept = f"images kept in {images} for {disk.duration(keep_s)}" if keep_s > 0 else "images removed"
        finish_failed(session, api.SessionState.FAILED, f"{exc} ({kept})")
    except CheckpointRefused as exc:
        finish_failed(session, api.SessionState.REFUSED, str(exc))
    except CoordinationAborted as exc:
        finish_failed(session, api.SessionState.ABORTED, str(exc))
    except (CheckpointFailed, CoordinatorError, CriuError, OSError) as exc:
        aborted = bool(session.abort_reason) or (
            session.engine is not None and session.engine.report.outcome == "Aborted"
        )
        state = api.SessionState.ABORTED if aborted and session.abort_reason else api.SessionState.FAILED
        finish_failed(session, state, str(exc))
    except asyncio.CancelledError:
        why = disk.ABORTED
        if not session.recovering:  # a recovery reports for itself
            finish_failed(session, api.SessionState.ABORTED, session.abort_reason or "cancelled")
    except Exception as exc:
        log.exception("session %s", request.session_id)
        finish_failed(session, api.SessionState.FAILED, f"agent error: {exc}")
    finally:
        # released pages were in no manifest: the follower's lease is held until the upload had its own
        if during is not None:
            await asyncio.to_thread(during.end_lease)
        if session.engine is not None:
            # the renewals went on through the upload; a Held rank is handed over with no lease
            await session.engine.end_leases()
        # Every rank runs again: nothing for a next agent to bring back. A rank the abort could not
        # rebuild (its peer was away: an agent stopping mid-cut) keeps the record for the next agent.
        back = all(p.phase is not api.RankPhase.FAILED for p in report.ranks)
        if not session.held and back:
            recovery.forget(agent.work_dir, request.session_id)
        if report.state is not api.SessionState.SUCCEEDED:
            copy = None
        session.copying = copy is not None  # the sweep leaves its images alone meanwhile
        if copy is None:
            await settle(agent, session, images, staged, why or report.state.value.lower())
        if not session.recovering:
            report.finished_at = time.time()
            log.info(
                "session %s: %s (%s) %s",
                request.session_id,
                report.state.value,
                report.phase,
                report.message,
            )
            agent.on_finished(report)
    if copy is not None:
        held = None
        try:
            held = await copy.make()
        except Exception:
            log.exception("session %s: the memory copy", request.session_id)
        finally:
            session.copying = False
            await settle(agent, session, images, staged, "staged")
        if held is not None:  # in the report once the images are gone too
            report.memory_copy = held
            report.phases["memoryCopy"] = held.seconds


async def settle(agent: Agent, session: Session, images: Path, staged: bool, why: str) -> None:
    """The images once the session is over: staged ones are removed; a store-less checkpoint's are
    its result and stay; others stay for `keep_failed_images_s` (the sweep removes them then), or go
    at once when that is 0. Never fails the session: what cannot be removed is logged, and swept later."""
    request = session.request
    sid = request.session_id
    result = request.images is None and session.report.state is api.SessionState.SUCCEEDED
    try:
        present = images.exists()
        if staged or (agent.keep_failed_images_s <= 0 and not result):
            freed = await asyncio.to_thread(disk.release, agent.work_dir, sid)
            if present:
                done = "staged" if staged else f"not staged: {why}"
                log.info("session %s: removed its images (%s): %d bytes freed", sid, done, freed)
        elif present:
            disk.keep(agent.work_dir, sid, disk.RESULT if result else why)
    except OSError as exc:
        log.warning("session %s: its images in %s: %s", sid, images, exc)


async def upload(
    agent: Agent,
    session: Session,
    images: Path,
    during: FollowStats | None = None,
    devices: Mapping[str, Mapping[str, Any]] | None = None,
) -> MemoryCopy | None:
    """Upload this node's images as its part of the checkpoint (the operator commits the parts); `during`:
    what was uploaded while CRIU wrote them (preupload.py); `devices`: each tree's RDMA devices
    (rdma_devices.record), recorded in its RankInfo. Returns the memory tier's copy still to make when the
    job commits on S3: the session reports first, so the commit does not wait for it."""
    from ibckpt_node.agent import memorycopies  # boto3: when staging
    from ibckpt_node.agent.staging import image_keys, read_config, stage_part

    assert isinstance(session.request, api.CheckpointRequest)
    destination = session.request.images
    assert destination is not None
    report = session.report
    report.phase = api.RankPhase.UPLOADING.value
    for rank in report.ranks:
        rank.phase = api.RankPhase.UPLOADING
    if agent.secrets is None:
        raise StagingError("this agent has no way to read Secrets")
    config = await read_config(
        agent.secrets, destination.location, destination.credentials, agent.work_dir / "ca"
    )
    keys = image_keys(agent.image_keys)
    uploaded = 0

    def count(size: int) -> None:  # runs on the upload's threads
        nonlocal uploaded
        uploaded += size

    # pod names may hold dots: take each tree's pod from its ranks' keys (job/pod/container/process)
    trees = [(t.name, RankId.parse(session.tree_keys[t.name][0]).pod) for t in session.trees]
    started = time.monotonic()
    target = session.request.memory_copy
    first = target is not None and target.first
    if target is not None and first:
        # commitOn: Memory: the copy and its signed part first, so the operator may commit on the
        # holders while S3 is slow or away; the S3 upload follows, and is not copied again
        deadline = started + session.request.timeouts.upload_seconds
        report.memory_copy = await memorycopies.keep_first_within(
            agent, target, config, destination, images, trees, keys, devices, deadline
        )
        report.phases["memoryCopy"] = report.memory_copy.seconds
        if report.memory_copy.kept:
            report.phases[Milestone.MEMORY_KEPT] = report.memory_copy.seconds
        started = time.monotonic()
    followed = during.spans if during is not None else None
    staging = asyncio.to_thread(
        stage_part, config, destination, agent.node, images, trees, count, keys, devices, followed
    )
    try:
        # a thread cannot be cancelled: on timeout the upload may go on, but nothing commits it
        staged = await asyncio.wait_for(staging, session.request.timeouts.upload_seconds)
    except TimeoutError:
        raise StagingError(
            f"upload did not finish within {session.request.timeouts.upload_seconds:g}s"
        ) from None
    total = staged.logical_bytes
    report.phases[Milestone.UPLOADED] = round(time.monotonic() - started, 3)
    report.message = (
        f"staged {total} bytes ({uploaded} uploaded, the rest already stored) as part {agent.node} "
        f"of {destination.job}/{destination.checkpoint_id}"
    )
    if during is not None:
        report.message += f"; {during.stored_chunks} chunks were uploaded during the dump"
    if target is not None and not first:
        return MemoryCopy(agent, session, target, staged, images)
    return None


@dataclass
class MemoryCopy:
    """commitOn S3: this node's part copied to its buddy once the session has reported (the operator
    commits on S3 meanwhile and lists the copy once its holder has sealed it). Bounded by the upload's
    timeout from its start; its outcome is logged, and added to the finished report once the images are
    removed."""

    agent: Agent
    session: Session
    target: api.MemoryCopyTarget
    staged: StagedPart
    images: Path

    async def make(self) -> api.MemoryCopyReport:
        from ibckpt_node.agent import memorycopies

        sid = self.session.request.session_id
        assert isinstance(self.session.request, api.CheckpointRequest)
        deadline = time.monotonic() + self.session.request.timeouts.upload_seconds
        kept = await memorycopies.keep_within(self.agent, self.target, self.staged, self.images, deadline)
        if kept.kept:
            log.info("session %s: part kept in memory on %s (%d chunks, %d bytes) in %.1fs",
                     sid, kept.node, kept.chunks, kept.bytes, kept.seconds)  # fmt: skip
        else:
            log.warning("session %s: part not kept in memory on %s: %s", sid, kept.node, kept.message)
        return kept
