/* The per-process control socket and the in-process ibckpt.h API.
 * Protocol version 1: one command per line, one reply line per command,
 * "ok <json>" or "err <json>".  Commands:
 *   hello | status | quiesce [ms] | drain [ms] | release [ms]
 *   rebuild <epoch> [ms] | resume | abort                                   */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "ibckpt.h"
#include "shim.h"

#define REPLY_MAX (256 * 1024)
static pthread_mutex_t cmd_lock = PTHREAD_MUTEX_INITIALIZER;

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

static void serve_client(int fd, char *reply, char *body)
{
	char line[256];
	size_t got = 0;

	for (;;) {
		ssize_t r = read(fd, line + got, sizeof(line) - 1 - got);
		char *nl;

		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return;
		got += (size_t)r;
		line[got] = 0;
		while ((nl = strchr(line, '\n'))) {
			size_t rest;
			int rc;

			*nl = 0;
			rc = run_command(line, body, REPLY_MAX);
			snprintf(reply, REPLY_MAX + 8, "%s %s\n", rc ? "err" : "ok", body);
			if (write(fd, reply, strlen(reply)) < 0)
				return;
			rest = got - (size_t)(nl + 1 - line);
			memmove(line, nl + 1, rest + 1);
			got = rest;
		}
		if (got == sizeof(line) - 1)
			return; /* a line too long to be a command */
	}
}

static void *control_main(void *arg)
{
	int lfd = (int)(intptr_t)arg;
	char *reply = malloc(REPLY_MAX + 8), *body = malloc(REPLY_MAX);

	/* The node agent finds this thread by name and raises its priority for a
	 * checkpoint: it shares its CPU with busy-polling app threads. */
	pthread_setname_np(pthread_self(), IBK_CONTROL_THREAD_NAME);
	if (!reply || !body) {
		free(reply);
		free(body);
		return NULL;
	}
	for (;;) {
		int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);

		if (fd < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			ibk_log("control socket: accept: %s", strerror(errno));
			break;
		}
		serve_client(fd, reply, body);
		close(fd);
	}
	free(reply);
	free(body);
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
		if (rc || chmod(path, 0600) || listen(fd, 4)) {
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
