/*
 * LayerNorm and RMSNorm backward, tiled family (norm_cuda_internal.cuh).
 *
 * With g = dy * gamma and xh = x_hat, one pass over a row computes
 *   LN:  dx = rstd * (g - mean(g) - xh * mean(g * xh))
 *   RMS: dx = rstd * (g - xh * mean(g * xh))
 * from x (or, memory-efficient, y: xh = (y - beta) * rg, rg = 1 / clamp(gamma)
 * computed once per job by launch_reciprocal_gamma) and dy, both read from
 * device memory once into registers (the next row's loads are issued before
 * this row's reduction). After the reduction, xh and g are recomputed from
 * the registers rather than kept (launder()), which keeps the kernel within
 * 128 registers. Each thread also sums dy * xh and dy over the rows it sees
 * in fp32 registers; at the end every row group writes them as one partial
 * row to the workspace, and launch_finish() (norm_cuda_generic.cu) sums the
 * partial rows in a fixed order. The grid has min(row groups, units_cap)
 * groups, a rule of the shape and the variant alone, so dgamma/dbeta do not
 * depend on the device or on timing.
 *
 * The residual add's backward adds ds to dx as dx is stored (bwd_tiled's
 * DS instances); the weight offset is added to gamma wherever it is read.
 * The common job (see common_job) runs bwd_common instead, the same
 * computation with the run-time flags it does not need compiled out.
 *
 * Rows wider than a block either run on a cluster of K blocks (sm_90), the
 * row sums exchanged through distributed shared memory, or split
 * (F_PRESUMS): bwd_row_sums computes sum(g) and sum(g * xh) of every row
 * first, and K independent blocks then each own a column slice.
 *
 * Built by `make` (nvcc -O3, sm_80 and sm_90 machine code plus compute_90
 * PTX); instantiated for the five (x, weight) dtype pairs and NV in
 * {1, 2} (more vectors a thread spill registers). Timed by
 * bench/bench_norm.c with CUDA events against the device's copy bandwidth.
 */
#include "kernels/norm_cuda_internal.cuh"

namespace nkc
{
namespace
{

/* Loads the NV vectors of x (or y) and dy of one row; missing ones are zero. */
template <typename T, int NV>
__device__ __forceinline__ void load_row(const Params &p, int64_t row, bool valid, const int *vi,
					 uint4 *x, uint4 *dy)
{
	const int64_t off = (valid ? row : 0) * p.cols;
	const uint4 *bx = reinterpret_cast<const uint4 *>(static_cast<const T *>(p.x) + off);
	const uint4 *bd = reinterpret_cast<const uint4 *>(static_cast<const T *>(p.dy) + off);
#pragma unroll
	for (int j = 0; j < NV; j++) {
		x[j] = make_uint4(0, 0, 0, 0);
		dy[j] = make_uint4(0, 0, 0, 0);
		if (valid && vi[j] < p.nvec) {
			x[j] = load_stream(bx + vi[j]);
			dy[j] = load_stream(bd + vi[j]);
		}
	}
}

/* Loads the NV vectors of ds of one row (the residual add's backward); missing ones are zero. */
template <typename T, int NV>
__device__ __forceinline__ void load_ds(const Params &p, int64_t row, bool valid, const int *vi,
					uint4 *ds)
{
	const uint4 *b = reinterpret_cast<const uint4 *>(static_cast<const T *>(p.ds) +
							 (valid ? row : 0) * p.cols);
#pragma unroll
	for (int j = 0; j < NV; j++) {
		ds[j] = make_uint4(0, 0, 0, 0);
		if (valid && vi[j] < p.nvec)
			ds[j] = load_stream(b + vi[j]);
	}
}

/* Per-row scalars: rstd and (standard LayerNorm) mean. */
struct RowStats {
	float mean;
	float rstd;
	float s0, s1; /* split backward: the row's sum(g), sum(g * xh) */
};

__device__ __forceinline__ RowStats load_stats(const Params &p, int64_t row, bool valid)
{
	RowStats r = {0.0f, 0.0f, 0.0f, 0.0f};
	if (valid) {
		r.rstd = p.rstd[row];
		if ((p.f & F_LN) && !(p.f & F_MEMEFF))
			r.mean = p.mean[row];
		if (p.f & F_PRESUMS) {
			r.s0 = p.sums[2 * row];
			r.s1 = p.sums[2 * row + 1];
		}
	}
	return r;
}

/*
 * Memory-efficient tiled backward stages the weights of the thread's fixed
 * columns in shared memory once per block, as floats: gamma, beta and rg,
 * each as VEC / 4 planes of float4 indexed by slot (j * G + t), so a warp
 * reads 16 contiguous bytes a thread. Read from L1 instead, the three
 * weights of both passes cost more L1 bandwidth than the rows themselves.
 */
struct Staged {
	const float4 *w; /* NULL: weights come from device memory */
	int slot;	 /* this thread's vector j: j * G + t */
	int slots;	 /* NV * G */
};

template <int VEC> __device__ __forceinline__ void read_staged(const Staged &sw, int kind, float *f)
{
	constexpr int H = VEC / 4;
#pragma unroll
	for (int h = 0; h < H; h++) {
		const float4 v = sw.w[(kind * H + h) * sw.slots + sw.slot];
		f[4 * h] = v.x;
		f[4 * h + 1] = v.y;
		f[4 * h + 2] = v.z;
		f[4 * h + 3] = v.w;
	}
}

/* Fills the staged weights of the block's slots (the vectors its rank owns). */
template <typename T, typename W, int NV>
__device__ __forceinline__ void stage_weights(const Params &p, int rank, float4 *w)
{
	constexpr int VEC = 16 / sizeof(T), H = VEC / 4;
	const int slots = NV * p.G;
	for (int sl = threadIdx.x; sl < slots; sl += blockDim.x) {
		const int v = (sl / p.G * p.K + rank) * p.G + sl % p.G;
		float f[3][VEC];
#pragma unroll
		for (int i = 0; i < VEC; i++) {
			f[0][i] = 1.0f;
			f[1][i] = 0.0f;
			f[2][i] = 0.0f;
		}
		if (v < p.nvec) {
			if (p.f & F_GAMMA) {
				load_weights<VEC>(static_cast<const W *>(p.gamma) + v * VEC, f[0]);
				add_offset<VEC>(p, f[0]);
			}
			if (p.f & F_BETA)
				load_weights<VEC>(static_cast<const W *>(p.beta) + v * VEC, f[1]);
			load_weights<VEC>(p.rg + v * VEC, f[2]);
		}
#pragma unroll
		for (int k = 0; k < 3; k++) {
#pragma unroll
			for (int h = 0; h < H; h++)
				w[(k * H + h) * slots + sl] = make_float4(
				    f[k][4 * h], f[k][4 * h + 1], f[k][4 * h + 2], f[k][4 * h + 3]);
		}
	}
	__syncthreads();
}

/* Shared memory of the staged weights (memory-efficient tiled backward). */
template <typename T> static size_t staged_weight_bytes(int nv, int G)
{
	return (size_t)3 * (16 / sizeof(T)) * sizeof(float) * (size_t)nv * (size_t)G;
}

/* Adds one vector's terms to the row sums: s[0] += sum(g), s[1] += sum(g * xh). */
template <int VEC>
__device__ __forceinline__ void add_row_sums(const float *xh, const float *g, float *s)
{
#pragma unroll
	for (int i = 0; i < VEC; i++) {
		s[0] += g[i];
		s[1] += g[i] * xh[i];
	}
}

/* Adds one vector's terms to the thread's dgamma (dy * xh) and dbeta (dy) partials. */
template <int VEC>
__device__ __forceinline__ void add_weight_grads(const float *xh, const float *dy, float *ag,
						 float *ab)
{
#pragma unroll
	for (int i = 0; i < VEC; i++) {
		ag[i] += dy[i] * xh[i];
		ab[i] += dy[i];
	}
}

/*
 * xh and g = dy * gamma of one vector. Vectors past the row end come in as
 * zeros and leave zeros (g = 0), so they add nothing to any sum.
 */
template <typename T, typename W>
__device__ __forceinline__ void vector_terms(const Params &p, uint4 xr, uint4 dyr, int col,
					     bool present, RowStats st, float *xh, float *dy,
					     float *g, const Staged &sw = Staged{nullptr, 0, 0})
{
	constexpr int VEC = 16 / sizeof(T);
	float x[VEC], gm[VEC], bt[VEC];
	unpack<T>(xr, x);
	unpack<T>(dyr, dy);
	if (sw.w) {
		/* Staged (memory-efficient only); absent vectors hold 1, 0, 0. */
		float rg[VEC];
		read_staged<VEC>(sw, 0, gm);
		read_staged<VEC>(sw, 1, bt);
		read_staged<VEC>(sw, 2, rg);
#pragma unroll
		for (int i = 0; i < VEC; i++) {
			xh[i] = (x[i] - bt[i]) * rg[i];
			g[i] = dy[i] * gm[i];
		}
		return;
	}
#pragma unroll
	for (int i = 0; i < VEC; i++) {
		gm[i] = 1.0f;
		bt[i] = 0.0f;
	}
	if (present && (p.f & F_GAMMA)) {
		load_weights<VEC>(static_cast<const W *>(p.gamma) + col, gm);
		add_offset<VEC>(p, gm);
	}
	if (p.f & F_MEMEFF) {
		float rg[VEC];
#pragma unroll
		for (int i = 0; i < VEC; i++)
			rg[i] = 0.0f;
		if (present && (p.f & F_BETA))
			load_weights<VEC>(static_cast<const W *>(p.beta) + col, bt);
		if (present)
			load_weights<VEC>(p.rg + col, rg);
#pragma unroll
		for (int i = 0; i < VEC; i++)
			xh[i] = (x[i] - bt[i]) * rg[i];
	} else {
#pragma unroll
		for (int i = 0; i < VEC; i++)
			xh[i] = (x[i] - st.mean) * st.rstd;
	}
#pragma unroll
	for (int i = 0; i < VEC; i++)
		g[i] = dy[i] * gm[i];
}

/*
 * sm_80 gets at most 256 threads a block (the variant rules keep to that):
 * with 512 its register file leaves too little for two vectors a thread.
 */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define BWD_LAUNCH_BOUNDS __launch_bounds__(BWD_MAX_THREADS_SM80, 1)
#else
#define BWD_LAUNCH_BOUNDS __launch_bounds__(MAX_THREADS, 1)
#endif

/*
 * DS: the residual add's backward, dx += ds. Threads of up to 8 elements
 * load the next row's ds with its x and dy, a row ahead of its use; wider
 * ones load it as they store dx (holding it longer spilled registers).
 */
template <typename T, typename W, int NV, bool SW, bool DS>
__global__ void BWD_LAUNCH_BOUNDS bwd_tiled(const Params p)
{
	constexpr int VEC = 16 / sizeof(T);
	constexpr int E = NV * VEC;
	constexpr bool DS_AHEAD = DS && E <= 8;
	__shared__ RedSmem sm;
	extern __shared__ float4 staged[]; /* SW: the weights, see Staged */
	const int g = threadIdx.x / p.G, t = threadIdx.x % p.G;
	const int rank = cluster_rank(p.K);
	const int64_t first = blockIdx.x / p.K, stride = gridDim.x / p.K;
	const int64_t iters = p.iters;
	const bool sums = p.f & (F_DGAMMA | F_DBETA);
	const bool presums = p.f & F_PRESUMS;
	int vi[NV];
	uint4 cx[NV], cd[NV], cs[DS_AHEAD ? NV : 1];
	float ag[E], ab[E];
	int parity = 0;

#pragma unroll
	for (int j = 0; j < NV; j++)
		vi[j] = (j * p.K + rank) * p.G + t;
#pragma unroll
	for (int e = 0; e < E; e++) {
		ag[e] = 0.0f;
		ab[e] = 0.0f;
	}
	if (SW)
		stage_weights<T, W, NV>(p, rank, staged);
	bool cvalid = first < iters && first * p.R + g < p.rows;
	load_row<T, NV>(p, first * p.R + g, cvalid, vi, cx, cd);
	if (DS_AHEAD)
		load_ds<T, NV>(p, first * p.R + g, cvalid, vi, cs);
	RowStats cst = load_stats(p, first * p.R + g, cvalid);
	for (int64_t it = first; it < iters; it += stride) {
		const int64_t row = it * p.R + g, next = (it + stride) * p.R + g;
		const bool valid = row < p.rows;
		const bool nvalid = it + stride < iters && next < p.rows;
		uint4 nx[NV], nd[NV], ns[DS_AHEAD ? NV : 1];
		float s[2] = {0.0f, 0.0f};

		load_row<T, NV>(p, next, nvalid, vi, nx, nd);
		if (DS_AHEAD)
			load_ds<T, NV>(p, next, nvalid, vi, ns);
		RowStats nst = load_stats(p, next, nvalid);
#pragma unroll
		for (int j = 0; j < NV && !presums; j++) {
			float xh[VEC], dy[VEC], gg[VEC];
			const Staged sw = {SW ? staged : nullptr, j * p.G + t, NV * p.G};
			vector_terms<T, W>(p, cx[j], cd[j], vi[j] * VEC, vi[j] < p.nvec, cst, xh,
					   dy, gg, sw);
			add_row_sums<VEC>(xh, gg, s);
			if (sums && valid && !presums) {
				add_weight_grads<VEC>(xh, dy, ag + j * VEC, ab + j * VEC);
			}
		}
		if (presums) {
			s[0] = cst.s0;
			s[1] = cst.s1;
		} else {
			group_reduce<SumOp<2>>(s, p.G, p.K, sm, parity);
		}
		const float m1 = (p.f & F_LN) ? s[0] * p.inv_cols : 0.0f, m2 = s[1] * p.inv_cols;
		uint4 *out = reinterpret_cast<uint4 *>(static_cast<T *>(p.dx) + row * p.cols);
		Params q = p; /* the same job, its weights reloaded rather than kept */
		q.gamma = launder(q.gamma);
		q.beta = launder(q.beta);
#pragma unroll
		for (int j = 0; j < NV; j++) {
			if (!valid || vi[j] >= p.nvec)
				continue;
			float xh[VEC], dy[VEC], gg[VEC], dx[VEC];
			const Staged sw = {SW ? staged : nullptr, j * p.G + t, NV * p.G};
			launder(cx[j]);
			launder(cd[j]);
			vector_terms<T, W>(q, cx[j], cd[j], vi[j] * VEC, true, cst, xh, dy, gg, sw);
#pragma unroll
			for (int i = 0; i < VEC; i++)
				dx[i] = cst.rstd * (gg[i] - m1 - xh[i] * m2);
			if (DS) {
				float ds[VEC];
				unpack<T>(DS_AHEAD ? cs[j]
						   : load_stream(reinterpret_cast<const uint4 *>(
								 static_cast<const T *>(p.ds) +
								 row * p.cols) +
							 vi[j]),
					  ds);
#pragma unroll
				for (int i = 0; i < VEC; i++)
					dx[i] += ds[i];
			}
			if (sums && presums) {
				add_weight_grads<VEC>(xh, dy, ag + j * VEC, ab + j * VEC);
			}
			__stcs(out + vi[j], pack<T>(dx));
		}
#pragma unroll
		for (int j = 0; j < NV; j++) {
			cx[j] = nx[j];
			cd[j] = nd[j];
			if (DS_AHEAD)
				cs[j] = ns[j];
		}
		cst = nst;
		parity ^= 1;
	}
	if (sums)
		write_partials<NV, VEC>(p, first * p.R + g, vi, ag, ab);
	if (!presums)
		cluster_done(p.K);
}

/*
 * The common job's backward: each row in one block (K = 1, not split),
 * dgamma wanted, and either standard (x) with gamma and no weight offset,
 * or memory-efficient RMSNorm (y) with the weights staged as bwd_tiled
 * stages them (ME): what a training step runs. (Memory-efficient
 * LayerNorm, which reads a third staged weight every vector, did not gain
 * at every width here and stays on bwd_tiled.) bwd_tiled serves every job
 * with run-time flags and pays for them in every element (defaults for
 * absent weights, the offset, the memory-efficient branch, the cluster
 * exchange, the copies of the prefetched row); here LayerNorm or RMSNorm
 * is known at compile time, and the row loop is unrolled by two over two
 * row buffers, the reduction's parity with it. The partial rows are bwd_tiled's, summed in the same
 * order, so dgamma and dbeta keep their bits.
 */
template <typename T, int NV, bool DS> struct CommonRow {
	static constexpr bool DS_AHEAD = DS && NV * 16 / sizeof(T) <= 8;
	uint4 x[NV], dy[NV], ds[DS_AHEAD ? NV : 1];
	float mean, rstd;
	bool valid;
};

template <typename T, int NV, bool DS, bool LN, bool ME>
__device__ __forceinline__ void load_common_row(const Params &p, int64_t it, int g, const int *vi,
						CommonRow<T, NV, DS> &r)
{
	const int64_t row = it * p.R + g;
	r.valid = it < p.iters && row < p.rows;
	load_row<T, NV>(p, row, r.valid, vi, r.x, r.dy);
	if constexpr (CommonRow<T, NV, DS>::DS_AHEAD)
		load_ds<T, NV>(p, row, r.valid, vi, r.ds);
	r.mean = LN && r.valid ? p.mean[row] : 0.0f;
	r.rstd = r.valid ? p.rstd[row] : 0.0f;
}

/*
 * x_hat and gamma of vector j: standard from x, the row's mean and rstd;
 * memory-efficient (RMSNorm) from y and the staged gamma and rg (its absent
 * vectors hold 1 and 0). Vectors past the row end hold zeros (dy = 0) and
 * read vector 0's weights.
 */
template <typename T, typename W, int NV, bool LN, bool ME>
__device__ __forceinline__ void common_terms(const Params &p, const W *gamma, const float4 *staged,
					     const int *vi, int j, const float *x, float mean,
					     float rstd, float *xh, float *gm)
{
	constexpr int VEC = 16 / sizeof(T);
	if constexpr (ME) {
		const Staged sw = {staged, vi[j], NV * p.G}; /* K = 1: slot j * G + t is vi[j] */
		float rg[VEC];
		read_staged<VEC>(sw, 0, gm);
		read_staged<VEC>(sw, 2, rg);
#pragma unroll
		for (int i = 0; i < VEC; i++)
			xh[i] = x[i] * rg[i];
	} else {
		load_weights<VEC>(gamma + (vi[j] < p.nvec ? vi[j] : 0) * VEC, gm);
#pragma unroll
		for (int i = 0; i < VEC; i++)
			xh[i] = (LN ? x[i] - mean : x[i]) * rstd;
	}
}

/* One row of bwd_common: its sums, their reduction, dx, the weight-gradient sums. */
template <typename T, typename W, int NV, bool DS, bool LN, bool ME, int PARITY>
__device__ __forceinline__ void common_row(const Params &p, int64_t it, int g, const int *vi,
					   CommonRow<T, NV, DS> &r, RedSmem &sm,
					   const float4 *staged, float *ag, float *ab)
{
	constexpr int VEC = 16 / sizeof(T);
	const W *gamma = static_cast<const W *>(p.gamma);
	float s[2] = {0.0f, 0.0f}; /* sum(g * xh), and for LayerNorm sum(g) */

#pragma unroll
	for (int j = 0; j < NV; j++) {
		float x[VEC], dy[VEC], gm[VEC], xh[VEC];
		unpack<T>(r.x[j], x);
		unpack<T>(r.dy[j], dy);
		common_terms<T, W, NV, LN, ME>(p, gamma, staged, vi, j, x, r.mean, r.rstd, xh, gm);
#pragma unroll
		for (int i = 0; i < VEC; i++) {
			const float gg = dy[i] * gm[i];
			s[0] += gg * xh[i];
			if (LN)
				s[1] += gg;
			ag[j * VEC + i] += dy[i] * xh[i];
			ab[j * VEC + i] += dy[i];
		}
	}
	group_reduce<SumOp<LN ? 2 : 1>>(s, p.G, 1, sm, PARITY);
	/*
	 * dx = rstd * (g - m1 - xh * m2): rstd * g + xh * k + c, the standard
	 * job's xh * k as (x - mean) * (rstd * k).
	 */
	const float k = -r.rstd * (s[0] * p.inv_cols) * (ME ? 1.0f : r.rstd);
	const float c = LN ? -r.rstd * (s[1] * p.inv_cols) : 0.0f;
	const int64_t row = it * p.R + g;
	uint4 *out = reinterpret_cast<uint4 *>(static_cast<T *>(p.dx) + row * p.cols);
	gamma = launder(gamma); /* reloaded (L1) rather than kept across the reduction */
#pragma unroll
	for (int j = 0; j < NV; j++) {
		if (!r.valid || vi[j] >= p.nvec)
			continue;
		float x[VEC], dy[VEC], gm[VEC], dx[VEC];
		launder(r.x[j]);
		launder(r.dy[j]);
		unpack<T>(r.x[j], x);
		unpack<T>(r.dy[j], dy);
		if constexpr (ME) {
			float xh[VEC];
			common_terms<T, W, NV, LN, ME>(p, gamma, staged, vi, j, x, 0.0f, 0.0f, xh,
						       gm);
#pragma unroll
			for (int i = 0; i < VEC; i++)
				dx[i] = fmaf(r.rstd, dy[i] * gm[i], fmaf(xh[i], k, c));
		} else {
			load_weights<VEC>(gamma + vi[j] * VEC, gm);
#pragma unroll
			for (int i = 0; i < VEC; i++)
				dx[i] = fmaf(r.rstd, dy[i] * gm[i],
					     LN ? fmaf(x[i] - r.mean, k, c) : x[i] * k);
		}
		if constexpr (DS) {
			float ds[VEC];
			unpack<T>(CommonRow<T, NV, DS>::DS_AHEAD
				      ? r.ds[j]
				      : load_stream(reinterpret_cast<const uint4 *>(
							static_cast<const T *>(p.ds) + row * p.cols) +
						    vi[j]),
				  ds);
#pragma unroll
			for (int i = 0; i < VEC; i++)
				dx[i] += ds[i];
		}
		__stcs(out + vi[j], pack<T>(dx));
	}
}

template <typename T, typename W, int NV, bool DS, bool LN, bool ME>
__global__ void BWD_LAUNCH_BOUNDS bwd_common(const Params p)
{
	static_assert(!(LN && ME), "memory-efficient LayerNorm runs bwd_tiled (common_job)");
	constexpr int E = NV * 16 / sizeof(T);
	__shared__ RedSmem sm;
	extern __shared__ float4 staged[]; /* ME: the weights, see Staged */
	const int g = row_group(p), t = threadIdx.x - g * p.G;
	const int64_t first = blockIdx.x, stride = gridDim.x;
	int vi[NV];
	float ag[E], ab[E];
	CommonRow<T, NV, DS> a, b;

#pragma unroll
	for (int j = 0; j < NV; j++)
		vi[j] = j * p.G + t;
#pragma unroll
	for (int e = 0; e < E; e++) {
		ag[e] = 0.0f;
		ab[e] = 0.0f;
	}
	if constexpr (ME)
		stage_weights<T, W, NV>(p, 0, staged);
	load_common_row<T, NV, DS, LN, ME>(p, first, g, vi, a);
	for (int64_t it = first; it < p.iters; it += 2 * stride) {
		load_common_row<T, NV, DS, LN, ME>(p, it + stride, g, vi, b);
		common_row<T, W, NV, DS, LN, ME, 0>(p, it, g, vi, a, sm, staged, ag, ab);
		if (it + stride >= p.iters)
			break;
		load_common_row<T, NV, DS, LN, ME>(p, it + 2 * stride, g, vi, a);
		common_row<T, W, NV, DS, LN, ME, 1>(p, it + stride, g, vi, b, sm, staged, ag, ab);
	}
	write_partials<NV, E / NV>(p, first * p.R + g, vi, ag, ab);
}

/*
 * Whether bwd_common runs a tiled job: one block a row, dgamma wanted, and
 * gamma without an offset (standard) or RMSNorm (memory-efficient, whose
 * staged weights carry the offset); bwd_tiled runs the rest.
 */
static bool common_job(const Params &p, const Shape &s)
{
	const bool weights = (p.f & F_MEMEFF) ? !(p.f & F_LN) : (p.f & F_GAMMA) && p.offset == 0.0f;
	return (p.f & F_DGAMMA) && !(p.f & F_PRESUMS) && weights && s.K == 1 && !s.split;
}

/* Launches bwd_common<T, W, NV, DS, LN, ME> with the job's DS, LN and ME. */
template <typename T, typename W, int NV>
cudaError_t launch_common(const Params &p, const struct nk_device_info *dev, int64_t grid,
			  int threads, cudaStream_t stream)
{
	const bool ds = p.f & F_RESIDUAL, ln = p.f & F_LN;
	if (!(p.f & F_MEMEFF))
		return launch_kernel(ds ? (ln ? bwd_common<T, W, NV, true, true, false>
					      : bwd_common<T, W, NV, true, false, false>)
					: (ln ? bwd_common<T, W, NV, false, true, false>
					      : bwd_common<T, W, NV, false, false, false>),
				     grid, threads, 1, stream, p);
	const size_t smem = staged_weight_bytes<T>(NV, p.G);
	return ds ? launch_with_smem<bwd_common<T, W, NV, true, false, true>>(dev, grid, threads, 1,
									     stream, p, smem)
		  : launch_with_smem<bwd_common<T, W, NV, false, false, true>>(dev, grid, threads, 1,
									      stream, p, smem);
}

/*
 * Split backward, first kernel: sum(g) and sum(g * xh) of whole rows, a
 * block a row, the row walked in chunks of NV vectors a thread; the tiled
 * kernel then runs on column slices with these sums (F_PRESUMS).
 */
template <typename T, typename W, int NV>
__global__ void __launch_bounds__(MAX_THREADS) bwd_row_sums(const Params p)
{
	constexpr int VEC = 16 / sizeof(T);
	__shared__ RedSmem sm;
	const int t = threadIdx.x, G = blockDim.x;
	int parity = 0;

	for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
		const RowStats st = load_stats(p, row, true);
		float s[2] = {0.0f, 0.0f};
		for (int base = 0; base < p.nvec; base += G * NV) {
			int vi[NV];
			uint4 x[NV], dy[NV];
#pragma unroll
			for (int j = 0; j < NV; j++)
				vi[j] = base + j * G + t;
			load_row<T, NV>(p, row, true, vi, x, dy);
#pragma unroll
			for (int j = 0; j < NV; j++) {
				float xh[VEC], d[VEC], gg[VEC];
				vector_terms<T, W>(p, x[j], dy[j], vi[j] * VEC, vi[j] < p.nvec, st,
						   xh, d, gg);
				add_row_sums<VEC>(xh, gg, s);
			}
		}
		group_reduce<SumOp<2>>(s, G, 1, sm, parity);
		parity ^= 1;
		if (t == 0) {
			p.sums[2 * row] = s[0];
			p.sums[2 * row + 1] = s[1];
		}
	}
}

template <typename T, typename W, int NV>
int run(const Params &p, const struct nk_device_info *dev, const Shape &s, cudaStream_t stream)
{
	int64_t units = (p.rows + s.R - 1) / s.R;
	cudaError_t err;

	if (units > s.units_cap)
		units = s.units_cap;
	if (s.split) {
		constexpr auto sums = bwd_row_sums<T, W, NV>;
		int64_t grid = (int64_t)dev->sm_count * resident_blocks<sums>(s.threads);
		err = launch_kernel(sums, p.rows < grid ? p.rows : grid, s.threads, 1, stream, p);
		if (err != cudaSuccess)
			return set_error(err, "backward row sums launch");
	}
	const bool ds = p.f & F_RESIDUAL;
	if (common_job(p, s)) {
		err = launch_common<T, W, NV>(p, dev, units, s.threads, stream);
		return err == cudaSuccess ? NK_OK : set_error(err, "backward kernel launch");
	}
	if (!(p.f & F_MEMEFF)) {
		err = launch_kernel(ds ? bwd_tiled<T, W, NV, false, true> : bwd_tiled<T, W, NV, false, false>,
				    units * s.K, s.threads, s.split ? 1 : s.K, stream, p);
		return err == cudaSuccess ? NK_OK : set_error(err, "backward kernel launch");
	}
	const size_t smem = staged_weight_bytes<T>(NV, s.G);
	const int K = s.split ? 1 : s.K;
	err = ds ? launch_with_smem<bwd_tiled<T, W, NV, true, true>>(dev, units * s.K, s.threads, K,
								   stream, p, smem)
		 : launch_with_smem<bwd_tiled<T, W, NV, true, false>>(dev, units * s.K, s.threads, K,
								    stream, p, smem);
	return err == cudaSuccess ? NK_OK : set_error(err, "backward kernel launch");
}

/*
 * block_smem backward: a block (or, on sm_90, a cluster of K blocks) owns
 * whole rows, one at a time (persistent over rows). Thread t of rank r
 * owns vectors (j * K + r) * G + t of every row and keeps the dgamma/dbeta
 * sums of those columns in registers, as the tiled kernel does, but the row
 * itself (x or y, and dy) is staged in shared memory by cp.async, two
 * stages deep: while a row is reduced and written, the next one is in
 * flight (not three: the larger carve-out leaves L1 too small for the
 * weights; BENCHMARKS.md, block_smem backward: stages). A thread reads
 * back only the slots it copied itself, so the stages need no barrier; one
 * block (cluster) reduction a row remains.
 * Partial row u of the workspace is row group u's; the grid is
 * min(rows, units_cap) groups. Cluster blocks have at most 256 threads, so
 * that the cluster reduction finds registers to spare beside the sums.
 */
template <typename T, typename W, int NV, bool CLUSTER>
__global__ void __launch_bounds__(CLUSTER ? SMEM_CLUSTER_MAX_THREADS : MAX_THREADS, 1)
    bwd_smem(const Params p)
{
	constexpr int VEC = 16 / sizeof(T);
	constexpr int E = NV * VEC;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
	if constexpr (CLUSTER) { /* clusters are sm_90 only; the variant rules keep to that */
		__trap();
		return;
	}
#endif
	extern __shared__ uint4 stage[]; /* [2 stages][x, dy][NV * G slots] */
	__shared__ RedSmem sm;
	const int t = threadIdx.x, G = blockDim.x, slots = NV * G;
	const int K = CLUSTER ? p.K : 1; /* a compile-time 1 keeps the sums in registers */
	const int rank = cluster_rank(K);
	const int64_t first = blockIdx.x / K, stride = gridDim.x / K;
	const bool sums = p.f & (F_DGAMMA | F_DBETA);
	int vi[NV];
	float ag[E], ab[E];
	int parity = 0, st = 0;

#pragma unroll
	for (int j = 0; j < NV; j++)
		vi[j] = (j * K + rank) * G + t;
#pragma unroll
	for (int e = 0; e < E; e++) {
		ag[e] = 0.0f;
		ab[e] = 0.0f;
	}
	auto issue = [&](int64_t row, uint4 *dst) {
		const uint4 *bx =
		    reinterpret_cast<const uint4 *>(static_cast<const T *>(p.x) + row * p.cols);
		const uint4 *bd =
		    reinterpret_cast<const uint4 *>(static_cast<const T *>(p.dy) + row * p.cols);
#pragma unroll
		for (int j = 0; j < NV; j++) {
			if (vi[j] < p.nvec) {
				cp_async16(dst + j * G + t, bx + vi[j]);
				cp_async16(dst + slots + j * G + t, bd + vi[j]);
			}
		}
	};
	issue(first, stage);
	cp_async_commit();
	RowStats cst = load_stats(p, first, true);
	for (int64_t row = first; row < p.rows; row += stride) {
		const int64_t next = row + stride;
		const bool nvalid = next < p.rows;
		if (nvalid)
			issue(next, stage + 2 * slots * (st ^ 1));
		cp_async_commit();
		RowStats nst = load_stats(p, next, nvalid);
		cp_async_wait<1>(); /* this row's copies; the next row's stay in flight */
		const uint4 *cx = stage + 2 * slots * st, *cd = cx + slots;
		float s[2] = {0.0f, 0.0f};
#pragma unroll
		for (int j = 0; j < NV; j++) {
			if (vi[j] >= p.nvec)
				continue;
			float xh[VEC], dy[VEC], gg[VEC];
			vector_terms<T, W>(p, cx[j * G + t], cd[j * G + t], vi[j] * VEC, true, cst,
					   xh, dy, gg);
			add_row_sums<VEC>(xh, gg, s);
			if (sums) {
				add_weight_grads<VEC>(xh, dy, ag + j * VEC, ab + j * VEC);
			}
		}
		group_reduce<SumOp<2>>(s, G, K, sm, parity);
		parity ^= 1;
		const float m1 = (p.f & F_LN) ? s[0] * p.inv_cols : 0.0f, m2 = s[1] * p.inv_cols;
		uint4 *out = reinterpret_cast<uint4 *>(static_cast<T *>(p.dx) + row * p.cols);
		Params q = p; /* the weights reloaded rather than kept */
		q.gamma = launder(q.gamma);
		q.beta = launder(q.beta);
#pragma unroll
		for (int j = 0; j < NV; j++) {
			if (vi[j] >= p.nvec)
				continue;
			float xh[VEC], dy[VEC], gg[VEC], dx[VEC];
			vector_terms<T, W>(q, cx[j * G + t], cd[j * G + t], vi[j] * VEC, true, cst,
					   xh, dy, gg);
#pragma unroll
			for (int i = 0; i < VEC; i++)
				dx[i] = cst.rstd * (gg[i] - m1 - xh[i] * m2);
			__stcs(out + vi[j], pack<T>(dx));
		}
		cst = nst;
		st ^= 1;
	}
	if (sums)
		write_partials<NV, VEC>(p, first, vi, ag, ab);
	cluster_done(K);
}

template <typename T, typename W, int NV>
int run_smem(const Params &p, const struct nk_device_info *dev, const Shape &s, size_t smem,
	     cudaStream_t stream)
{
	const int64_t units = p.rows < s.units_cap ? p.rows : s.units_cap;
	const cudaError_t err =
	    s.K == 1 ? launch_with_smem<bwd_smem<T, W, NV, false>>(dev, units, s.threads, 1, stream,
								  p, smem)
		     : launch_with_smem<bwd_smem<T, W, NV, true>>(dev, units * s.K, s.threads, s.K,
								 stream, p, smem);
	return err == cudaSuccess ? NK_OK : set_error(err, "block_smem backward launch");
}

/*
 * block_smem ring backward: for rows whose two stages do not fit (fp32
 * 16384 columns on one block of 512 threads, or a cluster's share of a
 * wider row), and for 512-thread clusters. Thread t of rank r owns
 * vectors (j * K + r) * G + t of every row, as in bwd_smem, but its shared
 * memory is a ring of C = NV + P vector slots (x and dy each), not two
 * stages of NV: the block's i-th row keeps vector j at ring position
 * (i * NV + j) mod C. While a row is reduced, the first P vectors of the
 * next row are already in flight in the P free slots; pass 2 refills each
 * slot as soon as it has read it, with the rest of the next row (j < NV - P)
 * or the first P vectors of the row after it. A thread only ever reads the
 * slots it filled itself, so the ring needs no barrier. cp.async groups,
 * committed in this order every row: "rest of the next row", then "head of
 * the row after"; waiting for all but the newest group therefore completes
 * the current row and leaves the head of the next one in flight. P = NV is
 * double buffering; P = 0 stages exactly one row.
 *
 * Blocks have up to 512 threads, clusters of 32 elements a thread up to 256
 * (at 512 the cluster reduction beside the 64 sums spills registers).
 *
 * SW (memory-efficient only): gamma, beta and rg of the thread's columns
 * are staged once per block in shared memory after the ring (fp32, see
 * Staged), so that rows do not re-read them from L2 (L1 is small once the
 * ring takes most of shared memory).
 */
template <typename T, typename W, int NV, bool CLUSTER, bool SW>
__global__ void __launch_bounds__(ring_max_threads(CLUSTER, NV * 16 / sizeof(T)), 1)
    bwd_smem_ring(const Params p)
{
	constexpr int VEC = 16 / sizeof(T);
	constexpr int E = NV * VEC;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
	if constexpr (CLUSTER) { /* clusters are sm_90 only; the variant rules keep to that */
		__trap();
		return;
	}
#endif
	extern __shared__ uint4 ring[]; /* [C positions][x, dy][G]; then SW weights */
	__shared__ RedSmem sm;
	const int t = threadIdx.x, G = blockDim.x, P = p.prefetch, C = NV + P;
	const int K = CLUSTER ? p.K : 1;
	const int rank = cluster_rank(K);
	const int64_t first = blockIdx.x / K, stride = gridDim.x / K;
	const bool sums = p.f & (F_DGAMMA | F_DBETA);
	float4 *staged = reinterpret_cast<float4 *>(ring + (size_t)2 * C * G);
	int vi[NV];
	float ag[E], ab[E];
	int parity = 0, base = 0; /* base: ring position of this row's vector 0 */

#pragma unroll
	for (int j = 0; j < NV; j++)
		vi[j] = (j * K + rank) * G + t;
#pragma unroll
	for (int e = 0; e < E; e++) {
		ag[e] = 0.0f;
		ab[e] = 0.0f;
	}
	if (SW)
		stage_weights<T, W, NV>(p, rank, staged);
	/* Copies vector j of `row` into ring position pos (nothing past the row end). */
	/* (j may be a run-time value here: v is computed, never an indexed register array.) */
	auto issue = [&](int64_t row, int j, int pos) {
		const int v = (j * K + rank) * G + t;
		if (v >= p.nvec)
			return;
		const int64_t off = row * p.cols;
		const uint4 *bx = reinterpret_cast<const uint4 *>(static_cast<const T *>(p.x) + off);
		const uint4 *bd = reinterpret_cast<const uint4 *>(static_cast<const T *>(p.dy) + off);
		cp_async16(ring + (size_t)(2 * pos) * G + t, bx + v);
		cp_async16(ring + (size_t)(2 * pos + 1) * G + t, bd + v);
	};
	/* The first row whole, then the head of the second in positions NV.. NV + P - 1. */
#pragma unroll
	for (int j = 0; j < NV; j++)
		issue(first, j, j);
	cp_async_commit();
#pragma unroll
	for (int j = 0; j < NV; j++) {
		if (j < P && first + stride < p.rows)
			issue(first + stride, j, NV + j);
	}
	cp_async_commit();
	RowStats cst = load_stats(p, first, true);
	for (int64_t row = first; row < p.rows; row += stride) {
		const int64_t next = row + stride, after = next + stride;
		const bool nvalid = next < p.rows, avalid = after < p.rows;
		RowStats nst = load_stats(p, next, nvalid);
		cp_async_wait<1>(); /* this row; the head of the next stays in flight */
		float s[2] = {0.0f, 0.0f};
#pragma unroll
		for (int j = 0; j < NV; j++) {
			if (vi[j] >= p.nvec)
				continue;
			const int pos = base + j < C ? base + j : base + j - C;
			const Staged sw = {SW ? staged : nullptr, j * G + t, NV * G};
			float xh[VEC], dy[VEC], gg[VEC];
			vector_terms<T, W>(p, ring[(size_t)(2 * pos) * G + t],
					   ring[(size_t)(2 * pos + 1) * G + t], vi[j] * VEC, true,
					   cst, xh, dy, gg, sw);
			add_row_sums<VEC>(xh, gg, s);
			if (sums) {
				add_weight_grads<VEC>(xh, dy, ag + j * VEC, ab + j * VEC);
			}
		}
		group_reduce<SumOp<2>>(s, G, K, sm, parity);
		parity ^= 1;
		const float m1 = (p.f & F_LN) ? s[0] * p.inv_cols : 0.0f, m2 = s[1] * p.inv_cols;
		uint4 *out = reinterpret_cast<uint4 *>(static_cast<T *>(p.dx) + row * p.cols);
		Params q = p; /* the weights reloaded rather than kept */
		q.gamma = launder(q.gamma);
		q.beta = launder(q.beta);
		if (P == NV)
			cp_async_commit(); /* the rest of the next row is empty */
#pragma unroll
		for (int j = 0; j < NV; j++) {
			const int pos = base + j < C ? base + j : base + j - C;
			if (vi[j] < p.nvec) {
				const Staged sw = {SW ? staged : nullptr, j * G + t, NV * G};
				float xh[VEC], dy[VEC], gg[VEC], dx[VEC];
				vector_terms<T, W>(q, ring[(size_t)(2 * pos) * G + t],
						   ring[(size_t)(2 * pos + 1) * G + t], vi[j] * VEC,
						   true, cst, xh, dy, gg, sw);
#pragma unroll
				for (int i = 0; i < VEC; i++)
					dx[i] = cst.rstd * (gg[i] - m1 - xh[i] * m2);
				__stcs(out + vi[j], pack<T>(dx));
			}
			/* The slot is read: refill it (position arithmetic in the comment above). */
			if (j < NV - P) {
				if (nvalid)
					issue(next, P + j, pos);
			} else if (avalid) {
				issue(after, j - (NV - P), pos);
			}
			if (j == NV - P - 1)
				cp_async_commit(); /* the rest of the next row */
		}
		cp_async_commit(); /* the head of the row after */
		cst = nst;
		base = base + NV < C ? base + NV : base + NV - C;
	}
	cp_async_wait<0>();
	if (sums)
		write_partials<NV, VEC>(p, first, vi, ag, ab);
	cluster_done(K);
}

template <typename T, typename W, int NV>
int run_smem_ring(const Params &p, const struct nk_device_info *dev, const Shape &s, bool sw,
		  size_t smem, cudaStream_t stream)
{
	const int64_t grid = (p.rows < s.units_cap ? p.rows : s.units_cap) * s.K;
	cudaError_t err;
	if (s.K == 1)
		err = sw ? launch_with_smem<bwd_smem_ring<T, W, NV, false, true>>(
			       dev, grid, s.threads, s.K, stream, p, smem)
			 : launch_with_smem<bwd_smem_ring<T, W, NV, false, false>>(
			       dev, grid, s.threads, s.K, stream, p, smem);
	else
		err = sw ? launch_with_smem<bwd_smem_ring<T, W, NV, true, true>>(
			       dev, grid, s.threads, s.K, stream, p, smem)
			 : launch_with_smem<bwd_smem_ring<T, W, NV, true, false>>(
			       dev, grid, s.threads, s.K, stream, p, smem);
	return err == cudaSuccess ? NK_OK : set_error(err, "block_smem ring backward launch");
}

} /* namespace */

int launch_bwd_smem(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		    float *part, const float *rg, cudaStream_t stream)
{
	Params p = params_of(a);
	p.rg = rg;
	p.G = s.threads;
	p.K = s.K;
	p.R = 1;
	p.iters = a->rows;
	p.part = part;
	p.part_rows = partial_rows(a, s);
	const size_t smem = smem_stage_bytes(a, s, dev);
	return with_types(a->dtype, a->weight_dtype, [&](auto tt, auto wt) {
		using T = decltype(tt);
		using W = decltype(wt);
		constexpr int VEC = 16 / sizeof(T);
		p.nvec = (int)(a->cols / VEC);
		return with_nv<SMEM_BWD_MAX_ELEMS, VEC>(s.NV, [&](auto nv) {
			return run_smem<T, W, decltype(nv)::value>(p, dev, s, smem, stream);
		});
	});
}

int launch_bwd_smem_ring(const struct nk_norm_args *a, const struct nk_device_info *dev,
			 const Shape &s, float *part, const float *rg, cudaStream_t stream)
{
	Params p = params_of(a);
	p.rg = rg;
	p.G = s.threads;
	p.K = s.K;
	p.R = 1;
	p.iters = a->rows;
	p.part = part;
	p.part_rows = partial_rows(a, s);
	p.prefetch = s.prefetch;
	const bool sw = s.staged_weights && (p.f & F_MEMEFF);
	const size_t smem = smem_stage_bytes(a, s, dev);
	return with_types(a->dtype, a->weight_dtype, [&](auto tt, auto wt) {
		using T = decltype(tt);
		using W = decltype(wt);
		constexpr int VEC = 16 / sizeof(T);
		p.nvec = (int)(a->cols / VEC);
		/* Instantiated for 16 and 32 elements a thread only (the variant rules keep to that). */
		if (s.NV * VEC == SMEM_BWD_MAX_ELEMS)
			return run_smem_ring<T, W, SMEM_BWD_MAX_ELEMS / VEC>(p, dev, s, sw, smem,
									     stream);
		if (s.NV * VEC == SMEM_BWD_MAX_ELEMS / 2)
			return run_smem_ring<T, W, SMEM_BWD_MAX_ELEMS / 2 / VEC>(p, dev, s, sw, smem,
										 stream);
		return (int)NK_EUNSUPPORTED;
	});
}

int launch_bwd_tiled(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		     float *part, const float *rg, float *sums, cudaStream_t stream)
{
	Params p = params_of(a, s);
	p.rg = rg;
	p.sums = sums;
	if (s.split)
		p.f |= F_PRESUMS;
	p.part = part;
	p.part_rows = partial_rows(a, s);
	return with_types(a->dtype, a->weight_dtype, [&](auto tt, auto wt) {
		using T = decltype(tt);
		using W = decltype(wt);
		constexpr int VEC = 16 / sizeof(T);
		p.nvec = (int)(a->cols / VEC);
		return with_nv<BWD_MAX_NV * VEC, VEC>(s.NV, [&](auto nv) {
			return run<T, W, decltype(nv)::value>(p, dev, s, stream);
		});
	});
}

} /* namespace nkc */
