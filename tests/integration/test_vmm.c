/*
 * CUDA_VMM_FD registrations (a VMM region's chunks, one POSIX fd each, in one
 * frame) against a CPU-backend daemon, in raw frames: a well-formed one is
 * refused with UNSUPPORTED and a message naming the CUDA backend; malformed
 * ones (fds and chunk_sizes of different counts, more than NC_VMM_MAX_CHUNKS,
 * a chunk of size 0, sizes that do not add up to size, no chunk_sizes,
 * chunk_sizes on another kind, an fd too many for the FIFO) are refused with
 * INVALID_ARGUMENT naming the problem. After each, the daemon holds no fd it
 * was sent (its /proc/<pid>/fd count is back to where it was), the
 * connection still answers, the refusal is counted under bad_region, and a
 * well-behaved client's jobs are still right. The CUDA backend's import is
 * tests/gpu/test_vmm.c's.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "normclient.h"
#include "proto/frame.h"
#include "tests/support/group.h"

#define CHUNK (2u << 20)
#define MAX_SEND 80 /* fds one test frame may carry: more than the daemon's FIFO */

static void sleep_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
}

/* Waits until the daemon holds `want` fds (it closes refused fds right after the reply). */
static int fd_count_settles(int want)
{
	int now = test_daemon_fd_count(&group_daemon);
	for (int i = 0; i < 200 && now != want; i++) {
		sleep_ms(10);
		now = test_daemon_fd_count(&group_daemon);
	}
	return now;
}

/*
 * Sends RegisterRegion(kind, chunk_sizes, size) with `fd_count` memfds
 * standing in for chunk fds (the CPU backend cannot tell) and checks the
 * reply's status and that its message contains `needle`.
 */
static void register_chunks(struct raw *r, Normd__RegionKind kind, const uint64_t *sizes,
			    size_t n_sizes, uint64_t size, unsigned fd_count, Normd__Status status,
			    const char *needle)
{
	int fds[MAX_SEND];
	assert_true(fd_count <= MAX_SEND);
	for (unsigned i = 0; i < fd_count; i++) {
		fds[i] = test_memfd(4096, MFD_ALLOW_SEALING);
		assert_true(fds[i] >= 0);
	}
	Normd__RegisterRegion reg = NORMD__REGISTER_REGION__INIT;
	reg.region_id = r->next_id;
	reg.kind = kind;
	reg.has_device = true;
	reg.device = 0;
	reg.size = size;
	reg.n_chunk_sizes = n_sizes;
	reg.chunk_sizes = (uint64_t *)sizes;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = r->next_id++;
	env.body_case = NORMD__ENVELOPE__BODY_REGISTER_REGION;
	env.register_region = &reg;
	assert_int_equal(fd_count ? raw_send_with_fds(r->fd, &env, fds, fd_count)
				  : raw_send(r->fd, &env),
			 0);
	/* Ours are copies: the daemon's must be gone once it has answered. */
	for (unsigned i = 0; i < fd_count; i++)
		close(fds[i]);
	Normd__Envelope *reply = raw_recv(r->fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->request_id, env.request_id);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_RESULT);
	const char *message = reply->result->message ? reply->result->message : "";
	if ((Normd__Status)reply->result->status != status || !strstr(message, needle))
		fail_msg("status %d (%s), expected %d with \"%s\"", (int)reply->result->status,
			 message, (int)status, needle);
	nc__envelope_free(reply);
}

/* The connection still answers a Ping after a refusal. */
static void still_answers(struct raw *r)
{
	Normd__Ping ping;
	Normd__Envelope env;
	raw_ping_init(&env, &ping, r->next_id++);
	assert_int_equal(raw_send(r->fd, &env), 0);
	Normd__Envelope *reply = raw_recv(r->fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_PONG);
	nc__envelope_free(reply);
}

/* Runs one refusal on a fresh connection and checks that no fd stayed behind. */
#define REFUSED(kind, sizes, n_sizes, size, fd_count, status, needle)                      \
	do {                                                                               \
		struct raw r;                                                              \
		assert_int_equal(raw_start(&r, group_daemon.socket), 0);                   \
		int base = fd_count_settles(test_daemon_fd_count(&group_daemon));          \
		register_chunks(&r, kind, sizes, n_sizes, size, fd_count, status, needle); \
		still_answers(&r);                                                         \
		int now = fd_count_settles(base);                                          \
		if (now != base)                                                           \
			fail_msg("the daemon holds %d fds, %d before the registration", now,  \
				 base);                                                    \
		close(r.fd);                                                               \
	} while (0)

static uint64_t sizes64[NC_VMM_MAX_CHUNKS + 1];

static int setup_sizes(void **state)
{
	(void)state;
	for (int i = 0; i <= NC_VMM_MAX_CHUNKS; i++)
		sizes64[i] = CHUNK;
	return 0;
}

/* A well-formed registration: the CPU backend has no device memory to map it into. */
static void test_cpu_backend_refuses_vmm(void **state)
{
	(void)state;
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, sizes64, 3, 3ull * CHUNK, 3,
		NORMD__STATUS__UNSUPPORTED, "CUDA_VMM_FD regions (device memory) need the cuda backend");
	/* The largest allowed: 64 chunks, 64 fds in one frame. */
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, sizes64, NC_VMM_MAX_CHUNKS,
		(uint64_t)NC_VMM_MAX_CHUNKS * CHUNK, NC_VMM_MAX_CHUNKS, NORMD__STATUS__UNSUPPORTED,
		"need the cuda backend");
	assert_others_unharmed();
}

/* fds and chunk_sizes of different counts. */
static void test_fd_count_mismatch(void **state)
{
	(void)state;
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, sizes64, 3, 3ull * CHUNK, 2,
		NORMD__STATUS__INVALID_ARGUMENT, "the frame carried 2 fds for 3 chunks");
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, sizes64, 2, 2ull * CHUNK, 3,
		NORMD__STATUS__INVALID_ARGUMENT, "the frame carried 3 fds for 2 chunks");
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, sizes64, 2, 2ull * CHUNK, 0,
		NORMD__STATUS__INVALID_ARGUMENT, "the frame carried 0 fds for 2 chunks");
	assert_others_unharmed();
}

/* More chunks than a region may have, and more fds than the daemon keeps for a frame. */
static void test_too_many_chunks(void **state)
{
	(void)state;
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, sizes64, NC_VMM_MAX_CHUNKS + 1,
		(uint64_t)(NC_VMM_MAX_CHUNKS + 1) * CHUNK, NC_VMM_MAX_CHUNKS + 1,
		NORMD__STATUS__INVALID_ARGUMENT, "1 to 64 chunks, not 65");
	/* 64 chunks but 80 fds: the ones past the FIFO are closed at once, the rest refused. */
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, sizes64, NC_VMM_MAX_CHUNKS,
		(uint64_t)NC_VMM_MAX_CHUNKS * CHUNK, MAX_SEND, NORMD__STATUS__INVALID_ARGUMENT,
		"the frame carried 65 fds for 64 chunks");
	assert_others_unharmed();
}

/* A chunk of size 0, sizes that do not add up, and none at all. */
static void test_bad_chunk_sizes(void **state)
{
	(void)state;
	static const uint64_t zero[] = {CHUNK, 0, CHUNK};
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, zero, 3, 2ull * CHUNK, 3,
		NORMD__STATUS__INVALID_ARGUMENT, "chunk 1 has size 0");
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, sizes64, 2, 3ull * CHUNK, 2,
		NORMD__STATUS__INVALID_ARGUMENT, "is not the sum of the chunk sizes");
	/* A sum that wraps around 2^64 is refused, not taken for a small region. */
	static const uint64_t wrap[] = {UINT64_MAX - 4095, 8192};
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, wrap, 2, 4096, 2,
		NORMD__STATUS__INVALID_ARGUMENT, "chunk 1 has size 8192");
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, NULL, 0, CHUNK, 1,
		NORMD__STATUS__INVALID_ARGUMENT, "1 to 64 chunks, not 0");
	assert_others_unharmed();
}

/* chunk_sizes belong to CUDA_VMM_FD: a memfd registration with them is refused, its fd closed. */
static void test_chunk_sizes_on_other_kinds(void **state)
{
	(void)state;
	REFUSED(NORMD__REGION_KIND__HOST_MEMFD, sizes64, 1, 4096, 1,
		NORMD__STATUS__INVALID_ARGUMENT, "chunk_sizes apply to CUDA_VMM_FD regions only");
	REFUSED(NORMD__REGION_KIND__CUDA_IPC, sizes64, 1, 4096, 0,
		NORMD__STATUS__INVALID_ARGUMENT, "chunk_sizes apply to CUDA_VMM_FD regions only");
	assert_others_unharmed();
}

/*
 * A refused VMM frame's fds never reach the next frame: a memfd registration
 * right behind it, with its own fd, gets that fd and succeeds.
 */
static void test_next_frame_unaffected(void **state)
{
	(void)state;
	struct raw r;
	assert_int_equal(raw_start(&r, group_daemon.socket), 0);
	register_chunks(&r, NORMD__REGION_KIND__CUDA_VMM_FD, sizes64, 2, 2ull * CHUNK, 3,
			NORMD__STATUS__INVALID_ARGUMENT, "3 fds for 2 chunks");
	int memfd = test_memfd(8192, MFD_ALLOW_SEALING);
	assert_true(memfd >= 0);
	Normd__RegisterRegion reg;
	Normd__Envelope env;
	raw_register_init(&env, &reg, r.next_id, 77, 8192);
	assert_int_equal(raw_send_with_fd(r.fd, &env, memfd), 0);
	close(memfd);
	Normd__Envelope *reply = raw_recv(r.fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->result->status, NORMD__STATUS__OK);
	nc__envelope_free(reply);
	close(r.fd);
	assert_others_unharmed();
}

/* Every refusal above was counted under bad_region, and none under another reason. */
static void test_refusals_counted(void **state)
{
	(void)state;
	nc_conn *conn;
	struct nc_stats before, after;
	assert_int_equal(nc_connect(group_daemon.socket, "counter", 5000, &conn), NC_OK);
	assert_int_equal(nc_stats_get(conn, 5000, &before), NC_OK);
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, sizes64, 3, 3ull * CHUNK, 2,
		NORMD__STATUS__INVALID_ARGUMENT, "2 fds for 3 chunks");
	REFUSED(NORMD__REGION_KIND__CUDA_VMM_FD, sizes64, 1, CHUNK, 1,
		NORMD__STATUS__UNSUPPORTED, "cuda backend");
	assert_int_equal(nc_stats_get(conn, 5000, &after), NC_OK);
	for (int i = 0; i < NC_REJECT_COUNT; i++) {
		uint64_t more = after.rejections[i] - before.rejections[i];
		if (more != (i == NC_REJECT_BAD_REGION ? 2u : 0u))
			fail_msg("rejections[%s]: %llu more", nc_reject_name(i),
				 (unsigned long long)more);
	}
	assert_int_equal(after.regions, before.regions);
	nc_close(conn);
}

/* The library refuses what it cannot describe here (no CUDA driver) without sending anything. */
static void test_library_without_driver(void **state)
{
	(void)state;
	nc_conn *conn;
	assert_int_equal(nc_connect(group_daemon.socket, "no-gpu", 5000, &conn), NC_OK);
	static char host[4096];
	struct nc_tensor t = {9, 9};
	nc_region *region = NULL;
	int rc = nc_tensor_device_range(conn, host, sizeof(host), &t);
	assert_true(rc == NC_EINVALID_ARGUMENT || rc == NC_EUNSUPPORTED);
	rc = nc_region_register_device_range(conn, host, sizeof(host), &region);
	assert_true(rc == NC_EINVALID_ARGUMENT || rc == NC_EUNSUPPORTED);
	assert_null(region);
	assert_int_equal(nc_tensor_device_range(conn, NULL, 16, &t), NC_OK);
	assert_int_equal(t.region, 0);
	assert_int_equal(nc_ping(conn, 5000), NC_OK);
	nc_close(conn);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup(test_cpu_backend_refuses_vmm, setup_sizes),
		cmocka_unit_test_setup(test_fd_count_mismatch, setup_sizes),
		cmocka_unit_test_setup(test_too_many_chunks, setup_sizes),
		cmocka_unit_test_setup(test_bad_chunk_sizes, setup_sizes),
		cmocka_unit_test_setup(test_chunk_sizes_on_other_kinds, setup_sizes),
		cmocka_unit_test_setup(test_next_frame_unaffected, setup_sizes),
		cmocka_unit_test_setup(test_refusals_counted, setup_sizes),
		cmocka_unit_test(test_library_without_driver),
	};
	return test_run_group(tests, NULL);
}
