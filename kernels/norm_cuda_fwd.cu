/*
 * LayerNorm and RMSNorm forward, tiled family (norm_cuda_internal.cuh).
 *
 * A group of G threads owns a row; thread t of the group holds vectors
 * (j * K + rank) * G + t, j < NV, of the row in registers (16-byte loads that
 * do not allocate in L1), so x is read from device memory exactly once.
 * LayerNorm statistics are those of two passes over the registers (mean,
 * then squared deviations; row_stats), or of one pass of sum(x) and
 * sum(x * x) on full 16-bit warp rows where that is as accurate (mean^2 <=
 * variance, checked per warp); RMSNorm reduces the sum of squares.
 * While a row is reduced, the next row the group owns is already being
 * loaded. The grid is persistent: as many blocks as are resident on the
 * device, striding over row groups.
 *
 * Built by `make` (nvcc -O3, sm_80 and sm_90 machine code plus compute_90
 * PTX); instantiated for the five (x, weight) dtype pairs and NV in
 * {1, 2, 4, 8} with NV * VEC <= 32 elements a thread, plus a FULL twin
 * without bounds checks for the 16-bit pairs; block_smem once for
 * LayerNorm and once for RMSNorm. Timed by bench/bench_norm.c with CUDA
 * events against the device's copy bandwidth.
 */
#include "kernels/norm_cuda_internal.cuh"

namespace nkc
{
namespace
{

/* Loads the NV vectors of one row a thread owns; missing ones are zero. */
template <typename T, int NV, bool FULL>
__device__ __forceinline__ void load_row(const Params &p, int64_t row, bool valid, const int *vi,
					 uint4 *out)
{
	const uint4 *base = reinterpret_cast<const uint4 *>(static_cast<const T *>(p.x) +
							    (valid ? row : 0) * p.cols);
#pragma unroll
	for (int j = 0; j < NV; j++) {
		out[j] = make_uint4(0, 0, 0, 0);
		if (valid && (FULL || vi[j] < p.nvec))
			out[j] = load_stream(base + vi[j]);
	}
}

/*
 * The statistics of a row, reduced over its row group. `parity` flips with
 * every reduction (see group_reduce). LayerNorm on a single block takes two
 * cheap sum reductions (the mean, then the sum of squared deviations); a
 * cluster, whose barriers cost more, takes one reduction of (count, mean,
 * M2) triples merged with Chan's formula. Both are as robust as two passes.
 * Full warp rows (FULL: K = 1, G <= 32) first try one pass (below): 0.4-0.5
 * points at bf16 512 and 1024 columns on the H100.
 */
template <typename T, int NV, bool FULL>
__device__ __forceinline__ void row_stats(const Params &p, const float *x, const int *vi,
					  RedSmem &sm, int &parity, float *mean, float *rstd)
{
	constexpr int VEC = 16 / sizeof(T);
	if (!(p.f & F_LN)) {
		float q[1] = {0.0f};
#pragma unroll
		for (int e = 0; e < NV * VEC; e++)
			q[0] += x[e] * x[e];
		group_reduce<SumOp<1>>(q, p.G, p.K, sm, parity);
		parity ^= 1;
		*mean = 0.0f;
		*rstd = rsqrtf(q[0] * p.inv_cols + p.eps);
		return;
	}
	if (FULL) {
		/*
		 * Full warp rows: one pass of sum(x) and sum(x * x) and one
		 * butterfly. Its variance loses at most a bit to cancellation
		 * where mean^2 <= variance; if any row of the warp is not such
		 * a row, or its sum of squares is not finite (overflow: bf16
		 * values near 1e18), the whole warp takes the two passes below
		 * (warp-uniform, since their butterflies span the warp).
		 */
		float q[2] = {0.0f, 0.0f};
#pragma unroll
		for (int e = 0; e < NV * VEC; e++) {
			q[0] += x[e];
			q[1] += x[e] * x[e];
		}
		butterfly<SumOp<2>>(q, p.G);
		const float m = q[0] * p.inv_cols, var = q[1] * p.inv_cols - m * m;
		if (__all_sync(0xffffffffu, isfinite(var) && m * m <= var)) {
			*mean = m;
			*rstd = rsqrtf(var + p.eps);
			return;
		}
	}
	float s = 0.0f, n = 0.0f;
#pragma unroll
	for (int j = 0; j < NV; j++) {
		if (FULL || vi[j] < p.nvec) {
			n += (float)VEC;
#pragma unroll
			for (int i = 0; i < VEC; i++)
				s += x[j * VEC + i];
		}
	}
	float w[3] = {n, s, 0.0f};
	if (p.K == 1) {
		group_reduce<SumOp<1>>(&w[1], p.G, 1, sm, parity);
		parity ^= 1;
		w[1] *= p.inv_cols;
	} else if (n > 0.0f) {
		w[1] = __fdividef(s, n);
	}
#pragma unroll
	for (int j = 0; j < NV; j++) {
		if (FULL || vi[j] < p.nvec) {
#pragma unroll
			for (int i = 0; i < VEC; i++) {
				float d = x[j * VEC + i] - w[1];
				w[2] += d * d;
			}
		}
	}
	if (p.K == 1)
		group_reduce<SumOp<1>>(&w[2], p.G, 1, sm, parity);
	else
		group_reduce<WelfordOp>(w, p.G, p.K, sm, parity);
	parity ^= 1;
	*mean = w[1];
	*rstd = rsqrtf(w[2] * p.inv_cols + p.eps);
}

/* y of vector `v` of a row (its x in `x`), rounded once and streamed to `out`. */
template <typename T, typename W>
__device__ __forceinline__ void write_vector(const Params &p, uint4 *out, int v,
					     const float *x, float mean, float rstd)
{
	constexpr int VEC = 16 / sizeof(T);
	float g[VEC], b[VEC], y[VEC];
	if (p.f & F_GAMMA) {
		load_weights<VEC>(static_cast<const W *>(p.gamma) + v * VEC, g);
	} else {
#pragma unroll
		for (int i = 0; i < VEC; i++)
			g[i] = 1.0f;
	}
	if (p.f & F_BETA) {
		load_weights<VEC>(static_cast<const W *>(p.beta) + v * VEC, b);
	} else {
#pragma unroll
		for (int i = 0; i < VEC; i++)
			b[i] = 0.0f;
	}
#pragma unroll
	for (int i = 0; i < VEC; i++)
		y[i] = (x[i] - mean) * rstd * g[i] + b[i];
	__stcs(out + v, pack<T>(y));
}

/* y of the NV vectors a thread owns. */
template <typename T, typename W, int NV, bool FULL>
__device__ __forceinline__ void write_row(const Params &p, int64_t row, const float *x,
					  const int *vi, float mean, float rstd)
{
	constexpr int VEC = 16 / sizeof(T);
	uint4 *out = reinterpret_cast<uint4 *>(static_cast<T *>(p.y) + row * p.cols);
#pragma unroll
	for (int j = 0; j < NV; j++) {
		if (FULL || vi[j] < p.nvec)
			write_vector<T, W>(p, out, vi[j], x + j * VEC, mean, rstd);
	}
}

template <typename T, typename W, int NV, bool FULL>
__global__ void __launch_bounds__(MAX_THREADS, 1) fwd_tiled(const Params p)
{
	constexpr int VEC = 16 / sizeof(T);
	__shared__ RedSmem sm;
	const int g = threadIdx.x / p.G, t = threadIdx.x % p.G;
	const int rank = cluster_rank(p.K);
	const int64_t first = blockIdx.x / p.K, stride = gridDim.x / p.K;
	const int64_t iters = p.iters;
	int vi[NV];
	uint4 cur[NV];
	int parity = 0;

#pragma unroll
	for (int j = 0; j < NV; j++)
		vi[j] = (j * p.K + rank) * p.G + t;
	load_row<T, NV, FULL>(p, first * p.R + g, first < iters && first * p.R + g < p.rows, vi, cur);
	for (int64_t it = first; it < iters; it += stride) {
		const int64_t row = it * p.R + g, next = (it + stride) * p.R + g;
		const bool valid = row < p.rows;
		uint4 nxt[NV];
		float x[NV * VEC], mean, rstd;

		load_row<T, NV, FULL>(p, next, it + stride < iters && next < p.rows, vi, nxt);
#pragma unroll
		for (int j = 0; j < NV; j++)
			unpack<T>(cur[j], x + j * VEC);
		row_stats<T, NV, FULL>(p, x, vi, sm, parity, &mean, &rstd);
		/* Unpack again rather than keep the floats across the barrier. */
#pragma unroll
		for (int j = 0; j < NV; j++) {
			launder(cur[j]);
			unpack<T>(cur[j], x + j * VEC);
		}
		if (valid) {
			write_row<T, W, NV, FULL>(p, row, x, vi, mean, rstd);
			if (t == 0 && rank == 0 && p.mean)
				p.mean[row] = mean;
			if (t == 0 && rank == 0 && p.rstd)
				p.rstd[row] = rstd;
		}
#pragma unroll
		for (int j = 0; j < NV; j++)
			cur[j] = nxt[j];
	}
	cluster_done(p.K);
}

template <typename T, typename W, int NV, bool FULL>
int run(const Params &p, const struct nk_device_info *dev, const Shape &s, cudaStream_t stream)
{
	constexpr auto kern = fwd_tiled<T, W, NV, FULL>;
	int64_t units = (p.rows + s.R - 1) / s.R;
	int64_t resident = (int64_t)dev->sm_count * resident_blocks<kern>(s.threads) / s.K;

	if (resident < 1)
		resident = 1;
	if (units > resident)
		units = resident;
	cudaError_t err = launch_kernel(kern, units * s.K, s.threads, s.K, stream, p);
	return err == cudaSuccess ? NK_OK : set_error(err, "forward kernel launch");
}

/*
 * block_smem forward: a block owns whole rows, one at a time (persistent
 * over rows), for rows too wide for a block's registers. The row is staged
 * in shared memory by cp.async, p.stages (2 or 3, smem_stage_bytes) deep:
 * the next rows are in flight while this one is reduced and written;
 * thread t copies and reads back vectors t, t + G, ..., so the stages need
 * no barrier. LayerNorm reduces sum(x) and sum(x * x) in one pass where
 * mean^2 <= variance (bf16 32768: 89 -> 92-93% of copy bandwidth), else
 * adds the two-pass reduction of squared deviations; RMSNorm takes one.
 * At most 40 registers (as many as 4 blocks of 384 threads leave; with
 * more, bf16 RMSNorm 12288 measured 3-4 points slower), any block size up
 * to SMEM_FWD_MAX_THREADS.
 */
template <typename T, typename W, bool LN>
__global__ void __maxnreg__(40) fwd_smem(const Params p)
{
	constexpr int VEC = 16 / sizeof(T);
	extern __shared__ uint4 stage[]; /* [p.stages][nvec] */
	__shared__ RedSmem sm;
	const int t = threadIdx.x, G = blockDim.x;
	const int n = p.nvec;
	int parity = 0, st = 0;

	auto issue = [&](int64_t row, uint4 *dst) {
		const uint4 *b =
		    reinterpret_cast<const uint4 *>(static_cast<const T *>(p.x) + row * p.cols);
		for (int v = t; v < n; v += G)
			cp_async16(dst + v, b + v);
	};
	const int S = p.stages;
	int64_t row = blockIdx.x;
	for (int k = 0; k < S - 1; k++) {
		const int64_t r = row + (int64_t)k * gridDim.x;
		if (r < p.rows)
			issue(r, stage + n * k);
		cp_async_commit();
	}
	for (; row < p.rows; row += gridDim.x) {
		const int64_t next = row + (int64_t)(S - 1) * gridDim.x;
		if (next < p.rows) /* into the stage of the previous row */
			issue(next, stage + n * (st > 0 ? st - 1 : S - 1));
		cp_async_commit();
		if (S == 3) /* this row's copies are the oldest group */
			cp_async_wait<2>();
		else
			cp_async_wait<1>();
		const uint4 *cur = stage + n * st;
		float mean = 0.0f, var = -1.0f; /* var < 0: not known yet */
		if (LN) {
			/*
			 * One pass of sum(x) and sum(x * x), kept where it is finite
			 * and mean^2 <= variance (as accurate as two passes there;
			 * every thread holds the same sums, so the choice is
			 * block-uniform).
			 */
			float s2[2] = {0.0f, 0.0f};
#pragma unroll 2
			for (int v = t; v < n; v += G) {
				float x[VEC];
				unpack<T>(cur[v], x);
#pragma unroll
				for (int i = 0; i < VEC; i++) {
					s2[0] += x[i];
					s2[1] += x[i] * x[i];
				}
			}
			group_reduce<SumOp<2>>(s2, G, 1, sm, parity);
			parity ^= 1;
			mean = s2[0] * p.inv_cols;
			const float one_pass = s2[1] * p.inv_cols - mean * mean;
			if (isfinite(one_pass) && mean * mean <= one_pass)
				var = one_pass;
		}
		if (!LN || !(var >= 0.0f)) { /* RMSNorm (mean 0), or LayerNorm's second pass */
			float q[1] = {0.0f};
#pragma unroll 2
			for (int v = t; v < n; v += G) {
				float x[VEC];
				unpack<T>(cur[v], x);
#pragma unroll
				for (int i = 0; i < VEC; i++) {
					const float d = x[i] - mean;
					q[0] += d * d;
				}
			}
			group_reduce<SumOp<1>>(q, G, 1, sm, parity);
			parity ^= 1;
			var = q[0] * p.inv_cols;
		}
		const float rstd = rsqrtf(var + p.eps);
		uint4 *out = reinterpret_cast<uint4 *>(static_cast<T *>(p.y) + row * p.cols);
#pragma unroll 2
		for (int v = t; v < n; v += G) {
			float x[VEC];
			unpack<T>(cur[v], x);
			write_vector<T, W>(p, out, v, x, mean, rstd);
		}
		if (t == 0 && p.mean)
			p.mean[row] = mean;
		if (t == 0 && p.rstd)
			p.rstd[row] = rstd;
		st = st + 1 == S ? 0 : st + 1;
	}
}

/* Resident blocks of kern with `threads` threads and `smem` bytes, asked once. */
template <auto kern> static int resident_smem_blocks(int threads, size_t smem)
{
	static int cached_threads, cached_n;
	static size_t cached_smem;
	int n = 0;
	if (__atomic_load_n(&cached_threads, __ATOMIC_ACQUIRE) == threads &&
	    __atomic_load_n(&cached_smem, __ATOMIC_RELAXED) == smem)
		return __atomic_load_n(&cached_n, __ATOMIC_RELAXED);
	if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, threads, smem) != cudaSuccess ||
	    n < 1) {
		(void)cudaGetLastError();
		n = 1;
	}
	__atomic_store_n(&cached_n, n, __ATOMIC_RELAXED);
	__atomic_store_n(&cached_smem, smem, __ATOMIC_RELAXED);
	__atomic_store_n(&cached_threads, threads, __ATOMIC_RELEASE);
	return n;
}

} /* namespace */

int launch_fwd_smem(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		    cudaStream_t stream)
{
	Params p = params_of(a);
	p.G = s.threads;
	p.K = 1;
	p.R = 1;
	p.iters = a->rows;
	const size_t smem = smem_stage_bytes(a, s, dev);
	p.stages = (int)(smem / ((size_t)a->cols * nk_dtype_size(a->dtype))); /* 2 or 3 */
	return with_types(a->dtype, a->weight_dtype, [&](auto tt, auto wt) {
		using T = decltype(tt);
		using W = decltype(wt);
		p.nvec = (int)(a->cols / (16 / sizeof(T)));
		auto launch = [&](auto ln) {
			constexpr auto kern = fwd_smem<T, W, decltype(ln)::value != 0>;
			cudaError_t err = allow_smem<kern>(dev, smem);
			if (err != cudaSuccess)
				return set_error(err, "block_smem forward shared memory");
			int64_t grid =
			    (int64_t)dev->sm_count * resident_smem_blocks<kern>(s.threads, smem);
			if (grid > a->rows)
				grid = a->rows;
			err = launch_kernel(kern, grid, s.threads, 1, stream, p, smem);
			return err == cudaSuccess ? (int)NK_OK
						  : set_error(err, "block_smem forward launch");
		};
		return (p.f & F_LN) ? launch(Int<1>()) : launch(Int<0>());
	});
}

int launch_fwd_tiled(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		     cudaStream_t stream)
{
	Params p = params_of(a, s);
	return with_types(a->dtype, a->weight_dtype, [&](auto tt, auto wt) {
		using T = decltype(tt);
		using W = decltype(wt);
		constexpr int VEC = 16 / sizeof(T);
		p.nvec = (int)(a->cols / VEC);
		return with_nv<FWD_MAX_ELEMS, VEC>(s.NV, [&](auto nv) {
			constexpr int NV = decltype(nv)::value;
			/*
			 * 16-bit rows of at most a warp's lanes that fill every
			 * thread's vectors skip the bounds checks: 0.5-1.4 points
			 * at bf16 LayerNorm 512 and 1024 columns. Not for wider
			 * rows (measured no faster) nor fp32 data or weights (the
			 * unchecked kernels spill registers there).
			 */
			if constexpr (sizeof(T) == 2 && sizeof(W) == 2) {
				if (p.G <= 32 && p.K == 1 && p.nvec == NV * p.G)
					return run<T, W, NV, true>(p, dev, s, stream);
			}
			return run<T, W, NV, false>(p, dev, s, stream);
		});
	});
}

} /* namespace nkc */
