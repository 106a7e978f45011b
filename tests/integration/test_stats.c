/*
 * Stats beyond the totals: jobs are counted by op and reply status (refused
 * ones too), the latency histogram of each op counts exactly the jobs that
 * ran, bytes per op add up to the total, and the host device of the CPU
 * backend reports the jobs that ran on it. Also the library's quantile
 * estimate from a histogram.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "tests/support/testlib.h"

static uint64_t hist_count(const uint64_t *buckets)
{
	uint64_t n = 0;
	for (int i = 0; i < NC_LATENCY_BUCKETS; i++)
		n += buckets[i];
	return n;
}

static void test_counts_by_op_status_and_device(void **state)
{
	(void)state;
	struct test_daemon d;
	assert_int_equal(test_daemon_start(&d, NULL), 0);
	/* One LayerNorm backward and one RMSNorm forward, both correct. */
	assert_true(good_client_works(d.socket));

	nc_conn *conn;
	assert_int_equal(nc_connect(d.socket, "stats", 5000, &conn), NC_OK);
	/* A LayerNorm forward refused before it runs (rows 0). */
	struct jobkit kit;
	struct jobkit_spec spec = {
	    .op = NC_LAYERNORM_FWD, .rows = 4, .cols = 64, .dtype = NC_F32, .seed = 3};
	assert_int_equal(jobkit_create(conn, &spec, &kit), NC_OK);
	kit.job.rows = 0;
	struct nc_job_result result;
	assert_int_equal(nc_job_run(conn, &kit.job, 5000, &result), NC_EINVALID_ARGUMENT);
	jobkit_destroy(&kit);

	struct nc_stats s;
	assert_int_equal(nc_stats_get(conn, 5000, &s), NC_OK);
	assert_int_equal(s.jobs_ok, 2);
	assert_int_equal(s.jobs_failed, 1);
	const struct nc_op_stats *ln_bwd = &s.ops[NC_LAYERNORM_BWD];
	const struct nc_op_stats *rms_fwd = &s.ops[NC_RMSNORM_FWD];
	const struct nc_op_stats *ln_fwd = &s.ops[NC_LAYERNORM_FWD];
	assert_int_equal(ln_bwd->jobs_by_status[0], 1);
	assert_int_equal(rms_fwd->jobs_by_status[0], 1);
	assert_int_equal(ln_fwd->jobs_by_status[0], 0);
	assert_int_equal(ln_fwd->jobs_by_status[-NC_EINVALID_ARGUMENT], 1);
	assert_int_equal(s.ops[NC_RMSNORM_BWD].jobs_by_status[0], 0);

	/* The histograms hold the jobs that ran, and only those. */
	assert_int_equal(hist_count(ln_bwd->latency_buckets), 1);
	assert_int_equal(hist_count(rms_fwd->latency_buckets), 1);
	assert_int_equal(hist_count(ln_fwd->latency_buckets), 0);
	assert_true(ln_bwd->latency_us_sum >= ln_bwd->device_us);
	assert_true(nc_latency_quantile_us(ln_bwd->latency_buckets, 0.5) > 0.0);
	assert_int_equal(ln_bwd->bytes + rms_fwd->bytes, s.bytes_processed);
	assert_true(ln_bwd->bytes > 0 && rms_fwd->bytes > 0);

	/* The CPU backend has one device, the host, and no variant cache. */
	assert_int_equal(s.device_count, 1);
	assert_int_equal(s.devices[0].index, -1);
	assert_int_equal(s.devices[0].jobs_ok, 2);
	assert_int_equal(s.devices[0].jobs_failed, 0);
	assert_int_equal(s.devices[0].bytes, s.bytes_processed);
	assert_false(s.devices[0].has_variant_cache);
	nc_close(conn);
	assert_int_equal(test_daemon_stop(&d), 0);
}

static void test_latency_quantiles(void **state)
{
	(void)state;
	uint64_t h[NC_LATENCY_BUCKETS] = {0};
	assert_true(nc_latency_quantile_us(h, 0.5) == 0.0);
	/* 100 jobs in [16, 32) us: the median interpolates to the middle. */
	h[5] = 100;
	assert_true(nc_latency_quantile_us(h, 0.5) > 23.9 && nc_latency_quantile_us(h, 0.5) < 24.1);
	assert_true(nc_latency_quantile_us(h, 1.0) > 31.9 && nc_latency_quantile_us(h, 1.0) < 32.1);
	/* 90 fast jobs and 10 slow ones: p99 lands among the slow. */
	h[5] = 90;
	h[12] = 10; /* [2048, 4096) us */
	double p99 = nc_latency_quantile_us(h, 0.99);
	assert_true(p99 >= 2048.0 && p99 <= 4096.0);
	assert_true(nc_latency_quantile_us(h, 0.5) < 32.0);
	/* The open last bucket reports its lower bound. */
	memset(h, 0, sizeof(h));
	h[NC_LATENCY_BUCKETS - 1] = 1;
	assert_true(nc_latency_quantile_us(h, 0.5) == (double)(1ull << (NC_LATENCY_BUCKETS - 2)));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_counts_by_op_status_and_device),
	    cmocka_unit_test(test_latency_quantiles),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
