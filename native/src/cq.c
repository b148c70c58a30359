/* Completion queues.  A shadow CQ owns a private queue that drain fills;
 * poll returns it first, then translates what the real CQ holds: real
 * wr_ids point at log entries, which give back the app's wr_id and QP. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "shim.h"

static enum ibv_wc_opcode wc_opcode_of(enum ibv_wr_opcode op)
{
	switch (op) {
	case IBV_WR_RDMA_WRITE:
	case IBV_WR_RDMA_WRITE_WITH_IMM:
		return IBV_WC_RDMA_WRITE;
	case IBV_WR_RDMA_READ:
		return IBV_WC_RDMA_READ;
	case IBV_WR_ATOMIC_CMP_AND_SWP:
		return IBV_WC_COMP_SWAP;
	case IBV_WR_ATOMIC_FETCH_AND_ADD:
		return IBV_WC_FETCH_ADD;
	case IBV_WR_BIND_MW:
		return IBV_WC_BIND_MW;
	default:
		return IBV_WC_SEND;
	}
}

/* A completion for a send the peer is known to have received, although the
 * ack never arrived before release. */
void ibk_cq_synthesize(struct ibk_qp *qp, struct ibk_swr *e)
{
	struct ibv_wc wc;
	uint32_t i, len = 0;

	memset(&wc, 0, sizeof(wc));
	for (i = 0; i < (uint32_t)e->wr.num_sge; i++)
		len += e->sge[i].length;
	wc.wr_id = e->app_wr_id;
	wc.status = IBV_WC_SUCCESS;
	wc.opcode = wc_opcode_of(e->wr.opcode);
	wc.byte_len = (wc.opcode == IBV_WC_RDMA_READ || wc.opcode == IBV_WC_COMP_SWAP ||
		       wc.opcode == IBV_WC_FETCH_ADD) ? len : 0;
	wc.qp_num = qp->vqpn;
	ibk_lock(&qp->scq->lock);
	ibk_wcq_push(&qp->scq->pq, &wc);
	atomic_store(&qp->scq->pq_len, ibk_wcq_count(&qp->scq->pq));
	ibk_unlock(&qp->scq->lock);
}

static struct ibk_qp *qp_by_real_qpn(struct ibk_ctx *ctx, uint32_t rqpn)
{
	uint32_t slot;

	if (ibk_idmap_get(&ctx->rqpns, rqpn, &slot))
		return NULL;
	return ctx->qp_slots[slot];
}

/* A send completion off the common case (flag WR, error, out of order),
 * entered with qp->lock held. */
static __attribute__((noinline)) int wc_translate_send_slow(struct ibk_qp *qp, struct ibk_swr *e, struct ibv_wc *wc)
{
	int show = 1;

	wc->wr_id = e->app_wr_id;
	if (e->flags & IBK_SWR_BIND) /* replayed as a zero-length write (post.c) */
		wc->opcode = IBV_WC_BIND_MW;
	if (e->flags & IBK_SWR_FLAG_WR) {
		qp->flag_outstanding = 0;
		show = 0;
	}
	if (wc->status == IBV_WC_SUCCESS || !qp->releasing)
		ibk_sendlog_retire_entry(&qp->slog, e, &qp->cnt);
	else {
		show = 0; /* flushed by the shim itself: stays logged for replay */
		qp->rel_send_seen = e->seq + 1;
	}
	ibk_unlock(&qp->lock);
	wc->qp_num = qp->vqpn;
	return show;
}

/* Any completion off the two common cases below. */
static __attribute__((noinline)) int wc_translate_other(struct ibk_ctx *ctx, struct ibv_wc *wc)
{
	uint32_t *kind = (uint32_t *)(uintptr_t)wc->wr_id;

	if (*kind == IBK_KIND_SEND) {
		struct ibk_swr *e = (struct ibk_swr *)kind;
		struct ibk_qp *qp = IBK_OBJ(e->owner, ibk_qp);

		ibk_lock(&qp->lock);
		return wc_translate_send_slow(qp, e, wc);
	}
	if (*kind == IBK_KIND_RECV) {
		struct ibk_rwr *e = (struct ibk_rwr *)kind;
		struct ibk_obj *owner = e->owner;
		struct ibk_qp *qp;
		int show = 1;

		if (owner->kind == IBK_SRQ) {
			struct ibk_srq *srq = IBK_OBJ(owner, ibk_srq);

			qp = qp_by_real_qpn(ctx, wc->qp_num);
			ibk_lock(&srq->lock);
			wc->wr_id = e->app_wr_id;
			if (wc->status == IBV_WC_SUCCESS) {
				srq->cnt.recvs_completed++;
				ibk_recvlog_release(&srq->rlog, e);
			} else if (!(qp && qp->releasing)) {
				ibk_recvlog_release(&srq->rlog, e);
			} else {
				show = 0;
			}
			ibk_unlock(&srq->lock);
			if (qp && wc->status == IBV_WC_SUCCESS) {
				ibk_lock(&qp->rlock);
				qp->cnt.recvs_completed++;
				ibk_unlock(&qp->rlock);
			}
		} else {
			qp = IBK_OBJ(owner, ibk_qp);
			ibk_lock(&qp->rlock);
			wc->wr_id = e->app_wr_id;
			if (wc->status == IBV_WC_SUCCESS) {
				qp->cnt.recvs_completed++;
				ibk_recvlog_release(&qp->rlog, e);
			} else if (qp->releasing) {
				show = 0;
				qp->rel_recvs_flushed++;
			} else {
				ibk_recvlog_release(&qp->rlog, e);
			}
			ibk_unlock(&qp->rlock);
		}
		if (qp)
			wc->qp_num = qp->vqpn;
		if (__builtin_expect(atomic_load_explicit(&ibk_translating, memory_order_relaxed), 0) && qp &&
		    qp->pub.qp_type == IBV_QPT_UD) {
			uint32_t v;

			if (!ibk_peers_reverse_qpn(wc->src_qp, &v))
				wc->src_qp = v;
		}
		return show;
	}
	ibk_log("completion with an unknown wr_id %#llx: dropped", (unsigned long long)wc->wr_id);
	return 0;
}

/* The unlock when the decrement found more than "held" (waiters, or the
 * posts closed): the slow unlock, and show the completion. */
static __attribute__((noinline)) int unlock_slow_show(ibk_lock_t *l, int old)
{
	ibk_unlock_slow(l, old);
	return 1;
}

/* Release a lock taken with ibk_trylock and return 1; the slow unlock is a
 * tail call, so the common paths below stay leaf code (no registers to save). */
static inline __attribute__((always_inline)) int unlock_show(ibk_lock_t *l)
{
	int old = atomic_fetch_sub_explicit(&l->v, 1, memory_order_release);

	if (__builtin_expect(old != 1, 0))
		return unlock_slow_show(l, old);
	return 1;
}

/* Translate one real completion in place; 0 means hide it from the app.
 * The two common cases are handled here, under an uncontended lock; all
 * else (and contention) goes to wc_translate_other. */
static inline __attribute__((always_inline)) int wc_translate(struct ibk_ctx *ctx, struct ibv_wc *wc)
{
	uint32_t *kind = (uint32_t *)(uintptr_t)wc->wr_id;

	if (__builtin_expect(*kind == IBK_KIND_SEND, 1)) {
		struct ibk_swr *e = (struct ibk_swr *)kind;
		struct ibk_qp *qp = IBK_OBJ(e->owner, ibk_qp);
		uint32_t f = e->flags;

		if (__builtin_expect(!ibk_trylock(&qp->lock), 0))
			return wc_translate_other(ctx, wc);
		/* A successful app WR, the oldest in the log. */
		if (__builtin_expect(e->seq == qp->slog.head && !(f & (IBK_SWR_FLAG_WR | IBK_SWR_BIND)) &&
					     wc->status == IBV_WC_SUCCESS, 1)) {
			/* read the entry before the unlock frees its slot */
			wc->wr_id = e->app_wr_id;
			wc->qp_num = qp->vqpn;
			qp->slog.head++;
			qp->cnt.sends_completed++;
			if (f & IBK_SWR_CONSUMER)
				qp->cnt.consumers_done++;
			return unlock_show(&qp->lock);
		}
		return wc_translate_send_slow(qp, e, wc);
	}
	if (__builtin_expect(*kind == IBK_KIND_RECV, 1)) {
		struct ibk_rwr *e = (struct ibk_rwr *)kind;
		struct ibk_obj *owner = e->owner;
		struct ibk_qp *qp = IBK_OBJ(owner, ibk_qp);

		/* A successful receive on a plain QP, no UD source to translate. */
		if (__builtin_expect(owner->kind == IBK_QP && wc->status == IBV_WC_SUCCESS &&
					     !atomic_load_explicit(&ibk_translating, memory_order_relaxed) &&
					     ibk_trylock(&qp->rlock), 1)) {
			wc->wr_id = e->app_wr_id;
			wc->qp_num = qp->vqpn;
			qp->cnt.recvs_completed++;
			if (e->seq >= qp->rlog.head) /* the ring: retires every older one too */
				qp->rlog.head = e->seq + 1;
			return unlock_show(&qp->rlock);
		}
	}
	return wc_translate_other(ctx, wc);
}

/* The rest of a batch after a hidden completion at wc[0]: translate and
 * close the gaps. */
static __attribute__((noinline)) int wc_translate_rest(struct ibk_ctx *ctx, struct ibv_wc *wc, int n)
{
	int i, out = 0;

	for (i = 1; i < n; i++)
		if (wc_translate(ctx, &wc[i]))
			wc[out++] = wc[i];
	return out;
}

/* A batch of one, the usual result of polling: no loop, few registers. */
static __attribute__((noinline)) int wc_translate_one(struct ibk_ctx *ctx, struct ibv_wc *wc)
{
	return wc_translate(ctx, wc);
}

/* Translate got completions in wc in place, dropping hidden ones; returns
 * how many are left.  Out of line: an empty poll never comes here. */
static __attribute__((noinline)) int wc_translate_all(struct ibk_ctx *ctx, struct ibv_wc *wc, int got)
{
	int i;

	for (i = 0; i < got; i++)
		if (__builtin_expect(!wc_translate(ctx, &wc[i]), 0))
			return i + wc_translate_rest(ctx, &wc[i], got - i);
	return got;
}

int ibk_cq_poll_real(struct ibk_cq *cq, int n, struct ibv_wc *wc)
{
	int got = cq->poll_fn(cq->real, n, wc);

	if (got == 1)
		return wc_translate_one(cq->obj.ctx, wc);
	return got > 0 ? wc_translate_all(cq->obj.ctx, wc, got) : got;
}

int ibk_cq_drain_real(struct ibk_cq *cq)
{
	struct ibv_wc wc[32];
	int n, i, total = 0;

	while ((n = ibk_cq_poll_real(cq, 32, wc)) != 0) {
		if (n < 0)
			return n;
		ibk_lock(&cq->lock);
		for (i = 0; i < n; i++)
			ibk_wcq_push(&cq->pq, &wc[i]);
		atomic_store(&cq->pq_len, ibk_wcq_count(&cq->pq));
		ibk_unlock(&cq->lock);
		total += n;
	}
	return total;
}

/* poll_cq with completions drain left in the private queue: those first. */
static __attribute__((noinline)) int poll_cq_private(struct ibk_cq *cq, int n, struct ibv_wc *wc)
{
	int got, more;

	ibk_lock(&cq->lock);
	got = ibk_wcq_pop(&cq->pq, wc, n);
	atomic_store(&cq->pq_len, ibk_wcq_count(&cq->pq));
	ibk_unlock(&cq->lock);
	if (got < n) {
		more = ibk_cq_poll_real(cq, n - got, wc + got);
		if (more < 0 && !got)
			got = more;
		else if (more > 0)
			got += more;
	}
	return got;
}

int ibk_poll_cq(struct ibv_cq *c, int n, struct ibv_wc *wc)
{
	struct ibk_cq *cq = (struct ibk_cq *)c;
	int got;

	ibk_enter();
	if (__builtin_expect(atomic_load_explicit(&cq->pq_len, memory_order_relaxed) != 0, 0))
		got = poll_cq_private(cq, n, wc);
	else {
		got = cq->poll_fn(cq->real, n, wc);
		if (got > 0)
			got = got == 1 ? wc_translate_one(cq->obj.ctx, wc) : wc_translate_all(cq->obj.ctx, wc, got);
	}
	ibk_leave();
	return got;
}

int ibk_req_notify_cq(struct ibv_cq *c, int solicited_only)
{
	struct ibk_cq *cq = (struct ibk_cq *)c;
	int rc;

	ibk_enter();
	cq->armed = 1;
	cq->solicited = solicited_only;
	rc = cq->real->context->ops.req_notify_cq(cq->real, solicited_only);
	ibk_leave();
	return rc;
}

int ibk_cq_create_real(struct ibk_cq *cq)
{
	struct ibk_ctx *ctx = cq->obj.ctx;

	cq->real = ibk_real.create_cq(ctx->real, cq->cqe_req, cq, cq->chan ? cq->chan->real : NULL,
				      cq->comp_vector);
	if (cq->real)
		cq->poll_fn = cq->real->context->ops.poll_cq;
	return cq->real ? 0 : (errno ? -errno : -EIO);
}

static struct ibk_cq *cq_new(struct ibv_context *c, int cqe, void *cq_context, struct ibv_comp_channel *ch,
			     int vec)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	struct ibk_cq *cq = calloc(1, sizeof(*cq));

	if (!cq)
		return NULL;
	cq->obj.ctx = ctx;
	cq->cqe_req = cqe;
	cq->comp_vector = vec;
	cq->chan = ch ? (struct ibk_chan *)ch : NULL;
	ibk_lock_init(&cq->lock);
	if (ibk_wcq_init(&cq->pq, (uint32_t)(cqe > 16 ? cqe : 16))) {
		free(cq);
		return NULL;
	}
	ibk_enter();
	if (ibk_cq_create_real(cq)) {
		ibk_leave();
		ibk_wcq_fini(&cq->pq);
		free(cq);
		return NULL;
	}
	cq->pub.ex.context = c;
	cq->pub.ex.channel = ch;
	cq->pub.ex.cq_context = cq_context;
	cq->pub.ex.handle = cq->real->handle;
	cq->pub.ex.cqe = cq->real->cqe;
	pthread_mutex_init(&cq->pub.ex.mutex, NULL);
	pthread_cond_init(&cq->pub.ex.cond, NULL);
	ibk_obj_add(ctx, &cq->obj, IBK_CQ);
	ibk_leave();
	return cq;
}

IBK_EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *c, int cqe, void *cq_context,
					struct ibv_comp_channel *ch, int vec)
{
	struct ibk_cq *cq = cq_new(c, cqe, cq_context, ch, vec);

	return cq ? &cq->pub.cq : NULL;
}

/* ---- the extended polling API over the same translated completions ------- */

static struct ibk_cq *cqx(struct ibv_cq_ex *c)
{
	return (struct ibk_cq *)c;
}

static void cqx_load(struct ibk_cq *cq)
{
	struct ibv_wc *w = &cq->xbuf[cq->xpos];

	cq->pub.ex.wr_id = w->wr_id;
	cq->pub.ex.status = w->status;
}

static int cqx_start_poll(struct ibv_cq_ex *c, struct ibv_poll_cq_attr *attr)
{
	struct ibk_cq *cq = cqx(c);
	int n;

	(void)attr;
	n = ibk_poll_cq(&cq->pub.cq, IBK_XBATCH, cq->xbuf);
	if (n < 0)
		return -n;
	if (n == 0)
		return ENOENT;
	cq->xn = n;
	cq->xpos = 0;
	cqx_load(cq);
	return 0;
}

static int cqx_next_poll(struct ibv_cq_ex *c)
{
	struct ibk_cq *cq = cqx(c);

	if (++cq->xpos >= cq->xn) {
		int n = ibk_poll_cq(&cq->pub.cq, IBK_XBATCH, cq->xbuf);

		if (n <= 0) {
			cq->xn = 0;
			return n < 0 ? -n : ENOENT;
		}
		cq->xn = n;
		cq->xpos = 0;
	}
	cqx_load(cq);
	return 0;
}

static void cqx_end_poll(struct ibv_cq_ex *c)
{
	(void)c;
}

#define CQX_READ(name, type, field)                                        \
	static type cqx_read_##name(struct ibv_cq_ex *c)                   \
	{                                                                  \
		return (type)cqx(c)->xbuf[cqx(c)->xpos].field;             \
	}
CQX_READ(opcode, enum ibv_wc_opcode, opcode)
CQX_READ(vendor_err, uint32_t, vendor_err)
CQX_READ(byte_len, uint32_t, byte_len)
CQX_READ(imm_data, __be32, imm_data)
CQX_READ(qp_num, uint32_t, qp_num)
CQX_READ(src_qp, uint32_t, src_qp)
CQX_READ(wc_flags, unsigned int, wc_flags)
CQX_READ(slid, uint32_t, slid)
CQX_READ(sl, uint8_t, sl)
CQX_READ(dlid_path_bits, uint8_t, dlid_path_bits)

/* Readers of WC fields create_cq_ex refuses to provide: never valid to
 * call, but an app that calls one anyway reads 0 rather than jumping to NULL. */
static uint64_t cqx_read_none64(struct ibv_cq_ex *c)
{
	(void)c;
	return 0;
}

static uint16_t cqx_read_none16(struct ibv_cq_ex *c)
{
	(void)c;
	return 0;
}

static uint32_t cqx_read_none32(struct ibv_cq_ex *c)
{
	(void)c;
	return 0;
}

static void cqx_read_no_tm(struct ibv_cq_ex *c, struct ibv_wc_tm_info *tm)
{
	(void)c;
	memset(tm, 0, sizeof(*tm));
}

struct ibv_cq_ex *ibk_create_cq_ex(struct ibv_context *c, struct ibv_cq_init_attr_ex *attr)
{
	struct ibk_cq *cq;

	if ((attr->wc_flags & ~(uint64_t)IBV_WC_STANDARD_FLAGS) ||
	    (attr->comp_mask & ~(uint32_t)IBV_CQ_INIT_ATTR_MASK_FLAGS)) {
		ibk_unsupported("ibv_create_cq_ex with timestamps, flow tags or a parent domain");
		return NULL;
	}
	cq = cq_new(c, (int)attr->cqe, attr->cq_context, attr->channel, (int)attr->comp_vector);
	if (!cq)
		return NULL;
	cq->pub.ex.start_poll = cqx_start_poll;
	cq->pub.ex.next_poll = cqx_next_poll;
	cq->pub.ex.end_poll = cqx_end_poll;
	cq->pub.ex.read_opcode = cqx_read_opcode;
	cq->pub.ex.read_vendor_err = cqx_read_vendor_err;
	cq->pub.ex.read_byte_len = cqx_read_byte_len;
	cq->pub.ex.read_imm_data = cqx_read_imm_data;
	cq->pub.ex.read_qp_num = cqx_read_qp_num;
	cq->pub.ex.read_src_qp = cqx_read_src_qp;
	cq->pub.ex.read_wc_flags = cqx_read_wc_flags;
	cq->pub.ex.read_slid = cqx_read_slid;
	cq->pub.ex.read_sl = cqx_read_sl;
	cq->pub.ex.read_dlid_path_bits = cqx_read_dlid_path_bits;
	cq->pub.ex.read_completion_ts = cqx_read_none64;
	cq->pub.ex.read_completion_wallclock_ns = cqx_read_none64;
	cq->pub.ex.read_cvlan = cqx_read_none16;
	cq->pub.ex.read_flow_tag = cqx_read_none32;
	cq->pub.ex.read_tm_info = cqx_read_no_tm;
	return &cq->pub.ex;
}

IBK_EXPORT int ibv_destroy_cq(struct ibv_cq *c)
{
	struct ibk_cq *cq = (struct ibk_cq *)c;
	int rc = 0;

	ibk_enter();
	if (cq->real)
		rc = ibk_real.destroy_cq(cq->real);
	if (rc) {
		ibk_leave();
		return rc;
	}
	ibk_obj_del(cq->obj.ctx, &cq->obj);
	ibk_leave();
	ibk_wcq_fini(&cq->pq);
	free(cq);
	return 0;
}

/* The real CQ is resized; rebuild then makes it at the new size. */
IBK_EXPORT int ibv_resize_cq(struct ibv_cq *c, int cqe)
{
	struct ibk_cq *cq = (struct ibk_cq *)c;
	int rc;

	ibk_enter();
	rc = ibk_real.resize_cq(cq->real, cqe);
	if (!rc) {
		cq->cqe_req = cqe;
		cq->pub.cq.cqe = cq->real->cqe;
	}
	ibk_leave();
	return rc;
}
