/*
 * The C ABI of normd's normalization kernels.
 *
 * Two implementations sit behind this header:
 *   - kernels/norm_cpu.c: the CPU backend and the numerical oracle. It computes
 *     in fp32 (NK_CPU_FP32) or, in reference mode, in fp64 (NK_CPU_REFERENCE);
 *     outputs are rounded once to their storage dtype.
 *   - kernels/norm_cuda_*.cu: the CUDA kernels and their launchers.
 *
 * Semantics (shared by both, see docs/DESIGN.md "Job semantics"):
 *   Input is a row-major [rows, cols] view. Statistics are fp32, one per row.
 *   LayerNorm fwd: y = (x - mean) * rstd * gamma + beta, rstd = 1/sqrt(var + eps),
 *                  var biased. gamma and beta optional (NULL).
 *   RMSNorm fwd:   y = x * rstd * gamma, rstd = 1/sqrt(mean(x^2) + eps).
 *   Backward:      dx, and dgamma / dbeta when those pointers are non-NULL.
 *                  dgamma/dbeta are overwritten unless NK_ACCUMULATE is set.
 *   Variants (docs/VARIANTS.md; all off when their fields are zero):
 *     residual add  forward: s = x + residual, rounded once to dtype and
 *                   stored in residual_out; the norm normalizes that stored
 *                   s. Backward (run on s): dx = dnorm(s) + ds, the gradient
 *                   of both x and residual, ds optional.
 *     weight offset the weight is weight_offset + gamma, in the compute type
 *                   (1: zero-centered gamma; Gemma's offset).
 *     FP8 output    forward: y = saturate(RNE(y * scale)) in e4m3 or e5m2,
 *                   amax = max |y| before scaling (NaN skipped).
 *   NK_MEMORY_EFFICIENT backward reads y (passed in `x`) instead of x and
 *   recomputes x_hat = (y - beta) / clamp(gamma) (RMS: y / clamp(gamma);
 *   beta absent: 0; gamma absent: x_hat = y), where clamp() moves gamma
 *   values with |gamma| < eps to +-eps as apex's clamp_by_magnitude does
 *   (0 <= gamma < eps becomes +eps, -eps < gamma < 0 becomes -eps, so both
 *   zeros become +eps). The dy * gamma terms of dx use the real gamma. mean
 *   is not read then.
 *
 * Nothing here allocates device memory, synchronizes, or exits; every
 * function reports failure through its return value (enum nk_status).
 */
#ifndef NORMD_NORM_KERNELS_H
#define NORMD_NORM_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Return codes of every function in this header. */
enum nk_status {
	NK_OK = 0,
	NK_EINVAL = -1,       /* arguments violate the preconditions below */
	NK_ENOMEM = -2,       /* host allocation failed (CPU backend) */
	NK_EUNSUPPORTED = -3, /* valid request this build cannot run */
	NK_EDEVICE = -4,      /* a CUDA call failed; see nk_cuda_last_error() */
};

/* Storage types. Compute and statistics are always at least fp32. */
enum nk_dtype {
	NK_F32 = 0,
	NK_F16 = 1,
	NK_BF16 = 2,
};

/*
 * The FP8 format of a forward's y (nk_norm_args.y_fp8), one byte an
 * element (OCP 8-bit floating point). Not an nk_dtype: FP8 is an output
 * format only, never the dtype of x or of the weights.
 */
enum nk_fp8 {
	NK_FP8_NONE = 0, /* y has dtype */
	NK_FP8_E4M3 = 1, /* 1-4-3, bias 7, no infinities, max 448, NaN S.1111.111 */
	NK_FP8_E5M2 = 2, /* 1-5-2, bias 15, IEEE-like, max finite 57344 */
};

/*
 * The variants a job uses (nk_norm_features), so that a backend can say
 * which it runs: a job using one it lacks is refused, never run as the
 * plain norm.
 */
enum nk_features {
	NK_FEATURE_RESIDUAL = 1u << 0,      /* forward residual; backward ds */
	NK_FEATURE_WEIGHT_OFFSET = 1u << 1, /* weight_offset != 0 */
	NK_FEATURE_FP8_OUTPUT = 1u << 2,    /* y_fp8 != NK_FP8_NONE */
};
#define NK_FEATURES_ALL (NK_FEATURE_RESIDUAL | NK_FEATURE_WEIGHT_OFFSET | NK_FEATURE_FP8_OUTPUT)

enum nk_op {
	NK_LAYERNORM_FWD = 0,
	NK_LAYERNORM_BWD = 1,
	NK_RMSNORM_FWD = 2,
	NK_RMSNORM_BWD = 3,
};

enum nk_flags {
	NK_MEMORY_EFFICIENT = 1u << 0, /* backward: `x` holds the forward output y */
	NK_ACCUMULATE = 1u << 1,       /* backward: dgamma/dbeta += instead of = */
};

/*
 * One normalization job.
 *   dtype        x, y (unless y_fp8), dy, dx, residual, residual_out, ds
 *   weight_dtype gamma, beta, dgamma, dbeta (equal to dtype, or NK_F32)
 *   fp32         mean, rstd, scale, amax
 *
 * op       reads                                writes
 * LN fwd   x, residual?, gamma?, beta?, scale?  y, residual_out?, mean?, rstd?,
 *                                               amax?
 * RMS fwd  x, residual?, gamma?, scale?         y, residual_out?, rstd?, amax?
 * LN bwd   dy, x|y, mean (not if mem-eff),      dx, dgamma? (needs gamma),
 *          rstd, gamma?, beta?, ds?             dbeta? (needs gamma)
 * RMS bwd  dy, x|y, rstd, gamma?, ds?           dx, dgamma? (needs gamma)
 *
 * With a residual, x|y of the backward is s (residual_out of the forward)
 * or y. residual and residual_out come together; scale comes with y_fp8
 * and amax only with it. weight_offset needs gamma; dgamma is still the sum
 * of dy * x_hat (the offset is a constant). An output may alias an input
 * only exactly (same address and size), and only a per-row one (y or
 * residual_out over x or residual; dx over x|y, dy or ds): each row's
 * inputs are read before that row's outputs are written. The daemon
 * enforces it (docs/VARIANTS.md); this interface assumes it.
 *
 * "?" means optional: NULL skips it. dgamma = sum over rows of dy * x_hat,
 * dbeta = sum over rows of dy; both are accumulated in the compute type
 * (fp32; fp64 in the CPU reference) and stored in weight_dtype, rounded
 * once. With NK_ACCUMULATE the stored value is old + sum, rounded once.
 * beta without gamma is refused (apex has no such mode); dbeta without beta
 * is allowed (the gradient of a bias that is zero), dbeta without gamma is
 * not. Tensors of the other direction (dy, dx, dgamma, dbeta of a forward
 * op; y of a backward op) are ignored, and so is mean in memory-efficient
 * LayerNorm backward. Tensors may have any alignment.
 */
struct nk_norm_args {
	enum nk_op op;
	int64_t rows; /* >= 1 */
	int64_t cols; /* >= 1 */
	float eps;    /* > 0 and finite */
	enum nk_dtype dtype;
	enum nk_dtype weight_dtype;
	unsigned flags; /* enum nk_flags */
	const void *x;  /* [rows, cols]: x, or y when NK_MEMORY_EFFICIENT */
	void *y;        /* [rows, cols] forward output */
	float *mean;    /* [rows] */
	float *rstd;    /* [rows] */
	const void *gamma; /* [cols] */
	const void *beta;  /* [cols] */
	const void *dy;    /* [rows, cols] */
	void *dx;          /* [rows, cols] */
	void *dgamma;      /* [cols] */
	void *dbeta;       /* [cols] */
	/* The variants (issue 19); all zero (NULL) is the plain norm. */
	const void *residual;  /* [rows, cols] of dtype: forward adds it to x */
	void *residual_out;    /* [rows, cols] of dtype: s = x + residual, rounded once */
	const void *ds;        /* [rows, cols] of dtype: backward adds it to dx */
	float weight_offset;   /* the weight is weight_offset + gamma (finite) */
	enum nk_fp8 y_fp8;     /* forward: y's FP8 format, or NK_FP8_NONE */
	const float *scale;    /* [1]: y_fp8 stores saturate(RNE(y * scale)) */
	float *amax;           /* [1]: max |y| before scaling, NaN skipped (y_fp8 only) */
};

/* What a job reports back besides its outputs. */
struct nk_norm_result {
	uint32_t clamped_cols; /* memory-efficient bwd: gamma entries clamped to +-eps */
};

/* Bytes per element of a storage dtype (0 for an unknown value). */
size_t nk_dtype_size(enum nk_dtype dtype);

/* Short names for logs and replies: "f32", "f16", "bf16"; "?" if unknown. */
const char *nk_dtype_name(enum nk_dtype dtype);
const char *nk_op_name(enum nk_op op);

/*
 * Storage conversions. To 16 bits: round to nearest, ties to even, with
 * subnormals, overflow to infinity, and NaN kept NaN (sign and top payload
 * bits kept, made quiet). To fp32: exact.
 */
float nk_f16_to_f32(uint16_t h);
uint16_t nk_f32_to_f16(float f);
float nk_bf16_to_f32(uint16_t b);
uint16_t nk_f32_to_bf16(float f);

/*
 * Element i of a buffer of `dtype` as double (exact; NaN for an unknown
 * dtype) / stored from a double, rounded once, straight from the double
 * (nothing is written for an unknown dtype). Any alignment.
 */
double nk_load(enum nk_dtype dtype, const void *base, size_t i);
void nk_store(enum nk_dtype dtype, void *base, size_t i, double value);

/*
 * FP8 conversions. From a double: round to nearest even, then saturate: a
 * magnitude above the largest finite value (448 in e4m3, 57344 in e5m2),
 * infinities included, becomes that value with its sign; any NaN becomes
 * 0x7f (a NaN in both formats); -0 stays -0 (0x80); subnormals are kept.
 * To a double: exact (e5m2's infinities read as infinities, though the
 * conversion above never makes them). `format` must be E4M3 or E5M2
 * (else 0x7f / NaN). nk_fp8_name: "e4m3", "e5m2", "none", or "?".
 */
uint8_t nk_fp8_from_double(enum nk_fp8 format, double value);
double nk_fp8_to_double(enum nk_fp8 format, uint8_t bits);
const char *nk_fp8_name(enum nk_fp8 format);

/* `value` rounded to `dtype` as nk_store stores it, as a double (exact). */
double nk_round(enum nk_dtype dtype, double value);

/* Which variants (enum nk_features) a job uses; 0 for the plain norm. */
unsigned nk_norm_features(const struct nk_norm_args *args);

/*
 * Checks the combination of op, flags, dtypes and which tensors are present
 * (not their sizes: the caller bounds-checks memory). Returns NK_OK or
 * NK_EINVAL and, if `why` is non-NULL, a static one-line reason (NULL on
 * NK_OK). Refused:
 *   - args NULL; an op, dtype or weight_dtype outside its enum;
 *     weight_dtype neither dtype nor NK_F32 (e.g. f16 data, bf16 weights);
 *   - rows < 1, cols < 1, cols > 2^32 - 1 (clamped_cols must count them),
 *     rows * cols > 2^59 (byte offsets must fit in int64_t);
 *   - eps not finite or not > 0 (NaN included);
 *   - flag bits outside enum nk_flags; NK_MEMORY_EFFICIENT or NK_ACCUMULATE
 *     on a forward op;
 *   - x absent; forward without y; backward without dy, dx or rstd;
 *     LayerNorm backward without mean unless memory-efficient;
 *   - beta without gamma; dgamma or dbeta without gamma;
 *   - RMSNorm with beta, mean or dbeta (it has none of them);
 *   - y_fp8 outside enum nk_fp8, or on a backward op; y_fp8 without scale;
 *     scale or amax without y_fp8; residual without residual_out or the
 *     reverse (forward); weight_offset not finite, or non-zero without
 *     gamma.
 * Tensors of the other direction are ignored (ds of a forward; residual,
 * residual_out, scale, amax of a backward).
 */
int nk_norm_check(const struct nk_norm_args *args, const char **why);

/* ---- CPU backend and reference ----------------------------------------- */

enum nk_cpu_precision {
	NK_CPU_FP32 = 0,      /* the CPU backend: fp32 compute */
	NK_CPU_REFERENCE = 1, /* the oracle: the same code computing in fp64 */
};

struct nk_cpu_opts {
	enum nk_cpu_precision precision;
	int threads; /* worker threads for this job; <= 1 runs on the caller */
};

/*
 * Runs one job on host memory. Results do not depend on `threads`: rows are
 * split into at most 32 blocks by a rule of rows and cols alone, and
 * per-block dgamma/dbeta partials are summed in block order. Helper threads
 * (threads - 1 of them, at most one per block) are started by the call
 * only for jobs of more than 256K elements. opts NULL: NK_CPU_FP32 on the
 * calling thread. result (may be NULL) gets the clamped count of a
 * memory-efficient backward, else 0. Every variant runs (NK_FEATURES_ALL).
 * Returns NK_OK, NK_EINVAL (see
 * nk_norm_check; also an unknown precision), NK_ENOMEM (scratch of about
 * (4 * threads + 3 + 2 * blocks) * cols compute-type elements could not be
 * allocated). Thread-safe: concurrent calls on disjoint outputs are fine.
 */
int nk_cpu_norm(const struct nk_norm_args *args, const struct nk_cpu_opts *opts,
		struct nk_norm_result *result);

/* ---- CUDA backend ------------------------------------------------------- */

/*
 * The generation of the CUDA variants and of the rules that pick them: bump
 * it when a variant's meaning or a default changes, so that choices a
 * daemon persisted for older kernels are dropped instead of kept forever
 * (this line's git history says what each generation changed).
 */
#define NK_VARIANT_SET 10

/* Which kernel family a variant runs. */
enum nk_variant_family {
	NK_FAMILY_NONE = 0,
	NK_FAMILY_WARP_ROWS = 1, /* one warp handles one or several whole rows */
	NK_FAMILY_BLOCK_ROW = 2, /* one block per row, row held in registers */
	NK_FAMILY_BLOCK_SMEM = 3, /* one block per row, row staged in shared memory */
	NK_FAMILY_GENERIC = 4,   /* any cols, any alignment: the fallback */
	NK_FAMILY_TMA_SLICE = 5, /* backward, sm_90: a cluster a row, each block a
				    column slice staged by TMA bulk copies */
	NK_FAMILY_FUSED = 6,     /* the norm variants (residual, offset, FP8): every
				    job that uses one, and only those */
	NK_FAMILY_LAST = NK_FAMILY_FUSED,
};

/*
 * A kernel variant and its launch shape: a plain value that the daemon's
 * variant cache stores and persists as is (fixed size, no pointers).
 */
struct nk_variant {
	uint16_t family;         /* enum nk_variant_family */
	uint16_t threads;        /* threads per block */
	uint16_t rows_per_block; /* rows a block owns at a time */
	uint16_t vec_elems;      /* elements per vector load (1 = scalar) */
	uint32_t param;          /* family-specific; the CUDA backend packs
				    vectors a thread (bits 0-7), blocks sharing
				    a row (8-15), the backward grid cap (16-30)
				    and "split rows" (31; in block_smem the ring
				    backward, which repacks bits 0-15; tma_slice
				    keeps its stages in bits 4-7), see
				    norm_cuda_shape.cuh */
	uint32_t reserved;       /* zero */
};

/* Facts about a device that the launchers need; the daemon fills it once. */
struct nk_device_info {
	int ordinal;
	int sm_count;
	int max_threads_per_sm;
	size_t max_smem_per_block_optin;
	int cc_major, cc_minor;
	int mem_gbps; /* DRAM bandwidth by memory clock and bus width, GB/s (0: unknown) */
};

/* The mem_gbps of CUDA device `ordinal` (0 when the runtime does not say). */
int nk_cuda_mem_gbps(int ordinal);

/* Execution context for one launch. */
struct nk_cuda_exec {
	void *stream;          /* cudaStream_t; NULL is the legacy default stream */
	void *workspace;       /* device scratch of nk_cuda_workspace_bytes() */
	size_t workspace_bytes;
	uint32_t *clamped_cols; /* device or mapped host word, written
				   asynchronously by every backward job
				   (0 unless memory-efficient); may be NULL */
};

/* Fills the default (rule-based) variant for a job on a device. */
int nk_cuda_variant_default(const struct nk_norm_args *args, const struct nk_device_info *dev,
			    struct nk_variant *out);

/* Lists up to `max` candidate variants for autotuning; returns the count (>= 0). */
int nk_cuda_variant_candidates(const struct nk_norm_args *args,
			       const struct nk_device_info *dev, struct nk_variant *out, int max);

/* Whether `variant` can run `args` (alignment, cols, shared memory). */
bool nk_cuda_variant_fits(const struct nk_norm_args *args, const struct nk_device_info *dev,
			  const struct nk_variant *variant);

/* A human-readable name such as "warp_rows/t128/r4/v8" into buf. */
void nk_variant_name(const struct nk_variant *variant, char *buf, size_t len);

/*
 * Scratch the launch needs (dgamma/dbeta partials, 1 / clamp(gamma), row
 * sums): a deterministic function of the shape and of the variant that
 * nk_cuda_norm will actually run for `variant` (its fallback when it does
 * not fit). 0 for forward jobs. The workspace must be 16-byte aligned; its
 * contents need not be initialized.
 */
size_t nk_cuda_workspace_bytes(const struct nk_norm_args *args,
			       const struct nk_device_info *dev, const struct nk_variant *variant);

/*
 * Enqueues the job on exec->stream. If `variant` (NULL: the default) does
 * not fit the job (alignment, shared memory), the launcher falls back to
 * the default variant, or the generic one, and writes what it ran into *ran
 * (may be NULL). Never synchronizes. NK_EINVAL for a job nk_norm_check
 * refuses, a pointer not aligned to its element size, or a missing or too
 * small workspace; NK_EDEVICE when a launch fails. Thread-safe.
 */
int nk_cuda_norm(const struct nk_norm_args *args, const struct nk_device_info *dev,
		 const struct nk_variant *variant, const struct nk_cuda_exec *exec,
		 struct nk_variant *ran);

/* The last CUDA error string seen by a launcher on this thread. */
const char *nk_cuda_last_error(void);

/* The fused family (kernels/norm_cuda_fused.cu): any job with norm variants, any layout. */
size_t nk_cuda_fused_workspace_bytes(const struct nk_norm_args *args,
				     const struct nk_device_info *dev);
int nk_cuda_fused_norm(const struct nk_norm_args *args, const struct nk_device_info *dev,
		       const struct nk_cuda_exec *exec);

/* ---- output check on the device (normstress's enqueue mode) ------------- */

#define NK_CHECK_MAX_OUTPUTS 3 /* outputs of one job: y/mean/rstd or dx/dgamma/dbeta */
#define NK_CHECK_MAX_BLOCKS 264 /* blocks of one check (its per-block partials) */

/*
 * One output of a job and the values it must hold: the reference computed
 * on the host (fp64, rounded to the output's dtype as the CPU oracle stores
 * it) and widened to fp32, which is exact. The output passes when no
 * element is NaN where the reference is not (or the reverse) and
 * ||out - expect|| < rtol * sqrt(ref_norm2) over the non-NaN elements: a
 * relative L2 tolerance, the rule of client/tools/jobkit.c, whose
 * ref_norm2 is the squared norm of the reference, or of the terms the
 * output sums when cancellation makes that larger.
 */
struct nk_check_output {
	const void *out;      /* device: n elements of dtype */
	const float *expect;  /* device: n fp32 values */
	int64_t n;
	enum nk_dtype dtype;
	float rtol;           /* relative tolerance, > 0 */
	double ref_norm2;     /* squared norm the error is judged against, > 0 */
};

/* Device counters the checks add to; zeroed once, shared by any number of streams. */
struct nk_check_counters {
	unsigned long long checks;     /* jobs checked (each check adds one when it ends) */
	unsigned long long mismatched; /* of them, with an output out of tolerance */
};

/*
 * Device scratch of one stream's checks: per-block partial sums and the
 * count of blocks done, which the last block resets. Zeroed once; the
 * checks that share one must be ordered (the same stream).
 */
struct nk_check_scratch {
	unsigned int blocks_done;
	unsigned int reserved;
	double partial[NK_CHECK_MAX_BLOCKS][NK_CHECK_MAX_OUTPUTS];
};

/*
 * Enqueues on `stream` a check of `count` (1..NK_CHECK_MAX_OUTPUTS) outputs
 * of one job: adds 1 to counters->checks, and 1 to counters->mismatched if
 * any output fails, once the whole check has run (deterministic sums: block
 * partials added in block order, no float atomics). Never synchronizes.
 * NK_EINVAL for a NULL pointer, a count out of range, an unknown dtype or
 * a tolerance that is not positive; NK_EDEVICE when the launch fails
 * (nk_cuda_last_error() says why). Thread-safe.
 */
int nk_cuda_check_outputs(const struct nk_check_output *outputs, int count,
			  struct nk_check_counters *counters, struct nk_check_scratch *scratch,
			  void *stream);

#ifdef __cplusplus
}
#endif

#endif /* NORMD_NORM_KERNELS_H */
