/* Async events.  The app's async fd is an epoll fd the shim owns, holding
 * the real context's async fd while a device is open and an eventfd that is
 * readable while a drain holds events.  It is the same open file across a
 * release and rebuild (which only swap the real fd inside it), so an app
 * that polls it, or put it in its own epoll set, keeps being woken.  Events
 * are read from the real context, acknowledged there at once, and handed to
 * the app about its own (shadow) objects. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "shim.h"

int ibk_async_open(struct ibk_ctx *ctx)
{
	struct epoll_event ev = { .events = EPOLLIN };

	pthread_mutex_init(&ctx->async_lock, NULL);
	ctx->async_pending = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	/* like libibverbs' async fd: blocking and close-on-exec */
	ctx->async_fd = epoll_create1(EPOLL_CLOEXEC);
	ev.data.fd = ctx->async_pending;
	if (ctx->async_pending < 0 || ctx->async_fd < 0 ||
	    epoll_ctl(ctx->async_fd, EPOLL_CTL_ADD, ctx->async_pending, &ev))
		return -1;
	return ibk_async_attach(ctx);
}

void ibk_async_close(struct ibk_ctx *ctx)
{
	if (ctx->async_fd >= 0)
		close(ctx->async_fd);
	if (ctx->async_pending >= 0)
		close(ctx->async_pending);
}

/* The real context's async fd joins the app's epoll fd; the shim never
 * blocks on it (a blocking wait is on the app's fd, outside the gate). */
int ibk_async_attach(struct ibk_ctx *ctx)
{
	struct epoll_event ev = { .events = EPOLLIN };
	int fd = ctx->real->async_fd, fl = fcntl(fd, F_GETFL);

	if (fl >= 0)
		fcntl(fd, F_SETFL, fl | O_NONBLOCK);
	ev.data.fd = fd;
	return epoll_ctl(ctx->async_fd, EPOLL_CTL_ADD, fd, &ev) ? -errno : 0;
}

/* Which of rdma-core's element union an event names. */
enum async_about { ABOUT_NONE, ABOUT_CQ, ABOUT_QP, ABOUT_SRQ, ABOUT_WQ };

static enum async_about async_about(enum ibv_event_type type)
{
	switch (type) {
	case IBV_EVENT_CQ_ERR:
		return ABOUT_CQ;
	case IBV_EVENT_QP_FATAL:
	case IBV_EVENT_QP_REQ_ERR:
	case IBV_EVENT_QP_ACCESS_ERR:
	case IBV_EVENT_COMM_EST:
	case IBV_EVENT_SQ_DRAINED:
	case IBV_EVENT_PATH_MIG:
	case IBV_EVENT_PATH_MIG_ERR:
	case IBV_EVENT_QP_LAST_WQE_REACHED:
		return ABOUT_QP;
	case IBV_EVENT_SRQ_ERR:
	case IBV_EVENT_SRQ_LIMIT_REACHED:
		return ABOUT_SRQ;
	case IBV_EVENT_WQ_FATAL:
		return ABOUT_WQ;
	default:
		return ABOUT_NONE; /* port and device events */
	}
}

/* The app's objects an event names: the real ones' contexts are the shadows
 * (NULL for the shim's own QPs and CQs).  0: not about the app's objects. */
static int async_translate(const struct ibv_async_event *real, struct ibv_async_event *out)
{
	*out = *real;
	switch (async_about(real->event_type)) {
	case ABOUT_CQ: {
		struct ibk_cq *cq = real->element.cq->cq_context;

		out->element.cq = cq ? &cq->pub.cq : NULL;
		return cq != NULL;
	}
	case ABOUT_QP: {
		struct ibk_qp *qp = real->element.qp->qp_context;

		out->element.qp = qp ? &qp->pub : NULL;
		return qp != NULL;
	}
	case ABOUT_SRQ: {
		struct ibk_srq *srq = real->element.srq->srq_context;

		out->element.srq = srq ? &srq->pub : NULL;
		return srq != NULL;
	}
	case ABOUT_WQ:
		return 0; /* the shim makes no WQs */
	default:
		return 1; /* port and device events name no object */
	}
}

/* One event about the app's objects from the real context, without
 * blocking; events about the shim's own objects are dropped.  1: got one. */
static int async_read_real(struct ibk_ctx *ctx, struct ibv_async_event *out)
{
	struct ibv_async_event rev;

	for (;;) {
		int got, keep;

		if (!ctx->real)
			return 0;
		pthread_mutex_lock(&ctx->async_lock);
		got = !ibk_real.get_async_event(ctx->real, &rev);
		pthread_mutex_unlock(&ctx->async_lock);
		if (!got)
			return 0;
		keep = async_translate(&rev, out);
		ibk_real.ack_async_event(&rev);
		if (keep)
			return 1;
	}
}

static int async_pop(struct ibk_ctx *ctx, struct ibv_async_event *out)
{
	int got = 0;

	pthread_mutex_lock(&ctx->async_lock);
	if (ctx->async_n) {
		*out = ctx->async_q[ctx->async_head];
		ctx->async_head = (uint8_t)((ctx->async_head + 1) % IBK_ASYNC_QUEUE);
		got = 1;
		if (!--ctx->async_n) {
			uint64_t v;

			if (read(ctx->async_pending, &v, sizeof(v)) < 0)
				ibk_log("async queue: %s", strerror(errno));
		}
	}
	pthread_mutex_unlock(&ctx->async_lock);
	return got;
}

/* For drain (gate closed): the events the device raised before the
 * checkpoint are kept for the app, in order. */
void ibk_async_drain(struct ibk_ctx *ctx)
{
	struct ibv_async_event ev;
	uint64_t one = 1;

	while (async_read_real(ctx, &ev)) {
		pthread_mutex_lock(&ctx->async_lock);
		if (ctx->async_n == IBK_ASYNC_QUEUE) {
			pthread_mutex_unlock(&ctx->async_lock);
			ibk_log("async event %d dropped: %d already held for the app", ev.event_type,
				IBK_ASYNC_QUEUE);
			continue;
		}
		ctx->async_q[(ctx->async_head + ctx->async_n) % IBK_ASYNC_QUEUE] = ev;
		if (!ctx->async_n++ && write(ctx->async_pending, &one, sizeof(one)) < 0)
			ibk_log("async queue: %s", strerror(errno));
		pthread_mutex_unlock(&ctx->async_lock);
	}
}

/* Before the real context closes: what it raised since the drain came from
 * the release itself (QPs moved to error) and is not the app's. */
void ibk_async_detach(struct ibk_ctx *ctx)
{
	struct ibv_async_event rev;

	while (!ibk_real.get_async_event(ctx->real, &rev))
		ibk_real.ack_async_event(&rev);
	epoll_ctl(ctx->async_fd, EPOLL_CTL_DEL, ctx->real->async_fd, NULL);
}

IBK_EXPORT int ibv_get_async_event(struct ibv_context *c, struct ibv_async_event *ev)
{
	struct ibk_ctx *ctx;

	if (!ibk_is_shadow(c))
		return ibk_real.get_async_event(c, ev);
	ctx = ibk_ctx_of(c);
	for (;;) {
		struct pollfd p = { .fd = ctx->async_fd, .events = POLLIN };

		ibk_enter();
		if (async_pop(ctx, ev) || async_read_real(ctx, ev)) {
			ibk_leave();
			return 0;
		}
		ibk_leave();
		/* as libibverbs' read() of its async fd */
		if (fcntl(ctx->async_fd, F_GETFL) & O_NONBLOCK) {
			errno = EAGAIN;
			return -1;
		}
		/* outside the gate: a checkpoint goes on while this thread waits */
		if (poll(&p, 1, -1) < 0 && errno != EINTR)
			return -1;
	}
}

/* The object an event names, if any (NULL for port and device events). */
static struct ibv_context *async_object_context(const struct ibv_async_event *ev)
{
	switch (async_about(ev->event_type)) {
	case ABOUT_CQ:
		return ev->element.cq->context;
	case ABOUT_QP:
		return ev->element.qp->context;
	case ABOUT_SRQ:
		return ev->element.srq->context;
	case ABOUT_WQ:
		return ev->element.wq->context;
	default:
		return NULL;
	}
}

IBK_EXPORT void ibv_ack_async_event(struct ibv_async_event *ev)
{
	struct ibv_context *c = async_object_context(ev);

	/* The shim acknowledged the real event when it read it; an event read
	 * from a real context by someone else is acknowledged there. */
	if (c && !ibk_is_shadow(c))
		ibk_real.ack_async_event(ev);
}
