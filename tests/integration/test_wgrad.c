/*
 * WGRAD_ACCUM (main_grad += dy^T x) through a real daemon on the CPU
 * backend: odd and large shapes against the float64 reference, accumulate
 * and overwrite, main_grad in fp32 and in the activation dtype, and bad
 * shapes or out-of-region tensors refused with a clear error.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "tests/support/group.h"

static void test_shapes_against_reference(void **state)
{
	(void)state;
	nc_conn *conn;
	assert_int_equal(nc_connect(group_daemon.socket, "wgrad", 5000, &conn), NC_OK);
	static const uint64_t shapes[][3] = {
		{1, 1, 1}, {3, 5, 7}, {17, 33, 9}, {64, 127, 65}, {513, 384, 257}, {1024, 512, 768},
	};
	static const enum nc_dtype types[][2] = {
		{NC_F32, NC_F32}, {NC_BF16, NC_F32}, {NC_F16, NC_F32}, {NC_BF16, NC_BF16},
		{NC_F16, NC_F16},
	};
	int bad = 0, seed = 1;
	for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
		for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++)
			for (int acc = 0; acc <= 1; acc++) {
				struct jobkit_spec spec = {
					.op = NC_WGRAD_ACCUM, .rows = shapes[s][0],
					.cols = shapes[s][1], .out_features = shapes[s][2],
					.dtype = types[t][0], .weight_dtype = types[t][1],
					.accumulate = acc, .seed = (uint64_t)seed++,
				};
				bad += test_run_checked(conn, &spec, 60000) != 0;
			}
	nc_close(conn);
	assert_int_equal(bad, 0);
}

/* Accumulating twice adds the product twice to the initial main_grad. */
static void test_accumulate_twice(void **state)
{
	(void)state;
	nc_conn *conn;
	assert_int_equal(nc_connect(group_daemon.socket, "wgrad-twice", 5000, &conn), NC_OK);
	struct jobkit kit, once;
	struct jobkit_spec spec = {.op = NC_WGRAD_ACCUM, .rows = 40, .cols = 24, .out_features = 16,
				   .dtype = NC_F32, .accumulate = true, .seed = 77};
	struct jobkit_spec overwrite = spec;
	overwrite.accumulate = false;
	assert_int_equal(jobkit_create(conn, &spec, &kit), NC_OK);
	assert_int_equal(jobkit_create(conn, &overwrite, &once), NC_OK);
	struct nc_job_result result;
	assert_int_equal(nc_job_run(conn, &kit.job, 10000, &result), NC_OK);
	assert_int_equal(nc_job_run(conn, &kit.job, 10000, &result), NC_OK);
	assert_int_equal(nc_job_run(conn, &once.job, 10000, &result), NC_OK);
	const float *twice = kit.ptr[JK_MAIN_GRAD], *initial = kit.initial[JK_MAIN_GRAD];
	const float *product = once.ptr[JK_MAIN_GRAD];
	double worst = 0;
	for (int i = 0; i < 16 * 24; i++) {
		double want = (double)initial[i] + 2.0 * (double)product[i];
		double err = twice[i] - want;
		worst = err * err > worst ? err * err : worst;
	}
	assert_true(worst < 1e-10);
	jobkit_destroy(&kit);
	jobkit_destroy(&once);
	nc_close(conn);
}

static void expect_status(nc_conn *conn, const struct nc_job *job, int status, const char *part)
{
	struct nc_job_result result;
	int rc = nc_job_run(conn, job, 5000, &result);
	if (rc != status || (part && !strstr(result.message, part)))
		fprintf(stderr, "expected %s (%s), got %s: %s\n", nc_status_name(status),
			part ? part : "", nc_status_name(rc), result.message);
	assert_int_equal(rc, status);
	if (part)
		assert_non_null(strstr(result.message, part));
}

static void test_bad_wgrad_jobs(void **state)
{
	(void)state;
	nc_conn *conn;
	assert_int_equal(nc_connect(group_daemon.socket, "wgrad-bad", 5000, &conn), NC_OK);
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_WGRAD_ACCUM, .rows = 8, .cols = 16, .out_features = 4,
				   .dtype = NC_BF16, .accumulate = true, .seed = 5};
	assert_int_equal(jobkit_create(conn, &spec, &kit), NC_OK);
	const struct nc_job good = kit.job;
	struct nc_job job;
	job = good, job.out_features = 0;
	expect_status(conn, &job, NC_EINVALID_ARGUMENT, "out_features");
	job = good, job.out_features = 1ull << 62;
	expect_status(conn, &job, NC_EOUT_OF_RANGE, "overflows");
	job = good, job.out_features = 5; /* dy and main_grad no longer fit */
	expect_status(conn, &job, NC_EOUT_OF_RANGE, "runs past");
	job = good, job.main_grad.offset = nc_region_size(kit.region);
	expect_status(conn, &job, NC_EOUT_OF_RANGE, "tensor main_grad");
	job = good, job.main_grad.region = 0;
	expect_status(conn, &job, NC_EINVALID_ARGUMENT, "needs tensor main_grad");
	job = good, job.y = job.x;
	expect_status(conn, &job, NC_EINVALID_ARGUMENT, "tensor y is not used");
	job = good, job.weight_dtype = NC_F16;
	expect_status(conn, &job, NC_EUNSUPPORTED, "weight_dtype");
	job = good, job.flags = NC_MEMORY_EFFICIENT;
	expect_status(conn, &job, NC_EINVALID_ARGUMENT, "gemm_beta");
	struct nc_job_result result;
	struct jobkit_report report;
	assert_int_equal(nc_job_run(conn, &good, 5000, &result), NC_OK);
	assert_true(jobkit_check(&kit, &report));
	jobkit_destroy(&kit);
	nc_close(conn);
	assert_true(good_client_works(group_daemon.socket));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_shapes_against_reference),
		cmocka_unit_test(test_accumulate_twice),
		cmocka_unit_test(test_bad_wgrad_jobs),
	};
	return test_run_group(tests, NULL);
}
