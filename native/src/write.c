/* The shim's write(), interposed on every write() of the process.  It stays
 * libc's write() until a rebuild has opened a device on the device thread
 * (whose fds a restored thread may be refused: devthread.c says why) or
 * an rdma_cm channel is followed (whose commands rdmacm.c answers). */
#include <stdatomic.h>
#include <unistd.h>

#include "devthread.h"
#include "rdmacm.h"
#include "shim.h"

/* The rest of write(): after a rebuild, in an rdma_cm program, or before
 * the real write() is resolved. */
static __attribute__((noinline)) ssize_t write_slow(int fd, const void *buf, size_t n)
{
	ssize_t rc;

	if (atomic_load_explicit(&ibk_cm_active, memory_order_relaxed) && ibk_cm_write(fd, buf, n, &rc))
		return rc;
	return ibk_write_real(fd, buf, n);
}

/* Every write() of the process passes here (Soft-RoCE's doorbell among
 * them), so the way through is kept short: until a rebuild has opened a
 * device on the device thread, no write can need handing over, and the
 * real write() is a tail call. */
IBK_EXPORT ssize_t write(int fd, const void *buf, size_t n)
{
	ibk_write_fn real = atomic_load_explicit(&ibk_libc_write, memory_order_relaxed);

	if (__builtin_expect(real && atomic_load_explicit(&ibk_devfds_ready, memory_order_relaxed) != 2 &&
				     !atomic_load_explicit(&ibk_cm_active, memory_order_relaxed),
			     1))
		return real(fd, buf, n);
	return write_slow(fd, buf, n);
}
