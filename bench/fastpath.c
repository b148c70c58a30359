/* Fast-path micro-benchmark for the verbs shim: one verb in a loop, so that
 * callgrind (run at two loop sizes) shows what one call costs with and
 * without libibckpt preloaded.  Built and run by bench/native_perf.sh.
 *
 *   fastpath [-d dev] [-g gid_index] poll  N   N ibv_poll_cq on an empty CQ
 *   fastpath [-d dev] [-g gid_index] recv  N   N ibv_post_recv on an RC QP in INIT (N <= 16384)
 *   fastpath [-d dev] [-g gid_index] write N   N x (signaled 8-byte inline RDMA WRITE on an RC QP
 *                                              looped back to a second QP, poll until it completes)
 *   fastpath [-d dev] [-g gid_index] send  N   N x (post_recv on the receiver, signaled 8-byte inline
 *                                              SEND, poll both CQs until both complete)
 *
 * It prints one line of key=value pairs: the mode, N, the number of
 * ibv_poll_cq calls, how many of them found nothing, and the wall time per
 * iteration in ns (meaningless under valgrind).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

static void die(const char *what)
{
	fprintf(stderr, "fastpath: %s: %s\n", what, strerror(errno));
	exit(1);
}

static void dief(const char *what, int rc)
{
	fprintf(stderr, "fastpath: %s: %s\n", what, strerror(rc));
	exit(1);
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

struct env {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *mr;
	char *buf;
	int gid_index;
	union ibv_gid gid;
	uint32_t max_qp_wr;
};

static struct ibv_context *open_dev(const char *name)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	struct ibv_context *ctx = NULL;
	int i;

	if (!list)
		die("ibv_get_device_list");
	for (i = 0; list[i]; i++)
		if (!name || !strcmp(ibv_get_device_name(list[i]), name)) {
			ctx = ibv_open_device(list[i]);
			break;
		}
	if (!ctx)
		die("no such device (or ibv_open_device failed)");
	ibv_free_device_list(list);
	return ctx;
}

static struct ibv_qp *rc_qp(struct env *e, struct ibv_cq *scq, struct ibv_cq *rcq, uint32_t nsend,
			    uint32_t nrecv)
{
	struct ibv_qp_init_attr ia;
	struct ibv_qp_attr a;
	struct ibv_qp *qp;
	int rc;

	memset(&ia, 0, sizeof(ia));
	ia.send_cq = scq;
	ia.recv_cq = rcq;
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = nsend;
	ia.cap.max_recv_wr = nrecv;
	ia.cap.max_send_sge = 1;
	ia.cap.max_recv_sge = 1;
	ia.cap.max_inline_data = 64;
	qp = ibv_create_qp(e->pd, &ia);
	if (!qp)
		die("ibv_create_qp");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = 1;
	a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
	rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
	if (rc)
		dief("modify_qp INIT", rc);
	return qp;
}

static void rc_connect(struct env *e, struct ibv_qp *qp, uint32_t dest_qpn)
{
	struct ibv_qp_attr a;
	int rc;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dest_qpn;
	a.rq_psn = 0;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 1;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = e->gid;
	a.ah_attr.grh.sgid_index = (uint8_t)e->gid_index;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = 1;
	rc = ibv_modify_qp(qp, &a,
			   IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
				   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
	if (rc)
		dief("modify_qp RTR", rc);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = 0;
	a.max_rd_atomic = 1;
	rc = ibv_modify_qp(qp, &a,
			   IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
				   IBV_QP_MAX_QP_RD_ATOMIC);
	if (rc)
		dief("modify_qp RTS", rc);
}

/* Poll until one completion arrives; counts every call and the empty ones. */
static void wait_one(struct ibv_cq *cq, uint64_t *polls, uint64_t *empty)
{
	struct ibv_wc wc;
	int n;

	for (;;) {
		n = ibv_poll_cq(cq, 1, &wc);
		++*polls;
		if (n < 0)
			dief("ibv_poll_cq", -n);
		if (n == 0) {
			++*empty;
			continue;
		}
		if (wc.status != IBV_WC_SUCCESS) {
			fprintf(stderr, "fastpath: completion status %s\n", ibv_wc_status_str(wc.status));
			exit(1);
		}
		return;
	}
}

static void usage(void)
{
	fprintf(stderr, "usage: fastpath [-d dev] [-g gid_index] poll|recv|write|send N\n");
	exit(2);
}

int main(int argc, char **argv)
{
	const char *dev = "rxe0", *mode;
	struct env e;
	struct ibv_device_attr da;
	struct ibv_cq *cq, *cq2;
	struct ibv_qp *qa, *qb;
	struct ibv_wc wc;
	uint64_t n, i, polls = 0, empty = 0, t0, t1;
	int opt, rc;

	memset(&e, 0, sizeof(e));
	e.gid_index = 1;
	while ((opt = getopt(argc, argv, "d:g:")) != -1) {
		if (opt == 'd')
			dev = optarg;
		else if (opt == 'g')
			e.gid_index = atoi(optarg);
		else
			usage();
	}
	if (argc - optind != 2)
		usage();
	mode = argv[optind];
	n = strtoull(argv[optind + 1], NULL, 10);
	if (!n)
		usage();

	e.ctx = open_dev(dev);
	if (ibv_query_device(e.ctx, &da))
		die("ibv_query_device");
	e.max_qp_wr = (uint32_t)da.max_qp_wr;
	if (ibv_query_gid(e.ctx, 1, e.gid_index, &e.gid))
		die("ibv_query_gid");
	e.pd = ibv_alloc_pd(e.ctx);
	if (!e.pd)
		die("ibv_alloc_pd");
	e.buf = calloc(1, 4096);
	if (!e.buf)
		die("calloc");
	e.mr = ibv_reg_mr(e.pd, e.buf, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!e.mr)
		die("ibv_reg_mr");
	cq = ibv_create_cq(e.ctx, 256, NULL, NULL, 0);
	cq2 = ibv_create_cq(e.ctx, 256, NULL, NULL, 0);
	if (!cq || !cq2)
		die("ibv_create_cq");

	if (!strcmp(mode, "poll")) {
		t0 = now_ns();
		for (i = 0; i < n; i++) {
			rc = ibv_poll_cq(cq, 1, &wc);
			polls++;
			if (rc < 0)
				dief("ibv_poll_cq", -rc);
			if (rc == 0)
				empty++;
		}
		t1 = now_ns();
	} else if (!strcmp(mode, "recv")) {
		struct ibv_sge sge = { .addr = (uintptr_t)e.buf, .length = 64, .lkey = e.mr->lkey };
		struct ibv_recv_wr wr = { .sg_list = &sge, .num_sge = 1 }, *bad;

		/* A receive queue of the same size whatever N is, so that setup cancels out. */
		uint32_t cap = e.max_qp_wr < 16384 ? e.max_qp_wr : 16384;

		if (n > cap) {
			fprintf(stderr, "fastpath: recv N=%" PRIu64 " exceeds %u\n", n, cap);
			return 1;
		}
		qa = rc_qp(&e, cq, cq, 1, cap);
		t0 = now_ns();
		for (i = 0; i < n; i++) {
			wr.wr_id = i;
			rc = ibv_post_recv(qa, &wr, &bad);
			if (rc)
				dief("ibv_post_recv", rc);
		}
		t1 = now_ns();
	} else if (!strcmp(mode, "write") || !strcmp(mode, "send")) {
		int is_send = !strcmp(mode, "send");
		uint64_t payload = 0;
		struct ibv_sge sge = { .addr = (uintptr_t)&payload, .length = sizeof(payload), .lkey = 0 };
		struct ibv_send_wr wr, *bad;
		struct ibv_sge rsge = { .addr = (uintptr_t)e.buf + 2048, .length = 64, .lkey = e.mr->lkey };
		struct ibv_recv_wr rwr = { .sg_list = &rsge, .num_sge = 1 }, *rbad;

		qa = rc_qp(&e, cq, cq, 16, 1);
		qb = rc_qp(&e, cq2, cq2, 1, 16);
		rc_connect(&e, qa, qb->qp_num);
		rc_connect(&e, qb, qa->qp_num);
		memset(&wr, 0, sizeof(wr));
		wr.sg_list = &sge;
		wr.num_sge = 1;
		wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
		if (is_send) {
			wr.opcode = IBV_WR_SEND;
		} else {
			wr.opcode = IBV_WR_RDMA_WRITE;
			wr.wr.rdma.remote_addr = (uintptr_t)e.buf;
			wr.wr.rdma.rkey = e.mr->rkey;
		}
		t0 = now_ns();
		for (i = 0; i < n; i++) {
			payload = i;
			wr.wr_id = i;
			if (is_send) {
				rwr.wr_id = i;
				rc = ibv_post_recv(qb, &rwr, &rbad);
				if (rc)
					dief("ibv_post_recv", rc);
			}
			rc = ibv_post_send(qa, &wr, &bad);
			if (rc)
				dief("ibv_post_send", rc);
			wait_one(cq, &polls, &empty);
			if (is_send)
				wait_one(cq2, &polls, &empty);
		}
		t1 = now_ns();
		if (is_send ? memcmp(e.buf + 2048, &payload, sizeof(payload))
			    : memcmp(e.buf, &payload, sizeof(payload))) {
			fprintf(stderr, "fastpath: the last payload did not arrive\n");
			return 1;
		}
	} else {
		usage();
	}
	printf("mode=%s n=%" PRIu64 " polls=%" PRIu64 " empty=%" PRIu64 " ns_per_iter=%.1f\n", mode, n, polls,
	       empty, (double)(t1 - t0) / (double)n);
	/* Leave teardown to exit: the measured part ends here. */
	return 0;
}
