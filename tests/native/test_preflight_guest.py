"""What a checkpoint cannot carry shows in the shim's status before anything is touched, and an
address handle made from a work completion after a rebuild names the sender by its virtual GID
even when the real GIDs changed under it (issue 16). Programs: pv_ckpt_cases.py (pyverbs)."""

from __future__ import annotations

import ipaddress
import subprocess
import time
from pathlib import Path

import pytest

from ibckpt_native.control import ShimStatus
from ibckpt_node.preflight import ShimIdentity, shim_problems
from ibckpt_node.procfs import device_fds_and_maps
from shimtest import SHIM, SHIM_ASAN, SHIM_UBSAN
from shimtest.coordinator import Coordinator
from shimtest.harness import ShimProc, checkpoint, parse_fields, wait_traffic

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("built")]

CASES = Path(__file__).with_name("pv_ckpt_cases.py")
PORT = Path("/sys/class/infiniband/rxe0/ports/1")
OLD, NEW = "10.77.0.21", "10.77.0.22"  # the GID that moves, before and after the checkpoint


def _proc(
    tmp_path: Path, name: str, argv: list[str], shim: Path, env: dict[str, str] | None = None
) -> ShimProc:
    # a crash in the shim leaves the Python stack on stderr
    env = {"PATH": "/usr/bin:/bin", "PYTHONFAULTHANDLER": "1", **(env or {})}
    return ShimProc(name, ["/usr/bin/python3", str(CASES), *argv], tmp_path, env, shim=shim)


# the shim as shipped, and under ASan and UBSan (the new status and AH paths run in all three)
SHIMS = pytest.mark.parametrize("shim", [SHIM, SHIM_ASAN, SHIM_UBSAN], ids=["plain", "asan", "ubsan"])


@SHIMS
def test_status_lists_what_a_checkpoint_cannot_carry(tmp_path: Path, shim: Path) -> None:
    stop = tmp_path / "stop"
    prog = _proc(tmp_path, "refusals", ["refusals", str(stop)], shim)
    prog.start()
    try:
        m = prog.wait_for_output(r"READY (\d+) (\d+) mw=(-?\d+) raw=(-?\d+)", 120)
        status = prog.ctl.status()
        stop.touch()
        code = prog.wait(60)
    finally:
        prog.kill()
    assert code == 0, prog.outputs()
    qpn_b = int(m.group(2))
    # the app got clean errors it could handle (EOPNOTSUPP), no crash
    assert m.group(3) == "95" and m.group(4) == "95", m.group(0)
    refused = status["unsupported"]
    assert "ibv_alloc_mw" in refused, refused
    # rxe refuses a raw packet QP itself (EOPNOTSUPP natively too): the shim passes the device's
    # answer on, and the process holds nothing a checkpoint would miss
    assert f"ibv_modify_qp (QP {qpn_b}: more than 8 calls since RESET, not replayable)" in refused, refused
    assert len(refused) == 2, refused
    # the agent's preflight turns each into a reason to refuse the checkpoint
    problems = shim_problems(ShimIdentity.from_status(ShimStatus.parse(status)))
    assert len(problems) == 2 and all("ibv_" in p for p in problems), problems
    # and asking touched nothing: the process runs, its QPs are connected, its device is open
    assert status["state"] == "running" and status["gate_closed"] == 0, status
    assert [q["state"] for q in status["qps"]] == [3, 3], status["qps"]


def _gone(prog: ShimProc, exc: Exception) -> AssertionError:
    """The failure to report when the program's control socket stopped answering: how the program
    ended and what it printed."""
    code = None if prog.popen is None else prog.popen.poll()
    return AssertionError(f"{prog.name}: {exc!r}; exit code {code}; {prog.outputs()}")


def _sh(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, text=True)


def _gid_index(addr: str, timeout: float = 30) -> int:
    """The index of the RoCEv2 GID of an IPv4 address in rxe0's table, once it is there."""
    want = ipaddress.IPv6Address(f"::ffff:{addr}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i in range(8):
            try:
                text = (PORT / "gids" / str(i)).read_text().strip()
            except OSError:
                continue
            if ipaddress.IPv6Address(text) == want:
                return i
        time.sleep(0.2)
    raise AssertionError(f"no GID for {addr}")


def _gid_hex(addr: str) -> str:
    return ipaddress.IPv6Address(f"::ffff:{addr}").packed.hex()


@SHIMS
def test_ah_from_wc_after_a_rebuild_that_changed_the_gid(tmp_path: Path, shim: Path) -> None:
    """UD requests and answers over the GID of OLD; between release and rebuild that address is
    replaced by NEW, so the rebuilt QPs' real GID differs from the virtual one and every GRH
    carries NEW. The answers keep flowing through AHs made from those completions, and every AH
    the process holds names OLD (the preflight would refuse a GID no rank holds). That checkpoint
    comes while the program holds a request it received before it, whose GRH names OLD, a GID the
    device no longer has; its AH is made after the rebuild (the AH from such a completion failed
    with EINVAL, and the program died, when a checkpoint happened to cut a round there)."""
    netdev = (PORT / "gid_attrs" / "ndevs" / "1").read_text().strip()
    _sh("ip", "addr", "add", f"{OLD}/32", "dev", netdev)
    try:
        index = _gid_index(OLD)
        assert index < 4, index  # the shim virtualizes the first four GIDs
        with Coordinator(tmp_path / "coord.sock") as coord:
            stop = tmp_path / "stop"
            hold = tmp_path / "hold"
            prog = _proc(tmp_path, "udreply", ["ud_reply", str(stop), str(index), str(hold)], shim, coord.env)
            prog.start()
            try:
                prog.wait_for_output("READY", 120)
                wait_traffic([prog], 10)
                first = checkpoint([prog], 1)
                wait_traffic([prog], 10)
                # the second checkpoint by hand, with a request received before it: the GID
                # changes while the device is released
                hold.touch()
                prog.wait_for_output("HELD", 120)
                prog.ctl.quiesce(20000)
                prog.ctl.drain(3000)
                prog.ctl.release(10000)
                assert device_fds_and_maps(prog.pid) == (0, 0)
                _sh("ip", "addr", "del", f"{OLD}/32", "dev", netdev)
                _sh("ip", "addr", "add", f"{NEW}/32", "dev", netdev)
                assert _gid_index(NEW) == index  # the new address took the old one's slot
                rebuilt = prog.ctl.rebuild(2, 60000)
                prog.ctl.resume()
                hold.unlink()
                wait_traffic([prog], 20)
                ah_gids = set(prog.ctl.status()["ah_gids"])
                stop.touch()
                code = prog.wait(120)
            except OSError as exc:  # the control socket is gone: say why the program ended
                raise _gone(prog, exc) from exc
            finally:
                prog.kill()
    finally:
        for addr in (OLD, NEW):
            subprocess.run(["ip", "addr", "del", f"{addr}/32", "dev", netdev], capture_output=True)
    assert first.reports["rebuild"]["udreply"]["ok"] and rebuilt["ok"], (first.reports, rebuilt)
    assert code == 0, prog.outputs()
    fields = parse_fields(prog.out.read_text())
    assert fields["bad"] == "0" and int(fields["rounds"]) >= 20, fields
    assert ah_gids == {_gid_hex(OLD)}, ah_gids
