/* Exported verbs with no shadow state of their own: forwarded with the real
 * object, or refused because they would hand the app a real object or
 * share one with another process. */
#include <errno.h>

#include "shim.h"

IBK_EXPORT int ibv_query_qp_data_in_order(struct ibv_qp *q, enum ibv_wr_opcode op, uint32_t flags)
{
	struct ibk_qp *qp = (struct ibk_qp *)q;
	int rc;

	if (!ibk_real.query_qp_data_in_order)
		return 0; /* what libibverbs answers where it cannot tell */
	ibk_enter();
	rc = ibk_real.query_qp_data_in_order(qp->real, op, flags);
	ibk_leave();
	return rc;
}

/* Imports share one object between processes: a checkpoint of one could
 * not recreate what the other holds. */
IBK_REFUSED(IBK_EXPORT struct ibv_context *ibv_import_device(int cmd_fd),
	    "ibv_import_device", NULL, (void)cmd_fd)

IBK_REFUSED(IBK_EXPORT struct ibv_dm *ibv_import_dm(struct ibv_context *c, uint32_t handle),
	    "ibv_import_dm", NULL, (void)c, (void)handle)

/* Nothing can have been imported: the imports above and in pd_mr.c fail. */
IBK_EXPORT void ibv_unimport_pd(struct ibv_pd *pd)
{
	(void)pd;
	ibk_unsupported("ibv_unimport_pd");
}

IBK_EXPORT void ibv_unimport_mr(struct ibv_mr *mr)
{
	(void)mr;
	ibk_unsupported("ibv_unimport_mr");
}

IBK_EXPORT void ibv_unimport_dm(struct ibv_dm *dm)
{
	(void)dm;
	ibk_unsupported("ibv_unimport_dm");
}
