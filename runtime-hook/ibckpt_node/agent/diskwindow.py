"""The node's disk window: a Stop or Hold dump keeps about `window` bytes of images on the node's disk, not
the whole image (docs/node-agent.md, "The disk window").

The follower (ibckpt/store/follow.py) punches each page span out of its file once the bucket has it. When
CRIU writes faster than the bucket takes, the bytes still on the disk grow: past the window, CRIU is
paused (SIGSTOP; its ranks are frozen for the dump anyway, and a Stop or Hold ends their run) until the
follower has brought them back under LOW_WATER of it. So the dump goes at the upload's pace, and the whole
checkpoint costs about max(dump, upload), as before.

Every pause is bounded: CRIU runs again when the follower stops or gives up, when the bytes held make no
progress for STALL_SECONDS, and for good once half the dump's bound has passed since the pre-upload began
(the window then gives way to the bound, and says so).
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05  # CRIU may write this long past the window before it is paused
LOW_WATER = 0.75  # CRIU runs again once the bytes held are under this share of the window
# CRIU is paused once the bytes held would pass the window within this many looks at its last pace: it
# writes on while the agent reacts (on the testbed's emulated nodes, tens of MiB past a 16 MiB window)
LOOKAHEAD_LOOKS = 3
STALL_SECONDS = 30.0  # paused this long with no byte released: the window gives way
CRIU = "criu"


class Step(Enum):
    PAUSE = "pause"
    RESUME = "resume"


@dataclass
class WindowGate:
    """When CRIU must pause and run again, from the bytes held: pure, so its rules are tested alone."""

    window: int
    give_way_at: float  # time.monotonic(): past it CRIU is never paused again
    paused: bool = False
    gave_way: str = ""  # why the window no longer holds, once it does not
    _progress_at: float = 0.0
    _lowest: int = 0
    _last: int | None = None  # the bytes held at the last look

    def step(self, held: int, following: bool, now: float) -> Step | None:
        growth = 0 if self._last is None else max(0, held - self._last)
        self._last = held
        if self.gave_way:
            return Step.RESUME if self.paused else None
        if not following:
            why = "the upload during the dump stopped"
        elif now >= self.give_way_at:
            why = "half the dump's bound has passed"
        elif self.paused and held < self._lowest:
            self._lowest, self._progress_at = held, now
            why = ""
        elif self.paused and now - self._progress_at >= STALL_SECONDS:
            why = f"no byte left the disk for {STALL_SECONDS:g}s"
        else:
            why = ""
        if why:
            self.gave_way = why
            return self._resume() if self.paused else None
        if self.paused and held <= self.window * LOW_WATER:
            return self._resume()
        if not self.paused and held + LOOKAHEAD_LOOKS * growth > self.window:
            self.paused, self._lowest, self._progress_at = True, held, now
            return Step.PAUSE
        return None

    def _resume(self) -> Step:
        self.paused = False
        return Step.RESUME


def held_bytes(root: Path, chunk_size: int) -> int:
    """What the page files under `root` take on the disk in whole chunks, which the follower may release
    (their blocks: a released span takes none). A file's tail short of a chunk, and the other images (a
    few MiB: cores, page maps), stay until the upload: pausing CRIU for them would gain nothing."""
    from ibckpt.store.follow import RELEASABLE  # the store: only once a window is watched (agent start)

    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            if not fnmatch.fnmatch(name, RELEASABLE):
                continue
            with contextlib.suppress(OSError):
                info = os.lstat(os.path.join(dirpath, name))
                total += max(0, info.st_blocks * 512 - info.st_size % chunk_size)
    return total


def criu_descendants(ancestor: int | None = None) -> list[int]:
    """The CRIU processes started below `ancestor` (this agent: runc runs them for it). Walked down from
    it through /proc/PID/task/TID/children, a few reads where a scan of /proc reads every process of the
    node (a tenth of a second and more on a busy node, while CRIU writes on)."""
    ancestor = os.getpid() if ancestor is None else ancestor
    if not os.path.exists(f"/proc/{ancestor}/task/{ancestor}/children"):  # a kernel without it
        return _scanned_descendants(ancestor)
    found: list[int] = []
    below, seen = [ancestor], {ancestor}
    while below:
        for child in _children(below.pop()):
            if child in seen:
                continue
            seen.add(child)
            below.append(child)
            with contextlib.suppress(OSError):
                if Path(f"/proc/{child}/comm").read_text().strip() == CRIU:
                    found.append(child)
    return found


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children: list[int] = []
    for tid in tasks:
        with contextlib.suppress(OSError):
            children += [int(child) for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return children


def _scanned_descendants(ancestor: int) -> list[int]:
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        names[int(entry.name)] = text[text.index("(") + 1 : text.rindex(")")]
        parents[int(entry.name)] = int(text[text.rindex(")") + 2 :].split()[1])
    found = []
    for pid, comm in names.items():
        up = parents.get(pid, 0)
        while comm == CRIU and up > 1 and up != ancestor:
            up = parents.get(up, 0)
        if comm == CRIU and up == ancestor:
            found.append(pid)
    return found


@dataclass
class WindowStats:
    window: int
    peak_bytes: int = 0  # the most the images held on the disk while the window was watched
    pauses: int = 0
    paused_seconds: float = 0.0
    gave_way: str = ""


@dataclass
class DiskWindow:
    """`start()` once the follower runs, `stop()` after the dump (in a finally): CRIU is running again and
    the thread gone when stop() returns."""

    images: Path
    window: int
    following: Callable[[], bool]  # whether the follower still uploads (and so releases)
    give_way_after: float  # seconds from start()
    chunk_size: int = 0  # the follower's, once its store's configuration is read; 0: the default
    stats: WindowStats = field(init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _paused: list[int] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.stats = WindowStats(self.window)

    def start(self) -> DiskWindow:
        gate = WindowGate(self.window, time.monotonic() + self.give_way_after)
        self._thread = threading.Thread(
            target=self._run, args=(gate,), name="ibckpt-disk-window", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> WindowStats:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._resume()  # never left paused, whatever the thread did
        return self.stats

    def _run(self, gate: WindowGate) -> None:
        from ibckpt.store.config import DEFAULT_CHUNK_SIZE

        paused_at = 0.0
        with contextlib.suppress(OSError):  # prompt looks beside CRIU and the follower (root only)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        try:
            while not self._stop.is_set():
                held = held_bytes(self.images, self.chunk_size or DEFAULT_CHUNK_SIZE)
                self.stats.peak_bytes = max(self.stats.peak_bytes, held)
                now = time.monotonic()
                step = gate.step(held, self.following(), now)
                if step is Step.PAUSE:
                    self._pause()
                    self.stats.pauses += 1
                    paused_at = now
                elif step is Step.RESUME:
                    self._resume()
                    self.stats.paused_seconds += now - paused_at
                elif gate.paused:
                    self._pause()  # a CRIU started meanwhile (the next tree's) waits too
                if gate.gave_way and not self.stats.gave_way:
                    self.stats.gave_way = gate.gave_way
                    log.warning(
                        "%s: the disk window of %d bytes gives way: %s",
                        self.images,
                        self.window,
                        gate.gave_way,
                    )
                self._stop.wait(POLL_SECONDS)
            if gate.paused:
                self.stats.paused_seconds += time.monotonic() - paused_at
        except Exception:  # the window is an economy, never a reason to fail or hang the dump
            log.exception("%s: the disk window", self.images)

    def _pause(self) -> None:
        for pid in criu_descendants():
            if pid in self._paused:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                self._paused.append(pid)

    def _resume(self) -> None:
        paused, self._paused = self._paused, []
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
