/*
 * The equivalence harness of the CUDA variant policy: what
 * nk_cuda_variant_default and nk_cuda_variant_candidates choose for a large
 * grid of jobs on two device profiles, compared line by line with a golden
 * record (tests/unit/data/variant_policy.golden.gz).
 *
 * Why: the planner is rewritten for readability from time to time, and a
 * rewrite must not move a single shape to another kernel unless that is
 * the point of the change. Both functions are host code that read a
 * struct nk_device_info and never touch a GPU, so the whole grid runs here.
 *
 * The grid: every op (LayerNorm and RMSNorm, forward and backward), the
 * five (x, weight) dtype pairs, memory-efficient off and on (backward),
 * three sets of weight tensors (affine, gamma only, none), five pointer
 * layouts (all 16-byte aligned, then x, gamma, the output, or dy one
 * element off), about 190 widths from 1 to 262144 columns (every power of
 * two from 1 to 65536, odd widths, multiples of 4 and 8 on both sides of
 * every rule's limits, fill_widths) and 16 row counts from 1 to 2^20,
 * on an H100 (sm_90) and an A100 (sm_80); then jobs that use the norm
 * variants (residual add, weight offset, FP8 output, all of them) on ten
 * widths. A line of the record holds the default and every candidate
 * (asked for up to MAX_CANDIDATES), each as nk_variant_name and its raw
 * param word (the name shows the other raw fields). Jobs of one width with
 * one answer share a line (all of them, or a group of dtype pairs; else a
 * line per weights set and run of row counts). Digest lines add the
 * workspace size and fit of every variant of every job, which the lines do
 * not show. A second test asks the policy table (kernels/norm_cuda_policy.c)
 * which rule took each job, and fails if a rule takes none (`--rules`
 * prints them all).
 *
 * When a change of the rules is intended, regenerate the record from the
 * repository root and commit it with the change (the diff of the two
 * records, gunzipped, is the change of the policy):
 *   build/tests/unit/test_variant_policy --print |
 *     gzip -9n > tests/unit/data/variant_policy.golden.gz
 * The test reads the record relative to the current directory: run it from
 * the repository root, as tests/run.sh does.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/norm_cuda_variant.h"
#include "kernels/norm_kernels.h"

#define COUNT(array) (sizeof(array) / sizeof((array)[0]))

/* The record, relative to the repository root. */
static const char golden_path[] = "tests/unit/data/variant_policy.golden.gz";

/* Candidates asked for: more than any caller asks for (the daemon: 16). */
enum { MAX_CANDIDATES = 64 };

/* Mismatched lines printed in full before the rest are only counted. */
enum { MAX_PRINTED = 10 };

struct device {
	const char *name;
	struct nk_device_info info;
};

static const struct device devices[] = {
    {"h100",
     {.sm_count = 132,
      .max_threads_per_sm = 2048,
      .max_smem_per_block_optin = 232448,
      .cc_major = 9,
      .cc_minor = 0,
      .mem_gbps = 3352}},
    {"h200",
     {.sm_count = 132,
      .max_threads_per_sm = 2048,
      .max_smem_per_block_optin = 232448,
      .cc_major = 9,
      .cc_minor = 0,
      .mem_gbps = 4915}},
    {"a100",
     {.sm_count = 108,
      .max_threads_per_sm = 2048,
      .max_smem_per_block_optin = 166912,
      .cc_major = 8,
      .cc_minor = 0}},
};

static const enum nk_op ops[] = {NK_LAYERNORM_FWD, NK_RMSNORM_FWD, NK_LAYERNORM_BWD,
				 NK_RMSNORM_BWD};

/* Storage dtype of x, y, dy, dx, then of the weights and their gradients. */
static const enum nk_dtype dtype_pairs[][2] = {
    {NK_F32, NK_F32}, {NK_F16, NK_F16}, {NK_F16, NK_F32}, {NK_BF16, NK_BF16}, {NK_BF16, NK_F32}};

/* Weight tensors present: gamma and beta (and their gradients), gamma only, none. */
enum weights { W_AFFINE, W_GAMMA, W_NONE, W_COUNT };
static const char *const weights_names[W_COUNT] = {"affine", "gamma", "none"};

/*
 * The norm variants a job uses (docs/VARIANTS.md): none, the residual add
 * (forward residual and residual_out, backward ds), the weight offset, FP8
 * output (forward), all of them.
 */
enum feature { F_PLAIN, F_RESIDUAL, F_OFFSET, F_FP8, F_ALL, F_COUNT };
static const char *const feature_names[F_COUNT] = {"plain", "residual", "offset", "fp8", "all"};

/* Pointer layouts: all 16-byte aligned, or one tensor an element off. */
enum layout { L_ALIGNED, L_X_OFF, L_GAMMA_OFF, L_OUT_OFF, L_DY_OFF, L_COUNT };
static const char *const layout_names[L_COUNT] = {"aligned", "x+1", "gamma+1", "out+1", "dy+1"};

/*
 * The widths: every width from 1 to 72; around every power of two p from
 * 64 to 65536, p - 8, p - 4, p - 1, p, p + 1, p + 4, p + 8 (the rules'
 * limits are powers of two in elements or vectors, so both sides of each
 * are here, with odd widths and multiples of 4 and 8), 1.25p, 1.5p,
 * 1.5p + 8 and 1.75p; and a few past 65536.
 */
enum { SMALL_WIDTHS = 72, POW2_STEPS = 11, PER_POW2 = 11, LARGE_WIDTHS = 6 };
static int64_t widths[SMALL_WIDTHS + POW2_STEPS * PER_POW2 + LARGE_WIDTHS];
static size_t width_count;

static int compare_widths(const void *a, const void *b)
{
	const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
	return (x > y) - (x < y);
}

/* Fills widths[] (sorted, each once) and width_count. */
static void fill_widths(void)
{
	static const int64_t large[LARGE_WIDTHS] = {65544, 70000, 70001, 98304, 131072, 262144};
	size_t n = 0;

	for (int64_t c = 1; c <= SMALL_WIDTHS; c++)
		widths[n++] = c;
	for (int k = 6; k < 6 + POW2_STEPS; k++) {
		const int64_t p = (int64_t)1 << k;
		const int64_t around[PER_POW2] = {p - 8,     p - 4,	    p - 1,    p,
						  p + 1,     p + 4,	    p + 8,    p * 5 / 4,
						  p * 3 / 2, p * 3 / 2 + 8, p * 7 / 4};
		for (int i = 0; i < PER_POW2; i++)
			widths[n++] = around[i];
	}
	for (int i = 0; i < LARGE_WIDTHS; i++)
		widths[n++] = large[i];
	qsort(widths, n, sizeof(widths[0]), compare_widths);
	width_count = 0;
	for (size_t i = 0; i < n; i++) {
		if (width_count == 0 || widths[width_count - 1] != widths[i])
			widths[width_count++] = widths[i];
	}
}

/* Rows: a log grid from 1 to 2^20, with odd counts between. */
static const int64_t row_counts[] = {1,	  2,	3,    4,     7,	    16,	    33,	     64,
				     255, 1024, 4097, 16384, 65535, 262144, 1000003, 1048576};

static bool op_is_bwd(enum nk_op op)
{
	return op == NK_LAYERNORM_BWD || op == NK_RMSNORM_BWD;
}

static bool op_is_ln(enum nk_op op)
{
	return op == NK_LAYERNORM_FWD || op == NK_LAYERNORM_BWD;
}

/* A fake tensor address: tensor `n` of the job, 1 MB apart, 16-byte aligned. */
static char *fake_tensor(unsigned n)
{
	return (char *)(uintptr_t)(0x100000u * n);
}

/* Everything that makes one job of the grid but its width and rows. */
struct job_key {
	const struct device *dev;
	enum nk_op op;
	bool mem_eff;
	enum layout layout;
	size_t pair;
	enum weights weights;
	enum feature feature; /* F_PLAIN but in the variants' lines */
};

/*
 * The job of `k` at `cols` x `rows`: every tensor the op reads or writes is
 * present but the weights `k.weights` leaves out; the tensor `k.layout`
 * names sits one element past a 16-byte boundary. False for layouts the op
 * has no tensor for (dy of a forward op).
 */
static bool make_job(const struct job_key *k, int64_t cols, int64_t rows, struct nk_norm_args *a)
{
	const enum nk_dtype dt = dtype_pairs[k->pair][0], wt = dtype_pairs[k->pair][1];
	const size_t e = nk_dtype_size(dt), we = nk_dtype_size(wt);
	const bool bwd = op_is_bwd(k->op), ln = op_is_ln(k->op);

	if (k->layout == L_DY_OFF && !bwd)
		return false;
	memset(a, 0, sizeof(*a));
	a->op = k->op;
	a->rows = rows;
	a->cols = cols;
	a->eps = 1e-5f;
	a->dtype = dt;
	a->weight_dtype = wt;
	a->flags = k->mem_eff ? NK_MEMORY_EFFICIENT : 0u;
	a->x = fake_tensor(1) + (k->layout == L_X_OFF ? e : 0);
	a->rstd = (float *)fake_tensor(4);
	if (ln && !(bwd && k->mem_eff))
		a->mean = (float *)fake_tensor(3);
	if (k->weights != W_NONE)
		a->gamma = fake_tensor(5) + (k->layout == L_GAMMA_OFF ? we : 0);
	if (k->weights == W_AFFINE && ln)
		a->beta = fake_tensor(6);
	if (!bwd) {
		a->y = fake_tensor(2) + (k->layout == L_OUT_OFF ? e : 0);
		return true;
	}
	a->dy = fake_tensor(7) + (k->layout == L_DY_OFF ? e : 0);
	a->dx = fake_tensor(8) + (k->layout == L_OUT_OFF ? e : 0);
	if (k->weights != W_NONE)
		a->dgamma = fake_tensor(9);
	if (k->weights == W_AFFINE && ln)
		a->dbeta = fake_tensor(10);
	return true;
}

/*
 * Adds the variants of k.feature to the job *a of make_job; false where
 * the op has no such variant (FP8 output of a backward op) or the weights
 * lack the gamma an offset needs.
 */
static bool add_feature(const struct job_key *k, struct nk_norm_args *a)
{
	const bool bwd = op_is_bwd(k->op);
	const bool residual = k->feature == F_RESIDUAL || k->feature == F_ALL;
	const bool offset = k->feature == F_OFFSET || k->feature == F_ALL;
	const bool fp8 = k->feature == F_FP8 || (k->feature == F_ALL && !bwd);

	if ((fp8 && bwd) || (offset && !a->gamma))
		return false;
	if (residual && bwd)
		a->ds = fake_tensor(13);
	if (residual && !bwd) {
		a->residual = fake_tensor(11);
		a->residual_out = fake_tensor(12);
	}
	if (offset)
		a->weight_offset = 1.0f;
	if (fp8) {
		a->y_fp8 = NK_FP8_E4M3;
		a->scale = (const float *)fake_tensor(14);
		a->amax = (float *)fake_tensor(15);
	}
	return true;
}

/* Appends `v` as "name@param" (and "/res<n>" if its reserved word is set). */
static size_t put_variant(char *buf, size_t len, const struct nk_variant *v)
{
	char name[128];
	nk_variant_name(v, name, sizeof(name));
	int n = snprintf(buf, len, "%s@%08x", name, (unsigned)v->param);
	if (n >= 0 && (size_t)n < len && v->reserved != 0)
		n += snprintf(buf + n, len - (size_t)n, "/res%u", (unsigned)v->reserved);
	return n < 0 ? 0 : (size_t)n;
}

/* FNV-1a over 64 bits: the digest of workspace sizes and fits. */
static uint64_t digest_add(uint64_t h, uint64_t value)
{
	for (int i = 0; i < 8; i++) {
		h ^= (value >> (8 * i)) & 0xff;
		h *= 0x100000001b3ull;
	}
	return h;
}

enum { ANSWER_MAX = MAX_CANDIDATES * 96 + 64 };

/*
 * What the policy answers for job `a` on `dev` into buf: "D=<default>
 * C=<candidate> ...". Folds the workspace size and fit of each variant into
 * *digest.
 */
static void answer_of(const struct nk_norm_args *a, const struct nk_device_info *dev, char *buf,
		      uint64_t *digest)
{
	struct nk_variant def, cands[MAX_CANDIDATES];
	size_t n = 0;

	memset(&def, 0, sizeof(def));
	const int rc = nk_cuda_variant_default(a, dev, &def);
	if (rc != NK_OK) {
		snprintf(buf, ANSWER_MAX, "D=error%d", rc);
		return;
	}
	n += (size_t)snprintf(buf + n, ANSWER_MAX - n, "D=");
	n += put_variant(buf + n, ANSWER_MAX - n, &def);
	*digest = digest_add(*digest, nk_cuda_workspace_bytes(a, dev, &def));
	const int count = nk_cuda_variant_candidates(a, dev, cands, MAX_CANDIDATES);
	n += (size_t)snprintf(buf + n, ANSWER_MAX - n, " C%d=", count);
	for (int i = 0; i < count && i < MAX_CANDIDATES && n < ANSWER_MAX; i++) {
		if (i > 0)
			n += (size_t)snprintf(buf + n, ANSWER_MAX - n, " ");
		n += put_variant(buf + n, ANSWER_MAX - n, &cands[i]);
		*digest = digest_add(*digest, nk_cuda_workspace_bytes(a, dev, &cands[i]));
		*digest = digest_add(*digest, nk_cuda_variant_fits(a, dev, &cands[i]));
	}
}

/* The answers for one width: per dtype pair, weights and row count. */
struct width_answers {
	char text[COUNT(dtype_pairs)][W_COUNT][COUNT(row_counts)][ANSWER_MAX];
	bool present;
};

/* Whether every row count of (pair, weights) has the answer of the first. */
static bool rows_uniform(const struct width_answers *w, size_t p, int wi)
{
	for (size_t r = 1; r < COUNT(row_counts); r++) {
		if (strcmp(w->text[p][wi][r], w->text[p][wi][0]) != 0)
			return false;
	}
	return true;
}

/* Whether every weights set and row count of pair p has one answer. */
static bool pair_uniform(const struct width_answers *w, size_t p)
{
	for (int wi = 0; wi < W_COUNT; wi++) {
		if (!rows_uniform(w, p, wi) || strcmp(w->text[p][wi][0], w->text[p][0][0]) != 0)
			return false;
	}
	return true;
}

static const char *pair_name(size_t p, char *buf, size_t len)
{
	snprintf(buf, len, "%s/%s", nk_dtype_name(dtype_pairs[p][0]),
		 nk_dtype_name(dtype_pairs[p][1]));
	return buf;
}

/* Rows of (pair, weights) as runs of one answer: "rows=a..b: answer" lines. */
static void print_row_runs(FILE *out, const char *prefix, const struct width_answers *w, size_t p,
			   int wi)
{
	for (size_t r = 0; r < COUNT(row_counts);) {
		size_t end = r + 1;
		while (end < COUNT(row_counts) &&
		       strcmp(w->text[p][wi][end], w->text[p][wi][r]) == 0)
			end++;
		fprintf(out, "%s %s rows=%lld..%lld: %s\n", prefix, weights_names[wi],
			(long long)row_counts[r], (long long)row_counts[end - 1],
			w->text[p][wi][r]);
		r = end;
	}
}

/*
 * The lines of one width: one line if every job has the same answer, else
 * a line per group of dtype pairs with one answer each, and for the other
 * pairs a line per weights set and run of row counts.
 */
static void print_width(FILE *out, const char *prefix, const struct width_answers *w)
{
	bool done[COUNT(dtype_pairs)] = {false};
	char pname[32];
	size_t p;

	for (p = 0; p < COUNT(dtype_pairs) && pair_uniform(w, p); p++)
		if (strcmp(w->text[p][0][0], w->text[0][0][0]) != 0)
			break;
	if (p == COUNT(dtype_pairs)) {
		fprintf(out, "%s *: %s\n", prefix, w->text[0][0][0]);
		return;
	}
	for (p = 0; p < COUNT(dtype_pairs); p++) {
		if (done[p] || !pair_uniform(w, p))
			continue;
		char names[128] = "";
		size_t n = 0;
		for (size_t q = p; q < COUNT(dtype_pairs); q++) {
			if (done[q] || !pair_uniform(w, q) ||
			    strcmp(w->text[q][0][0], w->text[p][0][0]))
				continue;
			done[q] = true;
			n += (size_t)snprintf(names + n, sizeof(names) - n, "%s%s", n ? "," : "",
					      pair_name(q, pname, sizeof(pname)));
		}
		fprintf(out, "%s %s: %s\n", prefix, names, w->text[p][0][0]);
	}
	for (p = 0; p < COUNT(dtype_pairs); p++) {
		if (done[p])
			continue;
		char pre[256];
		snprintf(pre, sizeof(pre), "%s %s", prefix, pair_name(p, pname, sizeof(pname)));
		for (int wi = 0; wi < W_COUNT; wi++)
			print_row_runs(out, pre, w, p, wi);
	}
}

/* Fills w with the answers of key k (pair and weights vary) at `cols`. */
static void answer_width(struct job_key k, int64_t cols, struct width_answers *w, uint64_t *digest)
{
	struct nk_norm_args a;

	w->present = false;
	for (k.pair = 0; k.pair < COUNT(dtype_pairs); k.pair++) {
		for (int wi = 0; wi < W_COUNT; wi++) {
			k.weights = (enum weights)wi;
			for (size_t r = 0; r < COUNT(row_counts); r++) {
				if (!make_job(&k, cols, row_counts[r], &a))
					return;
				answer_of(&a, &k.dev->info, w->text[k.pair][wi][r], digest);
			}
		}
	}
	w->present = true;
}

/* The lines of every width of key k (pair and weights vary); the jobs they answer. */
static long print_widths(FILE *out, struct job_key k, struct width_answers *w, uint64_t *digest)
{
	long jobs = 0;
	char prefix[128];

	for (size_t c = 0; c < width_count; c++) {
		answer_width(k, widths[c], w, digest);
		if (!w->present)
			break;
		jobs += (long)(COUNT(dtype_pairs) * W_COUNT * COUNT(row_counts));
		snprintf(prefix, sizeof(prefix), "%s %s %s %s cols=%lld", k.dev->name,
			 nk_op_name(k.op), k.mem_eff ? "memeff" : "-", layout_names[k.layout],
			 (long long)widths[c]);
		print_width(out, prefix, w);
	}
	return jobs;
}

/* The lines of one op on one device, then its digest line; the jobs they answer. */
static long print_op(FILE *out, const struct device *dev, enum nk_op op, struct width_answers *w)
{
	uint64_t digest = 0xcbf29ce484222325ull;
	long jobs = 0;

	for (int m = 0; m < (op_is_bwd(op) ? 2 : 1); m++) {
		for (int l = 0; l < L_COUNT; l++) {
			const struct job_key k = {
			    .dev = dev, .op = op, .mem_eff = m == 1, .layout = (enum layout)l};
			jobs += print_widths(out, k, w, &digest);
		}
	}
	fprintf(out, "%s %s workspace and fit digest: %016llx\n", dev->name, nk_op_name(op),
		(unsigned long long)digest);
	return jobs;
}

/* Widths and row counts of the variants' lines: one of each family's ranges. */
static const int64_t feature_widths[] = {1, 7, 8, 128, 1000, 1024, 4096, 8192, 12288, 65536};
static const int64_t feature_rows[] = {1, 4097};

/*
 * The line of a job that uses a variant (key k but its pair, affine
 * weights) at `cols`: one answer for every dtype pair and row count, or a
 * line per pair and row count. The jobs it answers.
 */
static long print_feature_width(FILE *out, struct job_key k, int64_t cols, uint64_t *digest)
{
	static char text[COUNT(dtype_pairs)][COUNT(feature_rows)][ANSWER_MAX];
	char prefix[160], pname[32];
	struct nk_norm_args a;
	bool same = true;

	k.weights = W_AFFINE;
	for (k.pair = 0; k.pair < COUNT(dtype_pairs); k.pair++) {
		for (size_t r = 0; r < COUNT(feature_rows); r++) {
			if (!make_job(&k, cols, feature_rows[r], &a) || !add_feature(&k, &a))
				return 0;
			answer_of(&a, &k.dev->info, text[k.pair][r], digest);
			same = same && strcmp(text[k.pair][r], text[0][0]) == 0;
		}
	}
	snprintf(prefix, sizeof(prefix), "%s %s %s %s %s cols=%lld", k.dev->name, nk_op_name(k.op),
		 k.mem_eff ? "memeff" : "-", feature_names[k.feature], layout_names[k.layout],
		 (long long)cols);
	if (same) {
		fprintf(out, "%s *: %s\n", prefix, text[0][0]);
		return (long)(COUNT(dtype_pairs) * COUNT(feature_rows));
	}
	for (size_t p = 0; p < COUNT(dtype_pairs); p++) {
		for (size_t r = 0; r < COUNT(feature_rows); r++)
			fprintf(out, "%s %s rows=%lld: %s\n", prefix,
				pair_name(p, pname, sizeof(pname)), (long long)feature_rows[r],
				text[p][r]);
	}
	return (long)(COUNT(dtype_pairs) * COUNT(feature_rows));
}

/* Keys of the variants' lines: device, op, flag, variant (not plain), layout (two). */
#define FEATURE_KEYS (COUNT(devices) * COUNT(ops) * 2 * (F_COUNT - 1) * 2)

/*
 * Key `i` (0 <= i < FEATURE_KEYS) of the variants' lines into *k; false
 * for memory-efficient forward keys.
 */
static bool feature_key(size_t i, struct job_key *k)
{
	const enum layout layout = i % 2 ? L_X_OFF : L_ALIGNED;
	i /= 2;
	const enum feature feature = (enum feature)(F_RESIDUAL + i % (F_COUNT - 1));
	i /= F_COUNT - 1;
	const bool mem_eff = i % 2 == 1;
	i /= 2;
	*k = (struct job_key){.dev = &devices[i / COUNT(ops)],
			      .op = ops[i % COUNT(ops)],
			      .mem_eff = mem_eff,
			      .layout = layout,
			      .weights = W_AFFINE,
			      .feature = feature};
	return !mem_eff || op_is_bwd(k->op);
}

/*
 * The lines of jobs that use the norm variants, on fewer widths than the
 * plain jobs: per device, op, flag, variant and layout (aligned, x one
 * element off), then a digest line. The jobs they answer.
 */
static long print_features(FILE *out)
{
	uint64_t digest = 0xcbf29ce484222325ull;
	struct job_key k;
	long jobs = 0;

	for (size_t i = 0; i < FEATURE_KEYS; i++) {
		if (!feature_key(i, &k))
			continue;
		for (size_t c = 0; c < COUNT(feature_widths); c++)
			jobs += print_feature_width(out, k, feature_widths[c], &digest);
	}
	fprintf(out, "variants workspace and fit digest: %016llx\n", (unsigned long long)digest);
	return jobs;
}

/* The whole record: a header, then per device, op, flag and layout every width. */
static long print_record(FILE *out)
{
	long jobs = 0;
	struct width_answers *w = malloc(sizeof(*w));
	assert_non_null(w);
	fill_widths();
	fprintf(out, "# nk_cuda_variant_default and nk_cuda_variant_candidates "
		     "(tests/unit/test_variant_policy.c)\n");
	fprintf(out, "# <device> <op> <flags> <layout> cols=<n> [<dtype pairs> | <pair> <weights> "
		     "rows=<a>..<b>]: D=<default> C<count>=<candidates>\n");
	for (size_t d = 0; d < COUNT(devices); d++) {
		const struct nk_device_info *i = &devices[d].info;
		fprintf(out, "device %s: %d SMs, %d threads/SM, %zu B shared/block, sm_%d%d, %d GB/s\n",
			devices[d].name, i->sm_count, i->max_threads_per_sm,
			i->max_smem_per_block_optin, i->cc_major, i->cc_minor, i->mem_gbps);
	}
	for (size_t d = 0; d < COUNT(devices); d++) {
		for (size_t o = 0; o < COUNT(ops); o++)
			jobs += print_op(out, &devices[d], ops[o], w);
	}
	free(w);
	return jobs + print_features(out);
}

/* Lines of a record, each split at its first ": " into key and answer. */
struct record {
	char *text;    /* the whole record, its lines NUL-terminated in place */
	char **lines;  /* line i, sorted by key once sort_record has run */
	bool *matched; /* (golden record) line i has a line of the same key now */
	size_t count;
};

/* The key of a line: what precedes its first ": " (all of it if none). */
static size_t key_len(const char *line)
{
	const char *sep = strstr(line, ": ");
	return sep ? (size_t)(sep - line) : strlen(line);
}

static int compare_keys(const char *a, const char *b)
{
	const size_t la = key_len(a), lb = key_len(b);
	const int c = memcmp(a, b, la < lb ? la : lb);
	return c != 0 ? c : (la > lb) - (la < lb);
}

static int compare_lines(const void *a, const void *b)
{
	return compare_keys(*(char *const *)a, *(char *const *)b);
}

/* Splits `text` (taken over, NUL-terminated) into the lines of *r. */
static void split_record(char *text, struct record *r)
{
	size_t n = 0;
	for (const char *c = text; *c; c++)
		n += *c == '\n';
	r->text = text;
	r->lines = calloc(n + 1, sizeof(*r->lines));
	r->matched = calloc(n + 1, sizeof(*r->matched));
	assert_non_null(r->lines);
	assert_non_null(r->matched);
	r->count = 0;
	for (char *line = text; *line;) {
		char *nl = strchr(line, '\n');
		r->lines[r->count++] = line;
		if (!nl)
			break;
		*nl = '\0';
		line = nl + 1;
	}
}

static void free_record(struct record *r)
{
	free(r->text);
	free(r->lines);
	free(r->matched);
}

/* Reads the whole of `in` into a NUL-terminated buffer. */
static char *read_all(FILE *in)
{
	size_t len = 0, cap = 1 << 20;
	char *buf = malloc(cap);
	assert_non_null(buf);
	for (size_t got; (got = fread(buf + len, 1, cap - len - 1, in)) > 0;) {
		len += got;
		if (cap - len - 1 == 0) {
			cap *= 2;
			buf = realloc(buf, cap);
			assert_non_null(buf);
		}
	}
	buf[len] = '\0';
	return buf;
}

/* Counts a difference and prints the first MAX_PRINTED of them. */
static void report(int *diffs, const char *what, const char *golden, const char *now)
{
	if ((*diffs)++ >= MAX_PRINTED)
		return;
	print_error("%s\n", what);
	if (golden)
		print_error("  golden: %s\n", golden);
	if (now)
		print_error("  now:    %s\n", now);
}

/*
 * Compares the record `now` with `golden` by key, so that a line added or
 * removed shows as itself and not as a shift of every line after it.
 * Returns the number of keys whose answer changed, appeared or vanished.
 */
static int compare_records(struct record *now, struct record *golden)
{
	int diffs = 0;

	qsort(golden->lines, golden->count, sizeof(*golden->lines), compare_lines);
	for (size_t i = 0; i < now->count; i++) {
		const char *line = now->lines[i];
		char **hit = bsearch(&line, golden->lines, golden->count, sizeof(*golden->lines),
				     compare_lines);
		if (!hit) {
			report(&diffs, "a line the golden record lacks:", NULL, line);
			continue;
		}
		golden->matched[hit - golden->lines] = true;
		if (strcmp(*hit, line) != 0)
			report(&diffs, "a changed answer:", *hit, line);
	}
	for (size_t i = 0; i < golden->count; i++) {
		if (!golden->matched[i])
			report(&diffs,
			       "a line of the golden record that is gone:", golden->lines[i], NULL);
	}
	return diffs;
}

static void test_policy_matches_golden_record(void **state)
{
	(void)state;
	struct record now, golden;
	char *text = NULL;
	size_t len = 0;
	char cmd[256];

	FILE *out = open_memstream(&text, &len);
	assert_non_null(out);
	const long jobs = print_record(out);
	assert_int_equal(fclose(out), 0);
	print_message("%ld jobs on %zu devices, %zu widths: a record of %zu bytes\n", jobs,
		      COUNT(devices), width_count, len);
	split_record(text, &now);

	FILE *probe = fopen(golden_path, "rb");
	if (!probe)
		fail_msg("%s not found: run the test from the repository root", golden_path);
	fclose(probe);
	snprintf(cmd, sizeof(cmd), "gzip -dc '%s'", golden_path);
	FILE *in = popen(cmd, "r");
	assert_non_null(in);
	split_record(read_all(in), &golden);
	assert_int_equal(pclose(in), 0);

	const int diffs = compare_records(&now, &golden);
	const size_t golden_lines = golden.count;
	free_record(&now);
	free_record(&golden);
	if (diffs > 0)
		fail_msg("%d lines differ from %s (the first %d printed above); if the change "
			 "is intended, regenerate it as the file's comment says",
			 diffs, golden_path, diffs < MAX_PRINTED ? diffs : MAX_PRINTED);
	print_message("%zu lines, all as recorded\n", golden_lines);
}

/* How many jobs of the grid each rule of the policy table took, and the first of them. */
struct rule_use {
	long jobs;
	char first[160];
};

/* Slots of the grid: every combination, of which grid_job skips the ones that are no job. */
static size_t grid_slots(void)
{
	return COUNT(devices) * COUNT(ops) * 2 * L_COUNT * width_count * COUNT(dtype_pairs) *
	       W_COUNT * COUNT(row_counts);
}

/*
 * Job `i` of the grid (0 <= i < grid_slots()) into *k, *cols and *a; false
 * for the slots that are no job (memory-efficient or dy layouts of a
 * forward op).
 */
static bool grid_job(size_t i, struct job_key *k, int64_t *cols, struct nk_norm_args *a)
{
	const size_t r = i % COUNT(row_counts);
	i /= COUNT(row_counts);
	k->weights = (enum weights)(i % W_COUNT);
	i /= W_COUNT;
	k->pair = i % COUNT(dtype_pairs);
	i /= COUNT(dtype_pairs);
	*cols = widths[i % width_count];
	i /= width_count;
	k->layout = (enum layout)(i % L_COUNT);
	i /= L_COUNT;
	k->mem_eff = i % 2 == 1;
	i /= 2;
	k->op = ops[i % COUNT(ops)];
	k->dev = &devices[i / COUNT(ops)];
	if (k->mem_eff && !op_is_bwd(k->op))
		return false;
	return make_job(k, *cols, row_counts[r], a);
}

/* Adds the jobs of the variants' lines (affine weights, rows 1) to uses[]. */
static void count_feature_rule_uses(struct rule_use *uses)
{
	struct nk_norm_args a;
	struct nk_variant v;
	struct job_key k;

	for (size_t i = 0; i < FEATURE_KEYS * COUNT(feature_widths) * COUNT(dtype_pairs); i++) {
		const size_t c = i / COUNT(dtype_pairs) % COUNT(feature_widths);
		if (!feature_key(i / COUNT(dtype_pairs) / COUNT(feature_widths), &k))
			continue;
		k.pair = i % COUNT(dtype_pairs);
		if (!make_job(&k, feature_widths[c], 1, &a) || !add_feature(&k, &a))
			continue;
		const int rule = nk__policy_pick(&a, &k.dev->info, &v);
		assert_true(rule >= 0 && rule < nk__policy_rule_count());
		if (uses[rule].jobs++ == 0)
			snprintf(uses[rule].first, sizeof(uses[rule].first), "%s %s %s %s cols=%lld",
				 k.dev->name, nk_op_name(k.op), k.mem_eff ? "memeff" : "-",
				 feature_names[k.feature], (long long)feature_widths[c]);
	}
}

/* Fills uses[0..nk__policy_rule_count()) over every job of the grid. */
static void count_rule_uses(struct rule_use *uses)
{
	struct nk_norm_args a;
	struct nk_variant v;
	struct job_key k;
	int64_t cols;
	char pname[32];

	fill_widths();
	for (size_t i = 0; i < grid_slots(); i++) {
		if (!grid_job(i, &k, &cols, &a))
			continue;
		const int rule = nk__policy_pick(&a, &k.dev->info, &v);
		assert_true(rule >= 0 && rule < nk__policy_rule_count());
		if (uses[rule].jobs++ > 0)
			continue;
		snprintf(uses[rule].first, sizeof(uses[rule].first), "%s %s %s %s %s cols=%lld",
			 k.dev->name, nk_op_name(k.op), pair_name(k.pair, pname, sizeof(pname)),
			 k.mem_eff ? "memeff" : "-", layout_names[k.layout], (long long)cols);
	}
	count_feature_rule_uses(uses);
}

/* Prints every rule with the jobs of the grid it took and the first of them. */
static int print_rules(FILE *out)
{
	const int n = nk__policy_rule_count();
	struct rule_use *uses = calloc((size_t)n, sizeof(*uses));
	int unused = 0;

	assert_non_null(uses);
	count_rule_uses(uses);
	for (int i = 0; i < n; i++) {
		fprintf(out, "rule %2d: %8ld jobs, first %s\n          %s\n", i, uses[i].jobs,
			uses[i].jobs ? uses[i].first : "(none)", nk__policy_rule_why(i));
		unused += uses[i].jobs == 0;
	}
	free(uses);
	return unused;
}

/*
 * Every rule of the policy table takes some job of the grid: a rule that
 * takes none is shadowed by the rules above it, or names a shape that
 * never fits, and says something the policy does not do.
 */
static void test_every_rule_takes_a_job(void **state)
{
	(void)state;
	const int unused = print_rules(stdout);
	fflush(stdout);
	if (unused > 0)
		fail_msg("%d rules of kernels/norm_cuda_policy.c take no job of the grid", unused);
}

/*
 * With no argument, the tests; `--print` writes the record to stdout (to
 * regenerate the golden one), `--rules` the rules of the policy table with
 * the jobs of the grid each takes.
 */
int main(int argc, char **argv)
{
	if (argc == 2 && strcmp(argv[1], "--print") == 0) {
		print_record(stdout);
		return fflush(stdout) == 0 ? 0 : 1;
	}
	if (argc == 2 && strcmp(argv[1], "--rules") == 0) {
		print_rules(stdout);
		return fflush(stdout) == 0 ? 0 : 1;
	}
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_policy_matches_golden_record),
	    cmocka_unit_test(test_every_rule_takes_a_job),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
