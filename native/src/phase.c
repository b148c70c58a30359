/* The phase state the phases share, and the head of every reply: the
 * ground floor of the control side, calling nothing else of the shim. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "fork.h"
#include "phase.h"

enum ibk_phase ibk_phase_cur = IBK_RUNNING;
uint64_t ibk_last_epoch;
unsigned long ibk_checkpoints_done;

const char *ibk_phase_name(enum ibk_phase p)
{
	static const char *const names[] = {"running", "quiesced", "drained", "released", "rebuilt"};

	return names[p];
}

enum ibk_phase ibk_phase_now(void)
{
	return ibk_phase_cur;
}

void ibk_jcat(char *out, size_t len, const char *fmt, ...)
{
	size_t n = strlen(out);
	va_list ap;

	if (n + 1 >= len)
		return;
	va_start(ap, fmt);
	vsnprintf(out + n, len - n, fmt, ap);
	va_end(ap);
}

void ibk_report_begin(char *out, size_t len, const char *name, int ok, long t0)
{
	out[0] = 0;
	ibk_jcat(out, len, "{\"phase\":\"%s\",\"ok\":%s,\"ms\":%ld,\"state\":\"%s\"", name, ok ? "true" : "false",
	     ibk_ms_now() - t0, ibk_phase_name(ibk_phase_cur));
}

void ibk_phase_fork_child(void)
{
	ibk_phase_cur = IBK_RUNNING;
	ibk_last_epoch = 0;
	ibk_checkpoints_done = 0;
}
