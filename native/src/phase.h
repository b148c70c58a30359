/* The phase state and the head of every reply (phase.c): which phase the
 * process is in, and the one-line JSON writer every phase and the status
 * command use.  Leans on nothing else of the shim. */
#ifndef IBK_PHASE_H
#define IBK_PHASE_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#pragma GCC visibility push(hidden)

enum ibk_phase {
	IBK_RUNNING = 0,
	IBK_QUIESCED,
	IBK_DRAINED,
	IBK_RELEASED,
	IBK_REBUILT,
};

/* Written by the phases on the control thread, one at a time. */
extern enum ibk_phase ibk_phase_cur;
extern uint64_t ibk_last_epoch;
extern unsigned long ibk_checkpoints_done;

const char *ibk_phase_name(enum ibk_phase p);
enum ibk_phase ibk_phase_now(void);

static inline long ibk_ms_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Append to a report buffer, never overflowing it. */
void ibk_jcat(char *out, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* A reply's head: {"phase":name,"ok":..,"ms":since t0,"state":the phase now */
void ibk_report_begin(char *out, size_t len, const char *name, int ok, long t0);

#pragma GCC visibility pop

#endif
