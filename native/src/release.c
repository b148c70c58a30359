/* release: move every QP to ERR, collect what it finished, destroy every
 * real object and close the device, then prove from /proc that nothing of
 * the device is left. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "devthread.h"
#include "phases.h"
#include "rdmacm.h"

static int count_device_fds(int *maps)
{
	char line[256];
	int n = ibk_proc_fds("/dev/infiniband/", 1);
	FILE *f;

	*maps = 0;
	f = fopen("/proc/self/maps", "r");
	while (f && fgets(line, sizeof(line), f))
		if (strstr(line, "/dev/infiniband/"))
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

/* One case of release_destroy's switch: kind's real object goes with the
 * verb `destroy`, rc takes its result and the shadow o forgets it. */
#define DESTROY_REAL_CASE(kind, type, destroy)             \
	case kind:                                         \
		rc = ibk_real.destroy(IBK_OBJ(o, type)->real); \
		IBK_OBJ(o, type)->real = NULL;             \
		break

static int release_destroy(struct ibk_ctx *ctx)
{
	struct ibk_obj *o, *p;
	int errs = release_destroy_qps(ctx);

	/* windows first: a window bound to an MR keeps the MR from going */
	FOR_EACH_OBJ(ctx, o)
	if (o->kind == IBK_MW && IBK_OBJ(o, ibk_mw)->real) {
		struct ibv_mw *real = IBK_OBJ(o, ibk_mw)->real;

		if (real->context->ops.dealloc_mw(real)) {
			ibk_log("release: deallocating a memory window failed");
			errs++;
		}
		IBK_OBJ(o, ibk_mw)->real = NULL;
	}
	FOR_EACH_OBJ_REV(ctx, o, p)
	{
		int rc = 0;

		switch (o->kind) {
		DESTROY_REAL_CASE(IBK_AH, ibk_ah, destroy_ah);
		case IBK_QP: {
			struct ibk_qp *qp = IBK_OBJ(o, ibk_qp);

			if (qp->real) /* not destroyed above: no memory for the job */
				rc = release_destroy_qp(ctx, qp);
			break;
		}
		DESTROY_REAL_CASE(IBK_SRQ, ibk_srq, destroy_srq);
		DESTROY_REAL_CASE(IBK_CQ, ibk_cq, destroy_cq);
		case IBK_CHAN:
			rc = ibk_chan_release_real(IBK_OBJ(o, ibk_chan));
			break;
		DESTROY_REAL_CASE(IBK_MR, ibk_mr, dereg_mr);
		DESTROY_REAL_CASE(IBK_PD, ibk_pd, dealloc_pd);
		case IBK_MW:
			break; /* above */
		}
		if (rc) {
			ibk_log("release: destroying a kind-%d object failed: %d", o->kind, rc);
			errs++;
		}
	}
	ibk_async_detach(ctx);
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

/* Drains the CQs, pausing pause_us between passes, until they stay quiet for
 * 20 ms or the release's timeout_ms since t0 runs out. With may_settle it
 * stops as soon as every logged WR has reported back, and says so in
 * *settled. Returns the completions it collected. */
static int drain_until_quiet(long t0, int timeout_ms, useconds_t pause_us, int may_settle, int *settled)
{
	long quiet_since = ibk_ms_now();
	int late = 0;

	while (ibk_ms_now() - quiet_since < 20 && ibk_ms_now() - t0 < timeout_ms) {
		int n = ibk_drain_pass();

		late += n;
		if (n)
			quiet_since = ibk_ms_now();
		if (may_settle && release_settled()) {
			*settled = 1;
			break;
		}
		usleep(pause_us);
	}
	return late;
}

int ibk_do_release(int timeout_ms, int quiet_only, char *out, size_t len)
{
	long t0 = ibk_ms_now(), t_flushed, t_destroyed;
	struct ibk_ctx *ctx;
	int errs = 0, fds, maps, late = 0, unflushed = 0, settled = 0, cm_detached;
	struct ibk_redirty redirty;

	if (ibk_phase_cur != IBK_DRAINED) {
		ibk_report_begin(out, len, "release", 0, t0);
		ibk_jcat(out, len, ",\"error\":\"not drained\"}");
		return -EINVAL;
	}
	pthread_mutex_lock(&ibk_ctx_lock);
	/* A datagram on its way in when the QP goes to ERR is lost for good (UD
	 * has no retry): first let the CQs of a process with UD QPs go quiet. */
	if (have_ud_qps())
		late += drain_until_quiet(t0, timeout_ms, 1000, 0, &settled);
	FOR_EACH_CTX(ctx)
	unflushed += release_flush_qps(ctx);
	/* Collect what the QPs finished before ERR: until every logged WR has
	 * reported back, or else until the CQs stay quiet. */
	late += drain_until_quiet(t0, timeout_ms, 200, !unflushed && !quiet_only, &settled);
	t_flushed = ibk_ms_now();
	FOR_EACH_CTX(ctx)
	errs += release_destroy(ctx);
	ibk_redirty_mrs(&redirty); /* no QP is left to write them */
	pthread_mutex_unlock(&ibk_ctx_lock);
	cm_detached = ibk_cm_release();
	t_destroyed = ibk_ms_now();
	fds = count_device_fds(&maps);
	ibk_phase_cur = IBK_RELEASED;
	ibk_report_begin(out, len, "release", errs == 0 && fds == 0 && maps == 0, t0);
	ibk_jcat(out, len,
	     ",\"late_completions\":%d,\"settled\":%s,\"flush_ms\":%ld,\"destroy_ms\":%ld,\"errors\":%d,"
	     "\"device_fds\":%d,\"device_maps\":%d,\"cm_detached\":%d,\"redirtied_pages\":%zu,"
	     "\"redirty_missed_bytes\":%zu,",
	     late, settled ? "true" : "false", t_flushed - t0, t_destroyed - t_flushed, errs, fds, maps, cm_detached,
	     redirty.pages, redirty.missed_bytes);
	pthread_mutex_lock(&ibk_ctx_lock);
	ibk_report_qps(out, len);
	pthread_mutex_unlock(&ibk_ctx_lock);
	ibk_jcat(out, len, "}");
	return errs || fds || maps ? -EIO : 0;
}
