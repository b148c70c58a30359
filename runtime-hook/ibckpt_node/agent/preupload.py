"""A checkpoint's pages go to the store while CRIU writes them (ibckpt/store/follow.py), beside the dump.

Started with a Stop or Hold session's checkpoint, stopped when the dump ends or fails. It never fails the
session and
never delays the dump: the Secrets are read and the store opened in the background, and the upload after
the dump re-reads every file and stores whatever is missing (hashing again only the spans the follower did
not record, or that changed since), so a follower that could not start, or that failed, only leaves that
upload more to do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ibckpt.agentapi import Mode
from ibckpt.agentapi import models as api
from ibckpt_node.agent.session import Agent, Session

if TYPE_CHECKING:
    from ibckpt.store.config import StoreConfig
    from ibckpt.store.follow import Follower, FollowStats
    from ibckpt.store.signing import ManifestKeys

log = logging.getLogger(__name__)


class PreUpload:
    """`start()` before the dump, `await stop()` after it (in a finally): no thread outlives stop()."""

    def __init__(self, agent: Agent, session: Session, images: Path) -> None:
        self._agent = agent
        self._session = session
        self._images = images
        self._lock = threading.Lock()  # the follower is started on a worker thread, stopped here
        self._stopped = False
        self._follower: Follower | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        request = self._session.request
        assert isinstance(request, api.CheckpointRequest)
        # Not in LeaveRunning, whose ranks wait frozen for the dump and run on right after it: the
        # follower's hashing and PUTs would take CPU from CRIU (the upload comes after they resume). A Stop
        # and a Hold (the operator's Stop jobs and drains) end their ranks' run with the dump, and what
        # their job waits for is the commit.
        if request.mode == Mode.LEAVE_RUNNING:
            return
        if request.images is None or not self._agent.pre_upload or self._agent.secrets is None:
            return
        self._task = asyncio.create_task(self._open(request, request.images))

    async def _open(self, request: api.CheckpointRequest, destination: api.ImageDestination) -> None:
        from ibckpt_node.agent.staging import image_keys, read_config  # boto3: when staging

        agent = self._agent
        try:
            assert agent.secrets is not None
            config = await read_config(
                agent.secrets, destination.location, destination.credentials, agent.work_dir / "ca"
            )
            keys = image_keys(agent.image_keys)
            # the follower's own bound; stop() ends it earlier, when the dump does
            bounds = dataclasses.asdict(request.timeouts.seconds())
            phases = ("preflight", "quiesce", "drain", "release", "dump")
            timeout = sum(bounds[f"{phase}_seconds"] for phase in phases)
            await asyncio.to_thread(self._start_follower, config, destination, keys, timeout)
        except Exception as exc:  # the upload after the dump meets (and reports) the same problem
            log.warning("session %s: no upload during the dump: %s", request.session_id, exc)

    def _start_follower(
        self, config: StoreConfig, destination: api.ImageDestination, keys: ManifestKeys, timeout: float
    ) -> None:
        from ibckpt_node.agent.staging import follower

        found = follower(config, destination, self._images, keys, timeout)
        with self._lock:
            if not self._stopped:  # else the dump is over already: never started, nothing to stop
                self._follower = found.start()

    async def stop(self) -> FollowStats | None:
        """Stop following (the dump has ended or failed); the stats of what was uploaded meanwhile."""
        with self._lock:
            self._stopped = True
            follower = self._follower
        if self._task is not None and not self._task.done():
            self._task.cancel()  # a store being opened on a thread finishes there, and starts nothing
        if follower is None:
            return None
        stats = await asyncio.to_thread(follower.stop)
        log.info(
            "session %s: %d chunks (%d bytes) uploaded during the dump, %d there already, %d failed",
            self._session.request.session_id,
            stats.stored_chunks,
            stats.stored_bytes,
            stats.present_chunks,
            stats.failed_chunks,
        )
        return stats
