"""The one place that runs CRIU: which options are used, and the full error text when it fails.

Every call is bounded by a timeout; on timeout CRIU is killed and the error says so. A dump
that fails leaves the task running (CRIU resumes it), so the caller can rebuild and resume.

A pre-dump copies a tree's memory while it runs and starts tracking which pages it writes; a dump
given that pre-dump as its parent then copies only those pages, and CRIU reads the rest from the
parent's images at restore (`parent` in the image dir). The verbs device may still be open during a
pre-dump: CRIU passes over its mappings with the plugin in PLUGINS_ENV's directory
(native/criu_plugin/uverbs_vma.c).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LOG_TAIL_CHARS = 4000
# Where CRIU looks for plugins when no --libdir is given: it loads every .so there.
PLUGINS_ENV = "CRIU_LIBS_DIR"
# A dump's link to its pre-dump, as CRIU names it in the image dir.
PARENT_LINK = "parent"


def parse_version(output: str) -> tuple[int, int, int] | None:
    """`criu --version` prints `Version: 3.17.1` (and a GitID line on builds from git)."""
    match = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", output)
    if not match:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


class CriuError(RuntimeError):
    """CRIU failed; the message carries the command, its exit status and the log's tail."""

    def __init__(self, action: str, pid_or_dir: str, detail: str, log_tail: str) -> None:
        super().__init__(
            f"criu {action} of {pid_or_dir} failed: {detail}\n--- criu log (tail) ---\n{log_tail}"
        )
        self.action = action
        self.detail = detail
        self.log_tail = log_tail


@dataclass(frozen=True)
class DumpOptions:
    leave_running: bool = False
    # Established TCP connections (launchers, PMIx, bootstrap sockets) are dumped with
    # TCP repair; without it CRIU refuses them.
    tcp_established: bool = True
    shell_job: bool = False
    file_locks: bool = True
    ext_unix_sk: bool = True

    def restore_flags(self) -> list[str]:
        """What a restore of such a dump must be told too (CRIU's flags; runc's have the same names)."""
        chosen = {
            "--tcp-established": self.tcp_established,
            "--shell-job": self.shell_job,
            "--file-locks": self.file_locks,
            "--ext-unix-sk": self.ext_unix_sk,
        }
        return [flag for flag, on in chosen.items() if on]

    def dump_flags(self) -> list[str]:
        return ["--leave-running"] * self.leave_running + self.restore_flags()


@dataclass(frozen=True)
class DumpResult:
    images: Path
    seconds: float


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    seconds: float


def criu_binary() -> str:
    found = shutil.which("criu")
    if not found:
        raise CriuError("lookup", "criu", "the criu binary is not installed on this node", "")
    return found


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return f"(no log at {path})"


def plugins_env(plugins: str | None) -> dict[str, str] | None:
    """The environment of a CRIU (or a runc that starts one) that loads the plugins of `plugins`."""
    return None if not plugins else {**os.environ, PLUGINS_ENV: plugins}


def _run(
    action: str, subject: str, args: Sequence[str], log: Path, timeout_s: float, plugins: str | None = None
) -> None:
    try:
        proc = subprocess.run(
            list(args), capture_output=True, text=True, timeout=timeout_s, env=plugins_env(plugins)
        )
    except subprocess.TimeoutExpired:
        raise CriuError(
            action, subject, f"timed out after {timeout_s:g}s (criu was killed)", _tail(log)
        ) from None
    if proc.returncode != 0:
        detail = f"exit status {proc.returncode}"
        if proc.stderr.strip():
            detail += f": {proc.stderr.strip()[-500:]}"
        raise CriuError(action, subject, detail, _tail(log))


def _empty_dir(action: str, subject: str, images: Path) -> None:
    images.mkdir(parents=True, exist_ok=True)
    if any(images.iterdir()):
        raise CriuError(action, subject, f"image dir {images} is not empty", "")


def parent_arg(images: Path, parent: Path) -> str:
    """A pre-dump's dir as CRIU and runc take it: relative to the dump's own image dir."""
    return os.path.relpath(parent, images)


def pre_dump(
    pid: int, images: Path, options: DumpOptions, timeout_s: float, plugins: str, parent: Path | None = None
) -> DumpResult:
    """Copy the memory of the tree rooted at `pid` into `images` while it runs (CRIU freezes it only
    to collect its pages) and start tracking the pages it writes from then on; with `parent` (an
    earlier pre-dump of it), only the pages written since that one."""
    _empty_dir("pre-dump", str(pid), images)
    args = [criu_binary(), "pre-dump", "-t", str(pid), "-D", str(images), "-o", "pre-dump.log", "-v4"]
    args += ["--track-mem", *(["--shell-job"] if options.shell_job else [])]
    if parent is not None:
        args += ["--prev-images-dir", parent_arg(images, parent)]
    started = time.monotonic()
    _run("pre-dump", f"pid {pid}", args, images / "pre-dump.log", timeout_s, plugins)
    return DumpResult(images, time.monotonic() - started)


def pages_bytes(images: Path) -> int:
    """The bytes of memory pages a dump or pre-dump wrote into `images` (its pages-*.img files)."""
    return sum(p.stat().st_size for p in images.glob("pages-*.img"))


def dump(
    pid: int, images: Path, options: DumpOptions, timeout_s: float, parent: Path | None = None
) -> DumpResult:
    """Dump the process tree rooted at `pid` into `images` (created, must be empty); with `parent` (a
    pre-dump of it), only the pages written since."""
    _empty_dir("dump", str(pid), images)
    args = [criu_binary(), "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v4"]
    args += options.dump_flags()
    if parent is not None:
        args += ["--prev-images-dir", parent_arg(images, parent), "--track-mem"]
    started = time.monotonic()
    _run("dump", f"pid {pid}", args, images / "dump.log", timeout_s)
    return DumpResult(images, time.monotonic() - started)


def adopt_parent(images: Path, parent: Path) -> None:
    """Move a dump's pre-dump into its image dir, in place of CRIU's link to it: the images then
    travel as one tree, and a restore finds the parent's pages where CRIU looks for them. A pre-dump
    on an earlier one brings that one in as its own `parent`, and so on down the chain."""
    chain = [parent]
    while (link := chain[-1] / PARENT_LINK).is_symlink():
        chain.append((chain[-1] / os.readlink(link)).resolve())  # before anything moves
    where = images
    for pre in chain:
        link = where / PARENT_LINK
        if link.is_symlink():
            link.unlink()
        pre.rename(link)
        where = link


def restore(
    images: Path, timeout_s: float, tcp_established: bool = True, shell_job: bool = False
) -> RestoreResult:
    """Restore a dumped tree, detached from CRIU; returns the restored root's pid."""
    pidfile = images / "restored.pid"
    pidfile.unlink(missing_ok=True)
    args = [
        criu_binary(), "restore", "-D", str(images), "-o", "restore.log", "-v4",
        "--restore-detached", "--pidfile", str(pidfile),
    ]  # fmt: skip
    if tcp_established:
        args.append("--tcp-established")
    if shell_job:
        args.append("--shell-job")
    started = time.monotonic()
    _run("restore", str(images), args, images / "restore.log", timeout_s)
    return RestoreResult(int(pidfile.read_text().strip()), time.monotonic() - started)
