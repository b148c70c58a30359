/* verbs_seq's UD mode (-m ud): the client sends data, the server
 * acknowledges each datagram; both check order, content and the peer's
 * (virtual) source QPN. */
#include "verbs_seq.h"

/* ---- UD: the client sends, the server acknowledges ---------------------------- */

static void ud_send(uint64_t wr_id, struct msg *m, int sig)
{
	struct ibv_sge sge = {(uintptr_t)m, sizeof(*m), mr->lkey};
	struct ibv_send_wr w;

	memset(&w, 0, sizeof(w));
	w.wr_id = wr_id;
	w.sg_list = &sge;
	w.num_sge = 1;
	w.opcode = IBV_WR_SEND;
	w.send_flags = sig ? IBV_SEND_SIGNALED : 0;
	w.wr.ud.ah = ah;
	w.wr.ud.remote_qpn = theirs.qpn;
	w.wr.ud.remote_qkey = QKEY;
	post(&w);
}

void ud_run(void)
{
	int client = o.peer != NULL, stopping = 0, end_sent = 0, got_end = 0, i;
	/* client: data posted / acked; server: data received / acks posted */
	uint64_t next = 0, acked = 0, received = 0, acks_posted = 0, send_retired = 0;
	uint64_t send_sum = 0, recv_sum = 0, end_at = UINT64_MAX;
	long last_check = 0, last_progress = now_ms();

	for (;;) {
		struct ibv_wc wc[16];
		int n;

		if (client && !stopping && now_ms() - last_check > 20) {
			last_check = now_ms();
			stopping = file_exists(o.stop);
		}
		if (client && got_end && send_retired == next)
			break;
		if (!client && end_sent && send_retired == acks_posted)
			break;
		/* a send slot is free again once its send completed */
		while (client && !end_sent && next - acked < (uint64_t)o.window &&
		       next - send_retired < (uint64_t)o.window) {
			struct msg *m = sbuf_at(next);
			int last = stopping;

			if (last)
				msg_fill(m, next, MSG_END, next, send_sum);
			else
				msg_fill(m, next, MSG_DATA, 0, 0);
			ud_send(next, m, last || signaled(next));
			if (last) {
				end_sent = 1;
				end_at = next;
			} else {
				send_sum = mix64(send_sum ^ m->check);
			}
			next++;
			if (last || signaled(next - 1))
				break;
		}
		while (!client && acks_posted < received && acks_posted - send_retired < (uint64_t)o.window) {
			struct msg *m = sbuf_at(acks_posted);
			struct msg data;
			int last = acks_posted == end_at;

			if (last) {
				msg_fill(m, acks_posted, MSG_END, acks_posted, send_sum);
			} else {
				msg_fill(&data, acks_posted, MSG_DATA, 0, 0);
				msg_fill(m, acks_posted, MSG_ACK, data.check, 0);
				send_sum = mix64(send_sum ^ m->check);
			}
			ud_send(acks_posted, m, last || signaled(acks_posted));
			acks_posted++;
			if (last)
				end_sent = 1;
		}
		n = poll_or_stall(wc, 16, &last_progress);
		if (n < 0) {
			BAD("no progress for %d ms: a datagram was lost (next %llu acked %llu received %llu)", STALL_MS,
			    (unsigned long long)next, (unsigned long long)acked, (unsigned long long)received);
			break;
		}
		for (i = 0; i < n; i++) {
			struct ibv_wc *c = &wc[i];

			if (c->status != IBV_WC_SUCCESS)
				DIE("completion %s wr_id %llu", ibv_wc_status_str(c->status),
				    (unsigned long long)c->wr_id);
			if (c->qp_num != qp->qp_num)
				BAD("qp_num %u != %u", c->qp_num, qp->qp_num);
			if (c->opcode == IBV_WC_SEND) {
				uint64_t limit = client ? next : acks_posted;

				if (c->wr_id < send_retired || c->wr_id >= limit)
					BAD("send completion %llu outside [%llu, %llu)", (unsigned long long)c->wr_id,
					    (unsigned long long)send_retired, (unsigned long long)limit);
				else
					send_retired = c->wr_id + 1;
				continue;
			}
			if (c->opcode != IBV_WC_RECV) {
				BAD("opcode %d", c->opcode);
				continue;
			}
			{
				struct msg *m = (struct msg *)(rbuf_at(c->wr_id) + GRH);
				uint64_t want = client ? acked : received;

				if (c->src_qp != theirs.qpn)
					BAD("src_qp %u, the peer is %u", c->src_qp, theirs.qpn);
				if (c->byte_len != GRH + sizeof(*m) || !msg_ok(m))
					BAD("corrupt datagram (len %u) at %llu", c->byte_len, (unsigned long long)want);
				else if (m->seq != want)
					BAD("seq %llu, expected %llu (%s)", (unsigned long long)m->seq,
					    (unsigned long long)want, m->seq < want ? "duplicate" : "gap");
				else if (client && m->kind == MSG_END) {
					if (m->value != end_at || m->sum != recv_sum)
						BAD("end ack: server acked %llu (sum %llx), got %llu (sum %llx)",
						    (unsigned long long)m->value, (unsigned long long)m->sum,
						    (unsigned long long)end_at, (unsigned long long)recv_sum);
					got_end = 1;
				} else if (client) {
					struct msg data;

					msg_fill(&data, m->seq, MSG_DATA, 0, 0);
					if (m->kind != MSG_ACK || m->value != data.check)
						BAD("ack %llu does not match the data", (unsigned long long)m->seq);
					recv_sum = mix64(recv_sum ^ m->check);
				} else if (m->kind == MSG_END) {
					if (m->value != received || m->sum != recv_sum)
						BAD("end: client sent %llu (sum %llx), got %llu (sum %llx)",
						    (unsigned long long)m->value, (unsigned long long)m->sum,
						    (unsigned long long)received, (unsigned long long)recv_sum);
					end_at = received;
					got_end = 1;
				} else {
					recv_sum = mix64(recv_sum ^ m->check);
				}
				if (m->seq == want) {
					if (client)
						acked++;
					else
						received++;
				}
			}
			post_recv_slot(c->wr_id);
		}
	}
	(void)got_end;
	if (client)
		printf("RESULT mode=%d sent=%llu received=%llu send_sum=%016llx recv_sum=%016llx events=0 bad=%d\n",
		       o.mode, (unsigned long long)(end_at == UINT64_MAX ? next : end_at),
		       (unsigned long long)(acked ? acked - 1 : 0), (unsigned long long)send_sum,
		       (unsigned long long)recv_sum, bad);
	else
		printf("RESULT mode=%d sent=%llu received=%llu send_sum=%016llx recv_sum=%016llx events=0 bad=%d\n",
		       o.mode, (unsigned long long)(acks_posted ? acks_posted - 1 : 0),
		       (unsigned long long)(received ? received - 1 : 0), (unsigned long long)send_sum,
		       (unsigned long long)recv_sum, bad);
}

void ud_connect(void)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.port_num = 1;
	a.qkey = QKEY;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
		DIE("UD INIT");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE))
		DIE("UD RTR");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = mine.psn;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN))
		DIE("UD RTS");
}
