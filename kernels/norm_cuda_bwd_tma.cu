/*
 * LayerNorm and RMSNorm backward, tma_slice family (sm_90): rows too wide
 * for one block's registers (norm_cuda_internal.cuh).
 *
 * A cluster of K blocks owns one row at a time, block r the contiguous
 * column slice r of it (`slice` vectors), and walks rows first, first +
 * units, ... (Rows of at most 32 lanes: one block owns R consecutive rows
 * at a time, a row on G lanes of a warp; "row" below is then the group of
 * R.) Thread tg of a row's G threads owns the slice's vectors j * G + tg
 * (TMA_ELEMS elements in all): their weights and dgamma/dbeta sums stay in
 * registers for the whole kernel. One thread copies each row's slice of x
 * (or y) and dy (and ds, the residual add's backward: dx += ds) into
 * shared memory with TMA bulk copies, `stages` rows deep, each stage
 * completing an mbarrier; no thread issues loads, so the rows in flight do
 * not depend on occupancy.
 *
 * Per row (the block's i-th):
 *   1. wait for stage i; sum g = dy * gamma and g * xh over the thread's
 *      elements, add dy * xh and dy to its dgamma/dbeta sums; warp sums;
 *   2. block barrier; thread 0 refills the stage of row i - 2 (read by
 *      everyone before the barrier) with row i + stages - 2;
 *   3. warp 0 sums the warps in order and stores the block's sums in slot
 *      `rank` of row slot i % D of every block of the cluster with st.async
 *      (distributed shared memory), each store completing 16 bytes of that
 *      block's mbarrier sums[i % D];
 *   4. wait for sums[(i - 1) % D] (all K blocks' sums of row i - 1, sent a
 *      row ago), sum the K slots in rank order, write dx of row i - 1.
 * The exchange has a whole row to land, so a block that runs up to a row
 * ahead of its peers does not wait for them. It uses no cluster barrier:
 * a release barrier would also wait for every dx store still in flight,
 * which halves the speed (BENCHMARKS.md, tma_slice backward: the exchange
 * of row sums). A block
 * stores row j + D's sums into a peer only after it has received the
 * peer's sums of row j + D - 2, which the peer sends (step 3 of row
 * j + D - 2) after it has read the slots of row j (step 4 of row j + 1),
 * so with D = TMA_SUM_SLOTS = 4 slots no store overtakes a read. Three
 * stages are the least (rows i - 1 and i are held); more keep stages - 2
 * rows in flight. A block of its own (K = 1) exchanges through its own
 * slot, which the next row's block barrier publishes. Narrow rows (R > 1)
 * have their sums from the group's butterfly and skip steps 3 and 4's wait.
 *
 * At the end each block writes its slice of the cluster's dgamma/dbeta
 * sums as partial row first * R + g (the grid is min(row groups,
 * units_cap) clusters, a rule of the shape and variant), summed by
 * launch_finish in a fixed order, so the weight gradients are
 * bit-identical on every run.
 *
 * Needs 16-byte aligned tensors and cols % VEC == 0 (the variant rules
 * check it). Built for sm_90 (the sm_80 build traps; the rules never pick
 * it there).
 */
#include "kernels/norm_cuda_internal.cuh"

namespace nkc
{
namespace
{

template <typename T, typename W, bool MEMEFF>
__global__ void __launch_bounds__(MAX_THREADS, 1) bwd_tma(const Params p)
{
#ifdef NKC_TMA
	constexpr int VEC = 16 / sizeof(T), NV = TMA_ELEMS / VEC, E = TMA_ELEMS;
	constexpr int WE = MEMEFF ? E : 1;
	extern __shared__ __align__(128) uint4 stage[]; /* [stages][x, dy(, ds)][sva] */
	__shared__ TmaSmem sm;
	const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5;
	const int K = p.K, S = p.stages, R = p.R, G = p.G;
	const int g = t / G, tg = t % G; /* row of the stage, thread within the row */
	const bool narrow = G <= 32;	  /* R rows a stage, a row on G lanes of a warp */
	const int rank = cluster_rank(K), lo = rank * p.slice;
	const int cnt = max(0, min(p.slice, p.nvec - lo)); /* this block's vectors of a row */
	const int sva = (R * p.slice + 7) & ~7;		   /* vectors of x (dy, ds) a stage */
	const bool has_ds = p.f & F_RESIDUAL;
	const int nbuf = has_ds ? 3 : 2; /* x, dy and ds: sva vectors each a stage */
	const int64_t units = (p.rows + R - 1) / R;	   /* row groups */
	const int64_t first = blockIdx.x / K, stride = gridDim.x / K;
	const int64_t n = first < units ? (units - first + stride - 1) / stride : 0;
	const bool sums = p.f & (F_DGAMMA | F_DBETA), ln = p.f & F_LN;
	const T *xs = static_cast<const T *>(p.x) + (int64_t)lo * VEC;
	const T *dys = static_cast<const T *>(p.dy) + (int64_t)lo * VEC;
	const T *dss = has_ds ? static_cast<const T *>(p.ds) + (int64_t)lo * VEC : nullptr;
	float gm[E], bt[WE], rg[WE], ag[E], ab[E];

#pragma unroll
	for (int j = 0; j < NV; j++) {
		const int lv = j * G + tg;
		float *wg = gm + j * VEC;
#pragma unroll
		for (int i = 0; i < VEC; i++) {
			wg[i] = 1.0f;
			if (MEMEFF) {
				bt[j * VEC + i] = 0.0f;
				rg[j * VEC + i] = 0.0f;
			}
		}
		if (lv >= cnt)
			continue;
		const int64_t col = (int64_t)(lo + lv) * VEC;
		if (p.f & F_GAMMA) {
			load_weights<VEC>(static_cast<const W *>(p.gamma) + col, wg);
			add_offset<VEC>(p, wg);
		}
		if constexpr (MEMEFF) {
			if (p.f & F_BETA)
				load_weights<VEC>(static_cast<const W *>(p.beta) + col, bt + j * VEC);
			load_weights<VEC>(p.rg + col, rg + j * VEC);
		}
	}
#pragma unroll
	for (int e = 0; e < E; e++) {
		ag[e] = 0.0f;
		ab[e] = 0.0f;
	}
	tma_barriers_init(sm, S, K, n);

	/* Thread 0: the block's i-th row group into stage k (= i % S). */
	auto issue = [&](int64_t i, int k) {
		const int64_t r0 = (first + i * stride) * R, off = r0 * p.cols;
		const int64_t nr = p.rows - r0 < R ? p.rows - r0 : R;
		const unsigned bytes = (unsigned)(K > 1 ? cnt : nr * p.nvec) * 16u;
		uint4 *dst = stage + (size_t)k * nbuf * sva;
		mbarrier_expect(&sm.full[k], nbuf * bytes);
		if (bytes) {
			bulk_load(dst, xs + off, bytes, &sm.full[k]);
			bulk_load(dst + sva, dys + off, bytes, &sm.full[k]);
			if (has_ds)
				bulk_load(dst + 2 * sva, dss + off, bytes, &sm.full[k]);
		}
	};
	/* This thread's row of the block's i-th row group; >= rows past the end. */
	auto row_of = [&](int64_t i) { return (first + i * stride) * R + g; };
	/* (mean, rstd) of that row; mean only for standard LayerNorm. */
	auto stats = [&](int64_t i) {
		float2 st = make_float2(0.0f, 0.0f);
		if (i < n && row_of(i) < p.rows) {
			const int64_t row = row_of(i);
			if (ln && !MEMEFF)
				st.x = p.mean[row];
			st.y = p.rstd[row];
		}
		return st;
	};
	auto terms = [&](float xv, float dyv, int e, float2 st, float &xh, float &gg) {
		if constexpr (MEMEFF)
			xh = (xv - bt[e]) * rg[e];
		else
			xh = (xv - st.x) * st.y;
		gg = dyv * gm[e];
	};
	/* dx of the block's i-th row (in stage k), with m1 = mean(g) (LayerNorm), m2 = mean(g * xh). */
	auto write_dx = [&](int64_t i, int k, float2 st, float m1, float m2) {
		const int64_t row = row_of(i);
		if (row >= p.rows)
			return;
		const uint4 *cur = stage + (size_t)k * nbuf * sva + (size_t)g * p.nvec;
		uint4 *out = reinterpret_cast<uint4 *>(static_cast<T *>(p.dx) + row * p.cols) + lo;
#pragma unroll
		for (int j = 0; j < NV; j++) {
			const int lv = j * G + tg;
			if (lv >= cnt)
				continue;
			float x[VEC], dy[VEC], dx[VEC], dsv[VEC];
			unpack<T>(cur[lv], x);
			unpack<T>(cur[sva + lv], dy);
			if (has_ds)
				unpack<T>(cur[2 * sva + lv], dsv);
#pragma unroll
			for (int i2 = 0; i2 < VEC; i2++) {
				float xh, gg; /* x_hat and dy * gamma */
				terms(x[i2], dy[i2], j * VEC + i2, st, xh, gg);
				dx[i2] = st.y * (gg - m1 - xh * m2);
				if (has_ds)
					dx[i2] += dsv[i2];
			}
			__stcs(out + lv, pack<T>(dx));
		}
	};

	if (t == 0) {
		for (int i = 0; i < n && i < S - 2; i++)
			issue(i, i);
	}
	/*
	 * Row j's sums (waiting for the cluster's, wide rows) and its dx;
	 * narrow rows pass their own sums in s0, s1.
	 */
	auto finish = [&](int64_t j, int k, float2 st, float s0, float s1) {
		if (!narrow) {
			const int slot = (int)(j & (TMA_SUM_SLOTS - 1));
			if (K > 1) {
				mbarrier_wait_cluster(&sm.sums[slot], (unsigned)(j / TMA_SUM_SLOTS) & 1u);
				if (t == 0 && j + TMA_SUM_SLOTS < n) /* re-arm for the row D later */
					mbarrier_expect(&sm.sums[slot], 16u * K);
			}
			s0 = 0.0f;
			s1 = 0.0f;
			for (int r = 0; r < K; r++) {
				s0 += sm.rank[slot][r].x;
				s1 += sm.rank[slot][r].y;
			}
		}
		write_dx(j, k, st, ln ? s0 * p.inv_cols : 0.0f, s1 * p.inv_cols);
	};

	float2 cst = stats(0), pst = make_float2(0.0f, 0.0f);
	float ps0 = 0.0f, ps1 = 0.0f; /* narrow: row i - 1's sums */
	int k = 0;	      /* stage of row i: i % S, kept without 64-bit division */
	unsigned phase = 0;   /* parity of stage k's mbarrier phase for row i */
	for (int64_t i = 0; i < n; i++) {
		const float2 nst = stats(i + 1);
		const int slot = (int)(i & (TMA_SUM_SLOTS - 1)), prev = k > 0 ? k - 1 : S - 1;
		/* (narrow: rows of the last group past the end hold stale data, never used) */
		const uint4 *cur = stage + (size_t)k * nbuf * sva + (size_t)g * p.nvec;
		const bool valid = row_of(i) < p.rows;
		float s[2] = {0.0f, 0.0f};

		mbarrier_wait(&sm.full[k], phase);
#pragma unroll
		for (int j = 0; j < NV; j++) {
			const int lv = j * G + tg;
			if (lv >= cnt || !valid)
				continue;
			float x[VEC], dy[VEC];
			unpack<T>(cur[lv], x);
			unpack<T>(cur[sva + lv], dy);
#pragma unroll
			for (int i2 = 0; i2 < VEC; i2++) {
				const int e = j * VEC + i2;
				float xh, gg;
				terms(x[i2], dy[i2], e, cst, xh, gg);
				s[0] += gg;
				s[1] += gg * xh;
				if (sums) {
					ag[e] += dy[i2] * xh;
					ab[e] += dy[i2];
				}
			}
		}
		butterfly<SumOp<2>>(s, narrow ? G : 32);
		if (!narrow && lane == 0)
			sm.warp[i & 1][warp] = make_float4(s[0], s[1], 0.0f, 0.0f);
		__syncthreads();
		if (t == 0 && i + S - 2 < n) /* into the stage of row group i - 2 */
			issue(i + S - 2, k >= 2 ? k - 2 : k + S - 2);
		if (!narrow && warp == 0) {
			float v[2] = {0.0f, 0.0f};
			if (lane < nw) {
				v[0] = sm.warp[i & 1][lane].x;
				v[1] = sm.warp[i & 1][lane].y;
			}
			butterfly<SumOp<2>>(v, lanes_for(nw));
			broadcast_lane0<2>(v);
			if (K == 1 && lane == 0)
				sm.rank[slot][0] = make_float4(v[0], v[1], 0.0f, 0.0f);
			else if (K > 1 && lane < K)
				store_to_rank(&sm.rank[slot][rank], &sm.sums[slot], lane,
					      make_float4(v[0], v[1], 0.0f, 0.0f));
		}
		if (i > 0)
			finish(i - 1, prev, pst, ps0, ps1);
		ps0 = s[0]; /* narrow: the group's butterfly summed the row */
		ps1 = s[1];
		pst = cst;
		cst = nst;
		if (++k == S) {
			k = 0;
			phase ^= 1u;
		}
	}
	if (n > 0) {
		if (!narrow && K == 1)
			__syncthreads(); /* warp 0 stored the last row's sums after the last barrier */
		finish(n - 1, k > 0 ? k - 1 : S - 1, pst, ps0, ps1);
	}
	if (!sums)
		return;
	/*
	 * Partial row first * R + g: each row of a stage sums its own. (The grid
	 * is min(row groups, units_cap) clusters, so every cluster has a row
	 * group and partial_rows() counts exactly these rows.)
	 */
	int vi[NV]; /* the row's vector of each of the thread's slots; nvec: none */
#pragma unroll
	for (int j = 0; j < NV; j++)
		vi[j] = j * G + tg < cnt ? lo + j * G + tg : p.nvec;
	write_partials<NV, VEC>(p, first * R + g, vi, ag, ab);
#else
	(void)p;
	__trap();
#endif
}

} /* namespace */

int launch_bwd_tma(const struct nk_norm_args *a, const struct nk_device_info *dev, const Shape &s,
		   float *part, const float *rg, cudaStream_t stream)
{
	Params p = params_of(a, s);
	p.rg = rg;
	p.part = part;
	p.part_rows = partial_rows(a, s);
	p.stages = s.stages;
	const int64_t units = p.iters < s.units_cap ? p.iters : s.units_cap;
	const size_t smem = tma_stage_bytes(a, s);
	const bool memeff = p.f & F_MEMEFF;
	return with_types(a->dtype, a->weight_dtype, [&](auto tt, auto wt) {
		using T = decltype(tt);
		using W = decltype(wt);
		constexpr int VEC = 16 / sizeof(T);
		p.nvec = (int)(a->cols / VEC);
		p.slice = (p.nvec + s.K - 1) / s.K;
		cudaError_t err = memeff ? launch_with_smem<bwd_tma<T, W, true>>(
					       dev, units * s.K, s.threads, s.K, stream, p, smem)
					 : launch_with_smem<bwd_tma<T, W, false>>(
					       dev, units * s.K, s.threads, s.K, stream, p, smem);
		return err == cudaSuccess ? (int)NK_OK : set_error(err, "tma_slice backward launch");
	});
}

} /* namespace nkc */
