/*
 * What the launchers share (private to kernels/): the kernel parameters
 * (Params), the launchers and the workspace layout they are called with
 * (norm_cuda_dispatch.cu calls them), and the host helpers that launch a
 * kernel: shared-memory opt-in, cluster launches, occupancy, and the
 * dispatch from runtime dtypes and vector counts to template instances.
 */
#ifndef NORMD_NORM_CUDA_LAUNCH_CUH
#define NORMD_NORM_CUDA_LAUNCH_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/norm_cuda_shape.cuh"
#include "kernels/norm_kernels.h"

namespace nkc
{

/* Bits of Params::f. */
enum : unsigned {
	F_LN = 1u << 0,	    /* LayerNorm (else RMSNorm) */
	F_MEMEFF = 1u << 1, /* backward reads y and recomputes x_hat */
	F_GAMMA = 1u << 2,
	F_BETA = 1u << 3,
	F_DGAMMA = 1u << 4,
	F_DBETA = 1u << 5,
	F_ACCUM = 1u << 6,   /* dgamma/dbeta += */
	F_PRESUMS = 1u << 7, /* backward: row sums come from p.sums (split rows) */
	F_RESIDUAL = 1u << 8, /* forward: s = x + residual normalized; backward: dx += ds */
	F_FP8 = 1u << 9,      /* forward: y in FP8 (p.fp8), scaled by *p.scale; amax */
};

/* Everything a kernel needs, passed by value. */
struct Params {
	const void *x; /* x, or y for memory-efficient backward */
	void *y;
	float *mean;
	float *rstd;
	const void *gamma;
	const void *beta;
	const void *dy;
	void *dx;
	const void *residual; /* forward, F_RESIDUAL: added to x */
	void *residual_out;   /* forward, F_RESIDUAL: s = x + residual, rounded once */
	const void *ds;	      /* backward, F_RESIDUAL: added to dx */
	const float *scale;   /* forward, F_FP8 */
	float *amax;	      /* forward, F_FP8: max |y| before scaling (optional) */
	float offset;	      /* weight = offset + gamma, in fp32 (docs/VARIANTS.md) */
	int fp8;	      /* enum nk_fp8 of y with F_FP8 */
	float *part;	   /* [2][part_rows][cols] dgamma, then dbeta partials */
	const float *rg;   /* memory-efficient: [cols] 1 / clamp(gamma) */
	float *sums;	   /* split backward: [rows][2] sum(g), sum(g * xh) */
	int64_t part_rows; /* partial rows of each weight gradient */
	int64_t rows;
	int64_t cols;
	int64_t iters;	  /* ceil(rows / R): row groups, computed on the host */
	int64_t part_per; /* generic dgamma: rows per partial chunk */
	float eps;
	float inv_cols; /* 1 / cols, rounded once from double */
	unsigned f;
	int G;	      /* threads per row (per block of a cluster) */
	int g_mul;    /* 2^21 / G + 1 (params_of(a, s)): (threadIdx.x * g_mul) >> 21 is
			 threadIdx.x / G; 0 where a launcher sets G itself */
	int K;	      /* blocks sharing a row: a cluster, or (F_PRESUMS) column slices */
	int R;	      /* rows a block holds at a time */
	int nvec;     /* 16-byte vectors per row (tiled family) */
	int prefetch; /* block_smem ring backward: next-row vectors a thread stages early */
	int stages;   /* tma_slice: rows of the block's slice staged in shared memory */
	int slice;    /* tma_slice: vectors of a row each block of the cluster owns */
};

/* Facts about a job that the variant code and the launchers ask often. */
static inline bool is_bwd(const struct nk_norm_args *a)
{
	return a->op == NK_LAYERNORM_BWD || a->op == NK_RMSNORM_BWD;
}

static inline bool is_ln(const struct nk_norm_args *a)
{
	return a->op == NK_LAYERNORM_FWD || a->op == NK_LAYERNORM_BWD;
}

/* Elements of the storage type in one 16-byte vector. */
static inline int vec_of(const struct nk_norm_args *a)
{
	return 16 / (int)nk_dtype_size(a->dtype);
}

static inline bool aligned16(const void *p)
{
	return ((uintptr_t)p & 15) == 0;
}

/* ---- norm_cuda_dispatch.cu: errors, Params, the workspace layout ------------ */

/* Records a CUDA error for nk_cuda_last_error() and returns NK_EDEVICE. */
int set_error(cudaError_t err, const char *where);
/* Checks the launch just made; NK_OK or NK_EDEVICE. */
int check_launch(const char *where);

/* Fills Params from a job. */
Params params_of(const struct nk_norm_args *a);
/* Params of a job on a row-group shape: G threads a row, R rows a group, K blocks a row. */
Params params_of(const struct nk_norm_args *a, const Shape &s);

/* Partial rows (per weight gradient) a backward job writes. */
int64_t partial_rows(const struct nk_norm_args *a, const Shape &s);
/*
 * Chunks launch_finish sums the partial rows in first (1: one step), and
 * where their sums start in the workspace (floats after the partials).
 */
int64_t finish_chunks(int64_t cols, int64_t part_rows);
int64_t mid_offset(const struct nk_norm_args *a, int64_t part_rows);

/* ---- norm_cuda_variant.cu: shared memory of the staged families ------------- */

/*
 * Dynamic shared memory of a block_smem variant: its slice of the row, two
 * stages (forward RMSNorm rows over 56 KB: three where `dev` has room; the
 * backward never reads `dev`, which may be NULL there).
 */
size_t smem_stage_bytes(const struct nk_norm_args *a, const Shape &s,
			const struct nk_device_info *dev);
/*
 * Dynamic shared memory of a tma_slice variant: `stages` rows of a block's
 * slice of x, dy and (residual add) ds (backward), of x (forward, R rows a
 * stage).
 */
size_t tma_stage_bytes(const struct nk_norm_args *a, const Shape &s);

/* ---- the launchers, one a family and direction ------------------------------ */

/* tiled (norm_cuda_fwd.cu, norm_cuda_bwd.cu): rows held in registers. */
int launch_fwd_tiled(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		     cudaStream_t stream);
int launch_bwd_tiled(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		     float *part, const float *rg, float *sums, cudaStream_t stream);
/* block_smem (norm_cuda_fwd.cu, norm_cuda_bwd.cu): the row staged in shared memory. */
int launch_fwd_smem(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		    cudaStream_t stream);
int launch_bwd_smem(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		    float *part, const float *rg, cudaStream_t stream);
/* Ring backward (Shape::ring): one row staged, part of the next in flight. */
int launch_bwd_smem_ring(const struct nk_norm_args *a, const struct nk_device_info *dev,
			 const Shape &s, float *part, const float *rg, cudaStream_t stream);
/* tma_slice (norm_cuda_fwd_tma.cu, norm_cuda_bwd_tma.cu, sm_90). */
int launch_fwd_tma(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		   cudaStream_t stream);
int launch_bwd_tma(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		   float *part, const float *rg, cudaStream_t stream);
/* generic (norm_cuda_generic.cu): any width, any alignment. */
int launch_fwd_generic(const struct nk_norm_args *a, const struct nk_device_info *dev,
		       const Shape &s, cudaStream_t stream);
int launch_bwd_generic(const struct nk_norm_args *a, const struct nk_device_info *dev,
		       const Shape &s, float *part, cudaStream_t stream);
/* Memory-efficient backward: rg[c] = 1 / clamp(gamma[c]), before the kernel (generic.cu). */
int launch_reciprocal_gamma(const struct nk_norm_args *a, float *rg, cudaStream_t stream);
/*
 * Sums the partial rows at `part` (workspace; the chunk sums go after them,
 * mid_offset) into dgamma/dbeta and counts clamped gamma entries (generic.cu).
 */
int launch_finish(const struct nk_norm_args *a, float *part, int64_t part_rows,
		  uint32_t *clamped_cols, cudaStream_t stream);

/* ---- host launch helpers ---------------------------------------------------- */

/*
 * Lets kern use `bytes` of dynamic shared memory (static plus dynamic above
 * 48 KB is an opt-in per function and device); remembered per device.
 */
template <auto kern>
static inline cudaError_t allow_smem(const struct nk_device_info *dev, size_t bytes)
{
	static size_t allowed[16];
	const int slot = dev->ordinal >= 0 && dev->ordinal < 16 ? dev->ordinal : 0;
	/* Static shared memory counts against the default too: ask for any dynamic. */
	if (bytes == 0 || __atomic_load_n(&allowed[slot], __ATOMIC_RELAXED) >= bytes)
		return cudaSuccess;
	cudaError_t err =
	    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
	if (err == cudaSuccess)
		__atomic_store_n(&allowed[slot], bytes, __ATOMIC_RELAXED);
	return err;
}

/*
 * Launches kern(p) on a 1-D grid, as clusters of K blocks when K > 1, with
 * `smem` bytes of dynamic shared memory (see allow_smem).
 */
template <typename Kern>
static inline cudaError_t launch_kernel(Kern kern, int64_t grid, int threads, int K,
					cudaStream_t stream, const Params &p, size_t smem = 0)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[1];

	cfg.gridDim = dim3((unsigned)grid);
	cfg.blockDim = dim3((unsigned)threads);
	cfg.dynamicSmemBytes = smem;
	cfg.stream = stream;
	if (K > 1) {
		attr[0].id = cudaLaunchAttributeClusterDimension;
		attr[0].val.clusterDim.x = (unsigned)K;
		attr[0].val.clusterDim.y = 1;
		attr[0].val.clusterDim.z = 1;
		cfg.attrs = attr;
		cfg.numAttrs = 1;
	}
	return cudaLaunchKernelEx(&cfg, kern, p);
}

/* launch_kernel, after letting kern use `smem` bytes of dynamic shared memory (allow_smem). */
template <auto kern>
static inline cudaError_t launch_with_smem(const struct nk_device_info *dev, int64_t grid,
					   int threads, int K, cudaStream_t stream, const Params &p,
					   size_t smem)
{
	cudaError_t err = allow_smem<kern>(dev, smem);
	return err == cudaSuccess ? launch_kernel(kern, grid, threads, K, stream, p, smem) : err;
}

/*
 * Resident blocks of `threads` threads per multiprocessor, asked once per
 * kernel and block size (the answer only sizes grids, so a stale value on a
 * second, different GPU costs speed, never correctness).
 */
template <auto kern> static inline int resident_blocks(int threads)
{
	static int cache[17]; /* by threads / 32; 0 = not asked yet */
	int slot = threads / 32 <= 16 ? threads / 32 : 16;
	int n = __atomic_load_n(&cache[slot], __ATOMIC_RELAXED);

	if (n > 0)
		return n;
	if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, threads, 0) != cudaSuccess ||
	    n < 1) {
		(void)cudaGetLastError();
		n = 1;
	}
	__atomic_store_n(&cache[slot], n, __ATOMIC_RELAXED);
	return n;
}

/* Calls f(T(), W()) with the storage types of a job. */
template <class F> static inline int with_types(int dtype, int wdtype, F &&f)
{
	bool wf32 = wdtype == NK_F32;
	switch (dtype) {
	case NK_F32:
		return f(float(), float());
	case NK_F16:
		return wf32 ? f(__half(), float()) : f(__half(), __half());
	case NK_BF16:
		return wf32 ? f(__nv_bfloat16(), float()) : f(__nv_bfloat16(), __nv_bfloat16());
	}
	return NK_EUNSUPPORTED;
}

template <int N> struct Int {
	static constexpr int value = N;
};

/* Calls f(Int<nv>()) for nv in {1, 2, 4, 8} with nv * VEC <= MAXE. */
template <int MAXE, int VEC, class F> static inline int with_nv(int nv, F &&f)
{
	switch (nv) {
	case 1:
		return f(Int<1>());
	case 2:
		if constexpr (2 * VEC <= MAXE)
			return f(Int<2>());
		break;
	case 4:
		if constexpr (4 * VEC <= MAXE)
			return f(Int<4>());
		break;
	case 8:
		if constexpr (8 * VEC <= MAXE)
			return f(Int<8>());
		break;
	}
	return NK_EUNSUPPORTED;
}

} /* namespace nkc */

#endif /* NORMD_NORM_CUDA_LAUNCH_CUH */
