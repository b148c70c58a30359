/* The parts of the status report that walk the shadow objects: per-QP
 * counters, and this rank's identity for the agent's preflight. */
#include "devmap.h"
#include "phases.h"
#include "rdmacm.h"

void ibk_report_qps(char *out, size_t len)
{
	struct ibk_qp *qp;
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	int first = 1;

	ibk_jcat(out, len, "\"qps\":[");
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
		ibk_jcat(out, len,
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
	ibk_jcat(out, len, "]");
}

/* For the agent's preflight: this rank's own GIDs, every connected QP's peer as the app
 * gave it (virtual GID and QPN), every address handle's GID, and the verbs the shim refused. */
void ibk_report_identity(char *out, size_t len)
{
	struct ibk_qp *qp;
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	const char *verbs[IBK_MAX_REFUSED];
	char hex[40];
	int first = 1, g, n, i;

	ibk_jcat(out, len, ",\"gids\":[");
	FOR_EACH_CTX(ctx)
	for (g = 0; g < 4; g++) {
		if (!(ctx->port_gid_valid & (1u << g)))
			continue;
		ibk_gid_hex(&ctx->vgid[g], hex);
		ibk_jcat(out, len, "%s\"%s\"", first ? "" : ",", hex);
		first = 0;
	}
	ibk_jcat(out, len, "],\"peers\":[");
	first = 1;
	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	{
		if (!qp->peer.valid || qp->pub.qp_type == IBV_QPT_UD)
			continue;
		ibk_gid_hex(&qp->peer.vgid, hex);
		ibk_jcat(out, len, "%s{\"qpn\":%u,\"type\":%d,\"peer_gid\":\"%s\",\"peer_qpn\":%u}", first ? "" : ",",
		     qp->vqpn, qp->pub.qp_type, hex, qp->peer.vqpn);
		first = 0;
	}
	/* UD has no connection: where its datagrams go is in the address handles */
	ibk_jcat(out, len, "],\"ah_gids\":[");
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
		ibk_jcat(out, len, "%s\"%s\"", first ? "" : ",", hex);
		first = 0;
	}
	/* memory windows: the app's (virtual) rkey, the real one, bound or not */
	ibk_jcat(out, len, "],\"mws\":[");
	first = 1;
	FOR_EACH_CTX(ctx)
	FOR_EACH_OBJ(ctx, o)
	if (o->kind == IBK_MW) {
		struct ibk_mw *mw = IBK_OBJ(o, ibk_mw);

		ibk_jcat(out, len, "%s{\"rkey\":%u,\"real_rkey\":%u,\"bound\":%d}", first ? "" : ",", mw->pub.rkey,
		     mw->real ? mw->real->rkey : 0, mw->mr != NULL);
		first = 0;
	}
	ibk_jcat(out, len, "],\"unsupported\":[");
	n = ibk_refused_verbs(verbs, IBK_MAX_REFUSED);
	for (i = 0; i < n; i++)
		ibk_jcat(out, len, "%s\"%s\"", i ? "," : "", verbs[i]);
	/* State the process holds that a rebuild would not recreate: the
	 * preflight refuses the checkpoint before anything is touched. */
	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	{
		if (qp->mods_overflow)
			ibk_jcat(out, len, "%s\"ibv_modify_qp (QP %u: more than %d calls since RESET, not replayable)\"",
			     n++ ? "," : "", qp->vqpn, IBK_MAX_MODS);
		if (qp->ece_set)
			ibk_jcat(out, len, "%s\"ibv_set_ece (QP %u: ECE is not set again on a rebuilt QP)\"",
			     n++ ? "," : "", qp->vqpn);
	}
	/* a fork child still holding its parent's device files and mappings (fork.c) */
	if (ibk_ctx_inherited)
		ibk_jcat(out, len, "%s\"verbs device of the parent process (opened before fork)\"", n++ ? "," : "");
	/* librdmacm's ids that a checkpoint would not carry (rdmacm.c) */
	ibk_cm_report_problems(out, len, &n);
	ibk_jcat(out, len, "]");
}

/* Each context's device, as the agent records it in a checkpoint: its name
 * and index in the device list now, its virtual GIDs and, while open, the
 * real ones (they tell which device it is really on). */
void ibk_report_contexts(char *out, size_t len)
{
	struct ibk_ctx *ctx;
	char name[IBV_SYSFS_NAME_MAX * 6], hex[40];
	int n = 0, k, i, g, kind;

	for (ctx = ibk_ctx_list; ctx; ctx = ctx->next_ctx)
		n++;
	ibk_jcat(out, len, ",\"contexts\":[");
	for (k = n - 1; k >= 0; k--) { /* the list is newest first */
		for (ctx = ibk_ctx_list, i = 0; i < k; i++)
			ctx = ctx->next_ctx;
		ibk_json_str(name, sizeof(name), ctx->dev_name);
		ibk_jcat(out, len, "%s{\"device\":\"%s\",\"index\":%d", k == n - 1 ? "" : ",", name, ctx->dev_index);
		for (kind = 0; kind < 2; kind++) {
			int first = 1;

			ibk_jcat(out, len, kind ? "],\"real_gids\":[" : ",\"gids\":[");
			for (g = 0; g < 4; g++) {
				if (!(ctx->port_gid_valid & (1u << g)) || (kind && !ctx->real))
					continue;
				ibk_gid_hex(kind ? &ctx->rgid[g] : &ctx->vgid[g], hex);
				ibk_jcat(out, len, "%s\"%s\"", first ? "" : ",", hex);
				first = 0;
			}
		}
		ibk_jcat(out, len, "]}");
	}
	ibk_jcat(out, len, "]");
}
