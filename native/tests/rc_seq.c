/* rc_seq: two processes exchange sequence-numbered, checksummed messages over
 * one RC QP in both directions until a stop file appears, then each sends an
 * END message carrying its count and checksum.  The receiver checks every
 * message arrives exactly once, in order, intact.  Exit 0 only if so.
 *
 *   rc_seq [-c SERVER_IP] [-p PORT] [-g GID_INDEX] -f STOPFILE
 *          [-u K (signal every K-th send)] [-i (inline)] [-q (SRQ)]
 *          [-e (completion channel, blocking ibv_get_cq_event)]
 *          [-E (completion channel, non-blocking fd watched by the app's own epoll set, added once)]
 *          [-w WINDOW] [-r RECVS]
 *          [-t N (keep the bootstrap TCP connection open; ping over it every N messages)]
 *          [-x IP:PORT (hold an idle TCP connection to an outsider)]
 *          [-T (a second thread posts the sends while the main thread polls and re-posts receives)]
 *          [-P USEC (pace: sleep USEC whenever the CQ is empty, so the pair leaves the CPU to others)]
 *          [-A alarm:S | interval:S (timers due S seconds after READY, reported at the end: timers.h)]
 *
 * With -t, both sides send a sequence-numbered, checked 16-byte ping over the TCP
 * connection every N data messages and read the peer's without blocking; at the end
 * each sends an END ping carrying its count and reads until the peer's END.  A line
 * "TCP sent= received= bad=" precedes RESULT; bad counts gaps, duplicates, corruption. */
#include <fcntl.h>
#include <getopt.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/epoll.h>
#include <time.h>

#include "common.h"
#include "timers.h"

struct opts {
	const char *peer;
	int port, gid, unsig, inl, srq, chan, window, recvs, tcp_every, threaded, pace_us;
	const char *stop, *outsider, *timers;
};

static struct opts o = {NULL, 18515, 1, 1, 0, 0, 0, 16, 32, 0, 0, 0, NULL, NULL, NULL};

/* Message n into m, and the SEND WR that carries it (every -u'th signaled,
 * and the END message; inline with -i). */
static void send_wr_fill(struct ibv_send_wr *w, struct ibv_sge *sg, struct msg *m, uint32_t lkey, uint64_t n,
			 int last, uint64_t data_sent, uint64_t send_sum)
{
	if (last)
		msg_fill(m, n, MSG_END, data_sent, send_sum);
	else
		msg_fill(m, n, MSG_DATA, 0, 0);
	*sg = (struct ibv_sge){(uintptr_t)m, sizeof(*m), lkey};
	memset(w, 0, sizeof(*w));
	w->wr_id = n;
	w->sg_list = sg;
	w->num_sge = 1;
	w->opcode = IBV_WR_SEND;
	if (last || n % (uint64_t)o.unsig == (uint64_t)o.unsig - 1)
		w->send_flags = IBV_SEND_SIGNALED;
	if (o.inl)
		w->send_flags |= IBV_SEND_INLINE;
}

/* ---- -T: the sending thread ----
 * It owns the send side; the main thread only polls.  s_next is advanced
 * before each post, so a completion never names a WR the poller has not
 * seen counted; s_retired comes back from the poller's send completions. */
struct sender {
	struct ibv_qp *qp;
	struct msg *sbuf;
	struct ibv_mr *smr;
	uint64_t data_sent, send_sum; /* read after the join */
};
static _Atomic uint64_t s_next, s_retired;
static atomic_int s_stopping, s_end_sent;

static void *send_thread(void *arg)
{
	struct sender *sd = arg;

	while (!atomic_load(&s_end_sent)) {
		uint64_t n = atomic_load(&s_next);
		struct msg *m = &sd->sbuf[n % (uint64_t)o.window];
		struct ibv_sge sg;
		struct ibv_send_wr w, *bw;
		int last;

		if (n - atomic_load(&s_retired) >= (uint64_t)o.window) {
			sched_yield();
			continue;
		}
		last = atomic_load(&s_stopping);
		send_wr_fill(&w, &sg, m, sd->smr->lkey, n, last, sd->data_sent, sd->send_sum);
		atomic_store(&s_next, n + 1);
		int prc = ibv_post_send(sd->qp, &w, &bw);

		if (prc)
			DIE("post send %llu: %s", (unsigned long long)n, strerror(prc));
		if (last) {
			atomic_store(&s_end_sent, 1);
		} else {
			sd->send_sum = mix64(sd->send_sum ^ m->check);
			sd->data_sent++;
			if (o.inl)
				memset(m, 0xee, sizeof(*m));
		}
	}
	return NULL;
}

/* ---- -t: pings over the kept bootstrap TCP connection ---- */
#define PING_END UINT64_MAX
struct ping {
	uint64_t seq;
	uint64_t check; /* END: the number of pings sent */
};

static int tfd = -1;
static uint64_t t_sent, t_recv, t_bad;
static unsigned char t_buf[sizeof(struct ping)];
static size_t t_have;
static int t_got_end;

static uint64_t ping_check(uint64_t seq)
{
	return mix64(seq ^ 0x7463702070696e67ull);
}

static void ping_send(uint64_t seq, uint64_t check)
{
	struct ping p = {seq, check};
	size_t off = 0;

	while (off < sizeof(p)) {
		ssize_t w = write(tfd, (char *)&p + off, sizeof(p) - off);

		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			DIE("tcp ping write");
		off += (size_t)w;
	}
}

/* Read whatever pings have arrived; with block, until the peer's END. */
static void ping_poll(int block)
{
	while (!t_got_end) {
		ssize_t r = recv(tfd, t_buf + t_have, sizeof(t_buf) - t_have, block ? 0 : MSG_DONTWAIT);
		struct ping p;

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && !block && (errno == EAGAIN || errno == EWOULDBLOCK))
			return;
		if (r <= 0)
			DIE("tcp ping connection lost after %llu pings received", (unsigned long long)t_recv);
		t_have += (size_t)r;
		if (t_have < sizeof(t_buf))
			continue;
		t_have = 0;
		memcpy(&p, t_buf, sizeof(p));
		if (p.seq == PING_END) {
			t_got_end = 1;
			if (p.check != t_recv) {
				fprintf(stderr, "BAD tcp end: peer sent %llu pings, got %llu\n",
					(unsigned long long)p.check, (unsigned long long)t_recv);
				t_bad++;
			}
		} else if (p.seq != t_recv || p.check != ping_check(p.seq)) {
			fprintf(stderr, "BAD tcp ping %llu (expected %llu)\n", (unsigned long long)p.seq,
				(unsigned long long)t_recv);
			t_bad++;
			t_recv = p.seq + 1;
		} else {
			t_recv++;
		}
	}
}

static int connect_outsider(const char *spec)
{
	char host[64];
	const char *colon = strrchr(spec, ':');
	struct sockaddr_in sa;
	int fd;

	if (!colon || (size_t)(colon - spec) >= sizeof(host))
		DIE("-x wants IP:PORT");
	memcpy(host, spec, (size_t)(colon - spec));
	host[colon - spec] = 0;
	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	sa.sin_port = htons((uint16_t)atoi(colon + 1));
	if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
		DIE("-x %s: not an IPv4 address", spec);
	fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)))
		DIE("connect to outsider %s", spec);
	return fd;
}

int main(int argc, char **argv)
{
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *smr, *rmr;
	struct ibv_cq *cq;
	struct ibv_comp_channel *ch = NULL;
	struct ibv_srq *srq = NULL;
	struct ibv_qp *qp;
	struct ibv_qp_init_attr qa;
	struct oob mine, theirs;
	struct msg *sbuf, *rbuf;
	uint64_t next = 0, retired = 0, expect = 0, send_sum = 0, recv_sum = 0, data_sent = 0;
	int c, stopping = 0, end_sent = 0, got_end = 0, bad = 0, i;
	long last_check = 0, events = 0, ep_timeouts = 0;
	int ep = -1;
	struct sender sd;
	pthread_t sender_tid;

	while ((c = getopt(argc, argv, "c:p:g:f:u:iqeEw:r:t:x:TP:A:")) != -1) {
		switch (c) {
		case 'c': o.peer = optarg; break;
		case 'p': o.port = atoi(optarg); break;
		case 'g': o.gid = atoi(optarg); break;
		case 'f': o.stop = optarg; break;
		case 'u': o.unsig = atoi(optarg); break;
		case 'i': o.inl = 1; break;
		case 'q': o.srq = 1; break;
		case 'e': o.chan = 1; break;
		case 'E': o.chan = 2; break;
		case 'w': o.window = atoi(optarg); break;
		case 'r': o.recvs = atoi(optarg); break;
		case 't': o.tcp_every = atoi(optarg); break;
		case 'x': o.outsider = optarg; break;
		case 'T': o.threaded = 1; break;
		case 'P': o.pace_us = atoi(optarg); break;
		case 'A': o.timers = optarg; break;
		default: return 2;
		}
	}
	if (!o.stop || o.unsig < 1 || o.unsig > o.window)
		DIE("usage: -f STOPFILE required; 1 <= -u <= -w");
	if (o.threaded && o.tcp_every)
		DIE("usage: -T and -t do not go together");
	setvbuf(stdout, NULL, _IOLBF, 0);
	ctx = open_first_device();
	pd = ibv_alloc_pd(ctx);
	sbuf = aligned_alloc(4096, 4096 * 4);
	rbuf = aligned_alloc(4096, 4096 * 4);
	memset(sbuf, 0, 4096 * 4);
	memset(rbuf, 0, 4096 * 4);
	smr = ibv_reg_mr(pd, sbuf, sizeof(struct msg) * (size_t)o.window, IBV_ACCESS_LOCAL_WRITE);
	rmr = ibv_reg_mr(pd, rbuf, sizeof(struct msg) * (size_t)o.recvs, IBV_ACCESS_LOCAL_WRITE |
			 IBV_ACCESS_REMOTE_WRITE);
	if (!pd || !smr || !rmr)
		DIE("pd/mr");
	if (o.chan && !(ch = ibv_create_comp_channel(ctx)))
		DIE("channel");
	if (o.chan == 2) {
		/* Like UCX: the channel fd goes into the app's epoll set once, for good. */
		struct epoll_event ev = { .events = EPOLLIN };

		ep = epoll_create1(EPOLL_CLOEXEC);
		if (ep < 0 || fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK) ||
		    epoll_ctl(ep, EPOLL_CTL_ADD, ch->fd, &ev))
			DIE("epoll");
	}
	cq = ibv_create_cq(ctx, o.window + o.recvs + 16, NULL, ch, 0);
	if (!cq)
		DIE("cq");
	if (o.srq) {
		struct ibv_srq_init_attr sa;

		memset(&sa, 0, sizeof(sa));
		sa.attr.max_wr = (uint32_t)o.recvs;
		sa.attr.max_sge = 1;
		if (!(srq = ibv_create_srq(pd, &sa)))
			DIE("srq");
	}
	memset(&qa, 0, sizeof(qa));
	qa.send_cq = cq;
	qa.recv_cq = cq;
	qa.srq = srq;
	qa.qp_type = IBV_QPT_RC;
	qa.cap.max_send_wr = (uint32_t)o.window;
	qa.cap.max_recv_wr = (uint32_t)o.recvs;
	qa.cap.max_send_sge = 1;
	qa.cap.max_recv_sge = 1;
	qa.cap.max_inline_data = o.inl ? sizeof(struct msg) : 0;
	if (!(qp = ibv_create_qp(pd, &qa)))
		DIE("qp");
	qp_to_init(qp, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	for (i = 0; i < o.recvs; i++) {
		struct ibv_sge s = {(uintptr_t)&rbuf[i], sizeof(struct msg), rmr->lkey};
		struct ibv_recv_wr w = {.wr_id = (uint64_t)i, .sg_list = &s, .num_sge = 1}, *bw;

		if (srq ? ibv_post_srq_recv(srq, &w, &bw) : ibv_post_recv(qp, &w, &bw))
			DIE("post recv");
	}
	oob_fill(&mine, ctx, o.gid, qp, rmr->rkey, (uintptr_t)rbuf);
	if (o.tcp_every > 0)
		tfd = oob_exchange_keep(o.peer, o.port, &mine, &theirs);
	else
		oob_exchange(o.peer, o.port, &mine, &theirs);
	if (o.outsider)
		connect_outsider(o.outsider); /* held open, never used */
	qp_to_rts(qp, &theirs, o.gid, mine.psn);
	if (ch && ibv_req_notify_cq(cq, 0))
		DIE("notify");
	if (o.timers)
		timers_arm(o.timers);
	printf("READY qpn=%u peer_qpn=%u\n", qp->qp_num, theirs.qpn);
	if (o.threaded) {
		sd = (struct sender){qp, sbuf, smr, 0, 0};
		if (pthread_create(&sender_tid, NULL, send_thread, &sd))
			DIE("sender thread");
	}

	while (!(end_sent && retired == next && got_end)) {
		struct ibv_wc wc[16];
		int n, progressed = 0;

		if (!stopping && now_ms() - last_check > 20) {
			last_check = now_ms();
			stopping = file_exists(o.stop);
			if (stopping)
				atomic_store(&s_stopping, 1);
		}
		if (o.threaded) {
			/* the sender thread's view, for the checks and the loop's end */
			end_sent = atomic_load(&s_end_sent);
			next = atomic_load(&s_next);
		}
		/* post sends while the window allows */
		while (!o.threaded && next - retired < (uint64_t)o.window && !end_sent) {
			struct msg *m = &sbuf[next % (uint64_t)o.window];
			struct ibv_sge s;
			struct ibv_send_wr w, *bw;
			int last = stopping;

			send_wr_fill(&w, &s, m, smr->lkey, next, last, data_sent, send_sum);
			int prc = ibv_post_send(qp, &w, &bw);

			if (prc)
				DIE("post send %llu: %s", (unsigned long long)next, strerror(prc));
			if (!last) {
				send_sum = mix64(send_sum ^ m->check);
				data_sent++;
				if (tfd >= 0 && data_sent % (uint64_t)o.tcp_every == 0) {
					ping_send(t_sent, ping_check(t_sent));
					t_sent++;
				}
				/* the buffer may be reused as soon as an inline post returns */
				if (o.inl)
					memset(m, 0xee, sizeof(*m));
			} else {
				end_sent = 1;
			}
			next++;
			progressed = 1;
			if (next % (uint64_t)o.unsig == 0 && !last)
				break;
		}
		if (tfd >= 0)
			ping_poll(0);
		n = ibv_poll_cq(cq, 16, wc);
		if (n < 0)
			DIE("poll");
		if (o.threaded && n > 0)
			next = atomic_load(&s_next); /* every WR completed here is counted in it */
		for (i = 0; i < n; i++) {
			progressed = 1;
			if (wc[i].status != IBV_WC_SUCCESS)
				DIE("completion %s wr_id %llu opcode %d", ibv_wc_status_str(wc[i].status),
				    (unsigned long long)wc[i].wr_id, wc[i].opcode);
			if (wc[i].qp_num != qp->qp_num) {
				fprintf(stderr, "BAD qp_num %u != %u\n", wc[i].qp_num, qp->qp_num);
				bad++;
			}
			if (wc[i].opcode == IBV_WC_SEND) {
				if (wc[i].wr_id + 1 <= retired || wc[i].wr_id >= next) {
					fprintf(stderr, "BAD send completion %llu (retired %llu next %llu)\n",
						(unsigned long long)wc[i].wr_id, (unsigned long long)retired,
						(unsigned long long)next);
					bad++;
				}
				retired = wc[i].wr_id + 1;
				atomic_store(&s_retired, retired);
			} else if (wc[i].opcode == IBV_WC_RECV) {
				struct msg *m = &rbuf[wc[i].wr_id];
				struct ibv_sge s = {(uintptr_t)m, sizeof(*m), rmr->lkey};
				struct ibv_recv_wr w = {.wr_id = wc[i].wr_id, .sg_list = &s, .num_sge = 1}, *bw;

				if (wc[i].byte_len != sizeof(*m) || !msg_ok(m)) {
					fprintf(stderr, "BAD corrupt message at expect %llu\n", (unsigned long long)expect);
					bad++;
				} else if (m->seq != expect) {
					fprintf(stderr, "BAD seq %llu expected %llu (%s)\n", (unsigned long long)m->seq,
						(unsigned long long)expect, m->seq < expect ? "duplicate" : "gap");
					bad++;
					expect = m->seq + 1;
				} else if (m->kind == MSG_END) {
					got_end = 1;
					if (m->value != expect || m->sum != recv_sum) {
						fprintf(stderr, "BAD end: peer sent %llu, got %llu; sums %llx/%llx\n",
							(unsigned long long)m->value, (unsigned long long)expect,
							(unsigned long long)m->sum, (unsigned long long)recv_sum);
						bad++;
					}
					expect++;
				} else {
					recv_sum = mix64(recv_sum ^ m->check);
					expect++;
				}
				memset(m, 0, sizeof(*m));
				if (srq ? ibv_post_srq_recv(srq, &w, &bw) : ibv_post_recv(qp, &w, &bw))
					DIE("repost recv");
			} else {
				fprintf(stderr, "BAD opcode %d\n", wc[i].opcode);
				bad++;
			}
		}
		/* Pacing: never while stopping, and only with the CQ drained (fewer than asked for), so the
		 * peer's sends (one window) always find receives posted. */
		if (o.pace_us > 0 && !stopping && n < 16)
			usleep((useconds_t)o.pace_us);
		if (ch && !progressed) {
			struct ibv_cq *ecq;
			void *ectx;

			if (ep >= 0) {
				struct epoll_event ev;
				int n = epoll_wait(ep, &ev, 1, 5000);

				if (n == 0)
					ep_timeouts++; /* not woken: look at the CQ anyway */
				if (n <= 0)
					continue;
				if (ibv_get_cq_event(ch, &ecq, &ectx)) {
					if (errno != EAGAIN)
						DIE("get_cq_event");
					continue;
				}
			} else if (ibv_get_cq_event(ch, &ecq, &ectx)) {
				DIE("get_cq_event");
			}
			if (ecq != cq)
				DIE("event for a foreign CQ");
			events++;
			ibv_ack_cq_events(ecq, 1);
			if (ibv_req_notify_cq(cq, 0))
				DIE("re-arm");
		}
	}
	if (o.threaded) {
		pthread_join(sender_tid, NULL);
		data_sent = sd.data_sent;
		send_sum = sd.send_sum;
	}
	if (tfd >= 0) {
		ping_send(PING_END, t_sent);
		ping_poll(1);
		printf("TCP sent=%llu received=%llu bad=%llu\n", (unsigned long long)t_sent,
		       (unsigned long long)t_recv, (unsigned long long)t_bad);
		close(tfd);
	}
	if (ep >= 0)
		printf("EPOLL timeouts=%ld\n", ep_timeouts);
	if (o.timers)
		timers_report();
	printf("RESULT sent=%llu received=%llu send_sum=%016llx recv_sum=%016llx events=%ld bad=%d\n",
	       (unsigned long long)data_sent, (unsigned long long)(expect ? expect - 1 : 0),
	       (unsigned long long)send_sum, (unsigned long long)recv_sum, events, bad);
	/* give the peer's last ack time to land before the QP goes away */
	usleep(200000);
	ibv_destroy_qp(qp);
	if (srq)
		ibv_destroy_srq(srq);
	ibv_destroy_cq(cq);
	if (ch)
		ibv_destroy_comp_channel(ch);
	ibv_dereg_mr(smr);
	ibv_dereg_mr(rmr);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	return bad || t_bad ? 1 : 0;
}
