/*
 * A client may die at any point: halfway through a frame, with a memfd in
 * flight, between registering and using its regions, with jobs running, or
 * right after pipelining requests it will never read. Each time the daemon
 * must release everything the client held (regions, mapped bytes, its
 * connection slot, every file descriptor) once the client's in-flight jobs
 * are done, and keep serving everyone else.
 *
 * "Released" is measured, not assumed: Stats (regions, mapped bytes, clients,
 * jobs in flight) and the daemon's open file descriptors in /proc must come
 * back to the values they had before the client connected.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "proto/frame.h"
#include "tests/support/group.h"

static void sleep_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

/* What a dead client must give back, seen through one fresh connection. */
struct snapshot {
	int fds;
	uint32_t clients, regions, jobs_in_flight;
	uint64_t mapped_bytes;
};

static void take_snapshot(struct snapshot *s)
{
	nc_conn *conn;
	struct nc_stats stats;
	assert_int_equal(nc_connect(group_daemon.socket, "observer", 5000, &conn), NC_OK);
	assert_int_equal(nc_stats_get(conn, 5000, &stats), NC_OK);
	/* The daemon's fds without the observer's own socket. */
	s->fds = test_daemon_fd_count(&group_daemon) - 1;
	s->clients = stats.clients;
	s->regions = stats.regions;
	s->jobs_in_flight = stats.jobs_in_flight;
	s->mapped_bytes = stats.mapped_bytes;
	nc_close(conn);
	/* Let the daemon see the observer go, so that the tests count only their own fds. */
	for (int i = 0; i < 100 && test_daemon_fd_count(&group_daemon) != s->fds; i++)
		sleep_ms(10);
}

static bool snapshot_equal(const struct snapshot *a, const struct snapshot *b)
{
	return a->fds == b->fds && a->clients == b->clients && a->regions == b->regions &&
	       a->jobs_in_flight == b->jobs_in_flight && a->mapped_bytes == b->mapped_bytes;
}

/* Waits (up to 20 s) until the daemon holds what it held in `base`. */
static void assert_back_to(const struct snapshot *base)
{
	struct snapshot now;
	for (int i = 0; i < 400; i++) {
		take_snapshot(&now);
		if (snapshot_equal(&now, base))
			break;
		sleep_ms(50);
	}
	if (!snapshot_equal(&now, base))
		fail_msg("not released: fds %d (was %d), clients %u (%u), regions %u (%u), "
			 "mapped %llu (%llu), jobs %u (%u)",
			 now.fds, base->fds, now.clients, base->clients, now.regions, base->regions,
			 (unsigned long long)now.mapped_bytes, (unsigned long long)base->mapped_bytes,
			 now.jobs_in_flight, base->jobs_in_flight);
	assert_true(test_daemon_alive(&group_daemon));
	assert_true(good_client_works(group_daemon.socket));
}

/* SIGKILLs a client process and reaps it. */
static void kill_child(pid_t pid)
{
	kill(pid, SIGKILL);
	int status;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFSIGNALED(status));
}

static int make_memfd(size_t bytes)
{
	int fd = test_memfd(bytes, MFD_ALLOW_SEALING);
	assert_true(fd >= 0);
	return fd;
}

static uint8_t *register_frame(uint64_t id, uint64_t size, size_t *len)
{
	Normd__RegisterRegion reg;
	Normd__Envelope env;
	raw_register_init(&env, &reg, id, id, size);
	uint8_t *frame;
	assert_int_equal(nc__frame_pack(&env, UINT32_MAX, &frame, len), 0);
	return frame;
}

/* Sends `len` bytes of `bytes` with `fds` attached by SCM_RIGHTS. */
static void send_with_fds(int sock, const void *bytes, size_t len, const int *fds, int count)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * 32)];
		struct cmsghdr align;
	} control;
	memset(&control, 0, sizeof(control));
	struct iovec iov = {.iov_base = (void *)bytes, .iov_len = len};
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
			     .msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)count)};
	struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)count);
	memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)count);
	assert_int_equal(sendmsg(sock, &msg, MSG_NOSIGNAL), (ssize_t)len);
}

/* Half a frame, then gone: the partial frame buffer is freed. */
static void test_dies_mid_frame(void **state)
{
	(void)state;
	struct snapshot base;
	take_snapshot(&base);
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	uint8_t half[4 + 50] = {100, 0, 0, 0};
	memset(half + 4, 0x08, 50);
	assert_int_equal(raw_write(fd, half, sizeof(half)), 0);
	close(fd);
	assert_back_to(&base);
}

/* Half a RegisterRegion frame with its memfd attached: the waiting fd is closed. */
static void test_dies_with_fd_in_flight(void **state)
{
	(void)state;
	struct snapshot base;
	take_snapshot(&base);
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	size_t len;
	uint8_t *frame = register_frame(1, 1 << 20, &len);
	int memfd = make_memfd(1 << 20);
	send_with_fds(fd, frame, len / 2, &memfd, 1);
	close(memfd);
	nc__free(frame);
	/* The daemon holds the fd while it waits for the rest of the frame. */
	for (int i = 0; i < 200 && test_daemon_fd_count(&group_daemon) < base.fds + 2; i++)
		sleep_ms(10);
	assert_int_equal(test_daemon_fd_count(&group_daemon), base.fds + 2); /* socket + memfd */
	close(fd);
	assert_back_to(&base);
}

/* More fds than the FIFO holds, with a Ping: the daemon keeps none of them. */
static void test_fd_flood(void **state)
{
	(void)state;
	enum { FDS = 24 };
	struct snapshot base;
	take_snapshot(&base);
	int sock = raw_connect(group_daemon.socket);
	assert_true(sock >= 0);
	assert_int_equal(raw_hello(sock), 0);
	int fds[FDS];
	for (int i = 0; i < FDS; i++)
		fds[i] = make_memfd(4096);
	Normd__Ping ping;
	Normd__Envelope env;
	raw_ping_init(&env, &ping, 3);
	uint8_t *frame;
	size_t len;
	assert_int_equal(nc__frame_pack(&env, UINT32_MAX, &frame, &len), 0);
	for (int round = 0; round < 3; round++) {
		send_with_fds(sock, frame, len, fds, FDS);
		Normd__Envelope *reply = raw_recv(sock, 5000);
		assert_non_null(reply);
		assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_PONG);
		nc__envelope_free(reply);
		int held = test_daemon_fd_count(&group_daemon) - base.fds;
		/* Its socket only: fds that came with a Ping are closed once it is answered. */
		if (held != 1)
			fail_msg("the daemon holds %d fds for this client", held);
	}
	nc__free(frame);
	for (int i = 0; i < FDS; i++)
		close(fds[i]);
	close(sock);
	assert_back_to(&base);
}

/* Killed while registering: some regions registered, one frame maybe unread. */
static void test_dies_while_registering(void **state)
{
	(void)state;
	struct snapshot base;
	take_snapshot(&base);
	int ready[2];
	assert_int_equal(pipe(ready), 0);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		int sock = raw_connect(group_daemon.socket);
		if (sock < 0 || raw_hello(sock))
			_exit(2);
		for (uint64_t id = 1; id <= 4; id++) {
			size_t len;
			uint8_t *frame = register_frame(id, 1 << 20, &len);
			int memfd = make_memfd(1 << 20);
			send_with_fds(sock, frame, len, &memfd, 1);
			close(memfd);
			nc__free(frame);
			/* Wait for the first two replies only. */
			if (id <= 2) {
				Normd__Envelope *reply = raw_recv(sock, 5000);
				if (!reply || reply->result->status != NORMD__STATUS__OK)
					_exit(3);
				nc__envelope_free(reply);
			}
		}
		if (write(ready[1], "r", 1) != 1)
			_exit(4);
		pause();
		_exit(0);
	}
	close(ready[1]);
	char byte;
	assert_int_equal(read(ready[0], &byte, 1), 1);
	close(ready[0]);
	/* The daemon holds at least the two acknowledged regions. */
	nc_conn *conn;
	struct nc_stats stats;
	assert_int_equal(nc_connect(group_daemon.socket, "observer", 5000, &conn), NC_OK);
	assert_int_equal(nc_stats_get(conn, 5000, &stats), NC_OK);
	assert_true(stats.regions >= base.regions + 2);
	assert_true(stats.mapped_bytes >= base.mapped_bytes + (2u << 20));
	nc_close(conn);
	kill_child(pid);
	assert_back_to(&base);
}

/*
 * Killed with jobs running and queued: the regions those jobs use stay
 * mapped until they finish (no job ever writes to unmapped memory), then
 * everything is released.
 */
static void test_dies_mid_job(void **state)
{
	(void)state;
	struct snapshot base;
	take_snapshot(&base);
	int ready[2];
	assert_int_equal(pipe(ready), 0);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		nc_conn *conn;
		struct jobkit kit;
		struct jobkit_spec spec = {.op = NC_LAYERNORM_BWD, .rows = 1000, .cols = 4096,
					   .dtype = NC_F32, .gamma = true, .beta = true, .seed = 4};
		if (nc_connect(group_daemon.socket, "doomed", 5000, &conn) ||
		    jobkit_create(conn, &spec, &kit))
			_exit(2);
		uint64_t id;
		for (int i = 0; i < 3; i++) {
			if (nc_job_submit(conn, &kit.job, &id))
				_exit(3);
		}
		/* Frames are handled in order: the pong proves the jobs were accepted. */
		if (nc_ping(conn, 5000) || write(ready[1], "r", 1) != 1)
			_exit(4);
		pause();
		_exit(0);
	}
	close(ready[1]);
	char byte;
	assert_int_equal(read(ready[0], &byte, 1), 1);
	close(ready[0]);
	kill_child(pid);
	assert_back_to(&base);
}

/* Requests pipelined, then gone before any reply: replies meet a closed socket. */
static void test_dies_before_reading_replies(void **state)
{
	(void)state;
	struct snapshot base;
	take_snapshot(&base);
	for (int round = 0; round < 5; round++) {
		int sock = raw_connect(group_daemon.socket);
		assert_true(sock >= 0);
		assert_int_equal(raw_hello(sock), 0);
		uint8_t buf[8192];
		size_t len = 0;
		Normd__StatsRequest req = NORMD__STATS_REQUEST__INIT;
		Normd__Envelope env = NORMD__ENVELOPE__INIT;
		env.has_request_id = true;
		env.body_case = NORMD__ENVELOPE__BODY_STATS;
		env.stats = &req;
		for (uint64_t id = 1; id <= 500; id++) {
			env.request_id = id;
			assert_int_equal(raw_pack_into(&env, buf, sizeof(buf), &len), 0);
		}
		assert_int_equal(raw_write(sock, buf, len), 0);
		close(sock);
	}
	assert_back_to(&base);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_dies_mid_frame),
		cmocka_unit_test(test_dies_with_fd_in_flight),
		cmocka_unit_test(test_fd_flood),
		cmocka_unit_test(test_dies_while_registering),
		cmocka_unit_test(test_dies_mid_job),
		cmocka_unit_test(test_dies_before_reading_replies),
	};
	static const char *const extra[] = {"--cpu-workers", "1", "--cpu-threads", "1", NULL};
	return test_run_group(tests, extra);
}
