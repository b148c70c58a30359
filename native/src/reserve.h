/* Virtual QPNs of siblings this process must not hand out (reserve.c). */
#ifndef IBK_RESERVE_H
#define IBK_RESERVE_H

#include <stddef.h>
#include <stdint.h>

#include "core.h"

#pragma GCC visibility push(hidden)

/* the control command: add [qpn, qpn + count), or empty the set (qpn 0) */
int ibk_do_reserve(unsigned long long first, long count, char *out, size_t len);
void ibk_reserve_clear(void);
size_t ibk_reserve_count(void);
/* ibk_qpn_taken and ibk_qpn_choose (core.h) against the reserved set */
int ibk_reserve_taken(const struct ibk_idmap *own, uint32_t qpn);
uint32_t ibk_reserve_choose(const struct ibk_idmap *own, uint32_t real);

#pragma GCC visibility pop

#endif
