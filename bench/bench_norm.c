/*
 * Effective bandwidth of normd's CUDA kernels (kernels/norm_cuda_*.cu).
 *
 * For LayerNorm and RMSNorm forward, backward and memory-efficient backward
 * (affine: gamma, and beta for LayerNorm; dgamma/dbeta computed), in bf16
 * and fp32 (fp16 when asked), at 2^28 elements per shape and cols in
 * {128 ... 32768}, it times nk_cuda_norm with CUDA events (median of REPS
 * launches after WARMUP, queued back to back as bench_torch.py queues
 * PyTorch's, alternating between two buffer sets, each far bigger than L2;
 * a backward interleaved with its memory-efficient twin) and counts every
 * tensor read or written once. The device's copy bandwidth is measured
 * first with a large device-to-device cudaMemcpy, timed the same way,
 * counting bytes read plus bytes written. Each shape runs the default
 * variant and then every autotuning candidate; the best is reported as
 * "tuned".
 *
 * With "variants" (or "add", "offset", "fp8"), the same ops with the norm
 * variants of docs/VARIANTS.md follow each shape's plain rows, all run by
 * the fused family: "+add" (forward s = x + residual, writing s and y;
 * backward with ds), LayerNorm "+zero_centered" and RMSNorm "+offset"
 * (weight offset 1), and "+fp8_e4m3" (forward only, y one byte an element,
 * scale in, amax out).
 *
 * Output, one line per measurement, key=value (bench/run.sh joins them with
 * bench/bench_torch.py's into one table, bench/bench_peers.py with its
 * peers'):
 *   device name="..." sms=N
 *   copy gbps=G
 *   normd op=ln_fwd dtype=bf16 cols=C rows=R bytes=B us=T gbps=G pct=P variant=V
 *         tuned_gbps=G tuned_pct=P tuned_variant=V
 * "--plan" prints, without touching the GPU, the rows a run with the same
 * arguments would measure and the bytes each counts:
 *   plan op=ln_fwd+add dtype=bf16 cols=C rows=R bytes=B
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "client/tools/rng.h"
#include "kernels/norm_kernels.h"

#define TOTAL_ELEMS ((int64_t)1 << 28)
#define WARMUP 3
#define REPS 25
#define TUNE_REPS 9
#define MAX_CANDIDATES 12
#define MAX_INTERLEAVED 2 /* jobs timed in turn: a backward and its memory-efficient twin */
#define EPS 1e-5f
#define WEIGHT_OFFSET 1.0f /* +zero_centered and +offset rows: Megatron's and Gemma's 1 + w */
#define FP8_SCALE 64.0f	   /* +fp8_e4m3 rows: |y| up to about 7 lands inside e4m3's 448 */

static struct nk_device_info dev;
static double copy_gbps;

static void check(cudaError_t err, const char *what)
{
	if (err == cudaSuccess)
		return;
	fprintf(stderr, "bench_norm: %s: %s\n", what, cudaGetErrorString(err));
	exit(1);
}

/*
 * Two sets of row tensors (so that consecutive runs touch different
 * memory). residual, s (the forward's residual_out) and ds exist only
 * when the variants are measured.
 */
struct set {
	void *x, *y, *dy, *dx;
	void *residual, *s, *ds;
	float *mean, *rstd;
};

static struct set sets[2];
static void *gamma_d, *beta_d, *dgamma_d, *dbeta_d, *workspace;
static float *scale_d, *amax_d;
static size_t workspace_size = (size_t)512 << 20;

static int cmp_float(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return (x > y) - (x < y);
}

/* Fills n bytes with random values of dtype in [lo, hi): a host chunk, replicated. */
static void fill_random(void *dst, enum nk_dtype dt, size_t bytes, double lo, double hi)
{
	static uint64_t s = 0x2545f4914f6cdd1dull;
	size_t chunk = (size_t)16 << 20, es = nk_dtype_size(dt);
	unsigned char *h = malloc(chunk);

	if (!h)
		check(cudaErrorMemoryAllocation, "host allocation");
	for (size_t i = 0; i < chunk / es; i++) {
		nk_store(dt, h, i, rng_uniform(&s, lo, hi));
	}
	for (size_t off = 0; off < bytes; off += chunk) {
		size_t n = bytes - off < chunk ? bytes - off : chunk;
		check(cudaMemcpy((char *)dst + off, h, n, cudaMemcpyHostToDevice), "fill");
	}
	free(h);
}

static double measure_copy(void)
{
	size_t bytes = (size_t)2 << 30;
	void *a, *b;
	cudaEvent_t ev[WARMUP + REPS][2];
	float ms[REPS];

	check(cudaMalloc(&a, bytes), "cudaMalloc copy");
	check(cudaMalloc(&b, bytes), "cudaMalloc copy");
	check(cudaMemset(a, 1, bytes), "memset");
	/* Queued back to back between events, as the kernels are (time_jobs). */
	for (int r = 0; r < WARMUP + REPS; r++) {
		check(cudaEventCreate(&ev[r][0]), "event");
		check(cudaEventCreate(&ev[r][1]), "event");
		check(cudaEventRecord(ev[r][0], 0), "record");
		check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0), "copy");
		check(cudaEventRecord(ev[r][1], 0), "record");
	}
	check(cudaDeviceSynchronize(), "copy");
	for (int r = 0; r < WARMUP + REPS; r++) {
		if (r >= WARMUP)
			check(cudaEventElapsedTime(&ms[r - WARMUP], ev[r][0], ev[r][1]), "elapsed");
		cudaEventDestroy(ev[r][0]);
		cudaEventDestroy(ev[r][1]);
	}
	qsort(ms, REPS, sizeof(float), cmp_float);
	cudaFree(a);
	cudaFree(b);
	return 2.0 * (double)bytes / (ms[REPS / 2] * 1e-3) / 1e9;
}

/* The norm variant a row measures (docs/VARIANTS.md); PLAIN is the norm alone. */
enum bvariant {
	V_PLAIN,
	V_ADD,	  /* residual add: forward writes s and y, backward adds ds */
	V_OFFSET, /* weight offset WEIGHT_OFFSET (LayerNorm: zero-centered gamma) */
	V_FP8,	  /* forward only: y in e4m3, scale read, amax written */
	V_COUNT,
};

/* One benchmarked job: op, dtype, cols, variant; mem-eff backward if memeff. */
struct bjob {
	enum nk_op op;
	enum nk_dtype dt;
	bool memeff;
	int64_t rows, cols;
	enum bvariant var;
};

static bool ln_op(enum nk_op op)
{
	return op == NK_LAYERNORM_FWD || op == NK_LAYERNORM_BWD;
}

static bool bwd_op(enum nk_op op)
{
	return op == NK_LAYERNORM_BWD || op == NK_RMSNORM_BWD;
}

static void args_for(const struct bjob *b, const struct set *s, struct nk_norm_args *a)
{
	bool ln = ln_op(b->op);
	memset(a, 0, sizeof(*a));
	a->op = b->op;
	a->rows = b->rows;
	a->cols = b->cols;
	a->eps = EPS;
	a->dtype = b->dt;
	a->weight_dtype = b->dt;
	a->gamma = gamma_d;
	a->beta = ln ? beta_d : NULL;
	a->rstd = s->rstd;
	a->weight_offset = b->var == V_OFFSET ? WEIGHT_OFFSET : 0.0f;
	if (!bwd_op(b->op)) {
		a->x = s->x;
		a->y = s->y;
		a->mean = ln ? s->mean : NULL;
		if (b->var == V_ADD) {
			a->residual = s->residual;
			a->residual_out = s->s;
		} else if (b->var == V_FP8) {
			a->y_fp8 = NK_FP8_E4M3;
			a->scale = scale_d;
			a->amax = amax_d;
		}
		return;
	}
	/* With a residual the backward reads the forward's s (or y), and ds. */
	a->flags = b->memeff ? NK_MEMORY_EFFICIENT : 0;
	a->x = b->memeff ? s->y : b->var == V_ADD ? s->s : s->x;
	a->ds = b->var == V_ADD ? s->ds : NULL;
	a->mean = ln && !b->memeff ? s->mean : NULL;
	a->dy = s->dy;
	a->dx = s->dx;
	a->dgamma = dgamma_d;
	a->dbeta = ln ? dbeta_d : NULL;
}

/*
 * Bytes a job must move: every tensor it reads or writes, once. The
 * variants add theirs: +add the residual and s (forward) or ds (backward),
 * +fp8_e4m3 writes y at one byte an element and moves scale and amax; a
 * weight offset moves nothing more. bench/bench_peers.py takes every peer's
 * bytes from here (--plan) and checks these relations.
 */
static double job_bytes(const struct bjob *b)
{
	double n = (double)b->rows * (double)b->cols, es = (double)nk_dtype_size(b->dt);
	double row = n * es, col = (double)b->cols * es, stat = (double)b->rows * 4;
	bool ln = ln_op(b->op);

	if (!bwd_op(b->op)) { /* x, y, gamma, beta, mean, rstd */
		double y = b->var == V_FP8 ? n + 2 * 4 : row;
		double add = b->var == V_ADD ? 2 * row : 0;
		return row + y + add + col * (ln ? 2 : 1) + stat * (ln ? 2 : 1);
	}
	/* x or y, dy, dx, rstd, gamma, dgamma; LN: dbeta and mean, or beta (mem-eff) */
	return 3 * row + stat + 2 * col + (ln ? col + (b->memeff ? col : stat) : 0) +
	       (b->var == V_ADD ? row : 0);
}

/*
 * Median microseconds of `reps` runs of each of the n jobs b[k] (variant
 * v[k], NULL: the default), launched in turn (b[0], b[1], ..., b[0], ...)
 * so that drift in the device's speed falls on all of them alike. The
 * launches are queued back to back, each between two events, and the host
 * waits once at the end, as bench_torch.py times PyTorch: the events time
 * the device's work, not the host's launch path (waiting after each launch
 * added that, 3-5 us, to every normd time only).
 */
static void time_jobs(const struct bjob *b, const struct nk_variant *const *v, int n, int reps,
		      struct nk_variant *ran, double *us)
{
	struct nk_cuda_exec exec = {NULL, workspace, workspace_size, NULL};
	struct nk_norm_args a[MAX_INTERLEAVED][2];
	cudaEvent_t ev[MAX_INTERLEAVED][WARMUP + REPS][2];
	float ms[REPS];

	if (n > MAX_INTERLEAVED || reps > REPS) {
		fprintf(stderr, "bench_norm: too many jobs or repetitions\n");
		exit(1);
	}
	for (int k = 0; k < n; k++) {
		args_for(&b[k], &sets[0], &a[k][0]);
		args_for(&b[k], &sets[1], &a[k][1]);
		if (nk_cuda_workspace_bytes(&a[k][0], &dev, v[k]) > workspace_size) {
			fprintf(stderr, "bench_norm: workspace too small\n");
			exit(1);
		}
		for (int r = 0; r < WARMUP + reps; r++) {
			check(cudaEventCreate(&ev[k][r][0]), "event");
			check(cudaEventCreate(&ev[k][r][1]), "event");
		}
	}
	/* Launch i uses buffer set i & 1: every launch follows one on the other set. */
	for (int r = 0; r < WARMUP + reps; r++) {
		for (int k = 0; k < n; k++) {
			const int set = (r * n + k) & 1;
			check(cudaEventRecord(ev[k][r][0], 0), "record");
			if (nk_cuda_norm(&a[k][set], &dev, v[k], &exec, ran ? &ran[k] : NULL) !=
			    NK_OK) {
				fprintf(stderr, "bench_norm: nk_cuda_norm: %s\n",
					nk_cuda_last_error());
				exit(1);
			}
			check(cudaEventRecord(ev[k][r][1], 0), "record");
		}
	}
	check(cudaDeviceSynchronize(), "kernels");
	for (int k = 0; k < n; k++) {
		for (int r = 0; r < WARMUP + reps; r++) {
			if (r >= WARMUP)
				check(
				    cudaEventElapsedTime(&ms[r - WARMUP], ev[k][r][0], ev[k][r][1]),
				    "elapsed");
			cudaEventDestroy(ev[k][r][0]);
			cudaEventDestroy(ev[k][r][1]);
		}
		qsort(ms, (size_t)reps, sizeof(float), cmp_float);
		us[k] = ms[reps / 2] * 1e3;
	}
}

/* Median microseconds of `reps` runs of one job with variant v (NULL: the default). */
static double time_job(const struct bjob *b, const struct nk_variant *v, int reps,
		       struct nk_variant *ran)
{
	double us;
	time_jobs(b, &v, 1, reps, ran, &us);
	return us;
}

/* Forward outputs (y, mean, rstd; s with a residual) for the backward jobs of a shape. */
static void prepare_backward(const struct bjob *b)
{
	struct bjob f = *b;
	struct nk_cuda_exec exec = {NULL, workspace, workspace_size, NULL};
	f.op = ln_op(b->op) ? NK_LAYERNORM_FWD : NK_RMSNORM_FWD;
	for (int k = 0; k < 2; k++) {
		struct nk_norm_args a;
		args_for(&f, &sets[k], &a);
		if (nk_cuda_norm(&a, &dev, NULL, &exec, NULL) != NK_OK) {
			fprintf(stderr, "bench_norm: forward: %s\n", nk_cuda_last_error());
			exit(1);
		}
	}
	check(cudaDeviceSynchronize(), "forward");
}

/* "ln_fwd", "rms_bwd_memeff", ..., with the variant's suffix ("+add", ...). */
static const char *op_label(const struct bjob *b)
{
	static char label[48];
	const char *op, *var = "";

	if (!bwd_op(b->op))
		op = ln_op(b->op) ? "ln_fwd" : "rms_fwd";
	else if (b->memeff)
		op = ln_op(b->op) ? "ln_bwd_memeff" : "rms_bwd_memeff";
	else
		op = ln_op(b->op) ? "ln_bwd" : "rms_bwd";
	if (b->var == V_ADD)
		var = "+add";
	else if (b->var == V_OFFSET)
		var = ln_op(b->op) ? "+zero_centered" : "+offset";
	else if (b->var == V_FP8)
		var = "+fp8_e4m3";
	snprintf(label, sizeof(label), "%s%s", op, var);
	return label;
}

/*
 * Prints a job's line: the default variant's time `us` (it ran `ran`), and
 * the fastest of the autotuning candidates, each timed here.
 */
static void report_job(const struct bjob *b, double us, const struct nk_variant *ran)
{
	struct nk_norm_args a;
	struct nk_variant cand[MAX_CANDIDATES], best = *ran;
	char name[96], best_name[96];
	double bytes = job_bytes(b), best_us = us;

	nk_variant_name(ran, name, sizeof(name));
	args_for(b, &sets[0], &a);
	int n = nk_cuda_variant_candidates(&a, &dev, cand, MAX_CANDIDATES);
	for (int k = 1; k < n; k++) {
		double t = time_job(b, &cand[k], TUNE_REPS, NULL);
		char cn[96];
		nk_variant_name(&cand[k], cn, sizeof(cn));
		printf("candidate op=%s dtype=%s cols=%lld variant=%s gbps=%.1f\n", op_label(b),
		       nk_dtype_name(b->dt), (long long)b->cols, cn, bytes / (t * 1e-6) / 1e9);
		if (t < best_us) {
			best_us = t;
			best = cand[k];
		}
	}
	nk_variant_name(&best, best_name, sizeof(best_name));
	double gbps = bytes / (us * 1e-6) / 1e9, tuned = bytes / (best_us * 1e-6) / 1e9;
	printf("normd op=%s dtype=%s cols=%lld rows=%lld bytes=%.0f us=%.1f gbps=%.1f pct=%.1f "
	       "variant=%s tuned_gbps=%.1f tuned_pct=%.1f tuned_variant=%s\n",
	       op_label(b), nk_dtype_name(b->dt), (long long)b->cols, (long long)b->rows, bytes, us,
	       gbps, 100.0 * gbps / copy_gbps, name, tuned, 100.0 * tuned / copy_gbps, best_name);
	fflush(stdout);
}

/*
 * Benchmarks op on one dtype and shape. A backward is timed together with
 * its memory-efficient twin, their launches interleaved, so the two
 * numbers that the "within 3%" target compares come from the same span of
 * time.
 */
static void bench_op(enum nk_op op, enum nk_dtype dt, int64_t rows, int64_t cols,
		     enum bvariant var)
{
	struct bjob b[2] = {{op, dt, false, rows, cols, var}, {op, dt, true, rows, cols, var}};
	const struct nk_variant *defaults[2] = {NULL, NULL};
	struct nk_variant ran[2];
	double us[2];
	const int n = bwd_op(op) ? 2 : 1;

	if (bwd_op(op))
		prepare_backward(&b[0]);
	time_jobs(b, defaults, n, REPS, ran, us);
	for (int k = 0; k < n; k++)
		report_job(&b[k], us[k], &ran[k]);
}

static void setup(bool variants)
{
	struct cudaDeviceProp prop;
	size_t row_bytes = (size_t)TOTAL_ELEMS * 4;
	int64_t max_rows = TOTAL_ELEMS / 128;
	const float scale = FP8_SCALE;

	check(cudaGetDevice(&dev.ordinal), "cudaGetDevice");
	check(cudaGetDeviceProperties(&prop, dev.ordinal), "properties");
	dev.sm_count = prop.multiProcessorCount;
	dev.max_threads_per_sm = prop.maxThreadsPerMultiProcessor;
	dev.max_smem_per_block_optin = prop.sharedMemPerBlockOptin;
	dev.cc_major = prop.major;
	dev.cc_minor = prop.minor;
	dev.mem_gbps = nk_cuda_mem_gbps(dev.ordinal);
	printf("device name=\"%s\" sms=%d l2_mb=%d mem_gbps=%d\n", prop.name, dev.sm_count,
	       prop.l2CacheSize >> 20, dev.mem_gbps);
	copy_gbps = measure_copy();
	printf("copy gbps=%.1f\n", copy_gbps);
	for (int k = 0; k < 2; k++) {
		struct set *s = &sets[k];
		check(cudaMalloc(&s->x, row_bytes), "cudaMalloc");
		check(cudaMalloc(&s->y, row_bytes), "cudaMalloc");
		check(cudaMalloc(&s->dy, row_bytes), "cudaMalloc");
		check(cudaMalloc(&s->dx, row_bytes), "cudaMalloc");
		check(cudaMalloc((void **)&s->mean, (size_t)max_rows * 4), "cudaMalloc");
		check(cudaMalloc((void **)&s->rstd, (size_t)max_rows * 4), "cudaMalloc");
		if (!variants)
			continue;
		check(cudaMalloc(&s->residual, row_bytes), "cudaMalloc");
		check(cudaMalloc(&s->s, row_bytes), "cudaMalloc");
		check(cudaMalloc(&s->ds, row_bytes), "cudaMalloc");
	}
	check(cudaMalloc(&gamma_d, 65536 * 4), "cudaMalloc");
	check(cudaMalloc(&beta_d, 65536 * 4), "cudaMalloc");
	check(cudaMalloc(&dgamma_d, 65536 * 4), "cudaMalloc");
	check(cudaMalloc(&dbeta_d, 65536 * 4), "cudaMalloc");
	check(cudaMalloc((void **)&scale_d, 4), "cudaMalloc");
	check(cudaMalloc((void **)&amax_d, 4), "cudaMalloc");
	check(cudaMemcpy(scale_d, &scale, 4, cudaMemcpyHostToDevice), "scale");
	check(cudaMalloc(&workspace, workspace_size), "cudaMalloc");
}

/* Random x and dy (and residual and ds) of dtype in both sets, random weights. */
static void fill_inputs(enum nk_dtype dt, bool variants)
{
	size_t bytes = (size_t)TOTAL_ELEMS * nk_dtype_size(dt);
	for (int k = 0; k < 2; k++) {
		fill_random(sets[k].x, dt, bytes, -2.0, 2.6);
		fill_random(sets[k].dy, dt, bytes, -1.0, 1.0);
		if (!variants)
			continue;
		fill_random(sets[k].residual, dt, bytes, -1.0, 1.0);
		fill_random(sets[k].ds, dt, bytes, -1.0, 1.0);
	}
	fill_random(gamma_d, dt, 65536 * nk_dtype_size(dt), 0.5, 1.5);
	fill_random(beta_d, dt, 65536 * nk_dtype_size(dt), -0.5, 0.5);
}

/* What the command line asked for (main's comment). */
struct selection {
	bool plan;
	bool fwd, bwd;	       /* forward ops, backward ops */
	bool dtype[3];	       /* by enum nk_dtype */
	bool variant[V_COUNT]; /* by enum bvariant */
	int64_t cols[32];
	int ncols;
	int64_t rows;	       /* rows=N; 0: 2^28 elements a shape */
};

/* rows=N: every shape with N rows (as many as the 2^28-element buffers hold at its width). */
static bool parse_rows(struct selection *sel, const char *v)
{
	char *end;
	long long n = strtoll(v, &end, 10);
	if (*v < '0' || *v > '9' || *end || n < 1 || n > TOTAL_ELEMS / 128)
		return false;
	sel->rows = n;
	return true;
}

static bool parse_word(struct selection *sel, const char *w)
{
	bool *dt = sel->dtype, *var = sel->variant;

	if (strcmp(w, "--plan") == 0)
		sel->plan = true;
	else if (strncmp(w, "rows=", 5) == 0)
		return parse_rows(sel, w + 5);
	else if (strcmp(w, "fwd") == 0 || strcmp(w, "bwd") == 0)
		*(w[0] == 'f' ? &sel->fwd : &sel->bwd) = true;
	else if (strcmp(w, "bf16") == 0 || strcmp(w, "f16") == 0 || strcmp(w, "f32") == 0)
		dt[w[0] == 'b' ? NK_BF16 : w[1] == '1' ? NK_F16 : NK_F32] = true;
	else if (strcmp(w, "plain") == 0)
		var[V_PLAIN] = true;
	else if (strcmp(w, "add") == 0)
		var[V_ADD] = true;
	else if (strcmp(w, "offset") == 0)
		var[V_OFFSET] = true;
	else if (strcmp(w, "fp8") == 0)
		var[V_FP8] = true;
	else if (strcmp(w, "variants") == 0)
		var[V_ADD] = var[V_OFFSET] = var[V_FP8] = true;
	else
		return false;
	return true;
}

/* Fills sel from argv; false (after a message) on a word it does not know. */
static bool parse_args(int argc, char **argv, struct selection *sel)
{
	const int64_t default_cols[] = {128, 512, 1024, 2048, 4096, 8192, 12288, 16384, 32768};

	memset(sel, 0, sizeof(*sel));
	for (int k = 1; k < argc; k++) {
		char *end;
		long long c = strtoll(argv[k], &end, 10);
		if (parse_word(sel, argv[k]))
			continue;
		if (*end != '\0' || c < 128 || c > 65536 || sel->ncols == 32) {
			fprintf(stderr,
				"bench_norm: %s: expected --plan, fwd, bwd, bf16, f16, f32, "
				"plain, add, offset, fp8, variants, rows=N or a width of "
				"128..65536 columns (at most 32)\n",
				argv[k]);
			return false;
		}
		sel->cols[sel->ncols++] = c;
	}
	if (!sel->fwd && !sel->bwd)
		sel->fwd = sel->bwd = true;
	if (!sel->dtype[NK_BF16] && !sel->dtype[NK_F16] && !sel->dtype[NK_F32])
		sel->dtype[NK_BF16] = sel->dtype[NK_F32] = true;
	bool any = false;
	for (int v = 0; v < V_COUNT; v++)
		any = any || sel->variant[v];
	sel->variant[V_PLAIN] = sel->variant[V_PLAIN] || !any;
	if (sel->ncols == 0) {
		sel->ncols = (int)(sizeof(default_cols) / sizeof(default_cols[0]));
		memcpy(sel->cols, default_cols, sizeof(default_cols));
	}
	return true;
}

/* Prints a plan line for job b and its memory-efficient twin (backward). */
static void plan_op(const struct bjob *b)
{
	struct bjob twin = *b;
	const int n = bwd_op(b->op) ? 2 : 1;

	for (int k = 0; k < n; k++) {
		twin.memeff = k == 1;
		printf("plan op=%s dtype=%s cols=%lld rows=%lld bytes=%.0f\n", op_label(&twin),
		       nk_dtype_name(b->dt), (long long)b->cols, (long long)b->rows,
		       job_bytes(&twin));
	}
}

/* Every selected op and variant at one dtype and width, in the order of the output. */
static void run_shape(const struct selection *sel, enum nk_dtype dt, int64_t cols)
{
	const enum nk_op ops[] = {NK_LAYERNORM_FWD, NK_LAYERNORM_BWD, NK_RMSNORM_FWD,
				  NK_RMSNORM_BWD};
	int64_t rows = sel->rows ? sel->rows : TOTAL_ELEMS / cols;
	if (rows > TOTAL_ELEMS / cols) {
		fprintf(stderr, "bench_norm: %lld rows of %lld columns exceed the buffers (2^28 "
				"elements): skipped\n", (long long)rows, (long long)cols);
		return;
	}

	for (int v = 0; v < V_COUNT; v++) {
		for (size_t o = 0; sel->variant[v] && o < sizeof(ops) / sizeof(ops[0]); o++) {
			bool bwd = bwd_op(ops[o]);
			struct bjob b = {ops[o], dt, false, rows, cols, v};
			if ((bwd && !sel->bwd) || (!bwd && !sel->fwd) || (bwd && v == V_FP8))
				continue;
			if (sel->plan)
				plan_op(&b);
			else
				bench_op(ops[o], dt, rows, cols, v);
		}
	}
}

int main(int argc, char **argv)
{
	const enum nk_dtype dts[] = {NK_BF16, NK_F16, NK_F32};
	struct selection sel;
	/*
	 * Optional arguments: widths (any of 128..65536 columns; default the
	 * nine of 128..32768) limit the run to those, "fwd" or "bwd" to the
	 * forward or backward ops, "bf16", "f16", "f32" to those dtypes
	 * (default bf16 and f32), "plain", "add", "offset", "fp8" to the plain
	 * norms and those variants ("variants": all three; default plain),
	 * "rows=N" gives every shape N rows instead of 2^28 elements' worth,
	 * "--plan" prints the rows and their bytes instead of measuring.
	 */
	if (!parse_args(argc, argv, &sel))
		return 2;
	bool variants = sel.variant[V_ADD]; /* the residual add's tensors are needed */
	if (!sel.plan)
		setup(variants);
	for (int d = 0; d < 3; d++) {
		if (!sel.dtype[dts[d]])
			continue;
		if (!sel.plan)
			fill_inputs(dts[d], variants);
		for (int c = 0; c < sel.ncols; c++)
			run_shape(&sel, dts[d], sel.cols[c]);
	}
	return 0;
}
