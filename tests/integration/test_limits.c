/*
 * Resource limits, against a daemon started with small ones: regions and
 * mapped bytes per connection, jobs in flight per connection, clients, the
 * frame size, and the output queue of a client that stops reading. Each
 * refusal carries RESOURCE_EXHAUSTED (or PROTOCOL_ERROR for the frame) and
 * a message naming the limit and its value, is counted under its reason in
 * Stats, and leaves everyone else served.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "normclient.h"
#include "proto/frame.h"
#include "tests/support/group.h"

#define MAX_REGIONS 3
#define MAX_MAPPED (1024 * 1024)
#define MAX_JOBS 2
#define MAX_CLIENTS 3
#define MAX_OUTPUT 4096
#define MAX_FRAME 4096

static void sleep_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

/* The daemon's rejection counters (on a connection of its own, closed again). */
static void get_rejections(uint64_t out[NC_REJECT_COUNT])
{
	nc_conn *conn = NULL;
	struct nc_stats stats;
	assert_int_equal(nc_connect(group_daemon.socket, "stats", 5000, &conn), NC_OK);
	assert_int_equal(nc_stats_get(conn, 5000, &stats), NC_OK);
	memcpy(out, stats.rejections, sizeof(uint64_t) * NC_REJECT_COUNT);
	nc_close(conn);
}

/* Checks that exactly `count` rejections of `reason` happened since `before`. */
static void assert_rejected(const uint64_t before[NC_REJECT_COUNT], int reason, uint64_t count)
{
	uint64_t after[NC_REJECT_COUNT];
	get_rejections(after);
	for (int i = 0; i < NC_REJECT_COUNT; i++) {
		uint64_t want = i == reason ? count : 0;
		if (after[i] - before[i] != want)
			fail_msg("rejections[%s] grew by %llu, expected %llu", nc_reject_name(i),
				 (unsigned long long)(after[i] - before[i]),
				 (unsigned long long)want);
	}
}

/* Closes a connection and waits until the daemon has closed its end too. */
static void close_and_wait(int fd)
{
	int before = test_daemon_fd_count(&group_daemon);
	assert_true(before > 0);
	close(fd);
	for (int i = 0; i < 500 && test_daemon_fd_count(&group_daemon) >= before; i++)
		sleep_ms(10);
	assert_true(test_daemon_fd_count(&group_daemon) < before);
}

static int raw_open(void)
{
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	return fd;
}

static void expect_result(int fd, uint64_t id, Normd__Status status, const char *needle)
{
	Normd__Envelope *env = raw_recv(fd, 5000);
	assert_non_null(env);
	assert_int_equal(env->body_case, NORMD__ENVELOPE__BODY_RESULT);
	assert_int_equal(env->request_id, id);
	if (env->result->status != status || (needle && !strstr(env->result->message, needle)))
		fail_msg("status %d \"%s\", expected %d \"%s\"", (int)env->result->status,
			 env->result->message, (int)status, needle ? needle : "");
	nc__envelope_free(env);
}

/* Registers a memfd of `file_bytes` as region `id` claiming `size` bytes. */
static void register_expect(int fd, uint64_t id, size_t file_bytes, uint64_t size,
			    Normd__Status status, const char *needle)
{
	int memfd = test_memfd(file_bytes, MFD_ALLOW_SEALING);
	assert_true(memfd >= 0);
	Normd__RegisterRegion reg;
	Normd__Envelope env;
	raw_register_init(&env, &reg, 1000 + id, id, size);
	assert_int_equal(raw_send_with_fd(fd, &env, memfd), 0);
	close(memfd);
	expect_result(fd, env.request_id, status, needle);
}

static void unregister_expect(int fd, uint64_t id, Normd__Status status)
{
	Normd__UnregisterRegion unreg = NORMD__UNREGISTER_REGION__INIT;
	unreg.region_id = id;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = 2000 + id;
	env.body_case = NORMD__ENVELOPE__BODY_UNREGISTER_REGION;
	env.unregister_region = &unreg;
	assert_int_equal(raw_send(fd, &env), 0);
	expect_result(fd, env.request_id, status, NULL);
}

/* The limits are reported by Stats (normctl stats prints them) and HelloReply. */
static void test_limits_reported(void **state)
{
	(void)state;
	nc_conn *conn;
	struct nc_stats stats;
	assert_int_equal(nc_connect(group_daemon.socket, "limits", 5000, &conn), NC_OK);
	assert_int_equal(nc_stats_get(conn, 5000, &stats), NC_OK);
	assert_int_equal(stats.limits.max_regions, MAX_REGIONS);
	assert_int_equal(stats.limits.max_mapped_bytes, MAX_MAPPED);
	assert_int_equal(stats.limits.max_jobs_in_flight, MAX_JOBS);
	assert_int_equal(stats.limits.max_clients, MAX_CLIENTS);
	assert_int_equal(stats.limits.max_output_bytes, MAX_OUTPUT);
	assert_int_equal(stats.limits.max_frame, MAX_FRAME);
	const struct nc_server_info *info = nc_server_info(conn);
	assert_int_equal(info->max_regions, MAX_REGIONS);
	assert_int_equal(info->max_frame, MAX_FRAME);
	nc_close(conn);
}

static void test_limit_regions(void **state)
{
	(void)state;
	uint64_t before[NC_REJECT_COUNT];
	get_rejections(before);
	int fd = raw_open();
	for (uint64_t id = 1; id <= MAX_REGIONS; id++)
		register_expect(fd, id, 4096, 4096, NORMD__STATUS__OK, NULL);
	register_expect(fd, 4, 4096, 4096, NORMD__STATUS__RESOURCE_EXHAUSTED, "max_regions (3)");
	/* The limit is on live regions: one out, one in. */
	unregister_expect(fd, 2, NORMD__STATUS__OK);
	register_expect(fd, 4, 4096, 4096, NORMD__STATUS__OK, NULL);
	close(fd);
	assert_rejected(before, NC_REJECT_LIMIT_REGIONS, 1);
	assert_others_unharmed();
}

static void test_limit_mapped_bytes(void **state)
{
	(void)state;
	uint64_t before[NC_REJECT_COUNT];
	get_rejections(before);
	int fd = raw_open();
	register_expect(fd, 1, 700 * 1024, 700 * 1024, NORMD__STATUS__OK, NULL);
	register_expect(fd, 2, 400 * 1024, 400 * 1024, NORMD__STATUS__RESOURCE_EXHAUSTED,
			"max_mapped_bytes (1048576)");
	/* Refused from the claim alone, before the daemon maps anything. */
	register_expect(fd, 2, 4096, 1ull << 40, NORMD__STATUS__RESOURCE_EXHAUSTED,
			"size 1099511627776");
	/* Exactly up to the limit is fine; one byte more is not. */
	register_expect(fd, 2, 324 * 1024, 324 * 1024, NORMD__STATUS__OK, NULL);
	register_expect(fd, 3, 4096, 1, NORMD__STATUS__RESOURCE_EXHAUSTED, "max_mapped_bytes");
	/* The limit is per connection: another one has its own. */
	int other = raw_open();
	register_expect(other, 1, 700 * 1024, 700 * 1024, NORMD__STATUS__OK, NULL);
	close(other);
	close(fd);
	assert_rejected(before, NC_REJECT_LIMIT_MAPPED_BYTES, 3);
	assert_others_unharmed();
}

/* One LayerNorm forward on region 1 (x at 0, y at 4096). */
static void pack_job(uint64_t id, uint8_t *buf, size_t cap, size_t *len)
{
	Normd__Tensor x = NORMD__TENSOR__INIT, y = NORMD__TENSOR__INIT;
	x.region_id = y.region_id = 1;
	y.has_offset = true;
	y.offset = 4096;
	Normd__Job job = NORMD__JOB__INIT;
	job.op = NORMD__OP__LAYERNORM_FWD;
	job.rows = 4;
	job.cols = 64;
	job.dtype = NORMD__DTYPE__F32;
	job.x = &x;
	job.y = &y;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = id;
	env.body_case = NORMD__ENVELOPE__BODY_JOB;
	env.job = &job;
	assert_int_equal(raw_pack_into(&env, buf, cap, len), 0);
}

/*
 * Three jobs in one write: the daemon handles all three frames in one
 * callback, before any completion can be answered, so the third always
 * finds two in flight.
 */
static void test_limit_jobs_in_flight(void **state)
{
	(void)state;
	uint64_t before[NC_REJECT_COUNT];
	get_rejections(before);
	int fd = raw_open();
	register_expect(fd, 1, 8192, 8192, NORMD__STATUS__OK, NULL);
	for (int round = 0; round < 2; round++) {
		uint8_t buf[1024];
		size_t len = 0;
		for (uint64_t id = 11; id <= 13; id++)
			pack_job(id, buf, sizeof(buf), &len);
		assert_int_equal(raw_write(fd, buf, len), 0);
		bool ok[3] = {false};
		for (int i = 0; i < 3; i++) {
			Normd__Envelope *env = raw_recv(fd, 10000);
			assert_non_null(env);
			uint64_t id = env->request_id;
			assert_true(id >= 11 && id <= 13);
			if (id == 13) {
				assert_int_equal(env->body_case, NORMD__ENVELOPE__BODY_RESULT);
				assert_int_equal(env->result->status,
						 NORMD__STATUS__RESOURCE_EXHAUSTED);
				assert_non_null(strstr(env->result->message,
						       "max_jobs_in_flight (2)"));
			} else {
				assert_int_equal(env->body_case, NORMD__ENVELOPE__BODY_JOB_REPLY);
				assert_int_equal(env->job_reply->status, NORMD__STATUS__OK);
			}
			ok[id - 11] = true;
			nc__envelope_free(env);
		}
		assert_true(ok[0] && ok[1] && ok[2]);
	}
	close(fd);
	assert_rejected(before, NC_REJECT_LIMIT_JOBS_IN_FLIGHT, 2);
	assert_others_unharmed();
}

static void test_limit_clients(void **state)
{
	(void)state;
	uint64_t before[NC_REJECT_COUNT];
	get_rejections(before);
	int fds[MAX_CLIENTS];
	for (int i = 0; i < MAX_CLIENTS; i++)
		fds[i] = raw_open();
	/* One too many: a Result at once, then the close. */
	int extra = raw_connect(group_daemon.socket);
	assert_true(extra >= 0);
	expect_result(extra, 0, NORMD__STATUS__RESOURCE_EXHAUSTED, "max_clients");
	assert_true(raw_closed(extra, 5000));
	close(extra);
	/* The library reports the refusal with the daemon's words. */
	nc_conn *conn = NULL;
	assert_int_equal(nc_connect(group_daemon.socket, "one-too-many", 5000, &conn),
			 NC_ERESOURCE_EXHAUSTED);
	assert_non_null(strstr(nc_last_error(), "max_clients"));
	/* A slot freed is a slot usable again. */
	close_and_wait(fds[0]);
	assert_int_equal(nc_connect(group_daemon.socket, "next", 5000, &conn), NC_OK);
	assert_int_equal(nc_ping(conn, 5000), NC_OK);
	nc_close(conn);
	for (int i = 1; i < MAX_CLIENTS; i++)
		close_and_wait(fds[i]);
	assert_rejected(before, NC_REJECT_LIMIT_CLIENTS, 2);
	assert_others_unharmed();
}

/* A Hello padded so that its frame body is exactly `body` bytes. */
static uint8_t *hello_of_size(size_t body, size_t *len)
{
	static char name[MAX_FRAME * 2];
	memset(name, 'n', sizeof(name) - 1);
	Normd__Hello hello = NORMD__HELLO__INIT;
	hello.protocol_version = NORMD__PROTOCOL_VERSION__PROTOCOL_VERSION;
	hello.client_name = name;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_HELLO;
	env.hello = &hello;
	for (size_t n = body; n > 0; n--) {
		name[n] = '\0';
		if (protobuf_c_message_get_packed_size(&env.base) == body) {
			uint8_t *frame;
			assert_int_equal(nc__frame_pack(&env, UINT32_MAX, &frame, len), 0);
			memset(name, 'n', sizeof(name) - 1);
			return frame;
		}
	}
	fail_msg("no Hello of %zu bytes", body);
	return NULL;
}

/* max_frame is inclusive: a body of exactly max_frame bytes is read, one more is not. */
static void test_frame_size_boundary(void **state)
{
	(void)state;
	uint64_t before[NC_REJECT_COUNT];
	get_rejections(before);
	size_t len;
	uint8_t *frame = hello_of_size(MAX_FRAME, &len);
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_write(fd, frame, len), 0);
	Normd__Envelope *env = raw_recv(fd, 5000);
	assert_non_null(env);
	assert_int_equal(env->body_case, NORMD__ENVELOPE__BODY_HELLO_REPLY);
	nc__envelope_free(env);
	close(fd);
	nc__free(frame);

	frame = hello_of_size(MAX_FRAME + 1, &len);
	fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	/* The header alone is refused; the body is never read. */
	assert_int_equal(raw_write(fd, frame, NC__FRAME_HEADER_BYTES), 0);
	expect_result(fd, 0, NORMD__STATUS__PROTOCOL_ERROR,
		      "frame of 4097 bytes exceeds max_frame 4096");
	assert_true(raw_closed(fd, 5000));
	close(fd);
	nc__free(frame);
	assert_rejected(before, NC_REJECT_FRAME_TOO_LARGE, 1);
	assert_others_unharmed();
}

/* Stats requests, `count` frames, packed back to back. */
static size_t pack_stats(uint8_t *buf, size_t cap, int count)
{
	size_t len = 0;
	Normd__StatsRequest req = NORMD__STATS_REQUEST__INIT;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.body_case = NORMD__ENVELOPE__BODY_STATS;
	env.stats = &req;
	for (int i = 0; i < count; i++) {
		env.request_id = (uint64_t)i + 1;
		assert_int_equal(raw_pack_into(&env, buf, cap, &len), 0);
	}
	return len;
}

/*
 * A client that pipelines many requests and then reads every reply is not
 * a slow client: the replies (far more than max_output_bytes in all) go to
 * the socket as they are made, and only what the socket cannot take counts
 * against the cap.
 */
static void test_pipelining_reader_is_served(void **state)
{
	(void)state;
	enum { REQUESTS = 100 };
	int fd = raw_open();
	static uint8_t buf[REQUESTS * 16];
	size_t len = pack_stats(buf, sizeof(buf), REQUESTS);
	assert_int_equal(raw_write(fd, buf, len), 0);
	size_t reply_bytes = 0;
	for (int i = 0; i < REQUESTS; i++) {
		Normd__Envelope *env = raw_recv(fd, 5000);
		assert_non_null(env);
		assert_int_equal(env->body_case, NORMD__ENVELOPE__BODY_STATS_REPLY);
		assert_int_equal(env->request_id, (uint64_t)i + 1);
		reply_bytes += protobuf_c_message_get_packed_size(&env->base);
		nc__envelope_free(env);
	}
	assert_true(reply_bytes > MAX_OUTPUT * 2);
	close(fd);
	assert_others_unharmed();
}

/*
 * A client that sends requests and never reads a reply: once the socket is
 * full and half of max_output_bytes is queued, the daemon stops reading its
 * requests (backpressure) instead of queueing more; its own writes then
 * stall. It is not dropped, nothing is refused, everyone else is served as
 * before, and once it reads, every reply comes, in order. (Before issue 20
 * the daemon kept reading and dropped it at max_output_bytes.)
 */
static void test_slow_reader_is_paused(void **state)
{
	(void)state;
	enum { BATCH = 500, BATCHES = 200 };
	uint64_t before[NC_REJECT_COUNT];
	get_rejections(before);
	int fd = raw_open();
	int small = 4096;
	assert_int_equal(setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
	static uint8_t buf[BATCH * 16];
	size_t len = pack_stats(buf, sizeof(buf), BATCH);
	size_t written = 0;
	int stalls = 0;
	/* Write without blocking until the daemon has stopped taking requests for a while. */
	while (written < len * BATCHES && stalls < 20) {
		ssize_t n = send(fd, buf + written % len, len - written % len,
				 MSG_DONTWAIT | MSG_NOSIGNAL);
		if (n > 0) {
			written += (size_t)n;
			stalls = 0;
			continue;
		}
		assert_true(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
		stalls++;
		usleep(10000);
	}
	assert_true(written < len * BATCHES);
	assert_others_unharmed();
	/* One reply is due for every whole frame written (ids past 127 take a byte more). */
	size_t due = written / len * BATCH;
	for (size_t at = 0; at + NC__FRAME_HEADER_BYTES <= written % len;) {
		at += NC__FRAME_HEADER_BYTES + nc__frame_length(buf + at);
		if (at <= written % len)
			due++;
	}
	for (size_t i = 0; i < due; i++) {
		Normd__Envelope *env = raw_recv(fd, 5000);
		if (!env)
			fail_msg("reply %zu of %zu did not come", i + 1, due);
		assert_int_equal(env->request_id, (uint64_t)(i % BATCH) + 1);
		nc__envelope_free(env);
	}
	close(fd);
	assert_rejected(before, NC_REJECT_OUTPUT_CAP, 0);
}

/* Reads everything `command` prints into buf; returns its exit status. */
static int capture(const char *command, char *buf, size_t len)
{
	FILE *p = popen(command, "r");
	assert_non_null(p);
	size_t used = 0, n;
	while (used + 1 < len && (n = fread(buf + used, 1, len - 1 - used, p)) > 0)
		used += n;
	buf[used] = '\0';
	return pclose(p);
}

/* normctl stats shows the limits and every refusal above, by reason. */
static void test_normctl_reports_rejections(void **state)
{
	(void)state;
	const char *normctl = getenv("NORMCTL_BIN") ? getenv("NORMCTL_BIN") : "build/bin/normctl";
	char command[512], out[16384];
	snprintf(command, sizeof(command), "%s --socket %s stats", normctl, group_daemon.socket);
	assert_int_equal(capture(command, out, sizeof(out)), 0);
	static const char *const expected[] = {
		"limits           3 clients; per connection: frame 4096 B, 3 regions, 1048576 B mapped, "
		"2 jobs in flight, 4096 B unread replies",
		" limit_regions=1", " limit_mapped_bytes=3", " limit_jobs_in_flight=2",
		" limit_clients=2", " frame_too_large=1",
	};
	for (size_t i = 0; i < sizeof(expected) / sizeof(expected[0]); i++) {
		if (!strstr(out, expected[i]))
			fail_msg("normctl stats lacks \"%s\":\n%s", expected[i], out);
	}
	/* The slow reader above was paused, not dropped: normctl lists only reasons that happened. */
	if (strstr(out, "output_cap"))
		fail_msg("normctl stats counts an output_cap rejection:\n%s", out);
	snprintf(command, sizeof(command), "%s --socket %s stats --json", normctl, group_daemon.socket);
	assert_int_equal(capture(command, out, sizeof(out)), 0);
	assert_non_null(strstr(out, "\"limit_clients\":2"));
	assert_non_null(strstr(out, "\"max_regions\":3"));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_limits_reported),
		cmocka_unit_test(test_limit_regions),
		cmocka_unit_test(test_limit_mapped_bytes),
		cmocka_unit_test(test_limit_jobs_in_flight),
		cmocka_unit_test(test_limit_clients),
		cmocka_unit_test(test_frame_size_boundary),
		cmocka_unit_test(test_pipelining_reader_is_served),
		cmocka_unit_test(test_slow_reader_is_paused),
		cmocka_unit_test(test_normctl_reports_rejections),
	};
	static const char *const extra[] = {
		"--max-regions", "3",	       "--max-mapped-bytes", "1048576",
		"--max-jobs-in-flight", "2",   "--max-clients", "3",
		"--max-output-bytes", "4096",  "--max-frame", "4096",
		"--cpu-workers", "1",	       "--cpu-threads", "1",
		NULL,
	};
	return test_run_group(tests, extra);
}
