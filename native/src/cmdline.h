/* The control protocol's input side, pure so it is fuzzed on the host:
 * framing bytes into lines, and one line into a command (cmdline.c). */
#ifndef IBK_CMDLINE_H
#define IBK_CMDLINE_H

#include <stddef.h>

#pragma GCC visibility push(hidden)

#define IBK_CMD_MAX 256 /* the longest line a command can be, newline included */

struct ibk_linebuf {
	size_t got;  /* bytes in buf */
	size_t used; /* bytes of buf already handed out as lines */
	char buf[IBK_CMD_MAX];
};

/* Where to read more bytes, and how many fit; 0 when the pending line is
 * longer than any command (the client is then dropped). */
char *ibk_linebuf_space(struct ibk_linebuf *lb, size_t *room);
void ibk_linebuf_added(struct ibk_linebuf *lb, size_t n);
/* The next complete line without its newline, or NULL; valid until the
 * next call on lb. */
char *ibk_linebuf_line(struct ibk_linebuf *lb);

enum ibk_verb { IBK_CMD_HELLO = 1, IBK_CMD_STATUS, IBK_CMD_QUIESCE, IBK_CMD_DRAIN, IBK_CMD_RELEASE,
		IBK_CMD_REBUILD, IBK_CMD_RESUME, IBK_CMD_ABORT, IBK_CMD_LEASE, IBK_CMD_ITIMER,
		IBK_CMD_RESERVE, IBK_CMD_DEVMAP, IBK_CMD_LAST = IBK_CMD_DEVMAP };

#define IBK_NAME_MAX 64 /* a device name and its NUL (the kernel's IB_DEVICE_NAME_MAX) */

struct ibk_cmd {
	enum ibk_verb verb;
	int nargs;            /* numbers given after the verb, at most 2 */
	unsigned long long a; /* timeout ms, rebuild's epoch, lease ms, itimer's which, or a QPN */
	long b;               /* drain's stall ms, rebuild's timeout ms, itimer's us, or a count */
	int quiet;            /* release ... quiet */
	char name[2][IBK_NAME_MAX]; /* devmap's old and new device names ("-" alone empties) */
	const char *error;    /* when the line is not a command */
};

/* 0 and *c filled, or -1 with c->error set. */
int ibk_command_parse(const char *line, struct ibk_cmd *c);

#pragma GCC visibility pop

#endif
