"""The `lease` command and its watchdog, on the host with no RDMA device: the shim preloaded into a
Python that drives it in-process through ibckpt_control (the same commands as the socket). A
quiesced or drained rank whose lease runs out resumes on its own and says so; a renewed one stays
held; a released one only says, once, that it waits for its rebuild. Plain, ASan and UBSan shims."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shimtest import NATIVE_DIR, SHIM, SHIM_ASAN, SHIM_UBSAN

PROGRAM = """
import ctypes, json, sys, time
g = ctypes.CDLL(None)
g.ibckpt_phase.restype = ctypes.c_char_p
buf = ctypes.create_string_buffer(1 << 16)
out = {}

def cmd(line):
    rc = g.ibckpt_control(line.encode(), buf, len(buf))
    return [rc, json.loads(buf.value)]

def held_for(limit):
    t0 = time.monotonic()
    while g.ibckpt_phase() != b"running" and time.monotonic() - t0 < limit:
        time.sleep(0.01)
    return round(time.monotonic() - t0, 3)

for bad in ("lease", "lease x", "lease -5", "lease 86400001", "lease 99999999999999999999999"):
    out[bad] = cmd(bad)
out["running"] = cmd("lease 700")
out["running_status"] = cmd("status")[1]["lease_ms"]
# the quiesce's own lease (IBCKPT_LEASE_MS), nobody renewing
out["quiesce"] = cmd("quiesce 2000")[1]["ok"]
out["quiesce_lease"] = cmd("status")[1]["lease_ms"]
out["quiesced_s"] = held_for(10)
# drained, a shorter lease from the agent
cmd("quiesce 2000"); cmd("drain 2000")
out["drain_lease"] = cmd("lease 500")
out["drained_s"] = held_for(10)
# renewed every 200 ms for 1.5 s: still held, then let go
cmd("quiesce 2000")
t0 = time.monotonic()
while time.monotonic() - t0 < 1.5:
    cmd("lease 500"); time.sleep(0.2)
out["renewed_phase"] = g.ibckpt_phase().decode()
out["renewed_s"] = held_for(10)
# lease 0: the agent hands the rank over for good
cmd("quiesce 2000"); cmd("lease 0"); time.sleep(1.5)
out["handed_phase"] = g.ibckpt_phase().decode()
out["resume"] = cmd("resume")[1]["ok"]
# released: only a rebuild brings the QPs back, so the shim waits
cmd("quiesce 2000"); cmd("drain 2000")
out["release"] = cmd("release 2000")[1]["ok"]
cmd("lease 300"); time.sleep(1.5)
out["released_phase"] = g.ibckpt_phase().decode()
out["released_status"] = cmd("status")[1]["lease_left_ms"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR), "build/libibckpt.so", "sanitizers"], check=True)


@pytest.mark.parametrize("shim", [SHIM, SHIM_ASAN, SHIM_UBSAN], ids=["plain", "asan", "ubsan"])
def test_lease_on_the_host(shim: Path) -> None:
    preload = str(shim)
    env = {"PATH": "/usr/bin:/bin", "IBCKPT_LEASE_MS": "800"}
    if shim == SHIM_ASAN:  # the ASan runtime must be the first object in the process
        libasan = subprocess.run(
            ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
        preload = f"{libasan} {shim}"
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1"
    env["LD_PRELOAD"] = preload
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    err = proc.stderr
    assert got["lease"][0] != 0 and got["lease"][1]["error"] == "lease needs ms"
    assert got["lease x"][1]["error"] == "lease needs ms"
    for bad in ("lease -5", "lease 86400001", "lease 99999999999999999999999"):
        assert got[bad][0] != 0 and not got[bad][1]["ok"], got[bad]
    # a renewal that comes after resume holds nothing
    assert got["running"] == [0, {"phase": "lease", "ok": True, "ms": 0, "state": "running", "lease_ms": 0}]
    assert got["running_status"] == 0
    assert got["quiesce"] and got["quiesce_lease"] == 800
    assert 0.7 <= got["quiesced_s"] < 3, got
    assert "lease expired (no renewal from the agent for 800 ms) while quiesced: resuming on my own" in err
    assert got["drain_lease"][1]["lease_ms"] == 500 and got["drain_lease"][1]["state"] == "drained"
    assert 0.4 <= got["drained_s"] < 3, got
    assert "lease expired (no renewal from the agent for 500 ms) while drained: resuming on my own" in err
    assert got["renewed_phase"] == "quiesced" and got["renewed_s"] < 3, got
    assert got["handed_phase"] == "quiesced" and got["resume"], got
    assert "lease ended by the agent while quiesced" in err
    assert got["release"] and got["released_phase"] == "released", got
    assert got["released_status"] < 0, got  # expired, still watched
    assert err.count("while released: the QPs are gone") == 1, err
    assert err.count("lease expired") == 4, err
