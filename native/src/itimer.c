/* itimer <which> <us>: arm a one-shot interval timer the restore lost.
 *
 * CRIU before 4.1 restores ITIMER_REAL, _VIRTUAL and _PROF only when they
 * have an interval: a one-shot timer (alarm(), perftest's phase chain) is
 * dumped with its remaining time and then dropped.  The node agent reads
 * that time from the images and asks the restored rank, before it resumes,
 * to arm the timer with it.  A timer armed already (a CRIU that restored it,
 * or the app armed it again) is left alone. */
#include <errno.h>
#include <sys/time.h>

#include "phases.h"

#define MAX_ITIMER_US (86400LL * 365 * 1000000) /* a year: more is not a dumped timer */

int ibk_do_itimer(long which, long long us, char *out, size_t len)
{
	static const int kinds[] = {ITIMER_REAL, ITIMER_VIRTUAL, ITIMER_PROF};
	struct itimerval cur, set = {{0, 0}, {0, 0}};
	long t0 = ibk_ms_now();
	int armed = 0;

	if (which < 0 || which > 2 || us <= 0 || us > MAX_ITIMER_US) {
		ibk_report_begin(out, len, "itimer", 0, t0);
		ibk_jcat(out, len, ",\"error\":\"itimer is 0|1|2 (real, virtual, prof) and 1 us to a year\"}");
		return -EINVAL;
	}
	if (getitimer(kinds[which], &cur) == 0 && !cur.it_value.tv_sec && !cur.it_value.tv_usec) {
		set.it_value.tv_sec = (time_t)(us / 1000000);
		set.it_value.tv_usec = (suseconds_t)(us % 1000000);
		armed = setitimer(kinds[which], &set, NULL) == 0;
		if (armed)
			ibk_log("itimer %ld armed again for %lld us (lost by the restore)", which, us);
	}
	ibk_report_begin(out, len, "itimer", 1, t0);
	ibk_jcat(out, len, ",\"which\":%ld,\"armed\":%s}", which, armed ? "true" : "false");
	return 0;
}
