/* many_qps: N RC QPs in INIT on one CQ, so the shim's reports carry N
 * entries (the control socket must answer in full).  Prints READY with its
 * pid and QP numbers, then waits for the stop file.  With -Q K, each
 * SIGUSR1 makes K more QPs and prints them on a NEW line (the ids a process
 * hands out after a restore, next to its siblings').
 *
 *   many_qps -n N -f STOPFILE [-Q K] */
#include <signal.h>
#include <time.h>

#include "common.h"

static volatile sig_atomic_t more_asked;

static void ask_more(int sig)
{
	(void)sig;
	more_asked = 1;
}

/* Make n QPs in INIT and print "<word> pid=P round=R qpns=a,b,...". */
static void make_qps(struct ibv_pd *pd, struct ibv_cq *cq, int n, const char *word, int round)
{
	char line[4096];
	int i, len;

	len = snprintf(line, sizeof(line), "%s pid=%d round=%d qpns=", word, (int)getpid(), round);
	for (i = 0; i < n; i++) {
		struct ibv_qp *qp;

		if (!(qp = create_rc_qp(pd, cq, 2, 2)))
			DIE("qp %d", i);
		qp_to_init(qp, IBV_ACCESS_LOCAL_WRITE);
		if (len < (int)sizeof(line) - 16)
			len += snprintf(line + len, sizeof(line) - (size_t)len, "%s%u", i ? "," : "",
					qp->qp_num);
	}
	printf("%s\n", line);
}

int main(int argc, char **argv)
{
	struct timespec nap = {0, 50 * 1000 * 1000};
	struct sigaction sa = {0};
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	const char *stop;
	int n, more = 0, round = 0;

	if ((argc != 5 && argc != 7) || strcmp(argv[1], "-n") || strcmp(argv[3], "-f") ||
	    (argc == 7 && strcmp(argv[5], "-Q")))
		DIE("usage: many_qps -n N -f STOPFILE [-Q K]");
	n = atoi(argv[2]);
	stop = argv[4];
	if (argc == 7)
		more = atoi(argv[6]);
	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Before the device opens: the shim then leaves an app's own handler alone. */
	sa.sa_handler = ask_more;
	sigemptyset(&sa.sa_mask);
	if (more > 0 && sigaction(SIGUSR1, &sa, NULL))
		DIE("sigaction");
	ctx = open_first_device();
	pd = ibv_alloc_pd(ctx);
	cq = pd ? ibv_create_cq(ctx, 64, NULL, NULL, 0) : NULL;
	if (!cq)
		DIE("pd/cq");
	make_qps(pd, cq, n, "READY", round);
	while (!file_exists(stop)) {
		if (more_asked) {
			more_asked = 0;
			make_qps(pd, cq, more, "NEW", ++round);
		}
		nanosleep(&nap, NULL);
	}
	printf("DONE\n");
	return 0;
}
