/* What the shim says about itself: its log lines on stderr, the verbs it
 * refused, which the status report lists for the agent's preflight, and
 * the fds /proc shows it holds. */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "diag.h"
#include "fork.h"

int ibk_verbose;

void ibk_log(const char *fmt, ...)
{
	char buf[512];
	va_list ap;
	int n;

	n = snprintf(buf, sizeof(buf), "libibckpt[%d]: ", (int)getpid());
	va_start(ap, fmt);
	vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
	va_end(ap);
	fprintf(stderr, "%s\n", buf);
}

/* The distinct verbs refused so far, for the status report (the agent's preflight). */
static const char *refused[IBK_MAX_REFUSED];
static int nrefused;
static pthread_mutex_t refused_lock = PTHREAD_MUTEX_INITIALIZER;

void ibk_unsupported(const char *verb)
{
	int i;

	ibk_log("%s is not supported under checkpointing (libibckpt); failing with EOPNOTSUPP", verb);
	pthread_mutex_lock(&refused_lock);
	for (i = 0; i < nrefused && strcmp(refused[i], verb); i++)
		;
	if (i == nrefused && nrefused < IBK_MAX_REFUSED)
		refused[nrefused++] = verb;
	pthread_mutex_unlock(&refused_lock);
	errno = EOPNOTSUPP;
}

/* What the parent tried is not the child's to answer for at its checkpoint. */
void ibk_refused_fork_child(void)
{
	pthread_mutex_init(&refused_lock, NULL);
	nrefused = 0;
}

int ibk_refused_verbs(const char **out, int max)
{
	int i, n;

	pthread_mutex_lock(&refused_lock);
	n = nrefused < max ? nrefused : max;
	for (i = 0; i < n; i++)
		out[i] = refused[i];
	pthread_mutex_unlock(&refused_lock);
	return n;
}

int ibk_proc_fds(const char *target, int prefix)
{
	char path[300], link[256];
	DIR *d = opendir("/proc/self/fd");
	struct dirent *de;
	size_t tlen = strlen(target);
	int n = 0;

	while (d && (de = readdir(d))) {
		ssize_t l;

		snprintf(path, sizeof(path), "/proc/self/fd/%s", de->d_name);
		l = readlink(path, link, sizeof(link) - 1);
		if (l > 0) {
			link[l] = 0;
			n += prefix ? !strncmp(link, target, tlen) : !strcmp(link, target);
		}
	}
	if (d)
		closedir(d);
	return n;
}
