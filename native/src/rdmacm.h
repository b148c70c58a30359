/* librdmacm's event channels, followed and carried through a checkpoint
 * (rdmacm.c). */
#ifndef IBK_RDMACM_H
#define IBK_RDMACM_H

#include <stdatomic.h>
#include <sys/types.h>

#pragma GCC visibility push(hidden)

/* Set once a channel is followed: from then on write() asks ibk_cm_write. */
extern atomic_int ibk_cm_active;
/* A write on an app's event channel fd: 1 and *rc when it was one. */
int ibk_cm_write(int fd, const void *buf, size_t n, ssize_t *rc);
void ibk_cm_wake_all(int on);
int ibk_cm_drain(void);
int ibk_cm_release(void);
void ibk_cm_report(char *out, size_t len);
void ibk_cm_report_problems(char *out, size_t len, int *n);

#pragma GCC visibility pop

#endif
