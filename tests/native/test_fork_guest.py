"""The shim across fork() and exec() (issue 29), with programs written as outsiders write them.

- pv_fork_cm.py: pyverbs workers made by multiprocessing (fork) connect over rdma_cm (a synchronous
  server, whose accepted ids librdmacm migrates to channels of their own, and a client), each also
  resolving an address on an event channel of its own; then the parent connects itself. Parents
  that touched no verbs, that opened a device and an rdma_cm channel first, after ibv_fork_init,
  and under RDMAV_FORK_SAFE: the same lines with and without the shim, and under the shim each
  worker's own control socket answers with its own channels and QP.
- native/tests/fork_seq: a C parent forks after opening a device; the child opens its own, makes an
  rdma_cm id, and exchanges messages with the parent's QP (plain, ASan shims; ibv_fork_init and
  RDMAV_FORK_SAFE). A child that uses no verbs has no thread and no socket of the shim's. After an
  exec, in a child and in place, the new image holds no descriptor beyond stdio and no thread.
  With IBCKPT_CTL lacking "%p", a child makes no socket: the name stays the parent's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from shimtest import SHIM, SHIM_ASAN, TESTS_DIR

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("built")]

PV_FORK_CM = Path(__file__).with_name("pv_fork_cm.py")
FORK_SEQ = TESTS_DIR / "fork_seq"
FORK_ENVS = {"default": {}, "ibv_fork_init": {"FORK_INIT": "1"}, "RDMAV_FORK_SAFE": {"RDMAV_FORK_SAFE": "1"}}


def _preload(shim: Path) -> str:
    if shim != SHIM_ASAN:
        return str(shim)
    # the ASan runtime must be the first object in the process
    libasan = subprocess.run(
        ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    )
    return f"{libasan.stdout.strip()} {shim}"


def _run(argv: list[str], shim: Path | None, ctl: str | None = None, **extra: str) -> tuple[list[str], str]:
    """stdout's lines and stderr of one run, which must exit 0."""
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": os.environ.get("HOME", "/root"), **extra}
    if shim is not None:
        env["LD_PRELOAD"] = _preload(shim)
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1"
    if ctl is not None:
        env["IBCKPT_CTL"] = ctl
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return proc.stdout.splitlines(), proc.stderr


def _app(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith("shim:")]


def _shim(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("shim:")]


@pytest.mark.parametrize(
    ("mode", "fork_env"),
    [("fresh", "default"), ("opened", "default"), ("fork_init", "default"), ("opened", "RDMAV_FORK_SAFE")],
)
def test_pyverbs_rdma_cm_workers_same_with_and_without_the_shim(
    tmp_path: Path, mode: str, fork_env: str
) -> None:
    extra = {k: v for k, v in FORK_ENVS[fork_env].items() if k != "FORK_INIT"}
    plain, _ = _run(["/usr/bin/python3", str(PV_FORK_CM), mode, "7410"], None, **extra)
    shimmed, err = _run(
        ["/usr/bin/python3", str(PV_FORK_CM), mode, "7420"], SHIM, f"{tmp_path}/%p.ctl", **extra
    )
    assert _app(shimmed) == _app(plain)
    assert _app(plain).count("worker exit 0") == 3
    assert sum("got echo" in line for line in _app(plain)) == 8
    assert sum(line.endswith("addr resolved") for line in _app(plain)) == 4
    # each worker (and the parent, once connected) answered on a socket of its own pid, about its
    # own channels (a synchronous server: its listener's and its connection's), not the parent's
    # a worker of a parent that opened a device and a channel first holds both: its checkpoint is refused
    parents = 1 if mode == "fresh" else 2  # the channel the parent made before forking
    held = 0 if mode == "fresh" else 2
    assert sorted(_shim(shimmed)) == sorted(
        [
            f"shim: server status ok channels 2 qps 1 parent's {held}",
            f"shim: client status ok channels 1 qps 1 parent's {held}",
            f"shim: server status ok channels 2 qps 1 parent's {held}",
            f"shim: parent status ok channels {parents} qps 1 parent's 0",
        ]
    ), _shim(shimmed)
    assert "not supported" not in err, err


@pytest.mark.parametrize("fork_env", list(FORK_ENVS))
@pytest.mark.parametrize("shim", [SHIM, SHIM_ASAN], ids=["plain", "asan"])
def test_a_forked_child_opens_its_own_device_and_talks_to_its_parent(
    tmp_path: Path, shim: Path, fork_env: str
) -> None:
    plain, _ = _run([str(FORK_SEQ), "verbs"], None, **FORK_ENVS[fork_env])
    shimmed, err = _run([str(FORK_SEQ), "verbs"], shim, f"{tmp_path}/%p.ctl", **FORK_ENVS[fork_env])
    assert _app(shimmed) == _app(plain)
    assert "child: 8 messages echoed" in plain and "parent: 8 messages echoed, child exit 0" in plain
    assert _shim(shimmed) == [
        "shim: child before verbs threads 0 socket absent",  # nothing until its first verb
        # its own control thread and socket, whose status lists the parent's context it still holds
        "shim: child after verbs threads 1 socket answers, 1 of the parent's",
        "shim: parent threads 1 socket answers, 0 of the parent's",  # through the child's life and exit
    ]
    assert "ERROR: AddressSanitizer" not in err, err


def test_a_child_that_uses_no_verbs_costs_nothing(tmp_path: Path) -> None:
    plain, _ = _run([str(FORK_SEQ), "idle"], None)
    shimmed, _ = _run([str(FORK_SEQ), "idle"], SHIM, f"{tmp_path}/%p.ctl")
    assert _app(shimmed) == _app(plain) == ["child: threads 1", "parent: child exit 0"]
    assert _shim(shimmed) == [
        "shim: idle child threads 0 socket absent",
        "shim: parent threads 1 socket answers, 0 of the parent's",
    ]


@pytest.mark.parametrize("shim", [SHIM, SHIM_ASAN], ids=["plain", "asan"])
def test_nothing_crosses_an_exec(tmp_path: Path, shim: Path) -> None:
    plain, _ = _run([str(FORK_SEQ), "exec"], None)
    shimmed, err = _run([str(FORK_SEQ), "exec"], shim, f"{tmp_path}/%p.ctl")
    assert _app(shimmed) == _app(plain)
    # a forked child's exec, then the parent's own: no fd beyond stdio, one thread
    assert _app(plain) == [
        "fds: 0 beyond stdio, threads 1",
        "parent: child exit 0",
        "fds: 0 beyond stdio, threads 1",
    ]
    assert _shim(shimmed) == [
        "shim: parent before exec threads 1 socket answers, 0 of the parent's",
        "shim: exec'd image threads 0 socket absent",
        "shim: exec'd image threads 0 socket absent",  # same pid: the old image's socket is gone
    ]
    assert list(tmp_path.glob("*.ctl")) == []
    assert "ERROR: AddressSanitizer" not in err, err


def test_a_fixed_control_socket_stays_the_parents(tmp_path: Path) -> None:
    ctl = tmp_path / "rank.ctl"
    shimmed, err = _run([str(FORK_SEQ), "verbs"], SHIM, str(ctl))
    assert "child: 8 messages echoed" in shimmed
    # the child's verbs work, it starts no control thread, and the name still answers for the parent
    assert _shim(shimmed) == [
        "shim: child before verbs threads 0 socket answers, 0 of the parent's",
        "shim: child after verbs threads 0 socket answers, 0 of the parent's",
        "shim: parent threads 1 socket answers, 0 of the parent's",
    ]
    assert "has no %p: this fork child makes no control socket of its own" in err, err
