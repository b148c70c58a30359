/* Completion channels.  The app's channel fd number stays the same for the
 * life of the channel (the real fd is dup2'ed onto it at every rebuild);
 * events are read by the shim and queued per shadow channel, so that a
 * thread blocked in ibv_get_cq_event can be parked for a checkpoint. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

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
	pthread_mutex_unlock(&ch->lock);
	return 0;
}

static struct ibk_cq *chan_pop_event(struct ibk_chan *ch)
{
	struct ibk_cq *cq = NULL;

	pthread_mutex_lock(&ch->lock);
	if (ch->ev_head != ch->ev_tail)
		cq = ch->events[ch->ev_head++ % ch->ev_cap];
	pthread_mutex_unlock(&ch->lock);
	return cq;
}

/* Read one real event without blocking and queue it; 1 if one was read.
 * The real fd keeps the blocking mode the app chose (UCX, for one, sets
 * O_NONBLOCK and expects EAGAIN), so readiness is checked with poll()
 * first, under rd_lock so that two readers never race for one event. */
static int chan_read_real(struct ibk_chan *ch)
{
	struct ibv_cq *rcq;
	void *cqctx;
	struct ibk_cq *cq;
	struct pollfd p;
	int got;

	if (!ch->real)
		return 0;
	pthread_mutex_lock(&ch->rd_lock);
	p.fd = ch->real->fd;
	p.events = POLLIN;
	p.revents = 0;
	got = poll(&p, 1, 0) == 1 && (p.revents & POLLIN) &&
	      !ibk_real.get_cq_event(ch->real, &rcq, &cqctx);
	pthread_mutex_unlock(&ch->rd_lock);
	if (!got)
		return 0;
	cq = cqctx; /* the real CQ's context is its shadow */
	ibk_real.ack_cq_events(rcq, 1);
	cq->armed = 0;
	ibk_chan_push_event(ch, cq);
	return 1;
}

int ibk_chan_drain_real(struct ibk_chan *ch)
{
	int n = 0;

	while (chan_read_real(ch))
		n++;
	return n;
}

int ibk_chan_create_real(struct ibk_chan *ch, int stable_fd)
{
	struct ibk_ctx *ctx = ch->obj.ctx;
	int fl;

	ch->real = ibk_real.create_comp_channel(ctx->real);
	if (!ch->real)
		return errno ? -errno : -EIO;
	if (stable_fd >= 0 && ch->real->fd != stable_fd) {
		/* Put the new channel under the number the app already knows. */
		if (dup2(ch->real->fd, stable_fd) < 0)
			return -errno;
		close(ch->real->fd);
		ch->real->fd = stable_fd;
	}
	/* A new real file after a rebuild: give it the app's blocking mode. */
	fl = fcntl(ch->real->fd, F_GETFL);
	if (fl >= 0 && ch->app_nonblock && !(fl & O_NONBLOCK))
		fcntl(ch->real->fd, F_SETFL, fl | O_NONBLOCK);
	return 0;
}

/* Destroy the real channel but keep its fd number occupied by a harmless
 * placeholder (an eventfd, which CRIU can dump). */
int ibk_chan_release_real(struct ibk_chan *ch)
{
	int keep, ph, rc;

	if (!ch->real)
		return 0;
	ch->app_nonblock = (fcntl(ch->pub.fd, F_GETFL) & O_NONBLOCK) != 0;
	keep = dup(ch->real->fd);
	ph = eventfd(0, EFD_CLOEXEC);
	if (keep < 0 || ph < 0)
		return -errno;
	if (dup2(ph, ch->pub.fd) < 0)
		return -errno;
	close(ph);
	ch->real->fd = keep; /* so the real destroy closes the real file */
	rc = ibk_real.destroy_comp_channel(ch->real);
	ch->real = NULL;
	return rc;
}

IBK_EXPORT struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *c)
{
	struct ibk_ctx *ctx = ibk_ctx_of(c);
	struct ibk_chan *ch = calloc(1, sizeof(*ch));

	if (!ch)
		return NULL;
	ch->obj.ctx = ctx;
	pthread_mutex_init(&ch->lock, NULL);
	pthread_mutex_init(&ch->rd_lock, NULL);
	ch->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	ibk_enter();
	if (ibk_chan_create_real(ch, -1)) {
		ibk_leave();
		close(ch->wake_fd);
		free(ch);
		return NULL;
	}
	ibk_leave();
	ch->pub.context = c;
	ch->pub.fd = ch->real->fd;
	ibk_obj_add(ctx, &ch->obj, IBK_CHAN);
	return &ch->pub;
}

IBK_EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel *c)
{
	struct ibk_chan *ch = (struct ibk_chan *)c;
	int rc = 0;

	ibk_enter();
	if (ch->real)
		rc = ibk_real.destroy_comp_channel(ch->real);
	else
		close(ch->pub.fd);
	ibk_leave();
	if (rc)
		return rc;
	ibk_obj_del(ch->obj.ctx, &ch->obj);
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
		cq = chan_pop_event(ch);
		if (!cq && chan_read_real(ch))
			cq = chan_pop_event(ch);
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
}
