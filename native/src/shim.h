/* The shadow objects of libibckpt and the verbs paths that share them.
 * It includes the few headers every verbs file needs: the real verbs
 * (real.h), the gate (gate.h), logging (diag.h) and the object lists
 * (objs.h); the rest is included where it is used. */
#ifndef IBK_SHIM_H
#define IBK_SHIM_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>

#include "core.h"
#include "diag.h"
#include "gate.h"
#include "lock.h"
#include "objs.h"
#include "real.h"
#include "records.h"

/* Everything declared below is the shim's own: direct calls and rip-relative
 * loads, no PLT or GOT on the fast paths.  Exports say IBK_EXPORT. */
#pragma GCC visibility push(hidden)

#define IBK_EXPORT __attribute__((visibility("default")))

struct ibk_qp;
struct ibk_srq;
struct ibk_cq;
struct ibk_ah;
struct ibk_chan;
struct ibk_mr;

/* The compiler must assume x changed: addresses derived from it are then
 * recomputed after a call instead of kept in a saved register. */
#define IBK_FORGET(x) __asm__("" : "+r"(x))

/* ---- shadow objects ------------------------------------------------------ */

struct ibk_pd {
	struct ibv_pd pub;
	struct ibk_obj obj;
	struct ibv_pd *real;
};

struct ibk_mr {
	struct ibv_mr pub;
	struct ibk_obj obj;
	struct ibv_mr *real;
	struct ibk_pd *pd;
	uint64_t iova;
	unsigned int access;
};

/* A memory window of type 1 and its binding as the app last asked for it
 * (mw.c): rebuild allocates it again and binds it to the same range. */
struct ibk_mw {
	struct ibv_mw pub;
	struct ibk_obj obj;
	struct ibv_mw *real;
	struct ibk_pd *pd;
	struct ibk_mr *mr; /* bound to; NULL while unbound */
	uint64_t addr, length;
	unsigned int access;
};
struct ibv_mw *ibk_alloc_mw(struct ibv_pd *pd, enum ibv_mw_type type);
int ibk_bind_mw(struct ibv_qp *qp, struct ibv_mw *mw, struct ibv_mw_bind *bind);
int ibk_dealloc_mw(struct ibv_mw *mw);
/* rebuild: every window of ctx again, bound as before, its rkey mapped */
int ibk_mw_rebuild_all(struct ibk_ctx *ctx);

/* Pending completion events of one channel: shadow CQs in arrival order. */
struct ibk_chan {
	struct ibv_comp_channel pub;
	struct ibk_obj obj;
	struct ibv_comp_channel *real;
	int wake_fd;    /* eventfd: readable while the gate is closed */
	int pending_fd; /* eventfd in the app's epoll fd: readable while events are queued */
	int pending_on; /* pending_fd is signalled (under lock) */
	pthread_mutex_t lock;
	pthread_mutex_t rd_lock; /* one reader of the real fd at a time */
	struct ibk_cq **events;
	uint32_t ev_cap, ev_head, ev_tail;
};

#define IBK_XBATCH 16

struct ibk_cq {
	union {
		struct ibv_cq cq;
		struct ibv_cq_ex ex; /* same leading layout as ibv_cq */
	} pub;
	struct ibk_obj obj;
	struct ibv_cq *real;
	struct ibk_chan *chan;
	int cqe_req;
	int comp_vector;
	int (*poll_fn)(struct ibv_cq *, int, struct ibv_wc *); /* the real CQ's */
	ibk_lock_t lock; /* private queue */
	struct ibk_wcq pq;
	atomic_uint pq_len; /* fast-path check without the lock */
	int armed, solicited;
	uint64_t events_got;
	struct ibv_wc xbuf[IBK_XBATCH]; /* ibv_cq_ex polling batch */
	int xn, xpos;
};
void ibk_cq_synthesize(struct ibk_qp *qp, struct ibk_swr *e);
int ibk_cq_create_real(struct ibk_cq *cq);
int ibk_mr_register_real(struct ibk_mr *mr);
int ibk_qp_create_real(struct ibk_qp *qp);
int ibk_srq_create_real(struct ibk_srq *srq);
int ibk_chan_create_real(struct ibk_chan *ch);
int ibk_chan_release_real(struct ibk_chan *ch);
void ibk_chan_wake_all(int on);
int ibk_ah_create_real(struct ibk_ah *ah);

struct ibk_srq {
	struct ibv_srq pub;
	struct ibk_obj obj;
	struct ibv_srq *real;
	struct ibk_pd *pd;
	struct ibv_srq_init_attr attr;
	int (*post_recv_fn)(struct ibv_srq *, struct ibv_recv_wr *, struct ibv_recv_wr **); /* real's */
	ibk_lock_t lock;
	struct ibk_recvlog rlog;
	struct ibk_counters cnt;
};

#define IBK_MAX_MODS 8

/* Where a connected QP points: the peer's virtual ids as the app gave them. */
struct ibk_peer {
	int valid;
	union ibv_gid vgid;
	uint16_t vlid;
	uint32_t vqpn;
	union ibv_gid rgid; /* the peer's current real ids */
	uint16_t rlid;
	uint32_t rqpn;
	uint64_t recvs_completed; /* from the peer's last rebuild record */
	struct ibk_idmap rkeys;   /* the peer's virtual rkey -> real rkey */
	int rkeys_translate;
};

/* The ibv_wr_* builder of a QP made with send ops flags (qp_ex.c): WRs
 * gathered between wr_start and wr_complete, then posted as one list
 * through the shim's logged post_send. */
struct ibk_wrb {
	struct ibv_send_wr *wr;
	struct ibv_send_wr *cur; /* the WR the setters fill; NULL after an error */
	struct ibv_sge *sge;     /* max_sge per WR */
	uint8_t *inl;            /* max_inline bytes per WR */
	uint32_t n, cap, max_sge, max_inline;
	int err;
};

/* ibv_create_qp_ex's attributes a real QP is made with again (comp_mask
 * holds the ones given, but the PD; 0 for ibv_create_qp) */
struct ibk_qp_ex_attr {
	uint32_t comp_mask, create_flags;
	uint64_t send_ops_flags;
	uint16_t max_tso_header;
};

struct ibk_qp {
	union { /* an extended QP's ibv_qp_ex starts with its ibv_qp, as in libibverbs */
		struct ibv_qp pub;
		struct ibv_qp_ex pubx;
	};
	struct ibk_obj obj;
	struct ibk_wrb *wrb; /* NULL unless made with send ops flags */
	struct ibv_qp *real;
	struct ibk_pd *pd;
	struct ibk_cq *scq, *rcq;
	struct ibk_srq *srq;
	struct ibv_qp_init_attr init; /* with shadow pointers */
	struct ibk_qp_ex_attr ex;
	uint32_t vqpn;
	/* the real QP's post verbs, looked up once per incarnation */
	int (*post_send_fn)(struct ibv_qp *, struct ibv_send_wr *, struct ibv_send_wr **);
	int (*post_recv_fn)(struct ibv_qp *, struct ibv_recv_wr *, struct ibv_recv_wr **);
	int ud;             /* UD: every send needs its AH translated */
	uint32_t flag_mask; /* log flags this QP type keeps (no CONSUMER but on RC) */
	uint32_t sig_all;   /* IBK_SWR_SIGNALED if sq_sig_all */
	uint8_t opf[16];    /* log flags per opcode: op_flags & flag_mask | sig_all */
	ibk_lock_t lock;  /* send side log and counters */
	ibk_lock_t rlock; /* receive side log */
	struct ibk_sendlog slog;
	struct ibk_recvlog rlog;
	struct ibk_counters cnt;
	int nmods;
	struct ibv_qp_attr mods[IBK_MAX_MODS];
	int mod_masks[IBK_MAX_MODS];
	enum ibv_qp_state state;
	struct ibk_peer peer;
	int flag_outstanding;
	int releasing; /* the shim moved it to ERR: flushes stay in the logs */
	/* release's bookkeeping: once every logged WR has completed or been
	 * flushed, the QP's CQs will never report anything more for it */
	uint64_t rel_send_seen; /* seq + 1 of the newest flushed send */
	uint32_t rel_recvs_flushed;
	uint32_t slot;
	uint64_t flag_seq;
	uint32_t psn_base; /* replay PSN, same on both ends */
	struct ibv_qp_cap real_cap;
	int mods_overflow;
	int mods_done; /* replayed before the peers were known */
	int ece_set;   /* ibv_set_ece succeeded: a rebuilt QP would not get it */
};

struct ibk_ah {
	struct ibv_ah pub;
	struct ibk_obj obj;
	struct ibv_ah *real;
	struct ibk_pd *pd;
	struct ibv_ah_attr attr; /* as the app gave it (virtual) */
	/* the last UD QP sent to through this AH: after a rebuild that peer is
	 * looked up at once, so its datagrams show their virtual src_qp even
	 * before we send to it again */
	uint32_t last_qpn;
	int used;
};

void ibk_install_ops(struct ibk_ctx *ctx);
/* async.c: the app's async fd and the events from the real context */
int ibk_async_open(struct ibk_ctx *ctx);
void ibk_async_close(struct ibk_ctx *ctx);
int ibk_async_attach(struct ibk_ctx *ctx);
void ibk_async_detach(struct ibk_ctx *ctx);
void ibk_async_drain(struct ibk_ctx *ctx);
int ibk_ctx_read_port(struct ibk_ctx *ctx);
void ibk_ctx_remember_gids(struct ibk_ctx *ctx);
#define IBK_MAX_QPS 4096

/* ---- fast-path helpers shared between files ----------------------------- */

int ibk_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc);
int ibk_req_notify_cq(struct ibv_cq *cq, int solicited_only);
int ibk_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);
int ibk_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);
int ibk_post_srq_recv(struct ibv_srq *srq, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);

/* A context the shim made.  libibverbs and providers call the exported
 * verbs with real contexts too (rxe's create_ah queries a GID, libibverbs'
 * fallbacks query ports): those go straight to libibverbs. */
static inline int ibk_is_shadow(const struct ibv_context *c)
{
	return c->ops.post_send == ibk_post_send;
}
/* The post fast paths take no gate; quiesce closes them per QP (post.c). */
void ibk_qp_set_op_flags(struct ibk_qp *qp);
void ibk_qp_posts_close(struct ibk_qp *qp);
int ibk_qp_posts_busy(struct ibk_qp *qp);
void ibk_qp_posts_open(struct ibk_qp *qp);
struct ibv_qp *ibk_create_qp_ex(struct ibv_context *c, struct ibv_qp_init_attr_ex *attr);
/* qp_ex.c: the ibv_wr_* builder of a new extended QP, and its end */
int ibk_qpx_init(struct ibk_qp *qp);
void ibk_qpx_fini(struct ibk_qp *qp);
struct ibv_cq_ex *ibk_create_cq_ex(struct ibv_context *c, struct ibv_cq_init_attr_ex *attr);

/* Poll the real CQ of a shadow CQ once and translate into `wc`; returns
 * the number of app-visible completions (hidden flag ones dropped). */
int ibk_cq_poll_real(struct ibk_cq *cq, int n, struct ibv_wc *wc);
/* Move everything the real CQ holds into the private queue. */
int ibk_cq_drain_real(struct ibk_cq *cq);

/* Post one logged send/recv entry on the real QP (keys translated). */
int ibk_qp_post_logged_send(struct ibk_qp *qp, struct ibk_swr *e);
int ibk_qp_post_logged_recv(struct ibk_qp *qp, struct ibk_rwr *e);
int ibk_srq_post_logged_recv(struct ibk_srq *srq, struct ibk_rwr *e);
int ibk_qp_post_flag(struct ibk_qp *qp);
/* Apply an app-level modify to the real QP with virtual ids translated. */
int ibk_qp_modify_real(struct ibk_qp *qp, struct ibv_qp_attr *attr, int mask, int replay);

/* channel helpers */
int ibk_chan_push_event(struct ibk_chan *ch, struct ibk_cq *cq);
int ibk_chan_drain_real(struct ibk_chan *ch);

/* ---- control socket and library hooks ------------------------------------ */

/* Start this process's control socket and thread, once per process: a
 * fork child that opens a device starts its own (control.c). */
void ibk_control_ensure(void);
/* commands.c: the reply line ("ok <json>\n" or "err <json>\n") to one
 * command line, malloc'd; NULL without memory */
char *ibk_command_reply(const char *line, size_t *outlen);
/* Deferral by ibckpt.h callers; returns -EBUSY while a critical section
 * is open after the wait. */
int ibk_hooks_wait_critical(int timeout_ms);
void ibk_hooks_notify(int event);

#pragma GCC visibility pop

#endif
