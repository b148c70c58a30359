"""The record that lets ranks out of running be brought back after their session's driver is over.

Two cases need it. A Stop or Hold checkpoint keeps its ranks released after the dump, until the
operator kills them once the manifest is committed (or a restore rebuilds them); if the job aborts
instead (an upload failed), they must be rebuilt with their peers and resumed. And an agent that
dies mid-session (a crash, an OOM kill) leaves its ranks where they were: quiesced or drained ones
resume on their shim's lease, released ones cannot. The next agent reads the session's request from
this record when the operator's abort reaches it, and brings them back the same way.

The record is the checkpoint request without its coordinator token (the abort brings the token of
the coordinator to rebuild through). It is written before any rank is touched and removed once the
ranks are back or the session ended with every rank running.

The recovery run (`start`, `run`) connects to the coordinator the abort names and runs
NodeDriver.recover over the session's ranks. A coordinator lost while the driver still runs (the
operator restarted) is replaced by the one the next abort names (`rejoin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path

from pydantic import ValidationError

from ibckpt.agentapi import models as api
from ibckpt.coordination.client import CoordinatorClient, CoordinatorError
from ibckpt_node import driver
from ibckpt_node.agent import disk
from ibckpt_node.agent.session import Agent, Session, connect, finish_failed, shim_channels
from ibckpt_node.coord_proxy import ShimCoordinatorProxy

log = logging.getLogger(__name__)

RECORD = "session.json"
# How long ranks left released by a lost coordinator wait for the next operator's recovery: its
# Lease handover and start-up (2.5 minutes on the emulated testbed nodes), with room.
REJOIN_WAIT_S = 600.0


def record_path(work_dir: Path, session_id: str) -> Path:
    return work_dir / "sessions" / session_id / RECORD


def save(work_dir: Path, request: api.CheckpointRequest) -> None:
    path = record_path(work_dir, request.session_id)
    for directory in (path.parent.parent, path.parent):  # sessions/ and the session's: the images go here
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)  # they hold the job's memory: root's alone (one made before was 0755)
    data = request.model_dump(mode="json", exclude={"session_token"})
    partial = path.with_suffix(".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    partial.replace(path)


def load(work_dir: Path, session_id: str, order: api.AbortRequest) -> api.CheckpointRequest | None:
    """The recorded request, pointed at the coordinator `order` names; None if there is no record
    (or it cannot be read, which is logged)."""
    path = record_path(work_dir, session_id)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.error("session %s: cannot read its record %s: %s", session_id, path, exc)
        return None
    if not order.coordinator or order.session_token is None:
        return None
    data.update(coordinator=order.coordinator, session_token=order.session_token.get_secret_value())
    try:
        return api.CheckpointRequest.model_validate(data)
    except ValidationError as exc:
        log.error("session %s: its record %s is not a checkpoint request: %s", session_id, path, exc)
        return None


def forget(work_dir: Path, session_id: str) -> None:
    path = record_path(work_dir, session_id)
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # the session's directory, once nothing else is in it (disk.py)
        path.parent.rmdir()


def start(agent: Agent, session: Session, reason: str, order: api.AbortRequest | None) -> None:
    if order is None or not order.coordinator or order.session_token is None:
        # an operator that names no coordinator: nothing to rebuild through
        log.error(
            "session %s: its ranks are released and the abort names no coordinator to rebuild them "
            "through; they wait for a restore or a kill",
            session.report.session_id,
        )
        return
    session.abort_reason = session.abort_reason or reason
    session.recovering = True  # from now on the report says Running until the ranks are back
    session.report.state = api.SessionState.RUNNING
    session.report.phase = "Aborting"
    previous = session.task
    session.task = asyncio.create_task(
        run(agent, session, order, previous), name=f"recovery {session.report.session_id}"
    )


async def run(
    agent: Agent, session: Session, order: api.AbortRequest, previous: asyncio.Task[None] | None
) -> None:
    """Bring back the ranks a held (or a previous agent's) session left out of running."""
    request = session.request
    assert isinstance(request, api.CheckpointRequest)
    assert order.coordinator and order.session_token is not None
    report = session.report
    if previous is not None and not previous.done():
        previous.cancel()  # an upload still running: the checkpoint is aborted
        await asyncio.wait([previous])
    reason = session.abort_reason
    phases = dict(report.phases)
    token = order.session_token.get_secret_value()
    try:
        client = await connect(agent, request.session_id, order.coordinator, token)
        try:
            async with ShimCoordinatorProxy(client, shim_channels(session.ranks)) as proxy:
                session.engine = driver.NodeDriver(
                    agent.node,
                    client,
                    session.ranks,
                    timeouts=request.timeouts.seconds(),
                    flush_records=proxy.published,
                    confine=proxy.confine,
                )
                await session.engine.recover(reason, request.epoch)
        finally:
            await client.close()
        back = len(session.engine.report.shim.get("abort", {}))
        message = f"aborted: {reason}; {back} of {len(session.ranks)} rank(s) brought back"
        finish_failed(session, api.SessionState.ABORTED, message)
    except (CoordinatorError, OSError) as exc:
        message = f"aborted: {reason}; the released ranks could not be rebuilt: {exc}"
        finish_failed(session, api.SessionState.ABORTED, message)
    except Exception as exc:
        log.exception("recovery of session %s", request.session_id)
        finish_failed(session, api.SessionState.FAILED, f"agent error: {exc}")
    finally:
        session.recovering = False
        report.phases = {**phases, **report.phases}
        if all(p.phase is api.RankPhase.RESUMED for p in report.ranks):
            forget(agent.work_dir, request.session_id)
        settle_left(agent, request.session_id)
        report.finished_at = time.time()
        log.info("session %s: %s (recovery) %s", request.session_id, report.state.value, report.message)
        agent.on_finished(report)


def settle_left(agent: Agent, session_id: str) -> None:
    """Images a previous agent dumped and died before settling (no marker): kept as an aborted
    checkpoint's are, so the sweep's bound counts from now and says why (or removed at once when
    failed images are not kept). What this agent's own session settled is left as it is."""
    images = disk.session_dir(agent.work_dir, session_id) / "images"
    try:
        if not images.is_dir() or disk.kept(agent.work_dir, session_id) is not None:
            return
        if agent.keep_failed_images_s > 0:
            disk.keep(agent.work_dir, session_id, disk.ABORTED)
        else:
            disk.release(agent.work_dir, session_id)
    except OSError as exc:
        log.warning("session %s: its images in %s: %s", session_id, images, exc)


async def rejoin(agent: Agent, session: Session, proxy: ShimCoordinatorProxy) -> CoordinatorClient | None:
    """Wait (bounded) for an abort naming the coordinator that replaces the lost one; connect to it
    and route the session and its shims' records through it."""
    try:
        await asyncio.wait_for(session.rejoin_ready.wait(), REJOIN_WAIT_S)
    except TimeoutError:
        return None
    order = session.rejoin_to
    assert order is not None and order.coordinator and order.session_token is not None
    token = order.session_token.get_secret_value()
    try:
        client = await connect(agent, session.request.session_id, order.coordinator, token)
    except CoordinatorError as exc:
        log.error("session %s: cannot rejoin: %s", session.request.session_id, exc)
        return None
    old, session.client = session.client, client
    proxy.use(client)
    if old is not None:
        await old.close()
    return client
