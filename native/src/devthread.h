/* The device thread (devthread.c) and the writes it may take over, which
 * the shim's write() (write.c) relies on. */
#ifndef IBK_DEVTHREAD_H
#define IBK_DEVTHREAD_H

#include <stdatomic.h>
#include <sys/types.h>

#include <infiniband/verbs.h>

#pragma GCC visibility push(hidden)

/* Run fn(arg) on the shim's device thread and return its result. */
void *ibk_devthread_call(void *(*fn)(void *), void *arg);
/* Open a device on the device thread and track its command fd. */
struct ibv_context *ibk_devthread_open(struct ibv_device *dev);
void ibk_devfd_track(int fd);
void ibk_devfd_forget(int fd);
/* Writes other threads handed to the device thread (after a CRIU restore). */
unsigned long ibk_devthread_writes(void);

/* write() as libc does it, with the device thread's hand-over after a
 * restore; the shim's write() (write.c) adds the rdma_cm routing
 * (rdmacm.c) on top. */
ssize_t ibk_write_real(int fd, const void *buf, size_t n);
/* For write()'s fast path: libc's write once resolved (NULL before), and 2
 * once a device fd is tracked, so that a write may need handing over. */
typedef ssize_t (*ibk_write_fn)(int, const void *, size_t);
extern _Atomic(ibk_write_fn) ibk_libc_write;
extern _Atomic int ibk_devfds_ready;

#pragma GCC visibility pop

#endif
