/*
 * The enqueue completion mode on the CUDA backend (run on the GPU machine by
 * `make test-gpu`): nc_job_enqueue() orders a job with the caller's stream
 * through a semaphore slot, and nobody waits on the host. Checked here:
 *   1. every op, dtype and a few awkward shapes, enqueued in batches on a
 *      non-blocking stream, against the float64 reference;
 *   2. a dependent chain of 200 RMSNorm forwards (x of each job is y of the
 *      previous one) with no host wait, against the same chain in double;
 *   3. ordering with the caller's own copies and memsets between jobs;
 *   4. an asynchronous error (cols past the daemon's --max-cols): the stream
 *      is still released, the outputs are poisoned, the error comes back from
 *      nc_conn_check() or a later nc_job_enqueue(), and later jobs work;
 *   5. a silent client (its stream never writes the ready word) stalls no
 *      one else, and its jobs end once it is killed;
 *   6. the daemon SIGKILLed mid-chain: the caller's stream is released within
 *      a second and the connection reports NC_EDISCONNECTED; and again with
 *      48 streams of one client waiting (more than its hardware queues);
 *   7. a client SIGKILLed with work enqueued: the daemon's device memory
 *      comes back and the other clients keep working;
 *   8. nc_job_enqueue_device: jobs named by device pointers, and pool
 *      memory refused with the tensor named.
 *
 * Every CUDA call happens in a child process (a process that has touched
 * CUDA cannot fork children that use it); the processes that coordinate
 * (tests 5 to 7) stay CUDA-free themselves. Each test sets an alarm, so a
 * hang fails that test instead of blocking the run.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "kernels/cuda_driver.h"
#include "normclient.h"
#include "tests/gpu/gpu_test.h"
#include "tests/support/enqueue_chain.h"
#include "tests/support/testlib.h"

static struct test_daemon daemon_;

static nc_conn *connect_daemon(const char *name)
{
	return gpu_test_connect(daemon_.socket, name);
}

static int64_t now_ns(void)
{
	return enqueue_chain_now_ns(); /* system-wide: comparable between processes */
}

static double ms_since(int64_t start_ns)
{
	return (double)(now_ns() - start_ns) / 1e6;
}

/* Deterministic values in [lo, hi). */
static double uniform(uint64_t *state, double lo, double hi)
{
	*state ^= *state << 13;
	*state ^= *state >> 7;
	*state ^= *state << 17;
	return lo + (hi - lo) * (double)(*state >> 11) / 9007199254740992.0;
}

static void fill_f32(float *v, size_t n, uint64_t seed, double lo, double hi)
{
	uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
	for (size_t i = 0; i < n; i++)
		v[i] = (float)uniform(&s, lo, hi);
}

/* Runs fn in a child process that an alarm ends after `seconds`; returns its status. */
static int in_child_timed(int (*fn)(void *), void *arg, unsigned seconds)
{
	fflush(NULL);
	pid_t pid = fork();
	if (pid < 0)
		return 127;
	if (pid == 0) {
		alarm(seconds);
		child_exit(fn(arg));
	}
	int status;
	if (waitpid(pid, &status, 0) != pid)
		return 127;
	if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM)
		fprintf(stderr, "  timed out after %u s\n", seconds);
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* A helper process that dies with its parent (a test ended by its alarm leaves none behind). */
static pid_t fork_helper(void)
{
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0)
		prctl(PR_SET_PDEATHSIG, SIGKILL);
	return pid;
}

/* Polls the daemon at `socket_path` until it runs no jobs; the milliseconds it took, or -1. */
static double wait_no_jobs(const char *socket_path, int timeout_ms)
{
	int64_t start = now_ns();
	struct nc_stats stats;
	while (ms_since(start) < timeout_ms) {
		if (gpu_test_stats(socket_path, &stats) == 0 && stats.jobs_in_flight == 0)
			return ms_since(start);
		usleep(20 * 1000);
	}
	return -1;
}

/* RMSNorm forward of one row in double: y = x * rstd * gamma (gamma NULL: 1). */
static double rms_row_ref(const double *x, const double *gamma, double *y, size_t cols, double eps)
{
	double sum = 0;
	for (size_t c = 0; c < cols; c++)
		sum += x[c] * x[c];
	double rstd = 1.0 / sqrt(sum / (double)cols + eps);
	for (size_t c = 0; c < cols; c++)
		y[c] = x[c] * rstd * (gamma ? gamma[c] : 1.0);
	return rstd;
}

/* ||got - want|| / ||want|| over n values. */
static double rel_l2(const float *got, const double *want, size_t n)
{
	double err = 0, ref = 0;
	for (size_t i = 0; i < n; i++) {
		double d = (double)got[i] - want[i];
		err += d * d;
		ref += want[i] * want[i];
	}
	return ref > 0 ? sqrt(err / ref) : sqrt(err);
}

/* ---- 1. every op against the reference ----------------------------------------------- */

enum { SHAPES = 6, VARIANTS = 5 };
static const uint64_t shapes[SHAPES][2] = {{1, 1},     {7, 33},   {33, 1000},
					   {5, 4096},  {3, 12288}, {130, 257}};

/* Variant v: 0 plain, 1 affine, 2 affine with fp32 weights, 3 memory-efficient, 4 accumulate. */
static struct jobkit_spec every_op_spec(int op, int dt, int s, int v, uint64_t seed)
{
	bool bwd = op == NC_LAYERNORM_BWD || op == NC_RMSNORM_BWD;
	struct jobkit_spec spec = {
		.op = (enum nc_op)op, .rows = shapes[s][0], .cols = shapes[s][1],
		.dtype = (enum nc_dtype)dt, .weight_dtype = v == 2 ? NC_F32 : 0,
		.gamma = v != 0, .beta = v != 0, .memory_efficient = bwd && v == 3,
		.accumulate = bwd && v == 4, .seed = seed, .on_device = true,
	};
	return spec;
}

/* One op and dtype: every kit created, all enqueued, one stream synchronize, then checked. */
static int every_op_batch(nc_conn *conn, cudaStream_t stream, int op, int dt, uint64_t *seed,
			  int *jobs)
{
	struct jobkit kits[SHAPES * VARIANTS];
	bool bwd = op == NC_LAYERNORM_BWD || op == NC_RMSNORM_BWD;
	int n = 0, bad = 0;
	for (int s = 0; s < SHAPES; s++) {
		for (int v = 0; v < (bwd ? VARIANTS : 3); v++) {
			struct jobkit_spec spec = every_op_spec(op, dt, s, v, (*seed)++);
			if (jobkit_create(conn, &spec, &kits[n]) != 0) {
				fprintf(stderr, "  set-up: %s\n", nc_last_error());
				bad++;
				continue;
			}
			n++;
		}
	}
	for (int i = 0; i < n; i++) {
		int rc = nc_job_enqueue(conn, &kits[i].job, stream);
		if (rc != NC_OK) {
			fprintf(stderr, "  enqueue %s: %s\n", nc_status_name(rc), nc_last_error());
			bad++;
		}
	}
	cudaError_t err = cudaStreamSynchronize(stream);
	int rc = nc_conn_check(conn, 30000);
	if (err != cudaSuccess || rc != NC_OK) {
		fprintf(stderr, "  stream: %s; check: %s (%s)\n", cudaGetErrorString(err),
			nc_status_name(rc), nc_last_error());
		bad++;
	}
	for (int i = 0; i < n; i++) {
		struct jobkit_report rep = {0};
		const struct jobkit_spec *sp = &kits[i].spec;
		if (!jobkit_check(&kits[i], &rep)) {
			fprintf(stderr, "  %s %llux%llu %s wdt %d me %d acc %d: %s\n",
				jobkit_op_name(sp->op), (unsigned long long)sp->rows,
				(unsigned long long)sp->cols, jobkit_dtype_name(sp->dtype),
				sp->weight_dtype, sp->memory_efficient, sp->accumulate, rep.detail);
			bad++;
		}
		jobkit_destroy(&kits[i]);
	}
	*jobs += n;
	return bad;
}

static int every_op(void *arg)
{
	(void)arg;
	nc_conn *conn = connect_daemon("enqueue-every-op");
	CHECK(conn, "no connection");
	cudaStream_t stream;
	CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
	uint64_t seed = 1;
	int bad = 0, jobs = 0;
	int64_t start = now_ns();
	for (int op = NC_LAYERNORM_FWD; op <= NC_RMSNORM_BWD; op++)
		for (int dt = NC_F32; dt <= NC_BF16; dt++)
			bad += every_op_batch(conn, stream, op, dt, &seed, &jobs);
	printf("  %d jobs enqueued in 12 batches (%.0f ms with set-up), %d wrong\n", jobs,
	       ms_since(start), bad);
	cudaStreamDestroy(stream);
	nc_close(conn);
	CHECK(bad == 0, "%d jobs or batches wrong", bad);
	return 0;
}

/* ---- 2. a dependent chain ---------------------------------------------------------------- */

enum { CHAIN = 200, CHAIN_ROWS = 5, CHAIN_COLS = 1536 };

/* The chain on the host in double, from the same fp32 input and gamma. */
static void chain_reference(const float *x0, const float *gamma, double *out)
{
	static double cur[CHAIN_ROWS * CHAIN_COLS], g[CHAIN_COLS];
	for (size_t i = 0; i < CHAIN_ROWS * CHAIN_COLS; i++)
		cur[i] = x0[i];
	for (size_t c = 0; c < CHAIN_COLS; c++)
		g[c] = gamma[c];
	for (int k = 0; k < CHAIN; k++) {
		for (size_t r = 0; r < CHAIN_ROWS; r++)
			rms_row_ref(cur + r * CHAIN_COLS, g, out + r * CHAIN_COLS, CHAIN_COLS,
				    1e-5);
		memcpy(cur, out, sizeof(cur));
	}
}

/*
 * gamma = 1 +- 0.002: a step skipped, repeated or raced changes the result by
 * about 1e-3 (relative L2), ten times the tolerance, while fp32 rounding over
 * 200 steps stays near 1e-6.
 */
static int dependent_chain(void *arg)
{
	(void)arg;
	const size_t n = CHAIN_ROWS * CHAIN_COLS, bytes = n * sizeof(float);
	static float x0[CHAIN_ROWS * CHAIN_COLS], gamma[CHAIN_COLS], got[CHAIN_ROWS * CHAIN_COLS];
	static double want[CHAIN_ROWS * CHAIN_COLS];
	fill_f32(x0, n, 7, -1, 1);
	fill_f32(gamma, CHAIN_COLS, 8, 0.998, 1.002);
	nc_conn *conn = connect_daemon("enqueue-chain");
	CHECK(conn, "no connection");
	char *base = NULL;
	cudaStream_t stream;
	CHECK(cudaMalloc((void **)&base, 2 * bytes + sizeof(gamma)) == cudaSuccess &&
		      cudaMemcpy(base, x0, bytes, cudaMemcpyHostToDevice) == cudaSuccess &&
		      cudaMemset(base + bytes, 0, bytes) == cudaSuccess &&
		      cudaMemcpy(base + 2 * bytes, gamma, sizeof(gamma), cudaMemcpyHostToDevice) ==
			      cudaSuccess &&
		      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
		      cudaDeviceSynchronize() == cudaSuccess,
	      "cuda set-up");
	struct nc_tensor buf[2], g;
	CHECK(nc_tensor_device(conn, base, &buf[0]) == NC_OK &&
		      nc_tensor_device(conn, base + bytes, &buf[1]) == NC_OK &&
		      nc_tensor_device(conn, base + 2 * bytes, &g) == NC_OK,
	      "register: %s", nc_last_error());
	struct nc_job job = {.op = NC_RMSNORM_FWD, .rows = CHAIN_ROWS, .cols = CHAIN_COLS,
			     .eps = 1e-5f, .dtype = NC_F32, .gamma = g};
	int64_t start = now_ns();
	for (int k = 0; k < CHAIN; k++) {
		job.x = buf[k % 2];
		job.y = buf[(k + 1) % 2];
		int rc = nc_job_enqueue(conn, &job, stream);
		CHECK(rc == NC_OK, "job %d: %s (%s)", k, nc_status_name(rc), nc_last_error());
	}
	double enqueue_ms = ms_since(start);
	CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "stream synchronize");
	double total_ms = ms_since(start);
	int rc = nc_conn_check(conn, 10000);
	CHECK(rc == NC_OK, "nc_conn_check: %s (%s)", nc_status_name(rc), nc_last_error());
	CHECK(cudaMemcpy(got, base + (CHAIN % 2) * bytes, bytes, cudaMemcpyDeviceToHost) ==
		      cudaSuccess,
	      "download");
	chain_reference(x0, gamma, want);
	double err = rel_l2(got, want, n);
	printf("  %d dependent jobs: enqueued in %.2f ms, done after %.2f ms; relative L2 error "
	       "%.3g (tolerance 1e-4)\n",
	       CHAIN, enqueue_ms, total_ms, err);
	cudaStreamDestroy(stream);
	cudaFree(base);
	nc_close(conn);
	CHECK(err < 1e-4, "the chain's result is off by %.3g", err);
	return 0;
}

/* ---- 3. ordering with the caller's own work ---------------------------------------------- */

enum { ORD_JOBS = 48, ORD_ROWS = 16, ORD_COLS = 1024 };
#define ORD_ELEMS ((size_t)ORD_ROWS * ORD_COLS)
#define ORD_BYTES (ORD_ELEMS * sizeof(float))

/* The device side of the ordering test: one allocation, carved up. */
struct ordering {
	char *base;
	float *x, *gamma, *y, *rstd, *y_copy; /* y, rstd, y_copy: ORD_JOBS of each */
	void *scratch;                         /* a slow memset keeps the stream busy */
	float *host_in;                        /* pinned: ORD_JOBS inputs */
};

static int ordering_alloc(struct ordering *o)
{
	size_t total = ORD_BYTES + ORD_COLS * 4 + ORD_JOBS * (2 * ORD_BYTES + ORD_ROWS * 4);
	if (cudaMalloc((void **)&o->base, total) != cudaSuccess ||
	    cudaMalloc(&o->scratch, (size_t)1 << 30) != cudaSuccess ||
	    cudaMallocHost((void **)&o->host_in, ORD_JOBS * ORD_BYTES) != cudaSuccess ||
	    cudaMemset(o->base, 0, total) != cudaSuccess)
		return -1;
	o->x = (float *)o->base;
	o->gamma = o->x + ORD_ELEMS;
	o->y = o->gamma + ORD_COLS;
	o->y_copy = o->y + ORD_JOBS * ORD_ELEMS;
	o->rstd = o->y_copy + ORD_JOBS * ORD_ELEMS;
	return 0;
}

/* Job k's input: a copy (k % 3 == 0), a memset (1), or a copy then a memset of half the rows (2).
 */
static unsigned char ordering_byte(int k)
{
	return (unsigned char)(0x3c + k % 6); /* fp32 0x3c3c3c3c = 0.0115 ... 0x41414141 = 12.1 */
}

static void ordering_expected(const struct ordering *o, int k, double *in)
{
	float pattern;
	unsigned char b = ordering_byte(k);
	memset(&pattern, b, sizeof(pattern));
	for (size_t i = 0; i < ORD_ELEMS; i++) {
		bool set = k % 3 == 1 || (k % 3 == 2 && i < ORD_ELEMS / 2);
		in[i] = set ? pattern : o->host_in[(size_t)k * ORD_ELEMS + i];
	}
}

static int ordering_queue(nc_conn *conn, const struct ordering *o, cudaStream_t s)
{
	struct nc_job job = {.op = NC_RMSNORM_FWD, .rows = ORD_ROWS, .cols = ORD_COLS,
			     .dtype = NC_F32};
	if (nc_tensor_device(conn, o->x, &job.x) || nc_tensor_device(conn, o->gamma, &job.gamma))
		return -1;
	for (int i = 0; i < 4; i++) /* a few ms of work: the enqueue calls run far ahead */
		cudaMemsetAsync(o->scratch, i, (size_t)1 << 30, s);
	for (int k = 0; k < ORD_JOBS; k++) {
		float *in = o->host_in + (size_t)k * ORD_ELEMS;
		if (k % 3 != 1)
			cudaMemcpyAsync(o->x, in, ORD_BYTES, cudaMemcpyHostToDevice, s);
		if (k % 3 != 0)
			cudaMemsetAsync(o->x, ordering_byte(k),
					k % 3 == 1 ? ORD_BYTES : ORD_BYTES / 2, s);
		if (nc_tensor_device(conn, o->y + k * ORD_ELEMS, &job.y) ||
		    nc_tensor_device(conn, o->rstd + k * ORD_ROWS, &job.rstd))
			return -1;
		int rc = nc_job_enqueue(conn, &job, s);
		if (rc != NC_OK) {
			fprintf(stderr, "  job %d: %s\n", k, nc_last_error());
			return -1;
		}
		/* The caller's work after the job sees its output. */
		cudaMemcpyAsync(o->y_copy + k * ORD_ELEMS, o->y + k * ORD_ELEMS, ORD_BYTES,
				cudaMemcpyDeviceToDevice, s);
	}
	return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

/* Compares every job's y and rstd with the reference of the input the stream order gives it. */
static int ordering_verify(const struct ordering *o, const float *gamma, int *copies_differ)
{
	size_t ybytes = ORD_JOBS * ORD_BYTES;
	float *y = malloc(ybytes), *y_copy = malloc(ybytes),
	      *rstd = malloc(ORD_JOBS * ORD_ROWS * 4);
	double *in = malloc(ORD_BYTES * 2), *want = malloc(ORD_BYTES * 2), g[ORD_COLS];
	int bad = -1;
	if (!y || !y_copy || !rstd || !in || !want ||
	    cudaMemcpy(y, o->y, ybytes, cudaMemcpyDeviceToHost) != cudaSuccess ||
	    cudaMemcpy(y_copy, o->y_copy, ybytes, cudaMemcpyDeviceToHost) != cudaSuccess ||
	    cudaMemcpy(rstd, o->rstd, ORD_JOBS * ORD_ROWS * 4, cudaMemcpyDeviceToHost) !=
		cudaSuccess)
		goto out;
	bad = 0;
	*copies_differ = 0;
	for (int c = 0; c < ORD_COLS; c++)
		g[c] = gamma[c];
	for (int k = 0; k < ORD_JOBS; k++) {
		ordering_expected(o, k, in);
		double rstd_err = 0;
		for (int r = 0; r < ORD_ROWS; r++) {
			double want_rstd = rms_row_ref(in + r * ORD_COLS, g, want + r * ORD_COLS,
						       ORD_COLS, 1e-5);
			rstd_err =
			    fmax(rstd_err, fabs(rstd[k * ORD_ROWS + r] - want_rstd) / want_rstd);
		}
		double err = rel_l2(y + k * ORD_ELEMS, want, ORD_ELEMS);
		if (err > 1e-5 || rstd_err > 1e-5) {
			fprintf(stderr, "  job %d (input kind %d): y off by %.3g, rstd by %.3g\n",
				k, k % 3, err, rstd_err);
			bad++;
		}
		*copies_differ += memcmp(y + k * ORD_ELEMS, y_copy + k * ORD_ELEMS, ORD_BYTES) != 0;
	}
out:
	free(y);
	free(y_copy);
	free(rstd);
	free(in);
	free(want);
	return bad;
}

static int ordering_test(void *arg)
{
	(void)arg;
	static float gamma[ORD_COLS];
	nc_conn *conn = connect_daemon("enqueue-ordering");
	CHECK(conn, "no connection");
	struct ordering o = {0};
	cudaStream_t s;
	CHECK(ordering_alloc(&o) == 0 &&
		      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess,
	      "cuda set-up");
	fill_f32(gamma, ORD_COLS, 31, 0.5, 1.5);
	fill_f32(o.host_in, ORD_JOBS * ORD_ELEMS, 32, -2, 2);
	CHECK(cudaMemcpy(o.gamma, gamma, sizeof(gamma), cudaMemcpyHostToDevice) == cudaSuccess &&
		      cudaDeviceSynchronize() == cudaSuccess,
	      "upload");
	int64_t start = now_ns();
	CHECK(ordering_queue(conn, &o, s) == 0, "queueing: %s", nc_last_error());
	double queued_ms = ms_since(start);
	bool busy = cudaStreamQuery(s) == cudaErrorNotReady;
	CHECK(cudaStreamSynchronize(s) == cudaSuccess, "stream synchronize");
	int rc = nc_conn_check(conn, 10000);
	CHECK(rc == NC_OK, "nc_conn_check: %s (%s)", nc_status_name(rc), nc_last_error());
	int copies_differ = 0;
	int bad = ordering_verify(&o, gamma, &copies_differ);
	printf("  %d jobs between copies and memsets: queued in %.2f ms (stream %s then), done "
	       "after %.2f ms; %d wrong, %d later copies differ\n",
	       ORD_JOBS, queued_ms, busy ? "still busy" : "already idle", ms_since(start), bad,
	       copies_differ);
	cudaStreamDestroy(s);
	cudaFree(o.base);
	cudaFree(o.scratch);
	cudaFreeHost(o.host_in);
	nc_close(conn);
	CHECK(bad == 0, "%d jobs did not see exactly the input the stream order gives them", bad);
	CHECK(copies_differ == 0, "%d copies queued after a job missed its output", copies_differ);
	return 0;
}

/* ---- 4. an asynchronous error ------------------------------------------------------------ */

enum { ERR_ROWS = 4, ERR_COLS = 512, ERR_GOOD_COLS = 256 }; /* the daemon's --max-cols 256 */

struct err_bufs {
	char *base;
	float *x, *y, *rstd, *gamma;
};

static bool all_bytes(const void *p, size_t n, unsigned char b)
{
	const unsigned char *c = p;
	for (size_t i = 0; i < n; i++)
		if (c[i] != b)
			return false;
	return true;
}

/* Whether y and rstd of the refused job hold 0xff bytes (the poison); -1 if unreadable. */
static int err_poisoned(const struct err_bufs *e)
{
	static float y[ERR_ROWS * ERR_COLS], rstd[ERR_ROWS];
	if (cudaMemcpy(y, e->y, sizeof(y), cudaMemcpyDeviceToHost) != cudaSuccess ||
	    cudaMemcpy(rstd, e->rstd, sizeof(rstd), cudaMemcpyDeviceToHost) != cudaSuccess)
		return -1;
	return all_bytes(y, sizeof(y), 0xff) && all_bytes(rstd, sizeof(rstd), 0xff);
}

/* The valid job's output against the reference; its relative L2 error. */
static double err_good_error(const struct err_bufs *e, const float *x, const float *gamma)
{
	static float y[ERR_ROWS * ERR_GOOD_COLS];
	static double xd[ERR_GOOD_COLS], g[ERR_GOOD_COLS], want[ERR_ROWS * ERR_GOOD_COLS];
	if (cudaMemcpy(y, e->y, sizeof(y), cudaMemcpyDeviceToHost) != cudaSuccess)
		return INFINITY;
	for (int c = 0; c < ERR_GOOD_COLS; c++)
		g[c] = gamma[c];
	for (int r = 0; r < ERR_ROWS; r++) {
		for (int c = 0; c < ERR_GOOD_COLS; c++)
			xd[c] = x[r * ERR_GOOD_COLS + c];
		rms_row_ref(xd, g, want + r * ERR_GOOD_COLS, ERR_GOOD_COLS, 1e-5);
	}
	return rel_l2(y, want, ERR_ROWS * ERR_GOOD_COLS);
}

static int async_error(void *arg)
{
	nc_conn *conn = gpu_test_connect((const char *)arg, "enqueue-error");
	CHECK(conn, "no connection");
	static float x[ERR_ROWS * ERR_COLS], gamma[ERR_COLS];
	fill_f32(x, ERR_ROWS * ERR_COLS, 41, -1, 1);
	fill_f32(gamma, ERR_COLS, 42, 0.5, 1.5);
	struct err_bufs e;
	size_t xb = sizeof(x);
	cudaStream_t s;
	CHECK(cudaMalloc((void **)&e.base, 2 * xb + 4096 + sizeof(gamma)) == cudaSuccess &&
		      cudaMemset(e.base, 0, 2 * xb + 4096 + sizeof(gamma)) == cudaSuccess &&
		      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess,
	      "cuda set-up");
	e.x = (float *)e.base;
	e.y = (float *)(e.base + xb);
	e.rstd = (float *)(e.base + 2 * xb);
	e.gamma = (float *)(e.base + 2 * xb + 4096);
	CHECK(cudaMemcpy(e.x, x, xb, cudaMemcpyHostToDevice) == cudaSuccess &&
		  cudaMemcpy(e.gamma, gamma, sizeof(gamma), cudaMemcpyHostToDevice) ==
		      cudaSuccess &&
		  cudaDeviceSynchronize() == cudaSuccess,
	      "upload");
	struct nc_job job = {.op = NC_RMSNORM_FWD, .rows = ERR_ROWS, .cols = ERR_COLS,
			     .dtype = NC_F32};
	CHECK(nc_tensor_device(conn, e.x, &job.x) == NC_OK &&
		      nc_tensor_device(conn, e.y, &job.y) == NC_OK &&
		      nc_tensor_device(conn, e.rstd, &job.rstd) == NC_OK &&
		      nc_tensor_device(conn, e.gamma, &job.gamma) == NC_OK,
	      "register: %s", nc_last_error());

	/* The refused job: queued here, refused by the daemon. */
	int rc = nc_job_enqueue(conn, &job, s);
	CHECK(rc == NC_OK, "enqueue of the too-wide job: %s (%s)", nc_status_name(rc),
	      nc_last_error());
	int64_t start = now_ns();
	CHECK(cudaStreamSynchronize(s) == cudaSuccess, "stream synchronize");
	double released_ms = ms_since(start);
	int poisoned = err_poisoned(&e);
	rc = nc_conn_check(conn, 5000);
	printf("  refused job: stream released after %.2f ms; outputs %s; nc_conn_check: %s (%s)\n",
	       released_ms, poisoned == 1 ? "poisoned" : "NOT poisoned", nc_status_name(rc),
	       nc_last_error());
	CHECK(rc == NC_EOUT_OF_RANGE, "nc_conn_check gave %s", nc_status_name(rc));
	CHECK(nc_conn_check(conn, 5000) == NC_OK, "the error was reported twice");

	/* Again, the error now coming back from the next nc_job_enqueue(). */
	CHECK(nc_job_enqueue(conn, &job, s) == NC_OK, "second enqueue: %s", nc_last_error());
	CHECK(cudaStreamSynchronize(s) == cudaSuccess, "stream synchronize");
	usleep(500 * 1000); /* the daemon's reply arrives */
	struct nc_job good = job;
	good.cols = ERR_GOOD_COLS;
	rc = nc_job_enqueue(conn, &good, s);
	printf("  the next nc_job_enqueue: %s (%s)\n", nc_status_name(rc), nc_last_error());
	CHECK(rc == NC_EOUT_OF_RANGE, "the next nc_job_enqueue gave %s", nc_status_name(rc));

	/* A valid job afterwards works (x read as [4, 256]). */
	rc = nc_job_enqueue(conn, &good, s);
	CHECK(rc == NC_OK, "valid job: %s (%s)", nc_status_name(rc), nc_last_error());
	CHECK(cudaStreamSynchronize(s) == cudaSuccess, "stream synchronize");
	rc = nc_conn_check(conn, 5000);
	CHECK(rc == NC_OK, "valid job: nc_conn_check %s (%s)", nc_status_name(rc), nc_last_error());
	double err = err_good_error(&e, x, gamma);
	printf("  valid job afterwards: relative L2 error %.3g\n", err);
	CHECK(err < 1e-5, "the valid job's output is off by %.3g", err);
	cudaStreamDestroy(s);
	cudaFree(e.base);
	nc_close(conn);
	CHECK(poisoned == 1, "the refused job's outputs were not filled with 0xff bytes");
	return 0;
}

static int async_error_test(void)
{
	static const char *const narrow[] = {"--max-cols", "256", NULL};
	struct test_daemon d;
	if (test_daemon_start_on(&d, "0", narrow) != 0) {
		fprintf(stderr, "  cannot start normd --max-cols 256\n");
		return 1;
	}
	int rc = in_child_timed(async_error, d.socket, 120);
	if (rc)
		test_daemon_dump_log(&d);
	int stop = test_daemon_stop(&d);
	if (stop != 0)
		fprintf(stderr, "  the --max-cols daemon exited %d\n", stop);
	return rc || stop;
}

/* ---- shared by 5 to 7: a well-behaved client, and a client with a long chain ------------ */

/* Enqueued and synchronous jobs of another process, each within 5 s; checked. */
static int good_client(void *arg)
{
	const char *socket_path = arg;
	int64_t start = now_ns();
	nc_conn *conn = gpu_test_connect(socket_path, "enqueue-good");
	CHECK(conn, "no connection");
	cudaStream_t s;
	CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "stream");
	struct jobkit kits[8];
	int bad = 0;
	for (int i = 0; i < 8; i++) {
		struct jobkit_spec spec = {.op = (enum nc_op)(1 + i % 4),
					   .rows = 64,
					   .cols = 2048,
					   .dtype = (enum nc_dtype)(1 + i % 3),
					   .gamma = true,
					   .beta = true,
					   .seed = 900 + (uint64_t)i,
					   .on_device = true};
		CHECK(jobkit_create(conn, &spec, &kits[i]) == 0, "set-up: %s", nc_last_error());
	}
	for (int i = 0; i < 4; i++)
		bad += nc_job_enqueue(conn, &kits[i].job, s) != NC_OK;
	int rc = nc_stream_wait(conn, s, 5000);
	CHECK(rc == NC_OK, "enqueued jobs: %s (%s)", nc_status_name(rc), nc_last_error());
	for (int i = 4; i < 8; i++) {
		struct nc_job_result r;
		rc = nc_job_run_on_stream(conn, &kits[i].job, s, 5000, &r);
		if (rc != NC_OK)
			fprintf(stderr, "  sync job: %s (%s)\n", nc_status_name(rc), r.message);
		bad += rc != NC_OK;
	}
	for (int i = 0; i < 8; i++) {
		struct jobkit_report rep = {0};
		if (!jobkit_check(&kits[i], &rep)) {
			fprintf(stderr, "  job %d: %s\n", i, rep.detail);
			bad++;
		}
		jobkit_destroy(&kits[i]);
	}
	cudaStreamDestroy(s);
	nc_close(conn);
	printf("  another client: 4 enqueued + 4 synchronous jobs correct in %.0f ms "
	       "(CUDA start-up included), %d wrong\n",
	       ms_since(start), bad);
	CHECK(bad == 0, "%d of the other client's jobs failed", bad);
	return 0;
}

/* Tests 6 and 7 run a long chain of enqueued jobs (tests/support/enqueue_chain.h). */
static int long_chain_child(void *arg)
{
	return enqueue_chain_run(arg, -1);
}

/* ---- 5. a silent client ------------------------------------------------------------------ */

/* Enqueues two jobs behind a stream wait nobody satisfies, says so on go_fd, and waits to die. */
static int silent_client(int go_fd)
{
	nc_conn *conn = connect_daemon("enqueue-silent");
	uint32_t *gate = NULL;
	cudaStream_t s;
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_RMSNORM_FWD, .rows = 8, .cols = 1024, .dtype = NC_BF16,
				   .gamma = true, .seed = 77, .on_device = true};
	if (!conn || cudaMalloc((void **)&gate, 4) != cudaSuccess ||
	    cudaMemset(gate, 0, 4) != cudaSuccess ||
	    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
	    jobkit_create(conn, &spec, &kit) != 0)
		return 2;
	/* The stream stops here for good: it never reaches the ready word's write. */
	if (nk_cuda_stream_wait(s, gate, 1) != 0)
		return 3;
	if (nc_job_enqueue(conn, &kit.job, s) != NC_OK ||
	    nc_job_enqueue(conn, &kit.job, s) != NC_OK)
		return 4;
	if (write(go_fd, "g", 1) != 1)
		return 5;
	for (;;)
		pause();
}

static int silent_client_test(void *arg)
{
	(void)arg;
	int fds[2];
	CHECK(pipe(fds) == 0, "pipe");
	pid_t silent = fork_helper();
	CHECK(silent >= 0, "fork");
	if (silent == 0) {
		close(fds[0]);
		child_exit(silent_client(fds[1]));
	}
	close(fds[1]);
	char go;
	int ready = test_read_within(fds[0], &go, 1, 60000);
	close(fds[0]);
	if (ready != 0)
		kill(silent, SIGKILL);
	CHECK(ready == 0, "the silent client did not enqueue its jobs");
	usleep(200 * 1000); /* the daemon reads the requests and queues their waits */
	struct nc_stats st;
	CHECK(gpu_test_stats(daemon_.socket, &st) == 0, "stats");
	printf("  silent client holds %u jobs in flight\n", st.jobs_in_flight);
	int64_t start = now_ns();
	int good = in_child_timed(good_client, daemon_.socket, 60);
	double good_ms = ms_since(start);
	kill(silent, SIGKILL);
	waitpid(silent, NULL, 0);
	double drained_ms = wait_no_jobs(daemon_.socket, 10000);
	printf("  after its SIGKILL, jobs_in_flight reached 0 in %.0f ms\n", drained_ms);
	CHECK(st.jobs_in_flight >= 2, "the daemon did not hold the silent client's jobs");
	CHECK(good == 0, "the other client failed beside a silent one");
	CHECK(good_ms < 10000, "the other client took %.0f ms", good_ms);
	CHECK(drained_ms >= 0 && drained_ms < 5000, "jobs_in_flight did not drop to 0 within 5 s");
	return 0;
}

/* ---- 6. the daemon killed mid-chain --------------------------------------------------------- */

/* SIGKILLs a test's own daemon, reads its client's outcome (30 s at most), ends the client. */
static int64_t kill_daemon_then_collect(struct test_daemon *d, pid_t child, int out_fd,
					void *outcome, size_t size, int *got)
{
	int64_t killed_ns = now_ns();
	kill(d->pid, SIGKILL);
	waitpid(d->pid, &d->wait_status, 0);
	d->exited = true;
	*got = test_read_within(out_fd, outcome, size, 30000);
	kill(child, SIGKILL);
	waitpid(child, NULL, 0);
	return killed_ns;
}

static int daemon_killed_test(void *arg)
{
	(void)arg;
	struct test_daemon d;
	CHECK(test_daemon_start_on(&d, "0", NULL) == 0, "cannot start a second normd");
	int go[2], out[2];
	CHECK(pipe(go) == 0 && pipe(out) == 0, "pipes");
	/* 2000 jobs of 16384 x 8192 bf16 (about 170 us each on an H100): a third of a second. */
	struct enqueue_chain lc = {.socket_path = d.socket, .rows = 16384, .cols = 8192,
				.jobs = 2000, .signal_after = 50, .go_fd = go[1]};
	pid_t child = fork_helper();
	CHECK(child >= 0, "fork");
	if (child == 0) {
		close(go[0]);
		close(out[0]);
		child_exit(enqueue_chain_run(&lc, out[1]));
	}
	close(go[1]);
	close(out[1]);
	char byte;
	int started = test_read_within(go[0], &byte, 1, 60000);
	usleep(30 * 1000);
	struct enqueue_chain_outcome o = {0};
	int got;
	int64_t killed_ns = kill_daemon_then_collect(&d, child, out[0], &o, sizeof(o), &got);
	close(go[0]);
	close(out[0]);
	test_daemon_stop(&d);
	CHECK(started == 0, "the chain did not start");
	CHECK(got == 0, "the client's stream was not released within 30 s of the kill");
	double after_ms = (double)(o.synced_ns - killed_ns) / 1e6;
	printf("  daemon SIGKILLed after the client enqueued >= 50 jobs; %d of 2000 enqueued "
	       "(then %s); cudaStreamSynchronize returned %.1f ms after the kill (%s); "
	       "nc_conn_check: %s\n",
	       o.enqueued, o.enqueue_rc ? nc_status_name(o.enqueue_rc) : "none refused", after_ms,
	       cudaGetErrorString((cudaError_t)o.cuda_rc), nc_status_name(o.check_rc));
	CHECK(o.cuda_rc == cudaSuccess, "the stream failed");
	CHECK(after_ms > 0, "the chain ended before the kill: make it longer");
	CHECK(after_ms < 1000, "the stream was released %.0f ms after the kill", after_ms);
	CHECK(o.check_rc == NC_EDISCONNECTED, "nc_conn_check gave %s", nc_status_name(o.check_rc));
	CHECK(o.enqueue_rc == 0 || o.enqueue_rc == NC_EDISCONNECTED,
	      "enqueue failed with %s", nc_status_name(o.enqueue_rc));
	return 0;
}

/*
 * 6b. The daemon killed while many streams of one client wait on their done
 * words: more streams than the process has hardware queues (a few under
 * MPS), so waiting streams share queues with each other and with anything
 * the library could queue to release them. The jobs are queued behind a
 * gate in host memory; the daemon is stopped (SIGSTOP), the gate opened, so
 * that every stream writes its ready words and blocks on a done wait no one
 * can satisfy but the library, and then the daemon is SIGKILLed.
 */
#define MANY_STREAMS 48

struct many_streams_outcome {
	int streams_synced;  /* streams whose cudaStreamSynchronize returned */
	int cuda_rc;         /* the first failure, or cudaSuccess */
	int check_rc;        /* nc_conn_check after the kill */
	int64_t synced_ns;   /* when the last stream returned */
};

static int many_streams_client(const char *socket_path, int go_fd, int open_fd, int out_fd)
{
	nc_conn *conn = gpu_test_connect(socket_path, "enqueue-many-streams");
	volatile uint32_t *gate = NULL;
	void *gate_gpu = NULL;
	cudaStream_t streams[MANY_STREAMS];
	struct jobkit kit;
	struct jobkit_spec spec = {.op = NC_RMSNORM_FWD, .rows = 64, .cols = 1024, .dtype = NC_BF16,
				   .gamma = true, .seed = 81, .on_device = true};
	if (!conn || cudaHostAlloc((void **)&gate, 4, cudaHostAllocMapped) != cudaSuccess ||
	    cudaHostGetDevicePointer(&gate_gpu, (void *)gate, 0) != cudaSuccess ||
	    jobkit_create(conn, &spec, &kit) != 0)
		return 2;
	*gate = 0;
	for (int i = 0; i < MANY_STREAMS; i++) {
		if (cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking) != cudaSuccess)
			return 3;
	}
	/* One job ungated first: setting up the semaphore words may wait for the device. */
	if (nc_job_enqueue(conn, &kit.job, streams[0]) != NC_OK ||
	    nc_stream_wait(conn, streams[0], 10000) != NC_OK)
		return 4;
	for (int i = 0; i < MANY_STREAMS; i++) {
		if (nk_cuda_stream_wait(streams[i], gate_gpu, 1) != 0 ||
		    nc_job_enqueue(conn, &kit.job, streams[i]) != NC_OK ||
		    nc_job_enqueue(conn, &kit.job, streams[i]) != NC_OK)
			return 5;
	}
	char byte;
	if (write(go_fd, "g", 1) != 1 || test_read_within(open_fd, &byte, 1, 30000) != 0)
		return 6;
	*gate = 1; /* the daemon is stopped: every stream goes on to a done wait and stays */
	if (write(go_fd, "o", 1) != 1)
		return 7;
	struct many_streams_outcome o = {.cuda_rc = cudaSuccess};
	int64_t start = now_ns();
	do { /* the watcher has released the slots once the connection reports the drop */
		usleep(1000);
		o.check_rc = nc_conn_check(conn, 0);
	} while (o.check_rc != NC_EDISCONNECTED && ms_since(start) < 20000);
	for (int i = 0; i < MANY_STREAMS; i++) {
		cudaError_t rc = cudaStreamSynchronize(streams[i]);
		if (rc == cudaSuccess)
			o.streams_synced++;
		else if (o.cuda_rc == cudaSuccess)
			o.cuda_rc = rc;
	}
	o.synced_ns = now_ns();
	return write(out_fd, &o, sizeof(o)) == (ssize_t)sizeof(o) ? 0 : 8;
}

static int many_streams_killed_test(void *arg)
{
	(void)arg;
	struct test_daemon d;
	CHECK(test_daemon_start_on(&d, "0", NULL) == 0, "cannot start a second normd");
	int go[2], open_gate[2], out[2];
	CHECK(pipe(go) == 0 && pipe(open_gate) == 0 && pipe(out) == 0, "pipes");
	pid_t child = fork_helper();
	CHECK(child >= 0, "fork");
	if (child == 0) {
		close(go[0]);
		close(open_gate[1]);
		close(out[0]);
		child_exit(many_streams_client(d.socket, go[1], open_gate[0], out[1]));
	}
	close(go[1]);
	close(open_gate[0]);
	close(out[1]);
	char byte;
	int started = test_read_within(go[0], &byte, 1, 60000);
	if (started == 0) { /* the daemon stopped, the gate opened, the streams on their waits */
		kill(d.pid, SIGSTOP);
		started = write(open_gate[1], "o", 1) == 1 ? test_read_within(go[0], &byte, 1, 30000)
							   : -1;
		usleep(50 * 1000);
	}
	if (started != 0) { /* the client's exit status says which step failed */
		kill(child, SIGKILL);
		int status = 0;
		waitpid(child, &status, 0);
		kill(d.pid, SIGCONT);
		test_daemon_stop(&d);
		CHECK(0, "the client did not enqueue its jobs or open its gate (exit %d)",
		      WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status));
	}
	struct many_streams_outcome o = {0};
	int got;
	int64_t killed_ns = kill_daemon_then_collect(&d, child, out[0], &o, sizeof(o), &got);
	close(go[0]);
	close(open_gate[1]);
	close(out[0]);
	test_daemon_stop(&d);
	CHECK(got == 0, "the client's streams were not released within 30 s of the kill");
	double after_ms = (double)(o.synced_ns - killed_ns) / 1e6;
	printf("  daemon SIGKILLed with %d streams of one client waiting; %d of them synchronized "
	       "%.1f ms after the kill (%s); nc_conn_check: %s\n", MANY_STREAMS,
	       o.streams_synced, after_ms, cudaGetErrorString((cudaError_t)o.cuda_rc),
	       nc_status_name(o.check_rc));
	CHECK(o.check_rc == NC_EDISCONNECTED, "nc_conn_check gave %s", nc_status_name(o.check_rc));
	CHECK(o.streams_synced == MANY_STREAMS && o.cuda_rc == cudaSuccess, "streams failed");
	CHECK(after_ms < 5000, "the streams were released %.0f ms after the kill", after_ms);
	return 0;
}

/* ---- 7. a client killed with work enqueued ----------------------------------------------------
 */

static int killed_client_test(void *arg)
{
	(void)arg;
	/* The same jobs, run to the end first: the daemon's streams and pools are warm. */
	struct enqueue_chain warm = {.socket_path = daemon_.socket, .rows = 16384, .cols = 4096,
				  .jobs = 200, .go_fd = -1, .backward = true};
	CHECK(in_child_timed(long_chain_child, &warm, 120) == 0, "the warm-up chain failed");
	CHECK(gpu_test_wait_idle(daemon_.socket) == 0, "daemon not idle before");
	/* Measured in a fresh child each time: no allocation of ours differs between the two. */
	long long before = device_free_bytes();
	int go[2];
	CHECK(pipe(go) == 0, "pipe");
	struct enqueue_chain doomed = warm;
	doomed.jobs = 4000;
	doomed.signal_after = 100;
	doomed.go_fd = go[1];
	pid_t child = fork_helper();
	CHECK(child >= 0, "fork");
	if (child == 0) {
		close(go[0]);
		enqueue_chain_run(&doomed, -1);
		for (;;)
			pause();
	}
	close(go[1]);
	char byte;
	int started = test_read_within(go[0], &byte, 1, 60000);
	close(go[0]);
	usleep(20 * 1000);
	struct nc_stats st = {0};
	int stats_rc = gpu_test_stats(daemon_.socket, &st);
	kill(child, SIGKILL);
	waitpid(child, NULL, 0);
	CHECK(started == 0 && stats_rc == 0, "the doomed chain did not start");
	printf("  client SIGKILLed with %u jobs in flight in the daemon\n", st.jobs_in_flight);
	CHECK(st.jobs_in_flight > 0, "the chain was over before the kill");
	CHECK(in_child_timed(good_client, daemon_.socket, 60) == 0, "others were disturbed");
	double drained_ms = wait_no_jobs(daemon_.socket, 20000);
	CHECK(gpu_test_wait_idle(daemon_.socket) == 0, "the killed client's regions stayed");
	long long after = device_free_bytes();
	CHECK(before > 0 && after > 0, "cannot read device memory");
	printf("  jobs_in_flight 0 after %.0f ms; device free memory before %lld MiB, after %lld "
	       "MiB\n",
	       drained_ms, before >> 20, after >> 20);
	CHECK(llabs(after - before) <= (16ll << 20), "device memory moved by %lld bytes",
	      after - before);
	return 0;
}

/* ---- 8. jobs named by device pointers ------------------------------------------------------ */

/* The device pointers of a kit's tensors, in NC_JOB_TENSORS order (NULL where absent). */
static void kit_pointers(const struct jobkit *kit, const void *ptrs[NC_JOB_TENSORS])
{
	const struct nc_job *j = &kit->job;
	const struct nc_tensor t[NC_JOB_TENSORS] = {j->x,  j->y,  j->mean,   j->rstd,  j->gamma,
						    j->beta, j->dy, j->dx, j->dgamma, j->dbeta,
						    j->main_grad};
	for (int i = 0; i < NC_JOB_TENSORS; i++)
		ptrs[i] = t[i].region ? (const char *)kit->device_base + t[i].offset : NULL;
}

/*
 * One kit's job enqueued `times` times by its device pointers alone (the
 * job's own tensors absent), then checked against the reference. Returns
 * the number of failures; *base is the kit's allocation.
 */
static int enqueue_kit_by_pointers(nc_conn *conn, cudaStream_t stream,
				   const struct jobkit_spec *spec, int times, void **base)
{
	struct jobkit kit;
	if (jobkit_create(conn, spec, &kit) != 0) {
		fprintf(stderr, "  kit: %s\n", nc_last_error());
		return 1;
	}
	*base = kit.device_base;
	const void *ptrs[NC_JOB_TENSORS];
	kit_pointers(&kit, ptrs);
	struct nc_job job = kit.job;
	const struct nc_tensor none = {0, 0};
	job.x = job.y = job.mean = job.rstd = job.gamma = job.beta = none;
	job.dy = job.dx = job.dgamma = job.dbeta = job.main_grad = none;
	int bad = 0;
	for (int i = 0; i < times; i++) {
		int rc = nc_job_enqueue_device(conn, &job, ptrs, stream);
		if (rc != NC_OK) {
			fprintf(stderr, "  %s: %s\n", nc_status_name(rc), nc_last_error());
			bad++;
		}
	}
	if (cudaStreamSynchronize(stream) != cudaSuccess || nc_conn_check(conn, 30000) != NC_OK) {
		fprintf(stderr, "  synchronize / check: %s\n", nc_last_error());
		bad++;
	}
	struct jobkit_report rep = {0};
	if (!jobkit_check(&kit, &rep)) {
		fprintf(stderr, "  %s: %s\n", jobkit_op_name(spec->op), rep.detail);
		bad++;
	}
	jobkit_destroy(&kit);
	return bad;
}

/*
 * nc_job_enqueue_device: every op from device pointers alone, twice each
 * (the second time through the registration the first made), against the
 * reference; kits of one size made one after the other, each freed before
 * the next (cudaMalloc then often hands out the same address again: the
 * registration of the freed allocation must not serve the new one); memory
 * CUDA IPC cannot export (cudaMallocAsync) is refused with the tensor named
 * and nothing queued.
 */
static int enqueue_device_test(void *arg)
{
	(void)arg;
	nc_conn *conn = connect_daemon("enqueue-device");
	CHECK(conn, "no connection");
	cudaStream_t stream;
	CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
	int bad = 0;
	void *base = NULL, *previous = NULL;
	for (int op = NC_LAYERNORM_FWD; op <= NC_RMSNORM_BWD; op++) {
		struct jobkit_spec spec = {.op = (enum nc_op)op, .rows = 7, .cols = 1000,
					   .dtype = NC_BF16, .gamma = true, .beta = true,
					   .seed = 40 + (uint64_t)op, .on_device = true};
		bad += enqueue_kit_by_pointers(conn, stream, &spec, 2, &base);
	}
	int reused = 0;
	for (int i = 0; i < 4; i++) {
		struct jobkit_spec spec = {.op = NC_RMSNORM_FWD, .rows = 9, .cols = 2048,
					   .dtype = NC_F32, .gamma = true, .seed = 60 + (uint64_t)i,
					   .on_device = true};
		bad += enqueue_kit_by_pointers(conn, stream, &spec, 1, &base);
		reused += i > 0 && base == previous;
		previous = base;
	}
	printf("  4 allocations of one size in turn: the address came back %d times\n", reused);
	void *pooled = NULL;
	CHECK(cudaMallocAsync(&pooled, 1 << 16, stream) == cudaSuccess, "cudaMallocAsync");
	CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "synchronize");
	struct nc_job job = {.op = NC_RMSNORM_FWD, .rows = 4, .cols = 64, .dtype = NC_F32};
	const void *ptrs[NC_JOB_TENSORS] = {pooled, (char *)pooled + 4096};
	int rc = nc_job_enqueue_device(conn, &job, ptrs, stream);
	CHECK(rc == NC_EUNSUPPORTED, "pool memory gave %s", nc_status_name(rc));
	CHECK(strncmp(nc_last_error(), "tensor x: ", 10) == 0, "message: %s", nc_last_error());
	CHECK(nc_conn_check(conn, 1000) == NC_OK, "something was queued: %s", nc_last_error());
	cudaFreeAsync(pooled, stream);
	cudaStreamSynchronize(stream);
	cudaStreamDestroy(stream);
	nc_close(conn);
	CHECK(bad == 0, "%d jobs wrong", bad);
	return 0;
}

int main(void)
{
	if (test_daemon_start_on(&daemon_, "0", NULL) != 0) {
		fprintf(stderr, "cannot start normd --device 0\n");
		printf("test_enqueue: 0 passed, 1 failed\n");
		return 1;
	}
	report("every op enqueued, against the reference", in_child_timed(every_op, NULL, 600));
	report("200 dependent jobs, no host wait", in_child_timed(dependent_chain, NULL, 120));
	report("ordered with the caller's copies/memsets",
	       in_child_timed(ordering_test, NULL, 120));
	report("refused job: stream released, error later", async_error_test());
	report("a silent client stalls no one else", in_child_timed(silent_client_test, NULL, 180));
	report("daemon SIGKILL releases the stream", in_child_timed(daemon_killed_test, NULL, 180));
	report("daemon SIGKILL releases 48 waiting streams",
	       in_child_timed(many_streams_killed_test, NULL, 120));
	report("client SIGKILL: memory back, others work",
	       in_child_timed(killed_client_test, NULL, 300));
	report("jobs named by device pointers (nc_job_enqueue_device)",
	       in_child_timed(enqueue_device_test, NULL, 120));
	bool alive = test_daemon_alive(&daemon_);
	if (gpu_tests_failed || !alive)
		test_daemon_dump_log(&daemon_);
	int rc = test_daemon_stop(&daemon_);
	report("daemon alive and exits 0 on SIGTERM", alive && rc == 0 ? 0 : 1);
	return gpu_test_summary("test_enqueue");
}
