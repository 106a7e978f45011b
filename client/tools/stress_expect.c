/*
 * A kit's reference outputs on the GPU (stress.h). The enqueue mode checks
 * a verified job on the GPU, in stream order after it
 * (kernels/norm_cuda_check.cu), against the reference outputs computed
 * here once per kit and uploaded as fp32. The rule is jobkit_check()'s: a
 * relative L2 tolerance (1e-5 for fp32 outputs, 1e-2 for 16-bit ones)
 * against the reference's norm, or against the norm of the terms an output
 * sums when cancellation makes that larger (dx, dgamma, dbeta, LayerNorm's
 * mean), with jobkit's layout and reference arguments.
 */
#include "client/tools/stress.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static double kit_load(const struct kit *k, int role, uint64_t i)
{
	return nk_load(jobkit_role_dtype(&k->jk.spec, role), k->jk.ptr[role], i);
}

/* x_hat of element (r, c), as the backward recomputes it. */
static double kit_x_hat(const struct kit *k, uint64_t r, uint64_t c)
{
	const struct jobkit *jk = &k->jk;
	double in = kit_load(k, JK_X, r * jk->spec.cols + c);
	if (jk->spec.memory_efficient) {
		double g = jk->ptr[JK_GAMMA] ? kit_load(k, JK_GAMMA, c) : 1.0;
		double b = jk->ptr[JK_BETA] ? kit_load(k, JK_BETA, c) : 0.0;
		double eps = jk->job.eps;
		if (jk->ptr[JK_GAMMA] && fabs(g) < eps)
			g = g < 0 ? -eps : eps;
		return (in - b) / g;
	}
	double mean = jk->ptr[JK_MEAN] ? kit_load(k, JK_MEAN, r) : 0.0;
	return (in - mean) * kit_load(k, JK_RSTD, r);
}

/*
 * The squared norm of the terms an output sums (0: it is judged against
 * itself): rstd * dy * gamma for dx, the column sums of |dy * x_hat| and
 * |dy| for dgamma and dbeta, the row means of |x| for LayerNorm's mean.
 */
static double kit_terms_norm2(const struct kit *k, int role)
{
	const struct jobkit_spec *s = &k->jk.spec;
	bool by_rows = role == JK_DX || role == JK_MEAN;
	if (!by_rows && role != JK_DGAMMA && role != JK_DBETA)
		return 0;
	uint64_t outer = by_rows ? s->rows : s->cols, inner = by_rows ? s->cols : s->rows;
	double sum = 0;
	for (uint64_t i = 0; i < outer; i++) {
		double part = 0;
		for (uint64_t j = 0; j < inner; j++) {
			uint64_t r = by_rows ? i : j, c = by_rows ? j : i, at = r * s->cols + c;
			double g = k->jk.ptr[JK_GAMMA] ? kit_load(k, JK_GAMMA, c) : 1.0;
			if (role == JK_DX) {
				double t = kit_load(k, JK_RSTD, r) * g * kit_load(k, JK_DY, at);
				sum += t * t;
			} else if (role == JK_MEAN) {
				part += fabs(kit_load(k, JK_X, at));
			} else {
				double dy = kit_load(k, JK_DY, at);
				part += fabs(role == JK_DBETA ? dy : dy * kit_x_hat(k, r, c));
			}
		}
		part /= role == JK_MEAN ? (double)inner : 1.0;
		sum += part * part;
	}
	return sum;
}

/* Widens one reference output to fp32 at `host` and describes its check. */
static void kit_expect_output(struct kit *k, int role, const void *ref, float *host,
			      struct nk_check_output *check)
{
	const struct jobkit *jk = &k->jk;
	enum nk_dtype dtype = jobkit_role_dtype(&jk->spec, role);
	size_t n = jk->bytes[role] / nk_dtype_size(dtype);
	double ref2 = 0;
	for (size_t i = 0; i < n; i++) {
		double v = nk_load(dtype, ref, i);
		host[i] = (float)v;
		ref2 += isnan(v) ? 0.0 : v * v;
	}
	double norm2 = ref2 > 0 ? ref2 : 1.0, terms2 = kit_terms_norm2(k, role);
	if (terms2 > ref2 && terms2 > norm2)
		norm2 = terms2;
	size_t offset = (size_t)((const char *)jk->ptr[role] - (const char *)jk->staging);
	*check = (struct nk_check_output){
		.out = (const char *)jk->device_base + offset,
		.n = (int64_t)n,
		.dtype = dtype,
		.rtol = dtype == NK_F32 ? 1e-5f : 1e-2f,
		.ref_norm2 = norm2,
	};
}

/*
 * Computes the kit's reference outputs (from the initial values of the
 * accumulated ones, as kit_rearm() resets them before a verified job),
 * uploads them on `stream`, ahead of the check that reads them there, and
 * fills k->check. Returns 0 or a negative NC_E* code.
 */
int kit_expect(struct kit *k, cudaStream_t stream)
{
	struct jobkit *jk = &k->jk;
	void *ptr[ROLES], *ref[ROLES] = {0};
	size_t at[ROLES] = {0}, floats = 0;
	float *host = NULL;
	int rc = NC_ENOMEM;
	memcpy(ptr, jk->ptr, sizeof(ptr));
	for (int role = 0; role < ROLES; role++) {
		if (!jk->ptr[role] || !kit_role_is_output(jk->spec.op, role))
			continue;
		if (!(ref[role] = malloc(jk->bytes[role])))
			goto out_free;
		if (jk->initial[role])
			memcpy(ref[role], jk->initial[role], jk->bytes[role]);
		else
			memset(ref[role], 0xff, jk->bytes[role]);
		ptr[role] = ref[role];
		at[role] = floats;
		floats += jk->bytes[role] / nk_dtype_size(jobkit_role_dtype(&jk->spec, role));
	}
	if (!(host = malloc(floats * sizeof(float))))
		goto out_free;
	struct nk_norm_args a;
	struct nk_cpu_opts opts = {.precision = NK_CPU_REFERENCE, .threads = 2};
	jobkit_args(&k->jk, ptr, &a);
	rc = nk_cpu_norm(&a, &opts, NULL) == NK_OK ? 0 : NC_EINTERNAL;
	k->n_check = 0;
	for (int role = 0; rc == 0 && role < ROLES; role++) {
		if (ref[role])
			kit_expect_output(k, role, ref[role], host + at[role],
					  &k->check[k->n_check++]);
	}
	/* A copy from pageable memory has taken its source once it returns. */
	size_t bytes = floats * sizeof(float);
	if (rc == 0 && (cudaMalloc((void **)&k->expect, bytes) != cudaSuccess ||
			cudaMemcpyAsync(k->expect, host, bytes, cudaMemcpyHostToDevice, stream) !=
				cudaSuccess)) {
		cudaGetLastError();
		rc = NC_EDEVICE_ERROR;
	}
	for (int i = 0, role = 0; rc == 0 && role < ROLES; role++) {
		if (ref[role])
			k->check[i++].expect = k->expect + at[role];
	}
out_free:
	if (rc && k->expect) {
		cudaFree(k->expect);
		k->expect = NULL;
	}
	free(host);
	for (int role = 0; role < ROLES; role++)
		free(ref[role]);
	return rc;
}
