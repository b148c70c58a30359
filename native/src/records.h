/* The rebuild records at the coordinator: keys, values, and their parser
 * (records.c; docs/wire-formats.md). */
#ifndef IBK_RECORDS_H
#define IBK_RECORDS_H

#include <stddef.h>
#include <stdint.h>
#include <infiniband/verbs.h>

#include "core.h"

#pragma GCC visibility push(hidden)

#define IBK_GID_HEX 33 /* 32 hex digits and the NUL */

/* What a record says of one QP incarnation. */
struct ibk_record {
	union ibv_gid rgid;
	uint16_t rlid;
	uint32_t rqpn;
	uint64_t recvs_completed; /* qp records only */
	size_t nkeys;             /* qp records: how many rkey pairs follow */
	const char *keys;         /* qp records: the pairs, inside the parsed value */
};

void ibk_gid_hex(const union ibv_gid *g, char *out);
int ibk_gid_parse(const char *hex, union ibv_gid *g);
void ibk_record_key_map(char *key, size_t len, const union ibv_gid *vgid, uint32_t vqpn);
void ibk_record_key_qp(char *key, size_t len, uint64_t epoch, const union ibv_gid *vgid, uint32_t vqpn);
/* "<rgid> <rlid> <rqpn>": the map record, and the head of the qp record */
void ibk_record_head(char *out, size_t len, const struct ibk_record *r);
/* The whole qp record with every live rkey of the context, malloc'd. */
char *ibk_record_qp(const struct ibk_record *r, const struct ibk_idmap *rkeys);
/* 0 when val is a well-formed map record (qp_record 0) or qp record. */
int ibk_record_parse(const char *val, int qp_record, struct ibk_record *r);
/* The next "<vrkey>:<rrkey>" pair after *p (as left by the parser). */
int ibk_record_next_key(const char **p, uint32_t *vkey, uint32_t *rkey);

#pragma GCC visibility pop

#endif
