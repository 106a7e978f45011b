/*
 * What the CPU and CUDA backends of normd's normalization kernels share:
 * names of dtypes and ops, the validation of a job (nk_norm_check), and the
 * conversions between the 16-bit storage types (fp16, bf16) and fp32/fp64.
 *
 * Conversions to a 16-bit type round to nearest, ties to even, directly from
 * the double value (never through float first), so a double is rounded
 * exactly once. Infinities and subnormals are exact where representable;
 * values beyond the largest finite number become infinity; a NaN stays a NaN
 * with its sign and top payload bits, made quiet. Conversions to FP8 round
 * to nearest even and saturate (norm_kernels.h, nk_store).
 */
#include "norm_kernels.h"

#include <math.h>
#include <string.h>

/* Jobs bigger than this (2^59 elements) are refused so that no byte offset,
 * even of an fp64 scratch copy, can overflow int64_t. */
#define MAX_ELEMS (INT64_MAX / 16)

size_t nk_dtype_size(enum nk_dtype dtype)
{
	switch (dtype) {
	case NK_F32:
		return 4;
	case NK_F16:
	case NK_BF16:
		return 2;
	}
	return 0;
}

const char *nk_dtype_name(enum nk_dtype dtype)
{
	switch (dtype) {
	case NK_F32:
		return "f32";
	case NK_F16:
		return "f16";
	case NK_BF16:
		return "bf16";
	}
	return "?";
}

const char *nk_op_name(enum nk_op op)
{
	switch (op) {
	case NK_LAYERNORM_FWD:
		return "layernorm_fwd";
	case NK_LAYERNORM_BWD:
		return "layernorm_bwd";
	case NK_RMSNORM_FWD:
		return "rmsnorm_fwd";
	case NK_RMSNORM_BWD:
		return "rmsnorm_bwd";
	}
	return "?";
}

/* ---- conversions --------------------------------------------------------- */

/*
 * Rounds a double to a binary format of 1 + ebits + mbits bits (IEEE layout:
 * sign, biased exponent, mantissa without the implicit bit), to nearest with
 * ties to even. fp16 is (5, 10), bf16 is (8, 7).
 */
static uint16_t round_to_short_float(double d, int ebits, int mbits)
{
	uint64_t u;
	memcpy(&u, &d, sizeof(u));
	uint16_t sign = (uint16_t)((u >> 63) << (ebits + mbits));
	int dexp = (int)((u >> 52) & 0x7ff);
	uint64_t dmant = u & ((UINT64_C(1) << 52) - 1);
	int bias = (1 << (ebits - 1)) - 1;
	uint16_t inf = (uint16_t)(((1u << ebits) - 1) << mbits);

	if (dexp == 0x7ff && dmant != 0) /* NaN: keep the top payload, set quiet */
		return sign | inf | (uint16_t)(1u << (mbits - 1)) |
		       (uint16_t)(dmant >> (52 - mbits));
	if (dexp == 0x7ff)
		return sign | inf;
	/* Zero and double subnormals lie far below half the smallest target
	 * subnormal, so they round to a signed zero. */
	if (dexp == 0)
		return sign;

	int e = dexp - 1023;
	if (e > bias)
		return sign | inf;
	/* The target's quantum at this magnitude is 2^(qexp - mbits): below the
	 * normal range it stays at the subnormal quantum. */
	int qexp = e < 1 - bias ? 1 - bias : e;
	int shift = 52 - mbits + (qexp - e);
	if (shift > 63)
		return sign;

	uint64_t sig = dmant | (UINT64_C(1) << 52);
	uint64_t q = sig >> shift;
	uint64_t rem = sig & ((UINT64_C(1) << shift) - 1);
	uint64_t half = UINT64_C(1) << (shift - 1);
	if (rem > half || (rem == half && (q & 1)))
		q++;
	/* q includes the implicit bit for normal numbers, so adding it to the
	 * exponent field one below carries correctly into the next binade, from
	 * subnormal to normal and from the largest finite value to infinity. */
	uint64_t bits = ((uint64_t)(qexp + bias - 1) << mbits) + q;
	if (bits >= inf)
		return sign | inf;
	return sign | (uint16_t)bits;
}

/*
 * Rounds a double to an FP8 format of `ebits` exponent and `mbits` mantissa
 * bits to nearest, ties to even, saturating at `max` (whose encoding is
 * `max_bits`): what nk_store writes. NaN becomes 0x7f, a NaN in both
 * formats (e4m3 has no other; e5m2's quiet NaN with every mantissa bit set).
 */
static uint8_t round_to_fp8(double d, int ebits, int mbits, double max, uint8_t max_bits)
{
	if (isnan(d))
		return 0x7f;
	uint8_t sign = signbit(d) ? 0x80 : 0;
	double a = fabs(d);
	if (a >= max)
		return sign | max_bits;
	if (a == 0)
		return sign;
	int bias = (1 << (ebits - 1)) - 1, e;
	frexp(a, &e); /* a = m * 2^e with m in [0.5, 1): its leading bit is 2^(e - 1) */
	/* The quantum at this magnitude is 2^(qexp - mbits); below the normal
	 * range it stays at the subnormal quantum. */
	int qexp = e - 1 < 1 - bias ? 1 - bias : e - 1;
	/* Scaling by a power of two is exact; nearbyint rounds ties to even. */
	double q = nearbyint(ldexp(a, mbits - qexp));
	/* q counts quanta, the implicit bit included for normal numbers, so
	 * adding it to the exponent field one below carries correctly (from
	 * subnormal to normal, and into the next binade); a < max keeps the
	 * result at most max. */
	unsigned bits = ((unsigned)(qexp + bias - 1) << mbits) + (unsigned)q;
	return sign | (uint8_t)bits;
}

/* An FP8 byte as a double (exact). */
static double fp8_value(uint8_t b, int ebits, int mbits, bool has_inf)
{
	int bias = (1 << (ebits - 1)) - 1, emax = (1 << ebits) - 1;
	int e = (b >> mbits) & emax, m = b & ((1 << mbits) - 1);
	double v;
	if (e == emax && has_inf)
		v = m ? NAN : INFINITY;
	else if (e == emax && m == (1 << mbits) - 1)
		v = NAN; /* e4m3: the one NaN pattern (per sign) */
	else if (e == 0)
		v = ldexp(m, 1 - bias - mbits);
	else
		v = ldexp(m + (1 << mbits), e - bias - mbits);
	return (b & 0x80) ? -v : v;
}

float nk_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000) << 16;
	uint32_t exp = (h >> 10) & 0x1f;
	uint32_t mant = h & 0x3ff;
	uint32_t bits;
	float f;

	if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in float */
		f = (float)mant * 0x1p-24f;
		return sign ? -f : f;
	}
	if (exp == 0x1f)
		bits = sign | 0x7f800000u | (mant << 13);
	else
		bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
	memcpy(&f, &bits, sizeof(f));
	return f;
}

uint16_t nk_f32_to_f16(float f)
{
	return round_to_short_float((double)f, 5, 10);
}

float nk_bf16_to_f32(uint16_t b)
{
	uint32_t bits = (uint32_t)b << 16;
	float f;
	memcpy(&f, &bits, sizeof(f));
	return f;
}

uint16_t nk_f32_to_bf16(float f)
{
	return round_to_short_float((double)f, 8, 7);
}

double nk_load(enum nk_dtype dtype, const void *base, size_t i)
{
	const unsigned char *p = base;
	uint16_t h;
	float f;

	switch (dtype) {
	case NK_F32:
		memcpy(&f, p + 4 * i, sizeof(f));
		return f;
	case NK_F16:
		memcpy(&h, p + 2 * i, sizeof(h));
		return nk_f16_to_f32(h);
	case NK_BF16:
		memcpy(&h, p + 2 * i, sizeof(h));
		return nk_bf16_to_f32(h);
	}
	return NAN;
}

void nk_store(enum nk_dtype dtype, void *base, size_t i, double value)
{
	unsigned char *p = base;
	uint16_t h;
	float f;

	switch (dtype) {
	case NK_F32:
		f = (float)value;
		memcpy(p + 4 * i, &f, sizeof(f));
		break;
	case NK_F16:
		h = round_to_short_float(value, 5, 10);
		memcpy(p + 2 * i, &h, sizeof(h));
		break;
	case NK_BF16:
		h = round_to_short_float(value, 8, 7);
		memcpy(p + 2 * i, &h, sizeof(h));
		break;
	}
}

double nk_round(enum nk_dtype dtype, double value)
{
	unsigned char buf[4];
	nk_store(dtype, buf, 0, value);
	return nk_load(dtype, buf, 0);
}

uint8_t nk_fp8_from_double(enum nk_fp8 format, double value)
{
	switch (format) {
	case NK_FP8_E4M3:
		return round_to_fp8(value, 4, 3, 448.0, 0x7e);
	case NK_FP8_E5M2:
		return round_to_fp8(value, 5, 2, 57344.0, 0x7b);
	default:
		return 0x7f;
	}
}

double nk_fp8_to_double(enum nk_fp8 format, uint8_t bits)
{
	switch (format) {
	case NK_FP8_E4M3:
		return fp8_value(bits, 4, 3, false);
	case NK_FP8_E5M2:
		return fp8_value(bits, 5, 2, true);
	default:
		return NAN;
	}
}

const char *nk_fp8_name(enum nk_fp8 format)
{
	switch (format) {
	case NK_FP8_NONE:
		return "none";
	case NK_FP8_E4M3:
		return "e4m3";
	case NK_FP8_E5M2:
		return "e5m2";
	}
	return "?";
}

unsigned nk_norm_features(const struct nk_norm_args *args)
{
	bool backward = args->op == NK_LAYERNORM_BWD || args->op == NK_RMSNORM_BWD;
	unsigned f = 0;
	if (backward ? args->ds != NULL : args->residual != NULL)
		f |= NK_FEATURE_RESIDUAL;
	if (args->weight_offset != 0.0f)
		f |= NK_FEATURE_WEIGHT_OFFSET;
	if (!backward && args->y_fp8 != NK_FP8_NONE)
		f |= NK_FEATURE_FP8_OUTPUT;
	return f;
}

/* ---- job validation ------------------------------------------------------ */

static bool op_is_known(enum nk_op op)
{
	return (int)op >= NK_LAYERNORM_FWD && (int)op <= NK_RMSNORM_BWD;
}

/* A dtype that x and the weights may have (FP8 is for y alone). */
static bool dtype_is_known(enum nk_dtype dtype)
{
	return (int)dtype >= NK_F32 && (int)dtype <= NK_BF16;
}

/* The scalar part of a job: op, dtypes, shape, eps, flags. */
static const char *check_scalars(const struct nk_norm_args *a)
{
	bool backward = a->op == NK_LAYERNORM_BWD || a->op == NK_RMSNORM_BWD;

	if (!op_is_known(a->op))
		return "unknown op";
	if (!dtype_is_known(a->dtype))
		return "unknown dtype";
	if (!dtype_is_known(a->weight_dtype))
		return "unknown weight_dtype";
	if (a->weight_dtype != a->dtype && a->weight_dtype != NK_F32)
		return "weight_dtype must equal dtype or be f32";
	if (a->rows < 1)
		return "rows must be at least 1";
	if (a->cols < 1)
		return "cols must be at least 1";
	if (a->cols > (int64_t)UINT32_MAX)
		return "cols must be at most 2^32 - 1";
	if (a->rows > MAX_ELEMS / a->cols)
		return "rows * cols is too large (more than 2^59 elements)";
	if (!(a->eps > 0.0f) || isinf(a->eps))
		return "eps must be finite and greater than 0";
	if (a->flags & ~(unsigned)(NK_MEMORY_EFFICIENT | NK_ACCUMULATE))
		return "unknown flag bits are set";
	if (!backward && (a->flags & NK_MEMORY_EFFICIENT))
		return "memory_efficient applies to backward ops only";
	if (!backward && (a->flags & NK_ACCUMULATE))
		return "accumulate applies to backward ops only";
	if ((int)a->y_fp8 < NK_FP8_NONE || (int)a->y_fp8 > NK_FP8_E5M2)
		return "unknown y_fp8 format";
	if (backward && a->y_fp8 != NK_FP8_NONE)
		return "FP8 output (y_fp8) applies to forward ops only";
	if (!isfinite(a->weight_offset))
		return "weight_offset must be finite";
	return NULL;
}

/* The forward's own tensors: y, the residual pair, FP8's scale and amax. */
static const char *check_forward_variants(const struct nk_norm_args *a)
{
	if (!a->y)
		return "y is absent";
	if (a->residual && !a->residual_out)
		return "residual is given but residual_out (where s = x + residual goes) is absent";
	if (a->residual_out && !a->residual)
		return "residual_out is given but residual is absent";
	if (a->y_fp8 != NK_FP8_NONE && !a->scale)
		return "FP8 output (y_fp8) needs scale";
	if (a->y_fp8 == NK_FP8_NONE && (a->scale || a->amax))
		return "scale and amax go with FP8 output (y_fp8) only";
	return NULL;
}

/* Which tensors are present, for ops of both directions. */
static const char *check_tensors(const struct nk_norm_args *a)
{
	bool rms = a->op == NK_RMSNORM_FWD || a->op == NK_RMSNORM_BWD;
	bool backward = a->op == NK_LAYERNORM_BWD || a->op == NK_RMSNORM_BWD;
	bool mem_eff = a->flags & NK_MEMORY_EFFICIENT;

	if (!a->x)
		return mem_eff ? "y (passed in x) is absent" : "x is absent";
	if (rms && a->beta)
		return "RMSNorm takes no beta; pass beta = NULL";
	if (rms && a->mean)
		return "RMSNorm has no mean; pass mean = NULL";
	if (a->beta && !a->gamma)
		return "beta is given but gamma is absent";
	if (a->weight_offset != 0.0f && !a->gamma)
		return "weight_offset is set but gamma is absent";
	if (!backward)
		return check_forward_variants(a);

	if (!a->dy)
		return "dy is absent";
	if (!a->dx)
		return "dx is absent";
	if (!a->rstd)
		return "rstd is absent";
	if (!rms && !mem_eff && !a->mean)
		return "mean is absent (only memory_efficient backward can do without)";
	if (a->dgamma && !a->gamma)
		return "dgamma requested but gamma is absent";
	if (rms && a->dbeta)
		return "RMSNorm has no dbeta; pass dbeta = NULL";
	if (a->dbeta && !a->gamma)
		return "dbeta requested but gamma is absent";
	return NULL;
}

int nk_norm_check(const struct nk_norm_args *args, const char **why)
{
	const char *reason = "args is NULL";

	if (args) {
		reason = check_scalars(args);
		if (!reason)
			reason = check_tensors(args);
	}
	if (why)
		*why = reason;
	return reason ? NK_EINVAL : NK_OK;
}
