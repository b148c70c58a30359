"""Programs written against the public APIs, as third parties write them, run in the Soft-RoCE
guest with and without the shim: they must give the same results (issue 16)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from shimtest import SHIM, TESTS_DIR
from shimtest.coordinator import Coordinator
from shimtest.harness import ShimProc, checkpoint_loop, parse_fields

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("built")]

PV_APPS = Path(__file__).with_name("pv_apps.py")


def _run(argv: list[str], shim: bool, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    if shim:
        env["LD_PRELOAD"] = str(SHIM)
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


def _lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln and not ln.startswith("libibckpt")]


def test_pyverbs_programs_same_with_and_without_the_shim() -> None:
    plain = _run(["/usr/bin/python3", str(PV_APPS), "all"], shim=False)
    shimmed = _run(["/usr/bin/python3", str(PV_APPS), "all"], shim=True)
    # a crash (SIGSEGV under the shim was the bug) shows as a negative return code
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert shimmed.returncode == 0, shimmed.stderr[-3000:]
    base, got = _lines(plain.stdout), _lines(shimmed.stdout)
    assert base[-1] == "DONE" and got[-1] == "DONE"
    # the program really did what it says without the shim
    text = "\n".join(base)
    assert "rc_traffic: 3 32 [256, 256] True" in text  # 32 SGEs per WR on rxe, scattered and checked
    assert "qp_max_sge: ud created True" in text
    assert "ud_traffic: 8 152 True True" in text and "ud_reply_via_wc: [(0, 16), (128, 56)]" in text
    assert "atomics: [1000, 1005, 77, 77] 80" in text
    assert "resize_cq: True True" in text and "resize_cq: 24 [0, 1, 2" in text
    assert "events_rc: [(0, 64), (1, 64), (2, 64)]" in text
    assert "events_ud: [(0, 104, True), (1, 104, True), (2, 104, True)]" in text
    assert "mw_bind: [(9, 5), (10, 1)] True" in text  # IBV_WC_BIND_MW, then IBV_WC_RDMA_WRITE
    # ibv_create_qp_ex with a comp_mask naming create flags (none set): RC traffic, UC to INIT, UD
    # to RTS then modified and queried; send ops the shim refuses only when used (bind MW)
    assert "qp_ex_rc: [(1, 64), (2, 64)] True" in text and "qp_ex_uc: 3 1" in text
    assert "qp_ex_ud: 3 0x11111112 True" in text and "qp_ex_ops: 1" in text
    # what rxe refuses (TSO, create flags, a raw packet QP with too many WRs): the device's errno,
    # compared line by line below, and no word from the shim on stderr
    assert "qp_ex_refused: raw_big errno 95" in text
    assert "gid_table: 2" in text and "gid: 1 0000:0000:0000:0000:0000:ffff:0a4d:0001 type 1" in text
    errors = [ln for ln in base if " error " in ln and not ln.startswith("rereg_mr: error 95")]
    assert errors == [], errors  # rxe answers rereg_mr with EOPNOTSUPP, with or without the shim
    # with the shim: the same lines, but for the documented differences
    assert len(got) == len(base), (base, got)
    mw_lines = [b for b in base if b.startswith("mw:")]
    for b, g in zip(base, got, strict=True):
        if b.startswith(("max_qp_wr:", "max_qp_wr_ex:")):
            # one send slot per QP is the shim's flag WR
            assert int(g.split()[1]) == int(b.split()[1]) - 1
        elif b == mw_lines[-1]:
            # a type 2 memory window is refused cleanly (rxe has them; the shim carries type 1 only,
            # whose line, the one before, must be the same)
            assert len(mw_lines) == 2 and g == " ".join(b.split()[:2]) + " error 95", g
        else:
            assert g == b
    assert "ibv_alloc_mw is not supported" in shimmed.stderr
    assert "libibckpt" not in "".join(ln for ln in shimmed.stderr.splitlines() if "ibv_alloc_mw" not in ln)


def _pyverbs_seq_checkpointed(
    tmp_path: Path, name: str, flag: str, seed: int, dump_at: int
) -> dict[str, str]:
    """pyverbs_seq.py with flag under five checkpoints at random moments, the one at dump_at with a
    CRIU dump: every checkpoint went through, and every message arrived exactly once."""
    with Coordinator(tmp_path / "coord.sock") as coord:
        stop = tmp_path / "stop"
        prog = ShimProc(
            name,
            ["/usr/bin/python3", str(Path(__file__).with_name("pyverbs_seq.py")), str(stop), flag],
            tmp_path,
            {**coord.env, "PATH": "/usr/bin:/bin"},
        )
        prog.start()
        try:
            prog.wait_for_output("READY", 120)
            prog.wait_connected(60)
            results = checkpoint_loop([prog], 5, seed=seed, dump_at=(dump_at,), images=tmp_path / "img")
            time.sleep(1)
            stop.touch()
            code = prog.wait(120)
        finally:
            prog.kill()
    assert code == 0, prog.err.read_text(errors="replace")[-3000:]
    for r in results:
        assert r.released_state == {name: (0, 0)}, r.reports["release"]
        assert r.reports["rebuild"][name]["ok"], r.reports["rebuild"][name]
    assert results[dump_at].criu_rc == 0, results[dump_at].criu_log
    fields = parse_fields(prog.out.read_text())
    assert fields["bad"] == "0", fields
    assert fields["a_sent"] == fields["b_received"] and fields["b_sent"] == fields["a_received"], fields
    return fields


def test_wr_api_checkpointed_under_traffic(tmp_path: Path) -> None:
    """The ibv_wr_* send API under checkpoints: pyverbs_seq.py --wr-api sends every message with
    wr_start/wr_send/wr_set_sge/wr_complete; five checkpoints (one with a CRIU dump) at random
    moments, every message exactly once."""
    fields = _pyverbs_seq_checkpointed(tmp_path, "wrapi", "--wr-api", seed=11, dump_at=1)
    assert int(fields["a_sent"]) > 5, fields


def test_wr_api_rdma_and_atomics_checkpointed_under_traffic(tmp_path: Path) -> None:
    """The ibv_wr_* API with RDMA write, RDMA read, fetch-and-add and compare-and-swap under
    checkpoints: pyverbs_seq.py --wr-rdma posts each message as a batch of the four and a send.
    An atomic run twice or lost after a rebuild would move the peer's counters off the message
    count, and the sender checks every value the atomics fetched and every RDMA read."""
    fields = _pyverbs_seq_checkpointed(tmp_path, "wrrdma", "--wr-rdma", seed=23, dump_at=2)
    # each message ran each atomic exactly once on the receiver's counters
    assert fields["b_fa"] == fields["b_cs"] == fields["a_sent"], fields
    assert fields["a_fa"] == fields["a_cs"] == fields["b_sent"], fields
    assert int(fields["a_sent"]) > 5, fields


def test_async_events_same_with_and_without_the_shim() -> None:
    """native/tests/async_ev.c reads async events as a library's event thread does: poll() on the
    context's async fd, then ibv_get_async_event. The SRQ limit event must come through the fd,
    name the app's own SRQ, and come once, exactly as without the shim."""
    prog = [str(TESTS_DIR / "async_ev")]
    plain, shimmed = _run(prog, shim=False, timeout=60), _run(prog, shim=True, timeout=60)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert shimmed.returncode == 0, shimmed.stderr[-3000:]
    base, got = _lines(plain.stdout), _lines(shimmed.stdout)
    # IBV_EVENT_SRQ_LIMIT_REACHED is 15
    assert base == [
        "nonblocking: -1 EAGAIN",
        "srq_limit: readable 1 got 0 type 15 our_srq 1 then_readable 0",
        "DONE",
    ]
    assert got == base, shimmed.stderr[-3000:]
    assert "libibckpt" not in shimmed.stderr


def test_async_events_across_checkpoints(tmp_path: Path) -> None:
    """After three checkpoints (one with a CRIU dump) the app's async fd is the same open file, holds
    nothing the release raised (QPs moved to error, the device closed), and delivers the next event
    from the rebuilt device about the app's SRQ."""
    stop = tmp_path / "stop"
    with Coordinator(tmp_path / "coord.sock") as coord:
        prog = ShimProc("async", [str(TESTS_DIR / "async_ev"), str(stop)], tmp_path, coord.env)
        prog.start()
        try:
            prog.wait_for_output("READY", 60)
            results = checkpoint_loop([prog], 3, seed=5, dump_at=(1,), images=tmp_path / "img")
            stop.touch()
            code = prog.wait(60)
        finally:
            prog.kill()
    assert code == 0, prog.outputs()
    for r in results:
        assert r.reports["rebuild"]["async"]["ok"], r.reports["rebuild"]["async"]
    assert results[1].criu_rc == 0, results[1].criu_log
    out = prog.out.read_text()
    assert "srq_limit: readable 1 got 0 type 15 our_srq 1 then_readable 0" in out, out
    assert "after: same_fd 1 valid 1 readable 0" in out, out
    assert "srq_limit_after: readable 1 got 0 type 15 our_srq 1 then_readable 0" in out, out
