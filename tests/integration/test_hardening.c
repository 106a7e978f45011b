/*
 * Every class of bad input that tests/integration/test_bad_input.c does not
 * already cover gets a reply with the right status and a one-line message
 * naming the field and value, and harms nobody else: after every case a
 * well-behaved client's jobs must still match the reference.
 *
 * Most cases speak raw frames (a client library never sends these), on a
 * connection that has registered one memfd region, so that jobs can be
 * broken one field at a time: eps = 0, unknown enum values, missing required
 * fields, fields with the wrong wire type, truncated bodies, and so on.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "proto/frame.h"
#include "tests/support/group.h"

#define REGION_ID 5
#define REGION_BYTES 65536

/* A sealable memfd of `bytes`, optionally sealed against shrinking. */
static int make_memfd(size_t bytes, unsigned flags)
{
	int fd = test_memfd(bytes, flags);
	assert_true(fd >= 0);
	return fd;
}

/* Reads replies until the one for `id`; checks its status and message. */
static void expect_reply(struct raw *r, uint64_t id, Normd__Status status, const char *needle)
{
	Normd__Envelope *env = raw_recv(r->fd, 5000);
	assert_non_null(env);
	assert_int_equal(env->request_id, id);
	Normd__Status got;
	const char *message;
	if (env->body_case == NORMD__ENVELOPE__BODY_JOB_REPLY) {
		got = env->job_reply->status;
		message = env->job_reply->message;
	} else {
		assert_int_equal(env->body_case, NORMD__ENVELOPE__BODY_RESULT);
		got = env->result->status;
		message = env->result->message;
	}
	if (got != status || (needle && (!message || !strstr(message, needle))))
		fprintf(stderr, "request %llu: status %d, message \"%s\"; wanted %d and \"%s\"\n",
			(unsigned long long)id, (int)got, message ? message : "(none)", (int)status,
			needle ? needle : "");
	assert_int_equal(got, status);
	if (status != NORMD__STATUS__OK) {
		assert_non_null(message);
		assert_true(strlen(message) > 0 && !strchr(message, '\n'));
	}
	if (needle)
		assert_non_null(strstr(message, needle));
	nc__envelope_free(env);
}

/* Sends `env` under a fresh request id and checks the reply. */
static void call_expect(struct raw *r, Normd__Envelope *env, Normd__Status status,
			const char *needle)
{
	env->has_request_id = true;
	env->request_id = r->next_id++;
	assert_int_equal(raw_send(r->fd, env), 0);
	expect_reply(r, env->request_id, status, needle);
}

/* Sends a RegisterRegion of `memfd` under request `request` without waiting. */
static void register_send(struct raw *r, uint64_t request, uint64_t id, int memfd,
			  uint64_t size)
{
	Normd__RegisterRegion reg;
	Normd__Envelope env;
	raw_register_init(&env, &reg, request, id, size);
	assert_int_equal(raw_send_with_fd(r->fd, &env, memfd), 0);
}

static void register_region(struct raw *r, uint64_t id, int memfd, uint64_t size,
			    Normd__Status status, const char *needle)
{
	uint64_t request = r->next_id++;
	register_send(r, request, id, memfd, size);
	expect_reply(r, request, status, needle);
}

static void unregister_region(struct raw *r, uint64_t id, Normd__Status status,
			      const char *needle)
{
	Normd__UnregisterRegion unreg = NORMD__UNREGISTER_REGION__INIT;
	unreg.region_id = id;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_UNREGISTER_REGION;
	env.unregister_region = &unreg;
	call_expect(r, &env, status, needle);
}

static void raw_open_with_region(struct raw *r)
{
	assert_int_equal(raw_start(r, group_daemon.socket), 0);
	int memfd = make_memfd(REGION_BYTES, MFD_ALLOW_SEALING);
	register_region(r, REGION_ID, memfd, REGION_BYTES, NORMD__STATUS__OK, NULL);
	close(memfd);
}

/* A valid LayerNorm forward on REGION_ID that the cases break one field at a time. */
struct job_msg {
	Normd__Job job;
	Normd__Tensor x, y;
};

static void job_msg_init(struct job_msg *m)
{
	normd__job__init(&m->job);
	normd__tensor__init(&m->x);
	normd__tensor__init(&m->y);
	m->job.op = NORMD__OP__LAYERNORM_FWD;
	m->job.rows = 8;
	m->job.cols = 64;
	m->job.dtype = NORMD__DTYPE__F32;
	m->x.region_id = m->y.region_id = REGION_ID;
	m->y.has_offset = true;
	m->y.offset = 8192;
	m->job.x = &m->x;
	m->job.y = &m->y;
}

/* An envelope carrying m's job under request `id`. */
static void job_envelope(Normd__Envelope *env, struct job_msg *m, uint64_t id)
{
	normd__envelope__init(env);
	env->has_request_id = true;
	env->request_id = id;
	env->body_case = NORMD__ENVELOPE__BODY_JOB;
	env->job = &m->job;
}

static void job_expect(struct raw *r, struct job_msg *m, Normd__Status status, const char *needle)
{
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_JOB;
	env.job = &m->job;
	call_expect(r, &env, status, needle);
}

/* Sends a frame made of `body` and expects PROTOCOL_ERROR naming `needle`, then a close. */
static void bytes_expect_close(const uint8_t *body, size_t len, bool hello_first,
			       const char *needle)
{
	struct raw r;
	if (hello_first) {
		assert_int_equal(raw_start(&r, group_daemon.socket), 0);
	} else {
		r.fd = raw_connect(group_daemon.socket);
		assert_true(r.fd >= 0);
	}
	uint8_t header[NC__FRAME_HEADER_BYTES] = {(uint8_t)len, (uint8_t)(len >> 8),
						  (uint8_t)(len >> 16), (uint8_t)(len >> 24)};
	assert_int_equal(raw_write(r.fd, header, sizeof(header)), 0);
	if (len)
		assert_int_equal(raw_write(r.fd, body, len), 0);
	expect_reply(&r, 0, NORMD__STATUS__PROTOCOL_ERROR, needle);
	assert_true(raw_closed(r.fd, 5000));
	close(r.fd);
}

/* ---- frames ---------------------------------------------------------------- */

/* A frame whose body is the first half of a valid Job envelope. */
static void test_truncated_body(void **state)
{
	(void)state;
	struct job_msg m;
	job_msg_init(&m);
	Normd__Envelope env;
	job_envelope(&env, &m, 9);
	uint8_t *frame;
	size_t len;
	assert_int_equal(nc__frame_pack(&env, UINT32_MAX, &frame, &len), 0);
	size_t body = (len - NC__FRAME_HEADER_BYTES) / 2;
	bytes_expect_close(frame + NC__FRAME_HEADER_BYTES, body, true, "Envelope.job");
	nc__free(frame);
	assert_others_unharmed();
}

/* A zero-length frame and an envelope with no message in it. */
static void test_empty_envelope(void **state)
{
	(void)state;
	bytes_expect_close(NULL, 0, true, "no message");
	static const uint8_t only_id[] = {0x08, 0x07}; /* request_id = 7, no body */
	bytes_expect_close(only_id, sizeof(only_id), true, "no message");
	assert_others_unharmed();
}

/* Required proto2 fields that are absent fail decoding, named in the reply. */
static void test_missing_required_fields(void **state)
{
	(void)state;
	/* Job {op: 1, cols: 64, dtype: F32}: no rows. */
	static const uint8_t no_rows[] = {0x08, 0x02, 0x7a, 0x06, 0x08, 0x01, 0x18, 0x40, 0x28, 0x01};
	bytes_expect_close(no_rows, sizeof(no_rows), true, "Job is missing required field 'rows'");
	/* Job {op, rows, cols, dtype, x: {offset: 0}}: a tensor without region_id. */
	static const uint8_t no_region[] = {0x08, 0x02, 0x7a, 0x0c, 0x08, 0x01, 0x10, 0x01, 0x18,
					    0x01, 0x28, 0x01, 0x52, 0x02, 0x10, 0x00};
	bytes_expect_close(no_region, sizeof(no_region), true,
			   "Job.x is missing required field 'region_id'");
	/* RegisterRegion {region_id: 1, kind: HOST_MEMFD}: no size. */
	static const uint8_t no_size[] = {0x08, 0x02, 0x62, 0x04, 0x08, 0x01, 0x10, 0x02};
	bytes_expect_close(no_size, sizeof(no_size), true,
			   "RegisterRegion is missing required field 'size'");
	/* Hello {client_name: "a"}: no protocol_version, and Hello comes first. */
	static const uint8_t no_version[] = {0x52, 0x03, 0x12, 0x01, 'a'};
	bytes_expect_close(no_version, sizeof(no_version), false,
			   "Hello is missing required field 'protocol_version'");
	assert_others_unharmed();
}

/* A field sent with the wrong wire type (size as a length-delimited field). */
static void test_wrong_wire_type(void **state)
{
	(void)state;
	static const uint8_t body[] = {0x08, 0x02, 0x62, 0x08, 0x08, 0x01, 0x10,
				       0x02, 0x2a, 0x02, 0x00, 0x00};
	bytes_expect_close(body, sizeof(body), true, "RegisterRegion.size has wire type 2");
	assert_others_unharmed();
}

/* A job before Hello is a protocol violation: error reply, then close. */
static void test_job_before_hello(void **state)
{
	(void)state;
	struct raw r = {.fd = raw_connect(group_daemon.socket), .next_id = 3};
	assert_true(r.fd >= 0);
	struct job_msg m;
	job_msg_init(&m);
	job_expect(&r, &m, NORMD__STATUS__PROTOCOL_ERROR, "first message must be Hello");
	assert_true(raw_closed(r.fd, 5000));
	close(r.fd);
	assert_others_unharmed();
}

/* Hello twice and daemon-to-client messages are refused; the connection stays usable. */
/*
 * Requests sent back to back without waiting: a registration (mapped off the
 * loop), a job naming that region, a second registration under the same id
 * and an unregister. Each must see the one before it done, in order.
 */
static void test_pipelined_registration(void **state)
{
	(void)state;
	struct raw r;
	assert_int_equal(raw_start(&r, group_daemon.socket), 0);
	int memfd = make_memfd(REGION_BYTES, MFD_ALLOW_SEALING);
	register_send(&r, 500, REGION_ID, memfd, REGION_BYTES);
	close(memfd);
	struct job_msg m;
	job_msg_init(&m);
	Normd__Envelope job;
	job_envelope(&job, &m, 501);
	assert_int_equal(raw_send(r.fd, &job), 0);
	Normd__RegisterRegion again = NORMD__REGISTER_REGION__INIT;
	again.region_id = REGION_ID;
	again.kind = NORMD__REGION_KIND__CUDA_IPC;
	again.size = REGION_BYTES;
	Normd__Envelope second = NORMD__ENVELOPE__INIT;
	second.has_request_id = true;
	second.request_id = 502;
	second.body_case = NORMD__ENVELOPE__BODY_REGISTER_REGION;
	second.register_region = &again;
	assert_int_equal(raw_send(r.fd, &second), 0);
	Normd__UnregisterRegion unreg = NORMD__UNREGISTER_REGION__INIT;
	unreg.region_id = REGION_ID;
	Normd__Envelope gone = NORMD__ENVELOPE__INIT;
	gone.has_request_id = true;
	gone.request_id = 503;
	gone.body_case = NORMD__ENVELOPE__BODY_UNREGISTER_REGION;
	gone.unregister_region = &unreg;
	assert_int_equal(raw_send(r.fd, &gone), 0);
	/* A job is answered when it completes, so replies may come in any order. */
	Normd__Status want[4] = {NORMD__STATUS__OK, NORMD__STATUS__OK,
				 NORMD__STATUS__ALREADY_EXISTS, NORMD__STATUS__OK};
	bool seen[4] = {false};
	for (int i = 0; i < 4; i++) {
		Normd__Envelope *env = raw_recv(r.fd, 5000);
		assert_non_null(env);
		assert_true(env->request_id >= 500 && env->request_id <= 503);
		int k = (int)(env->request_id - 500);
		assert_false(seen[k]);
		seen[k] = true;
		Normd__Status got = env->body_case == NORMD__ENVELOPE__BODY_JOB_REPLY
					    ? env->job_reply->status
					    : env->result->status;
		if (got != want[k])
			fprintf(stderr, "request %d: status %d, wanted %d\n", 500 + k, (int)got,
				(int)want[k]);
		assert_int_equal(got, want[k]);
		nc__envelope_free(env);
	}
	close(r.fd);
	assert_others_unharmed();
}

static void test_out_of_order_messages(void **state)
{
	(void)state;
	struct raw r;
	assert_int_equal(raw_start(&r, group_daemon.socket), 0);
	Normd__Hello hello = NORMD__HELLO__INIT;
	hello.protocol_version = NORMD__PROTOCOL_VERSION__PROTOCOL_VERSION;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_HELLO;
	env.hello = &hello;
	call_expect(&r, &env, NORMD__STATUS__PROTOCOL_ERROR, "Hello sent twice");
	Normd__Pong pong = NORMD__PONG__INIT;
	Normd__Envelope env2 = NORMD__ENVELOPE__INIT;
	env2.body_case = NORMD__ENVELOPE__BODY_PONG;
	env2.pong = &pong;
	call_expect(&r, &env2, NORMD__STATUS__PROTOCOL_ERROR, "message type 20");
	Normd__Ping ping;
	Normd__Envelope env3;
	raw_ping_init(&env3, &ping, 77);
	assert_int_equal(raw_send(r.fd, &env3), 0);
	Normd__Envelope *reply = raw_recv(r.fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_PONG);
	assert_int_equal(reply->request_id, 77);
	nc__envelope_free(reply);
	close(r.fd);
	assert_others_unharmed();
}

/* ---- jobs ------------------------------------------------------------------ */

/* Enum fields carry values the protocol does not define, negative ones included. */
static void test_unknown_enum_values(void **state)
{
	(void)state;
	struct raw r;
	raw_open_with_region(&r);
	struct job_msg m;
	job_msg_init(&m);
	job_expect(&r, &m, NORMD__STATUS__OK, NULL); /* the template is valid */
	job_msg_init(&m), m.job.op = (Normd__Op)-1;
	job_expect(&r, &m, NORMD__STATUS__INVALID_ARGUMENT, "op -1");
	job_msg_init(&m), m.job.op = (Normd__Op)(NORMD__OP__WGRAD_ACCUM + 1);
	job_expect(&r, &m, NORMD__STATUS__INVALID_ARGUMENT, "op 6");
	job_msg_init(&m), m.job.op = NORMD__OP__OP_UNSPECIFIED;
	job_expect(&r, &m, NORMD__STATUS__INVALID_ARGUMENT, "op 0");
	job_msg_init(&m), m.job.dtype = (Normd__DType)-7;
	job_expect(&r, &m, NORMD__STATUS__INVALID_ARGUMENT, "dtype -7");
	job_msg_init(&m), m.job.dtype = NORMD__DTYPE__DTYPE_UNSPECIFIED;
	job_expect(&r, &m, NORMD__STATUS__INVALID_ARGUMENT, "dtype 0");
	job_msg_init(&m), m.job.has_weight_dtype = true, m.job.weight_dtype = (Normd__DType)9;
	job_expect(&r, &m, NORMD__STATUS__INVALID_ARGUMENT, "weight_dtype 9");

	Normd__RegisterRegion reg = NORMD__REGISTER_REGION__INIT;
	reg.region_id = 6;
	reg.kind = (Normd__RegionKind)42;
	reg.size = 4096;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_REGISTER_REGION;
	env.register_region = &reg;
	call_expect(&r, &env, NORMD__STATUS__UNSUPPORTED, "region kind 42");
	reg.kind = NORMD__REGION_KIND__REGION_KIND_UNSPECIFIED;
	call_expect(&r, &env, NORMD__STATUS__UNSUPPORTED, "region kind 0");
	close(r.fd);
	assert_others_unharmed();
}

/* eps = 0, -0, -inf and a negative subnormal (the library turns 0 into the default). */
static void test_eps_edges(void **state)
{
	(void)state;
	struct raw r;
	raw_open_with_region(&r);
	static const float bad[] = {0.0f, -0.0f, -INFINITY, -1e-40f};
	struct job_msg m;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		job_msg_init(&m), m.job.has_eps = true, m.job.eps = bad[i];
		job_expect(&r, &m, NORMD__STATUS__INVALID_ARGUMENT, "eps must be positive");
	}
	/* A tiny positive eps is legal. */
	job_msg_init(&m), m.job.has_eps = true, m.job.eps = 1e-30f;
	job_expect(&r, &m, NORMD__STATUS__OK, NULL);
	close(r.fd);
	assert_others_unharmed();
}

/* Products and sums that wrap near 2^64, and bounds at the exact region end. */
static void test_size_overflow(void **state)
{
	(void)state;
	struct raw r;
	raw_open_with_region(&r);
	struct job_msg m;
	/* rows * cols = 2^62 fits, but times 4 bytes does not. */
	job_msg_init(&m), m.job.rows = 1ull << 40, m.job.cols = 1ull << 22;
	job_expect(&r, &m, NORMD__STATUS__OUT_OF_RANGE, "overflows");
	/* rows * cols itself wraps to a small number (2^64 + 2^24). */
	job_msg_init(&m), m.job.rows = (1ull << 40) + 1, m.job.cols = 1ull << 24;
	job_expect(&r, &m, NORMD__STATUS__OUT_OF_RANGE, "overflows (rows 1099511627777");
	job_msg_init(&m), m.job.cols = 1ull << 32;
	job_expect(&r, &m, NORMD__STATUS__OUT_OF_RANGE, "cols 4294967296 exceeds max_cols");
	job_msg_init(&m), m.job.rows = UINT64_MAX / 3, m.job.cols = 3;
	job_expect(&r, &m, NORMD__STATUS__OUT_OF_RANGE, "overflows");
	/* offset + bytes wraps to a small number. */
	job_msg_init(&m), m.x.has_offset = true, m.x.offset = UINT64_MAX - 2047;
	job_expect(&r, &m, NORMD__STATUS__OUT_OF_RANGE, "tensor x: offset 18446744073709549568");
	/* y ends exactly at the region's end: fine; one byte further: refused. */
	job_msg_init(&m), m.y.offset = REGION_BYTES - 8 * 64 * 4;
	job_expect(&r, &m, NORMD__STATUS__OK, NULL);
	job_msg_init(&m), m.y.offset = REGION_BYTES - 8 * 64 * 4 + 1;
	job_expect(&r, &m, NORMD__STATUS__OUT_OF_RANGE, "tensor y");
	/* A [cols] tensor (gamma) past the end. */
	Normd__Tensor gamma = NORMD__TENSOR__INIT;
	gamma.region_id = REGION_ID;
	gamma.has_offset = true;
	gamma.offset = REGION_BYTES - 255;
	job_msg_init(&m), m.job.gamma = &gamma;
	job_expect(&r, &m, NORMD__STATUS__OUT_OF_RANGE, "tensor gamma");
	close(r.fd);
	assert_others_unharmed();
}

/* Dtype pairs the kernels do not implement. */
static void test_dtype_combinations(void **state)
{
	(void)state;
	struct raw r;
	raw_open_with_region(&r);
	static const Normd__DType pairs[][2] = {
		{NORMD__DTYPE__F16, NORMD__DTYPE__BF16},
		{NORMD__DTYPE__BF16, NORMD__DTYPE__F16},
		{NORMD__DTYPE__F32, NORMD__DTYPE__F16},
		{NORMD__DTYPE__F32, NORMD__DTYPE__BF16},
	};
	struct job_msg m;
	for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++) {
		job_msg_init(&m);
		m.job.dtype = pairs[i][0];
		m.job.has_weight_dtype = true;
		m.job.weight_dtype = pairs[i][1];
		job_expect(&r, &m, NORMD__STATUS__UNSUPPORTED, "weight_dtype");
	}
	/* f16 data with f32 weights is apex's mixed mode: accepted. */
	job_msg_init(&m), m.job.dtype = NORMD__DTYPE__F16;
	m.job.has_weight_dtype = true, m.job.weight_dtype = NORMD__DTYPE__F32;
	job_expect(&r, &m, NORMD__STATUS__OK, NULL);
	close(r.fd);
	assert_others_unharmed();
}

/* ---- regions --------------------------------------------------------------- */

/* A region unregistered is gone: jobs and a second unregister name its id. */
static void test_region_already_unregistered(void **state)
{
	(void)state;
	struct raw r;
	raw_open_with_region(&r);
	struct job_msg m;
	job_msg_init(&m);
	job_expect(&r, &m, NORMD__STATUS__OK, NULL);
	unregister_region(&r, REGION_ID, NORMD__STATUS__OK, NULL);
	job_expect(&r, &m, NORMD__STATUS__NOT_FOUND, "region 5 is not registered");
	unregister_region(&r, REGION_ID, NORMD__STATUS__NOT_FOUND, "region 5");
	/* The id can be registered again, and works again. */
	int memfd = make_memfd(REGION_BYTES, MFD_ALLOW_SEALING);
	register_region(&r, REGION_ID, memfd, REGION_BYTES, NORMD__STATUS__OK, NULL);
	close(memfd);
	job_expect(&r, &m, NORMD__STATUS__OK, NULL);
	close(r.fd);
	assert_others_unharmed();
}

/* Region ids: zero, duplicates. */
static void test_region_ids(void **state)
{
	(void)state;
	struct raw r;
	raw_open_with_region(&r);
	int memfd = make_memfd(4096, MFD_ALLOW_SEALING);
	register_region(&r, 0, memfd, 4096, NORMD__STATUS__INVALID_ARGUMENT, "region_id (0)");
	register_region(&r, REGION_ID, memfd, 4096, NORMD__STATUS__ALREADY_EXISTS,
			"region 5 is already registered");
	register_region(&r, 7, memfd, 0, NORMD__STATUS__INVALID_ARGUMENT, "size (0)");
	close(memfd);
	close(r.fd);
	assert_others_unharmed();
}

/* File descriptors that are not usable shared memory. */
static void test_bad_memfds(void **state)
{
	(void)state;
	struct raw r;
	assert_int_equal(raw_start(&r, group_daemon.socket), 0);
	/* A pipe is not a memfd. */
	int pipe_fds[2];
	assert_int_equal(pipe(pipe_fds), 0);
	register_region(&r, 1, pipe_fds[0], 4096, NORMD__STATUS__INVALID_ARGUMENT, "not a memfd");
	close(pipe_fds[0]);
	close(pipe_fds[1]);
	/* A memfd that cannot be sealed could shrink under a running job. */
	int unsealable = make_memfd(4096, 0);
	register_region(&r, 2, unsealable, 4096, NORMD__STATUS__INVALID_ARGUMENT,
			"MFD_ALLOW_SEALING");
	close(unsealable);
	/* A write-sealed memfd cannot be mapped writable. */
	int sealed = make_memfd(4096, MFD_ALLOW_SEALING);
	assert_int_equal(fcntl(sealed, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_WRITE), 0);
	register_region(&r, 3, sealed, 4096, NORMD__STATUS__INVALID_ARGUMENT, "mmap");
	close(sealed);
	/* One byte more than the memfd holds. */
	int small = make_memfd(4096, MFD_ALLOW_SEALING);
	register_region(&r, 4, small, 4097, NORMD__STATUS__OUT_OF_RANGE, "size 4097");
	close(small);
	close(r.fd);
	assert_others_unharmed();
}

/* Sends a Ping (request `request`) with `pass_fd` attached, or none for -1; expects the Pong. */
static void ping_with_fd(struct raw *r, uint64_t request, int pass_fd)
{
	Normd__Ping ping;
	Normd__Envelope env;
	raw_ping_init(&env, &ping, request);
	assert_int_equal(pass_fd >= 0 ? raw_send_with_fd(r->fd, &env, pass_fd) : raw_send(r->fd, &env),
			 0);
	Normd__Envelope *reply = raw_recv(r->fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_PONG);
	assert_int_equal(reply->request_id, request);
	nc__envelope_free(reply);
}

/*
 * An fd belongs to the frame it was sent with. One sent with a Ping is
 * closed by the daemon (it holds no more fds than before), and a later
 * RegisterRegion sent without an fd fails instead of taking it. A
 * registration pipelined right behind such a Ping, in the same write, still
 * gets its own fd and not the stray one.
 */
static void test_stray_fd_closed(void **state)
{
	(void)state;
	struct raw r;
	assert_int_equal(raw_start(&r, group_daemon.socket), 0);
	ping_with_fd(&r, 60, -1);
	int base = test_daemon_fd_count(&group_daemon);
	assert_true(base > 0);
	int stray = make_memfd(4096, MFD_ALLOW_SEALING);
	for (int i = 0; i < 3; i++)
		ping_with_fd(&r, 61 + (uint64_t)i, stray);
	assert_int_equal(test_daemon_fd_count(&group_daemon), base);
	Normd__RegisterRegion reg;
	Normd__Envelope env;
	raw_register_init(&env, &reg, 70, 1, 4096);
	assert_int_equal(raw_send(r.fd, &env), 0);
	expect_reply(&r, 70, NORMD__STATUS__INVALID_ARGUMENT,
		     "HOST_MEMFD region arrived without an fd");
	assert_int_equal(test_daemon_fd_count(&group_daemon), base);
	/* A Ping with the stray fd and the registration with its own fd, back to back. */
	int own = make_memfd(8192, MFD_ALLOW_SEALING);
	Normd__Ping ping;
	Normd__Envelope ping_env;
	raw_ping_init(&ping_env, &ping, 71);
	raw_register_init(&env, &reg, 72, 2, 8192);
	assert_int_equal(raw_send_with_fd(r.fd, &ping_env, stray), 0);
	assert_int_equal(raw_send_with_fd(r.fd, &env, own), 0);
	Normd__Envelope *pong = raw_recv(r.fd, 5000);
	assert_non_null(pong);
	assert_int_equal(pong->body_case, NORMD__ENVELOPE__BODY_PONG);
	nc__envelope_free(pong);
	expect_reply(&r, 72, NORMD__STATUS__OK, NULL);
	/* The 4096-byte stray would have failed the 8192-byte registration; its fd is gone. */
	assert_int_equal(test_daemon_fd_count(&group_daemon), base);
	close(stray);
	close(own);
	close(r.fd);
	assert_others_unharmed();
}

/*
 * CUDA_IPC handles of the wrong length. The CPU backend refuses the kind
 * outright (UNSUPPORTED); the CUDA backend must refuse the length
 * (INVALID_ARGUMENT naming the handle). Either way, never OK.
 */
static void test_cuda_ipc_handle_length(void **state)
{
	(void)state;
	struct raw r;
	assert_int_equal(raw_start(&r, group_daemon.socket), 0);
	uint8_t handle[65] = {0};
	static const size_t lengths[] = {0, 10, 63, 65};
	for (size_t i = 0; i < sizeof(lengths) / sizeof(lengths[0]); i++) {
		Normd__RegisterRegion reg = NORMD__REGISTER_REGION__INIT;
		reg.region_id = 10 + i;
		reg.kind = NORMD__REGION_KIND__CUDA_IPC;
		reg.has_device = true;
		reg.device = 0;
		reg.has_handle = true;
		reg.handle.len = lengths[i];
		reg.handle.data = handle;
		reg.size = 4096;
		Normd__Envelope env = NORMD__ENVELOPE__INIT;
		env.has_request_id = true;
		env.request_id = r.next_id++;
		env.body_case = NORMD__ENVELOPE__BODY_REGISTER_REGION;
		env.register_region = &reg;
		assert_int_equal(raw_send(r.fd, &env), 0);
		Normd__Envelope *reply = raw_recv(r.fd, 5000);
		assert_non_null(reply);
		assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_RESULT);
		Normd__Status status = reply->result->status;
		const char *message = reply->result->message;
		assert_non_null(message);
		if (status == NORMD__STATUS__UNSUPPORTED)
			assert_non_null(strstr(message, "region kind 1"));
		else if (status == NORMD__STATUS__INVALID_ARGUMENT)
			assert_non_null(strstr(message, "handle"));
		else
			fail_msg("handle of %zu bytes: status %d (%s)", lengths[i], (int)status,
				 message);
		nc__envelope_free(reply);
	}
	close(r.fd);
	assert_others_unharmed();
}

/* ---- the rejection counters ------------------------------------------------ */

/* Each refusal above was counted under its reason; normctl stats shows them. */
static void test_rejections_counted(void **state)
{
	(void)state;
	nc_conn *conn;
	struct nc_stats before, after;
	assert_int_equal(nc_connect(group_daemon.socket, "counter", 5000, &conn), NC_OK);
	assert_int_equal(nc_stats_get(conn, 5000, &before), NC_OK);
	struct raw r;
	raw_open_with_region(&r);
	struct job_msg m;
	job_msg_init(&m), m.job.cols = 0;
	job_expect(&r, &m, NORMD__STATUS__INVALID_ARGUMENT, "cols");
	job_msg_init(&m), m.x.region_id = 999;
	job_expect(&r, &m, NORMD__STATUS__NOT_FOUND, "region 999");
	unregister_region(&r, 998, NORMD__STATUS__NOT_FOUND, "region 998");
	int memfd = make_memfd(4096, MFD_ALLOW_SEALING);
	register_region(&r, 0, memfd, 4096, NORMD__STATUS__INVALID_ARGUMENT, "region_id (0)");
	close(memfd);
	close(r.fd);
	static const uint8_t garbage[] = {0xff, 0xff, 0xff};
	bytes_expect_close(garbage, sizeof(garbage), true, NULL);
	static const uint8_t ping[] = {0x9a, 0x01, 0x00}; /* Ping before Hello */
	bytes_expect_close(ping, sizeof(ping), false, "first message must be Hello");
	assert_int_equal(nc_stats_get(conn, 5000, &after), NC_OK);
	static const uint64_t expected[NC_REJECT_COUNT] = {
		[NC_REJECT_BAD_JOB] = 1,    [NC_REJECT_UNKNOWN_REGION] = 2,
		[NC_REJECT_BAD_FRAME] = 1,  [NC_REJECT_BAD_REGION] = 1,
		[NC_REJECT_BEFORE_HELLO] = 1,
	};
	for (int i = 0; i < NC_REJECT_COUNT; i++) {
		if (after.rejections[i] - before.rejections[i] != expected[i])
			fail_msg("rejections[%s]: %llu more, expected %llu more", nc_reject_name(i),
				 (unsigned long long)(after.rejections[i] - before.rejections[i]),
				 (unsigned long long)expected[i]);
	}
	assert_string_equal(nc_reject_name(NC_REJECT_LIMIT_MAPPED_BYTES), "limit_mapped_bytes");
	assert_string_equal(nc_reject_name(NC_REJECT_COUNT), "unknown");
	nc_close(conn);
	assert_others_unharmed();
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_truncated_body),
		cmocka_unit_test(test_empty_envelope),
		cmocka_unit_test(test_missing_required_fields),
		cmocka_unit_test(test_wrong_wire_type),
		cmocka_unit_test(test_job_before_hello),
		cmocka_unit_test(test_out_of_order_messages),
		cmocka_unit_test(test_pipelined_registration),
		cmocka_unit_test(test_unknown_enum_values),
		cmocka_unit_test(test_eps_edges),
		cmocka_unit_test(test_size_overflow),
		cmocka_unit_test(test_dtype_combinations),
		cmocka_unit_test(test_region_already_unregistered),
		cmocka_unit_test(test_region_ids),
		cmocka_unit_test(test_bad_memfds),
		cmocka_unit_test(test_stray_fd_closed),
		cmocka_unit_test(test_cuda_ipc_handle_length),
		cmocka_unit_test(test_rejections_counted),
	};
	return test_run_group(tests, NULL);
}
