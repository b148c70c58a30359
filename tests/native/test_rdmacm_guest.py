"""rdma_cm programs under the shim (issue 16): Debian's rping and ucmatose connect with
rdma_create_id, resolve_addr/route, connect/accept and rdma_create_qp, exchange their data, and
give the same results with and without the shim. Their connection ids live in the kernel behind
/dev/infiniband/rdma_cm, which the shim does not rebuild: status says so, and the agent's preflight
refuses to checkpoint a rank that holds a connected rdma_cm QP."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from ibckpt_native import NATIVE_DIR, SHIM
from ibckpt_native.control import ShimControl
from ibckpt_node.preflight import ShimIdentity, shim_problems

pytestmark = pytest.mark.guest

ADDR = "10.77.0.1"  # rxe0's address in the guest


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR)], check=True)


def _env(shim: bool, ctl: Path | None = None) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": os.environ.get("HOME", "/root")}
    if shim:
        env["LD_PRELOAD"] = str(SHIM)
    if ctl is not None:
        env["IBCKPT_CTL"] = str(ctl)
    return env


def _pair(server: list[str], client: list[str], shim: bool, ctl: Path | None = None) -> tuple[str, str, str]:
    """Server and client; returns both outputs and the server's status (under the shim)."""
    srv = subprocess.Popen(
        server, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(shim, ctl)
    )
    status = ""
    try:
        time.sleep(3)  # the server is listening
        if ctl is not None:
            deadline = time.monotonic() + 60
            while not ctl.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            status = str(ShimControl(str(ctl)).status()["unsupported"])
        cli = subprocess.run(client, capture_output=True, text=True, env=_env(shim), timeout=300)
        out, _ = srv.communicate(timeout=300)
    finally:
        srv.kill()
    assert cli.returncode == 0 and srv.returncode == 0, (cli.stdout, cli.stderr, out)
    return out, cli.stdout + cli.stderr, status


def test_rping_same_with_and_without_the_shim(tmp_path: Path) -> None:
    server = ["rping", "-s", "-a", ADDR, "-p", "7174", "-C", "20", "-v"]
    client = ["rping", "-c", "-a", ADDR, "-p", "7174", "-C", "20", "-v"]
    plain_srv, plain_cli, _ = _pair(server, client, shim=False)
    srv, cli, status = _pair(server, client, shim=True, ctl=tmp_path / "rping.ctl")
    assert plain_cli.count("ping data: rdma-ping-") == 20
    assert cli == plain_cli and srv == plain_srv
    assert "rdma_cm (librdmacm connection ids)" in status


def test_ucmatose_same_with_and_without_the_shim() -> None:
    server = ["ucmatose", "-p", "7175", "-c", "4", "-C", "20"]
    client = ["ucmatose", "-s", ADDR, "-p", "7175", "-c", "4", "-C", "20"]
    plain_srv, plain_cli, _ = _pair(server, client, shim=False)
    srv, cli, _ = _pair(server, client, shim=True)
    assert "return status 0" in plain_cli and "return status 0" in plain_srv
    assert cli == plain_cli and srv == plain_srv


def _connected_status(ctl: Path, proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    """The status of a program under the shim once its QPs are all in RTS."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if ctl.exists():
            status = ShimControl(str(ctl)).status()
            qps = status["qps"]
            if qps and all(q["state"] == 3 for q in qps):
                return status
        time.sleep(0.2)
    raise AssertionError("the rdma_cm QP never reached RTS")


def test_connected_rdma_cm_qp_is_refused_by_the_preflight(tmp_path: Path) -> None:
    """rping pinging for ever: while its rdma_cm QP is connected, both ends' status lists the
    connection ids under unsupported, the agent's preflight turns that into a refusal, and asking
    touched nothing (the gate stays open, the pings go on)."""
    server = ["rping", "-s", "-a", ADDR, "-p", "7176"]
    client = ["rping", "-c", "-a", ADDR, "-p", "7176"]
    procs: list[subprocess.Popen[str]] = []
    try:
        for argv, name in ((server, "srv"), (client, "cli")):
            procs.append(
                subprocess.Popen(
                    argv,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    env=_env(True, tmp_path / f"{name}.ctl"),
                )
            )
            time.sleep(3)  # the server is listening before the client connects
        for name, proc in zip(("srv", "cli"), procs, strict=True):
            status = _connected_status(tmp_path / f"{name}.ctl", proc)
            assert "rdma_cm (librdmacm connection ids)" in status["unsupported"], status["unsupported"]
            problems = shim_problems(ShimIdentity.from_status(status))
            assert any("rdma_cm" in p for p in problems), problems
            assert status["state"] == "running" and status["gate_closed"] == 0, status
            before = sum(int(q["sends_completed"]) for q in status["qps"])
            time.sleep(1)
            after = ShimControl(str(tmp_path / f"{name}.ctl")).status()["qps"]
            assert sum(int(q["sends_completed"]) for q in after) > before, after
        assert all(p.poll() is None for p in procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()
