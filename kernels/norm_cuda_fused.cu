/*
 * The norm variants of docs/VARIANTS.md on the GPU: residual add (forward
 * s = x + residual, rounded once and stored, then normalized; backward
 * dx = dnorm(s) + ds), the weight offset (w = weight_offset + gamma in
 * fp32) and FP8 output (saturate(RNE(y * scale)), amax = max |y| before
 * scaling, NaN skipped), for any width and alignment: the family the
 * policy falls back to where the faster ones cannot take a variant job
 * (rows not of whole 16-byte vectors, and the autotuner's second
 * candidate). Plain jobs never come here.
 *
 * A block takes whole rows (grid-stride), its threads striding the columns.
 * The forward keeps a row's s in shared memory when it fits (else re-reads
 * it from where it was stored: residual_out, or x), so x + residual is
 * computed once. The backward makes two passes over a row (the two row
 * sums, then dx) and adds each row's dy * x_hat and dy into its block's
 * column partials in the workspace; a second kernel sums the blocks'
 * partials in block order, so dgamma and dbeta are bit-identical run to
 * run. Within a row every element is read before the element of an
 * aliased output at the same index is written, by the same thread, which
 * is what the daemon's alias rule allows.
 */
#include "kernels/norm_cuda_internal.cuh"

namespace nkc
{
namespace
{

constexpr int FUSED_THREADS = 256;
constexpr int FUSED_WARPS = FUSED_THREADS / 32;
constexpr int64_t FUSED_STAGE_COLS = 8192;             /* 32 KiB of fp32 s, under the 48 KiB default */
constexpr size_t FUSED_PARTIALS_MAX = (size_t)64 << 20; /* backward workspace cap */

struct FusedParams {
	const void *x;		 /* forward: x; backward: s (or x), or y if memory-efficient */
	const void *residual;	 /* forward */
	void *residual_out;	 /* forward: s */
	void *y;		 /* forward: dtype, or one byte an element with fp8 */
	float *mean;
	float *rstd;
	const void *gamma;
	const void *beta;
	const void *dy;		 /* backward */
	const void *ds;		 /* backward, optional */
	void *dx;		 /* backward */
	const float *scale;	 /* fp8 */
	float *amax;		 /* fp8, optional */
	float *part;		 /* backward: [2][blocks][cols] dgamma, dbeta partials */
	int64_t rows;
	int64_t cols;
	float eps;
	float inv_cols;
	float offset;
	int fp8;		 /* enum nk_fp8 */
	bool ln;
	bool memeff;
	bool stage;		 /* forward: s kept in shared memory */
};

/* Sums v over the block; every thread gets the total. `red` holds FUSED_WARPS floats. */
__device__ __forceinline__ float block_sum(float v, float *red)
{
	for (int off = 16; off > 0; off >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, off);
	__syncthreads(); /* red's last readers are done */
	if ((threadIdx.x & 31) == 0)
		red[threadIdx.x >> 5] = v;
	__syncthreads();
	float total = 0.0f;
	for (int w = 0; w < FUSED_WARPS; w++)
		total += red[w];
	return total;
}

/* The larger of a and b, NaN skipped (fmaxf returns the other operand). */
__device__ __forceinline__ float block_max(float v, float *red)
{
	for (int off = 16; off > 0; off >>= 1)
		v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
	__syncthreads();
	if ((threadIdx.x & 31) == 0)
		red[threadIdx.x >> 5] = v;
	__syncthreads();
	float m = 0.0f;
	for (int w = 0; w < FUSED_WARPS; w++)
		m = fmaxf(m, red[w]);
	return m;
}

template <typename W> __device__ __forceinline__ float weight(const FusedParams &p, int64_t c)
{
	return p.gamma ? p.offset + to_f(static_cast<const W *>(p.gamma)[c]) : 1.0f;
}

template <typename W> __device__ __forceinline__ float bias(const FusedParams &p, int64_t c)
{
	return p.beta ? to_f(static_cast<const W *>(p.beta)[c]) : 0.0f;
}

template <typename T, typename W>
__global__ void __launch_bounds__(FUSED_THREADS) fused_fwd(const FusedParams p)
{
	extern __shared__ float srow[];
	__shared__ float red[FUSED_WARPS];
	const int64_t cols = p.cols;
	float amax = 0.0f;
	for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
		const T *x = static_cast<const T *>(p.x) + row * cols;
		const T *r = p.residual ? static_cast<const T *>(p.residual) + row * cols : nullptr;
		T *so = p.residual_out ? static_cast<T *>(p.residual_out) + row * cols : nullptr;
		/* s where a later pass re-reads it when it is not staged */
		const T *s_at = so ? so : x;
		float sum = 0.0f;
		for (int64_t c = threadIdx.x; c < cols; c += FUSED_THREADS) {
			float v = to_f(x[c]);
			if (r) {
				T s = from_f<T>(v + to_f(r[c]));
				so[c] = s;
				v = to_f(s);
			}
			if (p.stage)
				srow[c] = v;
			sum += p.ln ? v : v * v;
		}
		sum = block_sum(sum, red);
		float mean = 0.0f, var;
		if (p.ln) {
			mean = sum * p.inv_cols;
			float sq = 0.0f;
			for (int64_t c = threadIdx.x; c < cols; c += FUSED_THREADS) {
				float d = (p.stage ? srow[c] : to_f(s_at[c])) - mean;
				sq += d * d;
			}
			var = block_sum(sq, red) * p.inv_cols;
		} else {
			var = sum * p.inv_cols;
		}
		const float rstd = rsqrtf(var + p.eps);
		if (threadIdx.x == 0) {
			if (p.mean)
				p.mean[row] = mean;
			if (p.rstd)
				p.rstd[row] = rstd;
		}
		const float scale = p.fp8 ? *p.scale : 1.0f;
		for (int64_t c = threadIdx.x; c < cols; c += FUSED_THREADS) {
			float v = p.stage ? srow[c] : to_f(s_at[c]);
			float y = (v - mean) * rstd * weight<W>(p, c) + bias<W>(p, c);
			if (p.fp8) {
				amax = fmaxf(amax, fabsf(y));
				static_cast<uint8_t *>(p.y)[row * cols + c] = to_fp8(y * scale, p.fp8);
			} else {
				static_cast<T *>(p.y)[row * cols + c] = from_f<T>(y);
			}
		}
		__syncthreads(); /* srow's readers are done before the next row stages */
	}
	if (p.amax) {
		amax = block_max(amax, red);
		if (threadIdx.x == 0) /* non-negative floats order as their bits do */
			atomicMax(reinterpret_cast<int *>(p.amax), __float_as_int(amax));
	}
}

/* x_hat of one element: from x (or s), or recomputed from y when memory-efficient. */
template <typename T, typename W>
__device__ __forceinline__ float x_hat_of(const FusedParams &p, const T *x, int64_t c, float mean,
					  float rstd)
{
	float v = to_f(x[c]);
	if (!p.memeff)
		return (v - mean) * rstd;
	return p.gamma ? (v - bias<W>(p, c)) / clamp_magnitude(weight<W>(p, c), p.eps)
		       : v - bias<W>(p, c);
}

template <typename T, typename W>
__global__ void __launch_bounds__(FUSED_THREADS) fused_bwd(const FusedParams p)
{
	__shared__ float red[FUSED_WARPS];
	const int64_t cols = p.cols;
	float *pg = p.part ? p.part + (int64_t)blockIdx.x * cols : nullptr;
	float *pb = p.part ? p.part + ((int64_t)gridDim.x + blockIdx.x) * cols : nullptr;
	for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
		const T *x = static_cast<const T *>(p.x) + row * cols;
		const T *dy = static_cast<const T *>(p.dy) + row * cols;
		const T *ds = p.ds ? static_cast<const T *>(p.ds) + row * cols : nullptr;
		T *dx = static_cast<T *>(p.dx) + row * cols;
		const float mean = p.ln && !p.memeff ? p.mean[row] : 0.0f;
		const float rstd = p.rstd[row];
		float sg = 0.0f, sgx = 0.0f;
		for (int64_t c = threadIdx.x; c < cols; c += FUSED_THREADS) {
			float xh = x_hat_of<T, W>(p, x, c, mean, rstd);
			float g = to_f(dy[c]) * weight<W>(p, c);
			sg += g;
			sgx += g * xh;
		}
		const float mg = p.ln ? block_sum(sg, red) * p.inv_cols : 0.0f;
		const float mgx = block_sum(sgx, red) * p.inv_cols;
		for (int64_t c = threadIdx.x; c < cols; c += FUSED_THREADS) {
			float xh = x_hat_of<T, W>(p, x, c, mean, rstd);
			float d = to_f(dy[c]);
			float g = d * weight<W>(p, c);
			float v = rstd * (g - mg - xh * mgx);
			if (ds)
				v += to_f(ds[c]);
			if (pg) {
				pg[c] += d * xh;
				pb[c] += d;
			}
			dx[c] = from_f<T>(v); /* after this index's last read of x, dy and ds */
		}
	}
}

/* dgamma (blockIdx.y 0) and dbeta (1): the blocks' partials summed in block order. */
template <typename W>
__global__ void __launch_bounds__(256)
    fused_reduce(const float *part, int blocks, int64_t cols, W *dgamma, W *dbeta, bool accumulate)
{
	const int64_t c = (int64_t)blockIdx.x * 256 + threadIdx.x;
	W *out = blockIdx.y == 0 ? dgamma : dbeta;
	if (!out || c >= cols)
		return;
	const float *base = part + (int64_t)blockIdx.y * blocks * cols;
	float sum = 0.0f;
	for (int b = 0; b < blocks; b++)
		sum += base[(int64_t)b * cols + c];
	if (accumulate)
		sum += to_f(out[c]);
	out[c] = from_f<W>(sum);
}

/* Columns whose weight clamps (|w| < eps) into *out, for a memory-efficient backward. */
template <typename W>
__global__ void __launch_bounds__(256) fused_count_clamped(const FusedParams p, uint32_t *out)
{
	__shared__ float red[FUSED_WARPS];
	float n = 0.0f;
	for (int64_t c = threadIdx.x; p.memeff && c < p.cols; c += 256) {
		float w = weight<W>(p, c);
		n += (w >= 0.0f && w < p.eps) || (w < 0.0f && w > -p.eps);
	}
	n = block_sum(n, red);
	if (threadIdx.x == 0)
		*out = (uint32_t)n;
}

bool is_bwd_op(const struct nk_norm_args *a)
{
	return a->op == NK_LAYERNORM_BWD || a->op == NK_RMSNORM_BWD;
}

/* Blocks of a job: enough rows in flight, and a backward's partials within their cap. */
int fused_blocks(const struct nk_norm_args *a, const struct nk_device_info *dev)
{
	int64_t blocks = (int64_t)dev->sm_count * (is_bwd_op(a) ? 2 : 8);
	if (blocks > a->rows)
		blocks = a->rows;
	if (is_bwd_op(a) && (a->dgamma || a->dbeta)) {
		int64_t cap = (int64_t)(FUSED_PARTIALS_MAX / ((size_t)a->cols * 2 * sizeof(float)));
		if (blocks > cap)
			blocks = cap;
	}
	return blocks < 1 ? 1 : (int)blocks;
}

FusedParams fused_params(const struct nk_norm_args *a)
{
	FusedParams p = {};
	p.x = a->x;
	p.residual = a->residual;
	p.residual_out = a->residual_out;
	p.y = a->y;
	p.mean = a->mean;
	p.rstd = a->rstd;
	p.gamma = a->gamma;
	p.beta = a->beta;
	p.dy = a->dy;
	p.ds = a->ds;
	p.dx = a->dx;
	p.scale = a->scale;
	p.amax = a->amax;
	p.rows = a->rows;
	p.cols = a->cols;
	p.eps = a->eps;
	p.inv_cols = (float)(1.0 / (double)a->cols);
	p.offset = a->weight_offset;
	p.fp8 = is_bwd_op(a) ? NK_FP8_NONE : a->y_fp8;
	p.ln = a->op == NK_LAYERNORM_FWD || a->op == NK_LAYERNORM_BWD;
	p.memeff = is_bwd_op(a) && (a->flags & NK_MEMORY_EFFICIENT);
	if (!is_bwd_op(a)) {
		p.ds = nullptr;
	} else {
		p.residual = p.residual_out = nullptr;
		p.scale = p.amax = nullptr;
	}
	return p;
}

} /* namespace */
} /* namespace nkc */

extern "C" {

size_t nk_cuda_fused_workspace_bytes(const struct nk_norm_args *a, const struct nk_device_info *dev)
{
	if (!nkc::is_bwd_op(a) || (!a->dgamma && !a->dbeta))
		return 0;
	return (size_t)nkc::fused_blocks(a, dev) * (size_t)a->cols * 2 * sizeof(float);
}

int nk_cuda_fused_norm(const struct nk_norm_args *a, const struct nk_device_info *dev,
		       const struct nk_cuda_exec *exec)
{
	using namespace nkc;
	cudaStream_t stream = static_cast<cudaStream_t>(exec->stream);
	FusedParams p = fused_params(a);
	const int blocks = fused_blocks(a, dev);
	if (!is_bwd_op(a)) {
		p.stage = a->cols <= FUSED_STAGE_COLS;
		size_t smem = p.stage ? (size_t)a->cols * sizeof(float) : 0;
		if (p.amax && cudaMemsetAsync(p.amax, 0, sizeof(float), stream) != cudaSuccess)
			return set_error(cudaGetLastError(), "amax reset");
		return with_types(a->dtype, a->weight_dtype, [&](auto t, auto w) {
			using T = decltype(t);
			using W = decltype(w);
			fused_fwd<T, W><<<blocks, FUSED_THREADS, smem, stream>>>(p);
			return check_launch("fused forward launch");
		});
	}
	const size_t part_bytes = nk_cuda_fused_workspace_bytes(a, dev);
	if (part_bytes) {
		if (exec->workspace_bytes < part_bytes)
			return set_error(cudaErrorInvalidValue, "fused backward workspace");
		p.part = static_cast<float *>(exec->workspace);
		if (cudaMemsetAsync(p.part, 0, part_bytes, stream) != cudaSuccess)
			return set_error(cudaGetLastError(), "fused partials reset");
	}
	return with_types(a->dtype, a->weight_dtype, [&](auto t, auto w) {
		using T = decltype(t);
		using W = decltype(w);
		fused_bwd<T, W><<<blocks, FUSED_THREADS, 0, stream>>>(p);
		if (check_launch("fused backward launch") != NK_OK)
			return NK_EDEVICE;
		if (part_bytes) {
			dim3 grid((unsigned)((a->cols + 255) / 256), 2);
			fused_reduce<W><<<grid, 256, 0, stream>>>(
			    p.part, blocks, a->cols, static_cast<W *>(a->dgamma),
			    static_cast<W *>(a->dbeta), (a->flags & NK_ACCUMULATE) != 0);
			if (check_launch("fused reduce launch") != NK_OK)
				return NK_EDEVICE;
		}
		if (exec->clamped_cols) {
			fused_count_clamped<W><<<1, 256, 0, stream>>>(p, exec->clamped_cols);
			if (check_launch("fused clamp count launch") != NK_OK)
				return NK_EDEVICE;
		}
		return NK_OK;
	});
}

} /* extern "C" */
