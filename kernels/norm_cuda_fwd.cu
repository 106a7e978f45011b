/*
 * LayerNorm and RMSNorm forward, tiled family (norm_cuda_internal.cuh).
 *
 * A group of G threads owns a row; thread t of the group holds vectors
 * (j * K + rank) * G + t, j < NV, of the row in registers (16-byte loads that
 * do not allocate in L1), so x is read from device memory exactly once.
 * LayerNorm statistics are one pass of sum(x) and sum(x * x) where that is
 * about as accurate as two (mean^2 <= variance, checked per warp or
 * block), else two passes over the registers (mean, then squared
 * deviations), or, on a cluster, merged (count, mean, M2) triples
 * (row_stats); RMSNorm reduces the sum of squares. The grid holds every
 * row group, or (a variant's units_cap) a few waves of them whose blocks
 * loop over rows; at most 64 registers a thread keep 32 warps a
 * multiprocessor resident, whose loads are what keeps device memory busy
 * (fwd_tiled).
 * The weight is offset + gamma (the weight-offset variant; offset 0 for
 * the plain norm). The norm variants of docs/VARIANTS.md run on instances
 * of their own (Var): FP8 output, one instance a format, on the plain
 * kernel's occupancy; the residual add (x and residual loaded together, s
 * stored before the statistics) on one block of 128 registers a
 * multiprocessor.
 *
 * Built by `make` (nvcc -O3, sm_80 and sm_90 machine code plus compute_90
 * PTX); fwd_tiled is instantiated for the five (x, weight) dtype pairs, NV
 * in {1, 2, 4, 8} with NV * VEC <= 32 elements a thread, LayerNorm and
 * RMSNorm, plus a FULL twin without bounds checks for the 16-bit pairs,
 * plus the three variant instances (NV <= 4); block_smem once for LayerNorm
 * and once for RMSNorm. Timed by
 * bench/bench_norm.c with CUDA events against the device's copy
 * bandwidth.
 */
#include "kernels/norm_cuda_internal.cuh"

namespace nkc
{
namespace
{

/*
 * Whether this device code may run in a cluster (sm_90). sm_80 code never
 * does: tiled_fits refuses K > 1 below compute capability 9.
 */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool HAS_CLUSTERS = false;
#else
constexpr bool HAS_CLUSTERS = true;
#endif

/*
 * Which norm variants a forward instance runs (docs/VARIANTS.md): none;
 * FP8 output in e4m3 or in e5m2 (an instance a format: choosing it at run
 * time costs registers these kernels do not have); or the residual add,
 * with or without FP8 output, whose second row of loads wants the
 * registers of one block a multiprocessor (the others keep the plain
 * kernel's two, whose warps keep more loads in flight). Every instance
 * runs the weight offset.
 */
enum Var { VAR_NONE, VAR_E4M3, VAR_E5M2, VAR_ADD };

/*
 * Which weights a forward instance reads: as the job's flags say, with the
 * weight offset (WEIGHTS_ANY); or gamma, and beta for LayerNorm, with no
 * offset (WEIGHTS_AFFINE), the common job, whose write pass then holds no
 * default weights and no offset add (an instruction or two an element).
 */
enum Weights { WEIGHTS_ANY, WEIGHTS_AFFINE };

/*
 * The vectors of a row a thread owns: j-th at first + j * step (first =
 * rank * G + t, step = K * G), fewer than nvec unless the row is short.
 */
struct Owned {
	int first;
	int step;
	__device__ __forceinline__ int at(int j) const
	{
		return first + j * step;
	}
};

/* Whether the j-th vector a thread owns is inside the row (FULL: always). */
template <bool FULL> __device__ __forceinline__ bool has_vector(const Params &p, Owned o, int j)
{
	return FULL || o.at(j) < p.nvec;
}

/* Loads the NV vectors of one row a thread owns; missing ones are zero. */
template <typename T, int NV, bool FULL>
__device__ __forceinline__ void load_row(const Params &p, int64_t row, bool valid, Owned o,
					 uint4 *out)
{
	const uint4 *base = reinterpret_cast<const uint4 *>(static_cast<const T *>(p.x) +
							    (valid ? row : 0) * p.cols);
#pragma unroll
	for (int j = 0; j < NV; j++) {
		out[j] = make_uint4(0, 0, 0, 0);
		if (valid && has_vector<FULL>(p, o, j))
			out[j] = load_stream(base + o.at(j));
	}
}

/*
 * The residual add: loads the NV vectors of x and of the residual a thread
 * owns, makes them s = x + residual rounded once, stores s to residual_out
 * and leaves it in `out` for the norm (missing vectors stay zero). Every
 * element is read before any is written, by the thread that owns it, so
 * residual_out may be residual and y may be x (docs/VARIANTS.md).
 */
template <typename T, int NV>
__device__ __forceinline__ void load_residual_row(const Params &p, int64_t row, bool valid,
						  Owned o, uint4 *out)
{
	constexpr int VEC = 16 / sizeof(T);
	const int64_t off = (valid ? row : 0) * p.cols;
	const uint4 *bx = reinterpret_cast<const uint4 *>(static_cast<const T *>(p.x) + off);
	const uint4 *br = reinterpret_cast<const uint4 *>(static_cast<const T *>(p.residual) + off);
	uint4 r[NV];
#pragma unroll
	for (int j = 0; j < NV; j++) {
		out[j] = r[j] = make_uint4(0, 0, 0, 0);
		if (valid && has_vector<false>(p, o, j)) {
			out[j] = load_stream(bx + o.at(j));
			r[j] = load_stream(br + o.at(j));
		}
	}
	uint4 *so = reinterpret_cast<uint4 *>(static_cast<T *>(p.residual_out) + off);
#pragma unroll
	for (int j = 0; j < NV; j++) {
		if (valid && has_vector<false>(p, o, j)) {
			float a[VEC], b[VEC];
			unpack<T>(out[j], a);
			unpack<T>(r[j], b);
#pragma unroll
			for (int i = 0; i < VEC; i++)
				a[i] += b[i];
			out[j] = pack<T>(a);
			__stcs(so + o.at(j), out[j]);
		}
	}
}

/*
 * The sum over a thread's vectors of (x - m)^2: with m = 0 the sum of
 * squares. Vectors outside the row are skipped.
 */
template <typename T, int NV, bool FULL>
__device__ __forceinline__ float squared_deviations(const Params &p, const uint4 *v, Owned o,
						    float m)
{
	constexpr int VEC = 16 / sizeof(T);
	float q = 0.0f;
#pragma unroll
	for (int j = 0; j < NV; j++) {
		float x[VEC];
		unpack<T>(v[j], x);
		if (has_vector<FULL>(p, o, j)) {
#pragma unroll
			for (int i = 0; i < VEC; i++)
				q += (x[i] - m) * (x[i] - m);
		}
	}
	return q;
}

/* The sum of a thread's elements, and (sum_sq) of their squares. */
template <typename T, int NV>
__device__ __forceinline__ float element_sum(const uint4 *v, float *sum_sq)
{
	constexpr int VEC = 16 / sizeof(T);
	float s = 0.0f, q = 0.0f;
#pragma unroll
	for (int j = 0; j < NV; j++) {
		float x[VEC];
		unpack<T>(v[j], x);
#pragma unroll
		for (int i = 0; i < VEC; i++) {
			s += x[i];
			q += x[i] * x[i];
		}
	}
	*sum_sq = q;
	return s;
}

/*
 * The statistics of a row, reduced over its row group, from the packed
 * vectors `v` (unpacked again for each pass: cheaper than keeping the
 * floats live, which costs registers, hence occupancy). `parity` flips with
 * every reduction (see group_reduce). LayerNorm takes one pass of sum(x)
 * and sum(x * x) where its variance is within a bit or two of two passes'
 * (mean^2 <= variance, and finite: bf16 values near 1e18 overflow the
 * squares); where any row of the warp (rows of a warp) or the block (block
 * rows) is not such a row, they all add the second pass over squared
 * deviations (the choice must be uniform where the reductions span rows).
 * So a row's rstd may round differently next to such a row than next to
 * ordinary ones: deterministic for the same rows, not independent of its
 * neighbours. A cluster merges (count, mean, M2) triples with Chan's
 * formula instead (its barriers cost more). RMSNorm reduces the sum of
 * squares.
 */
template <typename T, int NV, bool FULL, bool LN>
__device__ __forceinline__ void row_stats(const Params &p, const uint4 *v, Owned o, RedSmem &sm,
					  int &parity, float *mean, float *rstd)
{
	constexpr int VEC = 16 / sizeof(T);
	/* One block a row: reductions with K = 1 known here (FULL rows never are a cluster's). */
	const bool one_block = FULL || !HAS_CLUSTERS || p.K == 1;
	if (!LN) {
		float q[1] = {squared_deviations<T, NV, FULL>(p, v, o, 0.0f)};
		if (one_block)
			group_reduce<SumOp<1>>(q, p.G, 1, sm, parity);
		else
			group_reduce<SumOp<1>>(q, p.G, p.K, sm, parity);
		parity ^= 1;
		*mean = 0.0f;
		*rstd = rsqrtf(q[0] * p.inv_cols + p.eps);
		return;
	}
	if (one_block) {
		float s[2];
		s[0] = element_sum<T, NV>(v, &s[1]); /* vectors outside the row are zeros */
		group_reduce<SumOp<2>>(s, p.G, 1, sm, parity);
		parity ^= 1;
		const float m = s[0] * p.inv_cols, var = s[1] * p.inv_cols - m * m;
		const bool exact = isfinite(var) && m * m <= var;
		const bool all_exact =
		    p.G > 32 ? __syncthreads_and(exact) : __all_sync(0xffffffffu, exact);
		*mean = m;
		if (all_exact) {
			*rstd = rsqrtf(var + p.eps);
			return;
		}
		float q[1] = {squared_deviations<T, NV, FULL>(p, v, o, m)};
		group_reduce<SumOp<1>>(q, p.G, 1, sm, parity);
		parity ^= 1;
		*rstd = rsqrtf(q[0] * p.inv_cols + p.eps);
		return;
	}
	float w[3] = {0.0f, 0.0f, 0.0f}; /* count, mean, M2 of this thread's part */
#pragma unroll
	for (int j = 0; j < NV; j++) {
		float x[VEC];
		unpack<T>(v[j], x);
		if (has_vector<FULL>(p, o, j)) {
			w[0] += (float)VEC;
#pragma unroll
			for (int i = 0; i < VEC; i++)
				w[1] += x[i];
		}
	}
	if (w[0] > 0.0f)
		w[1] = __fdividef(w[1], w[0]);
	w[2] = squared_deviations<T, NV, FULL>(p, v, o, w[1]);
	group_reduce<WelfordOp>(w, p.G, p.K, sm, parity);
	parity ^= 1;
	*mean = w[1];
	*rstd = rsqrtf(w[2] * p.inv_cols + p.eps);
}

/*
 * y of vector `v` of a row (its x in `x`), rounded once and streamed to
 * `out`; the weight is offset + gamma in fp32 (the weight-offset variant,
 * which every forward instance runs). FMT (an FP8 format, VAR kernels
 * only): y goes to `out8` as saturate(RNE(y * scale)) FP8 bytes, |y|
 * folded into *amax. WTS: the weights as the job's flags say, or known
 * affine (Weights); LN matters only then (whether beta is read).
 */
template <typename T, typename W, int FMT = NK_FP8_NONE, int WTS = WEIGHTS_ANY, bool LN = true>
__device__ __forceinline__ void write_vector(const Params &p, uint4 *out, int v,
					     const float *x, float mean, float rstd,
					     uint8_t *out8 = nullptr, float scale = 1.0f,
					     float *amax = nullptr)
{
	constexpr int VEC = 16 / sizeof(T);
	float g[VEC], b[VEC], y[VEC];
	if (WTS == WEIGHTS_AFFINE) {
		load_weights<VEC>(static_cast<const W *>(p.gamma) + v * VEC, g);
	} else if (p.f & F_GAMMA) {
		load_weights<VEC>(static_cast<const W *>(p.gamma) + v * VEC, g);
		add_offset<VEC>(p, g);
	} else {
#pragma unroll
		for (int i = 0; i < VEC; i++)
			g[i] = 1.0f;
	}
	if (WTS == WEIGHTS_AFFINE ? LN : (p.f & F_BETA) != 0) {
		load_weights<VEC>(static_cast<const W *>(p.beta) + v * VEC, b);
	} else {
#pragma unroll
		for (int i = 0; i < VEC; i++)
			b[i] = 0.0f;
	}
#pragma unroll
	for (int i = 0; i < VEC; i++)
		y[i] = (x[i] - mean) * rstd * g[i] + b[i];
	if constexpr (FMT != NK_FP8_NONE) {
		union {
			__nv_fp8x2_storage_t h[VEC / 2];
			unsigned u[VEC / 4];
		} q;
#pragma unroll
		for (int i = 0; i < VEC; i += 2) {
			*amax = fmaxf(*amax, fmaxf(fabsf(y[i]), fabsf(y[i + 1]))); /* skips NaN */
			q.h[i / 2] = to_fp8x2<FMT>(y[i] * scale, y[i + 1] * scale);
		}
		if constexpr (VEC == 8)
			__stcs(reinterpret_cast<uint2 *>(out8) + v, make_uint2(q.u[0], q.u[1]));
		else
			__stcs(reinterpret_cast<unsigned *>(out8) + v, q.u[0]);
		return;
	}
	__stcs(out + v, pack<T>(y));
}

/* y of the NV vectors a thread owns (packed in `v`); FMT, WTS, LN: write_vector's. */
template <typename T, typename W, int NV, bool FULL, int FMT, int WTS, bool LN>
__device__ __forceinline__ void write_row(const Params &p, int64_t row, const uint4 *v, Owned o,
					  float mean, float rstd, float scale, float *amax)
{
	constexpr int VEC = 16 / sizeof(T);
	uint4 *out = reinterpret_cast<uint4 *>(static_cast<T *>(p.y) + row * p.cols);
	uint8_t *out8 = FMT ? static_cast<uint8_t *>(p.y) + row * p.cols : nullptr;
#pragma unroll
	for (int j = 0; j < NV; j++) {
		if (has_vector<FULL>(p, o, j)) {
			float x[VEC];
			unpack<T>(v[j], x);
			write_vector<T, W, FMT, WTS, LN>(p, out, o.at(j), x, mean, rstd, out8, scale,
							  amax);
		}
	}
}

/*
 * Folds the block's largest |y| into *p.amax: one atomic a block at most,
 * none where the block's maximum does not raise it (non-negative floats
 * order as their bits do).
 */
__device__ __forceinline__ void block_amax(const Params &p, float m)
{
	__shared__ float warp_max[MAX_THREADS / 32];
#pragma unroll
	for (int off = 16; off > 0; off >>= 1)
		m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
	if ((threadIdx.x & 31) == 0)
		warp_max[threadIdx.x >> 5] = m;
	__syncthreads();
	if (threadIdx.x == 0) {
		for (int w = 1; w < (int)(blockDim.x >> 5); w++)
			m = fmaxf(m, warp_max[w]);
		if (m > *reinterpret_cast<volatile float *>(p.amax))
			atomicMax(reinterpret_cast<int *>(p.amax), __float_as_int(m));
	}
}

/*
 * One row group (R rows of G threads, or a row of K blocks) a block at a
 * time, and a grid of every row group: a block loads its rows, reduces and
 * writes them, and the hardware starts the next block in its place. At
 * most 64 registers a thread (two blocks of 512 threads, four of 256, a
 * multiprocessor), so 32 warps a multiprocessor keep their loads in
 * flight: that beat a persistent grid of the same kernel for plain rows
 * of one block, and a persistent kernel that loaded the next row while
 * reducing this one (BENCHMARKS.md, tiled forward: the kernel). Where the
 * rules give a grid of a few waves (FP8 output, variant rows from 8193
 * columns, rows on clusters), each block loops over rows, paying its setup
 * once for several (tiled forward: persistent grids).
 */
template <typename T, typename W, int NV, bool FULL, bool LN, int VAR, int FMT, int WTS>
__device__ __forceinline__ void tiled_rows(const Params &p, RedSmem &sm)
{
	const int g = row_group(p), t = threadIdx.x - g * p.G;
	const GridPlace place = grid_place(p.K);
	const int rank = place.rank;
	const Owned o = {rank * p.G + t, p.K * p.G};
	const float scale = FMT != NK_FP8_NONE ? *p.scale : 1.0f;
	float amax = 0.0f;
	int parity = 0;

	for (int64_t it = place.first; it < p.iters; it += place.stride) {
		const int64_t row = it * p.R + g;
		const bool valid = row < p.rows;
		uint4 v[NV];
		float mean, rstd;

		if (VAR == VAR_ADD)
			load_residual_row<T, NV>(p, row, valid, o, v);
		else
			load_row<T, NV, FULL>(p, row, valid, o, v);
		row_stats<T, NV, FULL, LN>(p, v, o, sm, parity, &mean, &rstd);
		if (valid) {
			write_row<T, W, NV, FULL, FMT, WTS, LN>(p, row, v, o, mean, rstd, scale,
							       &amax);
			if (t == 0 && rank == 0 && p.mean)
				p.mean[row] = mean;
			if (t == 0 && rank == 0 && p.rstd)
				p.rstd[row] = rstd;
		}
	}
	if (FMT != NK_FP8_NONE && p.amax)
		block_amax(p, amax);
	cluster_done(p.K);
}

/* tiled_rows in the instance's output format (VAR_ADD: the job's) and weights. */
template <typename T, typename W, int NV, bool FULL, bool LN, int VAR, int WTS>
__device__ __forceinline__ void tiled_format(const Params &p, RedSmem &sm)
{
	if constexpr (VAR == VAR_E4M3) {
		tiled_rows<T, W, NV, FULL, LN, VAR, NK_FP8_E4M3, WTS>(p, sm);
	} else if constexpr (VAR == VAR_E5M2) {
		tiled_rows<T, W, NV, FULL, LN, VAR, NK_FP8_E5M2, WTS>(p, sm);
	} else if constexpr (VAR == VAR_ADD) {
		if (!(p.f & F_FP8))
			tiled_rows<T, W, NV, FULL, LN, VAR, NK_FP8_NONE, WTS>(p, sm);
		else if (p.fp8 == NK_FP8_E4M3)
			tiled_rows<T, W, NV, FULL, LN, VAR, NK_FP8_E4M3, WTS>(p, sm);
		else
			tiled_rows<T, W, NV, FULL, LN, VAR, NK_FP8_E5M2, WTS>(p, sm);
	} else {
		tiled_rows<T, W, NV, FULL, LN, VAR, NK_FP8_NONE, WTS>(p, sm);
	}
}

template <typename T, typename W, int NV, bool FULL, bool LN, int VAR>
__global__ void __launch_bounds__(MAX_THREADS, VAR == VAR_ADD ? 1 : 2) fwd_tiled(const Params p)
{
	__shared__ RedSmem sm;
	/* 16-bit data only: fp32 rows are less bound by instructions, and spilled there. */
	if constexpr (sizeof(T) == 2) {
		const unsigned affine = LN ? F_GAMMA | F_BETA : F_GAMMA;
		if ((p.f & affine) == affine && p.offset == 0.0f) {
			tiled_format<T, W, NV, FULL, LN, VAR, WEIGHTS_AFFINE>(p, sm);
			return;
		}
	}
	tiled_format<T, W, NV, FULL, LN, VAR, WEIGHTS_ANY>(p, sm);
}

/* Most blocks a forward grid has (a 1-D grid allows 2^31 - 1); the kernel strides past them. */
constexpr int64_t FWD_MAX_GRID = (int64_t)1 << 30;

template <typename T, typename W, int NV, bool FULL, int VAR = VAR_NONE>
int run(const Params &p, const Shape &s, cudaStream_t stream)
{
	int64_t units = p.iters;

	if (units > FWD_MAX_GRID / s.K)
		units = FWD_MAX_GRID / s.K;
	if (s.units_cap > 0 && units > s.units_cap) /* a persistent grid: blocks loop over rows */
		units = s.units_cap;
	constexpr auto ln = fwd_tiled<T, W, NV, FULL, true, VAR>;
	constexpr auto rms = fwd_tiled<T, W, NV, FULL, false, VAR>;
	const int64_t grid = units * s.K;
	cudaError_t err = (p.f & F_LN) ? launch_kernel(ln, grid, s.threads, s.K, stream, p)
				       : launch_kernel(rms, grid, s.threads, s.K, stream, p);
	return err == cudaSuccess ? NK_OK : set_error(err, "forward kernel launch");
}

/* A job with the residual add or FP8 output: the variant instances (tiled_fits caps NV). */
template <typename T, typename W, int NV>
int run_variants(const Params &p, const Shape &s, cudaStream_t stream)
{
	if constexpr (NV > FWD_VAR_MAX_NV) {
		return NK_EUNSUPPORTED;
	} else {
		if ((p.f & F_FP8) && p.amax &&
		    cudaMemsetAsync(p.amax, 0, sizeof(float), stream) != cudaSuccess)
			return set_error(cudaGetLastError(), "amax reset");
		if (p.f & F_RESIDUAL)
			return run<T, W, NV, false, VAR_ADD>(p, s, stream);
		if (p.fp8 == NK_FP8_E4M3)
			return run<T, W, NV, false, VAR_E4M3>(p, s, stream);
		return run<T, W, NV, false, VAR_E5M2>(p, s, stream);
	}
}

/*
 * block_smem forward: a block owns whole rows, one at a time (persistent
 * over rows), for rows too wide for a block's registers. The row is staged
 * in shared memory by cp.async, p.stages (2 or 3, smem_stage_bytes) deep:
 * the next rows are in flight while this one is reduced and written;
 * thread t copies and reads back vectors t, t + G, ..., so the stages need
 * no barrier. LayerNorm reduces sum(x) and sum(x * x) in one pass where
 * mean^2 <= variance (faster than two), else adds the two-pass reduction
 * of squared deviations; RMSNorm takes one. At most 40 registers (as many
 * as 4 blocks of 384 threads leave; more ran slower), any block size up to
 * SMEM_FWD_MAX_THREADS (BENCHMARKS.md, block_smem forward: registers and
 * one pass).
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
	(void)dev; /* the grid (every row group, or the variant's cap) never depends on the device */
	return with_types(a->dtype, a->weight_dtype, [&](auto tt, auto wt) {
		using T = decltype(tt);
		using W = decltype(wt);
		constexpr int VEC = 16 / sizeof(T);
		p.nvec = (int)(a->cols / VEC);
		return with_nv<FWD_MAX_ELEMS, VEC>(s.NV, [&](auto nv) {
			constexpr int NV = decltype(nv)::value;
			if (nk_norm_features(a) & ~NK_FEATURE_WEIGHT_OFFSET) /* residual, FP8 */
				return run_variants<T, W, NV>(p, s, stream);
			/*
			 * 16-bit rows of at most a warp's lanes that fill every
			 * thread's vectors skip the bounds checks, which ran
			 * faster; not wider rows (no faster) nor fp32 data or
			 * weights (the unchecked kernels spill registers there;
			 * BENCHMARKS.md, tiled forward: rows without bounds checks).
			 */
			if constexpr (sizeof(T) == 2 && sizeof(W) == 2) {
				if (p.G <= 32 && p.K == 1 && p.nvec == NV * p.G)
					return run<T, W, NV, true>(p, s, stream);
			}
			return run<T, W, NV, false>(p, s, stream);
		});
	});
}

} /* namespace nkc */
