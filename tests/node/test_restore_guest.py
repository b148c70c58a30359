"""Stop-checkpoint a two-rank verbs job and restore it on the same node (one guest), exactly once. Each
rank armed timers before the checkpoint (native/tests/timers.h: ITIMER_REAL as a one-shot alarm in one
rank and as an interval timer in the other, a POSIX timer and a timerfd in both); each fires once restored,
after the time it had left when the rank was frozen: the downtime does not count, nothing is lost."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from ibckpt_native.control import ShimControl
from shimtest import SHIM, TESTS_DIR
from shimtest.harness import parse_result, run_node_agent

pytestmark = pytest.mark.guest

DUE_S = 60  # the timers' delay from arming: longer than a checkpoint takes to freeze the ranks
RANKS = {
    "ring/rank-0/main/0": ("server", ["-A", f"alarm:{DUE_S}"]),
    "ring/rank-1/main/0": ("client", ["-c", "127.0.0.1", "-A", f"interval:{DUE_S}"]),
}
INTERVAL_S = 1  # rc_seq's interval timer repeats every second once it fired
SLACK_MS = 4000  # a signal's delivery to a process of the emulated guest, and the test's own steps


def _timers(out: str) -> dict[str, int]:
    """What rc_seq's TIMERS lines said, in its own clock: when armed, when each timer first fired,
    when it was frozen and thawed."""
    said: dict[str, int] = {}
    for line in re.findall(r"^TIMERS (.*)$", out, re.MULTILINE):
        said |= {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
    return said


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
    restore_called = time.monotonic() * 1000
    report = run_node_agent(coordinator.port, session, token, "restore", *ranks, "--epoch", "2")
    restore_returned = time.monotonic() * 1000
    assert report["outcome"] == "Succeeded", report
    time.sleep(2)
    for role, _ in RANKS.values():
        status = ShimControl(f"/run/ibckpt/{role}.ctl").status()
        assert status["state"] == "running" and status["epoch"] == 2, status
        # The restored threads each have their own cred: writes went through the device thread.
        assert status["delegated_writes"] > 0, status
    # once every timer fired (the ranks say so), they end and report when
    deadline = time.monotonic() + DUE_S + 120
    while not all("fired" in _timers((tmp_path / f"{r}.out").read_text()) for r, _ in RANKS.values()):
        said = {r: _timers((tmp_path / f"{r}.out").read_text()) for r, _ in RANKS.values()}
        assert time.monotonic() < deadline, f"not every timer fired after the restore: {said}"
        time.sleep(0.5)
    time.sleep(INTERVAL_S * 3)  # the client's interval timer fires again (its first may have been just now)
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
    span = restore_returned - restore_called
    for role, _ in RANKS.values():
        said = _timers((tmp_path / f"{role}.out").read_text())
        # all in the rank's own clock: the time left when frozen is what it waits once thawed
        left = said["armed"] + said["due"] - said["frozen"]
        assert left > SLACK_MS, f"{role}: its timers were due before the checkpoint froze it ({said})"
        # CRIU arms a timer during the restore, the shim (a lost one-shot) before the resume
        window = (said["thawed"] + left - span - SLACK_MS, said["thawed"] + left + span + SLACK_MS)
        for timer in ("real", "posix", "timerfd"):
            assert window[0] <= said[timer] <= window[1], (
                f"{role}: {timer} not within {window} (restore {span:.0f} ms: {said})"
            )
    assert _timers((tmp_path / "client.out").read_text())["real_count"] >= 2  # the interval went on
