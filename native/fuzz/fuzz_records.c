/* libFuzzer target: the rebuild-record parser (src/records.c).  Any bytes
 * parse or fail cleanly; what parses formats back to the same record. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "records.h"

static void check(int cond)
{
	if (!cond)
		abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *val = malloc(size + 1), head[128];
	struct ibk_record r, again;
	int kind;

	if (!val)
		return 0;
	memcpy(val, data, size);
	val[size] = 0;
	for (kind = 0; kind < 2; kind++) {
		uint32_t v, rk;
		const char *p;
		size_t i;

		if (ibk_record_parse(val, kind, &r))
			continue;
		/* the keys are read without running past the value */
		for (p = r.keys, i = 0; kind && i < r.nkeys && ibk_record_next_key(&p, &v, &rk); i++)
			check(p > val && p <= val + size);
		/* the head formats back to what was parsed */
		ibk_record_head(head, sizeof(head), &r);
		check(ibk_record_parse(head, 0, &again) == 0);
		check(!memcmp(&again.rgid, &r.rgid, sizeof(r.rgid)) && again.rlid == r.rlid && again.rqpn == r.rqpn);
	}
	free(val);
	return 0;
}
