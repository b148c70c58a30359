/* Which device each shadow context is on, and which one a rebuild reopens
 * it on (docs/native-shim.md, "Several devices per process").
 *
 * A process may hold contexts on several devices (multi-rail: NCCL and UCX
 * open 2 to 8), and a restored pod may be given its devices under other
 * names or in another order.  So each context remembers its device's name
 * and its index in the device list (the order the container was given its
 * devices), and a rebuild chooses, for every context before it opens any:
 *   (a) the node agent's explicit map (`devmap <old> <new>`), else
 *   (b) IBCKPT_DEVICE, when every context was on one device, else
 *   (c) the device of the same name, else
 *   (d) the device at the same index, else
 *   (e) none: the rebuild is refused, naming the device, its index and the
 *       devices there are.
 * Contexts that were on different devices are never put on one: that is
 * refused too.  "Any device" is never a choice: with several it is wrong. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "devmap.h"
#include "phase.h"
#include "shim.h"

#define IBK_DEVMAP_MAX 64 /* pairs: more devices than a node has */
#define QNAME (IBV_SYSFS_NAME_MAX * 6) /* a name escaped for JSON at worst */

/* The explicit map: written by the devmap command and read by a rebuild,
 * both under the commands' lock, one at a time. */
static struct {
	char from[IBV_SYSFS_NAME_MAX], to[IBV_SYSFS_NAME_MAX];
} devmap[IBK_DEVMAP_MAX];
static int ndevmap;

void ibk_json_str(char *dst, size_t len, const char *s)
{
	size_t o = 0;

	for (; *s && o + 7 < len; s++) {
		unsigned char c = (unsigned char)*s;

		if (c == '"' || c == '\\') {
			dst[o++] = '\\';
			dst[o++] = (char)c;
		} else if (c < 0x20 || c >= 0x7f) { /* the reply must stay ASCII JSON */
			o += (size_t)snprintf(dst + o, len - o, "\\u%04x", c);
		} else {
			dst[o++] = (char)c;
		}
	}
	if (len)
		dst[o] = 0;
}

/* The device's name now.  libibverbs names a device once, when it first
 * lists it, and keeps it as long as its uverbs file and kernel index stay
 * the same: a device renamed since (or, after a restore, another device
 * behind the same uverbs file) keeps the old name there.  The uverbs file's
 * ibdev attribute is the kernel's name of the moment. */
static void dev_name_now(struct ibv_device *dev, char name[IBV_SYSFS_NAME_MAX])
{
	char path[IBV_SYSFS_PATH_MAX + 64], line[IBV_SYSFS_NAME_MAX];
	FILE *f;

	snprintf(name, IBV_SYSFS_NAME_MAX, "%s", ibk_real.get_device_name(dev));
	snprintf(path, sizeof(path), "/sys/class/infiniband_verbs/%s/ibdev", dev->dev_name);
	f = fopen(path, "re");
	if (!f)
		return;
	if (fgets(line, sizeof(line), f) && line[0] != '\n') {
		line[strcspn(line, "\n")] = 0;
		memcpy(name, line, sizeof(line));
	}
	fclose(f);
}

static struct ibk_devlist *devlist_get(void)
{
	struct ibk_devlist *d = calloc(1, sizeof(*d));
	int i;

	if (!d)
		return NULL;
	d->list = ibk_real.get_device_list(&d->n);
	if (!d->list) {
		free(d);
		return NULL;
	}
	d->names = calloc((size_t)d->n + 1, sizeof(*d->names));
	if (!d->names) {
		ibk_real.free_device_list(d->list);
		free(d);
		return NULL;
	}
	for (i = 0; i < d->n; i++)
		dev_name_now(d->list[i], d->names[i]);
	d->refs = 1;
	return d;
}

void ibk_devlist_put(struct ibk_devlist *d)
{
	if (d && --d->refs == 0) {
		ibk_real.free_device_list(d->list);
		free(d->names);
		free(d);
	}
}

static int find_name(const struct ibk_devlist *d, const char *name)
{
	int i;

	for (i = 0; i < d->n; i++)
		if (!strcmp(d->names[i], name))
			return i;
	return -1;
}

void ibk_ctx_place(struct ibk_ctx *ctx, struct ibv_device *dev)
{
	struct ibk_devlist *d = devlist_get();
	int i;

	ctx->devs = d;
	ctx->dev_index = -1;
	for (i = 0; d && i < d->n && ctx->dev_index < 0; i++)
		if (d->list[i] == dev)
			ctx->dev_index = i;
	if (ctx->dev_index >= 0)
		snprintf(ctx->dev_name, sizeof(ctx->dev_name), "%s", d->names[ctx->dev_index]);
	else if (d) /* a struct of an older listing: its name */
		ctx->dev_index = find_name(d, ctx->dev_name);
}

/* "rxe0 (index 0), rxe1 (index 1)", or "none" */
static void present(const struct ibk_devlist *d, char *buf, size_t len)
{
	char q[QNAME];
	size_t o = 0;
	int i;

	buf[0] = 0;
	for (i = 0; i < d->n && o < len; i++) {
		ibk_json_str(q, sizeof(q), d->names[i]);
		o += (size_t)snprintf(buf + o, len - o, "%s%s (index %d)", i ? ", " : "", q, i);
	}
	if (!d->n)
		snprintf(buf, len, "none");
}

static const char *mapped(const char *from)
{
	int i;

	for (i = 0; i < ndevmap; i++)
		if (!strcmp(devmap[i].from, from))
			return devmap[i].to;
	return NULL;
}

/* Step (a) to (e) for one context: the index in now, or -1 with why set. */
static int choose(const struct ibk_ctx *ctx, const struct ibk_devlist *now, const char *env, const char **how,
		  char *why, size_t len)
{
	const char *to = mapped(ctx->dev_name);
	char q[QNAME], qto[QNAME], there[1024];
	int i;

	if (to) {
		*how = "devmap";
		i = find_name(now, to);
		if (i >= 0)
			return i;
	} else {
		if (env && (i = find_name(now, env)) >= 0) {
			*how = "IBCKPT_DEVICE";
			return i;
		}
		*how = "name";
		if ((i = find_name(now, ctx->dev_name)) >= 0)
			return i;
		*how = "index";
		if (ctx->dev_index >= 0 && ctx->dev_index < now->n)
			return ctx->dev_index;
	}
	present(now, there, sizeof(there));
	ibk_json_str(q, sizeof(q), ctx->dev_name);
	if (to) {
		ibk_json_str(qto, sizeof(qto), to);
		snprintf(why, len,
			 "the devmap puts the context on %s (index %d) on %s, and no device has that name "
			 "(devices now: %s)",
			 q, ctx->dev_index, qto, there);
	} else {
		snprintf(why, len,
			 "no device for the context on %s (index %d): no devmap entry for it, and no device "
			 "has its name or its index (devices now: %s)",
			 q, ctx->dev_index, there);
	}
	return -1;
}

int ibk_devmap_plan(struct ibk_devlist **nowp, char *why, size_t len)
{
	const char *env = getenv("IBCKPT_DEVICE"), *how;
	struct ibk_ctx *ctx, *other;
	struct ibk_devlist *now;
	int one_device = 1;
	char q[3][QNAME];

	*nowp = NULL;
	why[0] = 0;
	if (!ibk_ctx_list)
		return 0;
	for (ctx = ibk_ctx_list; ctx; ctx = ctx->next_ctx)
		one_device &= ctx->dev == ibk_ctx_list->dev;
	if (env && !*env)
		env = NULL;
	if (env && !one_device) {
		ibk_log("rebuild: IBCKPT_DEVICE=%s is not used: this process has contexts on several devices", env);
		env = NULL;
	}
	now = devlist_get();
	if (!now) {
		snprintf(why, len, "no device list from libibverbs: %s", strerror(errno));
		goto refuse;
	}
	for (ctx = ibk_ctx_list; ctx; ctx = ctx->next_ctx) {
		ctx->plan_index = choose(ctx, now, env, &how, why, len);
		if (ctx->plan_index < 0)
			goto refuse;
		if (strcmp(ctx->dev_name, now->names[ctx->plan_index]) || ctx->dev_index != ctx->plan_index)
			ibk_log("rebuild: the context on %s (index %d) reopens on %s (index %d), by %s", ctx->dev_name,
				ctx->dev_index, now->names[ctx->plan_index], ctx->plan_index, how);
	}
	for (ctx = ibk_ctx_list; ctx; ctx = ctx->next_ctx)
		for (other = ctx->next_ctx; other; other = other->next_ctx) {
			if (other->dev == ctx->dev || other->plan_index != ctx->plan_index)
				continue;
			ibk_json_str(q[0], sizeof(q[0]), other->dev_name);
			ibk_json_str(q[1], sizeof(q[1]), ctx->dev_name);
			ibk_json_str(q[2], sizeof(q[2]), now->names[ctx->plan_index]);
			snprintf(why, len,
				 "the contexts on %s (index %d) and on %s (index %d) would both reopen on %s (index %d): "
				 "contexts on different devices are never put on one",
				 q[0], other->dev_index, q[1], ctx->dev_index, q[2], ctx->plan_index);
			goto refuse;
		}
	*nowp = now;
	return 0;
refuse:
	ibk_log("rebuild refused, nothing opened: %s", why);
	ibk_devlist_put(now);
	return -1;
}

void ibk_ctx_moved(struct ibk_ctx *ctx, struct ibk_devlist *now)
{
	struct ibv_device *dev = now->list[ctx->plan_index];
	struct ibk_devlist *old = ctx->devs;

	now->refs++;
	ctx->devs = now;
	ctx->dev = dev;
	ctx->dev_index = ctx->plan_index;
	snprintf(ctx->dev_name, sizeof(ctx->dev_name), "%s", now->names[ctx->plan_index]);
	/* the app's context->device is the device it is on from now on; the
	 * old struct goes only after that, with the list that held it */
	ctx->vctx.context.device = dev;
	ibk_devlist_put(old);
}

void ibk_devmap_consumed(void)
{
	ndevmap = 0;
}

int ibk_do_devmap(const char *from, const char *to, char *out, size_t len)
{
	long t0 = ibk_ms_now();
	char q[2][QNAME];
	int i = 0, full = 0;

	if (!strcmp(from, "-")) {
		ndevmap = 0;
	} else {
		while (i < ndevmap && strcmp(devmap[i].from, from))
			i++;
		full = i == IBK_DEVMAP_MAX;
		if (!full) { /* a device named again is mapped anew */
			snprintf(devmap[i].from, sizeof(devmap[i].from), "%s", from);
			snprintf(devmap[i].to, sizeof(devmap[i].to), "%s", to);
			ndevmap += i == ndevmap;
		}
	}
	ibk_report_begin(out, len, "devmap", !full, t0);
	if (full)
		ibk_jcat(out, len, ",\"error\":\"the map holds %d devices at most\"", IBK_DEVMAP_MAX);
	ibk_jcat(out, len, ",\"devmap\":[");
	for (i = 0; i < ndevmap; i++) {
		ibk_json_str(q[0], sizeof(q[0]), devmap[i].from);
		ibk_json_str(q[1], sizeof(q[1]), devmap[i].to);
		ibk_jcat(out, len, "%s{\"from\":\"%s\",\"to\":\"%s\"}", i ? "," : "", q[0], q[1]);
	}
	ibk_jcat(out, len, "]}");
	return full ? -E2BIG : 0;
}
