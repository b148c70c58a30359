/* The control commands: one line in, one JSON report out, whether they come
 * over the control socket or through ibckpt_control().  One at a time.
 *   hello | status | quiesce [ms] | drain [ms [stall_ms]] | release [ms] [quiet]
 *   rebuild <epoch> [ms] | resume | abort                                   */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ibckpt.h"
#include "shim.h"

/* A report is a few hundred bytes per object: the reply buffer is sized
 * for the objects there are, so 2,048 QPs per rank fit (docs/wire-formats.md). */
#define REPLY_BASE (64 * 1024)
#define REPLY_PER_OBJ 1024

static pthread_mutex_t cmd_lock = PTHREAD_MUTEX_INITIALIZER;

static int run_command(const char *line, char *out, size_t len)
{
	char verb[32] = "";
	unsigned long long a = 0;
	long b = 0;
	int n = sscanf(line, "%31s %llu %ld", verb, &a, &b);
	int rc;

	pthread_mutex_lock(&cmd_lock);
	if (n < 1)
		rc = (snprintf(out, len, "{\"error\":\"empty command\"}"), -EINVAL);
	else if (!strcmp(verb, "hello"))
		rc = (snprintf(out, len, "{\"proto\":%d,\"api\":%d,\"pid\":%d}", IBCKPT_PROTO_VERSION,
			       IBCKPT_API_VERSION, (int)getpid()),
		      0);
	else if (!strcmp(verb, "status"))
		rc = ibk_do_status(out, len);
	else if (!strcmp(verb, "quiesce"))
		rc = ibk_do_quiesce(n >= 2 ? (int)a : 10000, out, len);
	else if (!strcmp(verb, "drain"))
		rc = ibk_do_drain(n >= 2 ? (int)a : 10000, n >= 3 ? (int)b : IBK_DRAIN_STALL_MS, out, len);
	else if (!strcmp(verb, "release"))
		rc = ibk_do_release(n >= 2 ? (int)a : 10000, strstr(line, " quiet") != NULL, out, len);
	else if (!strcmp(verb, "rebuild"))
		rc = n >= 2 ? ibk_do_rebuild(a, n >= 3 ? (int)b : 30000, out, len)
			    : (snprintf(out, len, "{\"error\":\"rebuild needs an epoch\"}"), -EINVAL);
	else if (!strcmp(verb, "resume"))
		rc = ibk_do_resume(out, len);
	else if (!strcmp(verb, "abort"))
		rc = ibk_do_abort(out, len);
	else
		rc = (snprintf(out, len, "{\"error\":\"unknown command\"}"), -EINVAL);
	pthread_mutex_unlock(&cmd_lock);
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
