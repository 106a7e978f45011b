/*
 * Between the variant policy and the variant mechanism of the CUDA backend
 * (private to kernels/, C and CUDA C++ alike).
 *
 * The policy (norm_cuda_policy.c) names the shape it wants for a job with
 * a struct nk__shape_request; the mechanism (norm_cuda_variant.cu) builds
 * that shape for the job and device, as a struct nk_variant, or refuses it
 * when the shape cannot run the job there (alignment, width, threads,
 * shared memory, clusters before sm_90). Neither reaches the CUDA runtime.
 */
#ifndef NORMD_NORM_CUDA_VARIANT_H
#define NORMD_NORM_CUDA_VARIANT_H

#include <stdbool.h>

#include "kernels/norm_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The shapes a rule may ask for, by the builder that makes them. */
enum nk__build {
	/* warp_rows or block_row: `nv` vectors a thread in registers, rows of
	   up to a warp `threads` to a block, a wider row one block of up to
	   512 threads (256 for backward on sm_80); refused if wider still */
	NK__TILED,
	/* the same, a forward row wider than a block on a cluster of 2, 4 or
	   8 blocks (sm_90) */
	NK__TILED_CLUSTER,
	/* the same, a backward row wider than a block in up to 16 column
	   slices after a row-sums kernel */
	NK__TILED_SPLIT,
	/* block_smem: the row staged in shared memory, `nv` vectors a thread,
	   `blocks` blocks a row */
	NK__SMEM,
	/* block_smem with the fewest vectors a thread (the most threads) that
	   fit; backward on one block, else a cluster of 2 (sm_90) */
	NK__SMEM_MOST_THREADS,
	/* block_smem ring backward: one row staged and as much of the next as
	   fits, `nv` vectors a thread, `blocks` blocks a row */
	NK__RING,
	/* tma_slice (sm_90): rows staged by TMA bulk copies, `blocks` blocks a
	   row, one block a multiprocessor */
	NK__TMA,
	/* tma_slice backward on the fewest blocks a row whose slices fit 512
	   threads and whose stages fit shared memory; where that leaves a
	   multiprocessor under 16 warps and the rows have no ds, on the fewest
	   (at most 4) that fit 256 threads, two blocks a multiprocessor */
	NK__TMA_FEWEST_BLOCKS,
	/* generic: scalar loads, any width, any alignment; refuses no plain job */
	NK__GENERIC,
	/* fused (norm_cuda_fused.cu): the one shape of jobs that use a norm
	   variant (residual add, weight offset, FP8 output); refuses plain jobs */
	NK__FUSED,
};

/* nv of a request: the most vectors a thread the family holds. */
#define NK__MOST_NV 0

/* A shape a rule asks for; the fields its builder does not read are 0. */
struct nk__shape_request {
	enum nk__build build;
	int nv;		     /* 16-byte vectors a thread, or NK__MOST_NV */
	int threads;	     /* tiled: threads of a block of rows that fit a warp */
	int blocks;	     /* blocks sharing a row (block_smem, ring, tma_slice) */
	bool staged_weights; /* ring, memory-efficient: gamma, beta, 1 / clamp(gamma)
				in shared memory */
	int waves;	     /* tiled forward: a grid of this many times the row groups the
				reference device holds at once, each block looping over
				rows (0: a block a row group) */
};

/*
 * Builds the variant `req` names for a valid job (nk_norm_check) on `dev`
 * into *out. False when the shape cannot run the job on the device; *out
 * is then undefined. Thread-safe; no CUDA call.
 */
bool nk__variant_build(const struct nk_norm_args *args, const struct nk_device_info *dev,
		       const struct nk__shape_request *req, struct nk_variant *out);

/*
 * The rule of the policy table that picks the default of a valid job on
 * `dev`, its variant into *out: the rule's index, or -1 if none (the last
 * rule takes every job, so never). For tests and for explaining a choice.
 */
int nk__policy_pick(const struct nk_norm_args *args, const struct nk_device_info *dev,
		    struct nk_variant *out);

/* The number of rules, and the one-sentence reason of rule `i` (NULL past the end). */
int nk__policy_rule_count(void);
const char *nk__policy_rule_why(int i);

#ifdef __cplusplus
}
#endif

#endif /* NORMD_NORM_CUDA_VARIANT_H */
