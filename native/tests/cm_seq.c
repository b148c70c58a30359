/* cm_seq: an rdma_cm program written the way a third party writes one.
 *
 * The server listens with rdma_cm, the client resolves the address and the
 * route and connects; each side tells the other its ring buffer (address and
 * rkey) in the connection's private data.  Then both send sequence-numbered,
 * checksummed messages: each one is an RDMA WRITE into the peer's ring slot
 * followed by a SEND of the same message, and the receiver checks the send
 * (in order, no gap, no duplicate) and the ring slot it names.  On the stop
 * file (-f) or after -n messages each side sends END with its count and
 * checksum; once both ENDs are through, both call rdma_disconnect, wait for
 * their DISCONNECTED event, destroy QP, id and channel, and exit 0 if all
 * was well.
 *
 *   cm_seq -s ADDR -p PORT [opts]     server (bound to ADDR)
 *   cm_seq -c ADDR -p PORT [opts]     client
 *   -f FILE  stop when FILE exists    -n N  stop after N messages
 *   -L       the server keeps its listening id to the end (rping does)
 *   -T       a thread blocks in rdma_get_cm_event from the connection on,
 *            waiting for DISCONNECTED (as rping's cm thread does)
 *   -P       wait for events with poll() on a non-blocking channel fd
 *   -A       then connect again, on a new event channel at PORT+1, and
 *            exchange 50 messages more (prints READY-AGAIN and AGAIN ...);
 *            with -T, that connection's cm thread is one made at the start
 *
 * Prints READY once connected and
 *   RESULT sent= received= send_sum= recv_sum= events= bad=
 * where events counts the rdma_cm events the program got. */
#include <fcntl.h>
#include <getopt.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <time.h>
#include <rdma/rdma_cma.h>

#include "common.h"

#define WINDOW 16   /* messages in flight per side */
#define RECVS 64    /* receives posted */
#define RING 256    /* slots of the ring each side writes into */
#define BATCH 16
#define AGAIN_COUNT 50 /* messages of the -A connection */

struct ring_info {
	uint64_t addr;
	uint32_t rkey;
	uint32_t slots;
};

static struct {
	int server, keep_listen, thread, use_poll, again;
	const char *addr, *port, *stop;
	long count;
	char port_again[16];
} o = { .port = "7471", .count = -1 };

static struct rdma_event_channel *ch;
static struct rdma_cm_id *listen_id, *id;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static struct ibv_mr *mr;
static struct msg *sendbuf, *recvbuf, *ring; /* one MR: WINDOW + RECVS + RING */
static struct ring_info peer;
static atomic_long events;
static atomic_int disconnected;
static pthread_t late; /* -T -A: the second connection's cm thread */

static const char *event_name(enum rdma_cm_event_type e)
{
	return rdma_event_str(e);
}

/* The next rdma_cm event, blocking in rdma_get_cm_event or in poll(). */
static struct rdma_cm_event *next_event(void)
{
	struct rdma_cm_event *ev;

	for (;;) {
		if (!rdma_get_cm_event(ch, &ev)) {
			events++;
			return ev;
		}
		if (o.use_poll && errno == EAGAIN) {
			struct pollfd p = { .fd = ch->fd, .events = POLLIN };

			if (poll(&p, 1, -1) < 0 && errno != EINTR)
				DIE("poll on the event channel");
			continue;
		}
		DIE("rdma_get_cm_event");
	}
}

static struct rdma_cm_event *expect(enum rdma_cm_event_type want)
{
	struct rdma_cm_event *ev = next_event();

	if (ev->event != want || ev->status)
		DIE("got %s (status %d), wanted %s", event_name(ev->event), ev->status, event_name(want));
	return ev;
}

static void post_recv(int slot)
{
	struct ibv_sge sge = { .addr = (uintptr_t)&recvbuf[slot], .length = sizeof(struct msg), .lkey = mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = (uint64_t)slot, .sg_list = &sge, .num_sge = 1 }, *bad;

	if (ibv_post_recv(id->qp, &wr, &bad))
		DIE("ibv_post_recv");
}

/* The resources of the connected id, before it connects or accepts. */
static void setup(struct rdma_cm_id *cid)
{
	struct ibv_qp_init_attr attr;
	size_t bytes = (WINDOW + RECVS + RING) * sizeof(struct msg);
	int i;

	pd = ibv_alloc_pd(cid->verbs);
	cq = pd ? ibv_create_cq(cid->verbs, 2 * WINDOW + RECVS + 8, NULL, NULL, 0) : NULL;
	sendbuf = calloc(1, bytes);
	if (!cq || !sendbuf)
		DIE("pd/cq/buffers");
	recvbuf = sendbuf + WINDOW;
	ring = recvbuf + RECVS;
	mr = ibv_reg_mr(pd, sendbuf, bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!mr)
		DIE("ibv_reg_mr");
	memset(&attr, 0, sizeof(attr));
	attr.send_cq = cq;
	attr.recv_cq = cq;
	attr.qp_type = IBV_QPT_RC;
	attr.cap.max_send_wr = 2 * WINDOW + 4;
	attr.cap.max_recv_wr = RECVS;
	attr.cap.max_send_sge = 1;
	attr.cap.max_recv_sge = 1;
	if (rdma_create_qp(cid, pd, &attr))
		DIE("rdma_create_qp");
	id = cid;
	for (i = 0; i < RECVS; i++)
		post_recv(i);
}

static void conn_param(struct rdma_conn_param *p, struct ring_info *mine)
{
	mine->addr = (uintptr_t)ring;
	mine->rkey = mr->rkey;
	mine->slots = RING;
	memset(p, 0, sizeof(*p));
	p->private_data = mine;
	p->private_data_len = sizeof(*mine);
	p->responder_resources = 1;
	p->initiator_depth = 1;
	p->retry_count = 7;
	p->rnr_retry_count = 7;
}

static void take_peer(const struct rdma_cm_event *ev)
{
	if (ev->param.conn.private_data_len < sizeof(peer))
		DIE("no ring in the private data (%u bytes)", ev->param.conn.private_data_len);
	memcpy(&peer, ev->param.conn.private_data, sizeof(peer));
}

static void connect_server(void)
{
	struct addrinfo *ai, hints = { .ai_flags = AI_PASSIVE, .ai_family = AF_INET };
	struct rdma_conn_param param;
	struct ring_info mine;
	struct rdma_cm_event *ev;
	struct rdma_cm_id *child;

	if (getaddrinfo(o.addr, o.port, &hints, &ai))
		DIE("getaddrinfo %s", o.addr);
	if (rdma_create_id(ch, &listen_id, NULL, RDMA_PS_TCP) || rdma_bind_addr(listen_id, ai->ai_addr) ||
	    rdma_listen(listen_id, 1))
		DIE("listen on %s:%s", o.addr, o.port);
	freeaddrinfo(ai);
	printf("LISTENING\n");
	fflush(stdout);
	ev = expect(RDMA_CM_EVENT_CONNECT_REQUEST);
	child = ev->id;
	take_peer(ev);
	rdma_ack_cm_event(ev);
	setup(child);
	conn_param(&param, &mine);
	if (rdma_accept(id, &param))
		DIE("rdma_accept");
	rdma_ack_cm_event(expect(RDMA_CM_EVENT_ESTABLISHED));
	if (!o.keep_listen) {
		/* one connection is all this server takes */
		if (rdma_destroy_id(listen_id))
			DIE("rdma_destroy_id (listener)");
		listen_id = NULL;
	}
}

static void connect_client(void)
{
	struct addrinfo *ai, hints = { .ai_family = AF_INET };
	struct rdma_conn_param param;
	struct ring_info mine;
	struct rdma_cm_event *ev;
	struct rdma_cm_id *cid;
	int tries;

	if (getaddrinfo(o.addr, o.port, &hints, &ai))
		DIE("getaddrinfo %s", o.addr);
	for (tries = 0;; tries++) { /* the server may not listen yet */
		atomic_store(&events, 0); /* count the events of the attempt that connects */
		if (rdma_create_id(ch, &cid, NULL, RDMA_PS_TCP) || rdma_resolve_addr(cid, NULL, ai->ai_addr, 2000))
			DIE("rdma_resolve_addr");
		rdma_ack_cm_event(expect(RDMA_CM_EVENT_ADDR_RESOLVED));
		if (rdma_resolve_route(cid, 2000))
			DIE("rdma_resolve_route");
		rdma_ack_cm_event(expect(RDMA_CM_EVENT_ROUTE_RESOLVED));
		setup(cid);
		conn_param(&param, &mine);
		if (rdma_connect(id, &param))
			DIE("rdma_connect");
		ev = next_event();
		if (ev->event == RDMA_CM_EVENT_ESTABLISHED && !ev->status)
			break;
		if (ev->event != RDMA_CM_EVENT_REJECTED || tries > 300)
			DIE("connect: %s (status %d)", event_name(ev->event), ev->status);
		rdma_ack_cm_event(ev);
		rdma_destroy_qp(id);
		ibv_dereg_mr(mr);
		ibv_destroy_cq(cq);
		ibv_dealloc_pd(pd);
		free(sendbuf);
		rdma_destroy_id(cid);
		usleep(200000);
	}
	take_peer(ev);
	rdma_ack_cm_event(ev);
	freeaddrinfo(ai);
}

/* -T: blocks in rdma_get_cm_event for the whole run, like rping's cm thread */
static void *cm_thread(void *arg)
{
	struct rdma_cm_event *ev = next_event();

	(void)arg;
	if (ev->event != RDMA_CM_EVENT_DISCONNECTED)
		DIE("cm thread: got %s", event_name(ev->event));
	rdma_ack_cm_event(ev);
	atomic_store(&disconnected, 1);
	return NULL;
}

/* -T -A: the cm thread of the second connection is made at the start and
 * waits for it, so it runs before any checkpoint, and a restore gives it a
 * cred of its own (the channel is made by the main thread, later). */
static pthread_mutex_t late_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t late_cond = PTHREAD_COND_INITIALIZER;
static int late_go;

static void *late_cm_thread(void *arg)
{
	pthread_mutex_lock(&late_lock);
	while (!late_go)
		pthread_cond_wait(&late_cond, &late_lock);
	pthread_mutex_unlock(&late_lock);
	return cm_thread(arg);
}

static void post_message(uint64_t seq, uint64_t kind, uint64_t value, uint64_t sum)
{
	struct msg *m = &sendbuf[seq % WINDOW];
	struct ibv_sge sge = { .addr = (uintptr_t)m, .length = sizeof(*m), .lkey = mr->lkey };
	struct ibv_send_wr write = { .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE };
	struct ibv_send_wr send = { .wr_id = seq, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				    .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *bad;

	msg_fill(m, seq, kind, value, sum);
	write.wr.rdma.remote_addr = peer.addr + (seq % peer.slots) * sizeof(struct msg);
	write.wr.rdma.rkey = peer.rkey;
	write.next = kind == MSG_DATA ? &send : NULL;
	if (ibv_post_send(id->qp, kind == MSG_DATA ? &write : &send, &bad))
		DIE("ibv_post_send");
}

/* One connection: connect, exchange messages until stop/count, END both
 * ways, disconnect, free everything; prints its result line under label. */
static int session(const char *label, const char *stop, long count)
{
	uint64_t sent = 0, received = 0, send_sum = 0, recv_sum = 0;
	int outstanding = 0, stopping = 0, end_sent = 0, got_end = 0, bad = 0;
	long last_check = 0;
	pthread_t thr;
	struct stat st;

	atomic_store(&events, 0);
	ch = rdma_create_event_channel();
	if (!ch)
		DIE("rdma_create_event_channel");
	if (o.use_poll && fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK))
		DIE("O_NONBLOCK on the event channel");
	if (o.server)
		connect_server();
	else
		connect_client();
	printf("%s qpn=%u peer_ring=%u\n", stop ? "READY" : "READY-AGAIN", id->qp->qp_num, peer.slots);
	if (o.thread && !stop && o.again) {
		thr = late;
		pthread_mutex_lock(&late_lock);
		late_go = 1;
		pthread_cond_signal(&late_cond);
		pthread_mutex_unlock(&late_lock);
	} else if (o.thread && pthread_create(&thr, NULL, cm_thread, NULL)) {
		DIE("pthread_create");
	}

	while (!(end_sent && !outstanding && got_end)) {
		struct ibv_wc wc[BATCH];
		int n, i;

		if (!stopping) {
			if (count >= 0)
				stopping = (long)sent >= count;
			else if (now_ms() - last_check > 20) {
				last_check = now_ms();
				stopping = !stat(stop, &st);
			}
		}
		while (!stopping && outstanding < WINDOW && (count < 0 || (long)sent < count)) {
			struct msg m;

			msg_fill(&m, sent, MSG_DATA, 0, 0);
			post_message(sent, MSG_DATA, 0, 0);
			send_sum = mix64(send_sum ^ m.check);
			sent++;
			outstanding++;
		}
		if (stopping && !outstanding && !end_sent) {
			post_message(sent, MSG_END, sent, send_sum);
			outstanding++;
			end_sent = 1;
		}
		n = ibv_poll_cq(cq, BATCH, wc);
		if (n < 0)
			DIE("ibv_poll_cq");
		for (i = 0; i < n; i++) {
			struct msg *m;

			if (wc[i].status != IBV_WC_SUCCESS)
				DIE("completion %s (opcode %d, wr_id %llu)", ibv_wc_status_str(wc[i].status),
				    wc[i].opcode, (unsigned long long)wc[i].wr_id);
			if (!(wc[i].opcode & IBV_WC_RECV)) {
				outstanding--;
				continue;
			}
			m = &recvbuf[wc[i].wr_id];
			if (!msg_ok(m)) {
				bad++;
			} else if (m->kind == MSG_END) {
				got_end = 1;
				if (m->value != received || m->sum != recv_sum)
					bad++;
			} else if (m->seq != received || memcmp(&ring[m->seq % RING], m, sizeof(*m))) {
				bad++; /* a gap, a duplicate, or the write did not land */
				received = m->seq + 1;
			} else {
				recv_sum = mix64(recv_sum ^ m->check);
				received++;
			}
			post_recv((int)wc[i].wr_id);
		}
	}

	/* both ENDs are through: disconnect, and wait for our DISCONNECTED */
	if (rdma_disconnect(id))
		DIE("rdma_disconnect");
	if (o.thread) {
		pthread_join(thr, NULL);
	} else {
		rdma_ack_cm_event(expect(RDMA_CM_EVENT_DISCONNECTED));
		atomic_store(&disconnected, 1);
	}
	printf("DISCONNECTED\n");
	rdma_destroy_qp(id);
	if (ibv_dereg_mr(mr) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd))
		DIE("freeing the verbs resources");
	if (rdma_destroy_id(id))
		DIE("rdma_destroy_id");
	if (listen_id && rdma_destroy_id(listen_id))
		DIE("rdma_destroy_id (listener)");
	rdma_destroy_event_channel(ch);
	free(sendbuf);
	printf("%s sent=%llu received=%llu send_sum=%016llx recv_sum=%016llx events=%ld bad=%d\n", label,
	       (unsigned long long)sent, (unsigned long long)received, (unsigned long long)send_sum,
	       (unsigned long long)recv_sum, atomic_load(&events), bad);
	listen_id = NULL;
	return bad;
}

int main(int argc, char **argv)
{
	int c, bad;

	while ((c = getopt(argc, argv, "s:c:p:f:n:LTPA")) != -1) {
		switch (c) {
		case 's': o.server = 1; o.addr = optarg; break;
		case 'c': o.addr = optarg; break;
		case 'p': o.port = optarg; break;
		case 'f': o.stop = optarg; break;
		case 'n': o.count = atol(optarg); break;
		case 'L': o.keep_listen = 1; break;
		case 'T': o.thread = 1; break;
		case 'P': o.use_poll = 1; break;
		case 'A': o.again = 1; break;
		default: DIE("usage: cm_seq -s|-c ADDR [-p PORT] [-f STOPFILE] [-n COUNT] [-L] [-T] [-P] [-A]");
		}
	}
	if (!o.addr || (!o.stop && o.count < 0))
		DIE("usage: cm_seq -s|-c ADDR [-p PORT] (-f STOPFILE | -n COUNT) [-L] [-T] [-P] [-A]");
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (o.thread && o.again && pthread_create(&late, NULL, late_cm_thread, NULL))
		DIE("pthread_create");
	bad = session("RESULT", o.stop ? o.stop : "", o.count);
	if (o.again) {
		/* a second connection on a new channel, at the next port */
		snprintf(o.port_again, sizeof(o.port_again), "%d", atoi(o.port) + 1);
		o.port = o.port_again;
		bad += session("AGAIN", NULL, AGAIN_COUNT);
	}
	return bad ? 1 : 0;
}
