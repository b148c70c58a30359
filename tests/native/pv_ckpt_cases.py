"""pyverbs programs for test_preflight_guest.py (run under the shim, not collected by pytest).

refusals STOP: connects an RC pair, then tries what the shim cannot carry through a checkpoint
(a memory window, a raw packet QP) and modifies one QP more often than a rebuild can replay.
Prints `READY <qpn a> <qpn b> mw=<errno> raw=<errno>` and waits for the stop file.

mw STOP [REBIND_EVERY]: an RC pair; B's MR holds a memory window of type 1, bound (ibv_bind_mw)
to 1 KiB in its middle with remote write and read. A writes a numbered record through the
window's rkey and reads it back, round after round, always with the rkey it read after the last
bind. Prints `READY rkey=<rkey> bind=<opcode>`, then once the stop file appears it tries a
fetch-and-add through the window, which the MR and the QPs allow but the window does not, and prints
`RESULT rounds=<n> bad=<n> outside=<completion status> rebinds=<n>` (the window's rights kept; rxe
checks an access through a window against the MR's range, not the window's, so the range cannot
show). With REBIND_EVERY, B binds the window again every that many rounds, and A goes on with the
new rkey.

ud_reply STOP GID_INDEX [HOLD]: two UD QPs; A sends a numbered request to B over GID_INDEX, B
answers through an address handle made from the request's completion and GRH
(ibv_create_ah_from_wc), a new one each round, and every other round through the one it made first.
A checks each answer. When the file HOLD exists after B got a request, prints HELD and makes the AH
only once HOLD is gone (a checkpoint in between leaves a completion from before it). Prints READY,
then `RESULT rounds=<n> bad=<n>` once the stop file appears.
"""

from __future__ import annotations

import os
import struct
import sys
import time

import pyverbs.enums as e
from pyverbs.addr import AH, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR, MW, MWBind, MWBindInfo
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

QKEY = 0x11111111
GRH = 40


def rc_qp(pd: PD, cq: CQ) -> QP:
    init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap(max_send_wr=4, max_recv_wr=4))
    return QP(pd, init, QPAttr(port_num=1))


def connect(ctx: Context, qp: QP, peer_qpn: int) -> None:
    attr = QPAttr(port_num=1)
    attr.path_mtu = e.IBV_MTU_1024
    attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
    attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
    attr.ah_attr = AHAttr(port_num=1, is_global=1, gr=GlobalRoute(dgid=ctx.query_gid(1, 1), sgid_index=1))
    attr.dest_qp_num = peer_qpn
    qp.to_rts(attr)


def mw_pair(ctx: Context, pd: PD, cq: CQ, rights: int) -> tuple[QP, QP]:
    """Two RC QPs of this process connected to each other, with rights and the right to bind
    memory windows."""
    qps = []
    for _ in range(2):
        attr = QPAttr(port_num=1)
        attr.qp_access_flags = rights | e.IBV_ACCESS_MW_BIND
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap(max_send_wr=4, max_recv_wr=4))
        qps.append(QP(pd, init, attr))
    a, b = qps
    connect(ctx, a, b.qp_num)
    connect(ctx, b, a.qp_num)
    return a, b


def refused(fn: object) -> int:
    try:
        fn()  # type: ignore[operator]
    except PyverbsRDMAError as ex:
        return int(ex.error_code)
    except PyverbsError:
        return -1
    return 0


def wait_stop(stop: str) -> None:
    while not os.path.exists(stop):
        os.sched_yield()


def refusals(stop: str) -> int:
    ctx = Context(name="rxe0")
    pd = PD(ctx)
    cq = CQ(ctx, 16)
    a, b = rc_qp(pd, cq), rc_qp(pd, cq)
    connect(ctx, a, b.qp_num)
    connect(ctx, b, a.qp_num)
    mw = refused(lambda: MW(pd, e.IBV_MW_TYPE_2))
    cap = QPCap(max_send_wr=4, max_recv_wr=4)
    raw = refused(lambda: QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RAW_PACKET, scq=cq, rcq=cq, cap=cap)))
    # RTS to RTS, ten times: more modify_qp calls since RESET than a rebuild replays
    for timer in range(10):
        attr = QPAttr()
        attr.min_rnr_timer = 10 + timer
        b.modify(attr, e.IBV_QP_MIN_RNR_TIMER)
    print(f"READY {a.qp_num} {b.qp_num} mw={mw} raw={raw}", flush=True)
    wait_stop(stop)
    return 0


MW_OFF, MW_LEN = 1024, 1024  # the window inside B's 4 KiB MR


def mw_rdma(stop: str, rebind_every: int = 0) -> int:
    ctx = Context(name="rxe0")
    pd = PD(ctx)
    cq = CQ(ctx, 16)
    rights = (
        e.IBV_ACCESS_LOCAL_WRITE
        | e.IBV_ACCESS_REMOTE_WRITE
        | e.IBV_ACCESS_REMOTE_READ
        | e.IBV_ACCESS_REMOTE_ATOMIC
    )
    a, b = mw_pair(ctx, pd, cq, rights)
    local = MR(pd, 4096, e.IBV_ACCESS_LOCAL_WRITE)  # A's source and destination buffers
    mr = MR(pd, 4096, rights | e.IBV_ACCESS_MW_BIND)
    mw = MW(pd, e.IBV_MW_TYPE_1)
    info = MWBindInfo(mr, mr.buf + MW_OFF, MW_LEN, e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ)
    b.bind_mw(mw, MWBind(info, e.IBV_SEND_SIGNALED, wr_id=77))
    bind = poll_for(cq, {77})[77]
    rkey = mw.rkey
    print(f"READY rkey={rkey} bind={bind.opcode}", flush=True)  # type: ignore[attr-defined]
    rounds = bad = rebinds = 0
    while not os.path.exists(stop):
        off = MW_OFF + (rounds % (MW_LEN // 16)) * 16
        record = struct.pack("<QQ", rounds, 0xC0FFEE)
        local.write(record, 16, 0)
        wr = SendWR(wr_id=5, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(local.buf, 16, local.lkey)])
        wr.send_flags = e.IBV_SEND_SIGNALED
        wr.set_wr_rdma(rkey, mr.buf + off)
        a.post_send(wr)
        poll_for(cq, {5})
        wr = SendWR(wr_id=6, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(local.buf + 512, 16, local.lkey)])
        wr.send_flags = e.IBV_SEND_SIGNALED
        wr.set_wr_rdma(rkey, mr.buf + off)
        a.post_send(wr)
        poll_for(cq, {6})
        if mr.read(16, off) != record or local.read(16, 512) != record:
            bad += 1
        rounds += 1
        if rebind_every and rounds % rebind_every == 0:
            # bound again to the same range: a new rkey, which A uses from now on
            b.bind_mw(mw, MWBind(info, e.IBV_SEND_SIGNALED, wr_id=78))
            poll_for(cq, {78})
            rkey = mw.rkey
            rebinds += 1
    # an atomic: the MR and the QPs allow it, the window does not
    wr = SendWR(wr_id=7, opcode=e.IBV_WR_ATOMIC_FETCH_AND_ADD, num_sge=1, sg=[SGE(local.buf, 8, local.lkey)])
    wr.send_flags = e.IBV_SEND_SIGNALED
    wr.set_wr_atomic(rkey, mr.buf + MW_OFF, 1, 0)
    a.post_send(wr)
    outside = -1
    for _ in range(20_000_000):
        n, wcs = cq.poll(1)
        if n and wcs[0].wr_id == 7:
            outside = wcs[0].status
            break
    print(f"RESULT rounds={rounds} bad={bad} outside={outside} rebinds={rebinds}", flush=True)
    return 0


def mw_queued(go: str) -> int:
    """A bind queued behind a send the peer cannot take yet (no receive posted: RNR), so a
    checkpoint finds both in A's send log. Once the file GO exists, B posts the receive; prints
    `RESULT send=<status> bind=<status>/<opcode> through=<bool>`: both completions, and an RDMA
    write by B through the window's rkey."""
    ctx = Context(name="rxe0")
    pd = PD(ctx)
    cq = CQ(ctx, 16)
    rights = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
    a, b = mw_pair(ctx, pd, cq, rights)
    mr = MR(pd, 4096, rights | e.IBV_ACCESS_MW_BIND)
    mw = MW(pd, e.IBV_MW_TYPE_1)
    mr.write(b"S" * 16, 16, 0)
    wr = SendWR(wr_id=1, opcode=e.IBV_WR_SEND, num_sge=1, sg=[SGE(mr.buf, 16, mr.lkey)])
    wr.send_flags = e.IBV_SEND_SIGNALED
    a.post_send(wr)
    info = MWBindInfo(mr, mr.buf + MW_OFF, MW_LEN, e.IBV_ACCESS_REMOTE_WRITE)
    a.bind_mw(mw, MWBind(info, e.IBV_SEND_SIGNALED, wr_id=2))
    print(f"READY rkey={mw.rkey}", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    b.post_recv(RecvWR(wr_id=3, num_sge=1, sg=[SGE(mr.buf + 512, 16, mr.lkey)]))
    got: dict[int, object] = {}
    for _ in range(20_000_000):
        n, wcs = cq.poll(1)
        if n:
            got[wcs[0].wr_id] = wcs[0]
            if {1, 2, 3} <= set(got):
                break
    send, bind = got.get(1), got.get(2)
    mr.write(b"T" * 16, 16, 1024 + 2048)  # B's source, outside the window
    wr = SendWR(wr_id=4, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(mr.buf + 3072, 16, mr.lkey)])
    wr.send_flags = e.IBV_SEND_SIGNALED
    wr.set_wr_rdma(mw.rkey, mr.buf + MW_OFF)
    b.post_send(wr)
    through = poll_for(cq, {4}) and mr.read(16, MW_OFF) == b"T" * 16
    print(
        f"RESULT send={getattr(send, 'status', None)} "
        f"bind={getattr(bind, 'status', None)}/{getattr(bind, 'opcode', None)} through={through}",
        flush=True,
    )
    return 0


def poll_for(cq: CQ, want: set[int], spins: int = 20_000_000) -> dict[int, object]:
    """The completions whose wr_id is in want, by wr_id."""
    got: dict[int, object] = {}
    for _ in range(spins):
        n, wcs = cq.poll(1)
        if n:
            wc = wcs[0]
            if wc.status != e.IBV_WC_SUCCESS:
                raise RuntimeError(f"completion {wc.wr_id} status {wc.status}")
            got[wc.wr_id] = wc
            if set(got) >= want:
                return got
    raise RuntimeError(f"waited for {sorted(want)}, got {sorted(got)}")


def ud_reply(stop: str, gid_index: int, hold: str | None = None) -> int:
    ctx = Context(name="rxe0")
    pd = PD(ctx)
    cq = CQ(ctx, 32)
    cap = QPCap(max_send_wr=8, max_recv_wr=8)
    attr = QPAttr(port_num=1)
    attr.qkey = QKEY
    a = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_UD, scq=cq, rcq=cq, cap=cap), attr)
    b = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_UD, scq=cq, rcq=cq, cap=cap), attr)
    mr = MR(pd, 1024, e.IBV_ACCESS_LOCAL_WRITE)
    a_in, b_in, a_out, b_out = 0, 256, 512, 640  # receive buffers hold the GRH first
    gr = GlobalRoute(dgid=ctx.query_gid(1, gid_index), sgid_index=gid_index)
    to_b = AH(pd, attr=AHAttr(port_num=1, is_global=1, gr=gr))
    first: AH | None = None
    rounds = bad = 0
    print("READY", flush=True)
    while not os.path.exists(stop):
        b.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(mr.buf + b_in, GRH + 64, mr.lkey)]))
        a.post_recv(RecvWR(wr_id=2, num_sge=1, sg=[SGE(mr.buf + a_in, GRH + 64, mr.lkey)]))
        mr.write(struct.pack("<QQ", rounds, 0xA), 16, a_out)
        wr = SendWR(wr_id=3, num_sge=1, sg=[SGE(mr.buf + a_out, 16, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_ud(to_b, b.qp_num, QKEY)
        a.post_send(wr)
        rwc = poll_for(cq, {1, 3})[1]
        if mr.read(16, b_in + GRH) != struct.pack("<QQ", rounds, 0xA):
            bad += 1
        if hold and os.path.exists(hold):
            print("HELD", flush=True)
            while os.path.exists(hold):
                time.sleep(0.01)
        # the GRH as the receive wrote it into the buffer, as a C program passes it
        ah = AH(pd, wc=rwc, grh=mr.buf + b_in, port_num=1)
        if first is None:
            first = AH(pd, wc=rwc, grh=mr.buf + b_in, port_num=1)
        mr.write(struct.pack("<QQ", rounds, 0xB), 16, b_out)
        wr = SendWR(wr_id=4, num_sge=1, sg=[SGE(mr.buf + b_out, 16, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_ud(ah if rounds % 2 == 0 else first, rwc.src_qp, QKEY)  # type: ignore[attr-defined]
        b.post_send(wr)
        poll_for(cq, {2, 4})
        if mr.read(16, a_in + GRH) != struct.pack("<QQ", rounds, 0xB):
            bad += 1
        ah.close()
        rounds += 1
    print(f"RESULT rounds={rounds} bad={bad}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "refusals":
        sys.exit(refusals(sys.argv[2]))
    if sys.argv[1] == "mw_queued":
        sys.exit(mw_queued(sys.argv[2]))
    if sys.argv[1] == "mw":
        sys.exit(mw_rdma(sys.argv[2], *(int(a) for a in sys.argv[3:4])))
    sys.exit(ud_reply(sys.argv[2], int(sys.argv[3]), *sys.argv[4:5]))
