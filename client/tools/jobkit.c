/*
 * jobkit: a job, its buffers and its reference check (see jobkit.h).
 */
#include "client/tools/jobkit.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "client/tools/rng.h"
#include "kernels/norm_kernels.h"
#include "kernels/wgrad.h"

#define JK_ALIGN 64

static const char *const role_names[JK_ROLES] = {
	"x",	     "y",     "mean",	      "rstd", "gamma", "beta",	"dy",	"dx",
	"dgamma",    "dbeta", "main_grad",    "residual", "residual_out", "ds", "scale", "amax",
};

const char *jobkit_role_name(int role)
{
	return role >= 0 && role < JK_ROLES ? role_names[role] : "?";
}

const char *jobkit_op_name(enum nc_op op)
{
	switch (op) {
	case NC_LAYERNORM_FWD:
		return "layernorm_fwd";
	case NC_LAYERNORM_BWD:
		return "layernorm_bwd";
	case NC_RMSNORM_FWD:
		return "rmsnorm_fwd";
	case NC_RMSNORM_BWD:
		return "rmsnorm_bwd";
	case NC_WGRAD_ACCUM:
		return "wgrad_accum";
	}
	return "?";
}

const char *jobkit_dtype_name(enum nc_dtype dtype)
{
	return dtype == NC_F32 ? "f32" : dtype == NC_F16 ? "f16" : dtype == NC_BF16 ? "bf16" : "?";
}

static enum nk_dtype nk_dtype_of(enum nc_dtype dtype)
{
	return dtype == NC_F16 ? NK_F16 : dtype == NC_BF16 ? NK_BF16 : NK_F32;
}

static enum nk_op nk_op_of(enum nc_op op)
{
	switch (op) {
	case NC_LAYERNORM_BWD:
		return NK_LAYERNORM_BWD;
	case NC_RMSNORM_FWD:
		return NK_RMSNORM_FWD;
	case NC_RMSNORM_BWD:
		return NK_RMSNORM_BWD;
	default:
		return NK_LAYERNORM_FWD;
	}
}

static bool op_is_backward(enum nc_op op)
{
	return op == NC_LAYERNORM_BWD || op == NC_RMSNORM_BWD;
}

static bool op_is_wgrad(enum nc_op op)
{
	return op == NC_WGRAD_ACCUM;
}

static bool op_is_layernorm(enum nc_op op)
{
	return op == NC_LAYERNORM_FWD || op == NC_LAYERNORM_BWD;
}

enum nk_fp8 jobkit_y_fp8(const struct jobkit_spec *s)
{
	if (op_is_backward(s->op) || op_is_wgrad(s->op))
		return NK_FP8_NONE;
	return s->y_dtype == NC_F8E4M3 ? NK_FP8_E4M3
	       : s->y_dtype == NC_F8E5M2 ? NK_FP8_E5M2
					  : NK_FP8_NONE;
}

uint32_t jobkit_features(const struct jobkit_spec *s)
{
	if (op_is_wgrad(s->op))
		return 0;
	return (s->residual ? NC_FEATURE_RESIDUAL : 0u) |
	       (s->weight_offset != 0.0f && s->gamma ? NC_FEATURE_WEIGHT_OFFSET : 0u) |
	       (jobkit_y_fp8(s) != NK_FP8_NONE ? NC_FEATURE_FP8_OUTPUT : 0u);
}

const char *jobkit_variant_label(const struct jobkit_spec *s, char *buf, size_t len)
{
	enum nk_fp8 fp8 = jobkit_y_fp8(s);
	char offset[32] = "";
	if (s->weight_offset == 1.0f)
		snprintf(offset, sizeof(offset), "+%s",
			 op_is_layernorm(s->op) ? "zero_centered" : "offset");
	else if (s->weight_offset != 0.0f)
		snprintf(offset, sizeof(offset), "+offset%g", (double)s->weight_offset);
	snprintf(buf, len, "%s%s%s%s%s", s->residual ? "+add" : "", offset,
		 fp8 == NK_FP8_NONE ? "" : "+fp8_", fp8 == NK_FP8_NONE ? "" : nk_fp8_name(fp8),
		 s->in_place ? "+inplace" : "");
	return buf;
}

/* Which roles the spec's job uses. */
static void jobkit_roles(const struct jobkit_spec *s, bool used[JK_ROLES])
{
	bool bwd = op_is_backward(s->op), ln = op_is_layernorm(s->op);
	memset(used, 0, JK_ROLES * sizeof(bool));
	if (op_is_wgrad(s->op)) {
		used[JK_X] = used[JK_DY] = used[JK_MAIN_GRAD] = true;
		return;
	}
	used[JK_X] = used[JK_RSTD] = true;
	used[JK_GAMMA] = s->gamma;
	used[JK_BETA] = ln && s->gamma && s->beta;
	used[JK_MEAN] = ln && !(bwd && s->memory_efficient);
	used[JK_Y] = !bwd;
	used[JK_DY] = used[JK_DX] = bwd;
	used[JK_DGAMMA] = bwd && s->gamma;
	used[JK_DBETA] = bwd && ln && s->gamma && s->beta;
	used[JK_RESIDUAL] = used[JK_RESIDUAL_OUT] = !bwd && s->residual;
	used[JK_DS] = bwd && s->residual;
	used[JK_SCALE] = used[JK_AMAX] = jobkit_y_fp8(s) != NK_FP8_NONE;
}

/* main_grad's dtype, or gamma's: weight_dtype, defaulting to f32 for the GEMM. */
static enum nc_dtype weight_dtype_of(const struct jobkit_spec *s)
{
	if (s->weight_dtype)
		return s->weight_dtype;
	return op_is_wgrad(s->op) ? NC_F32 : s->dtype;
}

static size_t role_bytes(const struct jobkit_spec *s, int role)
{
	enum nc_dtype w = weight_dtype_of(s);
	size_t esize = nk_dtype_size(nk_dtype_of(s->dtype)), wsize = nk_dtype_size(nk_dtype_of(w));
	if (op_is_wgrad(s->op))
		return role == JK_X	 ? s->rows * s->cols * esize
		       : role == JK_DY ? s->rows * s->out_features * esize
				       : s->out_features * s->cols * wsize;
	switch (role) {
	case JK_SCALE:
	case JK_AMAX:
		return sizeof(float);
	case JK_Y:
		return s->rows * s->cols * (jobkit_y_fp8(s) != NK_FP8_NONE ? 1 : esize);
	case JK_MEAN:
	case JK_RSTD:
		return s->rows * sizeof(float);
	case JK_GAMMA:
	case JK_BETA:
	case JK_DGAMMA:
	case JK_DBETA:
		return s->cols * wsize;
	default:
		return s->rows * s->cols * esize;
	}
}

enum nk_dtype jobkit_role_dtype(const struct jobkit_spec *s, int role)
{
	enum nc_dtype w = weight_dtype_of(s);
	if (role == JK_MEAN || role == JK_RSTD || role == JK_SCALE || role == JK_AMAX)
		return NK_F32;
	if (role == JK_GAMMA || role == JK_BETA || role == JK_DGAMMA || role == JK_DBETA ||
	    role == JK_MAIN_GRAD)
		return nk_dtype_of(w);
	return nk_dtype_of(s->dtype);
}

static void fill_random(void *buf, enum nk_dtype dtype, size_t n, uint64_t *state, double lo,
			double hi, bool random_sign)
{
	for (size_t i = 0; i < n; i++) {
		double v = rng_uniform(state, lo, hi);
		if (random_sign && (rng_next(state) & 1))
			v = -v;
		nk_store(dtype, buf, i, v);
	}
}

static bool is_output(const struct jobkit_spec *s, int role)
{
	if (op_is_wgrad(s->op))
		return role == JK_MAIN_GRAD;
	if (op_is_backward(s->op))
		return role == JK_DX || role == JK_DGAMMA || role == JK_DBETA;
	return role == JK_Y || role == JK_MEAN || role == JK_RSTD || role == JK_RESIDUAL_OUT ||
	       role == JK_AMAX;
}

void jobkit_args(const struct jobkit *kit, void *const ptr[JK_ROLES], struct nk_norm_args *a)
{
	const struct jobkit_spec *s = &kit->spec;
	memset(a, 0, sizeof(*a));
	a->op = nk_op_of(s->op);
	a->rows = (int64_t)s->rows;
	a->cols = (int64_t)s->cols;
	a->eps = kit->job.eps;
	a->dtype = nk_dtype_of(s->dtype);
	a->weight_dtype = jobkit_role_dtype(s, JK_GAMMA);
	a->flags = (s->memory_efficient ? NK_MEMORY_EFFICIENT : 0u) |
		   (s->accumulate ? NK_ACCUMULATE : 0u);
	a->x = ptr[JK_X];
	a->y = ptr[JK_Y];
	a->mean = ptr[JK_MEAN];
	a->rstd = ptr[JK_RSTD];
	a->gamma = ptr[JK_GAMMA];
	a->beta = ptr[JK_BETA];
	a->dy = ptr[JK_DY];
	a->dx = ptr[JK_DX];
	a->dgamma = ptr[JK_DGAMMA];
	a->dbeta = ptr[JK_DBETA];
	a->residual = ptr[JK_RESIDUAL];
	a->residual_out = ptr[JK_RESIDUAL_OUT];
	a->ds = ptr[JK_DS];
	a->scale = ptr[JK_SCALE];
	a->amax = ptr[JK_AMAX];
	a->weight_offset = s->gamma ? s->weight_offset : 0.0f;
	a->y_fp8 = jobkit_y_fp8(s);
}

/*
 * Backward inputs must be what a forward produced: run the reference forward
 * on x to get mean and rstd, and y for the memory-efficient backward. With
 * a residual the forward adds a random residual to x, and the backward's x
 * is that forward's s.
 */
static int jobkit_forward_inputs(struct jobkit *kit)
{
	const struct jobkit_spec *s = &kit->spec;
	size_t ybytes = role_bytes(s, JK_X);
	void *y = malloc(ybytes), *res = NULL, *sum = NULL;
	float *mean = malloc(s->rows * sizeof(float)), *rstd = malloc(s->rows * sizeof(float));
	if (s->residual) {
		uint64_t state = (s->seed ? s->seed : 1) ^ 0x5eed;
		res = malloc(ybytes);
		sum = malloc(ybytes);
		if (res)
			fill_random(res, jobkit_role_dtype(s, JK_X), s->rows * s->cols, &state, -2.0,
				    2.0, false);
	}
	int rc = (y && mean && rstd && (!s->residual || (res && sum))) ? 0 : NC_ENOMEM;
	if (rc == 0) {
		struct nk_norm_args a;
		void *ptr[JK_ROLES] = {0};
		memcpy(ptr, kit->ptr, sizeof(ptr));
		ptr[JK_Y] = y;
		ptr[JK_MEAN] = op_is_layernorm(s->op) ? mean : NULL;
		ptr[JK_RSTD] = rstd;
		ptr[JK_DY] = ptr[JK_DX] = ptr[JK_DGAMMA] = ptr[JK_DBETA] = ptr[JK_DS] = NULL;
		ptr[JK_RESIDUAL] = res;
		ptr[JK_RESIDUAL_OUT] = sum;
		jobkit_args(kit, ptr, &a);
		a.op = op_is_layernorm(s->op) ? NK_LAYERNORM_FWD : NK_RMSNORM_FWD;
		a.flags = 0;
		struct nk_cpu_opts opts = {.precision = NK_CPU_REFERENCE, .threads = 2};
		struct nk_norm_result result;
		rc = nk_cpu_norm(&a, &opts, &result) == NK_OK ? 0 : NC_EINTERNAL;
	}
	if (rc == 0) {
		if (s->memory_efficient)
			memcpy(kit->ptr[JK_X], y, ybytes);
		else if (s->residual)
			memcpy(kit->ptr[JK_X], sum, ybytes);
		if (kit->ptr[JK_MEAN])
			memcpy(kit->ptr[JK_MEAN], mean, s->rows * sizeof(float));
		memcpy(kit->ptr[JK_RSTD], rstd, s->rows * sizeof(float));
	}
	free(y);
	free(res);
	free(sum);
	free(mean);
	free(rstd);
	return rc;
}

/*
 * In-place forms (spec.in_place): the input an output is laid over, or -1.
 * y over x only where both have the same bytes (an FP8 y is smaller).
 */
static int in_place_source(const struct jobkit_spec *s, int role)
{
	if (!s->in_place)
		return -1;
	if (role == JK_Y && !op_is_backward(s->op) && !op_is_wgrad(s->op) &&
	    jobkit_y_fp8(s) == NK_FP8_NONE)
		return JK_X;
	if (role == JK_RESIDUAL_OUT && s->residual && !op_is_backward(s->op))
		return JK_RESIDUAL;
	if (role == JK_DX && op_is_backward(s->op))
		return JK_DY;
	return -1;
}

/* Whether `role` is an output that lies over an input (its memory holds the input). */
static bool in_place_input(const struct jobkit *kit, int role)
{
	return in_place_source(&kit->spec, role) >= 0;
}

static void jobkit_fill(struct jobkit *kit, const bool used[JK_ROLES])
{
	const struct jobkit_spec *s = &kit->spec;
	uint64_t state = s->seed ? s->seed : 1;
	/* x with a non-zero mean so LayerNorm's centring matters. */
	fill_random(kit->ptr[JK_X], jobkit_role_dtype(s, JK_X), s->rows * s->cols, &state, -1.5, 2.5,
		    false);
	if (used[JK_GAMMA])
		fill_random(kit->ptr[JK_GAMMA], jobkit_role_dtype(s, JK_GAMMA), s->cols, &state, 0.5, 1.5,
			    true);
	if (used[JK_BETA])
		fill_random(kit->ptr[JK_BETA], jobkit_role_dtype(s, JK_BETA), s->cols, &state, -0.5, 0.5,
			    false);
	if (used[JK_DY])
		fill_random(kit->ptr[JK_DY], jobkit_role_dtype(s, JK_DY),
			    kit->bytes[JK_DY] / nk_dtype_size(jobkit_role_dtype(s, JK_DY)), &state, -1.0,
			    1.0, false);
	if (used[JK_RESIDUAL])
		fill_random(kit->ptr[JK_RESIDUAL], jobkit_role_dtype(s, JK_RESIDUAL),
			    s->rows * s->cols, &state, -2.0, 2.0, false);
	if (used[JK_DS])
		fill_random(kit->ptr[JK_DS], jobkit_role_dtype(s, JK_DS), s->rows * s->cols, &state,
			    -1.0, 1.0, false);
	if (used[JK_SCALE]) {
		/* |y| reaches about 4: e4m3 saturates now and then, e5m2 keeps its range. */
		float scale = jobkit_y_fp8(s) == NK_FP8_E4M3 ? 96.0f : 2048.0f;
		memcpy(kit->ptr[JK_SCALE], &scale, sizeof(scale));
	}
	/* Outputs: poison (all-ones bytes are NaN in every float type); in-place ones are inputs. */
	for (int role = 0; role < JK_ROLES; role++) {
		if (used[role] && is_output(s, role) && !in_place_input(kit, role))
			memset(kit->ptr[role], 0xff, kit->bytes[role]);
	}
	/* Accumulate: start the accumulated outputs from random values, and remember them. */
	for (int role = JK_DGAMMA; s->accumulate && role <= JK_MAIN_GRAD; role++) {
		if (!used[role])
			continue;
		fill_random(kit->ptr[role], jobkit_role_dtype(s, role),
			    kit->bytes[role] / nk_dtype_size(jobkit_role_dtype(s, role)), &state, -1.0, 1.0,
			    false);
		kit->initial[role] = malloc(kit->bytes[role]);
		if (kit->initial[role])
			memcpy(kit->initial[role], kit->ptr[role], kit->bytes[role]);
	}
}

static struct nc_tensor *job_tensor(struct nc_job *job, struct nc_job_ext *ext, int role)
{
	struct nc_tensor *const tensors[JK_ROLES] = {
		&job->x,       &job->y,		  &job->mean,  &job->rstd,   &job->gamma,
		&job->beta,    &job->dy,	  &job->dx,    &job->dgamma, &job->dbeta,
		&job->main_grad, &ext->residual, &ext->residual_out, &ext->ds, &ext->scale,
		&ext->amax,
	};
	return tensors[role];
}

/*
 * One cudaMalloc allocation for every tensor, registered, plus its host
 * staging copy; or the caller's device_memory, whose tensors are named one
 * by one (jobkit_create).
 */
static int jobkit_alloc_device(nc_conn *conn, struct jobkit *kit)
{
	kit->staging = malloc(kit->total);
	if (!kit->staging)
		return NC_ENOMEM;
	if (kit->spec.device_memory) {
		kit->device_base = kit->spec.device_memory;
		return cudaSetDevice(kit->spec.device) == cudaSuccess ? 0 : NC_EINVALID_ARGUMENT;
	}
	if (cudaSetDevice(kit->spec.device) != cudaSuccess ||
	    cudaMalloc(&kit->device_base, kit->total) != cudaSuccess) {
		cudaGetLastError();
		kit->device_base = NULL;
		return NC_ENOMEM;
	}
	return nc_region_register_device(conn, kit->device_base, &kit->region);
}

/* Where each tensor goes (in-place outputs share their input's place); returns the total. */
static size_t jobkit_layout(const struct jobkit_spec *spec, const bool used[JK_ROLES],
			    size_t bytes[JK_ROLES], size_t offsets[JK_ROLES])
{
	size_t total = 0;
	for (int role = 0; role < JK_ROLES; role++) {
		if (!used[role])
			continue;
		bytes[role] = role_bytes(spec, role);
		/* In-place outputs take their input's place (inputs come first in role order
		 * except residual, which precedes residual_out). */
		int source = in_place_source(spec, role);
		if (source >= 0 && used[source] && role > source) {
			offsets[role] = offsets[source];
			continue;
		}
		offsets[role] = total;
		total += (bytes[role] + JK_ALIGN - 1) / JK_ALIGN * JK_ALIGN;
	}
	return total;
}

/* The spec with the flags that mean nothing for its op dropped. */
static void jobkit_normalize(struct jobkit_spec *spec)
{
	if (!op_is_backward(spec->op))
		spec->memory_efficient = false;
	if (!op_is_backward(spec->op) && !op_is_wgrad(spec->op))
		spec->accumulate = false;
}

size_t jobkit_bytes(const struct jobkit_spec *spec)
{
	struct jobkit_spec s = *spec;
	bool used[JK_ROLES];
	size_t bytes[JK_ROLES] = {0}, offsets[JK_ROLES] = {0};
	jobkit_normalize(&s);
	jobkit_roles(&s, used);
	return jobkit_layout(&s, used, bytes, offsets);
}

/* With device_memory: each tensor named through nc_tensor_device_range (the VMM path). */
static int jobkit_name_device_tensors(nc_conn *conn, struct jobkit *kit,
				      const size_t offsets[JK_ROLES])
{
	for (int role = 0; role < JK_ROLES; role++) {
		if (!kit->ptr[role])
			continue;
		int rc = nc_tensor_device_range(conn, (char *)kit->device_base + offsets[role],
						kit->bytes[role], job_tensor(&kit->job, &kit->ext, role));
		if (rc)
			return rc;
	}
	return 0;
}

int jobkit_create(nc_conn *conn, const struct jobkit_spec *spec, struct jobkit *kit)
{
	bool used[JK_ROLES];
	size_t offsets[JK_ROLES] = {0}, total = 0;
	memset(kit, 0, sizeof(*kit));
	kit->spec = *spec;
	jobkit_normalize(&kit->spec);
	spec = &kit->spec;
	jobkit_roles(spec, used);
	total = jobkit_layout(spec, used, kit->bytes, offsets);
	kit->total = total;
	int rc = spec->on_device ? jobkit_alloc_device(conn, kit) :
				   nc_region_alloc_host(conn, total, &kit->region);
	if (rc) {
		jobkit_destroy(kit);
		return rc;
	}
	struct nc_job *job = &kit->job;
	job->op = spec->op;
	job->rows = spec->rows;
	job->cols = spec->cols;
	job->eps = spec->eps != 0.0f ? spec->eps : 1e-5f;
	job->dtype = spec->dtype;
	job->weight_dtype = spec->weight_dtype;
	job->flags = (spec->memory_efficient ? NC_MEMORY_EFFICIENT : 0u) |
		     (spec->accumulate ? NC_ACCUMULATE : 0u);
	if (op_is_wgrad(spec->op)) {
		job->flags = spec->accumulate ? 0u : NC_OVERWRITE;
		job->out_features = spec->out_features;
	}
	if (!op_is_wgrad(spec->op)) {
		kit->ext.weight_offset = spec->gamma ? spec->weight_offset : 0.0f;
		kit->ext.y_dtype = jobkit_y_fp8(spec) != NK_FP8_NONE ? spec->y_dtype : 0;
	}
	char *base = spec->on_device ? kit->staging : nc_region_data(kit->region);
	for (int role = 0; role < JK_ROLES; role++) {
		if (!used[role])
			continue;
		kit->ptr[role] = base + offsets[role];
		job_tensor(job, &kit->ext, role)->region = nc_region_id(kit->region);
		job_tensor(job, &kit->ext, role)->offset = offsets[role];
	}
	if (spec->on_device && spec->device_memory) {
		rc = jobkit_name_device_tensors(conn, kit, offsets);
		if (rc) {
			jobkit_destroy(kit);
			return rc;
		}
	}
	jobkit_fill(kit, used);
	if (op_is_backward(spec->op) && jobkit_forward_inputs(kit) != 0) {
		jobkit_destroy(kit);
		return NC_ENOMEM;
	}
	/* The inputs an in-place output overwrites, kept for the reference. */
	for (int role = 0; role < JK_ROLES; role++) {
		int source = used[role] ? in_place_source(spec, role) : -1;
		if (source < 0 || kit->saved[source])
			continue;
		kit->saved[source] = malloc(kit->bytes[source]);
		if (!kit->saved[source]) {
			jobkit_destroy(kit);
			return NC_ENOMEM;
		}
		memcpy(kit->saved[source], kit->ptr[source], kit->bytes[source]);
	}
	/* Synchronized: a pageable copy may return before its DMA lands. */
	if (spec->on_device &&
	    (cudaMemcpy(kit->device_base, kit->staging, total, cudaMemcpyHostToDevice) != cudaSuccess ||
	     cudaDeviceSynchronize() != cudaSuccess)) {
		jobkit_destroy(kit);
		return NC_EINTERNAL;
	}
	return 0;
}

void jobkit_destroy(struct jobkit *kit)
{
	if (kit->region)
		nc_region_free(kit->region);
	if (kit->device_base && kit->device_base != kit->spec.device_memory)
		cudaFree(kit->device_base);
	free(kit->staging);
	for (int role = 0; role < JK_ROLES; role++) {
		free(kit->initial[role]);
		free(kit->saved[role]);
	}
	memset(kit, 0, sizeof(*kit));
}

/* ---- checking ------------------------------------------------------------------ */

/* An input as it was before the job ran (in-place outputs overwrite some). */
static const void *input_of(const struct jobkit *kit, int role)
{
	return kit->saved[role] ? kit->saved[role] : kit->ptr[role];
}

/* The weight of column c: weight_offset + gamma, or 1. */
static double jobkit_weight(const struct jobkit *kit, uint64_t c)
{
	const struct jobkit_spec *s = &kit->spec;
	if (!kit->ptr[JK_GAMMA])
		return 1.0;
	return (double)s->weight_offset +
	       nk_load(jobkit_role_dtype(s, JK_GAMMA), kit->ptr[JK_GAMMA], c);
}

/* The squared norm of rstd * dy * weight (+ ds), the terms dx is computed from. */
static double dx_term_norm2(const struct jobkit *kit)
{
	const struct jobkit_spec *s = &kit->spec;
	enum nk_dtype dt = jobkit_role_dtype(s, JK_DY);
	double sum = 0;
	for (uint64_t r = 0; r < s->rows; r++) {
		double rstd = nk_load(NK_F32, kit->ptr[JK_RSTD], r);
		for (uint64_t c = 0; c < s->cols; c++) {
			uint64_t i = r * s->cols + c;
			double t = fabs(rstd * jobkit_weight(kit, c) * nk_load(dt, input_of(kit, JK_DY), i));
			if (kit->ptr[JK_DS])
				t += fabs(nk_load(dt, kit->ptr[JK_DS], i));
			sum += t * t;
		}
	}
	return sum;
}

/* x_hat of element (r, c), as the backward recomputes it. */
static double jobkit_x_hat(const struct jobkit *kit, uint64_t r, uint64_t c)
{
	const struct jobkit_spec *s = &kit->spec;
	double in = nk_load(jobkit_role_dtype(s, JK_X), input_of(kit, JK_X), r * s->cols + c);
	if (s->memory_efficient) {
		double g = jobkit_weight(kit, c);
		double b = kit->ptr[JK_BETA] ? nk_load(jobkit_role_dtype(s, JK_BETA), kit->ptr[JK_BETA], c)
					     : 0.0;
		double eps = kit->job.eps;
		if (kit->ptr[JK_GAMMA] && fabs(g) < eps)
			g = g < 0 ? -eps : eps;
		return (in - b) / g;
	}
	double mean = kit->ptr[JK_MEAN] ? nk_load(NK_F32, kit->ptr[JK_MEAN], r) : 0.0;
	return (in - mean) * nk_load(NK_F32, kit->ptr[JK_RSTD], r);
}

/*
 * The squared norm, over rows, of mean(|x|) (|x| + |residual| with a
 * residual): the size LayerNorm's mean would have without cancellation (a
 * row of few columns whose values nearly cancel has a mean near zero,
 * whose correct fp32 rounding is large against the mean itself).
 */
static double mean_term_norm2(const struct jobkit *kit)
{
	const struct jobkit_spec *s = &kit->spec;
	enum nk_dtype dt = jobkit_role_dtype(s, JK_X);
	double sum = 0;
	for (uint64_t r = 0; r < s->rows; r++) {
		double row = 0;
		for (uint64_t c = 0; c < s->cols; c++) {
			uint64_t i = r * s->cols + c;
			row += fabs(nk_load(dt, input_of(kit, JK_X), i));
			if (kit->ptr[JK_RESIDUAL])
				row += fabs(nk_load(dt, input_of(kit, JK_RESIDUAL), i));
		}
		row /= (double)s->cols;
		sum += row * row;
	}
	return sum;
}

/*
 * The squared norm, over columns, of the sums of |terms| that dgamma (dy *
 * x_hat) or dbeta (dy) add up over rows: the size the sums would have
 * without cancellation, against which their rounding is judged.
 */
static double dweight_term_norm2(const struct jobkit *kit, int role)
{
	const struct jobkit_spec *s = &kit->spec;
	double sum = 0;
	for (uint64_t c = 0; c < s->cols; c++) {
		double col = 0;
		for (uint64_t r = 0; r < s->rows; r++) {
			double dy = nk_load(jobkit_role_dtype(s, JK_DY), input_of(kit, JK_DY),
					    r * s->cols + c);
			col += fabs(role == JK_DBETA ? dy : dy * jobkit_x_hat(kit, r, c));
		}
		sum += col * col;
	}
	return sum;
}

/* The squared size of the terms an output sums (0: it is judged against itself). */
static double terms_norm2(const struct jobkit *kit, int role)
{
	switch (role) {
	case JK_DX:
		return dx_term_norm2(kit);
	case JK_DGAMMA:
	case JK_DBETA:
		return dweight_term_norm2(kit, role);
	case JK_MEAN:
		return mean_term_norm2(kit);
	default:
		return 0;
	}
}

/* An FP8 code's place on the number line: adjacent values differ by one. */
static int fp8_rank(uint8_t code)
{
	return (code & 0x80) ? -(int)(code & 0x7f) : (int)code;
}

/*
 * Within fp32's error of the reference, scaled: y = x_hat * w + beta is
 * computed in fp32, whose error is a few ulp of |x_hat * w| + |beta|
 * (|w_ref - beta| + |beta| scaled), and near y = 0, where the two cancel,
 * that error spans more than one FP8 code (and may flip the sign of 0).
 */
static bool fp8_within_fp32_error(const struct jobkit *kit, size_t i, double got, double ref)
{
	const struct jobkit_spec *s = &kit->spec;
	if (!isfinite(got) || !isfinite(ref))
		return false;
	float scale;
	memcpy(&scale, kit->ptr[JK_SCALE], sizeof(scale));
	double beta = kit->ptr[JK_BETA] ? nk_load(jobkit_role_dtype(s, JK_BETA), kit->ptr[JK_BETA],
						  i % s->cols) * scale
					: 0.0;
	return fabs(got - ref) <= 8.0 * FLT_EPSILON * (fabs(ref - beta) + fabs(beta));
}

/*
 * An FP8 y against the reference's codes: both NaN together; each code
 * the reference's, one step from it, or within fp32's error of it (fp32
 * and fp64 round alike except where y * scale lies within fp32's error of
 * a midpoint, where they may pick neighbours); such codes in at most 1
 * element in 1000 (and 2). The codes bound the error; the relative L2 is
 * reported, not judged: one e5m2 neighbour (a step of up to 25%) in a few
 * hundred elements is 1%.
 */
static void compare_fp8(const struct jobkit *kit, const void *ref, struct jobkit_report *report)
{
	enum nk_fp8 f = jobkit_y_fp8(&kit->spec);
	const uint8_t *out = kit->ptr[JK_Y], *want = ref;
	size_t n = kit->bytes[JK_Y], neighbours = 0;
	double err2 = 0, ref2 = 0, max_abs = 0, max_ref = 0;
	for (size_t i = 0; i < n; i++) {
		double o = nk_fp8_to_double(f, out[i]), w = nk_fp8_to_double(f, want[i]);
		bool near = abs(fp8_rank(out[i]) - fp8_rank(want[i])) == 1 ||
			    fp8_within_fp32_error(kit, i, o, w);
		if (isnan(o) != isnan(w) || (out[i] != want[i] && !near)) {
			if (report->ok)
				snprintf(report->detail, sizeof(report->detail),
					 "y[%zu] = %s code 0x%02x, reference 0x%02x", i,
					 nk_fp8_name(f), out[i], want[i]);
			report->ok = false;
			report->max_abs_err = INFINITY;
			return;
		}
		neighbours += out[i] != want[i];
		if (isnan(o))
			continue;
		err2 += (o - w) * (o - w);
		ref2 += w * w;
		max_abs = fmax(max_abs, fabs(o - w));
		max_ref = fmax(max_ref, fabs(w));
	}
	double rel_l2 = ref2 > 0 ? sqrt(err2 / ref2) : sqrt(err2);
	report->max_abs_err = fmax(report->max_abs_err, max_abs);
	report->max_rel_err = fmax(report->max_rel_err, max_ref > 0 ? max_abs / max_ref : max_abs);
	report->rel_l2_err = fmax(report->rel_l2_err, rel_l2);
	if (neighbours > 2 && neighbours * 1000 > n) {
		if (report->ok)
			snprintf(report->detail, sizeof(report->detail),
				 "y: %zu of %zu %s codes one step off, relative L2 %.3g", neighbours,
				 n, nk_fp8_name(f), rel_l2);
		report->ok = false;
	}
}

/* Compares one output; updates the report. */
static void compare_output(const struct jobkit *kit, int role, const void *ref,
			   struct jobkit_report *report)
{
	if (role == JK_Y && jobkit_y_fp8(&kit->spec) != NK_FP8_NONE) {
		compare_fp8(kit, ref, report);
		return;
	}
	enum nk_dtype dtype = jobkit_role_dtype(&kit->spec, role);
	size_t n = kit->bytes[role] / nk_dtype_size(dtype);
	double tolerance = dtype == NK_F32 ? 1e-5 : 1e-2;
	double max_abs = 0, max_ref = 0, err2 = 0, ref2 = 0;
	for (size_t i = 0; i < n; i++) {
		double out = nk_load(dtype, kit->ptr[role], i), want = nk_load(dtype, ref, i);
		if (isnan(out) != isnan(want)) {
			if (report->ok)
				snprintf(report->detail, sizeof(report->detail),
					 "%s[%zu] = %g, reference %g (unwritten or NaN)",
					 role_names[role], i, out, want);
			report->ok = false;
			report->max_abs_err = INFINITY;
			return;
		}
		if (isnan(out))
			continue;
		double d = fabs(out - want);
		max_abs = d > max_abs ? d : max_abs;
		max_ref = fabs(want) > max_ref ? fabs(want) : max_ref;
		err2 += d * d;
		ref2 += want * want;
	}
	double rel_l2 = ref2 > 0 ? sqrt(err2 / ref2) : sqrt(err2);
	double rel_max = max_ref > 0 ? max_abs / max_ref : max_abs;
	/*
	 * dx is a difference of terms of size rstd * dy * gamma that cancel
	 * almost exactly over very few columns (LayerNorm over 1 or 2 columns):
	 * a correct fp32 result is then judged against the size of those terms.
	 * So are the weight gradients (sums over rows) and LayerNorm's mean (a
	 * sum over columns). Other outputs are of order one, and are judged
	 * against themselves. The terms' size (a pass over the inputs) is
	 * computed only for an output that fails against itself.
	 */
	bool within = rel_l2 < tolerance;
	if (!within) {
		double scale2 = terms_norm2(kit, role);
		within = scale2 > ref2 && sqrt(err2 / scale2) < tolerance;
	}
	report->max_abs_err = fmax(report->max_abs_err, max_abs);
	report->max_rel_err = fmax(report->max_rel_err, rel_max);
	report->rel_l2_err = fmax(report->rel_l2_err, rel_l2);
	report->tolerance = fmax(report->tolerance, tolerance);
	if (!within && report->ok) {
		snprintf(report->detail, sizeof(report->detail),
			 "%s: relative L2 error %.3g over tolerance %.0e", role_names[role], rel_l2,
			 tolerance);
		report->ok = false;
	}
}

/* Runs the reference over `ptr` (the kit's inputs, fresh outputs). */
static int jobkit_reference(const struct jobkit *kit, void *const ptr[JK_ROLES],
			    const struct nk_cpu_opts *opts)
{
	const struct jobkit_spec *s = &kit->spec;
	if (op_is_wgrad(s->op)) {
		struct nk_wgrad_args g = {
			.tokens = (int64_t)s->rows, .in = (int64_t)s->cols,
			.out = (int64_t)s->out_features, .dtype = nk_dtype_of(s->dtype),
			.grad_dtype = jobkit_role_dtype(s, JK_MAIN_GRAD), .beta = s->accumulate ? 1.0f : 0.0f,
			.x = ptr[JK_X], .dy = ptr[JK_DY], .main_grad = ptr[JK_MAIN_GRAD],
		};
		return nk_cpu_wgrad(&g, opts);
	}
	struct nk_norm_args a;
	struct nk_norm_result res;
	jobkit_args(kit, ptr, &a);
	return nk_cpu_norm(&a, opts, &res);
}

bool jobkit_check(const struct jobkit *kit, struct jobkit_report *report)
{
	void *ref[JK_ROLES] = {0}, *ptr[JK_ROLES];
	memset(report, 0, sizeof(*report));
	report->ok = true;
	if (kit->spec.on_device &&
	    cudaMemcpy(kit->staging, kit->device_base, kit->total, cudaMemcpyDeviceToHost) !=
		    cudaSuccess) {
		report->ok = false;
		snprintf(report->detail, sizeof(report->detail), "cannot copy the outputs back");
		return false;
	}
	memcpy(ptr, kit->ptr, sizeof(ptr));
	for (int role = 0; role < JK_ROLES; role++)
		ptr[role] = (void *)input_of(kit, role);
	for (int role = 0; role < JK_ROLES; role++) {
		if (!kit->ptr[role] || !is_output(&kit->spec, role))
			continue;
		ref[role] = malloc(kit->bytes[role]);
		if (!ref[role]) {
			report->ok = false;
			snprintf(report->detail, sizeof(report->detail), "out of memory");
			goto out_free;
		}
		memset(ref[role], 0xff, kit->bytes[role]);
		if (kit->initial[role])
			memcpy(ref[role], kit->initial[role], kit->bytes[role]);
		ptr[role] = ref[role];
	}
	struct nk_cpu_opts opts = {.precision = NK_CPU_REFERENCE, .threads = 2};
	if (jobkit_reference(kit, ptr, &opts) != NK_OK) {
		report->ok = false;
		snprintf(report->detail, sizeof(report->detail), "the reference refused the job");
		goto out_free;
	}
	for (int role = 0; role < JK_ROLES; role++) {
		if (ref[role])
			compare_output(kit, role, ref[role], report);
	}
out_free:
	for (int role = 0; role < JK_ROLES; role++)
		free(ref[role]);
	return report->ok;
}
