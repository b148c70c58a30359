/* ibckpt.h for libraries that know more than the shim: critical sections
 * that defer a checkpoint, and callbacks at quiesce and resume. */
#include <errno.h>
#include <pthread.h>
#include <time.h>

#include "fork.h"
#include "ibckpt.h"
#include "shim.h"

static pthread_mutex_t hook_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hook_cond = PTHREAD_COND_INITIALIZER;
static int critical_open, checkpoint_pending;
static struct {
	ibckpt_event_cb cb;
	void *arg;
} hooks[8];
static int nhooks;

IBK_EXPORT int ibckpt_api_version(void)
{
	return IBCKPT_API_VERSION;
}

IBK_EXPORT void ibckpt_critical_enter(void)
{
	pthread_mutex_lock(&hook_lock);
	while (checkpoint_pending)
		pthread_cond_wait(&hook_cond, &hook_lock);
	critical_open++;
	pthread_mutex_unlock(&hook_lock);
}

IBK_EXPORT void ibckpt_critical_leave(void)
{
	pthread_mutex_lock(&hook_lock);
	if (critical_open > 0)
		critical_open--;
	pthread_cond_broadcast(&hook_cond);
	pthread_mutex_unlock(&hook_lock);
}

IBK_EXPORT int ibckpt_register_callback(ibckpt_event_cb cb, void *arg)
{
	int rc = -1;

	pthread_mutex_lock(&hook_lock);
	if (nhooks < 8) {
		hooks[nhooks].cb = cb;
		hooks[nhooks++].arg = arg;
		rc = 0;
	}
	pthread_mutex_unlock(&hook_lock);
	return rc;
}

int ibk_hooks_wait_critical(int timeout_ms)
{
	struct timespec ts;
	int rc = 0;

	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_sec += timeout_ms / 1000;
	ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
	if (ts.tv_nsec >= 1000000000) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000;
	}
	pthread_mutex_lock(&hook_lock);
	checkpoint_pending = 1;
	while (critical_open && rc == 0)
		rc = pthread_cond_timedwait(&hook_cond, &hook_lock, &ts);
	if (critical_open) {
		checkpoint_pending = 0;
		pthread_cond_broadcast(&hook_cond);
		rc = -EBUSY;
	} else {
		rc = 0;
	}
	pthread_mutex_unlock(&hook_lock);
	return rc;
}

void ibk_hooks_notify(int event)
{
	int i;

	pthread_mutex_lock(&hook_lock);
	if (event == IBCKPT_EV_RESUME) {
		checkpoint_pending = 0;
		pthread_cond_broadcast(&hook_cond);
	}
	for (i = 0; i < nhooks; i++)
		hooks[i].cb((enum ibckpt_event)event, hooks[i].arg);
	pthread_mutex_unlock(&hook_lock);
}

/* The parent's critical sections and checkpoint are not the child's; the
 * callbacks registered are code the child has too, and stay. */
void ibk_hooks_fork_child(void)
{
	pthread_mutex_init(&hook_lock, NULL);
	pthread_cond_init(&hook_cond, NULL);
	critical_open = 0;
	checkpoint_pending = 0;
}
