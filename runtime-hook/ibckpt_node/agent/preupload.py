"""A checkpoint's pages go to the store while CRIU writes them (ibckpt/store/follow.py), beside the dump.

Started with a Stop or Hold session's checkpoint, stopped when the dump ends or fails. It never fails the
session and
never delays the dump: the Secrets are read and the store opened in the background, and the upload after
the dump re-reads every file and stores whatever is missing (hashing again only the spans the follower did
not record, or that changed since), so a follower that could not start, or that failed, only leaves that
upload more to do.

With the agent's disk window (`--disk-window-bytes`), the follower also releases the page spans it stored
from the disk, and diskwindow.py keeps CRIU to the upload's pace. Not when the job commits on its memory
copies first: that copy is sealed from the images before the upload (memorycopies.keep_first).
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
from ibckpt_node.agent.diskwindow import DiskWindow, WindowStats
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
        self._window: DiskWindow | None = None
        self._task: asyncio.Task[None] | None = None
        self.window: WindowStats | None = None  # after stop(): what the disk window saw

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
        copy = request.memory_copy
        if self._agent.disk_window_bytes > 0 and (copy is None or not copy.first):
            # From now, not from the follower's start: CRIU may not outrun a follower still opening the
            # store. CRIU is paused only within half the dump's bound from here: the pre-dumps' and the
            # dump's bounds (each dump_seconds) are never spent on the window alone.
            give_way = request.timeouts.seconds().dump_seconds / 2
            window = DiskWindow(self._images, self._agent.disk_window_bytes, self._following, give_way)
            self._window = window.start()

    def _following(self) -> bool:
        """Whether page spans may still leave the disk: the follower is opening, or runs and has not given
        up (diskwindow.py)."""
        with self._lock:
            follower = self._follower
        if follower is None:
            return self._task is not None and not self._task.done()
        return follower.running and not follower.stats.gave_up

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
            if self._window is not None:
                self._window.chunk_size = config.chunk_size
            release = self._window is not None
            await asyncio.to_thread(self._start_follower, config, destination, keys, timeout, release)
        except Exception as exc:  # the upload after the dump meets (and reports) the same problem
            log.warning("session %s: no upload during the dump: %s", request.session_id, exc)

    def _start_follower(
        self,
        config: StoreConfig,
        destination: api.ImageDestination,
        keys: ManifestKeys,
        timeout: float,
        release: bool,
    ) -> None:
        from ibckpt_node.agent.staging import follower

        found = follower(config, destination, self._images, keys, timeout, release=release)
        with self._lock:
            if not self._stopped:  # else the dump is over already: never started, nothing to stop
                self._follower = found.start()

    async def stop(self) -> FollowStats | None:
        """Stop following (the dump has ended or failed); the stats of what was uploaded meanwhile."""
        with self._lock:
            self._stopped = True
            follower, window = self._follower, self._window
        if self._task is not None and not self._task.done():
            self._task.cancel()  # a store being opened on a thread finishes there, and starts nothing
        if window is not None:
            self.window = await asyncio.to_thread(window.stop)
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
        if self.window is not None:
            log.info(
                "session %s: %d bytes left the disk as they were uploaded; the images held at most %d bytes "
                "(window %d; CRIU paused %d times, %.1fs)",
                self._session.request.session_id,
                stats.released_bytes,
                self.window.peak_bytes,
                self.window.window,
                self.window.pauses,
                self.window.paused_seconds,
            )
        return stats
