/* Protection domains and memory regions.  MRs keep their address, length,
 * iova and access so rebuild can register them again at the same place;
 * the app keeps the first incarnation's keys as virtual keys. */
#include <errno.h>
#include <stdlib.h>

#include "coord.h"
#include "shim.h"

/* verbs.h wraps these in macros; we define the exported symbols. */
#undef ibv_reg_mr
#undef ibv_reg_mr_iova

IBK_EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *c)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	struct ibk_pd *pd = calloc(1, sizeof(*pd));

	if (!pd)
		return NULL;
	ibk_enter();
	pd->real = ibk_real.alloc_pd(ctx->real);
	if (!pd->real) {
		ibk_leave();
		free(pd);
		return NULL;
	}
	pd->pub.context = c;
	pd->pub.handle = pd->real->handle;
	ibk_obj_add(ctx, &pd->obj, IBK_PD);
	ibk_leave();
	return &pd->pub;
}

IBK_EXPORT int ibv_dealloc_pd(struct ibv_pd *p)
{
	struct ibk_pd *pd = (struct ibk_pd *)p;
	int rc;

	ibk_enter();
	rc = ibk_real.dealloc_pd(pd->real);
	if (rc) {
		ibk_leave();
		return rc;
	}
	ibk_obj_del(pd->obj.ctx, &pd->obj);
	ibk_leave();
	free(pd);
	return 0;
}

/* Register (again) on the real PD and record the virtual->real keys. */
int ibk_mr_register_real(struct ibk_mr *mr)
{
	struct ibk_ctx *ctx = mr->obj.ctx;

	mr->real = ibk_real.reg_mr_iova2(mr->pd->real, mr->pub.addr, mr->pub.length, mr->iova, mr->access);
	if (!mr->real)
		return errno ? -errno : -EIO;
	pthread_mutex_lock(&ctx->lock);
	ibk_idmap_put(&ctx->lkeys, mr->pub.lkey, mr->real->lkey);
	ibk_idmap_put(&ctx->rkeys, mr->pub.rkey, mr->real->rkey);
	pthread_mutex_unlock(&ctx->lock);
	return 0;
}

static struct ibv_mr *mr_create(struct ibv_pd *p, void *addr, size_t len, uint64_t iova, unsigned int access)
{
	struct ibk_pd *pd = (struct ibk_pd *)p;
	struct ibk_ctx *ctx = pd->obj.ctx;
	struct ibk_mr *mr = calloc(1, sizeof(*mr));

	if (!mr)
		return NULL;
	mr->pd = pd;
	mr->iova = iova;
	mr->access = access;
	mr->pub.context = p->context;
	mr->pub.pd = p;
	mr->pub.addr = addr;
	mr->pub.length = len;
	ibk_enter();
	mr->real = ibk_real.reg_mr_iova2(pd->real, addr, len, iova, access);
	if (!mr->real) {
		ibk_leave();
		free(mr);
		return NULL;
	}
	/* Keys issued after a rebuild must not collide with live virtual keys. */
	pthread_mutex_lock(&ctx->lock);
	mr->pub.lkey = ibk_idmap_choose(&ctx->lkeys, mr->real->lkey, 0x80000000u, 0xffffffffu);
	mr->pub.rkey = ibk_idmap_choose(&ctx->rkeys, mr->real->rkey, 0x80000000u, 0xffffffffu);
	ibk_idmap_put(&ctx->lkeys, mr->pub.lkey, mr->real->lkey);
	ibk_idmap_put(&ctx->rkeys, mr->pub.rkey, mr->real->rkey);
	if (mr->pub.lkey != mr->real->lkey || mr->pub.rkey != mr->real->rkey) {
		atomic_store(&ibk_xlate_any, 1);
		ctx->translate = 1;
	}
	pthread_mutex_unlock(&ctx->lock);
	mr->pub.handle = mr->real->handle;
	ibk_obj_add(ctx, &mr->obj, IBK_MR);
	ibk_leave();
	return &mr->pub;
}

IBK_EXPORT struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access)
{
	return mr_create(pd, addr, len, (uintptr_t)addr, (unsigned int)access);
}

IBK_EXPORT struct ibv_mr *ibv_reg_mr_iova(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova, int access)
{
	return mr_create(pd, addr, len, iova, (unsigned int)access);
}

IBK_EXPORT struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova,
					   unsigned int access)
{
	return mr_create(pd, addr, len, iova, access);
}

IBK_EXPORT int ibv_dereg_mr(struct ibv_mr *m)
{
	struct ibk_mr *mr = (struct ibk_mr *)m;
	struct ibk_ctx *ctx = mr->obj.ctx;
	struct ibk_obj *o;
	int rc;

	ibk_enter();
	rc = ibk_real.dereg_mr(mr->real);
	if (rc) {
		ibk_leave();
		return rc;
	}
	pthread_mutex_lock(&ctx->lock);
	ibk_idmap_del(&ctx->lkeys, mr->pub.lkey);
	ibk_idmap_del(&ctx->rkeys, mr->pub.rkey);
	/* a window still bound to it (if the provider let the MR go) is not
	 * bound again at rebuild */
	for (o = ctx->head.next; o != &ctx->head; o = o->next)
		if (o->kind == IBK_MW && IBK_OBJ(o, ibk_mw)->mr == mr)
			IBK_OBJ(o, ibk_mw)->mr = NULL;
	pthread_mutex_unlock(&ctx->lock);
	ibk_obj_del(ctx, &mr->obj);
	ibk_leave();
	free(mr);
	return 0;
}

/* A key the provider changed gets a virtual key of its own (ctx->lock held). */
static void mr_rekey(struct ibk_ctx *ctx, struct ibk_idmap *map, uint32_t *vkey, uint32_t real)
{
	uint32_t old;

	if (!ibk_idmap_get(map, *vkey, &old) && old == real)
		return;
	ibk_idmap_del(map, *vkey);
	*vkey = ibk_idmap_choose(map, real, 0x80000000u, 0xffffffffu);
	ibk_idmap_put(map, *vkey, real);
	if (*vkey != real) {
		atomic_store(&ibk_xlate_any, 1);
		ctx->translate = 1;
	}
}

/* The real MR changes in place; the shadow follows it, and keys the
 * provider changed get virtual keys of their own, as a new MR would. */
IBK_EXPORT int ibv_rereg_mr(struct ibv_mr *m, int flags, struct ibv_pd *p, void *addr, size_t len, int access)
{
	struct ibk_mr *mr = (struct ibk_mr *)m;
	struct ibk_pd *pd = (struct ibk_pd *)p;
	struct ibk_ctx *ctx = mr->obj.ctx;
	int rc;

	if ((flags & IBV_REREG_MR_CHANGE_PD) && (!pd || pd->obj.ctx != ctx)) {
		errno = EINVAL;
		return IBV_REREG_MR_ERR_INPUT;
	}
	ibk_enter();
	rc = ibk_real.rereg_mr(mr->real, flags, (flags & IBV_REREG_MR_CHANGE_PD) ? pd->real : NULL, addr, len,
			       access);
	if (rc) {
		ibk_leave();
		return rc;
	}
	if (flags & IBV_REREG_MR_CHANGE_PD) {
		mr->pd = pd;
		mr->pub.pd = p;
	}
	if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
		mr->pub.addr = addr;
		mr->pub.length = len;
		mr->iova = (uintptr_t)addr;
	}
	if (flags & IBV_REREG_MR_CHANGE_ACCESS)
		mr->access = (unsigned int)access;
	pthread_mutex_lock(&ctx->lock);
	mr_rekey(ctx, &ctx->lkeys, &mr->pub.lkey, mr->real->lkey);
	mr_rekey(ctx, &ctx->rkeys, &mr->pub.rkey, mr->real->rkey);
	pthread_mutex_unlock(&ctx->lock);
	ibk_leave();
	return 0;
}

IBK_REFUSED(IBK_EXPORT struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t off, size_t len,
		uint64_t iova, int fd, int access),
	    "ibv_reg_dmabuf_mr", NULL, (void)pd, (void)off, (void)len, (void)iova, (void)fd, (void)access)

IBK_REFUSED(IBK_EXPORT struct ibv_pd *ibv_import_pd(struct ibv_context *c, uint32_t h),
	    "ibv_import_pd", NULL, (void)c, (void)h)

IBK_REFUSED(IBK_EXPORT struct ibv_mr *ibv_import_mr(struct ibv_pd *pd, uint32_t h),
	    "ibv_import_mr", NULL, (void)pd, (void)h)

IBK_REFUSED(IBK_EXPORT int ibv_attach_mcast(struct ibv_qp *qp, const union ibv_gid *gid, uint16_t lid),
	    "ibv_attach_mcast", EOPNOTSUPP, (void)qp, (void)gid, (void)lid)

IBK_REFUSED(IBK_EXPORT int ibv_detach_mcast(struct ibv_qp *qp, const union ibv_gid *gid, uint16_t lid),
	    "ibv_detach_mcast", EOPNOTSUPP, (void)qp, (void)gid, (void)lid)
