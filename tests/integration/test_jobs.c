/*
 * Jobs through a real daemon and real sockets: every op and dtype checked
 * against the float64 reference, several client processes at once, async
 * submission with out-of-order completion, many threads on one connection,
 * and a client that dies with jobs in flight.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "tests/support/group.h"

static nc_conn *connect_or_fail(void)
{
	nc_conn *conn = NULL;
	int rc = nc_connect(group_daemon.socket, "test_jobs", 5000, &conn);
	if (rc)
		fprintf(stderr, "connect: %s\n", nc_last_error());
	assert_int_equal(rc, NC_OK);
	return conn;
}

/* Every op x dtype x affine x memory_efficient, on awkward shapes. */
static void test_every_op_matches_reference(void **state)
{
	(void)state;
	nc_conn *conn = connect_or_fail();
	static const enum nc_op ops[] = {NC_LAYERNORM_FWD, NC_LAYERNORM_BWD, NC_RMSNORM_FWD,
					 NC_RMSNORM_BWD};
	static const enum nc_dtype dtypes[] = {NC_F32, NC_F16, NC_BF16};
	static const uint64_t shapes[][2] = {{1, 1}, {3, 7}, {5, 33}, {64, 1000}, {2, 4096}};
	int failures = 0, seed = 1;
	for (size_t o = 0; o < 4; o++)
		for (size_t d = 0; d < 3; d++)
			for (size_t s = 0; s < 5; s++)
				for (int variant = 0; variant < 4; variant++) {
					struct jobkit_spec spec = {
						.op = ops[o], .rows = shapes[s][0],
						.cols = shapes[s][1], .dtype = dtypes[d],
						.weight_dtype = (variant & 2) ? NC_F32 : 0,
						.gamma = variant != 0, .beta = variant != 0,
						.memory_efficient = variant == 3,
						.accumulate = variant == 2, .seed = (uint64_t)seed++,
					};
					failures += test_run_checked(conn, &spec, 60000) != 0;
				}
	nc_close(conn);
	assert_int_equal(failures, 0);
}

/* Several client processes at once, each checking its own results. */
static void test_many_processes(void **state)
{
	(void)state;
	enum { PROCS = 6 };
	pid_t pids[PROCS];
	for (int p = 0; p < PROCS; p++) {
		pids[p] = fork();
		assert_true(pids[p] >= 0);
		if (pids[p] == 0) {
			nc_conn *conn;
			if (nc_connect(group_daemon.socket, "child", 5000, &conn))
				_exit(2);
			int bad = 0;
			for (int i = 0; i < 12; i++) {
				struct jobkit_spec spec = {
					.op = (enum nc_op)(1 + (i + p) % 4), .rows = 16 + (uint64_t)i,
					.cols = 100 + 31 * (uint64_t)p, .dtype = (enum nc_dtype)(1 + i % 3),
					.gamma = true, .beta = true, .memory_efficient = i % 2,
					.seed = (uint64_t)(p * 100 + i),
				};
				bad += test_run_checked(conn, &spec, 60000) != 0;
			}
			nc_close(conn);
			_exit(bad ? 1 : 0);
		}
	}
	int failed = 0;
	for (int p = 0; p < PROCS; p++) {
		int status;
		waitpid(pids[p], &status, 0);
		failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	}
	assert_int_equal(failed, 0);
}

/*
 * A large job is submitted first and a small one after; the small one's
 * reply arrives while the large one still runs (two CPU workers), so replies
 * come back out of order and are matched by request id.
 */
static void test_async_out_of_order(void **state)
{
	(void)state;
	nc_conn *conn = connect_or_fail();
	struct jobkit big, small;
	struct jobkit_spec big_spec = {.op = NC_LAYERNORM_BWD, .rows = 3000, .cols = 4096,
				       .dtype = NC_F32, .gamma = true, .beta = true, .seed = 5};
	struct jobkit_spec small_spec = {.op = NC_RMSNORM_FWD, .rows = 2, .cols = 64,
					 .dtype = NC_F32, .gamma = true, .seed = 6};
	assert_int_equal(jobkit_create(conn, &big_spec, &big), NC_OK);
	assert_int_equal(jobkit_create(conn, &small_spec, &small), NC_OK);
	uint64_t big_id, small_id;
	struct nc_job_result big_result, small_result;
	struct jobkit_report report;
	assert_int_equal(nc_job_submit(conn, &big.job, &big_id), NC_OK);
	assert_int_equal(nc_job_submit(conn, &small.job, &small_id), NC_OK);
	assert_int_equal(nc_job_wait(conn, small_id, 30000, &small_result), NC_OK);
	/* The big job is still running: a zero timeout finds no reply yet. */
	assert_int_equal(nc_job_wait(conn, big_id, 0, &big_result), NC_ETIMEOUT);
	assert_int_equal(nc_job_wait(conn, big_id, 60000, &big_result), NC_OK);
	assert_true(jobkit_check(&small, &report));
	assert_true(jobkit_check(&big, &report));
	/* An id never submitted, or already waited for, is NOT_FOUND. */
	assert_int_equal(nc_job_wait(conn, big_id, 0, &big_result), NC_ENOT_FOUND);
	jobkit_destroy(&big);
	jobkit_destroy(&small);
	nc_close(conn);
}

/* Many jobs in flight on one connection, waited for in reverse order. */
static void test_many_in_flight(void **state)
{
	(void)state;
	enum { JOBS = 200 };
	nc_conn *conn = connect_or_fail();
	static struct jobkit kits[JOBS];
	uint64_t ids[JOBS];
	for (int i = 0; i < JOBS; i++) {
		struct jobkit_spec spec = {.op = NC_LAYERNORM_FWD, .rows = 4, .cols = 1 + (uint64_t)i,
					   .dtype = NC_BF16, .gamma = true, .beta = true,
					   .seed = (uint64_t)i + 1};
		assert_int_equal(jobkit_create(conn, &spec, &kits[i]), NC_OK);
		assert_int_equal(nc_job_submit(conn, &kits[i].job, &ids[i]), NC_OK);
	}
	int bad = 0;
	for (int i = JOBS - 1; i >= 0; i--) {
		struct nc_job_result result;
		struct jobkit_report report;
		bad += nc_job_wait(conn, ids[i], 30000, &result) != NC_OK ||
		       !jobkit_check(&kits[i], &report);
		jobkit_destroy(&kits[i]);
	}
	nc_close(conn);
	assert_int_equal(bad, 0);
}

struct thread_arg {
	nc_conn *conn;
	int index;
	int failures;
};

static void *thread_main(void *p)
{
	struct thread_arg *arg = p;
	for (int i = 0; i < 20; i++) {
		struct jobkit_spec spec = {.op = (enum nc_op)(1 + (i + arg->index) % 4), .rows = 8,
					   .cols = 96 + (uint64_t)arg->index, .dtype = NC_F32,
					   .gamma = true, .beta = true,
					   .seed = (uint64_t)(arg->index * 1000 + i)};
		arg->failures += test_run_checked(arg->conn, &spec, 60000) != 0;
	}
	return NULL;
}

/* One connection shared by several threads. */
static void test_threads_share_connection(void **state)
{
	(void)state;
	enum { THREADS = 6 };
	nc_conn *conn = connect_or_fail();
	pthread_t threads[THREADS];
	struct thread_arg args[THREADS];
	for (int t = 0; t < THREADS; t++) {
		args[t] = (struct thread_arg){conn, t, 0};
		assert_int_equal(pthread_create(&threads[t], NULL, thread_main, &args[t]), 0);
	}
	int failures = 0;
	for (int t = 0; t < THREADS; t++) {
		pthread_join(threads[t], NULL);
		failures += args[t].failures;
	}
	nc_close(conn);
	assert_int_equal(failures, 0);
}

/*
 * A client process submits large jobs and dies at once. The daemon stays
 * up, keeps serving others, and releases the dead client's regions once its
 * jobs are done.
 */
static void test_client_dies_mid_job(void **state)
{
	(void)state;
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		nc_conn *conn;
		struct jobkit kit;
		struct jobkit_spec spec = {.op = NC_LAYERNORM_FWD, .rows = 2000, .cols = 4096,
					   .dtype = NC_F32, .gamma = true, .beta = true, .seed = 9};
		if (nc_connect(group_daemon.socket, "doomed", 5000, &conn) ||
		    jobkit_create(conn, &spec, &kit))
			_exit(2);
		uint64_t id;
		for (int i = 0; i < 4; i++)
			nc_job_submit(conn, &kit.job, &id);
		_exit(0); /* no goodbye, no unregister, jobs in flight */
	}
	int status;
	waitpid(pid, &status, 0);
	assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	assert_true(good_client_works(group_daemon.socket));
	assert_true(test_daemon_alive(&group_daemon));

	/* Everything the dead client held is released once its jobs end. */
	nc_conn *conn = connect_or_fail();
	struct nc_stats stats = {0};
	for (int i = 0; i < 200; i++) {
		assert_int_equal(nc_stats_get(conn, 5000, &stats), NC_OK);
		if (stats.regions == 0 && stats.jobs_in_flight == 0 && stats.clients == 1)
			break;
		usleep(50 * 1000);
	}
	assert_int_equal(stats.jobs_in_flight, 0);
	assert_int_equal(stats.regions, 0);
	assert_int_equal(stats.mapped_bytes, 0);
	assert_int_equal(stats.clients, 1);
	nc_close(conn);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_every_op_matches_reference),
		cmocka_unit_test(test_many_processes),
		cmocka_unit_test(test_async_out_of_order),
		cmocka_unit_test(test_many_in_flight),
		cmocka_unit_test(test_threads_share_connection),
		cmocka_unit_test(test_client_dies_mid_job),
	};
	static const char *const extra[] = {"--cpu-workers", "2", "--cpu-threads", "1", NULL};
	return test_run_group(tests, extra);
}
