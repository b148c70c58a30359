/* The per-process control socket (protocol version 1, docs/wire-formats.md):
 * one command per line, one reply line per command, "ok <json>" or
 * "err <json>".  The commands themselves are in commands.c. */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "cmdline.h"
#include "ctlsock.h"
#include "fork.h"
#include "shim.h"

/* One control thread serves every client with poll(): an idle or slow
 * client never holds up another one's command (the agent's abort).  Each
 * read and write is bounded; a client that does not take its reply within
 * IO_TIMEOUT_MS, or sends a line longer than a command, is dropped. */
#define MAX_CLIENTS 16
#define IO_TIMEOUT_MS 5000

static long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Write it all within IO_TIMEOUT_MS (the socket is non-blocking). */
static int write_bounded(int fd, const char *p, size_t n)
{
	long deadline = now_ms() + IO_TIMEOUT_MS;

	while (n) {
		ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
		struct pollfd pf = {.fd = fd, .events = POLLOUT};
		long left;

		if (w > 0) {
			p += w;
			n -= (size_t)w;
			continue;
		}
		if (w < 0 && errno != EAGAIN && errno != EINTR)
			return -1;
		left = deadline - now_ms();
		if (left <= 0 || poll(&pf, 1, (int)left) < 0)
			return -1;
	}
	return 0;
}

/* Root or the process's own user: anyone else cannot drive its checkpoints. */
static int peer_allowed(int fd)
{
	struct ucred cr;
	socklen_t l = sizeof(cr);

	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &l) || l != sizeof(cr))
		return 0;
	return cr.uid == 0 || cr.uid == getuid() || cr.uid == geteuid();
}

struct client {
	int fd;
	long last; /* ms of its last line, for choosing whom to drop when full */
	struct ibk_linebuf in;
};

static void client_drop(struct client *c)
{
	close(c->fd);
	c->fd = -1;
}

/* New bytes from a client: run each complete line.  0 to keep it. */
static int client_input(struct client *c)
{
	size_t room, n = 0;
	char *space = ibk_linebuf_space(&c->in, &room), *line;
	ssize_t r;

	if (!room)
		return -1; /* a line too long to be a command */
	r = recv(c->fd, space, room, MSG_DONTWAIT);
	if (r < 0 && (errno == EAGAIN || errno == EINTR))
		return 0;
	if (r <= 0)
		return -1;
	ibk_linebuf_added(&c->in, (size_t)r);
	while ((line = ibk_linebuf_line(&c->in))) {
		char *reply = ibk_command_reply(line, &n);
		int bad = !reply || write_bounded(c->fd, reply, n);

		free(reply);
		if (bad)
			return -1;
		c->last = now_ms();
	}
	return 0;
}

static void client_accept(int lfd, struct client *cl)
{
	int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK), i, oldest = 0;

	if (fd < 0) {
		if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED)
			ibk_log("control socket: accept: %s", strerror(errno));
		return;
	}
	if (!peer_allowed(fd)) {
		ibk_log("control socket: refused a client of another user");
		close(fd);
		return;
	}
	for (i = 0; i < MAX_CLIENTS && cl[i].fd >= 0; i++)
		if (cl[i].last < cl[oldest].last)
			oldest = i;
	if (i == MAX_CLIENTS) /* full: the one quiet the longest makes room */
		client_drop(&cl[i = oldest]);
	cl[i].fd = fd;
	memset(&cl[i].in, 0, sizeof(cl[i].in));
	cl[i].last = now_ms();
}

static void *control_main(void *arg)
{
	struct client cl[MAX_CLIENTS];
	struct pollfd pf[MAX_CLIENTS + 1];
	int lfd = (int)(intptr_t)arg, i;

	/* The node agent finds this thread by name and raises its priority for a
	 * checkpoint: it shares its CPU with busy-polling app threads. */
	pthread_setname_np(pthread_self(), IBK_CONTROL_THREAD_NAME);
	for (i = 0; i < MAX_CLIENTS; i++)
		cl[i].fd = -1;
	for (;;) {
		pf[0].fd = lfd;
		pf[0].events = POLLIN;
		for (i = 0; i < MAX_CLIENTS; i++) {
			pf[i + 1].fd = cl[i].fd;
			pf[i + 1].events = POLLIN;
			pf[i + 1].revents = 0;
		}
		if (poll(pf, MAX_CLIENTS + 1, -1) < 0) {
			if (errno == EINTR)
				continue;
			ibk_log("control socket: poll: %s", strerror(errno));
			break;
		}
		for (i = 0; i < MAX_CLIENTS; i++)
			if (cl[i].fd >= 0 && pf[i + 1].revents && client_input(&cl[i]))
				client_drop(&cl[i]);
		if (pf[0].revents & POLLIN)
			client_accept(lfd, cl);
	}
	return NULL;
}

/* IBCKPT_CTL is the socket path; "%p" in it becomes the pid, so children
 * that inherit the environment get their own socket.  Out of the app's low
 * fd numbers: perftest, for one, closes fds it never opened, which took
 * the control socket away mid-run. */
#define IBK_CONTROL_FD_MIN 900

static int forked; /* this process is a fork child of one under the shim */

static void control_start(void)
{
	pthread_attr_t at;
	pthread_t th;
	sigset_t all, old;
	char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
	const char *tmpl = getenv("IBCKPT_CTL");
	int fd;

	if (ibk_ctl_path(path, sizeof(path), getpid()))
		return;
	/* one name for every process: it is the parent's, which still serves it */
	if (forked && !strstr(tmpl, "%p")) {
		ibk_log("IBCKPT_CTL=%s has no %%p: this fork child makes no control socket of its own", tmpl);
		return;
	}
	fd = ibk_ctl_listen(path, IBK_CONTROL_FD_MIN);
	if (fd < 0) {
		ibk_log("control socket %s: %s", path, strerror(errno));
		return;
	}
	/* the control thread takes no signals meant for the app */
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	pthread_attr_init(&at);
	pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	if (pthread_create(&th, &at, control_main, (void *)(intptr_t)fd)) {
		close(fd);
		unlink(path);
	} else {
		ibk_ctl_own(path, fd);
	}
	pthread_attr_destroy(&at);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	IBK_DBG("control socket at %s", path);
}

static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic pid_t started_in; /* the process whose control socket is started */

void ibk_control_ensure(void)
{
	pid_t me = getpid();

	if (atomic_load_explicit(&started_in, memory_order_acquire) == me)
		return;
	pthread_mutex_lock(&start_lock);
	if (atomic_load(&started_in) != me) {
		control_start();
		atomic_store_explicit(&started_in, me, memory_order_release);
	}
	pthread_mutex_unlock(&start_lock);
}

/* The parent's control thread is not copied: the child starts its own when
 * it first uses verbs. */
void ibk_control_fork_child(void)
{
	pthread_mutex_init(&start_lock, NULL);
	forked = 1;
}
