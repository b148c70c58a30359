/* The control protocol's input side: lines, then commands.  Pure, fuzzed
 * on the host (native/fuzz). */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "cmdline.h"

char *ibk_linebuf_space(struct ibk_linebuf *lb, size_t *room)
{
	if (lb->used) { /* drop the lines already handed out */
		memmove(lb->buf, lb->buf + lb->used, lb->got - lb->used);
		lb->got -= lb->used;
		lb->used = 0;
	}
	/* one byte stays free for the NUL that ends a line */
	*room = sizeof(lb->buf) - 1 - lb->got;
	return lb->buf + lb->got;
}

void ibk_linebuf_added(struct ibk_linebuf *lb, size_t n)
{
	lb->got += n;
}

char *ibk_linebuf_line(struct ibk_linebuf *lb)
{
	char *start = lb->buf + lb->used, *nl = memchr(start, '\n', lb->got - lb->used);

	if (!nl)
		return NULL;
	*nl = 0;
	lb->used = (size_t)(nl + 1 - lb->buf);
	return start;
}

static const struct {
	const char *name;
	enum ibk_verb verb;
} verbs[] = {
	{"hello", IBK_CMD_HELLO},	{"status", IBK_CMD_STATUS},   {"quiesce", IBK_CMD_QUIESCE},
	{"drain", IBK_CMD_DRAIN},	{"release", IBK_CMD_RELEASE}, {"rebuild", IBK_CMD_REBUILD},
	{"resume", IBK_CMD_RESUME}, {"abort", IBK_CMD_ABORT},	      {"lease", IBK_CMD_LEASE},
	{"itimer", IBK_CMD_ITIMER},	{"reserve", IBK_CMD_RESERVE}, {"devmap", IBK_CMD_DEVMAP},
};

/* The words after the verb into c->name: their count, or -1 for a word
 * longer than a device name or more than two words. */
static int name_words(const char *p, struct ibk_cmd *c)
{
	int n = 0;

	while (isspace((unsigned char)*p))
		p++;
	while (*p && !isspace((unsigned char)*p)) /* the verb */
		p++;
	for (;;) {
		size_t w;

		while (isspace((unsigned char)*p))
			p++;
		if (!*p)
			return n;
		for (w = 0; p[w] && !isspace((unsigned char)p[w]); w++)
			;
		if (n == 2 || w >= IBK_NAME_MAX)
			return -1;
		memcpy(c->name[n], p, w);
		c->name[n++][w] = 0;
		p += w;
	}
}

int ibk_command_parse(const char *line, struct ibk_cmd *c)
{
	char verb[32] = "";
	int n = sscanf(line, "%31s %llu %ld", verb, &c->a, &c->b);
	size_t i;

	c->verb = 0;
	c->error = NULL;
	c->name[0][0] = c->name[1][0] = 0;
	c->nargs = n > 1 ? n - 1 : 0;
	c->quiet = strstr(line, " quiet") != NULL;
	if (n < 1) {
		c->error = "empty command";
		return -1;
	}
	for (i = 0; i < sizeof(verbs) / sizeof(verbs[0]); i++)
		if (!strcmp(verb, verbs[i].name))
			c->verb = verbs[i].verb;
	if (!c->verb) {
		c->error = "unknown command";
		return -1;
	}
	if (c->verb == IBK_CMD_REBUILD && c->nargs < 1) {
		c->error = "rebuild needs an epoch";
		return -1;
	}
	if (c->verb == IBK_CMD_ITIMER && c->nargs < 2) {
		c->error = "itimer needs which and us";
		return -1;
	}
	if (c->verb == IBK_CMD_RESERVE && c->nargs < 1) {
		c->error = "reserve needs a QPN";
		return -1;
	}
	if (c->verb == IBK_CMD_DEVMAP) {
		int n = name_words(line, c);

		c->nargs = n < 0 ? 0 : n;
		if (!(n == 2 && strcmp(c->name[0], "-")) && !(n == 1 && !strcmp(c->name[0], "-"))) {
			c->error = "devmap needs <old device> <new device> (names of at most 63 characters), or -";
			return -1;
		}
	}
	if (c->verb == IBK_CMD_LEASE && c->nargs < 1) {
		c->error = "lease needs ms";
		return -1;
	}
	return 0;
}
