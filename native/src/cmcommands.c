/* The commands librdmacm writes to an event channel's fd, as the shim
 * routes them: to the kernel on a live channel, answered by the shim on one
 * a checkpoint detached, GET_EVENT from the shim's queue first, and
 * MIGRATE_ID between two followed channels (the channels: rdmacm.c). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <rdma/rdma_user_cm.h>

#include "cmchan.h"
#include "cmstate.h"
#include "devthread.h"
#include "phases.h"
#include "rdmacm.h"

/* ---- the queue of events for the app (under ch->lock) -------------------- */

int ibk_cm_q_push(struct cm_chan *ch, const struct rdma_ucm_event_resp *ev)
{
	uint64_t one = 1;

	if (ch->qtail - ch->qhead == ch->qcap) {
		uint32_t cap = ch->qcap ? ch->qcap * 2 : 8, i, n = ch->qtail - ch->qhead;
		struct rdma_ucm_event_resp *q = calloc(cap, sizeof(*q));

		if (!q)
			return -ENOMEM;
		for (i = 0; i < n; i++)
			q[i] = ch->q[(ch->qhead + i) % ch->qcap];
		free(ch->q);
		ch->q = q;
		ch->qcap = cap;
		ch->qhead = 0;
		ch->qtail = n;
	}
	ch->q[ch->qtail++ % ch->qcap] = *ev;
	if (!ch->pending_on)
		ch->pending_on = ibk_write_real(ch->pending_fd, &one, sizeof(one)) == sizeof(one);
	return 0;
}

static void q_settle(struct cm_chan *ch)
{
	uint64_t v;

	if (ch->pending_on && ch->qhead == ch->qtail)
		ch->pending_on = !(read(ch->pending_fd, &v, sizeof(v)) == sizeof(v));
}

/* Drop the queued events of a destroyed id (the kernel drops unreported
 * ones too); how many. */
static uint32_t q_drop(struct cm_chan *ch, uint32_t handle)
{
	uint32_t i, kept = ch->qhead, n = 0;

	for (i = ch->qhead; i != ch->qtail; i++) {
		struct rdma_ucm_event_resp *ev = &ch->q[i % ch->qcap];

		if (ev->id == handle && ev->event != EV_CONNECT_REQUEST)
			n++;
		else
			ch->q[kept++ % ch->qcap] = *ev;
	}
	ch->qtail = kept;
	q_settle(ch);
	return n;
}

void ibk_cm_queue_disconnected(struct cm_chan *ch, struct ibk_cm_id *id)
{
	struct rdma_ucm_event_resp ev;

	memset(&ev, 0, sizeof(ev));
	ev.uid = id->uid;
	ev.id = id->handle;
	ev.event = EV_DISCONNECTED;
	if (!ibk_cm_q_push(ch, &ev))
		id->disc_out = 1;
}

/* ---- commands ---------------------------------------------------------------- */

static ssize_t fail(int err)
{
	errno = err;
	return -1;
}

/* A command on a detached channel: the shim plays the kernel's part. */
static ssize_t detached_cmd(struct cm_chan *ch, uint32_t cmd, const void *body, size_t blen, size_t n)
{
	struct ibk_cm_id *id;

	if (cmd == RDMA_USER_CM_CMD_DESTROY_ID) {
		struct rdma_ucm_destroy_id d;
		struct rdma_ucm_destroy_id_resp r;
		long reported;

		if (blen < sizeof(d))
			return fail(EINVAL);
		memcpy(&d, body, sizeof(d));
		q_drop(ch, d.id);
		reported = ibk_cm_forget(&ch->ids, d.id);
		if (reported < 0)
			return fail(EINVAL);
		r.events_reported = (uint32_t)reported;
		memcpy((void *)(uintptr_t)d.response, &r, sizeof(r));
		return (ssize_t)n;
	}
	if (cmd == RDMA_USER_CM_CMD_DISCONNECT) {
		struct rdma_ucm_disconnect d;

		if (blen < sizeof(d))
			return fail(EINVAL);
		memcpy(&d, body, sizeof(d));
		id = ibk_cm_find(&ch->ids, d.id);
		if (!id)
			return fail(EINVAL);
		if (id->state == IBK_CM_CONNECTED && !id->disc_out)
			ibk_cm_queue_disconnected(ch, id);
		ibk_cm_on_cmd(&ch->ids, cmd, body, blen, 0);
		return (ssize_t)n;
	}
	ibk_log("rdma_cm command %u on an event channel detached by a checkpoint: not supported", cmd);
	return fail(EOPNOTSUPP);
}

/* A command on a live channel goes to the kernel; the ids follow. */
static ssize_t live_cmd(struct cm_chan *ch, uint32_t cmd, const void *buf, size_t n)
{
	const char *body = (const char *)buf + sizeof(struct rdma_ucm_cmd_hdr);
	size_t blen = n - sizeof(struct rdma_ucm_cmd_hdr);
	uint32_t handle = 0;
	ssize_t rc;

	rc = ibk_write_real(ch->real_fd, buf, n);
	if (rc != (ssize_t)n)
		return rc;
	if (cmd == RDMA_USER_CM_CMD_CREATE_ID && blen >= sizeof(struct rdma_ucm_create_id)) {
		struct rdma_ucm_create_id c;
		struct rdma_ucm_create_id_resp r;

		memcpy(&c, body, sizeof(c));
		memcpy(&r, (void *)(uintptr_t)c.response, sizeof(r));
		handle = r.id;
	} else if (cmd == RDMA_USER_CM_CMD_DESTROY_ID && blen >= sizeof(struct rdma_ucm_destroy_id)) {
		struct rdma_ucm_destroy_id d;
		struct rdma_ucm_destroy_id_resp r;

		/* events a drain took from the kernel and the app never saw */
		memcpy(&d, body, sizeof(d));
		memcpy(&r, (void *)(uintptr_t)d.response, sizeof(r));
		r.events_reported -= q_drop(ch, d.id);
		memcpy((void *)(uintptr_t)d.response, &r, sizeof(r));
	}
	if (ibk_cm_on_cmd(&ch->ids, cmd, body, blen, handle))
		ibk_log("rdma_cm: no memory to follow a new id");
	return rc;
}

/* The queued events of one id go from one channel's queue to another's. */
static void q_move(struct cm_chan *from, struct cm_chan *to, uint32_t handle)
{
	uint32_t i, kept = from->qhead;

	for (i = from->qhead; i != from->qtail; i++) {
		struct rdma_ucm_event_resp ev = from->q[i % from->qcap];

		if (ev.id != handle)
			from->q[kept++ % from->qcap] = ev;
		else if (ibk_cm_q_push(to, &ev))
			ibk_log("rdma_migrate_id: no memory for an event of the id; it is lost");
	}
	from->qtail = kept;
	q_settle(from);
}

/* MIGRATE_ID (rdma_migrate_id; librdmacm's rdma_get_request moves every id
 * a synchronous listener accepts to a channel of its own) is written to
 * the channel the id goes to and names the one it leaves by its fd, which
 * is the app's epoll fd: the kernel is given that channel's kernel fd, and
 * the id's state and queued events move along as the kernel moves its. */
static ssize_t migrate(struct cm_chan *to, const void *buf, size_t n)
{
	struct {
		struct rdma_ucm_cmd_hdr hdr;
		struct rdma_ucm_migrate_id m;
	} c;
	struct cm_chan *from, *first, *second;
	struct ibk_cm_id *id, moved;
	ssize_t rc;
	int known;

	if (n != sizeof(c))
		return fail(EINVAL);
	memcpy(&c, buf, sizeof(c));
	from = c.m.fd < IBK_CM_MAXFD ? ibk_cm_chan_of_fd((int)c.m.fd) : NULL;
	known = from != NULL;
	if (!known) /* a channel the shim does not follow: its fd is the kernel's */
		from = to;
	first = (uintptr_t)from < (uintptr_t)to ? from : to;
	second = first == from ? to : from;
	pthread_mutex_lock(&first->lock);
	if (second != first)
		pthread_mutex_lock(&second->lock);
	if (to->real_fd < 0 || from->real_fd < 0) {
		ibk_log("rdma_migrate_id on an event channel detached by a checkpoint: not supported");
		rc = fail(EOPNOTSUPP);
	} else {
		if (known)
			c.m.fd = (uint32_t)from->real_fd;
		rc = ibk_write_real(to->real_fd, &c, sizeof(c));
		if (rc == (ssize_t)sizeof(c) && from != to && (id = ibk_cm_find(&from->ids, c.m.id))) {
			moved = *id;
			ibk_cm_forget(&from->ids, c.m.id);
			if (ibk_cm_adopt(&to->ids, &moved))
				ibk_log("rdma_cm: no memory to follow a migrated id");
			q_move(from, to, c.m.id);
		}
	}
	if (second != first)
		pthread_mutex_unlock(&second->lock);
	pthread_mutex_unlock(&first->lock);
	return rc;
}

/* Read one event from the kernel without blocking, into ev: 1, 0 when it
 * has none (or the channel is detached), -1 on another error (errno). */
int ibk_cm_read_kernel_event(struct cm_chan *ch, struct rdma_ucm_event_resp *ev)
{
	ssize_t rc;

	struct {
		struct rdma_ucm_cmd_hdr hdr;
		struct rdma_ucm_get_event get;
	} c;

	if (ch->real_fd < 0)
		return 0;
	memset(ev, 0, sizeof(*ev));
	c.hdr = (struct rdma_ucm_cmd_hdr){ .cmd = RDMA_USER_CM_CMD_GET_EVENT,
					   .in = sizeof(c.get),
					   .out = sizeof(*ev) };
	c.get.response = (uintptr_t)ev;
	rc = ibk_write_real(ch->real_fd, &c, sizeof(c));
	if (rc == (ssize_t)sizeof(c))
		return 1;
	if (rc >= 0)
		errno = ENODATA;
	return errno == EAGAIN ? 0 : -1;
}

/* GET_EVENT: queued events first, then the kernel's; a blocking wait
 * happens in poll(), outside the gate. */
static ssize_t get_event(struct cm_chan *ch, const void *buf, size_t n, uint16_t out)
{
	struct rdma_ucm_get_event g;
	struct rdma_ucm_event_resp ev;
	size_t len = out < sizeof(ev) ? out : sizeof(ev);

	if (n < sizeof(struct rdma_ucm_cmd_hdr) + sizeof(g) || len < offsetof(struct rdma_ucm_event_resp, param))
		return fail(EINVAL);
	memcpy(&g, (const char *)buf + sizeof(struct rdma_ucm_cmd_hdr), sizeof(g));
	for (;;) {
		struct pollfd p[2];
		int got = 0, err = 0;

		ibk_enter();
		pthread_mutex_lock(&ch->lock);
		if (ch->qhead != ch->qtail) {
			ev = ch->q[ch->qhead++ % ch->qcap];
			q_settle(ch);
			got = 1;
		} else {
			got = ibk_cm_read_kernel_event(ch, &ev);
			err = errno;
		}
		if (got > 0) {
			memcpy((void *)(uintptr_t)g.response, &ev, len);
			ibk_cm_on_event(&ch->ids, &ev, len);
		}
		pthread_mutex_unlock(&ch->lock);
		ibk_leave();
		if (got > 0)
			return (ssize_t)n;
		if (got < 0) /* the kernel refused: the app hears it, no spinning */
			return fail(err);
		if (fcntl(ch->app_fd, F_GETFL) & O_NONBLOCK)
			return fail(EAGAIN);
		p[0] = (struct pollfd){ .fd = ch->app_fd, .events = POLLIN };
		p[1] = (struct pollfd){ .fd = ch->wake_fd, .events = POLLIN };
		if (poll(p, 2, -1) < 0 && errno != EINTR)
			return -1;
		if (p[1].revents & POLLIN)
			usleep(1000); /* a checkpoint closes the gate: park there */
	}
}

int ibk_cm_write(int fd, const void *buf, size_t n, ssize_t *rc)
{
	struct rdma_ucm_cmd_hdr hdr;
	struct cm_chan *ch;

	if (fd < 0 || fd >= IBK_CM_MAXFD || !atomic_load_explicit(&ibk_cm_fd_on[fd], memory_order_relaxed) ||
	    !(ch = ibk_cm_chan_of_fd(fd)))
		return 0;
	if (n < sizeof(hdr)) {
		*rc = fail(EINVAL);
		return 1;
	}
	memcpy(&hdr, buf, sizeof(hdr));
	if (hdr.cmd == RDMA_USER_CM_CMD_GET_EVENT) {
		*rc = get_event(ch, buf, n, hdr.out);
		return 1;
	}
	ibk_enter(); /* no command reaches the kernel during a checkpoint */
	if (hdr.cmd == RDMA_USER_CM_CMD_MIGRATE_ID) {
		*rc = migrate(ch, buf, n);
		ibk_leave();
		return 1;
	}
	pthread_mutex_lock(&ch->lock);
	if (ch->real_fd >= 0)
		*rc = live_cmd(ch, hdr.cmd, buf, n);
	else
		*rc = detached_cmd(ch, hdr.cmd, (const char *)buf + sizeof(hdr), n - sizeof(hdr), n);
	pthread_mutex_unlock(&ch->lock);
	ibk_leave();
	return 1;
}
