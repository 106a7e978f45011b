/*
 * The counters behind Stats: replies by status, refusals by reason, and,
 * beyond totals, jobs by op and status, a latency histogram per op (log2
 * buckets of microseconds, so percentiles are good to a factor of two at any
 * scale and updating costs one bit scan), and jobs, bytes and busy time per
 * device; also the monotonic clock that stamps jobs for them. The loop
 * thread owns all the counters: jobs are counted when they are answered
 * (job.c), never by workers.
 */
#include "daemon/server.h"

#include <time.h>

#include "proto/frame.h"

uint64_t stats_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void stats_count_rejection(struct server *srv, enum nc_reject_reason reason)
{
	if ((int)reason >= 0 && reason < NC_REJECT_COUNT)
		srv->stats.rejections[reason]++;
}

void stats_count_status(struct server *srv, int status)
{
	Normd__Status wire = nc__status_to_wire(status);
	if ((int)wire >= 0 && (int)wire <= NORMD__STATUS__INTERNAL)
		srv->stats.errors_by_status[wire]++;
}

unsigned stats_latency_bucket(uint64_t us)
{
	/* Bucket i holds [2^(i-1), 2^i) us; bucket 0 holds 0 us. */
	unsigned bucket = us ? 64u - (unsigned)__builtin_clzll(us) : 0u;
	return bucket < STATS_LATENCY_BUCKETS ? bucket : STATS_LATENCY_BUCKETS - 1;
}

/* The per-device slot of a device index, or -1 for one beyond the table. */
static int stats_device_slot(int device)
{
	if (device < -1 || device >= STATS_DEVICES - 1)
		return -1;
	return device + 1;
}

void stats_count_job(struct server *srv, const struct job *job, bool ran)
{
	struct server_stats *st = &srv->stats;
	bool ok = job->status == NC_OK;
	Normd__Status wire = nc__status_to_wire(job->status);
	unsigned op = (unsigned)job->op < STATS_OPS ? (unsigned)job->op : 0u;
	struct op_stats *os = &st->ops[op];
	if ((unsigned)wire <= NORMD__STATUS__INTERNAL)
		os->jobs_by_status[wire]++;
	if (ok) {
		st->jobs_ok++;
		st->bytes_processed += job->bytes;
		os->bytes += job->bytes;
	} else {
		st->jobs_failed++;
	}
	if (!ran)
		return;
	uint64_t latency_us = (stats_now_ns() - job->t_arrive_ns) / 1000;
	uint64_t device_us = job->t_start_ns && job->t_end_ns >= job->t_start_ns
				 ? (job->t_end_ns - job->t_start_ns) / 1000
				 : 0;
	os->latency[stats_latency_bucket(latency_us)]++;
	os->latency_us_sum += latency_us;
	os->device_us += device_us;
	int slot = stats_device_slot(job->device);
	if (slot < 0)
		return;
	struct device_stats *ds = &st->devices[slot];
	if (ok) {
		ds->jobs_ok++;
		ds->bytes += job->bytes;
	} else {
		ds->jobs_failed++;
	}
	ds->busy_us += device_us;
}

/* Storage for the sub-messages of one StatsReply (loop thread only). */
static Normd__OpStats reply_ops[STATS_OPS];
static Normd__OpStats *reply_op_ptrs[STATS_OPS];
static Normd__DeviceStats reply_devices[STATS_DEVICES];
static Normd__DeviceStats *reply_device_ptrs[STATS_DEVICES];

static bool op_stats_empty(const struct op_stats *os)
{
	for (size_t i = 0; i <= NORMD__STATUS__INTERNAL; i++) {
		if (os->jobs_by_status[i])
			return false;
	}
	return true;
}

static void stats_fill_ops(struct server *srv, Normd__StatsReply *reply)
{
	size_t n = 0;
	for (unsigned op = 0; op < STATS_OPS; op++) {
		struct op_stats *os = &srv->stats.ops[op];
		if (op_stats_empty(os))
			continue;
		Normd__OpStats *m = &reply_ops[n];
		normd__op_stats__init(m);
		m->op = (Normd__Op)op;
		m->n_jobs_by_status = NORMD__STATUS__INTERNAL + 1;
		m->jobs_by_status = os->jobs_by_status;
		m->has_bytes = m->has_device_us = m->has_latency_us_sum = true;
		m->bytes = os->bytes;
		m->device_us = os->device_us;
		m->latency_us_sum = os->latency_us_sum;
		m->n_latency_buckets = STATS_LATENCY_BUCKETS;
		m->latency_buckets = os->latency;
		reply_op_ptrs[n++] = m;
	}
	reply->n_ops = n;
	reply->ops = reply_op_ptrs;
}

static void stats_fill_device(struct server *srv, int index, Normd__DeviceStats *m)
{
	normd__device_stats__init(m);
	m->index = index;
	int slot = stats_device_slot(index);
	if (slot >= 0) {
		const struct device_stats *ds = &srv->stats.devices[slot];
		m->has_jobs_ok = m->has_jobs_failed = m->has_bytes = m->has_busy_us = true;
		m->jobs_ok = ds->jobs_ok;
		m->jobs_failed = ds->jobs_failed;
		m->bytes = ds->bytes;
		m->busy_us = ds->busy_us;
	}
	struct backend *backend = srv->backend;
	if (backend && backend->variant_cache_counts) {
		m->has_variant_cache_hits = m->has_variant_cache_misses = true;
		backend->variant_cache_counts(backend, index, &m->variant_cache_hits,
					      &m->variant_cache_misses);
	}
}

void stats_fill_reply(struct server *srv, Normd__StatsReply *reply)
{
	stats_fill_ops(srv, reply);
	size_t n = 0;
	const struct backend *backend = srv->backend;
	int count = backend ? backend->device_count : 0;
	for (int i = 0; i < count && n < STATS_DEVICES; i++) {
		stats_fill_device(srv, backend->devices[i].index, &reply_devices[n]);
		reply_device_ptrs[n] = &reply_devices[n];
		n++;
	}
	reply->n_devices = n;
	reply->devices = reply_device_ptrs;
}
