/* verbs_seq: sequence-numbered, checksummed traffic over one verb family, for
 * checkpoint tests of every work-request kind the shim logs.  Both processes
 * run until a stop file appears; every check below makes the run fail (exit 1)
 * if an operation is lost, executed twice or delivers different data.
 *
 *   -m write     RDMA WRITE of message n into the peer's ring, then a zero-byte
 *                SEND_WITH_IMM (imm = n) telling the peer it is there
 *   -m writeimm  RDMA WRITE_WITH_IMM of message n into the ring (imm = n)
 *   -m read      RDMA READ of the peer's source slot n % NSRC into a cleared
 *                local slot; the data must be the peer's message for that slot
 *   -m atomic    FETCH_ADD(+1) on the peer's counter 0 (even n), CMP_SWAP k->k+1
 *                on its counter 1 (odd n); every returned old value must be the
 *                exact count so far, and the peer's counters must end equal to
 *                the counts the END message carries
 *   -m ud        UD: the client sends data, the server acknowledges each one;
 *                both check order, content and the peer's (virtual) source QPN
 *
 *   verbs_seq -m MODE [-c SERVER_IP] [-p PORT] [-g GID] -f STOPFILE [-u K] [-w W] [-r R]
 * -u K signals every K-th operation, so the others are unsignaled. */
#include <getopt.h>
#include <stdatomic.h>

#include "verbs_seq.h"

struct options o = {NULL, NULL, 18515, 1, 1, 16, 32, M_WRITE};
struct layout L;
uint8_t *base;
struct ibv_mr *mr;
struct ibv_qp *qp;
struct ibv_cq *cq;
struct ibv_ah *ah;
struct oob mine, theirs;
int bad;

static struct msg *ring_at(uint64_t n)
{
	return (struct msg *)(base + L.ring) + n % L.ring_slots;
}

struct msg *sbuf_at(uint64_t n)
{
	return (struct msg *)(base + L.sbuf) + n % (uint64_t)o.window;
}

static struct msg *dst_at(uint64_t n)
{
	return (struct msg *)(base + L.dst) + n % (uint64_t)o.window;
}

uint8_t *rbuf_at(uint64_t i)
{
	return base + L.rbuf + i * RSLOT;
}

static volatile uint64_t *counters(void)
{
	return (volatile uint64_t *)(base + L.ctr);
}

static void layout_init(void)
{
	/* A ring slot n is rewritten by message n + ring_slots.  By then the
	 * sender has seen message n + ring_slots - window delivered, which
	 * needed a receive the peer re-posted only after reading n. */
	L.ring_slots = (uint32_t)(o.window + o.recvs + 1);
	L.ring = 0;
	L.src = L.ring + (size_t)L.ring_slots * sizeof(struct msg);
	L.ctr = L.src + NSRC * sizeof(struct msg);
	L.sbuf = L.ctr + 64;
	L.dst = L.sbuf + (size_t)o.window * sizeof(struct msg);
	L.rbuf = L.dst + (size_t)o.window * sizeof(struct msg);
	L.total = L.rbuf + (size_t)o.recvs * RSLOT;
}

void post_recv_slot(uint64_t i)
{
	struct ibv_sge s = {(uintptr_t)rbuf_at(i), RSLOT, mr->lkey};
	struct ibv_recv_wr w = {.wr_id = i, .sg_list = &s, .num_sge = 1}, *bw;

	memset(rbuf_at(i), 0, RSLOT);
	if (ibv_post_recv(qp, &w, &bw))
		DIE("post recv");
}

void post(struct ibv_send_wr *w)
{
	struct ibv_send_wr *bw;

	if (ibv_post_send(qp, w, &bw))
		DIE("post send wr_id %llu opcode %d", (unsigned long long)w->wr_id, w->opcode);
}

/* ---- RC modes: both sides run the same loop -------------------------------- */

struct rc_state {
	uint64_t next, retired, expect;       /* own ops posted / completed; peer msgs received */
	uint64_t send_sum, recv_sum, data_sent;
	uint64_t fa_done, cs_done;             /* atomics posted so far, per kind */
	uint64_t want[1024];                   /* atomics: the old value each op must return */
	uint64_t peer_ops;                     /* from the peer's END */
	int end_sent, got_end;
};

int signaled(uint64_t n)
{
	return n % (uint64_t)o.unsig == (uint64_t)o.unsig - 1;
}

int poll_or_stall(struct ibv_wc *wc, int max, long *last_progress)
{
	int n = ibv_poll_cq(cq, max, wc);

	if (n < 0)
		DIE("poll");
	if (n)
		*last_progress = now_ms();
	else if (now_ms() - *last_progress > STALL_MS)
		return -1;
	return n;
}

static void rc_post_op(struct rc_state *s)
{
	uint64_t n = s->next;
	struct ibv_sge sge;
	struct ibv_send_wr w;
	uint64_t peer = theirs.addr;

	memset(&w, 0, sizeof(w));
	w.wr_id = n;
	w.sg_list = &sge;
	w.num_sge = 1;
	w.send_flags = signaled(n) ? IBV_SEND_SIGNALED : 0;
	switch (o.mode) {
	case M_WRITE:
	case M_WRITEIMM: {
		struct msg *m = sbuf_at(n);
		uint64_t roff = L.ring + (n % L.ring_slots) * sizeof(struct msg);

		msg_fill(m, n, MSG_DATA, 0, 0);
		sge = (struct ibv_sge){(uintptr_t)m, sizeof(*m), mr->lkey};
		w.wr.rdma.remote_addr = peer + roff;
		w.wr.rdma.rkey = theirs.rkey;
		if (o.mode == M_WRITEIMM) {
			w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
			w.imm_data = htonl((uint32_t)n);
			post(&w);
		} else {
			/* the data, unsignaled, then the notice that consumes a receive */
			struct ibv_send_wr note;

			w.opcode = IBV_WR_RDMA_WRITE;
			w.send_flags = 0;
			memset(&note, 0, sizeof(note));
			note.wr_id = n;
			note.opcode = IBV_WR_SEND_WITH_IMM;
			note.imm_data = htonl((uint32_t)n);
			note.send_flags = signaled(n) ? IBV_SEND_SIGNALED : 0;
			w.next = &note;
			post(&w);
		}
		s->send_sum = mix64(s->send_sum ^ m->check);
		s->data_sent++;
		break;
	}
	case M_READ: {
		struct msg *d = dst_at(n);

		memset(d, 0xee, sizeof(*d));
		sge = (struct ibv_sge){(uintptr_t)d, sizeof(*d), mr->lkey};
		w.opcode = IBV_WR_RDMA_READ;
		w.wr.rdma.remote_addr = peer + L.src + (n % NSRC) * sizeof(struct msg);
		w.wr.rdma.rkey = theirs.rkey;
		post(&w);
		s->data_sent++;
		break;
	}
	case M_ATOMIC: {
		uint64_t *d = (uint64_t *)dst_at(n);

		*d = 0xeeeeeeeeeeeeeeeeull;
		sge = (struct ibv_sge){(uintptr_t)d, 8, mr->lkey};
		w.wr.atomic.rkey = theirs.rkey;
		if (n % 2 == 0) {
			w.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
			w.wr.atomic.remote_addr = peer + L.ctr;
			w.wr.atomic.compare_add = 1;
			s->want[n % 1024] = s->fa_done++;
		} else {
			w.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
			w.wr.atomic.remote_addr = peer + L.ctr + 8;
			w.wr.atomic.compare_add = s->cs_done;
			w.wr.atomic.swap = s->cs_done + 1;
			s->want[n % 1024] = s->cs_done++;
		}
		post(&w);
		s->data_sent++;
		break;
	}
	case M_UD:
		break;
	}
	s->next++;
}

static void rc_post_end(struct rc_state *s)
{
	struct msg *m = sbuf_at(s->next);
	struct ibv_sge sge = {(uintptr_t)m, sizeof(*m), mr->lkey};
	struct ibv_send_wr w;

	if (o.mode == M_ATOMIC)
		msg_fill(m, s->next, MSG_END, s->fa_done, s->cs_done);
	else
		msg_fill(m, s->next, MSG_END, s->data_sent, s->send_sum);
	memset(&w, 0, sizeof(w));
	w.wr_id = s->next;
	w.sg_list = &sge;
	w.num_sge = 1;
	w.opcode = IBV_WR_SEND;
	w.send_flags = IBV_SEND_SIGNALED;
	post(&w);
	s->end_sent = 1;
	s->next++;
}

/* Op k finished (its own or a later signaled completion says so): check it. */
static void rc_verify_op(struct rc_state *s, uint64_t k)
{
	if (o.mode == M_READ) {
		struct msg *d = dst_at(k);

		if (!msg_ok(d) || d->seq != k % NSRC || d->kind != MSG_DATA || d->value != 1)
			BAD("read %llu: wrong data (seq %llu)", (unsigned long long)k, (unsigned long long)d->seq);
		else
			s->recv_sum = mix64(s->recv_sum ^ d->check);
	} else if (o.mode == M_ATOMIC) {
		uint64_t got = *(volatile uint64_t *)dst_at(k);

		if (got != s->want[k % 1024])
			BAD("%s %llu returned %llu, expected %llu", k % 2 ? "cmp_swap" : "fetch_add",
			    (unsigned long long)k, (unsigned long long)got, (unsigned long long)s->want[k % 1024]);
		else
			s->recv_sum = mix64(s->recv_sum ^ got ^ (k << 1));
	}
}

static enum ibv_wc_opcode rc_send_opcode(uint64_t k, int is_end)
{
	if (is_end)
		return IBV_WC_SEND;
	switch (o.mode) {
	case M_WRITEIMM:
		return IBV_WC_RDMA_WRITE;
	case M_READ:
		return IBV_WC_RDMA_READ;
	case M_ATOMIC:
		return k % 2 ? IBV_WC_COMP_SWAP : IBV_WC_FETCH_ADD;
	default:
		return IBV_WC_SEND;
	}
}

static void rc_recv(struct rc_state *s, struct ibv_wc *wc)
{
	if (wc->opcode == IBV_WC_RECV && !(wc->wc_flags & IBV_WC_WITH_IMM)) {
		struct msg *m = (struct msg *)rbuf_at(wc->wr_id);

		if (!msg_ok(m) || m->kind != MSG_END || s->got_end)
			BAD("unexpected or corrupt SEND");
		else if (o.mode == M_WRITE || o.mode == M_WRITEIMM) {
			if (m->seq != s->expect || m->value != s->expect || m->sum != s->recv_sum)
				BAD("end: peer sent %llu (sum %llx), got %llu (sum %llx)",
				    (unsigned long long)m->value, (unsigned long long)m->sum,
				    (unsigned long long)s->expect, (unsigned long long)s->recv_sum);
			s->peer_ops = m->value;
		} else if (o.mode == M_ATOMIC) {
			/* RC order: every atomic of the peer executed before its END */
			uint64_t fa = counters()[0], cs = counters()[1];

			if (fa != m->value || cs != m->sum)
				BAD("atomics: counters %llu/%llu, peer posted %llu/%llu", (unsigned long long)fa,
				    (unsigned long long)cs, (unsigned long long)m->value, (unsigned long long)m->sum);
			s->peer_ops = m->value + m->sum;
		} else {
			s->peer_ops = m->value;
		}
		s->got_end = 1;
	} else if ((o.mode == M_WRITE && wc->opcode == IBV_WC_RECV) ||
		   (o.mode == M_WRITEIMM && wc->opcode == IBV_WC_RECV_RDMA_WITH_IMM)) {
		struct msg *m = ring_at(s->expect);
		uint32_t imm = ntohl(wc->imm_data);

		if (!(wc->wc_flags & IBV_WC_WITH_IMM) || imm != (uint32_t)s->expect)
			BAD("imm %u, expected %llu (%s)", imm, (unsigned long long)s->expect,
			    imm < (uint32_t)s->expect ? "duplicate" : "gap");
		else if (!msg_ok(m) || m->seq != s->expect || m->kind != MSG_DATA)
			BAD("ring slot of %llu holds seq %llu (%s)", (unsigned long long)s->expect,
			    (unsigned long long)m->seq, msg_ok(m) ? "stale" : "corrupt");
		else
			s->recv_sum = mix64(s->recv_sum ^ m->check);
		memset(m, 0, sizeof(*m));
		s->expect++;
	} else {
		BAD("receive opcode %d flags %x", wc->opcode, wc->wc_flags);
	}
	post_recv_slot(wc->wr_id);
}

static void rc_run(void)
{
	struct rc_state *s = calloc(1, sizeof(*s));
	long last_check = 0, last_progress = now_ms();
	int stopping = 0, i;

	if (!s)
		DIE("calloc");
	while (!(s->end_sent && s->retired == s->next && s->got_end)) {
		struct ibv_wc wc[16];
		int n;

		if (!stopping && now_ms() - last_check > 20) {
			last_check = now_ms();
			stopping = file_exists(o.stop);
		}
		while (!s->end_sent && s->next - s->retired < (uint64_t)o.window) {
			if (stopping) {
				rc_post_end(s);
				break;
			}
			rc_post_op(s);
			if (signaled(s->next - 1))
				break; /* let completions interleave with posting */
		}
		n = poll_or_stall(wc, 16, &last_progress);
		if (n < 0) {
			BAD("no progress for %d ms (next %llu retired %llu expect %llu)", STALL_MS,
			    (unsigned long long)s->next, (unsigned long long)s->retired,
			    (unsigned long long)s->expect);
			break;
		}
		for (i = 0; i < n; i++) {
			if (wc[i].status != IBV_WC_SUCCESS)
				DIE("completion %s wr_id %llu opcode %d", ibv_wc_status_str(wc[i].status),
				    (unsigned long long)wc[i].wr_id, wc[i].opcode);
			if (wc[i].qp_num != qp->qp_num)
				BAD("qp_num %u != %u", wc[i].qp_num, qp->qp_num);
			if (wc[i].opcode & IBV_WC_RECV) {
				rc_recv(s, &wc[i]);
				continue;
			}
			if (wc[i].wr_id < s->retired || wc[i].wr_id >= s->next) {
				BAD("send completion %llu outside [%llu, %llu) (%s)", (unsigned long long)wc[i].wr_id,
				    (unsigned long long)s->retired, (unsigned long long)s->next,
				    wc[i].wr_id < s->retired ? "duplicate" : "never posted");
				continue;
			}
			if (wc[i].opcode != rc_send_opcode(wc[i].wr_id, s->end_sent && wc[i].wr_id == s->next - 1))
				BAD("op %llu completed as opcode %d", (unsigned long long)wc[i].wr_id, wc[i].opcode);
			for (; s->retired <= wc[i].wr_id; s->retired++)
				if (!(s->end_sent && s->retired == s->next - 1))
					rc_verify_op(s, s->retired);
		}
	}
	printf("RESULT mode=%d sent=%llu received=%llu send_sum=%016llx recv_sum=%016llx events=0 bad=%d "
	       "peer_ops=%llu fa=%llu cs=%llu ctr0=%llu ctr1=%llu\n",
	       o.mode, (unsigned long long)s->data_sent, (unsigned long long)s->expect,
	       (unsigned long long)s->send_sum, (unsigned long long)s->recv_sum, bad,
	       (unsigned long long)s->peer_ops, (unsigned long long)s->fa_done, (unsigned long long)s->cs_done,
	       (unsigned long long)counters()[0], (unsigned long long)counters()[1]);
	free(s);
}

/* ---- setup ------------------------------------------------------------------- */

int main(int argc, char **argv)
{
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_qp_init_attr qa;
	int c, i, ud;
	const char *mode = "write";

	while ((c = getopt(argc, argv, "m:c:p:g:f:u:w:r:")) != -1) {
		switch (c) {
		case 'm': mode = optarg; break;
		case 'c': o.peer = optarg; break;
		case 'p': o.port = atoi(optarg); break;
		case 'g': o.gid = atoi(optarg); break;
		case 'f': o.stop = optarg; break;
		case 'u': o.unsig = atoi(optarg); break;
		case 'w': o.window = atoi(optarg); break;
		case 'r': o.recvs = atoi(optarg); break;
		default: return 2;
		}
	}
	if (!strcmp(mode, "write"))
		o.mode = M_WRITE;
	else if (!strcmp(mode, "writeimm"))
		o.mode = M_WRITEIMM;
	else if (!strcmp(mode, "read"))
		o.mode = M_READ;
	else if (!strcmp(mode, "atomic"))
		o.mode = M_ATOMIC;
	else if (!strcmp(mode, "ud"))
		o.mode = M_UD;
	else
		DIE("unknown mode %s", mode);
	if (!o.stop || o.unsig < 1 || o.unsig > o.window || o.window > 1024 || o.recvs < o.window + 1)
		DIE("usage: -f STOPFILE required; 1 <= -u <= -w <= 1024; -r > -w");
	ud = o.mode == M_UD;
	setvbuf(stdout, NULL, _IOLBF, 0);
	layout_init();
	ctx = open_first_device();
	pd = ibv_alloc_pd(ctx);
	base = aligned_alloc(4096, (L.total + 4095) / 4096 * 4096);
	if (!pd || !base)
		DIE("pd/alloc");
	memset(base, 0, L.total);
	/* the source slots the peer reads: value 1 marks them as ours */
	for (i = 0; i < NSRC; i++)
		msg_fill((struct msg *)(base + L.src) + i, (uint64_t)i, MSG_DATA, 1, 0);
	mr = ibv_reg_mr(pd, base, L.total,
			IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
				IBV_ACCESS_REMOTE_ATOMIC);
	if (!mr)
		DIE("mr");
	cq = ibv_create_cq(ctx, 2 * o.window + o.recvs + 16, NULL, NULL, 0);
	if (!cq)
		DIE("cq");
	memset(&qa, 0, sizeof(qa));
	qa.send_cq = cq;
	qa.recv_cq = cq;
	qa.qp_type = ud ? IBV_QPT_UD : IBV_QPT_RC;
	qa.cap.max_send_wr = (uint32_t)(2 * o.window + 2);
	qa.cap.max_recv_wr = (uint32_t)o.recvs;
	qa.cap.max_send_sge = 1;
	qa.cap.max_recv_sge = 1;
	if (!(qp = ibv_create_qp(pd, &qa)))
		DIE("qp");
	if (ud)
		ud_connect();
	else
		qp_to_init(qp, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
				       IBV_ACCESS_REMOTE_ATOMIC);
	for (i = 0; i < o.recvs; i++)
		post_recv_slot((uint64_t)i);
	oob_fill(&mine, ctx, o.gid, qp, mr->rkey, (uintptr_t)base);
	oob_exchange(o.peer, o.port, &mine, &theirs);
	if (ud) {
		struct ibv_ah_attr aa;

		memset(&aa, 0, sizeof(aa));
		aa.is_global = 1;
		memcpy(aa.grh.dgid.raw, theirs.gid, 16);
		aa.grh.sgid_index = (uint8_t)o.gid;
		aa.grh.hop_limit = 1;
		aa.dlid = (uint16_t)theirs.lid;
		aa.port_num = 1;
		if (!(ah = ibv_create_ah(pd, &aa)))
			DIE("ah");
	} else {
		qp_to_rts(qp, &theirs, o.gid, mine.psn);
	}
	printf("READY mode=%s qpn=%u peer_qpn=%u\n", mode, qp->qp_num, theirs.qpn);
	if (ud)
		ud_run();
	else
		rc_run();
	/* give the peer's last ack time to land before the QP goes away */
	usleep(200000);
	if (ah)
		ibv_destroy_ah(ah);
	ibv_destroy_qp(qp);
	ibv_destroy_cq(cq);
	ibv_dereg_mr(mr);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	free(base);
	return bad ? 1 : 0;
}
