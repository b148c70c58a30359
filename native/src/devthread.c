/* The device thread: the one thread that opens devices during rebuild, and
 * that performs the writes other threads are refused.
 *
 * Why: the kernel refuses write() on a uverbs fd from a task whose cred is
 * not the very cred that opened it (ib_safe_file_access compares pointers).
 * Threads of a normal process share one cred, but CRIU restores each thread's
 * credentials separately, so after a restore every thread has its own.  Soft-
 * RoCE rings its send doorbell with write(), and modify_qp is a write on every
 * provider, so without this an app thread's first post after a restore fails
 * with EACCES ("changed security contexts after opening file descriptor").
 *
 * The fix costs nothing before the first restore: write() is tried first, and
 * only an EACCES on a device fd opened here is handed to this thread. */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "devthread.h"
#include "fork.h"
#include "shim.h"

#define IBK_MAX_DEVFDS 32

struct devcall {
	void *(*fn)(void *);
	void *arg;
	void *ret;
	int done;
	struct devcall *next;
};

static pthread_mutex_t dev_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t dev_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t dev_done = PTHREAD_COND_INITIALIZER;
static struct devcall *dev_queue;
static pid_t dev_started; /* pid that started the thread: a fork child has none */
static pthread_t dev_thread;
static _Atomic int devfds[IBK_MAX_DEVFDS];
_Atomic int ibk_devfds_ready;
static atomic_ulong delegated_writes;

static void *device_main(void *unused)
{
	(void)unused;
	pthread_setname_np(pthread_self(), IBK_DEVICE_THREAD_NAME);
	pthread_mutex_lock(&dev_lock);
	for (;;) {
		struct devcall *c;

		while (!dev_queue)
			pthread_cond_wait(&dev_wake, &dev_lock);
		c = dev_queue;
		dev_queue = c->next;
		pthread_mutex_unlock(&dev_lock);
		c->ret = c->fn(c->arg);
		pthread_mutex_lock(&dev_lock);
		c->done = 1;
		pthread_cond_broadcast(&dev_done);
	}
	return NULL;
}

static void devfds_init(void)
{
	int expected = 0;

	if (!atomic_compare_exchange_strong(&ibk_devfds_ready, &expected, 1))
		return;
	for (int i = 0; i < IBK_MAX_DEVFDS; i++)
		atomic_store(&devfds[i], -1);
	atomic_store(&ibk_devfds_ready, 2);
}

void *ibk_devthread_call(void *(*fn)(void *), void *arg)
{
	struct devcall c = { .fn = fn, .arg = arg };
	struct devcall **tail;

	pthread_mutex_lock(&dev_lock);
	if (dev_started != getpid()) {
		dev_queue = NULL;
		pthread_attr_t at;
		sigset_t all, old;

		/* signals belong to the application's threads, not ours */
		sigfillset(&all);
		pthread_sigmask(SIG_SETMASK, &all, &old);
		pthread_attr_init(&at);
		pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
		if (pthread_create(&dev_thread, &at, device_main, NULL)) {
			pthread_sigmask(SIG_SETMASK, &old, NULL);
			pthread_mutex_unlock(&dev_lock);
			ibk_log("cannot start the device thread; running on the caller");
			return fn(arg);
		}
		pthread_sigmask(SIG_SETMASK, &old, NULL);
		pthread_attr_destroy(&at);
		dev_started = getpid();
	}
	if (pthread_equal(pthread_self(), dev_thread)) {
		pthread_mutex_unlock(&dev_lock);
		return fn(arg);
	}
	for (tail = &dev_queue; *tail; tail = &(*tail)->next)
		;
	*tail = &c;
	pthread_cond_signal(&dev_wake);
	while (!c.done)
		pthread_cond_wait(&dev_done, &dev_lock);
	pthread_mutex_unlock(&dev_lock);
	return c.ret;
}

/* No call is half-queued across a fork (device_main and the callers hold
 * dev_lock only to queue and dequeue). */
void ibk_devthread_fork_lock(void)
{
	pthread_mutex_lock(&dev_lock);
}

void ibk_devthread_fork_parent(void)
{
	pthread_mutex_unlock(&dev_lock);
}

/* The child has no device thread (dev_started is the parent's pid) and no
 * calls for it; its condition variables may hold the parent's waiters. The
 * device fds tracked are the parent's, whose writes the kernel refuses the
 * child whoever makes them, so none is handed over. */
void ibk_devthread_fork_child(void)
{
	dev_queue = NULL;
	pthread_cond_init(&dev_wake, NULL);
	pthread_cond_init(&dev_done, NULL);
	pthread_mutex_unlock(&dev_lock);
	atomic_store(&ibk_devfds_ready, 0);
	atomic_store(&delegated_writes, 0);
}

/* ---- devices opened on the device thread ---------------------------------- */

static void *open_on_device_thread(void *dev)
{
	return ibk_real.open_device(dev);
}

struct ibv_context *ibk_devthread_open(struct ibv_device *dev)
{
	struct ibv_context *c = ibk_devthread_call(open_on_device_thread, dev);

	if (c)
		ibk_devfd_track(c->cmd_fd);
	return c;
}

void ibk_devfd_track(int fd)
{
	devfds_init();
	for (int i = 0; i < IBK_MAX_DEVFDS; i++) {
		int empty = -1;

		if (atomic_compare_exchange_strong(&devfds[i], &empty, fd))
			return;
	}
	ibk_log("more than %d device fds; fd %d is not tracked", IBK_MAX_DEVFDS, fd);
}

void ibk_devfd_forget(int fd)
{
	if (atomic_load(&ibk_devfds_ready) != 2)
		return;
	for (int i = 0; i < IBK_MAX_DEVFDS; i++) {
		int want = fd;

		atomic_compare_exchange_strong(&devfds[i], &want, -1);
	}
}

static int devfd_tracked(int fd)
{
	if (atomic_load(&ibk_devfds_ready) != 2)
		return 0;
	for (int i = 0; i < IBK_MAX_DEVFDS; i++)
		if (atomic_load(&devfds[i]) == fd)
			return 1;
	return 0;
}

unsigned long ibk_devthread_writes(void)
{
	return atomic_load(&delegated_writes);
}

/* ---- write() as libc does it, or on the device thread ---------------------------------------------------- */

_Atomic(ibk_write_fn) ibk_libc_write;

struct devwrite {
	int fd;
	const void *buf;
	size_t n;
	ssize_t rc;
	int err;
};

static ibk_write_fn resolve_write(void)
{
	ibk_write_fn w = atomic_load(&ibk_libc_write);

	if (!w) {
		*(void **)&w = dlsym(RTLD_NEXT, "write");
		if (!w)
			abort(); /* no libc write: nothing sane is possible */
		atomic_store(&ibk_libc_write, w);
	}
	return w;
}

static void *write_on_device_thread(void *arg)
{
	struct devwrite *w = arg;

	w->rc = resolve_write()(w->fd, w->buf, w->n);
	w->err = w->rc < 0 ? errno : 0;
	return NULL;
}

/* write() failed: hand it to the device thread if the kernel refused this
 * thread a device fd the device thread opened. */
static __attribute__((noinline)) ssize_t write_failed(int fd, const void *buf, size_t n, ssize_t rc)
{
	struct devwrite w;

	if (errno != EACCES || !devfd_tracked(fd))
		return rc;
	w = (struct devwrite){ .fd = fd, .buf = buf, .n = n };
	ibk_devthread_call(write_on_device_thread, &w);
	atomic_fetch_add(&delegated_writes, 1);
	if (w.rc < 0)
		errno = w.err;
	return w.rc;
}

ssize_t ibk_write_real(int fd, const void *buf, size_t n)
{
	ssize_t rc = resolve_write()(fd, buf, n);

	if (__builtin_expect(rc >= 0, 1))
		return rc;
	return write_failed(fd, buf, n, rc);
}
