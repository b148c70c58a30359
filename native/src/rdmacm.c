/* librdmacm's event channels, carried through a checkpoint.
 *
 * librdmacm talks to the kernel's connection manager by write()s of
 * commands (rdma/rdma_user_cm.h) on an event channel's fd, an open
 * /dev/infiniband/rdma_cm that CRIU cannot dump.  The shim owns that file:
 * rdma_create_event_channel hands the app (and librdmacm) an epoll fd that
 * holds the kernel fd and a "pending" eventfd, as for completion channels,
 * and the shim's write() routes every command written to the app's fd to
 * the kernel fd, following the ids' states (cmstate.c) on the way.
 *
 * GET_EVENT never blocks in the kernel: the kernel fd is non-blocking and a
 * waiting thread sleeps in poll() outside the gate, so a checkpoint can park
 * it.  drain moves the events the kernel holds into the shim's queue; release
 * closes the kernel fd ("detaches" the channel: the kernel forgets its ids).
 * On a detached channel the shim answers the commands itself: GET_EVENT
 * hands out queued events, DISCONNECT queues the DISCONNECTED the kernel
 * would have sent, DESTROY_ID answers with the events handed out; anything
 * else fails with EOPNOTSUPP.  The QPs of the ids are the shim's shadow QPs
 * and are rebuilt with every other QP. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <rdma/rdma_user_cm.h>

#include "cmstate.h"
#include "devthread.h"
#include "fork.h"
#include "phases.h"
#include "rdmacm.h"

#define IBK_CM_MAXFD 4096

/* librdmacm's public channel (rdma/rdma_cma.h, whose enums clash with the
 * kernel ABI header's) */
struct rdma_event_channel {
	int fd;
};

struct cm_chan {
	struct rdma_event_channel *pub;
	int app_fd;     /* epoll fd: pub->fd */
	int real_fd;    /* the kernel's rdma_cm file; -1 once detached */
	int pending_fd; /* in app_fd: readable while events are queued */
	int wake_fd;    /* readable while a checkpoint closes the gate */
	int pending_on;
	pthread_mutex_t lock; /* ids, queue, and the one reader of real_fd */
	int inherited;        /* a parent process's, made before it forked this one */
	struct ibk_cm_ids ids;
	struct rdma_ucm_event_resp *q;
	uint32_t qhead, qtail, qcap;
	struct cm_chan *next;
};

atomic_int ibk_cm_active; /* a channel was ever tracked: write() looks here */
static _Atomic unsigned char cm_fd_on[IBK_CM_MAXFD];
static pthread_mutex_t chans_lock = PTHREAD_MUTEX_INITIALIZER;
static struct cm_chan *chans;

static struct cm_chan *chan_of_fd(int fd)
{
	struct cm_chan *ch;

	pthread_mutex_lock(&chans_lock);
	for (ch = chans; ch && ch->app_fd != fd; ch = ch->next)
		;
	pthread_mutex_unlock(&chans_lock);
	return ch;
}

/* ---- the queue of events for the app (under ch->lock) -------------------- */

static int q_push(struct cm_chan *ch, const struct rdma_ucm_event_resp *ev)
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

static void queue_disconnected(struct cm_chan *ch, struct ibk_cm_id *id)
{
	struct rdma_ucm_event_resp ev;

	memset(&ev, 0, sizeof(ev));
	ev.uid = id->uid;
	ev.id = id->handle;
	ev.event = EV_DISCONNECTED;
	if (!q_push(ch, &ev))
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
			queue_disconnected(ch, id);
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
		else if (q_push(to, &ev))
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
	from = c.m.fd < IBK_CM_MAXFD ? chan_of_fd((int)c.m.fd) : NULL;
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
static int read_kernel_event(struct cm_chan *ch, struct rdma_ucm_event_resp *ev)
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
			got = read_kernel_event(ch, &ev);
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

	if (fd < 0 || fd >= IBK_CM_MAXFD || !atomic_load_explicit(&cm_fd_on[fd], memory_order_relaxed) ||
	    !(ch = chan_of_fd(fd)))
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

/* ---- the channels ------------------------------------------------------------- */

typedef struct rdma_event_channel *(*create_fn)(void);
typedef void (*destroy_fn)(struct rdma_event_channel *);

/* Close the kernel's fd (the channel is detached). */
static void close_real(struct cm_chan *ch)
{
	ibk_devfd_forget(ch->real_fd);
	close(ch->real_fd);
	ch->real_fd = -1;
}

static void chan_free(struct cm_chan *ch)
{
	if (ch->real_fd >= 0)
		close_real(ch);
	if (ch->pending_fd >= 0)
		close(ch->pending_fd);
	if (ch->wake_fd >= 0)
		close(ch->wake_fd);
	ibk_cm_ids_fini(&ch->ids);
	free(ch->q);
	pthread_mutex_destroy(&ch->lock);
	free(ch);
}

/* The app's fd becomes an epoll fd of the shim holding the kernel's. */
static int chan_track(struct cm_chan *ch, struct rdma_event_channel *pub)
{
	struct epoll_event ev = { .events = EPOLLIN };
	int fl = fcntl(pub->fd, F_GETFL);

	ch->pub = pub;
	ch->real_fd = pub->fd;
	ch->pending_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	ch->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	ch->app_fd = epoll_create1(EPOLL_CLOEXEC); /* librdmacm opens its fd close-on-exec */
	pthread_mutex_init(&ch->lock, NULL);
	if (ch->pending_fd < 0 || ch->wake_fd < 0 || ch->app_fd < 0 || ch->app_fd >= IBK_CM_MAXFD || fl < 0 ||
	    fcntl(ch->real_fd, F_SETFL, fl | O_NONBLOCK))
		return -1;
	ev.data.fd = ch->pending_fd;
	if (epoll_ctl(ch->app_fd, EPOLL_CTL_ADD, ch->pending_fd, &ev))
		return -1;
	ev.data.fd = ch->real_fd;
	if (epoll_ctl(ch->app_fd, EPOLL_CTL_ADD, ch->real_fd, &ev))
		return -1;
	pub->fd = ch->app_fd;
	return 0;
}

struct create_call {
	create_fn real;
};

/* librdmacm's own entry point.  RTLD_NEXT finds it when the program links
 * librdmacm; a library loaded privately (pyverbs' cmid module: Python's
 * dlopen is RTLD_LOCAL) is outside that scope, so then ask librdmacm
 * itself, which is loaded already: its caller came to us through it. */
static void *cm_real(const char *name)
{
	void *fn = dlvsym(RTLD_NEXT, name, "RDMACM_1.0"), *lib;

	if (!fn && (lib = dlopen("librdmacm.so.1", RTLD_LAZY | RTLD_NOLOAD))) {
		fn = dlvsym(lib, name, "RDMACM_1.0");
		dlclose(lib); /* RTLD_NOLOAD: only the count this call added */
	}
	if (!fn)
		ibk_log("cannot find librdmacm's %s", name);
	return fn;
}

static void *create_on_device_thread(void *arg)
{
	return ((struct create_call *)arg)->real();
}

IBK_EXPORT struct rdma_event_channel *rdma_create_event_channel(void)
{
	struct create_call call = { (create_fn)cm_real("rdma_create_event_channel") };
	struct rdma_event_channel *pub = NULL;
	struct cm_chan *ch;
	int on_devthread = ibk_last_epoch != 0;

	/* After a rebuild (so after a CRIU restore, maybe) each thread holds a
	 * cred of its own, and the kernel refuses writes to the file from any
	 * thread but its opener's: open it on the device thread, which then
	 * takes the writes the kernel refuses to the others (devthread.c). */
	if (!call.real) {
		errno = ENOSYS;
		return NULL;
	}
	ibk_control_ensure(); /* a fork child's first rdma_cm use, maybe */
	pub = on_devthread ? ibk_devthread_call(create_on_device_thread, &call) : call.real();
	if (!pub)
		return NULL;
	if (on_devthread)
		ibk_devfd_track(pub->fd);
	ch = calloc(1, sizeof(*ch));
	if (!ch || chan_track(ch, pub)) {
		/* left to librdmacm alone: status lists its fd, a checkpoint is refused */
		ibk_log("rdma_create_event_channel: cannot follow the channel (fd %d)", pub->fd);
		if (ch) {
			if (ch->app_fd >= 0)
				close(ch->app_fd);
			ch->real_fd = -1;
			chan_free(ch);
		}
		return pub;
	}
	pthread_mutex_lock(&chans_lock);
	ch->next = chans;
	chans = ch;
	atomic_store(&cm_fd_on[ch->app_fd], 1);
	atomic_store(&ibk_cm_active, 1);
	pthread_mutex_unlock(&chans_lock);
	IBK_DBG("rdma_cm channel: app fd %d, kernel fd %d", ch->app_fd, ch->real_fd);
	return pub;
}

IBK_EXPORT void rdma_destroy_event_channel(struct rdma_event_channel *pub)
{
	destroy_fn real = (destroy_fn)cm_real("rdma_destroy_event_channel");
	struct cm_chan *ch, **pp;

	ibk_enter();
	pthread_mutex_lock(&chans_lock);
	for (pp = &chans; *pp && (*pp)->pub != pub; pp = &(*pp)->next)
		;
	ch = *pp;
	if (ch) {
		*pp = ch->next;
		atomic_store(&cm_fd_on[ch->app_fd], 0);
	}
	pthread_mutex_unlock(&chans_lock);
	ibk_leave();
	if (ch)
		chan_free(ch); /* the kernel fd; librdmacm closes the app's */
	if (real)
		real(pub);
}

/* ---- fork ------------------------------------------------------------------------ */

/* No channel is half-way through a command or its queue across a fork. */
void ibk_cm_fork_lock(void)
{
	struct cm_chan *ch;

	pthread_mutex_lock(&chans_lock);
	for (ch = chans; ch; ch = ch->next)
		pthread_mutex_lock(&ch->lock);
}

void ibk_cm_fork_unlock(void)
{
	struct cm_chan *ch;

	for (ch = chans; ch; ch = ch->next)
		pthread_mutex_unlock(&ch->lock);
	pthread_mutex_unlock(&chans_lock);
}

/* The child holds the parent's channels (the same open files), whose
 * commands the kernel refuses it as it would without the shim; its phases
 * leave them alone, or they would take the parent's events and wake the
 * parent's threads. */
void ibk_cm_fork_child(void)
{
	struct cm_chan *ch;

	pthread_mutex_lock(&chans_lock);
	for (ch = chans; ch; ch = ch->next)
		ch->inherited = 1;
	pthread_mutex_unlock(&chans_lock);
}

/* ---- the phases ------------------------------------------------------------------ */

void ibk_cm_wake_all(int on)
{
	struct cm_chan *ch;
	uint64_t v = 1;

	pthread_mutex_lock(&chans_lock);
	for (ch = chans; ch; ch = ch->next) {
		if (ch->inherited)
			continue;
		if (on) {
			if (ibk_write_real(ch->wake_fd, &v, sizeof(v)) < 0)
				ibk_log("wake rdma_cm channel: %s", strerror(errno));
		} else if (read(ch->wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN) {
			ibk_log("unwake rdma_cm channel: %s", strerror(errno));
		}
	}
	pthread_mutex_unlock(&chans_lock);
}

/* drain (every rank quiesced, none released): the events the kernel holds
 * now are the app's; move them into the queues.  Events that come after
 * are the peers' releases tearing their ids down, and die with the file. */
int ibk_cm_drain(void)
{
	struct rdma_ucm_event_resp ev;
	struct cm_chan *ch;
	int n = 0;

	pthread_mutex_lock(&chans_lock);
	for (ch = chans; ch; ch = ch->next) {
		if (ch->inherited)
			continue;
		pthread_mutex_lock(&ch->lock);
		while (read_kernel_event(ch, &ev) > 0 && !q_push(ch, &ev))
			n++;
		pthread_mutex_unlock(&ch->lock);
	}
	pthread_mutex_unlock(&chans_lock);
	return n;
}

/* release: close every kernel fd.  An id the app was disconnecting gets
 * the DISCONNECTED the kernel would have sent. */
int ibk_cm_release(void)
{
	struct cm_chan *ch;
	uint32_t i;
	int n = 0;

	pthread_mutex_lock(&chans_lock);
	for (ch = chans; ch; ch = ch->next) {
		if (ch->inherited)
			continue;
		pthread_mutex_lock(&ch->lock);
		if (ch->real_fd >= 0) {
			for (i = 0; i < ch->ids.n; i++)
				if (ch->ids.v[i].state == IBK_CM_DISCONNECTING && !ch->ids.v[i].disc_out)
					queue_disconnected(ch, &ch->ids.v[i]);
			epoll_ctl(ch->app_fd, EPOLL_CTL_DEL, ch->real_fd, NULL);
			close_real(ch);
			n++;
		}
		pthread_mutex_unlock(&ch->lock);
	}
	pthread_mutex_unlock(&chans_lock);
	return n;
}

/* ---- status ------------------------------------------------------------------------ */

/* "rdma_cm":{"channels":N,"detached":N,"ids":[{"handle":H,"state":"..."}]} */
void ibk_cm_report(char *out, size_t len)
{
	struct cm_chan *ch;
	int nch = 0, ndet = 0, first = 1;
	uint32_t i;

	ibk_jcat(out, len, ",\"rdma_cm\":{\"ids\":[");
	pthread_mutex_lock(&chans_lock);
	for (ch = chans; ch; ch = ch->next) {
		if (ch->inherited)
			continue;
		nch++;
		pthread_mutex_lock(&ch->lock);
		ndet += ch->real_fd < 0;
		for (i = 0; i < ch->ids.n; i++, first = 0)
			ibk_jcat(out, len, "%s{\"channel\":%d,\"handle\":%u,\"state\":\"%s\",\"events\":%u}",
				 first ? "" : ",", ch->app_fd, ch->ids.v[i].handle,
				 ibk_cm_state_name(ch->ids.v[i].state), ch->ids.v[i].reported);
		pthread_mutex_unlock(&ch->lock);
	}
	pthread_mutex_unlock(&chans_lock);
	ibk_jcat(out, len, "],\"channels\":%d,\"detached\":%d}", nch, ndet);
}

/* For the preflight: what a checkpoint could not carry, one entry per
 * kind, appended to the unsupported list (*n entries so far). */
void ibk_cm_report_problems(char *out, size_t len, int *n)
{
	static const char *const why[] = {
		[IBK_CM_IDLE] = "rdma_cm id not connected (address, route or connection setup is not carried)",
		[IBK_CM_LISTEN] = "rdma_cm listening id (after a restore no connection request could reach it)",
		[IBK_CM_CONNECTING] = "rdma_cm id not connected (address, route or connection setup is not carried)",
		[IBK_CM_RESPONDED] = "rdma_cm id not connected (address, route or connection setup is not carried)",
		[IBK_CM_MCAST] = "rdma_cm multicast (joined groups are not rebuilt)",
	};
	const char *seen[4];
	int nseen = 0, live = 0, inherited = 0, j;
	struct cm_chan *ch;
	uint32_t i;

	pthread_mutex_lock(&chans_lock);
	for (ch = chans; ch; ch = ch->next) {
		pthread_mutex_lock(&ch->lock);
		live += ch->real_fd >= 0;
		if (ch->inherited) {
			inherited++;
			pthread_mutex_unlock(&ch->lock);
			continue;
		}
		for (i = 0; i < ch->ids.n; i++) {
			int st = ch->ids.v[i].state;
			const char *w = st > 0 && st <= IBK_CM_MCAST && !ibk_cm_carried(st) ? why[st] : NULL;

			for (j = 0; w && j < nseen; j++)
				if (seen[j] == w)
					w = NULL;
			if (w && nseen < 4) {
				seen[nseen++] = w;
				ibk_jcat(out, len, "%s\"%s\"", (*n)++ ? "," : "", w);
			}
		}
		pthread_mutex_unlock(&ch->lock);
	}
	pthread_mutex_unlock(&chans_lock);
	if (inherited)
		ibk_jcat(out, len, "%s\"rdma_cm event channel of the parent process (made before fork)\"",
			 (*n)++ ? "," : "");
	if (ibk_proc_fds("/dev/infiniband/rdma_cm", 0) > live)
		ibk_jcat(out, len, "%s\"rdma_cm (an event channel the shim does not follow)\"", (*n)++ ? "," : "");
}
