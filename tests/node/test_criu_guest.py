"""ibckpt_node.criu against real CRIU in the guest: dump, restore, TCP kept, errors in full, bounds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ibckpt_node import criu

pytestmark = pytest.mark.guest

# Sends a counter over an established TCP connection and logs what the echo server returns.
TCP_COUNTER = textwrap.dedent(
    """
    import socket, sys, time
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    n = 0
    with open(sys.argv[2], "a", buffering=1) as out:
        while True:
            sock.sendall(f"{n}\\n".encode())
            line = b""
            while not line.endswith(b"\\n"):
                line += sock.recv(64)
            out.write(line.decode())
            n += 1
            time.sleep(0.05)
    """
)


def echo_server() -> tuple[socket.socket, subprocess.Popen[bytes]]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    code = (
        "import socket,sys\n"
        "s=socket.socket(fileno=int(sys.argv[1]))\n"
        "c,_=s.accept()\n"
        "while (d:=c.recv(4096)): c.sendall(d)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(srv.fileno())], pass_fds=[srv.fileno()])
    return srv, proc


def wait_lines(path: Path, n: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            got = [int(x) for x in path.read_text().split()]
            if len(got) >= n:
                return got
        time.sleep(0.1)
    raise AssertionError(f"{path} did not reach {n} lines")


def test_dump_and_restore_keep_an_established_tcp_connection(tmp_path: Path) -> None:
    srv, echo = echo_server()
    script = tmp_path / "client.py"
    script.write_text(TCP_COUNTER)
    log = tmp_path / "echoed"
    with open(tmp_path / "client.err", "wb") as err:
        client = subprocess.Popen(
            [sys.executable, str(script), str(srv.getsockname()[1]), str(log)],
            stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True,
        )  # fmt: skip
    restored = None
    try:
        wait_lines(log, 5, 60)
        result = criu.dump(client.pid, tmp_path / "img", criu.DumpOptions(), timeout_s=120)
        assert (result.images / "dump.log").exists()
        client.wait(10)
        before = len(wait_lines(log, 5, 1))
        restored = criu.restore(tmp_path / "img", timeout_s=120)
        assert restored.pid == client.pid  # CRIU restores the same pid on the same node
        after = wait_lines(log, before + 10, 60)
        # The connection survived: the echo continues in sequence, nothing lost or repeated.
        assert after == list(range(len(after)))
    finally:
        if restored is not None:
            os.kill(restored.pid, signal.SIGKILL)
        client.kill()
        echo.kill()
        srv.close()


def test_failed_dump_names_the_cause_and_leaves_the_task_running(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        ["ibv_rc_pingpong", "-d", "rxe0", "-g", "1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        maps = Path(f"/proc/{holder.pid}/maps")
        deadline = time.monotonic() + 30
        while "/dev/infiniband/uverbs" not in maps.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(criu.CriuError) as info:
            criu.dump(holder.pid, tmp_path / "img", criu.DumpOptions(leave_running=True), timeout_s=120)
        message = str(info.value)
        assert f"criu dump of pid {holder.pid} failed: exit status" in message
        assert "Can't handle non-regular mapping" in message  # the log's tail is in the error
        assert holder.poll() is None
    finally:
        holder.kill()


def test_dump_is_bounded_in_time(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        with pytest.raises(criu.CriuError, match=r"timed out after 0.01s \(criu was killed\)"):
            criu.dump(sleeper.pid, tmp_path / "img", criu.DumpOptions(leave_running=True), timeout_s=0.01)
        assert sleeper.poll() is None
    finally:
        sleeper.kill()


def test_dump_refuses_a_used_image_dir(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "old.img").write_bytes(b"x")
    with pytest.raises(criu.CriuError, match="is not empty"):
        criu.dump(os.getpid(), tmp_path / "img", criu.DumpOptions(), timeout_s=5)
