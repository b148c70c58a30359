/* Which device each shadow context is on, and which one a rebuild reopens
 * it on (devmap.c; the rule is in docs/native-shim.md, "Several devices"). */
#ifndef IBK_DEVMAP_H
#define IBK_DEVMAP_H

#include <stddef.h>

#include <infiniband/verbs.h>

#pragma GCC visibility push(hidden)

struct ibk_ctx;

/* A device list of libibverbs' kept by the shim, shared by the contexts
 * whose device is in it.  Each listed device stays allocated while it is
 * held, so a context's `device` (the app's ibv_get_device_name reads it)
 * never dangles, even while released and after the device was renamed or
 * removed.  Counted under ibk_ctx_lock (or before the context is listed). */
struct ibk_devlist {
	struct ibv_device **list;
	char (*names)[IBV_SYSFS_NAME_MAX]; /* each one's name when listed */
	int n;
	int refs;
};

void ibk_devlist_put(struct ibk_devlist *d);

/* At open: hold the current device list and find dev in it, so the context
 * knows its name and its index among the devices (-1 if dev is not listed). */
void ibk_ctx_place(struct ibk_ctx *ctx, struct ibv_device *dev);

/* rebuild: choose the device of every context before any is opened.  0 with
 * each context's plan_index set in *now (held, 1 ref per context), or -1
 * with why filled (nothing was opened or changed). */
int ibk_devmap_plan(struct ibk_devlist **now, char *why, size_t len);
/* rebuild: ctx is open on now->list[ctx->plan_index]: it is its device now */
void ibk_ctx_moved(struct ibk_ctx *ctx, struct ibk_devlist *now);
/* a rebuild went well: the explicit map served it (the next one's is new) */
void ibk_devmap_consumed(void);

/* the control command: devmap <old> <new> adds a pair; old "-" empties it */
int ibk_do_devmap(const char *old, const char *new_name, char *out, size_t len);

/* status (report.c): ,"contexts":[{"device","index","gids","real_gids"}...],
 * oldest first */
void ibk_report_contexts(char *out, size_t len);

/* s as the inside of a JSON string, cut to fit dst */
void ibk_json_str(char *dst, size_t len, const char *s);

#pragma GCC visibility pop

#endif
