/* The shim across fork() (docs/native-shim.md, "fork and exec").
 *
 * A child is a process of its own: the shim's threads (control, device,
 * lease) do not exist in it, and it makes its own control socket and
 * threads when it first opens a device or an rdma_cm event channel; a child
 * that uses no verbs gets nothing.  The verbs objects and rdma_cm channels
 * it inherited are the parent's: its own checkpoints never touch them.
 *
 * Before the copy this thread takes the locks whose data the child goes on
 * using, so that no other thread is half-way through it: the commands' lock
 * first (no command or lease action is copied mid-way; it waits for the one
 * running, which is bounded), then the object lists.  Locks nobody can hold
 * across a fork for long are made new in the child instead. */
#include <pthread.h>

#include "fork.h"
#include "lease.h"
#include "objs.h"

static void before_fork(void)
{
	pthread_mutex_lock(&ibk_cmd_lock);
	pthread_mutex_lock(&ibk_ctx_lock);
	ibk_ctxs_fork_lock();
	ibk_cm_fork_lock();
	ibk_devthread_fork_lock();
}

static void parent_after_fork(void)
{
	ibk_devthread_fork_parent();
	ibk_cm_fork_unlock();
	ibk_ctxs_fork_unlock();
	pthread_mutex_unlock(&ibk_ctx_lock);
	pthread_mutex_unlock(&ibk_cmd_lock);
}

/* The child has one thread, this one, which holds what before_fork took. */
static void child_after_fork(void)
{
	ibk_devthread_fork_child();
	ibk_cm_fork_unlock();
	ibk_cm_fork_child();
	ibk_ctxs_fork_unlock();
	ibk_ctxs_fork_child();
	pthread_mutex_unlock(&ibk_ctx_lock);
	ibk_gate_fork_child();
	ibk_phase_fork_child();
	ibk_lease_fork_child();
	ibk_hooks_fork_child();
	ibk_refused_fork_child();
	ibk_peers_fork_child();
	ibk_control_fork_child();
	pthread_mutex_unlock(&ibk_cmd_lock);
}

__attribute__((constructor)) static void fork_handlers_at_load(void)
{
	pthread_atfork(before_fork, parent_after_fork, child_after_fork);
}
