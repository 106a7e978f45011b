/*
 * The norm variants on the GPU against the float64 CPU reference, called
 * directly through nk_cuda_norm, twice: the default variant (the tiled
 * family where the row is whole 16-byte vectors, else fused), then the
 * fused family (kernels/norm_cuda_fused.cu) named: every op x dtype with
 * the residual add (forward) or ds (backward), zero-centered and offset
 * weights, FP8 output in both formats with amax, memory-efficient
 * backward, in-place forms (y over x, residual_out over residual, dx over
 * dy, with ds and with the offset alone, which any family may run: the
 * generic one at unaligned widths), widths staged in shared memory and
 * wider ones, and bit-identical
 * weight gradients run to run. Outputs are poisoned (0xff) before each run.
 * Last, on the default variant only, bf16 forward rows well past the
 * grids of a few waves (blocks looping over row groups, on one block a row
 * and on clusters), with --quick too.
 * Usage: test_fused_cuda [--quick] (GPU 0); --quick runs a subset (five
 * widths, two dtypes), for compute-sanitizer.
 */
#include <cuda_runtime_api.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/norm_kernels.h"

static int passed, failed;
static struct nk_device_info dev;
/* The fused family, named to nk_cuda_norm; NULL: the default variant runs. */
static const struct nk_variant *named;
static const struct nk_variant fused_variant = {.family = NK_FAMILY_FUSED, .threads = 256,
						.rows_per_block = 1, .vec_elems = 1};
static uint64_t rng = 0x9e3779b97f4a7c15ull;

static double uniform(double lo, double hi)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return lo + (hi - lo) * (double)(rng >> 11) / 9007199254740992.0;
}

static void cuda_ok(cudaError_t err, const char *what)
{
	if (err != cudaSuccess) {
		fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(err));
		exit(2);
	}
}

/* One tensor on both sides. */
struct buf {
	void *host, *dev;
	size_t bytes;
};

static void buf_make(struct buf *b, size_t bytes)
{
	b->bytes = bytes ? bytes : 1;
	b->host = calloc(1, b->bytes);
	cuda_ok(cudaMalloc(&b->dev, b->bytes), "cudaMalloc");
}

static void buf_free(struct buf *b)
{
	free(b->host);
	cudaFree(b->dev);
	memset(b, 0, sizeof(*b));
}

static void fill(enum nk_dtype dt, struct buf *b, size_t n, double lo, double hi)
{
	for (size_t i = 0; i < n; i++)
		nk_store(dt, b->host, i, uniform(lo, hi));
}

static void up(struct buf *b)
{
	cuda_ok(cudaMemcpy(b->dev, b->host, b->bytes, cudaMemcpyHostToDevice), "upload");
}

static void poison(struct buf *b)
{
	cuda_ok(cudaMemset(b->dev, 0xff, b->bytes), "poison");
}

static void down(const struct buf *b, void *to)
{
	cuda_ok(cudaMemcpy(to, b->dev, b->bytes, cudaMemcpyDeviceToHost), "download");
}

/* Relative L2 distance of n elements of dtype `dt` (got) from the reference. */
static double rel_l2(enum nk_dtype dt, const void *got, const void *ref, size_t n)
{
	double num = 0, den = 0;
	for (size_t i = 0; i < n; i++) {
		double g = nk_load(dt, got, i), r = nk_load(dt, ref, i);
		if (isnan(r) && isnan(g))
			continue;
		num += (g - r) * (g - r);
		den += r * r;
	}
	return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Whether n elements are bit for bit the reference's, any NaN matching any NaN (payloads differ). */
static bool same_values(enum nk_dtype dt, const void *got, const void *ref, size_t n)
{
	const size_t es = nk_dtype_size(dt);
	for (size_t i = 0; i < n; i++) {
		if (memcmp((const char *)got + i * es, (const char *)ref + i * es, es) == 0)
			continue;
		if (!(isnan(nk_load(dt, got, i)) && isnan(nk_load(dt, ref, i))))
			return false;
	}
	return true;
}

static double tolerance(enum nk_dtype dt)
{
	return dt == NK_F32 ? 1e-5 : dt == NK_F16 ? 2e-3 : 1.6e-2;
}

struct tcase {
	enum nk_op op;
	enum nk_dtype dt, wdt;
	int64_t rows, cols;
	bool residual;   /* fwd: residual add; bwd: ds */
	float offset;
	enum nk_fp8 fp8;
	bool memeff;
	bool in_place;   /* fwd: y over x and residual_out over residual; bwd: dx over dy */
	int dx_over;     /* bwd, with in_place: DX_OVER_DY (the default), DX_OVER_DS, DX_OVER_X */
	bool special;    /* fwd: a NaN in one row of x and an infinity in another */
};

/* Which input a backward writes dx over (docs/VARIANTS.md, in-place forms). */
enum { DX_OVER_DY, DX_OVER_DS, DX_OVER_X };

static bool is_bwd(enum nk_op op)
{
	return op == NK_LAYERNORM_BWD || op == NK_RMSNORM_BWD;
}

static void report(const struct tcase *c, bool ok, const char *what)
{
	if (ok) {
		passed++;
		return;
	}
	failed++;
	fprintf(stderr,
		"FAIL %s%s %s w%s rows=%lld cols=%lld residual=%d offset=%g fp8=%s memeff=%d "
		"in_place=%d%s%s: %s\n", named ? "fused " : "",
		nk_op_name(c->op), nk_dtype_name(c->dt), nk_dtype_name(c->wdt), (long long)c->rows,
		(long long)c->cols, c->residual, c->offset, nk_fp8_name(c->fp8), c->memeff,
		c->in_place, c->in_place && c->dx_over == DX_OVER_DS ? " (dx over ds)"
			     : c->in_place && c->dx_over == DX_OVER_X ? " (dx over x)" : "",
		c->special ? " special" : "", what);
}

static void run_forward(const struct tcase *c)
{
	const size_t n = (size_t)(c->rows * c->cols), es = nk_dtype_size(c->dt),
		     ws = nk_dtype_size(c->wdt), ys = c->fp8 ? 1 : es;
	const bool ln = c->op == NK_LAYERNORM_FWD;
	struct buf x, r, so, y, mean, rstd, g, b, scale, amax;
	buf_make(&x, n * es);
	buf_make(&r, n * es);
	buf_make(&so, n * es);
	buf_make(&y, n * ys);
	buf_make(&mean, (size_t)c->rows * 4);
	buf_make(&rstd, (size_t)c->rows * 4);
	buf_make(&g, (size_t)c->cols * ws);
	buf_make(&b, (size_t)c->cols * ws);
	buf_make(&scale, 4);
	buf_make(&amax, 4);
	fill(c->dt, &x, n, -2, 3);
	fill(c->dt, &r, n, -1, 1);
	fill(c->wdt, &g, (size_t)c->cols, c->offset ? -0.5 : 0.5, c->offset ? 0.5 : 1.5);
	fill(c->wdt, &b, (size_t)c->cols, -0.2, 0.2);
	if (c->special && c->rows > 5) {
		nk_store(c->dt, x.host, (size_t)(3 * c->cols), NAN);
		nk_store(c->dt, x.host, (size_t)(5 * c->cols + c->cols / 2), INFINITY);
	}
	const float scale_value = c->fp8 == NK_FP8_E5M2 ? 1000.0f : 60.0f;
	*(float *)scale.host = scale_value;
	up(&x), up(&r), up(&g), up(&b), up(&scale);
	poison(&so), poison(&y), poison(&mean), poison(&rstd), poison(&amax);

	struct nk_norm_args a = {.op = c->op, .rows = c->rows, .cols = c->cols, .eps = 1e-5f,
				 .dtype = c->dt, .weight_dtype = c->wdt};
	a.weight_offset = c->offset;
	a.y_fp8 = c->fp8;
	/* the reference, on host copies */
	struct nk_norm_args h = a;
	void *href_y = calloc(1, y.bytes), *href_so = calloc(1, so.bytes);
	float *hmean = calloc((size_t)c->rows, 4), *hrstd = calloc((size_t)c->rows, 4), hamax = 0;
	h.x = x.host, h.y = href_y, h.mean = ln ? hmean : NULL, h.rstd = hrstd;
	h.gamma = g.host, h.beta = ln ? b.host : NULL;
	if (c->residual)
		h.residual = r.host, h.residual_out = href_so;
	if (c->fp8)
		h.scale = scale.host, h.amax = &hamax;
	struct nk_cpu_opts ref = {NK_CPU_REFERENCE, 1};
	int rc = nk_cpu_norm(&h, &ref, NULL);
	report(c, rc == NK_OK, "the reference refused the job");

	a.x = x.dev, a.y = c->in_place && !c->fp8 ? x.dev : y.dev;
	a.mean = ln ? mean.dev : NULL, a.rstd = rstd.dev;
	a.gamma = g.dev, a.beta = ln ? b.dev : NULL;
	if (c->residual) {
		a.residual = r.dev;
		a.residual_out = c->in_place ? r.dev : so.dev;
	}
	if (c->fp8)
		a.scale = scale.dev, a.amax = amax.dev;
	struct nk_cuda_exec exec = {0};
	struct nk_variant ran;
	rc = nk_cuda_norm(&a, &dev, named, &exec, &ran);
	cuda_ok(cudaDeviceSynchronize(), "forward");
	report(c, rc == NK_OK && (!named || ran.family == NK_FAMILY_FUSED), nk_cuda_last_error());

	void *got = malloc(y.bytes > so.bytes ? y.bytes : so.bytes);
	down(a.y == x.dev ? &x : &y, got);
	if (c->fp8) {
		size_t off = 0, worst = 0;
		for (size_t i = 0; i < n; i++) {
			uint8_t gb = ((uint8_t *)got)[i], rb = ((uint8_t *)href_y)[i];
			if (gb == rb)
				continue;
			double gv = nk_fp8_to_double(c->fp8, gb), rv = nk_fp8_to_double(c->fp8, rb);
			off++; /* a neighbouring code: y's fp32 error across a rounding midpoint */
			size_t dist = (size_t)abs((int)(gb & 0x7f) - (int)(rb & 0x7f));
			if ((gb ^ rb) & 0x80 && gv != 0 && rv != 0)
				dist = 1000;
			/*
			 * Near zero, where (s - mean) * rstd * w cancels against b, y's
			 * absolute fp32 error (a few ulp of those terms) spans several
			 * of the subnormal codes a large scale reaches: a code further
			 * than the next counts as one within 8 ulp of the terms.
			 */
			if (dist > 1) {
				const size_t row = i / (size_t)c->cols, col = i % (size_t)c->cols;
				const double sv = nk_load(c->dt, c->residual ? href_so : x.host, i);
				const double w = nk_load(c->wdt, g.host, col) + c->offset;
				const double bb = ln ? nk_load(c->wdt, b.host, col) : 0.0;
				const double terms = fabs((sv - (ln ? hmean[row] : 0.0)) * hrstd[row] * w) +
						     fabs(bb);
				if (fabs(gv - rv) <= 8.0 * FLT_EPSILON * terms * scale_value)
					dist = 1;
			}
			worst = dist > worst ? dist : worst;
		}
		char msg[160];
		snprintf(msg, sizeof(msg), "%zu of %zu FP8 codes differ, worst by %zu codes", off, n,
			 worst);
		report(c, worst <= 1 && off * 100 <= n + 100, msg);
		float gamax;
		down(&amax, &gamax);
		snprintf(msg, sizeof(msg), "amax %.9g, reference %.9g", gamax, hamax);
		report(c, gamax == hamax || fabs(gamax - hamax) <= 1e-5 * fabs(hamax), msg);
	} else {
		double e = rel_l2(c->dt, got, href_y, n);
		char msg[96];
		snprintf(msg, sizeof(msg), "y relative L2 %.3g", e);
		report(c, e <= tolerance(c->dt), msg);
	}
	if (c->residual) {
		down(a.residual_out == r.dev ? &r : &so, got);
		report(c, same_values(c->dt, got, href_so, n), "s is not x + residual rounded once");
	}
	float *grstd = malloc((size_t)c->rows * 4);
	down(&rstd, grstd);
	double e = 0;
	for (int64_t i = 0; i < c->rows; i++) {
		if (isnan(hrstd[i]) || isnan(grstd[i]) || hrstd[i] == 0 || grstd[i] == 0) {
			e = fmax(e, (isnan(hrstd[i]) != isnan(grstd[i]) ||
				     (hrstd[i] == 0) != (grstd[i] == 0)) ? 1.0 : 0.0);
			continue;
		}
		e = fmax(e, fabs(grstd[i] - hrstd[i]) / fabs(hrstd[i]));
	}
	report(c, e <= 1e-5, "rstd differs");
	free(grstd), free(got), free(href_y), free(href_so), free(hmean), free(hrstd);
	buf_free(&x), buf_free(&r), buf_free(&so), buf_free(&y), buf_free(&mean);
	buf_free(&rstd), buf_free(&g), buf_free(&b), buf_free(&scale), buf_free(&amax);
}

static void run_backward(const struct tcase *c)
{
	const size_t n = (size_t)(c->rows * c->cols), es = nk_dtype_size(c->dt),
		     ws = nk_dtype_size(c->wdt);
	const bool ln = c->op == NK_LAYERNORM_BWD;
	struct buf x, dy, ds, dx, mean, rstd, g, b, dg, db, work;
	buf_make(&x, n * es);
	buf_make(&dy, n * es);
	buf_make(&ds, n * es);
	buf_make(&dx, n * es);
	buf_make(&mean, (size_t)c->rows * 4);
	buf_make(&rstd, (size_t)c->rows * 4);
	buf_make(&g, (size_t)c->cols * ws);
	buf_make(&b, (size_t)c->cols * ws);
	buf_make(&dg, (size_t)c->cols * ws);
	buf_make(&db, (size_t)c->cols * ws);
	fill(c->dt, &x, n, -2, 3);
	fill(c->dt, &dy, n, -1, 1);
	fill(c->dt, &ds, n, -1, 1);
	fill(c->wdt, &g, (size_t)c->cols, c->offset ? -0.5 : 0.5, c->offset ? 0.5 : 1.5);
	fill(c->wdt, &b, (size_t)c->cols, -0.2, 0.2);
	/* mean and rstd (and y for memory-efficient) from the reference forward */
	struct nk_norm_args f = {.op = ln ? NK_LAYERNORM_FWD : NK_RMSNORM_FWD, .rows = c->rows,
				 .cols = c->cols, .eps = 1e-5f, .dtype = c->dt,
				 .weight_dtype = c->wdt, .weight_offset = c->offset};
	void *yfwd = malloc(x.bytes);
	f.x = x.host, f.y = yfwd, f.mean = ln ? mean.host : NULL, f.rstd = rstd.host;
	f.gamma = g.host, f.beta = ln ? b.host : NULL;
	struct nk_cpu_opts ref = {NK_CPU_REFERENCE, 1};
	report(c, nk_cpu_norm(&f, &ref, NULL) == NK_OK, "the reference forward refused the job");
	if (c->memeff)
		memcpy(x.host, yfwd, x.bytes);
	up(&x), up(&dy), up(&ds), up(&mean), up(&rstd), up(&g), up(&b);

	struct nk_norm_args a = {.op = c->op, .rows = c->rows, .cols = c->cols, .eps = 1e-5f,
				 .dtype = c->dt, .weight_dtype = c->wdt,
				 .flags = c->memeff ? NK_MEMORY_EFFICIENT : 0u,
				 .weight_offset = c->offset};
	struct nk_norm_args h = a;
	void *hdx = calloc(1, dx.bytes), *hdg = calloc(1, dg.bytes), *hdb = calloc(1, db.bytes);
	h.x = x.host, h.dy = dy.host, h.dx = hdx, h.rstd = rstd.host;
	h.mean = ln && !c->memeff ? mean.host : NULL;
	h.gamma = g.host, h.beta = ln ? b.host : NULL, h.dgamma = hdg, h.dbeta = ln ? hdb : NULL;
	h.ds = c->residual ? ds.host : NULL;
	report(c, nk_cpu_norm(&h, &ref, NULL) == NK_OK, "the reference refused the job");

	/* dx's memory: its own, or (in place) the input it is written over */
	struct buf *out = !c->in_place		    ? &dx
			  : c->dx_over == DX_OVER_DS ? &ds
			  : c->dx_over == DX_OVER_X  ? &x
						     : &dy;
	a.x = x.dev, a.dy = dy.dev, a.dx = out->dev, a.rstd = rstd.dev;
	a.mean = ln && !c->memeff ? mean.dev : NULL;
	a.gamma = g.dev, a.beta = ln ? b.dev : NULL, a.dgamma = dg.dev, a.dbeta = ln ? db.dev : NULL;
	a.ds = c->residual ? ds.dev : NULL;
	size_t wbytes = nk_cuda_workspace_bytes(&a, &dev, named);
	buf_make(&work, wbytes);
	void *dg1 = malloc(dg.bytes), *got = malloc(dx.bytes);
	for (int run = 0; run < 2; run++) {
		up(&x), up(&dy), up(&ds); /* dx in place overwrote one of them */
		poison(&dx), poison(&dg), poison(&db);
		struct nk_cuda_exec exec = {0, work.dev, wbytes, NULL};
		int rc = nk_cuda_norm(&a, &dev, named, &exec, NULL);
		cuda_ok(cudaDeviceSynchronize(), "backward");
		report(c, rc == NK_OK, nk_cuda_last_error());
		down(out, got);
		double e = rel_l2(c->dt, got, hdx, n);
		char msg[96];
		snprintf(msg, sizeof(msg), "dx relative L2 %.3g", e);
		/* One column cancels: g - mean(g) is rounding noise that rstd (~1/sqrt(eps)) amplifies. */
		/* One column: dx = w rstd dy (1 - x_hat^2) cancels to eps-sized values in fp32. */
		double tol = c->cols == 1 && c->dt == NK_F32 ? 1e-3 : tolerance(c->dt);
		report(c, e <= tol, msg);
		down(&dg, run == 0 ? dg1 : got);
		if (run == 0) {
			e = rel_l2(c->wdt, dg1, hdg, (size_t)c->cols);
			snprintf(msg, sizeof(msg), "dgamma relative L2 %.3g", e);
			report(c, e <= 10 * tolerance(c->wdt) + 1e-5, msg);
			if (ln) {
				void *gdb = malloc(db.bytes);
				down(&db, gdb);
				e = rel_l2(c->wdt, gdb, hdb, (size_t)c->cols);
				snprintf(msg, sizeof(msg), "dbeta relative L2 %.3g", e);
				report(c, e <= 10 * tolerance(c->wdt) + 1e-5, msg);
				free(gdb);
			}
		} else {
			report(c, memcmp(got, dg1, dg.bytes) == 0, "dgamma differs run to run");
		}
	}
	free(dg1), free(got), free(hdx), free(hdg), free(hdb), free(yfwd);
	buf_free(&x), buf_free(&dy), buf_free(&ds), buf_free(&dx), buf_free(&mean);
	buf_free(&rstd), buf_free(&g), buf_free(&b), buf_free(&dg), buf_free(&db), buf_free(&work);
}

/*
 * Backward rows with ds well past the grid (units_cap times the rows a
 * block holds), so that a block walks several rows: the tiled kernel's ds
 * loaded a row ahead and tma_slice's stage refills; dx in its own memory
 * and over dy, ds and x.
 */
static void run_many_rows(bool quick)
{
	static const int64_t widths[] = {128, 512, 1024, 4096, 8192};
	static const int64_t rows[] = {25349, 6341, 1589, 401, 401};
	static const enum nk_dtype dts[] = {NK_BF16, NK_F32};
	for (size_t w = 0; w < sizeof(widths) / sizeof(widths[0]); w++) {
		for (size_t d = 0; d < sizeof(dts) / sizeof(dts[0]); d++) {
			if (quick && (widths[w] != 512 || dts[d] != NK_BF16))
				continue;
			for (int op = NK_LAYERNORM_BWD; op <= NK_RMSNORM_BWD; op += 2) {
				for (int memeff = 0; memeff < 2; memeff++) {
					for (int alias = -1; alias <= DX_OVER_X; alias++) {
						struct tcase c = {.op = (enum nk_op)op, .dt = dts[d],
								  .wdt = dts[d], .rows = rows[w],
								  .cols = widths[w], .residual = true,
								  .memeff = memeff != 0,
								  .in_place = alias >= 0,
								  .dx_over = alias < 0 ? 0 : alias};
						run_backward(&c);
					}
				}
			}
		}
	}
}

/*
 * Forward rows well past the grids of four waves the rules give the FP8
 * forward, variant rows from 8193 columns and rows on clusters (the
 * reference device's row groups: 2112 groups of 16 rows at 512 columns,
 * 528 or 1056 rows at 12288, 264 or 528 clusters of 2 at 32768), so that
 * each block (cluster) loops over several row groups; amax over all of
 * them. The residual rows at 512 columns run on one block a row group.
 */
static void run_many_forward_rows(void)
{
	static const int64_t widths[] = {512, 12288, 32768};
	static const int64_t rows[] = {100003, 2203, 1201};
	for (size_t w = 0; w < sizeof(widths) / sizeof(widths[0]); w++) {
		for (int op = NK_LAYERNORM_FWD; op <= NK_RMSNORM_FWD; op += 2) {
			for (int v = 0; v < 2; v++) {
				struct tcase c = {.op = (enum nk_op)op, .dt = NK_BF16, .wdt = NK_BF16,
						  .rows = rows[w], .cols = widths[w],
						  .residual = v == 1,
						  .fp8 = v == 0 ? NK_FP8_E4M3 : NK_FP8_NONE};
				run_forward(&c);
			}
		}
	}
}

/* Every case, each on the variant `named` says. */
static void run_suite(bool quick)
{
	/*
	 * Whole vectors: 128 and 512 (backward: tma_slice rows on a warp's
	 * lanes), 1000 and 4096 (tiled), 8192 and 12288 (backward: tma_slice),
	 * 32768 (a cluster).
	 */
	static const int64_t widths[] = {1,    7,    33,   128,   512,   1000,
					 4096, 4097, 8192, 12288, 16387, 32768};
	static const enum nk_dtype dts[][2] = {
	    {NK_F32, NK_F32}, {NK_F16, NK_F16}, {NK_BF16, NK_BF16}, {NK_BF16, NK_F32}};
	static const float offsets[] = {0.0f, 1.0f, 0.5f};
	for (size_t w = 0; w < sizeof(widths) / sizeof(widths[0]); w++) {
		const int64_t cols = widths[w];
		if (quick && cols != 7 && cols != 512 && cols != 1000 && cols != 16387 &&
		    cols != 32768)
			continue;
		for (size_t d = 0; d < sizeof(dts) / sizeof(dts[0]); d++) {
			if (quick && d != 0 && d != 2)
				continue;
			for (int op = 0; op < 4; op++) {
				for (size_t o = 0; o < 3; o++) {
					for (int v = 0; v < 4; v++) {
						struct tcase c = {.op = (enum nk_op)op, .dt = dts[d][0],
								  .wdt = dts[d][1], .rows = 37,
								  .cols = cols,
								  .offset = offsets[o]};
						c.residual = v != 1;
						c.in_place = v == 2;
						if (is_bwd(c.op)) {
							c.memeff = v == 3;
							run_backward(&c);
							if (v == 1 && c.offset != 0.0f) {
								/* dx over dy without ds: every family */
								c.in_place = true;
								run_backward(&c);
							}
						} else {
							c.fp8 = v == 3 ? (o == 1 ? NK_FP8_E5M2
										 : NK_FP8_E4M3)
								       : NK_FP8_NONE;
							if (!c.residual && !c.offset && !c.fp8)
								c.offset = 0.25f;
							run_forward(&c);
							if (v == 0 || v == 3) { /* NaN and Inf rows */
								c.special = true;
								run_forward(&c);
							}
						}
					}
				}
			}
		}
	}
}

int main(int argc, char **argv)
{
	const bool quick = argc > 1 && !strcmp(argv[1], "--quick");
	struct cudaDeviceProp prop;
	setvbuf(stdout, NULL, _IOLBF, 0);
	cuda_ok(cudaGetDeviceProperties(&prop, 0), "device");
	dev = (struct nk_device_info){.ordinal = 0, .sm_count = prop.multiProcessorCount,
				      .max_threads_per_sm = prop.maxThreadsPerMultiProcessor,
				      .max_smem_per_block_optin = prop.sharedMemPerBlockOptin,
				      .cc_major = prop.major, .cc_minor = prop.minor,
				      .mem_gbps = nk_cuda_mem_gbps(0)};
	for (int pass = 0; pass < 2; pass++) {
		named = pass ? &fused_variant : NULL;
		run_suite(quick);
		run_many_rows(quick);
	}
	named = NULL;
	run_many_forward_rows();
	printf("test_fused_cuda: %d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
