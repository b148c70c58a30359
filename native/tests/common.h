/* Shared helpers of the C test programs: device setup, out-of-band exchange
 * of virtual ids over TCP, and sequence-numbered, checksummed messages. */
#ifndef IBK_TEST_COMMON_H
#define IBK_TEST_COMMON_H

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define DIE(...)                                      \
	do {                                          \
		fprintf(stderr, "FATAL: " __VA_ARGS__); \
		fprintf(stderr, " (errno %d)\n", errno); \
		exit(2);                              \
	} while (0)

enum { MSG_DATA = 1, MSG_END = 2 };

/* 64 bytes: header, then a pattern derived from seq, then a checksum. */
struct msg {
	uint64_t seq;
	uint64_t kind;
	uint64_t value; /* END: number of DATA messages sent */
	uint64_t sum;   /* END: running checksum of all DATA sent */
	uint8_t pattern[24];
	uint64_t check;
};

static inline uint64_t mix64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	return x ^ (x >> 33);
}

static inline uint64_t msg_check(const struct msg *m)
{
	uint64_t h = mix64(m->seq ^ (m->kind << 56) ^ m->value ^ mix64(m->sum));
	size_t i;

	for (i = 0; i < sizeof(m->pattern); i++)
		h = mix64(h ^ m->pattern[i]);
	return h;
}

static inline void msg_fill(struct msg *m, uint64_t seq, uint64_t kind, uint64_t value, uint64_t sum)
{
	size_t i;

	m->seq = seq;
	m->kind = kind;
	m->value = value;
	m->sum = sum;
	for (i = 0; i < sizeof(m->pattern); i++)
		m->pattern[i] = (uint8_t)(mix64(seq * 31 + i) & 0xff);
	m->check = msg_check(m);
}

static inline int msg_ok(const struct msg *m)
{
	struct msg want;

	msg_fill(&want, m->seq, m->kind, m->value, m->sum);
	return m->check == want.check && !memcmp(m->pattern, want.pattern, sizeof(want.pattern));
}

/* What each side tells the other out of band: all virtual ids. */
struct oob {
	uint32_t qpn;
	uint32_t psn;
	uint32_t rkey;
	uint32_t lid;
	uint64_t addr;
	uint8_t gid[16];
};

/* Connect to sa, trying every 100 ms, at most tries times: the peer may
 * not listen yet.  The connected fd, or -1. */
static inline int connect_retry(const struct sockaddr_in *sa, int tries)
{
	int fd = -1;

	while (tries-- > 0) {
		fd = socket(AF_INET, SOCK_STREAM, 0);
		if (!connect(fd, (const struct sockaddr *)sa, sizeof(*sa)))
			break;
		close(fd);
		fd = -1;
		usleep(100000);
	}
	return fd;
}

/* Exchange ids over a fresh TCP connection (connect to peer, or accept on port)
 * and return that connection, still open. */
static inline int oob_exchange_keep(const char *peer, int port, const struct oob *mine, struct oob *theirs)
{
	int fd, one = 1;
	struct sockaddr_in sa;

	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	sa.sin_port = htons((uint16_t)port);
	if (peer) {
		inet_pton(AF_INET, peer, &sa.sin_addr);
		fd = connect_retry(&sa, 300);
		if (fd < 0)
			DIE("connect to %s:%d", peer, port);
	} else {
		int lfd = socket(AF_INET, SOCK_STREAM, 0);

		setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
		sa.sin_addr.s_addr = htonl(INADDR_ANY);
		if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(lfd, 1))
			DIE("listen on %d", port);
		fd = accept(lfd, NULL, NULL);
		close(lfd);
	}
	if (write(fd, mine, sizeof(*mine)) != (ssize_t)sizeof(*mine) ||
	    read(fd, theirs, sizeof(*theirs)) != (ssize_t)sizeof(*theirs))
		DIE("oob exchange");
	return fd;
}

static inline int oob_exchange(const char *peer, int port, const struct oob *mine, struct oob *theirs)
{
	/* Closed right away: a process holding a TCP connection needs more
	 * CRIU options, and the tests want the plain case. */
	close(oob_exchange_keep(peer, port, mine, theirs));
	return 0;
}

static inline struct ibv_context *open_first_device(void)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	struct ibv_context *ctx;

	if (!list || n < 1)
		DIE("no RDMA device");
	ctx = ibv_open_device(list[0]);
	if (!ctx)
		DIE("open device");
	ibv_free_device_list(list);
	return ctx;
}

/* An RC QP with one CQ for both queues and one SGE a WR each way; NULL when
 * the device refuses it. */
static inline struct ibv_qp *create_rc_qp(struct ibv_pd *pd, struct ibv_cq *cq, uint32_t send_wr, uint32_t recv_wr)
{
	struct ibv_qp_init_attr qa;

	memset(&qa, 0, sizeof(qa));
	qa.send_cq = cq;
	qa.recv_cq = cq;
	qa.qp_type = IBV_QPT_RC;
	qa.cap.max_send_wr = send_wr;
	qa.cap.max_recv_wr = recv_wr;
	qa.cap.max_send_sge = 1;
	qa.cap.max_recv_sge = 1;
	return ibv_create_qp(pd, &qa);
}

static inline void qp_to_init(struct ibv_qp *qp, int access)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = 1;
	a.qp_access_flags = access;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		DIE("INIT");
}

static inline void qp_to_rts(struct ibv_qp *qp, const struct oob *peer, int gid_index, uint32_t my_psn)
{
	struct ibv_qp_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = peer->qpn;
	a.rq_psn = peer->psn;
	a.max_dest_rd_atomic = 4;
	a.min_rnr_timer = 1;
	a.ah_attr.is_global = 1;
	memcpy(a.ah_attr.grh.dgid.raw, peer->gid, 16);
	a.ah_attr.grh.sgid_index = (uint8_t)gid_index;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.dlid = (uint16_t)peer->lid;
	a.ah_attr.port_num = 1;
	if (ibv_modify_qp(qp, &a,
			  IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
				  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		DIE("RTR");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7; /* infinite: a quiesced peer must not break the QP */
	a.sq_psn = my_psn;
	a.max_rd_atomic = 4;
	if (ibv_modify_qp(qp, &a,
			  IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
				  IBV_QP_MAX_QP_RD_ATOMIC))
		DIE("RTS");
}

/* This side's ids, for oob_exchange: the QP, its first PSN and the region. */
static inline void oob_fill(struct oob *mine, struct ibv_context *ctx, int gid_index, const struct ibv_qp *qp,
			    uint32_t rkey, uint64_t addr)
{
	union ibv_gid gid;

	if (ibv_query_gid(ctx, 1, gid_index, &gid))
		DIE("gid");
	memset(mine, 0, sizeof(*mine));
	mine->qpn = qp->qp_num;
	mine->psn = (uint32_t)(getpid() * 7919) & 0xffffff;
	mine->rkey = rkey;
	mine->addr = addr;
	memcpy(mine->gid, gid.raw, 16);
}

static inline long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static inline int file_exists(const char *p)
{
	return p && access(p, F_OK) == 0;
}

#endif
