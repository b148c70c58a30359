/* The shim across fork() (fork.c): what each part does in the child, and
 * the locks it holds across the copy of the address space. */
#ifndef IBK_FORK_H
#define IBK_FORK_H

#pragma GCC visibility push(hidden)

/* objs.c: every context's object lock, under ibk_ctx_lock (taken by fork.c) */
void ibk_ctxs_fork_lock(void);
void ibk_ctxs_fork_unlock(void);
/* objs.c, in the child: the contexts so far are the parent's */
void ibk_ctxs_fork_child(void);
/* rdmacm.c: the channel list and each channel's lock; in the child the
 * channels so far are the parent's */
void ibk_cm_fork_lock(void);
void ibk_cm_fork_unlock(void);
void ibk_cm_fork_child(void);
/* devthread.c: the queue's lock; the child has no device thread */
void ibk_devthread_fork_lock(void);
void ibk_devthread_fork_parent(void);
void ibk_devthread_fork_child(void);
/* In the child: the gate open with nobody inside (gate.c), running (phase.c),
 * no lease (lease.c), no critical section or pending checkpoint (api.c), no
 * refusals of its own yet (diag.c), the peer table's lock free (coord.c),
 * and no control socket until it uses verbs (control.c). */
void ibk_gate_fork_child(void);
void ibk_phase_fork_child(void);
void ibk_lease_fork_child(void);
void ibk_hooks_fork_child(void);
void ibk_refused_fork_child(void);
void ibk_peers_fork_child(void);
void ibk_control_fork_child(void);

#pragma GCC visibility pop

#endif
