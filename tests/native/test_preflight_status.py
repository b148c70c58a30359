"""On the host, with no RDMA device: a verb the shim refuses fails with EOPNOTSUPP and is listed,
once, under `unsupported` in the shim's status, which the agent's preflight turns into a refusal
of the checkpoint. Refused verbs that take no device object are called through the global symbol
scope, as a program linked against libibverbs would reach them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ibckpt_native.control import ShimStatus
from ibckpt_node.preflight import ShimIdentity, shim_problems
from shimtest import NATIVE_DIR, SHIM

PROGRAM = """
import ctypes, json
g = ctypes.CDLL(None, use_errno=True)
g.ibv_import_device.restype = ctypes.c_void_p
g.ibv_import_pd.restype = ctypes.c_void_p
got = {}
got["device"] = [g.ibv_import_device(-1), ctypes.get_errno()]
got["pd"] = [g.ibv_import_pd(None, 7), ctypes.get_errno()]
g.ibv_import_device(-1)
buf = ctypes.create_string_buffer(1 << 16)
got["rc"] = g.ibckpt_control(b"status", buf, len(buf))
got["status"] = json.loads(buf.value)
print(json.dumps(got))
"""


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR), "build/libibckpt.so"], check=True)


def test_refused_verbs_are_listed_once_and_refuse_the_checkpoint() -> None:
    env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(SHIM)}
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["device"] == [None, 95] and got["pd"] == [None, 95], got
    status = got["status"]
    assert got["rc"] == 0 and status["unsupported"] == ["ibv_import_device", "ibv_import_pd"], status
    problems = shim_problems(ShimIdentity.from_status(ShimStatus.parse(status)))
    assert problems == [
        "the shim refused ibv_import_device (not supported under checkpointing)",
        "the shim refused ibv_import_pd (not supported under checkpointing)",
    ]
    # nothing was touched: no verbs object, the gate open
    assert status["state"] == "running" and status["gate_closed"] == 0 and status["qps"] == []
    # no rdma_cm channel: nothing of librdmacm's to carry or refuse
    assert status["rdma_cm"] == {"ids": [], "channels": 0, "detached": 0}, status
