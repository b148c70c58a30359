/* Queue pairs: creation with a reserved flag slot, logged modify_qp with
 * virtual-id translation, query and destroy.  The posts are in post.c. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "reserve.h"
#include "shim.h"

/* ---- creation --------------------------------------------------------------- */

/* The real QP of one made by ibv_create_qp_ex: the device gets the same
 * extended attributes, so it accepts and refuses exactly as it would
 * natively, and a rebuild makes the same QP again. */
static struct ibv_qp *qp_create_real_ex(struct ibv_pd *rpd, const struct ibk_qp_ex_attr *ex,
				       struct ibv_qp_init_attr *a)
{
	struct ibv_context *rc = rpd->context;
	struct verbs_context *v = verbs_get_ctx_op(rc, create_qp_ex);
	struct ibv_qp_init_attr_ex ax;
	struct ibv_qp *real;

	if (!v) {
		errno = EOPNOTSUPP;
		return NULL;
	}
	memset(&ax, 0, sizeof(ax));
	ax.qp_context = a->qp_context;
	ax.send_cq = a->send_cq;
	ax.recv_cq = a->recv_cq;
	ax.srq = a->srq;
	ax.cap = a->cap;
	ax.qp_type = a->qp_type;
	ax.sq_sig_all = a->sq_sig_all;
	ax.comp_mask = ex->comp_mask | IBV_QP_INIT_ATTR_PD;
	ax.pd = rpd;
	ax.create_flags = ex->create_flags;
	ax.send_ops_flags = ex->send_ops_flags;
	ax.max_tso_header = ex->max_tso_header;
	real = v->create_qp_ex(rc, &ax);
	if (real)
		a->cap = ax.cap;
	return real;
}

int ibk_qp_create_real(struct ibk_qp *qp)
{
	struct ibv_qp_init_attr a = qp->init;
	struct ibk_ctx *ctx = qp->obj.ctx;

	a.send_cq = qp->scq->real;
	a.recv_cq = qp->rcq->real;
	a.srq = qp->srq ? qp->srq->real : NULL;
	a.qp_context = qp;
	a.cap.max_send_wr += 1; /* the flag WR's slot */
	if (qp->ex.comp_mask)
		qp->real = qp_create_real_ex(qp->pd->real, &qp->ex, &a);
	else
		qp->real = ibk_real.create_qp(qp->pd->real, &a);
	if (!qp->real)
		return errno ? -errno : -EIO;
	qp->post_send_fn = qp->real->context->ops.post_send;
	qp->post_recv_fn = qp->real->context->ops.post_recv;
	pthread_mutex_lock(&ctx->lock);
	ibk_idmap_put(&ctx->rqpns, qp->real->qp_num, qp->slot);
	pthread_mutex_unlock(&ctx->lock);
	qp->real_cap = a.cap;
	return 0;
}

static uint32_t qp_slot_take(struct ibk_ctx *ctx, struct ibk_qp *qp)
{
	uint32_t i;

	pthread_mutex_lock(&ctx->lock);
	if (!ctx->qp_slots)
		ctx->qp_slots = calloc(IBK_MAX_QPS, sizeof(*ctx->qp_slots));
	for (i = 0; ctx->qp_slots && i < IBK_MAX_QPS; i++)
		if (!ctx->qp_slots[i]) {
			ctx->qp_slots[i] = qp;
			break;
		}
	pthread_mutex_unlock(&ctx->lock);
	return i;
}

/* A QP type the shim cannot carry (raw packet, XRC, driver QPs): the device
 * is asked first, so a program gets the device's own error for attributes
 * it refuses (a raw packet QP with too many WRs, say); one the device would
 * make is refused.  The probe QP is destroyed at once. */
static void qp_type_refuse(struct ibk_pd *pd, const struct ibv_qp_init_attr *attr,
			   const struct ibk_qp_ex_attr *ex)
{
	struct ibv_qp_init_attr a = *attr;
	struct ibv_qp *real;

	a.send_cq = attr->send_cq ? ((struct ibk_cq *)attr->send_cq)->real : NULL;
	a.recv_cq = attr->recv_cq ? ((struct ibk_cq *)attr->recv_cq)->real : NULL;
	a.srq = attr->srq ? ((struct ibk_srq *)attr->srq)->real : NULL;
	a.qp_context = NULL;
	ibk_enter();
	real = ex && ex->comp_mask ? qp_create_real_ex(pd->real, ex, &a) : ibk_real.create_qp(pd->real, &a);
	if (real)
		ibk_real.destroy_qp(real);
	ibk_leave();
	if (!real) /* errno is the device's */
		return;
	ibk_unsupported("ibv_create_qp of this QP type"); /* only RC, UC and UD are rebuilt */
}

/* A new QP's virtual QPN is its real one, so peers reach it with no record.
 * When that QPN is taken (a live virtual QPN of this process, or one the
 * agent reserved for a sibling: reserve.c), the device is asked for another
 * while the taken ones are held.  Devices hand QPNs out in turn, so one more
 * try than there are taken QPNs finds a free one; a sibling's block of QPNs
 * after a restore is longer than any fixed count.  Only when every try is
 * taken (or the device refuses more QPs) does the QP get a fresh virtual QPN
 * (ibk_qpn_choose). */
#define QPN_TRIES_MAX 4096

static void qp_avoid_taken_qpn(struct ibk_ctx *ctx, struct ibk_qp *qp)
{
	struct ibv_qp **held = NULL;
	uint32_t first = qp->real->qp_num;
	size_t n = 0, i, tries;
	int taken;

	pthread_mutex_lock(&ctx->lock);
	tries = ctx->qpns.live + 1;
	pthread_mutex_unlock(&ctx->lock);
	tries += ibk_reserve_count();
	if (tries > QPN_TRIES_MAX)
		tries = QPN_TRIES_MAX;
	for (;;) {
		struct ibv_qp *prev = qp->real;
		struct ibv_qp_cap cap = qp->real_cap;

		pthread_mutex_lock(&ctx->lock);
		taken = ibk_reserve_taken(&ctx->qpns, prev->qp_num);
		pthread_mutex_unlock(&ctx->lock);
		if (!taken || n == tries)
			break;
		if (!held && !(held = calloc(tries, sizeof(*held))))
			break;
		if (ibk_qp_create_real(qp)) {
			qp->real = prev;
			qp->real_cap = cap;
			break;
		}
		held[n++] = prev;
	}
	for (i = 0; i < n; i++) {
		uint32_t qpn = held[i]->qp_num;

		ibk_real.destroy_qp(held[i]);
		pthread_mutex_lock(&ctx->lock);
		ibk_idmap_del(&ctx->rqpns, qpn);
		pthread_mutex_unlock(&ctx->lock);
	}
	free(held);
	if (n) /* rare: worth a line */
		ibk_log("QPN %u was taken (a live virtual QPN here or a sibling's): the device gave %u after %zu tries",
			first, qp->real->qp_num, n);
}

static struct ibv_qp *qp_create(struct ibv_pd *p, struct ibv_qp_init_attr *attr,
				const struct ibk_qp_ex_attr *ex)
{
	struct ibk_pd *pd = (struct ibk_pd *)p;
	struct ibk_ctx *ctx = pd->obj.ctx;
	struct ibk_qp *qp;
	uint32_t rcap;

	if (attr->qp_type != IBV_QPT_RC && attr->qp_type != IBV_QPT_UD && attr->qp_type != IBV_QPT_UC) {
		qp_type_refuse(pd, attr, ex);
		return NULL;
	}
	if (attr->cap.max_send_sge > IBK_MAX_SGE || attr->cap.max_recv_sge > IBK_MAX_SGE) {
		ibk_log("ibv_create_qp: more than %d SGEs per WR is not supported", IBK_MAX_SGE);
		errno = EINVAL;
		return NULL;
	}
	qp = calloc(1, sizeof(*qp));
	if (!qp)
		return NULL;
	qp->obj.ctx = ctx;
	qp->pd = pd;
	qp->scq = (struct ibk_cq *)attr->send_cq;
	qp->rcq = (struct ibk_cq *)attr->recv_cq;
	qp->srq = (struct ibk_srq *)attr->srq;
	qp->init = *attr;
	if (ex)
		qp->ex = *ex;
	ibk_lock_init(&qp->lock);
	ibk_lock_init(&qp->rlock);
	if (qp->srq) /* its receives go to the SRQ: the slow path refuses them */
		atomic_store(&qp->rlock.v, IBK_LOCK_SLOW);
	qp->ud = attr->qp_type == IBV_QPT_UD;
	qp->flag_mask = attr->qp_type == IBV_QPT_RC ? ~0u : ~(uint32_t)IBK_SWR_CONSUMER;
	qp->sig_all = attr->sq_sig_all ? IBK_SWR_SIGNALED : 0;
	ibk_qp_set_op_flags(qp);
	if (ibk_idmap_init(&qp->peer.rkeys, 16))
		goto fail;
	qp->slot = qp_slot_take(ctx, qp);
	if (qp->slot >= IBK_MAX_QPS)
		goto fail;
	/* Inside the gate until the QP is on the context's list: a quiesce
	 * then either finds it (and closes its posts) or waits for us. */
	ibk_enter();
	if (ibk_qp_create_real(qp)) {
		ibk_leave();
		goto fail_slot;
	}
	qp_avoid_taken_qpn(ctx, qp);
	/* What the provider granted, minus our slot, is what the app gets;
	 * SGEs beyond what a log entry holds are not offered. */
	if (qp->real_cap.max_send_sge > IBK_MAX_SGE)
		qp->real_cap.max_send_sge = IBK_MAX_SGE;
	if (qp->real_cap.max_recv_sge > IBK_MAX_SGE)
		qp->real_cap.max_recv_sge = IBK_MAX_SGE;
	attr->cap = qp->real_cap;
	attr->cap.max_send_wr -= 1;
	qp->init.cap = attr->cap;
	if (ibk_sendlog_init(&qp->slog, qp->real_cap.max_send_wr, qp->real_cap.max_inline_data,
			     qp->real_cap.max_send_sge, &qp->obj))
		goto fail_real;
	rcap = qp->srq ? 1 : qp->real_cap.max_recv_wr;
	if (ibk_recvlog_init(&qp->rlog, rcap ? rcap : 1, 1, qp->real_cap.max_recv_sge, &qp->obj))
		goto fail_real;
	pthread_mutex_lock(&ctx->lock);
	qp->vqpn = ibk_reserve_choose(&ctx->qpns, qp->real->qp_num);
	ibk_idmap_put(&ctx->qpns, qp->vqpn, qp->real->qp_num);
	pthread_mutex_unlock(&ctx->lock);
	qp->pub.context = p->context;
	qp->pub.qp_context = attr->qp_context;
	qp->pub.pd = p;
	qp->pub.send_cq = attr->send_cq;
	qp->pub.recv_cq = attr->recv_cq;
	qp->pub.srq = attr->srq;
	qp->pub.handle = qp->real->handle;
	qp->pub.qp_num = qp->vqpn;
	qp->pub.state = IBV_QPS_RESET;
	qp->pub.qp_type = attr->qp_type;
	pthread_mutex_init(&qp->pub.mutex, NULL);
	pthread_cond_init(&qp->pub.cond, NULL);
	ibk_obj_add(ctx, &qp->obj, IBK_QP);
	ibk_leave();
	IBK_DBG("QP %u created (real %u)", qp->vqpn, qp->real->qp_num);
	return &qp->pub;
fail_real:
	ibk_real.destroy_qp(qp->real);
	ibk_leave();
fail_slot:
	ctx->qp_slots[qp->slot] = NULL;
fail:
	ibk_idmap_fini(&qp->peer.rkeys);
	ibk_sendlog_fini(&qp->slog);
	free(qp);
	return NULL;
}

IBK_EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr)
{
	return qp_create(pd, attr, NULL);
}

/* What ibv_create_qp_ex may ask for and a rebuild makes again: the device
 * checks the values.  Not carried: XRC domains, RSS (indirection tables,
 * hashing) and a UD QP posing as another QPN (source_qpn). */
#define IBK_QPX_COMP_MASK                                                                            \
	(IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS | IBV_QP_INIT_ATTR_MAX_TSO_HEADER | \
	 IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)

/* Every ibv_wr_* op of verbs.h: the builder posts or refuses each. */
#define IBK_QPX_KNOWN_OPS ((uint64_t)(2 * IBV_QP_EX_WITH_ATOMIC_WRITE - 1))

struct ibv_qp *ibk_create_qp_ex(struct ibv_context *c, struct ibv_qp_init_attr_ex *ax)
{
	struct ibv_qp_init_attr a;
	struct ibk_qp_ex_attr ex;
	struct ibv_qp *qp;

	(void)c;
	if (ax->comp_mask & (IBV_QP_INIT_ATTR_XRCD | IBV_QP_INIT_ATTR_IND_TABLE | IBV_QP_INIT_ATTR_RX_HASH)) {
		ibk_unsupported("ibv_create_qp_ex with an XRC domain or RSS (no XRC or WQs to rebuild)");
		return NULL;
	}
	if (ax->comp_mask & ~(uint32_t)IBK_QPX_COMP_MASK) {
		ibk_unsupported("ibv_create_qp_ex with comp_mask bits the shim does not know");
		return NULL;
	}
	if ((ax->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) && (ax->create_flags & IBV_QP_CREATE_SOURCE_QPN)) {
		ibk_unsupported("ibv_create_qp_ex with IBV_QP_CREATE_SOURCE_QPN (another QP's number)");
		return NULL;
	}
	if ((ax->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) && (ax->send_ops_flags & ~IBK_QPX_KNOWN_OPS)) {
		ibk_unsupported("ibv_create_qp_ex with send ops the shim does not know");
		return NULL;
	}
	if (!(ax->comp_mask & IBV_QP_INIT_ATTR_PD) || !ax->pd) {
		errno = EINVAL; /* no PD and no XRC domain */
		return NULL;
	}
	memset(&ex, 0, sizeof(ex));
	ex.comp_mask = ax->comp_mask & ~(uint32_t)IBV_QP_INIT_ATTR_PD;
	if (ax->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS)
		ex.create_flags = ax->create_flags;
	if (ax->comp_mask & IBV_QP_INIT_ATTR_MAX_TSO_HEADER)
		ex.max_tso_header = ax->max_tso_header;
	if (ax->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
		ex.send_ops_flags = ax->send_ops_flags;
	memset(&a, 0, sizeof(a));
	a.qp_context = ax->qp_context;
	a.send_cq = ax->send_cq;
	a.recv_cq = ax->recv_cq;
	a.srq = ax->srq;
	a.cap = ax->cap;
	a.qp_type = ax->qp_type;
	a.sq_sig_all = ax->sq_sig_all;
	qp = qp_create(ax->pd, &a, &ex);
	if (qp && (ax->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)) {
		int rc = ibk_qpx_init((struct ibk_qp *)qp);

		if (rc) {
			ibv_destroy_qp(qp);
			errno = -rc;
			return NULL;
		}
	}
	if (qp)
		ax->cap = a.cap;
	return qp;
}

/* ---- modify / query / destroy ------------------------------------------------ */

int ibk_qp_modify_real(struct ibk_qp *qp, struct ibv_qp_attr *in, int mask, int replay)
{
	struct ibv_qp_attr a = *in;

	if (mask & IBV_QP_AV) {
		struct ibk_peer_map pm;

		if (qp->peer.rqpn || qp->peer.rlid || replay) {
			/* The peer's real ids as learnt at the last rebuild. */
			a.ah_attr.grh.dgid = qp->peer.rgid;
			a.ah_attr.dlid = qp->peer.rlid;
		} else if (atomic_load(&ibk_translating) && in->ah_attr.is_global &&
			   !ibk_peers_lookup_gid(&in->ah_attr.grh.dgid, &pm.rgid)) {
			a.ah_attr.grh.dgid = pm.rgid;
		}
	}
	if (mask & IBV_QP_DEST_QPN) {
		struct ibk_peer_map pm;

		if (qp->peer.rqpn)
			a.dest_qp_num = qp->peer.rqpn;
		else if (atomic_load(&ibk_translating) && (mask & IBV_QP_AV) && in->ah_attr.is_global &&
			 (!ibk_peers_lookup(&in->ah_attr.grh.dgid, in->dest_qp_num, &pm) ||
			  (!ibk_peers_fetch(&in->ah_attr.grh.dgid, in->dest_qp_num, 0) &&
			   !ibk_peers_lookup(&in->ah_attr.grh.dgid, in->dest_qp_num, &pm)))) {
			a.dest_qp_num = pm.rqpn;
			a.ah_attr.grh.dgid = pm.rgid;
			a.ah_attr.dlid = pm.rlid;
		}
	}
	if (replay) {
		/* Both ends of a rebuilt connection start from PSN 0. */
		if (mask & IBV_QP_RQ_PSN)
			a.rq_psn = qp->psn_base;
		if (mask & IBV_QP_SQ_PSN)
			a.sq_psn = qp->psn_base;
	}
	return ibk_real.modify_qp(qp->real, &a, mask);
}

IBK_EXPORT int ibv_modify_qp(struct ibv_qp *q, struct ibv_qp_attr *attr, int mask)
{
	struct ibk_qp *qp = (struct ibk_qp *)q;
	int rc;

	ibk_enter();
	ibk_lock(&qp->lock);
	if (mask & IBV_QP_AV) {
		qp->peer.valid = 1;
		qp->peer.vgid = attr->ah_attr.grh.dgid;
		qp->peer.vlid = attr->ah_attr.dlid;
		qp->peer.rqpn = 0;
		qp->peer.rlid = 0;
	}
	if (mask & IBV_QP_DEST_QPN)
		qp->peer.vqpn = attr->dest_qp_num;
	rc = ibk_qp_modify_real(qp, attr, mask, 0);
	if (!rc) {
		if ((mask & IBV_QP_STATE) && attr->qp_state == IBV_QPS_RESET)
			qp->nmods = 0;
		else if (qp->nmods < IBK_MAX_MODS) {
			qp->mods[qp->nmods] = *attr;
			qp->mod_masks[qp->nmods++] = mask;
		} else {
			ibk_log("QP %u: more than %d modify_qp calls since RESET; checkpoint replay disabled",
				qp->vqpn, IBK_MAX_MODS);
			qp->mods_overflow = 1;
		}
		if (mask & IBV_QP_STATE) {
			qp->state = attr->qp_state;
			qp->pub.state = attr->qp_state;
		}
	}
	ibk_unlock(&qp->lock);
	ibk_leave();
	return rc;
}

IBK_EXPORT int ibv_query_qp(struct ibv_qp *q, struct ibv_qp_attr *attr, int mask, struct ibv_qp_init_attr *init)
{
	struct ibk_qp *qp = (struct ibk_qp *)q;
	int rc;

	ibk_enter();
	rc = ibk_real.query_qp(qp->real, attr, mask, init);
	if (!rc) {
		if (qp->peer.valid) {
			attr->dest_qp_num = qp->peer.vqpn;
			attr->ah_attr.grh.dgid = qp->peer.vgid;
			attr->ah_attr.dlid = qp->peer.vlid;
		}
		attr->cap = qp->init.cap;
		*init = qp->init;
	}
	ibk_leave();
	return rc;
}

IBK_EXPORT int ibv_destroy_qp(struct ibv_qp *q)
{
	struct ibk_qp *qp = (struct ibk_qp *)q;
	struct ibk_ctx *ctx = qp->obj.ctx;
	int rc = 0;

	ibk_enter();
	if (qp->real) {
		uint32_t rq = qp->real->qp_num;

		rc = ibk_real.destroy_qp(qp->real);
		if (!rc) {
			pthread_mutex_lock(&ctx->lock);
			ibk_idmap_del(&ctx->rqpns, rq);
			pthread_mutex_unlock(&ctx->lock);
		}
	}
	if (rc) {
		ibk_leave();
		return rc;
	}
	pthread_mutex_lock(&ctx->lock);
	ibk_idmap_del(&ctx->qpns, qp->vqpn);
	ctx->qp_slots[qp->slot] = NULL;
	pthread_mutex_unlock(&ctx->lock);
	ibk_obj_del(ctx, &qp->obj);
	ibk_leave();
	ibk_sendlog_fini(&qp->slog);
	ibk_recvlog_fini(&qp->rlog);
	ibk_idmap_fini(&qp->peer.rkeys);
	ibk_qpx_fini(qp);
	free(qp);
	return 0;
}

/* ECE goes to the real QP (librdmacm asks for it at every connect).  A
 * rebuilt QP does not get it again, so a QP whose ECE was set is listed
 * in status for the preflight (rxe has no ECE: it always fails there). */
IBK_EXPORT int ibv_query_ece(struct ibv_qp *q, struct ibv_ece *ece)
{
	struct ibk_qp *qp = (struct ibk_qp *)q;
	int rc;

	if (!ibk_real.query_ece)
		return EOPNOTSUPP;
	ibk_enter();
	rc = qp->real ? ibk_real.query_ece(qp->real, ece) : EOPNOTSUPP;
	ibk_leave();
	return rc;
}

IBK_EXPORT int ibv_set_ece(struct ibv_qp *q, struct ibv_ece *ece)
{
	struct ibk_qp *qp = (struct ibk_qp *)q;
	int rc;

	if (!ibk_real.set_ece)
		return EOPNOTSUPP;
	ibk_enter();
	rc = qp->real ? ibk_real.set_ece(qp->real, ece) : EOPNOTSUPP;
	if (!rc)
		qp->ece_set = 1;
	ibk_leave();
	return rc;
}
