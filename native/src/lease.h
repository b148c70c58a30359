/* The lease (lease.c): how long a quiesced process waits for its agent. */
#ifndef IBK_LEASE_H
#define IBK_LEASE_H

#include <pthread.h>

#include "phase.h"

#pragma GCC visibility push(hidden)

/* held by each command (commands.c) and by the lease watchdog */
extern pthread_mutex_t ibk_cmd_lock;
int ibk_do_lease(long ms, char *out, size_t len);
/* quiesce succeeded: the default lease (IBCKPT_LEASE_MS, else 60 s) starts */
void ibk_lease_quiesced(void);
void ibk_lease_after_command(long t0, enum ibk_phase before);
/* "lease_ms":N,"lease_left_ms":N, for status */
void ibk_lease_report(char *out, size_t len);

#pragma GCC visibility pop

#endif
