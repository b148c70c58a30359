/* Completion channels.  The app's channel fd is an epoll fd the shim owns,
 * holding the real channel's fd and a "pending" eventfd.  It is the same open
 * file for the life of the channel, so an app (UCX, for one) that put it in
 * its own epoll set keeps being woken after a release and rebuild, which
 * only swap the real fd inside it.  It is readable while the real channel
 * has an event or the shim holds queued ones (drained for a checkpoint).
 * Events are read by the shim, so that a thread blocked in ibv_get_cq_event
 * can be parked for a checkpoint. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "rdmacm.h"
#include "shim.h"

int ibk_chan_push_event(struct ibk_chan *ch, struct ibk_cq *cq)
{
	pthread_mutex_lock(&ch->lock);
	if (ch->ev_tail - ch->ev_head >= ch->ev_cap) {
		uint32_t ncap = ch->ev_cap ? ch->ev_cap * 2 : 64, i, n = ch->ev_tail - ch->ev_head;
		struct ibk_cq **ne = calloc(ncap, sizeof(*ne));

		if (!ne) {
			pthread_mutex_unlock(&ch->lock);
			return -ENOMEM;
		}
		for (i = 0; i < n; i++)
			ne[i] = ch->events[(ch->ev_head + i) % ch->ev_cap];
		free(ch->events);
		ch->events = ne;
		ch->ev_cap = ncap;
		ch->ev_head = 0;
		ch->ev_tail = n;
	}
	ch->events[ch->ev_tail++ % ch->ev_cap] = cq;
	if (!ch->pending_on) {
		uint64_t one = 1;

		ch->pending_on = write(ch->pending_fd, &one, sizeof(one)) == sizeof(one);
	}
	pthread_mutex_unlock(&ch->lock);
	return 0;
}

static struct ibk_cq *chan_pop_event(struct ibk_chan *ch)
{
	struct ibk_cq *cq = NULL;

	pthread_mutex_lock(&ch->lock);
	if (ch->ev_head != ch->ev_tail)
		cq = ch->events[ch->ev_head++ % ch->ev_cap];
	if (ch->pending_on && ch->ev_head == ch->ev_tail) {
		uint64_t v;

		ch->pending_on = !(read(ch->pending_fd, &v, sizeof(v)) == sizeof(v));
	}
	pthread_mutex_unlock(&ch->lock);
	return cq;
}

/* Read one real event without blocking (the real fd is always O_NONBLOCK);
 * its shadow CQ, or NULL.  rd_lock: two readers never race for one event. */
static struct ibk_cq *chan_read_real(struct ibk_chan *ch)
{
	struct ibv_cq *rcq;
	void *cqctx;
	struct ibk_cq *cq;
	int got;

	if (!ch->real)
		return NULL;
	pthread_mutex_lock(&ch->rd_lock);
	got = !ibk_real.get_cq_event(ch->real, &rcq, &cqctx);
	pthread_mutex_unlock(&ch->rd_lock);
	if (!got)
		return NULL;
	cq = cqctx; /* the real CQ's context is its shadow */
	ibk_real.ack_cq_events(rcq, 1);
	cq->armed = 0;
	return cq;
}

/* For drain: move every real event into the channel's queue. */
int ibk_chan_drain_real(struct ibk_chan *ch)
{
	struct ibk_cq *cq;
	int n = 0;

	while ((cq = chan_read_real(ch))) {
		ibk_chan_push_event(ch, cq);
		n++;
	}
	return n;
}

int ibk_chan_create_real(struct ibk_chan *ch)
{
	struct ibk_ctx *ctx = ch->obj.ctx;
	struct epoll_event ev = { .events = EPOLLIN };
	int fl;

	ch->real = ibk_real.create_comp_channel(ctx->real);
	if (!ch->real)
		return errno ? -errno : -EIO;
	/* The shim never blocks on the real fd: it polls it first, and a
	 * blocking wait happens on the app's fd (see ibv_get_cq_event). */
	fl = fcntl(ch->real->fd, F_GETFL);
	if (fl >= 0)
		fcntl(ch->real->fd, F_SETFL, fl | O_NONBLOCK);
	ev.data.fd = ch->real->fd;
	if (epoll_ctl(ch->pub.fd, EPOLL_CTL_ADD, ch->real->fd, &ev)) {
		int err = errno;

		ibk_real.destroy_comp_channel(ch->real);
		ch->real = NULL;
		return -err;
	}
	return 0;
}

/* Take the real fd out of the app's epoll fd and destroy the real channel;
 * the app's fd stays open and the same file (CRIU dumps it as an epoll fd
 * watching the pending eventfd only). */
int ibk_chan_release_real(struct ibk_chan *ch)
{
	int rc;

	if (!ch->real)
		return 0;
	epoll_ctl(ch->pub.fd, EPOLL_CTL_DEL, ch->real->fd, NULL);
	rc = ibk_real.destroy_comp_channel(ch->real);
	ch->real = NULL;
	return rc;
}

IBK_EXPORT struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *c)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	struct ibk_chan *ch = calloc(1, sizeof(*ch));
	struct epoll_event ev = { .events = EPOLLIN };

	if (!ch)
		return NULL;
	ch->obj.ctx = ctx;
	pthread_mutex_init(&ch->lock, NULL);
	pthread_mutex_init(&ch->rd_lock, NULL);
	ch->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	ch->pending_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	/* Like a real channel fd, the app's fd is blocking and not close-on-exec. */
	ch->pub.fd = epoll_create1(EPOLL_CLOEXEC); /* as the kernel's channel fd is */
	ev.data.fd = ch->pending_fd;
	if (ch->wake_fd < 0 || ch->pending_fd < 0 || ch->pub.fd < 0 ||
	    epoll_ctl(ch->pub.fd, EPOLL_CTL_ADD, ch->pending_fd, &ev))
		goto fail;
	ibk_enter();
	if (ibk_chan_create_real(ch)) {
		ibk_leave();
		goto fail;
	}
	ch->pub.context = c;
	ibk_obj_add(ctx, &ch->obj, IBK_CHAN);
	ibk_leave();
	return &ch->pub;
fail:
	if (ch->wake_fd >= 0)
		close(ch->wake_fd);
	if (ch->pending_fd >= 0)
		close(ch->pending_fd);
	if (ch->pub.fd >= 0)
		close(ch->pub.fd);
	free(ch);
	return NULL;
}

IBK_EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel *c)
{
	struct ibk_chan *ch = (struct ibk_chan *)c;
	int rc = 0;

	ibk_enter();
	rc = ibk_chan_release_real(ch);
	if (rc) {
		ibk_leave();
		return rc;
	}
	ibk_obj_del(ch->obj.ctx, &ch->obj);
	ibk_leave();
	close(ch->pub.fd);
	close(ch->pending_fd);
	close(ch->wake_fd);
	free(ch->events);
	free(ch);
	return 0;
}

IBK_EXPORT int ibv_get_cq_event(struct ibv_comp_channel *c, struct ibv_cq **cq_out, void **ctx_out)
{
	struct ibk_chan *ch = (struct ibk_chan *)c;

	for (;;) {
		struct pollfd p[2];
		struct ibk_cq *cq;
		int n;

		ibk_enter();
		cq = chan_pop_event(ch); /* queued by a drain come first */
		if (!cq)
			cq = chan_read_real(ch);
		if (cq) {
			cq->events_got++;
			*cq_out = &cq->pub.cq;
			*ctx_out = cq->pub.cq.cq_context;
			ibk_leave();
			return 0;
		}
		/* Like libibverbs' read() of the channel fd: a non-blocking
		 * fd gives EAGAIN instead of waiting. */
		if (fcntl(ch->pub.fd, F_GETFL) & O_NONBLOCK) {
			ibk_leave();
			errno = EAGAIN;
			return -1;
		}
		p[0].fd = ch->pub.fd;
		p[0].events = POLLIN;
		p[1].fd = ch->wake_fd;
		p[1].events = POLLIN;
		/* Blocked here the thread is outside the gate; the wake eventfd
		 * turns readable when a checkpoint closes it, and the next
		 * ibk_enter parks the thread until resume. */
		ibk_leave();
		n = poll(p, 2, -1);
		if (n < 0 && errno != EINTR)
			return -1;
		if (p[1].revents & POLLIN)
			usleep(1000); /* gate closing or just reopened: let it settle */
	}
}

IBK_EXPORT void ibv_ack_cq_events(struct ibv_cq *c, unsigned int n)
{
	/* Real events were acknowledged when the shim read them; only the
	 * app-visible count remains. */
	pthread_mutex_lock(&c->mutex);
	c->comp_events_completed += n;
	pthread_mutex_unlock(&c->mutex);
}

void ibk_chan_wake_all(int on)
{
	struct ibk_ctx *ctx;

	pthread_mutex_lock(&ibk_ctx_lock);
	for (ctx = ibk_ctx_list; ctx; ctx = ctx->next_ctx) {
		struct ibk_obj *o;

		for (o = ctx->head.next; o != &ctx->head; o = o->next) {
			struct ibk_chan *ch;
			uint64_t v = 1;

			if (o->kind != IBK_CHAN)
				continue;
			ch = IBK_OBJ(o, ibk_chan);
			if (on) {
				if (write(ch->wake_fd, &v, sizeof(v)) < 0)
					ibk_log("wake channel: %s", strerror(errno));
			} else if (read(ch->wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN) {
				ibk_log("unwake channel: %s", strerror(errno));
			}
		}
	}
	pthread_mutex_unlock(&ibk_ctx_lock);
	ibk_cm_wake_all(on); /* and threads waiting for an rdma_cm event */
}
