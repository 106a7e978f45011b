/*
 * The generic family (any cols, any alignment) and the backward finish.
 *
 * Generic forward and backward give a row to a warp (cols <= 1024) or to a
 * 256-thread block, load scalars and make several passes over the row; the
 * passes after the first hit L1/L2. Generic dgamma/dbeta come from a column
 * kernel: a 32 x 8 block owns 32 columns of a chunk of rows and writes one
 * partial row per chunk (chunks = min(ceil(rows / 8), units_cap), a rule of
 * the shape and the variant).
 *
 * The finish kernels serve both families: reduce_partials sums the partial
 * rows of the workspace in a fixed order (slice k sums rows k, k + 8, ...
 * with four running sums, the eight slices are then added pairwise), adds
 * the old value under NK_ACCUMULATE and rounds once; count_clamped counts
 * the gamma entries that memory-efficient backward clamps.
 *
 * Built by `make` (nvcc -O3, sm_80 and sm_90 machine code plus compute_90
 * PTX); instantiated for the five (x, weight) dtype pairs. Correctness is
 * checked by tests/gpu/test_norm_cuda.c against the CPU fp64 reference.
 */
#include "kernels/norm_cuda_internal.cuh"

namespace nkc
{
namespace
{

constexpr int GENERIC_THREADS = 256;

template <typename S> __device__ __forceinline__ float ld(const void *base, int64_t i)
{
	return to_f(static_cast<const S *>(base)[i]);
}

/* x_hat of element (row, col): from x, mean, rstd or (memory-efficient) y. */
template <typename T, typename W>
__device__ __forceinline__ float xhat_at(const Params &p, int64_t row, int64_t col, float mean,
					 float rstd)
{
	float x = ld<T>(p.x, row * p.cols + col);
	if (!(p.f & F_MEMEFF))
		return (x - mean) * rstd;
	float gm = (p.f & F_GAMMA) ? ld<W>(p.gamma, col) + p.offset : 1.0f;
	float bt = (p.f & F_BETA) ? ld<W>(p.beta, col) : 0.0f;
	return divide(x - bt, clamp_magnitude(gm, p.eps));
}

template <typename T, typename W>
__global__ void __launch_bounds__(GENERIC_THREADS) fwd_generic(const Params p)
{
	__shared__ RedSmem sm;
	const int g = threadIdx.x / p.G, t = threadIdx.x % p.G;
	const int64_t iters = p.iters;
	int parity = 0;

	for (int64_t it = blockIdx.x; it < iters; it += gridDim.x) {
		const int64_t row = it * p.R + g;
		const bool valid = row < p.rows;
		const int64_t off = (valid ? row : 0) * p.cols;
		float s[1] = {0.0f}, q[1] = {0.0f};
		float mean = 0.0f;

		if (p.f & F_LN) {
			for (int64_t c = t; valid && c < p.cols; c += p.G)
				s[0] += ld<T>(p.x, off + c);
			group_reduce<SumOp<1>>(s, p.G, 1, sm, parity);
			parity ^= 1;
			mean = s[0] * p.inv_cols;
		}
		for (int64_t c = t; valid && c < p.cols; c += p.G) {
			float d = ld<T>(p.x, off + c) - mean;
			q[0] += d * d;
		}
		group_reduce<SumOp<1>>(q, p.G, 1, sm, parity);
		parity ^= 1;
		const float rstd = rsqrtf(q[0] * p.inv_cols + p.eps);
		if (!valid)
			continue;
		for (int64_t c = t; c < p.cols; c += p.G) {
			float gm = (p.f & F_GAMMA) ? ld<W>(p.gamma, c) + p.offset : 1.0f;
			float bt = (p.f & F_BETA) ? ld<W>(p.beta, c) : 0.0f;
			float y = (ld<T>(p.x, off + c) - mean) * rstd * gm + bt;
			static_cast<T *>(p.y)[off + c] = from_f<T>(y);
		}
		if (t == 0 && p.mean)
			p.mean[row] = mean;
		if (t == 0 && p.rstd)
			p.rstd[row] = rstd;
	}
}

/* dx of the generic family; dgamma/dbeta come from dgamma_generic. */
template <typename T, typename W>
__global__ void __launch_bounds__(GENERIC_THREADS) bwd_generic(const Params p)
{
	__shared__ RedSmem sm;
	const int g = threadIdx.x / p.G, t = threadIdx.x % p.G;
	const int64_t iters = p.iters;
	const bool std_ln = (p.f & F_LN) && !(p.f & F_MEMEFF);
	int parity = 0;

	for (int64_t it = blockIdx.x; it < iters; it += gridDim.x) {
		const int64_t row = it * p.R + g;
		const bool valid = row < p.rows;
		const int64_t off = (valid ? row : 0) * p.cols;
		const float rstd = valid ? p.rstd[row] : 0.0f;
		const float mean = valid && std_ln ? p.mean[row] : 0.0f;
		float s[2] = {0.0f, 0.0f};

		for (int64_t c = t; valid && c < p.cols; c += p.G) {
			float gm = (p.f & F_GAMMA) ? ld<W>(p.gamma, c) + p.offset : 1.0f;
			float gg = ld<T>(p.dy, off + c) * gm;
			s[0] += gg;
			s[1] += gg * xhat_at<T, W>(p, row, c, mean, rstd);
		}
		group_reduce<SumOp<2>>(s, p.G, 1, sm, parity);
		parity ^= 1;
		if (!valid)
			continue;
		const float m1 = (p.f & F_LN) ? s[0] * p.inv_cols : 0.0f;
		const float m2 = s[1] * p.inv_cols;
		for (int64_t c = t; c < p.cols; c += p.G) {
			float gm = (p.f & F_GAMMA) ? ld<W>(p.gamma, c) + p.offset : 1.0f;
			float gg = ld<T>(p.dy, off + c) * gm;
			float xh = xhat_at<T, W>(p, row, c, mean, rstd);
			static_cast<T *>(p.dx)[off + c] = from_f<T>(rstd * (gg - m1 - xh * m2));
		}
	}
}

/* Partial dgamma/dbeta of 32 columns over one chunk of rows (block 32 x 8). */
template <typename T, typename W>
__global__ void __launch_bounds__(256) dgamma_generic(const Params p)
{
	__shared__ float acc[2][8][33];
	const int64_t col = (int64_t)blockIdx.x * 32 + threadIdx.x;
	const int64_t per = p.part_per;
	const int64_t r0 = blockIdx.y * per;
	const int64_t r1 = r0 + per < p.rows ? r0 + per : p.rows;
	const bool std_ln = (p.f & F_LN) && !(p.f & F_MEMEFF);
	float sg = 0.0f, sb = 0.0f;

	for (int64_t r = r0 + threadIdx.y; col < p.cols && r < r1; r += 8) {
		float rstd = p.rstd[r];
		float mean = std_ln ? p.mean[r] : 0.0f;
		float dy = ld<T>(p.dy, r * p.cols + col);
		sg += dy * xhat_at<T, W>(p, r, col, mean, rstd);
		sb += dy;
	}
	acc[0][threadIdx.y][threadIdx.x] = sg;
	acc[1][threadIdx.y][threadIdx.x] = sb;
	__syncthreads();
	if (threadIdx.y >= 2 || col >= p.cols)
		return;
	const int w = threadIdx.y;
	const unsigned need = w == 0 ? F_DGAMMA : F_DBETA;
	if (!(p.f & need))
		return;
	float(*a)[33] = acc[w];
	float sum =
	    ((a[0][threadIdx.x] + a[1][threadIdx.x]) + (a[2][threadIdx.x] + a[3][threadIdx.x])) +
	    ((a[4][threadIdx.x] + a[5][threadIdx.x]) + (a[6][threadIdx.x] + a[7][threadIdx.x]));
	p.part[((int64_t)w * p.part_rows + blockIdx.y) * p.cols + col] = sum;
}

/*
 * Sums rows [r0, r1) of column `col` of the partial rows at `base` (block
 * 32 x 8: threadIdx.x a column, threadIdx.y a row phase), always in the same
 * order; the sum is valid in the threads of threadIdx.y == 0.
 */
__device__ __forceinline__ float sum_partial_rows(const float *base, int64_t r0, int64_t r1,
						  int64_t cols, int64_t col)
{
	__shared__ float acc[8][33];
	float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
	int64_t r = r0 + threadIdx.y;
	for (; col < cols && r + 24 < r1; r += 32) {
#pragma unroll
		for (int k = 0; k < 4; k++)
			s[k] += base[(r + 8 * k) * cols + col];
	}
	for (int k = 0; col < cols && r < r1; r += 8, k++)
		s[k & 3] += base[r * cols + col];
	acc[threadIdx.y][threadIdx.x] = (s[0] + s[1]) + (s[2] + s[3]);
	__syncthreads();
	float(*a)[33] = acc;
	return ((a[0][threadIdx.x] + a[1][threadIdx.x]) + (a[2][threadIdx.x] + a[3][threadIdx.x])) +
	       ((a[4][threadIdx.x] + a[5][threadIdx.x]) + (a[6][threadIdx.x] + a[7][threadIdx.x]));
}

/*
 * First of two finishing steps when there are many partial rows: chunk
 * blockIdx.z of `chunk` partial rows of dgamma (blockIdx.y 0) or dbeta (1)
 * into row blockIdx.z of `mid` (chunks x cols for each of the two), for
 * those of the two in `wanted` (bit 0 dgamma, bit 1 dbeta).
 */
__global__ void __launch_bounds__(256)
    reduce_partial_chunks(const float *part, int64_t part_rows, int64_t chunk, int64_t cols,
			  unsigned wanted, float *mid)
{
	if (!(wanted & (1u << blockIdx.y))) /* partials nobody wrote */
		return;
	const int64_t col = (int64_t)blockIdx.x * 32 + threadIdx.x;
	const float *base = part + (int64_t)blockIdx.y * part_rows * cols;
	const int64_t r0 = (int64_t)blockIdx.z * chunk;
	const int64_t r1 = r0 + chunk < part_rows ? r0 + chunk : part_rows;
	const float sum = sum_partial_rows(base, r0, r1, cols, col);
	if (threadIdx.y == 0 && col < cols)
		mid[((int64_t)blockIdx.y * gridDim.z + blockIdx.z) * cols + col] = sum;
}

/* Sums the partial rows of dgamma (blockIdx.y 0) or dbeta (1) into `out`. */
template <typename W>
__global__ void __launch_bounds__(256)
    reduce_partials(const float *part, int64_t part_rows, int64_t cols, W *dgamma, W *dbeta,
		    bool accumulate)
{
	const int64_t col = (int64_t)blockIdx.x * 32 + threadIdx.x;
	W *out = blockIdx.y == 0 ? dgamma : dbeta;
	const float *base = part + (int64_t)blockIdx.y * part_rows * cols;

	if (!out)
		return;
	float sum = sum_partial_rows(base, 0, part_rows, cols, col);
	if (threadIdx.y != 0 || col >= cols)
		return;
	if (accumulate)
		sum = to_f(out[col]) + sum;
	out[col] = from_f<W>(sum);
}

/* rg[c] = 1 / clamp(offset + gamma[c]) (gamma absent: ones), IEEE division. */
template <typename W>
__global__ void __launch_bounds__(256)
    reciprocal_gamma(const W *gamma, float offset, int64_t cols, float eps, float *rg)
{
	const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
	if (c < cols)
		rg[c] = 1.0f / clamp_magnitude(gamma ? offset + to_f(gamma[c]) : 1.0f, eps);
}

/* Counts |offset + gamma| < eps (gamma absent counts as ones) into *out; one block. */
template <typename W>
__global__ void __launch_bounds__(256)
    count_clamped(const W *gamma, float offset, int64_t cols, float eps, bool memeff,
		  uint32_t *out)
{
	__shared__ unsigned warp_counts[8];
	unsigned n = 0;

	for (int64_t c = threadIdx.x; memeff && c < cols; c += blockDim.x) {
		float g = gamma ? offset + to_f(gamma[c]) : 1.0f;
		n += (g >= 0.0f && g < eps) || (g < 0.0f && g > -eps);
	}
	for (int off = 16; off > 0; off >>= 1)
		n += __shfl_xor_sync(0xffffffffu, n, off);
	if ((threadIdx.x & 31) == 0)
		warp_counts[threadIdx.x >> 5] = n;
	__syncthreads();
	if (threadIdx.x == 0) {
		unsigned total = 0;
		for (int w = 0; w < 8; w++)
			total += warp_counts[w];
		*out = total;
	}
}

template <typename Kern>
int launch2d(Kern kern, dim3 grid, dim3 block, cudaStream_t stream, const Params &p,
	     const char *what)
{
	cudaLaunchConfig_t cfg = {};
	cfg.gridDim = grid;
	cfg.blockDim = block;
	cfg.stream = stream;
	cudaError_t err = cudaLaunchKernelEx(&cfg, kern, p);
	return err == cudaSuccess ? NK_OK : set_error(err, what);
}

/* Blocks of the generic row kernels: persistent, at most the resident count. */
template <auto kern> int64_t generic_grid(const Params &p, const struct nk_device_info *dev)
{
	int64_t iters = (p.rows + p.R - 1) / p.R;
	int64_t resident = (int64_t)dev->sm_count * resident_blocks<kern>(GENERIC_THREADS);
	return iters < resident ? iters : resident;
}

} /* namespace */

int launch_fwd_generic(const struct nk_norm_args *a, const struct nk_device_info *dev,
		       const Shape &s, cudaStream_t stream)
{
	Params p = params_of(a, s);
	p.K = 1; /* generic rows never span blocks */
	return with_types(a->dtype, a->weight_dtype, [&](auto tt, auto wt) {
		constexpr auto kern = fwd_generic<decltype(tt), decltype(wt)>;
		return launch2d(kern, dim3((unsigned)generic_grid<kern>(p, dev)),
				dim3(GENERIC_THREADS), stream, p, "generic forward launch");
	});
}

int launch_bwd_generic(const struct nk_norm_args *a, const struct nk_device_info *dev,
		       const Shape &s, float *part, cudaStream_t stream)
{
	Params p = params_of(a, s);
	p.K = 1; /* generic rows never span blocks */
	p.part = part;
	p.part_rows = partial_rows(a, s);
	p.part_per = (a->rows + p.part_rows - 1) / p.part_rows;
	return with_types(a->dtype, a->weight_dtype, [&](auto tt, auto wt) {
		using T = decltype(tt);
		using W = decltype(wt);
		constexpr auto kern = bwd_generic<T, W>;
		/* The weight gradients first: they read dy and x, which dx may overwrite. */
		if (p.f & (F_DGAMMA | F_DBETA)) {
			dim3 grid((unsigned)((p.cols + 31) / 32), (unsigned)p.part_rows);
			int rc = launch2d(dgamma_generic<T, W>, grid, dim3(32, 8), stream, p,
					  "generic dgamma launch");
			if (rc != NK_OK)
				return rc;
		}
		return launch2d(kern, dim3((unsigned)generic_grid<kern>(p, dev)),
				dim3(GENERIC_THREADS), stream, p, "generic backward launch");
	});
}

int launch_reciprocal_gamma(const struct nk_norm_args *a, float *rg, cudaStream_t stream)
{
	const unsigned blocks = (unsigned)((a->cols + 255) / 256);
	switch (a->weight_dtype) {
	case NK_F32:
		reciprocal_gamma<<<blocks, 256, 0, stream>>>(static_cast<const float *>(a->gamma),
							     a->weight_offset, a->cols, a->eps, rg);
		break;
	case NK_F16:
		reciprocal_gamma<<<blocks, 256, 0, stream>>>(static_cast<const __half *>(a->gamma),
							     a->weight_offset, a->cols, a->eps, rg);
		break;
	case NK_BF16:
		reciprocal_gamma<<<blocks, 256, 0, stream>>>(
		    static_cast<const __nv_bfloat16 *>(a->gamma), a->weight_offset, a->cols, a->eps,
		    rg);
		break;
	}
	return check_launch("reciprocal_gamma launch");
}

int launch_finish(const struct nk_norm_args *a, float *part, int64_t part_rows,
		  uint32_t *clamped_cols, cudaStream_t stream)
{
	const bool memeff = a->flags & NK_MEMORY_EFFICIENT;
	const bool accumulate = a->flags & NK_ACCUMULATE;
	auto body = [&](auto wt) {
		using W = decltype(wt);
		if (a->dgamma || a->dbeta) {
			const unsigned col_blocks = (unsigned)((a->cols + 31) / 32);
			const int64_t chunks = finish_chunks(a->cols, part_rows);
			const float *rows = part;
			int64_t nrows = part_rows;
			if (chunks > 1) {
				float *mid = part + mid_offset(a, part_rows);
				const int64_t chunk = (part_rows + chunks - 1) / chunks;
				reduce_partial_chunks<<<dim3(col_blocks, a->dbeta ? 2 : 1,
							     (unsigned)chunks),
							dim3(32, 8), 0, stream>>>(
				    part, part_rows, chunk, a->cols,
				    (a->dgamma ? 1u : 0u) | (a->dbeta ? 2u : 0u), mid);
				if (check_launch("reduce_partial_chunks launch") != NK_OK)
					return NK_EDEVICE;
				rows = mid;
				nrows = chunks;
			}
			reduce_partials<W><<<dim3(col_blocks, 2), dim3(32, 8), 0, stream>>>(
			    rows, nrows, a->cols, static_cast<W *>(a->dgamma),
			    static_cast<W *>(a->dbeta), accumulate);
			if (check_launch("reduce_partials launch") != NK_OK)
				return NK_EDEVICE;
		}
		if (clamped_cols) {
			count_clamped<W><<<1, 256, 0, stream>>>(static_cast<const W *>(a->gamma),
								a->weight_offset, a->cols, a->eps,
								memeff, clamped_cols);
			if (check_launch("count_clamped launch") != NK_OK)
				return NK_EDEVICE;
		}
		return NK_OK;
	};
	switch (a->weight_dtype) {
	case NK_F32:
		return body(float());
	case NK_F16:
		return body(__half());
	case NK_BF16:
		return body(__nv_bfloat16());
	}
	return NK_EUNSUPPORTED;
}

} /* namespace nkc */
