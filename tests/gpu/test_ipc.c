/*
 * The CUDA backend end to end (run on the GPU machine by `make test-gpu`):
 * clients keep their tensors in their own cudaMalloc memory and pass CUDA
 * IPC handles; every op is checked against the float64 reference; a client
 * killed mid-job releases its mappings; 1000 connect/register/job/disconnect
 * cycles leave the daemon's device memory and RSS flat; memory CUDA IPC
 * cannot export is refused clearly; replies name the variant that ran.
 *
 * Every CUDA call happens in a child process: a process that has touched
 * CUDA cannot fork children that use it, and the daemon is a process of its
 * own (started by test_daemon_start_on).
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "tests/gpu/gpu_test.h"
#include "tests/support/testlib.h"

static struct test_daemon daemon_;

static nc_conn *connect_daemon(const char *name)
{
	return gpu_test_connect(daemon_.socket, name);
}

static int run_checked(nc_conn *conn, const struct jobkit_spec *spec, char *variant)
{
	struct jobkit kit;
	struct nc_job_result result;
	struct jobkit_report rep = {0};
	int rc = jobkit_create(conn, spec, &kit);
	if (rc) {
		fprintf(stderr, "  set-up: %s\n", nc_last_error());
		return 1;
	}
	rc = nc_job_run_on_stream(conn, &kit.job, NULL, 30000, &result);
	bool ok = rc == NC_OK && jobkit_check(&kit, &rep);
	if (!ok)
		fprintf(stderr, "  %s %llux%llu dtype %d me %d: %s (%s) %s\n",
			jobkit_op_name(spec->op), (unsigned long long)spec->rows,
			(unsigned long long)spec->cols, spec->dtype, spec->memory_efficient,
			nc_status_name(rc), result.message, rep.detail);
	if (variant)
		snprintf(variant, 64, "%s", result.variant);
	jobkit_destroy(&kit);
	return ok ? 0 : 1;
}

/* Every op x dtype x weight dtype x memory_efficient x affine on a few shapes. */
static int every_op(void *arg)
{
	(void)arg;
	nc_conn *conn = connect_daemon("every-op");
	CHECK(conn, "no connection");
	static const uint64_t shapes[][2] = {{1, 1}, {7, 33}, {33, 1000}, {5, 4096}, {3, 12288}};
	int bad = 0, seed = 1;
	for (int op = 1; op <= 4; op++)
		for (int dt = 1; dt <= 3; dt++)
			for (int s = 0; s < 5; s++)
				for (int variant = 0; variant < 4; variant++) {
					bool bwd = op == 2 || op == 4;
					struct jobkit_spec spec = {
						.op = (enum nc_op)op, .rows = shapes[s][0],
						.cols = shapes[s][1], .dtype = (enum nc_dtype)dt,
						.weight_dtype = variant == 2 ? NC_F32 : 0,
						.gamma = variant != 0, .beta = variant != 0,
						.memory_efficient = bwd && variant == 3,
						.seed = (uint64_t)seed++, .on_device = true,
					};
					bad += run_checked(conn, &spec, NULL);
				}
	nc_close(conn);
	CHECK(bad == 0, "%d jobs wrong", bad);
	return 0;
}

/* Several client processes at once, each with its own buffers. */
static int many_clients(void *arg)
{
	(void)arg;
	enum { PROCS = 6 };
	pid_t pids[PROCS];
	for (int p = 0; p < PROCS; p++) {
		pids[p] = fork();
		if (pids[p] == 0) {
			nc_conn *conn = connect_daemon("many");
			int bad = conn ? 0 : 1;
			for (int i = 0; conn && i < 24; i++) {
				struct jobkit_spec spec = {
					.op = (enum nc_op)(1 + (i + p) % 4), .rows = 64 + (uint64_t)p,
					.cols = 512 + 128 * (uint64_t)i, .dtype = (enum nc_dtype)(1 + i % 3),
					.gamma = true, .beta = true, .memory_efficient = (i / 4) % 2,
					.seed = (uint64_t)(p * 1000 + i), .on_device = true,
				};
				bad += run_checked(conn, &spec, NULL);
			}
			nc_close(conn);
			_exit(bad ? 1 : 0);
		}
	}
	int bad = 0;
	for (int p = 0; p < PROCS; p++) {
		int status;
		waitpid(pids[p], &status, 0);
		bad += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	}
	CHECK(bad == 0, "%d client processes saw wrong results", bad);
	return 0;
}

static int daemon_stats(struct nc_stats *stats)
{
	return gpu_test_stats(daemon_.socket, stats);
}

static int wait_idle(void)
{
	return gpu_test_wait_idle(daemon_.socket);
}

/*
 * Submits 8 large backward jobs at once; with arg == NULL dies mid-job, else
 * waits for them (to warm every worker's scratch before measuring memory).
 */
static int doomed_client(void *arg)
{
	nc_conn *conn = connect_daemon(arg ? "warm" : "doomed");
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_LAYERNORM_BWD, .rows = 16384, .cols = 4096,
				   .dtype = NC_BF16, .gamma = true, .beta = true, .seed = 3,
				   .on_device = true};
	if (!conn || jobkit_create(conn, &spec, &kit))
		return 2;
	uint64_t ids[8];
	for (int i = 0; i < 8; i++)
		nc_job_submit(conn, &kit.job, &ids[i]);
	if (!arg)
		kill(getpid(), SIGKILL); /* mid-job, no goodbye */
	int bad = 0;
	for (int i = 0; i < 8; i++)
		bad += nc_job_wait(conn, ids[i], 60000, NULL) != NC_OK;
	jobkit_destroy(&kit);
	nc_close(conn);
	return bad ? 4 : 0;
}

/* A client killed mid-job: the others go on, its memory comes back. */
static int killed_client_releases(void *arg)
{
	(void)arg;
	int warm = 1;
	CHECK(in_child(doomed_client, &warm) == 0, "warm-up with the same jobs failed");
	CHECK(wait_idle() == 0, "daemon not idle before");
	long long before = device_free_bytes();
	int rc = in_child(doomed_client, NULL);
	CHECK(rc == 128 + SIGKILL, "the doomed client ended with %d", rc);
	CHECK(in_child(many_clients, NULL) == 0, "others were disturbed");
	CHECK(wait_idle() == 0, "regions of the killed client were not released");
	long long after = device_free_bytes();
	CHECK(before > 0 && after > 0, "cannot read device memory");
	printf("  device free memory before %lld MiB, after %lld MiB\n", before >> 20, after >> 20);
	CHECK(llabs(after - before) <= (8ll << 20), "device memory moved by %lld bytes",
	      after - before);
	return 0;
}

static int cycles_child(void *arg)
{
	int cycles = *(int *)arg;
	void *buf = NULL;
	if (cudaMalloc(&buf, 1 << 20) != cudaSuccess ||
	    cudaMemset(buf, 0x3c, 1 << 20) != cudaSuccess)
		return 2;
	for (int i = 0; i < cycles; i++) {
		nc_conn *conn = connect_daemon("cycle");
		nc_region *region = NULL;
		if (!conn || nc_region_register_device(conn, buf, &region) != NC_OK)
			return 3;
		char *base = buf;
		struct nc_job job = {.op = NC_RMSNORM_FWD, .rows = 4, .cols = 1024, .dtype = NC_BF16,
				     .x = nc_tensor_at(region, base),
				     .y = nc_tensor_at(region, base + 65536),
				     .gamma = nc_tensor_at(region, base + 131072)};
		struct nc_job_result result;
		if (nc_job_run_on_stream(conn, &job, NULL, 10000, &result) != NC_OK) {
			fprintf(stderr, "  cycle %d: %s\n", i, result.message);
			return 4;
		}
		if (i % 2)
			nc_region_free(region); /* half unregister, half just disconnect */
		nc_close(conn);
	}
	cudaFree(buf);
	return 0;
}

/* 1000 connect/register/job/disconnect cycles leave memory flat. */
static int thousand_cycles(void *arg)
{
	(void)arg;
	int warmup = 50, cycles = 1000;
	CHECK(in_child(cycles_child, &warmup) == 0, "warm-up cycles failed");
	CHECK(wait_idle() == 0, "not idle after warm-up");
	struct nc_stats s0, s1;
	CHECK(daemon_stats(&s0) == 0, "stats");
	long long before = device_free_bytes();
	CHECK(in_child(cycles_child, &cycles) == 0, "cycles failed");
	CHECK(wait_idle() == 0, "not idle after the cycles");
	CHECK(daemon_stats(&s1) == 0, "stats");
	long long after = device_free_bytes();
	printf("  rss %llu -> %llu KiB, device free %lld -> %lld MiB, clients_total %llu\n",
	       (unsigned long long)s0.rss_bytes >> 10, (unsigned long long)s1.rss_bytes >> 10,
	       before >> 20, after >> 20, (unsigned long long)s1.clients_total);
	CHECK(s1.rss_bytes <= s0.rss_bytes + s0.rss_bytes / 20 + (1 << 20),
	      "rss grew from %llu to %llu", (unsigned long long)s0.rss_bytes,
	      (unsigned long long)s1.rss_bytes);
	CHECK(llabs(after - before) <= (8ll << 20), "device memory moved by %lld", after - before);
	return 0;
}

/* Memory CUDA IPC cannot export is refused with UNSUPPORTED and a reason. */
static int unexportable(void *arg)
{
	(void)arg;
	nc_conn *conn = connect_daemon("unexportable");
	CHECK(conn, "no connection");
	void *managed = NULL, *pooled = NULL;
	nc_region *region = NULL;
	CHECK(cudaMallocManaged(&managed, 1 << 16, cudaMemAttachGlobal) == cudaSuccess, "managed");
	int rc = nc_region_register_device(conn, managed, &region);
	CHECK(rc == NC_EUNSUPPORTED, "managed memory gave %s", nc_status_name(rc));
	printf("  managed: %s\n", nc_last_error());
	CHECK(cudaMallocAsync(&pooled, 1 << 16, 0) == cudaSuccess &&
		      cudaStreamSynchronize(0) == cudaSuccess,
	      "pool");
	rc = nc_region_register_device(conn, pooled, &region);
	CHECK(rc == NC_EUNSUPPORTED, "pool memory gave %s", nc_status_name(rc));
	printf("  pool: %s\n", nc_last_error());
	int host = 0;
	rc = nc_region_register_device(conn, &host, &region);
	CHECK(rc == NC_EINVALID_ARGUMENT, "a host pointer gave %s", nc_status_name(rc));
	cudaFree(managed);
	cudaFreeAsync(pooled, 0);
	nc_close(conn);
	return 0;
}

/* Replies name the variant; the cache lists what ran. */
static int variants_listed(void *arg)
{
	(void)arg;
	nc_conn *conn = connect_daemon("variants");
	CHECK(conn, "no connection");
	char variant[64] = "";
	struct jobkit_spec spec = {.op = NC_LAYERNORM_FWD, .rows = 100, .cols = 2048,
				   .dtype = NC_BF16, .gamma = true, .beta = true, .seed = 11,
				   .on_device = true};
	CHECK(run_checked(conn, &spec, variant) == 0, "job failed");
	CHECK(variant[0] != '\0', "the reply names no variant");
	struct nc_variant_info *list;
	size_t n;
	CHECK(nc_variants_get(conn, 10000, &list, &n) == NC_OK, "variants: %s", nc_last_error());
	bool found = false;
	for (size_t i = 0; i < n; i++)
		found |= list[i].cols == 2048 && list[i].op == NC_LAYERNORM_FWD && list[i].uses > 0;
	printf("  reply variant %s; %zu cache entries\n", variant, n);
	nc_variants_free(list);
	nc_close(conn);
	CHECK(found, "the cache does not list the job's key");
	return 0;
}

/*
 * normd --autotune times the candidates of a new key on scratch memory and
 * keeps the fastest: the cache lists the key with source "autotune" (until
 * session 3 a sizing pass cleared the scratch pointers, every candidate
 * failed, and the rule's variant was kept without a word). The job itself
 * is still checked against the reference. `arg` is the daemon's socket.
 */
static int autotuned(void *arg)
{
	nc_conn *conn = gpu_test_connect((const char *)arg, "autotune");
	CHECK(conn, "no connection");
	char variant[64] = "";
	struct jobkit_spec spec = {.op = NC_LAYERNORM_BWD, .rows = 64, .cols = 16384,
				   .dtype = NC_BF16, .gamma = true, .beta = true, .seed = 31,
				   .on_device = true};
	CHECK(run_checked(conn, &spec, variant) == 0, "job failed");
	struct nc_variant_info *list;
	size_t n;
	CHECK(nc_variants_get(conn, 10000, &list, &n) == NC_OK, "variants: %s", nc_last_error());
	const char *source = "(not listed)";
	for (size_t i = 0; i < n; i++) {
		if (list[i].cols == 16384 && list[i].op == NC_LAYERNORM_BWD)
			source = list[i].source;
	}
	printf("  autotuned variant %s, source %s\n", variant, source);
	bool tuned = strcmp(source, "autotune") == 0;
	nc_variants_free(list);
	nc_close(conn);
	CHECK(tuned, "the key's variant was not autotuned");
	return 0;
}

/* WGRAD_ACCUM through cuBLAS against the reference, then accumulating twice. */
static int wgrad_jobs(void *arg)
{
	(void)arg;
	nc_conn *conn = connect_daemon("wgrad");
	CHECK(conn, "no connection");
	static const uint64_t shapes[][3] = {{1, 1, 1}, {17, 33, 9}, {512, 384, 257}, {1024, 768, 512}};
	static const enum nc_dtype types[][2] = {{NC_F32, NC_F32}, {NC_BF16, NC_F32},
						 {NC_F16, NC_F32}, {NC_BF16, NC_BF16}};
	int bad = 0, seed = 500;
	for (int s = 0; s < 4; s++)
		for (int t = 0; t < 4; t++)
			for (int acc = 0; acc <= 1; acc++) {
				struct jobkit_spec spec = {
					.op = NC_WGRAD_ACCUM, .rows = shapes[s][0], .cols = shapes[s][1],
					.out_features = shapes[s][2], .dtype = types[t][0],
					.weight_dtype = types[t][1], .accumulate = acc,
					.seed = (uint64_t)seed++, .on_device = true,
				};
				bad += run_checked(conn, &spec, NULL);
			}
	CHECK(bad == 0, "%d wgrad jobs wrong", bad);

	/* Twice accumulated = initial + 2 x the product (fp32 main_grad). */
	struct jobkit twice, once;
	struct jobkit_spec spec = {.op = NC_WGRAD_ACCUM, .rows = 256, .cols = 128, .out_features = 96,
				   .dtype = NC_BF16, .accumulate = true, .seed = 9, .on_device = true};
	struct jobkit_spec over = spec;
	over.accumulate = false;
	CHECK(jobkit_create(conn, &spec, &twice) == 0 && jobkit_create(conn, &over, &once) == 0,
	      "set-up");
	struct nc_job_result r;
	CHECK(nc_job_run_on_stream(conn, &twice.job, NULL, 10000, &r) == NC_OK &&
		      nc_job_run_on_stream(conn, &twice.job, NULL, 10000, &r) == NC_OK &&
		      nc_job_run_on_stream(conn, &once.job, NULL, 10000, &r) == NC_OK,
	      "jobs: %s", r.message);
	struct jobkit_report rep;
	jobkit_check(&twice, &rep); /* downloads the outputs into the staging copies */
	jobkit_check(&once, &rep);
	const float *got = twice.ptr[JK_MAIN_GRAD], *init = twice.initial[JK_MAIN_GRAD];
	const float *prod = once.ptr[JK_MAIN_GRAD];
	double err2 = 0, ref2 = 0;
	for (int i = 0; i < 96 * 128; i++) {
		double want = (double)init[i] + 2.0 * (double)prod[i];
		err2 += (got[i] - want) * (got[i] - want);
		ref2 += want * want;
	}
	printf("  accumulate twice: relative L2 error %.3g (variant %s)\n", sqrt(err2 / ref2),
	       r.variant);
	jobkit_destroy(&twice);
	jobkit_destroy(&once);
	nc_close(conn);
	CHECK(sqrt(err2 / ref2) < 1e-6, "twice != initial + 2 * product");
	return 0;
}

/*
 * The IPC-event mode orders both ways through the caller's stream: the
 * daemon's job waits for the caller's input upload (queued behind a slow
 * memset, after the device input was poisoned), and a copy the caller queues
 * after the call sees the job's output, all without a host synchronize.
 */
static int event_mode(void *arg)
{
	(void)arg;
	nc_conn *conn = connect_daemon("events");
	CHECK(conn, "no connection");
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_LAYERNORM_FWD, .rows = 4096, .cols = 4096,
				   .dtype = NC_BF16, .gamma = true, .beta = true, .seed = 21,
				   .on_device = true};
	CHECK(jobkit_create(conn, &spec, &kit) == 0, "set-up: %s", nc_last_error());
	size_t xoff = (size_t)((char *)kit.ptr[JK_X] - (char *)kit.staging);
	size_t yoff = (size_t)((char *)kit.ptr[JK_Y] - (char *)kit.staging);
	char *x = (char *)kit.device_base + xoff, *y = (char *)kit.device_base + yoff;
	void *scratch = NULL, *y_copy = NULL;
	cudaStream_t s;
	CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess &&
		      cudaMalloc(&scratch, 1u << 30) == cudaSuccess &&
		      cudaMalloc(&y_copy, kit.bytes[JK_Y]) == cudaSuccess &&
		      cudaMemset(x, 0xff, kit.bytes[JK_X]) == cudaSuccess &&
		      cudaDeviceSynchronize() == cudaSuccess,
	      "cuda set-up");
	cudaMemsetAsync(scratch, 1, 1u << 30, s); /* keeps the stream busy a while */
	cudaMemcpyAsync(x, kit.ptr[JK_X], kit.bytes[JK_X], cudaMemcpyHostToDevice, s);
	struct nc_job_result r;
	int rc = nc_job_run_event(conn, &kit.job, s, 10000, &r);
	CHECK(rc == NC_OK, "nc_job_run_event: %s", r.message);
	cudaMemcpyAsync(y_copy, y, kit.bytes[JK_Y], cudaMemcpyDeviceToDevice, s);
	CHECK(cudaStreamSynchronize(s) == cudaSuccess, "stream");
	struct jobkit_report rep;
	bool ok = jobkit_check(&kit, &rep);
	printf("  event mode: job result %s (%s), variant %s\n", ok ? "correct" : "WRONG",
	       rep.detail, r.variant);
	char *copied = malloc(kit.bytes[JK_Y]);
	CHECK(copied && cudaMemcpy(copied, y_copy, kit.bytes[JK_Y], cudaMemcpyDeviceToHost) ==
				cudaSuccess,
	      "download");
	bool same = memcmp(copied, kit.ptr[JK_Y], kit.bytes[JK_Y]) == 0;
	free(copied);
	cudaFree(scratch);
	cudaFree(y_copy);
	cudaStreamDestroy(s);
	jobkit_destroy(&kit);
	nc_close(conn);
	CHECK(ok, "the job did not wait for the caller's upload");
	CHECK(same, "the caller's stream did not wait for the job");
	return 0;
}

int main(void)
{
	if (test_daemon_start_on(&daemon_, "0", NULL) != 0) {
		fprintf(stderr, "cannot start normd --device 0\n");
		printf("test_ipc: 0 passed, 1 failed\n");
		return 1;
	}
	report("every op against the reference", in_child(every_op, NULL));
	report("several client processes", in_child(many_clients, NULL));
	report("killed client releases its memory", killed_client_releases(NULL));
	report("1000 connect/register/job cycles", thousand_cycles(NULL));
	report("unexportable memory refused", in_child(unexportable, NULL));
	report("wgrad jobs and accumulation", in_child(wgrad_jobs, NULL));
	report("IPC-event mode orders both ways", in_child(event_mode, NULL));
	report("variants named and listed", in_child(variants_listed, NULL));
	bool alive = test_daemon_alive(&daemon_);
	if (gpu_tests_failed || !alive)
		test_daemon_dump_log(&daemon_);
	int rc = test_daemon_stop(&daemon_);
	report("daemon alive and exits 0 on SIGTERM", alive && rc == 0 ? 0 : 1);

	static const char *const tune[] = {"--autotune", NULL};
	struct test_daemon tuning;
	int failed_before = gpu_tests_failed;
	if (test_daemon_start_on(&tuning, "0", tune) != 0) {
		report("autotuning keeps the fastest candidate", 1);
	} else {
		report("autotuning keeps the fastest candidate", in_child(autotuned, tuning.socket));
		if (gpu_tests_failed > failed_before)
			test_daemon_dump_log(&tuning);
		report("autotuning daemon exits 0 on SIGTERM", test_daemon_stop(&tuning) == 0 ? 0 : 1);
	}
	return gpu_test_summary("test_ipc");
}
