/*
 * Connections cannot hold their slot without speaking: one that has not
 * sent Hello within hello_timeout_ms, or that holds a started frame for
 * frame_timeout_ms, is closed and counted (rejections hello_timeout and
 * frame_timeout), while an idle connection after Hello stays open. The
 * daemon runs with 500 ms deadlines so that the tests take seconds.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "normclient.h"
#include "proto/frame.h"
#include "tests/support/group.h"

#define DEADLINE_MS 500
#define SILENT_CONNECTIONS 200

static uint64_t rejections(int reason)
{
	nc_conn *conn;
	struct nc_stats stats;
	assert_int_equal(nc_connect(group_daemon.socket, "deadline-stats", 5000, &conn), NC_OK);
	assert_int_equal(nc_stats_get(conn, 5000, &stats), NC_OK);
	nc_close(conn);
	return stats.rejections[reason];
}

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/*
 * 200 connections that never say Hello are closed once the deadline has
 * passed (not before it), while a well-behaved client is served throughout.
 */
static void test_silent_connections_closed(void **state)
{
	(void)state;
	uint64_t before = rejections(NC_REJECT_HELLO_TIMEOUT);
	int fds[SILENT_CONNECTIONS];
	uint64_t start = now_ms();
	for (int i = 0; i < SILENT_CONNECTIONS; i++) {
		fds[i] = raw_connect(group_daemon.socket);
		assert_true(fds[i] >= 0);
	}
	assert_true(good_client_works(group_daemon.socket));
	/* Well before the deadline, the first connection is still open. */
	if (now_ms() - start < DEADLINE_MS / 2)
		assert_false(raw_closed(fds[0], DEADLINE_MS / 4));
	for (int i = 0; i < SILENT_CONNECTIONS; i++) {
		if (!raw_closed(fds[i], 5000))
			fail_msg("silent connection %d is still open %llu ms after it connected", i,
				 (unsigned long long)(now_ms() - start));
		close(fds[i]);
	}
	assert_true(now_ms() - start >= DEADLINE_MS);
	assert_true(test_daemon_log_contains(&group_daemon, "event=hello_timeout"));
	assert_int_equal(rejections(NC_REJECT_HELLO_TIMEOUT) - before, SILENT_CONNECTIONS);
	assert_others_unharmed();
}

/* Hello, then half a frame header, then nothing: closed at the frame deadline. */
static void test_half_frame_closed(void **state)
{
	(void)state;
	uint64_t before = rejections(NC_REJECT_FRAME_TIMEOUT);
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	static const uint8_t half_header[2] = {0x10, 0x00};
	assert_int_equal(raw_write(fd, half_header, sizeof(half_header)), 0);
	uint64_t start = now_ms();
	assert_true(raw_closed(fd, 5000));
	assert_true(now_ms() - start >= DEADLINE_MS / 2);
	close(fd);
	assert_int_equal(rejections(NC_REJECT_FRAME_TIMEOUT) - before, 1);
	assert_others_unharmed();
}

/* A connection quiet for three deadlines after Hello is still served. */
static void test_idle_after_hello_stays(void **state)
{
	(void)state;
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	assert_false(raw_closed(fd, 3 * DEADLINE_MS));
	Normd__Ping ping;
	Normd__Envelope env;
	raw_ping_init(&env, &ping, 7);
	assert_int_equal(raw_send(fd, &env), 0);
	Normd__Envelope *reply = raw_recv(fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_PONG);
	nc__envelope_free(reply);
	close(fd);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_silent_connections_closed),
		cmocka_unit_test(test_half_frame_closed),
		cmocka_unit_test(test_idle_after_hello_stays),
	};
	static const char *const extra[] = {
		"--hello-timeout-ms", "500", "--frame-timeout-ms", "500", NULL,
	};
	return test_run_group(tests, extra);
}
