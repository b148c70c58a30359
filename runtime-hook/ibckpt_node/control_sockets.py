"""Which of a container's control sockets have a rank behind them.

The shim makes `<pid in the container>.sock` for each process that opens a device, and removes it when
the process ends (native/src/ctlsock.c), except after SIGKILL, `_exit()` or a signal handler of the
app's own. A container whose verbs program is retried in a loop would otherwise collect one socket per
attempt, and a checkpoint would look for ranks that are gone. A socket is stale when its pid is no
longer in the container's pid namespace, or when a connect to it is refused (nobody listens: the
process ended, or exec'd into an image without the shim, and another took its pid). The agent drops
stale sockets (removes the file, and logs one line each) and takes the others as ranks.

`classify` is the decision, pure; the rest reads /proc and the sockets.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ibckpt_native.control import unfollowed

SUFFIX = ".sock"


@dataclass(frozen=True)
class LiveSocket:
    path: str
    ns_pid: int  # the process's pid in the container: the rank key's last part
    host_pid: int


@dataclass(frozen=True)
class StaleSocket:
    path: str
    ns_pid: int
    reason: str


def ns_pid_of(path: str) -> int | None:
    """The pid in the container a socket is named after; None for a name the shim does not make."""
    stem = Path(path).name.removesuffix(SUFFIX)
    return int(stem) if Path(path).name.endswith(SUFFIX) and stem.isdigit() else None


def classify(
    paths: Iterable[str], host_pids: Mapping[int, int], listening: Callable[[str], bool]
) -> tuple[list[LiveSocket], list[StaleSocket]]:
    """Split a container's sockets into those with a live process behind them and stale ones.

    `host_pids` maps each pid of the container's pid namespace to its host pid; `listening(path)` is
    False only when a connect is refused. Names the shim does not make are in neither list."""
    live: list[LiveSocket] = []
    stale: list[StaleSocket] = []
    for path in paths:
        ns_pid = ns_pid_of(path)
        if ns_pid is None:
            continue
        host = host_pids.get(ns_pid)
        if host is None:
            stale.append(StaleSocket(path, ns_pid, f"process {ns_pid} is gone from the container"))
        elif not listening(path):
            why = f"nobody listens on it (process {ns_pid} ended, or exec'd without the shim)"
            stale.append(StaleSocket(path, ns_pid, why))
        else:
            live.append(LiveSocket(path, ns_pid, host))
    return live, stale


def listening(path: str, tries: int = 3, pause_s: float = 0.05) -> bool:
    """False when a connect to the unix socket at `path` is refused (every one of `tries`) or it is
    gone; True otherwise (a full backlog, or any other error, is not taken as proof that nobody
    listens). The shim binds, then listens: a refusal between the two is not a stale socket."""
    for attempt in range(tries):
        if attempt:
            time.sleep(pause_s)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.setblocking(False)
            try:
                with unfollowed(path) as address:  # the container's directory: follow no link there
                    sock.connect(address)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTSOCK):
                    return False
                if exc.errno != errno.ECONNREFUSED:
                    return True
                continue
        return True
    return False


def namespace_pids(container_pid: int, proc: Path = Path("/proc")) -> dict[int, int]:
    """Every process of the pid namespace `container_pid` is in: pid there -> host pid. OSError when
    that namespace cannot be read (the container's process is gone)."""
    want = os.readlink(proc / str(container_pid) / "ns" / "pid")
    found: dict[int, int] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):
            if os.readlink(proc / name / "ns" / "pid") != want:
                continue
            status = (proc / name / "status").read_text()
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if nspid:
                found[int(nspid[-1])] = int(name)
    return found


def remove(path: str) -> bool:
    """Remove a stale socket; whether it was removed. It is moved aside first and asked again: a process
    that took its pid and made its socket meanwhile listens on the moved one, which goes back."""
    aside = f"{path}.stale"  # not a name the agent takes for a rank
    try:
        os.rename(path, aside)
    except OSError:
        return False
    if listening(aside):
        with contextlib.suppress(OSError):
            os.rename(aside, path)
        return False
    with contextlib.suppress(OSError):
        os.unlink(aside)
    return True
