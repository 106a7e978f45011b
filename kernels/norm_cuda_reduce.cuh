/*
 * The deterministic reductions of the kernels (private to kernels/): sums
 * and Welford triples merged over a row group's lanes (an xor butterfly),
 * its warps (shared memory) and the blocks of a cluster (distributed
 * shared memory, sm_90), always in the same order, so every thread of a
 * group ends with the same bits.
 */
#ifndef NORMD_NORM_CUDA_REDUCE_CUH
#define NORMD_NORM_CUDA_REDUCE_CUH

#include <cooperative_groups.h>
#include <cuda_runtime.h>

namespace nkc
{

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

} /* namespace nkc */

#endif /* NORMD_NORM_CUDA_REDUCE_CUH */
