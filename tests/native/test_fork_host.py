"""The shim's own state across fork(), on the host with no RDMA device: the shim preloaded into a
Python that drives it in-process through ibckpt_control (the same commands as the socket).

A child forked while its parent is quiesced under a lease runs: its gate is open, it holds no
lease, no thread of the shim's was copied, and its own quiesce and resume work; the parent stays
quiesced until it resumes. Forks while another thread runs commands back to back and the lease
watchdog ticks never hand a child a lock held mid-command: every child's commands answer. Plain,
ASan and UBSan shims."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shimtest import NATIVE_DIR, SHIM, SHIM_ASAN, SHIM_UBSAN

PROGRAM = """
import ctypes, json, os, signal, threading, time
g = ctypes.CDLL(None)
g.ibckpt_phase.restype = ctypes.c_char_p

def cmd(line):
    buf = ctypes.create_string_buffer(1 << 16)
    g.ibckpt_control(line.encode(), buf, len(buf))
    return json.loads(buf.value)

def shim_threads():
    n = 0
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/comm") as f:
            n += f.read().startswith("ibk-")
    return n

def in_child(report):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(5)  # a child stuck on a lock copied mid-command dies of it, and the parent sees how
        os.close(r)
        os.write(w, json.dumps(report()).encode())
        os._exit(0)
    os.close(w)
    got = os.read(r, 1 << 16)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return json.loads(got) if got else {"status": status}

out = {"quiesce": cmd("quiesce 2000")["ok"]}
for _ in range(200):  # the watchdog names itself once it runs
    if shim_threads():
        break
    time.sleep(0.01)
out["lease_thread"] = shim_threads()

def quiesced_parents_child():
    seen = {"phase": g.ibckpt_phase().decode(), "lease_ms": cmd("status")["lease_ms"],
            "shim_threads": shim_threads(), "threads": len(os.listdir("/proc/self/task"))}
    seen["quiesce"] = cmd("quiesce 2000")["ok"]
    seen["phase_quiesced"] = g.ibckpt_phase().decode()
    seen["resume"] = cmd("resume")["ok"]
    return seen

out["child"] = in_child(quiesced_parents_child)
out["parent_phase"] = g.ibckpt_phase().decode()
out["resume"] = cmd("resume")["ok"]

stop = threading.Event()
def busy():
    while not stop.is_set():
        cmd("quiesce 500"); cmd("lease 50"); cmd("status"); cmd("resume")
worker = threading.Thread(target=busy)
worker.start()
def child_commands():
    return {"ok": [cmd(c)["ok"] for c in ("quiesce 2000", "resume")], "state": cmd("status")["state"]}
out["busy_children"] = []
for _ in range(40):
    out["busy_children"].append(in_child(child_commands))
    if "status" in out["busy_children"][-1]:
        break  # one stuck child says enough
stop.set()
worker.join()
print(json.dumps(out))
"""


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR), "build/libibckpt.so", "sanitizers"], check=True)


@pytest.mark.parametrize("shim", [SHIM, SHIM_ASAN, SHIM_UBSAN], ids=["plain", "asan", "ubsan"])
def test_a_child_starts_running_with_state_of_its_own(tmp_path: Path, shim: Path) -> None:
    preload = str(shim)
    env = {"PATH": "/usr/bin:/bin", "IBCKPT_CTL": f"{tmp_path}/%p.sock", "IBCKPT_LEASE_MS": "60000"}
    if shim == SHIM_ASAN:  # the ASan runtime must be the first object in the process
        libasan = subprocess.run(
            ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
        preload = f"{libasan} {shim}"
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1"
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env={**env, "LD_PRELOAD": preload},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["quiesce"] and out["lease_thread"] == 1
    assert out["child"] == {
        "phase": "running",
        "lease_ms": 0,
        "shim_threads": 0,
        "threads": 1,
        "quiesce": True,
        "phase_quiesced": "quiesced",
        "resume": True,
    }
    assert out["parent_phase"] == "quiesced" and out["resume"]
    assert out["busy_children"] == [{"ok": [True, True], "state": "running"}] * 40
    # no device was opened: no process made a control socket
    assert list(tmp_path.iterdir()) == []
