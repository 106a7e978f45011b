/*
 * The row math of the CPU kernels, written once in terms of REAL, the
 * compute type, and compiled twice: kernels/norm_cpu_f32.c defines REAL =
 * float (the CPU backend, NK_CPU_FP32) and kernels/norm_cpu_f64.c REAL =
 * double (the reference, NK_CPU_REFERENCE). Each defines REAL, REAL_SQRT
 * and NORM_CPU_KERNELS (the name of the table of this type's functions,
 * which kernels/norm_cpu.c picks from) before including this file, once.
 * kernels/norm_cpu.c says how rows, blocks and threads fit together.
 */
#ifndef REAL
#error "define REAL, REAL_SQRT and NORM_CPU_KERNELS before including norm_cpu_row.h"
#endif

#include "norm_cpu_internal.h"

#include <math.h>
#include <string.h>

/* Converts elements [first, first + n) of a tensor to the compute type. */
static void load_row(enum nk_dtype dtype, const void *base, int64_t first, int64_t n, REAL *out)
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
static void store_row(enum nk_dtype dtype, void *base, int64_t first, int64_t n, const REAL *in)
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
static REAL combine8(const REAL *acc, REAL tail)
{
	return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) +
	       tail;
}

/* The sum of a[j], j < n. */
static REAL row_sum(const REAL *a, int64_t n)
{
	REAL acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
	REAL tail = 0;
	int64_t j = 0;

	if (n > PAIRWISE_LEAF)
		return row_sum(a, n / 2) + row_sum(a + n / 2, n - n / 2);
	for (; j + 8 <= n; j += 8) {
		for (int k = 0; k < 8; k++)
			acc[k] += a[j + k];
	}
	for (; j < n; j++)
		tail += a[j];
	return combine8(acc, tail);
}

/* The sum of a[j] * b[j], j < n. */
static REAL row_dot(const REAL *a, const REAL *b, int64_t n)
{
	REAL acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
	REAL tail = 0;
	int64_t j = 0;

	if (n > PAIRWISE_LEAF)
		return row_dot(a, b, n / 2) + row_dot(a + n / 2, b + n / 2, n - n / 2);
	for (; j + 8 <= n; j += 8) {
		for (int k = 0; k < 8; k++)
			acc[k] += a[j + k] * b[j + k];
	}
	for (; j < n; j++)
		tail += a[j] * b[j];
	return combine8(acc, tail);
}

/* dst[j] += src[j], j < n. */
static void add_to(REAL *dst, const REAL *src, int64_t n)
{
	for (int64_t j = 0; j < n; j++)
		dst[j] += src[j];
}

/*
 * s = x + residual of one row into v, rounded once to dtype and stored in
 * residual_out; v then holds the stored s, which is what the norm (and a
 * backward reading residual_out) sees. The sum in REAL is the correctly
 * rounded one after the rounding to dtype: float and double carry at least
 * 2p + 2 bits of every dtype's p, so rounding twice changes nothing.
 */
static void residual_row(const struct cpu_job *job, int64_t first, REAL *v, REAL *r)
{
	const struct nk_norm_args *a = job->args;
	int64_t n = job->cols;

	load_row(a->dtype, a->residual, first, n, r);
	for (int64_t j = 0; j < n; j++)
		v[j] = (REAL)nk_round(a->dtype, (double)(v[j] + r[j]));
	store_row(a->dtype, a->residual_out, first, n, v);
}

/*
 * FP8 output of one row: v (y before scaling) is scaled in place, and the
 * largest |y| is returned (NaN skipped, as fmaxf does; 0 for a row of NaN).
 */
static double scale_row(const struct cpu_job *job, REAL *v)
{
	REAL scale = (REAL)job->scale, amax = 0;

	for (int64_t j = 0; j < job->cols; j++) {
		REAL m = v[j] < 0 ? -v[j] : v[j];
		if (m > amax)
			amax = m;
		v[j] *= scale;
	}
	return (double)amax;
}

/*
 * Forward of one row with two scratch rows (v, and r for the residual);
 * returns the row's max |y| for FP8 output, else 0. Every input of the row
 * is read before any of its outputs is written (in-place forms).
 */
static double forward_row(const struct cpu_job *job, int64_t row, REAL *v, REAL *r)
{
	const struct nk_norm_args *a = job->args;
	const REAL *g = job->gamma, *b = job->beta;
	int64_t n = job->cols, first = row * n;
	REAL mean = 0, rstd;
	double amax = 0;

	load_row(a->dtype, a->x, first, n, v);
	if (job->residual)
		residual_row(job, first, v, r);
	if (job->layernorm) {
		mean = row_sum(v, n) / (REAL)n;
		for (int64_t j = 0; j < n; j++)
			v[j] -= mean;
	}
	/* v is now x - mean (LayerNorm) or x (RMSNorm); x is s with a residual. */
	rstd = (REAL)1 / REAL_SQRT(row_dot(v, v, n) / (REAL)n + (REAL)a->eps);
	for (int64_t j = 0; j < n; j++)
		v[j] = v[j] * rstd * g[j] + b[j];

	if (a->y_fp8 != NK_FP8_NONE) {
		amax = scale_row(job, v);
		for (int64_t j = 0; j < n; j++)
			((uint8_t *)a->y)[first + j] = nk_fp8_from_double(a->y_fp8, (double)v[j]);
	} else {
		store_row(a->dtype, a->y, first, n, v);
	}
	if (a->mean)
		store_stat(a->mean, row, (float)mean);
	if (a->rstd)
		store_stat(a->rstd, row, (float)rstd);
	return amax;
}

/* Overwrites the row of x (or y) in xh with x_hat. */
static void x_hat_row(const struct cpu_job *job, int64_t row, REAL rstd, REAL *xh)
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
 * Backward of one row with two scratch rows: xh receives x_hat (then ds),
 * dyg dy and then dx. pg/pb (may be NULL) are the block's dgamma/dbeta
 * partials. g is the weight, weight_offset + gamma.
 */
static void backward_row(const struct cpu_job *job, int64_t row, REAL *xh, REAL *dyg, REAL *pg,
			 REAL *pb)
{
	const struct nk_norm_args *a = job->args;
	const REAL *g = job->gamma;
	int64_t n = job->cols, first = row * n;
	REAL rstd = (REAL)load_stat(a->rstd, row);

	load_row(a->dtype, a->x, first, n, xh);
	load_row(a->dtype, a->dy, first, n, dyg);
	x_hat_row(job, row, rstd, xh);
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
	REAL m1 = job->layernorm ? row_sum(dyg, n) / (REAL)n : (REAL)0;
	REAL m2 = row_dot(dyg, xh, n) / (REAL)n;
	for (int64_t j = 0; j < n; j++)
		dyg[j] = rstd * (dyg[j] - m1 - xh[j] * m2);
	/* The residual's gradient joins before the one rounding of dx. */
	if (a->ds) {
		load_row(a->dtype, a->ds, first, n, xh);
		for (int64_t j = 0; j < n; j++)
			dyg[j] += xh[j];
	}
	store_row(a->dtype, a->dx, first, n, dyg);
}

/*
 * Backward rows [first, end) of a block. Rows are summed into chunk partials
 * (cg, cb) of ROW_CHUNK rows and each chunk into the block's partials (pg,
 * pb): the fp32 error of dgamma grows with ROW_CHUNK + rows / ROW_CHUNK,
 * not with the rows of a block.
 */
static void backward_rows(const struct cpu_job *job, int64_t first, int64_t end, REAL *pg, REAL *pb,
			  REAL *scratch)
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
			backward_row(job, r, xh, dyg, pg ? cg : NULL, pb ? cb : NULL);
		if (pg)
			add_to(pg, cg, n);
		if (pb)
			add_to(pb, cb, n);
	}
}

static void run_block(struct cpu_job *job, int64_t block, void *scratch)
{
	int64_t n = job->cols, first, end;
	REAL *pg = NULL, *pb = NULL;

	block_rows(job, block, &first, &end);
	if (!job->backward) {
		REAL *v = scratch, *res = v + n;
		double amax = 0;
		for (int64_t r = first; r < end; r++) {
			double m = forward_row(job, r, v, res);
			amax = m > amax ? m : amax;
		}
		job->part_amax[block] = amax;
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
	backward_rows(job, first, end, pg, pb, scratch);
}

/*
 * apex's clamp_by_magnitude: 0 <= g < eps becomes eps, -eps < g < 0 becomes
 * -eps (so 0 and -0 both become +eps, and NaN stays). Counts what it moved.
 */
static REAL clamp_by_magnitude(REAL g, REAL eps, uint32_t *clamped)
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

/*
 * Converts the weight, weight_offset + gamma (ones when gamma is absent),
 * and beta (zeros when absent) to the compute type, and clamps the weight
 * for the memory-efficient backward.
 */
static uint32_t prepare(struct cpu_job *job)
{
	const struct nk_norm_args *a = job->args;
	REAL *g = job->gamma, *b = job->beta, *gd = job->gamma_div;
	REAL eps = (REAL)a->eps;
	int64_t n = job->cols;
	uint32_t clamped = 0;

	if (a->gamma) {
		load_row(a->weight_dtype, a->gamma, 0, n, g);
		/* Zero-centered (offset 1) and Gemma's weights: added in REAL, never rounded to
		 * weight_dtype. */
		if (a->weight_offset != 0.0f) {
			for (int64_t j = 0; j < n; j++)
				g[j] += (REAL)a->weight_offset;
		}
	} else {
		for (int64_t j = 0; j < n; j++)
			g[j] = 1;
	}
	if (a->beta)
		load_row(a->weight_dtype, a->beta, 0, n, b);
	else
		memset(b, 0, (size_t)n * sizeof(REAL));

	/* Without gamma, memory-efficient x_hat is y itself: nothing to clamp. */
	if (!job->mem_eff || !a->gamma) {
		memcpy(gd, g, (size_t)n * sizeof(REAL));
		return 0;
	}
	for (int64_t j = 0; j < n; j++)
		gd[j] = clamp_by_magnitude(g[j], eps, &clamped);
	return clamped;
}

/*
 * Sums the nblocks partials of one weight gradient in block order, adds
 * the old output under NK_ACCUMULATE, and rounds once into `out`.
 */
static void finish_one(const struct cpu_job *job, const REAL *parts, void *out, REAL *sum,
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
		load_row(a->weight_dtype, out, 0, n, old);
		for (int64_t j = 0; j < n; j++)
			sum[j] = old[j] + sum[j];
	}
	store_row(a->weight_dtype, out, 0, n, sum);
}

static void finish(struct cpu_job *job, void *scratch)
{
	REAL *sum = scratch, *old = sum + job->cols;

	if (job->part_dgamma)
		finish_one(job, job->part_dgamma, job->args->dgamma, sum, old);
	if (job->part_dbeta)
		finish_one(job, job->part_dbeta, job->args->dbeta, sum, old);
}

const struct cpu_kernels NORM_CPU_KERNELS = {
    .real_size = sizeof(REAL),
    .prepare = prepare,
    .run_block = run_block,
    .finish = finish,
};
