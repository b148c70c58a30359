/* post_gate: two threads post receives (one SGE each, so the shim's fast
 * path) to one RC QP held in INIT, one post every 500 us each, until a stop
 * file appears or the queue is nearly full.  Nothing ever completes, so the
 * shim's count of posted receives only moves when a post gets through: a
 * test reads it while the shim has the posts closed, and it must stand still.
 *
 * First it posts one send with no SGE and no sg_list (EMPTY_SEND rc= bad_ok=).
 *
 *   post_gate -f STOPFILE      prints READY, then POSTED <n> at the end */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "common.h"

#define QUEUE 8192

static struct ibv_qp *qp;
static struct ibv_mr *mr;
static char buf[64];
static const char *stop;
static atomic_ulong posted;

static void *poster(void *arg)
{
	struct timespec nap = {0, 500 * 1000};
	unsigned long i;

	(void)arg;
	for (i = 0;; i++) {
		struct ibv_sge s = {(uintptr_t)buf, sizeof(buf), mr->lkey};
		struct ibv_recv_wr w = {.wr_id = i, .sg_list = &s, .num_sge = 1}, *bad;

		if (!(i & 63) && file_exists(stop))
			break;
		if (atomic_load(&posted) >= QUEUE - 64)
			break;
		if (ibv_post_recv(qp, &w, &bad))
			DIE("post_recv %lu", i);
		atomic_fetch_add(&posted, 1);
		nanosleep(&nap, NULL);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	pthread_t t[2];
	int i;

	if (argc != 3 || strcmp(argv[1], "-f"))
		DIE("usage: post_gate -f STOPFILE");
	stop = argv[2];
	setvbuf(stdout, NULL, _IOLBF, 0);
	ctx = open_first_device();
	pd = ibv_alloc_pd(ctx);
	mr = pd ? ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE) : NULL;
	cq = ibv_create_cq(ctx, QUEUE, NULL, NULL, 0);
	if (!mr || !cq)
		DIE("pd/mr/cq");
	if (!(qp = create_rc_qp(pd, cq, 1, QUEUE)))
		DIE("qp");
	qp_to_init(qp, IBV_ACCESS_LOCAL_WRITE);
	{
		/* A send with no SGE has no sg_list to read: whatever the provider
		 * says of it in INIT, the shim must not look past num_sge, and a
		 * failure must point bad at the app's own WR. */
		struct ibv_send_wr w = {.wr_id = 7, .opcode = IBV_WR_SEND, .num_sge = 0, .sg_list = NULL}, *bad = NULL;
		int rc = ibv_post_send(qp, &w, &bad);

		printf("EMPTY_SEND rc=%d bad_ok=%d\n", rc, rc ? bad == &w : 1);
	}
	printf("READY qpn=%u\n", qp->qp_num);
	for (i = 0; i < 2; i++)
		pthread_create(&t[i], NULL, poster, NULL);
	for (i = 0; i < 2; i++)
		pthread_join(t[i], NULL);
	printf("POSTED %lu\n", atomic_load(&posted));
	ibv_destroy_qp(qp);
	ibv_destroy_cq(cq);
	ibv_dereg_mr(mr);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	return 0;
}
