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

DUE_S = 45  # the timers' delay from arming: longer than a checkpoint takes here
RANKS = {
    "ring/rank-0/main/0": ("server", ["-A", f"alarm:{DUE_S}"]),
    "ring/rank-1/main/0": ("client", ["-c", "127.0.0.1", "-A", f"interval:{DUE_S}"]),
}
SLACK_MS = 4000  # a signal's delivery to a process of the emulated guest, and the test's own steps


def _timers(out: str) -> tuple[dict[str, int], dict[str, int]]:
    """The TIMERS lines of rc_seq's output: what was armed, and when each timer first fired."""
    lines = [
        {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
        for line in re.findall(r"^TIMERS (.*)$", out, re.MULTILINE)
    ]
    return lines[0], lines[1] if len(lines) > 1 else {}


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
    dump_called = time.monotonic() * 1000
    report = run_node_agent(
        coordinator.port, session, token, "checkpoint", *ranks, "--images", images, "--mode", "Stop"
    )
    dump_returned = time.monotonic() * 1000
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
    # every timer's latest due moment, then the ranks end and report when theirs fired
    armed = {r: _timers((tmp_path / f"{r}.out").read_text())[0] for r, _ in RANKS.values()}
    latest = max(restore_returned + a["armed"] + a["due"] - dump_called for a in armed.values())
    time.sleep(max(0.0, (latest + SLACK_MS) / 1000 - time.monotonic()))
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
    for role, _ in RANKS.values():
        armed_at, fired = _timers((tmp_path / f"{role}.out").read_text())
        # the rank's own ticker saw its downtime: the time left when frozen is what is left to wait
        left = armed_at["armed"] + armed_at["due"] - fired["frozen"]
        said = (
            f"dump {dump_called:.0f}-{dump_returned:.0f}, "
            f"restore {restore_called:.0f}-{restore_returned:.0f}, armed {armed_at}, then {fired}"
        )
        assert dump_called <= fired["frozen"] and fired["thawed"] <= restore_returned, said
        assert left > SLACK_MS, f"{role}: its timers were due before the checkpoint froze it ({said})"
        window = (fired["thawed"] + left - SLACK_MS, restore_returned + left + SLACK_MS)
        for timer in ("real", "posix", "timerfd"):
            assert fired[timer], f"{role}: its {timer} timer never fired after the restore ({said})"
            assert window[0] <= fired[timer] <= window[1], f"{role}: {timer} not within {window} ({said})"
    assert _timers((tmp_path / "client.out").read_text())[1]["real_count"] >= 2  # the interval went on
