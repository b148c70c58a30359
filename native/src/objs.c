/* The shadow contexts and their object lists, in creation order. */
#include <pthread.h>

#include "objs.h"

pthread_mutex_t ibk_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
struct ibk_ctx *ibk_ctx_list;

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
