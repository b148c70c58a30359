/* redirty: mark for a dump every page the NIC may have written.
 *
 * A pre-dump copies the process's memory while it runs, and the final dump
 * copies again only the pages the kernel saw written since (soft-dirty
 * bits in the page tables). The NIC writes registered memory (receives,
 * RDMA WRITEs and READ responses, atomics) without those page tables, so
 * such a page could keep the pre-dump's stale copy. At release, once no QP
 * can write any more, every page of an MR the device may write is written
 * once by the CPU with its own value (an atomic compare-and-swap), which
 * sets its soft-dirty bit. Without a pre-dump this only costs a pass over the MRs.
 *
 * Only pages the process may write can be touched: an MR range that is now
 * not writable (mprotect after registration) is counted as missed, and the
 * node agent then dumps that process without its pre-dump. */
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include "phases.h"

/* A write of a byte's own value, atomic so that no concurrent store of the
 * app's is lost. Not an OR of zero: compilers drop that as a no-op. A
 * compare-and-swap that fails found the byte written since, which marked
 * the page already. */
static void write_same(volatile unsigned char *p)
{
	unsigned char v = __atomic_load_n(p, __ATOMIC_RELAXED);

	__atomic_compare_exchange_n(p, &v, v, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

/* The writable parts of [start, end) per /proc/self/maps, touched; the
 * number of bytes of the range not writable is added to *missed. */
static size_t touch_writable(FILE *maps, uintptr_t start, uintptr_t end, size_t page, size_t *missed)
{
	unsigned long lo, hi;
	uintptr_t covered = start;
	char line[512], perms[5];
	size_t touched = 0;

	rewind(maps);
	while (covered < end && fgets(line, sizeof(line), maps)) {
		if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) != 3 || hi <= covered || lo >= end)
			continue;
		if (lo > covered) { /* a hole: nothing mapped there */
			*missed += lo - covered;
			covered = lo;
		}
		if (hi > end)
			hi = end;
		if (perms[1] != 'w') {
			*missed += hi - covered;
		} else {
			/* one byte of each page: the first page from `covered` on */
			for (uintptr_t p = covered; p < hi; p = (p | (page - 1)) + 1, touched++)
				write_same((volatile unsigned char *)p);
		}
		covered = hi;
	}
	if (covered < end)
		*missed += end - covered;
	return touched;
}

void ibk_redirty_mrs(struct ibk_redirty *out)
{
	size_t page = (size_t)sysconf(_SC_PAGESIZE);
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	FILE *maps = NULL;

	out->pages = 0;
	out->missed_bytes = 0;
	FOR_EACH_CTX(ctx)
	FOR_EACH_OBJ(ctx, o)
	{
		struct ibk_mr *mr;
		uintptr_t start;

		if (o->kind != IBK_MR)
			continue;
		mr = IBK_OBJ(o, ibk_mr);
		/* remote write and atomics require local write: one bit says it */
		if (!(mr->access & IBV_ACCESS_LOCAL_WRITE) || !mr->pub.length)
			continue;
		if (!maps && !(maps = fopen("/proc/self/maps", "r"))) {
			out->missed_bytes += mr->pub.length;
			continue;
		}
		start = (uintptr_t)mr->pub.addr;
		out->pages += touch_writable(maps, start, start + mr->pub.length, page, &out->missed_bytes);
	}
	if (maps)
		fclose(maps);
}
