/* The control commands: one line in, one JSON report out, whether they come
 * over the control socket or through ibckpt_control().  One at a time.
 *   hello | status | quiesce [ms] | drain [ms [stall_ms]] | release [ms] [quiet]
 *   rebuild <epoch> [ms] | resume | abort | lease <ms> | itimer <which> <us>
 *   reserve <qpn> [count] | devmap <old> <new> | devmap - */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cmdline.h"
#include "devmap.h"
#include "devthread.h"
#include "ibckpt.h"
#include "lease.h"
#include "phases.h"
#include "rdmacm.h"
#include "reserve.h"

/* A report is a few hundred bytes per object: the reply buffer is sized
 * for the objects there are, so 2,048 QPs per rank fit (docs/wire-formats.md). */
#define REPLY_BASE (64 * 1024)
#define REPLY_PER_OBJ 1024

pthread_mutex_t ibk_cmd_lock = PTHREAD_MUTEX_INITIALIZER;

/* status: every subsystem's part of the report, under the context list's lock */
static int do_status(char *out, size_t len)
{
	out[0] = 0;
	pthread_mutex_lock(&ibk_ctx_lock);
	ibk_jcat(out, len,
	     "{\"proto\":%d,\"pid\":%d,\"state\":\"%s\",\"epoch\":%llu,\"checkpoints\":%lu,"
	     "\"gate_closed\":%d,\"inside\":%ld,\"delegated_writes\":%lu,\"reserved_qpns\":%zu,",
	     IBCKPT_PROTO_VERSION, (int)getpid(), ibk_phase_name(ibk_phase_cur), (unsigned long long)ibk_last_epoch,
	     ibk_checkpoints_done, ibk_gate_is_closed(), ibk_gate_inside(),
	     ibk_devthread_writes(), ibk_reserve_count());
	ibk_lease_report(out, len);
	ibk_report_qps(out, len);
	ibk_report_identity(out, len);
	ibk_report_contexts(out, len);
	ibk_cm_report(out, len);
	ibk_jcat(out, len, "}");
	pthread_mutex_unlock(&ibk_ctx_lock);
	return 0;
}

static int run_command(const char *line, char *out, size_t len)
{
	struct ibk_cmd c;
	enum ibk_phase before;
	long t0;
	int rc;

	if (ibk_command_parse(line, &c)) {
		snprintf(out, len, "{\"error\":\"%s\"}", c.error);
		return -EINVAL;
	}
	pthread_mutex_lock(&ibk_cmd_lock);
	t0 = ibk_ms_now();
	before = ibk_phase_now();
	switch (c.verb) {
	case IBK_CMD_HELLO:
		snprintf(out, len, "{\"proto\":%d,\"api\":%d,\"pid\":%d}", IBCKPT_PROTO_VERSION, IBCKPT_API_VERSION,
			 (int)getpid());
		rc = 0;
		break;
	case IBK_CMD_STATUS:
		rc = do_status(out, len);
		break;
	case IBK_CMD_QUIESCE:
		rc = ibk_do_quiesce(c.nargs >= 1 ? (int)c.a : 10000, out, len);
		if (!rc) /* an agent that dies right after this cannot hold the app for ever */
			ibk_lease_quiesced();
		break;
	case IBK_CMD_DRAIN:
		rc = ibk_do_drain(c.nargs >= 1 ? (int)c.a : 10000, c.nargs >= 2 ? (int)c.b : IBK_DRAIN_STALL_MS, out,
				  len);
		break;
	case IBK_CMD_RELEASE:
		rc = ibk_do_release(c.nargs >= 1 ? (int)c.a : 10000, c.quiet, out, len);
		break;
	case IBK_CMD_REBUILD:
		rc = ibk_do_rebuild(c.a, c.nargs >= 2 ? (int)c.b : 30000, out, len);
		break;
	case IBK_CMD_RESUME:
		rc = ibk_do_resume(out, len);
		break;
	case IBK_CMD_LEASE:
		rc = ibk_do_lease(c.a > 86400000ULL ? -1 : (long)c.a, out, len);
		break;
	case IBK_CMD_ITIMER:
		rc = ibk_do_itimer(c.a > 2 ? -1 : (long)c.a, c.b, out, len);
		break;
	case IBK_CMD_RESERVE:
		rc = ibk_do_reserve(c.a, c.nargs >= 2 ? c.b : 1, out, len);
		break;
	case IBK_CMD_DEVMAP:
		rc = ibk_do_devmap(c.name[0], c.name[1], out, len);
		break;
	case IBK_CMD_ABORT:
	default:
		rc = ibk_do_abort(out, len);
		break;
	}
	ibk_lease_after_command(t0, before);
	pthread_mutex_unlock(&ibk_cmd_lock);
	return rc;
}

static size_t reply_size(void)
{
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	size_t n = 0;

	pthread_mutex_lock(&ibk_ctx_lock);
	for (ctx = ibk_ctx_list; ctx; ctx = ctx->next_ctx) {
		pthread_mutex_lock(&ctx->lock);
		for (o = ctx->head.next; o != &ctx->head; o = o->next)
			n++;
		pthread_mutex_unlock(&ctx->lock);
	}
	pthread_mutex_unlock(&ibk_ctx_lock);
	/* objects made while the command runs: room for as many again */
	return REPLY_BASE + 2 * n * REPLY_PER_OBJ;
}

/* The whole reply line for one command, malloc'd: "ok <json>\n" or
 * "err <json>\n".  A report that did not fit is an error, never a cut line. */
char *ibk_command_reply(const char *line, size_t *outlen)
{
	size_t cap = reply_size(), n;
	char *body = malloc(cap), *reply;
	int rc;

	if (!body)
		return NULL;
	body[0] = 0;
	rc = run_command(line, body, cap);
	n = strlen(body);
	if (n + 1 >= cap) {
		n = (size_t)snprintf(body, cap, "{\"error\":\"a reply of more than %zu bytes\"}", cap);
		rc = -E2BIG;
	}
	reply = malloc(n + 6);
	if (reply)
		*outlen = (size_t)snprintf(reply, n + 6, "%s %s\n", rc ? "err" : "ok", body);
	free(body);
	return reply;
}

/* ---- ibckpt.h: the in-process way in ---- */

IBK_EXPORT const char *ibckpt_phase(void)
{
	return ibk_phase_name(ibk_phase_now());
}

IBK_EXPORT int ibckpt_control(const char *cmd, char *out, size_t len)
{
	return run_command(cmd, out, len);
}
