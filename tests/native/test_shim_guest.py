"""libibckpt in the Soft-RoCE guest: exactly-once across checkpoints under traffic,
release proven from /proc and by CRIU, and unmodified third-party programs."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from shimtest import SHIM, SHIM_ASAN, SHIM_UBSAN, TESTS_DIR
from shimtest.coordinator import Coordinator
from shimtest.harness import (
    CheckpointResult,
    ShimProc,
    checkpoint,
    checkpoint_loop,
    parse_fields,
    parse_result,
    start_server_then_client,
)

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("built")]

CHECKPOINTS = 20


def _pair(
    tmp_path: Path,
    coord: Coordinator,
    argv: list[str],
    port: int,
    shim: Path = SHIM,
    client_args: tuple[str, ...] = ("-c", "127.0.0.1"),
) -> list[ShimProc]:
    # rc_seq takes `-c SERVER`; for the pingpongs `-c` is "check data" and the server is positional
    server = ShimProc("server", [*argv, "-p", str(port)], tmp_path, coord.env, shim=shim)
    client = ShimProc("client", [*argv, "-p", str(port), *client_args], tmp_path, coord.env, shim=shim)
    start_server_then_client(server, client)
    return [server, client]


def _checkpointed_pair(
    tmp_path: Path,
    coord: Coordinator,
    program: list[str],
    flags: list[str],
    port: int,
    shim: Path,
    checkpoints: int,
    statuses: dict[str, dict[str, Any]] | None = None,
    dump_at: tuple[int, ...] = (),
    images: Path | None = None,
) -> tuple[list[ShimProc], list[CheckpointResult], dict[str, str]]:
    """A server/client pair of `program` under the shim, checkpointed `checkpoints` times once both
    are READY (CRIU-dumping the server at `dump_at` into `images`), then stopped: both exit 0 and
    every release and rebuild went well, with nothing of the device left after release. Returns the
    processes, the results and each side's stderr tail. `statuses`, if given, receives each side's
    shim status at READY."""
    stop = tmp_path / "stop"
    procs = _pair(tmp_path, coord, [*program, "-f", str(stop), *flags], port, shim)
    try:
        for p in procs:
            p.wait_for_output("READY", 120)
        if statuses is not None:
            statuses.update({p.name: p.ctl.status() for p in procs})
        results = checkpoint_loop(procs, checkpoints, seed=port, dump_at=dump_at, images=images)
        stop.touch()
        codes = [p.wait(300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    errs = {p.name: p.err.read_text(errors="replace")[-3000:] for p in procs}
    assert codes == [0, 0], errs
    for r in results:
        # after release: no device fd and no device mapping, read from /proc
        assert r.released_state == {"server": (0, 0), "client": (0, 0)}, r.reports["release"]
        for name in ("server", "client"):
            assert r.reports["release"][name]["ok"], r.reports["release"][name]
            assert r.reports["rebuild"][name]["ok"], r.reports["rebuild"][name]
    return procs, results, errs


def _run_rc_seq(
    tmp_path: Path,
    coord: Coordinator,
    flags: list[str],
    port: int,
    shim: Path = SHIM,
    checkpoints: int = CHECKPOINTS,
    dump_at: tuple[int, ...] = (2,),
    release_settles: bool = False,
) -> tuple[str, str]:
    """rc_seq under the shim, checkpointed at random moments under traffic; returns both outputs.

    release_settles: releases end by counting their flushes (every send signaled, no SRQ), not by
    waiting for quiet CQs. Most, not all: a flush that rxe reports more than the 20 ms quiet
    window late (a loaded TCG guest, seen once in 40 in CI) ends that release by the window,
    which is as safe and only slower.
    """
    procs, results, errs = _checkpointed_pair(
        tmp_path,
        coord,
        [str(TESTS_DIR / "rc_seq")],
        flags,
        port,
        shim,
        checkpoints,
        dump_at=dump_at,
        images=tmp_path / "img",
    )
    unsettled = [
        r.reports["release"][name]
        for r in results
        for name in ("server", "client")
        if r.reports["release"][name]["settled"] is not True
    ]
    if release_settles:
        assert len(unsettled) <= len(results) * 2 // 4, unsettled
        last = results[-1]
        if last.criu_rc is not None:
            assert last.criu_rc == 0, last.criu_log
            assert "Dumping finished successfully" in last.criu_log
    assert sum(r.criu_rc is not None for r in results) == len(dump_at)
    srv, cli = (parse_result(p.out.read_text()) for p in procs)
    assert srv["bad"] == 0 and cli["bad"] == 0, errs
    # every message exactly once, identical data, both ways
    assert srv["sent"] == cli["received"] and cli["sent"] == srv["received"]
    assert srv["send_sum"] == cli["recv_sum"] and cli["send_sum"] == srv["recv_sum"]
    # traffic really flowed across the checkpoints
    assert int(srv["sent"]) > checkpoints and int(cli["sent"]) > checkpoints
    return procs[0].out.read_text(), procs[1].out.read_text()


def test_rc_send_recv_busy_poll(tmp_path: Path, coord: Coordinator) -> None:
    _run_rc_seq(tmp_path, coord, [], 18611, release_settles=True)


def test_rc_unsignaled_inline(tmp_path: Path, coord: Coordinator) -> None:
    _run_rc_seq(tmp_path, coord, ["-u", "4", "-i"], 18612, dump_at=())


def test_rc_sends_from_a_second_thread(tmp_path: Path, coord: Coordinator) -> None:
    """One thread posts sends while another polls and re-posts receives on the same QP: the
    post fast path runs outside the gate, against polls retiring the same log and quiesce
    closing the QP's posts under it."""
    _run_rc_seq(tmp_path, coord, ["-T", "-u", "2"], 18616, dump_at=(3,))


def test_posts_stand_still_while_quiesced(tmp_path: Path, coord: Coordinator) -> None:
    """The post fast paths take no gate; quiesce closes every QP's posts instead. Two threads
    post receives to one QP in INIT every 500 us, and nothing completes: the shim's count of
    posted receives must stand still from quiesce to resume, and move again after it. First, a
    send with no SGE and no sg_list must come back cleanly (the fast path once read sg_list
    before num_sge)."""
    stop = tmp_path / "stop"
    prog = ShimProc("post_gate", [str(TESTS_DIR / "post_gate"), "-f", str(stop)], tmp_path, coord.env)
    prog.start()

    def posted() -> int:
        return int(prog.ctl.status()["qps"][0]["recvs_posted"])

    try:
        prog.wait_for_output("READY", 120)
        assert re.search(r"EMPTY_SEND rc=\d+ bad_ok=1", prog.out.read_text()), prog.outputs()
        for _ in range(3):
            before = posted()
            time.sleep(0.3)
            assert posted() > before, prog.outputs()
            assert prog.ctl.quiesce(20000)["ok"]
            at_cut = posted()
            time.sleep(0.5)
            assert posted() == at_cut, "a post got through while the posts were closed"
            prog.ctl.resume()
            time.sleep(0.3)
            assert posted() > at_cut, prog.outputs()
        stop.touch()
        assert prog.wait(60) == 0, prog.outputs()
    finally:
        prog.kill()


def test_rc_srq_completion_channel(tmp_path: Path, coord: Coordinator) -> None:
    _run_rc_seq(tmp_path, coord, ["-q", "-e", "-u", "3"], 18613, dump_at=())


def test_channel_fd_in_the_apps_epoll_set_keeps_waking(tmp_path: Path, coord: Coordinator) -> None:
    """UCX's way: the channel fd goes into the app's own epoll set once, non-blocking. Release and
    rebuild must not take the file out from under that registration: each wait that is not woken
    times out after 5 s, so a stale registration shows as timeouts after the first checkpoint."""
    outs = _run_rc_seq(tmp_path, coord, ["-E"], 18619, dump_at=(2,))
    for out in outs:
        m = re.search(r"EPOLL timeouts=(\d+)", out)
        assert m, out[-500:]
        assert int(m.group(1)) <= 2, out[-500:]


@pytest.mark.parametrize("shim", [SHIM_ASAN, SHIM_UBSAN], ids=["asan", "ubsan"])
def test_rc_under_sanitizers(tmp_path: Path, coord: Coordinator, shim: Path) -> None:
    # an ASan shim must come first in the link order: preload libasan before it
    _run_rc_seq(
        tmp_path,
        coord,
        ["-u", "2"],
        18614 if shim == SHIM_ASAN else 18615,
        shim=shim,
        checkpoints=5,
        dump_at=(),
    )


def _run_verbs_seq(
    tmp_path: Path,
    coord: Coordinator,
    mode: str,
    flags: list[str],
    port: int,
    checkpoints: int = CHECKPOINTS,
    shim: Path = SHIM,
    statuses: dict[str, dict[str, Any]] | None = None,
) -> tuple[dict[str, str], dict[str, str], list[CheckpointResult]]:
    """verbs_seq MODE under the shim, checkpointed at random moments under traffic; returns both RESULTs.
    `statuses`, if given, receives each side's shim status once both are READY."""
    procs, results, errs = _checkpointed_pair(
        tmp_path,
        coord,
        [str(TESTS_DIR / "verbs_seq"), "-m", mode],
        flags,
        port,
        shim,
        checkpoints,
        statuses=statuses,
    )
    srv, cli = (parse_fields(p.out.read_text()) for p in procs)
    assert srv["bad"] == "0" and cli["bad"] == "0", errs
    # traffic really flowed across the checkpoints, and was in flight at some cuts
    assert int(srv["sent"]) > checkpoints and int(cli["sent"]) > checkpoints
    in_flight = sum(
        1
        for r in results
        if any(q["logged_sends"] for rep in r.reports["quiesce"].values() for q in rep["qps"])
    )
    assert in_flight > 0, "no checkpoint caught work in flight"
    return srv, cli, results


@pytest.mark.parametrize("mode,port", [("write", 18640), ("writeimm", 18641)])
def test_rdma_write_exactly_once(tmp_path: Path, coord: Coordinator, mode: str, port: int) -> None:
    # write: unsignaled RDMA WRITE of each message, then a SEND_WITH_IMM notice (every 3rd signaled);
    # writeimm: RDMA WRITE_WITH_IMM. The receiver checks the imm sequence and the ring slot's data.
    srv, cli, _ = _run_verbs_seq(tmp_path, coord, mode, ["-u", "3"], port)
    assert srv["sent"] == cli["received"] and cli["sent"] == srv["received"]
    assert srv["send_sum"] == cli["recv_sum"] and cli["send_sum"] == srv["recv_sum"]


def test_rdma_read_exactly_once(tmp_path: Path, coord: Coordinator) -> None:
    # every 4th read signaled: the others' data is checked when a later completion retires them
    srv, cli, _ = _run_verbs_seq(tmp_path, coord, "read", ["-u", "4"], 18642)
    assert srv["peer_ops"] == cli["sent"] and cli["peer_ops"] == srv["sent"]


def test_atomics_exactly_once(tmp_path: Path, coord: Coordinator) -> None:
    # fetch-add and cmp-swap alternate; every old value returned is the exact count so far,
    # and the target's counters end equal to what the peer posted: nothing ran twice or never
    srv, cli, _ = _run_verbs_seq(tmp_path, coord, "atomic", ["-u", "3"], 18643)
    for me, peer in ((srv, cli), (cli, srv)):
        assert me["ctr0"] == peer["fa"] and me["ctr1"] == peer["cs"]
        assert int(me["fa"]) + int(me["cs"]) == int(me["sent"])


@pytest.mark.parametrize("shim", [SHIM_ASAN, SHIM_UBSAN], ids=["asan", "ubsan"])
@pytest.mark.parametrize("mode", ["write", "read", "atomic", "ud"])
def test_verbs_seq_under_sanitizers(tmp_path: Path, coord: Coordinator, shim: Path, mode: str) -> None:
    # the one-sided, atomic and UD paths of the shim (logs, key translation, UD peers) under
    # ASan/UBSan, with checkpoints under traffic; any report aborts the program (codes != 0)
    port = 18660 + 2 * ["write", "read", "atomic", "ud"].index(mode) + (shim == SHIM_UBSAN)
    srv, cli, _ = _run_verbs_seq(tmp_path, coord, mode, ["-u", "3"], port, checkpoints=6, shim=shim)
    assert int(srv["sent"]) > 0 and int(cli["sent"]) > 0


def test_ud_exactly_once(tmp_path: Path, coord: Coordinator) -> None:
    # the client sends datagrams (every 3rd signaled), the server acknowledges each;
    # both check order, content and the peer's virtual source QPN
    statuses: dict[str, dict[str, Any]] = {}
    srv, cli, _ = _run_verbs_seq(tmp_path, coord, "ud", ["-u", "3"], 18644, statuses=statuses)
    assert srv["received"] == cli["sent"] and cli["received"] == srv["sent"]
    # status names where the UD address handles point (the agent's preflight checks them); both
    # ends run in this one guest, so each side's AH points at the GID they share
    for status in statuses.values():
        assert status["ah_gids"] and set(status["ah_gids"]) <= set(status["gids"]), status
    assert srv["recv_sum"] == cli["send_sum"] and cli["recv_sum"] == srv["send_sum"]


def _pingpong_ok(text: str) -> bool:
    return re.search(r"\d+ iters in [\d.]+ seconds", text) is not None


@pytest.mark.parametrize(
    "prog,extra",
    [("ibv_rc_pingpong", []), ("ibv_srq_pingpong", []), ("ibv_ud_pingpong", [])],
)
def test_pingpong_unmodified_under_shim(
    tmp_path: Path, coord: Coordinator, prog: str, extra: list[str]
) -> None:
    port = {"ibv_rc_pingpong": 18620, "ibv_srq_pingpong": 18622, "ibv_ud_pingpong": 18623}[prog]
    procs = _pair(tmp_path, coord, [prog, "-g", "1", "-n", "500", *extra], port)
    try:
        codes = [p.wait(300) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"timed out: {[p.out.read_text() + p.err.read_text() for p in procs]}")
    finally:
        for p in procs:
            p.kill()
    outs = [p.out.read_text() + p.err.read_text() for p in procs]
    assert codes == [0, 0], outs
    assert all(_pingpong_ok(o) for o in outs), outs


@pytest.mark.parametrize(
    "prog,port,iters",
    [
        ("ibv_rc_pingpong", 18621, 40000),
        ("ibv_srq_pingpong", 18624, 20000),
        ("ibv_ud_pingpong", 18625, 40000),
    ],
)
def test_pingpong_checkpointed_mid_run(
    tmp_path: Path, coord: Coordinator, prog: str, port: int, iters: int
) -> None:
    # --chk: each side validates every received buffer
    procs = _pair(tmp_path, coord, [prog, "-g", "1", "-n", str(iters), "--chk"], port)
    try:
        for p in procs:
            p.wait_connected(120)
        time.sleep(0.3)
        results = [checkpoint(procs, i + 1) for i in range(3)]
        codes = [p.wait(600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outs = [p.out.read_text() + p.err.read_text() for p in procs]
    assert codes == [0, 0], outs
    # each side reports the full iteration count: nothing was lost across the checkpoints
    assert all(re.search(rf"\b{iters} iters in [\d.]+ seconds", o) for o in outs), outs
    for r in results:
        assert r.released_state == {"server": (0, 0), "client": (0, 0)}
        for name in ("server", "client"):
            assert r.reports["rebuild"][name]["ok"], r.reports["rebuild"][name]


PYVERBS_PROG = """
import pyverbs.device as d
import pyverbs.enums as e
from pyverbs.cq import CQ
from pyverbs.mr import MR
from pyverbs.pd import PD

ctx = d.Context(name="rxe0")
pd = PD(ctx)
cq = CQ(ctx, 16)
mr = MR(pd, 4096, e.IBV_ACCESS_LOCAL_WRITE)
attr = ctx.query_device()
port = ctx.query_port(1)
print("PYVERBS", attr.max_qp_wr, mr.lkey, cq.poll(1)[0], port.state)
"""


def test_pyverbs_under_shim(tmp_path: Path) -> None:
    env = {"LD_PRELOAD": str(SHIM), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["/usr/bin/python3", "-c", PYVERBS_PROG], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "PYVERBS" in proc.stdout and "libibckpt" not in proc.stderr


def test_pyverbs_checkpointed_under_traffic(tmp_path: Path, coord: Coordinator) -> None:
    # two RC QPs of one Python process, talking to each other through rxe
    stop = tmp_path / "stop"
    prog = ShimProc(
        "pyverbs",
        ["/usr/bin/python3", str(Path(__file__).with_name("pyverbs_seq.py")), str(stop)],
        tmp_path,
        {**coord.env, "PATH": "/usr/bin:/bin"},
    )
    prog.start()
    try:
        prog.wait_for_output("READY", 120)
        prog.wait_connected(60)
        try:
            results = checkpoint_loop([prog], 5, seed=7, dump_at=(1,), images=tmp_path / "img")
        except Exception as exc:  # the shim's own log says why
            dump_log = tmp_path / "img" / "ckpt1" / "dump.log"
            log_tail = dump_log.read_text(errors="replace")[-3000:] if dump_log.exists() else ""
            pytest.fail(f"{exc}\nstderr: {prog.err.read_text(errors='replace')[-3000:]}\ncriu: {log_tail}")
        before_stop = prog.ctl.status()
        time.sleep(1)
        stop.touch()
        code = prog.wait(120)
    finally:
        prog.kill()
    err = prog.err.read_text(errors="replace")[-3000:]
    assert code == 0, err
    for r in results:
        assert r.released_state == {"pyverbs": (0, 0)}, r.reports["release"]
        assert r.reports["rebuild"]["pyverbs"]["ok"], r.reports["rebuild"]["pyverbs"]
    assert results[1].criu_rc == 0, results[1].criu_log
    assert before_stop["epoch"] == 5, before_stop
    fields = parse_fields(prog.out.read_text())
    assert fields["bad"] == "0", fields
    # every message arrived once, in order: the receive counts match the sends exactly
    assert fields["a_sent"] == fields["b_received"] and fields["b_sent"] == fields["a_received"], fields
    assert int(fields["a_sent"]) > 5, fields


@pytest.mark.parametrize("prog,port", [("ib_send_bw", 18650), ("ib_write_bw", 18652), ("ib_read_bw", 18654)])
def test_perftest_checkpointed_mid_run(tmp_path: Path, coord: Coordinator, prog: str, port: int) -> None:
    iters = 100000  # long enough (tens of seconds on rxe in TCG) to checkpoint it three times
    argv = [prog, "-d", "rxe0", "-x", "1", "-n", str(iters), "-s", "1024", "-F"]
    procs = _pair(tmp_path, coord, argv, port, client_args=("127.0.0.1",))
    try:
        for p in procs:
            p.wait_connected(120)
        time.sleep(0.5)
        results = [checkpoint(procs, i + 1) for i in range(3)]
        # traffic was still running after the last checkpoint: the run was really interrupted
        still_running = [p.popen.poll() is None for p in procs if p.popen is not None]
        codes = [p.wait(600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outs = [p.out.read_text() + p.err.read_text() for p in procs]
    assert codes == [0, 0], outs
    assert still_running == [True, True], outs
    for r in results:
        assert r.released_state == {"server": (0, 0), "client": (0, 0)}
        for name in ("server", "client"):
            assert r.reports["rebuild"][name]["ok"], r.reports["rebuild"][name]
    # perftest's own report line: 1024-byte messages, every iteration completed
    assert re.search(rf"1024\s+{iters}\s+[\d.]+\s+[\d.]+", outs[1]), outs[1]


@pytest.mark.parametrize("prog", ["ib_send_bw", "ib_write_bw", "ib_read_bw"])
def test_perftest_unmodified_under_shim(tmp_path: Path, coord: Coordinator, prog: str) -> None:
    argv = [prog, "-d", "rxe0", "-x", "1", "-n", "300", "-s", "4096", "-F"]
    procs = _pair(tmp_path, coord, argv, 18630, client_args=("127.0.0.1",))
    try:
        codes = [p.wait(300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outs = [p.out.read_text() + p.err.read_text() for p in procs]
    assert codes == [0, 0], outs
    assert re.search(r"4096\s+300\s+[\d.]+\s+[\d.]+", outs[1]), outs[1]
