/* drain: poll every real CQ into the shadow CQs' private queues until no
 * send is outstanding, or only sends rebuild can settle are left. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "phases.h"
#include "rdmacm.h"

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
int ibk_drain_pass(void)
{
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	int n = 0;

	FOR_EACH_CTX(ctx)
	ibk_async_drain(ctx);
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
	long t0 = ibk_ms_now(), last_move = t0;
	int flags, moved = 0, stalled = 0, cm_events;
	useconds_t nap = 100;
	uint32_t pending;

	if (ibk_phase_cur != IBK_QUIESCED) {
		ibk_report_begin(out, len, "drain", 0, t0);
		ibk_jcat(out, len, ",\"error\":\"not quiesced\"}");
		return -EINVAL;
	}
	pthread_mutex_lock(&ibk_ctx_lock);
	flags = drain_post_flags();
	for (;;) {
		int n = ibk_drain_pass();

		moved += n;
		if (n) {
			last_move = ibk_ms_now();
			nap = 100;
		}
		pending = pending_sends();
		if (!pending || ibk_ms_now() - t0 > timeout_ms)
			break;
		if (ibk_ms_now() - last_move >= stall_ms && pending_settleable()) {
			stalled = 1;
			break;
		}
		/* back off while nothing moves: other ranks' app threads need the
		 * CPU to reach their gates */
		usleep(nap);
		nap = nap < 2000 ? nap * 2 : 2000;
	}
	cm_events = ibk_cm_drain(); /* every rank is quiesced and none released yet */
	ibk_phase_cur = IBK_DRAINED;
	ibk_report_begin(out, len, "drain", 1, t0);
	/* Sends still pending are settled at rebuild by the peers' counters. */
	ibk_jcat(out, len, ",\"flag_wrs\":%d,\"moved\":%d,\"pending_sends\":%u,\"stalled\":%s,\"cm_events\":%d,",
	     flags, moved, pending, stalled ? "true" : "false", cm_events);
	ibk_report_qps(out, len);
	ibk_jcat(out, len, "}");
	pthread_mutex_unlock(&ibk_ctx_lock);
	return 0;
}
