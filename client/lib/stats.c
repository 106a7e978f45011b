/*
 * The daemon's counters (normclient.h): nc_stats_get, and reading its
 * latency histograms: quantiles from log2 buckets of microseconds,
 * interpolated linearly inside a bucket the way Prometheus'
 * histogram_quantile() does.
 */
#include <string.h>

#include "client/lib/internal.h"
#include "proto/frame.h"

/* Per-op counters; slots beyond NC_STATS_OPS are dropped. */
static void stats_copy_ops(struct nc_stats *out, const Normd__StatsReply *s)
{
	for (size_t i = 0; i < s->n_ops; i++) {
		const Normd__OpStats *m = s->ops[i];
		if ((unsigned)m->op >= NC_STATS_OPS)
			continue;
		struct nc_op_stats *o = &out->ops[m->op];
		for (size_t k = 0; k < m->n_jobs_by_status && k < 16; k++)
			o->jobs_by_status[k] = m->jobs_by_status[k];
		o->bytes = m->bytes;
		o->device_us = m->device_us;
		o->latency_us_sum = m->latency_us_sum;
		for (size_t k = 0; k < m->n_latency_buckets; k++) {
			/* A longer histogram from a newer daemon folds into the open last bucket. */
			size_t b = k < NC_LATENCY_BUCKETS ? k : NC_LATENCY_BUCKETS - 1;
			o->latency_buckets[b] += m->latency_buckets[k];
		}
	}
}

static void stats_copy_devices(struct nc_stats *out, const Normd__StatsReply *s)
{
	for (size_t i = 0; i < s->n_devices && out->device_count < NC_STATS_DEVICES; i++) {
		const Normd__DeviceStats *m = s->devices[i];
		struct nc_device_stats *d = &out->devices[out->device_count++];
		d->index = m->index;
		d->jobs_ok = m->jobs_ok;
		d->jobs_failed = m->jobs_failed;
		d->bytes = m->bytes;
		d->busy_us = m->busy_us;
		d->has_variant_cache = m->has_variant_cache_hits || m->has_variant_cache_misses;
		d->variant_cache_hits = m->variant_cache_hits;
		d->variant_cache_misses = m->variant_cache_misses;
	}
}

NC_API int nc_stats_get(nc_conn *conn, int timeout_ms, struct nc_stats *out)
{
	if (!conn || !out)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn and out must not be NULL");
	Normd__StatsRequest req = NORMD__STATS_REQUEST__INIT;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_STATS;
	env.stats = &req;
	Normd__Envelope *reply;
	int rc = nc__call_expect(conn, &env, timeout_ms, NORMD__ENVELOPE__BODY_STATS_REPLY, "Stats",
				 &reply);
	if (rc)
		return rc;
	const Normd__StatsReply *s = reply->stats_reply;
	memset(out, 0, sizeof(*out));
	out->uptime_ms = s->uptime_ms;
	out->clients = s->clients;
	out->clients_total = s->clients_total;
	out->jobs_ok = s->jobs_ok;
	out->jobs_failed = s->jobs_failed;
	out->jobs_in_flight = s->jobs_in_flight;
	out->regions = s->regions;
	out->mapped_bytes = s->mapped_bytes;
	out->rss_bytes = s->rss_bytes;
	out->heap_bytes = s->heap_bytes;
	out->bytes_processed = s->bytes_processed;
	for (size_t i = 0; i < s->n_errors_by_status && i < 16; i++)
		out->errors_by_status[i] = s->errors_by_status[i];
	nc__copy_string(out->backend, sizeof(out->backend), s->backend);
	out->has_mps = s->has_mps;
	out->mps = s->mps;
	stats_copy_ops(out, s);
	stats_copy_devices(out, s);
	size_t reasons = sizeof(out->rejections) / sizeof(out->rejections[0]);
	for (size_t i = 0; i < s->n_rejections && i < reasons; i++)
		out->rejections[i] = s->rejections[i];
	if (s->limits) {
		out->limits.max_clients = s->limits->max_clients;
		out->limits.max_frame = s->limits->max_frame;
		out->limits.max_regions = s->limits->max_regions;
		out->limits.max_jobs_in_flight = s->limits->max_jobs_in_flight;
		out->limits.max_mapped_bytes = s->limits->max_mapped_bytes;
		out->limits.max_output_bytes = s->limits->max_output_bytes;
		out->limits.max_cols = s->limits->max_cols;
	}
	nc__envelope_free(reply);
	return 0;
}

NC_API double nc_latency_quantile_us(const uint64_t buckets[NC_LATENCY_BUCKETS], double quantile)
{
	if (!buckets)
		return 0.0;
	if (!(quantile > 0.0))
		quantile = 0.0;
	if (quantile > 1.0)
		quantile = 1.0;
	uint64_t total = 0;
	for (int i = 0; i < NC_LATENCY_BUCKETS; i++)
		total += buckets[i];
	if (total == 0)
		return 0.0;
	double rank = quantile * (double)total, below = 0.0;
	for (int i = 0; i < NC_LATENCY_BUCKETS; i++) {
		double count = (double)buckets[i];
		double lower = i == 0 ? 0.0 : (double)(1ull << (i - 1));
		if (count == 0.0 || below + count < rank) {
			below += count;
			continue;
		}
		/* The open last bucket has no upper bound: report its lower one. */
		if (i == NC_LATENCY_BUCKETS - 1)
			return lower;
		double upper = (double)(1ull << i);
		return lower + (upper - lower) * (rank - below) / count;
	}
	return (double)(1ull << (NC_LATENCY_BUCKETS - 2));
}
