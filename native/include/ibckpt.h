/* ibckpt.h - optional API of libibckpt for libraries that know more than
 * the verbs layer (MPI, NCCL, GASPI).
 *
 * Link nothing: declare the functions weak and test them for NULL, so the
 * library still runs when libibckpt is not preloaded:
 *
 *     #pragma weak ibckpt_critical_enter
 *     if (ibckpt_critical_enter) ibckpt_critical_enter();
 *
 * A checkpoint's quiesce phase waits (bounded by its timeout) until no
 * critical section is open, and blocks new critical sections until resume.
 * Callbacks run on the shim's control thread: right before the gate on the
 * verbs entry points closes (IBCKPT_EV_QUIESCE) and right after it reopens
 * (IBCKPT_EV_RESUME).  They must not call verbs. */
#ifndef IBCKPT_H
#define IBCKPT_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define IBCKPT_API_VERSION 1
#define IBCKPT_PROTO_VERSION 1

enum ibckpt_event {
	IBCKPT_EV_QUIESCE = 1,
	IBCKPT_EV_RESUME = 2,
};

typedef void (*ibckpt_event_cb)(enum ibckpt_event ev, void *arg);

/* IBCKPT_API_VERSION of the loaded shim. */
int ibckpt_api_version(void);

/* Defer checkpoints over a critical section.  Nests.  enter blocks while a
 * checkpoint is in progress. */
void ibckpt_critical_enter(void);
void ibckpt_critical_leave(void);

/* Up to 8 callbacks; returns 0, or -1 when full. */
int ibckpt_register_callback(ibckpt_event_cb cb, void *arg);

/* Current phase: "running", "quiesced", "drained", "released", "rebuilt". */
const char *ibckpt_phase(void);

/* Run one control command in-process, exactly as on the control socket
 * (see docs/native-shim.md), and write its JSON reply.  0 on success. */
int ibckpt_control(const char *cmd, char *out, size_t len);

#ifdef __cplusplus
}
#endif

#endif
