/*
 * statsfmt (see statsfmt.h). Percentiles come from the daemon's log2
 * latency histograms (nc_latency_quantile_us), so they are estimates good
 * to a factor of two; the Prometheus output hands the buckets themselves
 * to Prometheus, which computes its own quantiles.
 */
#include "client/tools/statsfmt.h"

#include <ctype.h>
#include <stdbool.h>
#include <string.h>

/* Wire status values run from OK (0) to INTERNAL (10). */
#define STATUS_COUNT 11
/* The ops every output lists even before they have seen a job. */
#define FIRST_OP NC_LAYERNORM_FWD
#define LAST_COMMON_OP NC_WGRAD_ACCUM
/* The histogram buckets that become Prometheus buckets: le = 4 us to 2^24 us. */
#define PROM_FIRST_BUCKET 2
#define PROM_LAST_BUCKET 24

const char *statsfmt_op_name(unsigned op)
{
	static const char *const names[] = {"unknown",	   "layernorm_fwd", "layernorm_bwd",
					    "rmsnorm_fwd", "rmsnorm_bwd",   "wgrad_accum"};
	return op < sizeof(names) / sizeof(names[0]) ? names[op] : "unknown";
}

/* A status as a lower-case label value ("ok", "invalid_argument"). */
static const char *status_label(unsigned wire, char *buf, size_t len)
{
	snprintf(buf, len, "%s", nc_status_name(-(int)wire));
	for (char *p = buf; *p; p++)
		*p = (char)tolower((unsigned char)*p);
	return buf;
}

static uint64_t op_jobs(const struct nc_op_stats *o)
{
	uint64_t n = 0;
	for (unsigned i = 0; i < STATUS_COUNT; i++)
		n += o->jobs_by_status[i];
	return n;
}

static uint64_t hist_count(const uint64_t *buckets)
{
	uint64_t n = 0;
	for (unsigned i = 0; i < NC_LATENCY_BUCKETS; i++)
		n += buckets[i];
	return n;
}

/* Whether an op is listed: the four common ones always, others once used. */
static bool op_listed(const struct nc_stats *s, unsigned op)
{
	return (op >= FIRST_OP && op <= LAST_COMMON_OP) || op_jobs(&s->ops[op]) > 0;
}

/* All ops' histograms added up. */
static void hist_all(const struct nc_stats *s, uint64_t *out)
{
	memset(out, 0, sizeof(uint64_t) * NC_LATENCY_BUCKETS);
	for (unsigned op = 0; op < NC_STATS_OPS; op++) {
		for (unsigned i = 0; i < NC_LATENCY_BUCKETS; i++)
			out[i] += s->ops[op].latency_buckets[i];
	}
}

static void device_label(const struct nc_device_stats *d, char *buf, size_t len)
{
	if (d->index < 0)
		snprintf(buf, len, "host");
	else
		snprintf(buf, len, "%d", (int)d->index);
}

/* ---- text ----------------------------------------------------------------------- */

/* The limits, and how often each kind of refusal happened. */
static void text_limits(FILE *out, const struct nc_stats *s)
{
	const struct nc_limits *l = &s->limits;
	fprintf(out,
		"\nlimits           %u clients; per connection: frame %u B, %u regions, "
		"%llu B mapped, %u jobs in flight, %llu B unread replies\nrejections      ",
		l->max_clients, l->max_frame, l->max_regions,
		(unsigned long long)l->max_mapped_bytes, l->max_jobs_in_flight,
		(unsigned long long)l->max_output_bytes);
	bool any = false;
	for (int i = 0; i < NC_REJECT_COUNT; i++) {
		if (s->rejections[i])
			fprintf(out, " %s=%llu", nc_reject_name(i),
				(unsigned long long)s->rejections[i]);
		any = any || s->rejections[i];
	}
	fprintf(out, "%s\n", any ? "" : " none");
}

void statsfmt_text(FILE *out, const struct nc_stats *s)
{
	fprintf(out,
		"backend          %s\nuptime           %.1f s\nclients          %u (%llu total)\n"
		"jobs             %llu ok, %llu failed, %u in flight\n"
		"regions          %u (%llu bytes mapped)\nbytes processed  %llu\n"
		"daemon rss       %llu bytes (heap %llu in use)\nreplies by status",
		s->backend, (double)s->uptime_ms / 1e3, s->clients,
		(unsigned long long)s->clients_total, (unsigned long long)s->jobs_ok,
		(unsigned long long)s->jobs_failed, s->jobs_in_flight, s->regions,
		(unsigned long long)s->mapped_bytes, (unsigned long long)s->bytes_processed,
		(unsigned long long)s->rss_bytes, (unsigned long long)s->heap_bytes);
	for (unsigned i = 0; i < STATUS_COUNT; i++) {
		if (s->errors_by_status[i])
			fprintf(out, " %s=%llu", nc_status_name(-(int)i),
				(unsigned long long)s->errors_by_status[i]);
	}
	if (s->has_mps)
		fprintf(out, "\nmps              %s", s->mps ? "yes" : "no (each hand-off between a "
				 "client's enqueued work and the daemon's is a context switch)");
	uint64_t all[NC_LATENCY_BUCKETS];
	hist_all(s, all);
	fprintf(out,
		"\nlatency          p50 %.0f us, p90 %.0f us, p99 %.0f us (%llu jobs that ran)\n",
		nc_latency_quantile_us(all, 0.50), nc_latency_quantile_us(all, 0.90),
		nc_latency_quantile_us(all, 0.99), (unsigned long long)hist_count(all));
	fprintf(out, "\n%-14s %10s %8s %12s %10s %10s %10s %10s\n", "op", "ok", "failed", "bytes",
		"p50_us", "p90_us", "p99_us", "mean_us");
	for (unsigned op = 0; op < NC_STATS_OPS; op++) {
		const struct nc_op_stats *o = &s->ops[op];
		if (!op_listed(s, op))
			continue;
		uint64_t ran = hist_count(o->latency_buckets), jobs = op_jobs(o);
		fprintf(out, "%-14s %10llu %8llu %12llu %10.0f %10.0f %10.0f %10.0f\n",
			statsfmt_op_name(op), (unsigned long long)o->jobs_by_status[0],
			(unsigned long long)(jobs - o->jobs_by_status[0]),
			(unsigned long long)o->bytes,
			nc_latency_quantile_us(o->latency_buckets, 0.50),
			nc_latency_quantile_us(o->latency_buckets, 0.90),
			nc_latency_quantile_us(o->latency_buckets, 0.99),
			ran ? (double)o->latency_us_sum / (double)ran : 0.0);
	}
	if (s->device_count)
		fprintf(out, "\n%-8s %10s %8s %14s %10s %12s %12s\n", "device", "jobs_ok", "failed",
			"bytes", "busy_s", "cache_hits", "cache_misses");
	for (uint32_t i = 0; i < s->device_count; i++) {
		const struct nc_device_stats *d = &s->devices[i];
		char label[16], hits[24] = "-", misses[24] = "-";
		device_label(d, label, sizeof(label));
		if (d->has_variant_cache) {
			snprintf(hits, sizeof(hits), "%llu",
				 (unsigned long long)d->variant_cache_hits);
			snprintf(misses, sizeof(misses), "%llu",
				 (unsigned long long)d->variant_cache_misses);
		}
		fprintf(out, "%-8s %10llu %8llu %14llu %10.3f %12s %12s\n", label,
			(unsigned long long)d->jobs_ok, (unsigned long long)d->jobs_failed,
			(unsigned long long)d->bytes, (double)d->busy_us / 1e6, hits, misses);
	}
	text_limits(out, s);
}

/* ---- JSON ----------------------------------------------------------------------- */

static void json_percentiles(FILE *out, const uint64_t *buckets)
{
	fprintf(out, "{\"p50\":%.1f,\"p90\":%.1f,\"p99\":%.1f}",
		nc_latency_quantile_us(buckets, 0.5), nc_latency_quantile_us(buckets, 0.9),
		nc_latency_quantile_us(buckets, 0.99));
}

static void json_op(FILE *out, const struct nc_op_stats *o)
{
	fprintf(out, "{\"jobs_by_status\":{");
	for (unsigned i = 0; i < STATUS_COUNT; i++)
		fprintf(out, "%s\"%s\":%llu", i ? "," : "", nc_status_name(-(int)i),
			(unsigned long long)o->jobs_by_status[i]);
	fprintf(out, "},\"bytes\":%llu,\"device_us\":%llu,\"latency_us_sum\":%llu,\"latency_us\":",
		(unsigned long long)o->bytes, (unsigned long long)o->device_us,
		(unsigned long long)o->latency_us_sum);
	json_percentiles(out, o->latency_buckets);
	fprintf(out, ",\"latency_buckets\":[");
	for (unsigned i = 0; i < NC_LATENCY_BUCKETS; i++)
		fprintf(out, "%s%llu", i ? "," : "", (unsigned long long)o->latency_buckets[i]);
	fprintf(out, "]}");
}

static void json_device(FILE *out, const struct nc_device_stats *d)
{
	fprintf(out,
		"{\"index\":%d,\"jobs_ok\":%llu,\"jobs_failed\":%llu,\"bytes\":%llu,"
		"\"busy_us\":%llu",
		(int)d->index, (unsigned long long)d->jobs_ok, (unsigned long long)d->jobs_failed,
		(unsigned long long)d->bytes, (unsigned long long)d->busy_us);
	if (d->has_variant_cache)
		fprintf(out, ",\"variant_cache_hits\":%llu,\"variant_cache_misses\":%llu",
			(unsigned long long)d->variant_cache_hits,
			(unsigned long long)d->variant_cache_misses);
	fprintf(out, "}");
}

void statsfmt_json(FILE *out, const struct nc_stats *s)
{
	fprintf(out,
		"{\"backend\":\"%s\",\"uptime_ms\":%llu,\"clients\":%u,\"clients_total\":%llu,"
		"\"jobs_ok\":%llu,\"jobs_failed\":%llu,\"jobs_in_flight\":%u,\"regions\":%u,"
		"\"mapped_bytes\":%llu,\"rss_bytes\":%llu,\"heap_bytes\":%llu,\"bytes_processed\":%llu,"
		"\"replies_by_status\":{",
		s->backend, (unsigned long long)s->uptime_ms, s->clients,
		(unsigned long long)s->clients_total, (unsigned long long)s->jobs_ok,
		(unsigned long long)s->jobs_failed, s->jobs_in_flight, s->regions,
		(unsigned long long)s->mapped_bytes, (unsigned long long)s->rss_bytes,
		(unsigned long long)s->heap_bytes, (unsigned long long)s->bytes_processed);
	for (unsigned i = 0; i < STATUS_COUNT; i++)
		fprintf(out, "%s\"%s\":%llu", i ? "," : "", nc_status_name(-(int)i),
			(unsigned long long)s->errors_by_status[i]);
	uint64_t all[NC_LATENCY_BUCKETS];
	hist_all(s, all);
	fprintf(out, "},");
	if (s->has_mps)
		fprintf(out, "\"mps\":%s,", s->mps ? "true" : "false");
	fprintf(out, "\"latency_us\":");
	json_percentiles(out, all);
	fprintf(out, ",\"ops\":{");
	bool first = true;
	for (unsigned op = 0; op < NC_STATS_OPS; op++) {
		if (!op_listed(s, op))
			continue;
		fprintf(out, "%s\"%s\":", first ? "" : ",", statsfmt_op_name(op));
		json_op(out, &s->ops[op]);
		first = false;
	}
	fprintf(out, "},\"devices\":[");
	for (uint32_t i = 0; i < s->device_count; i++) {
		fprintf(out, "%s", i ? "," : "");
		json_device(out, &s->devices[i]);
	}
	const struct nc_limits *l = &s->limits;
	fprintf(out,
		"],\"limits\":{\"max_clients\":%u,\"max_frame\":%u,\"max_regions\":%u,"
		"\"max_mapped_bytes\":%llu,\"max_jobs_in_flight\":%u,\"max_output_bytes\":%llu,"
		"\"max_cols\":%llu},\"rejections\":{",
		l->max_clients, l->max_frame, l->max_regions,
		(unsigned long long)l->max_mapped_bytes, l->max_jobs_in_flight,
		(unsigned long long)l->max_output_bytes, (unsigned long long)l->max_cols);
	for (int i = 0; i < NC_REJECT_COUNT; i++)
		fprintf(out, "%s\"%s\":%llu", i ? "," : "", nc_reject_name(i),
			(unsigned long long)s->rejections[i]);
	fprintf(out, "}}\n");
}

/* ---- Prometheus ----------------------------------------------------------------- */

static void prom_family(FILE *out, const char *name, const char *type, const char *help)
{
	fprintf(out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void prom_ops(FILE *out, const struct nc_stats *s)
{
	char status[32];
	prom_family(out, "normd_jobs_total", "counter", "Jobs answered, by op and reply status.");
	for (unsigned op = 0; op < NC_STATS_OPS; op++) {
		if (!op_listed(s, op))
			continue;
		for (unsigned i = 0; i < STATUS_COUNT; i++)
			fprintf(out, "normd_jobs_total{op=\"%s\",status=\"%s\"} %llu\n",
				statsfmt_op_name(op), status_label(i, status, sizeof(status)),
				(unsigned long long)s->ops[op].jobs_by_status[i]);
	}
	prom_family(out, "normd_processed_bytes_total", "counter",
		    "Bytes read and written by jobs that succeeded, by op.");
	for (unsigned op = 0; op < NC_STATS_OPS; op++) {
		if (op_listed(s, op))
			fprintf(out, "normd_processed_bytes_total{op=\"%s\"} %llu\n",
				statsfmt_op_name(op), (unsigned long long)s->ops[op].bytes);
	}
	prom_family(out, "normd_job_compute_seconds_total", "counter",
		    "Compute time of the jobs that ran, by op.");
	for (unsigned op = 0; op < NC_STATS_OPS; op++) {
		if (op_listed(s, op))
			fprintf(out, "normd_job_compute_seconds_total{op=\"%s\"} %.6f\n",
				statsfmt_op_name(op), (double)s->ops[op].device_us / 1e6);
	}
}

static void prom_histograms(FILE *out, const struct nc_stats *s)
{
	prom_family(out, "normd_job_latency_seconds", "histogram",
		    "Time from a job's arrival at the daemon to its completion, jobs that ran.");
	for (unsigned op = 0; op < NC_STATS_OPS; op++) {
		if (!op_listed(s, op))
			continue;
		const struct nc_op_stats *o = &s->ops[op];
		const char *name = statsfmt_op_name(op);
		uint64_t cumulative = 0;
		/*
		 * Bucket i < last counts jobs under 2^i us: le is that bound in
		 * seconds. Only 4 us to 16.8 s get a series of their own, to keep
		 * the series count down; the rest fold into their neighbours.
		 */
		for (unsigned i = 0; i + 1 < NC_LATENCY_BUCKETS; i++) {
			cumulative += o->latency_buckets[i];
			if (i < PROM_FIRST_BUCKET || i > PROM_LAST_BUCKET)
				continue;
			fprintf(out,
				"normd_job_latency_seconds_bucket{op=\"%s\",le=\"%.9g\"} %llu\n",
				name, (double)(1ull << i) / 1e6, (unsigned long long)cumulative);
		}
		cumulative += o->latency_buckets[NC_LATENCY_BUCKETS - 1];
		fprintf(out, "normd_job_latency_seconds_bucket{op=\"%s\",le=\"+Inf\"} %llu\n", name,
			(unsigned long long)cumulative);
		fprintf(out, "normd_job_latency_seconds_sum{op=\"%s\"} %.6f\n", name,
			(double)o->latency_us_sum / 1e6);
		fprintf(out, "normd_job_latency_seconds_count{op=\"%s\"} %llu\n", name,
			(unsigned long long)cumulative);
	}
}

static void prom_devices(FILE *out, const struct nc_stats *s)
{
	char label[16];
	bool cache = false;
	prom_family(out, "normd_device_jobs_total", "counter",
		    "Jobs that ran on a device, by outcome.");
	for (uint32_t i = 0; i < s->device_count; i++) {
		const struct nc_device_stats *d = &s->devices[i];
		device_label(d, label, sizeof(label));
		fprintf(out, "normd_device_jobs_total{device=\"%s\",status=\"ok\"} %llu\n", label,
			(unsigned long long)d->jobs_ok);
		fprintf(out, "normd_device_jobs_total{device=\"%s\",status=\"failed\"} %llu\n",
			label, (unsigned long long)d->jobs_failed);
		cache = cache || d->has_variant_cache;
	}
	prom_family(out, "normd_device_busy_seconds_total", "counter",
		    "Summed compute time of the jobs that ran on a device.");
	for (uint32_t i = 0; i < s->device_count; i++) {
		device_label(&s->devices[i], label, sizeof(label));
		fprintf(out, "normd_device_busy_seconds_total{device=\"%s\"} %.6f\n", label,
			(double)s->devices[i].busy_us / 1e6);
	}
	if (!cache)
		return; /* the CPU backend has no variant cache */
	prom_family(out, "normd_variant_cache_hits_total", "counter",
		    "Jobs whose kernel variant was already in the device's cache.");
	for (uint32_t i = 0; i < s->device_count; i++) {
		device_label(&s->devices[i], label, sizeof(label));
		fprintf(out, "normd_variant_cache_hits_total{device=\"%s\"} %llu\n", label,
			(unsigned long long)s->devices[i].variant_cache_hits);
	}
	prom_family(out, "normd_variant_cache_misses_total", "counter",
		    "Jobs whose kernel variant had to be chosen (or tuned) first.");
	for (uint32_t i = 0; i < s->device_count; i++) {
		device_label(&s->devices[i], label, sizeof(label));
		fprintf(out, "normd_variant_cache_misses_total{device=\"%s\"} %llu\n", label,
			(unsigned long long)s->devices[i].variant_cache_misses);
	}
}

static void prom_rejections(FILE *out, const struct nc_stats *s)
{
	prom_family(out, "normd_rejections_total", "counter",
		    "Connections, frames and requests the daemon refused, by reason.");
	for (int i = 0; i < NC_REJECT_COUNT; i++)
		fprintf(out, "normd_rejections_total{reason=\"%s\"} %llu\n", nc_reject_name(i),
			(unsigned long long)s->rejections[i]);
	const struct nc_limits *l = &s->limits;
	const struct {
		const char *name;
		uint64_t value;
	} limits[] = {
		{"max_clients", l->max_clients},
		{"max_frame_bytes", l->max_frame},
		{"max_regions", l->max_regions},
		{"max_mapped_bytes", l->max_mapped_bytes},
		{"max_jobs_in_flight", l->max_jobs_in_flight},
		{"max_output_bytes", l->max_output_bytes},
	};
	prom_family(out, "normd_limit", "gauge",
		    "A configured limit (clients: all together; others per connection).");
	for (size_t i = 0; i < sizeof(limits) / sizeof(limits[0]); i++)
		fprintf(out, "normd_limit{name=\"%s\"} %llu\n", limits[i].name,
			(unsigned long long)limits[i].value);
}

static void prom_gauge(FILE *out, const char *name, const char *help, double value)
{
	prom_family(out, name, "gauge", help);
	fprintf(out, "%s %.15g\n", name, value);
}

void statsfmt_prometheus(FILE *out, const struct nc_stats *s, const char *version)
{
	char status[32];
	prom_gauge(out, "normd_up", "Whether normctl could read the daemon's counters.", 1);
	prom_family(out, "normd_info", "gauge", "The daemon's version and backend (always 1).");
	fprintf(out, "normd_info{version=\"%s\",backend=\"%s\"} 1\n", version ? version : "",
		s->backend);
	if (s->has_mps)
		prom_gauge(out, "normd_mps", "Whether the daemon's CUDA contexts run under NVIDIA MPS.",
			   s->mps);
	prom_gauge(out, "normd_uptime_seconds", "Seconds since the daemon started.",
		   (double)s->uptime_ms / 1e3);
	prom_gauge(out, "normd_clients", "Open client connections.", s->clients);
	prom_family(out, "normd_connections_total", "counter", "Client connections accepted.");
	fprintf(out, "normd_connections_total %llu\n", (unsigned long long)s->clients_total);
	prom_gauge(out, "normd_jobs_in_flight", "Jobs submitted and not yet answered.",
		   s->jobs_in_flight);
	prom_gauge(out, "normd_regions", "Registered memory regions, all clients.", s->regions);
	prom_gauge(out, "normd_mapped_bytes", "Bytes of registered memory the daemon maps.",
		   (double)s->mapped_bytes);
	prom_gauge(out, "normd_resident_memory_bytes", "The daemon's resident set size.",
		   (double)s->rss_bytes);
	prom_gauge(out, "normd_heap_bytes", "Bytes the daemon has allocated and not freed.",
		   (double)s->heap_bytes);
	prom_family(out, "normd_replies_total", "counter",
		    "Replies of every kind the daemon sent, by status.");
	for (unsigned i = 0; i < STATUS_COUNT; i++)
		fprintf(out, "normd_replies_total{status=\"%s\"} %llu\n",
			status_label(i, status, sizeof(status)),
			(unsigned long long)s->errors_by_status[i]);
	prom_ops(out, s);
	prom_histograms(out, s);
	prom_devices(out, s);
	prom_rejections(out, s);
}

void statsfmt_prometheus_down(FILE *out)
{
	prom_gauge(out, "normd_up", "Whether normctl could read the daemon's counters.", 0);
}
