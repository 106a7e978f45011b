/*
 * Several GPUs behind one daemon (issue 4), run by `make test-gpu` on a
 * machine with two or more (with fewer it says it is skipped and passes):
 *
 *  - normd --device all describes every GPU as CUDA does (index, UUID,
 *    name, SMs, memory; indexes and UUIDs distinct), in the HelloReply and
 *    in nc_server_info;
 *  - on each device, every op against the float64 reference, the reply
 *    naming its variant; the daemon's per-device counters show the jobs ran
 *    on the device their memory is on and nowhere else;
 *  - every device at once, a client process per device;
 *  - a job whose tensors are on two devices is refused (INVALID_ARGUMENT,
 *    naming devices), and the same job on one device runs;
 *  - the enqueue mode (issue 21): every op enqueued on each device's
 *    streams against the float64 reference, on each device alone, on every
 *    device at once from a process each, and from one process enqueueing
 *    on every device in turn;
 *  - the clients' regions are released and the daemon exits 0 on SIGTERM;
 *  - the variant cache keeps one entry per GPU UUID: an autotuned choice of
 *    the same key on each device, persisted to each GPU's own file and
 *    read back from it by the next daemon;
 *  - the daemon SIGKILLed while a client on each GPU has a long enqueued
 *    chain: every client's stream is released within a second;
 *  - normd --device 0,1 serves both; an ordinal past the last GPU makes
 *    the daemon exit with an error at start.
 *
 * As in test_ipc, every CUDA call happens in a child process.
 */
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "kernels/norm_kernels.h"
#include "normclient.h"
#include "proto/frame.h"
#include "tests/gpu/gpu_test.h"
#include "tests/support/enqueue_chain.h"
#include "tests/support/testlib.h"

enum {
	MAX_GPUS = 16,                 /* nc_server_info lists 16 devices at most */
	EVERY_OP_JOBS = 4 * 3 * 3 * 3, /* ops x dtypes x shapes x kinds of weights */
	AT_ONCE_JOBS = 48,             /* per device, every device at once */
	ENQUEUE_BATCH = 12,            /* enqueued jobs per device between stream waits */
};

/* What CUDA itself says about each GPU, read in a child process. */
struct gpu_list {
	int count;
	struct gpu_desc {
		uint8_t uuid[16];
		char name[256];
		int sm_count;
		size_t total_memory;
	} gpu[MAX_GPUS];
};

/* What a client process works on: a daemon's socket, a device (-1: every one), how many jobs. */
struct target {
	const char *socket;
	int device;
	int jobs;
};

static struct test_daemon daemon_; /* normd --device all */
static struct gpu_list gpus;

static bool cuda_ok(cudaError_t err, const char *what)
{
	if (err != cudaSuccess)
		fprintf(stderr, "  %s: %s\n", what, cudaGetErrorString(err));
	return err == cudaSuccess;
}

/* Child: writes CUDA's struct gpu_list to fd. */
static int list_gpus_child(int fd, void *arg)
{
	(void)arg;
	struct gpu_list list;
	memset(&list, 0, sizeof(list));
	cudaError_t err = cudaGetDeviceCount(&list.count);
	if (err == cudaErrorNoDevice)
		list.count = 0; /* skipped, as with one GPU */
	else if (!cuda_ok(err, "cudaGetDeviceCount"))
		return 1;
	for (int i = 0; i < list.count && i < MAX_GPUS; i++) {
		struct cudaDeviceProp prop;
		if (!cuda_ok(cudaGetDeviceProperties(&prop, i), "cudaGetDeviceProperties"))
			return 1;
		struct gpu_desc *g = &list.gpu[i];
		memcpy(g->uuid, prop.uuid.bytes, sizeof(g->uuid));
		snprintf(g->name, sizeof(g->name), "%s", prop.name);
		g->sm_count = prop.multiProcessorCount;
		g->total_memory = prop.totalGlobalMem;
	}
	return write(fd, &list, sizeof(list)) == (ssize_t)sizeof(list) ? 0 : 1;
}

/* ---- the device list --------------------------------------------------------------------- */

/* One device of the HelloReply against what CUDA says about the same ordinal. */
static int device_described(const Normd__Device *d)
{
	CHECK(d->index >= 0 && d->index < gpus.count, "a device with index %d", d->index);
	CHECK(d->has_uuid && d->uuid.len == 16 && d->name && d->name[0] && d->has_sm_count &&
		      d->sm_count > 0 && d->has_total_memory && d->total_memory > 0,
	      "device %d is described incompletely", d->index);
	const struct gpu_desc *g = &gpus.gpu[d->index];
	printf("  device %d: %s, %u SMs, %llu MiB\n", d->index, d->name, d->sm_count,
	       (unsigned long long)(d->total_memory >> 20));
	CHECK(memcmp(d->uuid.data, g->uuid, 16) == 0, "device %d: not the UUID CUDA reports",
	      d->index);
	CHECK(strncmp(d->name, g->name, 127) == 0 && d->sm_count == (uint32_t)g->sm_count &&
		      d->total_memory == g->total_memory,
	      "device %d: CUDA reports %s, %d SMs, %zu bytes", d->index, g->name, g->sm_count,
	      g->total_memory);
	return 0;
}

static int hello_lists_every_gpu(const Normd__HelloReply *h)
{
	CHECK(h->has_backend && h->backend == NORMD__BACKEND_KIND__BACKEND_CUDA, "backend %d",
	      (int)h->backend);
	CHECK(h->n_devices == (size_t)gpus.count, "%zu devices listed; CUDA sees %d",
	      h->n_devices, gpus.count);
	for (size_t i = 0; i < h->n_devices; i++) {
		const Normd__Device *d = h->devices[i];
		CHECK(device_described(d) == 0, "device %zu of the list", i);
		for (size_t j = 0; j < i; j++)
			CHECK(h->devices[j]->index != d->index &&
				      memcmp(h->devices[j]->uuid.data, d->uuid.data, 16) != 0,
			      "devices %zu and %zu share an index or a UUID", j, i);
	}
	return 0;
}

/* nc_server_info of a new connection lists exactly `want` (count ordinals). */
static int server_info_lists(const char *socket_path, const int *want, int count)
{
	nc_conn *conn = gpu_test_connect(socket_path, "device-list");
	CHECK(conn, "no connection");
	const struct nc_server_info *info = nc_server_info(conn);
	bool same = strcmp(info->backend, "cuda") == 0 && info->device_count == (uint32_t)count;
	for (int i = 0; same && i < count; i++)
		same = info->device_index[i] == want[i];
	nc_close(conn);
	CHECK(same, "nc_server_info does not list the %d devices served", count);
	return 0;
}

static int devices_listed(void)
{
	int fd = raw_connect(daemon_.socket);
	CHECK(fd >= 0, "cannot connect to %s", daemon_.socket);
	Normd__Envelope *env = raw_hello_reply(fd);
	close(fd);
	CHECK(env, "no HelloReply");
	int rc = hello_lists_every_gpu(env->hello_reply);
	nc__envelope_free(env);
	CHECK(rc == 0, "the HelloReply does not describe every GPU");
	int ordinals[MAX_GPUS];
	for (int i = 0; i < gpus.count; i++)
		ordinals[i] = i;
	return server_info_lists(daemon_.socket, ordinals, gpus.count);
}

/* ---- where jobs ran ---------------------------------------------------------------------- */

/* Jobs that ran on each device (by CUDA ordinal) since the daemon started; 0 or -1. */
static int device_job_counts(uint64_t counts[MAX_GPUS])
{
	struct nc_stats s;
	if (gpu_test_stats(daemon_.socket, &s) != 0)
		return -1;
	memset(counts, 0, MAX_GPUS * sizeof(counts[0]));
	for (uint32_t i = 0; i < s.device_count && i < NC_STATS_DEVICES; i++) {
		const struct nc_device_stats *d = &s.devices[i];
		if (d->index >= 0 && d->index < MAX_GPUS)
			counts[d->index] = d->jobs_ok + d->jobs_failed;
	}
	return 0;
}

/*
 * Checks that since `before`, expected[d] jobs ran on each device d: no more,
 * no fewer. An enqueued job counts once the daemon's loop retires it, which
 * may be a moment after the caller's stream saw it done: up to 5 s to settle.
 */
static int jobs_ran_where_expected(const uint64_t before[MAX_GPUS], const int expected[MAX_GPUS])
{
	uint64_t after[MAX_GPUS];
	for (int tries = 0;; tries++) {
		CHECK(device_job_counts(after) == 0, "no stats");
		bool settled = true;
		for (int d = 0; d < gpus.count; d++) {
			uint64_t ran = after[d] - before[d];
			CHECK(ran <= (uint64_t)expected[d], "device %d ran %llu jobs, not %d", d,
			      (unsigned long long)ran, expected[d]);
			settled &= ran == (uint64_t)expected[d];
		}
		if (settled)
			return 0;
		CHECK(tries < 100, "device job counts did not reach the expected ones in 5 s");
		usleep(50 * 1000);
	}
}

/* ---- jobs on each device ----------------------------------------------------------------- */

/* The i-th of EVERY_OP_JOBS: 4 ops x 3 dtypes x 3 shapes x (no weights, f32 weights, me). */
static struct jobkit_spec every_op_spec(int i, int device)
{
	static const uint64_t shapes[3][2] = {{1, 1}, {37, 1000}, {6, 8192}};
	int shape = i / 12 % 3, weights = i / 36 % 3;
	return (struct jobkit_spec){
		.op = (enum nc_op)(1 + i % 4),
		.rows = shapes[shape][0],
		.cols = shapes[shape][1],
		.dtype = (enum nc_dtype)(1 + i / 4 % 3),
		.weight_dtype = weights == 1 ? NC_F32 : 0,
		.gamma = weights != 0,
		.beta = weights != 0,
		.memory_efficient = weights == 2, /* jobkit drops it for the forward ops */
		.seed = (uint64_t)(1000 * device + i + 1),
		.on_device = true,
		.device = device,
	};
}

/* One job on `device` whose reply names its variant, listed in that device's cache. */
static int variant_named(nc_conn *conn, int device)
{
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_LAYERNORM_FWD, .rows = 64, .cols = 3072,
				   .dtype = NC_BF16, .gamma = true, .beta = true, .seed = 77,
				   .on_device = true, .device = device};
	struct nc_job_result r = {0};
	struct jobkit_report rep = {0};
	CHECK(jobkit_create(conn, &spec, &kit) == 0, "set-up: %s", nc_last_error());
	int rc = nc_job_run(conn, &kit.job, 30000, &r);
	bool right = rc == NC_OK && jobkit_check(&kit, &rep);
	jobkit_destroy(&kit);
	CHECK(right, "%s (%s) %s", nc_status_name(rc), r.message, rep.detail);
	printf("  device %d: reply variant %s\n", device, r.variant);
	CHECK(r.variant[0] != '\0', "the reply names no variant");
	struct nc_variant_info *list;
	size_t n;
	CHECK(nc_variants_get(conn, 10000, &list, &n) == NC_OK, "variants: %s", nc_last_error());
	bool listed = false;
	for (size_t i = 0; i < n; i++)
		listed |= list[i].device == device && list[i].op == NC_LAYERNORM_FWD &&
			  list[i].cols == 3072 && list[i].uses > 0;
	nc_variants_free(list);
	CHECK(listed, "device %d's variant cache does not list the job's key", device);
	return 0;
}

/* Child: every op on t->device, each against the reference, then variant_named. */
static int every_op_on(void *arg)
{
	const struct target *t = arg;
	nc_conn *conn = gpu_test_connect(t->socket, "every-op");
	CHECK(conn, "no connection");
	int bad = 0;
	for (int i = 0; i < EVERY_OP_JOBS; i++) {
		struct jobkit_spec spec = every_op_spec(i, t->device);
		bad += test_run_checked(conn, &spec, 30000) != 0;
	}
	int named = variant_named(conn, t->device);
	nc_close(conn);
	CHECK(bad == 0, "%d of %d jobs wrong on device %d", bad, EVERY_OP_JOBS, t->device);
	CHECK(named == 0, "device %d: no variant named", t->device);
	return 0;
}

/*
 * Runs client() in a child on `device` (-1: every device) with `jobs` jobs,
 * then checks that `ran` jobs ran on each device it named and none elsewhere.
 */
static int ran_where_asked(int (*client)(void *), int device, int jobs, int ran)
{
	uint64_t before[MAX_GPUS];
	int expected[MAX_GPUS] = {0};
	CHECK(device_job_counts(before) == 0, "no stats");
	struct target t = {.socket = daemon_.socket, .device = device, .jobs = jobs};
	CHECK(in_child(client, &t) == 0, "jobs on device %d failed", device);
	for (int d = 0; d < gpus.count; d++)
		expected[d] = device < 0 || d == device ? ran : 0;
	return jobs_ran_where_expected(before, expected);
}

/* Child: t->jobs jobs on t->device, of every op, dtype and several widths, each checked. */
static int jobs_on(void *arg)
{
	const struct target *t = arg;
	nc_conn *conn = gpu_test_connect(t->socket, "jobs-on");
	CHECK(conn, "no connection");
	int bad = 0;
	for (int i = 0; i < t->jobs; i++) {
		struct jobkit_spec spec = {
			.op = (enum nc_op)(1 + i % 4), .rows = 512 + 64 * (uint64_t)t->device,
			.cols = 1024 * (uint64_t)(1 + i % 5), .dtype = (enum nc_dtype)(1 + i / 4 % 3),
			.gamma = true, .beta = true, .memory_efficient = i / 12 % 2,
			.seed = (uint64_t)(7000 + 100 * t->device + i), .on_device = true,
			.device = t->device,
		};
		bad += test_run_checked(conn, &spec, 30000) != 0;
	}
	nc_close(conn);
	CHECK(bad == 0, "%d of %d jobs wrong on device %d", bad, t->jobs, t->device);
	return 0;
}

/* A client process per device, all at once, each running client() on `jobs` jobs. */
static int every_device_at_once(int (*client)(void *), int jobs)
{
	uint64_t before[MAX_GPUS];
	int expected[MAX_GPUS] = {0};
	struct target t[MAX_GPUS];
	pid_t pids[MAX_GPUS];
	CHECK(device_job_counts(before) == 0, "no stats");
	fflush(NULL);
	for (int d = 0; d < gpus.count; d++) {
		t[d] = (struct target){.socket = daemon_.socket, .device = d, .jobs = jobs};
		expected[d] = jobs;
		pids[d] = fork();
		if (pids[d] == 0)
			child_exit(client(&t[d]));
	}
	int bad = 0;
	for (int d = 0; d < gpus.count; d++) {
		int status = 0;
		bad += pids[d] < 0 || waitpid(pids[d], &status, 0) != pids[d] ||
		       !WIFEXITED(status) || WEXITSTATUS(status) != 0;
	}
	CHECK(bad == 0, "%d of %d client processes failed", bad, gpus.count);
	return jobs_ran_where_expected(before, expected);
}

/* ---- the enqueue mode -------------------------------------------------------------------- */

/* One batch: n jobs per device of every_op_spec from `first`, enqueued in turn; the bad ones. */
static int enqueue_batch(nc_conn *conn, const cudaStream_t *streams, int lo, int hi, int first,
			 int n)
{
	struct jobkit kits[MAX_GPUS][ENQUEUE_BATCH];
	bool made[MAX_GPUS][ENQUEUE_BATCH] = {{false}};
	int bad = 0;
	for (int d = lo; d <= hi; d++)
		for (int i = 0; i < n; i++) {
			struct jobkit_spec spec = every_op_spec((first + i) % EVERY_OP_JOBS, d);
			made[d][i] = jobkit_create(conn, &spec, &kits[d][i]) == 0;
			if (!made[d][i])
				fprintf(stderr, "  set-up on device %d: %s\n", d, nc_last_error());
			bad += !made[d][i];
		}
	/* Device by device in turn: one connection's jobs on every GPU interleaved. */
	for (int i = 0; i < n; i++)
		for (int d = lo; d <= hi; d++) {
			const struct nc_job *job = &kits[d][i].job;
			int rc = made[d][i] ? nc_job_enqueue(conn, job, streams[d]) : NC_OK;
			if (rc != NC_OK)
				fprintf(stderr, "  enqueue on device %d: %s (%s)\n", d,
					nc_status_name(rc), nc_last_error());
			bad += rc != NC_OK;
		}
	for (int d = lo; d <= hi; d++) {
		cudaError_t err = cudaSetDevice(d);
		err = err == cudaSuccess ? cudaStreamSynchronize(streams[d]) : err;
		bad += !cuda_ok(err, "cudaStreamSynchronize");
	}
	int rc = nc_conn_check(conn, 30000);
	if (rc != NC_OK)
		fprintf(stderr, "  nc_conn_check: %s (%s)\n", nc_status_name(rc), nc_last_error());
	bad += rc != NC_OK;
	for (int d = lo; d <= hi; d++)
		for (int i = 0; i < n; i++) {
			struct jobkit_report rep = {0};
			if (made[d][i] && !jobkit_check(&kits[d][i], &rep)) {
				fprintf(stderr, "  device %d, job %d: %s\n", d, first + i,
					rep.detail);
				bad++;
			}
			if (made[d][i])
				jobkit_destroy(&kits[d][i]);
		}
	return bad;
}

/*
 * Child: t->jobs jobs of every op on t->device (-1: on every device, one
 * connection enqueueing on a stream of each), in batches, each job checked.
 */
static int enqueued_on(void *arg)
{
	const struct target *t = arg;
	int lo = t->device < 0 ? 0 : t->device, hi = t->device < 0 ? gpus.count - 1 : t->device;
	cudaStream_t streams[MAX_GPUS];
	for (int d = lo; d <= hi; d++)
		CHECK(cuda_ok(cudaSetDevice(d), "cudaSetDevice") &&
			      cuda_ok(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking),
				      "cudaStreamCreateWithFlags"),
		      "a stream on device %d", d);
	nc_conn *conn = gpu_test_connect(t->socket, "enqueue");
	CHECK(conn, "no connection");
	int bad = 0;
	for (int first = 0; first < t->jobs; first += ENQUEUE_BATCH) {
		int n = t->jobs - first < ENQUEUE_BATCH ? t->jobs - first : ENQUEUE_BATCH;
		bad += enqueue_batch(conn, streams, lo, hi, first, n);
	}
	nc_close(conn);
	CHECK(bad == 0, "%d of %d enqueued jobs (or their streams) wrong on device %d", bad,
	      t->jobs * (hi - lo + 1), t->device);
	return 0;
}

/* ---- a job across devices ---------------------------------------------------------------- */

/* Zeroed cudaMalloc memory on `device`, which becomes the current one; NULL on failure. */
static char *zeroed_on(int device, size_t bytes)
{
	void *p = NULL;
	if (!cuda_ok(cudaSetDevice(device), "cudaSetDevice") ||
	    !cuda_ok(cudaMalloc(&p, bytes), "cudaMalloc"))
		return NULL;
	if (!cuda_ok(cudaMemset(p, 0, bytes), "cudaMemset") ||
	    !cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize")) {
		cuda_ok(cudaFree(p), "cudaFree");
		return NULL;
	}
	return p;
}

static int refused_across_devices(nc_conn *conn, const struct nc_job *job, const char *what)
{
	struct nc_job_result r = {0};
	int rc = nc_job_run(conn, job, 10000, &r);
	printf("  %s: %s: %s\n", what, nc_status_name(rc), r.message);
	CHECK(rc == NC_EINVALID_ARGUMENT, "%s gave %s", what, nc_status_name(rc));
	CHECK(strstr(r.message, "device") != NULL, "%s: the message names no device", what);
	return 0;
}

/*
 * Child: x on device 0 with y on device 1, then x and y on device 0 with
 * gamma on device 1, are refused; the job with x and y on device 0 runs.
 */
static int mixed_devices(void *arg)
{
	enum { ROWS = 4, COLS = 256, BYTES = ROWS * COLS * 4 };
	char *on0 = zeroed_on(0, 2 * BYTES), *on1 = zeroed_on(1, 2 * BYTES);
	CHECK(on0 && on1, "CUDA set-up");
	nc_conn *conn = gpu_test_connect(arg, "mixed");
	CHECK(conn, "no connection");
	struct nc_tensor x0, y0, y1, gamma1;
	CHECK(nc_tensor_device(conn, on0, &x0) == NC_OK &&
		      nc_tensor_device(conn, on0 + BYTES, &y0) == NC_OK &&
		      nc_tensor_device(conn, on1, &y1) == NC_OK &&
		      nc_tensor_device(conn, on1 + BYTES, &gamma1) == NC_OK,
	      "register: %s", nc_last_error());
	struct nc_job job = {.op = NC_RMSNORM_FWD, .rows = ROWS, .cols = COLS, .dtype = NC_F32,
			     .x = x0, .y = y1};
	int bad = refused_across_devices(conn, &job, "x on device 0, y on device 1");
	job.y = y0;
	job.gamma = gamma1;
	bad += refused_across_devices(conn, &job, "x, y on device 0, gamma on device 1");
	job.gamma = (struct nc_tensor){0};
	struct nc_job_result r = {0};
	int rc = nc_job_run(conn, &job, 10000, &r);
	nc_close(conn);
	bool freed = cuda_ok(cudaFree(on0), "cudaFree");
	freed = cuda_ok(cudaFree(on1), "cudaFree") && freed;
	CHECK(bad == 0, "a job across devices was not refused as it should be");
	CHECK(rc == NC_OK, "the job on device 0 alone: %s (%s)", nc_status_name(rc), r.message);
	CHECK(freed, "cudaFree");
	return 0;
}

static int mixed_devices_refused(void)
{
	uint64_t before[MAX_GPUS];
	int expected[MAX_GPUS] = {[0] = 1}; /* only the job on device 0 alone ran */
	CHECK(device_job_counts(before) == 0, "no stats");
	CHECK(in_child(mixed_devices, daemon_.socket) == 0, "see above");
	return jobs_ran_where_expected(before, expected);
}

/* ---- the variant cache, per GPU UUID ----------------------------------------------------- */

/* Child: variant_named on t->device of the daemon at t->socket. */
static int variant_named_on(void *arg)
{
	const struct target *t = arg;
	nc_conn *conn = gpu_test_connect(t->socket, "variant");
	CHECK(conn, "no connection");
	int rc = variant_named(conn, t->device);
	nc_close(conn);
	return rc;
}

/* variant_named's key (LayerNorm forward, bf16, 3072 columns, gamma and beta) on every device. */
static int cache_key_on_every_device(const char *socket_path)
{
	for (int d = 0; d < gpus.count; d++) {
		struct target t = {.socket = socket_path, .device = d};
		CHECK(in_child(variant_named_on, &t) == 0, "the job on device %d", d);
	}
	return 0;
}

/* The daemon lists exactly one entry of the key per device, each from `source`. */
static int cache_lists_key_per_device(const char *socket_path, const char *source)
{
	nc_conn *conn = gpu_test_connect(socket_path, "variants");
	CHECK(conn, "no connection");
	struct nc_variant_info *list;
	size_t n;
	int rc = nc_variants_get(conn, 10000, &list, &n);
	nc_close(conn);
	CHECK(rc == NC_OK, "variants: %s", nc_status_name(rc));
	int per_device[MAX_GPUS] = {0}, from_source[MAX_GPUS] = {0};
	for (size_t i = 0; i < n; i++) {
		const struct nc_variant_info *v = &list[i];
		if (v->op != NC_LAYERNORM_FWD || v->dtype != NC_BF16 || v->cols != 3072 ||
		    v->device < 0 || v->device >= gpus.count)
			continue;
		per_device[v->device]++;
		from_source[v->device] += strcmp(v->source, source) == 0;
		printf("  device %d: %s (%s)\n", v->device, v->variant, v->source);
	}
	nc_variants_free(list);
	for (int d = 0; d < gpus.count; d++)
		CHECK(per_device[d] == 1 && from_source[d] == 1,
		      "device %d: %d entries of the key, %d from %s", d, per_device[d],
		      from_source[d], source);
	return 0;
}

/* dir/variants-<uuid>.txt names GPU d's UUID in its header and holds the key's line (nk_ codes). */
static int cache_file_of(const char *dir, int d)
{
	char hex[33], path[256], line[256];
	for (int i = 0; i < 16; i++)
		snprintf(hex + 2 * i, 3, "%02x", gpus.gpu[d].uuid[i]);
	snprintf(path, sizeof(path), "%s/variants-%s.txt", dir, hex);
	FILE *f = fopen(path, "r");
	CHECK(f, "device %d: no %s", d, path);
	bool header = false;
	int keys = 0;
	for (int n = 0; fgets(line, sizeof(line), f); n++) {
		unsigned op, dtype, wdtype, flags;
		long long cols;
		if (n == 0)
			header = strncmp(line, "normd-variants ", 15) == 0 && strstr(line, hex);
		else if (sscanf(line, "%u %u %u %u %lld", &op, &dtype, &wdtype, &flags, &cols) == 5)
			keys += op == NK_LAYERNORM_FWD && dtype == NK_BF16 && cols == 3072;
	}
	fclose(f);
	CHECK(header, "device %d: %s does not start with its GPU's header", d, path);
	CHECK(keys == 1, "device %d: %s holds the key %d times", d, path, keys);
	return 0;
}

/*
 * With --autotune, the key tuned on each device is an entry of that
 * device's cache; SIGTERM saves each cache to its GPU's own file; a new
 * daemon on the same state directory reads each back for its own GPU.
 */
static int variant_cache_per_uuid(void)
{
	static const char *const autotune[] = {"--autotune", NULL};
	struct test_daemon first;
	CHECK(test_daemon_start_on(&first, "all", autotune) == 0, "normd --autotune did not start");
	int bad = cache_key_on_every_device(first.socket);
	bad += bad ? 0 : cache_lists_key_per_device(first.socket, "autotune");
	kill(first.pid, SIGTERM);
	first.exited = waitpid(first.pid, &first.wait_status, 0) == first.pid;
	bad += !first.exited || !WIFEXITED(first.wait_status) || WEXITSTATUS(first.wait_status);
	for (int d = 0; d < gpus.count && !bad; d++)
		bad += cache_file_of(first.dir, d);
	if (bad)
		test_daemon_dump_log(&first);
	const char *const reload[] = {"--autotune", "--state-dir", first.dir, NULL};
	struct test_daemon second;
	int started = bad ? -1 : test_daemon_start_on(&second, "all", reload);
	if (started == 0) {
		bad += cache_key_on_every_device(second.socket);
		bad += bad ? 0 : cache_lists_key_per_device(second.socket, "file");
		bad += test_daemon_stop(&second) != 0;
	}
	test_daemon_stop(&first);
	CHECK(bad == 0, "the per-GPU caches were not kept apart (see above)");
	CHECK(started == 0, "the second daemon did not start");
	return 0;
}

/* ---- the daemon killed under every GPU's clients ----------------------------------------- */

/* A chain client per GPU on d's socket; how many were forked (all is gpus.count). */
static int chains_start(const struct test_daemon *d, int go[2], int out[][2], pid_t *pids)
{
	int forked = 0;
	for (int g = 0; g < gpus.count; g++) {
		if (pipe(out[g]) != 0)
			break;
		struct enqueue_chain c = {.socket_path = d->socket, .device = g, .rows = 16384,
					  .cols = 8192, .jobs = 2000, .signal_after = 50,
					  .go_fd = go[1]};
		fflush(NULL);
		pids[g] = fork();
		if (pids[g] == 0) {
			prctl(PR_SET_PDEATHSIG, SIGKILL);
			close(go[0]);
			close(out[g][0]);
			child_exit(enqueue_chain_run(&c, out[g][1]));
		}
		close(out[g][1]);
		if (pids[g] < 0) {
			close(out[g][0]);
			break;
		}
		forked++;
	}
	return forked;
}

/* What GPU g's client saw after the kill at killed_ns; true if it was released in time. */
static bool chain_released(int g, int fd, int64_t killed_ns)
{
	struct enqueue_chain_outcome o = {0};
	int got = test_read_within(fd, &o, sizeof(o), 30000);
	double after_ms = (double)(o.synced_ns - killed_ns) / 1e6;
	printf("  GPU %d: %d of 2000 enqueued; stream released %.1f ms after the kill (%s); "
	       "nc_conn_check: %s\n",
	       g, o.enqueued, after_ms, cudaGetErrorString((cudaError_t)o.cuda_rc),
	       nc_status_name(o.check_rc));
	bool released = got == 0 && o.cuda_rc == cudaSuccess && after_ms > 0 && after_ms < 1000 &&
			o.check_rc == NC_EDISCONNECTED &&
			(o.enqueue_rc == 0 || o.enqueue_rc == NC_EDISCONNECTED);
	if (!released)
		fprintf(stderr, "  GPU %d's client was not released as it should be%s\n", g,
			got != 0     ? " (no outcome within 30 s)"
			: after_ms <= 0 ? " (its chain ended before the kill)"
					: "");
	return released;
}

/*
 * A client per GPU enqueues a long chain (2000 LayerNorm forwards of 16384 x
 * 8192 bf16, a third of a second of work); once each has 50 enqueued, the
 * daemon is SIGKILLed: each client's stream must be released within a
 * second, its connection reporting NC_EDISCONNECTED. Run in a child: it
 * names CUDA's errors, and the test's own process must stay CUDA-free.
 */
static int daemon_killed_under_every_gpu(void *arg)
{
	(void)arg;
	struct test_daemon d;
	CHECK(test_daemon_start_on(&d, "all", NULL) == 0, "cannot start a second normd");
	int go[2], out[MAX_GPUS][2];
	pid_t pids[MAX_GPUS];
	if (pipe(go) != 0) {
		test_daemon_stop(&d);
		CHECK(false, "pipe");
	}
	int forked = chains_start(&d, go, out, pids);
	close(go[1]);
	char bytes[MAX_GPUS];
	int started = forked == gpus.count
			      ? test_read_within(go[0], bytes, (size_t)gpus.count, 60000)
			      : -1;
	int bad = 0;
	if (started == 0) {
		usleep(30 * 1000);
		int64_t killed_ns = enqueue_chain_now_ns();
		kill(d.pid, SIGKILL);
		d.exited = waitpid(d.pid, &d.wait_status, 0) == d.pid;
		for (int g = 0; g < forked; g++)
			bad += !chain_released(g, out[g][0], killed_ns);
	}
	for (int g = 0; g < forked; g++) {
		kill(pids[g], SIGKILL);
		waitpid(pids[g], NULL, 0);
		close(out[g][0]);
	}
	close(go[0]);
	test_daemon_stop(&d);
	CHECK(forked == gpus.count, "%d of %d chain clients started (pipe or fork failed)", forked,
	      gpus.count);
	CHECK(started == 0, "the chains did not all start");
	CHECK(bad == 0, "%d of %d GPUs' clients not released within a second", bad, gpus.count);
	return 0;
}

/* ---- other device lists ------------------------------------------------------------------ */

/* normd --device 0,1 lists both and runs one checked job of each op on each. */
static int two_devices_served(void)
{
	static const int both[] = {0, 1};
	struct test_daemon pair;
	CHECK(test_daemon_start_on(&pair, "0,1", NULL) == 0, "normd --device 0,1 did not start");
	int bad = server_info_lists(pair.socket, both, 2);
	for (int d = 0; d < 2; d++) {
		struct target t = {.socket = pair.socket, .device = d, .jobs = 4};
		bad += in_child(jobs_on, &t) != 0;
	}
	bad += gpu_test_wait_idle(pair.socket) != 0;
	if (bad)
		test_daemon_dump_log(&pair);
	int rc = test_daemon_stop(&pair);
	CHECK(bad == 0, "normd --device 0,1 did not serve both devices");
	CHECK(rc == 0, "normd --device 0,1 exited with %d on SIGTERM", rc);
	return 0;
}

/* The first ordinal past the last GPU makes the daemon exit with an error at start. */
static int missing_device_refused(void)
{
	char ordinal[16];
	snprintf(ordinal, sizeof(ordinal), "%d", gpus.count);
	printf("  normd --device %s must not start; its log below is expected\n", ordinal);
	struct test_daemon bad;
	int rc = test_daemon_start_on(&bad, ordinal, NULL);
	if (rc == 0)
		test_daemon_stop(&bad);
	CHECK(rc != 0, "normd --device %s started with %d GPUs", ordinal, gpus.count);
	CHECK(bad.exited && WIFEXITED(bad.wait_status) && WEXITSTATUS(bad.wait_status) != 0,
	      "normd --device %s did not exit with an error by itself", ordinal);
	return 0;
}

int main(void)
{
	if (in_child_read(list_gpus_child, NULL, &gpus, sizeof(gpus)) != 0) {
		report("CUDA lists the GPUs", 1);
		return gpu_test_summary("test_multi_gpu");
	}
	if (gpus.count < 2) {
		printf("test_multi_gpu: skipped: %d GPU(s); needs 2\n", gpus.count);
		return 0;
	}
	if (gpus.count > MAX_GPUS || test_daemon_start_on(&daemon_, "all", NULL) != 0) {
		report("normd --device all starts (16 GPUs at most)", 1);
		return gpu_test_summary("test_multi_gpu");
	}
	report("every GPU listed as CUDA sees it", devices_listed());
	for (int d = 0; d < gpus.count; d++) {
		char name[64];
		snprintf(name, sizeof(name), "every op on device %d, and only there", d);
		/* EVERY_OP_JOBS and variant_named's job */
		report(name, ran_where_asked(every_op_on, d, 0, EVERY_OP_JOBS + 1));
	}
	report("every device at once", every_device_at_once(jobs_on, AT_ONCE_JOBS));
	for (int d = 0; d < gpus.count; d++) {
		char name[64];
		snprintf(name, sizeof(name), "enqueued jobs on device %d, and only there", d);
		report(name, ran_where_asked(enqueued_on, d, EVERY_OP_JOBS, EVERY_OP_JOBS));
	}
	report("enqueued on every device at once",
	       every_device_at_once(enqueued_on, EVERY_OP_JOBS));
	report("one process enqueues on every device",
	       ran_where_asked(enqueued_on, -1, AT_ONCE_JOBS, AT_ONCE_JOBS));
	report("a job across two devices refused", mixed_devices_refused());
	report("regions released after the clients", gpu_test_wait_idle(daemon_.socket) ? 1 : 0);
	bool alive = test_daemon_alive(&daemon_);
	if (gpu_tests_failed || !alive)
		test_daemon_dump_log(&daemon_);
	int rc = test_daemon_stop(&daemon_);
	report("daemon alive and exits 0 on SIGTERM", alive && rc == 0 ? 0 : 1);
	report("variant cache: an entry and a file per GPU UUID", variant_cache_per_uuid());
	report("daemon SIGKILL releases every GPU's clients",
	       in_child(daemon_killed_under_every_gpu, NULL));
	report("--device 0,1 serves both", two_devices_served());
	report("--device past the last GPU refused", missing_device_refused());
	return gpu_test_summary("test_multi_gpu");
}
