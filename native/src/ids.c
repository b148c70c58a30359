/* Virtual id tables (pure). */
#include <errno.h>
#include <stdlib.h>

#include "core.h"

static size_t idmap_slot(uint32_t key, size_t cap)
{
	/* Fibonacci hashing spreads the small sequential ids verbs hands out. */
	return (size_t)(((uint64_t)key * 0x9E3779B97F4A7C15ull) >> 32) & (cap - 1);
}

int ibk_idmap_init(struct ibk_idmap *m, size_t cap)
{
	size_t c = 16;

	while (c < cap * 2)
		c <<= 1;
	m->keys = calloc(c, sizeof(*m->keys));
	m->vals = calloc(c, sizeof(*m->vals));
	m->used = calloc(c, 1);
	m->cap = c;
	m->live = 0;
	m->filled = 0;
	if (!m->keys || !m->vals || !m->used) {
		ibk_idmap_fini(m);
		return -ENOMEM;
	}
	return 0;
}

void ibk_idmap_fini(struct ibk_idmap *m)
{
	free(m->keys);
	free(m->vals);
	free(m->used);
	m->keys = NULL;
	m->vals = NULL;
	m->used = NULL;
	m->cap = 0;
}

static long idmap_find(const struct ibk_idmap *m, uint32_t key)
{
	size_t i;

	if (!m->cap)
		return -1;
	for (i = idmap_slot(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
		if (!m->used[i])
			return -1;
		if (m->keys[i] == key)
			return (long)i;
	}
}

static int idmap_grow(struct ibk_idmap *m)
{
	struct ibk_idmap n;
	size_t i;
	int rc = ibk_idmap_init(&n, m->cap);

	if (rc)
		return rc;
	for (i = 0; i < m->cap; i++) {
		size_t j;

		if (!m->used[i])
			continue;
		for (j = idmap_slot(m->keys[i], n.cap); n.used[j]; j = (j + 1) & (n.cap - 1))
			;
		n.keys[j] = m->keys[i];
		n.vals[j] = m->vals[i];
		n.used[j] = m->used[i];
		n.filled++;
		if (m->used[i] == 1)
			n.live++;
	}
	ibk_idmap_fini(m);
	*m = n;
	return 0;
}

int ibk_idmap_put(struct ibk_idmap *m, uint32_t vid, uint32_t rid)
{
	long at = idmap_find(m, vid);
	size_t i;

	if (at >= 0) {
		if (m->used[at] != 1)
			m->live++;
		m->used[at] = 1;
		m->vals[at] = rid;
		return 0;
	}
	/* Keep the load factor under one half so probes stay short. */
	if ((m->filled + 1) * 2 > m->cap && idmap_grow(m))
		return -ENOMEM;
	for (i = idmap_slot(vid, m->cap); m->used[i]; i = (i + 1) & (m->cap - 1))
		;
	m->keys[i] = vid;
	m->vals[i] = rid;
	m->used[i] = 1;
	m->filled++;
	m->live++;
	return 0;
}

int ibk_idmap_get(const struct ibk_idmap *m, uint32_t vid, uint32_t *rid)
{
	long at = idmap_find(m, vid);

	if (at < 0 || m->used[at] != 1)
		return -ENOENT;
	*rid = m->vals[at];
	return 0;
}

int ibk_idmap_del(struct ibk_idmap *m, uint32_t vid)
{
	long at = idmap_find(m, vid);

	if (at < 0 || m->used[at] != 1)
		return -ENOENT;
	m->used[at] = 2;
	m->live--;
	return 0;
}

int ibk_idmap_is_live(const struct ibk_idmap *m, uint32_t vid)
{
	long at = idmap_find(m, vid);

	return at >= 0 && m->used[at] == 1;
}

int ibk_idmap_was_used(const struct ibk_idmap *m, uint32_t vid)
{
	return idmap_find(m, vid) >= 0;
}

uint32_t ibk_idmap_choose(const struct ibk_idmap *m, uint32_t real, uint32_t floor, uint32_t mask)
{
	uint32_t v;

	if (!ibk_idmap_is_live(m, real))
		return real;
	for (v = floor & mask;; v = (v + 1) & mask) {
		if (v && !ibk_idmap_was_used(m, v))
			return v;
	}
}

int ibk_qpn_taken(const struct ibk_idmap *own, const struct ibk_idmap *reserved, uint32_t qpn)
{
	return ibk_idmap_is_live(own, qpn) || ibk_idmap_is_live(reserved, qpn);
}

uint32_t ibk_qpn_choose(const struct ibk_idmap *own, const struct ibk_idmap *reserved, uint32_t real)
{
	uint32_t v;

	if (!ibk_qpn_taken(own, reserved, real))
		return real;
	for (v = 0x800000u;; v = (v + 1) & 0xffffffu) {
		if (v && !ibk_idmap_was_used(own, v) && !ibk_idmap_is_live(reserved, v))
			return v;
	}
}
