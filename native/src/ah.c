/* Address handles: the app's attributes are virtual; the real AH is made
 * from the peer's current real GID/LID. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "shim.h"

int ibk_ah_create_real(struct ibk_ah *ah)
{
	struct ibv_ah_attr a = ah->attr;

	if (atomic_load(&ibk_translating) && a.is_global) {
		union ibv_gid rg;

		if (!ibk_peers_lookup_gid(&a.grh.dgid, &rg))
			a.grh.dgid = rg;
	}
	ah->real = ibk_real.create_ah(ah->pd->real, &a);
	return ah->real ? 0 : (errno ? -errno : -EIO);
}

IBK_EXPORT struct ibv_ah *ibv_create_ah(struct ibv_pd *p, struct ibv_ah_attr *attr)
{
	struct ibk_pd *pd = (struct ibk_pd *)p;
	struct ibk_ah *ah = calloc(1, sizeof(*ah));

	if (!ah)
		return NULL;
	ah->obj.ctx = pd->obj.ctx;
	ah->pd = pd;
	ah->attr = *attr;
	ibk_enter();
	if (ibk_ah_create_real(ah)) {
		ibk_leave();
		free(ah);
		return NULL;
	}
	ah->pub.context = p->context;
	ah->pub.pd = p;
	ah->pub.handle = ah->real->handle;
	ibk_obj_add(pd->obj.ctx, &ah->obj, IBK_AH);
	ibk_leave();
	return &ah->pub;
}

IBK_EXPORT int ibv_destroy_ah(struct ibv_ah *a)
{
	struct ibk_ah *ah = (struct ibk_ah *)a;
	int rc = 0;

	ibk_enter();
	if (ah->real)
		rc = ibk_real.destroy_ah(ah->real);
	if (rc) {
		ibk_leave();
		return rc;
	}
	ibk_obj_del(ah->obj.ctx, &ah->obj);
	ibk_leave();
	free(ah);
	return 0;
}

/* The sender's GID as the app knows it.  After a rebuild the GRH holds
 * real GIDs: a peer's map back through the records learnt from the
 * coordinator (the one with the sender's QPN first), our own by index; a
 * sender never rebuilt keeps its GID (its real one is its virtual one). */
static void ah_gid_to_virtual(struct ibk_ctx *ctx, uint32_t src_qp, union ibv_gid *gid)
{
	union ibv_gid v;
	int i;

	if (src_qp && !ibk_peers_reverse_gid(gid, src_qp, &v)) {
		*gid = v;
		return;
	}
	for (i = 0; i < 4; i++)
		if ((ctx->port_gid_valid & (1u << i)) && !memcmp(&ctx->rgid[i], gid, sizeof(*gid))) {
			*gid = ctx->vgid[i];
			return;
		}
	if (!ibk_peers_reverse_gid(gid, 0, &v))
		*gid = v;
}

/* libibverbs' own code reads the real GRH against the real GID table,
 * where it matches; only the result is turned into virtual ids. */
IBK_EXPORT int ibv_init_ah_from_wc(struct ibv_context *c, uint8_t port, struct ibv_wc *wc, struct ibv_grh *grh,
				   struct ibv_ah_attr *attr)
{
	struct ibk_ctx *ctx;
	int rc;

	if (!ibk_is_shadow(c))
		return ibk_real.init_ah_from_wc(c, port, wc, grh, attr);
	ctx = ibk_ctx_of(c);
	ibk_enter();
	rc = ibk_real.init_ah_from_wc(ctx->real, port, wc, grh, attr);
	if (!rc && attr->is_global && atomic_load(&ibk_translating))
		ah_gid_to_virtual(ctx, wc->src_qp, &attr->grh.dgid);
	ibk_leave();
	return rc;
}

IBK_EXPORT struct ibv_ah *ibv_create_ah_from_wc(struct ibv_pd *pd, struct ibv_wc *wc, struct ibv_grh *grh,
						uint8_t port)
{
	struct ibv_ah_attr attr;

	if (!ibk_is_shadow(pd->context))
		return ibk_real.create_ah_from_wc(pd, wc, grh, port);
	if (ibv_init_ah_from_wc(pd->context, port, wc, grh, &attr))
		return NULL;
	return ibv_create_ah(pd, &attr);
}

/* Neighbour resolution for a destination the app names by its virtual GID:
 * done on the real context with the peer's current real GID. */
IBK_EXPORT int ibv_resolve_eth_l2_from_gid(struct ibv_context *c, struct ibv_ah_attr *attr, uint8_t mac[6],
					   uint16_t *vid)
{
	struct ibv_ah_attr a;
	union ibv_gid rg;
	int rc;

	if (!ibk_is_shadow(c))
		return ibk_real.resolve_eth_l2_from_gid(c, attr, mac, vid);
	a = *attr;
	if (atomic_load(&ibk_translating) && a.is_global && !ibk_peers_lookup_gid(&a.grh.dgid, &rg))
		a.grh.dgid = rg;
	ibk_enter();
	rc = ibk_real.resolve_eth_l2_from_gid(ibk_ctx_of(c)->real, &a, mac, vid);
	ibk_leave();
	return rc;
}
