"""What sessions leave on this node's disk, and the sweep that keeps it bounded.

A checkpoint writes its images to WORK_DIR/sessions/<id>/images, beside the session's recovery record
(recovery.py). Once they are staged to the store they are removed (checkpointing.py). The images of a
checkpoint that did not succeed (its upload failed, its dump failed, it was aborted) stay, for a look
at CRIU's logs or an upload by hand, with a marker (`kept.json`: why, and since when) for at most
`keep_s` seconds (the agent's --keep-failed-images). The images of a checkpoint asked without a store
are its result: marked so, and left until removed by hand. A restore's staging
(STATE_DIR/restore/NS/POD/CONTAINER) is removed when its session ends (restoring.py).

The sweep (`expired`, then `take` and `dispose`) removes what outlived its bound: images whose
marker is older than `keep_s`, images without a marker (an agent that died mid-session, or one of an
earlier version) older than `keep_s` by their directory's time, and restore staging older than
`keep_s` while no restore runs. The agent sweeps at start and then every SWEEP_EVERY_S. It never
removes a session's recovery record, nor anything of a session the agent runs or recovers. What it
removes is first renamed into WORK_DIR/trash on the event loop, where sessions start, so no session
can start using a path between the decision and the removal; the trash is emptied on a thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Container, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

KEPT = "kept.json"  # {"why": ..., "at": epoch seconds}: why a session's images stay, since when
RESULT = "result"  # why: a checkpoint asked without a store; its images are what it made
UPLOAD_FAILED = "upload failed"
ABORTED = "aborted"
DEFAULT_KEEP_FAILED_S = 6 * 3600.0
SWEEP_EVERY_S = 600.0
TRASH = "trash"


def tree_bytes(root: Path) -> int:
    """The size of the files under `root` (what removing it frees, near enough)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:g} h"
    if seconds >= 60:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def session_dir(work_dir: Path, session_id: str) -> Path:
    return work_dir / "sessions" / session_id


def _is_dir(path: Path) -> bool:
    """A directory, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _rmdir_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (a recovery record), or gone
        path.rmdir()


def keep(work_dir: Path, session_id: str, why: str, now: float | None = None) -> None:
    """Mark the session's images as kept: why, and since when (the sweep's bound counts from then)."""
    where = session_dir(work_dir, session_id)
    partial = where / (KEPT + ".partial")
    partial.write_text(json.dumps({"why": why, "at": time.time() if now is None else now}) + "\n")
    partial.replace(where / KEPT)


def kept(work_dir: Path, session_id: str) -> tuple[str, float] | None:
    """The marker's (why, since when); None without one (or one that cannot be read)."""
    try:
        data = json.loads((session_dir(work_dir, session_id) / KEPT).read_text())
        return str(data["why"]), float(data["at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def release(work_dir: Path, session_id: str) -> int:
    """Remove the session's images and their marker, then the session's directory if nothing is left
    in it (a recovery record keeps it). Returns the bytes freed; OSError if the images stay."""
    where = session_dir(work_dir, session_id)
    images = where / "images"
    freed = 0
    if _is_dir(images):
        freed = tree_bytes(images)
        shutil.rmtree(images)
    (where / KEPT).unlink(missing_ok=True)
    _rmdir_if_empty(where)
    return freed


@dataclass(frozen=True)
class Leftover:
    """Something the sweep removes: the path, what it is (for the log), and the empty parents to
    remove after it (a session's directory, a restored pod's and its namespace's)."""

    path: Path
    what: str
    then: tuple[Path, ...] = ()


def _entries(root: Path) -> list[Path]:
    """The directories (not links) in root, by name; none if root cannot be read."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [root / name for name in names if _is_dir(root / name)]


def _age(path: Path, now: float) -> float:
    try:
        return now - os.lstat(path).st_mtime
    except OSError:
        return 0.0


def expired(
    work_dir: Path,
    restore_root: Path,
    keep_s: float,
    busy: Container[str] = (),
    restoring: bool = False,
    now: float | None = None,
) -> list[Leftover]:
    """What outlived its bound (the module's docstring says which). `busy`: the ids of sessions this
    agent runs or recovers, left alone; `restoring`: a restore runs, so no staging is expired."""
    now = time.time() if now is None else now
    found = []
    for where in _entries(work_dir / "sessions"):
        sid = where.name
        if sid in busy:
            continue
        images = where / "images"
        marker = kept(work_dir, sid)
        if not _is_dir(images):  # tidy on the way: a marker that outlived its images, an empty dir
            with contextlib.suppress(OSError):
                (where / KEPT).unlink(missing_ok=True)
            _rmdir_if_empty(where)
            continue
        if marker is not None and marker[0] == RESULT:
            continue
        age = now - marker[1] if marker is not None else _age(images, now)
        if age < keep_s:
            continue
        why = marker[0] if marker is not None else "left by an earlier agent"
        what = f"images of session {sid} ({why}, {duration(round(age))} old)"
        found.append(Leftover(images, what, (where,)))
    if not restoring:
        for namespace in _entries(restore_root):
            for pod in _entries(namespace):
                for container in _entries(pod):
                    age = _age(container, now)
                    if age >= keep_s:
                        what = f"restore staging {container} (no restore runs, {duration(round(age))} old)"
                        found.append(Leftover(container, what, (pod, namespace)))
    return found


def take(leftovers: Sequence[Leftover], trash: Path) -> list[Leftover]:
    """Rename each leftover into `trash` (quick: on the event loop), remove its marker and the parents
    it leaves empty; returns them as they are in the trash. One that cannot be moved is logged and
    stays."""
    taken = []
    for item in leftovers:
        try:
            trash.mkdir(mode=0o700, exist_ok=True)
            moved = trash / f"{item.path.name}-{uuid.uuid4().hex[:12]}"
            item.path.rename(moved)
        except OSError as exc:
            log.warning("cannot remove %s: %s", item.what, exc)
            continue
        taken.append(Leftover(moved, item.what))
        for parent in item.then:
            with contextlib.suppress(OSError):
                (parent / KEPT).unlink(missing_ok=True)
            _rmdir_if_empty(parent)
    return taken


def in_trash(trash: Path) -> list[Leftover]:
    """What an earlier agent moved to the trash and did not get to remove."""
    return [Leftover(p, f"{p.name} (left in {trash})") for p in _entries(trash)]


def dispose(taken: Sequence[Leftover]) -> int:
    """Remove what `take` moved to the trash, one log line each with the bytes freed (on a thread)."""
    total = 0
    for item in taken:
        freed = tree_bytes(item.path)
        try:
            shutil.rmtree(item.path)
        except OSError as exc:
            log.warning("cannot remove %s at %s: %s", item.what, item.path, exc)
            continue
        total += freed
        log.info("removed %s: %d bytes freed", item.what, freed)
    return total
