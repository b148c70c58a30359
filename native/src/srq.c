/* Shared receive queues: a receive log that completes out of order. */
#include <errno.h>
#include <stdlib.h>

#include "shim.h"

int ibk_srq_create_real(struct ibk_srq *srq)
{
	struct ibv_srq_init_attr a = srq->attr;

	a.srq_context = srq;
	srq->real = ibk_real.create_srq(srq->pd->real, &a);
	if (srq->real)
		srq->post_recv_fn = srq->real->context->ops.post_srq_recv;
	return srq->real ? 0 : (errno ? -errno : -EIO);
}

IBK_EXPORT struct ibv_srq *ibv_create_srq(struct ibv_pd *p, struct ibv_srq_init_attr *attr)
{
	struct ibk_pd *pd = (struct ibk_pd *)p;
	struct ibk_srq *srq = calloc(1, sizeof(*srq));

	if (!srq)
		return NULL;
	if (attr->attr.max_sge > IBK_MAX_SGE) {
		ibk_log("ibv_create_srq: more than %d SGEs per WR is not supported", IBK_MAX_SGE);
		free(srq);
		errno = EINVAL;
		return NULL;
	}
	srq->obj.ctx = pd->obj.ctx;
	srq->pd = pd;
	srq->attr = *attr;
	ibk_lock_init(&srq->lock);
	ibk_enter();
	if (ibk_srq_create_real(srq)) {
		ibk_leave();
		free(srq);
		return NULL;
	}
	/* the provider may round max_wr up: write it back like the real verb */
	attr->attr = srq->attr.attr;
	if (ibk_recvlog_init(&srq->rlog, srq->attr.attr.max_wr * 2 + 1, 0, srq->attr.attr.max_sge, &srq->obj)) {
		ibk_real.destroy_srq(srq->real);
		ibk_leave();
		free(srq);
		return NULL;
	}
	srq->pub.context = p->context;
	srq->pub.srq_context = attr->srq_context;
	srq->pub.pd = p;
	srq->pub.handle = srq->real->handle;
	pthread_mutex_init(&srq->pub.mutex, NULL);
	pthread_cond_init(&srq->pub.cond, NULL);
	ibk_obj_add(pd->obj.ctx, &srq->obj, IBK_SRQ);
	ibk_leave();
	return &srq->pub;
}

IBK_EXPORT int ibv_modify_srq(struct ibv_srq *s, struct ibv_srq_attr *attr, int mask)
{
	struct ibk_srq *srq = (struct ibk_srq *)s;
	int rc;

	ibk_enter();
	rc = ibk_real.modify_srq(srq->real, attr, mask);
	if (!rc && (mask & IBV_SRQ_LIMIT))
		srq->attr.attr.srq_limit = attr->srq_limit; /* re-armed at rebuild */
	if (!rc && (mask & IBV_SRQ_MAX_WR))
		srq->attr.attr.max_wr = attr->max_wr;
	ibk_leave();
	return rc;
}

IBK_EXPORT int ibv_query_srq(struct ibv_srq *s, struct ibv_srq_attr *attr)
{
	struct ibk_srq *srq = (struct ibk_srq *)s;
	int rc;

	ibk_enter();
	rc = ibk_real.query_srq(srq->real, attr);
	ibk_leave();
	return rc;
}

IBK_EXPORT int ibv_destroy_srq(struct ibv_srq *s)
{
	struct ibk_srq *srq = (struct ibk_srq *)s;
	int rc = 0;

	ibk_enter();
	if (srq->real)
		rc = ibk_real.destroy_srq(srq->real);
	if (rc) {
		ibk_leave();
		return rc;
	}
	ibk_obj_del(srq->obj.ctx, &srq->obj);
	ibk_leave();
	ibk_recvlog_fini(&srq->rlog);
	free(srq);
	return 0;
}
