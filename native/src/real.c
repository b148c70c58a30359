/* Resolution of the real libibverbs entry points, once, with dlvsym. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "diag.h"
#include "real.h"

struct ibk_real ibk_real;

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
	R(get_async_event, "ibv_get_async_event", "IBVERBS_1.1");
	R(ack_async_event, "ibv_ack_async_event", "IBVERBS_1.1");
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
