"""Nothing the testbed starts survives a pytest that is killed outright (SIGKILL: no fixture teardown)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_killed_pytest_leaves_no_qemu_etcd_or_apiserver(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "python_files=orphans_case.py",
         f"--basetemp={tmp_path / 'inner'}", str(HERE / "selftest" / "orphans_case.py")],
        cwd=HERE.parents[1],
        env={**os.environ, "IBCKPT_ORPHANS_PIDS": str(pids_file)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not pids_file.exists():
            assert inner.poll() is None, inner.stdout.read().decode() if inner.stdout else ""
            assert time.monotonic() < deadline, "the inner pytest did not start its parts in 180 s"
            time.sleep(0.2)
        pids = [int(p) for p in pids_file.read_text().split()]
        # etcd, apiserver, controller-manager and two qemu guests, all running.
        assert len(pids) == 5 and all(_alive(p) for p in pids), pids
    finally:
        inner.send_signal(signal.SIGKILL)
        inner.wait()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in pids if _alive(p)}
    assert not survivors, f"still running after pytest was killed: {survivors}"
