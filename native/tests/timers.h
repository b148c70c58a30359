/* Timers a test program arms at its start and reports at its end (rc_seq -A):
 * ITIMER_REAL (a one-shot alarm() or a periodic setitimer), a one-shot POSIX
 * timer and a one-shot timerfd, all due SECONDS after arming.  Each records
 * the CLOCK_MONOTONIC millisecond it first fired, so a test can check that a
 * checkpoint and restore in between neither lost a timer nor let the downtime
 * count against it.  A thread ticking every 100 ms finds the downtime: the
 * longest gap between two ticks (frozen, thawed), in the process's own clock,
 * the one its timers run on.
 *
 *   TIMERS armed=MS due=MS kind=alarm|interval           (after arming)
 *   TIMERS fired=MS                                      (once all three fired)
 *   TIMERS real=MS real_count=N posix=MS timerfd=MS frozen=MS thawed=MS
 *                                                        (at the end; 0: never) */
#ifndef IBK_TEST_TIMERS_H
#define IBK_TEST_TIMERS_H

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/time.h>
#include <sys/timerfd.h>

#include "common.h"

static _Atomic long timers_real_ms, timers_posix_ms, timers_fd_ms, timers_frozen_ms, timers_thawed_ms;
static atomic_int timers_real_count;
static int timers_fd = -1;

static void timers_first(_Atomic long *at)
{
	long none = 0;

	atomic_compare_exchange_strong(at, &none, now_ms());
}

static void timers_on_alarm(int sig)
{
	(void)sig;
	timers_first(&timers_real_ms);
	atomic_fetch_add(&timers_real_count, 1);
}

static void timers_on_posix(int sig)
{
	(void)sig;
	timers_first(&timers_posix_ms);
}

/* A thread blocked in read(): the timerfd's expiry wakes it. */
static void *timers_fd_reader(void *arg)
{
	uint64_t ticks;

	(void)arg;
	while (read(timers_fd, &ticks, sizeof(ticks)) < 0 && errno == EINTR)
		;
	timers_first(&timers_fd_ms);
	return NULL;
}

static void *timers_ticker(void *arg)
{
	long before = now_ms(), now;
	int told = 0;

	(void)arg;
	for (;;) {
		usleep(100000);
		now = now_ms();
		if (!told && atomic_load(&timers_real_ms) && atomic_load(&timers_posix_ms) &&
		    atomic_load(&timers_fd_ms)) {
			printf("TIMERS fired=%ld\n", now);
			told = 1;
		}
		if (now - before > atomic_load(&timers_thawed_ms) - atomic_load(&timers_frozen_ms)) {
			atomic_store(&timers_frozen_ms, before);
			atomic_store(&timers_thawed_ms, now);
		}
		before = now;
	}
	return NULL;
}

static void timers_handler(int sig, void (*fn)(int))
{
	struct sigaction sa;

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = fn;
	sa.sa_flags = SA_RESTART; /* the program's own calls go on undisturbed */
	sigemptyset(&sa.sa_mask);
	if (sigaction(sig, &sa, NULL))
		DIE("sigaction");
}

/* spec: "alarm:SECONDS" or "interval:SECONDS" (then every second after). */
static void timers_arm(const char *spec)
{
	int seconds = atoi(strchr(spec, ':') ? strchr(spec, ':') + 1 : "");
	int periodic = strncmp(spec, "interval:", 9) == 0;
	struct sigevent ev;
	timer_t posix;
	struct itimerspec due;
	pthread_t reader, ticker;

	if (seconds < 1 || (!periodic && strncmp(spec, "alarm:", 6) != 0))
		DIE("usage: -A alarm:SECONDS or -A interval:SECONDS");
	timers_handler(SIGALRM, timers_on_alarm);
	timers_handler(SIGRTMIN, timers_on_posix);
	memset(&ev, 0, sizeof(ev));
	ev.sigev_notify = SIGEV_SIGNAL;
	ev.sigev_signo = SIGRTMIN;
	memset(&due, 0, sizeof(due));
	due.it_value.tv_sec = seconds;
	if (timer_create(CLOCK_MONOTONIC, &ev, &posix) || timer_settime(posix, 0, &due, NULL))
		DIE("posix timer");
	timers_fd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
	if (timers_fd < 0 || timerfd_settime(timers_fd, 0, &due, NULL))
		DIE("timerfd");
	if (pthread_create(&reader, NULL, timers_fd_reader, NULL) || pthread_detach(reader) ||
	    pthread_create(&ticker, NULL, timers_ticker, NULL) || pthread_detach(ticker))
		DIE("timer threads");
	if (periodic) {
		struct itimerval every = {{1, 0}, {seconds, 0}};

		if (setitimer(ITIMER_REAL, &every, NULL))
			DIE("setitimer");
	} else {
		alarm((unsigned)seconds);
	}
	printf("TIMERS armed=%ld due=%ld kind=%s\n", now_ms(), (long)seconds * 1000,
	       periodic ? "interval" : "alarm");
}

static void timers_report(void)
{
	printf("TIMERS real=%ld real_count=%d posix=%ld timerfd=%ld frozen=%ld thawed=%ld\n",
	       atomic_load(&timers_real_ms), atomic_load(&timers_real_count), atomic_load(&timers_posix_ms),
	       atomic_load(&timers_fd_ms), atomic_load(&timers_frozen_ms), atomic_load(&timers_thawed_ms));
}

#endif
