"""A pyverbs program that makes QPs when told to (run under the shim by test_reserve_guest.py, not
collected by pytest).

It makes one RC QP and prints `FIRST <qpn>`, then waits for GO_FILE. Meanwhile the test reserves the
QPNs the device would hand out next, as a node agent does for a sibling restored beside this process.
It then makes a pair of RC QPs, prints `PAIR <qpn> <qpn>`, connects them to each other and sends one
message each way over them, and prints `MOVED <bytes>` once both arrived intact. It exits when
STOP_FILE appears.

Usage: pv_reserved_qpn.py GO_FILE STOP_FILE
"""

from __future__ import annotations

import os
import sys
import time

import pyverbs.enums as e
from pv_apps import RC_ACCESS, connect_to_each_other, ok, poll  # beside this file
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

MSG = 64


def wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.05)


def main(go: str, stop: str) -> int:
    ctx = Context(name="rxe0")
    pd = PD(ctx)
    cq = CQ(ctx, 16)
    cap = QPCap(max_send_wr=4, max_recv_wr=4)
    init = QPAttr(port_num=1)
    init.qp_access_flags = RC_ACCESS

    def new_qp() -> QP:
        return QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap), init)

    first = new_qp()
    print("FIRST", first.qp_num, flush=True)
    wait_for(go)
    pair = [new_qp(), new_qp()]
    print("PAIR", pair[0].qp_num, pair[1].qp_num, flush=True)
    connect_to_each_other(ctx, pair, RC_ACCESS)
    mrs = [MR(pd, 2 * MSG, e.IBV_ACCESS_LOCAL_WRITE) for _ in pair]
    for qp, mr in zip(pair, mrs, strict=True):
        qp.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(mr.buf + MSG, MSG, mr.lkey)]))
    for i, (qp, mr) in enumerate(zip(pair, mrs, strict=True)):
        mr.write(bytes([i + 1]) * MSG, MSG, 0)
        qp.post_send(SendWR(wr_id=2, opcode=e.IBV_WR_SEND, num_sge=1, sg=[SGE(mr.buf, MSG, mr.lkey)]))
    ok(poll(cq, 4))
    # each end holds what the other sent
    got = [mr.read(MSG, MSG) for mr in mrs]
    if got != [bytes([2]) * MSG, bytes([1]) * MSG]:
        print("WRONG", got, flush=True)
        return 1
    print("MOVED", sum(len(g) for g in got), flush=True)
    wait_for(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
