"""The control socket's file on every way a process ends (issue 30, item 5), on the host: a socket
left by an ended process is a rank the agent cannot reach. ctlsock.c alone in a small program (plain,
ASan, UBSan), and the shim's load-time removal through LD_PRELOAD of the real libraries."""

from __future__ import annotations

import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shimtest import BUILD_DIR, NATIVE_DIR, SHIM, SHIM_ASAN, SHIM_UBSAN

PROGRAMS = {
    "plain": BUILD_DIR / "hosttests" / "ctlsock_exit",
    "asan": BUILD_DIR / "hosttests" / "ctlsock_exit-asan",
    "ubsan": BUILD_DIR / "hosttests" / "ctlsock_exit-ubsan",
}
# ASan takes the fault signals for itself; the shim then leaves them alone (asserted below)
ASAN_OPTIONS = "detect_leaks=0:handle_segv=0:handle_sigbus=0:handle_sigfpe=0:handle_abort=0"


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    targets = [str(p.relative_to(NATIVE_DIR)) for p in PROGRAMS.values()]
    targets += ["build/libibckpt.so", "sanitizers"]
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR), *targets], check=True)


def no_core() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for number in (signal.SIGHUP, signal.SIGINT):  # ignored under nohup or a background shell
        signal.signal(number, signal.SIG_DFL)


def ended(program: Path, how: str, ctl: Path) -> tuple[int, Path, str]:
    """Run the program to its end `how`: its exit status, its socket's path and its stderr."""
    env = {"IBCKPT_CTL": f"{ctl}/%p.sock", "ASAN_OPTIONS": ASAN_OPTIONS}
    proc = subprocess.run(
        [str(program), how], capture_output=True, text=True, env=env, timeout=30, preexec_fn=no_core
    )
    assert proc.stdout.strip(), f"{how}: no socket made (status {proc.returncode}): {proc.stderr}"
    return proc.returncode, Path(proc.stdout.strip()), proc.stderr


# how the process ends -> its exit status, and whether its socket stays behind
ENDINGS = {
    "exit": (0, False),
    "fork": (0, False),  # a fork child's exit() leaves its parent's socket (the program checks)
    str(int(signal.SIGTERM)): (-signal.SIGTERM, False),
    str(int(signal.SIGINT)): (-signal.SIGINT, False),
    str(int(signal.SIGHUP)): (-signal.SIGHUP, False),
    "abort": (-signal.SIGABRT, False),
    "segv": (-signal.SIGSEGV, False),
    # what no process can catch, and an app's own handler: the agent drops these sockets
    str(int(signal.SIGKILL)): (-signal.SIGKILL, True),
    "_exit": (0, True),
    "handler": (3, True),
}


@pytest.mark.parametrize("variant", sorted(PROGRAMS))
@pytest.mark.parametrize("how", sorted(ENDINGS))
def test_socket_goes_with_its_process(tmp_path: Path, variant: str, how: str) -> None:
    status, path, err = ended(PROGRAMS[variant], how, tmp_path)
    want_status, stays = ENDINGS[how]
    assert status == want_status, err
    assert path.parent == tmp_path and path.name.removesuffix(".sock").isdigit()
    assert path.exists() == stays, f"{how}: {sorted(tmp_path.iterdir())}"
    assert not list(tmp_path.glob("*.new")), "the temporary name outlived the bind"
    assert "runtime error" not in err and "AddressSanitizer" not in err, err


EXEC_OVER_STALE = """
import os, socket, sys
path = os.path.join(sys.argv[1], f"{os.getpid()}.sock")
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
s.listen(1)  # close-on-exec: after the exec nobody listens here
env = dict(os.environ, LD_PRELOAD=sys.argv[2])
os.execve(sys.argv[3], sys.argv[3:], env)
"""


@pytest.mark.parametrize("shim", [SHIM, SHIM_ASAN, SHIM_UBSAN], ids=["plain", "asan", "ubsan"])
def test_exec_image_removes_the_socket_of_its_pid(tmp_path: Path, shim: Path) -> None:
    """An exec'd image's shim removes the socket its pid left (the old image's listener closed)."""
    preload = str(shim)
    env = {"PATH": "/usr/bin:/bin", "IBCKPT_CTL": f"{tmp_path}/%p.sock", "ASAN_OPTIONS": "detect_leaks=0"}
    if shim == SHIM_ASAN:  # the ASan runtime must be the first object in the process
        libasan = subprocess.run(
            ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
        preload = f"{libasan} {shim}"
    other = tmp_path / "1.sock"  # another pid's socket is not this process's to remove
    keep = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    keep.bind(str(other))
    keep.listen(1)
    script = f'test ! -e "{tmp_path}/$$.sock" && test -S "{other}"'
    argv = [sys.executable, "-c", EXEC_OVER_STALE, str(tmp_path), preload, "/bin/sh", "-c", script]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    keep.close()
    assert proc.returncode == 0, (proc.stderr, sorted(p.name for p in tmp_path.iterdir()))


def test_exec_image_with_a_fixed_path_removes_nothing(tmp_path: Path) -> None:
    """Without "%p" the path may be another live process's socket: the shim leaves it at load."""
    fixed = tmp_path / "ctl.sock"
    keep = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    keep.bind(str(fixed))
    keep.listen(1)
    env = {"PATH": "/usr/bin:/bin", "IBCKPT_CTL": str(fixed), "LD_PRELOAD": str(SHIM)}
    proc = subprocess.run(["/bin/true"], env=env, timeout=30)
    keep.close()
    assert proc.returncode == 0 and fixed.exists()
