/* The lease (docs/native-shim.md, "Lease"): while a rank is held out of
 * running, the agent must renew it (`lease <ms>`).  If the agent dies or
 * stops renewing, a watchdog thread resumes the rank from quiesced, drained
 * or rebuilt on its own, as abort does; from released it can only wait for
 * a rebuild (the peers' new addresses come through the agent), and says so.
 *
 * Every function here but the thread runs under ibk_cmd_lock, as the
 * commands do; the thread takes it too, so a command is never interrupted. */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fork.h"
#include "lease.h"
#include "phases.h"

#define LEASE_DEFAULT_MS 60000
#define LEASE_TICK_MS 250         /* how late past the deadline the watchdog may act */
#define RELEASED_NAG_MS 30000     /* how often a released rank with no lease says so */

static long lease_len;      /* ms of the last grant; 0: no lease */
static long lease_deadline; /* CLOCK_MONOTONIC ms */
static long nagged;         /* when "released, lease expired" was last logged; 0: not yet */
static pid_t watchdog_pid;  /* the process whose watchdog runs: a fork child has none */
static long default_ms = -1;

static long lease_default(void)
{
	if (default_ms < 0) {
		const char *v = getenv("IBCKPT_LEASE_MS");
		char *end;
		long ms = v && *v ? strtol(v, &end, 10) : LEASE_DEFAULT_MS;

		if (v && *v && (*end || ms < 0)) {
			ibk_log("IBCKPT_LEASE_MS=%s is not a number of ms; the lease stays %d ms", v, LEASE_DEFAULT_MS);
			ms = LEASE_DEFAULT_MS;
		}
		default_ms = ms;
	}
	return default_ms;
}

static void *watchdog_main(void *unused);

static void watchdog_start(void)
{
	pthread_attr_t at;
	pthread_t th;
	sigset_t all, old;

	if (watchdog_pid == getpid())
		return;
	/* signals belong to the application's threads, not ours */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	pthread_attr_init(&at);
	pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	if (pthread_create(&th, &at, watchdog_main, NULL))
		ibk_log("cannot start the lease watchdog: an agent that dies leaves this rank held");
	else
		watchdog_pid = getpid();
	pthread_attr_destroy(&at);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static void grant(long ms)
{
	long now = ibk_ms_now();

	lease_len = ms;
	lease_deadline = now + ms;
	nagged = 0;
	if (ms)
		watchdog_start();
}

void ibk_lease_quiesced(void)
{
	grant(lease_default());
}

int ibk_do_lease(long ms, char *out, size_t len)
{
	long t0 = ibk_ms_now();

	if (ms < 0 || ms > 24L * 3600 * 1000) {
		ibk_report_begin(out, len, "lease", 0, t0);
		ibk_jcat(out, len, ",\"error\":\"a lease is 0 to 86400000 ms\"}");
		return -EINVAL;
	}
	/* a running rank holds nothing: a late renewal after resume is harmless */
	if (ibk_phase_cur != IBK_RUNNING) {
		if (!ms && lease_len)
			ibk_log("lease ended by the agent while %s: waiting for its commands, with no bound",
				ibk_phase_name(ibk_phase_cur));
		grant(ms);
	}
	ibk_report_begin(out, len, "lease", 1, t0);
	ibk_jcat(out, len, ",\"lease_ms\":%ld}", lease_len);
	return 0;
}

/* After every command, which started at t0: a running rank has no lease; a
 * phase that moved on renews it (its agent is alive), and time spent inside
 * a command does not count against it (renewals queue behind a long one). */
void ibk_lease_after_command(long t0, enum ibk_phase before)
{
	long now = ibk_ms_now();

	if (ibk_phase_cur == IBK_RUNNING) {
		lease_len = 0;
		return;
	}
	if (lease_len && (ibk_phase_cur != before || (lease_deadline > t0 && lease_deadline <= now))) {
		lease_deadline = now + lease_len;
		nagged = 0;
	}
}

void ibk_lease_report(char *out, size_t len)
{
	ibk_jcat(out, len, "\"lease_ms\":%ld,\"lease_left_ms\":%ld,", lease_len,
		 lease_len ? lease_deadline - ibk_ms_now() : -1L);
}

/* The deadline passed: act on it.  Returns 1 while the lease should still be watched. */
static int expired(long now)
{
	char tmp[256];
	long silent = lease_len; /* what the agent missed: its own lease, not the watchdog's lateness */
	enum ibk_phase p = ibk_phase_cur;

	if (p == IBK_RELEASED) {
		if (!nagged || now - nagged >= RELEASED_NAG_MS) {
			ibk_log("lease expired (no renewal from the agent for %ld ms) while released: the QPs are gone "
				"and only a rebuild with the peers brings them back; waiting for rebuild and resume",
				silent);
			nagged = now;
		}
		return 1;
	}
	lease_len = 0;
	if (p == IBK_RUNNING)
		return 0;
	/* nothing was released: the QPs are intact, so resuming keeps exactly-once */
	ibk_log("lease expired (no renewal from the agent for %ld ms) while %s: resuming on my own", silent,
		ibk_phase_name(p));
	if (ibk_do_abort(tmp, sizeof(tmp)))
		ibk_log("resuming on my own failed: %s", tmp);
	return 0;
}

static void *watchdog_main(void *unused)
{
	(void)unused;
	pthread_setname_np(pthread_self(), IBK_LEASE_THREAD_NAME);
	for (;;) {
		long now, nap = LEASE_TICK_MS;
		struct timespec ts;

		pthread_mutex_lock(&ibk_cmd_lock);
		now = ibk_ms_now();
		if (lease_len && now >= lease_deadline && !expired(now))
			lease_len = 0;
		if (!lease_len) {
			/* the next grant starts a new watchdog */
			watchdog_pid = 0;
			pthread_mutex_unlock(&ibk_cmd_lock);
			return NULL;
		}
		if (lease_deadline > now && lease_deadline - now < nap)
			nap = lease_deadline - now;
		pthread_mutex_unlock(&ibk_cmd_lock);
		/* relative sleeps: a restore onto another host may move the monotonic clock */
		ts.tv_sec = nap / 1000;
		ts.tv_nsec = (nap % 1000) * 1000000;
		while (nanosleep(&ts, &ts) && errno == EINTR)
			;
	}
}

/* The parent's lease is the parent's; a child runs, and holds none. */
void ibk_lease_fork_child(void)
{
	lease_len = 0;
	lease_deadline = 0;
	nagged = 0;
}
