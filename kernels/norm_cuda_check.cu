/*
 * The output check of normstress's enqueue mode: a job's outputs compared,
 * on the device and in stream order after the job, with the reference the
 * host computed once per job kit, so that no CPU waits for a job to check it.
 *
 * Each thread walks the outputs grid-stride and sums (out - expect)^2 in
 * fp64 per output (an element NaN on one side only adds infinity, NaN on
 * both sides nothing); a block reduces its threads' sums through warp
 * shuffles and shared memory and stores them as its partials in the
 * stream's scratch. The last block to finish (a counter in the scratch,
 * after a fence) adds the partials in block order, so the sums do not
 * depend on which block ran first, compares each output's error with its
 * relative L2 tolerance, bumps the job counters and resets the scratch.
 *
 * Built by `make` with the other kernels (nvcc -O3, sm_80 and sm_90 machine
 * code plus compute_90 PTX). It is a test instrument, not a product kernel:
 * it reads out and expect once (8 to 12 bytes an element) over at most
 * NK_CHECK_MAX_BLOCKS blocks and is not timed; normstress runs it only for
 * the --verify fraction of the jobs.
 */
#include <math_constants.h>

#include "kernels/norm_cuda_internal.cuh"

namespace nkc
{
namespace
{

constexpr int CHECK_THREADS = 256;
constexpr int CHECK_WARPS = CHECK_THREADS / 32;

/* Everything the check kernel needs, passed by value. */
struct CheckParams {
	struct nk_check_output out[NK_CHECK_MAX_OUTPUTS];
	int count;
	struct nk_check_counters *counters;
	struct nk_check_scratch *scratch;
};

__device__ __forceinline__ float load_as_float(const void *base, int64_t i, enum nk_dtype dtype)
{
	if (dtype == NK_F16)
		return to_f(static_cast<const __half *>(base)[i]);
	if (dtype == NK_BF16)
		return to_f(static_cast<const __nv_bfloat16 *>(base)[i]);
	return static_cast<const float *>(base)[i];
}

/* The squared error one element adds (NaN on one side only: infinity). */
__device__ __forceinline__ double element_err2(float out, float expect)
{
	bool out_nan = isnan(out), expect_nan = isnan(expect);
	if (out_nan || expect_nan)
		return out_nan == expect_nan ? 0.0 : CUDART_INF;
	if (out == expect)
		return 0.0; /* also equal infinities, whose difference is NaN */
	double d = (double)out - (double)expect;
	return d * d;
}

/* The block's sum of v, in thread 0 (the order is fixed by the block's shape). */
__device__ double block_sum(double v, double (*warp_sums)[CHECK_WARPS], int k)
{
	for (int off = 16; off > 0; off /= 2)
		v += __shfl_xor_sync(0xffffffffu, v, off);
	if (threadIdx.x % 32 == 0)
		warp_sums[k][threadIdx.x / 32] = v;
	__syncthreads();
	double sum = 0.0;
	if (threadIdx.x == 0) {
		for (int w = 0; w < CHECK_WARPS; w++)
			sum += warp_sums[k][w];
	}
	return sum;
}

/* The last block: sums the partials in block order, judges the job, resets the scratch. */
__device__ void check_finish(const CheckParams &p)
{
	bool mismatch = false;
	for (int k = 0; k < p.count; k++) {
		double err2 = 0.0;
		/* From L2 (__ldcg), not from a line of L1 that predates the other blocks' stores. */
		for (unsigned b = 0; b < gridDim.x; b++)
			err2 += __ldcg(&p.scratch->partial[b][k]);
		double rtol = p.out[k].rtol;
		/* Infinity (a NaN disagreement) is never within; neither is NaN. */
		if (!(err2 < rtol * rtol * p.out[k].ref_norm2))
			mismatch = true;
	}
	atomicAdd(&p.counters->checks, 1ull);
	if (mismatch)
		atomicAdd(&p.counters->mismatched, 1ull);
	p.scratch->blocks_done = 0; /* the stream's next check starts after this kernel */
}

__global__ void __launch_bounds__(CHECK_THREADS) check_outputs(const CheckParams p)
{
	__shared__ double warp_sums[NK_CHECK_MAX_OUTPUTS][CHECK_WARPS];
	__shared__ bool last;
	const int64_t stride = (int64_t)gridDim.x * CHECK_THREADS;
	for (int k = 0; k < p.count; k++) {
		const struct nk_check_output &o = p.out[k];
		double err2 = 0.0;
		for (int64_t i = (int64_t)blockIdx.x * CHECK_THREADS + threadIdx.x; i < o.n;
		     i += stride)
			err2 += element_err2(load_as_float(o.out, i, o.dtype), o.expect[i]);
		double sum = block_sum(err2, warp_sums, k);
		if (threadIdx.x == 0)
			p.scratch->partial[blockIdx.x][k] = sum;
	}
	if (threadIdx.x == 0) {
		__threadfence(); /* the partials are visible before the count says so */
		last = atomicAdd(&p.scratch->blocks_done, 1u) == gridDim.x - 1;
	}
	__syncthreads();
	if (last && threadIdx.x == 0) {
		__threadfence(); /* read the other blocks' partials after their counts */
		check_finish(p);
	}
}

bool output_valid(const struct nk_check_output &o)
{
	return o.out && o.expect && o.n >= 0 && o.rtol > 0.0f && o.ref_norm2 > 0.0 &&
	       (o.dtype == NK_F32 || o.dtype == NK_F16 || o.dtype == NK_BF16);
}

} /* namespace */
} /* namespace nkc */

using namespace nkc;

extern "C" {

int nk_cuda_check_outputs(const struct nk_check_output *outputs, int count,
			  struct nk_check_counters *counters, struct nk_check_scratch *scratch,
			  void *stream)
{
	if (!outputs || !counters || !scratch || count < 1 || count > NK_CHECK_MAX_OUTPUTS)
		return NK_EINVAL;
	CheckParams p = {};
	int64_t longest = 0;
	for (int k = 0; k < count; k++) {
		if (!output_valid(outputs[k]))
			return NK_EINVAL;
		p.out[k] = outputs[k];
		longest = outputs[k].n > longest ? outputs[k].n : longest;
	}
	p.count = count;
	p.counters = counters;
	p.scratch = scratch;
	int64_t blocks = (longest + CHECK_THREADS - 1) / CHECK_THREADS;
	blocks = blocks < 1 ? 1 : blocks > NK_CHECK_MAX_BLOCKS ? NK_CHECK_MAX_BLOCKS : blocks;
	check_outputs<<<(unsigned)blocks, CHECK_THREADS, 0, (cudaStream_t)stream>>>(p);
	return check_launch("check_outputs");
}

} /* extern "C" */
