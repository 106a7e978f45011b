/*
 * What the enqueue completion mode (nc_job_enqueue) costs, beside the
 * synchronous mode (nc_job_run_on_stream) and beside launching the same
 * kernel in-process, on a tiny RMSNorm forward job (8 x 1024 bf16, gamma):
 *   1. host cost per call: each nc_job_enqueue timed with clock_gettime
 *      (the stream synchronized every 256 calls, outside the timing); the
 *      synchronous mode's whole call for comparison;
 *   2. a dependent chain (x of each job is y of the previous one): GPU time
 *      per job from CUDA events on the caller's stream, with the chain's
 *      segments held behind a gate until every job of the segment is queued
 *      (so that the time is the GPU's, not the host's), against the same
 *      chain of kernels launched in-process through kernels/norm_kernels.h;
 *      also the chain run ungated (host and GPU overlapped) and, for the
 *      synchronous mode, the wall time per job;
 *   3. aggregate rate: P processes (1, 4, 16), each with its own connection
 *      and stream, enqueue tiny jobs for a few seconds (synchronizing every
 *      512 jobs); jobs per second in all, and the same for the sync mode.
 *
 * Every measurement runs in a child process (a process that has touched CUDA
 * cannot fork children that use it); this one stays CUDA-free and prints.
 *
 * Usage: bench_enqueue [--socket PATH] [--json FILE|-] [--calls N] [--chain N]
 *                      [--seconds S] [--procs 1,4,16] [--no-sync] [-- normd options...]
 *   --socket PATH  use the normd at PATH (e.g. one started under MPS) instead
 *                  of starting `normd --device 0` (from $NORMD_BIN, else the
 *                  bin/normd beside this program's bench/ directory)
 *   --json FILE    also write the results as one JSON object ('-': stdout)
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/cuda_driver.h"
#include "kernels/norm_kernels.h"
#include "normclient.h"
#include "tests/support/testlib.h"

#define ROWS 8
#define COLS 1024
#define MAX_PROCS 8
#define CHILD_TIMEOUT_S 600

struct options {
	const char *socket;
	const char *json;
	int calls;                /* host-cost calls per mode */
	int chain;                /* dependent jobs */
	double seconds;           /* per aggregate-rate run */
	int procs[MAX_PROCS];     /* process counts of the aggregate rate */
	int nprocs;
	bool sync;                /* measure the synchronous mode too */
	const char *const *daemon_args;
};

struct summary {
	double p50, p99, mean, max;
};

struct host_cost {
	struct summary enqueue, sync;
	bool daemon_mps, client_mps;
	char variant[64];
};

struct chain_cost {
	int jobs, segment;
	double enqueue_gpu_us;   /* per job, gated segments */
	double inproc_gpu_us;    /* per job, gated segments, in-process kernels */
	double enqueue_host_us;  /* per nc_job_enqueue call inside the chain */
	double enqueue_wall_us;  /* per job, ungated, first call to stream idle */
	double inproc_wall_us;   /* the same in-process */
	double enqueue_span_us;  /* per job, ungated, CUDA events around the whole chain */
	double inproc_span_us;   /* the same in-process */
	double sync_wall_us;     /* per job, nc_job_run_on_stream chain */
};

struct rate {
	int procs;
	double enqueue_jobs_s, sync_jobs_s;
	double enqueue_min_s, sync_min_s; /* the slowest process's own rate */
};

/* One aggregate-rate process's outcome. */
struct proc_result {
	long long jobs;
	double seconds;
	int status;
};

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static struct summary summarize(double *v, int n)
{
	struct summary s = {0};
	if (n <= 0)
		return s;
	double sum = 0;
	for (int i = 0; i < n; i++)
		sum += v[i];
	qsort(v, (size_t)n, sizeof(double), cmp_double);
	s.p50 = v[n / 2];
	s.p99 = v[(int)(n * 0.99)];
	s.mean = sum / n;
	s.max = v[n - 1];
	return s;
}

/* Reads exactly len bytes within timeout_ms; 0 or -1. */
static int read_within(int fd, void *buf, size_t len, int timeout_ms)
{
	size_t got = 0;
	double deadline = now_us() + timeout_ms * 1e3;
	while (got < len) {
		int left = (int)((deadline - now_us()) / 1e3);
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (left <= 0 || poll(&p, 1, left) <= 0)
			return -1;
		ssize_t n = read(fd, (char *)buf + got, len - got);
		if (n <= 0)
			return -1;
		got += (size_t)n;
	}
	return 0;
}

/* Forks a child that dies with us and ends after CHILD_TIMEOUT_S at most. */
static pid_t fork_child(void)
{
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		alarm(CHILD_TIMEOUT_S);
	}
	return pid;
}

/* Runs fn in a child; its result (len bytes at out) comes back through a pipe. 0 or -1. */
static int in_child(int (*fn)(const struct options *, void *), const struct options *o, void *out,
		    size_t len)
{
	int fds[2];
	if (pipe(fds) != 0)
		return -1;
	pid_t pid = fork_child();
	if (pid < 0)
		return -1;
	if (pid == 0) {
		close(fds[0]);
		int rc = fn(o, out);
		if (rc == 0 && write(fds[1], out, len) != (ssize_t)len)
			rc = 1;
		fflush(NULL);
		_exit(rc);
	}
	close(fds[1]);
	int got = read_within(fds[0], out, len, CHILD_TIMEOUT_S * 1000);
	close(fds[0]);
	int status = 0;
	if (got != 0)
		kill(pid, SIGKILL);
	waitpid(pid, &status, 0);
	return got == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1;
}

/* ---- the tiny job --------------------------------------------------------------------- */

/* Two buffers a and b ([ROWS, COLS] bf16) and gamma, in one allocation; a -> b and b -> a. */
struct tiny {
	nc_conn *conn;
	cudaStream_t stream;
	char *base;
	struct nc_job job[2];          /* [0]: a -> b, [1]: b -> a */
	struct nk_norm_args args[2];   /* the same, in-process */
};

#define TENSOR_BYTES ((size_t)ROWS * COLS * 2)

static int tiny_upload(char *base)
{
	static uint16_t host[2 * ROWS * COLS + COLS];
	uint64_t s = 0x2545f4914f6cdd1dull;
	for (size_t i = 0; i < sizeof(host) / 2; i++) {
		s ^= s << 13;
		s ^= s >> 7;
		s ^= s << 17;
		double u = (double)(s >> 11) / 9007199254740992.0;
		bool weight = i >= 2 * ROWS * COLS;
		nk_store(NK_BF16, host, i, weight ? 0.8 + 0.4 * u : 4 * u - 2);
	}
	return cudaMemcpy(base, host, sizeof(host), cudaMemcpyHostToDevice) == cudaSuccess &&
			       cudaDeviceSynchronize() == cudaSuccess
		       ? 0
		       : -1;
}

static int tiny_open(struct tiny *t, const struct options *o, const char *name)
{
	memset(t, 0, sizeof(*t));
	if (cudaMalloc((void **)&t->base, 2 * TENSOR_BYTES + COLS * 2) != cudaSuccess ||
	    tiny_upload(t->base) != 0 ||
	    cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking) != cudaSuccess) {
		fprintf(stderr, "bench_enqueue: CUDA set-up failed\n");
		return -1;
	}
	if (nc_connect(o->socket, name, 10000, &t->conn) != NC_OK) {
		fprintf(stderr, "bench_enqueue: connect %s: %s\n", o->socket, nc_last_error());
		return -1;
	}
	char *buf[2] = {t->base, t->base + TENSOR_BYTES}, *gamma = t->base + 2 * TENSOR_BYTES;
	for (int i = 0; i < 2; i++) {
		struct nc_job *j = &t->job[i];
		*j = (struct nc_job){.op = NC_RMSNORM_FWD, .rows = ROWS, .cols = COLS,
				     .eps = 1e-5f, .dtype = NC_BF16};
		if (nc_tensor_device(t->conn, buf[i], &j->x) ||
		    nc_tensor_device(t->conn, buf[1 - i], &j->y) ||
		    nc_tensor_device(t->conn, gamma, &j->gamma)) {
			fprintf(stderr, "bench_enqueue: register: %s\n", nc_last_error());
			return -1;
		}
		t->args[i] = (struct nk_norm_args){.op = NK_RMSNORM_FWD, .rows = ROWS, .cols = COLS,
						   .eps = 1e-5f, .dtype = NK_BF16,
						   .weight_dtype = NK_BF16, .x = buf[i],
						   .y = buf[1 - i], .gamma = gamma};
	}
	return 0;
}

static void tiny_close(struct tiny *t)
{
	cudaStreamSynchronize(t->stream);
	nc_close(t->conn);
	cudaStreamDestroy(t->stream);
	cudaFree(t->base);
}

static int enqueue_failed(const char *what, int rc)
{
	fprintf(stderr, "bench_enqueue: %s: %s (%s)\n", what, nc_status_name(rc), nc_last_error());
	return 1;
}

/* ---- 1. host cost per call --------------------------------------------------------------- */

static int time_enqueue_calls(struct tiny *t, int calls, double *samples)
{
	for (int i = -2048; i < calls; i++) {
		if (i % 256 == 0)
			cudaStreamSynchronize(t->stream); /* keeps the queue short; not timed */
		double t0 = now_us();
		int rc = nc_job_enqueue(t->conn, &t->job[0], t->stream);
		double t1 = now_us();
		if (rc != NC_OK)
			return enqueue_failed("nc_job_enqueue", rc);
		if (i >= 0)
			samples[i] = t1 - t0;
	}
	cudaStreamSynchronize(t->stream);
	int rc = nc_conn_check(t->conn, 10000);
	return rc == NC_OK ? 0 : enqueue_failed("nc_conn_check", rc);
}

static int time_sync_calls(struct tiny *t, int calls, double *samples, char *variant)
{
	struct nc_job_result r;
	for (int i = -500; i < calls; i++) {
		double t0 = now_us();
		int rc = nc_job_run_on_stream(t->conn, &t->job[0], t->stream, 10000, &r);
		double t1 = now_us();
		if (rc != NC_OK) {
			fprintf(stderr, "bench_enqueue: sync job: %s\n", r.message);
			return 1;
		}
		if (i >= 0)
			samples[i] = t1 - t0;
	}
	snprintf(variant, 64, "%s", r.variant);
	return 0;
}

static int host_cost_child(const struct options *o, void *out)
{
	struct host_cost *h = out;
	struct tiny t;
	if (tiny_open(&t, o, "bench-enqueue-host") != 0)
		return 1;
	h->daemon_mps = nc_server_info(t.conn)->mps;
	h->client_mps = nk_cuda_mps_enabled(0) == 1;
	double *samples = malloc(sizeof(double) * (size_t)o->calls);
	if (!samples || time_enqueue_calls(&t, o->calls, samples) != 0)
		return 1;
	h->enqueue = summarize(samples, o->calls);
	if (o->sync) {
		if (time_sync_calls(&t, o->calls, samples, h->variant) != 0)
			return 1;
		h->sync = summarize(samples, o->calls);
	}
	free(samples);
	tiny_close(&t);
	return 0;
}

/* ---- 2. the dependent chain --------------------------------------------------------------------
 */

static void device_info(struct nk_device_info *dev)
{
	struct cudaDeviceProp prop;
	cudaGetDeviceProperties(&prop, 0);
	memset(dev, 0, sizeof(*dev));
	dev->sm_count = prop.multiProcessorCount;
	dev->max_threads_per_sm = prop.maxThreadsPerMultiProcessor;
	dev->max_smem_per_block_optin = prop.sharedMemPerBlockOptin;
	dev->cc_major = prop.major;
	dev->cc_minor = prop.minor;
}

/* How the chain's jobs are launched. */
enum chain_kind { VIA_ENQUEUE, IN_PROCESS };

struct chain_ctx {
	struct tiny t;
	enum chain_kind kind;
	struct nk_device_info dev;
	struct nk_variant variant;
	struct nk_cuda_exec exec;
	uint32_t *gate;            /* device word the stream waits on before each segment */
	uint32_t gate_value;
	cudaStream_t gate_stream;  /* opens the gate */
};

/* Job k of the chain: x_k = y_{k-1}. */
static int chain_launch(struct chain_ctx *c, int k)
{
	if (c->kind == IN_PROCESS)
		return nk_cuda_norm(&c->t.args[k % 2], &c->dev, &c->variant, &c->exec, NULL) ==
			       NK_OK
			   ? 0
			   : -1;
	int rc = nc_job_enqueue(c->t.conn, &c->t.job[k % 2], c->t.stream);
	return rc == NC_OK ? 0 : enqueue_failed("chain nc_job_enqueue", rc);
}

/*
 * The chain in gated segments: the stream waits on the gate, every job of
 * the segment is queued (enqueued: sent to the daemon, which launches each
 * once the stream reaches it), then the gate opens; events around each
 * segment give GPU time only. *host_us gets the launch calls' own time per job.
 */
static int chain_gated(struct chain_ctx *c, int jobs, int segment, double *gpu_us, double *host_us)
{
	int segs = (jobs + segment - 1) / segment;
	double gpu_ms = 0, host = 0;
	for (int s = 0, k = 0; s < segs; s++) {
		cudaEvent_t ev[2];
		if (cudaEventCreate(&ev[0]) != cudaSuccess ||
		    cudaEventCreate(&ev[1]) != cudaSuccess ||
		    nk_cuda_stream_wait(c->t.stream, c->gate, ++c->gate_value) != 0)
			return -1;
		cudaEventRecord(ev[0], c->t.stream);
		double t0 = now_us();
		for (int end = k + segment < jobs ? k + segment : jobs; k < end; k++)
			if (chain_launch(c, k) != 0)
				return -1;
		host += now_us() - t0;
		cudaEventRecord(ev[1], c->t.stream);
		/* The daemon launches each job once the stream reaches it (its ready word). */
		if (nk_cuda_stream_write(c->gate_stream, c->gate, NULL, c->gate_value) != 0 ||
		    cudaStreamSynchronize(c->t.stream) != cudaSuccess)
			return -1;
		int rc = c->kind == VIA_ENQUEUE ? nc_conn_check(c->t.conn, 30000) : NC_OK;
		if (rc != NC_OK)
			return enqueue_failed("nc_conn_check", rc);
		float ms = 0;
		cudaEventElapsedTime(&ms, ev[0], ev[1]);
		gpu_ms += ms;
		cudaEventDestroy(ev[0]);
		cudaEventDestroy(ev[1]);
	}
	*gpu_us = gpu_ms * 1e3 / jobs;
	*host_us = host / jobs;
	return 0;
}

/*
 * The chain with no gate (host and GPU overlap): per job, the wall time from
 * the first launch to the stream idle, and the CUDA events' span around the
 * whole chain on the stream.
 */
static int chain_ungated(struct chain_ctx *c, int jobs, double *wall_us, double *span_us)
{
	cudaEvent_t ev[2];
	if (cudaStreamSynchronize(c->t.stream) != cudaSuccess ||
	    cudaEventCreate(&ev[0]) != cudaSuccess || cudaEventCreate(&ev[1]) != cudaSuccess)
		return -1;
	double t0 = now_us();
	cudaEventRecord(ev[0], c->t.stream);
	for (int k = 0; k < jobs; k++)
		if (chain_launch(c, k) != 0)
			return -1;
	cudaEventRecord(ev[1], c->t.stream);
	if (cudaStreamSynchronize(c->t.stream) != cudaSuccess)
		return -1;
	*wall_us = (now_us() - t0) / jobs;
	float ms = 0;
	cudaEventElapsedTime(&ms, ev[0], ev[1]);
	*span_us = ms * 1e3 / jobs;
	cudaEventDestroy(ev[0]);
	cudaEventDestroy(ev[1]);
	return 0;
}

static int chain_sync_mode(struct chain_ctx *c, int jobs, double *wall_us)
{
	struct nc_job_result r;
	double t0 = now_us();
	for (int k = 0; k < jobs; k++) {
		if (nc_job_run_on_stream(c->t.conn, &c->t.job[k % 2], c->t.stream, 10000, &r) !=
		    NC_OK) {
			fprintf(stderr, "bench_enqueue: sync chain: %s\n", r.message);
			return -1;
		}
	}
	*wall_us = (now_us() - t0) / jobs;
	return 0;
}

static int chain_setup(struct chain_ctx *c, const struct options *o)
{
	memset(c, 0, sizeof(*c));
	if (tiny_open(&c->t, o, "bench-enqueue-chain") != 0)
		return -1;
	device_info(&c->dev);
	nk_cuda_variant_default(&c->t.args[0], &c->dev, &c->variant);
	size_t ws = nk_cuda_workspace_bytes(&c->t.args[0], &c->dev, &c->variant);
	c->exec = (struct nk_cuda_exec){c->t.stream, NULL, ws, NULL};
	if (cudaMalloc(&c->exec.workspace, ws ? ws : 16) != cudaSuccess ||
	    cudaMalloc((void **)&c->gate, 4) != cudaSuccess ||
	    cudaMemset(c->gate, 0, 4) != cudaSuccess ||
	    cudaStreamCreateWithFlags(&c->gate_stream, cudaStreamNonBlocking) != cudaSuccess ||
	    cudaDeviceSynchronize() != cudaSuccess)
		return -1;
	return 0;
}

static int chain_child(const struct options *o, void *out)
{
	struct chain_cost *r = out;
	struct chain_ctx c;
	if (chain_setup(&c, o) != 0)
		return 1;
	/*
	 * A gated segment must fit under the daemon's in-flight limit (else the
	 * calls block) and under a stream's queue of pending launches.
	 */
	uint32_t limit = nc_server_info(c.t.conn)->max_jobs_in_flight;
	r->jobs = o->chain;
	r->segment = limit / 2 < 256 ? (int)(limit / 2) : 256;
	if (r->segment < 1)
		r->segment = 1;
	double ignored;
	int rc = 0;
	for (int kind = IN_PROCESS; kind >= VIA_ENQUEUE && rc == 0; kind--) {
		c.kind = (enum chain_kind)kind;
		bool enq = kind == VIA_ENQUEUE;
		rc = chain_gated(&c, r->segment, r->segment, &ignored, &ignored); /* warm-up */
		if (rc == 0)
			rc = chain_gated(&c, o->chain, r->segment,
					 enq ? &r->enqueue_gpu_us : &r->inproc_gpu_us,
					 enq ? &r->enqueue_host_us : &ignored);
		if (rc == 0)
			rc = chain_ungated(&c, o->chain,
					   enq ? &r->enqueue_wall_us : &r->inproc_wall_us,
					   enq ? &r->enqueue_span_us : &r->inproc_span_us);
	}
	if (rc == 0 && o->sync)
		rc = chain_sync_mode(&c, o->chain, &r->sync_wall_us);
	if (rc != 0) {
		fprintf(stderr, "bench_enqueue: chain failed (%s)\n",
			cudaGetErrorString(cudaGetLastError()));
		return 1;
	}
	cudaFree(c.exec.workspace);
	cudaFree(c.gate);
	cudaStreamDestroy(c.gate_stream);
	tiny_close(&c.t);
	return 0;
}

/* ---- 3. aggregate rate ------------------------------------------------------------------------
 */

/* One process: warm up, say ready, wait for the start (EOF on go_fd), run for o->seconds. */
static int rate_process(const struct options *o, bool sync_mode, int ready_fd, int go_fd,
			int out_fd)
{
	struct tiny t;
	struct proc_result res = {0};
	struct nc_job_result r;
	if (tiny_open(&t, o, sync_mode ? "bench-rate-sync" : "bench-rate-enqueue") != 0)
		return 1;
	for (int i = 0; i < 256; i++)
		nc_job_enqueue(t.conn, &t.job[0], t.stream);
	cudaStreamSynchronize(t.stream);
	char byte;
	if (nc_conn_check(t.conn, 10000) != NC_OK || write(ready_fd, "r", 1) != 1 ||
	    read(go_fd, &byte, 1) != 0)
		return 1;
	double t0 = now_us(), end = t0 + o->seconds * 1e6;
	while (res.status == 0 && now_us() < end) {
		if (sync_mode) {
			res.status = nc_job_run_on_stream(t.conn, &t.job[0], t.stream, 10000, &r);
		} else {
			res.status = nc_job_enqueue(t.conn, &t.job[0], t.stream);
			if (res.jobs % 512 == 511)
				cudaStreamSynchronize(t.stream);
		}
		res.jobs += res.status == NC_OK;
	}
	cudaStreamSynchronize(t.stream);
	res.seconds = (now_us() - t0) / 1e6;
	if (res.status == 0 && !sync_mode)
		res.status = nc_conn_check(t.conn, 10000);
	if (res.status != 0)
		fprintf(stderr, "bench_enqueue: rate process: %s (%s)\n",
			nc_status_name(res.status), nc_last_error());
	tiny_close(&t);
	return write(out_fd, &res, sizeof(res)) == sizeof(res) ? 0 : 1;
}

/* Starts `procs` processes together; their summed rate, and the slowest one's, in jobs/s. */
static int rate_run(const struct options *o, int procs, bool sync_mode, double *total,
		    double *slowest)
{
	int ready[2], go[2], out[2];
	pid_t pids[64];
	if (procs > 64 || pipe(ready) || pipe(go) || pipe(out))
		return -1;
	for (int p = 0; p < procs; p++) {
		pids[p] = fork_child();
		if (pids[p] == 0) {
			close(ready[0]);
			close(go[1]);
			close(out[0]);
			int rc = rate_process(o, sync_mode, ready[1], go[0], out[1]);
			fflush(NULL);
			_exit(rc);
		}
	}
	close(ready[1]);
	close(go[0]);
	close(out[1]);
	char bytes[64];
	int rc = read_within(ready[0], bytes, (size_t)procs, 120000);
	close(go[1]); /* EOF: every process starts now */
	*total = 0;
	*slowest = 1e30;
	double longest = 0;
	for (int p = 0; p < procs && rc == 0; p++) {
		struct proc_result res;
		rc = read_within(out[0], &res, sizeof(res), (int)(o->seconds * 1000) + 60000);
		if (rc == 0 && res.status != 0)
			rc = -1;
		if (rc == 0) {
			*total += (double)res.jobs;
			longest = res.seconds > longest ? res.seconds : longest;
			double own = (double)res.jobs / res.seconds;
			*slowest = own < *slowest ? own : *slowest;
		}
	}
	*total = longest > 0 ? *total / longest : 0;
	for (int p = 0; p < procs; p++) {
		if (rc != 0)
			kill(pids[p], SIGKILL);
		waitpid(pids[p], NULL, 0);
	}
	close(ready[0]);
	close(out[0]);
	return rc;
}

/* ---- output ------------------------------------------------------------------------------------
 */

static void print_table(const struct options *o, const struct host_cost *h,
			const struct chain_cost *c, const struct rate *rates, int nrates)
{
	printf("tiny job: RMSNorm fwd, rows=%d, cols=%d, bf16, gamma; normd MPS: %s, client MPS: "
	       "%s\n",
	       ROWS, COLS, h->daemon_mps ? "yes" : "no", h->client_mps ? "yes" : "no");
	printf("\n1. host cost per call (%d calls each)\n", o->calls);
	printf("%-40s %9s %9s %9s %9s\n", "call", "p50_us", "p99_us", "mean_us", "max_us");
	printf("%-40s %9.2f %9.2f %9.2f %9.1f\n", "nc_job_enqueue", h->enqueue.p50, h->enqueue.p99,
	       h->enqueue.mean, h->enqueue.max);
	if (o->sync)
		printf("%-40s %9.2f %9.2f %9.2f %9.1f\n", "nc_job_run_on_stream (whole job)",
		       h->sync.p50, h->sync.p99, h->sync.mean, h->sync.max);
	printf("\n2. dependent chain of %d jobs (x_k+1 = y_k), per job\n", c->jobs);
	printf("%-52s %9s\n", "measurement", "us/job");
	printf("%-52s %9.2f\n", "enqueue, GPU time (gated segments, CUDA events)",
	       c->enqueue_gpu_us);
	printf("%-52s %9.2f\n", "in-process nk_cuda_norm, GPU time (same gating)",
	       c->inproc_gpu_us);
	printf("%-52s %9.2f\n", "  difference (enqueue - in-process)",
	       c->enqueue_gpu_us - c->inproc_gpu_us);
	printf("%-52s %9.2f\n", "enqueue, host time per call inside the chain", c->enqueue_host_us);
	printf("%-52s %9.2f\n", "enqueue, ungated, CUDA events around the chain",
	       c->enqueue_span_us);
	printf("%-52s %9.2f\n", "in-process, ungated, CUDA events around the chain",
	       c->inproc_span_us);
	printf("%-52s %9.2f\n", "enqueue, ungated wall time (first call to idle)",
	       c->enqueue_wall_us);
	printf("%-52s %9.2f\n", "in-process, ungated wall time", c->inproc_wall_us);
	if (o->sync)
		printf("%-52s %9.2f\n", "sync mode (nc_job_run_on_stream), wall time",
		       c->sync_wall_us);
	printf("(gated segments of %d jobs: the stream waits until all of them are queued)\n",
	       c->segment);
	printf(
	    "\n3. aggregate rate, %.1f s per run (enqueue: stream synchronized every 512 jobs)\n",
	    o->seconds);
	printf("%-6s %16s %18s %16s %18s\n", "procs", "enqueue jobs/s", "slowest proc /s",
	       o->sync ? "sync jobs/s" : "", o->sync ? "slowest proc /s" : "");
	for (int i = 0; i < nrates; i++) {
		printf("%-6d %16.0f %18.0f", rates[i].procs, rates[i].enqueue_jobs_s,
		       rates[i].enqueue_min_s);
		if (o->sync)
			printf(" %16.0f %18.0f", rates[i].sync_jobs_s, rates[i].sync_min_s);
		printf("\n");
	}
}

static void json_summary(FILE *f, const char *name, const struct summary *s)
{
	fprintf(f,
		"\"%s\": {\"p50_us\": %.3f, \"p99_us\": %.3f, \"mean_us\": %.3f, \"max_us\": %.3f}",
		name, s->p50, s->p99, s->mean, s->max);
}

static void write_json(const struct options *o, const struct host_cost *h,
		       const struct chain_cost *c, const struct rate *rates, int nrates)
{
	FILE *f = strcmp(o->json, "-") == 0 ? stdout : fopen(o->json, "w");
	if (!f) {
		fprintf(stderr, "bench_enqueue: %s: %s\n", o->json, strerror(errno));
		return;
	}
	fprintf(f,
		"{\"job\": {\"op\": \"rmsnorm_fwd\", \"rows\": %d, \"cols\": %d, \"dtype\": "
		"\"bf16\"},\n \"daemon_mps\": %s, \"client_mps\": %s,\n \"host_cost\": {\"calls\": "
		"%d, ",
		ROWS, COLS, h->daemon_mps ? "true" : "false", h->client_mps ? "true" : "false",
		o->calls);
	json_summary(f, "enqueue", &h->enqueue);
	if (o->sync) {
		fprintf(f, ", ");
		json_summary(f, "sync", &h->sync);
	}
	fprintf(f, "},\n \"chain\": {\"jobs\": %d, \"segment\": %d, \"enqueue_gpu_us\": %.3f, "
		   "\"inproc_gpu_us\": %.3f, \"enqueue_host_us\": %.3f, \"enqueue_wall_us\": %.3f, "
		   "\"inproc_wall_us\": %.3f, \"enqueue_span_us\": %.3f, \"inproc_span_us\": %.3f",
		c->jobs, c->segment, c->enqueue_gpu_us, c->inproc_gpu_us, c->enqueue_host_us,
		c->enqueue_wall_us, c->inproc_wall_us, c->enqueue_span_us, c->inproc_span_us);
	if (o->sync)
		fprintf(f, ", \"sync_wall_us\": %.3f", c->sync_wall_us);
	fprintf(f, "},\n \"rate\": [");
	for (int i = 0; i < nrates; i++) {
		fprintf(f, "%s{\"procs\": %d, \"seconds\": %.2f, \"enqueue_jobs_s\": %.0f, "
			   "\"enqueue_slowest_proc_jobs_s\": %.0f",
			i ? ", " : "", rates[i].procs, o->seconds, rates[i].enqueue_jobs_s,
			rates[i].enqueue_min_s);
		if (o->sync)
			fprintf(f, ", \"sync_jobs_s\": %.0f, \"sync_slowest_proc_jobs_s\": %.0f",
				rates[i].sync_jobs_s, rates[i].sync_min_s);
		fprintf(f, "}");
	}
	fprintf(f, "]}\n");
	if (f != stdout)
		fclose(f);
}

/* ---- main -------------------------------------------------------------------------------------
 */

static int usage(void)
{
	fprintf(stderr, "usage: bench_enqueue [--socket PATH] [--json FILE|-] [--calls N] "
			"[--chain N] [--seconds S] [--procs 1,4,16] [--no-sync] "
			"[-- normd options...]\n");
	return 2;
}

static int parse_procs(struct options *o, const char *list)
{
	char *copy = strdup(list), *save = NULL;
	o->nprocs = 0;
	for (char *p = strtok_r(copy, ",", &save); p && o->nprocs < MAX_PROCS;
	     p = strtok_r(NULL, ",", &save)) {
		int n = atoi(p);
		if (n < 1 || n > 64) {
			free(copy);
			return -1;
		}
		o->procs[o->nprocs++] = n;
	}
	free(copy);
	return o->nprocs ? 0 : -1;
}

static int parse(struct options *o, int argc, char **argv)
{
	*o = (struct options){.calls = 20000, .chain = 2000, .seconds = 2.0, .sync = true,
			      .procs = {1, 4, 16}, .nprocs = 3};
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (strcmp(a, "--") == 0) {
			o->daemon_args = (const char *const *)argv + i + 1;
			return 0;
		}
		if (strcmp(a, "--no-sync") == 0) {
			o->sync = false;
			continue;
		}
		if (!v)
			return -1;
		i++;
		if (strcmp(a, "--socket") == 0)
			o->socket = v;
		else if (strcmp(a, "--json") == 0)
			o->json = v;
		else if (strcmp(a, "--calls") == 0)
			o->calls = atoi(v);
		else if (strcmp(a, "--chain") == 0)
			o->chain = atoi(v);
		else if (strcmp(a, "--seconds") == 0)
			o->seconds = atof(v);
		else if (strcmp(a, "--procs") != 0 || parse_procs(o, v) != 0)
			return -1;
	}
	return o->calls >= 100 && o->chain >= 1 && o->seconds > 0 ? 0 : -1;
}

/* Without $NORMD_BIN, the normd of this build: bench/../bin/normd beside this program. */
static void find_normd(const char *argv0)
{
	char path[4096];
	const char *slash = strrchr(argv0, '/');
	if (getenv("NORMD_BIN") || !slash)
		return;
	snprintf(path, sizeof(path), "%.*s/../bin/normd", (int)(slash - argv0), argv0);
	if (access(path, X_OK) == 0)
		setenv("NORMD_BIN", path, 1);
}

static int measure(const struct options *o, struct host_cost *h, struct chain_cost *c,
		   struct rate *rates)
{
	if (in_child(host_cost_child, o, h, sizeof(*h)) != 0) {
		fprintf(stderr, "bench_enqueue: the host-cost measurement failed\n");
		return -1;
	}
	if (in_child(chain_child, o, c, sizeof(*c)) != 0) {
		fprintf(stderr, "bench_enqueue: the chain measurement failed\n");
		return -1;
	}
	for (int i = 0; i < o->nprocs; i++) {
		rates[i].procs = o->procs[i];
		if (rate_run(o, o->procs[i], false, &rates[i].enqueue_jobs_s,
			     &rates[i].enqueue_min_s) != 0 ||
		    (o->sync && rate_run(o, o->procs[i], true, &rates[i].sync_jobs_s,
					 &rates[i].sync_min_s) != 0)) {
			fprintf(stderr, "bench_enqueue: the rate with %d processes failed\n",
				o->procs[i]);
			return -1;
		}
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct options o;
	if (parse(&o, argc, argv) != 0)
		return usage();
	signal(SIGPIPE, SIG_IGN);
	struct test_daemon d;
	bool own = !o.socket;
	if (own) {
		find_normd(argv[0]);
		if (test_daemon_start_on(&d, "0", o.daemon_args) != 0) {
			fprintf(stderr,
				"bench_enqueue: cannot start normd --device 0 (set NORMD_BIN)\n");
			return 1;
		}
		o.socket = d.socket;
	}
	struct host_cost h = {0};
	struct chain_cost c = {0};
	struct rate rates[MAX_PROCS] = {{0}};
	int rc = measure(&o, &h, &c, rates);
	if (own) {
		if (rc != 0)
			test_daemon_dump_log(&d);
		test_daemon_stop(&d);
	}
	if (rc != 0)
		return 1;
	print_table(&o, &h, &c, rates, o.nprocs);
	if (o.json)
		write_json(&o, &h, &c, rates, o.nprocs);
	return 0;
}
