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

#include "cmchan.h"
#include "cmstate.h"
#include "devthread.h"
#include "fork.h"
#include "phases.h"
#include "rdmacm.h"



atomic_int ibk_cm_active; /* a channel was ever tracked: write() looks here */
_Atomic unsigned char ibk_cm_fd_on[IBK_CM_MAXFD];
static pthread_mutex_t chans_lock = PTHREAD_MUTEX_INITIALIZER;
static struct cm_chan *chans;

struct cm_chan *ibk_cm_chan_of_fd(int fd)
{
	struct cm_chan *ch;

	pthread_mutex_lock(&chans_lock);
	for (ch = chans; ch && ch->app_fd != fd; ch = ch->next)
		;
	pthread_mutex_unlock(&chans_lock);
	return ch;
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
	atomic_store(&ibk_cm_fd_on[ch->app_fd], 1);
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
		atomic_store(&ibk_cm_fd_on[ch->app_fd], 0);
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
		while (ibk_cm_read_kernel_event(ch, &ev) > 0 && !ibk_cm_q_push(ch, &ev))
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
					ibk_cm_queue_disconnected(ch, &ch->ids.v[i]);
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
