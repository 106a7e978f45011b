/*
 * SIGTERM drains: the daemon stops accepting, refuses new jobs with
 * SHUTTING_DOWN, finishes and answers the jobs already in flight, and exits
 * with status 0.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "tests/support/testlib.h"

static void test_sigterm_finishes_jobs_in_flight(void **state)
{
	(void)state;
	enum { JOBS = 4 };
	struct test_daemon d;
	/* One worker, one thread: the jobs take long enough to drain visibly. */
	static const char *const extra[] = {"--cpu-workers", "1", "--cpu-threads", "1", NULL};
	assert_int_equal(test_daemon_start(&d, extra), 0);
	nc_conn *conn;
	assert_int_equal(nc_connect(d.socket, "drain", 5000, &conn), NC_OK);
	struct jobkit kits[JOBS];
	uint64_t ids[JOBS];
	for (int i = 0; i < JOBS; i++) {
		struct jobkit_spec spec = {.op = NC_LAYERNORM_BWD, .rows = 2000, .cols = 4096,
					   .dtype = NC_F32, .gamma = true, .beta = true,
					   .seed = (uint64_t)i + 1};
		assert_int_equal(jobkit_create(conn, &spec, &kits[i]), NC_OK);
		assert_int_equal(nc_job_submit(conn, &kits[i].job, &ids[i]), NC_OK);
	}
	/* Frames are handled in order: the pong proves the jobs were accepted. */
	assert_int_equal(nc_ping(conn, 5000), NC_OK);
	assert_int_equal(kill(d.pid, SIGTERM), 0);
	/* The drain has begun once the listener is gone. */
	int probe;
	for (int i = 0; i < 5000 && (probe = raw_connect(d.socket)) >= 0; i++) {
		close(probe);
		usleep(1000);
	}

	/* New work is refused while the old finishes. */
	struct nc_job_result result;
	int rc = nc_job_run(conn, &kits[0].job, 5000, &result);
	if (rc != NC_ESHUTTING_DOWN) {
		fprintf(stderr, "job during drain: %s (%s)\n", nc_status_name(rc), result.message);
		test_daemon_dump_log(&d);
	}
	assert_int_equal(rc, NC_ESHUTTING_DOWN);

	for (int i = 0; i < JOBS; i++) {
		struct jobkit_report report;
		assert_int_equal(nc_job_wait(conn, ids[i], 60000, &result), NC_OK);
		assert_true(jobkit_check(&kits[i], &report));
	}
	/* Unregistering may fail now (the daemon is leaving); the mappings go anyway. */
	for (int i = 0; i < JOBS; i++)
		jobkit_destroy(&kits[i]);
	nc_close(conn);
	assert_int_equal(test_daemon_stop(&d), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_sigterm_finishes_jobs_in_flight),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
