/* The coordinator client and the peers learnt from it (coord.c). */
#ifndef IBK_COORD_H
#define IBK_COORD_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <infiniband/verbs.h>

#pragma GCC visibility push(hidden)

int ibk_coord_configured(void);
/* Wait up to timeout_ms for key; 0 and the value on success. */
int ibk_coord_get(const char *key, char *val, size_t len, int timeout_ms);
/* PUTs gathered, then sent on one connection: one round trip instead of one
 * per record (a rebuild publishes two per QP and GID). */
struct ibk_coord_batch {
	char *buf;
	size_t len, cap;
	int n; /* requests gathered */
};
int ibk_coord_batch_put(struct ibk_coord_batch *b, const char *key, const char *val);
/* Sends the batch, waits up to timeout_ms for every OK, and frees it. */
int ibk_coord_batch_send(struct ibk_coord_batch *b, int timeout_ms);

/* Peers known by their virtual ids, learnt from the coordinator. */
struct ibk_peer_map {
	union ibv_gid vgid, rgid;
	union ibv_gid prev_rgid; /* its real GID in the record before (ibk_peers_put keeps it) */
	uint32_t vqpn, rqpn;
	uint16_t vlid, rlid;
	uint64_t epoch; /* the rebuild whose record this is */
};
int ibk_peers_lookup(const union ibv_gid *vgid, uint32_t vqpn, struct ibk_peer_map *out);
int ibk_peers_lookup_gid(const union ibv_gid *vgid, union ibv_gid *rgid);
int ibk_peers_reverse_qpn(uint32_t rqpn, uint32_t *vqpn);
/* past: match the real GID a peer had before its latest record instead */
int ibk_peers_reverse_gid(const union ibv_gid *rgid, uint32_t vqpn, int past, union ibv_gid *vgid);
void ibk_peers_put(const struct ibk_peer_map *p);
/* After a rebuild: take every cached peer not yet learnt in this epoch from
 * its new record; a peer that publishes none in time is forgotten. */
void ibk_peers_refresh(uint64_t epoch, int timeout_ms);
/* Fetch one peer's latest mapping from the coordinator (slow path). */
int ibk_peers_fetch(const union ibv_gid *vgid, uint32_t vqpn, int timeout_ms);
extern atomic_int ibk_translating; /* set after the first rebuild anywhere in this process */
/* Set (inside the gate's closed phases or under ctx->lock) before any
 * ctx->translate or peer.rkeys_translate turns on: while it is 0 the post
 * fast paths skip all of them with one load.  Read with the QP's post lock
 * held: a rebuild sets it before the posts reopen, so a post that takes the
 * lock after that sees it. */
extern atomic_int ibk_xlate_any;

#pragma GCC visibility pop

#endif
