/*
 * Replies are written once per connection per loop iteration (daemon/client.c,
 * client_defer_room): many connections with many requests each in one write
 * get every reply, once and in order, whether the socket takes them at once
 * or the output queue backs up under a small max_output_bytes; an error reply
 * still reaches a client that is closed for it; and jobs from many
 * connections at once all complete (the lock-free completion stack).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "normclient.h"
#include "proto/frame.h"
#include "tests/support/group.h"

#define CONNECTIONS 48
#define PINGS 300                 /* per connection: several deferred blocks' worth */
#define MAX_OUTPUT "8192"         /* deferred blocks of 1 KiB; reading pauses at 4 KiB */
#define FLOOD_PINGS 3000          /* far past what max_output_bytes holds unread */
#define JOB_PROCS 8

/* Writes `count` Pings (request ids first..., nonces the same) in as few writes as fit. */
static void send_pings(int fd, uint64_t first, unsigned count)
{
	static uint8_t buf[65536];
	size_t len = 0;
	for (unsigned i = 0; i < count; i++) {
		Normd__Ping ping = NORMD__PING__INIT;
		ping.has_nonce = true;
		ping.nonce = first + i;
		Normd__Envelope env = NORMD__ENVELOPE__INIT;
		env.has_request_id = true;
		env.request_id = first + i;
		env.body_case = NORMD__ENVELOPE__BODY_PING;
		env.ping = &ping;
		if (raw_pack_into(&env, buf, sizeof(buf), &len) != 0) {
			assert_int_equal(raw_write(fd, buf, len), 0);
			len = 0;
			assert_int_equal(raw_pack_into(&env, buf, sizeof(buf), &len), 0);
		}
	}
	assert_int_equal(raw_write(fd, buf, len), 0);
}

/* Reads `count` Pongs and checks they answer first, first + 1, ... in that order. */
static void expect_pongs(int fd, uint64_t first, unsigned count)
{
	for (unsigned i = 0; i < count; i++) {
		Normd__Envelope *env = raw_recv(fd, 10000);
		assert_non_null(env);
		assert_int_equal(env->body_case, NORMD__ENVELOPE__BODY_PONG);
		assert_int_equal(env->request_id, first + i);
		assert_int_equal(env->pong->nonce, first + i);
		nc__envelope_free(env);
	}
}

static void test_pipelined_requests_on_many_connections(void **state)
{
	(void)state;
	int fds[CONNECTIONS];
	for (int i = 0; i < CONNECTIONS; i++) {
		fds[i] = raw_connect(group_daemon.socket);
		assert_true(fds[i] >= 0);
		assert_int_equal(raw_hello(fds[i]), 0);
	}
	/* All connections' requests first, so that one loop iteration answers many of them. */
	for (int i = 0; i < CONNECTIONS; i++)
		send_pings(fds[i], 2, PINGS);
	for (int i = 0; i < CONNECTIONS; i++) {
		expect_pongs(fds[i], 2, PINGS);
		close(fds[i]);
	}
	assert_others_unharmed();
}

static void test_backed_up_output_keeps_order(void **state)
{
	(void)state;
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	/* Nothing is read while the daemon answers: its queue backs up and reading pauses. */
	send_pings(fd, 2, FLOOD_PINGS);
	usleep(200 * 1000);
	expect_pongs(fd, 2, FLOOD_PINGS);
	close(fd);
	assert_others_unharmed();
}

static void test_error_reply_before_close(void **state)
{
	(void)state;
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	/* A Ping before Hello is answered with PROTOCOL_ERROR, then the daemon hangs up. */
	Normd__Ping ping;
	Normd__Envelope env;
	raw_ping_init(&env, &ping, 7);
	assert_int_equal(raw_send(fd, &env), 0);
	Normd__Envelope *reply = raw_recv(fd, 10000);
	assert_non_null(reply);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_RESULT);
	assert_int_equal(reply->result->status, NORMD__STATUS__PROTOCOL_ERROR);
	nc__envelope_free(reply);
	assert_true(raw_closed(fd, 10000));
	close(fd);
}

/* Runs enough checked jobs that their completions meet on the daemon's stack. */
static int run_jobs_child(void)
{
	for (int i = 0; i < 40; i++) {
		if (!good_client_works(group_daemon.socket))
			return 1;
	}
	return 0;
}

static void test_completions_from_many_connections(void **state)
{
	(void)state;
	pid_t pids[JOB_PROCS];
	for (int i = 0; i < JOB_PROCS; i++) {
		pids[i] = fork();
		assert_true(pids[i] >= 0);
		if (pids[i] == 0)
			_exit(run_jobs_child());
	}
	for (int i = 0; i < JOB_PROCS; i++) {
		int status;
		assert_int_equal(waitpid(pids[i], &status, 0), pids[i]);
		assert_true(WIFEXITED(status));
		assert_int_equal(WEXITSTATUS(status), 0);
	}
	assert_others_unharmed();
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_pipelined_requests_on_many_connections),
		cmocka_unit_test(test_backed_up_output_keeps_order),
		cmocka_unit_test(test_error_reply_before_close),
		cmocka_unit_test(test_completions_from_many_connections),
	};
	static const char *const extra[] = {"--max-output-bytes", MAX_OUTPUT, NULL};
	return test_run_group(tests, extra);
}
