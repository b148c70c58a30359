/* The per-process control socket and the in-process ibckpt.h API.
 * Protocol version 1: one command per line, one reply line per command,
 * "ok <json>" or "err <json>".  Commands:
 *   hello | status | quiesce [ms] | drain [ms] | release [ms]
 *   rebuild <epoch> [ms] | resume | abort                                   */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "ibckpt.h"
#include "shim.h"

static pthread_mutex_t cmd_lock = PTHREAD_MUTEX_INITIALIZER;

/* One control thread serves every client with poll(): an idle or slow
 * client never holds up another one's command (the agent's abort).  Each
 * read and write is bounded; a client that does not take its reply within
 * IO_TIMEOUT_MS, or sends a line longer than a command, is dropped. */
#define MAX_CLIENTS 16
#define CMD_MAX 256
#define IO_TIMEOUT_MS 5000
/* A report is a few hundred bytes per object: the reply buffer is sized
 * for the objects there are, so 2,048 QPs per rank fit (docs/wire-formats). */
#define REPLY_BASE (64 * 1024)
#define REPLY_PER_OBJ 1024

static int run_command(const char *line, char *out, size_t len)
{
	char verb[32] = "";
	unsigned long long a = 0;
	long b = 0;
	int n = sscanf(line, "%31s %llu %ld", verb, &a, &b);
	int rc;

	pthread_mutex_lock(&cmd_lock);
	if (n < 1)
		rc = (snprintf(out, len, "{\"error\":\"empty command\"}"), -EINVAL);
	else if (!strcmp(verb, "hello"))
		rc = (snprintf(out, len, "{\"proto\":%d,\"api\":%d,\"pid\":%d}", IBCKPT_PROTO_VERSION,
			       IBCKPT_API_VERSION, (int)getpid()),
		      0);
	else if (!strcmp(verb, "status"))
		rc = ibk_do_status(out, len);
	else if (!strcmp(verb, "quiesce"))
		rc = ibk_do_quiesce(n >= 2 ? (int)a : 10000, out, len);
	else if (!strcmp(verb, "drain"))
		rc = ibk_do_drain(n >= 2 ? (int)a : 10000, n >= 3 ? (int)b : IBK_DRAIN_STALL_MS, out, len);
	else if (!strcmp(verb, "release"))
		rc = ibk_do_release(n >= 2 ? (int)a : 10000, strstr(line, " quiet") != NULL, out, len);
	else if (!strcmp(verb, "rebuild"))
		rc = n >= 2 ? ibk_do_rebuild(a, n >= 3 ? (int)b : 30000, out, len)
			    : (snprintf(out, len, "{\"error\":\"rebuild needs an epoch\"}"), -EINVAL);
	else if (!strcmp(verb, "resume"))
		rc = ibk_do_resume(out, len);
	else if (!strcmp(verb, "abort"))
		rc = ibk_do_abort(out, len);
	else
		rc = (snprintf(out, len, "{\"error\":\"unknown command\"}"), -EINVAL);
	pthread_mutex_unlock(&cmd_lock);
	return rc;
}

static size_t reply_size(void)
{
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	size_t n = 0;

	pthread_mutex_lock(&ibk_ctx_lock);
	for (ctx = ibk_ctx_list; ctx; ctx = ctx->next_ctx) {
		pthread_mutex_lock(&ctx->lock);
		for (o = ctx->head.next; o != &ctx->head; o = o->next)
			n++;
		pthread_mutex_unlock(&ctx->lock);
	}
	pthread_mutex_unlock(&ibk_ctx_lock);
	/* objects made while the command runs: room for as many again */
	return REPLY_BASE + 2 * n * REPLY_PER_OBJ;
}

/* The whole reply line for one command, malloc'd: "ok <json>\n" or
 * "err <json>\n".  A report that did not fit is an error, never a cut line. */
static char *control_reply(const char *line, size_t *outlen)
{
	size_t cap = reply_size(), n;
	char *body = malloc(cap), *reply;
	int rc;

	if (!body)
		return NULL;
	body[0] = 0;
	rc = run_command(line, body, cap);
	n = strlen(body);
	if (n + 1 >= cap) {
		n = (size_t)snprintf(body, cap, "{\"error\":\"a reply of more than %zu bytes\"}", cap);
		rc = -E2BIG;
	}
	reply = malloc(n + 6);
	if (reply)
		*outlen = (size_t)snprintf(reply, n + 6, "%s %s\n", rc ? "err" : "ok", body);
	free(body);
	return reply;
}

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
	size_t got;
	long last; /* ms of its last line, for choosing whom to drop when full */
	char line[CMD_MAX];
};

static void client_drop(struct client *c)
{
	close(c->fd);
	c->fd = -1;
	c->got = 0;
}

/* New bytes from a client: run each complete line.  0 to keep it. */
static int client_input(struct client *c)
{
	ssize_t r = recv(c->fd, c->line + c->got, sizeof(c->line) - 1 - c->got, MSG_DONTWAIT);
	char *nl;

	if (r < 0 && (errno == EAGAIN || errno == EINTR))
		return 0;
	if (r <= 0)
		return -1;
	c->got += (size_t)r;
	c->line[c->got] = 0;
	while ((nl = memchr(c->line, '\n', c->got))) {
		size_t rest = c->got - (size_t)(nl + 1 - c->line), n = 0;
		char *reply;
		int bad;

		*nl = 0;
		reply = control_reply(c->line, &n);
		bad = !reply || write_bounded(c->fd, reply, n);
		free(reply);
		if (bad)
			return -1;
		memmove(c->line, nl + 1, rest + 1);
		c->got = rest;
		c->last = now_ms();
	}
	return c->got == sizeof(c->line) - 1 ? -1 : 0; /* a line too long to be a command */
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
	cl[i].got = 0;
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
 * that inherit the environment get their own socket. */
#define IBK_CONTROL_FD_MIN 900

void ibk_control_start(void)
{
	const char *tmpl = getenv("IBCKPT_CTL");
	struct sockaddr_un sa;
	pthread_attr_t at;
	pthread_t th;
	sigset_t all, old;
	char path[sizeof(sa.sun_path)];
	size_t o = 0;
	int fd;

	if (!tmpl || !*tmpl)
		return;
	for (; *tmpl && o + 12 < sizeof(path); tmpl++) {
		if (tmpl[0] == '%' && tmpl[1] == 'p') {
			o += (size_t)snprintf(path + o, sizeof(path) - o, "%d", (int)getpid());
			tmpl++;
		} else {
			path[o++] = *tmpl;
		}
	}
	path[o] = 0;
	memset(&sa, 0, sizeof(sa));
	sa.sun_family = AF_UNIX;
	memcpy(sa.sun_path, path, o + 1);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return;
	/* Out of the app's low fd numbers: perftest, for one, closes fds it
	 * never opened, which took the control socket away mid-run. */
	{
		int high = fcntl(fd, F_DUPFD_CLOEXEC, IBK_CONTROL_FD_MIN);

		if (high >= 0) {
			close(fd);
			fd = high;
		}
	}
	unlink(path);
	/* 0600 from the start: umask while binding, chmod to be sure */
	{
		mode_t um = umask(077);
		int rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));

		umask(um);
		if (rc || chmod(path, 0600) || listen(fd, 16)) {
			ibk_log("control socket %s: %s", path, strerror(errno));
			close(fd);
			return;
		}
	}
	/* the control thread takes no signals meant for the app */
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	pthread_attr_init(&at);
	pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	if (pthread_create(&th, &at, control_main, (void *)(intptr_t)fd))
		close(fd);
	pthread_attr_destroy(&at);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	IBK_DBG("control socket at %s", path);
}

/* ---- ibckpt.h ------------------------------------------------------------------ */

static pthread_mutex_t hook_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hook_cond = PTHREAD_COND_INITIALIZER;
static int critical_open, checkpoint_pending;
static struct {
	ibckpt_event_cb cb;
	void *arg;
} hooks[8];
static int nhooks;

IBK_EXPORT int ibckpt_api_version(void)
{
	return IBCKPT_API_VERSION;
}

IBK_EXPORT void ibckpt_critical_enter(void)
{
	pthread_mutex_lock(&hook_lock);
	while (checkpoint_pending)
		pthread_cond_wait(&hook_cond, &hook_lock);
	critical_open++;
	pthread_mutex_unlock(&hook_lock);
}

IBK_EXPORT void ibckpt_critical_leave(void)
{
	pthread_mutex_lock(&hook_lock);
	if (critical_open > 0)
		critical_open--;
	pthread_cond_broadcast(&hook_cond);
	pthread_mutex_unlock(&hook_lock);
}

IBK_EXPORT int ibckpt_register_callback(ibckpt_event_cb cb, void *arg)
{
	int rc = -1;

	pthread_mutex_lock(&hook_lock);
	if (nhooks < 8) {
		hooks[nhooks].cb = cb;
		hooks[nhooks++].arg = arg;
		rc = 0;
	}
	pthread_mutex_unlock(&hook_lock);
	return rc;
}

IBK_EXPORT const char *ibckpt_phase(void)
{
	return ibk_phase_name(ibk_phase_now());
}

IBK_EXPORT int ibckpt_control(const char *cmd, char *out, size_t len)
{
	return run_command(cmd, out, len);
}

int ibk_hooks_wait_critical(int timeout_ms)
{
	struct timespec ts;
	int rc = 0;

	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_sec += timeout_ms / 1000;
	ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
	if (ts.tv_nsec >= 1000000000) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000;
	}
	pthread_mutex_lock(&hook_lock);
	checkpoint_pending = 1;
	while (critical_open && rc == 0)
		rc = pthread_cond_timedwait(&hook_cond, &hook_lock, &ts);
	if (critical_open) {
		checkpoint_pending = 0;
		pthread_cond_broadcast(&hook_cond);
		rc = -EBUSY;
	} else {
		rc = 0;
	}
	pthread_mutex_unlock(&hook_lock);
	return rc;
}

void ibk_hooks_notify(int event)
{
	int i;

	pthread_mutex_lock(&hook_lock);
	if (event == IBCKPT_EV_RESUME) {
		checkpoint_pending = 0;
		pthread_cond_broadcast(&hook_cond);
	}
	for (i = 0; i < nhooks; i++)
		hooks[i].cb((enum ibckpt_event)event, hooks[i].arg);
	pthread_mutex_unlock(&hook_lock);
}
