/*
 * Tests of issue 19's variants in the CPU kernels (kernels/norm_cpu.c,
 * kernels/norm_cpu_row.h) and their shared parts (kernels/norm_common.c):
 * residual add + norm (s = x + residual; backward dx = dnorm(s) + ds),
 * the weight offset (zero-centered gamma, Gemma's offset) and FP8 output
 * (e4m3, e5m2, with scale and amax). docs/VARIANTS.md is what they check.
 *
 * The oracle is a naive double implementation written here from the
 * formulas (sharing with the kernels only the f16/bf16 conversions, which
 * tests/unit/test_norm_cpu.c checks exhaustively), and the FP8 oracle a
 * brute force search over all 256 codes, decoded here independently.
 * Checked:
 *   - FP8: every code decoded; every finite code round-trips; ties to even
 *     at every midpoint; saturation, infinities, NaN, signed zero,
 *     subnormals; 200k random doubles against the brute force;
 *   - every variant (LayerNorm and RMSNorm, forward and backward, f32, f16,
 *     bf16, residual, ds, weight offsets, FP8 e4m3/e5m2, memory_efficient)
 *     on odd widths: the reference mode within half an ulp of the oracle,
 *     its FP8 codes the correctly rounded scaled oracle value, and the fp32
 *     mode within 1e-6 relative L2 of the reference for f32 outputs;
 *   - s is the same bits in both modes, the correctly rounded x + residual;
 *   - the fp32 mode's FP8 codes are exactly its fp32 y scaled and rounded
 *     once, and its amax exactly the largest |y| of those;
 *   - dx is the gradient of x and of residual (finite differences);
 *   - zero-centered gamma equals a shifted gamma bit for bit; the offset
 *     is not rounded to the weight dtype;
 *   - the in-place forms give the bits of the out-of-place ones, and no
 *     variant depends on the number of threads;
 *   - NaN and Inf rows stay in their rows (FP8 NaN, saturation, amax);
 *   - nk_norm_check's refusals of the new fields, nk_norm_features.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/tools/rng.h"
#include "kernels/norm_kernels.h"

#define EPS 1e-5f

static uint64_t rng_state = 19;

/* ---- FP8, decoded here from the format's definition ----------------------- */

/* The value of an FP8 byte: e4m3 has no infinities and one NaN per sign. */
static double fp8_decode(enum nk_fp8 f, uint8_t b)
{
	bool e4m3 = f == NK_FP8_E4M3;
	int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, emax = e4m3 ? 15 : 31;
	int e = (b & 0x7f) >> mbits, m = b & ((1 << mbits) - 1);
	double sign = (b & 0x80) ? -1.0 : 1.0;

	if (e4m3 && e == 15 && m == 7)
		return NAN;
	if (!e4m3 && e == emax)
		return m ? NAN : sign * INFINITY;
	if (e == 0)
		return sign * m * pow(2.0, 1 - bias - mbits);
	return sign * (1.0 + m / (double)(1 << mbits)) * pow(2.0, e - bias);
}

static double fp8_max(enum nk_fp8 f)
{
	return f == NK_FP8_E4M3 ? 448.0 : 57344.0;
}

/*
 * The correctly rounded, saturated code of v by brute force: the nearest
 * finite code, ties to the even code (last bit 0), |v| >= max to +-max.
 */
static uint8_t fp8_oracle(enum nk_fp8 f, double v)
{
	static double table[2][128];
	static bool ready;
	if (!ready) {
		for (int b = 0; b < 128; b++) {
			table[0][b] = fp8_decode(NK_FP8_E4M3, (uint8_t)b);
			table[1][b] = fp8_decode(NK_FP8_E5M2, (uint8_t)b);
		}
		ready = true;
	}
	if (isnan(v))
		return 0x7f;
	uint8_t sign = signbit(v) ? 0x80 : 0, best = 0;
	double a = fabs(v), best_d = INFINITY;
	if (a >= fp8_max(f))
		a = fp8_max(f);
	for (int b = 0; b < 128; b++) {
		double c = table[f == NK_FP8_E5M2][b];
		if (isnan(c) || isinf(c))
			continue;
		double d = fabs(c - a);
		if (d < best_d || (d == best_d && !(b & 1))) {
			best_d = d;
			best = (uint8_t)b;
		}
	}
	return sign | best;
}

/* How close v lies to a midpoint between two FP8 neighbours, relative to |v|. */
static double fp8_midpoint_distance(enum nk_fp8 f, double v)
{
	double a = fabs(v), best = INFINITY;
	for (int b = 0; b < 127; b++) {
		double lo = fp8_decode(f, (uint8_t)b), hi = fp8_decode(f, (uint8_t)(b + 1));
		if (isnan(hi) || isinf(hi))
			continue;
		double d = fabs(a - (lo + hi) / 2);
		best = d < best ? d : best;
	}
	return a > 0 ? best / a : best;
}

static const enum nk_fp8 fp8_formats[] = {NK_FP8_E4M3, NK_FP8_E5M2};

static void test_fp8_decodes_every_code(void **state)
{
	(void)state;
	for (int k = 0; k < 2; k++) {
		enum nk_fp8 f = fp8_formats[k];
		for (int b = 0; b < 256; b++) {
			double want = fp8_decode(f, (uint8_t)b),
			       got = nk_fp8_to_double(f, (uint8_t)b);
			if (isnan(want) ? !isnan(got) : memcmp(&want, &got, sizeof(got)) != 0)
				fail_msg("%s code 0x%02x: %g, want %g", nk_fp8_name(f), b, got,
					 want);
		}
	}
	assert_int_equal(nk_fp8_to_double(NK_FP8_E4M3, 0x7e), 448.0);
	assert_int_equal(nk_fp8_to_double(NK_FP8_E5M2, 0x7b), 57344.0);
	assert_true(isnan(nk_fp8_to_double(NK_FP8_E4M3, 0xff)));
	assert_true(isinf(nk_fp8_to_double(NK_FP8_E5M2, 0x7c)));
	assert_true(fp8_decode(NK_FP8_E4M3, 0x01) == 0x1p-9);
	assert_true(fp8_decode(NK_FP8_E5M2, 0x01) == 0x1p-16);
}

static void test_fp8_round_trip(void **state)
{
	(void)state;
	for (int k = 0; k < 2; k++) {
		enum nk_fp8 f = fp8_formats[k];
		for (int b = 0; b < 256; b++) {
			double v = fp8_decode(f, (uint8_t)b);
			uint8_t want = isnan(v) ? 0x7f : isinf(v) ? (b & 0x80) | 0x7b : (uint8_t)b;
			assert_int_equal(nk_fp8_from_double(f, v), want);
		}
	}
}

/* Midpoints tie to even, a nudge either way goes to the nearer code. */
static void test_fp8_ties_to_even(void **state)
{
	(void)state;
	for (int k = 0; k < 2; k++) {
		enum nk_fp8 f = fp8_formats[k];
		for (int b = 0; b < 127; b++) {
			double lo = fp8_decode(f, (uint8_t)b), hi = fp8_decode(f, (uint8_t)(b + 1));
			if (isnan(hi) || isinf(hi) || hi > fp8_max(f))
				continue;
			double mid = (lo + hi) / 2, even = (b & 1) ? b + 1 : b;
			for (int s = 0; s < 2; s++) {
				double sign = s ? -1.0 : 1.0;
				uint8_t sb = s ? 0x80 : 0;
				assert_int_equal(nk_fp8_from_double(f, sign * mid),
						 sb | (uint8_t)even);
				assert_int_equal(nk_fp8_from_double(f, sign * nextafter(mid, 0)),
						 sb | (uint8_t)b);
				assert_int_equal(
				    nk_fp8_from_double(f, sign * nextafter(mid, INFINITY)),
				    sb | (uint8_t)(b + 1));
			}
		}
	}
	/* Half the smallest subnormal ties to zero; a hair more is the subnormal. */
	assert_int_equal(nk_fp8_from_double(NK_FP8_E4M3, 0x1p-10), 0x00);
	assert_int_equal(nk_fp8_from_double(NK_FP8_E4M3, 0x1.0000001p-10), 0x01);
	assert_int_equal(nk_fp8_from_double(NK_FP8_E5M2, -0x1p-17), 0x80);
	assert_int_equal(nk_fp8_from_double(NK_FP8_E4M3, 1e-300), 0x00);
}

static void test_fp8_saturates(void **state)
{
	(void)state;
	const double big[] = {448.0, 448.5, 463.9, 464.0, 500.0, 1e30, INFINITY};
	for (size_t i = 0; i < sizeof(big) / sizeof(big[0]); i++) {
		assert_int_equal(nk_fp8_from_double(NK_FP8_E4M3, big[i]), 0x7e);
		assert_int_equal(nk_fp8_from_double(NK_FP8_E4M3, -big[i]), 0xfe);
	}
	const double big5[] = {57344.0, 60000.0, 61439.0, 65536.0, 1e300, INFINITY};
	for (size_t i = 0; i < sizeof(big5) / sizeof(big5[0]); i++) {
		assert_int_equal(nk_fp8_from_double(NK_FP8_E5M2, big5[i]), 0x7b);
		assert_int_equal(nk_fp8_from_double(NK_FP8_E5M2, -big5[i]), 0xfb);
	}
	assert_int_equal(nk_fp8_from_double(NK_FP8_E4M3, NAN), 0x7f);
	assert_int_equal(nk_fp8_from_double(NK_FP8_E5M2, -NAN), 0x7f);
	assert_int_equal(nk_fp8_from_double(NK_FP8_E4M3, -0.0), 0x80);
	assert_int_equal(nk_fp8_from_double(NK_FP8_E5M2, 0.0), 0x00);
	assert_int_equal(nk_fp8_from_double(NK_FP8_NONE, 1.0), 0x7f);
	assert_true(isnan(nk_fp8_to_double(NK_FP8_NONE, 0)));
	assert_string_equal(nk_fp8_name(NK_FP8_E4M3), "e4m3");
	assert_string_equal(nk_fp8_name(NK_FP8_E5M2), "e5m2");
	assert_string_equal(nk_fp8_name(NK_FP8_NONE), "none");
	assert_string_equal(nk_fp8_name((enum nk_fp8)9), "?");
}

/* Random magnitudes over the whole range, from underflow to saturation. */
static void test_fp8_random_against_brute_force(void **state)
{
	(void)state;
	uint64_t st = 77;
	for (int i = 0; i < 200000; i++) {
		enum nk_fp8 f = fp8_formats[i & 1];
		double v = ldexp(rng_uniform(&st, 1.0, 2.0), (int)rng_below(&st, 40) - 24);
		if (rng_next(&st) & 1)
			v = -v;
		uint8_t got = nk_fp8_from_double(f, v), want = fp8_oracle(f, v);
		if (got != want)
			fail_msg("%s(%a) = 0x%02x, want 0x%02x", nk_fp8_name(f), v, got, want);
	}
}

/* ---- jobs ------------------------------------------------------------------ */

/* A variant job: which parts are on, and its shape and types. */
struct vcase {
	bool ln, bwd, mem_eff;
	int64_t rows, cols;
	enum nk_dtype dt, wdt;
	bool gamma, beta, residual, ds;
	float offset;
	enum nk_fp8 fp8;
	float scale;
};

enum {
	T_X,
	T_R,
	T_S,
	T_Y,
	T_MEAN,
	T_RSTD,
	T_G,
	T_B,
	T_DY,
	T_DS,
	T_DX,
	T_DG,
	T_DB,
	T_SCALE,
	T_AMAX,
	T_COUNT
};

struct vjob {
	struct vcase c;
	struct nk_norm_args args;
	void *t[T_COUNT]; /* every buffer, NULL when absent */
	size_t bytes[T_COUNT];
};

static const char *vcase_name(const struct vcase *c)
{
	static char name[200];
	snprintf(name, sizeof(name), "%s_%s x=%s w=%s%s%s%s%s offset=%g fp8=%s%s %lldx%lld",
		 c->ln ? "layernorm" : "rmsnorm", c->bwd ? "bwd" : "fwd", nk_dtype_name(c->dt),
		 nk_dtype_name(c->wdt), c->gamma ? " gamma" : "", c->beta ? "+beta" : "",
		 c->residual ? " residual" : "", c->ds ? " ds" : "", (double)c->offset,
		 nk_fp8_name(c->fp8), c->mem_eff ? " mem_eff" : "", (long long)c->rows,
		 (long long)c->cols);
	return name;
}

static void *vj_alloc(struct vjob *j, int t, size_t bytes)
{
	j->bytes[t] = bytes;
	j->t[t] = malloc(bytes ? bytes : 1);
	assert_non_null(j->t[t]);
	memset(j->t[t], 0xff, bytes);
	return j->t[t];
}

static void vj_fill(struct vjob *j, int t, enum nk_dtype dt, size_t n, double lo, double hi,
		    bool random_sign)
{
	vj_alloc(j, t, n * nk_dtype_size(dt));
	for (size_t i = 0; i < n; i++) {
		double v = rng_uniform(&rng_state, lo, hi);
		if (random_sign && (rng_next(&rng_state) & 1))
			v = -v;
		nk_store(dt, j->t[t], i, v);
	}
}

static void vj_free(struct vjob *j)
{
	for (int t = 0; t < T_COUNT; t++)
		free(j->t[t]);
	memset(j, 0, sizeof(*j));
}

/* Points args at the buffers (forward or backward roles). */
static void vj_args(struct vjob *j)
{
	const struct vcase *c = &j->c;
	struct nk_norm_args *a = &j->args;
	memset(a, 0, sizeof(*a));
	a->op = c->bwd ? (c->ln ? NK_LAYERNORM_BWD : NK_RMSNORM_BWD)
		       : (c->ln ? NK_LAYERNORM_FWD : NK_RMSNORM_FWD);
	a->rows = c->rows;
	a->cols = c->cols;
	a->eps = EPS;
	a->dtype = c->dt;
	a->weight_dtype = c->wdt;
	a->flags = c->bwd && c->mem_eff ? NK_MEMORY_EFFICIENT : 0;
	a->gamma = j->t[T_G];
	a->beta = j->t[T_B];
	a->weight_offset = c->offset;
	a->rstd = j->t[T_RSTD];
	a->mean = c->ln && !(c->bwd && c->mem_eff) ? j->t[T_MEAN] : NULL;
	if (!c->bwd) {
		a->x = j->t[T_X];
		a->y = j->t[T_Y];
		a->residual = j->t[T_R];
		a->residual_out = j->t[T_S];
		a->y_fp8 = c->fp8;
		a->scale = j->t[T_SCALE];
		a->amax = j->t[T_AMAX];
		return;
	}
	a->x = c->mem_eff ? j->t[T_Y] : c->residual ? j->t[T_S] : j->t[T_X];
	a->dy = j->t[T_DY];
	a->ds = j->t[T_DS];
	a->dx = j->t[T_DX];
	a->dgamma = j->t[T_DG];
	a->dbeta = j->t[T_DB];
}

static int vj_run(struct vjob *j, enum nk_cpu_precision p, int threads)
{
	struct nk_cpu_opts opts = {p, threads};
	return nk_cpu_norm(&j->args, &opts, NULL);
}

/*
 * Builds the job: random inputs and, for a backward, the forward outputs it
 * reads (s, y, mean, rstd) from the reference forward of the same case
 * with y in dtype.
 */
static void vj_build(struct vjob *j, const struct vcase *c, uint64_t seed)
{
	size_t n = (size_t)(c->rows * c->cols), ds = nk_dtype_size(c->dt);
	memset(j, 0, sizeof(*j));
	j->c = *c;
	rng_state = seed;
	vj_fill(j, T_X, c->dt, n, -1.5, 2.5, false);
	if (c->residual)
		vj_fill(j, T_R, c->dt, n, -2.0, 2.0, false);
	if (c->gamma)
		vj_fill(j, T_G, c->wdt, (size_t)c->cols, 0.25, 1.5, true);
	if (c->beta)
		vj_fill(j, T_B, c->wdt, (size_t)c->cols, -0.5, 0.5, false);
	vj_alloc(j, T_RSTD, (size_t)c->rows * 4);
	if (c->ln)
		vj_alloc(j, T_MEAN, (size_t)c->rows * 4);
	if (c->residual)
		vj_alloc(j, T_S, n * ds);
	if (!c->bwd && c->fp8) {
		vj_alloc(j, T_Y, n);
		vj_alloc(j, T_SCALE, 4);
		memcpy(j->t[T_SCALE], &c->scale, 4);
		vj_alloc(j, T_AMAX, 4);
	} else {
		vj_alloc(j, T_Y, n * ds);
	}
	if (!c->bwd) {
		vj_args(j);
		return;
	}
	/* The forward a backward follows. */
	j->c.bwd = false;
	vj_args(j);
	assert_int_equal(vj_run(j, NK_CPU_REFERENCE, 1), NK_OK);
	j->c.bwd = true;
	vj_fill(j, T_DY, c->dt, n, -1.0, 1.0, false);
	if (c->ds)
		vj_fill(j, T_DS, c->dt, n, -1.0, 1.0, false);
	vj_alloc(j, T_DX, n * ds);
	if (c->gamma)
		vj_alloc(j, T_DG, (size_t)c->cols * nk_dtype_size(c->wdt));
	if (c->beta)
		vj_alloc(j, T_DB, (size_t)c->cols * nk_dtype_size(c->wdt));
	vj_args(j);
}

/* The outputs of the job, by buffer index; returns how many. */
static int vj_outputs(const struct vjob *j, int out[6])
{
	static const int fwd[] = {T_Y, T_S, T_MEAN, T_RSTD, T_AMAX};
	static const int bwd[] = {T_DX, T_DG, T_DB};
	const int *list = j->c.bwd ? bwd : fwd;
	int count = j->c.bwd ? 3 : 5, k = 0;
	for (int i = 0; i < count; i++) {
		if (j->t[list[i]])
			out[k++] = list[i];
	}
	return k;
}

/* The storage dtype of buffer t. */
static enum nk_dtype vj_dtype(const struct vjob *j, int t)
{
	switch (t) {
	case T_MEAN:
	case T_RSTD:
	case T_SCALE:
	case T_AMAX:
		return NK_F32;
	case T_G:
	case T_B:
	case T_DG:
	case T_DB:
		return j->c.wdt;
	default:
		return j->c.dt;
	}
}

static double vj_get(const struct vjob *j, int t, size_t i)
{
	return nk_load(vj_dtype(j, t), j->t[t], i);
}

/* A copy of every output buffer (free with outputs_free). */
static void outputs_save(const struct vjob *j, void *saved[T_COUNT])
{
	memset(saved, 0, T_COUNT * sizeof(void *));
	int out[6], n = vj_outputs(j, out);
	for (int k = 0; k < n; k++) {
		saved[out[k]] = malloc(j->bytes[out[k]]);
		assert_non_null(saved[out[k]]);
		memcpy(saved[out[k]], j->t[out[k]], j->bytes[out[k]]);
	}
}

static void outputs_free(void *saved[T_COUNT])
{
	for (int t = 0; t < T_COUNT; t++)
		free(saved[t]);
}

static void outputs_poison(struct vjob *j)
{
	int out[6], n = vj_outputs(j, out);
	for (int k = 0; k < n; k++)
		memset(j->t[out[k]], 0xff, j->bytes[out[k]]);
}

static void outputs_same_bits(const struct vjob *j, void *saved[T_COUNT], const char *what)
{
	int out[6], n = vj_outputs(j, out);
	for (int k = 0; k < n; k++) {
		if (memcmp(saved[out[k]], j->t[out[k]], j->bytes[out[k]]) != 0)
			fail_msg("%s: output %d differs (%s)", vcase_name(&j->c), out[k], what);
	}
}

/* ---- the naive oracle --------------------------------------------------------- */

/* Everything the oracle computes for a job, in double, before any rounding. */
struct oracle {
	double *s, *y, *mean, *rstd; /* forward (s: rounded to dtype as stored) */
	double *dx, *dg, *db, *xh;   /* backward (xh: x_hat of every element) */
	double amax;
};

static double *dalloc(size_t n)
{
	double *d = calloc(n ? n : 1, sizeof(double));
	assert_non_null(d);
	return d;
}

/* The weight of column c: offset + gamma, or 1. */
static double weight(const struct vjob *j, int64_t c)
{
	return j->t[T_G] ? (double)j->c.offset + vj_get(j, T_G, (size_t)c) : 1.0;
}

static double bias(const struct vjob *j, int64_t c)
{
	return j->t[T_B] ? vj_get(j, T_B, (size_t)c) : 0.0;
}

static void oracle_forward(const struct vjob *j, struct oracle *o)
{
	int64_t rows = j->c.rows, cols = j->c.cols;
	o->s = dalloc((size_t)(rows * cols));
	o->y = dalloc((size_t)(rows * cols));
	o->mean = dalloc((size_t)rows);
	o->rstd = dalloc((size_t)rows);
	o->amax = 0;
	for (int64_t r = 0; r < rows; r++) {
		double *s = o->s + r * cols, m = 0, var = 0;
		for (int64_t c = 0; c < cols; c++) {
			size_t i = (size_t)(r * cols + c);
			s[c] = vj_get(j, T_X, i);
			if (j->c.residual)
				s[c] = nk_round(j->c.dt, s[c] + vj_get(j, T_R, i));
			m += j->c.ln ? s[c] : 0;
		}
		m /= (double)cols;
		for (int64_t c = 0; c < cols; c++)
			var += (s[c] - m) * (s[c] - m);
		double rs = 1.0 / sqrt(var / (double)cols + EPS);
		for (int64_t c = 0; c < cols; c++) {
			double y = (s[c] - m) * rs * weight(j, c) + bias(j, c);
			o->y[r * cols + c] = y;
			if (fabs(y) > o->amax)
				o->amax = fabs(y);
		}
		o->mean[r] = m;
		o->rstd[r] = rs;
	}
}

static double clamp_eps(double g)
{
	if (g >= 0 && g < EPS)
		return EPS;
	if (g < 0 && g > -EPS)
		return -EPS;
	return g;
}

/* The backward from the stored inputs the kernel reads (s or y, mean, rstd). */
static void oracle_backward(const struct vjob *j, struct oracle *o)
{
	int64_t rows = j->c.rows, cols = j->c.cols;
	const void *in = j->args.x;
	o->dx = dalloc((size_t)(rows * cols));
	o->dg = dalloc((size_t)cols);
	o->db = dalloc((size_t)cols);
	o->xh = dalloc((size_t)(rows * cols));
	for (int64_t r = 0; r < rows; r++) {
		double rs = nk_load(NK_F32, j->t[T_RSTD], (size_t)r), m1 = 0, m2 = 0;
		double mean =
		    j->c.ln && !j->c.mem_eff ? nk_load(NK_F32, j->t[T_MEAN], (size_t)r) : 0;
		double *xh = o->xh + r * cols;
		for (int64_t c = 0; c < cols; c++) {
			size_t i = (size_t)(r * cols + c);
			double v = nk_load(j->c.dt, in, i), w = weight(j, c);
			xh[c] = j->c.mem_eff ? (v - bias(j, c)) / (j->t[T_G] ? clamp_eps(w) : 1.0)
					     : (v - mean) * rs;
			double dy = vj_get(j, T_DY, i);
			m1 += dy * w;
			m2 += dy * w * xh[c];
			o->dg[c] += dy * xh[c];
			o->db[c] += dy;
		}
		for (int64_t c = 0; c < cols; c++) {
			size_t i = (size_t)(r * cols + c);
			double dy = vj_get(j, T_DY, i);
			double dx = rs * (dy * weight(j, c) - (j->c.ln ? m1 / (double)cols : 0) -
					  xh[c] * m2 / (double)cols);
			o->dx[i] = dx + (j->c.ds ? vj_get(j, T_DS, i) : 0.0);
		}
	}
}

static void oracle_free(struct oracle *o)
{
	free(o->s);
	free(o->y);
	free(o->mean);
	free(o->rstd);
	free(o->dx);
	free(o->dg);
	free(o->db);
	free(o->xh);
	memset(o, 0, sizeof(*o));
}

/* The spacing of dtype's numbers at magnitude |d| (subnormals included). */
static double storage_ulp(enum nk_dtype dt, double d)
{
	int mbits = dt == NK_F32 ? 23 : dt == NK_F16 ? 10 : 7;
	int emin = dt == NK_F16 ? -14 : -126;
	int e = d == 0 ? emin : ilogb(d);
	return ldexp(1.0, (e < emin ? emin : e) - mbits);
}

/*
 * Output t of the reference mode against the oracle's values: within half
 * an ulp of dtype, plus `slack` for what the two double computations may
 * differ by (their cancellation).
 */
static void reference_within_half_ulp(const struct vjob *j, int t, const double *want, size_t n,
				      double slack)
{
	enum nk_dtype dt = vj_dtype(j, t);
	for (size_t i = 0; i < n; i++) {
		double got = vj_get(j, t, i);
		double bound = 0.5 * storage_ulp(dt, want[i]) * (1 + 1e-9) + slack;
		if (!(fabs(got - want[i]) <= bound))
			fail_msg("%s: output %d[%zu] = %.17g, oracle %.17g", vcase_name(&j->c), t,
				 i, got, want[i]);
	}
}

/* FP8 codes of the reference mode: the correctly rounded y * scale of the oracle. */
static void reference_fp8_exact(const struct vjob *j, const struct oracle *o)
{
	size_t n = (size_t)(j->c.rows * j->c.cols);
	const uint8_t *y = j->t[T_Y];
	for (size_t i = 0; i < n; i++) {
		double v = o->y[i] * (double)j->c.scale;
		uint8_t want = fp8_oracle(j->c.fp8, v);
		/* Two double computations of y may straddle a midpoint by an ulp of fp64. */
		if (y[i] != want && fp8_midpoint_distance(j->c.fp8, v) > 1e-12)
			fail_msg("%s: y[%zu] = 0x%02x, want 0x%02x (%.17g)", vcase_name(&j->c), i,
				 y[i], want, v);
	}
	float amax;
	memcpy(&amax, j->t[T_AMAX], 4);
	if (fabs((double)amax - o->amax) > o->amax * 0x1p-24)
		fail_msg("%s: amax %.9g, oracle %.17g", vcase_name(&j->c), (double)amax, o->amax);
}

/*
 * The magnitude of the terms element i of output t is computed from, from
 * the oracle: an fp32 result is only as close to the truth as a few
 * roundings of those terms, and they cancel (y + beta, dx at one column,
 * a LayerNorm mean of values of both signs). 0 for outputs judged against
 * themselves.
 */
static double term(const struct vjob *j, const struct oracle *o, int t, size_t i)
{
	int64_t cols = j->c.cols, r = (int64_t)i / cols, c = (int64_t)i % cols;
	switch (t) {
	case T_Y:
		return (fabs(o->s[i]) + fabs(o->mean[r])) * o->rstd[r] * fabs(weight(j, c)) +
		       fabs(bias(j, c));
	case T_MEAN: {
		double m = 0;
		for (int64_t k = 0; k < cols; k++)
			m += fabs(o->s[(size_t)(i * (size_t)cols) + (size_t)k]);
		return m / (double)cols;
	}
	case T_DX:
		return nk_load(NK_F32, j->t[T_RSTD], (size_t)r) * fabs(vj_get(j, T_DY, i)) *
			   (fabs(weight(j, c)) + 1) +
		       (j->c.ds ? fabs(vj_get(j, T_DS, i)) : 0);
	case T_DG:
	case T_DB: {
		double sum = 0;
		for (int64_t k = 0; k < j->c.rows; k++) {
			size_t e = (size_t)(k * cols) + i;
			double dy = fabs(vj_get(j, T_DY, e));
			sum += t == T_DB ? dy : dy * fabs(o->xh[e]);
		}
		return sum;
	}
	default:
		return 0;
	}
}

/*
 * ||out - ref|| / max(||ref||, ||terms||) over output t, with out this
 * run's and ref the reference's (decoded).
 */
static double rel_l2(const struct vjob *j, const struct oracle *o, int t, const void *ref)
{
	enum nk_dtype dt = vj_dtype(j, t);
	size_t n = j->bytes[t] / nk_dtype_size(dt);
	double e2 = 0, r2 = 0, t2 = 0;
	for (size_t i = 0; i < n; i++) {
		double a = nk_load(dt, j->t[t], i), b = nk_load(dt, ref, i), m = term(j, o, t, i);
		e2 += (a - b) * (a - b);
		r2 += b * b;
		t2 += m * m;
	}
	double scale2 = r2 > t2 ? r2 : t2;
	return scale2 > 0 ? sqrt(e2 / scale2) : sqrt(e2);
}

/*
 * The fp32 mode against the reference (ref[]): f32 outputs within 1e-6
 * relative L2 (judged against the terms where they cancel), 16-bit ones
 * within 1e-2; s the same bits; FP8 codes equal, or one code apart where
 * the reference's scaled y lies within the fp32 error of its terms (4e-6
 * of them) of a midpoint between two codes.
 */
static void fp32_against_reference(const struct vjob *j, void *ref[T_COUNT], const struct oracle *o)
{
	int out[6], n = vj_outputs(j, out);
	for (int k = 0; k < n; k++) {
		int t = out[k];
		if (t == T_S) {
			if (memcmp(j->t[T_S], ref[T_S], j->bytes[T_S]) != 0)
				fail_msg("%s: s differs between fp32 and reference",
					 vcase_name(&j->c));
			continue;
		}
		if (t == T_Y && j->c.fp8 && !j->c.bwd) {
			const uint8_t *got = j->t[T_Y], *want = ref[T_Y];
			for (size_t i = 0; i < j->bytes[T_Y]; i++) {
				double v = o->y[i] * (double)j->c.scale;
				double slack = 4e-6 * term(j, o, T_Y, i) * (double)j->c.scale;
				if (got[i] != want[i] &&
				    fp8_midpoint_distance(j->c.fp8, v) * fabs(v) > slack)
					fail_msg(
					    "%s: fp32 y[%zu] = 0x%02x, reference 0x%02x (%.9g)",
					    vcase_name(&j->c), i, got[i], want[i], v);
			}
			continue;
		}
		enum nk_dtype dt = vj_dtype(j, t);
		double tol = dt == NK_F32 ? 1e-6 : 1e-2, err = rel_l2(j, o, t, ref[t]);
		if (!(err < tol))
			fail_msg("%s: output %d: fp32 relative L2 %.3g over %.0e",
				 vcase_name(&j->c), t, err, tol);
	}
}

/* Runs the reference and the fp32 mode of a case and checks both. */
static void check_case(const struct vcase *c, uint64_t seed)
{
	struct vjob j;
	struct oracle o = {0};
	void *ref[T_COUNT];
	vj_build(&j, c, seed);
	size_t n = (size_t)(c->rows * c->cols);

	assert_int_equal(vj_run(&j, NK_CPU_REFERENCE, 1), NK_OK);
	if (!c->bwd) {
		oracle_forward(&j, &o);
		if (c->residual)
			reference_within_half_ulp(&j, T_S, o.s, n, 0);
		if (c->fp8)
			reference_fp8_exact(&j, &o);
		else
			reference_within_half_ulp(&j, T_Y, o.y, n, 1e-12);
		reference_within_half_ulp(&j, T_RSTD, o.rstd, (size_t)c->rows, 0);
		if (c->ln)
			reference_within_half_ulp(&j, T_MEAN, o.mean, (size_t)c->rows, 1e-13);
	} else {
		oracle_backward(&j, &o);
		reference_within_half_ulp(&j, T_DX, o.dx, n, 1e-12);
		if (c->gamma)
			reference_within_half_ulp(&j, T_DG, o.dg, (size_t)c->cols, 1e-12);
		if (c->beta)
			reference_within_half_ulp(&j, T_DB, o.db, (size_t)c->cols, 1e-12);
	}
	outputs_save(&j, ref);
	outputs_poison(&j);
	assert_int_equal(vj_run(&j, NK_CPU_FP32, 1), NK_OK);
	fp32_against_reference(&j, ref, &o);
	outputs_free(ref);
	oracle_free(&o);
	vj_free(&j);
}

static const int64_t shapes[][2] = {{1, 1}, {3, 7}, {5, 33}, {17, 1000}, {2, 4097}};
#define SHAPES (sizeof(shapes) / sizeof(shapes[0]))
static const enum nk_dtype dtypes[] = {NK_F32, NK_F16, NK_BF16};

/* Digit `base` of a mixed-radix counter: *k % base, and *k moves on to the next digit. */
static int digit(int *k, int base)
{
	int d = *k % base;
	*k /= base;
	return d;
}

/* Every forward: LayerNorm/RMSNorm x dtype x residual x offset x FP8 x shape. */
static void test_forward_variants(void **state)
{
	(void)state;
	static const float offsets[] = {0.0f, 1.0f, 0.25f};
	for (int n = 0; n < 2 * 3 * 2 * 3 * 3 * (int)SHAPES; n++) {
		int k = n, s = digit(&k, SHAPES), f = digit(&k, 3), off = digit(&k, 3);
		int residual = digit(&k, 2), d = digit(&k, 3), ln = digit(&k, 2);
		struct vcase c = {
		    .ln = ln,
		    .rows = shapes[s][0],
		    .cols = shapes[s][1],
		    .dt = dtypes[d],
		    .wdt = (s & 1) ? NK_F32 : dtypes[d],
		    .gamma = true,
		    .beta = ln && s != 2,
		    .residual = residual,
		    .offset = offsets[off],
		    .fp8 = (enum nk_fp8)f,
		    .scale = f == 2 ? 4096.0f : 96.0f, /* e4m3 saturates now and then */
		};
		check_case(&c, 1000 + (uint64_t)n);
	}
}

/* Every backward: LayerNorm/RMSNorm x dtype x residual (with ds) x offset x mem_eff x shape. */
static void test_backward_variants(void **state)
{
	(void)state;
	static const float offsets[] = {0.0f, 1.0f};
	for (int n = 0; n < 2 * 3 * 2 * 2 * 2 * (int)SHAPES; n++) {
		int k = n, s = digit(&k, SHAPES), me = digit(&k, 2), off = digit(&k, 2);
		int residual = digit(&k, 2), d = digit(&k, 3), ln = digit(&k, 2);
		struct vcase c = {
		    .ln = ln,
		    .bwd = true,
		    .mem_eff = me,
		    .rows = shapes[s][0],
		    .cols = shapes[s][1],
		    .dt = dtypes[d],
		    .wdt = (s & 1) ? NK_F32 : dtypes[d],
		    .gamma = true,
		    .beta = ln,
		    .residual = residual,
		    .ds = residual,
		    .offset = offsets[off],
		};
		check_case(&c, 5000 + (uint64_t)n);
	}
}

/*
 * The fp32 mode's FP8 output is its own fp32 y, scaled in fp32 and rounded
 * once: the same job with y in f32 gives the y values, and amax is exactly
 * the largest of their magnitudes.
 */
static void test_fp8_is_fp32_y_rounded_once(void **state)
{
	(void)state;
	for (int k = 0; k < 4; k++) {
		struct vcase c = {.ln = k & 1,
				  .rows = 33,
				  .cols = 777,
				  .dt = NK_F32,
				  .wdt = NK_F32,
				  .gamma = true,
				  .beta = k & 1,
				  .residual = k >= 2,
				  .offset = k >= 2 ? 1.0f : 0.0f,
				  .fp8 = (k & 1) ? NK_FP8_E5M2 : NK_FP8_E4M3,
				  .scale = 37.5f};
		struct vjob j, plain;
		struct vcase pc = c;
		pc.fp8 = NK_FP8_NONE;
		vj_build(&j, &c, 300 + (uint64_t)k);
		vj_build(&plain, &pc, 300 + (uint64_t)k);
		assert_int_equal(vj_run(&j, NK_CPU_FP32, 1), NK_OK);
		assert_int_equal(vj_run(&plain, NK_CPU_FP32, 1), NK_OK);
		const uint8_t *y8 = j.t[T_Y];
		float amax = 0, got;
		for (size_t i = 0; i < (size_t)(c.rows * c.cols); i++) {
			float y;
			memcpy(&y, (char *)plain.t[T_Y] + 4 * i, 4);
			amax = fabsf(y) > amax ? fabsf(y) : amax;
			assert_int_equal(y8[i], nk_fp8_from_double(c.fp8, (double)(y * c.scale)));
		}
		memcpy(&got, j.t[T_AMAX], 4);
		assert_true(got == amax);
		assert_memory_equal(j.t[T_RSTD], plain.t[T_RSTD], j.bytes[T_RSTD]);
		vj_free(&j);
		vj_free(&plain);
	}
}

/*
 * dx is the gradient of L = sum(dy * y) + sum(ds * s) with respect to x
 * and to residual alike, by central differences on the oracle in double,
 * and the kernel's reference dx agrees. x and residual are multiples of
 * 2^-12 below 4, so s = x + residual is exact in f32.
 */
static double loss(const struct vjob *j, const double *x, const double *r, const double *dy,
		   const double *ds)
{
	int64_t cols = j->c.cols;
	double l = 0;
	for (int64_t row = 0; row < j->c.rows; row++) {
		double s[64], m = 0, var = 0;
		for (int64_t c = 0; c < cols; c++) {
			s[c] = x[row * cols + c] + r[row * cols + c];
			m += j->c.ln ? s[c] / (double)cols : 0;
		}
		for (int64_t c = 0; c < cols; c++)
			var += (s[c] - m) * (s[c] - m);
		double rs = 1.0 / sqrt(var / (double)cols + EPS);
		for (int64_t c = 0; c < cols; c++) {
			size_t i = (size_t)(row * cols + c);
			l += dy[i] * ((s[c] - m) * rs * weight(j, c) + bias(j, c)) + ds[i] * s[c];
		}
	}
	return l;
}

static void test_residual_gradient(void **state)
{
	(void)state;
	for (int ln = 0; ln <= 1; ln++) {
		struct vcase c = {.ln = ln,
				  .bwd = true,
				  .rows = 3,
				  .cols = 19,
				  .dt = NK_F32,
				  .wdt = NK_F32,
				  .gamma = true,
				  .beta = ln,
				  .residual = true,
				  .ds = true,
				  .offset = 1.0f};
		struct vjob j;
		vj_build(&j, &c, 42 + (uint64_t)ln);
		size_t n = 3 * 19;
		double x[3 * 19], r[3 * 19], dy[3 * 19], ds[3 * 19];
		for (size_t i = 0; i < n; i++) {
			/* Exact sums: re-store x and residual on a 2^-12 grid, then rerun the
			 * forward. */
			nk_store(NK_F32, j.t[T_X], i, round(vj_get(&j, T_X, i) * 4096) / 4096);
			nk_store(NK_F32, j.t[T_R], i, round(vj_get(&j, T_R, i) * 4096) / 4096);
			x[i] = vj_get(&j, T_X, i);
			r[i] = vj_get(&j, T_R, i);
			dy[i] = vj_get(&j, T_DY, i);
			ds[i] = vj_get(&j, T_DS, i);
		}
		j.c.bwd = false;
		vj_args(&j);
		assert_int_equal(vj_run(&j, NK_CPU_REFERENCE, 1), NK_OK);
		for (size_t i = 0; i < n; i++)
			assert_true(vj_get(&j, T_S, i) == x[i] + r[i]);
		j.c.bwd = true;
		vj_args(&j);
		assert_int_equal(vj_run(&j, NK_CPU_REFERENCE, 1), NK_OK);
		for (size_t i = 0; i < n; i++) {
			const double h = 1e-5;
			double save = x[i];
			x[i] = save + h;
			double up = loss(&j, x, r, dy, ds);
			x[i] = save - h;
			double down = loss(&j, x, r, dy, ds);
			x[i] = save;
			double gx = (up - down) / (2 * h);
			save = r[i];
			r[i] = save + h;
			up = loss(&j, x, r, dy, ds);
			r[i] = save - h;
			down = loss(&j, x, r, dy, ds);
			r[i] = save;
			double gr = (up - down) / (2 * h), dx = vj_get(&j, T_DX, i);
			if (fabs(gx - dx) > 1e-5 * (1 + fabs(dx)) ||
			    fabs(gr - dx) > 1e-5 * (1 + fabs(dx)))
				fail_msg(
				    "ln=%d element %zu: dx %.9g, dL/dx %.9g, dL/dresidual %.9g", ln,
				    i, dx, gx, gr);
		}
		vj_free(&j);
	}
}

/*
 * Zero-centered gamma (offset 1) is the plain norm with gamma + 1 when
 * that sum is exact: bit-identical forward (y, mean, rstd) and backward (dx,
 * dgamma, dbeta; memory_efficient too), in both modes.
 */
static void test_zero_centered_is_shifted_gamma(void **state)
{
	(void)state;
	for (int k = 0; k < 8; k++) {
		struct vcase c = {.ln = k & 1,
				  .bwd = k & 2,
				  .mem_eff = k & 4,
				  .rows = 9,
				  .cols = 301,
				  .dt = NK_BF16,
				  .wdt = NK_F32,
				  .gamma = true,
				  .beta = k & 1,
				  .offset = 1.0f};
		if (!c.bwd && c.mem_eff)
			continue;
		struct vjob zc, shifted;
		struct vcase pc = c;
		pc.offset = 0;
		vj_build(&zc, &c, 900 + (uint64_t)k);
		/* gamma on a 2^-10 grid in [-1, 1]: gamma + 1 is exact in f32. */
		for (int64_t i = 0; i < c.cols; i++)
			nk_store(NK_F32, zc.t[T_G], (size_t)i,
				 round(vj_get(&zc, T_G, (size_t)i) * 1024) / 1024 - 0.5);
		if (c.bwd) { /* the forward outputs must come from the new gamma */
			zc.c.bwd = false;
			vj_args(&zc);
			assert_int_equal(vj_run(&zc, NK_CPU_REFERENCE, 1), NK_OK);
			zc.c.bwd = true;
			vj_args(&zc);
		}
		vj_build(&shifted, &pc, 900 + (uint64_t)k);
		for (int t = 0; t < T_COUNT; t++) {
			if (zc.t[t] && t != T_G)
				memcpy(shifted.t[t], zc.t[t], zc.bytes[t]);
		}
		for (int64_t i = 0; i < c.cols; i++)
			nk_store(NK_F32, shifted.t[T_G], (size_t)i,
				 vj_get(&zc, T_G, (size_t)i) + 1.0);
		for (int p = 0; p < 2; p++) {
			void *want[T_COUNT];
			enum nk_cpu_precision prec = p ? NK_CPU_REFERENCE : NK_CPU_FP32;
			assert_int_equal(vj_run(&shifted, prec, 1), NK_OK);
			outputs_save(&shifted, want);
			assert_int_equal(vj_run(&zc, prec, 1), NK_OK);
			outputs_same_bits(&zc, want, p ? "reference" : "fp32");
			outputs_free(want);
		}
		vj_free(&zc);
		vj_free(&shifted);
	}
}

/*
 * Gemma's rule: the weight offset + gamma is formed in float32, never
 * rounded to the weight dtype. bf16 gamma 2^-9 plus 1 is not a bf16 value;
 * amax (fp32) shows the unrounded weight 1 + 2^-9.
 */
static void test_offset_not_rounded_to_weight_dtype(void **state)
{
	(void)state;
	struct vcase c = {.ln = false,
			  .rows = 4,
			  .cols = 64,
			  .dt = NK_BF16,
			  .wdt = NK_BF16,
			  .gamma = true,
			  .offset = 1.0f,
			  .fp8 = NK_FP8_E4M3,
			  .scale = 1.0f};
	struct vjob j;
	vj_build(&j, &c, 4242);
	for (int64_t i = 0; i < c.cols; i++)
		nk_store(NK_BF16, j.t[T_G], (size_t)i, 0x1p-9);
	for (int p = 0; p < 2; p++) {
		assert_int_equal(vj_run(&j, p ? NK_CPU_REFERENCE : NK_CPU_FP32, 1), NK_OK);
		double xmax = 0;
		for (int64_t r = 0; r < c.rows; r++) {
			double rs = nk_load(NK_F32, j.t[T_RSTD], (size_t)r);
			for (int64_t k = 0; k < c.cols; k++) {
				double v = fabs(vj_get(&j, T_X, (size_t)(r * c.cols + k)) * rs);
				xmax = v > xmax ? v : xmax;
			}
		}
		float amax;
		memcpy(&amax, j.t[T_AMAX], 4);
		double want = xmax * (1 + 0x1p-9);
		if (fabs(amax - want) > want * 2e-7)
			fail_msg("%s: amax %.9g, want %.9g (weight 1 + 2^-9; 1 would give %.9g)",
				 p ? "reference" : "fp32", (double)amax, want, xmax);
	}
	vj_free(&j);
}

/*
 * The in-place forms (vLLM: y over x and s over residual; dx over dy, over
 * ds, over x) give the bits of the out-of-place job, on several threads of
 * a job big enough to be split into blocks.
 */
static void test_in_place_forms(void **state)
{
	(void)state;
	for (int k = 0; k < 6; k++) {
		bool bwd = k >= 3;
		struct vcase c = {.ln = k & 1,
				  .bwd = bwd,
				  .mem_eff = k == 5,
				  .rows = 700,
				  .cols = 1031,
				  .dt = NK_BF16,
				  .wdt = NK_BF16,
				  .gamma = true,
				  .beta = k & 1,
				  .residual = true,
				  .ds = bwd,
				  .offset = 1.0f,
				  .fp8 = NK_FP8_NONE};
		struct vjob j;
		void *want[T_COUNT];
		vj_build(&j, &c, 70 + (uint64_t)k);
		/* Keep the inputs an in-place run overwrites. */
		void *x = malloc(j.bytes[T_X]), *r = malloc(j.bytes[T_R]), *dy = NULL, *ds = NULL;
		assert_non_null(x);
		assert_non_null(r);
		memcpy(x, j.t[T_X], j.bytes[T_X]);
		memcpy(r, j.t[T_R], j.bytes[T_R]);
		assert_int_equal(vj_run(&j, NK_CPU_FP32, 4), NK_OK);
		outputs_save(&j, want);
		if (!bwd) {
			/* y over x, s over residual. */
			j.args.y = j.t[T_X];
			j.args.residual_out = j.t[T_R];
			assert_int_equal(vj_run(&j, NK_CPU_FP32, 4), NK_OK);
			assert_memory_equal(j.t[T_X], want[T_Y], j.bytes[T_Y]);
			assert_memory_equal(j.t[T_R], want[T_S], j.bytes[T_S]);
			/* The other way round: y over residual, s over x. */
			memcpy(j.t[T_X], x, j.bytes[T_X]);
			memcpy(j.t[T_R], r, j.bytes[T_R]);
			j.args.y = j.t[T_R];
			j.args.residual_out = j.t[T_X];
			assert_int_equal(vj_run(&j, NK_CPU_FP32, 4), NK_OK);
			assert_memory_equal(j.t[T_R], want[T_Y], j.bytes[T_Y]);
			assert_memory_equal(j.t[T_X], want[T_S], j.bytes[T_S]);
		} else {
			dy = malloc(j.bytes[T_DY]);
			ds = malloc(j.bytes[T_DS]);
			assert_non_null(dy);
			assert_non_null(ds);
			memcpy(dy, j.t[T_DY], j.bytes[T_DY]);
			memcpy(ds, j.t[T_DS], j.bytes[T_DS]);
			void *const targets[] = {j.t[T_DY], j.t[T_DS], (void *)j.args.x};
			for (int t = 0; t < 3; t++) {
				void *in = (void *)j.args.x;
				void *saved_in = malloc(j.bytes[T_X]);
				assert_non_null(saved_in);
				memcpy(saved_in, in, j.bytes[T_X]);
				j.args.dx = targets[t];
				assert_int_equal(vj_run(&j, NK_CPU_FP32, 4), NK_OK);
				assert_memory_equal(targets[t], want[T_DX], j.bytes[T_DX]);
				memcpy(j.t[T_DY], dy, j.bytes[T_DY]);
				memcpy(j.t[T_DS], ds, j.bytes[T_DS]);
				memcpy(in, saved_in, j.bytes[T_X]);
				free(saved_in);
			}
		}
		free(x);
		free(r);
		free(dy);
		free(ds);
		outputs_free(want);
		vj_free(&j);
	}
}

/* No variant's output (amax included) depends on the number of threads. */
static void test_threads_do_not_change_bits(void **state)
{
	(void)state;
	for (int k = 0; k < 4; k++) {
		struct vcase c = {.ln = k & 1,
				  .bwd = k >= 2,
				  .rows = 1200,
				  .cols = 777,
				  .dt = NK_F16,
				  .wdt = NK_F32,
				  .gamma = true,
				  .beta = k & 1,
				  .residual = true,
				  .ds = k >= 2,
				  .offset = 0.5f,
				  .fp8 = k >= 2 ? NK_FP8_NONE : NK_FP8_E4M3,
				  .scale = 64.0f};
		struct vjob j;
		void *want[T_COUNT];
		vj_build(&j, &c, 123 + (uint64_t)k);
		assert_int_equal(vj_run(&j, NK_CPU_FP32, 1), NK_OK);
		outputs_save(&j, want);
		for (int threads = 2; threads <= 9; threads += 7) {
			outputs_poison(&j);
			assert_int_equal(vj_run(&j, NK_CPU_FP32, threads), NK_OK);
			outputs_same_bits(&j, want, "threads");
		}
		outputs_free(want);
		vj_free(&j);
	}
}

/*
 * NaN and Inf rows: a NaN in x (or an Inf in residual) makes its row's s, y and
 * stats NaN (FP8 0x7f) and leaves the other rows alone; amax skips NaN.
 * An infinite y saturates and makes amax infinite; a NaN scale makes every
 * code NaN but not amax.
 */
static void test_nan_and_inf_rows(void **state)
{
	(void)state;
	for (int p = 0; p < 2; p++) {
		enum nk_cpu_precision prec = p ? NK_CPU_REFERENCE : NK_CPU_FP32;
		struct vcase c = {.ln = true,
				  .rows = 4,
				  .cols = 37,
				  .dt = NK_F32,
				  .wdt = NK_F32,
				  .gamma = true,
				  .beta = true,
				  .residual = true,
				  .fp8 = NK_FP8_E4M3,
				  .scale = 8.0f};
		struct vjob j, clean;
		vj_build(&j, &c, 555);
		vj_build(&clean, &c, 555);
		nk_store(NK_F32, j.t[T_X], 3 * 37 + 5, NAN);
		nk_store(NK_F32, j.t[T_R], 2 * 37 + 36, INFINITY);
		assert_int_equal(vj_run(&j, prec, 1), NK_OK);
		assert_int_equal(vj_run(&clean, prec, 1), NK_OK);
		const uint8_t *y = j.t[T_Y], *yc = clean.t[T_Y];
		float amax_clean = 0, amax;
		for (int64_t r = 0; r < 4; r++) {
			bool bad =
			    r >= 2; /* the NaN row last: a max that kept NaN would end on it */
			for (int64_t k = 0; k < 37; k++) {
				size_t i = (size_t)(r * 37 + k);
				if (bad)
					assert_int_equal(y[i], 0x7f);
				else
					assert_int_equal(y[i], yc[i]);
			}
			if (bad) {
				assert_true(isnan(vj_get(&j, T_RSTD, (size_t)r)) ||
					    vj_get(&j, T_RSTD, (size_t)r) == 0);
				assert_true(isnan(vj_get(&j, T_MEAN, (size_t)r)) ||
					    isinf(vj_get(&j, T_MEAN, (size_t)r)));
			} else {
				assert_memory_equal((char *)j.t[T_S] + r * 37 * 4,
						    (char *)clean.t[T_S] + r * 37 * 4, 37 * 4);
			}
		}
		assert_true(isnan(vj_get(&j, T_S, 3 * 37 + 5)));
		assert_true(isinf(vj_get(&j, T_S, 2 * 37 + 36)));
		/* amax over the clean rows (0 and 1) alone. */
		struct oracle o = {0};
		oracle_forward(&clean, &o);
		for (int64_t r = 0; r < 2; r++)
			for (int64_t k = 0; k < 37; k++) {
				float v = (float)fabs(o.y[r * 37 + k]);
				amax_clean = v > amax_clean ? v : amax_clean;
			}
		oracle_free(&o);
		memcpy(&amax, j.t[T_AMAX], 4);
		assert_false(isnan(amax));
		assert_true(fabsf(amax - amax_clean) <= amax_clean * 1e-6f);

		/* A NaN weight: its column is NaN in every row, amax the max of the others. */
		nk_store(NK_F32, clean.t[T_G], 20, NAN);
		assert_int_equal(vj_run(&clean, prec, 1), NK_OK);
		oracle_forward(&clean, &o);
		float amax_finite = 0;
		for (size_t i = 0; i < clean.bytes[T_Y]; i++) {
			bool nan_col = i % 37 == 20;
			assert_true((yc[i] == 0x7f) == nan_col);
			if (!nan_col && (float)fabs(o.y[i]) > amax_finite)
				amax_finite = (float)fabs(o.y[i]);
		}
		oracle_free(&o);
		memcpy(&amax, clean.t[T_AMAX], 4);
		assert_true(fabsf(amax - amax_finite) <= amax_finite * 1e-6f);
		nk_store(NK_F32, clean.t[T_G], 20, 1.0);

		/* An infinite y (an infinite weight) saturates to 448 and makes amax infinite. */
		nk_store(NK_F32, clean.t[T_G], 3, INFINITY);
		assert_int_equal(vj_run(&clean, prec, 1), NK_OK);
		memcpy(&amax, clean.t[T_AMAX], 4);
		assert_true(isinf(amax));
		int saturated = 0;
		for (int64_t r = 0; r < 4; r++)
			saturated += (yc[r * 37 + 3] & 0x7f) == 0x7e;
		assert_int_equal(saturated, 4);

		/* A NaN scale: every code NaN, amax still the largest |y|. */
		float nan = NAN;
		memcpy(clean.t[T_SCALE], &nan, 4);
		assert_int_equal(vj_run(&clean, prec, 1), NK_OK);
		for (size_t i = 0; i < clean.bytes[T_Y]; i++)
			assert_int_equal(yc[i], 0x7f);
		memcpy(&amax, clean.t[T_AMAX], 4);
		assert_true(isinf(amax));
		vj_free(&j);
		vj_free(&clean);
	}
}

/* A NaN in ds reaches only its own element of dx. */
static void test_nan_in_ds_stays_in_element(void **state)
{
	(void)state;
	struct vcase c = {.ln = false,
			  .bwd = true,
			  .rows = 3,
			  .cols = 9,
			  .dt = NK_F32,
			  .wdt = NK_F32,
			  .gamma = true,
			  .residual = true,
			  .ds = true};
	struct vjob j;
	vj_build(&j, &c, 8);
	nk_store(NK_F32, j.t[T_DS], 13, NAN);
	assert_int_equal(vj_run(&j, NK_CPU_FP32, 1), NK_OK);
	for (size_t i = 0; i < 27; i++)
		assert_true(isnan(vj_get(&j, T_DX, i)) == (i == 13));
	vj_free(&j);
}

/* ---- nk_norm_check and nk_norm_features --------------------------------------------- */

static char dummy[64];

static struct nk_norm_args valid_forward(void)
{
	struct nk_norm_args a;
	memset(&a, 0, sizeof(a));
	a.op = NK_RMSNORM_FWD;
	a.rows = 2;
	a.cols = 8;
	a.eps = EPS;
	a.dtype = a.weight_dtype = NK_BF16;
	a.x = a.gamma = a.residual = dummy;
	a.y = a.residual_out = dummy;
	a.rstd = (float *)dummy;
	a.y_fp8 = NK_FP8_E4M3;
	a.scale = a.amax = (float *)dummy;
	a.weight_offset = 1.0f;
	return a;
}

static void test_check_variants(void **state)
{
	(void)state;
	struct nk_norm_args a = valid_forward();
	const char *why;
	assert_int_equal(nk_norm_check(&a, &why), NK_OK);
	assert_int_equal(nk_norm_features(&a), NK_FEATURES_ALL);

	/* Each refusal, one field at a time, with a word its reason must contain. */
	struct nk_norm_args b;
#define REFUSE(stmt, word)                                                                         \
	do {                                                                                       \
		b = valid_forward();                                                               \
		stmt;                                                                              \
		if (nk_norm_check(&b, &why) != NK_EINVAL)                                          \
			fail_msg("accepted: %s", #stmt);                                           \
		if (!strstr(why, word))                                                            \
			fail_msg("%s: reason \"%s\" lacks \"%s\"", #stmt, why, word);              \
		struct nk_cpu_opts o = {NK_CPU_REFERENCE, 1};                                      \
		assert_int_equal(nk_cpu_norm(&b, &o, NULL), NK_EINVAL);                            \
	} while (0)
	REFUSE(b.residual_out = NULL, "residual_out");
	REFUSE(b.residual = NULL, "residual is absent");
	REFUSE(b.scale = NULL, "needs scale");
	REFUSE(b.y_fp8 = NK_FP8_NONE, "FP8");
	REFUSE(b.y_fp8 = (enum nk_fp8)3, "y_fp8");
	REFUSE(b.y_fp8 = (enum nk_fp8) - 1, "y_fp8");
	REFUSE(b.weight_offset = NAN, "weight_offset");
	REFUSE(b.weight_offset = INFINITY, "weight_offset");
	REFUSE(b.gamma = NULL, "gamma");
	REFUSE((b.op = NK_RMSNORM_BWD, b.dy = b.dx = dummy), "forward ops only");
	REFUSE((b.y_fp8 = NK_FP8_NONE, b.scale = NULL), "amax");
#undef REFUSE

	/* Accepted: amax left out; a backward with ds ignores the forward's tensors. */
	b = valid_forward();
	b.amax = NULL;
	assert_int_equal(nk_norm_check(&b, &why), NK_OK);
	b.op = NK_RMSNORM_BWD;
	b.dy = b.ds = dummy;
	b.dx = dummy;
	b.y_fp8 = NK_FP8_NONE;
	assert_int_equal(nk_norm_check(&b, &why), NK_OK);
	assert_int_equal(nk_norm_features(&b), NK_FEATURE_RESIDUAL | NK_FEATURE_WEIGHT_OFFSET);
	b.ds = NULL;
	b.weight_offset = 0;
	assert_int_equal(nk_norm_features(&b), 0);
	b.weight_offset = -0.0f;
	assert_int_equal(nk_norm_features(&b), 0);
	b = valid_forward();
	b.residual = b.residual_out = NULL;
	b.weight_offset = 0;
	assert_int_equal(nk_norm_features(&b), NK_FEATURE_FP8_OUTPUT);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_fp8_decodes_every_code),
	    cmocka_unit_test(test_fp8_round_trip),
	    cmocka_unit_test(test_fp8_ties_to_even),
	    cmocka_unit_test(test_fp8_saturates),
	    cmocka_unit_test(test_fp8_random_against_brute_force),
	    cmocka_unit_test(test_forward_variants),
	    cmocka_unit_test(test_backward_variants),
	    cmocka_unit_test(test_fp8_is_fp32_y_rounded_once),
	    cmocka_unit_test(test_residual_gradient),
	    cmocka_unit_test(test_zero_centered_is_shifted_gamma),
	    cmocka_unit_test(test_offset_not_rounded_to_weight_dtype),
	    cmocka_unit_test(test_in_place_forms),
	    cmocka_unit_test(test_threads_do_not_change_bits),
	    cmocka_unit_test(test_nan_and_inf_rows),
	    cmocka_unit_test(test_nan_in_ds_stays_in_element),
	    cmocka_unit_test(test_check_variants),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
