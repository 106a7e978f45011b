/*
 * normstress's summary: the text on stdout and the JSON of --json (stress.h).
 */
#include "client/tools/stress.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

bool run_passed(const struct stress *st, const struct totals *t)
{
	return t->count[C_UNEXPECTED] == 0 && t->count[C_MISMATCHES] == 0 &&
	       st->child_failures == 0 && st->have_after;
}

static void print_status_map(const uint64_t *by_status)
{
	bool any = false;
	for (unsigned i = 1; i < STATUS_SLOTS; i++) {
		if (!by_status[i])
			continue;
		printf(" %s=%llu", status_slot_name(i), (unsigned long long)by_status[i]);
		any = true;
	}
	printf("%s\n", any ? "" : " none");
}

/* Jobs the daemon ran on device `index` during the run, from its counters before and after. */
static uint64_t device_jobs(const struct stress *st, int index)
{
	uint64_t n[2] = {0, 0};
	const struct nc_stats *s[2] = {&st->before, &st->after};
	for (int k = 0; k < 2; k++)
		for (uint32_t i = 0; i < s[k]->device_count && i < NC_STATS_DEVICES; i++)
			if (s[k]->devices[i].index == index)
				n[k] = s[k]->devices[i].jobs_ok + s[k]->devices[i].jobs_failed;
	return n[1] - n[0];
}

/* Where the jobs ran, by the daemon's per-device counters (other clients' jobs included). */
static void print_devices(const struct stress *st)
{
	if (!st->opt.on_device || !st->have_before || !st->have_after)
		return;
	printf("devices    ");
	for (unsigned i = 0; i < st->after.device_count && i < NC_STATS_DEVICES; i++)
		printf(" GPU %d: %llu jobs%s", st->after.devices[i].index,
		       (unsigned long long)device_jobs(st, st->after.devices[i].index),
		       i + 1 < st->after.device_count ? "," : "");
	printf("\n");
}

void report_text(const struct stress *st, const struct totals *t, double elapsed)
{
	const struct stress_opts *o = &st->opt;
	const uint64_t *n = t->count;
	printf("normstress: %u processes x %u threads, %.1f s, %s backend, mode %s, seed %llu\n",
	       o->procs, o->threads, elapsed, st->backend, mode_names[o->mode],
	       (unsigned long long)o->seed);
	printf("jobs        %llu ok, %.1f jobs/s, %.1f MB/s\n", (unsigned long long)n[C_JOBS_OK],
	       (double)n[C_JOBS_OK] / elapsed, (double)n[C_BYTES] / elapsed / 1e6);
	printf("latency     p50 %.3f ms  p90 %.3f ms  p99 %.3f ms  p99.9 %.3f ms  max %.3f ms\n",
	       totals_quantile_us(t, 0.50) / 1e3, totals_quantile_us(t, 0.90) / 1e3,
	       totals_quantile_us(t, 0.99) / 1e3, totals_quantile_us(t, 0.999) / 1e3,
	       (double)t->max_ns / 1e9 * 1e3);
	printf("verify      %llu checked, %llu mismatches\n", (unsigned long long)n[C_VERIFIED],
	       (unsigned long long)n[C_MISMATCHES]);
	printf("invalid     %llu sent, %llu answered as expected; statuses:",
	       (unsigned long long)n[C_BAD_SENT], (unsigned long long)n[C_BAD_EXPECTED]);
	print_status_map(t->bad_status);
	printf("chaos       %u processes killed, %llu requests lost with them, "
	       "%llu regions created\n",
	       st->kills, (unsigned long long)st->lost, (unsigned long long)n[C_KITS]);
	printf("errors      %llu unexpected, %u client processes failed; valid jobs failed:",
	       (unsigned long long)n[C_UNEXPECTED], st->child_failures);
	print_status_map(t->valid_status);
	print_devices(st);
	if (st->have_after)
		printf("daemon      up; rss %.1f MiB before, %.1f MiB after (%+.1f%%); heap %+lld "
		       "bytes; %u regions, %u jobs left\n",
		       (double)st->before.rss_bytes / 1048576.0,
		       (double)st->after.rss_bytes / 1048576.0,
		       st->before.rss_bytes ? 100.0 * ((double)st->after.rss_bytes /
							(double)st->before.rss_bytes - 1.0)
					    : 0.0,
		       (long long)st->after.heap_bytes - (long long)st->before.heap_bytes,
		       st->after.regions, st->after.jobs_in_flight);
	else
		printf("daemon      NOT REACHABLE after the run\n");
	printf("result      %s\n", run_passed(st, t) ? "PASS" : "FAIL");
}

static void json_status_map(FILE *f, const char *key, const uint64_t *by_status)
{
	bool first = true;
	fprintf(f, "\"%s\":{", key);
	for (unsigned i = 1; i < STATUS_SLOTS; i++) {
		if (!by_status[i])
			continue;
		fprintf(f, "%s\"%s\":%llu", first ? "" : ",", status_slot_name(i),
			(unsigned long long)by_status[i]);
		first = false;
	}
	fprintf(f, "}");
}

static void json_body(FILE *f, const struct stress *st, const struct totals *t, double elapsed)
{
	const struct stress_opts *o = &st->opt;
	const uint64_t *n = t->count;
	fprintf(f, "{\"procs\":%u,\"threads\":%u,\"inflight\":%u,\"mode\":\"%s\","
		   "\"backend\":\"%s\",\"seed\":%llu,\"elapsed_s\":%.3f,\"jobs_ok\":%llu,"
		   "\"jobs_per_s\":%.1f,\"bytes\":%llu,\"bytes_per_s\":%.0f,",
		o->procs, o->threads, o->inflight, mode_names[o->mode],
		st->backend, (unsigned long long)o->seed, elapsed, (unsigned long long)n[C_JOBS_OK],
		(double)n[C_JOBS_OK] / elapsed, (unsigned long long)n[C_BYTES],
		(double)n[C_BYTES] / elapsed);
	fprintf(f, "\"latency_us\":{\"p50\":%.1f,\"p90\":%.1f,\"p99\":%.1f,\"p99_9\":%.1f,"
		   "\"max\":%.1f},",
		totals_quantile_us(t, 0.50), totals_quantile_us(t, 0.90),
		totals_quantile_us(t, 0.99), totals_quantile_us(t, 0.999), (double)t->max_ns / 1e3);
	fprintf(f, "\"verified\":%llu,\"mismatches\":%llu,\"bad_sent\":%llu,\"bad_expected\":%llu,",
		(unsigned long long)n[C_VERIFIED], (unsigned long long)n[C_MISMATCHES],
		(unsigned long long)n[C_BAD_SENT], (unsigned long long)n[C_BAD_EXPECTED]);
	json_status_map(f, "bad_by_status", t->bad_status);
	fprintf(f, ",\"unexpected_errors\":%llu,", (unsigned long long)n[C_UNEXPECTED]);
	json_status_map(f, "failed_by_status", t->valid_status);
	fprintf(f, ",\"kills\":%u,\"lost_in_flight\":%llu,\"regions_created\":%llu,"
		   "\"child_failures\":%u,\"daemon_up\":%s,",
		st->kills, (unsigned long long)st->lost, (unsigned long long)n[C_KITS],
		st->child_failures, st->have_after ? "true" : "false");
	fprintf(f, "\"device_jobs\":{");
	for (unsigned i = 0; st->have_before && st->have_after && i < st->after.device_count &&
			     i < NC_STATS_DEVICES;
	     i++)
		fprintf(f, "%s\"%d\":%llu", i ? "," : "", st->after.devices[i].index,
			(unsigned long long)device_jobs(st, st->after.devices[i].index));
	fprintf(f, "},");
	fprintf(f, "\"daemon_rss_before\":%llu,\"daemon_rss_after\":%llu,"
		   "\"daemon_heap_before\":%llu,\"daemon_heap_after\":%llu,"
		   "\"daemon_regions_after\":%u,\"passed\":%s}\n",
		(unsigned long long)st->before.rss_bytes, (unsigned long long)st->after.rss_bytes,
		(unsigned long long)st->before.heap_bytes, (unsigned long long)st->after.heap_bytes,
		st->after.regions, run_passed(st, t) ? "true" : "false");
}

int report_json(const struct stress *st, const struct totals *t, double elapsed)
{
	FILE *f = fopen(st->opt.json_path, "w");
	if (!f) {
		fprintf(stderr, "normstress: cannot write %s: %s\n", st->opt.json_path,
			strerror(errno));
		return -1;
	}
	json_body(f, st, t, elapsed);
	if (fclose(f) != 0) {
		fprintf(stderr, "normstress: writing %s failed\n", st->opt.json_path);
		return -1;
	}
	return 0;
}
