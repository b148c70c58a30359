/* The shadow contexts and their object lists, in creation order. */
#include <pthread.h>

#include "fork.h"
#include "objs.h"

pthread_mutex_t ibk_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
struct ibk_ctx *ibk_ctx_list;
struct ibk_ctx *ibk_ctx_inherited;

void ibk_ctxs_fork_lock(void)
{
	struct ibk_ctx *c;

	for (c = ibk_ctx_list; c; c = c->next_ctx)
		pthread_mutex_lock(&c->lock);
	for (c = ibk_ctx_inherited; c; c = c->next_ctx)
		pthread_mutex_lock(&c->lock);
}

void ibk_ctxs_fork_unlock(void)
{
	struct ibk_ctx *c;

	for (c = ibk_ctx_list; c; c = c->next_ctx)
		pthread_mutex_unlock(&c->lock);
	for (c = ibk_ctx_inherited; c; c = c->next_ctx)
		pthread_mutex_unlock(&c->lock);
}

/* The parent's contexts stay usable as the device allows, but the child's
 * phases walk only the contexts the child opens. */
void ibk_ctxs_fork_child(void)
{
	struct ibk_ctx **tail = &ibk_ctx_inherited;

	while (*tail)
		tail = &(*tail)->next_ctx;
	*tail = ibk_ctx_list;
	ibk_ctx_list = NULL;
}

void ibk_obj_add(struct ibk_ctx *ctx, struct ibk_obj *o, enum ibk_kind kind)
{
	o->kind = kind;
	o->ctx = ctx;
	pthread_mutex_lock(&ctx->lock);
	o->prev = ctx->head.prev;
	o->next = &ctx->head;
	ctx->head.prev->next = o;
	ctx->head.prev = o;
	pthread_mutex_unlock(&ctx->lock);
}

void ibk_obj_del(struct ibk_ctx *ctx, struct ibk_obj *o)
{
	pthread_mutex_lock(&ctx->lock);
	o->prev->next = o->next;
	o->next->prev = o->prev;
	pthread_mutex_unlock(&ctx->lock);
}
