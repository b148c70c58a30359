/* Address handles: the app's attributes are virtual; the real AH is made
 * from the peer's current real GID/LID. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
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
 * sender never rebuilt keeps its GID (its real one is its virtual one).
 * A datagram received before the last rebuild names the real GIDs of then:
 * those map back through the peers' records before their latest, and
 * through our own earlier GIDs by index. */
static void ah_gid_to_virtual(struct ibk_ctx *ctx, uint32_t src_qp, union ibv_gid *gid)
{
	union ibv_gid v;
	int i, past;

	for (past = 0; past < 2; past++) {
		if (src_qp && !ibk_peers_reverse_gid(gid, src_qp, past, &v)) {
			*gid = v;
			return;
		}
		for (i = 0; i < (past ? ctx->npast : 4); i++) {
			int index = past ? ctx->past[i].index : i;

			if ((ctx->port_gid_valid & (1u << index)) &&
			    !memcmp(past ? &ctx->past[i].gid : &ctx->rgid[i], gid, sizeof(*gid))) {
				*gid = ctx->vgid[index];
				return;
			}
		}
		if (!ibk_peers_reverse_gid(gid, 0, past, &v)) {
			*gid = v;
			return;
		}
	}
}

static int gid_v4mapped(const union ibv_gid *g)
{
	static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};

	return !memcmp(g->raw, prefix, sizeof(prefix));
}

/* An IPv4 header's checksum, its own field taken as 0 (RFC 1071: summed in
 * memory order, it is right in memory order). */
static uint16_t ip4_csum(const uint8_t *h)
{
	uint32_t sum = 0;
	uint16_t w;
	int i;

	for (i = 0; i < 20; i += 2) {
		if (i == 10)
			continue;
		memcpy(&w, h + i, sizeof(w));
		sum += w;
	}
	while (sum >> 16)
		sum = (sum & 0xffff) + (sum >> 16);
	return (uint16_t)~sum;
}

/* A datagram received before a rebuild (a completion the drain kept, or one
 * the app polled before the checkpoint) is addressed to our real GID of
 * then, which the device may no longer hold, so libibverbs finds no GID
 * index for it.  *out is a copy of the GRH addressed to the real GID now at
 * the same index; 0 if the GRH names none of our earlier GIDs.  The GRH is
 * either IBA/IPv6 (dgid at bytes 24-39) or RoCEv2 over IPv4 (an IPv4
 * header at bytes 20-39, the destination at 36-39). */
static int grh_to_current(const struct ibk_ctx *ctx, const struct ibv_grh *grh, struct ibv_grh *out)
{
	uint8_t *ip4 = (uint8_t *)out + 20;
	int j;

	*out = *grh;
	for (j = 0; j < ctx->npast; j++) {
		const union ibv_gid *then = &ctx->past[j].gid, *now = &ctx->rgid[ctx->past[j].index];

		if (!(ctx->port_gid_valid & (1u << ctx->past[j].index)) || !memcmp(then, now, sizeof(*now)))
			continue;
		if (!memcmp(&out->dgid, then, sizeof(*then))) {
			out->dgid = *now;
			return 1;
		}
		if ((ip4[0] >> 4) == 4 && gid_v4mapped(then) && gid_v4mapped(now) && !memcmp(ip4 + 16, &then->raw[12], 4)) {
			uint16_t check;
			int check_ok;

			memcpy(&check, ip4 + 10, sizeof(check));
			check_ok = check == ip4_csum(ip4);
			memcpy(ip4 + 16, &now->raw[12], 4);
			if (check_ok) {
				check = ip4_csum(ip4);
				memcpy(ip4 + 10, &check, sizeof(check));
			}
			return 1;
		}
	}
	return 0;
}

/* libibverbs' own code reads the real GRH against the real GID table,
 * where it matches; only the result is turned into virtual ids. */
IBK_EXPORT int ibv_init_ah_from_wc(struct ibv_context *c, uint8_t port, struct ibv_wc *wc, struct ibv_grh *grh,
				   struct ibv_ah_attr *attr)
{
	struct ibk_ctx *ctx;
	struct ibv_grh now;
	int rc;

	if (!ibk_is_shadow(c))
		return ibk_real.init_ah_from_wc(c, port, wc, grh, attr);
	ctx = ibk_ctx_of(c);
	ibk_enter();
	rc = ibk_real.init_ah_from_wc(ctx->real, port, wc, grh, attr);
	if (rc && port == 1 && grh && (wc->wc_flags & IBV_WC_GRH) && atomic_load(&ibk_translating) &&
	    grh_to_current(ctx, grh, &now))
		rc = ibk_real.init_ah_from_wc(ctx->real, port, wc, &now, attr);
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
