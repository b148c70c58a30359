/* The control socket's file.  A process under the shim makes one socket
 * (IBCKPT_CTL, "%p" its pid); the node agent takes every socket it finds
 * for a rank.  A process that ends must therefore take its socket along:
 * at exit(), on a fatal signal it can catch, and, after an exec, in the
 * new image (the listening fd is close-on-exec, so the old name is dead).
 * SIGKILL and _exit() leave it behind; the agent drops those by itself. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "ctlsock.h"


static char owned_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static volatile sig_atomic_t owner_pid; /* 0: nothing to remove */
static int owned_fd = -1;

/* Signals that end a process by default and carry nothing a handler could
 * spoil: the handler removes the socket, restores the default and raises
 * the signal again, so the process ends as it would have. */
static const int fatal_signals[] = {SIGHUP,  SIGINT,  SIGQUIT, SIGTERM, SIGPIPE, SIGALRM, SIGUSR1,
				    SIGUSR2, SIGABRT, SIGSEGV, SIGBUS,  SIGFPE,  SIGILL};

int ibk_ctl_path(char *out, size_t len, pid_t pid)
{
	const char *tmpl = getenv("IBCKPT_CTL");
	size_t o = 0;

	if (!tmpl || !*tmpl || !len)
		return -1;
	for (; *tmpl; tmpl++) {
		if (tmpl[0] == '%' && tmpl[1] == 'p') {
			int n = snprintf(out + o, len - o, "%d", (int)pid);

			if (n < 0 || (size_t)n >= len - o)
				return -1;
			o += (size_t)n;
			tmpl++;
		} else {
			if (o + 1 >= len)
				return -1;
			out[o++] = *tmpl;
		}
	}
	out[o] = 0;
	return 0;
}

static int bind_listen(int fd, const char *name)
{
	struct sockaddr_un sa;
	mode_t um;
	int rc;

	memset(&sa, 0, sizeof(sa));
	sa.sun_family = AF_UNIX;
	if (strlen(name) >= sizeof(sa.sun_path)) {
		errno = ENAMETOOLONG;
		return -1;
	}
	strcpy(sa.sun_path, name);
	unlink(name);
	um = umask(077); /* 0600 from the start; chmod to be sure */
	rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
	umask(um);
	if (rc || chmod(name, 0600) || listen(fd, 16))
		return -1;
	return 0;
}

int ibk_ctl_listen(const char *path, int fd_min)
{
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), high, err;

	if (fd < 0)
		return -1;
	high = fcntl(fd, F_DUPFD_CLOEXEC, fd_min);
	if (high >= 0) {
		close(fd);
		fd = high;
	}
	/* Bound at its final name, never renamed: CRIU restores a listening
	 * socket at the name it was bound to. The agent retries a refused
	 * connect before it calls a socket stale (listen() is yet to come). */
	if (!bind_listen(fd, path))
		return fd;
	err = errno;
	close(fd);
	errno = err;
	return -1;
}

void ibk_ctl_remove(void)
{
	/* A fork child inherits owner_pid but not the socket. */
	if (owner_pid && owner_pid == (sig_atomic_t)getpid()) {
		owner_pid = 0;
		unlink(owned_path);
	}
}

static void at_exit(void)
{
	ibk_ctl_remove();
}

static void on_fatal_signal(int sig)
{
	int saved = errno;

	ibk_ctl_remove();
	/* SA_RESETHAND restored the default: raised again, it ends the process
	 * (a fault's once this handler returns) just as it would have. */
	raise(sig);
	errno = saved;
}

/* A fork child holds a copy of the listening fd but no control thread: a
 * client would connect and wait for ever.  Closed, its socket refuses. */
static void in_fork_child(void)
{
	if (owned_fd >= 0) {
		close(owned_fd);
		owned_fd = -1;
	}
}

void ibk_ctl_own(const char *path, int fd)
{
	static int registered; /* a fork child that makes a socket of its own inherits them */
	struct sigaction sa;
	size_t i;

	snprintf(owned_path, sizeof(owned_path), "%s", path);
	owned_fd = fd;
	owner_pid = (sig_atomic_t)getpid();
	if (!registered) {
		atexit(at_exit);
		pthread_atfork(NULL, NULL, in_fork_child);
		registered = 1;
	}
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_fatal_signal;
	sa.sa_flags = SA_RESETHAND;
	sigemptyset(&sa.sa_mask);
	for (i = 0; i < sizeof(fatal_signals) / sizeof(fatal_signals[0]); i++) {
		struct sigaction old;

		/* only where nobody chose an action: an app's handler or an
		 * ignored signal (nohup, a shell's background job) stays its own */
		if (sigaction(fatal_signals[i], NULL, &old) == 0 && !(old.sa_flags & SA_SIGINFO) &&
		    old.sa_handler == SIG_DFL)
			sigaction(fatal_signals[i], &sa, NULL);
	}
}

/* At load, before any thread of the shim runs: a socket under this pid's
 * name is an earlier image's of this process (it exec'd; its listening fd
 * closed) or a dead process's whose pid this one now has.  Either is
 * stale, and a rank that opens a device makes a new one.  Only with "%p":
 * a fixed path may be another live process's. */
__attribute__((constructor)) static void remove_stale_at_load(void)
{
	const char *tmpl = getenv("IBCKPT_CTL");
	char path[sizeof(owned_path)];
	struct stat st;

	if (!tmpl || !strstr(tmpl, "%p") || ibk_ctl_path(path, sizeof(path), getpid()))
		return;
	if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode))
		unlink(path);
}
