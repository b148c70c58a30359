/* The gate (gate.c): every slow-path verb enters it, the control thread
 * closes it for the checkpoint phases. */
#ifndef IBK_GATE_H
#define IBK_GATE_H

#include <limits.h>
#include <stdatomic.h>

#pragma GCC visibility push(hidden)

/* One word: the sign bit says closed, the rest counts threads inside.  One
 * locked RMW both enters and sees the state: the close (an RMW on the same
 * word) is either ordered before it (we see the bit and step back out) or
 * after it (ibk_gate_close sees us counted and waits for ibk_leave). */
#define IBK_GATE_CLOSED LONG_MIN
extern atomic_long ibk_gate;
void ibk_gate_wait(void);
int ibk_gate_close(int timeout_ms);
void ibk_gate_open(void);

static inline long ibk_gate_inside(void)
{
	return atomic_load(&ibk_gate) & LONG_MAX;
}

static inline int ibk_gate_is_closed(void)
{
	return atomic_load(&ibk_gate) < 0;
}

static inline void ibk_enter(void)
{
	if (__builtin_expect(atomic_fetch_add(&ibk_gate, 1) < 0, 0))
		ibk_gate_wait();
}

static inline void ibk_leave(void)
{
	atomic_fetch_sub_explicit(&ibk_gate, 1, memory_order_release);
}

#pragma GCC visibility pop

#endif
