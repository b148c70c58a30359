"""A pyverbs program (run under the shim by test_shim_guest.py, not collected by pytest).

Two RC queue pairs of one process, connected to each other over rxe, exchange sequence-numbered
messages both ways until a stop file appears. Each message carries its sequence number and a
checksum of its payload; the receiver checks both. Prints READY once connected and a RESULT line
at the end, in the format of the C test programs.

With --wr-api the QPs are extended QPs and every send goes through the ibv_wr_* API
(wr_start, wr_send, wr_set_sge, wr_complete).

Usage: pyverbs_seq.py STOP_FILE [--wr-api]
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys

import pyverbs.enums as e
from pyverbs.addr import AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPEx, QPInitAttr, QPInitAttrEx
from pyverbs.wr import SGE, RecvWR, SendWR

MSG = 256
DEPTH = 8
GID_INDEX = 1
HEADER = struct.Struct("<Q32s")


def payload(seq: int, direction: int) -> bytes:
    seed = hashlib.sha256(struct.pack("<QI", seq, direction)).digest()
    body = (seed * (MSG // len(seed) + 1))[: MSG - HEADER.size]
    return HEADER.pack(seq, hashlib.sha256(body).digest()) + body


class End:
    """One queue pair with its own CQ and a ring of receive buffers."""

    def __init__(self, ctx: Context, pd: PD, wr_api: bool = False) -> None:
        self.cq = CQ(ctx, 4 * DEPTH)
        cap = QPCap(max_send_wr=DEPTH, max_recv_wr=DEPTH)
        self.wr_api = wr_api
        # The QP before the MRs its receives use, on purpose: a rebuild must give the MRs their
        # new keys before it re-posts the receives (this order once broke it).
        if wr_api:
            mask = e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS
            ex = QPInitAttrEx(
                qp_type=e.IBV_QPT_RC,
                scq=self.cq,
                rcq=self.cq,
                cap=cap,
                pd=pd,
                send_ops_flags=e.IBV_QP_EX_WITH_SEND,
                comp_mask=mask,
            )
            self.qp: QP = QPEx(ctx, ex, QPAttr(port_num=1))
        else:
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
            self.qp = QP(pd, init, QPAttr(port_num=1))
        self.send_mr = MR(pd, MSG, e.IBV_ACCESS_LOCAL_WRITE)
        self.recv_mr = MR(pd, MSG * DEPTH, e.IBV_ACCESS_LOCAL_WRITE)
        self.sent = 0
        self.received = 0
        self.bad = 0

    def connect(self, ctx: Context, peer_qpn: int) -> None:
        attr = QPAttr(port_num=1)
        attr.path_mtu = e.IBV_MTU_1024
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = GlobalRoute(dgid=ctx.query_gid(1, GID_INDEX), sgid_index=GID_INDEX)
        attr.ah_attr = AHAttr(port_num=1, is_global=1, gr=gr)
        attr.dest_qp_num = peer_qpn
        attr.rq_psn = 0
        attr.sq_psn = 0
        self.qp.to_rts(attr)

    def post_recv(self, slot: int) -> None:
        sge = SGE(self.recv_mr.buf + slot * MSG, MSG, self.recv_mr.lkey)
        self.qp.post_recv(RecvWR(wr_id=slot, num_sge=1, sg=[sge]))

    def send(self, direction: int) -> None:
        self.send_mr.write(payload(self.sent, direction), MSG, 0)
        sge = SGE(self.send_mr.buf, MSG, self.send_mr.lkey)
        if self.wr_api:
            qp = self.qp
            assert isinstance(qp, QPEx)
            qp.wr_start()
            qp.wr_id, qp.wr_flags = self.sent, e.IBV_SEND_SIGNALED
            qp.wr_send()
            qp.wr_set_sge(sge)
            qp.wr_complete()
            return
        wr = SendWR(wr_id=self.sent, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge])
        self.qp.post_send(wr)

    def check(self, slot: int, direction: int) -> None:
        data = self.recv_mr.read(MSG, slot * MSG)
        seq, digest = HEADER.unpack_from(data)
        body = data[HEADER.size :]
        if seq != self.received or hashlib.sha256(body).digest() != digest or data != payload(seq, direction):
            self.bad += 1
        self.received += 1


def exchange(sender: End, receiver: End, direction: int) -> None:
    sender.send(direction)
    got_send = got_recv = False
    while not (got_send and got_recv):
        # both ends share nothing but the wire: poll each CQ for its own completion
        if not got_send:
            n, wcs = sender.cq.poll(1)
            if n:
                if wcs[0].status != e.IBV_WC_SUCCESS:
                    raise RuntimeError(f"send completion error {wcs[0].status}")
                sender.sent += 1
                got_send = True
        if not got_recv:
            n, wcs = receiver.cq.poll(1)
            if n:
                wc = wcs[0]
                if wc.status != e.IBV_WC_SUCCESS:
                    raise RuntimeError(f"receive completion error {wc.status}")
                receiver.check(wc.wr_id, direction)
                receiver.post_recv(wc.wr_id)
                got_recv = True


def main() -> int:
    stop = sys.argv[1]
    wr_api = "--wr-api" in sys.argv[2:]
    ctx = Context(name="rxe0")
    pd = PD(ctx)
    a, b = End(ctx, pd, wr_api), End(ctx, pd, wr_api)
    a.connect(ctx, b.qp.qp_num)
    b.connect(ctx, a.qp.qp_num)
    for end in (a, b):
        for slot in range(DEPTH):
            end.post_recv(slot)
    print("READY", flush=True)
    while not os.path.exists(stop):
        exchange(a, b, 0)
        exchange(b, a, 1)
    print(
        f"RESULT a_sent={a.sent} b_received={b.received} b_sent={b.sent} a_received={a.received} "
        f"bad={a.bad + b.bad}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
