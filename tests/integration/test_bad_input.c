/*
 * Bad input gets a clear error reply and harms nobody else. Each case sends
 * something a well-behaved client never would (raw frames, or impossible
 * jobs through the library), checks the status (and, for protocol
 * violations, that the daemon closes that connection), and then checks that
 * a second, well-behaved client still gets correct results.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "proto/frame.h"
#include "tests/support/group.h"

/* Reads the Result the daemon sends and checks its status and message. */
static void expect_result(int fd, Normd__Status status)
{
	Normd__Envelope *env = raw_recv(fd, 5000);
	assert_non_null(env);
	assert_int_equal(env->body_case, NORMD__ENVELOPE__BODY_RESULT);
	assert_int_equal(env->result->status, status);
	assert_non_null(env->result->message);
	assert_true(strlen(env->result->message) > 0);
	nc__envelope_free(env);
}

static void test_garbage_frame(void **state)
{
	(void)state;
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	static const uint8_t garbage[] = {12, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
					  0xff, 0xff, 0xff, 0xff, 0x07, 0x01};
	assert_int_equal(raw_write(fd, garbage, sizeof(garbage)), 0);
	expect_result(fd, NORMD__STATUS__PROTOCOL_ERROR);
	assert_true(raw_closed(fd, 5000));
	close(fd);
	assert_others_unharmed();
}

static void test_frame_over_limit(void **state)
{
	(void)state;
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	/* Announce 1 GiB and send nothing more: refused from the length alone. */
	static const uint8_t header[] = {0x00, 0x00, 0x00, 0x40};
	assert_int_equal(raw_write(fd, header, sizeof(header)), 0);
	expect_result(fd, NORMD__STATUS__PROTOCOL_ERROR);
	assert_true(raw_closed(fd, 5000));
	close(fd);
	assert_others_unharmed();
}

static void test_request_before_hello(void **state)
{
	(void)state;
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	Normd__Ping ping = NORMD__PING__INIT;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_PING;
	env.ping = &ping;
	assert_int_equal(raw_send(fd, &env), 0);
	expect_result(fd, NORMD__STATUS__PROTOCOL_ERROR);
	assert_true(raw_closed(fd, 5000));
	close(fd);
	assert_others_unharmed();
}

static void test_wrong_protocol_version(void **state)
{
	(void)state;
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	Normd__Hello hello = NORMD__HELLO__INIT;
	hello.protocol_version = 999;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_HELLO;
	env.hello = &hello;
	assert_int_equal(raw_send(fd, &env), 0);
	expect_result(fd, NORMD__STATUS__PROTOCOL_ERROR);
	assert_true(raw_closed(fd, 5000));
	close(fd);
	assert_others_unharmed();
}

static void test_register_without_fd(void **state)
{
	(void)state;
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	Normd__RegisterRegion reg = NORMD__REGISTER_REGION__INIT;
	reg.region_id = 1;
	reg.kind = NORMD__REGION_KIND__HOST_MEMFD;
	reg.size = 4096;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = 2;
	env.body_case = NORMD__ENVELOPE__BODY_REGISTER_REGION;
	env.register_region = &reg;
	assert_int_equal(raw_send(fd, &env), 0);
	expect_result(fd, NORMD__STATUS__INVALID_ARGUMENT);
	close(fd);
	assert_others_unharmed();
}

static void test_memfd_smaller_than_claimed(void **state)
{
	(void)state;
	nc_conn *conn;
	assert_int_equal(nc_connect(group_daemon.socket, "liar", 5000, &conn), NC_OK);
	int fd = test_memfd(4096, MFD_ALLOW_SEALING);
	assert_true(fd >= 0);
	nc_region *region = NULL;
	/* The library maps 1 MiB of a 4 KiB memfd; the daemon must refuse it. */
	int rc = nc_region_register_fd(conn, fd, 1 << 20, &region);
	assert_int_equal(rc, NC_EOUT_OF_RANGE);
	assert_non_null(strstr(nc_last_error(), "larger than the memfd"));
	close(fd);
	nc_close(conn);
	assert_others_unharmed();
}

/* A valid job whose fields the cases below break one at a time. */
struct job_case {
	nc_conn *conn;
	struct jobkit kit;
};

static void job_case_open(struct job_case *jc)
{
	assert_int_equal(nc_connect(group_daemon.socket, "bad-jobs", 5000, &jc->conn), NC_OK);
	struct jobkit_spec spec = {.op = NC_LAYERNORM_FWD, .rows = 8, .cols = 64, .dtype = NC_F32,
				   .gamma = true, .beta = true, .seed = 3};
	assert_int_equal(jobkit_create(jc->conn, &spec, &jc->kit), NC_OK);
}

static void expect_job_status(struct job_case *jc, const struct nc_job *job, int status,
			      const char *message_part)
{
	struct nc_job_result result;
	int rc = nc_job_run(jc->conn, job, 5000, &result);
	if (rc != status)
		fprintf(stderr, "expected %s, got %s: %s\n", nc_status_name(status),
			nc_status_name(rc), result.message);
	assert_int_equal(rc, status);
	assert_int_equal(result.status, status);
	if (message_part && !strstr(result.message, message_part)) {
		fprintf(stderr, "message \"%s\" lacks \"%s\"\n", result.message, message_part);
		fail();
	}
}

static void test_bad_jobs(void **state)
{
	(void)state;
	struct job_case jc;
	job_case_open(&jc);
	const struct nc_job good = jc.kit.job;
	struct nc_job job;

	job = good, job.op = (enum nc_op)99;
	expect_job_status(&jc, &job, NC_EINVALID_ARGUMENT, "op 99");
	job = good, job.x.region = 4242;
	expect_job_status(&jc, &job, NC_ENOT_FOUND, "region 4242 is not registered");
	job = good, job.y.offset = nc_region_size(jc.kit.region) - 4;
	expect_job_status(&jc, &job, NC_EOUT_OF_RANGE, "tensor y");
	job = good, job.x.offset = 2; /* f32 elements at a 2-byte offset */
	expect_job_status(&jc, &job, NC_EINVALID_ARGUMENT, "element size");
	job = good, job.x.offset = UINT64_MAX - 16;
	expect_job_status(&jc, &job, NC_EOUT_OF_RANGE, "tensor x");
	job = good, job.gamma.offset = UINT64_MAX;
	expect_job_status(&jc, &job, NC_EOUT_OF_RANGE, "tensor gamma");
	job = good, job.rows = 1ull << 40, job.cols = 1ull << 24;
	expect_job_status(&jc, &job, NC_EOUT_OF_RANGE, "overflows");
	job = good, job.rows = UINT64_MAX;
	expect_job_status(&jc, &job, NC_EOUT_OF_RANGE, NULL);
	job = good, job.cols = 0;
	expect_job_status(&jc, &job, NC_EINVALID_ARGUMENT, "cols");
	job = good, job.rows = 0;
	expect_job_status(&jc, &job, NC_EINVALID_ARGUMENT, "rows");
	job = good, job.eps = -1.0f;
	expect_job_status(&jc, &job, NC_EINVALID_ARGUMENT, "eps");
	job = good, job.eps = NAN;
	expect_job_status(&jc, &job, NC_EINVALID_ARGUMENT, "eps");
	job = good, job.eps = INFINITY;
	expect_job_status(&jc, &job, NC_EINVALID_ARGUMENT, "eps");
	job = good, job.dtype = NC_BF16, job.weight_dtype = NC_F16;
	expect_job_status(&jc, &job, NC_EUNSUPPORTED, "weight_dtype");
	job = good, job.dtype = (enum nc_dtype)17;
	expect_job_status(&jc, &job, NC_EINVALID_ARGUMENT, "dtype 17");
	job = good, job.y.region = 0;
	expect_job_status(&jc, &job, NC_EINVALID_ARGUMENT, "needs tensor y");
	job = good, job.dy = job.x;
	expect_job_status(&jc, &job, NC_EINVALID_ARGUMENT, "tensor dy is not used");
	job = good, job.flags = NC_MEMORY_EFFICIENT;
	expect_job_status(&jc, &job, NC_EINVALID_ARGUMENT, "memory_efficient");

	/* The connection still works after all of that. */
	struct nc_job_result result;
	struct jobkit_report report;
	assert_int_equal(nc_job_run(jc.conn, &good, 5000, &result), NC_OK);
	assert_true(jobkit_check(&jc.kit, &report));
	jobkit_destroy(&jc.kit);
	nc_close(jc.conn);
	assert_others_unharmed();
}

/* Region ids are per connection: another client's id names nothing here. */
static void test_other_clients_region(void **state)
{
	(void)state;
	struct job_case owner, thief;
	job_case_open(&owner);
	assert_int_equal(nc_connect(group_daemon.socket, "thief", 5000, &thief.conn), NC_OK);
	/* The thief names the owner's region id without registering anything. */
	expect_job_status(&thief, &owner.kit.job, NC_ENOT_FOUND, "not registered");
	nc_close(thief.conn);
	jobkit_destroy(&owner.kit);
	nc_close(owner.conn);
	assert_others_unharmed();
}

static void test_unregister_twice(void **state)
{
	(void)state;
	struct job_case jc;
	job_case_open(&jc);
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	Normd__UnregisterRegion unreg = NORMD__UNREGISTER_REGION__INIT;
	unreg.region_id = 77;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = 5;
	env.body_case = NORMD__ENVELOPE__BODY_UNREGISTER_REGION;
	env.unregister_region = &unreg;
	assert_int_equal(raw_send(fd, &env), 0);
	expect_result(fd, NORMD__STATUS__NOT_FOUND);
	close(fd);
	jobkit_destroy(&jc.kit);
	nc_close(jc.conn);
	assert_others_unharmed();
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_garbage_frame),
		cmocka_unit_test(test_frame_over_limit),
		cmocka_unit_test(test_request_before_hello),
		cmocka_unit_test(test_wrong_protocol_version),
		cmocka_unit_test(test_register_without_fd),
		cmocka_unit_test(test_memfd_smaller_than_claimed),
		cmocka_unit_test(test_bad_jobs),
		cmocka_unit_test(test_other_clients_region),
		cmocka_unit_test(test_unregister_twice),
	};
	return test_run_group(tests, NULL);
}
