/*
 * Private to kernels/norm_cuda_*.cu: the one include of the CUDA files.
 *
 * The kernels come in four families:
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

/* The variant encoding and the families' limits: Shape, the param words. */
#include "kernels/norm_cuda_shape.cuh"
/* Params, the launchers, the workspace layout and the host launch helpers. */
#include "kernels/norm_cuda_launch.cuh"
/* Inline PTX: streaming loads, cp.async, TMA, mbarriers, clusters. */
#include "kernels/norm_cuda_ptx.cuh"
/* Row-group, block and cluster reductions in a fixed order. */
#include "kernels/norm_cuda_reduce.cuh"
/* Conversions, element math, partial rows, tma_slice barriers. */
#include "kernels/norm_cuda_device.cuh"

#endif /* NORMD_NORM_CUDA_INTERNAL_CUH */
