/* Work-request logs, private completion queues and the re-post planner (pure). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

static uint32_t pow2_at_least(uint32_t n)
{
	uint32_t p = 1;

	while (p < n)
		p <<= 1;
	return p;
}

/* The SGEs each entry of a log keeps: the QP's max_sge, but at least one (an
 * inline send is logged as one SGE pointing at its copy); 0 beyond IBK_MAX_SGE. */
static uint32_t sges_per_entry(uint32_t max_sge)
{
	if (max_sge > IBK_MAX_SGE)
		return 0;
	return max_sge ? max_sge : 1;
}

int ibk_sendlog_init(struct ibk_sendlog *l, uint32_t cap, uint32_t max_inline, uint32_t max_sge, void *owner)
{
	uint32_t i, size = pow2_at_least(cap);

	memset(l, 0, sizeof(*l));
	max_sge = sges_per_entry(max_sge);
	if (!max_sge)
		return -EINVAL;
	l->slots = calloc(size, sizeof(*l->slots));
	l->sge_area = calloc((size_t)size * max_sge, sizeof(*l->sge_area));
	if (max_inline)
		l->inline_area = calloc(size, max_inline);
	if (!l->slots || !l->sge_area || (max_inline && !l->inline_area)) {
		ibk_sendlog_fini(l);
		return -ENOMEM;
	}
	l->max_sge = max_sge;
	l->cap = cap;
	l->mask = size - 1;
	l->max_inline = max_inline;
	for (i = 0; i < size; i++) {
		l->slots[i].kind = IBK_KIND_SEND;
		l->slots[i].owner = owner;
		l->slots[i].inline_buf = max_inline ? l->inline_area + (size_t)i * max_inline : NULL;
		l->slots[i].sge = l->sge_area + (size_t)i * max_sge;
		/* fixed for the entry's life: it is posted to the real QP as is */
		l->slots[i].wr.wr_id = (uintptr_t)&l->slots[i];
		l->slots[i].wr.next = NULL;
		l->slots[i].wr.sg_list = l->slots[i].sge;
	}
	return 0;
}

void ibk_sendlog_fini(struct ibk_sendlog *l)
{
	free(l->slots);
	free(l->inline_area);
	free(l->sge_area);
	memset(l, 0, sizeof(*l));
}

void ibk_sendlog_unpush(struct ibk_sendlog *l)
{
	if (l->tail > l->head)
		l->tail--;
}

struct ibk_swr *ibk_sendlog_at(struct ibk_sendlog *l, uint64_t seq)
{
	if (seq < l->head || seq >= l->tail)
		return NULL;
	return &l->slots[seq & l->mask];
}

int ibk_recvlog_init(struct ibk_recvlog *l, uint32_t cap, int ring, uint32_t max_sge, void *owner)
{
	uint32_t i, size = ring ? pow2_at_least(cap) : cap;

	memset(l, 0, sizeof(*l));
	max_sge = sges_per_entry(max_sge);
	if (!max_sge)
		return -EINVAL;
	l->slots = calloc(size, sizeof(*l->slots));
	l->sge_area = calloc((size_t)size * max_sge, sizeof(*l->sge_area));
	if (!l->slots || !l->sge_area) {
		ibk_recvlog_fini(l);
		return -ENOMEM;
	}
	l->max_sge = max_sge;
	l->cap = cap;
	l->ring = ring;
	l->mask = ring ? size - 1 : 0;
	for (i = 0; i < size; i++) {
		l->slots[i].kind = IBK_KIND_RECV;
		l->slots[i].owner = owner;
		l->slots[i].wr.wr_id = (uintptr_t)&l->slots[i];
		l->slots[i].wr.next = NULL;
		l->slots[i].sge = l->sge_area + (size_t)i * max_sge;
		l->slots[i].wr.sg_list = l->slots[i].sge;
	}
	return 0;
}

void ibk_recvlog_fini(struct ibk_recvlog *l)
{
	free(l->slots);
	free(l->sge_area);
	memset(l, 0, sizeof(*l));
}

struct ibk_rwr *ibk_recvlog_take_scan(struct ibk_recvlog *l)
{
	uint32_t n, i = l->hint;

	if (l->live >= l->cap)
		return NULL;
	for (n = 0; n < l->cap; n++) {
		struct ibk_rwr *e = &l->slots[i];

		if (++i == l->cap)
			i = 0;
		if (!e->in_use) {
			l->hint = i;
			e->in_use = 1;
			e->seq = l->next_seq++;
			l->live++;
			return e;
		}
	}
	return NULL;
}

static int rwr_cmp(const void *a, const void *b)
{
	const struct ibk_rwr *x = *(struct ibk_rwr *const *)a;
	const struct ibk_rwr *y = *(struct ibk_rwr *const *)b;

	return x->seq < y->seq ? -1 : x->seq > y->seq;
}

uint32_t ibk_recvlog_ordered(const struct ibk_recvlog *l, struct ibk_rwr **out, uint32_t max)
{
	uint32_t i, n = 0;
	uint64_t seq;

	if (l->ring) {
		for (seq = l->head; seq < l->next_seq && n < max; seq++)
			out[n++] = &l->slots[seq & l->mask];
		return n;
	}
	for (i = 0; i < l->cap && n < max; i++)
		if (l->slots[i].in_use)
			out[n++] = &l->slots[i];
	qsort(out, n, sizeof(*out), rwr_cmp);
	return n;
}

int ibk_wcq_init(struct ibk_wcq *q, uint32_t cap)
{
	uint32_t c = 16;

	while (c < cap)
		c <<= 1;
	q->ring = calloc(c, sizeof(*q->ring));
	if (!q->ring)
		return -ENOMEM;
	q->cap = c;
	q->head = 0;
	q->tail = 0;
	return 0;
}

void ibk_wcq_fini(struct ibk_wcq *q)
{
	free(q->ring);
	memset(q, 0, sizeof(*q));
}

int ibk_wcq_push(struct ibk_wcq *q, const struct ibv_wc *wc)
{
	if (q->tail - q->head >= q->cap) {
		/* Grow: drain may capture more than the CQ depth when several
		 * generations of completions pile up before the app polls. */
		uint32_t ncap = q->cap * 2, i, n = (uint32_t)(q->tail - q->head);
		struct ibv_wc *nr = calloc(ncap, sizeof(*nr));

		if (!nr)
			return -ENOMEM;
		for (i = 0; i < n; i++)
			nr[i] = q->ring[(q->head + i) & (q->cap - 1)];
		free(q->ring);
		q->ring = nr;
		q->cap = ncap;
		q->head = 0;
		q->tail = n;
	}
	q->ring[q->tail++ & (q->cap - 1)] = *wc;
	return 0;
}

int ibk_wcq_pop(struct ibk_wcq *q, struct ibv_wc *out, int max)
{
	int n = 0;

	while (n < max && q->head < q->tail)
		out[n++] = q->ring[q->head++ & (q->cap - 1)];
	return n;
}

uint32_t ibk_wcq_count(const struct ibk_wcq *q)
{
	return (uint32_t)(q->tail - q->head);
}

int ibk_plan_resend(const uint32_t *flags, size_t n, uint64_t peer_recvs, uint64_t done_consumers,
		    uint8_t *verdict)
{
	uint64_t delivered;
	size_t i, last_delivered = 0, first_undelivered = n;
	int have_last = 0, unknown = 0;
	uint64_t seen = 0;

	if (peer_recvs < done_consumers)
		return -1;
	delivered = peer_recvs - done_consumers;
	for (i = 0; i < n; i++) {
		if (!(flags[i] & IBK_SWR_CONSUMER))
			continue;
		if (seen < delivered) {
			last_delivered = i;
			have_last = 1;
		} else if (first_undelivered == n) {
			first_undelivered = i;
		}
		seen++;
	}
	if (seen < delivered)
		return -1; /* the peer saw more than we ever sent */
	for (i = 0; i < n; i++) {
		if (flags[i] & IBK_SWR_FLAG_WR)
			verdict[i] = IBK_V_DELIVERED; /* dropped either way */
		else if (have_last && i <= last_delivered)
			verdict[i] = IBK_V_DELIVERED;
		else if (i >= first_undelivered)
			verdict[i] = IBK_V_REPOST;
		else if (flags[i] & IBK_SWR_ATOMIC) {
			verdict[i] = IBK_V_UNKNOWN;
			unknown++;
		} else
			verdict[i] = IBK_V_REPOST; /* write/read: executing again is harmless */
	}
	return unknown;
}
