/* Slow paths of the shim's futex lock (lock.h). */
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "lock.h"

void ibk_lock_slow(ibk_lock_t *l)
{
	int w = atomic_load_explicit(&l->v, memory_order_relaxed);
	/* Free at once (only IBK_LOCK_SLOW made the fast path fail): take it as
	 * "held", so its unlock needs no wake.  Once we have slept, others may
	 * sleep too: take it as "held with waiters", so its unlock wakes one. */
	int held = 1;

	for (;;) {
		int flags = w & ~IBK_LOCK_STATE;

		if ((w & IBK_LOCK_STATE) == 0) {
			if (atomic_compare_exchange_weak_explicit(&l->v, &w, flags | held, memory_order_acquire,
								  memory_order_relaxed))
				return;
			continue;
		}
		if ((w & IBK_LOCK_STATE) == 1 &&
		    !atomic_compare_exchange_weak_explicit(&l->v, &w, flags | 2, memory_order_relaxed,
							   memory_order_relaxed))
			continue;
		syscall(SYS_futex, &l->v, FUTEX_WAIT_PRIVATE, flags | 2, NULL, NULL, 0);
		held = 2;
		w = atomic_load_explicit(&l->v, memory_order_relaxed);
	}
}

/* ibk_unlock's decrement found more than a plain "held".  Either only
 * IBK_LOCK_SLOW (then the lock is already free), or waiters: then the
 * decrement left state 1, which nobody else can take, and it is freed here. */
void ibk_unlock_slow(ibk_lock_t *l, int old)
{
	int w;

	if ((old & IBK_LOCK_STATE) != 2)
		return;
	w = atomic_load_explicit(&l->v, memory_order_relaxed);
	while (!atomic_compare_exchange_weak_explicit(&l->v, &w, w & ~IBK_LOCK_STATE, memory_order_release,
						      memory_order_relaxed))
		;
	syscall(SYS_futex, &l->v, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}
