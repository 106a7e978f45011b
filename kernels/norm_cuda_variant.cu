/*
 * The C ABI of the CUDA backend (kernels/norm_kernels.h): variant rules,
 * candidates, fit checks, names, workspace sizes, and nk_cuda_norm, which
 * validates a job and dispatches it to the launchers of norm_cuda_fwd.cu,
 * norm_cuda_bwd.cu and norm_cuda_generic.cu.
 *
 * Variant rules (nk_cuda_variant_default):
 *   - tiled needs 16-byte aligned tensors and cols % VEC == 0 (VEC = 16 bytes
 *     of the storage type), otherwise the generic family runs;
 *   - a thread holds up to 32 elements (forward) or 2 vectors (backward,
 *     which also keeps dgamma/dbeta sums); rows of at most 32 such threads
 *     go to a piece of a warp, wider rows to a block of up to 512 threads
 *     (256 for backward on sm_80), and forward rows wider than one block
 *     holds to a cluster of 2, 4 or 8 blocks (sm_90);
 *   - rows wider than a block's registers are staged in shared memory
 *     (block_smem: a block a row, cp.async two rows deep) where the
 *     stages fit the device's opt-in shared memory: backward on one block of
 *     up to 512 threads (32 elements a thread), else on a cluster of 2
 *     (sm_90); forward on one block of up to 1024 threads. 16-bit forward rows
 *     past 8192 columns are staged too (fwd_default);
 *   - other backward rows wider than one block are split: a row-sums
 *     kernel, then K column slices of up to 16 independent blocks (also on
 *     sm_80); clusters stay autotuning candidates;
 *   - on sm_90, tma_slice (norm_cuda_*_tma.cu) takes backward rows of 1024
 *     vectors and more (tma_bwd_default) and fp32 backward rows of 65-128
 *     vectors (tma_narrow_default), where it measured faster on the H100;
 *     fp32 rows of fp32_bwd_default keep it; its forward kernels are
 *     autotuning candidates only;
 *   - the backward grid is capped by units_cap, computed for a reference
 *     device of REF_SMS multiprocessors (tma_slice: the clusters an H100 SXM
 *     holds) and never from the actual one, so the partial rows (hence the
 *     weight gradients' bits) depend on the shape and the variant alone.
 *
 * Host code only; built by `make` with the other kernels/ CUDA files.
 */
#include <stdio.h>
#include <string.h>

#include "kernels/norm_cuda_internal.cuh"

namespace nkc
{

/* Multiprocessors of the reference device the backward grid caps assume. */
constexpr int REF_SMS = 132;

static thread_local char last_error[256] = "no error";

int set_error(cudaError_t err, const char *where)
{
	(void)cudaGetLastError(); /* a failed launch must not fail the next check */
	snprintf(last_error, sizeof(last_error), "%s: %s (%s)", where, cudaGetErrorString(err),
		 cudaGetErrorName(err));
	return NK_EDEVICE;
}

int check_launch(const char *where)
{
	cudaError_t err = cudaGetLastError();
	return err == cudaSuccess ? NK_OK : set_error(err, where);
}

static void set_message(const char *msg)
{
	snprintf(last_error, sizeof(last_error), "%s", msg);
}

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

static bool is_bwd(const struct nk_norm_args *a)
{
	return a->op == NK_LAYERNORM_BWD || a->op == NK_RMSNORM_BWD;
}

static bool is_ln(const struct nk_norm_args *a)
{
	return a->op == NK_LAYERNORM_FWD || a->op == NK_LAYERNORM_BWD;
}

static size_t round256(size_t n)
{
	return (n + 255) / 256 * 256;
}

int64_t partial_rows(const struct nk_norm_args *a, const Shape &s)
{
	int64_t units;
	if (s.family == NK_FAMILY_GENERIC) {
		units = (a->rows + 7) / 8;
		return units < s.units_cap ? units : s.units_cap;
	}
	units = (a->rows + s.R - 1) / s.R;
	if (units > s.units_cap)
		units = s.units_cap;
	return units * s.R;
}

Params params_of(const struct nk_norm_args *a)
{
	Params p;
	memset(&p, 0, sizeof(p));
	p.x = a->x;
	p.y = a->y;
	p.mean = a->mean;
	p.rstd = a->rstd;
	p.gamma = a->gamma;
	p.beta = a->beta;
	p.dy = a->dy;
	p.dx = a->dx;
	p.rows = a->rows;
	p.cols = a->cols;
	p.eps = a->eps;
	p.inv_cols = (float)(1.0 / (double)a->cols);
	const unsigned none = 0;
	p.f = (is_ln(a) ? F_LN : none) | (a->flags & NK_MEMORY_EFFICIENT ? F_MEMEFF : none) |
	      (a->gamma ? F_GAMMA : none) | (a->beta ? F_BETA : none) |
	      (is_bwd(a) && a->dgamma ? F_DGAMMA : none) |
	      (is_bwd(a) && a->dbeta ? F_DBETA : none) |
	      (a->flags & NK_ACCUMULATE ? F_ACCUM : none);
	return p;
}

Params params_of(const struct nk_norm_args *a, const Shape &s)
{
	Params p = params_of(a);
	p.G = s.G;
	p.K = s.K;
	p.R = s.R;
	p.iters = (a->rows + s.R - 1) / s.R;
	return p;
}

static int vec_of(const struct nk_norm_args *a)
{
	return 16 / (int)nk_dtype_size(a->dtype);
}

static bool aligned16(const void *p)
{
	return ((uintptr_t)p & 15) == 0;
}

/* Whether every tensor the tiled kernels load as vectors allows it. */
static bool tiled_layout_ok(const struct nk_norm_args *a)
{
	if (a->cols % vec_of(a) != 0 || !aligned16(a->x) || !aligned16(a->gamma) ||
	    !aligned16(a->beta))
		return false;
	if (is_bwd(a))
		return aligned16(a->dy) && aligned16(a->dx);
	return aligned16(a->y);
}

static int pow2_ceil(int64_t n)
{
	int p = 1;
	while (p < n)
		p <<= 1;
	return p;
}

/* Threads a tiled block may have for this job on this device. */
static int block_limit(const struct nk_norm_args *a, const struct nk_device_info *dev)
{
	return is_bwd(a) && dev->cc_major < 9 ? BWD_MAX_THREADS_SM80 : MAX_THREADS;
}

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

size_t smem_stage_bytes(const struct nk_norm_args *a, const Shape &s,
			const struct nk_device_info *dev)
{
	/*
	 * Forward: two or three rows of x. Three where two already leave room
	 * for one block a SM (rows over 56 KB) and three fit, for RMSNorm only
	 * (bf16 32768: 90 -> 93-94% of copy bandwidth); LayerNorm measured
	 * 2 points slower with three (its gamma and beta, 128 KB, lose what L1
	 * they had). Backward: a block's slots of x or y and dy, two stages (a
	 * rule of the shape alone: its grid cap must not depend on the device).
	 */
	if (!is_bwd(a)) {
		const size_t row = (size_t)a->cols * nk_dtype_size(a->dtype);
		const bool three = !is_ln(a) && row > (size_t)56 * 1024 &&
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

size_t tma_stage_bytes(const struct nk_norm_args *a, const Shape &s)
{
	const int64_t nvec = a->cols / vec_of(a);
	const int64_t slice = (nvec + s.K - 1) / (s.K > 0 ? s.K : 1);
	/* Backward: x and dy, R rows (one block) or a slice, each rounded to 128 bytes. */
	if (is_bwd(a))
		return (size_t)s.stages * 2 * 16 * (size_t)((s.R * slice + 7) / 8 * 8);
	/* Forward: R consecutive rows (one block a row), or a cluster block's slice. */
	const int64_t rows = s.K > 1 ? (slice + 7) / 8 * 8 : (int64_t)s.R * nvec;
	return (size_t)s.stages * 16 * (size_t)((rows + 7) / 8 * 8);
}

/*
 * Clusters of K blocks the reference device holds at once with one or two
 * blocks a multiprocessor: an H100 SXM (132 SMs, 2026-11-22), as
 * cudaOccupancyMaxActiveClusters reported it for 256-512 threads and 200
 * (100) KB of shared memory a block. Clusters do not span GPCs, so K = 4
 * gets 30 clusters, not 132 / 4; a grid of more clusters than fit would run
 * a second, nearly empty wave.
 */
static int tma_units_cap(int K, int per_sm)
{
	static const int ref[2][TMA_MAX_CLUSTER + 1] = {{0, 132, 66, 39, 30, 22, 17, 15, 15},
							{0, 264, 132, 79, 62, 47, 39, 32, 30}};
	if (K < 1 || K > TMA_MAX_CLUSTER || per_sm < 1 || per_sm > 2)
		return 1;
	return ref[per_sm - 1][K];
}

/* Shared memory of a multiprocessor of the reference device (sm_90). */
constexpr size_t REF_SMEM_PER_SM = 228 * 1024;

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
		return s.R == 1 ? s.G > 32 : s.K == 1 && s.G * s.R == s.threads && s.G <= 32 &&
						     (s.G & (s.G - 1)) == 0;
	const int64_t slice = (nvec + s.K - 1) / s.K;
	if (s.NV * vec != TMA_ELEMS || (int64_t)s.G * s.NV < slice)
		return false;
	/* As forward: R rows on G lanes each (a power of two <= 32), or a block (of a cluster) a row. */
	return s.R == 1 ? s.G > 32 : s.K == 1 && s.G * s.R == s.threads && s.G <= 32 &&
					 (s.G & (s.G - 1)) == 0;
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
		 * lane (4 bits of param) on at most 32 lanes share a warp (K = 1, about four vectors
		 * a lane), R of them a stage of at most 64 KB (32 KB for two
		 * blocks a multiprocessor); wider rows take a block (of a cluster)
		 * each, about four vectors a thread.
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
		nv = (int)((slice + threads / R - 1) / (threads / R)); /* the kernel loops over them */
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
		const int64_t r = (int64_t)65536 / per_sm / (2 * slice * 16);
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

static void generic_variant(const struct nk_norm_args *a, struct nk_variant *v)
{
	memset(v, 0, sizeof(*v));
	v->family = NK_FAMILY_GENERIC;
	v->threads = 256;
	v->rows_per_block = a->cols <= 1024 ? 8 : 1;
	v->vec_elems = 1;
	v->param = shape_param(1, 1, is_bwd(a) ? 512 : 0, false);
}

/* The largest vectors-a-thread count the tiled kernels allow. */
static int max_nv(const struct nk_norm_args *a)
{
	return is_bwd(a) ? BWD_MAX_NV : FWD_MAX_ELEMS / vec_of(a);
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

/* The variant nk_cuda_norm runs for `v` (NULL: the default). */
static struct nk_variant resolve(const struct nk_norm_args *a, const struct nk_device_info *dev,
				 const struct nk_variant *v)
{
	struct nk_variant out;
	if (v && nk_cuda_variant_fits(a, dev, v))
		return *v;
	nk_cuda_variant_default(a, dev, &out);
	return out;
}


/*
 * Chunks of partial rows that launch_finish sums first, one block a chunk
 * and 32 columns, so that narrow rows with thousands of partial rows still
 * spread over about FINISH_BLOCKS blocks (one chunk: a single step). A rule
 * of cols and part_rows alone, so the order of the sums is always the same.
 */
int64_t finish_chunks(int64_t cols, int64_t part_rows)
{
	constexpr int64_t FINISH_BLOCKS = 256, MIN_CHUNK_ROWS = 64;
	const int64_t col_blocks = (cols + 31) / 32;
	const int64_t want = (FINISH_BLOCKS + col_blocks - 1) / col_blocks;
	if (want < 2 || part_rows < 2 * MIN_CHUNK_ROWS)
		return 1;
	int64_t chunk = (part_rows + want - 1) / want;
	if (chunk < MIN_CHUNK_ROWS)
		chunk = MIN_CHUNK_ROWS;
	return (part_rows + chunk - 1) / chunk;
}

/* Floats from the partials to the chunk sums (after the dgamma and dbeta partials). */
int64_t mid_offset(const struct nk_norm_args *a, int64_t part_rows)
{
	const size_t bytes = (size_t)part_rows * (size_t)a->cols * sizeof(float);
	return (int64_t)(round256(a->dbeta ? 2 * bytes : bytes) / sizeof(float));
}

/*
 * Workspace: the dgamma/dbeta partials and their chunk sums, then
 * (memory-efficient) rg.
 */
static size_t partials_bytes(const struct nk_norm_args *a, const struct nk_variant *v)
{
	if (!is_bwd(a) || (!a->dgamma && !a->dbeta))
		return 0;
	const int64_t rows = partial_rows(a, shape_of(v));
	const int64_t chunks = finish_chunks(a->cols, rows);
	size_t bytes = (size_t)mid_offset(a, rows) * sizeof(float);
	if (chunks > 1)
		bytes += round256((size_t)2 * (size_t)chunks * (size_t)a->cols * sizeof(float));
	return bytes;
}

/* Memory-efficient backward: 1 / clamp(gamma). */
static size_t rg_bytes(const struct nk_norm_args *a)
{
	if (!is_bwd(a) || !(a->flags & NK_MEMORY_EFFICIENT))
		return 0;
	return round256((size_t)a->cols * sizeof(float));
}

/* Split backward: two row sums a row. */
static size_t sums_bytes(const struct nk_norm_args *a, const struct nk_variant *v)
{
	if (!is_bwd(a) || v->family == NK_FAMILY_GENERIC || !shape_of(v).split)
		return 0;
	return round256((size_t)a->rows * 2 * sizeof(float));
}

static size_t workspace_of(const struct nk_norm_args *a, const struct nk_variant *v)
{
	return partials_bytes(a, v) + rg_bytes(a) + sums_bytes(a, v);
}

/* Pointers must at least be aligned to their element size. */
static bool elements_aligned(const struct nk_norm_args *a)
{
	uintptr_t ds = nk_dtype_size(a->dtype) - 1, ws = nk_dtype_size(a->weight_dtype) - 1;
	uintptr_t ys = a->y_fp8 && !is_bwd(a) ? 0 : ds; /* an FP8 y is bytes */
	return !(((uintptr_t)a->x | (uintptr_t)a->dy | (uintptr_t)a->dx |
		  (uintptr_t)a->residual | (uintptr_t)a->residual_out | (uintptr_t)a->ds) &
		 ds) &&
	       !((uintptr_t)a->y & ys) && !(((uintptr_t)a->scale | (uintptr_t)a->amax) & 3) &&
	       !(((uintptr_t)a->gamma | (uintptr_t)a->beta | (uintptr_t)a->dgamma |
		  (uintptr_t)a->dbeta) &
		 ws) &&
	       !(((uintptr_t)a->mean | (uintptr_t)a->rstd) & 3);
}

static int dispatch(const struct nk_norm_args *a, const struct nk_device_info *dev,
		    const struct nk_variant *v, const struct nk_cuda_exec *exec)
{
	cudaStream_t stream = static_cast<cudaStream_t>(exec->stream);
	float *part = static_cast<float *>(exec->workspace);
	Shape s = shape_of(v);
	int rc;

	if (!is_bwd(a)) {
		if (s.family == NK_FAMILY_GENERIC)
			return launch_fwd_generic(a, dev, s, stream);
		if (s.family == NK_FAMILY_TMA_SLICE)
			return launch_fwd_tma(a, dev, s, stream);
		if (s.family == NK_FAMILY_BLOCK_SMEM)
			return launch_fwd_smem(a, dev, s, stream);
		return launch_fwd_tiled(a, dev, s, stream);
	}
	if (s.family == NK_FAMILY_GENERIC) {
		rc = launch_bwd_generic(a, dev, s, part, stream);
	} else if (s.family == NK_FAMILY_BLOCK_SMEM || s.family == NK_FAMILY_TMA_SLICE) {
		float *rg = NULL;
		if (a->flags & NK_MEMORY_EFFICIENT) {
			rg = reinterpret_cast<float *>(static_cast<char *>(exec->workspace) +
						       partials_bytes(a, v));
			rc = launch_reciprocal_gamma(a, rg, stream);
			if (rc != NK_OK)
				return rc;
		}
		if (s.family == NK_FAMILY_TMA_SLICE)
			rc = launch_bwd_tma(a, dev, s, part, rg, stream);
		else if (s.ring)
			rc = launch_bwd_smem_ring(a, dev, s, part, rg, stream);
		else
			rc = launch_bwd_smem(a, dev, s, part, rg, stream);
	} else {
		char *ws = static_cast<char *>(exec->workspace);
		float *rg = NULL, *sums = NULL;
		if (a->flags & NK_MEMORY_EFFICIENT) {
			rg = reinterpret_cast<float *>(ws + partials_bytes(a, v));
			rc = launch_reciprocal_gamma(a, rg, stream);
			if (rc != NK_OK)
				return rc;
		}
		if (s.split)
			sums = reinterpret_cast<float *>(ws + partials_bytes(a, v) + rg_bytes(a));
		rc = launch_bwd_tiled(a, dev, s, part, rg, sums, stream);
	}
	if (rc != NK_OK)
		return rc;
	if (!a->dgamma && !a->dbeta && !exec->clamped_cols)
		return NK_OK;
	return launch_finish(a, part, partial_rows(a, s), exec->clamped_cols, stream);
}

} /* namespace nkc */

using namespace nkc;

extern "C" {

/*
 * The block_smem default, if one fits: the fewest vectors a thread (the most
 * threads, up to the block limit), backward on one block, else a cluster of
 * 2 (sm_90).
 */
static bool smem_default(const struct nk_norm_args *a, const struct nk_device_info *dev,
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
 * The fp32 backward defaults measured on the H100 (BENCHMARKS.md,
 * 2026-11-22), where block_smem beat the rows held in registers:
 *  - 513..4096 columns (128 < vectors <= 1024): block_smem with one vector
 *    a thread up to 256 vectors, else two (256 threads at 1024 and 2048
 *    columns, 512 at 4096): 92-94% of copy bandwidth against 83-86% tiled,
 *    memory-efficient included; one vector a thread at 2048 (512 threads)
 *    measured 84%;
 *  - memory-efficient at 4097..8192 columns: the ring kernel with its
 *    weights staged in shared memory, 512 threads (96% against 84-90%).
 * bf16 keeps the tiled kernel up to 8192 columns (as fast as block_smem).
 * False where the rule does not apply or its variant does not fit.
 */
static bool fp32_bwd_default(const struct nk_norm_args *a, const struct nk_device_info *dev,
			     struct nk_variant *v)
{
	const int64_t nvec = a->cols / vec_of(a);
	if (!is_bwd(a) || vec_of(a) != 4 || !tiled_layout_ok(a) || nvec <= 128)
		return false;
	if (nvec <= 1024)
		return smem_variant(a, dev, nvec <= 256 ? 1 : 2, 1, MAX_THREADS, v);
	if (nvec <= 2048 && (a->flags & NK_MEMORY_EFFICIENT))
		return ring_variant(a, dev, 4, 1, -1, true, v);
	return false;
}

/*
 * The sm_90 backward default for rows of 1024 vectors and more (bf16 or
 * fp16 from 8192 columns, fp32 from 4096 unless fp32_bwd_default took it;
 * bf16 8192: 95-98% against 92-93% tiled in four of five runs): tma_slice on the
 * fewest blocks a row whose slices fit 512 threads, one block a
 * multiprocessor. Where that leaves fewer than 512 threads (16 warps) a
 * multiprocessor, the fewest blocks (at most 4) whose slices fit 256
 * threads, two blocks a multiprocessor: at bf16 12288 columns a cluster
 * of 3 such blocks ran at 87-93% of copy bandwidth in four runs, 2 blocks
 * of 384 threads at 84-96%. On the H100 (BENCHMARKS.md, 2026-11-22) the
 * defaults ran at 85-98% from 8192 to 32768 columns, where block_smem and
 * the split rows ran at 55-86%. (fp32 memory-efficient rows up to 8192
 * columns keep fp32_bwd_default; 16-bit memory-efficient rows of 8192
 * columns stay on block_row, below.)
 */
static bool tma_bwd_default(const struct nk_norm_args *a, const struct nk_device_info *dev,
			    struct nk_variant *v)
{
	const int64_t nvec = a->cols / vec_of(a), nv = TMA_ELEMS / vec_of(a);
	if (!is_bwd(a) || dev->cc_major < 9 || nvec < 1024)
		return false;
	const int64_t K = (nvec + MAX_THREADS * nv - 1) / (MAX_THREADS * nv);
	/*
	 * Memory-efficient rows of one block (16-bit 8192 columns; fp32 rows
	 * that short are fp32_bwd_default's) stay tiled: there block_row/t512
	 * measured 92.5-93% against 89-91.5% (two runs), and within 0.5% of
	 * its standard backward.
	 */
	if (K == 1 && (a->flags & NK_MEMORY_EFFICIENT))
		return false;
	if (K > TMA_MAX_CLUSTER || !tma_variant(a, dev, (int)K, 1, v))
		return false;
	const int64_t K2 = (nvec + MAX_THREADS / 2 * nv - 1) / (MAX_THREADS / 2 * nv);
	struct nk_variant two;
	if (v->threads < MAX_THREADS && K2 <= 4 && tma_variant(a, dev, (int)K2, 2, &two))
		*v = two;
	return true;
}

/*
 * The sm_90 default of tma_slice rows on a warp's lanes (one block of 512
 * threads a multiprocessor), where they beat the tiled kernels on the H100
 * (BENCHMARKS.md, 2026-11-22): fp32 backward rows of 65 to 128 vectors
 * (measured at 512 columns: 84-87% -> 95%, memory-efficient included).
 * (Forward rows of 16 to 32 vectors ran here too until the tiled forward
 * overtook it, 88-91% -> 93-98% at 128 columns, session 5.)
 */
static bool tma_narrow_default(const struct nk_norm_args *a, const struct nk_device_info *dev,
			       struct nk_variant *v)
{
	const int64_t nvec = a->cols / vec_of(a);
	const bool bwd_rows = is_bwd(a) && vec_of(a) == 4 && nvec > 64 && nvec <= 128;
	return bwd_rows && tma_variant(a, dev, 1, 1, v);
}

/*
 * The forward defaults measured on the H100 (BENCHMARKS.md, session 5,
 * 2026-11-24), the tiled kernel at 64 registers a thread on a grid of
 * every row group:
 *  - 16-bit rows of up to 1024 vectors (8192 columns): four vectors a
 *    thread, 256 threads a block (four blocks a multiprocessor): 93-98% of
 *    copy bandwidth from 128 to 8192 columns; two vectors measured 1-7%
 *    slower, one 15-30%, tma_slice 4-10%; but RMSNorm rows of 129 to 512
 *    vectors (2048, 4096 columns) two a thread: 95% in two runs, where
 *    four measured 92-95% (and lost to PyTorch's 92.5% at 2048 once);
 *  - wider 16-bit rows: block_smem, four vectors a thread (384 to 1024
 *    threads), 91-95% at 12288-32768 columns: the tiled kernel there has
 *    one or two blocks of 384-512 threads a multiprocessor and measured
 *    82-95%, unevenly (fp32, with twice the bytes a thread in flight,
 *    does not: 98% at 12288 and 16384);
 *  - fp32: RMSNorm rows of up to 1024 vectors two a thread (98-100%),
 *    LayerNorm rows of up to 2048 vectors four (96-100%), wider rows the
 *    most (eight).
 * False where no rule applies or its variant does not fit (unaligned
 * tensors: the caller's fallbacks).
 */
static bool fwd_default(const struct nk_norm_args *a, const struct nk_device_info *dev,
			struct nk_variant *v)
{
	const int64_t nvec = a->cols / vec_of(a);
	if (is_bwd(a))
		return false;
	if (vec_of(a) == 8) {
		const bool rms_mid = a->op == NK_RMSNORM_FWD && nvec > 128 && nvec <= 512;
		if (nvec <= 1024)
			return tiled_variant(a, dev, rms_mid ? 2 : 4, 256, MAX_THREADS, false, v);
		return smem_variant(a, dev, 4, 1, SMEM_FWD_MAX_THREADS, v);
	}
	int nv = max_nv(a);
	if (a->op == NK_RMSNORM_FWD && nvec <= 1024)
		nv = 2;
	else if (a->op == NK_LAYERNORM_FWD && nvec <= 2048)
		nv = 4;
	return tiled_variant(a, dev, nv, 256, MAX_THREADS, false, v) && shape_of(v).K == 1;
}

/* The one variant of jobs that use a norm variant (residual, offset, FP8). */
static void fused_variant(struct nk_variant *v)
{
	memset(v, 0, sizeof(*v));
	v->family = NK_FAMILY_FUSED;
	v->threads = 256;
	v->rows_per_block = 1;
	v->vec_elems = 1;
}

int nk_cuda_variant_default(const struct nk_norm_args *args, const struct nk_device_info *dev,
			    struct nk_variant *out)
{
	if (!args || !dev || !out || nk_norm_check(args, NULL) != NK_OK)
		return NK_EINVAL;
	if (nk_norm_features(args)) {
		fused_variant(out);
		return NK_OK;
	}
	int nv = max_nv(args); /* fwd_default aside, the tiled defaults hold the most */
	if (fwd_default(args, dev, out) || fp32_bwd_default(args, dev, out) ||
	    tma_bwd_default(args, dev, out) || tma_narrow_default(args, dev, out))
		return NK_OK;
	if (!tiled_variant(args, dev, nv, 256, MAX_THREADS, false, out) || shape_of(out).K > 1) {
		/*
		 * Rows wider than a block's registers: the row staged in shared
		 * memory where it fits, else backward runs split (clusters lose
		 * to it from 4 blocks on, and at 2 blocks lose the
		 * memory-efficient backward 15-25% while winning the standard
		 * one by at most 6%, BENCHMARKS.md) and forward keeps its
		 * clusters.
		 */
		if (smem_default(args, dev, out))
			return NK_OK;
		if (is_bwd(args) && !tiled_variant(args, dev, nv, 256, MAX_THREADS, true, out))
			generic_variant(args, out);
		else if (!is_bwd(args) && !tiled_variant(args, dev, nv, 256, MAX_THREADS, false, out))
			generic_variant(args, out);
	}
	return NK_OK;
}

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
		if (!staged && s.prefetch == nv && (K == 1 || v.threads <= SMEM_CLUSTER_MAX_THREADS))
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

int nk_cuda_variant_candidates(const struct nk_norm_args *args, const struct nk_device_info *dev,
			       struct nk_variant *out, int max)
{
	struct nk_variant v;
	int n = 0;

	if (!args || !dev || !out || max <= 0 || nk_norm_check(args, NULL) != NK_OK)
		return 0;
	nk_cuda_variant_default(args, dev, &v);
	out[n++] = v;
	if (nk_norm_features(args))
		return n;
	n = add_tma_candidates(args, dev, out, n, max);
	/*
	 * Rows of more than 128 vectors: block_smem shapes first (callers keep
	 * few). Forward: 2, 4, 8 vectors a thread. Backward: 1 to 32 elements a
	 * thread on one block, then on clusters of 2; four block_smem shapes at
	 * most. (At 4096 fp32 columns block_smem beat the tiled backward by 13%.)
	 */
	for (int k = 0, staged = 0; k < 8 && staged < 4 && n < max &&
				    args->cols / vec_of(args) > 128;
	     k++) {
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
	for (int nv = max_nv(args); nv >= 1 && n < max; nv /= 2) {
		for (int k = 0; k < 12 && n < max; k++) {
			int wt = 128 << (k % 3), bm = k % 6 < 3 ? MAX_THREADS : 256;
			if (tiled_variant(args, dev, nv, wt, bm, k >= 6, &v))
				n = append_new(out, n, max, &v);
		}
	}
	generic_variant(args, &v);
	return append_new(out, n, max, &v);
}

bool nk_cuda_variant_fits(const struct nk_norm_args *args, const struct nk_device_info *dev,
			  const struct nk_variant *variant)
{
	if (!args || !dev || !variant || variant->reserved != 0)
		return false;
	if ((variant->family == NK_FAMILY_FUSED) != (nk_norm_features(args) != 0))
		return false;
	if (variant->family == NK_FAMILY_FUSED)
		return true;
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

size_t nk_cuda_workspace_bytes(const struct nk_norm_args *args, const struct nk_device_info *dev,
			       const struct nk_variant *variant)
{
	if (!args || !dev || nk_norm_check(args, NULL) != NK_OK)
		return 0;
	if (nk_norm_features(args))
		return nk_cuda_fused_workspace_bytes(args, dev);
	struct nk_variant v = resolve(args, dev, variant);
	return workspace_of(args, &v);
}

int nk_cuda_norm(const struct nk_norm_args *args, const struct nk_device_info *dev,
		 const struct nk_variant *variant, const struct nk_cuda_exec *exec,
		 struct nk_variant *ran)
{
	const char *why = NULL;

	if (!args || !dev || !exec || dev->sm_count < 1) {
		set_message("nk_cuda_norm: args, dev and exec are required");
		return NK_EINVAL;
	}
	if (nk_norm_check(args, &why) != NK_OK) {
		set_message(why);
		return NK_EINVAL;
	}
	if (!elements_aligned(args)) {
		set_message("a tensor is not aligned to its element size");
		return NK_EINVAL;
	}
	if (nk_norm_features(args)) {
		size_t need = nk_cuda_fused_workspace_bytes(args, dev);
		if (need > 0 && (exec->workspace_bytes < need || !exec->workspace ||
				 !aligned16(exec->workspace))) {
			set_message("workspace missing, too small or not 16-byte aligned");
			return NK_EINVAL;
		}
		int rc = nk_cuda_fused_norm(args, dev, exec);
		if (rc == NK_OK && ran)
			fused_variant(ran);
		return rc;
	}
	struct nk_variant v = resolve(args, dev, variant);
	size_t need = workspace_of(args, &v);
	if (need > 0 &&
	    (exec->workspace_bytes < need || !exec->workspace || !aligned16(exec->workspace))) {
		set_message("workspace missing, too small or not 16-byte aligned");
		return NK_EINVAL;
	}
	int rc = dispatch(args, dev, &v, exec);
	if (rc == NK_OK && ran)
		*ran = v;
	return rc;
}

const char *nk_cuda_last_error(void)
{
	return last_error;
}

} /* extern "C" */
