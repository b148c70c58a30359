/* The posts of a QP and an SRQ: the logged post_send / post_recv fast
 * paths, their slow paths through the gate, the flag WR, and the closing of
 * the posts from quiesce to resume. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "shim.h"

static inline uint32_t lkey_real(struct ibk_ctx *ctx, uint32_t v)
{
	uint32_t r;

	if (!ctx->translate || ibk_idmap_get(&ctx->lkeys, v, &r))
		return v;
	return r;
}

static inline uint32_t rkey_real(struct ibk_qp *qp, uint32_t v)
{
	uint32_t r;

	if (!qp->peer.rkeys_translate || ibk_idmap_get(&qp->peer.rkeys, v, &r))
		return v;
	return r;
}

int ibk_qp_post_logged_send(struct ibk_qp *qp, struct ibk_swr *e)
{
	struct ibk_ctx *ctx = qp->obj.ctx;
	struct ibv_send_wr w = e->wr, *bad;
	struct ibv_sge sge[IBK_MAX_SGE];
	int i;

	w.wr_id = (uintptr_t)e;
	w.next = NULL;
	if (e->wr.send_flags & IBV_SEND_INLINE) {
		/* Replay needs the bytes, so the inline payload is sent from the
		 * log's copy, which also frees the app's buffer at once. */
		sge[0].addr = (uintptr_t)e->inline_buf;
		sge[0].length = e->inline_len;
		sge[0].lkey = 0;
		w.sg_list = sge;
		w.num_sge = e->inline_len ? 1 : 0;
	} else {
		for (i = 0; i < e->wr.num_sge; i++) {
			sge[i] = e->sge[i];
			sge[i].lkey = lkey_real(ctx, e->sge[i].lkey);
		}
		w.sg_list = sge;
	}
	switch (w.opcode) {
	case IBV_WR_RDMA_WRITE:
	case IBV_WR_RDMA_WRITE_WITH_IMM:
	case IBV_WR_RDMA_READ:
		if (!(e->flags & IBK_SWR_FLAG_WR))
			w.wr.rdma.rkey = rkey_real(qp, e->wr.wr.rdma.rkey);
		break;
	case IBV_WR_ATOMIC_CMP_AND_SWP:
	case IBV_WR_ATOMIC_FETCH_AND_ADD:
		w.wr.atomic.rkey = rkey_real(qp, e->wr.wr.atomic.rkey);
		break;
	case IBV_WR_BIND_MW:
		if (e->flags & IBK_SWR_BIND) {
			/* An ibv_bind_mw replayed after a rebuild: the window is
			 * already bound again as the app last asked (mw.c), so a
			 * zero-length write keeps the entry's place and completion. */
			w.opcode = IBV_WR_RDMA_WRITE;
			w.num_sge = 0;
			w.send_flags &= ~(unsigned int)IBV_SEND_INLINE;
			memset(&w.wr, 0, sizeof(w.wr));
		}
		break;
	default:
		break;
	}
	if (qp->pub.qp_type == IBV_QPT_UD) {
		struct ibk_ah *ah = (struct ibk_ah *)e->wr.wr.ud.ah;

		w.wr.ud.ah = ah->real;
		ah->last_qpn = e->wr.wr.ud.remote_qpn;
		ah->used = 1;
		if (atomic_load(&ibk_translating) && ah->attr.is_global) {
			struct ibk_peer_map pm;

			if (!ibk_peers_lookup(&ah->attr.grh.dgid, e->wr.wr.ud.remote_qpn, &pm) ||
			    !ibk_peers_fetch(&ah->attr.grh.dgid, e->wr.wr.ud.remote_qpn, 0)) {
				if (!ibk_peers_lookup(&ah->attr.grh.dgid, e->wr.wr.ud.remote_qpn, &pm))
					w.wr.ud.remote_qpn = pm.rqpn;
			}
		}
	}
	return qp->real->context->ops.post_send(qp->real, &w, &bad);
}

/* The Q_Key a UD QP was given in its last modify that set one. */
static uint32_t qp_qkey(const struct ibk_qp *qp)
{
	int i;

	for (i = qp->nmods - 1; i >= 0; i--)
		if (qp->mod_masks[i] & IBV_QP_QKEY)
			return qp->mods[i].qkey;
	return 0;
}

int ibk_qp_post_flag(struct ibk_qp *qp)
{
	struct ibk_swr *tail = ibk_sendlog_count(&qp->slog) ? ibk_sendlog_at(&qp->slog, qp->slog.tail - 1) : NULL;
	struct ibk_swr *e;
	int rc;

	if (qp->pub.qp_type == IBV_QPT_UD && !tail)
		return -EINVAL;
	e = ibk_sendlog_push(&qp->slog);
	if (!e)
		return -ENOSPC;
	memset(&e->wr, 0, sizeof(e->wr));
	e->wr.wr_id = (uintptr_t)e;
	e->flags = IBK_SWR_FLAG_WR | IBK_SWR_SIGNALED;
	e->wr.send_flags = IBV_SEND_SIGNALED;
	e->wr.num_sge = 0;
	e->wr.sg_list = e->sge;
	if (qp->pub.qp_type == IBV_QPT_UD) {
		/* UD has no RDMA write: a zero-length send to the last destination,
		 * with a Q_Key the receiver does not hold, so it drops the datagram
		 * without consuming a receive. */
		uint32_t qkey = tail->wr.wr.ud.remote_qkey;

		if (qkey & 0x80000000u)
			qkey = qp_qkey(qp);
		e->wr.opcode = IBV_WR_SEND;
		e->wr.wr.ud = tail->wr.wr.ud;
		e->wr.wr.ud.remote_qkey = (qkey ^ 0x2b5a6c1du) & 0x7fffffffu;
	} else {
		e->wr.opcode = IBV_WR_RDMA_WRITE; /* zero length: needs no rkey (IBA C9-88) */
	}
	rc = ibk_qp_post_logged_send(qp, e);
	if (rc) {
		ibk_sendlog_unpush(&qp->slog);
		return -rc;
	}
	qp->flag_outstanding = 1;
	qp->flag_seq = e->seq;
	return 0;
}

/* What each opcode is, for the log and the counters (CONSUMER only on RC:
 * qp->flag_mask drops it elsewhere). */
static const uint8_t op_flags[16] = {
	[IBV_WR_RDMA_WRITE] = IBK_SWR_RDMA,
	[IBV_WR_RDMA_WRITE_WITH_IMM] = IBK_SWR_RDMA | IBK_SWR_CONSUMER,
	[IBV_WR_SEND] = IBK_SWR_CONSUMER,
	[IBV_WR_SEND_WITH_IMM] = IBK_SWR_CONSUMER,
	[IBV_WR_RDMA_READ] = IBK_SWR_RDMA,
	[IBV_WR_ATOMIC_CMP_AND_SWP] = IBK_SWR_ATOMIC,
	[IBV_WR_ATOMIC_FETCH_AND_ADD] = IBK_SWR_ATOMIC,
	[IBV_WR_SEND_WITH_INV] = IBK_SWR_CONSUMER,
};

/* memcpy for the short payloads inline sends carry, without a libc call. */
static inline void copy_small(uint8_t *d, const uint8_t *s, uint32_t n)
{
	uint64_t a, b;

	if (n >= 8 && n <= 16) {
		memcpy(&a, s, 8);
		memcpy(&b, s + n - 8, 8);
		memcpy(d, &a, 8);
		memcpy(d + n - 8, &b, 8);
	} else {
		memcpy(d, s, n);
	}
}

/* Copy one app WR into its log entry: the one copy the shim keeps, and
 * (virtual ids permitting) the very WR the real QP is given.  The entry's
 * wr_id, next and sg_list are fixed at log creation. */
static inline __attribute__((always_inline)) int swr_fill(struct ibk_qp *qp, struct ibk_swr *e,
							  const struct ibv_send_wr *w)
{
	int i, n = w->num_sge;
	unsigned op = (unsigned)w->opcode;

	if (__builtin_expect((unsigned)n > qp->slog.max_sge, 0))
		return EINVAL;
	e->app_wr_id = w->wr_id;
	/* num_sge, opcode, send_flags, imm_data, wr and qp_type are adjacent:
	 * one fixed-size copy (num_sge is redone below for inline sends) */
	memcpy(&e->wr.num_sge, &w->num_sge,
	       offsetof(struct ibv_send_wr, bind_mw) - offsetof(struct ibv_send_wr, num_sge));
	if (__builtin_expect(op == IBV_WR_BIND_MW || op == IBV_WR_TSO, 0))
		e->wr.bind_mw = w->bind_mw; /* the larger member of that union */
	if (__builtin_expect(w->send_flags & IBV_SEND_INLINE, 0) == 0) {
		if (__builtin_expect(n == 1, 1))
			e->sge[0] = w->sg_list[0];
		else
			for (i = 0; i < n; i++)
				e->sge[i] = w->sg_list[i];
	} else {
		/* Replay needs the bytes, so the inline payload is sent from the
		 * log's copy, which also frees the app's buffer at once. */
		uint32_t len = 0;

		if (__builtin_expect(n == 1 && w->sg_list[0].length <= qp->slog.max_inline, 1)) {
			len = w->sg_list[0].length;
			copy_small(e->inline_buf, (const uint8_t *)(uintptr_t)w->sg_list[0].addr, len);
		} else {
			for (i = 0; i < n; i++) {
				uint32_t l = w->sg_list[i].length;

				if (l > qp->slog.max_inline - len)
					return EINVAL;
				copy_small(e->inline_buf + len, (const uint8_t *)(uintptr_t)w->sg_list[i].addr, l);
				len += l;
			}
		}
		e->inline_len = len;
		e->sge[0].addr = (uintptr_t)e->inline_buf;
		e->sge[0].length = len;
		e->sge[0].lkey = 0;
		e->wr.num_sge = len ? 1 : 0;
	}
	/* qp->opf: the opcode's log flags for this QP type, with sq_sig_all */
	e->flags = (__builtin_expect(op < 16, 1) ? qp->opf[op] : qp->sig_all) |
		   ((w->send_flags & IBV_SEND_SIGNALED) ? IBK_SWR_SIGNALED : 0);
	return 0;
}

/* 1 while the drain's flag WR still holds an entry of the send log. */
static inline uint32_t flag_in_log(const struct ibk_qp *qp)
{
	return qp->flag_outstanding && qp->flag_seq >= qp->slog.head && qp->flag_seq < qp->slog.tail;
}

/* Any list of WRs, translated as needed.  The caller is inside the gate. */
static __attribute__((noinline)) int post_send_list(struct ibk_qp *qp, struct ibv_send_wr *wr,
						    struct ibv_send_wr **bad)
{
	struct ibv_send_wr *rbad;
	int rc = 0;

	ibk_lock(&qp->lock);
	for (; wr; wr = wr->next) {
		struct ibk_swr *e;

		/* Keep the flag WR's slot free: the app sees one slot less, and
		 * a flag WR in the log takes that slot, not one of the app's. */
		if (ibk_sendlog_count(&qp->slog) - flag_in_log(qp) + 1 >= qp->slog.cap) {
			rc = ENOMEM;
			break;
		}
		e = &qp->slog.slots[qp->slog.tail & qp->slog.mask];
		e->seq = qp->slog.tail++;
		rc = swr_fill(qp, e, wr);
		if (!rc) {
			if (!(qp->ud | qp->obj.ctx->translate | qp->peer.rkeys_translate))
				rc = qp->post_send_fn(qp->real, &e->wr, &rbad);
			else
				rc = ibk_qp_post_logged_send(qp, e);
		}
		if (rc) {
			ibk_sendlog_unpush(&qp->slog);
			break;
		}
		qp->cnt.sends_posted++;
	}
	ibk_unlock(&qp->lock);
	if (rc)
		*bad = wr;
	return rc;
}

/* Everything but the fast path's case, through the gate. */
static __attribute__((noinline)) int post_send_slow(struct ibk_qp *qp, struct ibv_send_wr *wr,
						    struct ibv_send_wr **bad)
{
	int rc;

	ibk_enter();
	rc = post_send_list(qp, wr, bad);
	ibk_leave();
	return rc;
}

/* The fast path's WR: one SGE, a data opcode (send, write, read, atomics:
 * the ones without bind_mw/tso/invalidate fields) and an inline payload, if
 * any, of 8 to 16 bytes.  Everything else takes the list path.  sg_list is
 * read only once num_sge says there is one. */
static inline __attribute__((always_inline)) int send_wr_is_plain(const struct ibk_qp *qp,
								   const struct ibv_send_wr *w)
{
	uint32_t len;

	if (__builtin_expect(w->num_sge != 1 || (unsigned)w->opcode > IBV_WR_ATOMIC_FETCH_AND_ADD, 0))
		return 0;
	if (__builtin_expect(!(w->send_flags & IBV_SEND_INLINE), 1))
		return 1;
	len = w->sg_list[0].length;
	return len - 8 <= 8 && len <= qp->slog.max_inline;
}

/* The fast path takes no gate: the QP's send lock stands in for it.  The
 * shim closes the posts by setting IBK_LOCK_SLOW on every post lock and
 * waiting until none is held, so a post either holds the lock before that
 * (and quiesce waits for it) or fails the trylock and parks at the gate. */
int ibk_post_send(struct ibv_qp *q, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
	struct ibk_qp *qp = (struct ibk_qp *)q;
	/* only a failed post reads these after the real call (see ibk_post_recv) */
	struct ibv_send_wr *volatile app_wr = wr;
	struct ibv_send_wr **volatile app_bad = bad;
	struct ibk_swr *e;
	uint64_t seq;
	unsigned op;
	int rc;

	/* The common case: one plain WR on a non-UD QP, the posts open and no
	 * translation (read under the lock: see ibk_xlate_any).  Only the real
	 * post is called on the way, so only qp needs a saved register. */
	if (__builtin_expect(!wr || wr->next || qp->ud || !ibk_trylock(&qp->lock), 0))
		return post_send_slow(qp, wr, bad);
	seq = qp->slog.tail;
	/* Keep the flag WR's slot free: the app sees one slot less. */
	if (__builtin_expect(atomic_load_explicit(&ibk_xlate_any, memory_order_relaxed) ||
				     seq + 1 - qp->slog.head >= qp->slog.cap || !send_wr_is_plain(qp, wr),
			     0)) {
		ibk_unlock(&qp->lock);
		return post_send_slow(qp, app_wr, app_bad);
	}
	e = &qp->slog.slots[seq & qp->slog.mask];
	qp->slog.tail = seq + 1;
	e->seq = seq;
	e->app_wr_id = wr->wr_id;
	/* num_sge, opcode, send_flags, imm_data and the rdma/atomic union */
	memcpy(&e->wr.num_sge, &wr->num_sge, offsetof(struct ibv_send_wr, qp_type) - offsetof(struct ibv_send_wr, num_sge));
	if (__builtin_expect(wr->send_flags & IBV_SEND_INLINE, 0)) {
		/* replay needs the bytes: the payload is sent from the log's copy */
		const uint8_t *src = (const uint8_t *)(uintptr_t)wr->sg_list[0].addr;
		uint32_t len = wr->sg_list[0].length;
		uint64_t head8, tail8;

		memcpy(&head8, src, 8);
		memcpy(&tail8, src + len - 8, 8);
		memcpy(e->inline_buf, &head8, 8);
		memcpy(e->inline_buf + len - 8, &tail8, 8);
		e->inline_len = len;
		e->sge[0].addr = (uintptr_t)e->inline_buf;
		e->sge[0].length = len;
		e->sge[0].lkey = 0;
	} else {
		e->sge[0] = wr->sg_list[0];
	}
	op = (unsigned)wr->opcode;
	e->flags = qp->opf[op] | ((wr->send_flags & IBV_SEND_SIGNALED) ? IBK_SWR_SIGNALED : 0);
	rc = qp->post_send_fn(qp->real, &e->wr, bad); /* the log entry itself */
	IBK_FORGET(qp);
	if (__builtin_expect(!rc, 1)) {
		qp->cnt.sends_posted++;
	} else {
		qp->slog.tail--;
		*app_bad = app_wr;
	}
	ibk_unlock(&qp->lock);
	return rc;
}

/* After a rebuild: a copy of the WR with real lkeys. */
static __attribute__((noinline)) int post_real_recv_translated(struct ibk_ctx *ctx, struct ibk_qp *qp,
							       struct ibk_srq *srq, struct ibk_rwr *e)
{
	struct ibv_recv_wr w = e->wr, *bad;
	struct ibv_sge sge[IBK_MAX_SGE];
	int i;

	for (i = 0; i < e->wr.num_sge; i++) {
		sge[i] = e->sge[i];
		sge[i].lkey = lkey_real(ctx, e->sge[i].lkey);
	}
	w.sg_list = sge;
	if (srq)
		return srq->post_recv_fn(srq->real, &w, &bad);
	return qp->post_recv_fn(qp->real, &w, &bad);
}

/* Post one logged receive: the log entry itself unless keys need translating. */
static inline __attribute__((always_inline)) int post_real_recv(struct ibk_ctx *ctx, struct ibk_qp *qp,
								struct ibk_srq *srq, struct ibk_rwr *e)
{
	struct ibv_recv_wr *bad;

	if (__builtin_expect(ctx->translate, 0))
		return post_real_recv_translated(ctx, qp, srq, e);
	if (srq)
		return srq->post_recv_fn(srq->real, &e->wr, &bad);
	return qp->post_recv_fn(qp->real, &e->wr, &bad);
}

int ibk_qp_post_logged_recv(struct ibk_qp *qp, struct ibk_rwr *e)
{
	return post_real_recv(qp->obj.ctx, qp, NULL, e);
}

int ibk_srq_post_logged_recv(struct ibk_srq *srq, struct ibk_rwr *e)
{
	return post_real_recv(srq->obj.ctx, NULL, srq, e);
}

/* Any list of receive WRs, for a QP or an SRQ.  The caller is inside the gate. */
static __attribute__((noinline)) int post_recv_list(struct ibk_recvlog *log, ibk_lock_t *lock,
						    struct ibk_counters *cnt, struct ibk_ctx *ctx,
						    struct ibk_qp *qp, struct ibk_srq *srq,
						    struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
	int rc = 0, i;

	ibk_lock(lock);
	for (; wr; wr = wr->next) {
		struct ibk_rwr *e;
		int n = wr->num_sge;

		if ((unsigned)n > log->max_sge) {
			rc = EINVAL;
			break;
		}
		e = ibk_recvlog_take(log);
		if (!e) {
			rc = ENOMEM;
			break;
		}
		e->app_wr_id = wr->wr_id;
		e->wr.num_sge = n;
		for (i = 0; i < n; i++)
			e->sge[i] = wr->sg_list[i];
		rc = post_real_recv(ctx, qp, srq, e);
		if (rc) {
			ibk_recvlog_untake(log, e);
			break;
		}
		if (srq)
			cnt->recvs_posted++;
	}
	ibk_unlock(lock);
	if (rc)
		*bad = wr;
	return rc;
}

int ibk_post_srq_recv(struct ibv_srq *s, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
	struct ibk_srq *srq = (struct ibk_srq *)s;
	int rc;

	ibk_enter();
	rc = post_recv_list(&srq->rlog, &srq->lock, &srq->cnt, srq->obj.ctx, NULL, srq, wr, bad);
	ibk_leave();
	return rc;
}

/* Everything but the fast path's case, through the gate. */
static __attribute__((noinline)) int post_recv_slow(struct ibk_qp *qp, struct ibv_recv_wr *wr,
						    struct ibv_recv_wr **bad)
{
	int rc;

	if (qp->srq) {
		*bad = wr;
		return EINVAL;
	}
	ibk_enter();
	rc = post_recv_list(&qp->rlog, &qp->rlock, &qp->cnt, qp->obj.ctx, qp, NULL, wr, bad);
	ibk_leave();
	return rc;
}

/* No gate here either: see ibk_post_send.  The receive lock of a QP on an
 * SRQ always has IBK_LOCK_SLOW, so the slow path refuses those posts. */
int ibk_post_recv(struct ibv_qp *q, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
	struct ibk_qp *qp = (struct ibk_qp *)q;
	struct ibk_recvlog *l = &qp->rlog;
	/* only a failed post reads these after the real call: kept in memory,
	 * not in saved registers */
	struct ibv_recv_wr *volatile app_wr = wr;
	struct ibv_recv_wr **volatile app_bad = bad;
	struct ibk_rwr *e;
	uint64_t seq;
	int rc;

	/* The common case: one WR with one SGE, the posts open and no
	 * translation.  A plain QP's receive log is always a ring. */
	if (__builtin_expect(!wr || wr->next || wr->num_sge != 1 || !ibk_trylock(&qp->rlock), 0))
		return post_recv_slow(qp, wr, bad);
	seq = l->next_seq;
	if (__builtin_expect(atomic_load_explicit(&ibk_xlate_any, memory_order_relaxed) || seq - l->head >= l->cap,
			     0)) {
		ibk_unlock(&qp->rlock);
		return post_recv_slow(qp, app_wr, app_bad);
	}
	e = &l->slots[seq & l->mask];
	l->next_seq = seq + 1;
	e->seq = seq;
	e->app_wr_id = wr->wr_id;
	e->wr.num_sge = 1;
	e->sge[0] = wr->sg_list[0];
	/* the log entry itself; on failure the provider points bad at it, and
	 * we point it back at the app's WR */
	rc = qp->post_recv_fn(qp->real, &e->wr, bad);
	IBK_FORGET(qp);
	if (__builtin_expect(rc != 0, 0)) {
		qp->rlog.next_seq--;
		*app_bad = app_wr;
	}
	ibk_unlock(&qp->rlock);
	return rc;
}

/* ---- closing the posts (quiesce to resume) ------------------------------- */

/* From now on this QP's posts fail the fast path's trylock and go to the gate. */
void ibk_qp_posts_close(struct ibk_qp *qp)
{
	atomic_fetch_or(&qp->lock.v, IBK_LOCK_SLOW);
	atomic_fetch_or(&qp->rlock.v, IBK_LOCK_SLOW);
}

/* Nonzero while a post that got in before the close still holds a lock. */
int ibk_qp_posts_busy(struct ibk_qp *qp)
{
	return (atomic_load(&qp->lock.v) | atomic_load(&qp->rlock.v)) & IBK_LOCK_STATE;
}

void ibk_qp_posts_open(struct ibk_qp *qp)
{
	atomic_fetch_and_explicit(&qp->lock.v, ~IBK_LOCK_SLOW, memory_order_release);
	if (!qp->srq)
		atomic_fetch_and_explicit(&qp->rlock.v, ~IBK_LOCK_SLOW, memory_order_release);
}

/* A new QP's log flags per opcode (qp.c fills flag_mask and sig_all first). */
void ibk_qp_set_op_flags(struct ibk_qp *qp)
{
	unsigned op;

	for (op = 0; op < 16; op++)
		qp->opf[op] = (uint8_t)((op_flags[op] & qp->flag_mask) | qp->sig_all);
}

