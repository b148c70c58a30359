/* libFuzzer target: the control protocol's input side (src/cmdline.c).
 * The bytes arrive in reads of the sizes a peer would choose (taken from
 * the input itself); every complete line is parsed as a command. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cmdline.h"

static void check(int cond)
{
	if (!cond)
		abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct ibk_linebuf lb;
	size_t off = 0;

	memset(&lb, 0, sizeof(lb));
	while (off < size) {
		size_t room, chunk = 1 + data[off] % 64;
		char *space = ibk_linebuf_space(&lb, &room), *line;

		off++;
		if (!room)
			return 0; /* the client would be dropped here */
		if (chunk > room)
			chunk = room;
		if (chunk > size - off)
			chunk = size - off;
		memcpy(space, data + off, chunk);
		off += chunk;
		ibk_linebuf_added(&lb, chunk);
		while ((line = ibk_linebuf_line(&lb))) {
			struct ibk_cmd c;

			check(strlen(line) < IBK_CMD_MAX);
			if (ibk_command_parse(line, &c))
				check(c.error != NULL);
			else
				check(c.verb >= IBK_CMD_HELLO && c.verb <= IBK_CMD_LAST && c.nargs <= 2 &&
				      (c.verb != IBK_CMD_ITIMER || c.nargs == 2) &&
				      (c.verb != IBK_CMD_RESERVE || c.nargs >= 1) &&
				      (c.verb != IBK_CMD_DEVMAP ||
				       (c.nargs >= 1 && strlen(c.name[0]) < IBK_NAME_MAX &&
					strlen(c.name[1]) < IBK_NAME_MAX && !strchr(c.name[0], ' '))));
		}
	}
	return 0;
}
