/* fork_seq: a verbs program that forks, written as a third party would.
 * Lines that start with "shim:" say what the shim made of this process
 * (its threads, its control socket); every other line must be the same with
 * and without the shim.  FORK_INIT=1 calls ibv_fork_init() first.
 *
 *   fork_seq verbs  the parent opens a device and makes an RC QP, then
 *                   forks; the child opens the device again, makes its own
 *                   QP and an rdma_cm id, connects to the parent's QP and
 *                   they exchange messages both ways
 *   fork_seq idle   the parent opens a device and forks a child that uses
 *                   no verbs: the child has no thread and no socket of the
 *                   shim's
 *   fork_seq exec   the parent opens a device, a completion channel and an
 *                   rdma_cm channel, forks a child that execs "fork_seq fds",
 *                   then execs it itself
 *   fork_seq fds    the file descriptors beyond stdio, and the threads */
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <rdma/rdma_cma.h>

#include "common.h"

#define GID_INDEX 1
#define ROUNDS 8
#define BUF 4096

struct side {
	int seen[3]; /* completions polled and not yet waited for, by wr_id */
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	struct msg *out, *in;
};

/* Buffers on pages of their own: with ibv_fork_init a registered page is
 * not copied into a child at all. */
static void side_open(struct side *s)
{
	void *buf = mmap(NULL, BUF, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	if (buf == MAP_FAILED)
		DIE("mmap");
	memset(s, 0, sizeof(*s));
	s->ctx = open_first_device();
	s->pd = ibv_alloc_pd(s->ctx);
	s->cq = s->pd ? ibv_create_cq(s->ctx, 16, NULL, NULL, 0) : NULL;
	s->qp = s->cq ? create_rc_qp(s->pd, s->cq, 8, 8) : NULL;
	s->mr = s->qp ? ibv_reg_mr(s->pd, buf, BUF, IBV_ACCESS_LOCAL_WRITE) : NULL;
	if (!s->mr)
		DIE("verbs objects");
	s->out = buf;
	s->in = s->out + 1;
	qp_to_init(s->qp, IBV_ACCESS_LOCAL_WRITE);
}

static void side_close(struct side *s)
{
	void *buf = s->mr->addr;

	if (ibv_destroy_qp(s->qp) || ibv_dereg_mr(s->mr) || ibv_destroy_cq(s->cq) || ibv_dealloc_pd(s->pd) ||
	    ibv_close_device(s->ctx))
		DIE("destroy");
	munmap(buf, BUF);
}

static void post_recv(struct side *s)
{
	struct ibv_sge sge = { .addr = (uintptr_t)s->in, .length = sizeof(*s->in), .lkey = s->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1 }, *bad;

	if (ibv_post_recv(s->qp, &wr, &bad))
		DIE("post_recv");
}

static void send_msg(struct side *s, uint64_t seq, uint64_t kind)
{
	struct ibv_sge sge = { .addr = (uintptr_t)s->out, .length = sizeof(*s->out), .lkey = s->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;

	msg_fill(s->out, seq, kind, 0, 0);
	if (ibv_post_send(s->qp, &wr, &bad))
		DIE("post_send");
}

/* Wait for a completion of wr_id `want` (1 send, 2 receive): a send's
 * may come after the answer it asked for. */
static void wait_wc(struct side *s, uint64_t want)
{
	struct ibv_wc wc;
	long deadline = now_ms() + 20000;

	while (!s->seen[want]) {
		int n = ibv_poll_cq(s->cq, 1, &wc);

		if (n < 0 || (n == 1 && (wc.status != IBV_WC_SUCCESS || wc.wr_id < 1 || wc.wr_id > 2)))
			DIE("completion status %d", n < 0 ? -1 : (int)wc.status);
		if (n == 1)
			s->seen[wc.wr_id]++;
		if (now_ms() > deadline)
			DIE("no completion");
	}
	s->seen[want]--;
}

/* Our ids to the other side and theirs back, over two pipes; then RTS. */
static void connect_over(struct side *s, int rfd, int wfd)
{
	struct oob mine, theirs;

	oob_fill(&mine, s->ctx, GID_INDEX, s->qp, s->mr->rkey, (uintptr_t)s->out);
	if (write(wfd, &mine, sizeof(mine)) != (ssize_t)sizeof(mine) ||
	    read(rfd, &theirs, sizeof(theirs)) != (ssize_t)sizeof(theirs))
		DIE("id exchange");
	post_recv(s);
	qp_to_rts(s->qp, &theirs, GID_INDEX, mine.psn);
	/* both ready to receive before either sends */
	if (write(wfd, "r", 1) != 1 || read(rfd, &mine.psn, 1) != 1)
		DIE("ready exchange");
}

/* The shim's threads (named "ibk-...") and all threads of this process. */
static int threads(int *shim)
{
	DIR *d = opendir("/proc/self/task");
	struct dirent *de;
	int n = 0;

	*shim = 0;
	while (d && (de = readdir(d))) {
		char path[300], comm[32] = "";
		FILE *f;

		if (de->d_name[0] == '.')
			continue;
		n++;
		snprintf(path, sizeof(path), "/proc/self/task/%s/comm", de->d_name);
		if ((f = fopen(path, "re"))) {
			*shim += fgets(comm, sizeof(comm), f) && !strncmp(comm, "ibk-", 4);
			fclose(f);
		}
	}
	if (d)
		closedir(d);
	return n;
}

/* This process's control socket (IBCKPT_CTL, "%p" the pid), or "" without one. */
static const char *ctl_path(void)
{
	static char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
	const char *t = getenv("IBCKPT_CTL"), *p;
	size_t o = 0;

	path[0] = 0;
	for (p = t ? t : ""; *p && o + 12 < sizeof(path); p++) {
		if (p[0] == '%' && p[1] == 'p') {
			o += (size_t)snprintf(path + o, sizeof(path) - o, "%d", (int)getpid());
			p++;
		} else {
			path[o++] = *p;
			path[o] = 0;
		}
	}
	return path;
}

/* Ask the control socket for status: -1 unless it answers "ok ...", else
 * how many entries of `unsupported` name the parent process (fork.c). */
static int control_answers(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	static char reply[1 << 16];
	size_t got = 0;
	ssize_t r;
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), n = -1;
	const char *p;

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) || write(fd, "status\n", 7) != 7)
		goto out;
	while (got < sizeof(reply) - 1 && (!got || reply[got - 1] != '\n') &&
	       (r = read(fd, reply + got, sizeof(reply) - 1 - got)) > 0)
		got += (size_t)r;
	reply[got] = 0;
	if (strncmp(reply, "ok", 2))
		goto out;
	for (n = 0, p = reply; (p = strstr(p, "of the parent process")); p++)
		n++;
out:
	if (fd >= 0)
		close(fd);
	return n;
}

static void shim_facts(const char *who)
{
	int shim, inherited;
	const char *path = ctl_path();

	threads(&shim);
	if (!*path || !file_exists(path)) {
		printf("shim: %s threads %d socket %s\n", who, shim, *path ? "absent" : "unset");
		return;
	}
	inherited = control_answers(path);
	if (inherited < 0)
		printf("shim: %s threads %d socket dead\n", who, shim);
	else
		printf("shim: %s threads %d socket answers, %d of the parent's\n", who, shim, inherited);
}

/* An rdma_cm id of this process's own, made and destroyed. */
static void cm_id_once(const char *who)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *id = NULL;

	if (!ch || rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) || rdma_destroy_id(id))
		DIE("%s: rdma_cm id", who);
	rdma_destroy_event_channel(ch);
	printf("%s: rdma_cm channel and id made and destroyed\n", who);
}

static int child_verbs(int rfd, int wfd)
{
	struct side s;
	int shim, n = threads(&shim);
	uint64_t i;

	printf("child: threads before verbs %d\n", n);
	shim_facts("child before verbs");
	side_open(&s);
	cm_id_once("child");
	connect_over(&s, rfd, wfd);
	for (i = 0; i < ROUNDS; i++) {
		send_msg(&s, i, MSG_DATA);
		wait_wc(&s, 1);
		wait_wc(&s, 2);
		if (!msg_ok(s.in) || s.in->seq != i + 100)
			DIE("child: echo %llu is wrong", (unsigned long long)i);
		post_recv(&s);
	}
	printf("child: %d messages echoed\n", ROUNDS);
	shim_facts("child after verbs");
	fflush(stdout);
	side_close(&s);
	return 0;
}

static int run_verbs(void)
{
	struct side s;
	int p2c[2], c2p[2], st;
	pid_t child;
	uint64_t i;

	side_open(&s);
	printf("parent: device open, QP made\n");
	fflush(stdout);
	if (pipe(p2c) || pipe(c2p))
		DIE("pipe");
	child = fork();
	if (child < 0)
		DIE("fork");
	if (child == 0) {
		close(p2c[1]);
		close(c2p[0]);
		exit(child_verbs(p2c[0], c2p[1]));
	}
	close(p2c[0]);
	close(c2p[1]);
	connect_over(&s, c2p[0], p2c[1]);
	for (i = 0; i < ROUNDS; i++) {
		wait_wc(&s, 2);
		if (!msg_ok(s.in) || s.in->seq != i)
			DIE("parent: message %llu is wrong", (unsigned long long)i);
		post_recv(&s);
		send_msg(&s, i + 100, MSG_DATA);
		wait_wc(&s, 1);
	}
	if (waitpid(child, &st, 0) != child)
		DIE("waitpid");
	printf("parent: %d messages echoed, child exit %d\n", ROUNDS, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
	cm_id_once("parent");
	shim_facts("parent");
	side_close(&s);
	return 0;
}

static int run_idle(void)
{
	struct side s;
	pid_t child;
	int st;

	side_open(&s);
	fflush(stdout);
	child = fork();
	if (child < 0)
		DIE("fork");
	if (child == 0) {
		int shim, n;

		usleep(200000); /* anything the shim would start has started */
		n = threads(&shim);
		printf("child: threads %d\n", n);
		shim_facts("idle child");
		return 0;
	}
	if (waitpid(child, &st, 0) != child)
		DIE("waitpid");
	printf("parent: child exit %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
	shim_facts("parent");
	side_close(&s);
	return 0;
}

static int run_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *de;
	int n = 0, shim;

	while (d && (de = readdir(d))) {
		int fd = atoi(de->d_name);
		char path[300], link[256];
		ssize_t l;

		if (de->d_name[0] == '.' || fd <= 2 || fd == dirfd(d))
			continue;
		snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
		l = readlink(path, link, sizeof(link) - 1);
		link[l > 0 ? l : 0] = 0;
		printf("fds: fd %d -> %s\n", fd, link);
		n++;
	}
	if (d)
		closedir(d);
	printf("fds: %d beyond stdio, threads %d\n", n, threads(&shim));
	shim_facts("exec'd image");
	return 0;
}

static int run_exec(const char *self)
{
	struct side s;
	struct ibv_comp_channel *cc;
	struct ibv_cq *cq;
	struct rdma_event_channel *cm;
	pid_t child;
	int st;

	side_open(&s);
	cc = ibv_create_comp_channel(s.ctx);
	cq = cc ? ibv_create_cq(s.ctx, 4, NULL, cc, 0) : NULL;
	cm = cq ? rdma_create_event_channel() : NULL;
	if (!cm)
		DIE("channels");
	shim_facts("parent before exec");
	fflush(stdout);
	child = fork();
	if (child < 0)
		DIE("fork");
	if (child == 0) {
		execl(self, self, "fds", (char *)NULL);
		DIE("exec");
	}
	if (waitpid(child, &st, 0) != child)
		DIE("waitpid");
	printf("parent: child exit %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
	fflush(stdout);
	/* and in place: the same pid, a new image */
	execl(self, self, "fds", (char *)NULL);
	DIE("exec");
}

int main(int argc, char **argv)
{
	const char *fi = getenv("FORK_INIT");

	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc != 2)
		DIE("usage: fork_seq verbs|idle|exec|fds");
	if (!strcmp(argv[1], "fds"))
		return run_fds();
	if (fi && !strcmp(fi, "1") && ibv_fork_init())
		DIE("ibv_fork_init");
	if (!strcmp(argv[1], "verbs"))
		return run_verbs();
	if (!strcmp(argv[1], "idle"))
		return run_idle();
	if (!strcmp(argv[1], "exec"))
		return run_exec(argv[0]);
	DIE("unknown mode %s", argv[1]);
}
