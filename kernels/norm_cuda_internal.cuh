/*
 * Private to kernels/norm_cuda_*.cu: what the CUDA launchers share.
 *
 * The kernels come in two families:
 *   - tiled (NK_FAMILY_WARP_ROWS, NK_FAMILY_BLOCK_ROW): a group of G threads
 *     owns one row; each thread keeps NV 16-byte vectors of the row in
 *     registers, so the row is read from device memory once. G <= 32 is a
 *     piece of a warp (a block then holds R = threads / G rows at a time);
 *     G > 32 is a whole block, and on sm_90 a thread-block cluster of K
 *     blocks may share one row, exchanging partial sums through distributed
 *     shared memory. Needs 16-byte aligned tensors and cols % VEC == 0.
 *   - block_smem (NK_FAMILY_BLOCK_SMEM): a block (backward on sm_90 also a
 *     cluster) owns a row at a time and stages it in shared memory with
 *     cp.async, the next row(s) in flight; for rows wider than registers hold.
 *   - tma_slice (NK_FAMILY_TMA_SLICE, sm_90): a cluster of K blocks owns a
 *     row at a time, block r a contiguous column slice of it (or a block R
 *     rows on a warp's lanes each), staged several rows deep by TMA bulk
 *     copies (norm_cuda_bwd_tma.cu, norm_cuda_fwd_tma.cu).
 *   - generic (NK_FAMILY_GENERIC): scalar loads, several passes over a row
 *     (the later ones hit L2); any cols, any alignment.
 * Backward writes per-row-group dgamma/dbeta partials (fp32) to the
 * workspace; launch_finish() sums them in a fixed order (many partial rows
 * in chunks first, finish_chunks). How many partial rows and chunks there
 * are depends on the shape and the variant only, never on the device, so
 * the weight gradients are bit-identical on every run and GPU.
 */
#ifndef NORMD_NORM_CUDA_INTERNAL_CUH
#define NORMD_NORM_CUDA_INTERNAL_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

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
	int G;	  /* threads per row (per block of a cluster) */
	int K;	  /* blocks sharing a row: a cluster, or (F_PRESUMS) column slices */
	int R;	  /* rows a block holds at a time */
	int nvec; /* 16-byte vectors per row (tiled family) */
	int prefetch; /* block_smem ring backward: next-row vectors a thread stages early */
	int stages;   /* tma_slice: rows of the block's slice staged in shared memory */
	int slice;    /* tma_slice: vectors of a row each block of the cluster owns */
};

/* Decoded launch shape of a variant. */
struct Shape {
	int family;
	int threads;
	int R;
	int G;
	int NV;
	int K;	       /* blocks sharing a row */
	bool split;    /* backward: K column slices after a row-sums kernel, no cluster */
	int units_cap; /* backward: most row groups (clusters) in the grid */
	bool ring;     /* block_smem backward: one row staged, `prefetch` of the next */
	int prefetch;  /* ring: vectors a thread of the next row staged ahead (<= NV) */
	bool staged_weights; /* ring, memory-efficient: gamma, beta, rg in shared memory */
	int stages;	     /* tma_slice: rows staged in shared memory (>= 3) */
};

/*
 * The variant param word: NV | K << 8 | units_cap << 16 | split << 31. In
 * the block_smem family (never split) bit 31 marks the ring backward
 * instead: its NV (at most 8) takes bits 0-6, bit 7 says "weights staged",
 * K (at most 8) bits 8-11 and the prefetch depth bits 12-15.
 */
constexpr int MAX_UNITS_CAP = 0x7fff;
static inline uint32_t shape_param(int nv, int k, int cap, bool split)
{
	return (uint32_t)nv | (uint32_t)k << 8 | (uint32_t)cap << 16 | (uint32_t)split << 31;
}
static inline uint32_t ring_param(int nv, int k, int prefetch, bool staged_weights, int cap)
{
	return (uint32_t)nv | (uint32_t)staged_weights << 7 | (uint32_t)k << 8 |
	       (uint32_t)prefetch << 12 | (uint32_t)cap << 16 | 1u << 31;
}

/* The tma_slice param word: NV | stages << 4 | K << 8 | units_cap << 16. */
static inline uint32_t tma_param(int nv, int stages, int k, int cap)
{
	return (uint32_t)nv | (uint32_t)stages << 4 | (uint32_t)k << 8 | (uint32_t)cap << 16;
}

Shape shape_of(const struct nk_variant *v);

/* Partial rows (per weight gradient) a backward job writes. */
int64_t partial_rows(const struct nk_norm_args *a, const Shape &s);
/* Chunks launch_finish sums the partial rows in first (1: one step), and
 * where their sums start in the workspace (floats after the partials). */
int64_t finish_chunks(int64_t cols, int64_t part_rows);
int64_t mid_offset(const struct nk_norm_args *a, int64_t part_rows);

/* Records a CUDA error for nk_cuda_last_error() and returns NK_EDEVICE. */
int set_error(cudaError_t err, const char *where);
/* Checks the launch just made; NK_OK or NK_EDEVICE. */
int check_launch(const char *where);

/* Launchers (norm_cuda_fwd.cu, norm_cuda_bwd.cu, norm_cuda_generic.cu). */
int launch_fwd_tiled(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		     cudaStream_t stream);
int launch_bwd_tiled(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		     float *part, const float *rg, float *sums, cudaStream_t stream);
int launch_fwd_generic(const struct nk_norm_args *a, const struct nk_device_info *dev,
		       const Shape &s, cudaStream_t stream);
int launch_bwd_generic(const struct nk_norm_args *a, const struct nk_device_info *dev,
		       const Shape &s, float *part, cudaStream_t stream);
/* Shared-memory family (norm_cuda_smem.cu): the row staged in shared memory. */
int launch_fwd_smem(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		    cudaStream_t stream);
int launch_bwd_smem(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		    float *part, const float *rg, cudaStream_t stream);
/* Ring backward (Shape::ring): one row staged, part of the next in flight. */
int launch_bwd_smem_ring(const struct nk_norm_args *a, const struct nk_device_info *dev,
			 const Shape &s, float *part, const float *rg, cudaStream_t stream);
/* tma_slice backward (norm_cuda_bwd_tma.cu, sm_90). */
int launch_bwd_tma(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		   float *part, const float *rg, cudaStream_t stream);
int launch_fwd_tma(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		   cudaStream_t stream);
/*
 * Dynamic shared memory of a tma_slice variant: `stages` rows of a block's
 * slice of x and dy (backward), of x (forward, R rows a stage).
 */
size_t tma_stage_bytes(const struct nk_norm_args *a, const Shape &s);
/*
 * Dynamic shared memory of a block_smem variant: its slice of the row, two
 * stages (forward RMSNorm rows over 56 KB: three where `dev` has room; the
 * backward never reads `dev`, which may be NULL there).
 */
size_t smem_stage_bytes(const struct nk_norm_args *a, const Shape &s,
			const struct nk_device_info *dev);
/* Memory-efficient backward: rg[c] = 1 / clamp(gamma[c]), before the kernel. */
int launch_reciprocal_gamma(const struct nk_norm_args *a, float *rg, cudaStream_t stream);
/*
 * Sums the partial rows at `part` (workspace; the chunk sums go after them,
 * mid_offset) into dgamma/dbeta and counts clamped gamma entries.
 */
int launch_finish(const struct nk_norm_args *a, float *part, int64_t part_rows,
		  uint32_t *clamped_cols, cudaStream_t stream);

/* Fills Params from a job. */
Params params_of(const struct nk_norm_args *a);
/* Params of a job on a row-group shape: G threads a row, R rows a group, K blocks a row. */
Params params_of(const struct nk_norm_args *a, const Shape &s);

/* ---- device helpers -------------------------------------------------------- */

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

/*
 * 16 bytes of a tensor read exactly once: through the read-only path
 * without allocating in L1, which stays free for the weights every row
 * reloads.
 */
__device__ __forceinline__ uint4 load_stream(const uint4 *p)
{
	uint4 u;
	asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
	    : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
	    : "l"(p));
	return u;
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
 * Hides a value from the optimizer, so that work recomputed from it after a
 * barrier is recomputed (cheap) instead of kept live across the barrier in
 * registers (which costs occupancy or spills).
 */
__device__ __forceinline__ void launder(uint4 &u)
{
	asm volatile("" : "+r"(u.x), "+r"(u.y), "+r"(u.z), "+r"(u.w));
}
template <typename P> __device__ __forceinline__ P *launder(P *ptr)
{
	asm volatile("" : "+l"(ptr));
	return ptr;
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

/* Per-block scratch of the group reductions, double-buffered by row parity. */
struct RedSmem {
	float warp[2][32][3];
	float cta[2][3];
};

/* Sums of N values. */
template <int N> struct SumOp {
	static constexpr int n = N;
	__device__ __forceinline__ static void merge(float *a, const float *b)
	{
#pragma unroll
		for (int i = 0; i < N; i++)
			a[i] += b[i];
	}
};

/* Chan's merge of (count, mean, M2) triples; a is the lower-ranked part. */
struct WelfordOp {
	static constexpr int n = 3;
	__device__ __forceinline__ static void merge(float *a, const float *b)
	{
		float cnt = a[0] + b[0];
		if (b[0] == 0.0f)
			return;
		if (a[0] == 0.0f) {
			a[0] = b[0];
			a[1] = b[1];
			a[2] = b[2];
			return;
		}
		float d = b[1] - a[1];
		float r = __fdividef(b[0], cnt); /* counts are small integers */
		a[1] += d * r;
		a[2] += b[2] + d * d * a[0] * r;
		a[0] = cnt;
	}
};

/*
 * Merges v across aligned groups of `width` lanes (a power of two <= 32)
 * with an xor butterfly. Partners always merge the lower lane's part
 * first, so every lane of a group ends with the same bits.
 */
template <class Op> __device__ __forceinline__ void butterfly(float *v, int width)
{
	constexpr int N = Op::n;
	for (int off = 1; off < width; off <<= 1) {
		float o[N];
#pragma unroll
		for (int i = 0; i < N; i++)
			o[i] = __shfl_xor_sync(0xffffffffu, v[i], off);
		if (threadIdx.x & off) {
			Op::merge(o, v);
#pragma unroll
			for (int i = 0; i < N; i++)
				v[i] = o[i];
		} else {
			Op::merge(v, o);
		}
	}
}

/* Gives every lane of the warp lane 0's v. */
template <int N> __device__ __forceinline__ void broadcast_lane0(float *v)
{
#pragma unroll
	for (int i = 0; i < N; i++)
		v[i] = __shfl_sync(0xffffffffu, v[i], 0);
}

/* The smallest power of two >= n (n <= 32). */
__device__ __forceinline__ int lanes_for(int n)
{
	return n <= 1 ? 1 : 1 << (32 - __clz(n - 1));
}

/*
 * The cluster level of group_reduce: every block publishes its value, and
 * lane r of every warp fetches block r's, then a butterfly merges them in
 * rank order and lane 0 hands the result to the whole warp. sm_90 only; the launchers never ask for
 * K > 1 elsewhere.
 */
template <class Op>
__device__ __forceinline__ void cluster_reduce(float *v, int K, RedSmem &sm, int parity)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
	cooperative_groups::cluster_group cl = cooperative_groups::this_cluster();
	const int lane = threadIdx.x & 31;
	if (threadIdx.x == 0) {
#pragma unroll
		for (int i = 0; i < Op::n; i++)
			sm.cta[parity][i] = v[i];
	}
	cl.sync();
	const float *r = cl.map_shared_rank(&sm.cta[parity][0], lane < K ? lane : 0);
#pragma unroll
	for (int i = 0; i < Op::n; i++)
		v[i] = lane < K ? r[i] : 0.0f;
	butterfly<Op>(v, K);
	broadcast_lane0<Op::n>(v);
#else
	(void)v;
	(void)K;
	(void)sm;
	(void)parity;
	__trap();
#endif
}

/* Keeps a block's shared memory alive until its cluster peers are done. */
__device__ __forceinline__ void cluster_done(int K)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
	if (K > 1)
		cooperative_groups::this_cluster().sync();
#else
	(void)K;
#endif
}

/* The rank of this block in its cluster (1-D grids, K blocks a cluster). */
__device__ __forceinline__ int cluster_rank(int K)
{
	return K > 1 ? (int)(blockIdx.x % (unsigned)K) : 0;
}

/*
 * Reduces v over the G threads of a row group (and the K blocks of a
 * cluster); every thread of the group ends with the same bits, merged in a
 * fixed order. Identity elements are zeros (a zero count for WelfordOp).
 * `parity` alternates per reduction so that one barrier per level suffices.
 */
template <class Op>
__device__ __forceinline__ void group_reduce(float *v, int G, int K, RedSmem &sm, int parity)
{
	constexpr int N = Op::n;
	butterfly<Op>(v, G < 32 ? G : 32);
	if (G > 32) {
		const int lane = threadIdx.x & 31, nw = G >> 5;
		const int first = (threadIdx.x / G) * nw;
		if (lane == 0) {
#pragma unroll
			for (int i = 0; i < N; i++)
				sm.warp[parity][threadIdx.x >> 5][i] = v[i];
		}
		__syncthreads();
#pragma unroll
		for (int i = 0; i < N; i++)
			v[i] = lane < nw ? sm.warp[parity][first + lane][i] : 0.0f;
		butterfly<Op>(v, lanes_for(nw));
		broadcast_lane0<N>(v);
	}
	if (K > 1)
		cluster_reduce<Op>(v, K, sm, parity);
}

/*
 * Asynchronous 16-byte copies from device to shared memory that bypass L1
 * (sm_80 and later). Every thread waits only for its own copies, so a slot
 * that one thread fills and reads needs no barrier.
 */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem)
{
	const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit()
{
	asm volatile("cp.async.commit_group;" ::: "memory");
}
/* Waits until at most N of this thread's newest copy groups are in flight. */
template <int N> __device__ __forceinline__ void cp_async_wait()
{
	asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
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

/*
 * TMA primitives (sm_90; the tma_slice kernels, norm_cuda_*_tma.cu): bulk
 * copies into shared memory that complete an mbarrier, and stores into the
 * shared memory of another block of the cluster that complete its mbarrier.
 */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define NKC_TMA 1
#endif

#ifdef NKC_TMA
__device__ __forceinline__ unsigned shared_addr(const void *p)
{
	return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbarrier_init(unsigned long long *bar, unsigned count)
{
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_addr(bar)), "r"(count)
		     : "memory");
}

/* Makes initialized mbarriers visible to the async proxy (the bulk copies). */
__device__ __forceinline__ void mbarrier_init_fence()
{
	asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/* Arrives once, announcing `bytes` the phase's bulk copies (or peers' st.async) will deliver. */
__device__ __forceinline__ void mbarrier_expect(unsigned long long *bar, unsigned bytes)
{
	asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
			 shared_addr(bar)),
		     "r"(bytes)
		     : "memory");
}

__device__ __forceinline__ void mbarrier_wait(unsigned long long *bar, unsigned parity)
{
	unsigned done;
	do {
		asm volatile("{\n\t.reg .pred p;\n\t"
			     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
			     "selp.u32 %0, 1, 0, p;\n\t}"
			     : "=r"(done)
			     : "r"(shared_addr(bar)), "r"(parity)
			     : "memory");
	} while (!done);
}

/*
 * mbarrier_wait for a barrier that other blocks of the cluster complete
 * (st.async): acquire at cluster scope, so that their stores are seen.
 */
__device__ __forceinline__ void mbarrier_wait_cluster(unsigned long long *bar, unsigned parity)
{
	unsigned done;
	do {
		asm volatile("{\n\t.reg .pred p;\n\t"
			     "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
			     "selp.u32 %0, 1, 0, p;\n\t}"
			     : "=r"(done)
			     : "r"(shared_addr(bar)), "r"(parity)
			     : "memory");
	} while (!done);
}

/* `bytes` (a multiple of 16) from global to this block's shared memory. */
__device__ __forceinline__ void bulk_load(void *dst, const void *src, unsigned bytes,
					  unsigned long long *bar)
{
	asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
		     "[%0], [%1], %2, [%3];" ::"r"(shared_addr(dst)),
		     "l"(src), "r"(bytes), "r"(shared_addr(bar))
		     : "memory");
}

__device__ __forceinline__ void cluster_arrive()
{
	asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait()
{
	asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

/* The address of `local` (shared memory) in the block of cluster rank `rank`. */
__device__ __forceinline__ unsigned rank_addr(const void *local, int rank)
{
	unsigned remote;
	asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
		     : "=r"(remote)
		     : "r"(shared_addr(local)), "r"(rank));
	return remote;
}

/*
 * Stores v at `local` in the block of cluster rank `rank`, completing 16
 * bytes of that block's mbarrier `bar` (its waiters then see v). Unlike a
 * release barrier, it does not wait for this thread's earlier global stores.
 */
__device__ __forceinline__ void store_to_rank(float4 *local, unsigned long long *bar, int rank,
					      float4 v)
{
	asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 "
		     "[%0], {%1, %2, %3, %4}, [%5];" ::"r"(rank_addr(local, rank)),
		     "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(rank_addr(bar, rank))
		     : "memory");
}
#endif

/* ---- host helpers ------------------------------------------------------------ */

/*
 * Lets kern use `bytes` of dynamic shared memory (static plus dynamic above
 * 48 KB is an opt-in per function and device); remembered per device.
 */
template <auto kern> static inline cudaError_t allow_smem(const struct nk_device_info *dev,
							  size_t bytes)
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

/*
 * What a tiled thread holds: forward up to 32 elements, backward (which also
 * keeps dgamma/dbeta sums) up to 2 vectors; more spills registers.
 */
constexpr int FWD_MAX_ELEMS = 32;
constexpr int BWD_MAX_NV = 2;
/* Elements a block_smem backward thread keeps dgamma/dbeta sums for. */
constexpr int SMEM_BWD_MAX_ELEMS = 32;
/* Threads per block of a block_smem backward cluster, at most. */
constexpr int SMEM_CLUSTER_MAX_THREADS = 256;
/* Threads per block of the block_smem forward, at most. */
constexpr int SMEM_FWD_MAX_THREADS = 1024;
/* Threads per block of the tiled kernels, at most; backward on sm_80. */
constexpr int MAX_THREADS = 512;
constexpr int BWD_MAX_THREADS_SM80 = 256;
/*
 * tma_slice (norm_cuda_*_tma.cu). TMA_ELEMS: elements of a row a backward
 * thread owns; their weights and dgamma/dbeta sums stay in registers, at
 * most 128 registers a thread with 512 threads, so blocks of up to 256
 * threads fit twice on a multiprocessor.
 */
constexpr int TMA_ELEMS = 16;
constexpr int TMA_MAX_STAGES = 15; /* rows staged at most */
constexpr int TMA_STAGES = 4;	    /* rows staged by default (deeper measured no faster) */
constexpr int TMA_MAX_CLUSTER = 8;
constexpr int TMA_SUM_SLOTS = 4; /* rows whose cluster sums are in flight at once */
/* The backward's slot-reuse argument (norm_cuda_bwd_tma.cu) needs 4; slots are masked. */
static_assert(TMA_SUM_SLOTS >= 4 && (TMA_SUM_SLOTS & (TMA_SUM_SLOTS - 1)) == 0,
	      "row-sum slots: a power of two, at least 4");
/* Per-block static shared memory of the tma_slice kernels (forward and backward). */
struct TmaSmem {
	unsigned long long full[TMA_MAX_STAGES]; /* mbarrier: stage k's copies landed */
	unsigned long long sums[TMA_SUM_SLOTS];	 /* mbarrier: a row's K block sums landed */
	/* (16 bytes a block: bwd sum(g), sum(g * xh); fwd count, mean, M2) */
	float4 warp[2][MAX_THREADS / 32];	 /* each warp's, by row parity */
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

/* Threads per block of the ring backward (bwd_smem_ring), at most. */
constexpr int ring_max_threads(bool cluster, int elems)
{
	return cluster && elems > SMEM_BWD_MAX_ELEMS / 2 ? SMEM_CLUSTER_MAX_THREADS : MAX_THREADS;
}

} /* namespace nkc */

#endif /* NORMD_NORM_CUDA_INTERNAL_CUH */
