/* The shim's futex lock, with the flag that closes a QP's posts.  Pure code
 * (no libibverbs): the host tests stress it on their own (tests/lock_stress.c). */
#ifndef IBK_LOCK_H
#define IBK_LOCK_H

#include <stdatomic.h>

/* A futex lock.  The low two bits are its state (0 free, 1 held, 2 held with
 * waiters); one locked RMW takes it and one gives it back when nobody waits,
 * against some 55 instructions for a pthread mutex pair.  Zeroed memory is an
 * unlocked lock.
 *
 * A QP's post locks also carry IBK_LOCK_SLOW, which sends the post fast path
 * (a trylock that wants the whole word 0) to the slow path.  It is set while
 * the shim has the posts closed (quiesce to resume) and for good on the
 * receive lock of a QP on an SRQ.  ibk_lock, ibk_unlock and the slow paths
 * keep the bit as they find it. */
#define IBK_LOCK_STATE 3
#define IBK_LOCK_SLOW 4
typedef struct {
	atomic_int v;
} ibk_lock_t;

void ibk_lock_slow(ibk_lock_t *l);
void ibk_unlock_slow(ibk_lock_t *l, int old);

static inline void ibk_lock_init(ibk_lock_t *l)
{
	atomic_init(&l->v, 0);
}

static inline void ibk_lock(ibk_lock_t *l)
{
	int z = 0;

	if (__builtin_expect(!atomic_compare_exchange_strong_explicit(&l->v, &z, 1, memory_order_acquire,
								      memory_order_relaxed),
			     0))
		ibk_lock_slow(l);
}

/* 1 if taken: only when it is free and has no IBK_LOCK_SLOW.  Never waits. */
static inline int ibk_trylock(ibk_lock_t *l)
{
	int z = 0;

	return atomic_compare_exchange_strong_explicit(&l->v, &z, 1, memory_order_acquire, memory_order_relaxed);
}

/* A decrement, not a store of 0: IBK_LOCK_SLOW may have been set meanwhile. */
static inline void ibk_unlock(ibk_lock_t *l)
{
	int old = atomic_fetch_sub_explicit(&l->v, 1, memory_order_release);

	if (__builtin_expect(old != 1, 0))
		ibk_unlock_slow(l, old);
}

#endif
