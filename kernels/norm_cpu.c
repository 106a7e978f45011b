/*
 * The CPU backend of normd and the numerical oracle of every GPU test:
 * LayerNorm and RMSNorm forward and backward, including apex's
 * memory-efficient backward, on host memory (kernels/norm_kernels.h has the
 * semantics).
 *
 * How it computes:
 *   - A row is converted from its storage dtype into a scratch row of the
 *     compute type, processed there, and every output is rounded once to its
 *     storage dtype when it is written back. Statistics are stored as fp32.
 *   - The row math is written once, below the NORM_CPU_BODY switch, in terms
 *     of the macro REAL, and this file includes itself twice to compile it:
 *     with REAL = float for the backend (NK_CPU_FP32) and REAL = double for
 *     the reference (NK_CPU_REFERENCE).
 *   - Forward: two-pass statistics, mean first, then the variance of x - mean
 *     (RMSNorm: the mean of x^2), y = (x - mean) * rstd * gamma + beta.
 *   - Backward, with g = gamma (or 1) and xh = x_hat:
 *       LN:  dx = rstd * (dy*g - mean(dy*g) - xh * mean(dy*g*xh))
 *       RMS: dx = rstd * (dy*g - xh * mean(dy*g*xh))
 *       dgamma = sum over rows of dy*xh, dbeta = sum over rows of dy.
 *     Memory-efficient backward recomputes xh = (y - beta) / clamp(gamma)
 *     (RMS: y / clamp(gamma)); the dy*g terms keep the real gamma.
 *   - Rows are cut into at most MAX_BLOCKS blocks by a rule of rows and cols
 *     alone. Worker threads take whole blocks; each backward block sums its
 *     rows, in row order, into its own dgamma/dbeta partial in the compute
 *     type, and the partials are summed in block order at the end. So no
 *     output depends on the number of threads.
 */
#ifndef NORM_CPU_BODY

#include "norm_kernels.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Upper bound on blocks, hence on dgamma/dbeta partials and on threads. */
#define MAX_BLOCKS 32
/* A block holds at least this many elements where the job is that large. */
#define BLOCK_MIN_ELEMS (64 * 1024)
/* Jobs of at most this many elements run on the calling thread alone. */
#define THREADED_MIN_ELEMS (256 * 1024)

struct cpu_job;

/* The row math of one compute type, instantiated from NORM_CPU_BODY. */
struct cpu_kernels {
	size_t real_size; /* sizeof the compute type */
	/* Converts gamma/beta to the compute type; returns the clamped count. */
	uint32_t (*prepare)(struct cpu_job *job);
	/* Runs the rows of one block with a scratch of SCRATCH_ROWS rows. */
	void (*run_block)(struct cpu_job *job, int64_t block, void *scratch);
	/* Sums the dgamma/dbeta partials into the outputs (backward only). */
	void (*finish)(struct cpu_job *job, void *scratch);
};

/* One call of nk_cpu_norm. The `void *` arrays hold the compute type. */
struct cpu_job {
	const struct nk_norm_args *args;
	const struct cpu_kernels *kernels;
	int64_t rows, cols;
	int64_t nblocks;	 /* blocks of consecutive rows, see block_rows() */
	bool layernorm;		 /* LayerNorm, not RMSNorm */
	bool backward;		 /* a backward op */
	bool mem_eff;		 /* backward reads y and recomputes x_hat */
	void *gamma;		 /* [cols] gamma, or ones when absent */
	void *beta;		 /* [cols] beta, or zeros when absent */
	void *gamma_div;	 /* [cols] clamp(gamma), divides y (mem-eff only) */
	void *part_dgamma;	 /* [nblocks][cols] per-block sums of dy*xh, or NULL */
	void *part_dbeta;	 /* [nblocks][cols] per-block sums of dy, or NULL */
	atomic_llong next_block; /* the next block a worker takes */
};

/* Rows of scratch (each `cols` of the compute type) one worker needs:
 * x_hat, dy (then dx), and the chunk partials of dgamma and dbeta. */
#define SCRATCH_ROWS 4
/* Backward sums this many rows into a chunk partial before adding it to
 * its block's partial. */
#define ROW_CHUNK 64
/* Sums over more elements than this are split in halves (pairwise). */
#define PAIRWISE_LEAF 256

/* Rows [*first, *end) of a block: blocks differ in size by at most one row. */
static void block_rows(const struct cpu_job *job, int64_t block, int64_t *first, int64_t *end)
{
	int64_t q = job->rows / job->nblocks, r = job->rows % job->nblocks;

	*first = block * q + (block < r ? block : r);
	*end = *first + q + (block < r ? 1 : 0);
}

/* Float statistics are read and written bytewise: any alignment works. */
static float load_stat(const float *base, int64_t row)
{
	float f;
	memcpy(&f, (const unsigned char *)base + (size_t)row * sizeof(f), sizeof(f));
	return f;
}

static void store_stat(float *base, int64_t row, float f)
{
	memcpy((unsigned char *)base + (size_t)row * sizeof(f), &f, sizeof(f));
}

/* Instantiate the row math for float and double. */
#define NORM_CPU_BODY
#define REAL float
#define REAL_SQRT sqrtf
#define RNAME(name) name##_f32
#include "norm_cpu.c"
#undef REAL
#undef REAL_SQRT
#undef RNAME

#define REAL double
#define REAL_SQRT sqrt
#define RNAME(name) name##_f64
#include "norm_cpu.c"
#undef REAL
#undef REAL_SQRT
#undef RNAME
#undef NORM_CPU_BODY

/* ---- blocks and threads -------------------------------------------------- */

/* One block per BLOCK_MIN_ELEMS elements (rounded up), at most MAX_BLOCKS
 * and at most one per row. */
static int64_t block_count(int64_t rows, int64_t cols)
{
	int64_t n = (rows * cols + BLOCK_MIN_ELEMS - 1) / BLOCK_MIN_ELEMS;

	if (n > MAX_BLOCKS)
		n = MAX_BLOCKS;
	if (n > rows)
		n = rows;
	return n < 1 ? 1 : n;
}

struct cpu_worker {
	struct cpu_job *job;
	void *scratch;
};

static void worker_loop(struct cpu_job *job, void *scratch)
{
	for (;;) {
		int64_t block = atomic_fetch_add(&job->next_block, 1);
		if (block >= job->nblocks)
			return;
		job->kernels->run_block(job, block, scratch);
	}
}

static void *worker_main(void *arg)
{
	struct cpu_worker *w = arg;

	worker_loop(w->job, w->scratch);
	return NULL;
}

/*
 * Runs every block on the caller and nworkers - 1 helper threads. A helper
 * that cannot be started only means that the others take its blocks.
 */
static void run_blocks(struct cpu_job *job, unsigned char *scratch, size_t scratch_bytes,
		       int nworkers)
{
	struct cpu_worker workers[MAX_BLOCKS];
	pthread_t tids[MAX_BLOCKS];
	bool started[MAX_BLOCKS] = {false};

	atomic_init(&job->next_block, 0);
	for (int i = 1; i < nworkers; i++) {
		workers[i].job = job;
		workers[i].scratch = scratch + (size_t)i * scratch_bytes;
		started[i] = pthread_create(&tids[i], NULL, worker_main, &workers[i]) == 0;
	}
	worker_loop(job, scratch);
	for (int i = 1; i < nworkers; i++) {
		if (started[i])
			pthread_join(tids[i], NULL);
	}
}

/* ---- one job ------------------------------------------------------------- */

static int worker_count(const struct cpu_job *job, const struct nk_cpu_opts *opts)
{
	if (opts->threads <= 1 || job->rows * job->cols <= THREADED_MIN_ELEMS)
		return 1;
	return opts->threads < job->nblocks ? opts->threads : (int)job->nblocks;
}

/*
 * Makes the one allocation a job needs and carves it up: gamma, beta and
 * clamped gamma, the dgamma/dbeta partials, and the workers' scratch rows.
 * Returns the scratch area, or NULL when out of memory.
 */
static unsigned char *job_alloc(struct cpu_job *job, int nworkers, size_t *scratch_bytes,
				void **block)
{
	size_t row_bytes = (size_t)job->cols * job->kernels->real_size;
	size_t parts = 0;
	unsigned char *p;

	if (job->backward && job->args->dgamma)
		parts++;
	if (job->backward && job->args->dbeta)
		parts++;
	/* cols < 2^32 and real_size <= 8 keep these products far below 2^64. */
	*scratch_bytes = SCRATCH_ROWS * row_bytes;
	size_t total =
	    (3 + parts * (size_t)job->nblocks) * row_bytes + (size_t)nworkers * *scratch_bytes;
	p = malloc(total);
	*block = p;
	if (!p)
		return NULL;

	job->gamma = p;
	job->beta = p + row_bytes;
	job->gamma_div = p + 2 * row_bytes;
	p += 3 * row_bytes;
	job->part_dgamma = NULL;
	job->part_dbeta = NULL;
	if (job->backward && job->args->dgamma) {
		job->part_dgamma = p;
		p += (size_t)job->nblocks * row_bytes;
	}
	if (job->backward && job->args->dbeta) {
		job->part_dbeta = p;
		p += (size_t)job->nblocks * row_bytes;
	}
	return p;
}

int nk_cpu_norm(const struct nk_norm_args *args, const struct nk_cpu_opts *opts,
		struct nk_norm_result *result)
{
	static const struct nk_cpu_opts default_opts = {NK_CPU_FP32, 1};
	struct cpu_job job;
	unsigned char *scratch;
	size_t scratch_bytes;
	void *block;
	uint32_t clamped;

	if (result)
		result->clamped_cols = 0;
	if (nk_norm_check(args, NULL) != NK_OK)
		return NK_EINVAL;
	if (!opts)
		opts = &default_opts;
	if (opts->precision != NK_CPU_FP32 && opts->precision != NK_CPU_REFERENCE)
		return NK_EINVAL;

	memset(&job, 0, sizeof(job));
	job.args = args;
	job.kernels = opts->precision == NK_CPU_REFERENCE ? &kernels_f64 : &kernels_f32;
	job.rows = args->rows;
	job.cols = args->cols;
	job.nblocks = block_count(args->rows, args->cols);
	job.layernorm = args->op == NK_LAYERNORM_FWD || args->op == NK_LAYERNORM_BWD;
	job.backward = args->op == NK_LAYERNORM_BWD || args->op == NK_RMSNORM_BWD;
	job.mem_eff = args->flags & NK_MEMORY_EFFICIENT;

	int nworkers = worker_count(&job, opts);
	scratch = job_alloc(&job, nworkers, &scratch_bytes, &block);
	if (!scratch)
		return NK_ENOMEM;

	clamped = job.kernels->prepare(&job);
	run_blocks(&job, scratch, scratch_bytes, nworkers);
	if (job.backward)
		job.kernels->finish(&job, scratch);
	free(block);

	if (result)
		result->clamped_cols = clamped;
	return NK_OK;
}

#else /* NORM_CPU_BODY: the row math, in terms of REAL, REAL_SQRT, RNAME() */

/* Converts elements [first, first + n) of a tensor to the compute type. */
static void RNAME(load_row)(enum nk_dtype dtype, const void *base, int64_t first, int64_t n,
			    REAL *out)
{
	const unsigned char *p = (const unsigned char *)base + (size_t)first * nk_dtype_size(dtype);

	if (dtype != NK_F32) {
		for (int64_t j = 0; j < n; j++)
			out[j] = (REAL)nk_load(dtype, p, (size_t)j);
		return;
	}
	for (int64_t j = 0; j < n; j++) {
		float f;
		memcpy(&f, p + (size_t)j * sizeof(f), sizeof(f));
		out[j] = (REAL)f;
	}
}

/* Rounds n values once to the storage dtype at elements [first, first + n). */
static void RNAME(store_row)(enum nk_dtype dtype, void *base, int64_t first, int64_t n,
			     const REAL *in)
{
	unsigned char *p = (unsigned char *)base + (size_t)first * nk_dtype_size(dtype);

	if (dtype != NK_F32) {
		for (int64_t j = 0; j < n; j++)
			nk_store(dtype, p, (size_t)j, (double)in[j]);
		return;
	}
	for (int64_t j = 0; j < n; j++) {
		float f = (float)in[j];
		memcpy(p + (size_t)j * sizeof(f), &f, sizeof(f));
	}
}

/*
 * Sums run over eight interleaved partial sums combined pairwise, and rows
 * longer than PAIRWISE_LEAF are split in halves recursively (pairwise
 * summation): the error grows with log(cols), not cols, and the order is
 * fixed, so a result depends on the data alone.
 */
static REAL RNAME(combine8)(const REAL *acc, REAL tail)
{
	return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) +
	       tail;
}

/* The sum of a[j], j < n. */
static REAL RNAME(sum)(const REAL *a, int64_t n)
{
	REAL acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
	REAL tail = 0;
	int64_t j = 0;

	if (n > PAIRWISE_LEAF)
		return RNAME(sum)(a, n / 2) + RNAME(sum)(a + n / 2, n - n / 2);
	for (; j + 8 <= n; j += 8) {
		for (int k = 0; k < 8; k++)
			acc[k] += a[j + k];
	}
	for (; j < n; j++)
		tail += a[j];
	return RNAME(combine8)(acc, tail);
}

/* The sum of a[j] * b[j], j < n. */
static REAL RNAME(dot)(const REAL *a, const REAL *b, int64_t n)
{
	REAL acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
	REAL tail = 0;
	int64_t j = 0;

	if (n > PAIRWISE_LEAF)
		return RNAME(dot)(a, b, n / 2) + RNAME(dot)(a + n / 2, b + n / 2, n - n / 2);
	for (; j + 8 <= n; j += 8) {
		for (int k = 0; k < 8; k++)
			acc[k] += a[j + k] * b[j + k];
	}
	for (; j < n; j++)
		tail += a[j] * b[j];
	return RNAME(combine8)(acc, tail);
}

/* dst[j] += src[j], j < n. */
static void RNAME(add_to)(REAL *dst, const REAL *src, int64_t n)
{
	for (int64_t j = 0; j < n; j++)
		dst[j] += src[j];
}

/* Forward of one row; v is a scratch row of cols elements. */
static void RNAME(forward_row)(const struct cpu_job *job, int64_t row, REAL *v)
{
	const struct nk_norm_args *a = job->args;
	const REAL *g = job->gamma, *b = job->beta;
	int64_t n = job->cols, first = row * n;
	REAL mean = 0, rstd;

	RNAME(load_row)(a->dtype, a->x, first, n, v);
	if (job->layernorm) {
		mean = RNAME(sum)(v, n) / (REAL)n;
		for (int64_t j = 0; j < n; j++)
			v[j] -= mean;
	}
	/* v is now x - mean (LayerNorm) or x (RMSNorm). */
	rstd = (REAL)1 / REAL_SQRT(RNAME(dot)(v, v, n) / (REAL)n + (REAL)a->eps);
	for (int64_t j = 0; j < n; j++)
		v[j] = v[j] * rstd * g[j] + b[j];

	RNAME(store_row)(a->dtype, a->y, first, n, v);
	if (a->mean)
		store_stat(a->mean, row, (float)mean);
	if (a->rstd)
		store_stat(a->rstd, row, (float)rstd);
}

/* Overwrites the row of x (or y) in xh with x_hat. */
static void RNAME(x_hat_row)(const struct cpu_job *job, int64_t row, REAL rstd, REAL *xh)
{
	const struct nk_norm_args *a = job->args;
	int64_t n = job->cols;

	if (job->mem_eff) {
		const REAL *b = job->beta, *gd = job->gamma_div;
		for (int64_t j = 0; j < n; j++)
			xh[j] = (xh[j] - b[j]) / gd[j];
		return;
	}
	REAL mean = job->layernorm ? (REAL)load_stat(a->mean, row) : (REAL)0;
	for (int64_t j = 0; j < n; j++)
		xh[j] = (xh[j] - mean) * rstd;
}

/*
 * Backward of one row with two scratch rows: xh receives x_hat, dyg dy and
 * then dx. pg/pb (may be NULL) are the block's dgamma/dbeta partials.
 */
static void RNAME(backward_row)(const struct cpu_job *job, int64_t row, REAL *xh, REAL *dyg,
				REAL *pg, REAL *pb)
{
	const struct nk_norm_args *a = job->args;
	const REAL *g = job->gamma;
	int64_t n = job->cols, first = row * n;
	REAL rstd = (REAL)load_stat(a->rstd, row);

	RNAME(load_row)(a->dtype, a->x, first, n, xh);
	RNAME(load_row)(a->dtype, a->dy, first, n, dyg);
	RNAME(x_hat_row)(job, row, rstd, xh);
	if (pg) {
		for (int64_t j = 0; j < n; j++)
			pg[j] += dyg[j] * xh[j];
	}
	if (pb) {
		for (int64_t j = 0; j < n; j++)
			pb[j] += dyg[j];
	}

	for (int64_t j = 0; j < n; j++)
		dyg[j] *= g[j];
	REAL m1 = job->layernorm ? RNAME(sum)(dyg, n) / (REAL)n : (REAL)0;
	REAL m2 = RNAME(dot)(dyg, xh, n) / (REAL)n;
	for (int64_t j = 0; j < n; j++)
		dyg[j] = rstd * (dyg[j] - m1 - xh[j] * m2);
	RNAME(store_row)(a->dtype, a->dx, first, n, dyg);
}

/*
 * Backward rows [first, end) of a block. Rows are summed into chunk partials
 * (cg, cb) of ROW_CHUNK rows and each chunk into the block's partials (pg,
 * pb): the fp32 error of dgamma grows with ROW_CHUNK + rows / ROW_CHUNK,
 * not with the rows of a block.
 */
static void RNAME(backward_rows)(const struct cpu_job *job, int64_t first, int64_t end, REAL *pg,
				 REAL *pb, REAL *scratch)
{
	int64_t n = job->cols;
	REAL *xh = scratch, *dyg = xh + n, *cg = dyg + n, *cb = cg + n;
	size_t row_bytes = (size_t)n * sizeof(REAL);

	for (int64_t chunk = first; chunk < end; chunk += ROW_CHUNK) {
		int64_t chunk_end = end - chunk > ROW_CHUNK ? chunk + ROW_CHUNK : end;
		if (pg)
			memset(cg, 0, row_bytes);
		if (pb)
			memset(cb, 0, row_bytes);
		for (int64_t r = chunk; r < chunk_end; r++)
			RNAME(backward_row)(job, r, xh, dyg, pg ? cg : NULL, pb ? cb : NULL);
		if (pg)
			RNAME(add_to)(pg, cg, n);
		if (pb)
			RNAME(add_to)(pb, cb, n);
	}
}

static void RNAME(run_block)(struct cpu_job *job, int64_t block, void *scratch)
{
	int64_t n = job->cols, first, end;
	REAL *pg = NULL, *pb = NULL;

	block_rows(job, block, &first, &end);
	if (!job->backward) {
		for (int64_t r = first; r < end; r++)
			RNAME(forward_row)(job, r, scratch);
		return;
	}
	if (job->part_dgamma) {
		pg = (REAL *)job->part_dgamma + block * n;
		memset(pg, 0, (size_t)n * sizeof(REAL));
	}
	if (job->part_dbeta) {
		pb = (REAL *)job->part_dbeta + block * n;
		memset(pb, 0, (size_t)n * sizeof(REAL));
	}
	RNAME(backward_rows)(job, first, end, pg, pb, scratch);
}

/*
 * apex's clamp_by_magnitude: 0 <= g < eps becomes eps, -eps < g < 0 becomes
 * -eps (so 0 and -0 both become +eps, and NaN stays). Counts what it moved.
 */
static REAL RNAME(clamp_by_magnitude)(REAL g, REAL eps, uint32_t *clamped)
{
	if (g >= 0 && g < eps) {
		(*clamped)++;
		return eps;
	}
	if (g < 0 && g > -eps) {
		(*clamped)++;
		return -eps;
	}
	return g;
}

/* Converts gamma and beta (ones and zeros when absent) and clamps gamma. */
static uint32_t RNAME(prepare)(struct cpu_job *job)
{
	const struct nk_norm_args *a = job->args;
	REAL *g = job->gamma, *b = job->beta, *gd = job->gamma_div;
	REAL eps = (REAL)a->eps;
	int64_t n = job->cols;
	uint32_t clamped = 0;

	if (a->gamma) {
		RNAME(load_row)(a->weight_dtype, a->gamma, 0, n, g);
	} else {
		for (int64_t j = 0; j < n; j++)
			g[j] = 1;
	}
	if (a->beta)
		RNAME(load_row)(a->weight_dtype, a->beta, 0, n, b);
	else
		memset(b, 0, (size_t)n * sizeof(REAL));

	/* Without gamma, memory-efficient x_hat is y itself: nothing to clamp. */
	if (!job->mem_eff || !a->gamma) {
		memcpy(gd, g, (size_t)n * sizeof(REAL));
		return 0;
	}
	for (int64_t j = 0; j < n; j++)
		gd[j] = RNAME(clamp_by_magnitude)(g[j], eps, &clamped);
	return clamped;
}

/*
 * Sums the nblocks partials of one weight gradient in block order, adds
 * the old output under NK_ACCUMULATE, and rounds once into `out`.
 */
static void RNAME(finish_one)(const struct cpu_job *job, const REAL *parts, void *out, REAL *sum,
			      REAL *old)
{
	const struct nk_norm_args *a = job->args;
	int64_t n = job->cols;

	memcpy(sum, parts, (size_t)n * sizeof(REAL));
	for (int64_t blk = 1; blk < job->nblocks; blk++) {
		const REAL *p = parts + blk * n;
		for (int64_t j = 0; j < n; j++)
			sum[j] += p[j];
	}
	if (a->flags & NK_ACCUMULATE) {
		RNAME(load_row)(a->weight_dtype, out, 0, n, old);
		for (int64_t j = 0; j < n; j++)
			sum[j] = old[j] + sum[j];
	}
	RNAME(store_row)(a->weight_dtype, out, 0, n, sum);
}

static void RNAME(finish)(struct cpu_job *job, void *scratch)
{
	REAL *sum = scratch, *old = sum + job->cols;

	if (job->part_dgamma)
		RNAME(finish_one)(job, job->part_dgamma, job->args->dgamma, sum, old);
	if (job->part_dbeta)
		RNAME(finish_one)(job, job->part_dbeta, job->args->dbeta, sum, old);
}

static const struct cpu_kernels RNAME(kernels) = {
    .real_size = sizeof(REAL),
    .prepare = RNAME(prepare),
    .run_block = RNAME(run_block),
    .finish = RNAME(finish),
};

#endif /* NORM_CPU_BODY */
