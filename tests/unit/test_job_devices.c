/*
 * A job runs on one device (daemon/job.c, job_validate): tensors whose
 * regions are on two different GPUs are refused with INVALID_ARGUMENT and a
 * message naming both devices, and the job's device is its regions' device.
 * The CPU-side half of the multi-GPU test (tests/gpu/test_multi_gpu.c):
 * regions are made with region_new() on devices 0 and 1 without mapping
 * anything, since validation only reads their size, base and device. The
 * server functions job.c calls beyond validation are stubs here.
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

enum { ROWS = 4, COLS = 256, REGION_BYTES = 1 << 20 };

/* Regions 1 and 2 on device 0, region 3 on device 1, none of them mapped. */
static int make_regions(void **state)
{
	static struct region_table table;
	region_table_init(&table);
	const int device_of[] = {0, 0, 1};
	for (uint64_t id = 1; id <= 3; id++) {
		struct region *r = region_new(id, NORMD__REGION_KIND__CUDA_IPC, REGION_BYTES,
					      device_of[id - 1]);
		if (!r || region_insert(&table, r) != 0)
			return -1;
	}
	*state = &table;
	return 0;
}

static int drop_regions(void **state)
{
	region_table_clear(*state);
	return region_live_count() == 0 ? 0 : -1;
}

/* Validates an RMSNorm forward with x, y and gamma in the given regions. */
static int validate(struct region_table *table, uint64_t x, uint64_t y, uint64_t gamma,
		    struct job *job)
{
	struct config cfg = {.max_cols = 1 << 20};
	Normd__Tensor tx = NORMD__TENSOR__INIT, ty = NORMD__TENSOR__INIT,
		      tg = NORMD__TENSOR__INIT;
	tx.region_id = x;
	ty.region_id = y;
	tg.region_id = gamma;
	/* Unmapped regions have base NULL: no tensor at offset 0, so none is NULL. */
	tx.has_offset = ty.has_offset = tg.has_offset = true;
	tx.offset = 4096;
	ty.offset = 65536;
	tg.offset = 131072;
	Normd__Job msg = NORMD__JOB__INIT;
	msg.op = NORMD__OP__RMSNORM_FWD;
	msg.rows = ROWS;
	msg.cols = COLS;
	msg.dtype = NORMD__DTYPE__F32;
	msg.x = &tx;
	msg.y = &ty;
	msg.gamma = &tg;
	memset(job, 0, sizeof(*job));
	return job_validate(job, table, &cfg, &msg);
}

/* Releases the region references a validated (or refused) job holds. */
static void release(struct job *job)
{
	for (unsigned i = 0; i < job->region_count; i++)
		region_unref(job->regions[i]);
}

static void test_one_device_runs_there(void **state)
{
	struct job job;
	assert_int_equal(validate(*state, 1, 2, 1, &job), 0);
	assert_int_equal(job.device, 0);
	release(&job);
	assert_int_equal(validate(*state, 3, 3, 3, &job), 0);
	assert_int_equal(job.device, 1);
	release(&job);
}

static void test_two_devices_refused(void **state)
{
	/* x and y apart, then x and y together with gamma apart. */
	static const uint64_t cases[][3] = {{1, 3, 1}, {3, 1, 3}, {1, 2, 3}};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct job job;
		int rc = validate(*state, cases[i][0], cases[i][1], cases[i][2], &job);
		assert_int_equal(rc, NC_EINVALID_ARGUMENT);
		assert_int_equal(job.status, NC_EINVALID_ARGUMENT);
		assert_non_null(strstr(job.message, "different devices"));
		assert_true(strstr(job.message, "0 and 1") || strstr(job.message, "1 and 0"));
		release(&job);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test_setup_teardown(test_one_device_runs_there, make_regions,
					    drop_regions),
	    cmocka_unit_test_setup_teardown(test_two_devices_refused, make_regions, drop_regions),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
