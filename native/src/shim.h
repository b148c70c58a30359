/* Internal declarations of libibckpt: shadow objects, the real-verbs table,
 * the gate and the phases. */
#ifndef IBK_SHIM_H
#define IBK_SHIM_H

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>

#include "core.h"
#include "lock.h"
#include "phase.h"
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

/* ---- the device thread (devthread.c) ------------------------------------ */

/* Run fn(arg) on the shim's device thread and return its result. */
void *ibk_devthread_call(void *(*fn)(void *), void *arg);
/* Open a device on the device thread and track its command fd. */
struct ibv_context *ibk_devthread_open(struct ibv_device *dev);
void ibk_devfd_track(int fd);
void ibk_devfd_forget(int fd);
/* Writes other threads handed to the device thread (after a CRIU restore). */
unsigned long ibk_devthread_writes(void);

/* write() as libc does it, with the device thread's hand-over after a
 * restore; the shim's write() (write.c) adds the rdma_cm routing
 * (rdmacm.c) on top. */
ssize_t ibk_write_real(int fd, const void *buf, size_t n);
/* For write()'s fast path: libc's write once resolved (NULL before), and 2
 * once a device fd is tracked, so that a write may need handing over. */
typedef ssize_t (*ibk_write_fn)(int, const void *, size_t);
extern _Atomic(ibk_write_fn) ibk_libc_write;
extern _Atomic int ibk_devfds_ready;

/* ---- librdmacm's event channels (rdmacm.c) ------------------------------ */

/* Set once a channel is followed: from then on write() asks ibk_cm_write. */
extern atomic_int ibk_cm_active;
/* A write on an app's event channel fd: 1 and *rc when it was one. */
int ibk_cm_write(int fd, const void *buf, size_t n, ssize_t *rc);
void ibk_cm_wake_all(int on);
int ibk_cm_drain(void);
int ibk_cm_release(void);
void ibk_cm_report(char *out, size_t len);
void ibk_cm_report_problems(char *out, size_t len, int *n);

/* ---- the real libibverbs, resolved once with dlvsym(RTLD_NEXT) --------- */

struct ibk_real {
	struct ibv_device **(*get_device_list)(int *);
	void (*free_device_list)(struct ibv_device **);
	const char *(*get_device_name)(struct ibv_device *);
	struct ibv_context *(*open_device)(struct ibv_device *);
	int (*close_device)(struct ibv_context *);
	int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
	int (*query_port)(struct ibv_context *, uint8_t, struct _compat_ibv_port_attr *);
	int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
	int (*query_pkey)(struct ibv_context *, uint8_t, int, __be16 *);
	int (*get_pkey_index)(struct ibv_context *, uint8_t, __be16);
	int (*query_gid_ex)(struct ibv_context *, uint32_t, uint32_t, struct ibv_gid_entry *, uint32_t,
			    size_t);
	ssize_t (*query_gid_table)(struct ibv_context *, struct ibv_gid_entry *, size_t, uint32_t, size_t);
	struct ibv_pd *(*alloc_pd)(struct ibv_context *);
	int (*dealloc_pd)(struct ibv_pd *);
	struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
	struct ibv_mr *(*reg_mr_iova2)(struct ibv_pd *, void *, size_t, uint64_t, unsigned int);
	int (*dereg_mr)(struct ibv_mr *);
	struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *);
	int (*destroy_comp_channel)(struct ibv_comp_channel *);
	struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
	int (*destroy_cq)(struct ibv_cq *);
	int (*get_cq_event)(struct ibv_comp_channel *, struct ibv_cq **, void **);
	void (*ack_cq_events)(struct ibv_cq *, unsigned int);
	struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
	int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
	int (*query_qp)(struct ibv_qp *, struct ibv_qp_attr *, int, struct ibv_qp_init_attr *);
	int (*destroy_qp)(struct ibv_qp *);
	struct ibv_srq *(*create_srq)(struct ibv_pd *, struct ibv_srq_init_attr *);
	int (*modify_srq)(struct ibv_srq *, struct ibv_srq_attr *, int);
	int (*query_srq)(struct ibv_srq *, struct ibv_srq_attr *);
	int (*destroy_srq)(struct ibv_srq *);
	struct ibv_ah *(*create_ah)(struct ibv_pd *, struct ibv_ah_attr *);
	int (*destroy_ah)(struct ibv_ah *);
	/* the type is an enum of rdma-core's driver.h, which is not installed: an int */
	int (*query_gid_type)(struct ibv_context *, uint8_t, unsigned int, int *);
	int (*query_qp_data_in_order)(struct ibv_qp *, enum ibv_wr_opcode, uint32_t);
	int (*resize_cq)(struct ibv_cq *, int);
	int (*rereg_mr)(struct ibv_mr *, int, struct ibv_pd *, void *, size_t, int);
	int (*init_ah_from_wc)(struct ibv_context *, uint8_t, struct ibv_wc *, struct ibv_grh *,
			       struct ibv_ah_attr *);
	struct ibv_ah *(*create_ah_from_wc)(struct ibv_pd *, struct ibv_wc *, struct ibv_grh *, uint8_t);
	int (*resolve_eth_l2_from_gid)(struct ibv_context *, struct ibv_ah_attr *, uint8_t *, uint16_t *);
	int (*query_ece)(struct ibv_qp *, struct ibv_ece *);
	int (*set_ece)(struct ibv_qp *, struct ibv_ece *);
};

extern struct ibk_real ibk_real;
void ibk_real_resolve(void);

/* ---- logging ----------------------------------------------------------- */

extern int ibk_verbose;
void ibk_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* A verb the shim does not support: say so on stderr, every time. */
void ibk_unsupported(const char *verb);
/* The distinct verbs ibk_unsupported refused (string literals), at most max. */
#define IBK_MAX_REFUSED 32
/* The shim's thread names (15 chars max): the node agent looks them up in
 * /proc, and a thread inherits its creator's name unless it sets its own. */
#define IBK_CONTROL_THREAD_NAME "ibk-control"
#define IBK_DEVICE_THREAD_NAME "ibk-device"
#define IBK_RELEASE_THREAD_NAME "ibk-release"
#define IBK_LEASE_THREAD_NAME "ibk-lease"
/* drain: no completion for this long with only settleable sends left ends
 * it (the control protocol's drain takes another value) */
#define IBK_DRAIN_STALL_MS 20
int ibk_refused_verbs(const char **out, int max);
#define IBK_DBG(...)                          \
	do {                                  \
		if (ibk_verbose)              \
			ibk_log(__VA_ARGS__); \
	} while (0)

/* ---- the gate ---------------------------------------------------------- */

/* One word: the sign bit says closed, the rest counts threads inside.  One
 * locked RMW both enters and sees the state: the close (an RMW on the same
 * word) is either ordered before it (we see the bit and step back out) or
 * after it (ibk_gate_close sees us counted and waits for ibk_leave). */
#define IBK_GATE_CLOSED LONG_MIN
extern atomic_long ibk_gate;
void ibk_gate_wait(void);
int ibk_gate_close(int timeout_ms);
void ibk_gate_open(void);

static inline long ibk_gate_inside(void)
{
	return atomic_load(&ibk_gate) & LONG_MAX;
}

static inline int ibk_gate_is_closed(void)
{
	return atomic_load(&ibk_gate) < 0;
}

static inline void ibk_enter(void)
{
	if (__builtin_expect(atomic_fetch_add(&ibk_gate, 1) < 0, 0))
		ibk_gate_wait();
}

static inline void ibk_leave(void)
{
	atomic_fetch_sub_explicit(&ibk_gate, 1, memory_order_release);
}

/* The compiler must assume x changed: addresses derived from it are then
 * recomputed after a call instead of kept in a saved register. */
#define IBK_FORGET(x) __asm__("" : "+r"(x))

/* ---- shadow objects ------------------------------------------------------ */

enum ibk_kind { IBK_PD = 1, IBK_MR, IBK_CHAN, IBK_CQ, IBK_SRQ, IBK_QP, IBK_AH, IBK_MW };

/* Every shadow object sits on its context's list in creation order: rebuild
 * walks it forwards (PD before MR, CQ before QP), release backwards.  An
 * object joins and leaves the list inside the gate, with its real object, so
 * a phase never finds one without the other. */
struct ibk_obj {
	struct ibk_obj *next, *prev;
	enum ibk_kind kind;
	struct ibk_ctx *ctx;
};

#define IBK_PAST_GIDS 8

struct ibk_ctx {
	struct verbs_context vctx; /* the app holds &vctx.context */
	struct ibv_context *real;
	struct ibv_device *dev;
	char dev_name[IBV_SYSFS_NAME_MAX];
	pthread_mutex_t lock; /* object list and id tables */
	struct ibk_obj head;  /* circular list sentinel */
	struct ibk_idmap lkeys; /* virtual lkey -> real lkey */
	struct ibk_idmap rkeys; /* virtual rkey -> real rkey, published to peers */
	struct ibk_idmap qpns;  /* virtual qpn -> real qpn, own QPs */
	struct ibk_idmap rqpns; /* real qpn -> index into qp_slots, for SRQ completions */
	struct ibk_qp **qp_slots;
	int translate;         /* 0 while every virtual id equals its real id */
	int async_fd;          /* placeholder the app may poll: never readable */
	uint8_t port_gid_valid;
	union ibv_gid vgid[4];  /* virtual GID per index (port 1), fixed at open */
	union ibv_gid rgid[4];  /* current real GID per index */
	/* Real GIDs of earlier incarnations and their index, newest first: a
	 * datagram received before a rebuild names them in its GRH. */
	struct {
		union ibv_gid gid;
		uint8_t index;
	} past[IBK_PAST_GIDS];
	uint8_t npast;
	uint16_t vlid, rlid;
	struct ibk_ctx *next_ctx;
};

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

#define IBK_OBJ(p, type) ((struct type *)((char *)(p) - offsetof(struct type, obj)))

static inline struct ibk_ctx *ibk_ctx_of(struct ibv_context *c)
{
	return (struct ibk_ctx *)((char *)c - offsetof(struct ibk_ctx, vctx.context));
}

void ibk_obj_add(struct ibk_ctx *ctx, struct ibk_obj *o, enum ibk_kind kind);
void ibk_obj_del(struct ibk_ctx *ctx, struct ibk_obj *o);
void ibk_install_ops(struct ibk_ctx *ctx);
int ibk_ctx_read_port(struct ibk_ctx *ctx);
void ibk_ctx_remember_gids(struct ibk_ctx *ctx);
#define IBK_MAX_QPS 4096

/* Peers known by their virtual ids, learnt from the coordinator. */
struct ibk_peer_map {
	union ibv_gid vgid, rgid;
	union ibv_gid prev_rgid; /* its real GID in the record before (ibk_peers_put keeps it) */
	uint32_t vqpn, rqpn;
	uint16_t vlid, rlid;
	uint64_t epoch; /* the rebuild whose record this is */
};
int ibk_peers_lookup(const union ibv_gid *vgid, uint32_t vqpn, struct ibk_peer_map *out);
int ibk_peers_lookup_gid(const union ibv_gid *vgid, union ibv_gid *rgid);
int ibk_peers_reverse_qpn(uint32_t rqpn, uint32_t *vqpn);
/* past: match the real GID a peer had before its latest record instead */
int ibk_peers_reverse_gid(const union ibv_gid *rgid, uint32_t vqpn, int past, union ibv_gid *vgid);
void ibk_peers_put(const struct ibk_peer_map *p);
/* After a rebuild: take every cached peer not yet learnt in this epoch from
 * its new record; a peer that publishes none in time is forgotten. */
void ibk_peers_refresh(uint64_t epoch, int timeout_ms);
/* Fetch one peer's latest mapping from the coordinator (slow path). */
int ibk_peers_fetch(const union ibv_gid *vgid, uint32_t vqpn, int timeout_ms);
extern atomic_int ibk_translating; /* set after the first rebuild anywhere in this process */
/* Set (inside the gate's closed phases or under ctx->lock) before any
 * ctx->translate or peer.rkeys_translate turns on: while it is 0 the post
 * fast paths skip all of them with one load.  Read with the QP's post lock
 * held: a rebuild sets it before the posts reopen, so a post that takes the
 * lock after that sees it. */
extern atomic_int ibk_xlate_any;

/* the global list of shadow contexts */
extern pthread_mutex_t ibk_ctx_lock;
extern struct ibk_ctx *ibk_ctx_list;

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
int ibk_qpx_init(struct ibk_qp *qp, uint64_t send_ops_flags);
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

/* ---- phases -------------------------------------------------------------- */

/* Each phase writes a one-line JSON report into out. 0 on success. */
int ibk_do_quiesce(int timeout_ms, char *out, size_t len);
int ibk_do_drain(int timeout_ms, int stall_ms, char *out, size_t len);
int ibk_do_release(int timeout_ms, int quiet_only, char *out, size_t len);
int ibk_do_rebuild(uint64_t epoch, int timeout_ms, char *out, size_t len);
int ibk_do_resume(char *out, size_t len);
int ibk_do_abort(char *out, size_t len);

/* ---- the lease (lease.c), all under ibk_cmd_lock ------------------------- */

/* held by each command (commands.c) and by the lease watchdog */
extern pthread_mutex_t ibk_cmd_lock;
int ibk_do_lease(long ms, char *out, size_t len);
/* quiesce succeeded: the default lease (IBCKPT_LEASE_MS, else 60 s) starts */
void ibk_lease_quiesced(void);
void ibk_lease_after_command(long t0, enum ibk_phase before);
/* "lease_ms":N,"lease_left_ms":N, for status */
void ibk_lease_report(char *out, size_t len);

/* ---- coordinator client -------------------------------------------------- */

int ibk_coord_configured(void);
/* Wait up to timeout_ms for key; 0 and the value on success. */
int ibk_coord_get(const char *key, char *val, size_t len, int timeout_ms);
/* PUTs gathered, then sent on one connection: one round trip instead of one
 * per record (a rebuild publishes two per QP and GID). */
struct ibk_coord_batch {
	char *buf;
	size_t len, cap;
	int n; /* requests gathered */
};
int ibk_coord_batch_put(struct ibk_coord_batch *b, const char *key, const char *val);
/* Sends the batch, waits up to timeout_ms for every OK, and frees it. */
int ibk_coord_batch_send(struct ibk_coord_batch *b, int timeout_ms);

/* ---- control socket and library hooks ------------------------------------ */

void ibk_control_start(void);
/* commands.c: the reply line ("ok <json>\n" or "err <json>\n") to one
 * command line, malloc'd; NULL without memory */
char *ibk_command_reply(const char *line, size_t *outlen);
/* Deferral by ibckpt.h callers; returns -EBUSY while a critical section
 * is open after the wait. */
int ibk_hooks_wait_critical(int timeout_ms);
void ibk_hooks_notify(int event);


#pragma GCC visibility pop

#endif
