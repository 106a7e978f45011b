/*
 * The variant policy of the CUDA backend: which kernel family and launch
 * shape a job runs when nobody asked for another (nk_cuda_variant_default).
 * The daemon caches this choice per shape and device; `normd --autotune`
 * may replace it with the fastest of nk_cuda_variant_candidates.
 *
 * How to read the table: the rules are tried from the top. A rule applies
 * to a job when its op, the storage dtype of x (16-bit: f16 and bf16;
 * fp32), the memory-efficient flag, the device's compute capability and
 * the width in columns all match, and the job uses no norm variant
 * (residual add, weight offset, FP8 output) that the rule's shape does not
 * run (`runs`). The first rule that applies and whose shape can be built
 * for the job is the default. A shape cannot be built when the job's
 * tensors are not 16-byte aligned or its width not a whole number of
 * 16-byte vectors (every family but generic and fused needs both), or when
 * the shape does not fit the device (threads, shared memory, clusters
 * before sm_90); the next rule that applies is tried then. The general
 * rules at the end take whatever the earlier ones leave, down to generic,
 * which takes any plain job; the fused family, last, takes every job that
 * uses a norm variant. Rows, the weight dtype and which weights are present
 * never matter.
 *
 * The shapes are named by their builder (norm_cuda_variant.h, built in
 * norm_cuda_variant.cu): TILED(nv, threads) holds nv 16-byte vectors a
 * thread in registers (8 elements of f16 or bf16, 4 of fp32), rows of up
 * to a warp `threads` to a block, one block a row group; TILED_WAVES and
 * TILED_CLUSTER_WAVES (forward) run the same on a grid of `w` waves of the
 * reference device's row groups, whose blocks loop over rows; SMEM(nv)
 * stages the row in shared memory; TMA(blocks) stages rows by TMA bulk
 * copies on `blocks` blocks a row.
 * Each rule says why in a sentence; the measurements behind it are in
 * BENCHMARKS.md under "Why the defaults are what they are", by the heading
 * the rule names (kernel, op, width).
 *
 * tests/unit/test_variant_policy.c records every default and candidate
 * list on a grid of 2.5 million jobs and fails on any change of them, and
 * on a rule that takes no job of that grid.
 */
#include <stdint.h>

#include "kernels/norm_cuda_variant.h"
#include "kernels/norm_kernels.h"

/* Which ops a rule takes. */
enum {
	LN_FWD = 1u << NK_LAYERNORM_FWD,
	LN_BWD = 1u << NK_LAYERNORM_BWD,
	RMS_FWD = 1u << NK_RMSNORM_FWD,
	RMS_BWD = 1u << NK_RMSNORM_BWD,
	FWD = LN_FWD | RMS_FWD,
	BWD = LN_BWD | RMS_BWD,
	ALL_OPS = FWD | BWD,
};

/* Which storage dtypes of x a rule takes: bf16, f16, either (X16), fp32. */
enum { XBF16 = 1u << 0, XF16 = 1u << 2, X16 = XBF16 | XF16, X32 = 1u << 1, ANY_X = X16 | X32 };

/* Which backward a rule takes (a forward job is a standard one). */
enum memeff_match { EITHER, STANDARD, MEMEFF };

/*
 * The norm variants (enum nk_features: residual add, weight offset, FP8
 * output) a rule's shape runs: a job that uses one outside them skips the
 * rule. PLAIN: none of them; FP8_OUT: FP8 output alone. The weight offset
 * never decides: every family adds it to gamma where gamma is read.
 */
enum { PLAIN = 0, FP8_OUT = NK_FEATURE_FP8_OUTPUT, VARIANTS = NK_FEATURES_ALL };

/* The upper bound of a rule for any width. */
#define WIDEST INT64_MAX

/*
 * A rule's `sm` beyond the compute capabilities: sm_90 (exactly) with at
 * least FAST_MEMORY_GBPS of DRAM bandwidth, the HBM3e parts such as the
 * H200, where kernels that kept up with the H100's memory run short of
 * instructions or bytes in flight and other shapes win. The threshold
 * leaves out the HBM3 parts (H100 SXM and NVL, the 96 GB GH200).
 */
enum { FAST_MEMORY = 100 };
#define FAST_MEMORY_GBPS 4500

/* One rule: when it applies, and the shape it asks for. */
struct rule {
	unsigned ops;		  /* LN_FWD, ..., ALL_OPS */
	unsigned x;		  /* XBF16, XF16, X16, X32, ANY_X */
	enum memeff_match memeff; /* EITHER, STANDARD, MEMEFF */
	unsigned runs;		  /* PLAIN, FP8_OUT, VARIANTS: the norm variants the shape runs */
	int min_sm;		  /* compute capability major at least (0: any device), or FAST_MEMORY */
	int64_t min_cols;	  /* width in columns, inclusive */
	int64_t max_cols;
	struct nk__shape_request shape;
	const char *why; /* one sentence; BENCHMARKS.md holds the numbers */
};

/* The shapes, by builder (norm_cuda_variant.h). */
/* clang-format off */
#define MOST NK__MOST_NV
#define TILED(nv, threads)                  {NK__TILED, (nv), (threads), 1, false, 0}
#define TILED_WAVES(nv, threads, w)         {NK__TILED, (nv), (threads), 1, false, (w)}
#define TILED_CLUSTER_WAVES(nv, threads, w) {NK__TILED_CLUSTER, (nv), (threads), 0, false, (w)}
#define TILED_SPLIT(nv, threads)            {NK__TILED_SPLIT, (nv), (threads), 0, false, 0}
#define SMEM(nv)                            {NK__SMEM, (nv), 0, 1, false, 0}
#define SMEM_MOST_THREADS                   {NK__SMEM_MOST_THREADS, 0, 0, 0, false, 0}
#define RING_STAGED_WEIGHTS(nv)             {NK__RING, (nv), 0, 1, true, 0}
#define TMA(blocks)                         {NK__TMA, 0, 0, (blocks), false, 0}
#define TMA_FEWEST_BLOCKS                   {NK__TMA_FEWEST_BLOCKS, 0, 0, 0, false, 0}
#define GENERIC                             {NK__GENERIC, 0, 0, 0, false, 0}
#define FUSED                               {NK__FUSED, 0, 0, 0, false, 0}
/* clang-format on */

/*
 * The rules. A new rule for plain jobs goes above the general ones (from
 * "Every job the rules above leave" on), with its reason, and its
 * measurements in BENCHMARKS.md; a family that learns to run a norm
 * variant says so in its rules' `runs`. Regenerate the golden record of
 * tests/unit/test_variant_policy.c and bump NK_VARIANT_SET (norm_kernels.h)
 * in the same commit.
 */
/* clang-format off */
static const struct rule rules[] = {
/*   ops      x      memeff    runs      sm  cols from .. to     shape */
    /* Forward, 16-bit. */
    {FWD,     X16,   EITHER,   PLAIN,    0,  1,     8192,  TILED(4, 256),
     "four vectors a thread in blocks of 256 (four blocks a multiprocessor) beat one or two "
     "vectors and tma_slice (tiled forward: 16-bit, up to 8192 columns)"},
    {RMS_FWD, XBF16, EITHER,   PLAIN,    0,  8193,  16384, TILED(4, 256),
     "four vectors a thread on one block a row beat the staged row "
     "(tiled forward: 16-bit, past 8192 columns)"},
    {LN_FWD,  X16,   EITHER,   PLAIN,    0,  12289, 16384, TILED(4, 256),
     "four vectors a thread on one block a row beat the staged row at 16384 columns "
     "(tiled forward: 16-bit, past 8192 columns)"},
    {FWD,     X16,   EITHER,   PLAIN,    0,  8193,  WIDEST, SMEM(4),
     "wider 16-bit rows leave the tiled kernel one or two blocks a multiprocessor, and it ran "
     "unevenly there where the staged row did not (block_smem forward: 16-bit, past 8192 columns)"},
    /* Forward, fp32. */
    {RMS_FWD, X32,   EITHER,   PLAIN,    FAST_MEMORY, 512, 4096, TILED(8, 256),
     "eight vectors a thread keep more bytes in flight than two, which the H200's memory "
     "needs (tiled forward: fp32)"},
    {RMS_FWD, X32,   EITHER,   PLAIN,    0,  1,     4096,  TILED(2, 256),
     "two vectors a thread ran fastest for fp32 RMSNorm rows up to 1024 vectors "
     "(tiled forward: fp32)"},
    {LN_FWD,  X32,   EITHER,   PLAIN,    0,  1,     8192,  TILED(4, 256),
     "four vectors a thread ran fastest for fp32 LayerNorm rows up to 2048 vectors "
     "(tiled forward: fp32)"},
    {FWD,     X32,   EITHER,   PLAIN,    0,  1,     WIDEST, TILED(MOST, 256),
     "wider fp32 rows on one block hold the most a thread can, and keep enough bytes in flight "
     "that staging them does not pay (tiled forward: fp32)"},
    /* Backward on GPUs of FAST_MEMORY (the H200); the H100 keeps the rules below. */
    {BWD,     X16,   EITHER,   PLAIN,    FAST_MEMORY, 1, 128, TMA(1),
     "tma_slice rows on a warp's lanes beat the tiled rows "
     "(tiled backward: the common job, on the H200)"},
    {BWD,     X16,   STANDARD, PLAIN,    FAST_MEMORY, 8192, 8192, TILED(MOST, 256),
     "the common job's tiled backward, a block of 512 threads a row, beat tma_slice "
     "(tiled backward: the common job, on the H200)"},
    {LN_BWD,  X16,   MEMEFF,   PLAIN,    FAST_MEMORY, 8192, 8192, TMA_FEWEST_BLOCKS,
     "tma_slice beat the tiled LayerNorm rows, which stay on bwd_tiled "
     "(tiled backward: the common job, on the H200)"},
    {BWD,     X32,   EITHER,   PLAIN,    FAST_MEMORY, 513, 1024, TILED(2, 256),
     "the rows held in registers beat the staged row "
     "(tiled backward: the common job, on the H200)"},
    {BWD,     X32,   MEMEFF,   PLAIN,    FAST_MEMORY, 1025, 2048, TILED(2, 256),
     "memory-efficient rows held in registers beat the staged row "
     "(tiled backward: the common job, on the H200)"},
    {BWD,     X32,   EITHER,   PLAIN,    FAST_MEMORY, 2049, 4096, TMA_FEWEST_BLOCKS,
     "tma_slice beat the staged row (tiled backward: the common job, on the H200)"},
    /* Backward, fp32 rows of up to 8192 columns. */
    {BWD,     X32,   EITHER,   PLAIN,    9,  257,   512,   TMA(1),
     "tma_slice rows on a warp's lanes beat the tiled kernel on these fp32 rows "
     "(tma_slice backward: fp32, 257-512 columns)"},
    {BWD,     X32,   EITHER,   PLAIN,    0,  513,   1024,  SMEM(1),
     "the staged row beat the row held in registers, one vector a thread up to 256 vectors "
     "(block_smem backward: fp32, 513-4096 columns)"},
    {BWD,     X32,   EITHER,   PLAIN,    0,  1025,  4096,  SMEM(2),
     "the staged row beat the row held in registers, two vectors a thread from 257 vectors "
     "(block_smem backward: fp32, 513-4096 columns)"},
    {BWD,     X32,   MEMEFF,   PLAIN,    0,  4097,  8192,  RING_STAGED_WEIGHTS(4),
     "the ring with the weights in shared memory beat every other shape on these rows "
     "(block_smem backward: fp32 memory-efficient, 4097-8192 columns)"},
    /* Backward, rows of 1024 vectors and more, sm_90. */
    {BWD,     X16,   STANDARD, PLAIN,    9,  8192,  WIDEST, TMA_FEWEST_BLOCKS,
     "from 1024 vectors a row tma_slice beat block_row, block_smem and the split rows "
     "(tma_slice backward: rows of 1024 vectors and more)"},
    {BWD,     X32,   STANDARD, PLAIN,    9,  4096,  WIDEST, TMA_FEWEST_BLOCKS,
     "from 1024 vectors a row tma_slice beat block_row, block_smem and the split rows "
     "(tma_slice backward: rows of 1024 vectors and more)"},
    {BWD,     ANY_X, MEMEFF,   PLAIN,    9,  8193,  WIDEST, TMA_FEWEST_BLOCKS,
     "the same for memory-efficient rows of two blocks and more; a row of one block stays on "
     "block_row, which beat tma_slice there (tma_slice backward: memory-efficient, one block)"},
    /* Every job the rules above leave. */
    {ALL_OPS, ANY_X, EITHER,   PLAIN,    0,  1,     WIDEST, TILED(MOST, 256),
     "a row that fits one block's registers is read from memory once (tiled)"},
    {ALL_OPS, ANY_X, EITHER,   PLAIN,    0,  1,     WIDEST, SMEM_MOST_THREADS,
     "a row too wide for a block's registers is staged in shared memory where it fits "
     "(block_smem)"},
    {BWD,     ANY_X, EITHER,   PLAIN,    0,  1,     WIDEST, TILED_SPLIT(MOST, 256),
     "a backward row wider still runs in column slices after a row-sums kernel, which beat "
     "clusters (tiled backward: rows wider than a block)"},
    {FWD,     ANY_X, EITHER,   PLAIN,    0,  1,     WIDEST, TILED_CLUSTER_WAVES(MOST, 256, 4),
     "a forward row wider still is shared by a cluster of blocks (sm_90), on a grid of four "
     "waves, which beat a cluster a row group (tiled forward: persistent grids)"},
    {ALL_OPS, ANY_X, EITHER,   PLAIN,    0,  1,     WIDEST, GENERIC,
     "any width and alignment: scalar loads, several passes over the row (generic)"},
    /* Jobs that use a norm variant (docs/VARIANTS.md); plain jobs never come this far. */
    {FWD,     X16,   EITHER,   FP8_OUT,  0,  1,     8192,  TILED_WAVES(4, 256, 4),
     "the FP8 forward is bound by instructions: a grid of four waves whose blocks loop over "
     "rows pays each block's setup once for several (tiled forward: persistent grids)"},
    {FWD,     X16,   EITHER,   VARIANTS, 0,  1,     8192,  TILED(4, 256),
     "the tiled forward runs the variants in the pass it reads the row in, with the plain "
     "16-bit rows' shape (norm variants: forward)"},
    {FWD,     X16,   EITHER,   VARIANTS, 0,  8193,  WIDEST, TILED_WAVES(MOST, 256, 4),
     "a wider 16-bit variant row on one block, on a grid of four waves "
     "(tiled forward: persistent grids)"},
    {FWD,     ANY_X, EITHER,   VARIANTS, 0,  1,     WIDEST, TILED(MOST, 256),
     "a variant row that fits one block's registers is read from memory once "
     "(norm variants: forward)"},
    {FWD,     ANY_X, EITHER,   VARIANTS, 0,  1,     WIDEST, TILED_CLUSTER_WAVES(MOST, 256, 4),
     "a variant row wider still is shared by a cluster of blocks (sm_90), on a grid of four "
     "waves (tiled forward: persistent grids)"},
    {BWD,     X16,   EITHER,   VARIANTS, 9,  1,     512,   TMA(1),
     "rows on a warp's lanes staged by tma_slice with their ds beat the tiled rows "
     "(norm variants: backward)"},
    {BWD,     X32,   EITHER,   VARIANTS, 9,  4096,  WIDEST, TMA_FEWEST_BLOCKS,
     "fp32 rows of 1024 vectors and more: tma_slice stages ds beside x and dy "
     "(norm variants: backward)"},
    {BWD,     X16,   EITHER,   VARIANTS, 0,  1,     4096,  TILED(1, 256),
     "threads of one vector load ds before the row's reduction, hiding its latency "
     "(norm variants: backward)"},
    {BWD,     X32,   EITHER,   VARIANTS, 0,  1,     4096,  TILED(2, 256),
     "threads of two fp32 vectors load ds before the row's reduction, hiding its latency "
     "(norm variants: backward)"},
    {BWD,     X16,   EITHER,   VARIANTS, 9,  8192,  WIDEST, TMA_FEWEST_BLOCKS,
     "16-bit rows of 1024 vectors and more: tma_slice stages ds beside x and dy "
     "(norm variants: backward)"},
    {BWD,     ANY_X, EITHER,   VARIANTS, 0,  1,     WIDEST, TILED(MOST, 256),
     "wider rows on one block add ds to dx as they store it (norm variants: backward)"},
    {BWD,     ANY_X, EITHER,   VARIANTS, 0,  1,     WIDEST, TILED_SPLIT(MOST, 256),
     "a wider variant row runs in column slices after the row sums, as plain rows do "
     "(norm variants: backward)"},
    {ALL_OPS, ANY_X, EITHER,   VARIANTS, 0,  1,     WIDEST, FUSED,
     "any width, alignment and device: the fused family runs every norm variant, one "
     "element a thread at a time (docs/VARIANTS.md)"},
};
/* clang-format on */

#define RULE_COUNT ((int)(sizeof(rules) / sizeof(rules[0])))

static bool rule_applies(const struct rule *r, const struct nk_norm_args *a,
			 const struct nk_device_info *dev)
{
	const bool memeff = (a->flags & NK_MEMORY_EFFICIENT) != 0;
	const unsigned x = a->dtype == NK_BF16 ? XBF16 : a->dtype == NK_F16 ? XF16 : X32;

	const unsigned runs = r->runs | NK_FEATURE_WEIGHT_OFFSET; /* every family runs it */
	if (!(r->ops & (1u << a->op)) || !(r->x & x) || (nk_norm_features(a) & ~runs) != 0)
		return false;
	if ((r->memeff == STANDARD && memeff) || (r->memeff == MEMEFF && !memeff))
		return false;
	const bool device = r->min_sm == FAST_MEMORY
				? dev->cc_major == 9 && dev->mem_gbps >= FAST_MEMORY_GBPS
				: dev->cc_major >= r->min_sm;
	return device && a->cols >= r->min_cols && a->cols <= r->max_cols;
}

int nk__policy_pick(const struct nk_norm_args *args, const struct nk_device_info *dev,
		    struct nk_variant *out)
{
	for (int i = 0; i < RULE_COUNT; i++) {
		if (rule_applies(&rules[i], args, dev) &&
		    nk__variant_build(args, dev, &rules[i].shape, out))
			return i;
	}
	return -1;
}

int nk__policy_rule_count(void)
{
	return RULE_COUNT;
}

const char *nk__policy_rule_why(int i)
{
	return i >= 0 && i < RULE_COUNT ? rules[i].why : NULL;
}

int nk_cuda_variant_default(const struct nk_norm_args *args, const struct nk_device_info *dev,
			    struct nk_variant *out)
{
	if (!args || !dev || !out || nk_norm_check(args, NULL) != NK_OK)
		return NK_EINVAL;
	return nk__policy_pick(args, dev, out) >= 0 ? NK_OK : NK_EUNSUPPORTED;
}
