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
 *   - The row math is written once, in kernels/norm_cpu_row.h, in terms of
 *     the macro REAL, and compiled twice: with REAL = float for the backend
 *     (NK_CPU_FP32, kernels/norm_cpu_f32.c) and REAL = double for the
 *     reference (NK_CPU_REFERENCE, kernels/norm_cpu_f64.c). This file cuts
 *     a job into blocks, runs them on threads and picks the table.
 *   - Forward: with a residual, x is replaced by s = x + residual rounded to
 *     dtype (and stored); two-pass statistics, mean first, then the variance
 *     of x - mean (RMSNorm: the mean of x^2), y = (x - mean) * rstd * g +
 *     beta with g = weight_offset + gamma (or 1). FP8 output stores
 *     y * scale rounded once to FP8, and amax = max |y| over the blocks.
 *   - Backward, with g as above and xh = x_hat:
 *       LN:  dx = rstd * (dy*g - mean(dy*g) - xh * mean(dy*g*xh)) + ds
 *       RMS: dx = rstd * (dy*g - xh * mean(dy*g*xh)) + ds
 *       dgamma = sum over rows of dy*xh, dbeta = sum over rows of dy.
 *     Memory-efficient backward recomputes xh = (y - beta) / clamp(g)
 *     (RMS: y / clamp(g)); the dy*g terms keep the real g.
 *   - Rows are cut into at most MAX_BLOCKS blocks by a rule of rows and cols
 *     alone. Worker threads take whole blocks; each backward block sums its
 *     rows, in row order, into its own dgamma/dbeta partial in the compute
 *     type, and the partials are summed in block order at the end. So no
 *     output depends on the number of threads.
 */
#include "norm_cpu_internal.h"

#include <pthread.h>
#include <stdlib.h>

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

/* FP8 output: the largest of the blocks' max |y| (order-free), stored as fp32. */
static void finish_amax(const struct cpu_job *job)
{
	double amax = 0;
	for (int64_t b = 0; b < job->nblocks; b++)
		amax = job->part_amax[b] > amax ? job->part_amax[b] : amax;
	store_stat(job->args->amax, 0, (float)amax);
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
	job.kernels =
	    opts->precision == NK_CPU_REFERENCE ? &norm_cpu_kernels_f64 : &norm_cpu_kernels_f32;
	job.rows = args->rows;
	job.cols = args->cols;
	job.nblocks = block_count(args->rows, args->cols);
	job.layernorm = args->op == NK_LAYERNORM_FWD || args->op == NK_LAYERNORM_BWD;
	job.backward = args->op == NK_LAYERNORM_BWD || args->op == NK_RMSNORM_BWD;
	job.mem_eff = args->flags & NK_MEMORY_EFFICIENT;
	job.residual = !job.backward && args->residual;
	if (!job.backward && args->y_fp8 != NK_FP8_NONE)
		job.scale = load_stat(args->scale, 0);

	int nworkers = worker_count(&job, opts);
	scratch = job_alloc(&job, nworkers, &scratch_bytes, &block);
	if (!scratch)
		return NK_ENOMEM;

	clamped = job.kernels->prepare(&job);
	run_blocks(&job, scratch, scratch_bytes, nworkers);
	if (job.backward)
		job.kernels->finish(&job, scratch);
	else if (args->y_fp8 != NK_FP8_NONE && args->amax)
		finish_amax(&job);
	free(block);

	if (result)
		result->clamped_cols = clamped;
	return NK_OK;
}
