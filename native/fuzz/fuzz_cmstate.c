/* libFuzzer target: how the shim follows librdmacm's ids (src/cmstate.c),
 * fed a stream of commands and events as an app (commands) and the kernel
 * (events) could write them.  Each step: one byte of kind, a little-endian
 * u32 (command number and new handle, or handle for a forget), a
 * little-endian u16 of length, then that many bytes of body.  No step may crash; the table keeps one entry per
 * handle, its states known and its size within its capacity. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cmstate.h"

static void check(int cond)
{
	if (!cond)
		abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct ibk_cm_ids ids = { 0 };
	size_t at = 0;

	while (at + 7 <= size) {
		uint8_t kind = data[at];
		uint16_t len;
		uint32_t word;
		uint8_t *body;
		uint32_t i, j;

		memcpy(&word, data + at + 1, sizeof(word));
		memcpy(&len, data + at + 5, sizeof(len));
		at += 7;
		if (len > size - at)
			len = (uint16_t)(size - at);
		/* a copy of exactly len bytes: ASan sees any read past it */
		body = malloc(len ? len : 1);
		if (!body)
			break;
		memcpy(body, data + at, len);
		at += len;
		switch (kind % 3) {
		case 0:
			ibk_cm_on_cmd(&ids, word % 32, body, len, word >> 8);
			break;
		case 1:
			ibk_cm_on_event(&ids, body, len);
			break;
		default:
			ibk_cm_forget(&ids, word);
			break;
		}
		free(body);
		check(ids.n <= ids.cap);
		for (i = 0; i < ids.n; i++) {
			check(ids.v[i].state >= IBK_CM_IDLE && ids.v[i].state <= IBK_CM_MCAST);
			check(ibk_cm_state_name(ids.v[i].state)[0] != '?');
			for (j = i + 1; j < ids.n; j++)
				check(ids.v[i].handle != ids.v[j].handle);
		}
	}
	ibk_cm_ids_fini(&ids);
	return 0;
}
