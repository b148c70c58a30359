"""A pyverbs program (run under the shim by test_shim_guest.py, not collected by pytest).

Two RC queue pairs of one process, connected to each other over rxe, exchange sequence-numbered
messages both ways until a stop file appears. Each message carries its sequence number and a
checksum of its payload; the receiver checks both. Prints READY once connected and a RESULT line
at the end, in the format of the C test programs.

With --wr-api the QPs are extended QPs and every send goes through the ibv_wr_* API
(wr_start, wr_send, wr_set_sge, wr_complete). With --wr-rdma each message is one wr_start ...
wr_complete batch of five: an RDMA write of the payload into the peer's memory, a fetch-and-add
and a compare-and-swap on two counters there, an RDMA read of what the write left, and the send.
The sender checks what the atomics fetched (the counters move once per message, so an atomic
executed twice or lost shows) and what the read brought back; the RESULT line adds the
counters' final values, which must equal the messages sent.

Usage: pyverbs_seq.py STOP_FILE [--wr-api | --wr-rdma]
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys

import pyverbs.enums as e
from pv_apps import RC_ACCESS, connect_to_each_other  # beside this file
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPEx, QPInitAttr, QPInitAttrEx
from pyverbs.wr import SGE, RecvWR, SendWR

MSG = 256
DEPTH = 8
HEADER = struct.Struct("<Q32s")
RDMA_OPS = (
    e.IBV_QP_EX_WITH_SEND
    | e.IBV_QP_EX_WITH_RDMA_WRITE
    | e.IBV_QP_EX_WITH_RDMA_READ
    | e.IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
    | e.IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
)
# the peer's target MR: two 8-byte counters, then where the RDMA write lands
FA, CS, LAND = 0, 8, 64


def payload(seq: int, direction: int) -> bytes:
    seed = hashlib.sha256(struct.pack("<QI", seq, direction)).digest()
    body = (seed * (MSG // len(seed) + 1))[: MSG - HEADER.size]
    return HEADER.pack(seq, hashlib.sha256(body).digest()) + body


class End:
    """One queue pair with its own CQ and a ring of receive buffers."""

    def __init__(self, ctx: Context, pd: PD, wr_api: bool = False, rdma: bool = False) -> None:
        self.cq = CQ(ctx, 4 * DEPTH)
        cap = QPCap(max_send_wr=DEPTH, max_recv_wr=DEPTH)
        self.wr_api = wr_api or rdma
        self.rdma = rdma
        init_attr = QPAttr(port_num=1)
        init_attr.qp_access_flags = RC_ACCESS
        # The QP before the MRs its receives use, on purpose: a rebuild must give the MRs their
        # new keys before it re-posts the receives (this order once broke it).
        if self.wr_api:
            mask = e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS
            ex = QPInitAttrEx(
                qp_type=e.IBV_QPT_RC,
                scq=self.cq,
                rcq=self.cq,
                cap=cap,
                pd=pd,
                send_ops_flags=RDMA_OPS if rdma else e.IBV_QP_EX_WITH_SEND,
                comp_mask=mask,
            )
            self.qp: QP = QPEx(ctx, ex, init_attr)
        else:
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
            self.qp = QP(pd, init, QPAttr(port_num=1))
        self.send_mr = MR(pd, MSG, e.IBV_ACCESS_LOCAL_WRITE)
        self.recv_mr = MR(pd, MSG * DEPTH, e.IBV_ACCESS_LOCAL_WRITE)
        # what peers write, read and count on; what the atomics fetch and the read brings
        self.target = MR(pd, LAND + MSG, RC_ACCESS)
        self.target.write(bytes(LAND + MSG), LAND + MSG, 0)
        self.fetched = MR(pd, 16 + MSG, e.IBV_ACCESS_LOCAL_WRITE)
        self.sent = 0
        self.received = 0
        self.bad = 0

    def post_recv(self, slot: int) -> None:
        sge = SGE(self.recv_mr.buf + slot * MSG, MSG, self.recv_mr.lkey)
        self.qp.post_recv(RecvWR(wr_id=slot, num_sge=1, sg=[sge]))

    def send(self, direction: int, peer: End) -> int:
        """Posts one message; returns how many send completions it will bring."""
        self.send_mr.write(payload(self.sent, direction), MSG, 0)
        sge = SGE(self.send_mr.buf, MSG, self.send_mr.lkey)
        if self.rdma:
            self.send_rdma(sge, peer.target)
            return 5
        if self.wr_api:
            qp = self.qp
            assert isinstance(qp, QPEx)
            qp.wr_start()
            qp.wr_id, qp.wr_flags = self.sent, e.IBV_SEND_SIGNALED
            qp.wr_send()
            qp.wr_set_sge(sge)
            qp.wr_complete()
            return 1
        wr = SendWR(wr_id=self.sent, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge])
        self.qp.post_send(wr)
        return 1

    def send_rdma(self, sge: SGE, target: MR) -> None:
        qp = self.qp
        assert isinstance(qp, QPEx)
        seq, f = self.sent, self.fetched
        self.fetched.write(bytes(16 + MSG), 16 + MSG, 0)
        qp.wr_start()
        qp.wr_id, qp.wr_flags = seq, e.IBV_SEND_SIGNALED
        qp.wr_rdma_write(target.rkey, target.buf + LAND)
        qp.wr_set_sge(sge)
        qp.wr_atomic_fetch_add(target.rkey, target.buf + FA, 1)
        qp.wr_set_sge(SGE(f.buf, 8, f.lkey))
        qp.wr_atomic_cmp_swp(target.rkey, target.buf + CS, seq, seq + 1)
        qp.wr_set_sge(SGE(f.buf + 8, 8, f.lkey))
        qp.wr_rdma_read(target.rkey, target.buf + LAND)
        qp.wr_set_sge(SGE(f.buf + 16, MSG, f.lkey))
        qp.wr_send()
        qp.wr_set_sge(sge)
        qp.wr_complete()

    def check_rdma(self, direction: int) -> None:
        """After the batch completed: each atomic ran once, the read saw the write."""
        fa, cs = struct.unpack("<QQ", self.fetched.read(16, 0))
        if fa != self.sent or cs != self.sent or self.fetched.read(MSG, 16) != payload(self.sent, direction):
            self.bad += 1

    def counters(self) -> tuple[int, int]:
        fa, cs = struct.unpack("<QQ", self.target.read(16, 0))
        return fa, cs

    def check(self, slot: int, direction: int) -> None:
        data = self.recv_mr.read(MSG, slot * MSG)
        seq, digest = HEADER.unpack_from(data)
        body = data[HEADER.size :]
        if seq != self.received or hashlib.sha256(body).digest() != digest or data != payload(seq, direction):
            self.bad += 1
        self.received += 1


def exchange(sender: End, receiver: End, direction: int) -> None:
    sends = sender.send(direction, receiver)
    got_send = got_recv = False
    while not (got_send and got_recv):
        # both ends share nothing but the wire: poll each CQ for its own completion
        if not got_send:
            n, wcs = sender.cq.poll(1)
            if n:
                if wcs[0].status != e.IBV_WC_SUCCESS:
                    raise RuntimeError(f"send completion error {wcs[0].status}")
                sends -= 1
                if sends == 0:
                    if sender.rdma:
                        sender.check_rdma(direction)
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
    rdma = "--wr-rdma" in sys.argv[2:]
    ctx = Context(name="rxe0")
    pd = PD(ctx)
    a, b = End(ctx, pd, wr_api, rdma), End(ctx, pd, wr_api, rdma)
    connect_to_each_other(ctx, (a.qp, b.qp))
    for end in (a, b):
        for slot in range(DEPTH):
            end.post_recv(slot)
    print("READY", flush=True)
    while not os.path.exists(stop):
        exchange(a, b, 0)
        exchange(b, a, 1)
    (b_fa, b_cs), (a_fa, a_cs) = b.counters(), a.counters()
    print(
        f"RESULT a_sent={a.sent} b_received={b.received} b_sent={b.sent} a_received={a.received} "
        f"bad={a.bad + b.bad} b_fa={b_fa} b_cs={b_cs} a_fa={a_fa} a_cs={a_cs}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
