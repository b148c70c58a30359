/* The gate's phases: quiesce closes the gate and every QP's posts, resume
 * and abort open them again. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ibckpt.h"
#include "phases.h"

/* The post fast paths take no gate, so closing the gate is not enough:
 * close every QP's posts too, and wait until no post that got in before
 * still holds a QP lock.  Returns how many QPs are still busy (0: closed). */
static long posts_close(long deadline)
{
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	struct ibk_qp *qp;
	useconds_t nap = 50;
	long busy;

	pthread_mutex_lock(&ibk_ctx_lock);
	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	ibk_qp_posts_close(qp);
	for (;;) {
		busy = 0;
		FOR_EACH_CTX(ctx)
		FOR_EACH_QP(ctx, o, qp)
		busy += ibk_qp_posts_busy(qp) != 0;
		if (!busy || ibk_ms_now() > deadline)
			break;
		usleep(nap);
		nap = nap < 2000 ? nap * 2 : 2000;
	}
	pthread_mutex_unlock(&ibk_ctx_lock);
	return busy;
}

void ibk_posts_open(void)
{
	struct ibk_ctx *ctx;
	struct ibk_obj *o;
	struct ibk_qp *qp;

	pthread_mutex_lock(&ibk_ctx_lock);
	FOR_EACH_CTX(ctx)
	FOR_EACH_QP(ctx, o, qp)
	ibk_qp_posts_open(qp);
	pthread_mutex_unlock(&ibk_ctx_lock);
}

int ibk_do_quiesce(int timeout_ms, char *out, size_t len)
{
	long t0 = ibk_ms_now(), inside = 0, busy = 0;
	int rc;

	if (ibk_phase_cur != IBK_RUNNING) {
		ibk_report_begin(out, len, "quiesce", 0, t0);
		ibk_jcat(out, len, ",\"error\":\"not running\"}");
		return -EINVAL;
	}
	rc = ibk_hooks_wait_critical(timeout_ms);
	if (rc) {
		ibk_report_begin(out, len, "quiesce", 0, t0);
		ibk_jcat(out, len, ",\"error\":\"a library critical section stayed open\"}");
		return rc;
	}
	ibk_hooks_notify(IBCKPT_EV_QUIESCE);
	ibk_chan_wake_all(1); /* threads blocked in ibv_get_cq_event come back to the gate */
	rc = ibk_gate_close(timeout_ms - (int)(ibk_ms_now() - t0));
	if (rc) {
		inside = ibk_gate_inside();
	} else {
		busy = posts_close(t0 + timeout_ms);
		if (busy) {
			ibk_posts_open();
			rc = -ETIMEDOUT;
		}
	}
	if (rc) {
		ibk_gate_open();
		ibk_chan_wake_all(0);
		ibk_hooks_notify(IBCKPT_EV_RESUME);
		ibk_report_begin(out, len, "quiesce", 0, t0);
		if (busy)
			ibk_jcat(out, len, ",\"error\":\"threads still inside a post\",\"posting_qps\":%ld}", busy);
		else
			ibk_jcat(out, len, ",\"error\":\"threads still inside verbs\",\"inside\":%ld}", inside);
		return rc;
	}
	ibk_phase_cur = IBK_QUIESCED;
	/* the counters at the cut show what was in flight when the gate closed */
	ibk_report_begin(out, len, "quiesce", 1, t0);
	ibk_jcat(out, len, ",");
	pthread_mutex_lock(&ibk_ctx_lock);
	ibk_report_qps(out, len);
	pthread_mutex_unlock(&ibk_ctx_lock);
	ibk_jcat(out, len, "}");
	return 0;
}

int ibk_do_resume(char *out, size_t len)
{
	long t0 = ibk_ms_now();

	if (ibk_phase_cur != IBK_REBUILT && ibk_phase_cur != IBK_QUIESCED && ibk_phase_cur != IBK_DRAINED) {
		ibk_report_begin(out, len, "resume", 0, t0);
		ibk_jcat(out, len, ",\"error\":\"nothing to resume from\"}");
		return -EINVAL;
	}
	if (ibk_phase_cur == IBK_REBUILT)
		ibk_checkpoints_done++;
	ibk_phase_cur = IBK_RUNNING;
	ibk_chan_wake_all(0);
	ibk_gate_open();
	ibk_posts_open();
	ibk_hooks_notify(IBCKPT_EV_RESUME);
	ibk_report_begin(out, len, "resume", 1, t0);
	ibk_jcat(out, len, "}");
	return 0;
}

int ibk_do_abort(char *out, size_t len)
{
	char tmp[256];

	if (ibk_phase_cur == IBK_RELEASED) {
		/* the resources are gone: only a rebuild (with the peers) helps */
		snprintf(out, len, "{\"phase\":\"abort\",\"ok\":false,\"state\":\"released\","
				   "\"error\":\"released: send rebuild, then resume\"}");
		return -EINVAL;
	}
	if (ibk_phase_cur != IBK_RUNNING && ibk_do_resume(tmp, sizeof(tmp))) {
		snprintf(out, len, "{\"phase\":\"abort\",\"ok\":false,\"error\":\"resume failed\"}");
		return -EINVAL;
	}
	snprintf(out, len, "{\"phase\":\"abort\",\"ok\":true,\"state\":\"running\"}");
	return 0;
}
