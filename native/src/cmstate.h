/* The state of librdmacm's connection ids as the shim sees them: the
 * commands librdmacm writes to an event channel's fd and the events the
 * kernel hands back (rdma/rdma_user_cm.h).  Pure: unit-tested on the host.
 * rdmacm.c feeds it and decides from it what a checkpoint can carry. */
#ifndef IBK_CMSTATE_H
#define IBK_CMSTATE_H

#include <stddef.h>
#include <stdint.h>

enum ibk_cm_state {
	IBK_CM_IDLE = 1,      /* created, maybe bound or resolving */
	IBK_CM_LISTEN,        /* rdma_listen */
	IBK_CM_CONNECTING,    /* rdma_connect sent, or a request not yet established */
	IBK_CM_RESPONDED,     /* active side: the peer's reply came, librdmacm accepts it */
	IBK_CM_CONNECTED,     /* established */
	IBK_CM_DISCONNECTING, /* rdma_disconnect sent, its DISCONNECTED not yet handed out */
	IBK_CM_CLOSED,        /* disconnected, rejected, unreachable: only destroy is left */
	IBK_CM_MCAST,         /* joined a multicast group */
};

/* RDMA_CM_EVENT_* of <rdma/rdma_cma.h>, which cannot be included with rdma/rdma_user_cm.h */
enum {
	EV_ADDR_RESOLVED,
	EV_ADDR_ERROR,
	EV_ROUTE_RESOLVED,
	EV_ROUTE_ERROR,
	EV_CONNECT_REQUEST,
	EV_CONNECT_RESPONSE,
	EV_CONNECT_ERROR,
	EV_UNREACHABLE,
	EV_REJECTED,
	EV_ESTABLISHED,
	EV_DISCONNECTED,
	EV_DEVICE_REMOVAL,
	EV_MULTICAST_JOIN,
	EV_MULTICAST_ERROR,
	EV_ADDR_CHANGE,
	EV_TIMEWAIT_EXIT,
};

/* cffi-begin: native/shimtest/core.py binds what stands up to cffi-end */
struct ibk_cm_id {
	uint64_t uid;      /* librdmacm's cookie: its private id, echoed in events */
	uint32_t handle;   /* the kernel's id */
	uint32_t reported; /* events handed to the app, as the kernel counts them */
	uint8_t state;
	uint8_t disc_out;  /* a DISCONNECTED was handed out or queued */
};

struct ibk_cm_ids {
	struct ibk_cm_id *v;
	uint32_t n, cap;
};

struct ibk_cm_id *ibk_cm_find(struct ibk_cm_ids *ids, uint32_t handle);
/* A command the kernel (or the shim, for a detached channel) accepted: body
 * is what follows the command header; new_handle is CREATE_ID's answer.
 * Returns -1 only when a new id cannot be recorded (no memory). */
int ibk_cm_on_cmd(struct ibk_cm_ids *ids, uint32_t cmd, const void *body, size_t blen, uint32_t new_handle);
/* An event handed to the app (a struct rdma_ucm_event_resp). */
int ibk_cm_on_event(struct ibk_cm_ids *ids, const void *resp, size_t rlen);
/* DESTROY_ID: forget the id; its reported count, or -1 if unknown. */
long ibk_cm_forget(struct ibk_cm_ids *ids, uint32_t handle);
/* MIGRATE_ID: an id another channel forgot goes on here as it was; -1
 * without memory. */
int ibk_cm_adopt(struct ibk_cm_ids *ids, const struct ibk_cm_id *id);
/* Whether a detached id in this state still behaves for the app. */
int ibk_cm_carried(int state);
const char *ibk_cm_state_name(int state);
void ibk_cm_ids_fini(struct ibk_cm_ids *ids);
/* cffi-end */

#endif
