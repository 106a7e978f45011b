/*
 * Tests of the CPU normalization kernels (kernels/norm_cpu.c) and of what
 * they share with the CUDA backend (kernels/norm_common.c).
 *
 * The oracle is a naive double implementation written here straight from
 * the formulas, sharing no code with the kernels (not even the fp16/bf16
 * decoding; inputs are encoded with nk_store, then read back independently),
 * and itself checked against finite differences. What is checked:
 *   - every op x dtype x weight dtype (same / f32) x affine (none, gamma,
 *     gamma+beta) x memory_efficient x accumulate, on cols 1 to 65536 and
 *     rows 1 to 3000: the reference mode within half an ulp of the oracle's
 *     value, and the fp32 mode against the reference by relative L2 error
 *     (1e-5 for f32 outputs, 1e-2 for f16/bf16);
 *   - memory-efficient backward against the standard one, and its count
 *     of clamped gamma entries (none, or the zeros and tiny values put in);
 *   - bit-identical outputs for 1, 4, 7 and 64 threads; accumulation;
 *   - every refusal of nk_norm_check, and combinations it must accept;
 *   - fp16/bf16 conversions: all 65536 patterns both ways, ties to even at
 *     every midpoint, single rounding from double, libgcc's _Float16;
 *   - a NaN stays in its row; unaligned buffers; optional tensors left
 *     out; NK_ENOMEM under an address-space limit.
 * Every job runs on seeded random data, with every output poisoned (all
 * bits set, a NaN in every dtype) before the run and checked afterwards to
 * have been written, and with guard bytes after every buffer.
 *
 * NORM_TEST_QUICK=1 in the environment skips the large shapes, for runs
 * under valgrind. About 15 s of CPU at -O2.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/tools/rng.h"
#include "kernels/norm_kernels.h"

/* The eps of every job below (apex's default). */
#define EPS 1e-5f

/* Whether to skip the large shapes (NORM_TEST_QUICK=1). */
static bool quick;

/* ---- random numbers (splitmix64, client/tools/rng.h) ---------------------- */

static uint64_t rng_state;

static void rng_seed(uint64_t seed)
{
	rng_state = seed * UINT64_C(0x9e3779b97f4a7c15) + 12345;
}

/* ---- storage, decoded independently of the kernels ----------------------- */

static double decode_f16(uint16_t h)
{
	int e = (h >> 10) & 0x1f, m = h & 0x3ff;
	double v;

	if (e == 0x1f)
		v = m ? NAN : INFINITY;
	else if (e == 0)
		v = ldexp(m, -24);
	else
		v = ldexp(m + 1024, e - 25);
	return (h & 0x8000) ? -v : v;
}

static double decode_bf16(uint16_t h)
{
	uint32_t u = (uint32_t)h << 16;
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

static double decode(enum nk_dtype dt, const void *base, size_t i)
{
	const unsigned char *p = base;
	uint16_t h;
	float f;

	if (dt == NK_F32) {
		memcpy(&f, p + 4 * i, sizeof(f));
		return f;
	}
	memcpy(&h, p + 2 * i, sizeof(h));
	return dt == NK_F16 ? decode_f16(h) : decode_bf16(h);
}

/* The spacing of dtype's numbers at magnitude |d| (subnormals included). */
static double storage_ulp(enum nk_dtype dt, double d)
{
	int mbits = dt == NK_F32 ? 23 : dt == NK_F16 ? 10 : 7;
	int emin = dt == NK_F16 ? -14 : -126;
	int e = d == 0 ? emin : ilogb(d);

	return ldexp(1.0, (e < emin ? emin : e) - mbits);
}

/* ---- buffers with guard bytes --------------------------------------------- */

#define GUARD_BYTES 64
#define GUARD_BYTE 0x5a

/* Offset of every new buffer from malloc's alignment (test_unaligned). */
static size_t misalign;

struct buf {
	unsigned char *raw; /* what malloc returned; NULL: absent */
	void *p;	    /* the tensor, raw + misalign */
	enum nk_dtype dt;
	size_t n, bytes;
};

static void buf_alloc(struct buf *b, enum nk_dtype dt, size_t n)
{
	b->dt = dt;
	b->n = n;
	b->bytes = n * nk_dtype_size(dt);
	b->raw = malloc(b->bytes + misalign + GUARD_BYTES);
	assert_non_null(b->raw);
	b->p = b->raw + misalign;
	memset((unsigned char *)b->p + b->bytes, GUARD_BYTE, GUARD_BYTES);
}

static void buf_free(struct buf *b)
{
	free(b->raw);
	memset(b, 0, sizeof(*b));
}

static void *buf_ptr(const struct buf *b)
{
	return b->raw ? b->p : NULL;
}

static double buf_get(const struct buf *b, size_t i)
{
	return decode(b->dt, b->p, i);
}

static void buf_set(struct buf *b, size_t i, double v)
{
	nk_store(b->dt, b->p, i, v);
}

static void buf_fill_uniform(struct buf *b, double lo, double hi)
{
	for (size_t i = 0; i < b->n; i++)
		buf_set(b, i, rng_uniform(&rng_state, lo, hi));
}

/* A malloc'd double copy of the buffer, or NULL when it is absent. */
static double *buf_decode(const struct buf *b)
{
	double *d;

	if (!b->raw)
		return NULL;
	d = malloc((b->n ? b->n : 1) * sizeof(*d));
	assert_non_null(d);
	for (size_t i = 0; i < b->n; i++)
		d[i] = buf_get(b, i);
	return d;
}

static void buf_check_guard(const struct buf *b, const char *name)
{
	const unsigned char *g = (const unsigned char *)b->p + b->bytes;

	if (!b->raw)
		return;
	for (int i = 0; i < GUARD_BYTES; i++) {
		if (g[i] != GUARD_BYTE)
			fail_msg("%s: written past its end (guard byte %d)", name, i);
	}
}

/* ---- the naive oracle, straight from the formulas -------------------------- */

/*
 * Forward over double arrays. LN: mean = sum x / n, var = sum (x - mean)^2 / n;
 * RMS: mean = 0 in the formulas. g and b may be NULL (1 and 0).
 */
static void naive_forward(bool ln, int64_t rows, int64_t cols, double eps, const double *x,
			  const double *g, const double *b, double *y, double *mean, double *rstd)
{
	for (int64_t r = 0; r < rows; r++) {
		const double *xr = x + r * cols;
		double m = 0, var = 0;
		for (int64_t j = 0; ln && j < cols; j++)
			m += xr[j];
		m /= (double)cols;
		for (int64_t j = 0; j < cols; j++)
			var += (xr[j] - m) * (xr[j] - m);
		double rs = 1.0 / sqrt(var / (double)cols + eps);
		for (int64_t j = 0; j < cols; j++)
			y[r * cols + j] = (xr[j] - m) * rs * (g ? g[j] : 1.0) + (b ? b[j] : 0.0);
		mean[r] = m;
		rstd[r] = rs;
	}
}

/* apex's clamp_by_magnitude. */
static double naive_clamp(double g, double eps, uint32_t *clamped)
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

struct naive_bwd_in {
	bool ln, mem_eff;
	int64_t rows, cols;
	double eps;
	const double *x; /* x, or y when mem_eff */
	const double *dy, *mean, *rstd;
	const double *g, *b; /* may be NULL */
};

/* Backward over double arrays; dg and db (may be NULL) are added to. */
static uint32_t naive_backward(const struct naive_bwd_in *in, double *dx, double *dg, double *db)
{
	int64_t n = in->cols;
	double *gc = malloc((size_t)n * sizeof(*gc));
	uint32_t clamped = 0;

	assert_non_null(gc);
	for (int64_t j = 0; j < n; j++) {
		double g = in->g ? in->g[j] : 1.0;
		gc[j] = in->mem_eff && in->g ? naive_clamp(g, in->eps, &clamped) : g;
	}
	for (int64_t r = 0; r < in->rows; r++) {
		double sum_dyg = 0, sum_dyg_xh = 0, rs = in->rstd[r];
		for (int pass = 0; pass < 2; pass++) {
			for (int64_t j = 0; j < n; j++) {
				int64_t i = r * n + j;
				double g = in->g ? in->g[j] : 1.0, b = in->b ? in->b[j] : 0.0;
				double xh = in->mem_eff
						? (in->x[i] - b) / gc[j]
						: (in->x[i] - (in->ln ? in->mean[r] : 0)) * rs;
				if (pass == 0) {
					sum_dyg += in->dy[i] * g;
					sum_dyg_xh += in->dy[i] * g * xh;
					continue;
				}
				dx[i] = rs * (in->dy[i] * g - (in->ln ? sum_dyg / (double)n : 0) -
					      xh * sum_dyg_xh / (double)n);
				if (dg)
					dg[j] += in->dy[i] * xh;
				if (db)
					db[j] += in->dy[i];
			}
		}
	}
	free(gc);
	return clamped;
}

/* ---- jobs ---------------------------------------------------------------- */

enum affine { AFFINE_NONE, AFFINE_GAMMA, AFFINE_GAMMA_BETA };

struct norm_case {
	enum nk_op op;
	enum nk_dtype dt, wdt;
	enum affine affine;
	bool mem_eff, accumulate;
	int64_t rows, cols;
	bool tiny_gamma; /* some gamma entries 0 or below eps (see set_tiny_gamma) */
};

#define MAX_OUTS 3

/* A job with its buffers, and what the naive oracle expects of it. */
struct job {
	struct norm_case c;
	struct nk_norm_args args;
	bool ln, bwd;
	struct buf x, y, dy, dx, gamma, beta, mean, rstd, dgamma, dbeta;
	struct buf dgamma_old, dbeta_old; /* what accumulation starts from */
	int nouts;
	struct buf *outs[MAX_OUTS];
	const char *names[MAX_OUTS];
	double *expect[MAX_OUTS]; /* the oracle's outputs, not rounded */
	double dx_scale;	  /* ||rstd * dy * g||, see rel_l2() */
	uint32_t expect_clamped;
	bool allow_nan; /* skip the every-output-written check (NaN inputs) */
};

static const char *case_name(const struct norm_case *c)
{
	static const char *affine_names[] = {"none", "gamma", "gamma+beta"};
	static char name[160];

	snprintf(name, sizeof(name), "%s x=%s w=%s affine=%s%s%s%s %lldx%lld", nk_op_name(c->op),
		 nk_dtype_name(c->dt), nk_dtype_name(c->wdt), affine_names[c->affine],
		 c->mem_eff ? " mem_eff" : "", c->accumulate ? " accumulate" : "",
		 c->tiny_gamma ? " tiny_gamma" : "", (long long)c->rows, (long long)c->cols);
	return name;
}

/* A case; flags are enum nk_flags. */
static struct norm_case make_case(enum nk_op op, enum nk_dtype dt, enum nk_dtype wdt,
				  enum affine affine, unsigned flags, int64_t rows, int64_t cols)
{
	struct norm_case c;

	memset(&c, 0, sizeof(c));
	c.op = op;
	c.dt = dt;
	c.wdt = wdt;
	c.affine = affine;
	c.mem_eff = flags & NK_MEMORY_EFFICIENT;
	c.accumulate = flags & NK_ACCUMULATE;
	c.rows = rows;
	c.cols = cols;
	return c;
}

/* Each row gets its own offset and spread, so rows differ in statistics. */
static void fill_rows(struct buf *x, int64_t rows, int64_t cols)
{
	for (int64_t r = 0; r < rows; r++) {
		double mu = rng_uniform(&rng_state, -2, 2), s = rng_uniform(&rng_state, 0.3, 3);
		for (int64_t j = 0; j < cols; j++)
			buf_set(x, (size_t)(r * cols + j),
				mu + s * rng_uniform(&rng_state, -1.7, 1.7));
	}
}

/* Number of entries set_tiny_gamma() clamps, per weight dtype. */
static uint32_t tiny_gamma_clamped(enum nk_dtype wdt)
{
	/* f16 and bf16 round eps (1e-5) and the value just below it up to
	 * 1.0014e-5, which is not clamped. */
	return wdt == NK_F32 ? 7 : 5;
}

/* Puts zeros and values around eps into gamma, spread over the columns. */
static void set_tiny_gamma(struct buf *gamma)
{
	const double e = EPS, below = nextafterf(EPS, 0.0f);
	const double vals[] = {0.0, -0.0, e / 2, -e / 2, e, -e, below, -below, 1e-30};
	size_t nv = sizeof(vals) / sizeof(vals[0]);

	assert_true(gamma->n >= nv);
	for (size_t k = 0; k < nv; k++)
		buf_set(gamma, k * gamma->n / nv, vals[k]);
}

static void job_add_out(struct job *j, struct buf *b, const char *name, double *expect)
{
	assert_true(j->nouts < MAX_OUTS);
	j->outs[j->nouts] = b;
	j->names[j->nouts] = name;
	j->expect[j->nouts] = expect;
	j->nouts++;
}

/* Forward outputs and what the oracle expects of them. */
static void job_build_forward(struct job *j, const double *x, const double *g, const double *b)
{
	const struct norm_case *c = &j->c;
	size_t n = (size_t)(c->rows * c->cols);
	double *y = malloc(n * sizeof(*y)), *mean = malloc((size_t)c->rows * sizeof(*mean));
	double *rstd = malloc((size_t)c->rows * sizeof(*rstd));

	assert_true(y && mean && rstd);
	naive_forward(j->ln, c->rows, c->cols, EPS, x, g, b, y, mean, rstd);
	buf_alloc(&j->y, c->dt, n);
	job_add_out(j, &j->y, "y", y);
	if (j->ln) {
		buf_alloc(&j->mean, NK_F32, (size_t)c->rows);
		job_add_out(j, &j->mean, "mean", mean);
	} else {
		free(mean);
	}
	buf_alloc(&j->rstd, NK_F32, (size_t)c->rows);
	job_add_out(j, &j->rstd, "rstd", rstd);
}

/* Stores the forward statistics (and y) the backward job reads. */
static void job_store_forward_inputs(struct job *j, const double *x, const double *g,
				     const double *b)
{
	const struct norm_case *c = &j->c;
	size_t n = (size_t)(c->rows * c->cols);
	double *y = malloc(n * sizeof(*y)), *mean = malloc((size_t)c->rows * sizeof(*mean));
	double *rstd = malloc((size_t)c->rows * sizeof(*rstd));

	assert_true(y && mean && rstd);
	naive_forward(j->ln, c->rows, c->cols, EPS, x, g, b, y, mean, rstd);
	buf_alloc(&j->rstd, NK_F32, (size_t)c->rows);
	for (int64_t r = 0; r < c->rows; r++)
		buf_set(&j->rstd, (size_t)r, rstd[r]);
	if (j->ln && !c->mem_eff) {
		buf_alloc(&j->mean, NK_F32, (size_t)c->rows);
		for (int64_t r = 0; r < c->rows; r++)
			buf_set(&j->mean, (size_t)r, mean[r]);
	}
	if (c->mem_eff) {
		buf_alloc(&j->y, c->dt, n);
		for (size_t i = 0; i < n; i++)
			buf_set(&j->y, i, y[i]);
	}
	free(y);
	free(mean);
	free(rstd);
}

/* Backward outputs and what the oracle expects, from the stored inputs. */
static void job_build_backward(struct job *j, const double *g, const double *b)
{
	const struct norm_case *c = &j->c;
	size_t n = (size_t)(c->rows * c->cols), cols = (size_t)c->cols;
	double *xin = buf_decode(c->mem_eff ? &j->y : &j->x), *dy = buf_decode(&j->dy);
	double *mean = buf_decode(&j->mean), *rstd = buf_decode(&j->rstd);
	double *dx = malloc(n * sizeof(*dx));
	double *dg = c->affine >= AFFINE_GAMMA ? buf_decode(&j->dgamma_old) : NULL;
	double *db = c->affine == AFFINE_GAMMA_BETA ? buf_decode(&j->dbeta_old) : NULL;
	struct naive_bwd_in in = {.ln = j->ln,
				  .mem_eff = c->mem_eff,
				  .rows = c->rows,
				  .cols = c->cols,
				  .eps = EPS,
				  .x = xin,
				  .dy = dy,
				  .mean = mean,
				  .rstd = rstd,
				  .g = g,
				  .b = b};

	assert_non_null(dx);
	for (size_t i = 0; !c->accumulate && i < cols; i++) {
		if (dg)
			dg[i] = 0;
		if (db)
			db[i] = 0;
	}
	j->expect_clamped = naive_backward(&in, dx, dg, db);
	for (size_t i = 0; i < n; i++) {
		double s = rstd[i / cols] * dy[i] * (g ? g[i % cols] : 1.0);
		j->dx_scale += s * s;
	}
	j->dx_scale = sqrt(j->dx_scale);

	buf_alloc(&j->dx, c->dt, n);
	job_add_out(j, &j->dx, "dx", dx);
	if (dg) {
		buf_alloc(&j->dgamma, c->wdt, cols);
		job_add_out(j, &j->dgamma, "dgamma", dg);
	}
	if (db) {
		buf_alloc(&j->dbeta, c->wdt, cols);
		job_add_out(j, &j->dbeta, "dbeta", db);
	}
	free(xin);
	free(dy);
	free(mean);
	free(rstd);
}

static void job_fill_args(struct job *j)
{
	const struct norm_case *c = &j->c;
	struct nk_norm_args *a = &j->args;

	memset(a, 0, sizeof(*a));
	a->op = c->op;
	a->rows = c->rows;
	a->cols = c->cols;
	a->eps = EPS;
	a->dtype = c->dt;
	a->weight_dtype = c->wdt;
	a->flags = (c->mem_eff ? NK_MEMORY_EFFICIENT : 0) | (c->accumulate ? NK_ACCUMULATE : 0);
	a->x = c->mem_eff ? buf_ptr(&j->y) : buf_ptr(&j->x);
	a->y = j->bwd ? NULL : buf_ptr(&j->y);
	a->mean = buf_ptr(&j->mean);
	a->rstd = buf_ptr(&j->rstd);
	a->gamma = buf_ptr(&j->gamma);
	a->beta = buf_ptr(&j->beta);
	a->dy = buf_ptr(&j->dy);
	a->dx = buf_ptr(&j->dx);
	a->dgamma = buf_ptr(&j->dgamma);
	a->dbeta = buf_ptr(&j->dbeta);
}

/*
 * Draws the inputs of a case from `seed` and computes the oracle's outputs.
 * The draws come in the same order whatever the flags, so cases that differ
 * only in mem_eff or accumulate see the same data.
 */
static void job_build(struct job *j, const struct norm_case *c, uint64_t seed)
{
	size_t n = (size_t)(c->rows * c->cols), cols = (size_t)c->cols;

	memset(j, 0, sizeof(*j));
	j->c = *c;
	j->ln = c->op == NK_LAYERNORM_FWD || c->op == NK_LAYERNORM_BWD;
	j->bwd = c->op == NK_LAYERNORM_BWD || c->op == NK_RMSNORM_BWD;
	rng_seed(seed);
	buf_alloc(&j->x, c->dt, n);
	fill_rows(&j->x, c->rows, c->cols);
	if (c->affine >= AFFINE_GAMMA) {
		buf_alloc(&j->gamma, c->wdt, cols);
		for (size_t i = 0; i < cols; i++)
			buf_set(&j->gamma, i,
				(rng_next(&rng_state) & 1 ? -1 : 1) *
				    rng_uniform(&rng_state, 0.5, 1.5));
		if (c->tiny_gamma)
			set_tiny_gamma(&j->gamma);
	}
	if (c->affine == AFFINE_GAMMA_BETA) {
		buf_alloc(&j->beta, c->wdt, cols);
		buf_fill_uniform(&j->beta, -1, 1);
	}
	double *x = buf_decode(&j->x), *g = buf_decode(&j->gamma), *b = buf_decode(&j->beta);
	if (!j->bwd) {
		job_build_forward(j, x, g, b);
	} else {
		buf_alloc(&j->dy, c->dt, n);
		buf_fill_uniform(&j->dy, -1, 1);
		buf_alloc(&j->dgamma_old, c->wdt, cols);
		buf_fill_uniform(&j->dgamma_old, -2, 2);
		buf_alloc(&j->dbeta_old, c->wdt, cols);
		buf_fill_uniform(&j->dbeta_old, -2, 2);
		job_store_forward_inputs(j, x, g, b);
		job_build_backward(j, g, b);
	}
	free(x);
	free(g);
	free(b);
	job_fill_args(j);
}

static void job_free(struct job *j)
{
	struct buf *bufs[] = {&j->x,	  &j->y,     &j->dy,	     &j->dx,
			      &j->gamma,  &j->beta,  &j->mean,	     &j->rstd,
			      &j->dgamma, &j->dbeta, &j->dgamma_old, &j->dbeta_old};

	for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
		buf_free(bufs[i]);
	for (int k = 0; k < j->nouts; k++)
		free(j->expect[k]);
	j->nouts = 0;
}

static void job_check_guards(const struct job *j)
{
	const struct buf *bufs[] = {&j->x,    &j->y,	&j->dy,	  &j->dx,     &j->gamma,
				    &j->beta, &j->mean, &j->rstd, &j->dgamma, &j->dbeta};
	static const char *names[] = {"x",    "y",    "dy",   "dx",	"gamma",
				      "beta", "mean", "rstd", "dgamma", "dbeta"};

	for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
		buf_check_guard(bufs[i], names[i]);
}

/* Poisons the outputs (or restores the accumulators) and runs the job. */
static uint32_t job_run(struct job *j, enum nk_cpu_precision precision, int threads)
{
	struct nk_cpu_opts opts = {precision, threads};
	struct nk_norm_result res = {.clamped_cols = 0xdeadbeef};
	int rc;

	for (int k = 0; k < j->nouts; k++)
		memset(j->outs[k]->p, 0xff, j->outs[k]->bytes);
	if (j->c.accumulate && j->dgamma.raw)
		memcpy(j->dgamma.p, j->dgamma_old.p, j->dgamma.bytes);
	if (j->c.accumulate && j->dbeta.raw)
		memcpy(j->dbeta.p, j->dbeta_old.p, j->dbeta.bytes);

	rc = nk_cpu_norm(&j->args, &opts, &res);
	if (rc != NK_OK)
		fail_msg("%s: nk_cpu_norm returned %d", case_name(&j->c), rc);
	job_check_guards(j);
	for (int k = 0; !j->allow_nan && k < j->nouts; k++) {
		for (size_t i = 0; i < j->outs[k]->n; i++) {
			if (isnan(buf_get(j->outs[k], i)))
				fail_msg("%s: %s[%zu] not written (precision %d, %d threads)",
					 case_name(&j->c), j->names[k], i, precision, threads);
		}
	}
	return res.clamped_cols;
}

/* ---- comparisons ------------------------------------------------------------ */

/*
 * (a) Each output is the oracle's value rounded to its dtype: within half
 * an ulp, plus 1e-12 of the tensor's largest value for the different order
 * in which the kernel sums in double.
 */
static void check_against_oracle(const struct job *j)
{
	for (int k = 0; k < j->nouts; k++) {
		const struct buf *b = j->outs[k];
		const double *e = j->expect[k];
		double maxabs = 0;
		for (size_t i = 0; i < b->n; i++)
			maxabs = fmax(maxabs, fabs(e[i]));
		for (size_t i = 0; i < b->n; i++) {
			double o = buf_get(b, i);
			double tol = 0.5 * storage_ulp(b->dt, e[i]) * (1 + 1e-9) + 1e-12 * maxabs;
			if (!(fabs(o - e[i]) <= tol))
				fail_msg("%s: %s[%zu] = %.9g, oracle %.9g (tolerance %.3g)",
					 case_name(&j->c), j->names[k], i, o, e[i], tol);
		}
	}
}

/*
 * ||got - want|| / max(||want||, scale). dx passes ||rstd * dy * g||, the
 * size of its leading term: where that term nearly cancels (RMSNorm with
 * cols = 1, where dx ~ eps / x^2), dx is tiny and ill-conditioned, and its
 * error is measured against the terms it came from.
 */
static double rel_l2(const double *want, const struct buf *got, double scale)
{
	double diff = 0, norm = 0;

	for (size_t i = 0; i < got->n; i++) {
		double d = buf_get(got, i) - want[i];
		diff += d * d;
		norm += want[i] * want[i];
	}
	norm = fmax(sqrt(norm), scale);
	if (norm == 0)
		return diff == 0 ? 0 : INFINITY;
	return sqrt(diff) / norm;
}

/* Decoded copies of a job's outputs (free with outputs_free). */
static void outputs_decode(const struct job *j, double **out)
{
	for (int k = 0; k < j->nouts; k++)
		out[k] = buf_decode(j->outs[k]);
}

static void outputs_free(const struct job *j, double **out)
{
	for (int k = 0; k < j->nouts; k++)
		free(out[k]);
}

/* Compares the current outputs with `want` by relative L2 error. */
static void check_rel_l2(const struct job *j, double *const *want, double tol_f32, double tol_16,
			 const char *what)
{
	for (int k = 0; k < j->nouts; k++) {
		const struct buf *b = j->outs[k];
		double scale = b == &j->dx ? j->dx_scale : 0;
		double tol = b->dt == NK_F32 ? tol_f32 : tol_16;
		double err = rel_l2(want[k], b, scale);
		if (!(err < tol))
			fail_msg("%s: %s: %s relative L2 error %.3g >= %.3g", case_name(&j->c),
				 what, j->names[k], err, tol);
	}
}

/* Raw bytes of every output, for bitwise comparisons. */
static void outputs_copy(const struct job *j, unsigned char **out)
{
	for (int k = 0; k < j->nouts; k++) {
		out[k] = malloc(j->outs[k]->bytes + 1);
		assert_non_null(out[k]);
		memcpy(out[k], j->outs[k]->p, j->outs[k]->bytes);
	}
}

static void outputs_copy_free(const struct job *j, unsigned char **out)
{
	for (int k = 0; k < j->nouts; k++)
		free(out[k]);
}

static void check_same_bits(const struct job *j, unsigned char *const *want, const char *what)
{
	for (int k = 0; k < j->nouts; k++) {
		if (memcmp(want[k], j->outs[k]->p, j->outs[k]->bytes) != 0)
			fail_msg("%s: %s: %s differs bitwise", case_name(&j->c), what, j->names[k]);
	}
}

/* ---- (a), (b): every combination against the oracle ---------------------- */

struct shape {
	int64_t rows, cols;
};

static const struct shape small_shapes[] = {
    {1, 1}, {3, 1}, {2, 7}, {1, 31}, {3, 32}, {5, 33}, {1, 1000}, {4, 1000}, {1, 4096}, {2, 4096},
};

/* Every combination runs one of these, in turn. */
static const struct shape large_shapes[] = {{3000, 1000}, {3, 65536}, {1, 65536}};

/* (a) and (b) for one case; gamma is far from eps, so nothing is clamped. */
static void run_sweep_case(const struct norm_case *c, uint64_t seed)
{
	struct job j;
	double *ref[MAX_OUTS];

	job_build(&j, c, seed);
	uint32_t clamped = job_run(&j, NK_CPU_REFERENCE, 2);
	check_against_oracle(&j);
	assert_int_equal(clamped, j.expect_clamped);
	assert_int_equal(clamped, 0);

	outputs_decode(&j, ref);
	clamped = job_run(&j, NK_CPU_FP32, 2);
	assert_int_equal(clamped, 0);
	check_rel_l2(&j, ref, 1e-5, 1e-2, "fp32 against reference");
	outputs_free(&j, ref);
	job_free(&j);
}

/* Runs a combination on every small shape and on large shape number `large`. */
static void sweep_shapes(struct norm_case *c, int large, uint64_t *seed)
{
	size_t nsmall = sizeof(small_shapes) / sizeof(small_shapes[0]);

	for (size_t s = 0; s < nsmall; s++) {
		c->rows = small_shapes[s].rows;
		c->cols = small_shapes[s].cols;
		run_sweep_case(c, ++*seed);
	}
	if (quick)
		return;
	c->rows = large_shapes[large].rows;
	c->cols = large_shapes[large].cols;
	run_sweep_case(c, ++*seed);
}

/*
 * Combination number k (of SWEEP_COMBOS) of one op: dtype x weight dtype
 * (same or f32) x affine (none, gamma, gamma+beta) x memory_efficient x
 * accumulate. False for combinations that do not exist or that the
 * validation refuses.
 */
#define SWEEP_COMBOS (3 * 2 * 3 * 2 * 2)

static bool sweep_case(enum nk_op op, int k, struct norm_case *c)
{
	static const enum nk_dtype dtypes[] = {NK_F32, NK_F16, NK_BF16};
	enum nk_dtype dt = dtypes[k % 3];
	bool f32_weights = k / 3 % 2;
	unsigned flags = (k / 18 % 2 ? NK_MEMORY_EFFICIENT : 0) | (k / 36 % 2 ? NK_ACCUMULATE : 0);
	bool bwd = op == NK_LAYERNORM_BWD || op == NK_RMSNORM_BWD;
	bool rms = op == NK_RMSNORM_FWD || op == NK_RMSNORM_BWD;

	*c = make_case(op, dt, f32_weights ? NK_F32 : dt, (enum affine)(k / 6 % 3), flags, 0, 0);
	if (f32_weights && dt == NK_F32)
		return false; /* the same as dtype */
	if (rms && c->affine == AFFINE_GAMMA_BETA)
		return false;
	if (!bwd && flags)
		return false;
	return !(c->accumulate && c->affine == AFFINE_NONE); /* nothing to accumulate */
}

/* Every combination of one op on every small shape and one large one. */
static void sweep_op(enum nk_op op)
{
	int nlarge = sizeof(large_shapes) / sizeof(large_shapes[0]);
	uint64_t seed = 1000 * (uint64_t)op;
	int combo = 0;
	struct norm_case c;

	for (int k = 0; k < SWEEP_COMBOS; k++) {
		if (sweep_case(op, k, &c))
			sweep_shapes(&c, combo++ % nlarge, &seed);
	}
}

static void test_sweep_layernorm_forward(void **state)
{
	(void)state;
	sweep_op(NK_LAYERNORM_FWD);
}

static void test_sweep_layernorm_backward(void **state)
{
	(void)state;
	sweep_op(NK_LAYERNORM_BWD);
}

static void test_sweep_rmsnorm_forward(void **state)
{
	(void)state;
	sweep_op(NK_RMSNORM_FWD);
}

static void test_sweep_rmsnorm_backward(void **state)
{
	(void)state;
	sweep_op(NK_RMSNORM_BWD);
}

/* ---- the oracle checked against finite differences ------------------------ */

/* sum(w * y) for the naive forward: its gradient is the backward with dy = w. */
static double naive_loss(bool ln, int64_t rows, int64_t cols, const double *x, const double *g,
			 const double *b, const double *w)
{
	size_t n = (size_t)(rows * cols);
	double *y = malloc(n * sizeof(*y)), *mean = malloc((size_t)rows * sizeof(*mean));
	double *rstd = malloc((size_t)rows * sizeof(*rstd)), loss = 0;

	assert_true(y && mean && rstd);
	naive_forward(ln, rows, cols, EPS, x, g, b, y, mean, rstd);
	for (size_t i = 0; i < n; i++)
		loss += w[i] * y[i];
	free(y);
	free(mean);
	free(rstd);
	return loss;
}

/* Central difference of naive_loss in v[i] (v is x, g or b). */
static double loss_slope(bool ln, int64_t rows, int64_t cols, double *x, double *g, double *b,
			 const double *w, double *v, size_t i)
{
	double keep = v[i], h = 1e-5 * fmax(1, fabs(keep)), up, down;

	v[i] = keep + h;
	up = naive_loss(ln, rows, cols, x, g, b, w);
	v[i] = keep - h;
	down = naive_loss(ln, rows, cols, x, g, b, w);
	v[i] = keep;
	return (up - down) / (2 * h);
}

static void check_slopes(const char *what, const double *analytic, const double *numeric, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (!(fabs(analytic[i] - numeric[i]) <= 1e-6 * fmax(1, fabs(numeric[i]))))
			fail_msg("%s[%zu]: backward %.12g, finite difference %.12g", what, i,
				 analytic[i], numeric[i]);
	}
}

/* One shape: dx, dgamma, dbeta of naive_backward (and its memory-efficient
 * form, from y) against finite differences of naive_forward. */
static void gradient_check(bool ln, int64_t rows, int64_t cols)
{
	size_t n = (size_t)(rows * cols), nc = (size_t)cols;
	double *x = malloc(n * sizeof(double)), *w = malloc(n * sizeof(double));
	double *y = malloc(n * sizeof(double)), *mean = malloc((size_t)rows * sizeof(double));
	double *rstd = malloc((size_t)rows * sizeof(double)), *dx = malloc(n * sizeof(double));
	double *g = malloc(nc * sizeof(double)), *b = malloc(nc * sizeof(double));
	double *dg = calloc(nc, sizeof(double)), *db = calloc(nc, sizeof(double));
	double *num = malloc(n * sizeof(double));

	assert_true(x && w && y && mean && rstd && dx && g && b && dg && db && num);
	for (size_t i = 0; i < n; i++) {
		x[i] = rng_uniform(&rng_state, -2, 2);
		w[i] = rng_uniform(&rng_state, -1, 1);
	}
	for (size_t j = 0; j < nc; j++) {
		g[j] = (rng_next(&rng_state) & 1 ? -1 : 1) * rng_uniform(&rng_state, 0.5, 1.5);
		b[j] = ln ? rng_uniform(&rng_state, -1, 1) : 0;
	}
	naive_forward(ln, rows, cols, EPS, x, g, b, y, mean, rstd);
	struct naive_bwd_in in = {.ln = ln,
				  .rows = rows,
				  .cols = cols,
				  .eps = EPS,
				  .x = x,
				  .dy = w,
				  .mean = mean,
				  .rstd = rstd,
				  .g = g,
				  .b = b};
	naive_backward(&in, dx, dg, db);

	for (size_t i = 0; i < n; i++)
		num[i] = loss_slope(ln, rows, cols, x, g, b, w, x, i);
	check_slopes("dx", dx, num, n);
	for (size_t j = 0; j < nc; j++)
		num[j] = loss_slope(ln, rows, cols, x, g, b, w, g, j);
	check_slopes("dgamma", dg, num, nc);
	for (size_t j = 0; ln && j < nc; j++)
		num[j] = loss_slope(ln, rows, cols, x, g, b, w, b, j);
	if (ln)
		check_slopes("dbeta", db, num, nc);

	/* The memory-efficient form, from y, gives the same gradients. */
	memcpy(num, dx, n * sizeof(double));
	in.mem_eff = true;
	in.x = y;
	in.mean = NULL;
	memset(dg, 0, nc * sizeof(double));
	memset(db, 0, nc * sizeof(double));
	assert_int_equal(naive_backward(&in, dx, NULL, NULL), 0);
	check_slopes("memory-efficient dx", dx, num, n);

	double *all[] = {x, w, y, mean, rstd, dx, g, b, dg, db, num};
	for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
		free(all[i]);
}

static void test_oracle_is_gradient(void **state)
{
	static const int64_t cols[] = {1, 2, 7, 33};

	(void)state;
	rng_seed(7);
	for (size_t c = 0; c < sizeof(cols) / sizeof(cols[0]); c++) {
		gradient_check(true, 3, cols[c]);
		gradient_check(false, 3, cols[c]);
	}
}

/* ---- (c) memory-efficient backward ------------------------------------------ */

/*
 * Backward case number k (of BACKWARD_GRID): op x dtype x weight dtype
 * (same or f32) x affine (gamma, gamma+beta); false where that does not exist.
 */
#define BACKWARD_GRID (2 * 3 * 2 * 2)

static bool backward_case(int k, unsigned flags, int64_t rows, int64_t cols, struct norm_case *c)
{
	static const enum nk_dtype dtypes[] = {NK_F32, NK_F16, NK_BF16};
	enum nk_op op = k % 2 ? NK_RMSNORM_BWD : NK_LAYERNORM_BWD;
	enum nk_dtype dt = dtypes[k / 2 % 3];
	bool f32_weights = k / 6 % 2;
	enum affine affine = k / 12 % 2 ? AFFINE_GAMMA_BETA : AFFINE_GAMMA;

	*c = make_case(op, dt, f32_weights ? NK_F32 : dt, affine, flags, rows, cols);
	return !(f32_weights && dt == NK_F32) && !(k % 2 && affine == AFFINE_GAMMA_BETA);
}

/*
 * The memory-efficient backward, which reads y rounded to its dtype, agrees
 * with the standard one where |gamma| >= 0.5, and clamps nothing. (Not with
 * LayerNorm on cols = 1: x_hat is exactly 0 there, but y - beta is beta's
 * rounding error when y is stored in a narrower dtype than beta.)
 */
static void test_memory_efficient_matches_standard(void **state)
{
	static const double tol[] = {1e-5, 2e-3, 2e-2}; /* by dtype: y's rounding */
	static const struct shape shapes[] = {{64, 1000}, {3, 4096}, {7, 33}, {5, 7}};
	uint64_t seed = 5000;

	(void)state;
	for (int k = 0; k < BACKWARD_GRID * 4; k++) {
		const struct shape *sh = &shapes[k / BACKWARD_GRID];
		struct norm_case c;
		struct job std, eff;
		double *want[MAX_OUTS];
		if (!backward_case(k % BACKWARD_GRID, 0, sh->rows, sh->cols, &c))
			continue;
		job_build(&std, &c, ++seed);
		c.mem_eff = true;
		job_build(&eff, &c, seed);
		for (int p = 0; p < 2; p++) {
			enum nk_cpu_precision prec = p ? NK_CPU_REFERENCE : NK_CPU_FP32;
			job_run(&std, prec, 2);
			outputs_decode(&std, want);
			assert_int_equal(job_run(&eff, prec, 2), 0);
			check_rel_l2(&eff, want, tol[c.dt], tol[c.dt],
				     "memory-efficient vs standard");
			outputs_free(&std, want);
		}
		job_free(&std);
		job_free(&eff);
	}
}

/* Zero and tiny gamma entries are clamped, counted, and computed as apex does. */
static void test_memory_efficient_clamp_count(void **state)
{
	static const struct shape shapes[] = {{4, 1000}, {3, 9}};
	uint64_t seed = 6000;

	(void)state;
	for (int k = 0; k < BACKWARD_GRID * 2; k++) {
		const struct shape *sh = &shapes[k / BACKWARD_GRID];
		struct norm_case c;
		struct job j;
		if (!backward_case(k % BACKWARD_GRID, NK_MEMORY_EFFICIENT, sh->rows, sh->cols, &c))
			continue;
		c.tiny_gamma = true;
		job_build(&j, &c, ++seed);
		assert_int_equal(j.expect_clamped, tiny_gamma_clamped(c.wdt));
		assert_int_equal(job_run(&j, NK_CPU_REFERENCE, 1), j.expect_clamped);
		check_against_oracle(&j);
		assert_int_equal(job_run(&j, NK_CPU_FP32, 3), j.expect_clamped);
		job_free(&j);
	}
}

/* Without gamma nothing is clamped, whatever eps (which memory-efficient
 * backward reads for the clamp alone). */
static void test_memory_efficient_without_gamma(void **state)
{
	unsigned char *want[MAX_OUTS];
	struct nk_norm_result res;
	struct job j;

	(void)state;
	for (int k = 0; k < 2; k++) {
		enum nk_op op = k ? NK_RMSNORM_BWD : NK_LAYERNORM_BWD;
		struct norm_case c =
		    make_case(op, NK_F16, NK_F16, AFFINE_NONE, NK_MEMORY_EFFICIENT, 5, 100);
		job_build(&j, &c, 6500 + (uint64_t)k);
		assert_int_equal(job_run(&j, NK_CPU_REFERENCE, 1), 0);
		check_against_oracle(&j);
		outputs_copy(&j, want);
		j.args.eps = 4;
		assert_int_equal(nk_cpu_norm(&j.args, NULL, &res), NK_OK);
		assert_int_equal(res.clamped_cols, 0);
		assert_int_equal(
		    nk_cpu_norm(&j.args, &(struct nk_cpu_opts){NK_CPU_REFERENCE, 1}, &res), NK_OK);
		check_same_bits(&j, want, "eps = 4");
		outputs_copy_free(&j, want);
		job_free(&j);
	}
}

/* ---- (d) thread count ------------------------------------------------------------ */

/* 1, 4, 7 and 64 threads give the same bits, in both precisions. */
static void check_thread_invariance(const struct norm_case *c, uint64_t seed)
{
	static const int threads[] = {4, 7, 64};
	struct job j;
	unsigned char *want[MAX_OUTS];
	char what[32];

	job_build(&j, c, seed);
	for (int p = 0; p < 2; p++) {
		enum nk_cpu_precision prec = p ? NK_CPU_REFERENCE : NK_CPU_FP32;
		job_run(&j, prec, 1);
		outputs_copy(&j, want);
		for (size_t t = 0; t < sizeof(threads) / sizeof(threads[0]); t++) {
			job_run(&j, prec, threads[t]);
			snprintf(what, sizeof(what), "%d threads, precision %d", threads[t], prec);
			check_same_bits(&j, want, what);
		}
		outputs_copy_free(&j, want);
	}
	job_free(&j);
}

static void test_threads_do_not_change_bits(void **state)
{
	static const struct shape shapes[] = {{3000, 1000}, {5, 65536}, {300, 1000}, {70, 4096}};
	static const struct norm_case cases[] = {
	    {NK_LAYERNORM_FWD, NK_BF16, NK_F32, AFFINE_GAMMA_BETA, false, false, 0, 0, false},
	    {NK_LAYERNORM_BWD, NK_F32, NK_F32, AFFINE_GAMMA_BETA, false, true, 0, 0, false},
	    {NK_LAYERNORM_BWD, NK_F16, NK_F16, AFFINE_GAMMA_BETA, true, false, 0, 0, false},
	    {NK_RMSNORM_FWD, NK_F16, NK_F32, AFFINE_GAMMA, false, false, 0, 0, false},
	    {NK_RMSNORM_BWD, NK_BF16, NK_F32, AFFINE_GAMMA, false, false, 0, 0, false},
	    {NK_RMSNORM_BWD, NK_F32, NK_F32, AFFINE_GAMMA, true, true, 0, 0, false},
	};
	size_t ncases = sizeof(cases) / sizeof(cases[0]);

	(void)state;
	for (size_t s = quick ? 2 : 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
		for (size_t k = 0; k < ncases; k++) {
			struct norm_case c = cases[k];
			/* The largest shape with only some cases, for time. */
			if (s == 0 && k % 2)
				continue;
			c.rows = shapes[s].rows;
			c.cols = shapes[s].cols;
			check_thread_invariance(&c, 7000 + 10 * s + k);
		}
	}
}

/* ---- (e) accumulation -------------------------------------------------------------- */

/* Accumulating adds the gradient of this job to what the outputs held. */
static void test_accumulate_adds(void **state)
{
	uint64_t seed = 8000;

	(void)state;
	for (int k = 0; k < BACKWARD_GRID; k++) {
		struct norm_case c;
		struct job plain, acc;
		if (!backward_case(k, 0, 300, 1000, &c))
			continue;
		job_build(&plain, &c, ++seed);
		c.accumulate = true;
		job_build(&acc, &c, seed);
		job_run(&plain, NK_CPU_FP32, 2);
		job_run(&acc, NK_CPU_FP32, 2);
		for (int o = 1; o < acc.nouts; o++) {
			const struct buf *old = o == 1 ? &acc.dgamma_old : &acc.dbeta_old;
			for (size_t i = 0; i < acc.outs[o]->n; i++) {
				double a = buf_get(acc.outs[o], i), p = buf_get(plain.outs[o], i);
				double want = buf_get(old, i) + p;
				double tol = storage_ulp(c.wdt, fabs(want) + fabs(p));
				if (!(fabs(a - want) <= tol))
					fail_msg("%s: %s[%zu] = %g, old + plain = %g",
						 case_name(&c), acc.names[o], i, a, want);
			}
		}
		/* dx does not accumulate. */
		assert_memory_equal(acc.dx.p, plain.dx.p, acc.dx.bytes);
		job_free(&plain);
		job_free(&acc);
	}
}

/* ---- (f) validation --------------------------------------------------------------- */

static float dummy[64];

/* A valid LayerNorm backward with every tensor present (never run). */
static struct nk_norm_args valid_backward(void)
{
	struct nk_norm_args a = {
	    .op = NK_LAYERNORM_BWD,
	    .rows = 4,
	    .cols = 8,
	    .eps = EPS,
	    .dtype = NK_F16,
	    .weight_dtype = NK_F32,
	    .x = dummy,
	    .mean = dummy,
	    .rstd = dummy,
	    .gamma = dummy,
	    .beta = dummy,
	    .dy = dummy,
	    .dx = dummy,
	    .dgamma = dummy,
	    .dbeta = dummy,
	};
	return a;
}

/* Refusal number k (< SCALAR_REFUSALS) of op, dtypes, shape, eps or flags,
 * applied to a valid job; returns a word the reason must contain. */
#define SCALAR_REFUSALS 16

static const char *refuse_scalar(int k, struct nk_norm_args *a)
{
	switch (k) {
	case 0:
		a->op = (enum nk_op)7;
		return "op";
	case 1:
		a->op = (enum nk_op)(-1);
		return "op";
	case 2:
		a->dtype = (enum nk_dtype)5;
		return "dtype";
	case 3:
		a->weight_dtype = (enum nk_dtype)9;
		return "weight_dtype";
	case 4: /* f16 data, bf16 weights */
		a->weight_dtype = NK_BF16;
		return "weight_dtype";
	case 5:
		a->dtype = NK_F32;
		a->weight_dtype = NK_F16;
		return "weight_dtype";
	case 6:
		a->rows = 0;
		return "rows";
	case 7:
		a->rows = -3;
		return "rows";
	case 8:
		a->cols = 0;
		return "cols";
	case 9:
		a->cols = INT64_C(1) << 32;
		return "cols";
	case 10:
		a->rows = INT64_MAX / 2;
		a->cols = 1000;
		return "rows * cols";
	case 11:
		a->eps = 0;
		return "eps";
	case 12:
		a->eps = -1e-5f;
		return "eps";
	case 13:
		a->eps = NAN;
		return "eps";
	case 14:
		a->eps = INFINITY;
		return "eps";
	case 15:
		a->flags = 1u << 5;
		return "flag";
	}
	return NULL;
}

/* Refusal number k of the flags or tensors of an op; returns a word the
 * reason must contain, NULL past the last one. */
static const char *refuse_tensor(int k, struct nk_norm_args *a)
{
	switch (k) {
	case 0:
		a->op = NK_LAYERNORM_FWD;
		a->flags = NK_MEMORY_EFFICIENT;
		return "backward";
	case 1:
		a->op = NK_RMSNORM_FWD;
		a->beta = a->mean = NULL;
		a->flags = NK_ACCUMULATE;
		return "backward";
	case 2:
		a->x = NULL;
		return "x is absent";
	case 3:
		a->x = NULL;
		a->flags = NK_MEMORY_EFFICIENT;
		return "y (passed in x)";
	case 4:
		a->gamma = a->dgamma = a->dbeta = NULL;
		return "gamma is absent";
	case 5:
		a->op = NK_LAYERNORM_FWD;
		a->gamma = NULL;
		a->y = dummy;
		return "gamma is absent";
	case 6:
		a->gamma = a->beta = a->dbeta = NULL;
		return "dgamma";
	case 7:
		a->gamma = a->beta = a->dgamma = NULL;
		return "dbeta";
	case 8:
		a->op = NK_RMSNORM_BWD;
		a->mean = a->dbeta = NULL;
		return "no beta";
	case 9:
		a->op = NK_RMSNORM_FWD;
		a->mean = NULL;
		a->y = dummy;
		return "no beta";
	case 10:
		a->op = NK_RMSNORM_BWD;
		a->beta = a->mean = NULL;
		return "no dbeta";
	case 11:
		a->op = NK_RMSNORM_FWD;
		a->beta = NULL;
		a->y = dummy;
		return "no mean";
	case 12:
		a->op = NK_LAYERNORM_FWD;
		return "y is absent";
	case 13:
		a->dy = NULL;
		return "dy";
	case 14:
		a->dx = NULL;
		return "dx";
	case 15:
		a->rstd = NULL;
		return "rstd";
	case 16:
		a->mean = NULL;
		return "mean";
	}
	return NULL;
}

/* Refusal number k applied to a valid job: returns a word its reason must
 * contain, NULL past the last one. */
static const char *make_refused(int k, struct nk_norm_args *a)
{
	*a = valid_backward();
	if (k < SCALAR_REFUSALS)
		return refuse_scalar(k, a);
	return refuse_tensor(k - SCALAR_REFUSALS, a);
}

static void test_check_refuses(void **state)
{
	struct nk_norm_args a;
	const char *word, *why = NULL;

	(void)state;
	for (int k = 0; (word = make_refused(k, &a)) != NULL; k++) {
		struct nk_cpu_opts opts = {NK_CPU_REFERENCE, 1};
		if (nk_norm_check(&a, &why) != NK_EINVAL || !why)
			fail_msg("refusal %d was accepted", k);
		if (!strstr(why, word))
			fail_msg("refusal %d: reason \"%s\" does not name \"%s\"", k, why, word);
		assert_int_equal(nk_norm_check(&a, NULL), NK_EINVAL);
		assert_int_equal(nk_cpu_norm(&a, &opts, NULL), NK_EINVAL);
	}
	assert_int_equal(nk_norm_check(NULL, &why), NK_EINVAL);
	assert_non_null(why);
}

/* Accepted variant number k of a valid job; false past the last one. */
static bool make_accepted(int k, struct nk_norm_args *a)
{
	*a = valid_backward();
	switch (k) {
	case 0: /* LayerNorm forward with x and y alone */
		memset(a, 0, sizeof(*a));
		a->rows = a->cols = 1;
		a->eps = EPS;
		a->x = a->y = dummy;
		return true;
	case 1: /* forward: dy, dx, dgamma, dbeta are ignored */
		a->op = NK_LAYERNORM_FWD;
		a->y = dummy;
		return true;
	case 2:
		a->op = NK_RMSNORM_FWD;
		a->beta = a->mean = a->rstd = NULL;
		a->y = dummy;
		return true;
	case 3:
		a->flags = NK_MEMORY_EFFICIENT;
		a->mean = NULL;
		return true;
	case 4: /* memory-efficient backward ignores mean */
		a->flags = NK_MEMORY_EFFICIENT | NK_ACCUMULATE;
		return true;
	case 5: /* RMSNorm backward computing dx alone */
		a->op = NK_RMSNORM_BWD;
		a->beta = a->mean = a->dbeta = a->dgamma = NULL;
		return true;
	case 6: /* dbeta of a LayerNorm without beta */
		a->beta = NULL;
		return true;
	case 7: /* accumulate with nothing to accumulate into */
		a->gamma = a->beta = a->dgamma = a->dbeta = NULL;
		a->flags = NK_ACCUMULATE;
		return true;
	case 8:
		a->dtype = a->weight_dtype = NK_BF16;
		return true;
	case 9:
		a->dtype = a->weight_dtype = NK_F32;
		return true;
	case 10:
		a->cols = UINT32_MAX;
		return true;
	case 11:
		a->eps = FLT_TRUE_MIN;
		return true;
	case 12:
		a->eps = FLT_MAX;
		return true;
	}
	return false;
}

static void test_check_accepts(void **state)
{
	struct nk_norm_args a;
	const char *why = "unset";

	(void)state;
	for (int k = 0; make_accepted(k, &a); k++) {
		if (nk_norm_check(&a, &why) != NK_OK)
			fail_msg("valid variant %d refused: %s", k, why);
		assert_null(why);
	}
}

/* Options: NULL opts is fp32 on one thread, NULL result is fine, and an
 * unknown precision is refused. */
static void test_cpu_options(void **state)
{
	struct norm_case c = make_case(NK_LAYERNORM_BWD, NK_F16, NK_F32, AFFINE_GAMMA_BETA,
				       NK_MEMORY_EFFICIENT, 9, 100);
	struct nk_cpu_opts bad = {(enum nk_cpu_precision)2, 1};
	unsigned char *want[MAX_OUTS];
	struct job j;

	(void)state;
	job_build(&j, &c, 8500);
	job_run(&j, NK_CPU_FP32, 1);
	outputs_copy(&j, want);
	for (int k = 0; k < j.nouts; k++)
		memset(j.outs[k]->p, 0xff, j.outs[k]->bytes);
	assert_int_equal(nk_cpu_norm(&j.args, NULL, NULL), NK_OK);
	check_same_bits(&j, want, "opts = NULL");
	assert_int_equal(nk_cpu_norm(&j.args, &bad, NULL), NK_EINVAL);
	job_run(&j, NK_CPU_FP32, 0);
	check_same_bits(&j, want, "0 threads");
	job_run(&j, NK_CPU_FP32, -3);
	check_same_bits(&j, want, "-3 threads");
	outputs_copy_free(&j, want);
	job_free(&j);
}

static void test_names(void **state)
{
	(void)state;
	assert_int_equal(nk_dtype_size(NK_F32), 4);
	assert_int_equal(nk_dtype_size(NK_F16), 2);
	assert_int_equal(nk_dtype_size(NK_BF16), 2);
	assert_int_equal(nk_dtype_size((enum nk_dtype)3), 0);
	assert_string_equal(nk_dtype_name(NK_BF16), "bf16");
	assert_string_equal(nk_dtype_name((enum nk_dtype) - 1), "?");
	assert_string_equal(nk_op_name(NK_RMSNORM_BWD), "rmsnorm_bwd");
	assert_string_equal(nk_op_name((enum nk_op)4), "?");
	assert_true(isnan(nk_load((enum nk_dtype)3, dummy, 0)));
}

/* ---- (g) conversions ---------------------------------------------------------------- */

static double decode16(enum nk_dtype dt, uint16_t h)
{
	return dt == NK_F16 ? decode_f16(h) : decode_bf16(h);
}

static uint16_t encode16(enum nk_dtype dt, float f)
{
	return dt == NK_F16 ? nk_f32_to_f16(f) : nk_f32_to_bf16(f);
}

/* Every bit pattern decodes exactly and encodes back to itself; a NaN stays
 * a NaN of the same sign (a signalling one becomes quiet). */
static void round_trip_all(enum nk_dtype dt)
{
	uint16_t quiet = dt == NK_F16 ? 0x0200 : 0x0040;

	for (uint32_t u = 0; u < 65536; u++) {
		uint16_t h = (uint16_t)u, back, stored;
		double want = decode16(dt, h);
		float f = dt == NK_F16 ? nk_f16_to_f32(h) : nk_bf16_to_f32(h);
		if (isnan(want) != isnan(f) || (!isnan(want) && want != f) ||
		    !signbit(want) != !signbit(f))
			fail_msg("%s 0x%04x decodes to %g, want %g", nk_dtype_name(dt), u, f, want);
		assert_true(isnan(nk_load(dt, &h, 0)) == isnan(want));
		back = encode16(dt, f);
		nk_store(dt, &stored, 0, nk_load(dt, &h, 0));
		if (!isnan(want) && (back != h || stored != h))
			fail_msg("%s 0x%04x encodes back to 0x%04x / 0x%04x", nk_dtype_name(dt), u,
				 back, stored);
		if (isnan(want) &&
		    !(isnan(decode16(dt, back)) && (back | quiet) == (h | quiet) && stored == back))
			fail_msg("%s NaN 0x%04x encodes back to 0x%04x", nk_dtype_name(dt), u,
				 back);
	}
}

static void test_round_trip_f16(void **state)
{
	(void)state;
	round_trip_all(NK_F16);
}

static void test_round_trip_bf16(void **state)
{
	(void)state;
	round_trip_all(NK_BF16);
}

/*
 * For every pair of neighbours (h, h + 1) of both signs, up to the largest
 * finite value and its neighbour infinity: the midpoint goes to the even one,
 * anything above it (even above by less than a float can hold, which is
 * where rounding through float first goes wrong) to h + 1, below it to h.
 */
static void ties_to_even(enum nk_dtype dt)
{
	uint16_t max = dt == NK_F16 ? 0x7bff : 0x7f7f;

	for (uint16_t h = 0; h <= max; h++) {
		double a = decode16(dt, h), prev = h ? decode16(dt, h - 1) : 0;
		double b = h < max ? decode16(dt, h + 1) : 2 * a - prev;
		double mid = (a + b) / 2;
		for (int s = 0; s < 2; s++) {
			double sg = s ? -1 : 1;
			uint16_t sign = s ? 0x8000 : 0, got;
			uint16_t even = (uint16_t)(sign | (h & 1 ? h + 1 : h));
			assert_int_equal(encode16(dt, (float)(sg * mid)), even);
			nk_store(dt, &got, 0, sg * mid);
			assert_int_equal(got, even);
			nk_store(dt, &got, 0, sg * mid * (1 + 0x1p-40));
			assert_int_equal(got, sign | (h + 1));
			nk_store(dt, &got, 0, sg * (mid - fabs(mid) * 0x1p-40));
			assert_int_equal(got, sign | h);
			got = encode16(dt, nextafterf((float)(sg * mid), (float)(sg * INFINITY)));
			assert_int_equal(got, sign | (h + 1));
		}
	}
}

static void test_rounding_ties_to_even(void **state)
{
	(void)state;
	ties_to_even(NK_F16);
	ties_to_even(NK_BF16);
	assert_int_equal(nk_f32_to_f16(65519.0f), 0x7bff);
	assert_int_equal(nk_f32_to_f16(65520.0f), 0x7c00);
	assert_int_equal(nk_f32_to_f16(-1e10f), 0xfc00);
	assert_int_equal(nk_f32_to_bf16(FLT_MAX), 0x7f80);
	assert_int_equal(nk_f32_to_f16(0x1p-25f), 0x0000);   /* tie with 0 */
	assert_int_equal(nk_f32_to_f16(0x1.8p-24f), 0x0002); /* tie, to even */
	assert_int_equal(nk_f32_to_bf16(0x1p-149f), 0x0000); /* smallest float subnormal */
	assert_int_equal(nk_f32_to_bf16(0x1.01p-126f), 0x0080);
}

#ifdef __FLT16_MAX__
/* Against the compiler's _Float16 conversions (libgcc's, single rounding). */
static void test_f16_matches_compiler(void **state)
{
	(void)state;
	rng_seed(9);
	for (int i = 0; i < 1000000; i++) {
		uint32_t u = (uint32_t)rng_next(&rng_state);
		float f;
		double d =
		    ldexp(rng_uniform(&rng_state, -1, 1), (int)(rng_next(&rng_state) % 60) - 40);
		_Float16 hf, hd;
		uint16_t want, got;
		memcpy(&f, &u, sizeof(f));
		hf = (_Float16)f;
		hd = (_Float16)d;
		memcpy(&want, &hf, sizeof(want));
		got = nk_f32_to_f16(f);
		if (isnan(f) ? !isnan(decode_f16(got)) : got != want)
			fail_msg("f16 of %a: 0x%04x, compiler 0x%04x", f, got, want);
		memcpy(&want, &hd, sizeof(want));
		nk_store(NK_F16, &got, 0, d);
		if (got != want)
			fail_msg("f16 of double %a: 0x%04x, compiler 0x%04x", d, got, want);
	}
}
#endif

/* ---- (h) NaN stays in its row ------------------------------------------------------- */

/*
 * Whether element i of output k must be NaN after x (or dy, for in_dy) got
 * a NaN at (row, col): the row of y, dx, mean and rstd; column col of dgamma
 * (x_hat is NaN there only, as backward reads the stored statistics), and of
 * dbeta when dy holds the NaN.
 */
static bool nan_expected(const struct job *j, int k, size_t i, int64_t row, int64_t col, bool in_dy)
{
	const struct buf *b = j->outs[k];

	if (b == &j->dgamma)
		return (int64_t)i == col;
	if (b == &j->dbeta)
		return in_dy && (int64_t)i == col;
	if (b == &j->mean || b == &j->rstd)
		return (int64_t)i == row;
	return (int64_t)i / j->c.cols == row;
}

/* Puts one NaN into x (or dy) and checks that everything else is as before. */
static void check_nan_confined(struct job *j, int64_t row, int64_t col, bool in_dy)
{
	unsigned char *clean[MAX_OUTS];

	job_run(j, NK_CPU_FP32, 4);
	outputs_copy(j, clean);
	buf_set(in_dy	       ? &j->dy
		: j->c.mem_eff ? &j->y
			       : &j->x,
		(size_t)(row * j->c.cols + col), NAN);
	j->allow_nan = true;
	job_run(j, NK_CPU_FP32, 4);
	for (int k = 0; k < j->nouts; k++) {
		const struct buf *b = j->outs[k];
		size_t es = nk_dtype_size(b->dt);
		for (size_t i = 0; i < b->n; i++) {
			const unsigned char *now = (const unsigned char *)b->p + i * es;
			bool nan = nan_expected(j, k, i, row, col, in_dy);
			if (nan && !isnan(buf_get(b, i)))
				fail_msg("%s: %s[%zu] is not NaN", case_name(&j->c), j->names[k],
					 i);
			if (!nan && memcmp(clean[k] + i * es, now, es) != 0)
				fail_msg("%s: %s[%zu] changed", case_name(&j->c), j->names[k], i);
		}
		free(clean[k]);
	}
}

/* A NaN in one row of x, y or dy stays in that row (and its column of the
 * weight gradients), with several threads and blocks. */
static void test_nan_stays_in_row(void **state)
{
	static const enum nk_op ops[] = {NK_LAYERNORM_FWD, NK_RMSNORM_FWD, NK_LAYERNORM_BWD,
					 NK_RMSNORM_BWD};

	(void)state;
	for (int k = 0; k < 4 * 2 * 2; k++) {
		enum nk_op op = ops[k % 4];
		bool ln = op == NK_LAYERNORM_FWD || op == NK_LAYERNORM_BWD;
		bool bwd = op == NK_LAYERNORM_BWD || op == NK_RMSNORM_BWD;
		enum affine affine = ln ? AFFINE_GAMMA_BETA : AFFINE_GAMMA;
		unsigned flags = k / 8 ? NK_MEMORY_EFFICIENT : 0;
		struct norm_case c =
		    make_case(op, k / 4 % 2 ? NK_BF16 : NK_F32, NK_F32, affine, flags, 300, 1000);
		struct job j;
		if (flags && !bwd)
			continue;
		job_build(&j, &c, 9000 + (uint64_t)k);
		check_nan_confined(&j, 137, 500, false);
		job_free(&j);
		if (!bwd)
			continue;
		job_build(&j, &c, 9000 + (uint64_t)k);
		check_nan_confined(&j, 250, 3, true);
		job_free(&j);
	}
}

/* ---- alignment, optional tensors, memory ---------------------------------------- */

/* Buffers at every byte offset from malloc's alignment give the same bits. */
static void test_unaligned(void **state)
{
	static const struct norm_case cases[] = {
	    {NK_LAYERNORM_FWD, NK_BF16, NK_BF16, AFFINE_GAMMA_BETA, false, false, 33, 1000, false},
	    {NK_LAYERNORM_BWD, NK_F16, NK_F32, AFFINE_GAMMA_BETA, true, true, 300, 1000, false},
	    {NK_RMSNORM_BWD, NK_F32, NK_F32, AFFINE_GAMMA, false, false, 300, 1000, false},
	    {NK_RMSNORM_FWD, NK_F16, NK_F16, AFFINE_GAMMA, false, false, 5, 33, false},
	};

	(void)state;
	for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
		unsigned char *want[MAX_OUTS];
		struct job j;
		int nouts;
		misalign = 0;
		job_build(&j, &cases[k], 9500 + k);
		job_run(&j, NK_CPU_FP32, 3);
		outputs_copy(&j, want);
		nouts = j.nouts;
		job_free(&j);
		for (misalign = 1; misalign < 4; misalign++) {
			job_build(&j, &cases[k], 9500 + k);
			job_run(&j, NK_CPU_FP32, 3);
			check_same_bits(&j, want, "unaligned buffers");
			job_free(&j);
		}
		misalign = 0;
		for (int o = 0; o < nouts; o++)
			free(want[o]);
	}
}

/* Runs modified args with the job's outputs poisoned; returns them as bytes. */
static void run_args(struct job *j, const struct nk_norm_args *a, unsigned char **out)
{
	struct nk_cpu_opts opts = {NK_CPU_FP32, 2};

	for (int k = 0; k < j->nouts; k++)
		memset(j->outs[k]->p, 0xff, j->outs[k]->bytes);
	assert_int_equal(nk_cpu_norm(a, &opts, NULL), NK_OK);
	job_check_guards(j);
	outputs_copy(j, out);
}

/* Whether output k has the same bytes in both runs. */
static bool same_out(const struct job *j, int k, unsigned char **a, unsigned char **b)
{
	return memcmp(a[k], b[k], j->outs[k]->bytes) == 0;
}

/* Optional outputs may be left out without changing the others; tensors an
 * op does not read or write are neither read nor written. */
static void test_optional_tensors(void **state)
{
	struct norm_case fwd =
	    make_case(NK_LAYERNORM_FWD, NK_F16, NK_F32, AFFINE_GAMMA_BETA, 0, 300, 1000);
	struct norm_case bwd = make_case(NK_LAYERNORM_BWD, NK_BF16, NK_BF16, AFFINE_GAMMA_BETA,
					 NK_MEMORY_EFFICIENT, 300, 1000);
	unsigned char *full[MAX_OUTS], *part[MAX_OUTS];
	struct nk_norm_args a;
	struct job j;
	float *nan_stats = malloc(300 * sizeof(float));

	(void)state;
	assert_non_null(nan_stats);
	for (int i = 0; i < 300; i++)
		nan_stats[i] = NAN;
	/* Forward without mean and rstd; dx and dgamma set but never touched. */
	job_build(&j, &fwd, 9600);
	run_args(&j, &j.args, full);
	a = j.args;
	a.mean = NULL;
	a.rstd = NULL;
	a.dx = nan_stats;
	a.dgamma = nan_stats;
	run_args(&j, &a, part);
	assert_true(same_out(&j, 0, full, part));
	for (int i = 0; i < 300; i++)
		assert_true(isnan(nan_stats[i]));
	outputs_copy_free(&j, full);
	outputs_copy_free(&j, part);
	job_free(&j);

	/* Memory-efficient backward never reads mean; dbeta and dgamma may be
	 * left out. */
	job_build(&j, &bwd, 9601);
	run_args(&j, &j.args, full);
	a = j.args;
	a.mean = nan_stats;
	a.dbeta = NULL;
	run_args(&j, &a, part);
	assert_true(same_out(&j, 0, full, part) && same_out(&j, 1, full, part));
	outputs_copy_free(&j, part);
	a.dgamma = NULL;
	run_args(&j, &a, part);
	assert_true(same_out(&j, 0, full, part));
	outputs_copy_free(&j, full);
	outputs_copy_free(&j, part);
	job_free(&j);
	free(nan_stats);
}

/* AddressSanitizer and ThreadSanitizer reserve more address space than any
 * limit the out-of-memory test could set. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define UNDER_SANITIZER 1
#endif
#endif

/* In a child limited to 32 MiB more address space than it uses: a job
 * whose scratch needs more returns NK_ENOMEM. 77: the limit does not work
 * here (the probe allocation succeeded). */
static int out_of_memory_child(void)
{
	const int64_t rows = 2, cols = INT64_C(1) << 22;
	size_t bytes = (size_t)(rows * cols) * 2;
	uint16_t *x = malloc(bytes), *y = malloc(bytes);
	struct nk_norm_args a = {.op = NK_LAYERNORM_FWD,
				 .rows = rows,
				 .cols = cols,
				 .eps = EPS,
				 .dtype = NK_F16,
				 .weight_dtype = NK_F16,
				 .x = x,
				 .y = y};
	struct nk_cpu_opts opts = {NK_CPU_REFERENCE, 1};
	long pages = 0;
	FILE *f = fopen("/proc/self/statm", "r");
	struct rlimit rl;
	int rc = 2;

	if (!x || !y || !f || fscanf(f, "%ld", &pages) != 1)
		goto out;
	memset(x, 0x3c, bytes);
	getrlimit(RLIMIT_AS, &rl);
	rl.rlim_cur = (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + (32u << 20);
	rc = 77;
	if (setrlimit(RLIMIT_AS, &rl) != 0)
		goto out;
	/* volatile: a compiler may drop an allocation that is only freed. */
	void *volatile probe = malloc(96u << 20);
	if (probe) {
		free(probe);
		goto out;
	}
	rc = nk_cpu_norm(&a, &opts, NULL) == NK_ENOMEM ? 0 : 1;
out:
	if (f)
		fclose(f);
	free(x);
	free(y);
	return rc;
}

static void test_out_of_memory(void **state)
{
	int status;
	pid_t pid;

	(void)state;
#ifdef UNDER_SANITIZER
	skip();
#endif
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0)
		_exit(out_of_memory_child());
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	if (WEXITSTATUS(status) == 77)
		skip();
	assert_int_equal(WEXITSTATUS(status), 0);
}

int main(void)
{
	const char *q = getenv("NORM_TEST_QUICK");
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_sweep_layernorm_forward),
	    cmocka_unit_test(test_sweep_layernorm_backward),
	    cmocka_unit_test(test_sweep_rmsnorm_forward),
	    cmocka_unit_test(test_sweep_rmsnorm_backward),
	    cmocka_unit_test(test_oracle_is_gradient),
	    cmocka_unit_test(test_memory_efficient_matches_standard),
	    cmocka_unit_test(test_memory_efficient_clamp_count),
	    cmocka_unit_test(test_memory_efficient_without_gamma),
	    cmocka_unit_test(test_threads_do_not_change_bits),
	    cmocka_unit_test(test_accumulate_adds),
	    cmocka_unit_test(test_check_refuses),
	    cmocka_unit_test(test_check_accepts),
	    cmocka_unit_test(test_cpu_options),
	    cmocka_unit_test(test_names),
	    cmocka_unit_test(test_round_trip_f16),
	    cmocka_unit_test(test_round_trip_bf16),
	    cmocka_unit_test(test_rounding_ties_to_even),
#ifdef __FLT16_MAX__
	    cmocka_unit_test(test_f16_matches_compiler),
#endif
	    cmocka_unit_test(test_nan_stays_in_row),
	    cmocka_unit_test(test_unaligned),
	    cmocka_unit_test(test_optional_tensors),
	    cmocka_unit_test(test_out_of_memory),
	};

	quick = q && *q && strcmp(q, "0") != 0;
	return cmocka_run_group_tests(tests, NULL, NULL);
}
