"""Stop-checkpoint a two-rank verbs job and restore it on the same node (one guest), exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from ibckpt_native.control import ShimControl
from shimtest import SHIM, TESTS_DIR
from shimtest.harness import parse_result, run_node_agent

pytestmark = pytest.mark.guest

RANKS = {"ring/rank-0/main/0": ("server", []), "ring/rank-1/main/0": ("client", ["-c", "127.0.0.1"])}


def test_stop_then_restore_on_the_same_node(coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    Path("/run/ibckpt").mkdir(parents=True, exist_ok=True)
    stop = tmp_path / "stop"
    pids = {}
    for key, (role, extra) in RANKS.items():
        env = {**os.environ, "LD_PRELOAD": str(SHIM), "IBCKPT_CTL": f"/run/ibckpt/{role}.ctl",
               "IBCKPT_COORD": "unix:/run/ibckpt/coord.sock"}  # fmt: skip
        with open(tmp_path / f"{role}.out", "wb") as out, open(tmp_path / f"{role}.err", "wb") as err:
            proc = subprocess.Popen(
                [str(TESTS_DIR / "rc_seq"), "-f", str(stop), "-p", "18600", *extra],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, start_new_session=True,
            )  # fmt: skip
        pids[key] = proc.pid
        time.sleep(0.5)
    deadline = time.monotonic() + 120
    while not all("READY" in (tmp_path / f"{r}.out").read_text() for r, _ in RANKS.values()):
        assert time.monotonic() < deadline, "rc_seq never connected"
        time.sleep(0.1)
    time.sleep(2)

    session, tokens = coordinator.create_session({"node-1"})

    token = tokens["node-1"]
    ranks = [f"--rank={k}={pids[k]}:/run/ibckpt/{r}.ctl" for k, (r, _) in RANKS.items()]
    images = str(tmp_path / "img")
    report = run_node_agent(
        coordinator.port, session, token, "checkpoint", *ranks, "--images", images, "--mode", "Stop"
    )
    assert report["outcome"] == "Stopped"
    for pid in pids.values():  # Stop: CRIU killed them (zombies until reaped)
        subprocess.run(["true"])
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    session, tokens = coordinator.create_session({"node-1"})

    token = tokens["node-1"]
    ranks = [f"--rank={k}={images}/{k.replace('/', '_')}:/run/ibckpt/{r}.ctl" for k, (r, _) in RANKS.items()]
    report = run_node_agent(coordinator.port, session, token, "restore", *ranks, "--epoch", "2")
    assert report["outcome"] == "Succeeded", report
    time.sleep(2)
    for role, _ in RANKS.values():
        status = ShimControl(f"/run/ibckpt/{role}.ctl").status()
        assert status["state"] == "running" and status["epoch"] == 2, status
        # The restored threads each have their own cred: writes went through the device thread.
        assert status["delegated_writes"] > 0, status
    stop.touch()
    deadline = time.monotonic() + 120
    while not all("RESULT" in (tmp_path / f"{r}.out").read_text() for r, _ in RANKS.values()):
        errs = {r: (tmp_path / f"{r}.err").read_text() for r, _ in RANKS.values()}
        assert time.monotonic() < deadline, f"no RESULT after restore: {errs} {json.dumps(report)[:3000]}"
        time.sleep(0.2)
    server = parse_result((tmp_path / "server.out").read_text())
    client = parse_result((tmp_path / "client.out").read_text())
    assert server["bad"] == 0 and client["bad"] == 0
    assert server["sent"] == client["received"] and client["sent"] == server["received"]
    assert server["send_sum"] == client["recv_sum"] and client["send_sum"] == server["recv_sum"]
