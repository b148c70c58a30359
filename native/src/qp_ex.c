/* The ibv_wr_* send API (ibv_qp_ex) on shadow QPs.  The builder gathers the
 * WRs between wr_start and wr_complete and posts them as one list through
 * the shim's own post_send, so they are logged, counted and replayed like
 * any other send.  The real QP is made with the same send ops flags (so the
 * device accepts and refuses them as natively) but never posted to this way.
 * Ops the shim cannot carry through a rebuild (bind MW, invalidations, TSO,
 * atomic write) are refused when used, not when the QP is made. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "shim.h"

static struct ibk_wrb *wrb_of(struct ibv_qp_ex *x)
{
	return ((struct ibk_qp *)x)->wrb; /* pubx is at offset 0 */
}

static struct ibv_send_wr *wr_new(struct ibv_qp_ex *x, enum ibv_wr_opcode op)
{
	struct ibk_wrb *b = wrb_of(x);
	struct ibv_send_wr *w;

	if (b->err)
		return b->cur = NULL;
	if (b->n >= b->cap) {
		b->err = ENOMEM; /* more than the send queue holds */
		return b->cur = NULL;
	}
	w = &b->wr[b->n];
	memset(w, 0, sizeof(*w));
	w->wr_id = x->wr_id;
	w->send_flags = x->wr_flags;
	w->opcode = op;
	w->sg_list = &b->sge[(size_t)b->n * b->max_sge];
	b->n++;
	return b->cur = w;
}

static void refuse(struct ibv_qp_ex *x, const char *verb)
{
	struct ibk_wrb *b = wrb_of(x);

	ibk_unsupported(verb);
	b->err = EOPNOTSUPP;
	b->cur = NULL;
}

static void qpx_start(struct ibv_qp_ex *x)
{
	struct ibk_wrb *b = wrb_of(x);

	b->n = 0;
	b->err = 0;
	b->cur = NULL;
}

static int qpx_complete(struct ibv_qp_ex *x)
{
	struct ibk_wrb *b = wrb_of(x);
	struct ibv_send_wr *bad;
	uint32_t i, n = b->n;
	int rc = b->err;

	b->n = 0;
	b->cur = NULL;
	if (rc || !n)
		return rc;
	for (i = 0; i + 1 < n; i++)
		b->wr[i].next = &b->wr[i + 1];
	b->wr[n - 1].next = NULL;
	return ibk_post_send(&((struct ibk_qp *)x)->pub, b->wr, &bad);
}

static void qpx_abort(struct ibv_qp_ex *x)
{
	qpx_start(x);
}

static void qpx_send(struct ibv_qp_ex *x)
{
	wr_new(x, IBV_WR_SEND);
}

static void qpx_send_imm(struct ibv_qp_ex *x, __be32 imm)
{
	struct ibv_send_wr *w = wr_new(x, IBV_WR_SEND_WITH_IMM);

	if (w)
		w->imm_data = imm;
}

static void qpx_rdma(struct ibv_qp_ex *x, enum ibv_wr_opcode op, uint32_t rkey, uint64_t addr, __be32 imm)
{
	struct ibv_send_wr *w = wr_new(x, op);

	if (w) {
		w->wr.rdma.rkey = rkey;
		w->wr.rdma.remote_addr = addr;
		w->imm_data = imm;
	}
}

static void qpx_rdma_write(struct ibv_qp_ex *x, uint32_t rkey, uint64_t addr)
{
	qpx_rdma(x, IBV_WR_RDMA_WRITE, rkey, addr, 0);
}

static void qpx_rdma_write_imm(struct ibv_qp_ex *x, uint32_t rkey, uint64_t addr, __be32 imm)
{
	qpx_rdma(x, IBV_WR_RDMA_WRITE_WITH_IMM, rkey, addr, imm);
}

static void qpx_rdma_read(struct ibv_qp_ex *x, uint32_t rkey, uint64_t addr)
{
	qpx_rdma(x, IBV_WR_RDMA_READ, rkey, addr, 0);
}

static void qpx_atomic(struct ibv_qp_ex *x, enum ibv_wr_opcode op, uint32_t rkey, uint64_t addr, uint64_t cmp_add,
		       uint64_t swap)
{
	struct ibv_send_wr *w = wr_new(x, op);

	if (w) {
		w->wr.atomic.rkey = rkey;
		w->wr.atomic.remote_addr = addr;
		w->wr.atomic.compare_add = cmp_add;
		w->wr.atomic.swap = swap;
	}
}

static void qpx_cmp_swp(struct ibv_qp_ex *x, uint32_t rkey, uint64_t addr, uint64_t compare, uint64_t swap)
{
	qpx_atomic(x, IBV_WR_ATOMIC_CMP_AND_SWP, rkey, addr, compare, swap);
}

static void qpx_fetch_add(struct ibv_qp_ex *x, uint32_t rkey, uint64_t addr, uint64_t add)
{
	qpx_atomic(x, IBV_WR_ATOMIC_FETCH_AND_ADD, rkey, addr, add, 0);
}

static void qpx_set_sge(struct ibv_qp_ex *x, uint32_t lkey, uint64_t addr, uint32_t length)
{
	struct ibv_send_wr *w = wrb_of(x)->cur;

	if (w) {
		w->sg_list[0] = (struct ibv_sge){.addr = addr, .length = length, .lkey = lkey};
		w->num_sge = 1;
	}
}

static void qpx_set_sge_list(struct ibv_qp_ex *x, size_t num, const struct ibv_sge *sg)
{
	struct ibk_wrb *b = wrb_of(x);

	if (!b->cur)
		return;
	if (num > b->max_sge) {
		b->err = EINVAL;
		b->cur = NULL;
		return;
	}
	memcpy(b->cur->sg_list, sg, num * sizeof(*sg));
	b->cur->num_sge = (int)num;
}

/* The payload is copied at once (the app may reuse its buffer), and the
 * shim's post copies it again into its log. */
static void qpx_set_inline_list(struct ibv_qp_ex *x, size_t num, const struct ibv_data_buf *bufs)
{
	struct ibk_wrb *b = wrb_of(x);
	struct ibv_send_wr *w = b->cur;
	uint8_t *dst;
	size_t i, len = 0;

	if (!w)
		return;
	dst = b->inl + (size_t)(w - b->wr) * b->max_inline;
	for (i = 0; i < num; i++) {
		if (bufs[i].length > b->max_inline - len) {
			b->err = EINVAL;
			b->cur = NULL;
			return;
		}
		memcpy(dst + len, bufs[i].addr, bufs[i].length);
		len += bufs[i].length;
	}
	w->sg_list[0] = (struct ibv_sge){.addr = (uintptr_t)dst, .length = (uint32_t)len, .lkey = 0};
	w->num_sge = 1;
	w->send_flags |= IBV_SEND_INLINE;
}

static void qpx_set_inline(struct ibv_qp_ex *x, void *addr, size_t length)
{
	struct ibv_data_buf one = {.addr = addr, .length = length};

	qpx_set_inline_list(x, 1, &one);
}

static void qpx_set_ud_addr(struct ibv_qp_ex *x, struct ibv_ah *ah, uint32_t remote_qpn, uint32_t remote_qkey)
{
	struct ibv_send_wr *w = wrb_of(x)->cur;

	if (w) {
		w->wr.ud.ah = ah;
		w->wr.ud.remote_qpn = remote_qpn;
		w->wr.ud.remote_qkey = remote_qkey;
	}
}

static void qpx_bind_mw(struct ibv_qp_ex *x, struct ibv_mw *mw, uint32_t rkey, const struct ibv_mw_bind_info *i)
{
	(void)mw, (void)rkey, (void)i;
	refuse(x, "ibv_wr_bind_mw (type 2 windows are not rebuilt)");
}

static void qpx_local_inv(struct ibv_qp_ex *x, uint32_t rkey)
{
	(void)rkey;
	refuse(x, "ibv_wr_local_inv (type 2 windows are not rebuilt)");
}

static void qpx_send_inv(struct ibv_qp_ex *x, uint32_t rkey)
{
	(void)rkey;
	refuse(x, "ibv_wr_send_inv (type 2 windows are not rebuilt)");
}

static void qpx_send_tso(struct ibv_qp_ex *x, void *hdr, uint16_t hdr_sz, uint16_t mss)
{
	(void)hdr, (void)hdr_sz, (void)mss;
	refuse(x, "ibv_wr_send_tso");
}

static void qpx_set_xrc_srqn(struct ibv_qp_ex *x, uint32_t srqn)
{
	(void)srqn;
	refuse(x, "ibv_wr_set_xrc_srqn");
}

static void qpx_atomic_write(struct ibv_qp_ex *x, uint32_t rkey, uint64_t addr, const void *data)
{
	(void)rkey, (void)addr, (void)data;
	refuse(x, "ibv_wr_atomic_write (not logged for replay)");
}

int ibk_qpx_init(struct ibk_qp *qp)
{
	struct ibk_wrb *b;
	struct ibv_qp_ex *x = &qp->pubx;

	b = calloc(1, sizeof(*b));
	if (!b)
		return -ENOMEM;
	b->cap = qp->init.cap.max_send_wr ? qp->init.cap.max_send_wr : 1;
	b->max_sge = qp->init.cap.max_send_sge ? qp->init.cap.max_send_sge : 1;
	b->max_inline = qp->init.cap.max_inline_data;
	b->wr = calloc(b->cap, sizeof(*b->wr));
	b->sge = calloc((size_t)b->cap * b->max_sge, sizeof(*b->sge));
	b->inl = b->max_inline ? calloc(b->cap, b->max_inline) : NULL;
	if (!b->wr || !b->sge || (b->max_inline && !b->inl)) {
		qp->wrb = b;
		ibk_qpx_fini(qp);
		return -ENOMEM;
	}
	qp->wrb = b;
	x->comp_mask = 0;
	x->wr_start = qpx_start;
	x->wr_complete = qpx_complete;
	x->wr_abort = qpx_abort;
	x->wr_send = qpx_send;
	x->wr_send_imm = qpx_send_imm;
	x->wr_rdma_write = qpx_rdma_write;
	x->wr_rdma_write_imm = qpx_rdma_write_imm;
	x->wr_rdma_read = qpx_rdma_read;
	x->wr_atomic_cmp_swp = qpx_cmp_swp;
	x->wr_atomic_fetch_add = qpx_fetch_add;
	x->wr_set_sge = qpx_set_sge;
	x->wr_set_sge_list = qpx_set_sge_list;
	x->wr_set_inline_data = qpx_set_inline;
	x->wr_set_inline_data_list = qpx_set_inline_list;
	x->wr_set_ud_addr = qpx_set_ud_addr;
	x->wr_bind_mw = qpx_bind_mw;
	x->wr_local_inv = qpx_local_inv;
	x->wr_send_inv = qpx_send_inv;
	x->wr_send_tso = qpx_send_tso;
	x->wr_set_xrc_srqn = qpx_set_xrc_srqn;
	x->wr_atomic_write = qpx_atomic_write;
	return 0;
}

void ibk_qpx_fini(struct ibk_qp *qp)
{
	struct ibk_wrb *b = qp->wrb;

	if (!b)
		return;
	free(b->wr);
	free(b->sge);
	free(b->inl);
	free(b);
	qp->wrb = NULL;
}

IBK_EXPORT struct ibv_qp_ex *ibv_qp_to_qp_ex(struct ibv_qp *q)
{
	struct ibk_qp *qp = (struct ibk_qp *)q;

	/* as libibverbs: NULL for a QP made without send ops flags */
	return qp->wrb ? &qp->pubx : NULL;
}
