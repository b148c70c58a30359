/* One followed rdma_cm event channel, shared by the channels' file
 * (rdmacm.c) and the commands' (cmcommands.c). */
#ifndef IBK_CMCHAN_H
#define IBK_CMCHAN_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include <rdma/rdma_user_cm.h>

#include "cmstate.h"

#pragma GCC visibility push(hidden)

#define IBK_CM_MAXFD 4096

/* librdmacm's public channel (rdma/rdma_cma.h, whose enums clash with the
 * kernel ABI header's) */
struct rdma_event_channel {
	int fd;
};

struct cm_chan {
	struct rdma_event_channel *pub;
	int app_fd;     /* epoll fd: pub->fd */
	int real_fd;    /* the kernel's rdma_cm file; -1 once detached */
	int pending_fd; /* in app_fd: readable while events are queued */
	int wake_fd;    /* readable while a checkpoint closes the gate */
	int pending_on;
	pthread_mutex_t lock; /* ids, queue, and the one reader of real_fd */
	int inherited;        /* a parent process's, made before it forked this one */
	struct ibk_cm_ids ids;
	struct rdma_ucm_event_resp *q;
	uint32_t qhead, qtail, qcap;
	struct cm_chan *next;
};

/* app fds that are followed channels' (write() checks here first) */
extern _Atomic unsigned char ibk_cm_fd_on[IBK_CM_MAXFD];
struct cm_chan *ibk_cm_chan_of_fd(int fd);

/* Under ch->lock: queue an event for the app (-ENOMEM), queue the
 * DISCONNECTED the kernel would have sent, read one event from the kernel
 * without blocking (1, 0 when none or detached, -1 with errno). */
int ibk_cm_q_push(struct cm_chan *ch, const struct rdma_ucm_event_resp *ev);
void ibk_cm_queue_disconnected(struct cm_chan *ch, struct ibk_cm_id *id);
int ibk_cm_read_kernel_event(struct cm_chan *ch, struct rdma_ucm_event_resp *ev);

#pragma GCC visibility pop

#endif
