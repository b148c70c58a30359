/* rebuild: open a device, create every object again, publish this rank's
 * new ids, fetch the peers', settle the send logs and reconnect. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coord.h"
#include "devmap.h"
#include "devthread.h"
#include "phases.h"

/* Open the device the plan chose for ctx (devmap.c: before any is opened). */
static int rebuild_open(struct ibk_ctx *ctx, struct ibk_devlist *now)
{
	ctx->real = ibk_devthread_open(now->list[ctx->plan_index]);
	if (!ctx->real) {
		ibk_log("rebuild: cannot open %s (index %d)", now->names[ctx->plan_index], ctx->plan_index);
		return -ENODEV;
	}
	ibk_ctx_moved(ctx, now);
	if (ibk_async_attach(ctx))
		ibk_log("rebuild: async events of %s will not be delivered", ctx->dev_name);
	ibk_ctx_remember_gids(ctx);
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
		case IBK_MW:
			break; /* below, once every MR has its new key */
		}
		if (rc) {
			ibk_log("rebuild: kind-%d object failed: %d", o->kind, rc);
			return rc;
		}
	}
	/* windows are bound again before the records carry their rkeys */
	return ibk_mw_rebuild_all(ctx);
}

static int publish_qps(struct ibk_ctx *ctx, uint64_t epoch, int timeout_ms)
{
	struct ibk_qp *qp;
	struct ibk_coord_batch batch = {0};
	struct ibk_obj *o;
	int rc = 0;

	FOR_EACH_QP(ctx, o, qp)
	{
		struct ibk_record r = {.rgid = {{0}}, .rlid = ctx->rlid, .rqpn = qp->real->qp_num,
				       .recvs_completed = qp->cnt.recvs_completed};
		int g;

		for (g = 0; g < 4; g++) {
			char key[128], head[128], *val;

			if (!(ctx->port_gid_valid & (1u << g)))
				continue;
			r.rgid = ctx->rgid[g];
			ibk_record_head(head, sizeof(head), &r);
			ibk_record_key_map(key, sizeof(key), &ctx->vgid[g], qp->vqpn);
			rc = ibk_coord_batch_put(&batch, key, head);
			if (rc)
				goto fail;
			val = ibk_record_qp(&r, &ctx->rkeys);
			if (!val) {
				rc = -ENOMEM;
				goto fail;
			}
			ibk_record_key_qp(key, sizeof(key), epoch, &ctx->vgid[g], qp->vqpn);
			rc = ibk_coord_batch_put(&batch, key, val);
			free(val);
			if (rc)
				goto fail;
		}
	}
	return ibk_coord_batch_send(&batch, timeout_ms);
fail:
	free(batch.buf);
	return rc;
}

static int fetch_peer(struct ibk_qp *qp, uint64_t epoch, int timeout_ms)
{
	char key[128], hex[IBK_GID_HEX], *val;
	struct ibk_peer_map pm;
	struct ibk_record r;
	const char *p;
	size_t vlen = 1 << 20, i;
	uint32_t v, rk;
	int rc;

	ibk_gid_hex(&qp->peer.vgid, hex);
	ibk_record_key_qp(key, sizeof(key), epoch, &qp->peer.vgid, qp->peer.vqpn);
	val = malloc(vlen);
	if (!val)
		return -ENOMEM;
	rc = ibk_coord_get(key, val, vlen, timeout_ms);
	if (rc) {
		ibk_log("rebuild: no record of peer %s/%u: %d", hex, qp->peer.vqpn, rc);
		free(val);
		return -ETIMEDOUT;
	}
	if (ibk_record_parse(val, 1, &r)) {
		ibk_log("rebuild: the record of peer %s/%u is malformed", hex, qp->peer.vqpn);
		free(val);
		return -EPROTO;
	}
	qp->peer.rgid = r.rgid;
	qp->peer.rlid = r.rlid;
	qp->peer.rqpn = r.rqpn;
	qp->peer.recvs_completed = r.recvs_completed;
	for (p = r.keys, i = 0; i < r.nkeys && ibk_record_next_key(&p, &v, &rk); i++)
		ibk_idmap_put(&qp->peer.rkeys, v, rk);
	atomic_store(&ibk_xlate_any, 1);
	qp->peer.rkeys_translate = 1;
	free(val);
	pm.vgid = qp->peer.vgid;
	pm.rgid = qp->peer.rgid;
	pm.vqpn = qp->peer.vqpn;
	pm.rqpn = r.rqpn;
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
	long now = ibk_ms_now(), ms = now - *mark;

	*mark = now;
	return ms;
}

int ibk_do_rebuild(uint64_t epoch, int timeout_ms, char *out, size_t len)
{
	struct ibk_qp *qp;
	long t0 = ibk_ms_now();
	/* each step's ms, for the report; lap is when the last step ended */
	long lap = t0, t_open = 0, t_objects = 0, t_publish = 0, t_peers = 0, t_settle = 0;
	struct ibk_ctx *ctx;
	struct ibk_devlist *now = NULL;
	struct ibk_obj *o;
	int rc = 0;
	const char *step = "open";
	char why[2048] = "";

	if (ibk_phase_cur != IBK_RELEASED) {
		ibk_report_begin(out, len, "rebuild", 0, t0);
		ibk_jcat(out, len, ",\"error\":\"not released\"}");
		return -EINVAL;
	}
	if (!ibk_coord_configured()) {
		ibk_report_begin(out, len, "rebuild", 0, t0);
		ibk_jcat(out, len, ",\"error\":\"IBCKPT_COORD is not set\"}");
		return -ENOTCONN;
	}
	pthread_mutex_lock(&ibk_ctx_lock);
	/* every context's device is chosen before any is opened: a refusal
	 * leaves the process released as it was, for a rebuild that can work */
	if (ibk_devmap_plan(&now, why, sizeof(why))) {
		rc = -ENODEV;
		goto out;
	}
	atomic_store(&ibk_translating, 1);
	atomic_store(&ibk_xlate_any, 1);
	FOR_EACH_CTX(ctx)
	{
		ctx->translate = 1;
		rc = rebuild_open(ctx, now);
		if (rc)
			goto out;
		t_open += lap_ms(&lap);
		step = "objects";
		rc = rebuild_objects(ctx);
		if (rc)
			goto out;
		t_objects += lap_ms(&lap);
		step = "publish";
		rc = publish_qps(ctx, epoch, timeout_ms - (int)(ibk_ms_now() - t0));
		if (rc)
			goto out;
		t_publish += lap_ms(&lap);
	}
	step = "peers";
	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	{
		if (qp->peer.valid && qp->pub.qp_type != IBV_QPT_UD) {
			rc = fetch_peer(qp, epoch, timeout_ms - (int)(ibk_ms_now() - t0));
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
	ibk_peers_refresh(epoch, timeout_ms - (int)(ibk_ms_now() - t0));
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
	ibk_last_epoch = epoch;
	ibk_phase_cur = IBK_REBUILT;
	ibk_devmap_consumed();
out:
	ibk_devlist_put(now);
	ibk_report_begin(out, len, "rebuild", rc == 0, t0);
	if (rc && why[0])
		ibk_jcat(out, len, ",\"error\":\"refused: %s\"", why);
	else if (rc)
		ibk_jcat(out, len, ",\"error\":\"%s failed: %s\"", step, strerror(-rc));
	ibk_jcat(out, len, ",\"steps_ms\":{\"open\":%ld,\"objects\":%ld,\"publish\":%ld,\"peers\":%ld,\"settle\":%ld}",
	     t_open, t_objects, t_publish, t_peers, t_settle);
	ibk_jcat(out, len, ",\"epoch\":%llu,", (unsigned long long)epoch);
	ibk_report_qps(out, len);
	ibk_jcat(out, len, "}");
	pthread_mutex_unlock(&ibk_ctx_lock);
	return rc;
}
