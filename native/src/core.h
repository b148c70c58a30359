/* Pure parts of libibckpt: id tables, work-request logs, completion queues and
 * the exactly-once re-post planner.  No libibverbs calls in here, so the same
 * code is unit-tested on the host (through cffi) where no RDMA device exists. */
#ifndef IBK_CORE_H
#define IBK_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <infiniband/verbs.h>

/* ---- id tables ------------------------------------------------------- */

/* Open-addressing map from a 32-bit virtual id to a 32-bit real id.  A
 * deleted key leaves a tombstone so a retired virtual id is remembered. */
/* cffi-begin: native/shimtest/core.py binds what stands up to cffi-end */
struct ibk_idmap {
	uint32_t *keys;
	uint32_t *vals;
	uint8_t *used; /* 0 empty, 1 live, 2 retired */
	size_t cap;
	size_t live;
	size_t filled;
};

int ibk_idmap_init(struct ibk_idmap *m, size_t cap);
void ibk_idmap_fini(struct ibk_idmap *m);
int ibk_idmap_put(struct ibk_idmap *m, uint32_t vid, uint32_t rid);
int ibk_idmap_get(const struct ibk_idmap *m, uint32_t vid, uint32_t *rid);
int ibk_idmap_del(struct ibk_idmap *m, uint32_t vid);
int ibk_idmap_is_live(const struct ibk_idmap *m, uint32_t vid);
int ibk_idmap_was_used(const struct ibk_idmap *m, uint32_t vid);
/* A virtual id for a new object: the real id itself unless another live
 * object holds it; otherwise the next id above `floor` (masked to `mask`)
 * that was never handed out. */
uint32_t ibk_idmap_choose(const struct ibk_idmap *m, uint32_t real, uint32_t floor, uint32_t mask);
/* QPNs also stay clear of `reserved`: the live virtual QPNs of the other
 * processes that share this one's virtual GID, as the agent said (`reserve`).
 * taken: the real QPN may not be the virtual one; choose: as above, from
 * 0x800000 and never a reserved one. */
int ibk_qpn_taken(const struct ibk_idmap *own, const struct ibk_idmap *reserved, uint32_t qpn);
uint32_t ibk_qpn_choose(const struct ibk_idmap *own, const struct ibk_idmap *reserved, uint32_t real);
/* cffi-end */

/* ---- counters -------------------------------------------------------- */

struct ibk_counters {
	uint64_t sends_posted;     /* app send WRs accepted */
	uint64_t sends_completed;  /* app send WRs retired (polled or implied) */
	uint64_t consumers_done;   /* sends that consume a remote receive, known delivered */
	uint64_t recvs_posted;     /* SRQ only: a QP's is its receive log's next_seq */
	uint64_t recvs_completed;  /* successful receive completions, ever */
	uint64_t reposted;         /* sends posted again after a rebuild */
	uint64_t synthesized;      /* completions made up for delivered sends */
};

/* ---- send log -------------------------------------------------------- */

/* The most SGEs per WR the shim takes: a bound for stack copies, above what
 * HCAs offer (rxe: 32).  Each log holds as many per entry as its QP got. */
#define IBK_MAX_SGE 64

enum ibk_wr_kind { IBK_KIND_SEND = 0x53454e44u, IBK_KIND_RECV = 0x52454356u };

enum ibk_swr_flags {
	IBK_SWR_SIGNALED = 1u << 0,
	IBK_SWR_CONSUMER = 1u << 1, /* consumes a receive at the peer */
	IBK_SWR_FLAG_WR = 1u << 2,  /* the shim's own zero-length probe */
	IBK_SWR_ATOMIC = 1u << 3,
	IBK_SWR_RDMA = 1u << 4,
	IBK_SWR_BIND = 1u << 5, /* an ibv_bind_mw (type 1): local, in order with the sends */
};

/* One logged send work request.  `kind` comes first: the real wr_id is a
 * pointer to the entry, and a completion tells send from receive by it. */
struct ibk_swr {
	uint32_t kind;
	uint32_t flags;
	uint64_t seq;
	void *owner; /* the shadow QP */
	uint64_t app_wr_id;
	struct ibv_send_wr wr; /* copy with virtual keys; sg_list -> sge */
	struct ibv_sge *sge;   /* the log's max_sge of them, fixed at init */
	uint8_t *inline_buf; /* copy of inline payload, for replay */
	uint32_t inline_len;
};

struct ibk_rwr {
	uint32_t kind;
	uint32_t in_use; /* scan mode only */
	uint64_t seq;
	void *owner; /* shadow QP or SRQ */
	uint64_t app_wr_id;
	struct ibv_recv_wr wr; /* wr_id (this entry), next, sg_list fixed at init */
	struct ibv_sge *sge;   /* the log's max_sge of them */
};

/* In-order ring of send entries: entries complete in posting order on one
 * send queue, so retiring is "everything up to seq".  The ring has a power
 * of two slots (seq & mask finds one); at most cap of them are live. */
struct ibk_sendlog {
	struct ibk_swr *slots;
	uint8_t *inline_area;
	struct ibv_sge *sge_area;
	uint64_t cap; /* 64 bits: the post fast path compares it to a seq difference */
	uint32_t mask;
	uint32_t max_inline;
	uint32_t max_sge;
	uint64_t head; /* seq of the oldest live entry */
	uint64_t tail; /* seq of the next entry */
};

int ibk_sendlog_init(struct ibk_sendlog *l, uint32_t cap, uint32_t max_inline, uint32_t max_sge, void *owner);
void ibk_sendlog_fini(struct ibk_sendlog *l);
void ibk_sendlog_unpush(struct ibk_sendlog *l);
struct ibk_swr *ibk_sendlog_at(struct ibk_sendlog *l, uint64_t seq);

static inline uint32_t ibk_sendlog_count(const struct ibk_sendlog *l)
{
	return (uint32_t)(l->tail - l->head);
}

static inline struct ibk_swr *ibk_sendlog_push(struct ibk_sendlog *l)
{
	struct ibk_swr *e;

	if (l->tail - l->head >= l->cap)
		return NULL;
	e = &l->slots[l->tail & l->mask];
	e->seq = l->tail++;
	e->flags = 0;
	e->inline_len = 0;
	return e;
}

/* Retire entries up to and including seq, folding them into counters.
 * (rdma_inflight and atomic_inflight are not kept here: the status report
 * counts them in the log.) */
static inline void ibk_sendlog_retire_to(struct ibk_sendlog *l, uint64_t seq, struct ibk_counters *c)
{
	uint64_t end = seq < l->tail ? seq + 1 : l->tail;

	for (; l->head < end; l->head++) {
		uint32_t f = l->slots[l->head & l->mask].flags;

		if (f & IBK_SWR_FLAG_WR)
			continue;
		c->sends_completed++;
		c->consumers_done += !!(f & IBK_SWR_CONSUMER);
	}
}

/* A completion for live entry e: usually the oldest one, retired at once. */
static inline void ibk_sendlog_retire_entry(struct ibk_sendlog *l, const struct ibk_swr *e,
					    struct ibk_counters *c)
{
	if (__builtin_expect(e->seq == l->head && !(e->flags & IBK_SWR_FLAG_WR), 1)) {
		l->head++;
		c->sends_completed++;
		c->consumers_done += !!(e->flags & IBK_SWR_CONSUMER);
		return;
	}
	ibk_sendlog_retire_to(l, e->seq, c);
}

/* Receive log.  Receives on a plain QP complete in posting order, so its log
 * is a ring like the send log (ring mode: retire everything up to the entry
 * that completed).  On an SRQ they complete in any order: slots are found
 * through a free scan and replayed by seq (scan mode). */
struct ibk_recvlog {
	struct ibk_rwr *slots;
	struct ibv_sge *sge_area;
	uint32_t max_sge;
	uint64_t cap;  /* live entries at most (64 bits: as in ibk_sendlog) */
	uint32_t mask; /* ring mode: slots - 1, a power of two minus one */
	int ring;
	uint32_t live; /* scan mode */
	uint32_t hint; /* scan mode */
	uint64_t head; /* ring mode: seq of the oldest live entry */
	uint64_t next_seq;
};

int ibk_recvlog_init(struct ibk_recvlog *l, uint32_t cap, int ring, uint32_t max_sge, void *owner);
void ibk_recvlog_fini(struct ibk_recvlog *l);
struct ibk_rwr *ibk_recvlog_take_scan(struct ibk_recvlog *l);
/* Live entries ordered by seq; returns how many were written to out. */
uint32_t ibk_recvlog_ordered(const struct ibk_recvlog *l, struct ibk_rwr **out, uint32_t max);

static inline uint32_t ibk_recvlog_live(const struct ibk_recvlog *l)
{
	return l->ring ? (uint32_t)(l->next_seq - l->head) : l->live;
}

static inline struct ibk_rwr *ibk_recvlog_take(struct ibk_recvlog *l)
{
	struct ibk_rwr *e;

	if (__builtin_expect(l->ring, 1)) {
		if (__builtin_expect(l->next_seq - l->head >= l->cap, 0))
			return NULL;
		e = &l->slots[l->next_seq & l->mask];
		e->seq = l->next_seq++;
		return e;
	}
	/* The slot after the last one taken is nearly always free: no scan. */
	e = &l->slots[l->hint];
	if (__builtin_expect(e->in_use || l->live >= l->cap, 0))
		return ibk_recvlog_take_scan(l);
	if (++l->hint == l->cap)
		l->hint = 0;
	e->in_use = 1;
	e->seq = l->next_seq++;
	l->live++;
	return e;
}

/* The entry completed (ring mode: and every one before it). */
static inline void ibk_recvlog_release(struct ibk_recvlog *l, struct ibk_rwr *e)
{
	if (l->ring) {
		if (e->seq >= l->head)
			l->head = e->seq + 1;
	} else if (e->in_use) {
		e->in_use = 0;
		l->live--;
	}
}

/* Give back the entry just taken (its post failed). */
static inline void ibk_recvlog_untake(struct ibk_recvlog *l, struct ibk_rwr *e)
{
	if (l->ring) {
		if (e->seq + 1 == l->next_seq)
			l->next_seq--;
	} else {
		ibk_recvlog_release(l, e);
	}
}

/* ---- private completion queue --------------------------------------- */

/* cffi-begin: native/shimtest/core.py binds what stands up to cffi-end */
struct ibk_wcq {
	struct ibv_wc *ring;
	uint32_t cap; /* power of two */
	uint64_t head;
	uint64_t tail;
};

int ibk_wcq_init(struct ibk_wcq *q, uint32_t cap);
void ibk_wcq_fini(struct ibk_wcq *q);
int ibk_wcq_push(struct ibk_wcq *q, const struct ibv_wc *wc);
int ibk_wcq_pop(struct ibk_wcq *q, struct ibv_wc *out, int max);
uint32_t ibk_wcq_count(const struct ibk_wcq *q);
/* cffi-end */

/* ---- exactly-once planner ------------------------------------------- */

enum ibk_verdict { IBK_V_DELIVERED = 1, IBK_V_REPOST = 2, IBK_V_UNKNOWN = 3 };

/* Decide, for each still-logged send (oldest first), whether the peer has
 * executed it.  peer_recvs is the peer QP's lifetime receive-completion
 * count; done_consumers is how many of our receive-consuming sends are
 * already known delivered.  RC executes in order, so everything up to the
 * last delivered consumer was executed and everything after the first
 * undelivered consumer was not.  Entries between (no consumer after them)
 * are executed-or-not: idempotent ones are re-posted, atomics are UNKNOWN.
 * Returns the number of UNKNOWN entries, or -1 when the counts disagree. */
/* cffi-begin: native/shimtest/core.py binds what stands up to cffi-end */
int ibk_plan_resend(const uint32_t *flags, size_t n, uint64_t peer_recvs, uint64_t done_consumers,
		    uint8_t *verdict);
/* cffi-end */

#endif
