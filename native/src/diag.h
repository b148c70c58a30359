/* The shim's log lines, the verbs it refused and its threads' names
 * (diag.c). */
#ifndef IBK_DIAG_H
#define IBK_DIAG_H

#pragma GCC visibility push(hidden)

extern int ibk_verbose;
void ibk_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* A verb the shim does not support: say so on stderr, every time. */
void ibk_unsupported(const char *verb);
/* Defines decl, a verb (or an op behind one) the shim refuses: it says so
 * through ibk_unsupported and answers failure, as libibverbs does for an
 * op the provider lacks.  The trailing arguments mark decl's parameters
 * unused, e.g. (void)c, (void)a. */
#define IBK_REFUSED(decl, verb, failure, ...) \
	decl                                  \
	{                                     \
		__VA_ARGS__;                  \
		ibk_unsupported(verb);        \
		return failure;               \
	}
/* The distinct verbs ibk_unsupported refused (string literals), at most max. */
#define IBK_MAX_REFUSED 32
/* The shim's thread names (15 chars max): the node agent looks them up in
 * /proc, and a thread inherits its creator's name unless it sets its own. */
#define IBK_CONTROL_THREAD_NAME "ibk-control"
#define IBK_DEVICE_THREAD_NAME "ibk-device"
#define IBK_RELEASE_THREAD_NAME "ibk-release"
#define IBK_LEASE_THREAD_NAME "ibk-lease"
int ibk_refused_verbs(const char **out, int max);
/* This process's open fds whose /proc link is target (prefix: starts with it). */
int ibk_proc_fds(const char *target, int prefix);
#define IBK_DBG(...)                          \
	do {                                  \
		if (ibk_verbose)              \
			ibk_log(__VA_ARGS__); \
	} while (0)

#pragma GCC visibility pop

#endif
