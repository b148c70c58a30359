"""A multi-rail pyverbs program, written as NCCL or UCX users write theirs (run under the shim by
test_devices_guest.py, not collected by pytest): it opens every RDMA device it finds, or the ones
named, and moves data over each.

On each device: a PD, a CQ, and two RC QPs connected to each other through the device. Once all are
connected it prints `DEVICES <name>...`. Then for round N = 1, 2, ...: it waits for DIR/go<N>, sends
one message each way on every device, checks every byte that arrived, and prints `ROUND <N> <bytes>`
(a wrong byte prints `WRONG ...` and ends it with 1). The receives of the next round are posted at the
end of each, so a checkpoint between rounds finds them posted. It exits 0 when DIR/stop appears.

Usage: pv_two_hcas.py DIR [DEVICE...]
"""

from __future__ import annotations

import os
import sys
import time

import pyverbs.enums as e
from pv_apps import ok, poll, rc_pair  # beside this file
from pyverbs.cq import CQ
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.wr import SGE, RecvWR, SendWR

MSG = 256


def payload(rnd: int, rail: int, side: int) -> bytes:
    return bytes((rnd * 7 + rail * 31 + side * 101 + i) & 0xFF for i in range(MSG))


class Rail:
    """One device's share of the traffic."""

    def __init__(self, name: str) -> None:
        self.ctx = Context(name=name)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 16)
        self.qps = rc_pair(self.ctx, self.pd, self.cq)
        self.mrs = [MR(self.pd, 2 * MSG, e.IBV_ACCESS_LOCAL_WRITE) for _ in self.qps]
        self.post_recvs()

    def post_recvs(self) -> None:
        for qp, mr in zip(self.qps, self.mrs, strict=True):
            qp.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(mr.buf + MSG, MSG, mr.lkey)]))

    def round(self, rnd: int, rail: int) -> int:
        sent = [payload(rnd, rail, side) for side in (0, 1)]
        for qp, mr, data in zip(self.qps, self.mrs, sent, strict=True):
            mr.write(data, MSG, 0)
            qp.post_send(SendWR(wr_id=2, opcode=e.IBV_WR_SEND, num_sge=1, sg=[SGE(mr.buf, MSG, mr.lkey)]))
        ok(poll(self.cq, 4))
        got = [mr.read(MSG, MSG) for mr in self.mrs]
        if got != [sent[1], sent[0]]:  # each end holds what the other sent
            raise ValueError(f"round {rnd}, rail {rail}: {got[0][:8].hex()} {got[1][:8].hex()}")
        self.post_recvs()
        return sum(len(g) for g in got)


def main(where: str, names: list[str]) -> int:
    if not names:
        names = [d.name.decode() for d in get_device_list()]
    rails = [Rail(name) for name in names]
    print("DEVICES", *names, flush=True)
    rnd = 1
    while not os.path.exists(os.path.join(where, "stop")):
        if not os.path.exists(os.path.join(where, f"go{rnd}")):
            time.sleep(0.05)
            continue
        try:
            moved = sum(rail.round(rnd, k) for k, rail in enumerate(rails))
        except (ValueError, RuntimeError) as exc:
            print("WRONG", exc, flush=True)
            return 1
        print("ROUND", rnd, moved, flush=True)
        rnd += 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
