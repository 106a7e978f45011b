/*
 * normctl: look at and exercise a running normd through libnormclient.
 *
 *   normctl [--socket PATH] ping
 *   normctl [--socket PATH] stats [--json | --prometheus]
 *   normctl [--socket PATH] variants
 *   normctl [--socket PATH] demo [--rows N] [--cols N]
 *
 * `demo` runs LayerNorm and RMSNorm forward and backward (memory_efficient
 * off and on) in several dtypes through the daemon on random data, then the
 * norm variants (residual add "+add", in place "+inplace", zero-centered
 * and offset weights, FP8 output "+fp8_e4m3"/"+fp8_e5m2") and the
 * weight-gradient GEMM, checks each result against the float64 reference
 * and prints one line per job. Variants the daemon's backend does not run
 * are listed as skipped. It exits non-zero if any job fails or misses its
 * tolerance.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/tools/jobkit.h"
#include "client/tools/statsfmt.h"
#include "normclient.h"

#define DEFAULT_SOCKET "/run/normd/0.sock"
#define TIMEOUT_MS 60000

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmd_ping(nc_conn *conn)
{
	double t0 = now_us();
	int rc = nc_ping(conn, TIMEOUT_MS);
	if (rc) {
		fprintf(stderr, "normctl: ping: %s: %s\n", nc_strerror(rc), nc_last_error());
		return 1;
	}
	const struct nc_server_info *info = nc_server_info(conn);
	printf("pong from normd %s (backend %s, pid %u) in %.0f us\n", info->version, info->backend,
	       info->server_pid, now_us() - t0);
	return 0;
}

enum stats_format { STATS_TEXT, STATS_JSON, STATS_PROMETHEUS };

static int cmd_stats(nc_conn *conn, enum stats_format format)
{
	struct nc_stats s;
	int rc = nc_stats_get(conn, TIMEOUT_MS, &s);
	if (rc) {
		fprintf(stderr, "normctl: stats: %s: %s\n", nc_strerror(rc), nc_last_error());
		if (format == STATS_PROMETHEUS)
			statsfmt_prometheus_down(stdout);
		return 1;
	}
	if (format == STATS_JSON)
		statsfmt_json(stdout, &s);
	else if (format == STATS_PROMETHEUS)
		statsfmt_prometheus(stdout, &s, nc_server_info(conn)->version);
	else
		statsfmt_text(stdout, &s);
	return 0;
}

static int cmd_variants(nc_conn *conn)
{
	struct nc_variant_info *list;
	size_t n;
	int rc = nc_variants_get(conn, TIMEOUT_MS, &list, &n);
	if (rc) {
		fprintf(stderr, "normctl: variants: %s: %s\n", nc_strerror(rc), nc_last_error());
		return 1;
	}
	/* Widths: "layernorm_bwd+me", and variant names up to about 40 characters. */
	printf("%-6s %-16s %-10s %-8s %-40s %-8s %s\n", "device", "op", "dtypes", "cols",
	       "variant", "source", "uses");
	for (size_t i = 0; i < n; i++) {
		const struct nc_variant_info *v = &list[i];
		char dtypes[16], op[32];
		snprintf(dtypes, sizeof(dtypes), "%s/%s", jobkit_dtype_name(v->dtype),
			 jobkit_dtype_name(v->weight_dtype));
		snprintf(op, sizeof(op), "%s%s", jobkit_op_name(v->op), (v->flags & 1) ? "+me" : "");
		printf("%-6d %-16s %-10s %-8llu %-40s %-8s %llu\n", v->device, op, dtypes,
		       (unsigned long long)v->cols, v->variant, v->source,
		       (unsigned long long)v->uses);
	}
	if (n == 0)
		printf("(empty: the cpu backend has no variants, or no job has run yet)\n");
	nc_variants_free(list);
	return 0;
}

#define LABEL_WIDTH 36

/* One demo job; returns true if it ran and matched the reference. */
static bool demo_one(nc_conn *conn, const struct jobkit_spec *spec)
{
	struct jobkit kit;
	struct nc_job_result result;
	struct jobkit_report report = {0};
	char label[96], variants[64];
	snprintf(label, sizeof(label), "%s%s%s%s", jobkit_op_name(spec->op),
		 jobkit_variant_label(spec, variants, sizeof(variants)),
		 spec->memory_efficient ? "+mem_eff" : "",
		 spec->op == NC_WGRAD_ACCUM ? (spec->accumulate ? "+=" : "=") : "");
	char dtypes[16];
	snprintf(dtypes, sizeof(dtypes), "%s/%s", jobkit_dtype_name(spec->dtype),
		 jobkit_dtype_name(spec->weight_dtype ? spec->weight_dtype : spec->dtype));
	int rc = jobkit_create(conn, spec, &kit);
	if (rc) {
		printf("%-*s %6llux%-6llu %-9s FAILED to set up: %s\n", LABEL_WIDTH, label,
		       (unsigned long long)spec->rows, (unsigned long long)spec->cols, dtypes,
		       nc_last_error());
		return false;
	}
	double t0 = now_us();
	rc = nc_job_run_ext(conn, &kit.job, &kit.ext, TIMEOUT_MS, &result);
	double latency = now_us() - t0;
	bool ok = rc == NC_OK && jobkit_check(&kit, &report);
	printf("%-*s %6llux%-6llu %-9s %10.3g %10.3g %10.3g %9.0f  %-7s %s\n", LABEL_WIDTH, label,
	       (unsigned long long)spec->rows, (unsigned long long)spec->cols, dtypes,
	       report.max_abs_err, report.max_rel_err, report.rel_l2_err, latency,
	       ok ? "ok" : "FAILED",
	       rc ? result.message : (ok ? result.variant : report.detail));
	jobkit_destroy(&kit);
	return ok;
}

/*
 * The norm variants of issue 19, one row each (docs/VARIANTS.md): residual
 * add (and vLLM's in-place form), zero-centered and offset weights, FP8
 * output, forward and backward where they apply.
 */
struct demo_variant {
	enum nc_op op;
	enum nc_dtype dtype;
	bool residual, in_place, memory_efficient;
	float weight_offset;
	enum nc_dtype y_dtype;
};

static const struct demo_variant demo_variants[] = {
	{NC_LAYERNORM_FWD, NC_BF16, true, false, false, 0, 0},
	{NC_RMSNORM_FWD, NC_BF16, true, false, false, 0, 0},
	{NC_RMSNORM_FWD, NC_F16, true, true, false, 0, 0},
	{NC_LAYERNORM_BWD, NC_BF16, true, false, false, 0, 0},
	{NC_RMSNORM_BWD, NC_F32, true, false, true, 0, 0},
	{NC_RMSNORM_BWD, NC_BF16, true, true, false, 0, 0},
	{NC_LAYERNORM_FWD, NC_BF16, false, false, false, 1.0f, 0},
	{NC_LAYERNORM_BWD, NC_BF16, false, false, true, 1.0f, 0},
	{NC_RMSNORM_FWD, NC_BF16, false, false, false, 1.0f, 0},
	{NC_RMSNORM_BWD, NC_F32, false, false, false, 1.0f, 0},
	{NC_LAYERNORM_FWD, NC_BF16, false, false, false, 0, NC_F8E4M3},
	{NC_RMSNORM_FWD, NC_F16, false, false, false, 0, NC_F8E5M2},
	{NC_RMSNORM_FWD, NC_BF16, true, false, false, 1.0f, NC_F8E4M3},
};

/* Runs the variant rows the daemon runs; counts them in *total and *failed. */
static void demo_run_variants(nc_conn *conn, uint64_t rows, uint64_t cols, bool on_device,
			      int device, int *total, int *failed)
{
	uint32_t features = nc_server_norm_features(conn);
	for (size_t i = 0; i < sizeof(demo_variants) / sizeof(demo_variants[0]); i++) {
		const struct demo_variant *v = &demo_variants[i];
		struct jobkit_spec spec = {
			.op = v->op, .rows = rows, .cols = cols, .dtype = v->dtype,
			.gamma = true, .beta = true, .memory_efficient = v->memory_efficient,
			.residual = v->residual, .in_place = v->in_place,
			.weight_offset = v->weight_offset, .y_dtype = v->y_dtype,
			.seed = 1000 + (uint64_t)*total, .on_device = on_device, .device = device,
		};
		uint32_t missing = jobkit_features(&spec) & ~features;
		if (missing) {
			char variants[64];
			printf("%-*s %6llux%-6llu %-9s skipped: the %s backend does not run it "
			       "(features 0x%x)\n",
			       LABEL_WIDTH, jobkit_op_name(spec.op), (unsigned long long)rows,
			       (unsigned long long)cols,
			       jobkit_variant_label(&spec, variants, sizeof(variants)),
			       nc_server_info(conn)->backend, missing);
			continue;
		}
		*failed += !demo_one(conn, &spec);
		(*total)++;
	}
}

static int cmd_demo(nc_conn *conn, uint64_t rows, uint64_t cols)
{
	static const enum nc_op ops[] = {NC_LAYERNORM_FWD, NC_RMSNORM_FWD, NC_LAYERNORM_BWD,
					 NC_RMSNORM_BWD};
	static const struct {
		enum nc_dtype dtype, weight;
	} types[] = {{NC_F32, 0}, {NC_BF16, 0}, {NC_F16, 0}, {NC_BF16, NC_F32}};
	int failed = 0, total = 0;
	const struct nc_server_info *info = nc_server_info(conn);
	bool on_device = !strcmp(info->backend, "cuda");
	int device = info->device_index[0];
	printf("normd demo on the %s backend; errors against the float64 reference\n"
	       "(rel = max|out-ref| / max|ref| per output; L2 = ||out-ref|| / ||ref||)\n\n",
	       nc_server_info(conn)->backend);
	printf("%-*s %13s %-9s %10s %10s %10s %9s  %-7s %s\n", LABEL_WIDTH, "job", "shape",
	       "dtype", "max_abs", "max_rel", "rel_L2", "lat_us", "result", "variant");
	for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
		for (size_t o = 0; o < sizeof(ops) / sizeof(ops[0]); o++) {
			bool bwd = ops[o] == NC_LAYERNORM_BWD || ops[o] == NC_RMSNORM_BWD;
			for (int mem_eff = 0; mem_eff <= (bwd ? 1 : 0); mem_eff++) {
				struct jobkit_spec spec = {
					.op = ops[o], .rows = rows, .cols = cols,
					.dtype = types[t].dtype, .weight_dtype = types[t].weight,
					.gamma = true, .beta = true, .memory_efficient = mem_eff,
					.seed = 1000 + (uint64_t)total,
					.on_device = on_device, .device = device,
				};
				failed += !demo_one(conn, &spec);
				total++;
			}
		}
	}
	demo_run_variants(conn, rows, cols, on_device, device, &total, &failed);
	/* The weight-gradient GEMM: main_grad[out, in] (+)= dy^T x, tokens = rows. */
	for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
		for (int accumulate = 0; accumulate <= 1; accumulate++) {
			struct jobkit_spec spec = {
				.op = NC_WGRAD_ACCUM, .rows = rows, .cols = cols / 4 + 1,
				.out_features = cols / 4 + 3, .dtype = types[t].dtype,
				/* main_grad in the activation dtype, or f32 (bf16/f32). */
				.weight_dtype = types[t].weight ? types[t].weight : types[t].dtype,
				.accumulate = accumulate,
				.seed = 1000 + (uint64_t)total, .on_device = on_device, .device = device,
			};
			failed += !demo_one(conn, &spec);
			total++;
		}
	}
	printf("\n%d passed, %d failed\n", total - failed, failed);
	return failed ? 1 : 0;
}

static void usage(void)
{
	fprintf(stderr, "usage: normctl [--socket PATH] ping | stats [--json | --prometheus] | variants | "
			"demo [--rows N] [--cols N]\n");
}

int main(int argc, char **argv)
{
	const char *socket_path = getenv("NORMD_SOCKET") ? getenv("NORMD_SOCKET") : DEFAULT_SOCKET;
	const char *command = NULL;
	enum stats_format format = STATS_TEXT;
	uint64_t rows = 256, cols = 1024;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--socket") && i + 1 < argc)
			socket_path = argv[++i];
		else if (!strcmp(argv[i], "--json"))
			format = STATS_JSON;
		else if (!strcmp(argv[i], "--prometheus"))
			format = STATS_PROMETHEUS;
		else if (!strcmp(argv[i], "--rows") && i + 1 < argc)
			rows = strtoull(argv[++i], NULL, 10);
		else if (!strcmp(argv[i], "--cols") && i + 1 < argc)
			cols = strtoull(argv[++i], NULL, 10);
		else if (!command && argv[i][0] != '-')
			command = argv[i];
		else {
			usage();
			return 2;
		}
	}
	if (!command || rows == 0 || cols == 0) {
		usage();
		return 2;
	}
	nc_conn *conn;
	int rc = nc_connect(socket_path, "normctl", 10000, &conn);
	if (rc) {
		fprintf(stderr, "normctl: %s\n", nc_last_error());
		/* A scrape of a stopped daemon still yields a valid file: normd_up 0. */
		if (format == STATS_PROMETHEUS && !strcmp(command, "stats"))
			statsfmt_prometheus_down(stdout);
		return 1;
	}
	int status;
	if (!strcmp(command, "ping"))
		status = cmd_ping(conn);
	else if (!strcmp(command, "stats"))
		status = cmd_stats(conn, format);
	else if (!strcmp(command, "demo"))
		status = cmd_demo(conn, rows, cols);
	else if (!strcmp(command, "variants"))
		status = cmd_variants(conn);
	else {
		usage();
		status = 2;
	}
	nc_close(conn);
	return status;
}
