/* write_mem: RDMA WRITEs into memory the CPU never writes, checked after a
 * restore.  One process, two RC QPs on one device connected to each other:
 * QP a writes rounds of a pattern into a region registered for QP b, one
 * chunk after another, each page's words derived from (round, page).  The
 * CPU fills only the one-chunk source buffer and counts the writes that
 * completed.  When CHECKFILE appears it stops and checks that every page of
 * the region holds what the last completed write of it put there: a page a
 * dump took from an older copy (a pre-dump's, not marked again after the
 * device wrote it) fails the check.
 *
 *   write_mem -f CHECKFILE [-m MIB] [-c CHUNK_KIB] [-g GID_INDEX] [-d MIB -r PCT] [-n]
 *
 * With -d, the CPU also keeps a buffer of that size, of random bytes (so
 * neither compression nor dedup shrinks its image), of which it rewrites
 * PCT percent of the pages each second (a job's own dirty rate, for
 * bench/pre_dump_freeze.py and bench/large_pod.py); it is checked too,
 * every page against the dirties counted.
 * -n: no device and no region, only that buffer: the same memory as a
 * plain process, which CRIU can dump without ibckpt (the raw side).
 *
 * Prints READY once the first round completed, then "CHECK ok writes=N
 * rounds=R" or "CHECK bad page=P ..." and exits 0 or 1. */
#include <getopt.h>
#include <sys/mman.h>

#include "common.h"

#define PAGE 4096u
#define WORDS (PAGE / sizeof(uint64_t))

static uint64_t page_word(uint64_t round, uint64_t page)
{
	return mix64((round << 32) ^ page ^ 0x5157u);
}

/* The source chunk for write number n: every page of chunk n % nchunks,
 * as round n / nchunks leaves it. */
static void fill(uint64_t *src, uint64_t n, size_t nchunks, size_t chunk_pages)
{
	uint64_t round = n / nchunks, first = (n % nchunks) * chunk_pages;

	for (size_t p = 0; p < chunk_pages; p++) {
		uint64_t w = page_word(round, first + p);

		for (size_t i = 0; i < WORDS; i++)
			src[p * WORDS + i] = w;
	}
}

/* What the region must hold after `writes` completed writes; the first bad
 * page, or -1. */
static long check(const uint64_t *dst, uint64_t writes, size_t nchunks, size_t chunk_pages, uint64_t *got,
		  uint64_t *want)
{
	for (size_t c = 0; c < nchunks; c++) {
		/* the last write of chunk c: the largest n < writes with n % nchunks == c */
		int written = writes > c;
		uint64_t n = written ? c + (writes - 1 - c) / nchunks * nchunks : 0;

		for (size_t p = c * chunk_pages; p < (c + 1) * chunk_pages; p++) {
			*want = written ? page_word(n / nchunks, p) : 0;
			for (size_t i = 0; i < WORDS; i++) {
				*got = dst[p * WORDS + i];
				if (*got != *want)
					return (long)p;
			}
		}
	}
	return -1;
}

static uint64_t buffer_word(size_t i)
{
	return mix64(i ^ 0x9e3779b97f4a7c15ull);
}

/* Every page present from the start, as a job's working set, and random. */
static unsigned char *random_buffer(size_t bytes)
{
	uint64_t *words = malloc(bytes);

	if (!words)
		DIE("dirty buffer of %zu bytes", bytes);
	for (size_t i = 0; i < bytes / sizeof(uint64_t); i++)
		words[i] = buffer_word(i);
	return (unsigned char *)words;
}

/* What the buffer must hold after `done` dirties (dirty_due: one more to
 * the first byte of each page in turn); the first bad page, or -1. A page
 * a checkpoint lost, zeroed or took from an older copy fails it. */
static long check_buffer(const unsigned char *buf, size_t pages, size_t done)
{
	const uint64_t *words = (const uint64_t *)buf;

	for (size_t p = 0; p < pages; p++) {
		unsigned char first = (unsigned char)(buffer_word(p * WORDS) + done / pages + (p < done % pages));

		if (buf[p * PAGE] != first)
			return (long)p;
		for (size_t i = p * WORDS + 1; i < (p + 1) * WORDS; i++)
			if (words[i] != buffer_word(i))
				return (long)p;
		if ((words[p * WORDS] & ~(uint64_t)0xff) != (buffer_word(p * WORDS) & ~(uint64_t)0xff))
			return (long)p;
	}
	return -1;
}

/* The CPU's dirty rate: page by page through buf, `pct` percent of its
 * pages per second since `t0`, as far as is due by now. */
static void dirty_due(unsigned char *buf, size_t pages, double pct, long t0, size_t *done)
{
	size_t due = (size_t)((double)(now_ms() - t0) / 1000.0 * pct / 100.0 * (double)pages);

	for (; *done < due; (*done)++)
		buf[(*done % pages) * PAGE] += 1;
}

/* -n: dirty the buffer at its rate until CHECKFILE appears. */
static int dirty_only(const char *checkfile, unsigned char *buf, size_t pages, double pct)
{
	long t0 = now_ms();
	size_t done = 0;

	printf("READY dirty=%zu MiB\n", pages * PAGE >> 20);
	fflush(stdout);
	while (!file_exists(checkfile)) {
		dirty_due(buf, pages, pct, t0, &done);
		usleep(1000);
	}
	if (check_buffer(buf, pages, done) >= 0) {
		printf("CHECK bad buffer page=%ld dirtied=%zu\n", check_buffer(buf, pages, done), done);
		return 1;
	}
	printf("CHECK ok dirtied=%zu\n", done);
	return 0;
}

int main(int argc, char **argv)
{
	size_t mib = 8, chunk_kib = 64, nchunks, chunk_pages, len, dirty_mib = 0, dirtied = 0;
	double dirty_pct = 0;
	unsigned char *dirty = NULL;
	long t0;
	const char *checkfile = NULL;
	int gid = 1, opt, no_device = 0;
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qa, *qb;
	struct ibv_mr *src_mr, *dst_mr;
	struct oob oa, ob;
	uint64_t *src, *dst, writes = 0, got = 0, want = 0;
	long bad;

	while ((opt = getopt(argc, argv, "f:m:c:g:d:r:n")) != -1) {
		if (opt == 'f')
			checkfile = optarg;
		else if (opt == 'm')
			mib = (size_t)atol(optarg);
		else if (opt == 'c')
			chunk_kib = (size_t)atol(optarg);
		else if (opt == 'g')
			gid = atoi(optarg);
		else if (opt == 'd')
			dirty_mib = (size_t)atol(optarg);
		else if (opt == 'r')
			dirty_pct = atof(optarg);
		else if (opt == 'n')
			no_device = 1;
	}
	len = mib << 20;
	chunk_pages = (chunk_kib << 10) / PAGE;
	if (!checkfile || !chunk_pages || len % (chunk_pages * PAGE))
		DIE("usage: write_mem -f CHECKFILE [-m MIB] [-c CHUNK_KIB (pages, dividing MIB)] [-g GID]");
	nchunks = len / (chunk_pages * PAGE);
	if (dirty_mib)
		dirty = random_buffer(dirty_mib << 20);
	if (no_device) {
		if (!dirty)
			DIE("-n needs -d MIB");
		return dirty_only(checkfile, dirty, (dirty_mib << 20) / PAGE, dirty_pct);
	}

	ctx = open_first_device();
	pd = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	src = aligned_alloc(PAGE, chunk_pages * PAGE);
	/* the region: fresh anonymous memory that only the device writes */
	dst = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (!pd || !cq || !src || dst == MAP_FAILED)
		DIE("setup");
	src_mr = ibv_reg_mr(pd, src, chunk_pages * PAGE, IBV_ACCESS_LOCAL_WRITE);
	dst_mr = ibv_reg_mr(pd, dst, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	qa = create_rc_qp(pd, cq, 4, 1);
	qb = create_rc_qp(pd, cq, 1, 1);
	if (!src_mr || !dst_mr || !qa || !qb)
		DIE("MRs and QPs");
	qp_to_init(qa, 0);
	qp_to_init(qb, IBV_ACCESS_REMOTE_WRITE);
	oob_fill(&oa, ctx, gid, qa, 0, 0);
	oob_fill(&ob, ctx, gid, qb, dst_mr->rkey, (uintptr_t)dst);
	ob.psn ^= 0x5a5a;
	qp_to_rts(qa, &ob, gid, oa.psn);
	qp_to_rts(qb, &oa, gid, ob.psn);
	t0 = now_ms();

	while (!file_exists(checkfile)) {
		struct ibv_sge sg = {(uintptr_t)src, (uint32_t)(chunk_pages * PAGE), src_mr->lkey};
		struct ibv_send_wr wr, *badwr;
		struct ibv_wc wc;
		int n;

		fill(src, writes, nchunks, chunk_pages);
		memset(&wr, 0, sizeof(wr));
		wr.wr_id = writes;
		wr.sg_list = &sg;
		wr.num_sge = 1;
		wr.opcode = IBV_WR_RDMA_WRITE;
		wr.send_flags = IBV_SEND_SIGNALED;
		wr.wr.rdma.remote_addr = ob.addr + (writes % nchunks) * chunk_pages * PAGE;
		wr.wr.rdma.rkey = ob.rkey;
		if (ibv_post_send(qa, &wr, &badwr))
			DIE("post write %llu", (unsigned long long)writes);
		while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
			;
		if (n < 0 || wc.status != IBV_WC_SUCCESS || wc.wr_id != writes)
			DIE("write %llu: status %d wr_id %llu", (unsigned long long)writes, n < 0 ? -1 : (int)wc.status,
			    (unsigned long long)wc.wr_id);
		if (dirty)
			dirty_due(dirty, (dirty_mib << 20) / PAGE, dirty_pct, t0, &dirtied);
		if (++writes == nchunks) {
			printf("READY region=%zu MiB chunks=%zu\n", mib, nchunks);
			fflush(stdout);
		}
	}
	bad = check(dst, writes, nchunks, chunk_pages, &got, &want);
	if (bad >= 0) {
		printf("CHECK bad page=%ld got=%016llx want=%016llx writes=%llu\n", bad, (unsigned long long)got,
		       (unsigned long long)want, (unsigned long long)writes);
		return 1;
	}
	bad = dirty ? check_buffer(dirty, (dirty_mib << 20) / PAGE, dirtied) : -1;
	if (bad >= 0) {
		printf("CHECK bad buffer page=%ld dirtied=%zu\n", bad, dirtied);
		return 1;
	}
	printf("CHECK ok writes=%llu rounds=%llu dirtied=%zu\n", (unsigned long long)writes,
	       (unsigned long long)(writes / nchunks), dirtied);
	return 0;
}
