"""Verbs programs written on Debian's pyverbs as a third party would write them (run by
test_api_guest.py with and without the shim, not collected by pytest).

Each case prints lines that must be the same with and without the shim: the device, port and
GID queries of every kind, RC/UC/UD QPs with the device's maximum SGEs, RC and UD traffic,
atomics, ibv_resize_cq, completion channels, ibv_rereg_mr, AHs made from a WC, memory windows.
A case that fails prints `<case>: error <errno or text>` and the next case runs.

Usage: pv_apps.py CASE... (or `all`)
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Sequence

import pyverbs.enums as e
from pyverbs.addr import AH, AHAttr, GlobalRoute
from pyverbs.cq import CQ, CQEX, CompChannel, CqInitAttrEx, PollCqAttr
from pyverbs.device import Context
from pyverbs.mr import MR, MW, MWBind, MWBindInfo
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPEx, QPInitAttr, QPInitAttrEx
from pyverbs.wr import SGE, RecvWR, SendWR

GID_INDEX = 1  # the IPv4-mapped RoCEv2 GID on rxe
QKEY = 0x11111111
GRH = 40
RC_ACCESS = (
    e.IBV_ACCESS_LOCAL_WRITE
    | e.IBV_ACCESS_REMOTE_WRITE
    | e.IBV_ACCESS_REMOTE_READ
    | e.IBV_ACCESS_REMOTE_ATOMIC
)


def out(case: str, *words: object) -> None:
    print(case + ":", *words, flush=True)


def poll(cq: CQ, n: int = 1, spins: int = 2_000_000) -> list:  # type: ignore[type-arg]
    got: list = []  # type: ignore[type-arg]
    for _ in range(spins):
        k, wcs = cq.poll(n - len(got))
        got += wcs[:k]
        if len(got) == n:
            return got
    raise RuntimeError(f"timed out waiting for {n} completions (got {len(got)})")


def ok(wcs: list) -> list:  # type: ignore[type-arg]
    for wc in wcs:
        if wc.status != e.IBV_WC_SUCCESS:
            raise RuntimeError(f"completion status {wc.status}")
    return wcs


def gr(ctx: Context) -> GlobalRoute:
    return GlobalRoute(dgid=ctx.query_gid(1, GID_INDEX), sgid_index=GID_INDEX)


def connect_to_each_other(ctx: Context, qps: Sequence[QP], access: int | None = None) -> None:
    """Take two QPs of this process to RTS, each the other's peer; access sets their access flags."""
    for me, peer in ((qps[0], qps[1]), (qps[1], qps[0])):
        attr = QPAttr(port_num=1)
        attr.path_mtu = e.IBV_MTU_1024
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        if access is not None:
            attr.qp_access_flags = access
        attr.ah_attr = AHAttr(port_num=1, is_global=1, gr=gr(ctx))
        attr.dest_qp_num = peer.qp_num
        me.to_rts(attr)


def rc_pair(ctx: Context, pd: PD, cq: CQ, qpt: int = e.IBV_QPT_RC, sge: int = 1) -> tuple[QP, QP]:
    """Two connected QPs of this process."""
    cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=sge, max_recv_sge=sge)
    # the attributes given at creation take the QP to INIT: the access flags go there
    init = QPAttr(port_num=1)
    init.qp_access_flags = RC_ACCESS
    qps = [QP(pd, QPInitAttr(qp_type=qpt, scq=cq, rcq=cq, cap=cap), init) for _ in range(2)]
    connect_to_each_other(ctx, qps, RC_ACCESS)
    return qps[0], qps[1]


def ud_qp(pd: PD, cq: CQ, sge: int = 1) -> QP:
    cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=sge, max_recv_sge=sge)
    attr = QPAttr(port_num=1)
    attr.qkey = QKEY
    # pyverbs takes a UD QP given attributes at creation all the way to RTS
    return QP(pd, QPInitAttr(qp_type=e.IBV_QPT_UD, scq=cq, rcq=cq, cap=cap), attr)


def case_query(ctx: Context) -> None:
    d = ctx.query_device()
    out("device", d.fw_version, hex(d.node_guid), d.max_qp, d.max_sge, d.max_cqe, d.max_mr, d.atomic_caps)
    out("device", d.phys_port_cnt, d.max_srq, d.max_srq_wr, d.max_pd, d.max_ah, d.max_mw)
    out("max_qp_wr", d.max_qp_wr)
    x = ctx.query_device_ex()
    out("device_ex", x.orig_attr.max_sge, x.max_dm_size, x.raw_packet_caps, x.device_cap_flags_ex)
    out("max_qp_wr_ex", x.orig_attr.max_qp_wr)
    p = ctx.query_port(1)
    out("port", p.state, p.max_mtu, p.active_mtu, p.gid_tbl_len, p.lid, p.link_layer, p.port_cap_flags)
    for i in range(p.gid_tbl_len):
        try:
            g = ctx.query_gid(1, i)
        except PyverbsError as ex:
            out("gid", i, "error", ex)
            continue
        if str(g) == "0000:0000:0000:0000:0000:0000:0000:0000":
            continue
        out("gid", i, g, "type", ctx.query_gid_type(1, i))
        x_ent = ctx.query_gid_ex(1, i)
        out("gid_ex", i, x_ent.gid_str(), x_ent.gid_type, x_ent.gid_index, x_ent.ndev_ifindex)
    table = ctx.query_gid_table(p.gid_tbl_len)
    out("gid_table", len(table))
    for t in table:
        out("gid_table", t.port_num, t.gid_index, t.gid_type, t.ndev_ifindex)
    out("pkey", ctx.query_pkey(1, 0))


def case_qp_max_sge(ctx: Context) -> None:
    d = ctx.query_device()
    pd = PD(ctx)
    cq = CQ(ctx, 64)
    for name, qpt in (("rc", e.IBV_QPT_RC), ("uc", e.IBV_QPT_UC), ("ud", e.IBV_QPT_UD)):
        cap = QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=d.max_sge, max_recv_sge=d.max_sge)
        qp = QP(pd, QPInitAttr(qp_type=qpt, scq=cq, rcq=cq, cap=cap))
        out("qp_max_sge", name, "created", qp.qp_type == qpt)
        qp.close()


def case_rc_traffic(ctx: Context) -> None:
    """Sends with the device's maximum SGEs, both ways, data checked."""
    nsge = ctx.query_device().max_sge
    pd = PD(ctx)
    cq = CQ(ctx, 64)
    a, b = rc_pair(ctx, pd, cq, sge=nsge)
    piece = 8
    smr = MR(pd, piece * nsge, e.IBV_ACCESS_LOCAL_WRITE)
    rmr = MR(pd, piece * nsge, e.IBV_ACCESS_LOCAL_WRITE)
    for rnd in range(4):
        data = bytes((rnd * 31 + i) & 0xFF for i in range(piece * nsge))
        smr.write(data, len(data), 0)
        rmr.write(b"\0" * len(data), len(data), 0)
        # receive SGEs in reverse order: the bytes land scattered, the check proves where
        rs = [SGE(rmr.buf + (nsge - 1 - i) * piece, piece, rmr.lkey) for i in range(nsge)]
        (b if rnd % 2 == 0 else a).post_recv(RecvWR(wr_id=rnd, num_sge=nsge, sg=rs))
        ss = [SGE(smr.buf + i * piece, piece, smr.lkey) for i in range(nsge)]
        (a if rnd % 2 == 0 else b).post_send(
            SendWR(wr_id=100 + rnd, opcode=e.IBV_WR_SEND, num_sge=nsge, sg=ss, send_flags=e.IBV_SEND_SIGNALED)
        )
        wcs = ok(poll(cq, 2))
        got = rmr.read(len(data), 0)
        want = b"".join(data[(nsge - 1 - i) * piece : (nsge - i) * piece] for i in range(nsge))
        out("rc_traffic", rnd, nsge, sorted(w.byte_len for w in wcs), got == want)


def case_atomics(ctx: Context) -> None:
    pd = PD(ctx)
    cq = CQ(ctx, 16)
    a, _b = rc_pair(ctx, pd, cq)
    target = MR(pd, 8, RC_ACCESS)
    target.write(struct.pack("<Q", 1000), 8, 0)
    local = MR(pd, 8, e.IBV_ACCESS_LOCAL_WRITE)
    results = []
    for op, args in (
        (e.IBV_WR_ATOMIC_FETCH_AND_ADD, (5, 0)),
        (e.IBV_WR_ATOMIC_CMP_AND_SWP, (1005, 77)),
        (e.IBV_WR_ATOMIC_CMP_AND_SWP, (1005, 99)),  # compare fails: memory stays 77
        (e.IBV_WR_ATOMIC_FETCH_AND_ADD, (3, 0)),
    ):
        wr = SendWR(
            wr_id=1, opcode=op, num_sge=1, sg=[SGE(local.buf, 8, local.lkey)], send_flags=e.IBV_SEND_SIGNALED
        )
        wr.set_wr_atomic(rkey=target.rkey, addr=target.buf, compare_add=args[0], swap=args[1])
        a.post_send(wr)
        ok(poll(cq))
        results.append(struct.unpack("<Q", local.read(8, 0))[0])
    out("atomics", results, struct.unpack("<Q", target.read(8, 0))[0])


def case_resize_cq(ctx: Context) -> None:
    pd = PD(ctx)
    cq = CQ(ctx, 8)
    small = cq.cqe
    cq.resize(200)
    out("resize_cq", small >= 8, cq.cqe >= 200)
    a, b = rc_pair(ctx, pd, cq)
    mr = MR(pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
    # more completions than the old size, polled only at the end
    for i in range(12):
        b.post_recv(RecvWR(wr_id=i, num_sge=1, sg=[SGE(mr.buf, 64, mr.lkey)]))
    for i in range(12):
        a.post_send(SendWR(wr_id=i, num_sge=1, sg=[SGE(mr.buf, 64, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED))
    wcs = ok(poll(cq, 24))
    out("resize_cq", len(wcs), sorted(w.wr_id for w in wcs if w.opcode == e.IBV_WC_RECV))


def _wait_event(ch: CompChannel, cq: CQ) -> list:  # type: ignore[type-arg]
    ch.get_cq_event(cq)
    cq.ack_events(1)
    cq.req_notify()
    k, wcs = cq.poll(4)
    return ok(wcs[:k])


def case_events(ctx: Context) -> None:
    """Completion channels with blocking waits, on RC and on UD."""
    pd = PD(ctx)
    mr = MR(pd, 256, e.IBV_ACCESS_LOCAL_WRITE)
    ch = CompChannel(ctx)
    rcq = CQ(ctx, 16, None, ch, 0)
    scq = CQ(ctx, 16)
    rcq.req_notify()
    cap = QPCap(max_send_wr=8, max_recv_wr=8)
    qps = [
        QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=scq, rcq=rcq, cap=cap), QPAttr(port_num=1))
        for _ in range(2)
    ]
    connect_to_each_other(ctx, qps)
    got = []
    for i in range(3):
        qps[1].post_recv(RecvWR(wr_id=i, num_sge=1, sg=[SGE(mr.buf, 128, mr.lkey)]))
        qps[0].post_send(
            SendWR(wr_id=i, num_sge=1, sg=[SGE(mr.buf + 128, 64, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED)
        )
        wcs = _wait_event(ch, rcq)
        got += [(w.wr_id, w.byte_len) for w in wcs]
        ok(poll(scq))
    out("events_rc", got)
    # UD: the receive CQ on a channel, the datagram's GRH ahead of the data
    uch = CompChannel(ctx)
    urcq = CQ(ctx, 16, None, uch, 0)
    urcq.req_notify()
    cap = QPCap(max_send_wr=8, max_recv_wr=8)
    attr = QPAttr(port_num=1)
    attr.qkey = QKEY
    ua = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_UD, scq=scq, rcq=scq, cap=cap), attr)
    ub = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_UD, scq=scq, rcq=urcq, cap=cap), attr)
    ah = AH(pd, attr=AHAttr(port_num=1, is_global=1, gr=gr(ctx)))
    got = []
    for i in range(3):
        ub.post_recv(RecvWR(wr_id=i, num_sge=1, sg=[SGE(mr.buf, GRH + 64, mr.lkey)]))
        wr = SendWR(wr_id=i, num_sge=1, sg=[SGE(mr.buf + 128, 64, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_ud(ah, ub.qp_num, QKEY)
        ua.post_send(wr)
        wcs = _wait_event(uch, urcq)
        got += [(w.wr_id, w.byte_len, w.src_qp == ua.qp_num) for w in wcs]
        ok(poll(scq))
    out("events_ud", got)


def case_ud_traffic(ctx: Context) -> None:
    """UD with the maximum SGEs, and a reply through an AH made from the request's WC and GRH."""
    nsge = min(ctx.query_device().max_sge, 8)
    pd = PD(ctx)
    cq = CQ(ctx, 32)
    a, b = ud_qp(pd, cq, sge=nsge), ud_qp(pd, cq, sge=nsge)
    smr = MR(pd, 16 * nsge, e.IBV_ACCESS_LOCAL_WRITE)
    rmr = MR(pd, GRH + 16 * nsge, e.IBV_ACCESS_LOCAL_WRITE)
    data = bytes(range(16 * nsge))
    smr.write(data, len(data), 0)
    # the GRH's 40 bytes go to the first SGE, the data to the rest
    rs = [SGE(rmr.buf, GRH, rmr.lkey)] + [SGE(rmr.buf + GRH + 16 * i, 16, rmr.lkey) for i in range(nsge - 1)]
    b.post_recv(RecvWR(wr_id=7, num_sge=nsge, sg=rs))
    ah = AH(pd, attr=AHAttr(port_num=1, is_global=1, gr=gr(ctx)))
    wr = SendWR(
        wr_id=8,
        num_sge=nsge - 1,
        sg=[SGE(smr.buf + 16 * i, 16, smr.lkey) for i in range(nsge - 1)],
        send_flags=e.IBV_SEND_SIGNALED,
    )
    wr.set_wr_ud(ah, b.qp_num, QKEY)
    a.post_send(wr)
    wcs = ok(poll(cq, 2))
    rwc = next(w for w in wcs if w.opcode == e.IBV_WC_RECV)
    same = rmr.read(16 * (nsge - 1), GRH) == data[: 16 * (nsge - 1)]
    out("ud_traffic", nsge, rwc.byte_len, rwc.src_qp == a.qp_num, same)
    # the GRH as the receive wrote it into the buffer, as a C program passes it
    reply_ah = AH(pd, wc=rwc, grh=rmr.buf, port_num=1)
    a.post_recv(
        RecvWR(wr_id=9, num_sge=2, sg=[SGE(rmr.buf, GRH, rmr.lkey), SGE(rmr.buf + GRH, 16, rmr.lkey)])
    )
    wr = SendWR(wr_id=10, num_sge=1, sg=[SGE(smr.buf, 16, smr.lkey)], send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_ud(reply_ah, rwc.src_qp, QKEY)
    b.post_send(wr)
    wcs = ok(poll(cq, 2))
    out("ud_reply_via_wc", sorted((w.opcode, w.byte_len) for w in wcs))


def rdma_write(src: MR, length: int, rkey: int, addr: int, wr_id: int) -> SendWR:
    """A signaled RDMA write of src's first length bytes to addr under rkey (src must outlive it)."""
    wr = SendWR(
        wr_id=wr_id,
        opcode=e.IBV_WR_RDMA_WRITE,
        num_sge=1,
        sg=[SGE(src.buf, length, src.lkey)],
        send_flags=e.IBV_SEND_SIGNALED,
    )
    wr.set_wr_rdma(rkey, addr)
    return wr


def case_rereg_mr(ctx: Context) -> None:
    pd = PD(ctx)
    cq = CQ(ctx, 16)
    a, b = rc_pair(ctx, pd, cq)
    mr = MR(pd, 4096, e.IBV_ACCESS_LOCAL_WRITE)
    mr.rereg(flags=e.IBV_REREG_MR_CHANGE_ACCESS, pd=pd, addr=0, length=0, access=RC_ACCESS)
    # an RDMA write into it proves the new access and the keys the app now reads
    src = MR(pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
    src.write(b"R" * 64, 64, 0)
    a.post_send(rdma_write(src, 64, mr.rkey, mr.buf, wr_id=1))
    ok(poll(cq))
    out("rereg_mr", mr.read(64, 0) == b"R" * 64)
    del b


def case_mw(ctx: Context) -> None:
    pd = PD(ctx)
    for t in (e.IBV_MW_TYPE_1, e.IBV_MW_TYPE_2):
        try:
            mw = MW(pd, t)
            out("mw", t, "allocated", mw.rkey != 0)
            mw.close()
        except PyverbsRDMAError as ex:
            out("mw", t, "error", ex.error_code)
    # a type 1 window bound to part of an MR, and an RDMA write through its rkey
    cq = CQ(ctx, 16)
    a, b = rc_pair(ctx, pd, cq)
    mr = MR(pd, 4096, RC_ACCESS | e.IBV_ACCESS_MW_BIND)
    mw = MW(pd, e.IBV_MW_TYPE_1)
    info = MWBindInfo(mr, mr.buf + 1024, 1024, e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ)
    a.bind_mw(mw, MWBind(info, e.IBV_SEND_SIGNALED, wr_id=9))
    bind = ok(poll(cq))
    src = MR(pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
    src.write(b"W" * 64, 64, 0)
    b.post_send(rdma_write(src, 64, mw.rkey, mr.buf + 1024, wr_id=10))
    wrote = ok(poll(cq))
    out("mw_bind", [(w.wr_id, w.opcode) for w in bind + wrote], mr.read(64, 1024) == b"W" * 64)
    mw.close()


def case_qp_data_in_order(ctx: Context) -> None:
    pd = PD(ctx)
    cq = CQ(ctx, 16)
    a, _b = rc_pair(ctx, pd, cq)
    out("data_in_order", a.query_data_in_order(e.IBV_WR_RDMA_WRITE))


def _poll_ex(cq: CQEX, n: int) -> list[tuple[int, int, int, int]]:
    """(wr_id, status, opcode, byte_len) of n completions, read the ibv_cq_ex way."""
    got: list[tuple[int, int, int, int]] = []
    attr = PollCqAttr()
    for _ in range(2_000_000):
        if cq.start_poll(attr) == 0:
            while True:
                got.append((cq.wr_id, cq.status, cq.read_opcode(), cq.read_byte_len()))
                if cq.poll_next() != 0:
                    break
            cq.end_poll()
        if len(got) >= n:
            return got
    raise RuntimeError(f"timed out waiting for {n} extended completions (got {len(got)})")


def case_wr_api(ctx: Context) -> None:
    """The ibv_wr_* send API on an RC pair whose CQ is an extended CQ."""
    pd = PD(ctx)
    # byte_len must be asked for: a provider need not give readers of fields not asked for
    cq = CQEX(ctx, CqInitAttrEx(cqe=64, wc_flags=e.IBV_WC_EX_WITH_BYTE_LEN))
    ops = e.IBV_QP_EX_WITH_SEND | e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
    cap = QPCap(max_send_wr=16, max_recv_wr=16)
    init = QPAttr(port_num=1)
    init.qp_access_flags = RC_ACCESS
    mask = e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS
    qps = [
        QPEx(
            ctx,
            QPInitAttrEx(
                qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, pd=pd, send_ops_flags=ops, comp_mask=mask
            ),
            init,
        )
        for _ in range(2)
    ]
    connect_to_each_other(ctx, qps)
    a, b = qps
    src = MR(pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
    dst = MR(pd, 64, RC_ACCESS)
    src.write(b"W" * 32 + struct.pack("<Q", 0) * 4, 64, 0)
    dst.write(struct.pack("<Q", 40) + b"\0" * 56, 64, 0)
    b.post_recv(RecvWR(wr_id=50, num_sge=1, sg=[SGE(dst.buf + 32, 32, dst.lkey)]))
    a.wr_start()
    a.wr_id, a.wr_flags = 1, e.IBV_SEND_SIGNALED
    a.wr_rdma_write(dst.rkey, dst.buf + 8)
    a.wr_set_sge(SGE(src.buf, 16, src.lkey))
    a.wr_id, a.wr_flags = 2, e.IBV_SEND_SIGNALED
    a.wr_send()
    a.wr_set_sge(SGE(src.buf, 24, src.lkey))
    a.wr_id, a.wr_flags = 3, e.IBV_SEND_SIGNALED
    a.wr_atomic_fetch_add(dst.rkey, dst.buf, 2)
    a.wr_set_sge(SGE(src.buf + 32, 8, src.lkey))
    a.wr_complete()
    got = sorted(_poll_ex(cq, 4))
    data = dst.read(64, 0)
    out("wr_api", got, struct.unpack("<Q", data[:8])[0], data[8:24] == b"W" * 16, data[32:56] == b"W" * 24)
    out("wr_api_fetched", struct.unpack("<Q", src.read(8, 32))[0])


def _qp_ex(ctx: Context, pd: PD, cq: CQ, qpt: int, **kw: int) -> QP:
    """A QP made through ibv_create_qp_ex (pyverbs does that when the creator is the context)."""
    cap = QPCap(max_send_wr=kw.pop("max_send_wr", 8), max_recv_wr=8)
    mask = kw.pop("comp_mask", e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_CREATE_FLAGS)
    attr = QPAttr(port_num=1)
    attr.qkey = QKEY
    attr.qp_access_flags = RC_ACCESS
    init = QPInitAttrEx(qp_type=qpt, scq=cq, rcq=cq, cap=cap, pd=pd, comp_mask=mask, **kw)
    return QP(ctx, init, attr)


def case_qp_ex(ctx: Context) -> None:
    """ibv_create_qp_ex as rdma-core's own tests call it: the basic attributes with a comp_mask that
    names create flags (none set), then traffic, modify and query; then what the device refuses."""
    pd = PD(ctx)
    cq = CQ(ctx, 32)
    a, b = _qp_ex(ctx, pd, cq, e.IBV_QPT_RC), _qp_ex(ctx, pd, cq, e.IBV_QPT_RC)
    connect_to_each_other(ctx, [a, b], RC_ACCESS)
    mr = MR(pd, 128, e.IBV_ACCESS_LOCAL_WRITE)
    mr.write(b"X" * 64, 64, 0)
    b.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(mr.buf + 64, 64, mr.lkey)]))
    a.post_send(SendWR(wr_id=2, num_sge=1, sg=[SGE(mr.buf, 64, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED))
    wcs = ok(poll(cq, 2))
    out("qp_ex_rc", sorted((w.wr_id, w.byte_len) for w in wcs), mr.read(64, 64) == b"X" * 64)
    uc = _qp_ex(ctx, pd, cq, e.IBV_QPT_UC)
    out("qp_ex_uc", uc.qp_type, uc.qp_state)
    ud = _qp_ex(ctx, pd, cq, e.IBV_QPT_UD)  # pyverbs takes it to RTS
    change = QPAttr()
    change.qkey = QKEY + 1
    ud.modify(change, e.IBV_QP_QKEY)
    qa, qi = ud.query(e.IBV_QP_STATE | e.IBV_QP_QKEY | e.IBV_QP_CAP)
    out("qp_ex_ud", qa.qp_state, hex(qa.qkey), qi.cap.max_recv_wr >= 8)
    # send ops the device accepts on RC, some of which the shim refuses only when used
    ops = e.IBV_QP_EX_WITH_SEND | e.IBV_QP_EX_WITH_LOCAL_INV | e.IBV_QP_EX_WITH_BIND_MW
    mask = e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS
    x = _qp_ex(ctx, pd, cq, e.IBV_QPT_RC, comp_mask=mask, send_ops_flags=ops)
    out("qp_ex_ops", x.qp_state)
    maxwr = ctx.query_device().max_qp_wr
    tso = e.IBV_QP_INIT_ATTR_MAX_TSO_HEADER
    tries: list[tuple[str, int, dict[str, int]]] = [
        ("ud_tso", e.IBV_QPT_UD, {"comp_mask": mask | tso, "max_tso_header": 64}),
        ("rc_fcs", e.IBV_QPT_RC, {"create_flags": e.IBV_QP_CREATE_SCATTER_FCS}),
        ("rc_ops_tso", e.IBV_QPT_RC, {"comp_mask": mask, "send_ops_flags": e.IBV_QP_EX_WITH_TSO}),
        ("raw_big", e.IBV_QPT_RAW_PACKET, {"max_send_wr": maxwr + 10}),
    ]
    for name, qpt, kw in tries:
        try:
            _qp_ex(ctx, pd, cq, qpt, **kw)
            out("qp_ex_refused", name, "created")
        except PyverbsRDMAError as ex:
            out("qp_ex_refused", name, "errno", ex.error_code)


CASES: dict[str, Callable[[Context], None]] = {
    "query": case_query,
    "qp_max_sge": case_qp_max_sge,
    "rc_traffic": case_rc_traffic,
    "ud_traffic": case_ud_traffic,
    "atomics": case_atomics,
    "resize_cq": case_resize_cq,
    "events": case_events,
    "rereg_mr": case_rereg_mr,
    "mw": case_mw,
    "data_in_order": case_qp_data_in_order,
    "wr_api": case_wr_api,
    "qp_ex": case_qp_ex,
}


def main() -> int:
    names = list(CASES) if sys.argv[1:] == ["all"] else sys.argv[1:]
    with Context(name="rxe0") as ctx:
        for name in names:
            try:
                CASES[name](ctx)
            except (PyverbsError, RuntimeError) as ex:
                code = getattr(ex, "error_code", None)
                out(name, "error", code if code is not None else ex)
                print(f"{name}: {ex}", file=sys.stderr, flush=True)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
