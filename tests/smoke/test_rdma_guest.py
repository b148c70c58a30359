"""Inside one Soft-RoCE guest: the device, real verbs traffic, and CRIU (the project's baseline).

These run in the guest (see testbed/pytest_guest.py); the host's report shows their results.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.guest


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def spawn_detached(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Own session, no tty: CRIU cannot dump a task that sits on the serial console."""
    with open(log, "wb") as out:
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def criu(action: str, images: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`criu ACTION -D IMAGES -o ACTION.log FLAGS` (the images directory made if need be): its log is
    IMAGES/ACTION.log."""
    images.mkdir(exist_ok=True)
    argv = ["criu", action, "-D", str(images), "-o", f"{action}.log", *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_rxe_device_is_up() -> None:
    assert Path("/dev/infiniband/uverbs0").exists()
    info = subprocess.run(
        ["ibv_devinfo", "-d", "rxe0", "-v"], capture_output=True, text=True, check=True
    ).stdout
    assert "PORT_ACTIVE" in info
    assert re.search(r"GID\[\s*1\]:\s+::ffff:10\.77\.0\.\d+, RoCE v2", info), info


def listening(port: int) -> bool:
    """A TCP socket of this guest listens on `port` (state 0A in /proc/net/tcp)."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A" for r in rows)


def test_rc_pingpong_between_two_processes(tmp_path: Path) -> None:
    server = spawn_detached(
        ["ibv_rc_pingpong", "-d", "rxe0", "-g", "1", "-n", "200", "-p", "18520"], tmp_path / "server.log"
    )
    try:
        # A loaded emulated guest takes its time to open the device; the client connects only once.
        wait_for(lambda: listening(18520) or server.poll() is not None, 60, "the server to listen")
        client = subprocess.run(
            ["ibv_rc_pingpong", "-d", "rxe0", "-g", "1", "-n", "200", "-p", "18520", "127.0.0.1"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert client.returncode == 0, client.stdout + client.stderr + (tmp_path / "server.log").read_text()
        assert server.wait(timeout=30) == 0, (tmp_path / "server.log").read_text()
    finally:
        server.kill()
        server.wait()
    for text in (client.stdout, (tmp_path / "server.log").read_text()):
        assert "200 iters in" in text


COUNTER = textwrap.dedent(
    """
    import sys, time
    n = 0
    with open(sys.argv[1], "a", buffering=1) as out:
        while True:
            out.write(f"{n}\\n")
            n += 1
            time.sleep(0.05)
    """
)


def read_counts(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def test_criu_dump_and_restore_plain_process(tmp_path: Path) -> None:
    script = tmp_path / "counter.py"
    script.write_text(COUNTER)
    counts = tmp_path / "counts"
    proc = spawn_detached([sys.executable, str(script), str(counts)], tmp_path / "counter.log")
    wait_for(lambda: counts.exists() and len(read_counts(counts)) > 5, 30, "counter to start")
    images = tmp_path / "images"
    dump = criu("dump", images, "-t", str(proc.pid), "-v4")
    assert dump.returncode == 0, (images / "dump.log").read_text()[-3000:]
    proc.wait(timeout=10)  # dump without --leave-running kills the task
    before = read_counts(counts)
    time.sleep(0.5)
    assert read_counts(counts) == before, "task still running after dump"

    restore = criu("restore", images, "-v4", "--restore-detached")
    assert restore.returncode == 0, (images / "restore.log").read_text()[-3000:]
    try:
        wait_for(lambda: len(read_counts(counts)) > len(before) + 5, 30, "restored counter to go on")
        after = read_counts(counts)
        # The restored task continues from its own memory: no restart from 0, no gap.
        assert after == list(range(len(after)))
    finally:
        os.kill(proc.pid, signal.SIGKILL)


def test_criu_refuses_process_holding_verbs_resources(tmp_path: Path) -> None:
    """The problem ibckpt exists to solve: CRIU cannot dump a task with uverbs mappings."""
    argv = ["ibv_rc_pingpong", "-d", "rxe0", "-g", "1", "-p", "18521"]
    server = spawn_detached(argv, tmp_path / "server.log")
    try:
        maps = Path(f"/proc/{server.pid}/maps")
        wait_for(lambda: "/dev/infiniband/uverbs" in maps.read_text(), 60, "verbs mapping")
        images = tmp_path / "images"
        dump = criu("dump", images, "-t", str(server.pid), "--leave-running")
        log = (images / "dump.log").read_text()
        assert dump.returncode != 0
        assert "Can't handle non-regular mapping" in log, log[-3000:]
        assert server.poll() is None, "a failed dump must leave the task running"
    finally:
        server.kill()
        server.wait()
