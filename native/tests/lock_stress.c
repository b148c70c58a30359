/* Stress test of the shim's futex lock (src/lock.h) with the protocol that
 * closes a QP's posts, on the host, no verbs:
 *   - "posters" take the lock only with ibk_trylock, as the post fast path
 *     does, and back off when it fails (the real ones park at the gate);
 *   - "internal" threads take it with ibk_lock, as the poll slow path and
 *     the phases do, whether IBK_LOCK_SLOW is set or not;
 *   - a "closer" sets IBK_LOCK_SLOW, waits until nobody holds the lock, and
 *     then checks that no poster gets in until it clears the flag again.
 * Every critical section bumps a plain counter, so a broken lock loses
 * increments.  Exit status 0 only if all checks hold.
 *
 * usage: lock_stress [seconds]   (built plain and with -fsanitize=thread) */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "lock.h"

#define POSTERS 3
#define INTERNALS 2

static ibk_lock_t lock;
static unsigned long counter;	 /* guarded by lock */
static int closed;		 /* guarded by lock: set by the closer while it holds the posts closed */
static atomic_int stop;
static atomic_ulong ops;
static atomic_ulong poster_inside_closed; /* must stay 0 */
static atomic_ulong closes;

static void *poster(void *arg)
{
	unsigned long n = 0;

	(void)arg;
	while (!atomic_load(&stop)) {
		if (!ibk_trylock(&lock)) {
			sched_yield();
			continue;
		}
		if (closed)
			atomic_fetch_add(&poster_inside_closed, 1);
		counter++;
		ibk_unlock(&lock);
		n++;
	}
	atomic_fetch_add(&ops, n);
	return NULL;
}

static void *internal(void *arg)
{
	unsigned long n = 0;

	(void)arg;
	while (!atomic_load(&stop)) {
		ibk_lock(&lock);
		counter++;
		ibk_unlock(&lock);
		n++;
		if (!(n & 63))
			sched_yield();
	}
	atomic_fetch_add(&ops, n);
	return NULL;
}

static void *closer(void *arg)
{
	(void)arg;
	while (!atomic_load(&stop)) {
		atomic_fetch_or(&lock.v, IBK_LOCK_SLOW);
		while (atomic_load(&lock.v) & IBK_LOCK_STATE)
			sched_yield();
		/* closed: from here only ibk_lock gets in */
		ibk_lock(&lock);
		closed = 1;
		ibk_unlock(&lock);
		usleep(200);
		ibk_lock(&lock);
		closed = 0;
		ibk_unlock(&lock);
		if (!(atomic_load(&lock.v) & IBK_LOCK_SLOW)) {
			fprintf(stderr, "lock_stress: IBK_LOCK_SLOW was lost while closed\n");
			exit(1);
		}
		atomic_fetch_and(&lock.v, ~IBK_LOCK_SLOW);
		atomic_fetch_add(&closes, 1);
		usleep(100);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	pthread_t t[POSTERS + INTERNALS + 1];
	int secs = argc > 1 ? atoi(argv[1]) : 2, i, n = 0;

	ibk_lock_init(&lock);
	for (i = 0; i < POSTERS; i++)
		pthread_create(&t[n++], NULL, poster, NULL);
	for (i = 0; i < INTERNALS; i++)
		pthread_create(&t[n++], NULL, internal, NULL);
	pthread_create(&t[n++], NULL, closer, NULL);
	sleep((unsigned)secs);
	atomic_store(&stop, 1);
	for (i = 0; i < n; i++)
		pthread_join(t[i], NULL);
	printf("{\"ops\":%lu,\"counter\":%lu,\"closes\":%lu,\"poster_inside_closed\":%lu,\"word\":%d}\n",
	       atomic_load(&ops), counter, atomic_load(&closes), atomic_load(&poster_inside_closed),
	       atomic_load(&lock.v));
	if (counter != atomic_load(&ops) || atomic_load(&poster_inside_closed) || atomic_load(&lock.v) != 0 ||
	    !atomic_load(&closes))
		return 1;
	return 0;
}
