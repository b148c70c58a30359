/* Shadow device contexts: open/close, device and port queries, and the ops
 * table the inline verbs in verbs.h call through. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "devmap.h"
#include "devthread.h"
#include "shim.h"

/* verbs.h wraps these in macros; we define the exported symbols. */
#undef ibv_query_port

/* ---- loud stubs for everything reachable through ops we do not support --- */

IBK_REFUSED(static int stub_advise_mr(struct ibv_pd *pd, enum ibv_advise_mr_advice a, uint32_t f,
		struct ibv_sge *s, uint32_t n),
	    "ibv_advise_mr", EOPNOTSUPP, (void)pd, (void)a, (void)f, (void)s, (void)n)

IBK_REFUSED(static struct ibv_mr *stub_alloc_null_mr(struct ibv_pd *pd),
	    "ibv_alloc_null_mr", NULL, (void)pd)

IBK_REFUSED(static struct ibv_counters *stub_create_counters(struct ibv_context *c,
		struct ibv_counters_init_attr *a),
	    "ibv_create_counters", NULL, (void)c, (void)a)

IBK_REFUSED(static struct ibv_dm *stub_alloc_dm(struct ibv_context *c, struct ibv_alloc_dm_attr *a),
	    "ibv_alloc_dm", NULL, (void)c, (void)a)

IBK_REFUSED(static struct ibv_pd *stub_alloc_parent_domain(struct ibv_context *c,
		struct ibv_parent_domain_init_attr *a),
	    "ibv_alloc_parent_domain", NULL, (void)c, (void)a)

IBK_REFUSED(static struct ibv_td *stub_alloc_td(struct ibv_context *c, struct ibv_td_init_attr *a),
	    "ibv_alloc_td", NULL, (void)c, (void)a)

IBK_REFUSED(static int stub_modify_cq(struct ibv_cq *cq, struct ibv_modify_cq_attr *a),
	    "ibv_modify_cq", EOPNOTSUPP, (void)cq, (void)a)

IBK_REFUSED(static struct ibv_wq *stub_create_wq(struct ibv_context *c, struct ibv_wq_init_attr *a),
	    "ibv_create_wq", NULL, (void)c, (void)a)

IBK_REFUSED(static struct ibv_rwq_ind_table *stub_create_rwq_ind_table(struct ibv_context *c,
		struct ibv_rwq_ind_table_init_attr *a),
	    "ibv_create_rwq_ind_table", NULL, (void)c, (void)a)

IBK_REFUSED(static int stub_query_rt_values(struct ibv_context *c, struct ibv_values_ex *v),
	    "ibv_query_rt_values_ex", EOPNOTSUPP, (void)c, (void)v)

IBK_REFUSED(static struct ibv_flow *stub_create_flow(struct ibv_qp *qp, struct ibv_flow_attr *a),
	    "ibv_create_flow", NULL, (void)qp, (void)a)

IBK_REFUSED(static struct ibv_qp *stub_open_qp(struct ibv_context *c, struct ibv_qp_open_attr *a),
	    "ibv_open_qp", NULL, (void)c, (void)a)

IBK_REFUSED(static int stub_get_srq_num(struct ibv_srq *s, uint32_t *n),
	    "ibv_get_srq_num", EOPNOTSUPP, (void)s, (void)n)

IBK_REFUSED(static struct ibv_srq *stub_create_srq_ex(struct ibv_context *c, struct ibv_srq_init_attr_ex *a),
	    "ibv_create_srq_ex", NULL, (void)c, (void)a)

IBK_REFUSED(static struct ibv_xrcd *stub_open_xrcd(struct ibv_context *c, struct ibv_xrcd_init_attr *a),
	    "ibv_open_xrcd", NULL, (void)c, (void)a)

IBK_REFUSED(static int stub_modify_qp_rate_limit(struct ibv_qp *qp, struct ibv_qp_rate_limit_attr *a),
	    "ibv_modify_qp_rate_limit", EOPNOTSUPP, (void)qp, (void)a)

IBK_REFUSED(static int stub_post_srq_ops(struct ibv_srq *s, struct ibv_ops_wr *op, struct ibv_ops_wr **bad),
	    "ibv_post_srq_ops", EOPNOTSUPP, (void)s, (void)op, (void)bad)

IBK_REFUSED(static struct ibv_flow_action *stub_create_flow_action_esp(struct ibv_context *c,
		struct ibv_flow_action_esp_attr *a),
	    "ibv_create_flow_action_esp", NULL, (void)c, (void)a)

IBK_REFUSED(static int stub_modify_flow_action_esp(struct ibv_flow_action *fa,
		struct ibv_flow_action_esp_attr *a),
	    "ibv_modify_flow_action_esp", EOPNOTSUPP, (void)fa, (void)a)

/* ---- port and device queries ------------------------------------------------ */

static int ctx_query_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *attr, size_t len)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	struct verbs_context *rv;
	int rc;

	ibk_enter();
	rv = verbs_get_ctx_op(ctx->real, query_port);
	memset(attr, 0, len);
	if (rv)
		rc = rv->query_port(ctx->real, port, attr, len);
	else
		rc = ibk_real.query_port(ctx->real, port, (struct _compat_ibv_port_attr *)attr);
	if (!rc && port == 1)
		attr->lid = ctx->vlid; /* the app and its peers only see the virtual LID */
	ibk_leave();
	return rc;
}

static int ctx_query_device_ex(struct ibv_context *c, const struct ibv_query_device_ex_input *in,
			       struct ibv_device_attr_ex *attr, size_t size)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	struct verbs_context *rv;
	int rc;

	ibk_enter();
	rv = verbs_get_ctx_op(ctx->real, query_device_ex);
	if (rv) {
		rc = rv->query_device_ex(ctx->real, in, attr, size);
	} else {
		memset(attr, 0, size);
		rc = ibk_real.query_device(ctx->real, &attr->orig_attr);
	}
	if (!rc && attr->orig_attr.max_qp_wr > 1)
		attr->orig_attr.max_qp_wr--; /* one slot per QP is the shim's flag WR */
	ibk_leave();
	return rc;
}

IBK_EXPORT int ibv_query_device(struct ibv_context *c, struct ibv_device_attr *attr)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	int rc;

	if (!ibk_is_shadow(c))
		return ibk_real.query_device(c, attr);
	ibk_enter();
	rc = ibk_real.query_device(ctx->real, attr);
	if (!rc && attr->max_qp_wr > 1)
		attr->max_qp_wr--;
	ibk_leave();
	return rc;
}

IBK_EXPORT int ibv_query_port(struct ibv_context *c, uint8_t port, struct _compat_ibv_port_attr *attr)
{
	if (!ibk_is_shadow(c))
		return ibk_real.query_port(c, port, attr);
	return ctx_query_port(c, port, (struct ibv_port_attr *)attr, sizeof(struct ibv_port_attr));
}

IBK_EXPORT int ibv_query_gid(struct ibv_context *c, uint8_t port, int index, union ibv_gid *gid)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	int rc = 0;

	if (!ibk_is_shadow(c))
		return ibk_real.query_gid(c, port, index, gid);
	ibk_enter();
	if (port == 1 && index >= 0 && index < 4 && (ctx->port_gid_valid & (1u << index)))
		*gid = ctx->vgid[index];
	else
		rc = ibk_real.query_gid(ctx->real, port, index, gid);
	ibk_leave();
	return rc;
}

IBK_EXPORT int ibv_query_pkey(struct ibv_context *c, uint8_t port, int index, __be16 *pkey)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	int rc;

	if (!ibk_is_shadow(c))
		return ibk_real.query_pkey(c, port, index, pkey);
	ibk_enter();
	rc = ibk_real.query_pkey(ctx->real, port, index, pkey);
	ibk_leave();
	return rc;
}

IBK_EXPORT int ibv_get_pkey_index(struct ibv_context *c, uint8_t port, __be16 pkey)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	int rc;

	if (!ibk_is_shadow(c))
		return ibk_real.get_pkey_index(c, port, pkey);
	ibk_enter();
	rc = ibk_real.get_pkey_index(ctx->real, port, pkey);
	ibk_leave();
	return rc;
}

IBK_EXPORT int _ibv_query_gid_ex(struct ibv_context *c, uint32_t port, uint32_t index,
				 struct ibv_gid_entry *entry, uint32_t flags, size_t size)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	int rc;

	if (!ibk_is_shadow(c))
		return ibk_real.query_gid_ex(c, port, index, entry, flags, size);
	ibk_enter();
	rc = ibk_real.query_gid_ex(ctx->real, port, index, entry, flags, size);
	if (!rc && port == 1 && index < 4 && (ctx->port_gid_valid & (1u << index)))
		entry->gid = ctx->vgid[index];
	ibk_leave();
	return rc;
}

IBK_EXPORT ssize_t _ibv_query_gid_table(struct ibv_context *c, struct ibv_gid_entry *entries, size_t max,
					uint32_t flags, size_t size)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	ssize_t n, i;

	if (!ibk_is_shadow(c))
		return ibk_real.query_gid_table(c, entries, max, flags, size);
	ibk_enter();
	n = ibk_real.query_gid_table(ctx->real, entries, max, flags, size);
	for (i = 0; i < n; i++)
		if (entries[i].port_num == 1 && entries[i].gid_index < 4 &&
		    (ctx->port_gid_valid & (1u << entries[i].gid_index)))
			entries[i].gid = ctx->vgid[entries[i].gid_index];
	ibk_leave();
	return n;
}

/* A private libibverbs symbol, but pyverbs and libibverbs' own
 * ibv_init_ah_from_wc call it: a GID's type does not change with its id. */
IBK_EXPORT int ibv_query_gid_type(struct ibv_context *c, uint8_t port, unsigned int index,
				  int *type)
{
	int rc;

	if (!ibk_is_shadow(c))
		return ibk_real.query_gid_type(c, port, index, type);
	ibk_enter();
	rc = ibk_real.query_gid_type(ibk_ctx_of(c)->real, port, index, type);
	ibk_leave();
	return rc;
}

/* ---- open / close ------------------------------------------------------------ */

void ibk_install_ops(struct ibk_ctx *ctx)
{
	struct verbs_context *v = &ctx->vctx;
	struct ibv_context_ops *o = &v->context.ops;

	o->alloc_mw = ibk_alloc_mw;
	o->bind_mw = ibk_bind_mw;
	o->dealloc_mw = ibk_dealloc_mw;
	o->poll_cq = ibk_poll_cq;
	o->req_notify_cq = ibk_req_notify_cq;
	o->post_srq_recv = ibk_post_srq_recv;
	o->post_send = ibk_post_send;
	o->post_recv = ibk_post_recv;

	v->query_port = ctx_query_port;
	v->advise_mr = stub_advise_mr;
	v->alloc_null_mr = stub_alloc_null_mr;
	v->create_counters = stub_create_counters;
	v->alloc_dm = stub_alloc_dm;
	v->alloc_parent_domain = stub_alloc_parent_domain;
	v->alloc_td = stub_alloc_td;
	v->modify_cq = stub_modify_cq;
	v->post_srq_ops = stub_post_srq_ops;
	v->create_rwq_ind_table = stub_create_rwq_ind_table;
	v->create_wq = stub_create_wq;
	v->query_rt_values = stub_query_rt_values;
	v->create_cq_ex = ibk_create_cq_ex;
	v->query_device_ex = ctx_query_device_ex;
	v->ibv_create_flow = stub_create_flow;
	v->open_qp = stub_open_qp;
	v->create_qp_ex = ibk_create_qp_ex;
	v->get_srq_num = stub_get_srq_num;
	v->create_srq_ex = stub_create_srq_ex;
	v->open_xrcd = stub_open_xrcd;
	v->modify_qp_rate_limit = stub_modify_qp_rate_limit;
	v->create_flow_action_esp = stub_create_flow_action_esp;
	v->modify_flow_action_esp = stub_modify_flow_action_esp;
	v->sz = sizeof(*v);
	v->context.abi_compat = __VERBS_ABI_IS_EXTENDED;
}

/* Before a rebuild reads the port again: its current real GIDs go to the
 * front of ctx->past (a GID already there at that index moves to the front). */
void ibk_ctx_remember_gids(struct ibk_ctx *ctx)
{
	int i, j, n;

	for (i = 3; i >= 0; i--) {
		if (!(ctx->port_gid_valid & (1u << i)))
			continue;
		n = ctx->npast;
		for (j = 0; j < n; j++)
			if (ctx->past[j].index == i && !memcmp(&ctx->past[j].gid, &ctx->rgid[i], sizeof(ctx->rgid[i])))
				break;
		if (j == n && n < IBK_PAST_GIDS)
			ctx->npast = (uint8_t)++n;
		if (j == n)
			j = n - 1; /* full: the oldest goes */
		memmove(&ctx->past[1], &ctx->past[0], (size_t)j * sizeof(ctx->past[0]));
		ctx->past[0].gid = ctx->rgid[i];
		ctx->past[0].index = (uint8_t)i;
	}
}

/* Read the port's current LID and first GIDs into the real-id slots. */
int ibk_ctx_read_port(struct ibk_ctx *ctx)
{
	struct ibv_port_attr full;
	struct verbs_context *rv = verbs_get_ctx_op(ctx->real, query_port);
	int i, rc;

	memset(&full, 0, sizeof(full));
	if (rv)
		rc = rv->query_port(ctx->real, 1, &full, sizeof(full));
	else
		rc = ibk_real.query_port(ctx->real, 1, (struct _compat_ibv_port_attr *)&full);
	if (rc)
		return rc;
	ctx->rlid = full.lid;
	for (i = 0; i < 4; i++) {
		if (ibk_real.query_gid(ctx->real, 1, i, &ctx->rgid[i]) == 0 && i < full.gid_tbl_len)
			ctx->port_gid_valid |= (uint8_t)(1u << i);
	}
	return 0;
}

IBK_EXPORT struct ibv_context *ibv_open_device(struct ibv_device *dev)
{
	struct ibk_ctx *ctx;

	ibk_real_resolve();
	ibk_control_ensure();
	ctx = calloc(1, sizeof(*ctx));
	if (!ctx)
		return NULL;
	ctx->async_fd = ctx->async_pending = -1; /* for the failure path */
	ctx->real = ibk_real.open_device(dev);
	if (!ctx->real) {
		free(ctx);
		return NULL;
	}
	ctx->dev = dev;
	snprintf(ctx->dev_name, sizeof(ctx->dev_name), "%s", ibk_real.get_device_name(dev));
	ibk_ctx_place(ctx, dev); /* its name now and index, for a rebuild (devmap.c) */
	pthread_mutex_init(&ctx->lock, NULL);
	ctx->head.next = ctx->head.prev = &ctx->head;
	if (ibk_idmap_init(&ctx->lkeys, 64) || ibk_idmap_init(&ctx->qpns, 16) ||
	    ibk_idmap_init(&ctx->rqpns, 16))
		goto fail;
	if (ibk_ctx_read_port(ctx))
		goto fail;
	/* The first incarnation's ids are the virtual ones, for good. */
	memcpy(ctx->vgid, ctx->rgid, sizeof(ctx->vgid));
	ctx->vlid = ctx->rlid;
	if (ibk_async_open(ctx))
		goto fail;
	ibk_install_ops(ctx);
	ctx->vctx.context.device = dev;
	ctx->vctx.context.cmd_fd = ctx->async_fd;
	ctx->vctx.context.async_fd = ctx->async_fd;
	ctx->vctx.context.num_comp_vectors = ctx->real->num_comp_vectors;
	pthread_mutex_init(&ctx->vctx.context.mutex, NULL);
	pthread_mutex_lock(&ibk_ctx_lock);
	ctx->next_ctx = ibk_ctx_list;
	ibk_ctx_list = ctx;
	pthread_mutex_unlock(&ibk_ctx_lock);
	IBK_DBG("opened %s as shadow context %p", ctx->dev_name, (void *)&ctx->vctx.context);
	return &ctx->vctx.context;
fail:
	ibk_async_close(ctx);
	ibk_real.close_device(ctx->real);
	ibk_devlist_put(ctx->devs);
	ibk_idmap_fini(&ctx->lkeys);
	ibk_idmap_fini(&ctx->qpns);
	ibk_idmap_fini(&ctx->rqpns);
	free(ctx);
	errno = ENOMEM;
	return NULL;
}

IBK_EXPORT int ibv_close_device(struct ibv_context *c)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c), **pp;
	int rc = 0;

	ibk_enter();
	pthread_mutex_lock(&ibk_ctx_lock);
	for (pp = &ibk_ctx_list; *pp && *pp != ctx; pp = &(*pp)->next_ctx)
		;
	if (!*pp) /* a parent's, closed in a fork child */
		for (pp = &ibk_ctx_inherited; *pp && *pp != ctx; pp = &(*pp)->next_ctx)
			;
	if (*pp)
		*pp = ctx->next_ctx;
	ibk_devlist_put(ctx->devs); /* its refs are counted under this lock */
	pthread_mutex_unlock(&ibk_ctx_lock);
	if (ctx->real) {
		ibk_devfd_forget(ctx->real->cmd_fd);
		rc = ibk_real.close_device(ctx->real);
	}
	ibk_async_close(ctx);
	ibk_idmap_fini(&ctx->lkeys);
	ibk_idmap_fini(&ctx->qpns);
	ibk_idmap_fini(&ctx->rqpns);
	free(ctx);
	ibk_leave();
	return rc;
}
