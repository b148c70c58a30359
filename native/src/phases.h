/* What the phase files (quiesce.c, drain.c, release.c, rebuild.c, report.c)
 * share: the phase state, walks over the shadow objects and the report
 * writer.  The phases run on the control thread, one at a time. */
#ifndef IBK_PHASES_H
#define IBK_PHASES_H

#include <time.h>

#include "shim.h"

#pragma GCC visibility push(hidden)

extern enum ibk_phase ibk_phase_cur;
extern uint64_t ibk_last_epoch;
extern unsigned long ibk_checkpoints_done;

static inline long ibk_ms_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

#define FOR_EACH_CTX(ctx) for (ctx = ibk_ctx_list; ctx; ctx = ctx->next_ctx)
#define FOR_EACH_OBJ(ctx, o) for (o = (ctx)->head.next; o != &(ctx)->head; o = o->next)
#define FOR_EACH_OBJ_REV(ctx, o, p) for (o = (ctx)->head.prev, p = o->prev; o != &(ctx)->head; o = p, p = o->prev)
/* the QPs among them: qp is set for each (an if/else, so break and continue
 * act on the object loop) */
#define FOR_EACH_QP(ctx, o, qp)                                         \
	FOR_EACH_OBJ(ctx, o)                                            \
	if ((o)->kind != IBK_QP || !((qp) = IBK_OBJ(o, ibk_qp))) { \
	} else

/* report.c: append to a report buffer, never overflowing it */
void ibk_jcat(char *out, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void ibk_report_begin(char *out, size_t len, const char *name, int ok, long t0);
void ibk_report_qps(char *out, size_t len);
void ibk_report_identity(char *out, size_t len);

/* drain.c: one pass over every real CQ and channel; completions moved */
int ibk_drain_pass(void);
/* quiesce.c: reopen every QP's posts */
void ibk_posts_open(void);

#pragma GCC visibility pop

#endif
