/*
 * The daemon's validation of issue 19's variants (daemon/job.c), below the
 * sockets: the alias check sees two registrations of one memfd (by inode)
 * and two CUDA IPC regions of one allocation (by address) as one memory;
 * an FP8 y is bounds-checked at one byte an element; a backend that lacks a
 * variant refuses it with UNSUPPORTED naming it (the CUDA backend until its
 * kernels come); and a failed job's outputs are listed for poisoning, all
 * all five of a LayerNorm forward.
 * Regions are made with region_new() without mapping anything, as in
 * test_job_devices.c; the server functions job.c calls beyond validation
 * are stubs.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "daemon/job.c"
#include "daemon/log.c"
#include "daemon/region.c"

#include "tests/support/job_stubs.h"

enum { ROWS = 4, COLS = 64, REGION_BYTES = 1 << 20 };

/*
 * Regions 1 and 2: one memfd registered twice (same inode); 3: another
 * memfd; 4 and 5: two CUDA IPC regions of one allocation on device 0 (the
 * same address). None mapped.
 */
static int make_regions(void **state)
{
	static struct region_table table;
	region_table_init(&table);
	for (uint64_t id = 1; id <= 5; id++) {
		bool memfd = id <= 3;
		struct region *r = region_new(
		    id, memfd ? NORMD__REGION_KIND__HOST_MEMFD : NORMD__REGION_KIND__CUDA_IPC,
		    REGION_BYTES, memfd ? -1 : 0);
		if (!r || region_insert(&table, r) != 0)
			return -1;
		r->file_dev = memfd ? 5 : 0;
		r->file_ino = id == 3 ? 101 : memfd ? 100 : 0;
		/* Addresses are only compared, never dereferenced. */
		r->base = (void *)(uintptr_t)(memfd ? 0x10000 * id : 0x7f0000000000ull);
	}
	*state = &table;
	return 0;
}

static int drop_regions(void **state)
{
	region_table_clear(*state);
	return region_live_count() == 0 ? 0 : -1;
}

struct msg {
	Normd__Job job;
	Normd__Tensor t[JOB_MAX_TENSORS];
};

/* Tensor `role` of m at (region, offset). */
static Normd__Tensor *tensor(struct msg *m, enum nc__job_role role, uint64_t region,
			     uint64_t offset)
{
	Normd__Tensor *t = &m->t[role];
	normd__tensor__init(t);
	t->region_id = region;
	t->has_offset = true;
	t->offset = offset;
	return t;
}

/* An RMSNorm forward, x at (xr, 0) and y at (yr, yoff). */
static void rms_forward(struct msg *m, uint64_t xr, uint64_t yr, uint64_t yoff)
{
	normd__job__init(&m->job);
	m->job.op = NORMD__OP__RMSNORM_FWD;
	m->job.rows = ROWS;
	m->job.cols = COLS;
	m->job.dtype = NORMD__DTYPE__F32;
	m->job.x = tensor(m, NC__ROLE_X, xr, 0);
	m->job.y = tensor(m, NC__ROLE_Y, yr, yoff);
}

static int validate(struct region_table *table, const struct msg *m, struct job *job)
{
	struct config cfg = {.max_cols = 1 << 20};
	memset(job, 0, sizeof(*job));
	job->op = m->job.op; /* as job_new_validated sets it */
	return job_validate(job, table, &cfg, &m->job);
}

static void release(struct job *job)
{
	for (unsigned i = 0; i < job->region_count; i++)
		region_unref(job->regions[i]);
}

static void expect(struct region_table *table, const struct msg *m, int status, const char *needle)
{
	struct job job;
	int rc = validate(table, m, &job);
	if (rc != status || (needle && !strstr(job.message, needle)))
		fail_msg("got %d \"%s\", want %d with \"%s\"", rc, job.message, status,
			 needle ? needle : "");
	release(&job);
}

static void test_memfd_registered_twice_is_one_memory(void **state)
{
	struct msg m;
	rms_forward(&m, 1, 2, 4); /* y in the second registration, 4 bytes into x */
	expect(*state, &m, NC_EINVALID_ARGUMENT, "overlaps x");
	rms_forward(&m, 1, 3, 4); /* another memfd: no overlap */
	expect(*state, &m, NC_OK, NULL);
	rms_forward(&m, 1, 2, 0); /* exactly x: the in-place form */
	expect(*state, &m, NC_OK, NULL);
	rms_forward(&m, 1, 1, ROWS * COLS * 4); /* right after x in the same region */
	expect(*state, &m, NC_OK, NULL);
	rms_forward(&m, 1, 1, ROWS * COLS * 4 - 4);
	expect(*state, &m, NC_EINVALID_ARGUMENT, "same bytes");
}

static void test_ipc_twins_are_one_memory(void **state)
{
	struct msg m;
	rms_forward(&m, 4, 5, 8);
	expect(*state, &m, NC_EINVALID_ARGUMENT, "overlaps x (region 4");
	rms_forward(&m, 4, 5, 0);
	expect(*state, &m, NC_OK, NULL);
}

/* An FP8 y needs rows * cols bytes; the same bytes of f32 would not fit. */
static void test_fp8_y_is_one_byte_an_element(void **state)
{
	struct msg m;
	rms_forward(&m, 1, 1, REGION_BYTES - ROWS * COLS);
	expect(*state, &m, NC_EOUT_OF_RANGE, "tensor y");
	m.job.has_y_dtype = true;
	m.job.y_dtype = NORMD__DTYPE__F8E4M3;
	m.job.scale = tensor(&m, NC__ROLE_SCALE, 1, 8192);
	m.job.amax = tensor(&m, NC__ROLE_AMAX, 1, 8196);
	struct job job;
	assert_int_equal(validate(*state, &m, &job), NC_OK);
	assert_int_equal(job.args.y_fp8, NK_FP8_E4M3);
	assert_int_equal(nk_norm_features(&job.args), NK_FEATURE_FP8_OUTPUT);
	release(&job);
	m.job.y_dtype = NORMD__DTYPE__F32; /* y_dtype = dtype: f32 again, past the region */
	expect(*state, &m, NC_EOUT_OF_RANGE, "tensor y");
	m.job.y->offset = 16384; /* and no FP8, so no scale */
	expect(*state, &m, NC_EINVALID_ARGUMENT, "scale and amax go with FP8");
}

/* A backend without a variant refuses it, never runs it as the plain norm. */
static void test_backend_without_variant_refuses(void **state)
{
	struct backend none = {.name = "cuda", .norm_features = 0};
	struct backend all = {.name = "cpu", .norm_features = NK_FEATURES_ALL};
	struct msg m;
	struct job job;

	rms_forward(&m, 1, 1, 8192);
	m.job.residual = tensor(&m, NC__ROLE_RESIDUAL, 1, 16384);
	m.job.residual_out = tensor(&m, NC__ROLE_RESIDUAL_OUT, 1, 16384);
	m.job.gamma = tensor(&m, NC__ROLE_GAMMA, 3, 0);
	m.job.has_weight_offset = true;
	m.job.weight_offset = 1.0f;
	assert_int_equal(validate(*state, &m, &job), NC_OK); /* s over residual: allowed */
	assert_int_equal(job_check_backend(&job, &all), NC_OK);
	assert_int_equal(job_check_backend(&job, &none), NC_EUNSUPPORTED);
	assert_non_null(strstr(job.message, "the cuda backend does not run residual-add"));
	release(&job);

	m.job.residual = m.job.residual_out = NULL;
	assert_int_equal(validate(*state, &m, &job), NC_OK);
	assert_int_equal(job_check_backend(&job, &none), NC_EUNSUPPORTED);
	assert_non_null(strstr(job.message, "weight_offset"));
	release(&job);

	m.job.has_weight_offset = false;
	assert_int_equal(validate(*state, &m, &job), NC_OK);
	assert_int_equal(job_check_backend(&job, &none), NC_OK); /* the plain norm */
	release(&job);
}

/* Outputs for poisoning: the five of a LayerNorm forward, in their order. */
static void test_outputs_listed(void **state)
{
	struct msg m;
	struct job job;
	rms_forward(&m, 1, 1, 8192);
	m.job.op = NORMD__OP__LAYERNORM_FWD;
	m.job.has_y_dtype = true;
	m.job.y_dtype = NORMD__DTYPE__F8E5M2;
	m.job.scale = tensor(&m, NC__ROLE_SCALE, 1, 65536);
	m.job.amax = tensor(&m, NC__ROLE_AMAX, 1, 65540);
	m.job.mean = tensor(&m, NC__ROLE_MEAN, 1, 66000);
	m.job.rstd = tensor(&m, NC__ROLE_RSTD, 1, 67000);
	m.job.residual = tensor(&m, NC__ROLE_RESIDUAL, 3, 0);
	m.job.residual_out = tensor(&m, NC__ROLE_RESIDUAL_OUT, 1, 32768);
	assert_int_equal(validate(*state, &m, &job), NC_OK);
	struct job_output all[JOB_MAX_OUTPUTS];
	assert_int_equal(job_outputs(&job, all), 5);
	const void *want[] = {job.args.y, job.args.residual_out, job.args.amax, job.args.rstd,
			      job.args.mean};
	const uint64_t bytes[] = {ROWS * COLS, ROWS * COLS * 4, 4, ROWS * 4, ROWS * 4};
	for (int i = 0; i < 5; i++) {
		assert_ptr_equal(all[i].ptr, want[i]);
		assert_int_equal(all[i].bytes, bytes[i]);
	}
	release(&job);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test_setup_teardown(test_memfd_registered_twice_is_one_memory, make_regions,
					    drop_regions),
	    cmocka_unit_test_setup_teardown(test_ipc_twins_are_one_memory, make_regions,
					    drop_regions),
	    cmocka_unit_test_setup_teardown(test_fp8_y_is_one_byte_an_element, make_regions,
					    drop_regions),
	    cmocka_unit_test_setup_teardown(test_backend_without_variant_refuses, make_regions,
					    drop_regions),
	    cmocka_unit_test_setup_teardown(test_outputs_listed, make_regions, drop_regions),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
