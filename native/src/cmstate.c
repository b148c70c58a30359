/* librdmacm's connection ids, followed through the commands written to an
 * event channel and the events read back (see cmstate.h). */
#include <stdlib.h>
#include <string.h>

#include <rdma/rdma_user_cm.h>

#include "cmstate.h"

struct ibk_cm_id *ibk_cm_find(struct ibk_cm_ids *ids, uint32_t handle)
{
	uint32_t i;

	for (i = 0; i < ids->n; i++)
		if (ids->v[i].handle == handle)
			return &ids->v[i];
	return NULL;
}

static struct ibk_cm_id *find_uid(struct ibk_cm_ids *ids, uint64_t uid)
{
	uint32_t i;

	for (i = 0; uid && i < ids->n; i++)
		if (ids->v[i].uid == uid)
			return &ids->v[i];
	return NULL;
}

static struct ibk_cm_id *add(struct ibk_cm_ids *ids, uint32_t handle, uint64_t uid, int state)
{
	struct ibk_cm_id *id = ibk_cm_find(ids, handle);

	if (!id) {
		if (ids->n == ids->cap) {
			uint32_t cap = ids->cap ? ids->cap * 2 : 8;
			struct ibk_cm_id *v = realloc(ids->v, cap * sizeof(*v));

			if (!v)
				return NULL;
			ids->v = v;
			ids->cap = cap;
		}
		id = &ids->v[ids->n++];
	}
	*id = (struct ibk_cm_id){ .uid = uid, .handle = handle, .state = (uint8_t)state };
	return id;
}

long ibk_cm_forget(struct ibk_cm_ids *ids, uint32_t handle)
{
	struct ibk_cm_id *id = ibk_cm_find(ids, handle);
	long reported;

	if (!id)
		return -1;
	reported = id->reported;
	*id = ids->v[--ids->n];
	return reported;
}

int ibk_cm_adopt(struct ibk_cm_ids *ids, const struct ibk_cm_id *id)
{
	struct ibk_cm_id *to = add(ids, id->handle, id->uid, id->state);

	if (!to)
		return -1;
	*to = *id;
	return 0;
}

/* The commands that name a kernel id, and where in each the id sits. */
static const struct {
	uint32_t cmd;
	size_t off;
} id_places[] = {
	{ RDMA_USER_CM_CMD_DESTROY_ID, offsetof(struct rdma_ucm_destroy_id, id) },
	{ RDMA_USER_CM_CMD_CONNECT, offsetof(struct rdma_ucm_connect, id) },
	{ RDMA_USER_CM_CMD_LISTEN, offsetof(struct rdma_ucm_listen, id) },
	{ RDMA_USER_CM_CMD_ACCEPT, offsetof(struct rdma_ucm_accept, id) },
	{ RDMA_USER_CM_CMD_REJECT, offsetof(struct rdma_ucm_reject, id) },
	{ RDMA_USER_CM_CMD_DISCONNECT, offsetof(struct rdma_ucm_disconnect, id) },
	{ RDMA_USER_CM_CMD_JOIN_IP_MCAST, offsetof(struct rdma_ucm_join_ip_mcast, id) },
	{ RDMA_USER_CM_CMD_JOIN_MCAST, offsetof(struct rdma_ucm_join_mcast, id) },
};

/* The kernel id a command names, read at its place in that command. */
static int cmd_handle(uint32_t cmd, const void *body, size_t blen, uint32_t *h)
{
	size_t i;

	for (i = 0; i < sizeof(id_places) / sizeof(id_places[0]); i++) {
		if (id_places[i].cmd != cmd)
			continue;
		if (blen < id_places[i].off + sizeof(*h))
			return -1;
		memcpy(h, (const char *)body + id_places[i].off, sizeof(*h));
		return 0;
	}
	return -1;
}

int ibk_cm_on_cmd(struct ibk_cm_ids *ids, uint32_t cmd, const void *body, size_t blen, uint32_t new_handle)
{
	struct ibk_cm_id *id;
	uint32_t h;

	if (cmd == RDMA_USER_CM_CMD_CREATE_ID) {
		struct rdma_ucm_create_id c;

		if (blen < sizeof(c))
			return 0;
		memcpy(&c, body, sizeof(c));
		return add(ids, new_handle, c.uid, IBK_CM_IDLE) ? 0 : -1;
	}
	if (cmd_handle(cmd, body, blen, &h) || !(id = ibk_cm_find(ids, h)))
		return 0;
	switch (cmd) {
	case RDMA_USER_CM_CMD_DESTROY_ID:
		ibk_cm_forget(ids, h);
		break;
	case RDMA_USER_CM_CMD_CONNECT:
		id->state = IBK_CM_CONNECTING;
		break;
	case RDMA_USER_CM_CMD_LISTEN:
		id->state = IBK_CM_LISTEN;
		break;
	case RDMA_USER_CM_CMD_ACCEPT: {
		struct rdma_ucm_accept a;

		/* the active side accepts the reply it got: established now;
		 * the passive side waits for ESTABLISHED and names its id */
		if (id->state == IBK_CM_RESPONDED) {
			id->state = IBK_CM_CONNECTED;
		} else {
			id->state = IBK_CM_CONNECTING;
			if (blen >= sizeof(a)) {
				memcpy(&a, body, sizeof(a));
				if (a.uid)
					id->uid = a.uid;
			}
		}
		break;
	}
	case RDMA_USER_CM_CMD_REJECT:
		id->state = IBK_CM_CLOSED;
		break;
	case RDMA_USER_CM_CMD_DISCONNECT:
		if (id->state == IBK_CM_CONNECTED)
			id->state = IBK_CM_DISCONNECTING;
		break;
	default: /* the joins */
		id->state = IBK_CM_MCAST;
		break;
	}
	return 0;
}

int ibk_cm_on_event(struct ibk_cm_ids *ids, const void *resp, size_t rlen)
{
	struct rdma_ucm_event_resp ev;
	struct ibk_cm_id *id;

	if (rlen < offsetof(struct rdma_ucm_event_resp, param))
		return 0;
	memset(&ev, 0, sizeof(ev));
	memcpy(&ev, resp, rlen < sizeof(ev) ? rlen : sizeof(ev));
	if (ev.event == EV_MULTICAST_JOIN || ev.event == EV_MULTICAST_ERROR)
		return 0; /* counted on the group, not the id (and refused) */
	if (ev.event == EV_CONNECT_REQUEST) {
		/* counted on the listener; the new id is the kernel's handle */
		id = find_uid(ids, ev.uid);
		if (id)
			id->reported++;
		return add(ids, ev.id, 0, IBK_CM_CONNECTING) ? 0 : -1;
	}
	id = ibk_cm_find(ids, ev.id);
	if (!id)
		return 0;
	id->reported++;
	if (ev.uid)
		id->uid = ev.uid;
	switch (ev.event) {
	case EV_CONNECT_RESPONSE:
		id->state = IBK_CM_RESPONDED;
		break;
	case EV_ESTABLISHED:
		id->state = IBK_CM_CONNECTED;
		break;
	case EV_DISCONNECTED:
		id->disc_out = 1;
		/* fall through */
	case EV_CONNECT_ERROR:
	case EV_UNREACHABLE:
	case EV_REJECTED:
	case EV_DEVICE_REMOVAL:
		id->state = IBK_CM_CLOSED;
		break;
	default: /* address and route resolution, address change, time wait */
		break;
	}
	return 0;
}

int ibk_cm_carried(int state)
{
	return state == IBK_CM_CONNECTED || state == IBK_CM_DISCONNECTING || state == IBK_CM_CLOSED;
}

const char *ibk_cm_state_name(int state)
{
	static const char *const names[] = { "?",	   "idle",	     "listening", "connecting",
					     "responded", "connected", "disconnecting", "closed",
					     "multicast" };

	return state > 0 && state <= IBK_CM_MCAST ? names[state] : names[0];
}

void ibk_cm_ids_fini(struct ibk_cm_ids *ids)
{
	free(ids->v);
	*ids = (struct ibk_cm_ids){ 0 };
}
