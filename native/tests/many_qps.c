/* many_qps: N RC QPs in INIT on one CQ, so the shim's reports carry N
 * entries (the control socket must answer in full).  Prints READY, then
 * waits for the stop file.
 *
 *   many_qps -n N -f STOPFILE */
#include <time.h>

#include "common.h"

int main(int argc, char **argv)
{
	struct timespec nap = {0, 50 * 1000 * 1000};
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	const char *stop;
	int i, n;

	if (argc != 5 || strcmp(argv[1], "-n") || strcmp(argv[3], "-f"))
		DIE("usage: many_qps -n N -f STOPFILE");
	n = atoi(argv[2]);
	stop = argv[4];
	setvbuf(stdout, NULL, _IOLBF, 0);
	ctx = open_first_device();
	pd = ibv_alloc_pd(ctx);
	cq = pd ? ibv_create_cq(ctx, 64, NULL, NULL, 0) : NULL;
	if (!cq)
		DIE("pd/cq");
	for (i = 0; i < n; i++) {
		struct ibv_qp *qp;

		if (!(qp = create_rc_qp(pd, cq, 2, 2)))
			DIE("qp %d", i);
		qp_to_init(qp, IBV_ACCESS_LOCAL_WRITE);
	}
	printf("READY %d\n", n);
	while (!file_exists(stop))
		nanosleep(&nap, NULL);
	printf("DONE\n");
	return 0;
}
