/* The shadow contexts and the list of every object each holds (objs.c). */
#ifndef IBK_OBJS_H
#define IBK_OBJS_H

#include <pthread.h>
#include <stddef.h>

#include <infiniband/verbs.h>

#include "core.h"

#pragma GCC visibility push(hidden)

enum ibk_kind { IBK_PD = 1, IBK_MR, IBK_CHAN, IBK_CQ, IBK_SRQ, IBK_QP, IBK_AH, IBK_MW };

/* Every shadow object sits on its context's list in creation order: rebuild
 * walks it forwards (PD before MR, CQ before QP), release backwards.  An
 * object joins and leaves the list inside the gate, with its real object, so
 * a phase never finds one without the other. */
struct ibk_obj {
	struct ibk_obj *next, *prev;
	enum ibk_kind kind;
	struct ibk_ctx *ctx;
};

#define IBK_PAST_GIDS 8
#define IBK_ASYNC_QUEUE 16

struct ibk_ctx {
	struct verbs_context vctx; /* the app holds &vctx.context */
	struct ibv_context *real;
	struct ibv_device *dev; /* held in devs; the same struct: the same device */
	char dev_name[IBV_SYSFS_NAME_MAX];
	/* The list dev is in, and its index there: the order of the devices the
	 * process was given.  A rebuild reopens the context by name, else by
	 * index (devmap.c), and both then name the device it is on now. */
	struct ibk_devlist *devs;
	int dev_index;  /* -1: dev was not listed */
	int plan_index; /* rebuild: the device chosen for it in the new list */
	pthread_mutex_t lock; /* object list and id tables */
	struct ibk_obj head;  /* circular list sentinel */
	struct ibk_idmap lkeys; /* virtual lkey -> real lkey */
	struct ibk_idmap rkeys; /* virtual rkey -> real rkey, published to peers */
	struct ibk_idmap qpns;  /* virtual qpn -> real qpn, own QPs */
	struct ibk_idmap rqpns; /* real qpn -> index into qp_slots, for SRQ completions */
	struct ibk_qp **qp_slots;
	int translate;         /* 0 while every virtual id equals its real id */
	int async_fd;          /* the app's: an epoll fd over the real one (async.c) */
	int async_pending;     /* eventfd in it: readable while async_q holds events */
	pthread_mutex_t async_lock; /* one reader of the real async fd; async_q */
	struct ibv_async_event async_q[IBK_ASYNC_QUEUE]; /* kept by a drain */
	uint8_t async_head, async_n;
	uint8_t port_gid_valid;
	union ibv_gid vgid[4];  /* virtual GID per index (port 1), fixed at open */
	union ibv_gid rgid[4];  /* current real GID per index */
	/* Real GIDs of earlier incarnations and their index, newest first: a
	 * datagram received before a rebuild names them in its GRH. */
	struct {
		union ibv_gid gid;
		uint8_t index;
	} past[IBK_PAST_GIDS];
	uint8_t npast;
	uint16_t vlid, rlid;
	struct ibk_ctx *next_ctx;
};

#define IBK_OBJ(p, type) ((struct type *)((char *)(p) - offsetof(struct type, obj)))

static inline struct ibk_ctx *ibk_ctx_of(struct ibv_context *c)
{
	return (struct ibk_ctx *)((char *)c - offsetof(struct ibk_ctx, vctx.context));
}

void ibk_obj_add(struct ibk_ctx *ctx, struct ibk_obj *o, enum ibk_kind kind);
void ibk_obj_del(struct ibk_ctx *ctx, struct ibk_obj *o);

/* the global list of shadow contexts this process opened, and those a
 * parent process opened before it forked this one (fork.c) */
extern pthread_mutex_t ibk_ctx_lock;
extern struct ibk_ctx *ibk_ctx_list;
extern struct ibk_ctx *ibk_ctx_inherited;

#pragma GCC visibility pop

#endif
