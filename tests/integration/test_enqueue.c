/*
 * The enqueue mode on the CPU backend (docs/ENQUEUE.md): the same protocol
 * paths as on the GPU, with host semaphore words. Checked here: every op
 * against the float64 reference; a dependent chain on one key runs in
 * order; errors the library can see are synchronous and queue nothing;
 * nc_job_enqueue_device with its pointers absent or unknown to CUDA;
 * an error only the daemon sees releases the key (done written, outputs
 * poisoned) and comes back from a later call; the daemon pauses instead of
 * refusing at max_jobs_in_flight; a silent client (a raw one that never
 * writes its ready word) stalls only itself and is released when it leaves;
 * and when the daemon dies the library releases the waiting key within a
 * second with NC_EDISCONNECTED.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "proto/frame.h"
#include "tests/support/group.h"

static nc_conn *connect_or_fail(const char *socket)
{
	nc_conn *conn = NULL;
	int rc = nc_connect(socket, "test_enqueue", 5000, &conn);
	if (rc)
		fprintf(stderr, "connect: %s\n", nc_last_error());
	assert_int_equal(rc, NC_OK);
	return conn;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Every op x dtype x affine x memory_efficient, enqueued on a few keys, then checked. */
static void test_every_op_matches_reference(void **state)
{
	(void)state;
	nc_conn *conn = connect_or_fail(group_daemon.socket);
	static const enum nc_op ops[] = {NC_LAYERNORM_FWD, NC_LAYERNORM_BWD, NC_RMSNORM_FWD,
					 NC_RMSNORM_BWD};
	static const enum nc_dtype dtypes[] = {NC_F32, NC_F16, NC_BF16};
	static const uint64_t shapes[][2] = {{1, 1}, {5, 33}, {64, 1000}};
	enum { KITS = 4 * 3 * 3 * 3 };
	static struct jobkit kits[KITS];
	int n = 0, seed = 100;
	for (size_t o = 0; o < 4; o++)
		for (size_t d = 0; d < 3; d++)
			for (size_t s = 0; s < 3; s++)
				for (int variant = 0; variant < 3; variant++) {
					struct jobkit_spec spec = {
						.op = ops[o], .rows = shapes[s][0],
						.cols = shapes[s][1], .dtype = dtypes[d],
						.weight_dtype = variant == 2 ? NC_F32 : 0,
						.gamma = variant != 0, .beta = variant != 0,
						.memory_efficient = variant == 2,
						.seed = (uint64_t)seed++,
					};
					assert_int_equal(jobkit_create(conn, &spec, &kits[n]), NC_OK);
					/* Four keys: jobs of one key in order, keys side by side. */
					void *key = (void *)(uintptr_t)(1 + n % 4);
					assert_int_equal(nc_job_enqueue(conn, &kits[n].job, key), NC_OK);
					n++;
				}
	for (uintptr_t key = 1; key <= 4; key++)
		assert_int_equal(nc_stream_wait(conn, (void *)key, 30000), NC_OK);
	int failures = 0;
	for (int i = 0; i < n; i++) {
		struct jobkit_report report;
		if (!jobkit_check(&kits[i], &report)) {
			fprintf(stderr, "kit %d (%s %s %llux%llu): %s\n", i,
				jobkit_op_name(kits[i].spec.op), jobkit_dtype_name(kits[i].spec.dtype),
				(unsigned long long)kits[i].spec.rows,
				(unsigned long long)kits[i].spec.cols, report.detail);
			failures++;
		}
		jobkit_destroy(&kits[i]);
	}
	nc_close(conn);
	assert_int_equal(failures, 0);
}

/*
 * 100 RMSNorm forwards on one key, each reading the previous one's output,
 * enqueued without waiting: the result is the same chain computed here.
 */
static void test_dependent_chain_runs_in_order(void **state)
{
	(void)state;
	enum { ROWS = 3, COLS = 40, STEPS = 100 };
	nc_conn *conn = connect_or_fail(group_daemon.socket);
	nc_region *region;
	size_t bytes = (size_t)(STEPS + 1) * ROWS * COLS * sizeof(float) + COLS * sizeof(float);
	assert_int_equal(nc_region_alloc_host(conn, bytes, &region), NC_OK);
	float *buf = nc_region_data(region);
	float *gamma = buf + (size_t)(STEPS + 1) * ROWS * COLS;
	double expect[ROWS * COLS];
	for (int i = 0; i < ROWS * COLS; i++)
		expect[i] = buf[i] = (float)sin(i * 0.37) + 0.1f * (float)(i % 7);
	for (int c = 0; c < COLS; c++)
		gamma[c] = 0.5f + 0.03f * (float)c;
	for (int step = 0; step < STEPS; step++) {
		float *x = buf + (size_t)step * ROWS * COLS, *y = x + ROWS * COLS;
		struct nc_job job = {
			.op = NC_RMSNORM_FWD, .rows = ROWS, .cols = COLS, .dtype = NC_F32,
			.x = nc_tensor_at(region, x), .y = nc_tensor_at(region, y),
			.gamma = nc_tensor_at(region, gamma),
		};
		assert_int_equal(nc_job_enqueue(conn, &job, NULL), NC_OK);
		for (int r = 0; r < ROWS; r++) {
			double sum = 0;
			for (int c = 0; c < COLS; c++)
				sum += expect[r * COLS + c] * expect[r * COLS + c];
			double rstd = 1.0 / sqrt(sum / COLS + 1e-5);
			for (int c = 0; c < COLS; c++)
				expect[r * COLS + c] *= rstd * gamma[c];
		}
	}
	assert_int_equal(nc_stream_wait(conn, NULL, 30000), NC_OK);
	const float *last = buf + (size_t)STEPS * ROWS * COLS;
	double err = 0, norm = 0;
	for (int i = 0; i < ROWS * COLS; i++) {
		err += (last[i] - expect[i]) * (last[i] - expect[i]);
		norm += expect[i] * expect[i];
	}
	fprintf(stderr, "chain of %d: rel L2 error %.3g\n", STEPS, sqrt(err / norm));
	assert_true(sqrt(err / norm) < 1e-4);
	nc_region_free(region);
	nc_close(conn);
}

/* What the library can check is refused by the call itself, and queues nothing. */
static void test_local_errors_are_synchronous(void **state)
{
	(void)state;
	nc_conn *conn = connect_or_fail(group_daemon.socket);
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_LAYERNORM_FWD, .rows = 4, .cols = 64,
				   .dtype = NC_F32, .gamma = true, .seed = 7};
	assert_int_equal(jobkit_create(conn, &spec, &kit), NC_OK);
	struct nc_job job = kit.job;
	job.x.region = 999;
	assert_int_equal(nc_job_enqueue(conn, &job, NULL), NC_ENOT_FOUND);
	job = kit.job;
	job.y.offset = nc_region_size(kit.region);
	assert_int_equal(nc_job_enqueue(conn, &job, NULL), NC_EOUT_OF_RANGE);
	job = kit.job;
	job.y.region = 0;
	assert_int_equal(nc_job_enqueue(conn, &job, NULL), NC_EINVALID_ARGUMENT);
	job = kit.job;
	job.dy = job.x;
	assert_int_equal(nc_job_enqueue(conn, &job, NULL), NC_EINVALID_ARGUMENT);
	job = kit.job;
	job.flags = NC_MEMORY_EFFICIENT;
	assert_int_equal(nc_job_enqueue(conn, &job, NULL), NC_EINVALID_ARGUMENT);
	job = kit.job;
	job.cols = 0;
	assert_int_equal(nc_job_enqueue(conn, &job, NULL), NC_EINVALID_ARGUMENT);
	job = kit.job;
	job.op = NC_WGRAD_ACCUM;
	assert_int_equal(nc_job_enqueue(conn, &job, NULL), NC_EUNSUPPORTED);
	/* Nothing was sent: the connection has no answer pending and no error to report. */
	assert_int_equal(nc_conn_check(conn, 1000), NC_OK);
	assert_int_equal(nc_job_enqueue(conn, &kit.job, NULL), NC_OK);
	assert_int_equal(nc_stream_wait(conn, NULL, 10000), NC_OK);
	struct jobkit_report report;
	assert_true(jobkit_check(&kit, &report));
	jobkit_destroy(&kit);
	nc_close(conn);
}

/*
 * 400 regions on one connection, every other one freed (and one freed id
 * named on purpose): the library's region index finds each live one through
 * its growth and removals, and refuses the freed ids before sending.
 */
static void test_many_regions_found_after_frees(void **state)
{
	(void)state;
	enum { KITS = 400 };
	nc_conn *conn = connect_or_fail(group_daemon.socket);
	static struct jobkit kits[KITS];
	for (int i = 0; i < KITS; i++) {
		struct jobkit_spec spec = {.op = NC_RMSNORM_FWD, .rows = 2, .cols = 8 + (uint64_t)i % 40,
					   .dtype = NC_F32, .gamma = true, .seed = (uint64_t)i + 1};
		assert_int_equal(jobkit_create(conn, &spec, &kits[i]), NC_OK);
	}
	for (int i = 0; i < KITS; i += 2) {
		struct nc_job job = kits[i].job;
		jobkit_destroy(&kits[i]);
		assert_int_equal(nc_job_enqueue(conn, &job, NULL), NC_ENOT_FOUND);
	}
	for (int i = 1; i < KITS; i += 2)
		assert_int_equal(nc_job_enqueue(conn, &kits[i].job, NULL), NC_OK);
	assert_int_equal(nc_stream_wait(conn, NULL, 30000), NC_OK);
	int failures = 0;
	for (int i = 1; i < KITS; i += 2) {
		struct jobkit_report report;
		failures += !jobkit_check(&kits[i], &report);
		jobkit_destroy(&kits[i]);
	}
	nc_close(conn);
	assert_int_equal(failures, 0);
}

/*
 * nc_job_enqueue_device on the CPU backend: NULL pointers keep the job's own
 * (host) tensors, so the job runs as nc_job_enqueue's would; a pointer the
 * CUDA driver does not know (here a host address, and no driver at all) is
 * refused with the tensor's role in the message, and nothing is queued.
 */
static void test_enqueue_device_pointers(void **state)
{
	(void)state;
	nc_conn *conn = connect_or_fail(group_daemon.socket);
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_RMSNORM_FWD, .rows = 3, .cols = 40,
				   .dtype = NC_F32, .gamma = true, .seed = 11};
	assert_int_equal(jobkit_create(conn, &spec, &kit), NC_OK);
	const void *none[NC_JOB_TENSORS] = {NULL};
	assert_int_equal(nc_job_enqueue_device(NULL, &kit.job, none, NULL), NC_EINVALID_ARGUMENT);
	assert_int_equal(nc_job_enqueue_device(conn, NULL, none, NULL), NC_EINVALID_ARGUMENT);
	assert_int_equal(nc_job_enqueue_device(conn, &kit.job, NULL, NULL), NC_EINVALID_ARGUMENT);
	const void *host[NC_JOB_TENSORS] = {NULL};
	host[4] = nc_region_data(kit.region); /* gamma */
	assert_int_equal(nc_job_enqueue_device(conn, &kit.job, host, NULL), NC_EINVALID_ARGUMENT);
	assert_non_null(strstr(nc_last_error(), "tensor gamma: "));
	assert_int_equal(nc_conn_check(conn, 1000), NC_OK); /* nothing was sent */
	assert_int_equal(nc_job_enqueue_device(conn, &kit.job, none, (void *)5), NC_OK);
	assert_int_equal(nc_stream_wait(conn, (void *)5, 10000), NC_OK);
	struct jobkit_report report;
	assert_true(jobkit_check(&kit, &report));
	jobkit_destroy(&kit);
	nc_close(conn);
}

/*
 * nc_job_enqueue_device_ext with a residual add on the CPU backend: NULL
 * pointers keep the job's and ext's own tensors and the job runs; a variant
 * pointer without ext, or one the CUDA driver does not know, is refused
 * with the tensor's role in the message, and nothing is queued.
 */
static void test_enqueue_device_ext_pointers(void **state)
{
	(void)state;
	nc_conn *conn = connect_or_fail(group_daemon.socket);
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_LAYERNORM_FWD, .rows = 3, .cols = 40,
				   .dtype = NC_F32, .gamma = true, .beta = true,
				   .residual = true, .weight_offset = 1.0f, .seed = 12};
	assert_int_equal(jobkit_create(conn, &spec, &kit), NC_OK);
	const void *ptrs[NC_JOB_ALL_TENSORS] = {NULL};
	ptrs[NC_JOB_TENSORS] = nc_region_data(kit.region); /* residual */
	assert_int_equal(nc_job_enqueue_device_ext(conn, &kit.job, NULL, ptrs, NULL),
			 NC_EINVALID_ARGUMENT);
	assert_non_null(strstr(nc_last_error(), "residual"));
	assert_int_equal(nc_job_enqueue_device_ext(conn, &kit.job, &kit.ext, ptrs, NULL),
			 NC_EINVALID_ARGUMENT);
	assert_non_null(strstr(nc_last_error(), "tensor residual: "));
	assert_int_equal(nc_conn_check(conn, 1000), NC_OK); /* nothing was sent */
	ptrs[NC_JOB_TENSORS] = NULL;
	assert_int_equal(nc_job_enqueue_device_ext(conn, &kit.job, &kit.ext, ptrs, (void *)6),
			 NC_OK);
	assert_int_equal(nc_stream_wait(conn, (void *)6, 10000), NC_OK);
	struct jobkit_report report;
	assert_true(jobkit_check(&kit, &report));
	jobkit_destroy(&kit);
	nc_close(conn);
}

/*
 * A daemon with --max-cols 64 refuses a 128-column job that the library
 * cannot judge: the key is released, the outputs are poisoned, the error
 * comes back from the next call, once, and later jobs run.
 */
static void test_daemon_error_is_asynchronous(void **state)
{
	(void)state;
	struct test_daemon d;
	const char *const extra[] = {"--max-cols", "64", NULL};
	assert_int_equal(test_daemon_start(&d, extra), 0);
	nc_conn *conn = connect_or_fail(d.socket);
	struct jobkit wide, ok;
	struct jobkit_spec spec = {.op = NC_RMSNORM_FWD, .rows = 2, .cols = 128,
				   .dtype = NC_BF16, .gamma = true, .seed = 11};
	assert_int_equal(jobkit_create(conn, &spec, &wide), NC_OK);
	spec.cols = 64;
	assert_int_equal(jobkit_create(conn, &spec, &ok), NC_OK);
	memset(wide.ptr[JK_Y], 0, wide.bytes[JK_Y]);
	assert_int_equal(nc_job_enqueue(conn, &wide.job, NULL), NC_OK);
	/* The key is released although the job failed; the wait reports the error. */
	assert_int_equal(nc_stream_wait(conn, NULL, 10000), NC_EOUT_OF_RANGE);
	assert_non_null(strstr(nc_last_error(), "max_cols"));
	const uint8_t *y = wide.ptr[JK_Y];
	for (size_t i = 0; i < wide.bytes[JK_Y]; i++)
		assert_int_equal(y[i], 0xff); /* NaN in bf16 */
	/* Reported once: the next calls succeed. */
	assert_int_equal(nc_job_enqueue(conn, &ok.job, NULL), NC_OK);
	assert_int_equal(nc_stream_wait(conn, NULL, 10000), NC_OK);
	struct jobkit_report report;
	assert_true(jobkit_check(&ok, &report));
	/* An error pending when enqueue is called comes back from that call, which queues nothing. */
	assert_int_equal(nc_job_enqueue(conn, &wide.job, NULL), NC_OK);
	assert_int_equal(nc_conn_check(conn, 10000) == NC_EOUT_OF_RANGE ? 0 : -1, 0);
	assert_int_equal(nc_job_enqueue(conn, &wide.job, (void *)1), NC_OK);
	for (int i = 0; i < 200; i++) {
		struct timespec ts = {0, 5000000};
		nanosleep(&ts, NULL);
		int rc = nc_job_enqueue(conn, &ok.job, (void *)1);
		if (rc == NC_EOUT_OF_RANGE)
			break;
		assert_int_equal(rc, NC_OK);
		assert_true(i < 199);
	}
	assert_int_equal(nc_stream_wait(conn, (void *)1, 10000), NC_OK);
	jobkit_destroy(&wide);
	jobkit_destroy(&ok);
	nc_close(conn);
	assert_int_equal(test_daemon_stop(&d), 0);
}

/* At max_jobs_in_flight the daemon stops reading instead of refusing: all 300 jobs run. */
static void test_limit_pauses_instead_of_refusing(void **state)
{
	(void)state;
	struct test_daemon d;
	const char *const extra[] = {"--max-jobs-in-flight", "4", NULL};
	assert_int_equal(test_daemon_start(&d, extra), 0);
	nc_conn *conn = connect_or_fail(d.socket);
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_LAYERNORM_FWD, .rows = 64, .cols = 256,
				   .dtype = NC_F16, .gamma = true, .beta = true, .seed = 5};
	assert_int_equal(jobkit_create(conn, &spec, &kit), NC_OK);
	for (int i = 0; i < 300; i++)
		assert_int_equal(nc_job_enqueue(conn, &kit.job, (void *)(uintptr_t)(i % 3)), NC_OK);
	for (uintptr_t key = 0; key < 3; key++)
		assert_int_equal(nc_stream_wait(conn, (void *)key, 30000), NC_OK);
	struct jobkit_report report;
	assert_true(jobkit_check(&kit, &report));
	struct nc_stats stats;
	assert_int_equal(nc_stats_get(conn, 5000, &stats), NC_OK);
	assert_int_equal(stats.rejections[NC_REJECT_LIMIT_JOBS_IN_FLIGHT], 0);
	assert_true(stats.ops[NC_LAYERNORM_FWD].jobs_by_status[0] >= 300);
	jobkit_destroy(&kit);
	nc_close(conn);
	assert_int_equal(test_daemon_stop(&d), 0);
}

/* ---- a raw client that never signals ready ------------------------------------------- */

struct silent_client {
	int fd;
	void *sem;       /* its semaphore slot's memfd mapping */
	void *data;      /* x, y, gamma */
};

static void raw_register(int fd, uint64_t request_id, uint64_t region_id, size_t bytes,
			 void **map)
{
	int memfd = test_memfd(bytes, MFD_ALLOW_SEALING);
	assert_true(memfd >= 0);
	*map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
	assert_true(*map != MAP_FAILED);
	Normd__Envelope env;
	Normd__RegisterRegion reg;
	raw_register_init(&env, &reg, request_id, region_id, bytes);
	assert_int_equal(raw_send_with_fd(fd, &env, memfd), 0);
	close(memfd);
	Normd__Envelope *reply = raw_recv(fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_RESULT);
	assert_int_equal(reply->result->status, NORMD__STATUS__OK);
	nc__envelope_free(reply);
}

/*
 * Sends an RMSNorm forward of 1 x 256 f32 (x at 0, y at 4096 of region 2)
 * as seq 1 of `slot` of region 1; `device` INT32_MIN leaves Enqueue.device out.
 */
static void raw_enqueue(int fd, uint64_t request_id, unsigned slot, int device)
{
	Normd__Tensor tx = NORMD__TENSOR__INIT, ty = NORMD__TENSOR__INIT;
	tx.region_id = ty.region_id = 2;
	ty.has_offset = true;
	ty.offset = 4096;
	Normd__Enqueue enq = NORMD__ENQUEUE__INIT;
	enq.sem_region = 1;
	enq.sem_offset = (uint64_t)slot * 128;
	enq.seq = 1;
	enq.has_device = device != INT32_MIN;
	enq.device = device;
	Normd__Job job = NORMD__JOB__INIT;
	job.op = NORMD__OP__RMSNORM_FWD;
	job.rows = 1;
	job.cols = 256;
	job.dtype = NORMD__DTYPE__F32;
	job.x = &tx;
	job.y = &ty;
	job.enqueue = &enq;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = request_id;
	env.body_case = NORMD__ENVELOPE__BODY_JOB;
	env.job = &job;
	assert_int_equal(raw_send(fd, &env), 0);
}

/* Registers a slot and data, then enqueues an RMSNorm forward whose ready word stays 0. */
static void silent_client_start(struct silent_client *s, const char *socket)
{
	s->fd = raw_connect(socket);
	assert_true(s->fd >= 0);
	assert_int_equal(raw_hello(s->fd), 0);
	raw_register(s->fd, 2, 1, 4096, &s->sem);
	raw_register(s->fd, 3, 2, 65536, &s->data);
	float *x = s->data;
	for (int i = 0; i < 256; i++)
		x[i] = 1.0f + (float)i;
	raw_enqueue(s->fd, 4, 1, INT32_MIN);
}

static uint32_t jobs_in_flight(const char *socket)
{
	nc_conn *conn = connect_or_fail(socket);
	struct nc_stats stats;
	assert_int_equal(nc_stats_get(conn, 5000, &stats), NC_OK);
	nc_close(conn);
	return stats.jobs_in_flight;
}

static _Atomic uint32_t *slot_word(void *sem, size_t offset)
{
	return (_Atomic uint32_t *)((char *)sem + offset);
}

/*
 * The silent client's job waits for its ready word while other clients'
 * jobs (enqueued and synchronous) run; once it signals, its job runs and its
 * done word is written.
 */
static void test_silent_client_stalls_only_itself(void **state)
{
	(void)state;
	struct silent_client s;
	silent_client_start(&s, group_daemon.socket);
	struct timespec pause = {0, 50000000};
	nanosleep(&pause, NULL);
	assert_int_equal(atomic_load(slot_word(s.sem, 128 + 64)), 0);
	assert_true(jobs_in_flight(group_daemon.socket) >= 1);
	/* Everyone else goes on. */
	assert_others_unharmed();
	nc_conn *conn = connect_or_fail(group_daemon.socket);
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_RMSNORM_BWD, .rows = 8, .cols = 96,
				   .dtype = NC_F32, .gamma = true, .seed = 3};
	assert_int_equal(jobkit_create(conn, &spec, &kit), NC_OK);
	assert_int_equal(nc_job_enqueue(conn, &kit.job, NULL), NC_OK);
	assert_int_equal(nc_stream_wait(conn, NULL, 10000), NC_OK);
	struct jobkit_report report;
	assert_true(jobkit_check(&kit, &report));
	jobkit_destroy(&kit);
	nc_close(conn);
	/* Its own job ran nowhere meanwhile. */
	assert_int_equal(atomic_load(slot_word(s.sem, 128 + 64)), 0);
	const float *y = (const float *)((char *)s.data + 4096);
	assert_true(y[0] == 0.0f);
	/* Ready at last: the job runs, done follows, the reply comes. */
	atomic_store(slot_word(s.sem, 128), 1);
	Normd__Envelope *reply = raw_recv(s.fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_JOB_REPLY);
	assert_int_equal(reply->job_reply->status, NORMD__STATUS__OK);
	nc__envelope_free(reply);
	assert_int_equal(atomic_load(slot_word(s.sem, 128 + 64)), 1);
	assert_true(y[0] > 0.0f && isfinite(y[0]));
	close(s.fd);
	munmap(s.sem, 4096);
	munmap(s.data, 65536);
}

/* A silent client that leaves: the daemon lets go of its job and its memory. */
static void test_silent_client_released_when_it_leaves(void **state)
{
	(void)state;
	struct silent_client s;
	silent_client_start(&s, group_daemon.socket);
	struct timespec pause = {0, 50000000};
	nanosleep(&pause, NULL);
	assert_true(jobs_in_flight(group_daemon.socket) >= 1);
	close(s.fd);
	uint32_t left = 1;
	for (int i = 0; i < 200 && left; i++) {
		nanosleep(&pause, NULL);
		left = jobs_in_flight(group_daemon.socket);
	}
	assert_int_equal(left, 0);
	munmap(s.sem, 4096);
	munmap(s.data, 65536);
	assert_others_unharmed();
}

/*
 * A slot's first job that no stream takes (here the 65th slot of one
 * connection) is refused and its done word written: the caller's wait is
 * released although nothing of the slot runs. Enqueue.device, which names a
 * CUDA device, means nothing to the CPU backend and is ignored.
 */
static void test_refused_slot_is_released(void **state)
{
	(void)state;
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	void *sem, *data;
	raw_register(fd, 2, 1, 16384, &sem);
	raw_register(fd, 3, 2, 65536, &data);
	for (int i = 0; i < 256; i++)
		((float *)data)[i] = 0.5f + (float)i;
	for (unsigned k = 0; k < 64; k++)
		raw_enqueue(fd, 100 + k, k, k == 0 ? 3 : INT32_MIN); /* every ready word 0: all wait */
	raw_enqueue(fd, 200, 64, INT32_MIN);
	Normd__Envelope *reply = raw_recv(fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->request_id, 200);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_RESULT);
	assert_int_equal(reply->result->status, NORMD__STATUS__RESOURCE_EXHAUSTED);
	nc__envelope_free(reply);
	assert_int_equal(atomic_load(slot_word(sem, 64 * 128 + 64)), 1);
	/* Slot 0 (device 3 named) runs once its ready word is set. */
	assert_int_equal(atomic_load(slot_word(sem, 64)), 0);
	atomic_store(slot_word(sem, 0), 1);
	reply = raw_recv(fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->request_id, 100);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_JOB_REPLY);
	assert_int_equal(reply->job_reply->status, NORMD__STATUS__OK);
	nc__envelope_free(reply);
	assert_int_equal(atomic_load(slot_word(sem, 64)), 1);
	close(fd);
	munmap(sem, 16384);
	munmap(data, 65536);
	assert_others_unharmed();
}

/*
 * The daemon dies while a key waits: the watcher writes the done word within
 * a second and the calls say NC_EDISCONNECTED.
 */
static void test_daemon_death_releases_within_a_second(void **state)
{
	(void)state;
	struct test_daemon d;
	const char *const extra[] = {"--cpu-workers", "1", "--cpu-threads", "1", NULL};
	assert_int_equal(test_daemon_start(&d, extra), 0);
	nc_conn *conn = connect_or_fail(d.socket);
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_LAYERNORM_BWD, .rows = 512, .cols = 4096,
				   .dtype = NC_F32, .gamma = true, .beta = true, .seed = 9};
	assert_int_equal(jobkit_create(conn, &spec, &kit), NC_OK);
	for (int i = 0; i < 40; i++)
		assert_int_equal(nc_job_enqueue(conn, &kit.job, NULL), NC_OK);
	kill(d.pid, SIGKILL);
	double killed = now_s();
	int rc = nc_stream_wait(conn, NULL, 5000);
	double waited = now_s() - killed;
	fprintf(stderr, "released %.3f s after the kill (%s)\n", waited, nc_status_name(rc));
	assert_int_equal(rc, NC_EDISCONNECTED);
	assert_true(waited < 1.0);
	assert_int_equal(nc_job_enqueue(conn, &kit.job, NULL), NC_EDISCONNECTED);
	jobkit_destroy(&kit);
	nc_close(conn);
	test_daemon_stop(&d);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_every_op_matches_reference),
		cmocka_unit_test(test_dependent_chain_runs_in_order),
		cmocka_unit_test(test_local_errors_are_synchronous),
		cmocka_unit_test(test_many_regions_found_after_frees),
		cmocka_unit_test(test_enqueue_device_pointers),
		cmocka_unit_test(test_enqueue_device_ext_pointers),
		cmocka_unit_test(test_daemon_error_is_asynchronous),
		cmocka_unit_test(test_limit_pauses_instead_of_refusing),
		cmocka_unit_test(test_silent_client_stalls_only_itself),
		cmocka_unit_test(test_silent_client_released_when_it_leaves),
		cmocka_unit_test(test_refused_slot_is_released),
		cmocka_unit_test(test_daemon_death_releases_within_a_second),
	};
	return test_run_group(tests, NULL);
}
