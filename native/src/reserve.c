/* reserve <qpn> [count]: virtual QPNs this process must not hand out.
 *
 * Processes restored from one node share its virtual GID, and a peer finds
 * a QP by (virtual GID, virtual QPN).  A QP made after a rebuild takes its
 * real QPN as its virtual one (so peers reach it with no record), and that
 * real QPN may be one a sibling restored beside it still holds virtually.
 * Before each rebuild the node agent reserves, in every rank, the virtual
 * QPNs of the other ranks it rebuilds that share one of its virtual GIDs
 * (runtime-hook/ibckpt_node/qpn_reserve.py); qp.c then asks the device for
 * another QPN.  `reserve 0` empties the set (QPN 0 is never a QP of ours):
 * the agent sends it first, so each rebuild's set replaces the last, and a
 * session that ends before its rebuild keeps the set of the one before. */
#include <errno.h>
#include <pthread.h>

#include "phases.h"
#include "reserve.h"

#define MAX_RESERVE_RUN 65536	/* QPNs one command may name */
#define MAX_RESERVED (1u << 20) /* in all: far more than a node's ranks hold */

static pthread_mutex_t reserve_lock = PTHREAD_MUTEX_INITIALIZER;
static struct ibk_idmap reserved; /* zeroed: holds nothing */

int ibk_do_reserve(unsigned long long first, long count, char *out, size_t len)
{
	long t0 = ibk_ms_now(), i;
	int rc = 0;

	if (first == 0) {
		ibk_reserve_clear();
		ibk_report_begin(out, len, "reserve", 1, t0);
		ibk_jcat(out, len, ",\"reserved_qpns\":0}");
		return 0;
	}
	if (first > 0xffffffULL || count < 1 || count > MAX_RESERVE_RUN ||
	    first + (unsigned long long)count - 1 > 0xffffffULL) {
		ibk_report_begin(out, len, "reserve", 0, t0);
		ibk_jcat(out, len, ",\"error\":\"reserve takes a QPN 1..0xffffff (0 empties the set) and a count 1..%d within it\"}",
			 MAX_RESERVE_RUN);
		return -EINVAL;
	}
	pthread_mutex_lock(&reserve_lock);
	if (reserved.live + (size_t)count > MAX_RESERVED)
		rc = -E2BIG;
	for (i = 0; !rc && i < count; i++)
		rc = ibk_idmap_put(&reserved, (uint32_t)(first + (unsigned long long)i), 0);
	ibk_report_begin(out, len, "reserve", !rc, t0);
	if (rc)
		ibk_jcat(out, len, ",\"error\":\"%s\"", rc == -E2BIG ? "more QPNs than a rank may reserve"
								 : "out of memory");
	ibk_jcat(out, len, ",\"reserved_qpns\":%zu}", reserved.live);
	pthread_mutex_unlock(&reserve_lock);
	return rc;
}

void ibk_reserve_clear(void)
{
	pthread_mutex_lock(&reserve_lock);
	ibk_idmap_fini(&reserved);
	reserved.live = reserved.filled = 0;
	pthread_mutex_unlock(&reserve_lock);
}

size_t ibk_reserve_count(void)
{
	size_t n;

	pthread_mutex_lock(&reserve_lock);
	n = reserved.live;
	pthread_mutex_unlock(&reserve_lock);
	return n;
}

int ibk_reserve_taken(const struct ibk_idmap *own, uint32_t qpn)
{
	int taken;

	pthread_mutex_lock(&reserve_lock);
	taken = ibk_qpn_taken(own, &reserved, qpn);
	pthread_mutex_unlock(&reserve_lock);
	return taken;
}

uint32_t ibk_reserve_choose(const struct ibk_idmap *own, uint32_t real)
{
	uint32_t v;

	pthread_mutex_lock(&reserve_lock);
	v = ibk_qpn_choose(own, &reserved, real);
	pthread_mutex_unlock(&reserve_lock);
	return v;
}
