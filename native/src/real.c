/* Resolution of the real libibverbs entry points, plus the small shared
 * helpers: logging, the gate and the object lists. */
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

struct ibk_real ibk_real;
int ibk_verbose;
pthread_mutex_t ibk_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
struct ibk_ctx *ibk_ctx_list;

/* Ask for the version applications bind to by default.  The shim is linked
 * against libibverbs, so RTLD_NEXT sees it even when the program loaded it
 * privately (pyverbs, UCX). */
static void *real_sym(const char *name, const char *ver)
{
	void *p = ver ? dlvsym(RTLD_NEXT, name, ver) : NULL;

	if (!p)
		p = dlsym(RTLD_NEXT, name);
	if (!p) {
		fprintf(stderr, "libibckpt: cannot resolve real %s@%s: %s\n", name, ver ? ver : "default",
			dlerror());
		abort();
	}
	return p;
}

#define R(field, name, ver) *(void **)&ibk_real.field = real_sym(name, ver)

static pthread_once_t real_once = PTHREAD_ONCE_INIT;

static void real_resolve_once(void)
{
	const char *v = getenv("IBCKPT_VERBOSE");

	ibk_verbose = v && *v && *v != '0';
	R(get_device_list, "ibv_get_device_list", "IBVERBS_1.1");
	R(free_device_list, "ibv_free_device_list", "IBVERBS_1.1");
	R(get_device_name, "ibv_get_device_name", "IBVERBS_1.1");
	R(open_device, "ibv_open_device", "IBVERBS_1.1");
	R(close_device, "ibv_close_device", "IBVERBS_1.1");
	R(query_device, "ibv_query_device", "IBVERBS_1.1");
	R(query_port, "ibv_query_port", "IBVERBS_1.1");
	R(query_gid, "ibv_query_gid", "IBVERBS_1.1");
	R(query_pkey, "ibv_query_pkey", "IBVERBS_1.1");
	R(get_pkey_index, "ibv_get_pkey_index", "IBVERBS_1.5");
	R(query_gid_ex, "_ibv_query_gid_ex", "IBVERBS_1.11");
	R(query_gid_table, "_ibv_query_gid_table", "IBVERBS_1.11");
	R(alloc_pd, "ibv_alloc_pd", "IBVERBS_1.1");
	R(dealloc_pd, "ibv_dealloc_pd", "IBVERBS_1.1");
	R(reg_mr, "ibv_reg_mr", "IBVERBS_1.1");
	R(reg_mr_iova2, "ibv_reg_mr_iova2", "IBVERBS_1.8");
	R(dereg_mr, "ibv_dereg_mr", "IBVERBS_1.1");
	R(create_comp_channel, "ibv_create_comp_channel", "IBVERBS_1.0");
	R(destroy_comp_channel, "ibv_destroy_comp_channel", "IBVERBS_1.0");
	R(create_cq, "ibv_create_cq", "IBVERBS_1.1");
	R(destroy_cq, "ibv_destroy_cq", "IBVERBS_1.1");
	R(get_cq_event, "ibv_get_cq_event", "IBVERBS_1.1");
	R(ack_cq_events, "ibv_ack_cq_events", "IBVERBS_1.1");
	R(create_qp, "ibv_create_qp", "IBVERBS_1.1");
	R(modify_qp, "ibv_modify_qp", "IBVERBS_1.1");
	R(query_qp, "ibv_query_qp", "IBVERBS_1.1");
	R(destroy_qp, "ibv_destroy_qp", "IBVERBS_1.1");
	R(create_srq, "ibv_create_srq", "IBVERBS_1.1");
	R(modify_srq, "ibv_modify_srq", "IBVERBS_1.1");
	R(query_srq, "ibv_query_srq", "IBVERBS_1.1");
	R(destroy_srq, "ibv_destroy_srq", "IBVERBS_1.1");
	R(create_ah, "ibv_create_ah", "IBVERBS_1.1");
	R(destroy_ah, "ibv_destroy_ah", "IBVERBS_1.1");
	/* newer than the rest: absent from libibverbs before rdma-core 35 */
	*(void **)&ibk_real.query_qp_data_in_order = dlvsym(RTLD_NEXT, "ibv_query_qp_data_in_order", "IBVERBS_1.14");
	R(resize_cq, "ibv_resize_cq", "IBVERBS_1.1");
	R(rereg_mr, "ibv_rereg_mr", "IBVERBS_1.1");
	R(init_ah_from_wc, "ibv_init_ah_from_wc", "IBVERBS_1.1");
	R(create_ah_from_wc, "ibv_create_ah_from_wc", "IBVERBS_1.1");
	R(resolve_eth_l2_from_gid, "ibv_resolve_eth_l2_from_gid", "IBVERBS_1.1");
	*(void **)&ibk_real.query_ece = dlvsym(RTLD_NEXT, "ibv_query_ece", "IBVERBS_1.10");
	*(void **)&ibk_real.set_ece = dlvsym(RTLD_NEXT, "ibv_set_ece", "IBVERBS_1.10");
	/* private to rdma-core: its version name follows the provider ABI */
	*(void **)&ibk_real.query_gid_type = real_sym("ibv_query_gid_type", NULL);
}

void ibk_real_resolve(void)
{
	pthread_once(&real_once, real_resolve_once);
}

void ibk_log(const char *fmt, ...)
{
	char buf[512];
	va_list ap;
	int n;

	n = snprintf(buf, sizeof(buf), "libibckpt[%d]: ", (int)getpid());
	va_start(ap, fmt);
	vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
	va_end(ap);
	fprintf(stderr, "%s\n", buf);
}

/* The distinct verbs refused so far, for the status report (the agent's preflight). */
static const char *refused[IBK_MAX_REFUSED];
static int nrefused;
static pthread_mutex_t refused_lock = PTHREAD_MUTEX_INITIALIZER;

void ibk_unsupported(const char *verb)
{
	int i;

	ibk_log("%s is not supported under checkpointing (libibckpt); failing with EOPNOTSUPP", verb);
	pthread_mutex_lock(&refused_lock);
	for (i = 0; i < nrefused && strcmp(refused[i], verb); i++)
		;
	if (i == nrefused && nrefused < IBK_MAX_REFUSED)
		refused[nrefused++] = verb;
	pthread_mutex_unlock(&refused_lock);
	errno = EOPNOTSUPP;
}

int ibk_refused_verbs(const char **out, int max)
{
	int i, n;

	pthread_mutex_lock(&refused_lock);
	n = nrefused < max ? nrefused : max;
	for (i = 0; i < n; i++)
		out[i] = refused[i];
	pthread_mutex_unlock(&refused_lock);
	return n;
}

/* ---- gate ---------------------------------------------------------------- */

atomic_long ibk_gate;
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cond = PTHREAD_COND_INITIALIZER;

/* Slow path of ibk_enter: step back out, sleep until the gate opens. */
void ibk_gate_wait(void)
{
	for (;;) {
		atomic_fetch_sub(&ibk_gate, 1);
		pthread_mutex_lock(&gate_lock);
		while (atomic_load(&ibk_gate) < 0)
			pthread_cond_wait(&gate_cond, &gate_lock);
		pthread_mutex_unlock(&gate_lock);
		if (atomic_fetch_add(&ibk_gate, 1) >= 0)
			return;
	}
}

static long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int ibk_gate_close(int timeout_ms)
{
	long deadline = now_ms() + timeout_ms;
	useconds_t nap = 50;

	pthread_mutex_lock(&gate_lock);
	atomic_fetch_or(&ibk_gate, IBK_GATE_CLOSED);
	pthread_mutex_unlock(&gate_lock);
	/* The threads still inside must get the CPU to leave: a boosted control
	 * thread that woke every 200 us starved them on a busy core. */
	while (ibk_gate_inside() > 0) {
		if (now_ms() > deadline)
			return -ETIMEDOUT;
		usleep(nap);
		nap = nap < 2000 ? nap * 2 : 2000;
	}
	return 0;
}

void ibk_gate_open(void)
{
	pthread_mutex_lock(&gate_lock);
	atomic_fetch_and(&ibk_gate, LONG_MAX);
	pthread_cond_broadcast(&gate_cond);
	pthread_mutex_unlock(&gate_lock);
}

/* ---- object lists ---------------------------------------------------------- */

void ibk_obj_add(struct ibk_ctx *ctx, struct ibk_obj *o, enum ibk_kind kind)
{
	o->kind = kind;
	o->ctx = ctx;
	pthread_mutex_lock(&ctx->lock);
	o->prev = ctx->head.prev;
	o->next = &ctx->head;
	ctx->head.prev->next = o;
	ctx->head.prev = o;
	pthread_mutex_unlock(&ctx->lock);
}

void ibk_obj_del(struct ibk_ctx *ctx, struct ibk_obj *o)
{
	pthread_mutex_lock(&ctx->lock);
	o->prev->next = o->next;
	o->next->prev = o->prev;
	pthread_mutex_unlock(&ctx->lock);
}
