/*
 * nk_cuda_norm, the entry of every CUDA job: it checks the job, resolves
 * the variant to run (the caller's if it fits, else the default of
 * norm_cuda_policy.c), checks the workspace against the layout below, and
 * hands the job to its family's launcher (norm_cuda_fwd.cu,
 * norm_cuda_bwd.cu, norm_cuda_fwd_tma.cu, norm_cuda_bwd_tma.cu,
 * norm_cuda_generic.cu), then, backward, to the weight gradients' finish.
 * Also what every launcher shares on the host: the error of the last
 * launch, Params from a job, and the workspace layout (partial rows and
 * their chunk sums, 1 / clamp(gamma), row sums), a rule of the shape and
 * the variant alone.
 *
 * Host code only; built by `make` with the other kernels/ CUDA files.
 */
#include <stdio.h>
#include <string.h>

#include "kernels/norm_cuda_internal.cuh"

namespace nkc
{

static thread_local char last_error[256] = "no error";

int set_error(cudaError_t err, const char *where)
{
	(void)cudaGetLastError(); /* a failed launch must not fail the next check */
	snprintf(last_error, sizeof(last_error), "%s: %s (%s)", where, cudaGetErrorString(err),
		 cudaGetErrorName(err));
	return NK_EDEVICE;
}

int check_launch(const char *where)
{
	cudaError_t err = cudaGetLastError();
	return err == cudaSuccess ? NK_OK : set_error(err, where);
}

static void set_message(const char *msg)
{
	snprintf(last_error, sizeof(last_error), "%s", msg);
}

static size_t round256(size_t n)
{
	return (n + 255) / 256 * 256;
}

Params params_of(const struct nk_norm_args *a)
{
	Params p;
	memset(&p, 0, sizeof(p));
	p.x = a->x;
	p.y = a->y;
	p.mean = a->mean;
	p.rstd = a->rstd;
	p.gamma = a->gamma;
	p.beta = a->beta;
	p.dy = a->dy;
	p.dx = a->dx;
	p.rows = a->rows;
	p.cols = a->cols;
	p.eps = a->eps;
	p.inv_cols = (float)(1.0 / (double)a->cols);
	const unsigned none = 0;
	p.f = (is_ln(a) ? F_LN : none) | (a->flags & NK_MEMORY_EFFICIENT ? F_MEMEFF : none) |
	      (a->gamma ? F_GAMMA : none) | (a->beta ? F_BETA : none) |
	      (is_bwd(a) && a->dgamma ? F_DGAMMA : none) |
	      (is_bwd(a) && a->dbeta ? F_DBETA : none) |
	      (a->flags & NK_ACCUMULATE ? F_ACCUM : none) |
	      ((is_bwd(a) ? a->ds : a->residual) ? F_RESIDUAL : none) |
	      (!is_bwd(a) && a->y_fp8 != NK_FP8_NONE ? F_FP8 : none);
	p.residual = a->residual;
	p.residual_out = a->residual_out;
	p.ds = a->ds;
	p.scale = a->scale;
	p.amax = a->amax;
	p.offset = a->weight_offset;
	p.fp8 = a->y_fp8;
	return p;
}

Params params_of(const struct nk_norm_args *a, const Shape &s)
{
	Params p = params_of(a);
	p.G = s.G;
	p.g_mul = s.G > 0 ? (1 << 21) / s.G + 1 : 0;
	p.K = s.K;
	p.R = s.R;
	p.iters = (a->rows + s.R - 1) / s.R;
	return p;
}

/* ---- the workspace ---------------------------------------------------------- */

int64_t partial_rows(const struct nk_norm_args *a, const Shape &s)
{
	int64_t units;
	if (s.family == NK_FAMILY_GENERIC) {
		units = (a->rows + 7) / 8;
		return units < s.units_cap ? units : s.units_cap;
	}
	units = (a->rows + s.R - 1) / s.R;
	if (units > s.units_cap)
		units = s.units_cap;
	return units * s.R;
}

/*
 * Chunks of partial rows that launch_finish sums first, one block a chunk
 * and 32 columns, so that narrow rows with thousands of partial rows still
 * spread over about FINISH_BLOCKS blocks (one chunk: a single step). A rule
 * of cols and part_rows alone, so the order of the sums is always the same.
 */
int64_t finish_chunks(int64_t cols, int64_t part_rows)
{
	constexpr int64_t FINISH_BLOCKS = 256, MIN_CHUNK_ROWS = 64;
	const int64_t col_blocks = (cols + 31) / 32;
	const int64_t want = (FINISH_BLOCKS + col_blocks - 1) / col_blocks;
	if (want < 2 || part_rows < 2 * MIN_CHUNK_ROWS)
		return 1;
	int64_t chunk = (part_rows + want - 1) / want;
	if (chunk < MIN_CHUNK_ROWS)
		chunk = MIN_CHUNK_ROWS;
	return (part_rows + chunk - 1) / chunk;
}

/* Floats from the partials to the chunk sums (after the dgamma and dbeta partials). */
int64_t mid_offset(const struct nk_norm_args *a, int64_t part_rows)
{
	const size_t bytes = (size_t)part_rows * (size_t)a->cols * sizeof(float);
	return (int64_t)(round256(a->dbeta ? 2 * bytes : bytes) / sizeof(float));
}

/*
 * Workspace: the dgamma/dbeta partials and their chunk sums, then
 * (memory-efficient) rg.
 */
static size_t partials_bytes(const struct nk_norm_args *a, const struct nk_variant *v)
{
	if (!is_bwd(a) || (!a->dgamma && !a->dbeta))
		return 0;
	const int64_t rows = partial_rows(a, shape_of(v));
	const int64_t chunks = finish_chunks(a->cols, rows);
	size_t bytes = (size_t)mid_offset(a, rows) * sizeof(float);
	if (chunks > 1)
		bytes += round256((size_t)2 * (size_t)chunks * (size_t)a->cols * sizeof(float));
	return bytes;
}

/* Memory-efficient backward: 1 / clamp(gamma). */
static size_t rg_bytes(const struct nk_norm_args *a)
{
	if (!is_bwd(a) || !(a->flags & NK_MEMORY_EFFICIENT))
		return 0;
	return round256((size_t)a->cols * sizeof(float));
}

/* Split backward: two row sums a row. */
static size_t sums_bytes(const struct nk_norm_args *a, const struct nk_variant *v)
{
	if (!is_bwd(a) || v->family == NK_FAMILY_GENERIC || !shape_of(v).split)
		return 0;
	return round256((size_t)a->rows * 2 * sizeof(float));
}

/* The workspace of variant v (the fused family sizes its own). */
static size_t workspace_of(const struct nk_norm_args *a, const struct nk_device_info *dev,
			   const struct nk_variant *v)
{
	if (v->family == NK_FAMILY_FUSED)
		return nk_cuda_fused_workspace_bytes(a, dev);
	return partials_bytes(a, v) + rg_bytes(a) + sums_bytes(a, v);
}

/* Pointers must at least be aligned to their element size. */
static bool elements_aligned(const struct nk_norm_args *a)
{
	uintptr_t ds = nk_dtype_size(a->dtype) - 1, ws = nk_dtype_size(a->weight_dtype) - 1;
	uintptr_t ys = a->y_fp8 && !is_bwd(a) ? 0 : ds; /* an FP8 y is bytes */
	return !(((uintptr_t)a->x | (uintptr_t)a->dy | (uintptr_t)a->dx |
		  (uintptr_t)a->residual | (uintptr_t)a->residual_out | (uintptr_t)a->ds) &
		 ds) &&
	       !((uintptr_t)a->y & ys) && !(((uintptr_t)a->scale | (uintptr_t)a->amax) & 3) &&
	       !(((uintptr_t)a->gamma | (uintptr_t)a->beta | (uintptr_t)a->dgamma |
		  (uintptr_t)a->dbeta) &
		 ws) &&
	       !(((uintptr_t)a->mean | (uintptr_t)a->rstd) & 3);
}

/* ---- dispatch ------------------------------------------------------------------ */

/* The variant nk_cuda_norm runs for `v` (NULL: the default). */
static struct nk_variant resolve(const struct nk_norm_args *a, const struct nk_device_info *dev,
				 const struct nk_variant *v)
{
	struct nk_variant out;
	if (v && nk_cuda_variant_fits(a, dev, v))
		return *v;
	nk_cuda_variant_default(a, dev, &out);
	return out;
}

static int dispatch(const struct nk_norm_args *a, const struct nk_device_info *dev,
		    const struct nk_variant *v, const struct nk_cuda_exec *exec)
{
	cudaStream_t stream = static_cast<cudaStream_t>(exec->stream);
	float *part = static_cast<float *>(exec->workspace);
	Shape s = shape_of(v);
	int rc;

	if (v->family == NK_FAMILY_FUSED) /* its own launches, weight gradients included */
		return nk_cuda_fused_norm(a, dev, exec);
	if (!is_bwd(a)) {
		if (s.family == NK_FAMILY_GENERIC)
			return launch_fwd_generic(a, dev, s, stream);
		if (s.family == NK_FAMILY_TMA_SLICE)
			return launch_fwd_tma(a, dev, s, stream);
		if (s.family == NK_FAMILY_BLOCK_SMEM)
			return launch_fwd_smem(a, dev, s, stream);
		return launch_fwd_tiled(a, dev, s, stream);
	}
	if (s.family == NK_FAMILY_GENERIC) {
		rc = launch_bwd_generic(a, dev, s, part, stream);
	} else if (s.family == NK_FAMILY_BLOCK_SMEM || s.family == NK_FAMILY_TMA_SLICE) {
		float *rg = NULL;
		if (a->flags & NK_MEMORY_EFFICIENT) {
			rg = reinterpret_cast<float *>(static_cast<char *>(exec->workspace) +
						       partials_bytes(a, v));
			rc = launch_reciprocal_gamma(a, rg, stream);
			if (rc != NK_OK)
				return rc;
		}
		if (s.family == NK_FAMILY_TMA_SLICE)
			rc = launch_bwd_tma(a, dev, s, part, rg, stream);
		else if (s.ring)
			rc = launch_bwd_smem_ring(a, dev, s, part, rg, stream);
		else
			rc = launch_bwd_smem(a, dev, s, part, rg, stream);
	} else {
		char *ws = static_cast<char *>(exec->workspace);
		float *rg = NULL, *sums = NULL;
		if (a->flags & NK_MEMORY_EFFICIENT) {
			rg = reinterpret_cast<float *>(ws + partials_bytes(a, v));
			rc = launch_reciprocal_gamma(a, rg, stream);
			if (rc != NK_OK)
				return rc;
		}
		if (s.split)
			sums = reinterpret_cast<float *>(ws + partials_bytes(a, v) + rg_bytes(a));
		rc = launch_bwd_tiled(a, dev, s, part, rg, sums, stream);
	}
	if (rc != NK_OK)
		return rc;
	if (!a->dgamma && !a->dbeta && !exec->clamped_cols)
		return NK_OK;
	return launch_finish(a, part, partial_rows(a, s), exec->clamped_cols, stream);
}

} /* namespace nkc */

using namespace nkc;

extern "C" {

size_t nk_cuda_workspace_bytes(const struct nk_norm_args *args, const struct nk_device_info *dev,
			       const struct nk_variant *variant)
{
	if (!args || !dev || nk_norm_check(args, NULL) != NK_OK)
		return 0;
	struct nk_variant v = resolve(args, dev, variant);
	return workspace_of(args, dev, &v);
}

int nk_cuda_norm(const struct nk_norm_args *args, const struct nk_device_info *dev,
		 const struct nk_variant *variant, const struct nk_cuda_exec *exec,
		 struct nk_variant *ran)
{
	const char *why = NULL;

	if (!args || !dev || !exec || dev->sm_count < 1) {
		set_message("nk_cuda_norm: args, dev and exec are required");
		return NK_EINVAL;
	}
	if (nk_norm_check(args, &why) != NK_OK) {
		set_message(why);
		return NK_EINVAL;
	}
	if (!elements_aligned(args)) {
		set_message("a tensor is not aligned to its element size");
		return NK_EINVAL;
	}
	struct nk_variant v = resolve(args, dev, variant);
	size_t need = workspace_of(args, dev, &v);
	if (need > 0 &&
	    (exec->workspace_bytes < need || !exec->workspace || !aligned16(exec->workspace))) {
		set_message("workspace missing, too small or not 16-byte aligned");
		return NK_EINVAL;
	}
	int rc = dispatch(args, dev, &v, exec);
	if (rc == NK_OK && ran)
		*ran = v;
	return rc;
}

int nk_cuda_mem_gbps(int ordinal)
{
	int khz = 0, bits = 0;
	if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, ordinal) != cudaSuccess ||
	    cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, ordinal) != cudaSuccess) {
		(void)cudaGetLastError(); /* not the next launch's error */
		return 0;
	}
	return (int)(2.0 * khz * 1e3 * (bits / 8) / 1e9); /* double data rate */
}

const char *nk_cuda_last_error(void)
{
	return last_error;
}

} /* extern "C" */
