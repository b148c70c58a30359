"""rdma_cm programs under the shim (issue 16): Debian's rping and ucmatose connect with
rdma_create_id, resolve_addr/route, connect/accept and rdma_create_qp, exchange their data, and
give the same results with and without the shim. Their connection ids live in the kernel behind
/dev/infiniband/rdma_cm, which the shim does not rebuild: status says so for the preflight."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from ibckpt_native import NATIVE_DIR, SHIM
from ibckpt_native.control import ShimControl

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
