/* What the phase files (quiesce.c, drain.c, release.c, rebuild.c, report.c)
 * share: walks over the shadow objects and the report parts; the phase
 * state and the report writer are phase.h's.  The phases run on the
 * control thread, one at a time. */
#ifndef IBK_PHASES_H
#define IBK_PHASES_H

#include "phase.h"
#include "shim.h"

#pragma GCC visibility push(hidden)

#define FOR_EACH_CTX(ctx) for (ctx = ibk_ctx_list; ctx; ctx = ctx->next_ctx)
#define FOR_EACH_OBJ(ctx, o) for (o = (ctx)->head.next; o != &(ctx)->head; o = o->next)
#define FOR_EACH_OBJ_REV(ctx, o, p) for (o = (ctx)->head.prev, p = o->prev; o != &(ctx)->head; o = p, p = o->prev)
/* the QPs among them: qp is set for each (an if/else, so break and continue
 * act on the object loop) */
#define FOR_EACH_QP(ctx, o, qp)                                         \
	FOR_EACH_OBJ(ctx, o)                                            \
	if ((o)->kind != IBK_QP || !((qp) = IBK_OBJ(o, ibk_qp))) { \
	} else

/* Each phase writes a one-line JSON report into out. 0 on success. */
int ibk_do_quiesce(int timeout_ms, char *out, size_t len);
int ibk_do_drain(int timeout_ms, int stall_ms, char *out, size_t len);
int ibk_do_release(int timeout_ms, int quiet_only, char *out, size_t len);
int ibk_do_rebuild(uint64_t epoch, int timeout_ms, char *out, size_t len);
int ibk_do_resume(char *out, size_t len);
int ibk_do_abort(char *out, size_t len);
/* itimer.c: arm a one-shot interval timer (0 real, 1 virtual, 2 prof) a restore lost */
int ibk_do_itimer(long which, long long us, char *out, size_t len);
/* drain: no completion for this long with only settleable sends left ends
 * it (the control protocol's drain takes another value) */
#define IBK_DRAIN_STALL_MS 20

/* redirty.c: at release, a CPU write to each page the device may have
 * written, so a dump after a pre-dump copies it again */
struct ibk_redirty {
	size_t pages;        /* touched */
	size_t missed_bytes; /* in MRs the device may write, not writable now */
};
void ibk_redirty_mrs(struct ibk_redirty *out);

/* report.c: the status report's walks over the objects */
void ibk_report_qps(char *out, size_t len);
void ibk_report_identity(char *out, size_t len);

/* drain.c: one pass over every real CQ and channel; completions moved */
int ibk_drain_pass(void);
/* quiesce.c: reopen every QP's posts */
void ibk_posts_open(void);

#pragma GCC visibility pop

#endif
