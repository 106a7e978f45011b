/*
 * Allocation failure anywhere in a request's path is answered, never a crash.
 *
 * For N = 1, 2, 3, ... a fresh daemon is started with NORMD_TEST_FAIL_ALLOC=N
 * (daemon/main.c): the Nth allocation after it starts listening fails, once,
 * and the daemon logs "event=test_alloc_failure_injected". A client then
 * runs one session: Hello, register a region, a job, Stats, Ping, three jobs
 * in flight at once, unregister, Goodbye. Wherever the failure lands, each
 * step must end in a reply (an error status is fine) or a closed connection,
 * never a hang or a wrong result; afterwards the daemon must still serve a
 * well-behaved client correctly and exit 0 on SIGTERM. The loop ends at the
 * first N that the session no longer reaches, so every allocation the
 * session causes has been failed once.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "tests/support/testlib.h"

#define MAX_N 1000
#define TIMEOUT_MS 10000

/* A step's outcome is acceptable unless the daemon never answered. */
static bool answered(int rc, const char *step, uint64_t n)
{
	if (rc == NC_ETIMEOUT) {
		fprintf(stderr, "N=%llu: %s got no reply: %s\n", (unsigned long long)n, step,
			nc_last_error());
		return false;
	}
	return true;
}

/* Runs the session; returns false only on a hang or a wrong result. */
static bool run_session(const char *socket_path, uint64_t n)
{
	nc_conn *conn;
	int rc = nc_connect(socket_path, "alloc-failure", TIMEOUT_MS, &conn);
	if (rc)
		return answered(rc, "Hello", n);
	bool ok = true;
	struct jobkit kits[3];
	int made = 0;
	struct nc_job_result result;
	struct jobkit_report report;
	struct nc_stats stats;
	for (; made < 3; made++) {
		struct jobkit_spec spec = {.op = NC_LAYERNORM_BWD, .rows = 16, .cols = 96,
					   .dtype = NC_F32, .gamma = true, .beta = true,
					   .seed = (uint64_t)made + 1};
		rc = jobkit_create(conn, &spec, &kits[made]);
		if (rc) {
			ok = answered(rc, "RegisterRegion", n);
			goto out;
		}
	}
	rc = nc_job_run(conn, &kits[0].job, TIMEOUT_MS, &result);
	if (rc == NC_OK && !jobkit_check(&kits[0], &report)) {
		fprintf(stderr, "N=%llu: wrong result: %s\n", (unsigned long long)n, report.detail);
		ok = false;
		goto out;
	}
	if (rc) {
		ok = answered(rc, "Job", n);
		goto out;
	}
	rc = nc_stats_get(conn, TIMEOUT_MS, &stats);
	if (rc == 0)
		rc = nc_ping(conn, TIMEOUT_MS);
	if (rc) {
		ok = answered(rc, "Stats/Ping", n);
		goto out;
	}
	uint64_t ids[3];
	int submitted = 0;
	for (; submitted < 3; submitted++) {
		if (nc_job_submit(conn, &kits[submitted].job, &ids[submitted]))
			break;
	}
	for (int i = 0; i < submitted; i++) {
		rc = nc_job_wait(conn, ids[i], TIMEOUT_MS, &result);
		if (rc == NC_OK && !jobkit_check(&kits[i], &report)) {
			fprintf(stderr, "N=%llu: wrong result in flight: %s\n",
				(unsigned long long)n, report.detail);
			ok = false;
		}
		ok = ok && answered(rc, "Job in flight", n);
	}
out:
	for (int i = 0; i < made; i++)
		jobkit_destroy(&kits[i]);
	nc_close(conn);
	return ok;
}

static void test_every_allocation_fails_once(void **state)
{
	(void)state;
	uint64_t n = 1;
	for (; n <= MAX_N; n++) {
		char value[32];
		struct test_daemon d;
		snprintf(value, sizeof(value), "%llu", (unsigned long long)n);
		static const char *const extra[] = {"--cpu-workers", "1", "--cpu-threads", "1",
						    NULL};
		setenv("NORMD_TEST_FAIL_ALLOC", value, 1);
		int started = test_daemon_start(&d, extra);
		unsetenv("NORMD_TEST_FAIL_ALLOC");
		assert_int_equal(started, 0);
		int idle_fds = test_daemon_fd_count(&d);
		bool ok = run_session(d.socket, n);
		/* Wait until the daemon has seen the session's end (its socket closed). */
		for (int i = 0; i < 500 && test_daemon_fd_count(&d) > idle_fds; i++)
			usleep(10000);
		bool alive = test_daemon_alive(&d);
		bool injected = test_daemon_log_contains(&d, "event=test_alloc_failure_injected");
		/* The one failure is spent: from here on everything must work. */
		bool good = alive && (!injected || good_client_works(d.socket));
		/* SIGTERM it here, so that its log can still be shown if it exits badly. */
		kill(d.pid, SIGTERM);
		for (int i = 0; i < 1500 && test_daemon_alive(&d); i++)
			usleep(10000);
		bool clean_exit = d.exited && WIFEXITED(d.wait_status) &&
				  WEXITSTATUS(d.wait_status) == 0;
		if (!ok || !alive || !good || !clean_exit)
			test_daemon_dump_log(&d);
		int exit_code = test_daemon_stop(&d);
		if (!ok || !alive || !good || exit_code != 0)
			fail_msg("N=%llu: session %s, daemon %s, good client %s, exit %d",
				 (unsigned long long)n, ok ? "ok" : "FAILED",
				 alive ? "alive" : "DEAD", good ? "ok" : "FAILED", exit_code);
		if (!injected)
			break; /* the session makes fewer than n allocations */
	}
	fprintf(stderr, "failed each of the session's %llu allocations once\n",
		(unsigned long long)n - 1);
	/* A session allocates dozens of times; a short loop means the hook did nothing. */
	assert_true(n > 20);
	assert_true(n <= MAX_N);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_every_allocation_fails_once),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
