/* The real libibverbs entry points the shim calls on (real.c). */
#ifndef IBK_REAL_H
#define IBK_REAL_H

#include <infiniband/verbs.h>

#pragma GCC visibility push(hidden)

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
	int (*get_async_event)(struct ibv_context *, struct ibv_async_event *);
	void (*ack_async_event)(struct ibv_async_event *);
};

extern struct ibk_real ibk_real;
void ibk_real_resolve(void);

#pragma GCC visibility pop

#endif
