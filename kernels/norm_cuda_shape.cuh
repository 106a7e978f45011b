/*
 * The variant encoding and the family limits (private to kernels/): how the
 * fields and the param word of a struct nk_variant decode into a launch
 * Shape, and how many threads, vectors and blocks each kernel family
 * allows. The builders and fit checks that use them are in
 * norm_cuda_variant.cu; the rules that choose among them in
 * norm_cuda_policy.c.
 */
#ifndef NORMD_NORM_CUDA_SHAPE_CUH
#define NORMD_NORM_CUDA_SHAPE_CUH

#include <stdint.h>

#include "kernels/norm_kernels.h"

namespace nkc
{

/* Decoded launch shape of a variant. */
struct Shape {
	int family;
	int threads;
	int R;
	int G;
	int NV;
	int K;		     /* blocks sharing a row */
	bool split;	     /* backward: K column slices after a row-sums kernel, no cluster */
	int units_cap;	     /* most row groups (clusters) in the grid; tiled forward: 0 for
				one block a row group, else its blocks loop over rows */
	bool ring;	     /* block_smem backward: one row staged, `prefetch` of the next */
	int prefetch;	     /* ring: vectors a thread of the next row staged ahead (<= NV) */
	bool staged_weights; /* ring, memory-efficient: gamma, beta, rg in shared memory */
	int stages;	     /* tma_slice: rows staged in shared memory (>= 3) */
};

/*
 * The variant param word: NV | K << 8 | units_cap << 16 | split << 31. In
 * the block_smem family (never split) bit 31 marks the ring backward
 * instead: its NV (at most 8) takes bits 0-6, bit 7 says "weights staged",
 * K (at most 8) bits 8-11 and the prefetch depth bits 12-15.
 */
constexpr int MAX_UNITS_CAP = 0x7fff;
static inline uint32_t shape_param(int nv, int k, int cap, bool split)
{
	return (uint32_t)nv | (uint32_t)k << 8 | (uint32_t)cap << 16 | (uint32_t)split << 31;
}
static inline uint32_t ring_param(int nv, int k, int prefetch, bool staged_weights, int cap)
{
	return (uint32_t)nv | (uint32_t)staged_weights << 7 | (uint32_t)k << 8 |
	       (uint32_t)prefetch << 12 | (uint32_t)cap << 16 | 1u << 31;
}

/* The tma_slice param word: NV | stages << 4 | K << 8 | units_cap << 16. */
static inline uint32_t tma_param(int nv, int stages, int k, int cap)
{
	return (uint32_t)nv | (uint32_t)stages << 4 | (uint32_t)k << 8 | (uint32_t)cap << 16;
}

/* Decodes a variant's fields and param word (norm_cuda_variant.cu). */
Shape shape_of(const struct nk_variant *v);

/*
 * What a tiled thread holds: forward up to 32 elements, backward (which also
 * keeps dgamma/dbeta sums) up to 2 vectors; more spills registers.
 */
constexpr int FWD_MAX_ELEMS = 32;
/* Vectors a thread of a forward that runs norm variants holds: more spill (fp32). */
constexpr int FWD_VAR_MAX_NV = 4;
constexpr int BWD_MAX_NV = 2;
/* Elements a block_smem backward thread keeps dgamma/dbeta sums for. */
constexpr int SMEM_BWD_MAX_ELEMS = 32;
/* Threads per block of a block_smem backward cluster, at most. */
constexpr int SMEM_CLUSTER_MAX_THREADS = 256;
/* Threads per block of the block_smem forward, at most. */
constexpr int SMEM_FWD_MAX_THREADS = 1024;
/* Threads per block of the tiled kernels, at most; backward on sm_80. */
constexpr int MAX_THREADS = 512;
constexpr int BWD_MAX_THREADS_SM80 = 256;
/*
 * tma_slice (norm_cuda_*_tma.cu). TMA_ELEMS: elements of a row a backward
 * thread owns; their weights and dgamma/dbeta sums stay in registers, at
 * most 128 registers a thread with 512 threads, so blocks of up to 256
 * threads fit twice on a multiprocessor.
 */
constexpr int TMA_ELEMS = 16;
constexpr int TMA_MAX_STAGES = 15; /* rows staged at most */
constexpr int TMA_STAGES = 4;	   /* rows staged by default (deeper is no faster) */
constexpr int TMA_MAX_CLUSTER = 8;
constexpr int TMA_SUM_SLOTS = 4; /* rows whose cluster sums are in flight at once */
/* The backward's slot-reuse argument (norm_cuda_bwd_tma.cu) needs 4; slots are masked. */
static_assert(TMA_SUM_SLOTS >= 4 && (TMA_SUM_SLOTS & (TMA_SUM_SLOTS - 1)) == 0,
	      "row-sum slots: a power of two, at least 4");

/* Threads per block of the ring backward (bwd_smem_ring), at most. */
constexpr int ring_max_threads(bool cluster, int elems)
{
	return cluster && elems > SMEM_BWD_MAX_ELEMS / 2 ? SMEM_CLUSTER_MAX_THREADS : MAX_THREADS;
}

} /* namespace nkc */

#endif /* NORMD_NORM_CUDA_SHAPE_CUH */
