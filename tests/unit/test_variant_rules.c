/*
 * The host-side variant rules of the CUDA backend (the policy table of
 * kernels/norm_cuda_policy.c, the builders and fit checks of
 * kernels/norm_cuda_variant.cu) through the C ABI of kernels/norm_kernels.h:
 * nk_cuda_variant_default, nk_cuda_variant_candidates, nk_cuda_variant_fits,
 * nk_variant_name and nk_cuda_workspace_bytes. They read a struct nk_device_info and never touch
 * a GPU, so they run here on two profiles: an H100-like sm_90 and an
 * A100-like sm_80.
 *
 * Why: nk_cuda_norm quietly falls back to another variant when the one it is
 * given does not fit, so a default or an autotuning candidate that the
 * rules' own fit check refuses would never run as chosen; duplicate
 * candidates waste autotuning time; and a tma_slice variant (sm_90 only) on
 * an sm_80 device would trap. The sweep covers every op, dtype pair and
 * flag over widths on both sides of each family's limits, then a few rules
 * are pinned: tma_slice defaults for wide backward rows and narrow forward
 * rows on sm_90, and the refusal of corrupted tma_slice variants.
 *
 * The tensors are fake, 16-byte aligned addresses: nothing is dereferenced.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <string.h>

#include "kernels/norm_kernels.h"

/* Candidates asked for, as the daemon's autotuner does. */
enum { MAX_CANDIDATES = 16 };

/* Failures the sweeps print in full before they only count them. */
enum { MAX_PRINTED = 20 };

static const struct nk_device_info h100 = {.ordinal = 0,
					   .sm_count = 132,
					   .max_threads_per_sm = 2048,
					   .max_smem_per_block_optin = 232448,
					   .cc_major = 9,
					   .cc_minor = 0};
/* The H100 with the H200's memory: the rules marked FAST_MEMORY apply. */
static const struct nk_device_info h200 = {.ordinal = 0,
					   .sm_count = 132,
					   .max_threads_per_sm = 2048,
					   .max_smem_per_block_optin = 232448,
					   .cc_major = 9,
					   .cc_minor = 0,
					   .mem_gbps = 4814};
static const struct nk_device_info a100 = {.ordinal = 0,
					   .sm_count = 108,
					   .max_threads_per_sm = 2048,
					   .max_smem_per_block_optin = 166912,
					   .cc_major = 8,
					   .cc_minor = 0};

static const enum nk_op ops[] = {NK_LAYERNORM_FWD, NK_RMSNORM_FWD, NK_LAYERNORM_BWD,
				 NK_RMSNORM_BWD};

/* Storage dtype of x, y, dy, dx, then of the weights and their gradients. */
static const enum nk_dtype dtype_pairs[][2] = {
    {NK_F32, NK_F32}, {NK_F16, NK_F16}, {NK_BF16, NK_BF16}, {NK_BF16, NK_F32}};

/*
 * Widths on both sides of the families' limits: not a multiple of any
 * vector (1, 7, 33, 127, 1000, 8200, 70001), warp rows, block rows, staged
 * rows, split rows and clusters.
 */
static const int64_t widths[] = {1,	7,     8,     32,    33,    127,   128,
				 512,	1000,  1024,  2048,  4096,  8192,  8200,
				 12288, 16384, 24584, 32768, 65536, 70000, 70001};

#define COUNT(array) (sizeof(array) / sizeof((array)[0]))

/* Jobs of one sweep: op x dtype pair x flags x width x row count (three). */
#define SWEEP_SLOTS (COUNT(ops) * COUNT(dtype_pairs) * 2 * COUNT(widths) * 3)

static int failures;

static bool op_is_bwd(enum nk_op op)
{
	return op == NK_LAYERNORM_BWD || op == NK_RMSNORM_BWD;
}

static bool op_is_ln(enum nk_op op)
{
	return op == NK_LAYERNORM_FWD || op == NK_LAYERNORM_BWD;
}

/* A fake tensor address: tensor `n` of the job, 64 KB apart, 16-byte aligned. */
static void *fake_tensor(unsigned n)
{
	return (void *)(uintptr_t)(0x10000u * n);
}

/* The rows of a job of about 2^24 elements. */
static int64_t rows_for(int64_t cols)
{
	int64_t rows = ((int64_t)1 << 24) / cols;
	return rows > 0 ? rows : 1;
}

/*
 * A valid job: every tensor the op reads or writes is present (RMSNorm has
 * no mean, beta or dbeta), so backward jobs compute dgamma.
 */
static struct nk_norm_args make_job(enum nk_op op, enum nk_dtype dtype, enum nk_dtype weight_dtype,
				    unsigned flags, int64_t cols, int64_t rows)
{
	struct nk_norm_args a = {.op = op,
				 .rows = rows,
				 .cols = cols,
				 .eps = 1e-5f,
				 .dtype = dtype,
				 .weight_dtype = weight_dtype,
				 .flags = flags,
				 .x = fake_tensor(1),
				 .rstd = fake_tensor(4),
				 .gamma = fake_tensor(5)};
	if (op_is_ln(op)) {
		a.mean = fake_tensor(3);
		a.beta = fake_tensor(6);
	}
	if (!op_is_bwd(op)) {
		a.y = fake_tensor(2);
		return a;
	}
	a.dy = fake_tensor(7);
	a.dx = fake_tensor(8);
	a.dgamma = fake_tensor(9);
	if (op_is_ln(op))
		a.dbeta = fake_tensor(10);
	return a;
}

/*
 * The sweep's job number `i` (0 <= i < SWEEP_SLOTS) into *out; false for the
 * slots that are no job (memory-efficient forward).
 */
static bool sweep_job(size_t i, struct nk_norm_args *out)
{
	const size_t w = i % COUNT(widths), r = i / COUNT(widths) % 3;
	const size_t mem_eff = i / COUNT(widths) / 3 % 2;
	const size_t pair = i / COUNT(widths) / 3 / 2 % COUNT(dtype_pairs);
	const size_t op = i / COUNT(widths) / 3 / 2 / COUNT(dtype_pairs);
	const int64_t rows[3] = {1, 7, rows_for(widths[w])};

	if (mem_eff && !op_is_bwd(ops[op]))
		return false;
	*out = make_job(ops[op], dtype_pairs[pair][0], dtype_pairs[pair][1],
			mem_eff ? NK_MEMORY_EFFICIENT : 0u, widths[w], rows[r]);
	return true;
}

static const char *profile_name(const struct nk_device_info *dev)
{
	if (dev->cc_major < 9)
		return "sm_80 (A100)";
	return dev->mem_gbps >= 4000 ? "sm_90, 4814 GB/s (H200)" : "sm_90 (H100)";
}

/*
 * Counts a failed expectation and prints the case (job, profile, variant)
 * so that a failing sweep names every rule it caught out.
 */
static void expect(bool ok, const char *what, const struct nk_norm_args *a,
		   const struct nk_device_info *dev, const struct nk_variant *v)
{
	char name[128] = "-";

	if (ok)
		return;
	if (v)
		nk_variant_name(v, name, sizeof(name));
	if (failures++ < MAX_PRINTED)
		print_error("%s: %s %s/%s flags %u cols %lld rows %lld on %s: %s\n", what,
			    nk_op_name(a->op), nk_dtype_name(a->dtype),
			    nk_dtype_name(a->weight_dtype), a->flags, (long long)a->cols,
			    (long long)a->rows, profile_name(dev), name);
}

/* Whether nk_variant_name names `v` by its family, without "unknown". */
static bool name_ok(const struct nk_variant *v)
{
	static const char *const families[] = {"none",	     "warp_rows", "block_row",
					       "block_smem", "generic",	  "tma_slice"};
	char name[128] = "";
	nk_variant_name(v, name, sizeof(name));
	if (name[0] == '\0' || strstr(name, "unknown") || v->family > NK_FAMILY_LAST)
		return false;
	const size_t len = strlen(families[v->family]);
	return strncmp(name, families[v->family], len) == 0 && name[len] == '/';
}

/* The default of one job: it exists, fits, is named, and sizes its workspace. */
static bool check_default(const struct nk_norm_args *a, const struct nk_device_info *dev,
			  struct nk_variant *def)
{
	const int rc = nk_cuda_variant_default(a, dev, def);
	expect(rc == NK_OK, "default refused", a, dev, NULL);
	if (rc != NK_OK)
		return false;
	expect(nk_cuda_variant_fits(a, dev, def), "default does not fit", a, dev, def);
	expect(name_ok(def), "default badly named", a, dev, def);
	const size_t ws = nk_cuda_workspace_bytes(a, dev, def);
	if (op_is_bwd(a->op) && a->dgamma)
		expect(ws > 0, "backward default without workspace", a, dev, def);
	else if (!op_is_bwd(a->op))
		expect(ws == 0, "forward default with workspace", a, dev, def);
	return true;
}

/*
 * The candidates of one job: the default first, at most MAX_CANDIDATES
 * (the slot past them stays untouched), each fitting, named and unique.
 */
static void check_job(const struct nk_norm_args *a, const struct nk_device_info *dev)
{
	struct nk_variant def, cands[MAX_CANDIDATES + 1], canary;

	if (!check_default(a, dev, &def))
		return;
	memset(cands, 0xa5, sizeof(cands));
	canary = cands[MAX_CANDIDATES];
	const int n = nk_cuda_variant_candidates(a, dev, cands, MAX_CANDIDATES);
	expect(n >= 1 && n <= MAX_CANDIDATES, "candidate count out of range", a, dev, NULL);
	expect(memcmp(&cands[MAX_CANDIDATES], &canary, sizeof(canary)) == 0,
	       "candidates written past max", a, dev, NULL);
	if (n < 1 || n > MAX_CANDIDATES)
		return;
	expect(memcmp(&cands[0], &def, sizeof(def)) == 0, "first candidate is not the default", a,
	       dev, &cands[0]);
	for (int i = 0; i < n; i++) {
		expect(nk_cuda_variant_fits(a, dev, &cands[i]), "candidate does not fit", a, dev,
		       &cands[i]);
		expect(name_ok(&cands[i]), "candidate badly named", a, dev, &cands[i]);
		for (int j = 0; j < i; j++)
			expect(memcmp(&cands[i], &cands[j], sizeof(cands[i])) != 0,
			       "duplicate candidate", a, dev, &cands[i]);
	}
}

/* No variant of the job, default or candidate, is a tma_slice one. */
static void check_no_tma(const struct nk_norm_args *a, const struct nk_device_info *dev)
{
	struct nk_variant def, cands[MAX_CANDIDATES];

	if (nk_cuda_variant_default(a, dev, &def) == NK_OK)
		expect(def.family != NK_FAMILY_TMA_SLICE, "tma_slice default", a, dev, &def);
	const int n = nk_cuda_variant_candidates(a, dev, cands, MAX_CANDIDATES);
	for (int i = 0; i < n && i < MAX_CANDIDATES; i++)
		expect(cands[i].family != NK_FAMILY_TMA_SLICE, "tma_slice candidate", a, dev,
		       &cands[i]);
}

/* Runs `check` on every job of the sweep; returns the number of jobs. */
static int sweep(const struct nk_device_info *dev,
		 void (*check)(const struct nk_norm_args *, const struct nk_device_info *))
{
	struct nk_norm_args a;
	int jobs = 0;

	failures = 0;
	for (size_t i = 0; i < SWEEP_SLOTS; i++) {
		if (!sweep_job(i, &a))
			continue;
		check(&a, dev);
		jobs++;
	}
	return jobs;
}

/* Jobs of a sweep: (2 forward ops + 2 backward ops x 2 flags) x 4 pairs x 21 widths x 3 rows. */
enum { SWEEP_JOBS = (2 + 2 * 2) * 4 * 21 * 3 };

/* Fails the test if the sweep counted failed expectations (printed above). */
static void assert_no_failures(void)
{
	if (failures > 0)
		fail_msg("%d failed expectations, the first %d printed above", failures,
			 failures < MAX_PRINTED ? failures : MAX_PRINTED);
}

static void test_sweep_sm90(void **state)
{
	(void)state;
	assert_int_equal(sweep(&h100, check_job), SWEEP_JOBS);
	assert_no_failures();
}

static void test_sweep_h200(void **state)
{
	(void)state;
	assert_int_equal(sweep(&h200, check_job), SWEEP_JOBS);
	assert_no_failures();
}

static void test_sweep_sm80(void **state)
{
	(void)state;
	assert_int_equal(sweep(&a100, check_job), SWEEP_JOBS);
	assert_no_failures();
}

static void test_no_tma_slice_on_sm80(void **state)
{
	(void)state;
	assert_int_equal(sweep(&a100, check_no_tma), SWEEP_JOBS);
	assert_no_failures();
}

/*
 * The tma_slice backward rules (TMA_FEWEST_BLOCKS): K = ceil(vectors / (512
 * threads * 2 vectors)) blocks a row, each of 512 threads (so the
 * two-blocks-a-multiprocessor shape is not taken): bf16 16384 columns (2048
 * vectors) on a cluster of 2, 32768 on 4.
 */
static void test_wide_bwd_defaults_to_tma_slice(void **state)
{
	(void)state;
	static const enum nk_op bwd_ops[] = {NK_LAYERNORM_BWD, NK_RMSNORM_BWD};
	static const enum nk_dtype weights[] = {NK_BF16, NK_F32};
	static const int64_t cols[] = {16384, 32768};
	static const char *const cluster[] = {"/c2/", "/c4/"};

	for (size_t i = 0; i < 2 * 2 * 2 * 2; i++) {
		const size_t c = i % 2, mem_eff = i / 2 % 2, w = i / 4 % 2, op = i / 8;
		struct nk_norm_args a =
		    make_job(bwd_ops[op], NK_BF16, weights[w], mem_eff ? NK_MEMORY_EFFICIENT : 0u,
			     cols[c], rows_for(cols[c]));
		struct nk_variant v;
		char name[128];
		assert_int_equal(nk_cuda_variant_default(&a, &h100, &v), NK_OK);
		nk_variant_name(&v, name, sizeof(name));
		print_message("%s %s/%s flags %u cols %lld: %s\n", nk_op_name(a.op),
			      nk_dtype_name(a.dtype), nk_dtype_name(a.weight_dtype), a.flags,
			      (long long)a.cols, name);
		assert_int_equal(v.family, NK_FAMILY_TMA_SLICE);
		assert_int_equal(v.threads, 512);
		assert_non_null(strstr(name, cluster[c]));
	}
}

/*
 * bf16 8192 columns (1024 vectors, one tma_slice block a row): the
 * standard backward takes tma_slice, the memory-efficient one stays on
 * block_row with 512 threads (faster there: BENCHMARKS.md, tma_slice backward).
 */
static void test_one_block_memeff_stays_tiled(void **state)
{
	(void)state;
	for (int k = 0; k < 4; k++) {
		const bool mem_eff = k & 1;
		const enum nk_op op = k & 2 ? NK_RMSNORM_BWD : NK_LAYERNORM_BWD;
		struct nk_norm_args a = make_job(op, NK_BF16, NK_BF16,
						 mem_eff ? NK_MEMORY_EFFICIENT : 0u, 8192,
						 rows_for(8192));
		struct nk_variant v;
		assert_int_equal(nk_cuda_variant_default(&a, &h100, &v), NK_OK);
		assert_int_equal(v.family, mem_eff ? NK_FAMILY_BLOCK_ROW : NK_FAMILY_TMA_SLICE);
		assert_int_equal(v.threads, 512);
	}
}

/* v with `bits` bits of its param from bit `shift` on set to `value`. */
static struct nk_variant with_param_bits(struct nk_variant v, unsigned shift, unsigned bits,
					 uint32_t value)
{
	const uint32_t mask = ((1u << bits) - 1) << shift;
	v.param = (v.param & ~mask) | (value << shift & mask);
	return v;
}

/* A variant that differs from `good` and must be refused for job `a` on `dev`. */
static void assert_refused(const struct nk_norm_args *a, const struct nk_device_info *dev,
			   const struct nk_variant *good, const struct nk_variant *bad)
{
	char name[128];
	nk_variant_name(bad, name, sizeof(name));
	print_message("refused: %s\n", name);
	assert_memory_not_equal(good, bad, sizeof(*bad));
	assert_false(nk_cuda_variant_fits(a, dev, bad));
}

static void test_corrupt_tma_slice_refused(void **state)
{
	(void)state;
	struct nk_norm_args a =
	    make_job(NK_LAYERNORM_BWD, NK_BF16, NK_BF16, 0u, 32768, rows_for(32768));
	struct nk_variant good, bad;

	assert_int_equal(nk_cuda_variant_default(&a, &h100, &good), NK_OK);
	assert_int_equal(good.family, NK_FAMILY_TMA_SLICE);
	assert_true(nk_cuda_variant_fits(&a, &h100, &good));

	/* Stages (bits 4-7) below the three the kernel needs, K (8-15) past a cluster of 8. */
	bad = with_param_bits(good, 4, 4, 2);
	assert_refused(&a, &h100, &good, &bad);
	bad = with_param_bits(good, 4, 4, 0);
	assert_refused(&a, &h100, &good, &bad);
	bad = with_param_bits(good, 8, 8, 9);
	assert_refused(&a, &h100, &good, &bad);
	bad = good;
	bad.threads = 1024;
	assert_refused(&a, &h100, &good, &bad);
	bad = good;
	bad.reserved = 1;
	assert_refused(&a, &h100, &good, &bad);

	/* The intact variant: not on sm_80, not for tensors off 16-byte alignment. */
	assert_false(nk_cuda_variant_fits(&a, &a100, &good));
	struct nk_norm_args misaligned = a;
	misaligned.x = (const char *)a.x + 2;
	assert_false(nk_cuda_variant_fits(&misaligned, &h100, &good));
}

/* The forward default of op on dtype at cols, on device d: family, threads, vectors a thread. */
static void expect_fwd(enum nk_op op, enum nk_dtype dt, int64_t cols,
		       const struct nk_device_info *d, int family, int threads, int nv)
{
	struct nk_norm_args a = make_job(op, dt, dt, 0u, cols, rows_for(cols));
	struct nk_variant v;
	char name[96];

	assert_int_equal(nk_cuda_variant_default(&a, d, &v), NK_OK);
	nk_variant_name(&v, name, sizeof(name));
	print_message("%s %s cols %lld cc %d: %s\n", nk_op_name(op), nk_dtype_name(dt),
		      (long long)cols, d->cc_major, name);
	assert_int_equal(v.family, family);
	assert_int_equal(v.threads, threads);
	assert_int_equal(v.param & 0xff, nv);
	assert_true(nk_cuda_variant_fits(&a, d, &v));
}

/*
 * The forward rules: 16-bit rows of up to 8192 columns on the tiled kernel, four
 * vectors a thread, 256 threads (no tma_slice, on sm_90 either); RMSNorm up to
 * 16384 columns (bf16 only) and LayerNorm from 12289 to 16384 too, one block
 * a row; wider
 * 16-bit rows staged (block_smem, four vectors a thread); fp32 RMSNorm two
 * vectors a thread up to 1024 vectors, LayerNorm four up to 2048, then
 * eight.
 */
static void test_fwd_defaults(void **state)
{
	(void)state;
	static const enum nk_op fwd_ops[] = {NK_LAYERNORM_FWD, NK_RMSNORM_FWD};
	const struct nk_device_info *devs[] = {&h100, &a100};

	for (size_t op = 0; op < COUNT(fwd_ops); op++) {
		for (size_t d = 0; d < COUNT(devs); d++) {
			expect_fwd(fwd_ops[op], NK_BF16, 128, devs[d], NK_FAMILY_WARP_ROWS, 256, 4);
			expect_fwd(fwd_ops[op], NK_F16, 512, devs[d], NK_FAMILY_WARP_ROWS, 256, 4);
			expect_fwd(fwd_ops[op], NK_BF16, 2048, devs[d], NK_FAMILY_BLOCK_ROW, 256,
				   4);
			expect_fwd(fwd_ops[op], NK_BF16, 1024, devs[d], NK_FAMILY_WARP_ROWS, 256,
				   4);
			expect_fwd(fwd_ops[op], NK_BF16, 8192, devs[d], NK_FAMILY_BLOCK_ROW, 256,
				   4);
			expect_fwd(fwd_ops[op], NK_BF16, 16384, devs[d], NK_FAMILY_BLOCK_ROW, 512,
				   4);
			expect_fwd(fwd_ops[op], NK_BF16, 24584, devs[d], NK_FAMILY_BLOCK_SMEM, 800,
				   4);
		}
		expect_fwd(fwd_ops[op], NK_BF16, 32768, &h100, NK_FAMILY_BLOCK_SMEM, 1024, 4);
		expect_fwd(fwd_ops[op], NK_F32, 16384, &h100, NK_FAMILY_BLOCK_ROW, 512, 8);
	}
	/* The edges: fp32 RMSNorm's two vectors stop past 1024 vectors; 16-bit takes four. */
	expect_fwd(NK_RMSNORM_FWD, NK_BF16, 4096, &h100, NK_FAMILY_BLOCK_ROW, 256, 4);
	expect_fwd(NK_RMSNORM_FWD, NK_BF16, 4104, &a100, NK_FAMILY_BLOCK_ROW, 160, 4);
	expect_fwd(NK_LAYERNORM_FWD, NK_F16, 8200, &h100, NK_FAMILY_BLOCK_SMEM, 288, 4);
	/* 16-bit RMSNorm from 8193 columns, LayerNorm from 12289, to 16384: the tiled kernel. */
	expect_fwd(NK_RMSNORM_FWD, NK_BF16, 8200, &h100, NK_FAMILY_BLOCK_ROW, 288, 4);
	expect_fwd(NK_RMSNORM_FWD, NK_F16, 8200, &h100, NK_FAMILY_BLOCK_SMEM, 288, 4);
	expect_fwd(NK_LAYERNORM_FWD, NK_BF16, 12288, &h100, NK_FAMILY_BLOCK_SMEM, 384, 4);
	expect_fwd(NK_RMSNORM_FWD, NK_BF16, 12288, &h100, NK_FAMILY_BLOCK_ROW, 384, 4);
	expect_fwd(NK_LAYERNORM_FWD, NK_BF16, 12296, &h100, NK_FAMILY_BLOCK_ROW, 416, 4);
	expect_fwd(NK_RMSNORM_FWD, NK_F16, 16384, &h100, NK_FAMILY_BLOCK_SMEM, 512, 4);
	expect_fwd(NK_RMSNORM_FWD, NK_F32, 128, &h100, NK_FAMILY_WARP_ROWS, 256, 2);
	expect_fwd(NK_RMSNORM_FWD, NK_F32, 4096, &a100, NK_FAMILY_BLOCK_ROW, 512, 2);
	expect_fwd(NK_RMSNORM_FWD, NK_F32, 4100, &h100, NK_FAMILY_BLOCK_ROW, 160, 8);
	expect_fwd(NK_LAYERNORM_FWD, NK_F32, 8192, &a100, NK_FAMILY_BLOCK_ROW, 512, 4);
	expect_fwd(NK_LAYERNORM_FWD, NK_F32, 8196, &h100, NK_FAMILY_BLOCK_ROW, 288, 8);

	/* fp32 rows past a block (clusters on sm_90), and unaligned rows: the general rules'. */
	struct nk_norm_args a = make_job(NK_LAYERNORM_FWD, NK_F32, NK_F32, 0u, 32768, 64);
	struct nk_variant v;
	assert_int_equal(nk_cuda_variant_default(&a, &h100, &v), NK_OK);
	assert_true(nk_cuda_variant_fits(&a, &h100, &v));
	assert_true((v.param >> 8 & 0xff) > 1 || v.family != NK_FAMILY_BLOCK_ROW);
	a = make_job(NK_RMSNORM_FWD, NK_BF16, NK_BF16, 0u, 1001, 64);
	assert_int_equal(nk_cuda_variant_default(&a, &h100, &v), NK_OK);
	assert_int_equal(v.family, NK_FAMILY_GENERIC);
}

/* The default of a backward job with ds: family, threads, blocks a row (tma_slice). */
static void expect_ds_bwd(enum nk_op op, enum nk_dtype dt, unsigned flags, int64_t cols,
			  const struct nk_device_info *d, int family, int threads, int blocks)
{
	struct nk_norm_args a = make_job(op, dt, dt, flags, cols, rows_for(cols));
	a.ds = fake_tensor(11);
	struct nk_variant v;
	char name[96];

	assert_int_equal(nk_cuda_variant_default(&a, d, &v), NK_OK);
	nk_variant_name(&v, name, sizeof(name));
	print_message("%s%s +ds %s cols %lld cc %d: %s\n", nk_op_name(op),
		      flags ? " memeff" : "", nk_dtype_name(dt), (long long)cols, d->cc_major, name);
	assert_int_equal(v.family, family);
	assert_int_equal(v.threads, threads);
	if (family == NK_FAMILY_TMA_SLICE)
		assert_int_equal(v.param >> 8 & 0xff, blocks);
	assert_true(nk_cuda_variant_fits(&a, d, &v));
}

/*
 * Backward rows with ds on sm_90: 16-bit rows of up to 512 columns on
 * tma_slice rows of a warp's lanes, up to 4096 on the tiled kernel, from
 * 8192 on tma_slice with one block a multiprocessor (12288: two blocks of
 * 384 threads, not three of 256 at two a multiprocessor), memory-efficient
 * included; fp32 from 4096 on tma_slice, with more blocks where one
 * block's stages with ds do not fit (8192: two). sm_80: the tiled kernel
 * (split rows at 8192).
 */
/* A backward job's default on a device: its family and threads. */
static void expect_bwd_default(enum nk_op op, enum nk_dtype dtype, unsigned flags, int64_t cols,
			       const struct nk_device_info *dev, int family,
			       int threads)
{
	struct nk_norm_args a = make_job(op, dtype, dtype, flags, cols, rows_for(cols));
	struct nk_variant v;
	char name[128];

	assert_int_equal(nk_cuda_variant_default(&a, dev, &v), NK_OK);
	nk_variant_name(&v, name, sizeof(name));
	print_message("%s %s flags %u cols %lld on %s: %s\n", nk_op_name(op), nk_dtype_name(dtype),
		      flags, (long long)cols, profile_name(dev), name);
	assert_int_equal(v.family, family);
	assert_int_equal(v.threads, threads);
}

/*
 * The FAST_MEMORY rules (the H200) change these backward defaults and no
 * H100 default: the same jobs keep the H100's families there.
 */
static void test_fast_memory_bwd_defaults(void **state)
{
	(void)state;
	const unsigned me = NK_MEMORY_EFFICIENT;
	expect_bwd_default(NK_LAYERNORM_BWD, NK_BF16, 0u, 128, &h200, NK_FAMILY_TMA_SLICE, 512);
	expect_bwd_default(NK_LAYERNORM_BWD, NK_BF16, 0u, 128, &h100, NK_FAMILY_WARP_ROWS, 256);
	expect_bwd_default(NK_RMSNORM_BWD, NK_F16, me, 128, &h200, NK_FAMILY_TMA_SLICE, 512);
	expect_bwd_default(NK_RMSNORM_BWD, NK_BF16, 0u, 8192, &h200, NK_FAMILY_BLOCK_ROW, 512);
	expect_bwd_default(NK_RMSNORM_BWD, NK_BF16, 0u, 8192, &h100, NK_FAMILY_TMA_SLICE, 512);
	expect_bwd_default(NK_LAYERNORM_BWD, NK_BF16, me, 8192, &h200, NK_FAMILY_TMA_SLICE, 512);
	expect_bwd_default(NK_LAYERNORM_BWD, NK_BF16, me, 8192, &h100, NK_FAMILY_BLOCK_ROW, 512);
	expect_bwd_default(NK_LAYERNORM_BWD, NK_F32, 0u, 1024, &h200, NK_FAMILY_BLOCK_ROW, 256);
	expect_bwd_default(NK_LAYERNORM_BWD, NK_F32, 0u, 1024, &h100, NK_FAMILY_BLOCK_SMEM, 256);
	expect_bwd_default(NK_LAYERNORM_BWD, NK_F32, 0u, 2048, &h200, NK_FAMILY_BLOCK_SMEM, 256);
	expect_bwd_default(NK_RMSNORM_BWD, NK_F32, me, 2048, &h200, NK_FAMILY_BLOCK_ROW, 256);
	expect_bwd_default(NK_RMSNORM_BWD, NK_F32, 0u, 4096, &h200, NK_FAMILY_TMA_SLICE, 256);
	expect_bwd_default(NK_RMSNORM_BWD, NK_F32, 0u, 4096, &h100, NK_FAMILY_BLOCK_SMEM, 512);
	/* Widths the FAST_MEMORY rules leave keep the H100's shapes. */
	expect_bwd_default(NK_LAYERNORM_BWD, NK_BF16, 0u, 1024, &h200, NK_FAMILY_BLOCK_ROW, 256);
}

/* fp32 RMSNorm forward of 512-4096 columns on the H200: eight vectors a thread. */
static void test_fast_memory_fwd_defaults(void **state)
{
	(void)state;
	static const int64_t cols[] = {512, 1024, 2048, 4096};
	for (size_t i = 0; i < 2 * COUNT(cols); i++) {
		const struct nk_device_info *dev = i % 2 ? &h100 : &h200;
		struct nk_norm_args a = make_job(NK_RMSNORM_FWD, NK_F32, NK_F32, 0u,
						 cols[i / 2], rows_for(cols[i / 2]));
		struct nk_variant v;
		assert_int_equal(nk_cuda_variant_default(&a, dev, &v), NK_OK);
		assert_int_equal(v.param & 0xff, i % 2 ? 2 : 8); /* vectors a thread */
	}
}

static void test_ds_bwd_defaults(void **state)
{
	(void)state;
	expect_ds_bwd(NK_LAYERNORM_BWD, NK_BF16, 0u, 128, &h100, NK_FAMILY_TMA_SLICE, 512, 1);
	expect_ds_bwd(NK_RMSNORM_BWD, NK_BF16, 0u, 1024, &h100, NK_FAMILY_BLOCK_ROW, 256, 0);
	expect_ds_bwd(NK_LAYERNORM_BWD, NK_BF16, 0u, 8192, &h100, NK_FAMILY_TMA_SLICE, 512, 1);
	expect_ds_bwd(NK_LAYERNORM_BWD, NK_BF16, NK_MEMORY_EFFICIENT, 8192, &h100,
		      NK_FAMILY_TMA_SLICE, 512, 1);
	expect_ds_bwd(NK_RMSNORM_BWD, NK_F16, 0u, 12288, &h100, NK_FAMILY_TMA_SLICE, 384, 2);
	expect_ds_bwd(NK_RMSNORM_BWD, NK_F32, 0u, 4096, &h100, NK_FAMILY_TMA_SLICE, 256, 1);
	expect_ds_bwd(NK_LAYERNORM_BWD, NK_F32, 0u, 8192, &h100, NK_FAMILY_TMA_SLICE, 256, 2);
	expect_ds_bwd(NK_LAYERNORM_BWD, NK_BF16, 0u, 8192, &a100, NK_FAMILY_BLOCK_ROW, 256, 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_sweep_sm90),
	    cmocka_unit_test(test_sweep_sm80),
	    cmocka_unit_test(test_no_tma_slice_on_sm80),
	    cmocka_unit_test(test_wide_bwd_defaults_to_tma_slice),
	    cmocka_unit_test(test_one_block_memeff_stays_tiled),
	    cmocka_unit_test(test_corrupt_tma_slice_refused),
	    cmocka_unit_test(test_fwd_defaults),
	    cmocka_unit_test(test_ds_bwd_defaults),
	    cmocka_unit_test(test_fast_memory_bwd_defaults),
	    cmocka_unit_test(test_fast_memory_fwd_defaults),
	    cmocka_unit_test(test_sweep_h200),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
