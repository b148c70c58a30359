/* a2a_seq: N ranks, all-to-all over RC.  Every rank holds one QP per peer and
 * sends sequence-numbered, checksummed messages to every peer until a stop
 * file appears; then it sends END (count + checksum) on every QP.  Each
 * receiver checks that every message from every peer arrives exactly once, in
 * order, intact.  One RESULT line per peer; exit 0 only if all are clean.
 *
 *   a2a_seq -n N -r RANK -H IP0,IP1,... -f STOPFILE [-p BASEPORT] [-g GID_INDEX]
 *           [-w WINDOW] [-R RECVS] [-m NEWFILE [-Q NEWQPS]]
 *
 * Rank i listens on BASEPORT+i and connects to every lower rank, so the
 * out-of-band exchange cannot deadlock.  With -m, when NEWFILE appears the rank
 * creates verbs objects mid-run (a new send MR, which then carries all
 * traffic, a new CQ and NEWQPS new QPs (1) moved to INIT) and prints their ids,
 * so a test can check that objects made after a restore never reuse a live
 * virtual id, its own or another rank's. */
#include <getopt.h>
#include <netinet/in.h>
#include <time.h>

#include "common.h"

#define MAXR 64
#define TAG(p, v) (((uint64_t)(p) << 56) | (uint64_t)(v))
#define TAG_PEER(t) ((int)((t) >> 56))
#define TAG_VAL(t) ((t) & ((1ull << 56) - 1))

struct peer {
	struct ibv_qp *qp;
	struct msg *sbuf, *rbuf;
	uint64_t next, retired, expect, send_sum, recv_sum, data_sent;
	int end_sent, got_end, bad;
};

static int n = 0, me = -1, port = 18600, gid_index = 1, window = 8, recvs = 16;
static const char *hosts[MAXR];
static const char *stop_file, *new_file;

struct hello {
	uint32_t rank;
	struct oob o;
};

static void xfer(int fd, void *buf, size_t len, int out)
{
	char *p = buf;

	while (len) {
		ssize_t k = out ? write(fd, p, len) : read(fd, p, len);

		if (k <= 0)
			DIE("oob %s", out ? "write" : "read");
		p += k;
		len -= (size_t)k;
	}
}

/* Exchange virtual ids with every peer; all sockets are closed on return, so
 * the process holds no TCP connection when it is checkpointed. */
static void exchange(const struct oob *mine, struct oob *theirs)
{
	struct sockaddr_in sa;
	int lfd, one = 1, j, k;

	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	sa.sin_port = htons((uint16_t)(port + me));
	sa.sin_addr.s_addr = htonl(INADDR_ANY);
	lfd = socket(AF_INET, SOCK_STREAM, 0);
	setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(lfd, MAXR))
		DIE("listen on %d", port + me);
	for (j = 0; j < me; j++) {
		struct hello h = {(uint32_t)me, mine[j]}, got;
		int fd;

		sa.sin_port = htons((uint16_t)(port + j));
		inet_pton(AF_INET, hosts[j], &sa.sin_addr);
		/* a slow guest may take a while to start the lower rank */
		fd = connect_retry(&sa, 1200);
		if (fd < 0)
			DIE("connect to rank %d at %s:%d", j, hosts[j], port + j);
		xfer(fd, &h, sizeof(h), 1);
		xfer(fd, &got, sizeof(got), 0);
		if (got.rank != (uint32_t)j)
			DIE("rank %d answered as %u", j, got.rank);
		theirs[j] = got.o;
		close(fd);
	}
	for (k = me + 1; k < n; k++) {
		struct hello h, got;
		int fd = accept(lfd, NULL, NULL);

		if (fd < 0)
			DIE("accept");
		xfer(fd, &got, sizeof(got), 0);
		if (got.rank <= (uint32_t)me || got.rank >= (uint32_t)n)
			DIE("hello from rank %u", got.rank);
		theirs[got.rank] = got.o;
		h.rank = (uint32_t)me;
		h.o = mine[got.rank];
		xfer(fd, &h, sizeof(h), 1);
		close(fd);
	}
	close(lfd);
}

int main(int argc, char **argv)
{
	static struct peer P[MAXR];
	static struct oob mine[MAXR], theirs[MAXR];
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *smr, *rmr;
	struct ibv_cq *cq;
	union ibv_gid gid;
	struct msg *sall, *rall;
	char *hl = NULL;
	int c, j, i, stopping = 0, created = 0, bad = 0, new_qps = 1;
	long last_check = 0;

	while ((c = getopt(argc, argv, "n:r:H:p:g:f:w:R:m:Q:")) != -1) {
		switch (c) {
		case 'n': n = atoi(optarg); break;
		case 'r': me = atoi(optarg); break;
		case 'H': hl = strdup(optarg); break;
		case 'p': port = atoi(optarg); break;
		case 'g': gid_index = atoi(optarg); break;
		case 'f': stop_file = optarg; break;
		case 'w': window = atoi(optarg); break;
		case 'R': recvs = atoi(optarg); break;
		case 'm': new_file = optarg; break;
		case 'Q': new_qps = atoi(optarg); break;
		default: return 2;
		}
	}
	if (n < 2 || n > MAXR || me < 0 || me >= n || !hl || !stop_file || window < 1 || recvs < 1 || new_qps < 1 ||
	    new_qps > 256)
		DIE("usage: -n N -r RANK -H IP0,IP1,... -f STOPFILE");
	for (j = 0; j < n; j++) {
		hosts[j] = strtok(j ? NULL : hl, ",");
		if (!hosts[j])
			DIE("-H names fewer than %d hosts", n);
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	ctx = open_first_device();
	pd = ibv_alloc_pd(ctx);
	sall = aligned_alloc(4096, ((sizeof(struct msg) * (size_t)(window * n)) | 4095) + 1);
	rall = aligned_alloc(4096, ((sizeof(struct msg) * (size_t)(recvs * n)) | 4095) + 1);
	if (!pd || !sall || !rall)
		DIE("pd/buffers");
	memset(sall, 0, sizeof(struct msg) * (size_t)(window * n));
	memset(rall, 0, sizeof(struct msg) * (size_t)(recvs * n));
	smr = ibv_reg_mr(pd, sall, sizeof(struct msg) * (size_t)(window * n), IBV_ACCESS_LOCAL_WRITE);
	rmr = ibv_reg_mr(pd, rall, sizeof(struct msg) * (size_t)(recvs * n),
			 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	cq = ibv_create_cq(ctx, n * (window + recvs) + 16, NULL, NULL, 0);
	if (!smr || !rmr || !cq)
		DIE("mr/cq");
	if (ibv_query_gid(ctx, 1, gid_index, &gid))
		DIE("gid");
	for (j = 0; j < n; j++) {
		if (j == me)
			continue;
		P[j].sbuf = &sall[j * window];
		P[j].rbuf = &rall[j * recvs];
		if (!(P[j].qp = create_rc_qp(pd, cq, (uint32_t)window, (uint32_t)recvs)))
			DIE("qp to rank %d", j);
		qp_to_init(P[j].qp, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
		for (i = 0; i < recvs; i++) {
			struct ibv_sge s = {(uintptr_t)&P[j].rbuf[i], sizeof(struct msg), rmr->lkey};
			struct ibv_recv_wr w = {.wr_id = TAG(j, i), .sg_list = &s, .num_sge = 1}, *bw;

			if (ibv_post_recv(P[j].qp, &w, &bw))
				DIE("post recv");
		}
		mine[j].qpn = P[j].qp->qp_num;
		mine[j].psn = (uint32_t)(getpid() * 7919 + j) & 0xffffff;
		mine[j].rkey = rmr->rkey;
		mine[j].addr = (uintptr_t)P[j].rbuf;
		memcpy(mine[j].gid, gid.raw, 16);
	}
	exchange(mine, theirs);
	for (j = 0; j < n; j++)
		if (j != me)
			qp_to_rts(P[j].qp, &theirs[j], gid_index, mine[j].psn);
	printf("READY rank=%d", me);
	for (j = 0; j < n; j++)
		if (j != me)
			printf(" qpn%d=%u", j, P[j].qp->qp_num);
	printf(" lkeys=%u,%u\n", smr->lkey, rmr->lkey);

	for (;;) {
		struct ibv_wc wc[32];
		int k, done = 1, progressed = 0;

		if (now_ms() - last_check > 20) {
			last_check = now_ms();
			if (!stopping)
				stopping = file_exists(stop_file);
			if (new_file && !created && file_exists(new_file)) {
				/* Objects made now (possibly after a restore) must get virtual
				 * ids no live object has; the new MR carries all later sends
				 * (the old one stays registered for sends still in flight). */
				struct msg *nb = aligned_alloc(4096, ((sizeof(struct msg) * (size_t)(window * n)) | 4095) + 1);
				struct ibv_mr *nmr;
				struct ibv_cq *ncq;
				struct ibv_qp *nqp;
				uint32_t old_slkey = smr->lkey, old_rlkey = rmr->lkey;

				if (!nb)
					DIE("alloc");
				memset(nb, 0, sizeof(struct msg) * (size_t)(window * n));
				nmr = ibv_reg_mr(pd, nb, sizeof(struct msg) * (size_t)(window * n), IBV_ACCESS_LOCAL_WRITE);
				ncq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
				if (!nmr || !ncq || !(nqp = create_rc_qp(pd, ncq, 2, 2)))
					DIE("objects after %s", new_file);
				qp_to_init(nqp, IBV_ACCESS_LOCAL_WRITE);
				printf("NEW rank=%d lkey=%u old_lkeys=%u,%u qpn=%u", me, nmr->lkey, old_slkey, old_rlkey,
				       nqp->qp_num);
				for (int q = 1; q < new_qps; q++) { /* kept to the end, in INIT */
					struct ibv_qp *more = create_rc_qp(pd, ncq, 2, 2);

					if (!more)
						DIE("QP %d of %d after %s", q + 1, new_qps, new_file);
					qp_to_init(more, IBV_ACCESS_LOCAL_WRITE);
					printf(" more=%u", more->qp_num);
				}
				for (j = 0; j < n; j++)
					if (j != me)
						printf(" qpn%d=%u", j, P[j].qp->qp_num);
				printf("\n");
				for (j = 0; j < n; j++)
					if (j != me)
						P[j].sbuf = &nb[j * window];
				smr = nmr;
				created = 1;
			}
		}
		for (j = 0; j < n; j++) {
			struct peer *p = &P[j];

			if (j == me)
				continue;
			while (p->next - p->retired < (uint64_t)window && !p->end_sent) {
				struct msg *m = &p->sbuf[p->next % (uint64_t)window];
				struct ibv_sge s = {(uintptr_t)m, sizeof(*m), smr->lkey};
				struct ibv_send_wr w, *bw;

				if (stopping)
					msg_fill(m, p->next, MSG_END, p->data_sent, p->send_sum);
				else
					msg_fill(m, p->next, MSG_DATA, 0, 0);
				memset(&w, 0, sizeof(w));
				w.wr_id = TAG(j, p->next);
				w.sg_list = &s;
				w.num_sge = 1;
				w.opcode = IBV_WR_SEND;
				w.send_flags = IBV_SEND_SIGNALED;
				if (ibv_post_send(p->qp, &w, &bw))
					DIE("post send to rank %d", j);
				if (stopping) {
					p->end_sent = 1;
				} else {
					p->send_sum = mix64(p->send_sum ^ m->check);
					p->data_sent++;
				}
				p->next++;
				progressed = 1;
			}
			if (!(p->end_sent && p->retired == p->next && p->got_end))
				done = 0;
		}
		if (done)
			break;
		k = ibv_poll_cq(cq, 32, wc);
		if (k < 0)
			DIE("poll");
		for (i = 0; i < k; i++) {
			int from = TAG_PEER(wc[i].wr_id);
			uint64_t v = TAG_VAL(wc[i].wr_id);
			struct peer *p;

			progressed = 1;
			if (wc[i].status != IBV_WC_SUCCESS)
				DIE("completion %s wr_id %llx", ibv_wc_status_str(wc[i].status),
				    (unsigned long long)wc[i].wr_id);
			if (from >= n || from == me)
				DIE("wr_id %llx names no peer", (unsigned long long)wc[i].wr_id);
			p = &P[from];
			if (wc[i].qp_num != p->qp->qp_num) {
				fprintf(stderr, "BAD qp_num %u != %u (peer %d)\n", wc[i].qp_num, p->qp->qp_num, from);
				p->bad++;
			}
			if (wc[i].opcode == IBV_WC_SEND) {
				if (v + 1 <= p->retired || v >= p->next) {
					fprintf(stderr, "BAD send completion %llu to %d (retired %llu next %llu)\n",
						(unsigned long long)v, from, (unsigned long long)p->retired,
						(unsigned long long)p->next);
					p->bad++;
				}
				p->retired = v + 1;
			} else if (wc[i].opcode == IBV_WC_RECV) {
				struct msg *m = &p->rbuf[v];
				struct ibv_sge s = {(uintptr_t)m, sizeof(*m), rmr->lkey};
				struct ibv_recv_wr w = {.wr_id = wc[i].wr_id, .sg_list = &s, .num_sge = 1}, *bw;

				if (wc[i].byte_len != sizeof(*m) || !msg_ok(m)) {
					fprintf(stderr, "BAD corrupt message from %d at %llu\n", from,
						(unsigned long long)p->expect);
					p->bad++;
				} else if (m->seq != p->expect) {
					fprintf(stderr, "BAD seq %llu from %d expected %llu (%s)\n",
						(unsigned long long)m->seq, from, (unsigned long long)p->expect,
						m->seq < p->expect ? "duplicate" : "gap");
					p->bad++;
					p->expect = m->seq + 1;
				} else if (m->kind == MSG_END) {
					p->got_end = 1;
					if (m->value != p->expect || m->sum != p->recv_sum) {
						fprintf(stderr, "BAD end from %d: sent %llu, got %llu\n", from,
							(unsigned long long)m->value, (unsigned long long)p->expect);
						p->bad++;
					}
					p->expect++;
				} else {
					p->recv_sum = mix64(p->recv_sum ^ m->check);
					p->expect++;
				}
				memset(m, 0, sizeof(*m));
				if (ibv_post_recv(p->qp, &w, &bw))
					DIE("repost recv");
			} else {
				fprintf(stderr, "BAD opcode %d\n", wc[i].opcode);
				p->bad++;
			}
		}
		/* four busy-polling ranks share two slow vCPUs: yield when idle */
		if (!progressed)
			usleep(200);
	}
	for (j = 0; j < n; j++) {
		if (j == me)
			continue;
		printf("RESULT rank=%d peer=%d sent=%llu received=%llu send_sum=%016llx recv_sum=%016llx bad=%d\n",
		       me, j, (unsigned long long)P[j].data_sent,
		       (unsigned long long)(P[j].expect ? P[j].expect - 1 : 0), (unsigned long long)P[j].send_sum,
		       (unsigned long long)P[j].recv_sum, P[j].bad);
		bad += P[j].bad;
	}
	printf("DONE rank=%d bad=%d\n", me, bad);
	/* let the peers' last acks land before the QPs go away */
	usleep(300000);
	return bad ? 1 : 0;
}
