/*
 * normstress's counters: one slot of atomic counters and latency histogram
 * per client thread, in the mapping every process shares, and their merge
 * (stress.h).
 */
#include "client/tools/stress.h"

#include <math.h>
#include <string.h>

/*
 * Log-linear buckets over nanoseconds: exact below 64 ns, then 32 buckets per
 * power of two (about 3% resolution), up to ~2^40 ns (18 minutes); anything
 * longer lands in the last bucket. The exact maximum is kept separately.
 */
static unsigned hist_index(uint64_t ns)
{
	if (ns < 2 * HIST_SUB)
		return (unsigned)ns;
	unsigned msb = 63u - (unsigned)__builtin_clzll(ns);
	unsigned shift = msb - HIST_SUB_BITS;
	uint64_t idx = 2 * HIST_SUB + (uint64_t)(shift - 1) * HIST_SUB + ((ns >> shift) - HIST_SUB);
	return idx < HIST_BUCKETS ? (unsigned)idx : HIST_BUCKETS - 1;
}

/* The largest value that falls into bucket `idx`. */
static uint64_t hist_upper(unsigned idx)
{
	if (idx < 2 * HIST_SUB)
		return idx;
	unsigned shift = (idx - 2 * HIST_SUB) / HIST_SUB + 1;
	uint64_t mantissa = (idx - 2 * HIST_SUB) % HIST_SUB + HIST_SUB;
	return ((mantissa + 1) << shift) - 1;
}

void slot_add(struct slot *s, enum counter c, uint64_t n)
{
	atomic_fetch_add_explicit(&s->count[c], n, memory_order_relaxed);
}

static unsigned status_slot(int status)
{
	int v = -status;
	if (v >= 0 && v <= 10)
		return (unsigned)v;
	if (v >= 100 && v <= 102)
		return (unsigned)(11 + v - 100);
	return STATUS_SLOTS - 1;
}

const char *status_slot_name(unsigned i)
{
	if (i <= 10)
		return nc_status_name(-(int)i);
	if (i <= 13)
		return nc_status_name(-(int)(100 + i - 11));
	return "OTHER";
}

void slot_status(_Atomic uint64_t *by_status, int status)
{
	atomic_fetch_add_explicit(&by_status[status_slot(status)], 1, memory_order_relaxed);
}

void slot_latency(struct slot *s, uint64_t ns)
{
	atomic_fetch_add_explicit(&s->hist[hist_index(ns)], 1, memory_order_relaxed);
	if (ns > atomic_load_explicit(&s->max_ns, memory_order_relaxed))
		atomic_store_explicit(&s->max_ns, ns, memory_order_relaxed);
}

void totals_merge(const struct stress *st, struct totals *t)
{
	memset(t, 0, sizeof(*t));
	for (unsigned i = 0; i < st->opt.procs * st->opt.threads; i++) {
		struct slot *s = &st->sh->slots[i];
		for (int c = 0; c < C_COUNTERS; c++)
			t->count[c] += atomic_load_explicit(&s->count[c], memory_order_relaxed);
		for (int j = 0; j < STATUS_SLOTS; j++) {
			t->valid_status[j] += atomic_load_explicit(&s->valid_status[j],
								   memory_order_relaxed);
			t->bad_status[j] += atomic_load_explicit(&s->bad_status[j],
								 memory_order_relaxed);
		}
		uint64_t max = atomic_load_explicit(&s->max_ns, memory_order_relaxed);
		t->max_ns = max > t->max_ns ? max : t->max_ns;
		for (unsigned b = 0; b < HIST_BUCKETS; b++)
			t->hist[b] += atomic_load_explicit(&s->hist[b], memory_order_relaxed);
	}
	for (unsigned b = 0; b < HIST_BUCKETS; b++)
		t->hist_total += t->hist[b];
}

/* The latency at quantile q in microseconds (bucket upper bound, at most the maximum). */
double totals_quantile_us(const struct totals *t, double q)
{
	if (!t->hist_total)
		return 0;
	uint64_t rank = (uint64_t)ceil(q * (double)t->hist_total), seen = 0;
	rank = rank < 1 ? 1 : rank;
	for (unsigned b = 0; b < HIST_BUCKETS; b++) {
		seen += t->hist[b];
		if (seen >= rank) {
			uint64_t v = hist_upper(b);
			return (double)(v < t->max_ns ? v : t->max_ns) / 1e3;
		}
	}
	return (double)t->max_ns / 1e3;
}
