"""`reserve` (native/src/reserve.c): a QP made while virtual QPNs are reserved never takes one of
them, and keeps its real QPN as its virtual one, so a peer reaches it with no record (issue 29: ranks
restored together from one node share its virtual GID; the node agent reserves, in each, the others'
virtual QPNs before they rebuild: runtime-hook/ibckpt_node/qpn_reserve.py).

The test plays the agent on a pyverbs program under the shim: it reserves the QPNs rxe would hand
out next (rxe gives them in turn), then lets the program make two QPs and move data over them."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest

from ibckpt_native.control import exchange_line
from shimtest.coordinator import Coordinator
from shimtest.harness import ShimProc

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("built")]

TAKEN = 40  # QPNs reserved right after the program's first one: more than a fixed count of tries


def _ask(path: Path, line: str) -> tuple[str, dict[str, Any]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(str(path))
        status, _, body = exchange_line(s, line).decode().strip().partition(" ")
    return status, json.loads(body)


def test_new_qps_skip_reserved_qpns_and_keep_their_real_ones(tmp_path: Path, coord: Coordinator) -> None:
    go, stop = tmp_path / "go", tmp_path / "stop"
    prog = ShimProc(
        "reserved",
        ["/usr/bin/python3", str(Path(__file__).with_name("pv_reserved_qpn.py")), str(go), str(stop)],
        tmp_path,
        {**coord.env, "PATH": "/usr/bin:/bin"},
    )
    prog.start()
    try:
        first = int(prog.wait_for_output(r"FIRST (\d+)", 120).group(1))
        ctl = prog.ctl_path
        # what a shim refuses, in one line each
        for line, why in (("reserve", "needs a QPN"), ("reserve 16777216", "1..0xffffff"),
                          ("reserve 5 70000", "count 1..65536")):  # fmt: skip
            status, reply = _ask(ctl, line)
            assert status == "err" and why in str(reply.get("error")), (line, reply)
        # the agent's round: empty the set, then the siblings' runs
        assert _ask(ctl, "reserve 0")[1]["reserved_qpns"] == 0
        status, reply = _ask(ctl, f"reserve {first + 1} {TAKEN}")
        assert status == "ok" and reply["reserved_qpns"] == TAKEN, reply
        go.touch()
        pair = [int(q) for q in prog.wait_for_output(r"PAIR (\d+) (\d+)", 120).groups()]
        prog.wait_for_output(r"MOVED 128", 120)
        reserved = set(range(first + 1, first + 1 + TAKEN))
        # not a reserved one, and not a fresh virtual one (0x800000 up): the device was asked again
        assert not reserved & set(pair) and all(q < 0x800000 for q in pair), (first, pair)
        assert pair[0] == first + 1 + TAKEN and pair[1] == pair[0] + 1, (first, pair)
        _, status_reply = _ask(ctl, "status")
        assert status_reply["reserved_qpns"] == TAKEN
        qps = {q["qpn"]: q for q in status_reply["qps"]}
        assert set(qps) == {first, *pair}, qps
        assert all(qps[q]["real_qpn"] == q for q in pair), qps  # virtual = real: reachable as is
        assert _ask(ctl, "reserve 0")[1]["reserved_qpns"] == 0
        stop.touch()
        assert prog.wait(60) == 0, prog.outputs()
        assert not re.search(r"libibckpt: .*(error|refus)", prog.err.read_text()), prog.err.read_text()
    finally:
        prog.kill()
