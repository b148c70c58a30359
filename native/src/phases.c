/* The checkpoint phases: quiesce, drain, release, rebuild, resume, abort.
 * They run on the control thread, one at a time, each bounded by a timeout,
 * and each writes a one-line JSON report. */
#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"
#include "ibckpt.h"

static enum ibk_phase phase = IBK_RUNNING;
static pthread_mutex_t phase_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t last_epoch;
static unsigned long checkpoints_done;

const char *ibk_phase_name(enum ibk_phase p)
{
	static const char *const names[] = {"running", "quiesced", "drained", "released", "rebuilt"};

	return names[p];
}

enum ibk_phase ibk_phase_now(void)
{
	return phase;
}

static long ms_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Append to a report buffer, never overflowing it. */
static void jcat(char *out, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void jcat(char *out, size_t len, const char *fmt, ...)
{
	size_t n = strlen(out);
	va_list ap;

	if (n + 1 >= len)
		return;
	va_start(ap, fmt);
	vsnprintf(out + n, len - n, fmt, ap);
	va_end(ap);
}

#define FOR_EACH_CTX(ctx) for (ctx = ibk_ctx_list; ctx; ctx = ctx->next_ctx)
#define FOR_EACH_OBJ(ctx, o) for (o = (ctx)->head.next; o != &(ctx)->head; o = o->next)
#define FOR_EACH_OBJ_REV(ctx, o, p) for (o = (ctx)->head.prev, p = o->prev; o != &(ctx)->head; o = p, p = o->prev)
/* the QPs among them: qp is set for each (an if/else, so break and continue
 * act on the object loop) */
#define FOR_EACH_QP(ctx, o, qp)                                         \
	FOR_EACH_OBJ(ctx, o)                                            \
	if ((o)->kind != IBK_QP || !((qp) = IBK_OBJ(o, ibk_qp))) { \
	} else

static void report_qps(char *out, size_t len)
{
	struct ibk_qp *qp;
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	int first = 1;

	jcat(out, len, "\"qps\":[");
	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	{
		unsigned long long rdma, atomics;
		uint64_t seq;

		/* RDMA and atomics in flight: counted in the log, not on the fast path */
		rdma = atomics = 0;
		ibk_lock(&qp->lock);
		for (seq = qp->slog.head; seq < qp->slog.tail; seq++) {
			uint32_t f = ibk_sendlog_at(&qp->slog, seq)->flags;

			rdma += !(f & IBK_SWR_FLAG_WR) && (f & IBK_SWR_RDMA);
			atomics += !!(f & IBK_SWR_ATOMIC);
		}
		ibk_unlock(&qp->lock);
		jcat(out, len,
		     "%s{\"qpn\":%u,\"real_qpn\":%d,\"type\":%d,\"state\":%d,\"sends_posted\":%llu,"
		     "\"sends_completed\":%llu,\"consumers_done\":%llu,\"recvs_posted\":%llu,"
		     "\"recvs_completed\":%llu,\"rdma_inflight\":%llu,\"atomic_inflight\":%llu,"
		     "\"logged_sends\":%u,\"logged_recvs\":%u,\"reposted\":%llu,\"synthesized\":%llu}",
		     first ? "" : ",", qp->vqpn, qp->real ? (int)qp->real->qp_num : -1, qp->pub.qp_type, qp->state,
		     (unsigned long long)qp->cnt.sends_posted, (unsigned long long)qp->cnt.sends_completed,
		     (unsigned long long)qp->cnt.consumers_done, (unsigned long long)qp->rlog.next_seq,
		     (unsigned long long)qp->cnt.recvs_completed, (unsigned long long)rdma,
		     (unsigned long long)atomics, ibk_sendlog_count(&qp->slog), ibk_recvlog_live(&qp->rlog),
		     (unsigned long long)qp->cnt.reposted, (unsigned long long)qp->cnt.synthesized);
		first = 0;
	}
	jcat(out, len, "]");
}

/* For the agent's preflight: this rank's own GIDs, every connected QP's peer as the app
 * gave it (virtual GID and QPN), every address handle's GID, and the verbs the shim refused. */
static void report_identity(char *out, size_t len)
{
	struct ibk_qp *qp;
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	const char *verbs[IBK_MAX_REFUSED];
	char hex[40];
	int first = 1, g, n, i;

	jcat(out, len, ",\"gids\":[");
	FOR_EACH_CTX(ctx)
	for (g = 0; g < 4; g++) {
		if (!(ctx->port_gid_valid & (1u << g)))
			continue;
		ibk_gid_hex(&ctx->vgid[g], hex);
		jcat(out, len, "%s\"%s\"", first ? "" : ",", hex);
		first = 0;
	}
	jcat(out, len, "],\"peers\":[");
	first = 1;
	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	{
		if (!qp->peer.valid || qp->pub.qp_type == IBV_QPT_UD)
			continue;
		ibk_gid_hex(&qp->peer.vgid, hex);
		jcat(out, len, "%s{\"qpn\":%u,\"type\":%d,\"peer_gid\":\"%s\",\"peer_qpn\":%u}", first ? "" : ",",
		     qp->vqpn, qp->pub.qp_type, hex, qp->peer.vqpn);
		first = 0;
	}
	/* UD has no connection: where its datagrams go is in the address handles */
	jcat(out, len, "],\"ah_gids\":[");
	first = 1;
	FOR_EACH_CTX(ctx)
	FOR_EACH_OBJ(ctx, o)
	{
		struct ibk_ah *ah;

		if (o->kind != IBK_AH)
			continue;
		ah = IBK_OBJ(o, ibk_ah);
		if (!ah->attr.is_global)
			continue;
		ibk_gid_hex(&ah->attr.grh.dgid, hex);
		jcat(out, len, "%s\"%s\"", first ? "" : ",", hex);
		first = 0;
	}
	jcat(out, len, "],\"unsupported\":[");
	n = ibk_refused_verbs(verbs, IBK_MAX_REFUSED);
	for (i = 0; i < n; i++)
		jcat(out, len, "%s\"%s\"", i ? "," : "", verbs[i]);
	jcat(out, len, "]");
}

static void report_begin(char *out, size_t len, const char *name, int ok, long t0)
{
	out[0] = 0;
	jcat(out, len, "{\"phase\":\"%s\",\"ok\":%s,\"ms\":%ld,\"state\":\"%s\"", name, ok ? "true" : "false",
	     ms_now() - t0, ibk_phase_name(phase));
}

/* ---- quiesce ----------------------------------------------------------------- */

/* The post fast paths take no gate, so closing the gate is not enough:
 * close every QP's posts too, and wait until no post that got in before
 * still holds a QP lock.  Returns how many QPs are still busy (0: closed). */
static long posts_close(long deadline)
{
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	struct ibk_qp *qp;
	useconds_t nap = 50;
	long busy;

	pthread_mutex_lock(&ibk_ctx_lock);
	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	ibk_qp_posts_close(qp);
	for (;;) {
		busy = 0;
		FOR_EACH_CTX(ctx)
		FOR_EACH_QP(ctx, o, qp)
		busy += ibk_qp_posts_busy(qp) != 0;
		if (!busy || ms_now() > deadline)
			break;
		usleep(nap);
		nap = nap < 2000 ? nap * 2 : 2000;
	}
	pthread_mutex_unlock(&ibk_ctx_lock);
	return busy;
}

static void posts_open(void)
{
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	struct ibk_qp *qp;

	pthread_mutex_lock(&ibk_ctx_lock);
	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	ibk_qp_posts_open(qp);
	pthread_mutex_unlock(&ibk_ctx_lock);
}

int ibk_do_quiesce(int timeout_ms, char *out, size_t len)
{
	long t0 = ms_now(), inside = 0, busy = 0;
	int rc;

	if (phase != IBK_RUNNING) {
		report_begin(out, len, "quiesce", 0, t0);
		jcat(out, len, ",\"error\":\"not running\"}");
		return -EINVAL;
	}
	rc = ibk_hooks_wait_critical(timeout_ms);
	if (rc) {
		report_begin(out, len, "quiesce", 0, t0);
		jcat(out, len, ",\"error\":\"a library critical section stayed open\"}");
		return rc;
	}
	ibk_hooks_notify(IBCKPT_EV_QUIESCE);
	ibk_chan_wake_all(1); /* threads blocked in ibv_get_cq_event come back to the gate */
	rc = ibk_gate_close(timeout_ms - (int)(ms_now() - t0));
	if (rc) {
		inside = ibk_gate_inside();
	} else {
		busy = posts_close(t0 + timeout_ms);
		if (busy) {
			posts_open();
			rc = -ETIMEDOUT;
		}
	}
	if (rc) {
		ibk_gate_open();
		ibk_chan_wake_all(0);
		ibk_hooks_notify(IBCKPT_EV_RESUME);
		report_begin(out, len, "quiesce", 0, t0);
		if (busy)
			jcat(out, len, ",\"error\":\"threads still inside a post\",\"posting_qps\":%ld}", busy);
		else
			jcat(out, len, ",\"error\":\"threads still inside verbs\",\"inside\":%ld}", inside);
		return rc;
	}
	phase = IBK_QUIESCED;
	/* the counters at the cut show what was in flight when the gate closed */
	report_begin(out, len, "quiesce", 1, t0);
	jcat(out, len, ",");
	pthread_mutex_lock(&ibk_ctx_lock);
	report_qps(out, len);
	pthread_mutex_unlock(&ibk_ctx_lock);
	jcat(out, len, "}");
	return 0;
}

/* ---- drain ------------------------------------------------------------------- */

/* Post a flag WR where trailing unsignaled sends would otherwise never
 * report completion. */
static int drain_post_flags(void)
{
	struct ibk_qp *qp;
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	int n = 0;

	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	{
		struct ibk_swr *tail;

		if (qp->state != IBV_QPS_RTS || qp->flag_outstanding)
			continue;
		ibk_lock(&qp->lock);
		tail = ibk_sendlog_count(&qp->slog) ? ibk_sendlog_at(&qp->slog, qp->slog.tail - 1) : NULL;
		if (tail && !(tail->flags & IBK_SWR_SIGNALED) && !ibk_qp_post_flag(qp))
			n++;
		ibk_unlock(&qp->lock);
	}
	return n;
}

/* One pass over every real CQ and channel; returns completions moved. */
static int drain_pass(void)
{
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	int n = 0;

	FOR_EACH_CTX(ctx)
	FOR_EACH_OBJ(ctx, o)
	{
		if (o->kind == IBK_CQ && IBK_OBJ(o, ibk_cq)->real)
			n += ibk_cq_drain_real(IBK_OBJ(o, ibk_cq));
		else if (o->kind == IBK_CHAN)
			ibk_chan_drain_real(IBK_OBJ(o, ibk_chan));
	}
	return n;
}

static uint32_t pending_sends(void)
{
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	uint32_t n = 0;

	FOR_EACH_CTX(ctx)
	FOR_EACH_OBJ(ctx, o)
	if (o->kind == IBK_QP && IBK_OBJ(o, ibk_qp)->state >= IBV_QPS_RTS)
		n += ibk_sendlog_count(&IBK_OBJ(o, ibk_qp)->slog);
	return n;
}

/* Whether the sends still logged may be left to rebuild's settlement. RC
 * executes in order, so a read or atomic that comes before every logged
 * receive-consuming send has already executed at the peer and only its
 * response is outstanding: release would lose that response, so drain
 * must wait for it. Anything after a consumer that stalls (RNR: the
 * peer's app is gated and posts no receives) has not executed and is
 * re-posted. Sends without acks (UD, UC) must complete locally. */
static int pending_settleable(void)
{
	struct ibk_qp *qp;
	struct ibk_ctx *ctx;
	struct ibk_obj *o;

	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	{
		uint64_t seq;

		if (qp->state < IBV_QPS_RTS || !ibk_sendlog_count(&qp->slog))
			continue;
		if (qp->pub.qp_type != IBV_QPT_RC)
			return 0;
		ibk_lock(&qp->lock);
		for (seq = qp->slog.head; seq < qp->slog.tail; seq++) {
			struct ibk_swr *e = ibk_sendlog_at(&qp->slog, seq);

			if (e->flags & IBK_SWR_CONSUMER)
				break;
			if ((e->flags & IBK_SWR_ATOMIC) || e->wr.opcode == IBV_WR_RDMA_READ) {
				ibk_unlock(&qp->lock);
				return 0;
			}
		}
		ibk_unlock(&qp->lock);
	}
	return 1;
}

/* No completion for stall_ms, with only settleable sends left, means they
 * are most likely stalled on the peer's gate. Stopping early is safe either
 * way: rebuild settles each pending send by the peer's counters, so the
 * window only trades cut time against sends replayed at rebuild. */
int ibk_do_drain(int timeout_ms, int stall_ms, char *out, size_t len)
{
	long t0 = ms_now(), last_move = t0;
	int flags, moved = 0, stalled = 0;
	useconds_t nap = 100;
	uint32_t pending;

	if (phase != IBK_QUIESCED) {
		report_begin(out, len, "drain", 0, t0);
		jcat(out, len, ",\"error\":\"not quiesced\"}");
		return -EINVAL;
	}
	pthread_mutex_lock(&ibk_ctx_lock);
	flags = drain_post_flags();
	for (;;) {
		int n = drain_pass();

		moved += n;
		if (n) {
			last_move = ms_now();
			nap = 100;
		}
		pending = pending_sends();
		if (!pending || ms_now() - t0 > timeout_ms)
			break;
		if (ms_now() - last_move >= stall_ms && pending_settleable()) {
			stalled = 1;
			break;
		}
		/* back off while nothing moves: other ranks' app threads need the
		 * CPU to reach their gates */
		usleep(nap);
		nap = nap < 2000 ? nap * 2 : 2000;
	}
	phase = IBK_DRAINED;
	report_begin(out, len, "drain", 1, t0);
	/* Sends still pending are settled at rebuild by the peers' counters. */
	jcat(out, len, ",\"flag_wrs\":%d,\"moved\":%d,\"pending_sends\":%u,\"stalled\":%s,", flags, moved,
	     pending, stalled ? "true" : "false");
	report_qps(out, len);
	jcat(out, len, "}");
	pthread_mutex_unlock(&ibk_ctx_lock);
	return 0;
}

/* ---- release ----------------------------------------------------------------- */

static int count_device_fds(int *maps)
{
	char path[300], link[256];
	DIR *d = opendir("/proc/self/fd");
	struct dirent *de;
	FILE *f;
	int n = 0;

	while (d && (de = readdir(d))) {
		ssize_t l;

		snprintf(path, sizeof(path), "/proc/self/fd/%s", de->d_name);
		l = readlink(path, link, sizeof(link) - 1);
		if (l > 0) {
			link[l] = 0;
			if (!strncmp(link, "/dev/infiniband/", 16))
				n++;
		}
	}
	if (d)
		closedir(d);
	*maps = 0;
	f = fopen("/proc/self/maps", "r");
	while (f && fgets(link, sizeof(link), f))
		if (strstr(link, "/dev/infiniband/"))
			(*maps)++;
	if (f)
		fclose(f);
	return n;
}

/* Moves every live QP to ERR; returns how many would not go. */
static int release_flush_qps(struct ibk_ctx *ctx)
{
	struct ibk_qp *qp;
	struct ibk_obj *o;
	int failed = 0;

	FOR_EACH_QP(ctx, o, qp)
	{
		struct ibv_qp_attr a;

		qp->releasing = 1;
		qp->rel_send_seen = 0;
		qp->rel_recvs_flushed = 0;
		if (qp->state == IBV_QPS_RESET || !qp->real)
			continue;
		/* ERR stops the QP accepting packets, so the final poll below
		 * sees every receive that will ever be counted. */
		memset(&a, 0, sizeof(a));
		a.qp_state = IBV_QPS_ERR;
		if (ibk_real.modify_qp(qp->real, &a, IBV_QP_STATE)) {
			ibk_log("release: QP %u to ERR failed", qp->vqpn);
			failed++;
		}
	}
	return failed;
}

/* Whether every WR still logged on a QP in ERR has reported back. A QP in
 * ERR completes each posted receive and, in order, each send from the
 * first unfinished one on, all with a completion (flushes are reported
 * signaled or not). So once the newest send and every logged receive has
 * shown up, no completion is left to come. An SRQ's receives are not
 * flushed with its QPs, and a newest send that succeeded unsignaled never
 * reports: those leave the answer to the quiet window. */
static int release_settled(void)
{
	struct ibk_qp *qp;
	struct ibk_ctx *ctx;
	struct ibk_obj *o;

	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	{
		int done;

		if (qp->state == IBV_QPS_RESET || !qp->real)
			continue;
		if (qp->srq)
			return 0;
		ibk_lock(&qp->lock);
		done = !ibk_sendlog_count(&qp->slog) || qp->rel_send_seen == qp->slog.tail;
		ibk_unlock(&qp->lock);
		if (!done)
			return 0;
		ibk_lock(&qp->rlock);
		done = ibk_recvlog_live(&qp->rlog) == qp->rel_recvs_flushed;
		ibk_unlock(&qp->rlock);
		if (!done)
			return 0;
	}
	return 1;
}

/* Destroying a QP can wait in the kernel: rxe waits (up to 200 ms) until
 * packets still queued toward the NIC drop their hold on it. A few threads
 * side by side overlap those waits instead of adding them up. */
#define RELEASE_DESTROY_THREADS 8

struct qp_destroy_job {
	pthread_t caller; /* the control thread, which destroys QPs too */
	struct ibk_ctx *ctx;
	struct ibk_qp **qps;
	int n;
	atomic_int next;
	atomic_int errs;
};

static int release_destroy_qp(struct ibk_ctx *ctx, struct ibk_qp *qp)
{
	int rc;

	pthread_mutex_lock(&ctx->lock);
	ibk_idmap_del(&ctx->rqpns, qp->real->qp_num);
	pthread_mutex_unlock(&ctx->lock);
	rc = ibk_real.destroy_qp(qp->real);
	qp->real = NULL;
	qp->flag_outstanding = 0;
	return rc;
}

static void *destroy_qps_worker(void *arg)
{
	struct qp_destroy_job *job = arg;
	int i;

	if (!pthread_equal(pthread_self(), job->caller))
		pthread_setname_np(pthread_self(), IBK_RELEASE_THREAD_NAME);
	while ((i = atomic_fetch_add(&job->next, 1)) < job->n) {
		struct ibk_qp *qp = job->qps[i];

		if (release_destroy_qp(job->ctx, qp)) {
			ibk_log("release: destroying QP %u failed", qp->vqpn);
			atomic_fetch_add(&job->errs, 1);
		}
	}
	return NULL;
}

static int release_destroy_qps(struct ibk_ctx *ctx)
{
	struct qp_destroy_job job = {.caller = pthread_self(), .ctx = ctx};
	pthread_t tids[RELEASE_DESTROY_THREADS];
	int started = 0, i;
	struct ibk_qp *qp;
	struct ibk_obj *o;

	FOR_EACH_QP(ctx, o, qp)
	job.n += qp->real != NULL;
	if (!job.n)
		return 0;
	job.qps = calloc((size_t)job.n, sizeof(*job.qps));
	if (!job.qps)
		return 0; /* release_destroy destroys them one by one */
	i = 0;
	FOR_EACH_QP(ctx, o, qp)
	if (qp->real)
		job.qps[i++] = qp;
	atomic_init(&job.next, 0);
	atomic_init(&job.errs, 0);
	while (started < RELEASE_DESTROY_THREADS && started < job.n - 1 &&
	       !pthread_create(&tids[started], NULL, destroy_qps_worker, &job))
		started++;
	destroy_qps_worker(&job);
	for (i = 0; i < started; i++)
		pthread_join(tids[i], NULL);
	free(job.qps);
	return atomic_load(&job.errs);
}

static int release_destroy(struct ibk_ctx *ctx)
{
	struct ibk_obj *o, *p;
	int errs = release_destroy_qps(ctx);

	FOR_EACH_OBJ_REV(ctx, o, p)
	{
		int rc = 0;

		switch (o->kind) {
		case IBK_AH:
			rc = ibk_real.destroy_ah(IBK_OBJ(o, ibk_ah)->real);
			IBK_OBJ(o, ibk_ah)->real = NULL;
			break;
		case IBK_QP: {
			struct ibk_qp *qp = IBK_OBJ(o, ibk_qp);

			if (qp->real) /* not destroyed above: no memory for the job */
				rc = release_destroy_qp(ctx, qp);
			break;
		}
		case IBK_SRQ:
			rc = ibk_real.destroy_srq(IBK_OBJ(o, ibk_srq)->real);
			IBK_OBJ(o, ibk_srq)->real = NULL;
			break;
		case IBK_CQ:
			rc = ibk_real.destroy_cq(IBK_OBJ(o, ibk_cq)->real);
			IBK_OBJ(o, ibk_cq)->real = NULL;
			break;
		case IBK_CHAN:
			rc = ibk_chan_release_real(IBK_OBJ(o, ibk_chan));
			break;
		case IBK_MR:
			rc = ibk_real.dereg_mr(IBK_OBJ(o, ibk_mr)->real);
			IBK_OBJ(o, ibk_mr)->real = NULL;
			break;
		case IBK_PD:
			rc = ibk_real.dealloc_pd(IBK_OBJ(o, ibk_pd)->real);
			IBK_OBJ(o, ibk_pd)->real = NULL;
			break;
		}
		if (rc) {
			ibk_log("release: destroying a kind-%d object failed: %d", o->kind, rc);
			errs++;
		}
	}
	ibk_devfd_forget(ctx->real->cmd_fd);
	if (ibk_real.close_device(ctx->real))
		errs++;
	ctx->real = NULL;
	return errs;
}

static int have_ud_qps(void)
{
	struct ibk_ctx *ctx;
	struct ibk_obj *o;

	FOR_EACH_CTX(ctx)
	FOR_EACH_OBJ(ctx, o)
	if (o->kind == IBK_QP && IBK_OBJ(o, ibk_qp)->pub.qp_type == IBV_QPT_UD)
		return 1;
	return 0;
}

int ibk_do_release(int timeout_ms, int quiet_only, char *out, size_t len)
{
	long t0 = ms_now(), quiet_since, t_flushed, t_destroyed;
	struct ibk_ctx *ctx;
	int errs = 0, fds, maps, late = 0, unflushed = 0, settled = 0;

	if (phase != IBK_DRAINED) {
		report_begin(out, len, "release", 0, t0);
		jcat(out, len, ",\"error\":\"not drained\"}");
		return -EINVAL;
	}
	pthread_mutex_lock(&ibk_ctx_lock);
	/* A datagram on its way in when the QP goes to ERR is lost for good (UD
	 * has no retry): first let the CQs of a process with UD QPs go quiet. */
	if (have_ud_qps()) {
		quiet_since = ms_now();
		while (ms_now() - quiet_since < 20 && ms_now() - t0 < timeout_ms) {
			int n = drain_pass();

			late += n;
			if (n)
				quiet_since = ms_now();
			usleep(1000);
		}
	}
	FOR_EACH_CTX(ctx)
	unflushed += release_flush_qps(ctx);
	/* Collect what the QPs finished before ERR: until every logged WR has
	 * reported back, or else until the CQs stay quiet. */
	quiet_since = ms_now();
	while (ms_now() - quiet_since < 20 && ms_now() - t0 < timeout_ms) {
		int n = drain_pass();

		late += n;
		if (n)
			quiet_since = ms_now();
		if (!unflushed && !quiet_only && release_settled()) {
			settled = 1;
			break;
		}
		usleep(200);
	}
	t_flushed = ms_now();
	FOR_EACH_CTX(ctx)
	errs += release_destroy(ctx);
	pthread_mutex_unlock(&ibk_ctx_lock);
	t_destroyed = ms_now();
	fds = count_device_fds(&maps);
	phase = IBK_RELEASED;
	report_begin(out, len, "release", errs == 0 && fds == 0 && maps == 0, t0);
	jcat(out, len,
	     ",\"late_completions\":%d,\"settled\":%s,\"flush_ms\":%ld,\"destroy_ms\":%ld,\"errors\":%d,"
	     "\"device_fds\":%d,\"device_maps\":%d,",
	     late, settled ? "true" : "false", t_flushed - t0, t_destroyed - t_flushed, errs, fds, maps);
	pthread_mutex_lock(&ibk_ctx_lock);
	report_qps(out, len);
	pthread_mutex_unlock(&ibk_ctx_lock);
	jcat(out, len, "}");
	return errs || fds || maps ? -EIO : 0;
}

/* ---- rebuild ------------------------------------------------------------------ */

static int rebuild_open(struct ibk_ctx *ctx)
{
	const char *want = getenv("IBCKPT_DEVICE");
	struct ibv_device **list;
	int i, n;

	list = ibk_real.get_device_list(&n);
	if (!list)
		return -ENODEV;
	for (i = 0; i < n && !ctx->real; i++)
		if (!strcmp(ibk_real.get_device_name(list[i]), want && *want ? want : ctx->dev_name))
			ctx->real = ibk_devthread_open(list[i]);
	/* otherwise any device with a port like ours */
	for (i = 0; i < n && !ctx->real; i++)
		ctx->real = ibk_devthread_open(list[i]);
	ibk_real.free_device_list(list);
	if (!ctx->real)
		return -ENODEV;
	ctx->port_gid_valid = 0;
	return ibk_ctx_read_port(ctx);
}

static int replay_mods(struct ibk_qp *qp, int from, int upto_init)
{
	int i;

	for (i = from; i < qp->nmods; i++) {
		int rc = ibk_qp_modify_real(qp, &qp->mods[i], qp->mod_masks[i], 1);

		if (rc)
			return -rc;
		if (upto_init && (qp->mod_masks[i] & IBV_QP_STATE) && qp->mods[i].qp_state == IBV_QPS_INIT)
			return i + 1;
	}
	return i;
}

static int repost_recvs(struct ibk_recvlog *log, struct ibk_qp *qp, struct ibk_srq *srq)
{
	struct ibk_rwr **v;
	uint32_t n, i;
	int rc = 0;

	n = ibk_recvlog_live(log);
	if (!n)
		return 0;
	v = calloc(n, sizeof(*v));
	if (!v)
		return -ENOMEM;
	n = ibk_recvlog_ordered(log, v, n);
	for (i = 0; i < n && !rc; i++)
		rc = qp ? ibk_qp_post_logged_recv(qp, v[i]) : ibk_srq_post_logged_recv(srq, v[i]);
	free(v);
	return rc;
}

/* One pass per kind, in dependency order (the enum's): the app may create a
 * QP before the MRs its receives use, and those receives are re-posted as
 * soon as the QP exists, so every MR must already have its new real key. */
static int rebuild_objects(struct ibk_ctx *ctx)
{
	struct ibk_obj *o;
	int rc = 0;
	int kind;

	for (kind = IBK_PD; kind <= IBK_QP; kind++)
	FOR_EACH_OBJ(ctx, o)
	{
		if ((int)o->kind != kind)
			continue;
		switch (o->kind) {
		case IBK_PD: {
			struct ibk_pd *pd = IBK_OBJ(o, ibk_pd);

			pd->real = ibk_real.alloc_pd(ctx->real);
			rc = pd->real ? 0 : -ENOMEM;
			break;
		}
		case IBK_MR:
			rc = ibk_mr_register_real(IBK_OBJ(o, ibk_mr));
			break;
		case IBK_CHAN:
			rc = ibk_chan_create_real(IBK_OBJ(o, ibk_chan));
			break;
		case IBK_CQ:
			rc = ibk_cq_create_real(IBK_OBJ(o, ibk_cq));
			break;
		case IBK_SRQ: {
			struct ibk_srq *srq = IBK_OBJ(o, ibk_srq);

			rc = ibk_srq_create_real(srq);
			if (!rc)
				rc = repost_recvs(&srq->rlog, NULL, srq);
			break;
		}
		case IBK_QP: {
			struct ibk_qp *qp = IBK_OBJ(o, ibk_qp);
			int done;

			if (qp->mods_overflow) {
				rc = -E2BIG;
				break;
			}
			rc = ibk_qp_create_real(qp);
			if (rc)
				break;
			qp->releasing = 0;
			qp->psn_base = 0;
			pthread_mutex_lock(&ctx->lock);
			ibk_idmap_put(&ctx->qpns, qp->vqpn, qp->real->qp_num);
			pthread_mutex_unlock(&ctx->lock);
			/* Receives go in before the peer can send: INIT first. */
			done = replay_mods(qp, 0, 1);
			if (done < 0) {
				rc = done;
				break;
			}
			qp->mods_done = done;
			if (!qp->srq && qp->state >= IBV_QPS_INIT)
				rc = repost_recvs(&qp->rlog, qp, NULL);
			break;
		}
		case IBK_AH:
			break; /* after the peers are known */
		}
		if (rc) {
			ibk_log("rebuild: kind-%d object failed: %d", o->kind, rc);
			return rc;
		}
	}
	return 0;
}

static int publish_qps(struct ibk_ctx *ctx, uint64_t epoch, int timeout_ms)
{
	struct ibk_qp *qp;
	struct ibk_coord_batch batch = {0};
	struct ibk_obj *o;
	size_t vlen = 64 + 24 * (ctx->rkeys.live + 1);
	char *val = malloc(vlen);
	int rc;

	if (!val)
		return -ENOMEM;
	FOR_EACH_QP(ctx, o, qp)
	{
		int g;

		for (g = 0; g < 4; g++) {
			char key[128], vhex[40], rhex[40], head[128];
			size_t i;

			if (!(ctx->port_gid_valid & (1u << g)))
				continue;
			ibk_gid_hex(&ctx->vgid[g], vhex);
			ibk_gid_hex(&ctx->rgid[g], rhex);
			snprintf(head, sizeof(head), "%s %u %u", rhex, ctx->rlid, qp->real->qp_num);
			snprintf(key, sizeof(key), "map/%s/%u", vhex, qp->vqpn);
			rc = ibk_coord_batch_put(&batch, key, head);
			if (rc)
				goto fail;
			snprintf(val, vlen, "%s %llu %zu", head, (unsigned long long)qp->cnt.recvs_completed,
				 ctx->rkeys.live);
			for (i = 0; i < ctx->rkeys.cap; i++)
				if (ctx->rkeys.used[i] == 1)
					snprintf(val + strlen(val), vlen - strlen(val), " %x:%x", ctx->rkeys.keys[i],
						 ctx->rkeys.vals[i]);
			snprintf(key, sizeof(key), "e%llu/qp/%s/%u", (unsigned long long)epoch, vhex, qp->vqpn);
			rc = ibk_coord_batch_put(&batch, key, val);
			if (rc)
				goto fail;
		}
	}
	free(val);
	return ibk_coord_batch_send(&batch, timeout_ms);
fail:
	free(val);
	free(batch.buf);
	return rc;
}

static int fetch_peer(struct ibk_qp *qp, uint64_t epoch, int timeout_ms)
{
	char key[128], hex[40], rg[40], *val, *p;
	unsigned int lid, rqpn;
	unsigned long long recvs;
	size_t nk, i;
	int off, rc;
	struct ibk_peer_map pm;
	size_t vlen = 1 << 20;

	ibk_gid_hex(&qp->peer.vgid, hex);
	snprintf(key, sizeof(key), "e%llu/qp/%s/%u", (unsigned long long)epoch, hex, qp->peer.vqpn);
	val = malloc(vlen);
	if (!val)
		return -ENOMEM;
	rc = ibk_coord_get(key, val, vlen, timeout_ms);
	if (rc) {
		ibk_log("rebuild: no record of peer %s/%u: %d", hex, qp->peer.vqpn, rc);
		free(val);
		return -ETIMEDOUT;
	}
	if (sscanf(val, "%39s %u %u %llu %zu%n", rg, &lid, &rqpn, &recvs, &nk, &off) != 5 ||
	    ibk_gid_parse(rg, &qp->peer.rgid)) {
		free(val);
		return -EPROTO;
	}
	qp->peer.rlid = (uint16_t)lid;
	qp->peer.rqpn = rqpn;
	qp->peer.recvs_completed = recvs;
	p = val + off;
	for (i = 0; i < nk; i++) {
		unsigned int v, r;
		int used;

		if (sscanf(p, " %x:%x%n", &v, &r, &used) != 2)
			break;
		ibk_idmap_put(&qp->peer.rkeys, v, r);
		p += used;
	}
	atomic_store(&ibk_xlate_any, 1);
	qp->peer.rkeys_translate = 1;
	free(val);
	pm.vgid = qp->peer.vgid;
	pm.rgid = qp->peer.rgid;
	pm.vqpn = qp->peer.vqpn;
	pm.rqpn = rqpn;
	pm.vlid = qp->peer.vlid;
	pm.rlid = qp->peer.rlid;
	pm.epoch = epoch;
	ibk_peers_put(&pm);
	return 0;
}

/* Settle the send log against the peer's count, then reconnect and post
 * exactly the sends the peer never executed. */
static int rebuild_settle_qp(struct ibk_qp *qp)
{
	uint32_t n, i, *flags;
	uint8_t *verdict;
	int unknown = 0, rc = 0;

	ibk_lock(&qp->lock);
	/* the flag WR is always last: it is re-posted at the next drain if needed */
	while (ibk_sendlog_count(&qp->slog) &&
	       (ibk_sendlog_at(&qp->slog, qp->slog.tail - 1)->flags & IBK_SWR_FLAG_WR))
		ibk_sendlog_unpush(&qp->slog);
	n = ibk_sendlog_count(&qp->slog);
	flags = calloc(n + 1, sizeof(*flags));
	verdict = calloc(n + 1, 1);
	if (!flags || !verdict) {
		rc = -ENOMEM;
		goto out;
	}
	for (i = 0; i < n; i++)
		flags[i] = ibk_sendlog_at(&qp->slog, qp->slog.head + i)->flags;
	if (qp->pub.qp_type == IBV_QPT_RC && qp->peer.valid) {
		unknown = ibk_plan_resend(flags, n, qp->peer.recvs_completed, qp->cnt.consumers_done, verdict);
		if (unknown) {
			ibk_log("rebuild: QP %u: cannot settle %d sends (peer recvs %llu, ours done %llu)", qp->vqpn,
				unknown, (unsigned long long)qp->peer.recvs_completed,
				(unsigned long long)qp->cnt.consumers_done);
			rc = -EPROTO;
			goto out;
		}
	} else {
		memset(verdict, IBK_V_REPOST, n);
	}
	/* DELIVERED entries form a prefix: complete them for the app. A read or
	 * atomic there executed at the peer, but its response never arrived:
	 * its data is lost, and neither a made-up completion nor a second
	 * execution would be right. Drain waits for these, so this is a bug. */
	for (i = 0; i < n && verdict[i] == IBK_V_DELIVERED; i++) {
		struct ibk_swr *e = ibk_sendlog_at(&qp->slog, qp->slog.head + i);

		if (!(e->flags & IBK_SWR_FLAG_WR) &&
		    ((e->flags & IBK_SWR_ATOMIC) || e->wr.opcode == IBV_WR_RDMA_READ)) {
			ibk_log("rebuild: QP %u: a read/atomic executed at the peer but its response was lost",
				qp->vqpn);
			rc = -EPROTO;
			goto out;
		}
	}
	for (i = 0; i < n && verdict[i] == IBK_V_DELIVERED; i++) {
		struct ibk_swr *e = ibk_sendlog_at(&qp->slog, qp->slog.head);

		if (e->flags & IBK_SWR_SIGNALED) {
			ibk_cq_synthesize(qp, e);
			qp->cnt.synthesized++;
		}
		ibk_sendlog_retire_to(&qp->slog, e->seq, &qp->cnt);
	}
	rc = replay_mods(qp, qp->mods_done, 0);
	if (rc < 0)
		goto out;
	rc = 0;
	n = ibk_sendlog_count(&qp->slog);
	for (i = 0; i < n && !rc; i++) {
		rc = ibk_qp_post_logged_send(qp, ibk_sendlog_at(&qp->slog, qp->slog.head + i));
		qp->cnt.reposted++;
	}
	if (rc)
		rc = -rc;
out:
	ibk_unlock(&qp->lock);
	free(flags);
	free(verdict);
	return rc;
}

/* ms since *mark, and *mark moved to now */
static long lap_ms(long *mark)
{
	long now = ms_now(), ms = now - *mark;

	*mark = now;
	return ms;
}

int ibk_do_rebuild(uint64_t epoch, int timeout_ms, char *out, size_t len)
{
	struct ibk_qp *qp;
	long t0 = ms_now();
	/* each step's ms, for the report; lap is when the last step ended */
	long lap = t0, t_open = 0, t_objects = 0, t_publish = 0, t_peers = 0, t_settle = 0;
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	int rc = 0;
	const char *step = "open";

	if (phase != IBK_RELEASED) {
		report_begin(out, len, "rebuild", 0, t0);
		jcat(out, len, ",\"error\":\"not released\"}");
		return -EINVAL;
	}
	if (!ibk_coord_configured()) {
		report_begin(out, len, "rebuild", 0, t0);
		jcat(out, len, ",\"error\":\"IBCKPT_COORD is not set\"}");
		return -ENOTCONN;
	}
	pthread_mutex_lock(&ibk_ctx_lock);
	atomic_store(&ibk_translating, 1);
	atomic_store(&ibk_xlate_any, 1);
	FOR_EACH_CTX(ctx)
	{
		ctx->translate = 1;
		rc = rebuild_open(ctx);
		if (rc)
			goto out;
		t_open += lap_ms(&lap);
		step = "objects";
		rc = rebuild_objects(ctx);
		if (rc)
			goto out;
		t_objects += lap_ms(&lap);
		step = "publish";
		rc = publish_qps(ctx, epoch, timeout_ms - (int)(ms_now() - t0));
		if (rc)
			goto out;
		t_publish += lap_ms(&lap);
	}
	step = "peers";
	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	{
		if (qp->peer.valid && qp->pub.qp_type != IBV_QPT_UD) {
			rc = fetch_peer(qp, epoch, timeout_ms - (int)(ms_now() - t0));
			if (rc)
				goto out;
		}
	}
	/* UD destinations the app has used: their new ids before the AHs and
	 * any re-posted datagram need them */
	step = "ud peers";
	FOR_EACH_CTX(ctx)
	FOR_EACH_OBJ(ctx, o)
	{
		struct ibk_ah *ah;
		struct ibk_peer_map pm;

		if (o->kind != IBK_AH || !IBK_OBJ(o, ibk_ah)->used || !IBK_OBJ(o, ibk_ah)->attr.is_global)
			continue;
		ah = IBK_OBJ(o, ibk_ah);
		if (!ibk_peers_lookup(&ah->attr.grh.dgid, ah->last_qpn, &pm))
			continue;
		memset(&pm, 0, sizeof(pm));
		pm.vgid = ah->attr.grh.dgid;
		pm.vqpn = ah->last_qpn;
		ibk_peers_put(&pm); /* epoch 0: the refresh below fills it in */
	}
	ibk_peers_refresh(epoch, timeout_ms - (int)(ms_now() - t0));
	t_peers = lap_ms(&lap);
	step = "settle";
	FOR_EACH_CTX(ctx)
	FOR_EACH_OBJ(ctx, o)
	{
		if (o->kind == IBK_QP) {
			rc = rebuild_settle_qp(IBK_OBJ(o, ibk_qp));
			if (rc)
				goto out;
		} else if (o->kind == IBK_AH) {
			rc = ibk_ah_create_real(IBK_OBJ(o, ibk_ah));
			if (rc)
				goto out;
		} else if (o->kind == IBK_CQ) {
			struct ibk_cq *cq = IBK_OBJ(o, ibk_cq);

			if (cq->armed)
				cq->real->context->ops.req_notify_cq(cq->real, cq->solicited);
		}
	}
	t_settle = lap_ms(&lap);
	last_epoch = epoch;
	phase = IBK_REBUILT;
out:
	report_begin(out, len, "rebuild", rc == 0, t0);
	if (rc)
		jcat(out, len, ",\"error\":\"%s failed: %s\"", step, strerror(-rc));
	jcat(out, len, ",\"steps_ms\":{\"open\":%ld,\"objects\":%ld,\"publish\":%ld,\"peers\":%ld,\"settle\":%ld}",
	     t_open, t_objects, t_publish, t_peers, t_settle);
	jcat(out, len, ",\"epoch\":%llu,", (unsigned long long)epoch);
	report_qps(out, len);
	jcat(out, len, "}");
	pthread_mutex_unlock(&ibk_ctx_lock);
	return rc;
}

/* ---- resume / abort / status ------------------------------------------------ */

int ibk_do_resume(char *out, size_t len)
{
	long t0 = ms_now();

	if (phase != IBK_REBUILT && phase != IBK_QUIESCED && phase != IBK_DRAINED) {
		report_begin(out, len, "resume", 0, t0);
		jcat(out, len, ",\"error\":\"nothing to resume from\"}");
		return -EINVAL;
	}
	if (phase == IBK_REBUILT)
		checkpoints_done++;
	phase = IBK_RUNNING;
	ibk_chan_wake_all(0);
	ibk_gate_open();
	posts_open();
	ibk_hooks_notify(IBCKPT_EV_RESUME);
	report_begin(out, len, "resume", 1, t0);
	jcat(out, len, "}");
	return 0;
}

int ibk_do_abort(char *out, size_t len)
{
	char tmp[256];

	if (phase == IBK_RELEASED) {
		/* the resources are gone: only a rebuild (with the peers) helps */
		snprintf(out, len, "{\"phase\":\"abort\",\"ok\":false,\"state\":\"released\","
				   "\"error\":\"released: send rebuild, then resume\"}");
		return -EINVAL;
	}
	if (phase != IBK_RUNNING && ibk_do_resume(tmp, sizeof(tmp))) {
		snprintf(out, len, "{\"phase\":\"abort\",\"ok\":false,\"error\":\"resume failed\"}");
		return -EINVAL;
	}
	snprintf(out, len, "{\"phase\":\"abort\",\"ok\":true,\"state\":\"running\"}");
	return 0;
}

int ibk_do_status(char *out, size_t len)
{
	out[0] = 0;
	pthread_mutex_lock(&ibk_ctx_lock);
	jcat(out, len,
	     "{\"proto\":%d,\"pid\":%d,\"state\":\"%s\",\"epoch\":%llu,\"checkpoints\":%lu,"
	     "\"gate_closed\":%d,\"inside\":%ld,\"delegated_writes\":%lu,",
	     IBCKPT_PROTO_VERSION, (int)getpid(), ibk_phase_name(phase), (unsigned long long)last_epoch,
	     checkpoints_done, ibk_gate_is_closed(), ibk_gate_inside(),
	     ibk_devthread_writes());
	report_qps(out, len);
	report_identity(out, len);
	jcat(out, len, "}");
	pthread_mutex_unlock(&ibk_ctx_lock);
	return 0;
}

int ibk_phase_lock(void)
{
	return pthread_mutex_lock(&phase_lock);
}

int ibk_phase_unlock(void)
{
	return pthread_mutex_unlock(&phase_lock);
}
