/*
 * The per-GPU variant cache (daemon/variant_cache.c): lookups count hits and
 * misses, the table is persisted to the state directory and reloaded, and a
 * corrupt file, a file of another GPU or of another format version is
 * ignored (the cache starts empty) instead of being trusted.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/log.c"
#include "daemon/variant_cache.c"

static const uint8_t uuid_a[16] = {0xa1, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08,
				   0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f, 0x10};
static const uint8_t uuid_b[16] = {0xb1, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08,
				   0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f, 0x10};

static char state_dir[64];

static int make_dir(void **state)
{
	(void)state;
	snprintf(state_dir, sizeof(state_dir), "/tmp/normd-vc.XXXXXX");
	log_set_level("error");
	return mkdtemp(state_dir) ? 0 : -1;
}

static int remove_dir(void **state)
{
	(void)state;
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", state_dir);
	return system(cmd) == 0 ? 0 : -1;
}

static struct nk_norm_args job(enum nk_op op, int64_t cols, bool mem_eff)
{
	static const float gamma[1];
	struct nk_norm_args a = {.op = op, .rows = 7, .cols = cols, .eps = 1e-5f,
				 .dtype = NK_BF16, .weight_dtype = NK_F32,
				 .flags = mem_eff ? NK_MEMORY_EFFICIENT : 0u, .gamma = gamma};
	return a;
}

static struct nk_variant variant(uint16_t threads, uint16_t rows)
{
	struct nk_variant v = {.family = NK_FAMILY_BLOCK_ROW, .threads = threads,
			       .rows_per_block = rows, .vec_elems = 8, .param = 2};
	return v;
}

static void test_hits_misses_and_keys(void **state)
{
	(void)state;
	struct variant_cache *c = variant_cache_create(uuid_a, 0, NULL);
	assert_non_null(c);
	struct nk_norm_args fwd = job(NK_LAYERNORM_FWD, 4096, false);
	struct nk_variant v = variant(256, 2), got;
	assert_false(variant_cache_lookup(c, &fwd, &got));
	variant_cache_store(c, &fwd, &v, VS_RULE);
	assert_true(variant_cache_lookup(c, &fwd, &got));
	assert_memory_equal(&got, &v, sizeof(v));
	/* Another width, op or flag is another key. */
	struct nk_norm_args wider = job(NK_LAYERNORM_FWD, 8192, false);
	struct nk_norm_args bwd_me = job(NK_LAYERNORM_BWD, 4096, true);
	assert_false(variant_cache_lookup(c, &wider, &got));
	assert_false(variant_cache_lookup(c, &bwd_me, &got));
	uint64_t hits, misses;
	variant_cache_counts(c, &hits, &misses);
	assert_int_equal(hits, 1);
	assert_int_equal(misses, 3);
	/* Many keys force the table to grow; all stay reachable. */
	for (int64_t cols = 1; cols <= 500; cols++) {
		struct nk_norm_args a = job(NK_RMSNORM_BWD, cols, cols % 2);
		struct nk_variant w = variant(128, (uint16_t)(1 + cols % 7));
		variant_cache_store(c, &a, &w, VS_AUTOTUNE);
	}
	for (int64_t cols = 1; cols <= 500; cols++) {
		struct nk_norm_args a = job(NK_RMSNORM_BWD, cols, cols % 2);
		assert_true(variant_cache_lookup(c, &a, &got));
		assert_int_equal(got.rows_per_block, 1 + cols % 7);
	}
	variant_cache_destroy(c);
}

static void test_persisted_and_reloaded(void **state)
{
	(void)state;
	struct variant_cache *c = variant_cache_create(uuid_a, 0, state_dir);
	struct nk_norm_args a = job(NK_RMSNORM_FWD, 12288, false);
	struct nk_norm_args ruled = job(NK_RMSNORM_FWD, 4096, false);
	struct nk_variant v = variant(384, 1), got;
	variant_cache_store(c, &a, &v, VS_AUTOTUNE);
	variant_cache_store(c, &ruled, &v, VS_RULE);
	assert_int_equal(variant_cache_save(c), 0);
	variant_cache_destroy(c);

	/* Only the autotuned choice comes back: rules are applied afresh. */
	c = variant_cache_create(uuid_a, 0, state_dir);
	assert_false(variant_cache_lookup(c, &ruled, &got));
	assert_true(variant_cache_lookup(c, &a, &got));
	assert_memory_equal(&got, &v, sizeof(v));
	struct variant_row *rows = NULL;
	size_t n = 0;
	assert_int_equal(variant_cache_rows(c, &rows, &n), 0);
	assert_int_equal(n, 1);
	assert_string_equal(rows[0].source, "file");
	assert_int_equal(rows[0].cols, 12288);
	nc__free(rows);
	variant_cache_destroy(c);

	/* Another GPU does not take this GPU's file. */
	c = variant_cache_create(uuid_b, 1, state_dir);
	assert_false(variant_cache_lookup(c, &a, &got));
	variant_cache_destroy(c);
}

/* Writes uuid_a's cache file: `header` (NULL: the valid one) and `lines`. */
static void write_cache_file(const char *header, const char *lines)
{
	char path[256], valid[96];
	snprintf(valid, sizeof(valid), "normd-variants 2 a102030405060708090a0b0c0d0e0f10 %d\n",
		 NK_VARIANT_SET);
	snprintf(path, sizeof(path), "%s/variants-a102030405060708090a0b0c0d0e0f10.txt",
		 state_dir);
	FILE *f = fopen(path, "w");
	assert_non_null(f);
	fputs(header ? header : valid, f);
	fputs(lines, f);
	fclose(f);
}

static void test_corrupt_files_ignored(void **state)
{
	(void)state;
	static const struct {
		const char *header, *lines;
	} bad[] = {
		/* a garbage line after a good one */
		{NULL, "2 2 0 2 1024 2 256 4 8 2 1\nnot a line\n"},
		/* impossible values: family 9, 4096 threads */
		{NULL, "2 2 0 2 1024 9 4096 4 8 2 1\n"},
		/* the previous format version */
		{"normd-variants 1 a102030405060708090a0b0c0d0e0f10\n", "2 2 0 2 1024 2 256 4 8 2 1\n"},
		/* choices made for another generation of kernels */
		{"normd-variants 2 a102030405060708090a0b0c0d0e0f10 1\n",
		 "2 2 0 2 1024 2 256 4 8 2 1\n"},
		/* no header at all */
		{"", "2 2 0 2 1024 2 256 4 8 2 1\n"},
		{"", ""},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		write_cache_file(bad[i].header, bad[i].lines);
		struct variant_cache *c = variant_cache_create(uuid_a, 0, state_dir);
		assert_non_null(c);
		struct variant_row *rows = NULL;
		size_t n = 0;
		assert_int_equal(variant_cache_rows(c, &rows, &n), 0);
		assert_int_equal(n, 0);
		nc__free(rows);
		variant_cache_destroy(c);
	}
	/* A well-formed file is taken. */
	write_cache_file(NULL, "2 2 0 2 1024 2 256 4 8 2 1\n");
	struct variant_cache *c = variant_cache_create(uuid_a, 0, state_dir);
	struct nk_norm_args a = job(NK_RMSNORM_FWD, 1024, false);
	struct nk_variant got;
	assert_true(variant_cache_lookup(c, &a, &got));
	assert_int_equal(got.threads, 256);
	variant_cache_destroy(c);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_hits_misses_and_keys),
		cmocka_unit_test(test_persisted_and_reloaded),
		cmocka_unit_test(test_corrupt_files_ignored),
	};
	return cmocka_run_group_tests(tests, make_dir, remove_dir);
}
