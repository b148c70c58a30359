/* The rebuild records a rank publishes at the coordinator, written and
 * read here only (docs/wire-formats.md):
 *   map/<vgid>/<vqpn>          = <rgid> <rlid> <rqpn>
 *   e<epoch>/qp/<vgid>/<vqpn>  = <rgid> <rlid> <rqpn> <recvs_completed> <n> <vrkey>:<rrkey>...
 * GIDs are 32 lower-case hex digits, LIDs, QPNs and counts decimal, keys hex.
 * Pure: no libibverbs calls, so the parser is fuzzed on the host. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "records.h"

void ibk_gid_hex(const union ibv_gid *g, char *out)
{
	static const char digits[] = "0123456789abcdef";
	int i;

	for (i = 0; i < 16; i++) {
		out[2 * i] = digits[g->raw[i] >> 4];
		out[2 * i + 1] = digits[g->raw[i] & 15];
	}
	out[32] = 0;
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* Exactly 32 hex digits, then the end of the string or a space. */
int ibk_gid_parse(const char *hex, union ibv_gid *g)
{
	int i;

	for (i = 0; i < 32; i++)
		if (hexval(hex[i]) < 0)
			return -EINVAL;
	if (hex[32] && hex[32] != ' ')
		return -EINVAL;
	for (i = 0; i < 16; i++)
		g->raw[i] = (uint8_t)(hexval(hex[2 * i]) << 4 | hexval(hex[2 * i + 1]));
	return 0;
}

void ibk_record_key_map(char *key, size_t len, const union ibv_gid *vgid, uint32_t vqpn)
{
	char hex[IBK_GID_HEX];

	ibk_gid_hex(vgid, hex);
	snprintf(key, len, "map/%s/%u", hex, vqpn);
}

void ibk_record_key_qp(char *key, size_t len, uint64_t epoch, const union ibv_gid *vgid, uint32_t vqpn)
{
	char hex[IBK_GID_HEX];

	ibk_gid_hex(vgid, hex);
	snprintf(key, len, "e%llu/qp/%s/%u", (unsigned long long)epoch, hex, vqpn);
}

void ibk_record_head(char *out, size_t len, const struct ibk_record *r)
{
	char hex[IBK_GID_HEX];

	ibk_gid_hex(&r->rgid, hex);
	snprintf(out, len, "%s %u %u", hex, r->rlid, r->rqpn);
}

char *ibk_record_qp(const struct ibk_record *r, const struct ibk_idmap *rkeys)
{
	size_t len = IBK_GID_HEX + 64 + 20 * (rkeys->live + 1), i, o;
	char *out = malloc(len);

	if (!out)
		return NULL;
	ibk_record_head(out, len, r);
	o = strlen(out);
	o += (size_t)snprintf(out + o, len - o, " %llu %zu", (unsigned long long)r->recvs_completed, rkeys->live);
	for (i = 0; i < rkeys->cap && o < len; i++)
		if (rkeys->used[i] == 1)
			o += (size_t)snprintf(out + o, len - o, " %x:%x", rkeys->keys[i], rkeys->vals[i]);
	return out;
}

/* An unsigned decimal that fits in max, then a space or the end. */
static const char *parse_dec(const char *p, unsigned long long max, unsigned long long *out)
{
	unsigned long long v = 0;

	if (*p < '0' || *p > '9')
		return NULL;
	for (; *p >= '0' && *p <= '9'; p++) {
		if (v > (max - (unsigned long long)(*p - '0')) / 10)
			return NULL;
		v = v * 10 + (unsigned long long)(*p - '0');
	}
	if (*p && *p != ' ')
		return NULL;
	*out = v;
	return p;
}

int ibk_record_parse(const char *val, int qp_record, struct ibk_record *r)
{
	unsigned long long v;
	const char *p = val;

	memset(r, 0, sizeof(*r));
	if (ibk_gid_parse(p, &r->rgid))
		return -EPROTO;
	p += 32;
	if (*p++ != ' ' || !(p = parse_dec(p, 0xffff, &v)))
		return -EPROTO;
	r->rlid = (uint16_t)v;
	if (*p++ != ' ' || !(p = parse_dec(p, 0xffffff, &v)))
		return -EPROTO;
	r->rqpn = (uint32_t)v;
	if (!qp_record)
		return *p ? -EPROTO : 0;
	if (*p++ != ' ' || !(p = parse_dec(p, ~0ull, &v)))
		return -EPROTO;
	r->recvs_completed = v;
	if (*p++ != ' ' || !(p = parse_dec(p, 1u << 24, &v)))
		return -EPROTO;
	r->nkeys = (size_t)v;
	r->keys = p;
	return 0;
}

/* One " <v>:<r>" pair of hex keys from *p; 1 if one was read. */
static const char *parse_hex32(const char *p, uint32_t *out)
{
	uint32_t v = 0;
	int n = 0;

	for (; hexval(*p) >= 0; p++, n++) {
		if (n == 8)
			return NULL;
		v = v << 4 | (uint32_t)hexval(*p);
	}
	if (!n)
		return NULL;
	*out = v;
	return p;
}

int ibk_record_next_key(const char **p, uint32_t *vkey, uint32_t *rkey)
{
	const char *s = *p;

	if (*s++ != ' ' || !(s = parse_hex32(s, vkey)) || *s++ != ':' || !(s = parse_hex32(s, rkey)))
		return 0;
	if (*s && *s != ' ')
		return 0;
	*p = s;
	return 1;
}
