/* async_ev: async events read the way a library's event thread reads them
 * (UCX and the MPIs run one): poll() on the context's async fd, then
 * ibv_get_async_event and ibv_ack_async_event.  Two RC QPs of this process
 * are connected to each other, the receiving one on an SRQ armed with a
 * limit, so sends that take the SRQ below it raise
 * IBV_EVENT_SRQ_LIMIT_REACHED about that SRQ.  One line per check.
 *
 *   async_ev [STOP]   with STOP: after the first event print READY and wait
 *                     for the file STOP (checkpoints happen meanwhile), then
 *                     check the fd again and raise a second event */
#include <fcntl.h>
#include <poll.h>

#include "common.h"

#define GID_INDEX 1
#define LIMIT 4
#define BUF 64

static struct ibv_cq *cq;
static struct ibv_srq *srq;
static struct ibv_mr *mr;
static int srq_held; /* receives posted to the SRQ and not yet consumed */

static void post_srq(int n)
{
	struct ibv_sge sge = { .addr = (uintptr_t)mr->addr + BUF, .length = BUF, .lkey = mr->lkey };
	struct ibv_recv_wr wr = { .sg_list = &sge, .num_sge = 1 }, *bad;

	while (n--) {
		if (ibv_post_srq_recv(srq, &wr, &bad))
			DIE("post_srq_recv");
		srq_held++;
	}
}

/* Arm the limit, then send until the SRQ holds fewer receives than it
 * (two fewer: whether the device counts before or after taking one). */
static void take_srq_below_limit(struct ibv_qp *sender)
{
	struct ibv_srq_attr sa = { .srq_limit = LIMIT };
	struct ibv_sge sge = { .addr = (uintptr_t)mr->addr, .length = BUF, .lkey = mr->lkey };
	struct ibv_send_wr wr = { .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	struct ibv_wc wc[8];
	int sends = srq_held - (LIMIT - 2), done = 0;
	long deadline = now_ms() + 10000;

	if (ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT))
		DIE("modify_srq");
	for (int i = 0; i < sends; i++)
		if (ibv_post_send(sender, &wr, &bad))
			DIE("post_send");
	while (done < 2 * sends && now_ms() < deadline) {
		int n = ibv_poll_cq(cq, 8, wc);

		for (int i = 0; i < n; i++)
			if (wc[i].status != IBV_WC_SUCCESS)
				DIE("completion status %d", wc[i].status);
		done += n > 0 ? n : 0;
	}
	if (done != 2 * sends)
		DIE("%d of %d completions", done, 2 * sends);
	srq_held -= sends;
}

static int readable(int fd, int ms)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };

	return poll(&p, 1, ms) == 1 && (p.revents & POLLIN);
}

/* The event the sends raised: through the fd, about our SRQ, once. */
static void expect_limit_event(struct ibv_context *ctx, const char *tag)
{
	struct ibv_async_event ev;
	int ready = readable(ctx->async_fd, 5000), rc;

	rc = ready ? ibv_get_async_event(ctx, &ev) : -1;
	printf("%s: readable %d got %d type %d our_srq %d", tag, ready, rc, rc ? -1 : (int)ev.event_type,
	       !rc && ev.element.srq == srq);
	if (!rc)
		ibv_ack_async_event(&ev);
	printf(" then_readable %d\n", readable(ctx->async_fd, 200));
	fflush(stdout);
}

static struct ibv_qp *srq_qp(struct ibv_pd *pd)
{
	struct ibv_qp_init_attr qa = { .send_cq = cq, .recv_cq = cq, .srq = srq, .qp_type = IBV_QPT_RC };

	qa.cap.max_send_wr = 4;
	qa.cap.max_send_sge = 1;
	return ibv_create_qp(pd, &qa);
}

int main(int argc, char **argv)
{
	const char *stop = argc > 1 ? argv[1] : NULL;
	struct ibv_context *ctx = open_first_device();
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_srq_init_attr si = { .attr = { .max_wr = 32, .max_sge = 1 } };
	struct ibv_async_event ev;
	struct ibv_qp *a, *b;
	struct oob oa, ob;
	int fl, rc;

	cq = pd ? ibv_create_cq(ctx, 128, NULL, NULL, 0) : NULL;
	mr = pd ? ibv_reg_mr(pd, calloc(1, 2 * BUF), 2 * BUF, IBV_ACCESS_LOCAL_WRITE) : NULL;
	srq = pd ? ibv_create_srq(pd, &si) : NULL;
	if (!cq || !mr || !srq)
		DIE("setup");
	a = create_rc_qp(pd, cq, 32, 1);
	b = srq_qp(pd);
	if (!a || !b)
		DIE("create_qp");
	qp_to_init(a, IBV_ACCESS_LOCAL_WRITE);
	qp_to_init(b, IBV_ACCESS_LOCAL_WRITE);
	oob_fill(&oa, ctx, GID_INDEX, a, 0, 0);
	oob_fill(&ob, ctx, GID_INDEX, b, 0, 0);
	qp_to_rts(a, &ob, GID_INDEX, oa.psn);
	qp_to_rts(b, &oa, GID_INDEX, ob.psn);

	/* nothing yet: a non-blocking fd answers EAGAIN, as libibverbs' read() */
	fl = fcntl(ctx->async_fd, F_GETFL);
	fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
	rc = ibv_get_async_event(ctx, &ev);
	printf("nonblocking: %d %s\n", rc, rc && errno == EAGAIN ? "EAGAIN" : "other");
	fcntl(ctx->async_fd, F_SETFL, fl);

	post_srq(8);
	take_srq_below_limit(a);
	expect_limit_event(ctx, "srq_limit");
	if (stop) {
		int fd = ctx->async_fd;

		printf("READY\n");
		fflush(stdout);
		while (!file_exists(stop))
			usleep(20000);
		/* the same fd, and nothing the release raised delivered as ours */
		printf("after: same_fd %d valid %d readable %d\n", ctx->async_fd == fd,
		       fcntl(ctx->async_fd, F_GETFD) >= 0, readable(ctx->async_fd, 200));
		post_srq(8);
		take_srq_below_limit(a);
		expect_limit_event(ctx, "srq_limit_after");
	}
	printf("DONE\n");
	return 0;
}
