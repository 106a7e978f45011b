/*
 * The variant mechanism of the CUDA backend: what a struct nk_variant
 * means, which variants exist for a job and device, and whether one fits.
 *   - shape_of decodes a variant into its launch Shape (the encoding:
 *     norm_cuda_shape.cuh);
 *   - one builder a kernel family makes the variant of a requested shape
 *     for a job and device, or refuses (tiled_variant, smem_variant,
 *     ring_variant, tma_variant, generic_variant); nk__variant_build is
 *     their entry for the policy (norm_cuda_policy.c, which decides the
 *     default);
 *   - the fit checks behind nk_cuda_variant_fits accept any variant that
 *     can run the job, whoever built it (a persisted choice, a caller's);
 *   - nk_cuda_variant_candidates lists what the autotuner times;
 *     nk_variant_name names a variant for logs and replies.
 *
 * What the builders and fit checks keep to:
 *   - every family but generic needs 16-byte aligned tensors and cols %
 *     VEC == 0 (VEC = 16 bytes of the storage type);
 *   - a tiled thread holds up to 32 elements (forward) or 2 vectors
 *     (backward, which also keeps dgamma/dbeta sums); rows of at most 32
 *     such threads go to a piece of a warp, wider rows to a block of up to
 *     512 threads (256 for backward on sm_80), wider still to a cluster of
 *     2, 4 or 8 blocks (sm_90) or, backward, to up to 16 column slices;
 *   - block_smem stages rows where the stages fit the device's opt-in
 *     shared memory: backward on one block of up to 512 threads (32
 *     elements a thread) or a cluster (sm_90), forward on one block of up
 *     to 1024 threads;
 *   - tma_slice runs on sm_90 only;
 *   - the backward grid is capped by units_cap, computed for a reference
 *     device of REF_SMS multiprocessors (tma_slice: the clusters an H100
 *     SXM holds) and never from the actual one, so the partial rows (hence
 *     the weight gradients' bits) depend on the shape and the variant alone;
 *     a tiled forward's cap (0: none) is a few waves of the reference
 *     device's row groups (fwd_units_cap).
 *
 * Host code only, and no call here reaches the CUDA runtime: the policy and
 * the candidates run without a GPU (tests/unit/test_variant_policy.c).
 */
#include <stdio.h>
#include <string.h>

#include "kernels/norm_cuda_internal.cuh"
#include "kernels/norm_cuda_variant.h"

namespace nkc
{

Shape shape_of(const struct nk_variant *v)
{
	Shape s;
	s.family = v->family;
	s.threads = v->threads;
	s.R = v->rows_per_block > 0 ? v->rows_per_block : 1;
	s.G = s.threads / s.R;
	s.NV = (int)(v->param & 0xff);
	s.K = (int)((v->param >> 8) & 0xff);
	s.units_cap = (int)((v->param >> 16) & MAX_UNITS_CAP);
	s.split = (v->param >> 31) != 0;
	s.ring = false;
	s.prefetch = 0;
	s.staged_weights = false;
	s.stages = 0;
	if (s.family == NK_FAMILY_TMA_SLICE) { /* see tma_param */
		s.NV = (int)(v->param & 0xf);
		s.stages = (int)((v->param >> 4) & 0xf);
	}
	if (s.family == NK_FAMILY_BLOCK_SMEM && s.split) { /* see ring_param */
		s.split = false;
		s.ring = true;
		s.NV = (int)(v->param & 0x7f);
		s.staged_weights = (v->param & 0x80) != 0;
		s.K = (int)((v->param >> 8) & 0xf);
		s.prefetch = (int)((v->param >> 12) & 0xf);
	}
	return s;
}

/* ---- facts of a job the builders share ------------------------------------ */

/* Whether every tensor the tiled kernels load as vectors allows it. */
static bool tiled_layout_ok(const struct nk_norm_args *a)
{
	if (a->cols % vec_of(a) != 0 || !aligned16(a->x) || !aligned16(a->gamma) ||
	    !aligned16(a->beta))
		return false;
	if (is_bwd(a))
		return aligned16(a->dy) && aligned16(a->dx) && aligned16(a->ds);
	return aligned16(a->y) && aligned16(a->residual) && aligned16(a->residual_out);
}

/*
 * The norm variants (enum nk_features, docs/VARIANTS.md) a family runs:
 * every family the weight offset (added to gamma where it is read), the
 * tiled family the residual add (forward; backward: ds) and FP8 output, the
 * tma_slice backward ds, the fused family all of them anywhere.
 */
static unsigned family_features(int family, const struct nk_norm_args *a)
{
	if (family == NK_FAMILY_FUSED || family == NK_FAMILY_WARP_ROWS ||
	    family == NK_FAMILY_BLOCK_ROW)
		return NK_FEATURES_ALL;
	if (family == NK_FAMILY_TMA_SLICE && is_bwd(a)) /* stages ds beside x and dy */
		return NK_FEATURE_WEIGHT_OFFSET | NK_FEATURE_RESIDUAL;
	return NK_FEATURE_WEIGHT_OFFSET;
}

static int pow2_ceil(int64_t n)
{
	int p = 1;
	while (p < n)
		p <<= 1;
	return p;
}

/* The largest vectors-a-thread count the tiled kernels allow. */
static int max_nv(const struct nk_norm_args *a)
{
	if (is_bwd(a))
		return BWD_MAX_NV;
	const int nv = FWD_MAX_ELEMS / vec_of(a);
	const bool var = nk_norm_features(a) & ~NK_FEATURE_WEIGHT_OFFSET; /* offset: plain kernels */
	return var && nv > FWD_VAR_MAX_NV ? FWD_VAR_MAX_NV : nv;
}

/* Threads a tiled block may have for this job on this device. */
static int block_limit(const struct nk_norm_args *a, const struct nk_device_info *dev)
{
	return is_bwd(a) && dev->cc_major < 9 ? BWD_MAX_THREADS_SM80 : MAX_THREADS;
}

/* ---- the reference device of the backward grid caps ------------------------ */

/* Multiprocessors of the reference device the backward grid caps assume. */
constexpr int REF_SMS = 132;

/* Shared memory of a multiprocessor of the reference device (sm_90). */
constexpr size_t REF_SMEM_PER_SM = 228 * 1024;

/* Backward grid cap of a tiled shape, from the reference device. */
static int bwd_units_cap(int threads, int elems, int K)
{
	int regs = 48 + 5 * elems; /* estimate: the kernels use about this */
	int per_sm = 2048 / threads;
	int by_regs = 65536 / (threads * ((regs + 7) / 8 * 8));
	if (by_regs < per_sm)
		per_sm = by_regs;
	if (per_sm < 1)
		per_sm = 1;
	int cap = REF_SMS * per_sm / K;
	if (cap > MAX_UNITS_CAP)
		cap = MAX_UNITS_CAP;
	return cap < 1 ? 1 : cap;
}

/*
 * Forward grid cap of a tiled shape: `waves` times the row groups the
 * reference device holds at once (64 registers a thread, 128 with the
 * residual add), so each block loops over rows and its setup is paid once
 * for several.
 */
static int fwd_units_cap(int threads, int K, bool residual, int waves)
{
	int per_sm = (residual ? 512 : 1024) / threads;
	int cap = REF_SMS * (per_sm < 1 ? 1 : per_sm) * waves / K;
	if (cap > MAX_UNITS_CAP)
		cap = MAX_UNITS_CAP;
	return cap < 1 ? 1 : cap;
}

/*
 * Clusters of K blocks the reference device holds at once with one or two
 * blocks a multiprocessor: an H100 SXM (132 SMs), as
 * cudaOccupancyMaxActiveClusters reported it for 256-512 threads and 200
 * (100) KB of shared memory a block (BENCHMARKS.md, tma_slice backward:
 * the reference clusters). Clusters do not span GPCs, so K = 4 gets 30
 * clusters, not 132 / 4; a grid of more clusters than fit would run a
 * second, nearly empty wave.
 */
static int tma_units_cap(int K, int per_sm)
{
	static const int ref[2][TMA_MAX_CLUSTER + 1] = {{0, 132, 66, 39, 30, 22, 17, 15, 15},
							{0, 264, 132, 79, 62, 47, 39, 32, 30}};
	if (K < 1 || K > TMA_MAX_CLUSTER || per_sm < 1 || per_sm > 2)
		return 1;
	return ref[per_sm - 1][K];
}

/* ---- tiled: warp_rows, block_row -------------------------------------------- */

/* Most blocks sharing a row: a portable cluster, or split column slices. */
constexpr int MAX_CLUSTER = 8;
constexpr int MAX_SLICES = 16;

/*
 * A tiled variant holding up to `nv` vectors a thread, with blocks of
 * `warp_threads` for rows that fit a warp and of at most `block_max` threads
 * for wider rows; rows wider than one block go to a cluster or, with
 * `split` (backward), to column slices. False if none fits the job.
 */
static bool tiled_variant(const struct nk_norm_args *a, const struct nk_device_info *dev, int nv,
			  int warp_threads, int block_max, bool split, struct nk_variant *v)
{
	const int vec = vec_of(a);
	const int64_t nvec = a->cols / vec;
	int G, R, K = 1;

	if (!tiled_layout_ok(a))
		return false;
	split = split && is_bwd(a); /* forward rows never split: clusters (sm_90) only */
	if (block_max > block_limit(a, dev))
		block_max = block_limit(a, dev);
	if (warp_threads > block_limit(a, dev))
		warp_threads = block_limit(a, dev);
	if (nvec <= 32 * (int64_t)nv) {
		G = pow2_ceil((nvec + nv - 1) / nv);
		nv = pow2_ceil((nvec + G - 1) / G);
		R = warp_threads / G;
	} else {
		const int kmax = split ? MAX_SLICES : MAX_CLUSTER;
		while (K <= kmax && nvec > (int64_t)block_max * nv * K)
			K *= 2;
		if (K > kmax || (K > 1 && !split && dev->cc_major < 9))
			return false;
		G = (int)((nvec + (int64_t)nv * K - 1) / ((int64_t)nv * K));
		G = (G + 31) / 32 * 32;
		R = K == 1 && G < 256 ? 256 / G : 1;
	}
	memset(v, 0, sizeof(*v));
	v->family = G <= 32 ? NK_FAMILY_WARP_ROWS : NK_FAMILY_BLOCK_ROW;
	v->threads = (uint16_t)(G * R);
	v->rows_per_block = (uint16_t)R;
	v->vec_elems = (uint16_t)vec;
	split = split && K > 1;
	v->param = shape_param(nv, K, is_bwd(a) ? bwd_units_cap(G * R, nv * vec, K) : 0, split);
	return true;
}

/*
 * Sets a tiled forward variant's grid to `waves` times the row groups the
 * reference device holds at once, or (0) to one block a row group. A
 * backward variant keeps its cap (bwd_units_cap).
 */
static void set_forward_waves(const struct nk_norm_args *a, int waves, struct nk_variant *v)
{
	if (is_bwd(a))
		return;
	const Shape s = shape_of(v);
	const int cap = waves > 0 ? fwd_units_cap(s.threads, s.K, a->residual != NULL, waves) : 0;
	v->param = shape_param(s.NV, s.K, cap, false);
}

static bool tiled_fits(const struct nk_norm_args *a, const struct nk_device_info *dev,
		       const struct nk_variant *v, const Shape &s)
{
	const int vec = vec_of(a);
	const int64_t nvec = a->cols / vec;

	if (!tiled_layout_ok(a) || v->vec_elems != vec)
		return false;
	if (s.NV < 1 || s.NV > max_nv(a) || (s.NV & (s.NV - 1)) != 0)
		return false;
	if (s.threads < 32 || s.threads > block_limit(a, dev) || s.threads % 32 != 0 ||
	    s.threads % s.R != 0)
		return false;
	if (s.K < 1 || s.K > (s.split ? MAX_SLICES : MAX_CLUSTER) || (s.K & (s.K - 1)) != 0)
		return false;
	if (s.split && (s.K == 1 || !is_bwd(a)))
		return false;
	if (s.K > 1 && (s.R != 1 || (!s.split && dev->cc_major < 9)))
		return false;
	if (s.family == NK_FAMILY_WARP_ROWS && (s.G > 32 || (s.G & (s.G - 1)) != 0))
		return false;
	if (s.family == NK_FAMILY_BLOCK_ROW && s.G % 32 != 0)
		return false;
	if (is_bwd(a) && s.units_cap < 1)
		return false;
	return (int64_t)s.G * s.K * s.NV >= nvec;
}

/* ---- block_smem, and its ring backward ------------------------------------- */

size_t smem_stage_bytes(const struct nk_norm_args *a, const Shape &s,
			const struct nk_device_info *dev)
{
	/*
	 * Forward: two or three rows of x. Three where two already leave room
	 * for only one block a multiprocessor (rows over 56 KB) and three fit,
	 * for RMSNorm only: LayerNorm's gamma and beta would lose what L1 they
	 * had (BENCHMARKS.md, block_smem forward: stages). Backward: a block's
	 * slots of x or y and dy, two stages (a rule of the shape alone: its
	 * grid cap must not depend on the device).
	 */
	if (!is_bwd(a)) {
		const size_t row = (size_t)a->cols * nk_dtype_size(a->dtype);
		const bool three =
		    !is_ln(a) && row > (size_t)56 * 1024 &&
		    3 * row + sizeof(RedSmem) + 1024 <= dev->max_smem_per_block_optin;
		return (three ? 3 : 2) * row;
	}
	if (!s.ring)
		return (size_t)2 * 2 * 16 * (size_t)s.NV * (size_t)s.threads;
	/* Ring: NV + prefetch slots of x and dy; staged weights: three fp32 planes. */
	size_t bytes = (size_t)2 * 16 * (size_t)(s.NV + s.prefetch) * (size_t)s.threads;
	if (s.staged_weights && (a->flags & NK_MEMORY_EFFICIENT))
		bytes += (size_t)3 * sizeof(float) * (size_t)(s.NV * vec_of(a)) * (size_t)s.threads;
	return bytes;
}

/* Whether a block_smem launch of `threads` threads fits the device's shared memory. */
static bool smem_fits(const struct nk_norm_args *a, const struct nk_device_info *dev,
		      const Shape &s)
{
	/* The static reduction scratch and the 1 KB the runtime reserves. */
	const size_t fixed = sizeof(RedSmem) + 1024;
	return dev->cc_major >= 8 &&
	       smem_stage_bytes(a, s, dev) + fixed <= dev->max_smem_per_block_optin;
}

/* Backward grid cap of a block_smem shape, from the reference device. */
static int smem_units_cap(const struct nk_norm_args *a, const Shape &s)
{
	const size_t ref_smem = 228 * 1024; /* shared memory of an sm_90 multiprocessor */
	/* Estimates: the dgamma/dbeta sums and 40; clusters (256 threads) take more. */
	const int elems = s.NV * vec_of(a);
	int regs = s.K > 1 ? 48 + 5 * elems : 40 + 2 * elems;
	int per_sm = 2048 / s.threads;
	int by_regs = 65536 / (s.threads * ((regs + 7) / 8 * 8));
	int by_smem = (int)(ref_smem / (smem_stage_bytes(a, s, NULL) + sizeof(RedSmem) + 1024));
	if (by_regs < per_sm)
		per_sm = by_regs;
	if (by_smem < per_sm)
		per_sm = by_smem;
	if (per_sm < 1)
		per_sm = 1;
	return REF_SMS * per_sm / s.K;
}

/*
 * The threads a block_smem row of `a` needs with `nv` vectors a thread on K
 * blocks (whole warps), and the variant fields that do not depend on the
 * kernel (the caller sets param). Returns the thread count.
 */
static int64_t smem_fill(const struct nk_norm_args *a, int nv, int K, struct nk_variant *v)
{
	const int vec = vec_of(a);
	const int64_t nvec = a->cols / vec;
	int64_t threads = (nvec + (int64_t)nv * K - 1) / ((int64_t)nv * K);
	threads = (threads + 31) / 32 * 32;
	memset(v, 0, sizeof(*v));
	v->family = NK_FAMILY_BLOCK_SMEM;
	v->threads = (uint16_t)(threads < 65535 ? threads : 65535);
	v->rows_per_block = 1;
	v->vec_elems = (uint16_t)vec;
	return threads;
}

/*
 * A block_smem variant: a block of up to `block_max` threads a row, `nv`
 * vectors a thread (backward: at most SMEM_BWD_MAX_ELEMS elements, whose
 * dgamma/dbeta sums stay in registers). False if none fits the job.
 */
static bool smem_variant(const struct nk_norm_args *a, const struct nk_device_info *dev, int nv,
			 int K, int block_max, struct nk_variant *v)
{
	const int vec = vec_of(a);
	const int tmax = is_bwd(a) ? MAX_THREADS : SMEM_FWD_MAX_THREADS;

	if (!tiled_layout_ok(a) || nv < 1 || (is_bwd(a) && nv * vec > SMEM_BWD_MAX_ELEMS))
		return false;
	if (K != 1 && (!is_bwd(a) || dev->cc_major < 9))
		return false;
	if (block_max > (K > 1 ? SMEM_CLUSTER_MAX_THREADS : tmax))
		block_max = K > 1 ? SMEM_CLUSTER_MAX_THREADS : tmax;
	const int64_t threads = smem_fill(a, nv, K, v);
	if (threads > block_max || threads < 64)
		return false;
	v->param = shape_param(nv, K, 0, false);
	Shape s = shape_of(v);
	if (!smem_fits(a, dev, s))
		return false;
	if (is_bwd(a))
		v->param = shape_param(nv, K, smem_units_cap(a, s), false);
	return true;
}

/*
 * The block_smem variant with the fewest vectors a thread (the most
 * threads, up to the block limit) that fits: backward on one block, else
 * on a cluster of 2 (sm_90). False if none fits.
 */
static bool smem_most_threads(const struct nk_norm_args *a, const struct nk_device_info *dev,
			      struct nk_variant *v)
{
	if (!is_bwd(a)) {
		for (int nv = 1; nv <= 16; nv *= 2) {
			if (smem_variant(a, dev, nv, 1, SMEM_FWD_MAX_THREADS, v))
				return true;
		}
		return false;
	}
	for (int K = 1; K <= 2; K++) {
		for (int nv = 1; nv * vec_of(a) <= SMEM_BWD_MAX_ELEMS; nv *= 2) {
			if (smem_variant(a, dev, nv, K, MAX_THREADS, v))
				return true;
		}
	}
	return false;
}

/*
 * A ring backward variant (bwd_smem_ring): `nv` vectors a thread (16 or 32
 * elements), K blocks a row (a cluster, sm_90), blocks of up to 512
 * threads, the ring `prefetch` vectors deep beyond one row (-1: the most
 * that fit the device's opt-in shared memory, at most nv), weights staged
 * in shared memory if `staged` (memory-efficient jobs only). False if none
 * fits the job.
 */
static bool ring_variant(const struct nk_norm_args *a, const struct nk_device_info *dev, int nv,
			 int K, int prefetch, bool staged, struct nk_variant *v)
{
	const int vec = vec_of(a);

	if (!is_bwd(a) || !tiled_layout_ok(a) || nv < 1 ||
	    (nv * vec != SMEM_BWD_MAX_ELEMS && nv * vec != SMEM_BWD_MAX_ELEMS / 2))
		return false;
	if ((K > 1 && dev->cc_major < 9) || (staged && !(a->flags & NK_MEMORY_EFFICIENT)))
		return false;
	const int64_t threads = smem_fill(a, nv, K, v);
	if (threads > ring_max_threads(K > 1, nv * vec) || threads < 64)
		return false;
	for (int pf = prefetch < 0 ? nv : prefetch; pf >= 0; pf--) {
		v->param = ring_param(nv, K, pf, staged, 0);
		Shape s = shape_of(v);
		if (smem_fits(a, dev, s)) {
			v->param = ring_param(nv, K, pf, staged, smem_units_cap(a, s));
			return true;
		}
		if (prefetch >= 0)
			break;
	}
	return false;
}

static bool ring_variant_fits(const struct nk_norm_args *a, const struct nk_device_info *dev,
			      const struct nk_variant *v, const Shape &s)
{
	const int vec = vec_of(a);
	const int64_t nvec = a->cols / vec;

	if (!is_bwd(a) || !tiled_layout_ok(a) || v->vec_elems != vec || s.R != 1)
		return false;
	if (s.K < 1 || s.K > MAX_CLUSTER || (s.K & (s.K - 1)) != 0 ||
	    (s.K > 1 && dev->cc_major < 9))
		return false;
	if (s.NV * vec != SMEM_BWD_MAX_ELEMS && s.NV * vec != SMEM_BWD_MAX_ELEMS / 2)
		return false;
	if (s.threads < 64 || s.threads > ring_max_threads(s.K > 1, s.NV * vec) ||
	    s.threads % 32 != 0)
		return false;
	if (s.prefetch > s.NV || s.units_cap < 1)
		return false;
	if (s.staged_weights && !(a->flags & NK_MEMORY_EFFICIENT))
		return false;
	return (int64_t)s.threads * s.NV * s.K >= nvec && smem_fits(a, dev, s);
}

static bool smem_variant_fits(const struct nk_norm_args *a, const struct nk_device_info *dev,
			      const struct nk_variant *v, const Shape &s)
{
	if (s.ring)
		return ring_variant_fits(a, dev, v, s);
	const int vec = vec_of(a);
	const int64_t nvec = a->cols / vec;
	const int tmax = is_bwd(a) ? MAX_THREADS : SMEM_FWD_MAX_THREADS;
	const int maxnv = is_bwd(a) ? SMEM_BWD_MAX_ELEMS / vec : 16;

	if (!tiled_layout_ok(a) || v->vec_elems != vec || s.R != 1 || s.split)
		return false;
	if (s.K != 1 && (!is_bwd(a) || dev->cc_major < 9 || s.K > MAX_CLUSTER ||
			 (s.K & (s.K - 1)) != 0 || s.threads > SMEM_CLUSTER_MAX_THREADS))
		return false;
	if (s.threads < 64 || s.threads > tmax || s.threads % 32 != 0)
		return false;
	if (s.NV < 1 || s.NV > maxnv || (s.NV & (s.NV - 1)) != 0)
		return false;
	if (is_bwd(a) && s.units_cap < 1)
		return false;
	return (int64_t)s.threads * s.NV * s.K >= nvec && smem_fits(a, dev, s);
}

/* ---- tma_slice (sm_90) ------------------------------------------------------ */

/* The tensors a tma_slice backward stages a row of: x and dy, and ds for the residual add. */
static int tma_bwd_buffers(const struct nk_norm_args *a)
{
	return (nk_norm_features(a) & NK_FEATURE_RESIDUAL) ? 3 : 2;
}

size_t tma_stage_bytes(const struct nk_norm_args *a, const Shape &s)
{
	const int64_t nvec = a->cols / vec_of(a);
	const int64_t slice = (nvec + s.K - 1) / (s.K > 0 ? s.K : 1);
	/* Backward: x, dy (and ds), R rows (one block) or a slice, each rounded to 128 bytes. */
	if (is_bwd(a))
		return (size_t)s.stages * tma_bwd_buffers(a) * 16 * (size_t)((s.R * slice + 7) / 8 * 8);
	/* Forward: R consecutive rows (one block a row), or a cluster block's slice. */
	const int64_t rows = s.K > 1 ? (slice + 7) / 8 * 8 : (int64_t)s.R * nvec;
	return (size_t)s.stages * 16 * (size_t)((rows + 7) / 8 * 8);
}

/* Whether a tma_slice shape fits the job and the device. */
static bool tma_shape_ok(const struct nk_norm_args *a, const struct nk_device_info *dev,
			 const Shape &s)
{
	const int vec = vec_of(a);
	const int64_t nvec = a->cols / vec;
	const size_t fixed = TMA_STATIC_SMEM + 1024;
	if (!tiled_layout_ok(a) || dev->cc_major < 9 || s.K < 1 || s.K > TMA_MAX_CLUSTER)
		return false;
	if (s.stages < 3 || s.stages > TMA_MAX_STAGES || s.units_cap < 1)
		return false;
	if (s.threads < 64 || s.threads % 32 != 0 || s.threads > MAX_THREADS)
		return false;
	if (tma_stage_bytes(a, s) + fixed > dev->max_smem_per_block_optin)
		return false;
	if (!is_bwd(a)) /* rows of a warp's lanes (G a power of two <= 32), or a block a row */
		return s.R == 1 ? s.G > 32
				: s.K == 1 && s.G * s.R == s.threads && s.G <= 32 &&
				      (s.G & (s.G - 1)) == 0;
	const int64_t slice = (nvec + s.K - 1) / s.K;
	if (s.NV * vec != TMA_ELEMS || (int64_t)s.G * s.NV < slice)
		return false;
	/* As forward: R rows on G lanes each (a power of two <= 32), or a block (of a cluster) a
	 * row. */
	return s.R == 1 ? s.G > 32
			: s.K == 1 && s.G * s.R == s.threads && s.G <= 32 && (s.G & (s.G - 1)) == 0;
}

/*
 * A tma_slice variant on clusters of K blocks, `per_sm` (1 or 2) blocks a
 * multiprocessor (two need at most 256 threads, for the registers, and
 * half its shared memory), TMA_STAGES rows deep or as many as fit (at
 * least 3). False if none fits the job.
 */
static bool tma_variant(const struct nk_norm_args *a, const struct nk_device_info *dev, int K,
			int per_sm, struct nk_variant *v)
{
	const int vec = vec_of(a);
	const int64_t nvec = a->cols / vec;
	int nv = TMA_ELEMS / vec, R = 1;
	if (K < 1 || K > TMA_MAX_CLUSTER || per_sm < 1 || per_sm > 2 || nvec < 1 ||
	    !tiled_layout_ok(a) || dev->cc_major < 9)
		return false;
	const int64_t slice = (nvec + K - 1) / K;
	int64_t threads = ((slice + nv - 1) / nv + 31) / 32 * 32;
	if (!is_bwd(a)) {
		/*
		 * Forward keeps no row in registers. Rows of up to 15 vectors a
		 * lane (4 bits of param) on at most 32 lanes share a warp (K = 1, about four
		 * vectors a lane), R of them a stage of at most 64 KB (32 KB for two blocks a
		 * multiprocessor); wider rows take a block (of a cluster) each, about four vectors
		 * a thread.
		 */
		const int64_t G = pow2_ceil((slice + 3) / 4) < 32 ? pow2_ceil((slice + 3) / 4) : 32;
		const int64_t stage_max = (int64_t)65536 / per_sm;
		threads = MAX_THREADS / per_sm;
		if (K == 1 && (slice + G - 1) / G <= 15) {
			int64_t r = stage_max / (slice * 16);
			r = r < threads / G ? r : threads / G;
			R = (int)(r > 1 ? r : 1);
			threads = R * G;
			if (threads % 32 != 0)
				return false;
		} else {
			const int64_t want = ((slice + 3) / 4 + 31) / 32 * 32;
			threads = want < MAX_THREADS ? want : MAX_THREADS;
		}
		nv = (int)((slice + threads / R - 1) /
			   (threads / R)); /* the kernel loops over them */
		if (nv > 15)
			return false;
	}
	if (is_bwd(a) && K == 1 && threads <= 32) {
		/*
		 * Rows of at most 32 lanes (bf16 512, fp32 512 columns and less):
		 * R of them a stage of at most 64 KB (32 KB for two blocks a
		 * multiprocessor), a warp's lanes split into rows.
		 */
		const int64_t G = pow2_ceil((slice + nv - 1) / nv);
		const int64_t r = (int64_t)65536 / per_sm / (tma_bwd_buffers(a) * slice * 16);
		const int64_t rmax = MAX_THREADS / per_sm / G;
		R = (int)(r < rmax ? (r > 1 ? r : 1) : rmax);
		threads = R * G;
		if (threads % 32 != 0)
			return false;
	}
	if (threads > MAX_THREADS || (is_bwd(a) && per_sm == 2 && threads > MAX_THREADS / 2))
		return false;
	memset(v, 0, sizeof(*v));
	v->family = NK_FAMILY_TMA_SLICE;
	v->threads = (uint16_t)threads;
	v->rows_per_block = (uint16_t)R;
	v->vec_elems = (uint16_t)vec;
	const size_t share = REF_SMEM_PER_SM / (size_t)per_sm - TMA_STATIC_SMEM - 1024;
	for (int st = TMA_STAGES; st >= 3; st--) {
		v->param = tma_param(nv, st, K, tma_units_cap(K, per_sm));
		const Shape s = shape_of(v);
		if (tma_shape_ok(a, dev, s) && tma_stage_bytes(a, s) <= share)
			return true;
	}
	return false;
}

/*
 * The tma_slice backward on the fewest blocks a row whose slices fit
 * MAX_THREADS threads and whose stages fit shared memory (ds takes a third
 * of a stage), one block a multiprocessor. Where that leaves a
 * multiprocessor fewer than MAX_THREADS threads (16 warps, too few to keep
 * the row's loads in flight) and the rows have no ds, the fewest blocks
 * (at most 4) whose slices fit half as many, two blocks a multiprocessor.
 * False past a cluster of TMA_MAX_CLUSTER blocks, or where neither fits.
 */
static bool tma_fewest_blocks(const struct nk_norm_args *a, const struct nk_device_info *dev,
			      struct nk_variant *v)
{
	const int64_t nvec = a->cols / vec_of(a), nv = TMA_ELEMS / vec_of(a);
	int64_t K = (nvec + MAX_THREADS * nv - 1) / (MAX_THREADS * nv);
	if (!is_bwd(a))
		return false;
	while (K <= TMA_MAX_CLUSTER && !tma_variant(a, dev, (int)K, 1, v))
		K++;
	if (K > TMA_MAX_CLUSTER)
		return false;
	const int64_t K2 = (nvec + MAX_THREADS / 2 * nv - 1) / (MAX_THREADS / 2 * nv);
	struct nk_variant two;
	const bool ds = nk_norm_features(a) & NK_FEATURE_RESIDUAL; /* a third more in flight */
	if (!ds && v->threads < MAX_THREADS && K2 <= 4 && tma_variant(a, dev, (int)K2, 2, &two))
		*v = two;
	return true;
}

/* ---- generic ---------------------------------------------------------------- */

static void generic_variant(const struct nk_norm_args *a, struct nk_variant *v)
{
	memset(v, 0, sizeof(*v));
	v->family = NK_FAMILY_GENERIC;
	v->threads = 256;
	v->rows_per_block = a->cols <= 1024 ? 8 : 1;
	v->vec_elems = 1;
	v->param = shape_param(1, 1, is_bwd(a) ? 512 : 0, false);
}

/* ---- fused (norm_cuda_fused.cu) ------------------------------------------------ */

/*
 * The one variant of jobs that use a norm variant (residual, offset, FP8),
 * which no other family runs; false for a plain job, which it never runs.
 */
static bool fused_variant(const struct nk_norm_args *a, struct nk_variant *v)
{
	if (!nk_norm_features(a))
		return false;
	memset(v, 0, sizeof(*v));
	v->family = NK_FAMILY_FUSED;
	v->threads = 256;
	v->rows_per_block = 1;
	v->vec_elems = 1;
	return true;
}

/* ---- autotuning candidates ---------------------------------------------------- */

/* Appends v to out[0..n) unless it is listed already or out is full; the new count. */
static int append_new(struct nk_variant *out, int n, int max, const struct nk_variant *v)
{
	for (int i = 0; i < n; i++) {
		if (memcmp(&out[i], v, sizeof(*v)) == 0)
			return n;
	}
	if (n < max)
		out[n++] = *v;
	return n;
}

/*
 * Appends up to four ring backward shapes (bwd_smem_ring) to out[0..n),
 * for rows of more than 1024 vectors (bf16 12288, fp32 8192 and wider):
 * 32, then 16 elements a thread, on 1, 2, 4, 8 blocks a row, each with the
 * deepest prefetch that fits. A shape is kept where it differs from the
 * double-buffered block_smem ones (a shallower ring: the row does not fit
 * twice; or a cluster of more than 256 threads), and for memory-efficient
 * jobs also with its weights staged. Returns the new count.
 */
static int add_ring_candidates(const struct nk_norm_args *a, const struct nk_device_info *dev,
			       struct nk_variant *out, int n, int max)
{
	struct nk_variant v;
	int added = 0;

	if (!is_bwd(a) || a->cols / vec_of(a) <= 1024)
		return n;
	for (int k = 0; k < 16 && added < 4 && n < max; k++) {
		const int elems = k < 8 ? SMEM_BWD_MAX_ELEMS : SMEM_BWD_MAX_ELEMS / 2;
		const int nv = elems / vec_of(a), K = 1 << (k % 8 / 2);
		const bool staged = k % 2 == 1;
		if (!ring_variant(a, dev, nv, K, -1, staged, &v) || v.threads < 128)
			continue;
		const Shape s = shape_of(&v);
		if (!staged && s.prefetch == nv &&
		    (K == 1 || v.threads <= SMEM_CLUSTER_MAX_THREADS))
			continue;
		n = append_new(out, n, max, &v);
		added++;
	}
	return n;
}

/*
 * Appends up to five tma_slice shapes (sm_90 backward rows of more than 512
 * vectors) to out[0..n): clusters of 1, 2, 3, 4, 6 and 8 blocks, one or
 * two blocks a multiprocessor, the most resident threads first (the kernel
 * is latency-bound below about 16 warps a multiprocessor), then the fewest
 * blocks a row. Returns the new count.
 */
static int add_tma_candidates(const struct nk_norm_args *a, const struct nk_device_info *dev,
			      struct nk_variant *out, int n, int max)
{
	static const int ks[] = {1, 2, 3, 4, 6, 8};
	struct nk_variant all[12], v;
	int warps[12], m = 0;

	if (!is_bwd(a)) { /* one block a row (group), then clusters of 2 and 4 past 1024 vectors */
		for (int k = 0; k < 6; k++) {
			const int K = 1 << (k / 2);
			if (K > 1 && a->cols / vec_of(a) <= 1024)
				break;
			if (tma_variant(a, dev, K, 1 + k % 2, &v))
				n = append_new(out, n, max, &v);
		}
		return n;
	}
	if (a->cols / vec_of(a) <= 32 * (TMA_ELEMS / vec_of(a))) { /* rows of a warp's lanes */
		for (int per_sm = 1; per_sm <= 2; per_sm++) {
			if (tma_variant(a, dev, 1, per_sm, &v))
				n = append_new(out, n, max, &v);
		}
		return n;
	}
	if (a->cols / vec_of(a) <= 512)
		return n;
	for (int k = 0; k < 6; k++) {
		for (int per_sm = 1; per_sm <= 2; per_sm++) {
			if (!tma_variant(a, dev, ks[k], per_sm, &all[m]) || all[m].threads < 128)
				continue;
			warps[m] = per_sm * all[m].threads / 32;
			m++;
		}
	}
	for (int added = 0; added < 5 && n < max; added++) {
		int best = -1;
		for (int i = 0; i < m; i++) {
			if (warps[i] > 0 && (best < 0 || warps[i] > warps[best]))
				best = i;
		}
		if (best < 0)
			break;
		warps[best] = 0;
		n = append_new(out, n, max, &all[best]);
	}
	return n;
}

} /* namespace nkc */

using namespace nkc;

extern "C" {

bool nk__variant_build(const struct nk_norm_args *args, const struct nk_device_info *dev,
		       const struct nk__shape_request *req, struct nk_variant *out)
{
	const int nv = req->nv == NK__MOST_NV ? max_nv(args) : req->nv;

	switch (req->build) {
	case NK__TILED:
	case NK__TILED_CLUSTER:
		if (!tiled_variant(args, dev, nv, req->threads, MAX_THREADS, false, out) ||
		    (req->build == NK__TILED && shape_of(out).K != 1))
			return false;
		set_forward_waves(args, req->waves, out);
		return true;
	case NK__TILED_SPLIT:
		return tiled_variant(args, dev, nv, req->threads, MAX_THREADS, true, out);
	case NK__SMEM:
		return smem_variant(args, dev, nv, req->blocks,
				    is_bwd(args) ? MAX_THREADS : SMEM_FWD_MAX_THREADS, out);
	case NK__SMEM_MOST_THREADS:
		return smem_most_threads(args, dev, out);
	case NK__RING:
		return ring_variant(args, dev, nv, req->blocks, -1, req->staged_weights, out);
	case NK__TMA:
		return tma_variant(args, dev, req->blocks, 1, out);
	case NK__TMA_FEWEST_BLOCKS:
		return tma_fewest_blocks(args, dev, out);
	case NK__GENERIC:
		generic_variant(args, out);
		return true;
	case NK__FUSED:
		return fused_variant(args, out);
	}
	return false;
}

/* Appends the tiled shapes: the most vectors a thread down to one, rows on 128-512 threads. */
static int add_tiled_candidates(const struct nk_norm_args *a, const struct nk_device_info *dev,
				struct nk_variant *out, int n, int max)
{
	struct nk_variant v;
	for (int nv = max_nv(a); nv >= 1 && n < max; nv /= 2) {
		for (int k = 0; k < 12 && n < max; k++) {
			int wt = 128 << (k % 3), bm = k % 6 < 3 ? MAX_THREADS : 256;
			if (tiled_variant(a, dev, nv, wt, bm, k >= 6, &v))
				n = append_new(out, n, max, &v);
		}
	}
	return n;
}

int nk_cuda_variant_candidates(const struct nk_norm_args *args, const struct nk_device_info *dev,
			       struct nk_variant *out, int max)
{
	struct nk_variant v;
	int n = 0;

	if (!args || !dev || !out || max <= 0 || nk_norm_check(args, NULL) != NK_OK)
		return 0;
	nk_cuda_variant_default(args, dev, &v);
	out[n++] = v;
	/* A tiled forward default, also on one block a row group and on grids of 1 and 4 waves. */
	if (!is_bwd(args) && (v.family == NK_FAMILY_WARP_ROWS || v.family == NK_FAMILY_BLOCK_ROW)) {
		static const int waves[] = {0, 1, 4};
		for (size_t i = 0; i < sizeof(waves) / sizeof(waves[0]) && n < max; i++) {
			struct nk_variant w = v;
			set_forward_waves(args, waves[i], &w);
			n = append_new(out, n, max, &w);
		}
	}
	/*
	 * Jobs with norm variants: the fused family, and the families that run
	 * their features (bench_norm times these; the daemon takes the rules'
	 * default for such jobs, as its cache cannot tell them apart).
	 */
	if (nk_norm_features(args) & ~NK_FEATURE_WEIGHT_OFFSET) {
		if (fused_variant(args, &v))
			n = append_new(out, n, max, &v);
		if (is_bwd(args)) /* tma_slice runs the residual's ds */
			n = add_tma_candidates(args, dev, out, n, max);
		return add_tiled_candidates(args, dev, out, n, max);
	}
	n = add_tma_candidates(args, dev, out, n, max);
	/*
	 * Rows of more than 128 vectors: block_smem shapes first (callers keep
	 * few). Forward: 2, 4, 8 vectors a thread. Backward: 1 to 32 elements a
	 * thread on one block, then on clusters of 2; four block_smem shapes at
	 * most (block_smem beat the tiled backward at 4096 fp32 columns:
	 * BENCHMARKS.md, block_smem backward).
	 */
	for (int k = 0, staged = 0;
	     k < 8 && staged < 4 && n < max && args->cols / vec_of(args) > 128; k++) {
		int nv = 2 << k, K = 1;
		if (is_bwd(args)) {
			nv = 1 << (k % 4);
			K = k < 4 ? 1 : 2;
			if (nv * vec_of(args) > SMEM_BWD_MAX_ELEMS)
				continue;
		} else if (k >= 3) {
			break;
		}
		if (!smem_variant(args, dev, nv, K,
				  is_bwd(args) ? MAX_THREADS : SMEM_FWD_MAX_THREADS, &v) ||
		    v.threads < 128)
			continue;
		staged++;
		n = append_new(out, n, max, &v);
	}
	n = add_ring_candidates(args, dev, out, n, max);
	n = add_tiled_candidates(args, dev, out, n, max);
	generic_variant(args, &v);
	return append_new(out, n, max, &v);
}

bool nk_cuda_variant_fits(const struct nk_norm_args *args, const struct nk_device_info *dev,
			  const struct nk_variant *variant)
{
	if (!args || !dev || !variant || variant->reserved != 0)
		return false;
	const unsigned features = nk_norm_features(args);
	if (variant->family == NK_FAMILY_FUSED)
		return features != 0;
	if (features & ~family_features(variant->family, args))
		return false;
	Shape s = shape_of(variant);
	switch (variant->family) {
	case NK_FAMILY_WARP_ROWS:
	case NK_FAMILY_BLOCK_ROW:
		return tiled_fits(args, dev, variant, s);
	case NK_FAMILY_BLOCK_SMEM:
		return smem_variant_fits(args, dev, variant, s);
	case NK_FAMILY_TMA_SLICE:
		return tma_shape_ok(args, dev, s) && variant->vec_elems == vec_of(args);
	case NK_FAMILY_GENERIC:
		return s.threads == 256 && (s.R == 1 || s.R == 8) && s.NV == 1 && s.K == 1 &&
		       variant->vec_elems == 1 && (!is_bwd(args) || s.units_cap >= 1);
	}
	return false;
}

void nk_variant_name(const struct nk_variant *variant, char *buf, size_t len)
{
	static const char *const names[] = {"none",	  "warp_rows", "block_row", "block_smem",
					    "generic",	  "tma_slice", "fused"};
	if (!buf || len == 0)
		return;
	if (!variant) {
		snprintf(buf, len, "none");
		return;
	}
	Shape s = shape_of(variant);
	const char *fam = variant->family <= NK_FAMILY_LAST ? names[variant->family] : "unknown";
	int n = snprintf(buf, len, "%s/t%u/r%u/v%u/n%d", fam, (unsigned)variant->threads,
			 (unsigned)variant->rows_per_block, (unsigned)variant->vec_elems, s.NV);
	if (n > 0 && (size_t)n < len && s.K > 1)
		n += snprintf(buf + n, len - (size_t)n, s.split ? "/s%d" : "/c%d", s.K);
	if (n > 0 && (size_t)n < len && s.stages > 0)
		n += snprintf(buf + n, len - (size_t)n, "/st%d", s.stages);
	if (n > 0 && (size_t)n < len && s.ring)
		n += snprintf(buf + n, len - (size_t)n, "/st1pf%d%s", s.prefetch,
			      s.staged_weights ? "/sw" : "");
	if (n > 0 && (size_t)n < len && s.units_cap > 0)
		snprintf(buf + n, len - (size_t)n, "/p%d", s.units_cap);
}

} /* extern "C" */
