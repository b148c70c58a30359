/* The control socket's file on each way a process ends, on a host with no
 * RDMA device (tests/native/test_ctlsock_host.py): ctlsock.c alone, plain
 * and under the sanitizers.  argv[1] says how this process ends; it prints
 * its socket's path first.  IBCKPT_CTL must hold "%p". */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ctlsock.h"

static int exists(const char *path)
{
	struct stat st;

	return lstat(path, &st) == 0;
}

/* 0: something listens at path (the connection is queued, never served) */
/* The name the kernel keeps for the socket is the one CRIU restores it at:
 * it must be the file's own name, not a temporary one. */
static int bound_at(int fd, const char *path)
{
	struct sockaddr_un addr;
	socklen_t len = sizeof(addr);

	if (getsockname(fd, (struct sockaddr *)&addr, &len))
		return 0;
	return !strcmp(addr.sun_path, path);
}

static int reachable(const char *path)
{
	struct sockaddr_un sa;
	int fd = socket(AF_UNIX, SOCK_STREAM, 0), rc;

	memset(&sa, 0, sizeof(sa));
	sa.sun_family = AF_UNIX;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
	close(fd);
	return rc;
}

static int fcntl_closed(int fd)
{
	return fcntl(fd, F_GETFD) == -1;
}

static void on_term(int sig)
{
	(void)sig;
	_exit(3);
}

int main(int argc, char **argv)
{
	char path[108], tmp[120];
	const char *how = argc > 1 ? argv[1] : "exit";
	int fd;

	if (!strcmp(how, "load")) /* exec'd over a stale socket of this pid */
		return ibk_ctl_path(path, sizeof(path), getpid()) || exists(path) ? 1 : 0;
	if (!strcmp(how, "handler")) /* the app's own handler stays */
		signal(SIGTERM, on_term);
	if (ibk_ctl_path(path, sizeof(path), getpid()))
		return 2;
	fd = ibk_ctl_listen(path, 900);
	snprintf(tmp, sizeof(tmp), "%s.new", path);
	if (fd < 900 || reachable(path) || exists(tmp) || !bound_at(fd, path))
		return 2;
	ibk_ctl_own(path, fd);
	printf("%s\n", path);
	fflush(stdout);
	if (!strcmp(how, "fork")) {
		/* the child ends by exit(): the parent's socket stays, and the
		 * child's copy of the listening fd is closed */
		pid_t child = fork();
		int status;

		if (child == 0)
			exit(fcntl_closed(fd) ? 0 : 4);
		if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) ||
		    WEXITSTATUS(status) || !exists(path) || reachable(path))
			return 5;
		return 0;
	}
	if (!strcmp(how, "exit"))
		exit(0);
	if (!strcmp(how, "_exit"))
		_exit(0);
	if (!strcmp(how, "abort"))
		abort();
	if (!strcmp(how, "segv"))
		raise(SIGSEGV);
	kill(getpid(), strcmp(how, "handler") ? atoi(how) : SIGTERM);
	for (;;)
		pause();
}
