/* What verbs_seq.c (setup and the RC modes) and verbs_seq_ud.c (the UD
 * mode) share: the options, the one registered region and the QP. */
#ifndef IBK_TEST_VERBS_SEQ_H
#define IBK_TEST_VERBS_SEQ_H

#include "common.h"

enum mode { M_WRITE, M_WRITEIMM, M_READ, M_ATOMIC, M_UD };
enum { MSG_ACK = 3 };

#define NSRC 256
#define RSLOT 128 /* receive slot: 40-byte GRH (UD) + message */
#define GRH 40
#define QKEY 0x11111111u
#define STALL_MS 90000

/* the command line */
struct options {
	const char *peer, *stop;
	int port, gid, unsig, window, recvs;
	enum mode mode;
};
extern struct options o;

/* One registered region, the same layout on both sides, so the peer's
 * addresses follow from its base address. */
struct layout {
	size_t ring, src, ctr, sbuf, dst, rbuf, total;
	uint32_t ring_slots;
};

extern struct layout L;
extern uint8_t *base;
extern struct ibv_mr *mr;
extern struct ibv_qp *qp;
extern struct ibv_cq *cq;
extern struct ibv_ah *ah;
extern struct oob mine, theirs;
extern int bad;

#define BAD(...)                                      \
	do {                                          \
		fprintf(stderr, "BAD " __VA_ARGS__); \
		fputc('\n', stderr);                  \
		bad++;                                \
	} while (0)


struct msg *sbuf_at(uint64_t n);
uint8_t *rbuf_at(uint64_t i);
void post_recv_slot(uint64_t i);
void post(struct ibv_send_wr *w);
/* -u K: every K-th operation is signaled */
int signaled(uint64_t n);
/* Up to max completions of cq into wc; -1 once none came for STALL_MS
 * since *last_progress (the caller says what it waited for and stops). */
int poll_or_stall(struct ibv_wc *wc, int max, long *last_progress);

/* verbs_seq_ud.c */
void ud_connect(void);
void ud_run(void);

#endif
