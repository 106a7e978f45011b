/*
 * LayerNorm and RMSNorm forward, tma_slice family (sm_90; see
 * norm_cuda_bwd_tma.cu for the backward and the pipeline it shares).
 *
 * A block stages the rows it owns in shared memory with TMA bulk copies,
 * `stages` deep, so the bytes in flight do not depend on registers or
 * occupancy. Two shapes:
 *   - narrow rows (K = 1, G <= 32): a stage holds R = threads / G
 *     consecutive rows (one bulk copy), a group of G lanes of a warp a row;
 *     the row's statistics are two butterflies within the group (the mean,
 *     then the squared deviations), no block barrier;
 *   - wide rows (R = 1, G = threads): a cluster of K blocks a row, block r
 *     its column slice r; each thread's (count, mean, M2) over its
 *     elements (two passes over shared memory) is merged with Chan's
 *     formula over the warp, the block (shared memory, a barrier) and the
 *     cluster (st.async into every block's slot, completing its mbarrier,
 *     as the backward exchanges its sums).
 * Per row group (the block's i-th): wait for stage i, the statistics of
 * row i, a block barrier (after which thread 0 refills the stage of row
 * i - 2 with row i + stages - 2), y of row i - 1 (its statistics are in
 * the thread's registers), then (wide rows) the cluster's statistics of
 * row i. Writing y of the previous row hides the exchange's latency.
 * mean and rstd as the tiled kernels define them: mean(x), rsqrt(mean((x
 * - mean)^2) + eps); RMSNorm rsqrt(mean(x^2) + eps).
 *
 * Needs 16-byte aligned x and y and cols % VEC == 0 (the variant rules
 * check it). Built for sm_90 (the sm_80 build traps; the rules never pick
 * it there).
 */
#include "kernels/norm_cuda_internal.cuh"

namespace nkc
{
namespace
{

template <typename T, typename W>
__global__ void __launch_bounds__(MAX_THREADS, 1) fwd_tma(const Params p)
{
#ifdef NKC_TMA
	constexpr int VEC = 16 / sizeof(T);
	extern __shared__ __align__(128) uint4 stage[];
	__shared__ TmaSmem sm;
	const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5;
	const int K = p.K, S = p.stages, R = p.R, G = p.G;
	const int g = t / G, tg = t % G; /* row of the stage, thread within the row */
	const bool wide = R == 1 && G > 32, ln = p.f & F_LN;
	const int rank = cluster_rank(K);
	const int sv = K > 1 ? p.slice : p.nvec; /* vectors of a row a block stages */
	const int lo = rank * sv, cnt = max(0, min(sv, p.nvec - lo));
	const int pitch = K > 1 ? (sv + 7) & ~7 : p.nvec; /* stage row pitch, in vectors */
	const int64_t stage_vecs = ((int64_t)R * pitch + 7) & ~(int64_t)7;
	const int64_t units = (p.rows + R - 1) / R; /* row groups */
	const int64_t first = blockIdx.x / K, stride = gridDim.x / K;
	const int64_t n = first < units ? (units - first + stride - 1) / stride : 0;

	tma_barriers_init(sm, S, K, n);

	/* Thread 0: the block's i-th row group into stage k. */
	auto issue = [&](int64_t i, int k) {
		const int64_t r0 = (first + i * stride) * R;
		const int64_t nr = p.rows - r0 < R ? p.rows - r0 : R;
		const unsigned bytes = (unsigned)(K > 1 ? cnt : nr * p.nvec) * 16u;
		mbarrier_expect(&sm.full[k], bytes);
		if (bytes)
			bulk_load(stage + (size_t)k * stage_vecs,
				  static_cast<const T *>(p.x) + r0 * p.cols + (int64_t)lo * VEC, bytes,
				  &sm.full[k]);
	};
	/* y of this thread's row of the block's i-th row group (in stage k). */
	auto write_y = [&](int64_t i, int k, float mean, float rstd) {
		const int64_t row = (first + i * stride) * R + g;
		if (row >= p.rows)
			return;
		const uint4 *xr = stage + (size_t)k * stage_vecs + (size_t)g * pitch;
		uint4 *out = reinterpret_cast<uint4 *>(static_cast<T *>(p.y) + row * p.cols) + lo;
		for (int v = tg; v < cnt; v += G) {
			float x[VEC], gm[VEC], bt[VEC], y[VEC];
			unpack<T>(xr[v], x);
#pragma unroll
			for (int e = 0; e < VEC; e++) {
				gm[e] = 1.0f;
				bt[e] = 0.0f;
			}
			if (p.f & F_GAMMA) {
				load_weights<VEC>(static_cast<const W *>(p.gamma) + (int64_t)(lo + v) * VEC,
						  gm);
				add_offset<VEC>(p, gm);
			}
			if (p.f & F_BETA)
				load_weights<VEC>(static_cast<const W *>(p.beta) + (int64_t)(lo + v) * VEC,
						  bt);
#pragma unroll
			for (int e = 0; e < VEC; e++)
				y[e] = (x[e] - mean) * rstd * gm[e] + bt[e];
			__stcs(out + v, pack<T>(y));
		}
		if (tg == 0 && rank == 0) {
			if (p.mean)
				p.mean[row] = mean;
			if (p.rstd)
				p.rstd[row] = rstd;
		}
	};

	if (t == 0) {
		for (int i = 0; i < n && i < S - 2; i++)
			issue(i, i);
	}
	float pmean = 0.0f, prstd = 0.0f; /* statistics of row i - 1 */
	int k = 0;
	unsigned phase = 0;
	for (int64_t i = 0; i < n; i++) {
		const int slot = (int)(i & (TMA_SUM_SLOTS - 1)), prev = k > 0 ? k - 1 : S - 1;
		const uint4 *xr = stage + (size_t)k * stage_vecs + (size_t)g * pitch;
		float mean = 0.0f, rstd = 0.0f;
		float w[3] = {0.0f, 0.0f, 0.0f}; /* wide: count, mean, M2 */

		mbarrier_wait(&sm.full[k], phase);
		if (!wide) {
			/* Rows of the last group past the end hold stale data: not read. */
			const int rcnt = (first + i * stride) * R + g < p.rows ? cnt : 0;
			float s[1] = {0.0f}, q[1] = {0.0f};
			if (ln) {
				for (int v = tg; v < rcnt; v += G) {
					float x[VEC];
					unpack<T>(xr[v], x);
#pragma unroll
					for (int e = 0; e < VEC; e++)
						s[0] += x[e];
				}
				butterfly<SumOp<1>>(s, G);
				mean = s[0] * p.inv_cols;
			}
			for (int v = tg; v < rcnt; v += G) {
				float x[VEC];
				unpack<T>(xr[v], x);
#pragma unroll
				for (int e = 0; e < VEC; e++)
					q[0] += (x[e] - mean) * (x[e] - mean);
			}
			butterfly<SumOp<1>>(q, G);
			rstd = rsqrtf(q[0] * p.inv_cols + p.eps);
		} else {
			float s = 0.0f;
			for (int v = tg; v < cnt; v += G) {
				float x[VEC];
				unpack<T>(xr[v], x);
				w[0] += (float)VEC;
#pragma unroll
				for (int e = 0; e < VEC; e++)
					s += ln ? x[e] : 0.0f;
			}
			w[1] = ln && w[0] > 0.0f ? __fdividef(s, w[0]) : 0.0f;
			for (int v = tg; v < cnt; v += G) {
				float x[VEC];
				unpack<T>(xr[v], x);
#pragma unroll
				for (int e = 0; e < VEC; e++)
					w[2] += (x[e] - w[1]) * (x[e] - w[1]);
			}
			butterfly<WelfordOp>(w, 32);
			if (lane == 0)
				sm.warp[i & 1][warp] = make_float4(w[0], w[1], w[2], 0.0f);
		}
		__syncthreads();
		if (t == 0 && i + S - 2 < n) /* into the stage of row i - 2 */
			issue(i + S - 2, k >= 2 ? k - 2 : k + S - 2);
		if (wide && warp == 0) {
			float v[3] = {0.0f, 0.0f, 0.0f};
			if (lane < nw) {
				const float4 o = sm.warp[i & 1][lane];
				v[0] = o.x;
				v[1] = o.y;
				v[2] = o.z;
			}
			butterfly<WelfordOp>(v, lanes_for(nw));
			broadcast_lane0<3>(v);
			const float4 mine = make_float4(v[0], v[1], v[2], 0.0f);
			if (K == 1 && lane == 0)
				sm.rank[slot][0] = mine;
			else if (K > 1 && lane < K)
				store_to_rank(&sm.rank[slot][rank], &sm.sums[slot], lane, mine);
		}
		if (i > 0)
			write_y(i - 1, prev, pmean, prstd);
		if (wide) {
			if (K > 1) {
				mbarrier_wait_cluster(&sm.sums[slot], (unsigned)(i / TMA_SUM_SLOTS) & 1u);
				if (t == 0 && i + TMA_SUM_SLOTS < n)
					mbarrier_expect(&sm.sums[slot], 16u * K);
			} else {
				__syncthreads();
			}
			float m[3] = {0.0f, 0.0f, 0.0f};
			for (int r = 0; r < K; r++) {
				const float4 o = sm.rank[slot][r];
				float b[3] = {o.x, o.y, o.z};
				WelfordOp::merge(m, b);
			}
			mean = ln ? m[1] : 0.0f;
			rstd = rsqrtf(m[2] * p.inv_cols + p.eps);
		}
		pmean = mean;
		prstd = rstd;
		if (++k == S) {
			k = 0;
			phase ^= 1u;
		}
	}
	if (n > 0)
		write_y(n - 1, k > 0 ? k - 1 : S - 1, pmean, prstd);
#else
	(void)p;
	__trap();
#endif
}

} /* namespace */

int launch_fwd_tma(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		   cudaStream_t stream)
{
	Params p = params_of(a, s);
	p.stages = s.stages;
	const int64_t units = p.iters < s.units_cap ? p.iters : s.units_cap;
	const size_t smem = tma_stage_bytes(a, s);
	return with_types(a->dtype, a->weight_dtype, [&](auto tt, auto wt) {
		using T = decltype(tt);
		using W = decltype(wt);
		p.nvec = (int)(a->cols / (16 / sizeof(T)));
		p.slice = (p.nvec + s.K - 1) / s.K;
		const cudaError_t err = launch_with_smem<fwd_tma<T, W>>(dev, units * s.K, s.threads,
									 s.K, stream, p, smem);
		return err == cudaSuccess ? (int)NK_OK : set_error(err, "tma_slice forward launch");
	});
}

} /* namespace nkc */
