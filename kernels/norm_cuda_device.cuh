/*
 * Device helpers the kernel files share (private to kernels/): storage
 * conversions and packing, weight loads, the clamp and division of the
 * memory-efficient backward, the backward's partial-row store, and the
 * shared state and barrier setup of the tma_slice kernels.
 */
#ifndef NORMD_NORM_CUDA_DEVICE_CUH
#define NORMD_NORM_CUDA_DEVICE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/norm_cuda_launch.cuh"
#include "kernels/norm_cuda_ptx.cuh"

namespace nkc
{

__device__ __forceinline__ float to_f(float v)
{
	return v;
}
__device__ __forceinline__ float to_f(__half v)
{
	return __half2float(v);
}
__device__ __forceinline__ float to_f(__nv_bfloat16 v)
{
	return __bfloat162float(v);
}

template <typename S> __device__ __forceinline__ S from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v)
{
	return v;
}
template <> __device__ __forceinline__ __half from_f<__half>(float v)
{
	return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v)
{
	return __float2bfloat16_rn(v);
}

/* Unpacks the 16 bytes of `u` into 16 / sizeof(S) floats. */
template <typename S> __device__ __forceinline__ void unpack(uint4 u, float *f)
{
	constexpr int PER = 16 / sizeof(S);
	union {
		uint4 u;
		S s[PER];
	} b;
	b.u = u;
#pragma unroll
	for (int i = 0; i < PER; i++)
		f[i] = to_f(b.s[i]);
}

/*
 * bf16 is the top half of an fp32: one shift or mask an element, where
 * extracting each half first costs two.
 */
template <> __device__ __forceinline__ void unpack<__nv_bfloat16>(uint4 u, float *f)
{
	const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
	for (int i = 0; i < 4; i++) {
		f[2 * i] = __uint_as_float(w[i] << 16);
		f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
	}
}

/* Packs 16 / sizeof(S) floats, rounded once, into 16 bytes. */
template <typename S> __device__ __forceinline__ uint4 pack(const float *f)
{
	constexpr int PER = 16 / sizeof(S);
	union {
		uint4 u;
		S s[PER];
	} b;
#pragma unroll
	for (int i = 0; i < PER; i++)
		b.s[i] = from_f<S>(f[i]);
	return b.u;
}

template <> __device__ __forceinline__ uint4 pack<__half>(const float *f)
{
	union {
		uint4 u;
		__half2 h[4];
	} b;
#pragma unroll
	for (int i = 0; i < 4; i++)
		b.h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
	return b.u;
}

template <> __device__ __forceinline__ uint4 pack<__nv_bfloat16>(const float *f)
{
	union {
		uint4 u;
		__nv_bfloat162 h[4];
	} b;
#pragma unroll
	for (int i = 0; i < 4; i++)
		b.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
	return b.u;
}

/* N elements of S at p (16-byte aligned) into floats, through L1. */
template <int N, typename S> __device__ __forceinline__ void load_weights(const S *p, float *f)
{
	constexpr int PER = 16 / sizeof(S);
	static_assert(N % PER == 0, "whole vectors only");
#pragma unroll
	for (int c = 0; c < N / PER; c++)
		unpack<S>(__ldg(reinterpret_cast<const uint4 *>(p) + c), f + c * PER);
}

/*
 * The row group of this thread, threadIdx.x / G, by a multiply and a
 * shift (an integer division is about 20 instructions): exact while
 * threadIdx.x * G < 2^21, and blocks have at most 1024 threads and G <= 1024.
 */
__device__ __forceinline__ int row_group(const Params &p)
{
	return (int)((threadIdx.x * (unsigned)p.g_mul) >> 21);
}

/*
 * This block's place in a grid of row groups that K blocks share (K a
 * power of two: tiled shapes): its rank among the K, the first row group
 * it takes and the grid's stride in row groups.
 */
struct GridPlace {
	int rank;
	int64_t first;
	int64_t stride;
};

__device__ __forceinline__ GridPlace grid_place(int K)
{
	const int shift = __ffs(K) - 1;
	return {(int)(blockIdx.x & (unsigned)(K - 1)), (int64_t)(blockIdx.x >> shift),
		(int64_t)(gridDim.x >> shift)};
}

/* saturate(RNE(v)) in e4m3 or e5m2; any NaN is 0x7f, as the CPU reference writes it. */
__device__ __forceinline__ uint8_t to_fp8(float v, int fmt)
{
	if (isnan(v))
		return 0x7f;
	__nv_fp8_interpretation_t kind = fmt == NK_FP8_E4M3 ? __NV_E4M3 : __NV_E5M2;
	return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kind);
}

/*
 * to_fp8 of two values at once in format FMT (one conversion instruction
 * on sm_89 and later). Inputs that are results of fp32 arithmetic need no
 * NaN fixup: the GPU writes every NaN result as the canonical positive NaN,
 * which converts to 0x7f (test_fused_cuda's NaN rows check it).
 */
template <int FMT>
__device__ __forceinline__ __nv_fp8x2_storage_t to_fp8x2(float a, float b)
{
	constexpr __nv_fp8_interpretation_t kind = FMT == NK_FP8_E4M3 ? __NV_E4M3 : __NV_E5M2;
	return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind);
}

/* The weight-offset variant: gamma + offset in fp32 (offset 0 for the plain norm). */
template <int N> __device__ __forceinline__ void add_offset(const Params &p, float *w)
{
#pragma unroll
	for (int i = 0; i < N; i++)
		w[i] += p.offset;
}

/* apex's clamp_by_magnitude: |g| < eps becomes +-eps, 0 becomes +eps. */
__device__ __forceinline__ float clamp_magnitude(float g, float eps)
{
	return g >= 0.0f ? (g < eps ? eps : g) : (g > -eps ? -eps : g);
}

/*
 * a / b within 2 ulp: the fast division, with b scaled by a power of two
 * into its range first (exact), so no IEEE slow-path call is compiled in.
 */
__device__ __forceinline__ float divide(float a, float b)
{
	float m = fabsf(b);
	if (m < 0x1p-125f)
		return __fdividef(a, b * 0x1p64f) * 0x1p64f;
	if (m > 0x1p125f)
		return __fdividef(a, b * 0x1p-64f) * 0x1p-64f;
	return __fdividef(a, b);
}

/*
 * Writes a thread's dgamma/dbeta sums of its vectors vi[j] (>= nvec: none)
 * as partial row `prow` of the workspace (backward kernels).
 */
template <int NV, int VEC>
__device__ __forceinline__ void write_partials(const Params &p, int64_t prow, const int *vi,
					       const float *ag, const float *ab)
{
	float *pg = p.part + prow * p.cols;
	float *pb = p.part + (p.part_rows + prow) * p.cols;
#pragma unroll
	for (int j = 0; j < NV; j++) {
		if (vi[j] >= p.nvec)
			continue;
#pragma unroll
		for (int c = 0; c < VEC / 4; c++) {
			const float *a = ag + j * VEC + 4 * c;
			const float *b = ab + j * VEC + 4 * c;
			if (p.f & F_DGAMMA)
				reinterpret_cast<float4 *>(pg + vi[j] * VEC)[c] =
				    make_float4(a[0], a[1], a[2], a[3]);
			if (p.f & F_DBETA)
				reinterpret_cast<float4 *>(pb + vi[j] * VEC)[c] =
				    make_float4(b[0], b[1], b[2], b[3]);
		}
	}
}

/* Per-block static shared memory of the tma_slice kernels (forward and backward). */
struct TmaSmem {
	unsigned long long full[TMA_MAX_STAGES]; /* mbarrier: stage k's copies landed */
	unsigned long long sums[TMA_SUM_SLOTS];	 /* mbarrier: a row's K block sums landed */
	/* (16 bytes a block: bwd sum(g), sum(g * xh); fwd count, mean, M2) */
	float4 warp[2][MAX_THREADS / 32];	     /* each warp's, by row parity */
	float4 rank[TMA_SUM_SLOTS][TMA_MAX_CLUSTER]; /* each block's of the cluster, by row slot */
};
/* Shared memory a tma_slice block takes besides its stages (the dynamic base is 128-aligned). */
constexpr size_t TMA_STATIC_SMEM = (sizeof(TmaSmem) + 127) / 128 * 128;

#ifdef NKC_TMA
/*
 * Thread 0 initializes the stage barriers (`stages`) and, on a cluster of
 * K > 1 blocks, the row-sum barriers, armed for the block's first rows of
 * its n row groups; then the block, and the cluster, meet, so that every
 * block's shared memory is live before any peer stores into it.
 */
__device__ __forceinline__ void tma_barriers_init(TmaSmem &sm, int stages, int K, int64_t n)
{
	if (threadIdx.x == 0) {
		for (int k = 0; k < stages; k++)
			mbarrier_init(&sm.full[k], 1);
		for (int d = 0; d < TMA_SUM_SLOTS && K > 1; d++) {
			mbarrier_init(&sm.sums[d], 1);
			if (d < n) /* the K blocks' sums of row group d */
				mbarrier_expect(&sm.sums[d], 16u * K);
		}
		mbarrier_init_fence();
	}
	__syncthreads();
	if (K > 1) {
		cluster_arrive();
		cluster_wait();
	}
}
#endif

} /* namespace nkc */

#endif /* NORMD_NORM_CUDA_DEVICE_CUH */
