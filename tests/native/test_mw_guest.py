"""A memory window of type 1 survives checkpoints (issue 16): a pyverbs program binds one to part
of an MR with ibv_bind_mw, and its peer QP writes and reads through the window's rkey, the one it
read once after the bind, before and after rebuilds. Run with and without the shim: same results,
and in both an atomic through the window, which the MR allows and the window does not, fails (the
rebuilt window keeps its rights). Program: pv_ckpt_cases.py mw."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from shimtest import SHIM, SHIM_ASAN, SHIM_UBSAN
from shimtest.coordinator import Coordinator
from shimtest.harness import ShimProc, checkpoint, parse_fields, wait_traffic

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("built")]

CASES = Path(__file__).with_name("pv_ckpt_cases.py")
ENV = {"PATH": "/usr/bin:/bin", "PYTHONFAULTHANDLER": "1"}
READY = r"READY rkey=(\d+) bind=(\d+)"
IBV_WC_BIND_MW = 5
IBV_WC_REM_ACCESS_ERR = 10


def _result(text: str) -> dict[str, str]:
    fields = parse_fields(text)
    assert int(fields["rounds"]) > 0 and fields["bad"] == "0", text
    return fields


def test_mw_without_the_shim(tmp_path: Path) -> None:
    """The program itself, on libibverbs alone: what the shimmed runs must match."""
    stop = tmp_path / "stop"
    with (tmp_path / "out").open("w") as out:
        proc = subprocess.Popen(
            ["/usr/bin/python3", str(CASES), "mw", str(stop)], stdout=out, stderr=subprocess.STDOUT, env=ENV
        )
        try:
            deadline = time.monotonic() + 120
            while not re.search(READY, (tmp_path / "out").read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out").read_text()
                time.sleep(0.1)
            time.sleep(2)
            stop.touch()
            assert proc.wait(120) == 0, (tmp_path / "out").read_text()
        finally:
            proc.kill()
    text = (tmp_path / "out").read_text()
    m = re.search(READY, text)
    assert m and int(m.group(2)) == IBV_WC_BIND_MW, text
    assert _result(text)["outside"] == str(IBV_WC_REM_ACCESS_ERR), text


@pytest.mark.parametrize("shim", [SHIM, SHIM_ASAN, SHIM_UBSAN], ids=["plain", "asan", "ubsan"])
def test_mw_rkey_survives_checkpoints(tmp_path: Path, shim: Path) -> None:
    """Three checkpoints under traffic through the window; the program keeps its first rkey."""
    with Coordinator(tmp_path / "coord.sock") as coord:
        stop = tmp_path / "stop"
        prog = ShimProc(
            "mw", ["/usr/bin/python3", str(CASES), "mw", str(stop)], tmp_path, {**ENV, **coord.env}, shim
        )
        prog.start()
        try:
            m = prog.wait_for_output(READY, 120)
            status = prog.ctl.status()
            assert status["unsupported"] == [], status["unsupported"]
            wait_traffic([prog], 10)
            results, windows = [], [status["mws"]]
            for epoch in (1, 2, 3):
                results.append(checkpoint([prog], epoch))
                wait_traffic([prog], 10)
                windows.append(prog.ctl.status()["mws"])
            stop.touch()
            code = prog.wait(120)
        finally:
            prog.kill()
    assert code == 0, prog.outputs()
    for r in results:
        assert r.released_state["mw"] == (0, 0), r.released_state  # no device fd or mapping after release
        assert r.reports["rebuild"]["mw"]["ok"], r.reports["rebuild"]
    assert int(m.group(2)) == IBV_WC_BIND_MW, m.group(0)
    # the program's rkey is the window's virtual one throughout, and the rebuilt windows' real
    # rkeys differ from it: the peer's accesses were translated, not matched by chance
    rkey = int(m.group(1))
    assert all(w == [{"rkey": rkey, "real_rkey": w[0]["real_rkey"], "bound": 1}] for w in windows), windows
    assert windows[0][0]["real_rkey"] == rkey, windows
    assert all(w[0]["real_rkey"] != rkey for w in windows[1:]), windows
    fields = _result(prog.out.read_text())
    assert fields["outside"] == str(IBV_WC_REM_ACCESS_ERR), fields
    assert "libibckpt" not in prog.err.read_text(), prog.outputs()


def test_mw_bound_again_between_checkpoints(tmp_path: Path) -> None:
    """The program binds its window again every 5 rounds (each bind a new rkey), before and after
    rebuilds: every bind completes, and every access through the newest rkey lands."""
    with Coordinator(tmp_path / "coord.sock") as coord:
        stop = tmp_path / "stop"
        argv = ["/usr/bin/python3", str(CASES), "mw", str(stop), "5"]
        prog = ShimProc("mw", argv, tmp_path, {**ENV, **coord.env}, SHIM)
        prog.start()
        try:
            prog.wait_for_output(READY, 120)
            wait_traffic([prog], 30)
            for epoch in (1, 2):
                assert checkpoint([prog], epoch).reports["rebuild"]["mw"]["ok"]
                wait_traffic([prog], 30)
            stop.touch()
            code = prog.wait(120)
        finally:
            prog.kill()
    assert code == 0, prog.outputs()
    fields = _result(prog.out.read_text())
    assert int(fields["rebinds"]) >= 6 and fields["outside"] == str(IBV_WC_REM_ACCESS_ERR), fields
    assert "libibckpt" not in prog.err.read_text(), prog.outputs()


def test_mw_bind_queued_behind_an_undelivered_send(tmp_path: Path) -> None:
    """A checkpoint finds a bind in the send log behind a send the peer has not taken (RNR): the
    rebuild posts the send again and, in the bind's place, a zero-length write (the window is
    bound again by the rebuild itself); the program sees both complete, the bind as
    IBV_WC_BIND_MW, and its peer writes through the window."""
    with Coordinator(tmp_path / "coord.sock") as coord:
        go = tmp_path / "go"
        argv = ["/usr/bin/python3", str(CASES), "mw_queued", str(go)]
        prog = ShimProc("mwq", argv, tmp_path, {**ENV, **coord.env}, SHIM)
        prog.start()
        try:
            prog.wait_for_output(r"READY rkey=\d+", 120)
            result = checkpoint([prog], 1)
            reposted = sorted(int(q["reposted"]) for q in prog.ctl.status()["qps"])
            go.touch()
            code = prog.wait(120)
        finally:
            prog.kill()
    assert code == 0, prog.outputs()
    assert result.reports["rebuild"]["mwq"]["ok"], result.reports
    assert reposted == [0, 2], reposted  # A's send and, in the bind's place, the zero-length write
    fields = parse_fields(prog.out.read_text())
    assert fields == {"send": "0", "bind": f"0/{IBV_WC_BIND_MW}", "through": "True"}, prog.outputs()
    assert "libibckpt" not in prog.err.read_text(), prog.outputs()
