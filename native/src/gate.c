/* The gate every slow-path verb passes: the control thread closes it for
 * the checkpoint phases and waits for the threads inside to leave. */
#include <errno.h>
#include <pthread.h>
#include <unistd.h>

#include "fork.h"
#include "gate.h"
#include "phase.h"

atomic_long ibk_gate;
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cond = PTHREAD_COND_INITIALIZER;

/* Slow path of ibk_enter: step back out, sleep until the gate opens. */
void ibk_gate_wait(void)
{
	for (;;) {
		atomic_fetch_sub(&ibk_gate, 1);
		pthread_mutex_lock(&gate_lock);
		while (atomic_load(&ibk_gate) < 0)
			pthread_cond_wait(&gate_cond, &gate_lock);
		pthread_mutex_unlock(&gate_lock);
		if (atomic_fetch_add(&ibk_gate, 1) >= 0)
			return;
	}
}

int ibk_gate_close(int timeout_ms)
{
	long deadline = ibk_ms_now() + timeout_ms;
	useconds_t nap = 50;

	pthread_mutex_lock(&gate_lock);
	atomic_fetch_or(&ibk_gate, IBK_GATE_CLOSED);
	pthread_mutex_unlock(&gate_lock);
	/* The threads still inside must get the CPU to leave: a boosted control
	 * thread that woke every 200 us starved them on a busy core. */
	while (ibk_gate_inside() > 0) {
		if (ibk_ms_now() > deadline)
			return -ETIMEDOUT;
		usleep(nap);
		nap = nap < 2000 ? nap * 2 : 2000;
	}
	return 0;
}

void ibk_gate_open(void)
{
	pthread_mutex_lock(&gate_lock);
	atomic_fetch_and(&ibk_gate, LONG_MAX);
	pthread_cond_broadcast(&gate_cond);
	pthread_mutex_unlock(&gate_lock);
}

/* A fork child's one thread is inside no verb, and its checkpoints are its
 * own: the gate is open, whatever the parent's phase. */
void ibk_gate_fork_child(void)
{
	pthread_mutex_init(&gate_lock, NULL);
	pthread_cond_init(&gate_cond, NULL);
	atomic_store(&ibk_gate, 0);
}
