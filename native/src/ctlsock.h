/* The control socket's file (ctlsock.c): made under its final name only
 * once it listens, and removed on every exit path the process can catch,
 * so that the node agent never finds a socket nobody answers on. */
#ifndef IBK_CTLSOCK_H
#define IBK_CTLSOCK_H

#include <stddef.h>
#include <sys/types.h>

#pragma GCC visibility push(hidden)

/* The IBCKPT_CTL template with "%p" replaced by pid, into out[len]; 0 on
 * success, -1 when IBCKPT_CTL is unset, empty or too long. */
int ibk_ctl_path(char *out, size_t len, pid_t pid);
/* A listening unix socket at path, mode 0600, close-on-exec, at fd >=
 * fd_min when it can be; -1 with errno on failure. */
int ibk_ctl_listen(const char *path, int fd_min);
/* path (listening on fd) is this process's: remove it at exit() and on
 * the fatal signals whose action is still the default, and close fd in
 * fork children (they do not remove it).  Once per process: a fork child
 * that makes a socket of its own calls it again for that one. */
void ibk_ctl_own(const char *path, int fd);
/* Remove the socket now if this process made it (async-signal-safe). */
void ibk_ctl_remove(void);

#pragma GCC visibility pop

#endif
