/* Memory windows of type 1.  A shadow window keeps its binding (MR, range,
 * rights) as the app last asked for it.  An ibv_bind_mw goes through the
 * QP's send log like a send: the provider posts it on the send queue, and
 * its completion names a log entry.  The window's rkey is virtual like an
 * MR's: the first incarnation's real rkey, or a fresh one when it collides.
 * Rebuild allocates every window again and binds it again, on a private
 * loopback QP of its PD, before the rank's records are published, so the
 * peers learn the new real rkey under the virtual one.  Type 2 windows
 * (bound by work requests, invalidated by the peer) are refused. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coord.h"
#include "shim.h"

/* The window's virtual rkey for its current real one (ctx->lock held): the
 * old one is retired, the new one is the real rkey unless that is taken. */
static void mw_rekey(struct ibk_ctx *ctx, struct ibk_mw *mw, int retire)
{
	if (retire)
		ibk_idmap_del(&ctx->rkeys, mw->pub.rkey);
	mw->pub.rkey = ibk_idmap_choose(&ctx->rkeys, mw->real->rkey, 0x80000000u, 0xffffffffu);
	ibk_idmap_put(&ctx->rkeys, mw->pub.rkey, mw->real->rkey);
	if (mw->pub.rkey != mw->real->rkey) {
		atomic_store(&ibk_xlate_any, 1);
		ctx->translate = 1;
	}
}

struct ibv_mw *ibk_alloc_mw(struct ibv_pd *p, enum ibv_mw_type type)
{
	struct ibk_pd *pd = (struct ibk_pd *)p;
	struct ibk_ctx *ctx = pd->obj.ctx;
	struct ibk_mw *mw;

	if (type != IBV_MW_TYPE_1) {
		ibk_unsupported("ibv_alloc_mw");
		errno = EOPNOTSUPP;
		return NULL;
	}
	mw = calloc(1, sizeof(*mw));
	if (!mw)
		return NULL;
	ibk_enter();
	mw->real = pd->real->context->ops.alloc_mw ? pd->real->context->ops.alloc_mw(pd->real, type) : NULL;
	if (!mw->real) {
		if (!pd->real->context->ops.alloc_mw)
			errno = EOPNOTSUPP;
		ibk_leave();
		free(mw);
		return NULL;
	}
	mw->pd = pd;
	mw->pub.context = p->context;
	mw->pub.pd = p;
	mw->pub.handle = mw->real->handle;
	mw->pub.type = type;
	pthread_mutex_lock(&ctx->lock);
	mw_rekey(ctx, mw, 0);
	pthread_mutex_unlock(&ctx->lock);
	ibk_obj_add(ctx, &mw->obj, IBK_MW);
	ibk_leave();
	IBK_DBG("alloc_mw rkey %#x", mw->pub.rkey);
	return &mw->pub;
}

int ibk_dealloc_mw(struct ibv_mw *m)
{
	struct ibk_mw *mw = (struct ibk_mw *)m;
	struct ibk_ctx *ctx = mw->obj.ctx;
	int rc;

	ibk_enter();
	rc = mw->real->context->ops.dealloc_mw(mw->real);
	if (rc) {
		ibk_leave();
		return rc;
	}
	pthread_mutex_lock(&ctx->lock);
	ibk_idmap_del(&ctx->rkeys, mw->pub.rkey);
	pthread_mutex_unlock(&ctx->lock);
	ibk_obj_del(ctx, &mw->obj);
	ibk_leave();
	free(mw);
	return 0;
}

/* ibv_bind_mw: logged like a send (IBK_SWR_BIND), posted by the provider
 * with the entry as its wr_id.  libibverbs' inline checked the window's
 * type and that the MR belongs to its PD. */
int ibk_bind_mw(struct ibv_qp *q, struct ibv_mw *m, struct ibv_mw_bind *b)
{
	struct ibk_qp *qp = (struct ibk_qp *)q;
	struct ibk_mw *mw = (struct ibk_mw *)m;
	struct ibk_mr *mr = (struct ibk_mr *)b->bind_info.mr;
	struct ibk_ctx *ctx = mw->obj.ctx;
	struct ibv_mw_bind rb = *b;
	struct ibk_swr *e;
	int rc;

	ibk_enter();
	ibk_lock(&qp->lock);
	/* Keep the flag WR's slot free, as the posts do. */
	e = ibk_sendlog_count(&qp->slog) + 1 >= qp->slog.cap ? NULL : ibk_sendlog_push(&qp->slog);
	if (!e) {
		rc = ENOMEM;
		goto out;
	}
	e->app_wr_id = b->wr_id;
	e->wr.opcode = IBV_WR_BIND_MW;
	e->wr.num_sge = 0;
	e->wr.send_flags = b->send_flags;
	e->wr.bind_mw.mw = m;
	e->wr.bind_mw.rkey = 0;
	e->wr.bind_mw.bind_info = b->bind_info;
	e->flags = IBK_SWR_BIND | qp->sig_all | ((b->send_flags & IBV_SEND_SIGNALED) ? IBK_SWR_SIGNALED : 0);
	rb.wr_id = (uintptr_t)e;
	rb.bind_info.mr = mr ? mr->real : NULL;
	rc = mw->real->context->ops.bind_mw(qp->real, mw->real, &rb);
	if (rc) {
		ibk_sendlog_unpush(&qp->slog);
		goto out;
	}
	qp->cnt.sends_posted++;
	/* a zero length (or no MR) unbinds */
	mw->mr = mr && b->bind_info.length ? mr : NULL;
	mw->addr = b->bind_info.addr;
	mw->length = b->bind_info.length;
	mw->access = b->bind_info.mw_access_flags;
	pthread_mutex_lock(&ctx->lock);
	mw_rekey(ctx, mw, 1);
	pthread_mutex_unlock(&ctx->lock);
	IBK_DBG("bind_mw rkey %#x (real %#x)", mw->pub.rkey, mw->real->rkey);
out:
	ibk_unlock(&qp->lock);
	ibk_leave();
	return rc;
}

/* ---- rebuild ------------------------------------------------------------ */

/* A private RC QP of the PD connected to itself: binds are local work
 * requests, so it only needs to reach RTS.  cq is its own CQ. */
static struct ibv_qp *loop_qp(struct ibk_ctx *ctx, struct ibk_pd *pd, struct ibv_cq *cq)
{
	struct ibv_qp_init_attr ia = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 1};
	struct ibv_qp_attr a;
	struct ibv_qp *qp;
	int g;

	ia.cap.max_send_wr = 2;
	ia.cap.max_recv_wr = 1;
	ia.cap.max_send_sge = 1;
	ia.cap.max_recv_sge = 1;
	qp = ibk_real.create_qp(pd->real, &ia);
	if (!qp)
		return NULL;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.port_num = 1;
	a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_MW_BIND;
	if (ibk_real.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		goto fail;
	for (g = 0; g < 4; g++) {
		if (!(ctx->port_gid_valid & (1u << g)))
			continue;
		memset(&a, 0, sizeof(a));
		a.qp_state = IBV_QPS_RTR;
		a.path_mtu = IBV_MTU_1024;
		a.dest_qp_num = qp->qp_num;
		a.max_dest_rd_atomic = 1;
		a.min_rnr_timer = 12;
		a.ah_attr.is_global = 1;
		a.ah_attr.grh.dgid = ctx->rgid[g];
		a.ah_attr.grh.sgid_index = (uint8_t)g;
		a.ah_attr.grh.hop_limit = 1;
		a.ah_attr.port_num = 1;
		a.ah_attr.dlid = ctx->rlid;
		if (!ibk_real.modify_qp(qp, &a,
					IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
						IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
			break;
	}
	if (g == 4)
		goto fail;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 1;
	if (ibk_real.modify_qp(qp, &a,
			       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
				       IBV_QP_MAX_QP_RD_ATOMIC))
		goto fail;
	return qp;
fail:
	ibk_real.destroy_qp(qp);
	return NULL;
}

/* Bind the new real window as the app last bound the old one, and wait
 * (bounded) for the bind's completion on the private CQ. */
static int mw_rebind(struct ibk_mw *mw, struct ibv_qp *qp, struct ibv_cq *cq)
{
	struct ibv_mw_bind rb;
	struct ibv_wc wc;
	struct timespec nap = {0, 100000};
	int rc, i, n = 0;

	memset(&rb, 0, sizeof(rb));
	rb.wr_id = 1;
	rb.send_flags = IBV_SEND_SIGNALED;
	rb.bind_info.mr = mw->mr->real;
	rb.bind_info.addr = mw->addr;
	rb.bind_info.length = mw->length;
	rb.bind_info.mw_access_flags = mw->access;
	rc = mw->real->context->ops.bind_mw(qp, mw->real, &rb);
	if (rc)
		return -rc;
	for (i = 0; i < 20000 && !n; i++) { /* 2 s */
		n = cq->context->ops.poll_cq(cq, 1, &wc);
		if (!n)
			nanosleep(&nap, NULL);
	}
	if (n != 1)
		return n < 0 ? -EIO : -ETIMEDOUT;
	return wc.status == IBV_WC_SUCCESS ? 0 : -EIO;
}

/* The windows of one PD: allocated again, and the bound ones bound again
 * through one loopback QP. */
static int mw_rebuild_pd(struct ibk_ctx *ctx, struct ibk_pd *pd)
{
	struct ibv_cq *cq = NULL;
	struct ibv_qp *qp = NULL;
	struct ibk_obj *o;
	int rc = 0;

	for (o = ctx->head.next; o != &ctx->head; o = o->next) {
		struct ibk_mw *mw;

		if (o->kind != IBK_MW || IBK_OBJ(o, ibk_mw)->pd != pd)
			continue;
		mw = IBK_OBJ(o, ibk_mw);
		if (!ctx->real->ops.alloc_mw) { /* IBCKPT_DEVICE named a device without windows */
			rc = -EOPNOTSUPP;
			break;
		}
		errno = 0;
		mw->real = ctx->real->ops.alloc_mw(pd->real, IBV_MW_TYPE_1);
		if (!mw->real) {
			rc = errno ? -errno : -ENOMEM;
			break;
		}
		if (mw->mr && !qp) {
			cq = ibk_real.create_cq(ctx->real, 4, NULL, NULL, 0);
			qp = cq ? loop_qp(ctx, pd, cq) : NULL;
			if (!qp) {
				rc = -EIO;
				break;
			}
		}
		if (mw->mr) {
			rc = mw_rebind(mw, qp, cq);
			if (rc)
				break;
		}
		pthread_mutex_lock(&ctx->lock);
		ibk_idmap_put(&ctx->rkeys, mw->pub.rkey, mw->real->rkey);
		pthread_mutex_unlock(&ctx->lock);
	}
	if (qp)
		ibk_real.destroy_qp(qp);
	if (cq)
		ibk_real.destroy_cq(cq);
	return rc;
}

int ibk_mw_rebuild_all(struct ibk_ctx *ctx)
{
	struct ibk_obj *o, *w;
	int rc = 0;

	for (o = ctx->head.next; o != &ctx->head; o = o->next) {
		if (o->kind != IBK_PD)
			continue;
		for (w = ctx->head.next; w != &ctx->head; w = w->next)
			if (w->kind == IBK_MW && IBK_OBJ(w, ibk_mw)->pd == IBK_OBJ(o, ibk_pd))
				break;
		if (w == &ctx->head)
			continue; /* no window on this PD */
		rc = mw_rebuild_pd(ctx, IBK_OBJ(o, ibk_pd));
		if (rc) {
			ibk_log("rebuild: memory windows failed: %d", rc);
			return rc;
		}
	}
	return 0;
}
