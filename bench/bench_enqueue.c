/*
 * What the enqueue completion mode (nc_job_enqueue) costs, beside the
 * synchronous mode (nc_job_run_on_stream) and beside launching the same
 * kernel in-process, on a tiny RMSNorm forward job (8 x 1024 bf16, gamma):
 *   1. host cost per call: each nc_job_enqueue timed with clock_gettime
 *      (the stream synchronized every 256 calls, outside the timing); the
 *      same calls each followed by --gap-us of host work that sweeps 16 MiB
 *      (a training step's pattern: the caches cold, the daemon idle for a
 *      while between two jobs); the synchronous mode's whole call for
 *      comparison;
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
 * cannot fork children that use it); this one stays CUDA-free and prints
 * each part of the table on stdout as soon as it is measured. Progress lines
 * go to stderr. Nothing waits without a limit: each step of a child runs
 * under an alarm that names the step when it fires, and this process waits
 * for its children with timeouts.
 *
 * The gate is a word in pinned host memory that the caller's stream waits on
 * (cuStreamWaitValue32) and this process's CPU writes: opening it needs no
 * CUDA call and no other stream. Nothing that may wait for the device runs
 * while a gate is closed: kernels load eagerly (CUDA_MODULE_LOADING=EAGER,
 * as in the daemon; a lazy load on the first launch waits for the whole
 * context, the gated stream included, which deadlocked the first version of
 * this benchmark), and the in-process kernels, the library's semaphore words
 * and the daemon's stream are all used once, ungated, before any gate. If a
 * gated segment still blocks the host, the alarm opens the gate and the
 * measurement fails with a message instead of hanging.
 *
 * Usage: bench_enqueue [--socket PATH] [--device N] [--json FILE|-] [--calls N]
 *                      [--chain N] [--seconds S] [--procs 1,4,16] [--no-sync]
 *                      [--gap-us US] [--no-rate] [-- normd options...]
 *   --socket PATH  use the normd at PATH (e.g. one started under MPS) instead
 *                  of starting `normd --device N` (from $NORMD_BIN, else the
 *                  bin/normd beside this program's bench/ directory)
 *   --device N     the GPU the caller's memory and streams are on (0); a
 *                  daemon at --socket must serve it
 *   --gap-us US    host work between two timed calls of part 1's second row (400)
 *   --no-rate      skip part 3 (the aggregate rate)
 *   --json FILE    also write the results as one JSON object ('-': stdout)
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
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
#define CHILD_TIMEOUT_S 900 /* a child's whole life at most (each step has its own alarm) */
#define SETUP_S 60          /* CUDA context, connection, registrations */
#define GATE_S 20           /* one gated segment, from its gate to the stream idle */
#define CHECK_MS 10000      /* nc_conn_check after the stream is idle */

struct options {
	const char *socket;
	const char *json;
	int calls;                /* host-cost calls per mode */
	int gap_us;               /* host work between the gapped host-cost calls */
	int chain;                /* dependent jobs */
	double seconds;           /* per aggregate-rate run */
	int procs[MAX_PROCS];     /* process counts of the aggregate rate */
	int nprocs;
	bool sync;                /* measure the synchronous mode too */
	bool rate;                /* measure part 3, the aggregate rate */
	int device;               /* the caller's GPU (CUDA ordinal) */
	const char *const *daemon_args;
};

struct summary {
	double p50, p99, mean, max;
};

struct host_cost {
	struct summary enqueue, enqueue_gapped, sync;
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
	bool enqueue_ok, sync_ok;
	double enqueue_jobs_s, sync_jobs_s;
	double enqueue_min_s, sync_min_s; /* the slowest process's own rate */
};

/* One aggregate-rate process's outcome. */
struct proc_result {
	long long jobs;
	double seconds;
	int status;
};

static double start_us; /* when main started (inherited by the children) */

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* A progress line on stderr: "bench_enqueue: [  12.3 s] what". */
static void progress(const char *fmt, ...)
{
	char line[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	fprintf(stderr, "bench_enqueue: [%7.1f s] %s\n", (now_us() - start_us) / 1e6, line);
}

/* ---- the watchdog of a child: every step runs under an alarm ----------------------------- */

static char step_text[2][256];
static const char *volatile step_name = "starting";
static unsigned step_next;
static volatile int step_job = -1;            /* the job being queued in a gated segment */
static uint32_t *volatile gate_armed;         /* the closed gate of the current segment */
static volatile uint32_t gate_armed_value;
static volatile sig_atomic_t gate_forced;     /* the alarm had to open it */

static void say(const char *s)
{
	ssize_t ignored = write(STDERR_FILENO, s, strlen(s));
	(void)ignored;
}

static void say_int(long v)
{
	char buf[24], *p = buf + sizeof(buf) - 1;
	bool neg = v < 0;
	unsigned long u = neg ? (unsigned long)-v : (unsigned long)v;
	*p = '\0';
	do {
		*--p = (char)('0' + u % 10);
		u /= 10;
	} while (u);
	if (neg)
		*--p = '-';
	say(p);
}

static void on_alarm(int sig)
{
	(void)sig;
	say("bench_enqueue: [pid ");
	say_int((long)getpid());
	uint32_t *gate = gate_armed;
	if (gate && !gate_forced) {
		/* The host blocked while its stream waits on the gate: open it, fail afterwards. */
		__atomic_store_n(gate, gate_armed_value, __ATOMIC_SEQ_CST);
		gate_forced = 1;
		say("] the gate was still closed after the step's time limit, in: ");
		say(step_name);
		say(" (job ");
		say_int(step_job);
		say("); the watchdog opened it\n");
		alarm(GATE_S);
		return;
	}
	say("] TIMED OUT in: ");
	say(step_name);
	if (step_job >= 0) {
		say(" (job ");
		say_int(step_job);
		say(")");
	}
	say("\n");
	_exit(3);
}

/* Names the step the child is in and gives it `seconds`; prints it when `loud`. */
static void step(bool loud, unsigned seconds, const char *fmt, ...)
{
	char *text = step_text[step_next++ % 2];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(text, sizeof(step_text[0]), fmt, ap);
	va_end(ap);
	step_name = text;
	step_job = -1;
	alarm(seconds);
	if (loud)
		progress("%s", text);
}

/* Time for n jobs (1 ms each: ten to a hundred times what they take). */
static unsigned budget_s(long jobs)
{
	return 30 + (unsigned)(jobs / 1000);
}

/* ---- children ------------------------------------------------------------------------------- */

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

/* Waits up to timeout_ms for the child, then kills it. Its wait status, or -1. */
static int reap_within(pid_t pid, int timeout_ms)
{
	int status = 0;
	double deadline = now_us() + timeout_ms * 1e3;
	for (;;) {
		pid_t r = waitpid(pid, &status, WNOHANG);
		if (r == pid)
			return status;
		if (r < 0)
			return -1;
		if (now_us() > deadline) {
			fprintf(stderr, "bench_enqueue: child %d did not exit: killed\n", (int)pid);
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
			return -1;
		}
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
}

static void describe_status(char *buf, size_t len, int status)
{
	if (status == -1)
		snprintf(buf, len, "killed after its timeout");
	else if (WIFEXITED(status))
		snprintf(buf, len, "exit %d", WEXITSTATUS(status));
	else if (WIFSIGNALED(status))
		snprintf(buf, len, "signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
	else
		snprintf(buf, len, "status 0x%x", status);
}

/*
 * Forks a child that dies with us, runs under the watchdog and ends after
 * CHILD_TIMEOUT_S at most. CUDA_MODULE_LOADING=EAGER is in main's environment.
 */
static pid_t fork_child(void)
{
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() == 1)
			_exit(1);
		struct sigaction sa;
		memset(&sa, 0, sizeof(sa));
		sa.sa_handler = on_alarm;
		sigemptyset(&sa.sa_mask);
		sigaction(SIGALRM, &sa, NULL);
		step(false, CHILD_TIMEOUT_S, "starting");
	}
	return pid;
}

/* Runs fn in a child; its result (len bytes at out) comes back through a pipe. 0 or -1. */
static int in_child(const char *what, int (*fn)(const struct options *, void *),
		    const struct options *o, void *out, size_t len)
{
	int fds[2];
	if (pipe(fds) != 0)
		return -1;
	pid_t pid = fork_child();
	if (pid < 0) {
		close(fds[0]);
		close(fds[1]);
		return -1;
	}
	if (pid == 0) {
		close(fds[0]);
		int rc = fn(o, out);
		alarm(30);
		if (rc == 0 && write(fds[1], out, len) != (ssize_t)len)
			rc = 1;
		fflush(NULL);
		_exit(rc);
	}
	close(fds[1]);
	/* The child's own alarms end it long before this; EOF comes at once if it dies. */
	int got = test_read_within(fds[0], out, len, (CHILD_TIMEOUT_S + 30) * 1000);
	close(fds[0]);
	/* A child that died closed the pipe as it went: a moment to reap it, else kill it. */
	int status = reap_within(pid, got == 0 ? 30000 : 5000);
	if (got == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0)
		return 0;
	char how[96];
	describe_status(how, sizeof(how), status);
	fprintf(stderr, "bench_enqueue: %s: the child process failed (%s)\n", what, how);
	return -1;
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
	cudaError_t err = cudaSuccess;
	if ((err = cudaSetDevice(o->device)) != cudaSuccess ||
	    (err = cudaMalloc((void **)&t->base, 2 * TENSOR_BYTES + COLS * 2)) != cudaSuccess ||
	    tiny_upload(t->base) != 0 ||
	    (err = cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking)) != cudaSuccess) {
		fprintf(stderr, "bench_enqueue: CUDA set-up failed: %s\n",
			cudaGetErrorString(err != cudaSuccess ? err : cudaGetLastError()));
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
	step(false, 30, "closing the connection");
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

static int sync_failed(const char *what, cudaError_t err)
{
	fprintf(stderr, "bench_enqueue: %s: cudaStreamSynchronize: %s\n", what,
		cudaGetErrorString(err));
	return 1;
}

/*
 * The stream idle, then every enqueued job answered (the daemon answers at
 * launch: only once the stream is idle may nc_conn_check wait).
 */
static int drain(struct tiny *t, const char *what)
{
	cudaError_t err = cudaStreamSynchronize(t->stream);
	if (err != cudaSuccess)
		return sync_failed(what, err);
	int rc = nc_conn_check(t->conn, CHECK_MS);
	return rc == NC_OK ? 0 : enqueue_failed(what, rc);
}

/* ---- 1. host cost per call --------------------------------------------------------------- */

static int time_enqueue_calls(struct tiny *t, int calls, double *samples)
{
	for (int i = -2048; i < calls; i++) {
		if (i % 256 == 0) {
			/* Keeps the queue short; not timed. Every job queued so far is ungated. */
			cudaError_t err = cudaStreamSynchronize(t->stream);
			if (err != cudaSuccess)
				return sync_failed("host cost", err);
		}
		double t0 = now_us();
		int rc = nc_job_enqueue(t->conn, &t->job[0], t->stream);
		double t1 = now_us();
		if (rc != NC_OK)
			return enqueue_failed("nc_job_enqueue", rc);
		if (i >= 0)
			samples[i] = t1 - t0;
	}
	return drain(t, "host cost");
}

/*
 * Host work of `us` microseconds that reads a 16 MiB buffer in a stride no
 * prefetcher follows, as a step's other ops leave the caches; returns what
 * it read so that the reads stay.
 */
static unsigned host_work(const unsigned char *junk, size_t size, size_t *pos, int us)
{
	unsigned sum = 0;
	double end = now_us() + us;
	while (now_us() < end)
		for (int k = 0; k < 1024; k++) {
			sum += junk[*pos];
			*pos = (*pos + 4099) % size;
		}
	return sum;
}

/* nc_job_enqueue calls a gap of host work apart, the stream synchronized every 64 (untimed). */
static int time_gapped_calls(struct tiny *t, int calls, int gap_us, double *samples)
{
	const size_t size = 16u << 20;
	unsigned char *junk = malloc(size);
	if (!junk)
		return 1;
	memset(junk, 1, size);
	size_t pos = 0;
	unsigned sum = 0;
	for (int i = -200; i < calls; i++) {
		if (i % 64 == 0) {
			cudaError_t err = cudaStreamSynchronize(t->stream);
			if (err != cudaSuccess) {
				free(junk);
				return sync_failed("gapped host cost", err);
			}
		}
		double t0 = now_us();
		int rc = nc_job_enqueue(t->conn, &t->job[0], t->stream);
		double t1 = now_us();
		if (rc != NC_OK) {
			free(junk);
			return enqueue_failed("nc_job_enqueue", rc);
		}
		if (i >= 0)
			samples[i] = t1 - t0;
		sum += host_work(junk, size, &pos, gap_us);
	}
	free(junk);
	if (sum == 0)
		fprintf(stderr, "bench_enqueue: the host work read nothing\n");
	return drain(t, "gapped host cost");
}

static int time_sync_calls(struct tiny *t, int calls, double *samples, char *variant)
{
	struct nc_job_result r;
	for (int i = -500; i < calls; i++) {
		double t0 = now_us();
		int rc = nc_job_run_on_stream(t->conn, &t->job[0], t->stream, 10000, &r);
		double t1 = now_us();
		if (rc != NC_OK) {
			fprintf(stderr, "bench_enqueue: sync job: %s: %s\n", nc_status_name(rc),
				r.message);
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
	step(true, SETUP_S, "host cost: set-up (CUDA context, connection, registrations)");
	if (tiny_open(&t, o, "bench-enqueue-host") != 0)
		return 1;
	h->daemon_mps = nc_server_info(t.conn)->mps;
	h->client_mps = nk_cuda_mps_enabled(0) == 1;
	double *samples = malloc(sizeof(double) * (size_t)o->calls);
	if (!samples)
		return 1;
	step(true, budget_s(o->calls + 2048), "host cost: 2048 + %d nc_job_enqueue calls "
	     "(stream synchronized every 256)", o->calls);
	if (time_enqueue_calls(&t, o->calls, samples) != 0)
		return 1;
	h->enqueue = summarize(samples, o->calls);
	int gapped = o->calls < 5000 ? o->calls : 5000;
	step(true, budget_s(2L * (gapped + 200) * (1 + o->gap_us / 100)),
	     "host cost: 200 + %d nc_job_enqueue calls %d us of host work apart", gapped,
	     o->gap_us);
	if (time_gapped_calls(&t, gapped, o->gap_us, samples) != 0)
		return 1;
	h->enqueue_gapped = summarize(samples, gapped);
	if (o->sync) {
		step(true, budget_s(2L * (o->calls + 500)),
		     "host cost: 500 + %d nc_job_run_on_stream calls", o->calls);
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

static int device_info(int device, struct nk_device_info *dev)
{
	struct cudaDeviceProp prop;
	memset(dev, 0, sizeof(*dev));
	cudaError_t err = cudaGetDeviceProperties(&prop, device);
	if (err != cudaSuccess) {
		fprintf(stderr, "bench_enqueue: GPU %d: %s\n", device, cudaGetErrorString(err));
		return -1;
	}
	dev->sm_count = prop.multiProcessorCount;
	dev->max_threads_per_sm = prop.maxThreadsPerMultiProcessor;
	dev->max_smem_per_block_optin = prop.sharedMemPerBlockOptin;
	dev->cc_major = prop.major;
	dev->cc_minor = prop.minor;
	dev->mem_gbps = nk_cuda_mem_gbps(device);
	return 0;
}

/* How the chain's jobs are launched. */
enum chain_kind { VIA_ENQUEUE, IN_PROCESS };

struct chain_ctx {
	struct tiny t;
	enum chain_kind kind;
	struct nk_device_info dev;
	struct nk_variant variant;
	struct nk_cuda_exec exec;
	uint32_t *gate_host;       /* pinned host word the stream waits on before each segment */
	void *gate_gpu;            /* the same word as the GPU sees it */
	uint32_t gate_value;
};

static const char *kind_name(enum chain_kind kind)
{
	return kind == VIA_ENQUEUE ? "enqueue" : "in-process";
}

/* Job k of the chain: x_k = y_{k-1}. */
static int chain_launch(struct chain_ctx *c, int k)
{
	if (c->kind == IN_PROCESS) {
		if (nk_cuda_norm(&c->t.args[k % 2], &c->dev, &c->variant, &c->exec, NULL) == NK_OK)
			return 0;
		fprintf(stderr, "bench_enqueue: nk_cuda_norm: %s\n", nk_cuda_last_error());
		return -1;
	}
	int rc = nc_job_enqueue(c->t.conn, &c->t.job[k % 2], c->t.stream);
	return rc == NC_OK ? 0 : enqueue_failed("chain nc_job_enqueue", rc);
}

/* Opens the gate from the CPU (no CUDA call: nothing here can block behind the stream). */
static void gate_open(struct chain_ctx *c)
{
	__atomic_store_n(c->gate_host, c->gate_value, __ATOMIC_SEQ_CST);
}

/*
 * The chain in gated segments: the stream waits on the gate, every job of
 * the segment is queued (enqueued: sent to the daemon, which launches each
 * once the stream reaches it), then the gate opens; events around each
 * segment give GPU time only. *host_us gets the launch calls' own time per job.
 * The daemon answers an enqueued job when it launches it, so nc_conn_check
 * comes only after the gate is open and the stream idle.
 */
static int chain_gated(struct chain_ctx *c, const char *label, int jobs, int segment,
		       double *gpu_us, double *host_us)
{
	int segs = (jobs + segment - 1) / segment;
	double gpu_ms = 0, host = 0;
	cudaEvent_t ev[2];
	if (cudaEventCreate(&ev[0]) != cudaSuccess || cudaEventCreate(&ev[1]) != cudaSuccess) {
		fprintf(stderr, "bench_enqueue: cudaEventCreate failed\n");
		return -1;
	}
	int rc = 0;
	for (int s = 0, k = 0; s < segs && rc == 0; s++) {
		step(false, GATE_S, "chain, %s, %s: gated segment %d of %d (%d jobs)",
		     kind_name(c->kind), label, s + 1, segs, segment);
		if (nk_cuda_stream_wait(c->t.stream, c->gate_gpu, ++c->gate_value) != 0 ||
		    cudaEventRecord(ev[0], c->t.stream) != cudaSuccess) {
			fprintf(stderr, "bench_enqueue: cannot queue the gate's wait\n");
			gate_open(c);
			rc = -1;
			break;
		}
		gate_armed_value = c->gate_value;
		gate_armed = c->gate_host; /* from here the alarm opens it */
		double t0 = now_us();
		for (int end = k + segment < jobs ? k + segment : jobs; k < end && rc == 0; k++) {
			step_job = k;
			rc = chain_launch(c, k);
		}
		host += now_us() - t0;
		if (rc == 0 && cudaEventRecord(ev[1], c->t.stream) != cudaSuccess)
			rc = -1;
		gate_open(c);
		gate_armed = NULL;
		step_job = -1;
		if (gate_forced) {
			fprintf(stderr,
				"bench_enqueue: chain, %s, %s, segment %d: the host blocked while the "
				"gate was closed (a CUDA call that waits for the device, or a full "
				"queue); the gated numbers would be wrong\n",
				kind_name(c->kind), label, s + 1);
			rc = -1;
		}
		cudaError_t err = cudaStreamSynchronize(c->t.stream);
		if (err != cudaSuccess)
			return sync_failed("gated chain", err);
		int crc = c->kind == VIA_ENQUEUE ? nc_conn_check(c->t.conn, CHECK_MS) : NC_OK;
		if (crc != NC_OK)
			return enqueue_failed("gated chain: nc_conn_check", crc);
		float ms = 0;
		if (rc == 0 && cudaEventElapsedTime(&ms, ev[0], ev[1]) != cudaSuccess)
			rc = -1;
		gpu_ms += ms;
	}
	cudaEventDestroy(ev[0]);
	cudaEventDestroy(ev[1]);
	if (rc != 0)
		return -1;
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
	cudaError_t err = cudaStreamSynchronize(c->t.stream);
	if (err != cudaSuccess)
		return sync_failed("ungated chain", err);
	*wall_us = (now_us() - t0) / jobs;
	float ms = 0;
	cudaEventElapsedTime(&ms, ev[0], ev[1]);
	*span_us = ms * 1e3 / jobs;
	cudaEventDestroy(ev[0]);
	cudaEventDestroy(ev[1]);
	if (c->kind == VIA_ENQUEUE) {
		int rc = nc_conn_check(c->t.conn, CHECK_MS);
		if (rc != NC_OK)
			return enqueue_failed("ungated chain: nc_conn_check", rc);
	}
	return 0;
}

static int chain_sync_mode(struct chain_ctx *c, int jobs, double *wall_us)
{
	struct nc_job_result r;
	double t0 = now_us();
	for (int k = 0; k < jobs; k++) {
		int rc = nc_job_run_on_stream(c->t.conn, &c->t.job[k % 2], c->t.stream, 10000, &r);
		if (rc != NC_OK) {
			fprintf(stderr, "bench_enqueue: sync chain: %s: %s\n", nc_status_name(rc),
				r.message);
			return -1;
		}
	}
	*wall_us = (now_us() - t0) / jobs;
	return 0;
}

static int chain_setup(struct chain_ctx *c, const struct options *o)
{
	memset(c, 0, sizeof(*c));
	if (tiny_open(&c->t, o, "bench-enqueue-chain") != 0 || device_info(o->device, &c->dev) != 0)
		return -1;
	nk_cuda_variant_default(&c->t.args[0], &c->dev, &c->variant);
	size_t ws = nk_cuda_workspace_bytes(&c->t.args[0], &c->dev, &c->variant);
	c->exec = (struct nk_cuda_exec){c->t.stream, NULL, ws, NULL};
	cudaError_t err = cudaSuccess;
	if ((err = cudaMalloc(&c->exec.workspace, ws ? ws : 16)) != cudaSuccess ||
	    (err = cudaHostAlloc((void **)&c->gate_host, 64, cudaHostAllocMapped)) != cudaSuccess ||
	    (err = cudaHostGetDevicePointer(&c->gate_gpu, c->gate_host, 0)) != cudaSuccess ||
	    (err = cudaDeviceSynchronize()) != cudaSuccess) {
		fprintf(stderr, "bench_enqueue: chain set-up: %s\n", cudaGetErrorString(err));
		return -1;
	}
	*c->gate_host = 0;
	return 0;
}

/*
 * Everything that may wait for the device, done once with no gate closed:
 * the in-process kernels' first launches (module loading, function
 * attributes), and the library's first enqueue on this stream (its
 * semaphore words: cudaMalloc, cudaHostRegister, registrations).
 */
static int chain_warm_ungated(struct chain_ctx *c)
{
	for (int kind = IN_PROCESS; kind >= VIA_ENQUEUE; kind--) {
		c->kind = (enum chain_kind)kind;
		for (int k = 0; k < 16; k++) {
			if (chain_launch(c, k) != 0)
				return -1;
		}
		if (drain(&c->t, "chain warm-up") != 0)
			return -1;
	}
	/* The gate itself, once, opened before anything is queued behind it. */
	if (nk_cuda_stream_wait(c->t.stream, c->gate_gpu, ++c->gate_value) != 0) {
		fprintf(stderr, "bench_enqueue: nk_cuda_stream_wait on a host word failed\n");
		return -1;
	}
	gate_open(c);
	cudaError_t err = cudaStreamSynchronize(c->t.stream);
	return err == cudaSuccess ? 0 : sync_failed("the gate's first wait", err);
}

static int chain_child(const struct options *o, void *out)
{
	struct chain_cost *r = out;
	struct chain_ctx c;
	step(true, SETUP_S, "chain: set-up (CUDA context, connection, registrations)");
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
	step(true, SETUP_S, "chain: ungated warm-up (in-process kernels, first enqueues, the gate)");
	int rc = chain_warm_ungated(&c);
	double ignored;
	for (int kind = IN_PROCESS; kind >= VIA_ENQUEUE && rc == 0; kind--) {
		c.kind = (enum chain_kind)kind;
		bool enq = kind == VIA_ENQUEUE;
		step(true, CHILD_TIMEOUT_S, "chain, %s: %d jobs in gated segments of %d, then ungated",
		     kind_name(c.kind), o->chain, r->segment);
		rc = chain_gated(&c, "warm-up", r->segment, r->segment, &ignored, &ignored);
		if (rc == 0)
			rc = chain_gated(&c, "measured", o->chain, r->segment,
					 enq ? &r->enqueue_gpu_us : &r->inproc_gpu_us,
					 enq ? &r->enqueue_host_us : &ignored);
		if (rc == 0) {
			step(false, budget_s(o->chain), "chain, %s: %d jobs ungated",
			     kind_name(c.kind), o->chain);
			rc = chain_ungated(&c, o->chain,
					   enq ? &r->enqueue_wall_us : &r->inproc_wall_us,
					   enq ? &r->enqueue_span_us : &r->inproc_span_us);
		}
	}
	if (rc == 0 && o->sync) {
		step(true, budget_s(2L * o->chain), "chain, sync mode: %d nc_job_run_on_stream calls",
		     o->chain);
		rc = chain_sync_mode(&c, o->chain, &r->sync_wall_us);
	}
	if (rc != 0) {
		fprintf(stderr, "bench_enqueue: chain failed (last CUDA error: %s)\n",
			cudaGetErrorString(cudaGetLastError()));
		return 1;
	}
	cudaFree(c.exec.workspace);
	cudaFreeHost(c.gate_host);
	tiny_close(&c.t);
	return 0;
}

/* ---- 3. aggregate rate ------------------------------------------------------------------------
 */

/* One process: warm up, say ready, wait for the start (EOF on go_fd), run for o->seconds. */
static int rate_process(const struct options *o, int procs, int index, bool sync_mode,
			int ready_fd, int go_fd, int out_fd)
{
	struct tiny t;
	struct proc_result res = {0};
	struct nc_job_result r;
	const char *mode = sync_mode ? "sync" : "enqueue";
	bool loud = index == 0;
	step(loud, SETUP_S, "rate P=%d %s: process %d: set-up and 256 warm-up jobs", procs, mode,
	     index);
	if (tiny_open(&t, o, sync_mode ? "bench-rate-sync" : "bench-rate-enqueue") != 0)
		return 1;
	for (int i = 0; i < 256; i++) {
		int rc = sync_mode ? nc_job_run_on_stream(t.conn, &t.job[0], t.stream, 10000, &r)
				   : nc_job_enqueue(t.conn, &t.job[0], t.stream);
		if (rc != NC_OK)
			return enqueue_failed("rate warm-up", rc);
	}
	if (drain(&t, "rate warm-up") != 0 || write(ready_fd, "r", 1) != 1)
		return 1;
	step(false, 180, "rate P=%d %s: process %d: waiting for the start", procs, mode, index);
	char byte;
	struct pollfd p = {.fd = go_fd, .events = POLLIN};
	int n;
	while ((n = poll(&p, 1, 150000)) < 0 && errno == EINTR)
		;
	if (n <= 0 || read(go_fd, &byte, 1) != 0) {
		fprintf(stderr, "bench_enqueue: rate process %d: no start signal\n", index);
		return 1;
	}
	step(false, budget_s(0) + (unsigned)o->seconds, "rate P=%d %s: process %d: running", procs,
	     mode, index);
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
		res.status = nc_conn_check(t.conn, CHECK_MS);
	if (res.status != 0)
		fprintf(stderr, "bench_enqueue: rate process %d: %s (%s)\n", index,
			nc_status_name(res.status), nc_last_error());
	tiny_close(&t);
	return write(out_fd, &res, sizeof(res)) == sizeof(res) ? 0 : 1;
}

/*
 * Waits for `procs` ready bytes; fails at once when a process exits before
 * it is ready (the others would wait for the start forever).
 */
static int await_ready(int fd, int procs, const pid_t *pids, int *status, bool *reaped,
		       int timeout_ms)
{
	int got = 0;
	double deadline = now_us() + timeout_ms * 1e3;
	while (got < procs) {
		if (now_us() > deadline) {
			fprintf(stderr, "bench_enqueue: only %d of %d rate processes were ready "
				"within %d s\n", got, procs, timeout_ms / 1000);
			return -1;
		}
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (poll(&p, 1, 100) > 0) {
			char bytes[64];
			ssize_t n = read(fd, bytes, (size_t)(procs - got));
			if (n > 0)
				got += (int)n;
		}
		for (int i = 0; i < procs && got < procs; i++) {
			if (!reaped[i] && waitpid(pids[i], &status[i], WNOHANG) == pids[i]) {
				reaped[i] = true;
				char how[96];
				describe_status(how, sizeof(how), status[i]);
				fprintf(stderr, "bench_enqueue: rate process %d ended before the start "
					"(%s)\n", i, how);
				return -1;
			}
		}
	}
	return 0;
}

/* Starts `procs` processes together; their summed rate, and the slowest one's, in jobs/s. */
static int rate_run(const struct options *o, int procs, bool sync_mode, double *total,
		    double *slowest)
{
	int ready[2], go[2], out[2];
	pid_t pids[64];
	int status[64] = {0};
	bool reaped[64] = {false};
	const char *mode = sync_mode ? "sync" : "enqueue";
	if (procs > 64 || pipe(ready) || pipe(go) || pipe(out))
		return -1;
	progress("rate P=%d %s: starting %d processes", procs, mode, procs);
	int started = 0;
	for (int p = 0; p < procs; p++) {
		pids[p] = fork_child();
		if (pids[p] < 0)
			break;
		if (pids[p] == 0) {
			close(ready[0]);
			close(go[1]);
			close(out[0]);
			int rc = rate_process(o, procs, p, sync_mode, ready[1], go[0], out[1]);
			fflush(NULL);
			_exit(rc);
		}
		started++;
	}
	close(ready[1]);
	close(go[0]);
	close(out[1]);
	int rc = started == procs ? 0 : -1;
	if (rc == 0)
		rc = await_ready(ready[0], procs, pids, status, reaped, 150000);
	close(go[1]); /* EOF: every process starts now (or gives up) */
	if (rc == 0)
		progress("rate P=%d %s: all ready, running %.1f s", procs, mode, o->seconds);
	*total = 0;
	*slowest = 1e30;
	double longest = 0;
	for (int p = 0; p < procs && rc == 0; p++) {
		struct proc_result res;
		/* EOF at once if every process has ended. */
		rc = test_read_within(out[0], &res, sizeof(res), (int)(o->seconds * 1000) + 90000);
		if (rc != 0)
			fprintf(stderr, "bench_enqueue: rate P=%d %s: %d of %d processes reported\n",
				procs, mode, p, procs);
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
	for (int p = 0; p < started; p++) {
		if (reaped[p])
			continue;
		if (rc != 0)
			kill(pids[p], SIGKILL);
		int st = reap_within(pids[p], 30000);
		if (rc == 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
			char how[96];
			describe_status(how, sizeof(how), st);
			fprintf(stderr, "bench_enqueue: rate process %d: %s\n", p, how);
			rc = -1;
		}
	}
	close(ready[0]);
	close(out[0]);
	return rc;
}

/* ---- output ------------------------------------------------------------------------------------
 */

static void print_header(const struct options *o, const struct host_cost *h, bool ok)
{
	printf("tiny job: RMSNorm fwd, rows=%d, cols=%d, bf16, gamma, GPU %d; normd MPS: %s, "
	       "client MPS: %s\n",
	       ROWS, COLS, o->device, !ok ? "?" : h->daemon_mps ? "yes" : "no",
	       !ok ? "?" : h->client_mps ? "yes" : "no");
}

static void print_host_cost(const struct options *o, const struct host_cost *h, bool ok)
{
	printf("\n1. host cost per call (%d calls each)\n", o->calls);
	if (!ok) {
		printf("FAILED (see the messages on stderr)\n");
		return;
	}
	printf("%-40s %9s %9s %9s %9s\n", "call", "p50_us", "p99_us", "mean_us", "max_us");
	printf("%-40s %9.2f %9.2f %9.2f %9.1f\n", "nc_job_enqueue", h->enqueue.p50, h->enqueue.p99,
	       h->enqueue.mean, h->enqueue.max);
	char gapped[64];
	snprintf(gapped, sizeof(gapped), "nc_job_enqueue, %d us of host work apart", o->gap_us);
	printf("%-40s %9.2f %9.2f %9.2f %9.1f\n", gapped, h->enqueue_gapped.p50,
	       h->enqueue_gapped.p99, h->enqueue_gapped.mean, h->enqueue_gapped.max);
	if (o->sync)
		printf("%-40s %9.2f %9.2f %9.2f %9.1f\n", "nc_job_run_on_stream (whole job)",
		       h->sync.p50, h->sync.p99, h->sync.mean, h->sync.max);
}

static void print_chain(const struct options *o, const struct chain_cost *c, bool ok)
{
	printf("\n2. dependent chain of %d jobs (x_k+1 = y_k), per job\n", o->chain);
	if (!ok) {
		printf("FAILED (see the messages on stderr)\n");
		return;
	}
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
}

static void print_rate_header(const struct options *o)
{
	printf(
	    "\n3. aggregate rate, %.1f s per run (enqueue: stream synchronized every 512 jobs)\n",
	    o->seconds);
	printf("%-6s %16s %18s %16s %18s\n", "procs", "enqueue jobs/s", "slowest proc /s",
	       o->sync ? "sync jobs/s" : "", o->sync ? "slowest proc /s" : "");
}

static void print_rate_row(const struct options *o, const struct rate *r)
{
	printf("%-6d", r->procs);
	if (r->enqueue_ok)
		printf(" %16.0f %18.0f", r->enqueue_jobs_s, r->enqueue_min_s);
	else
		printf(" %16s %18s", "FAILED", "-");
	if (o->sync && r->sync_ok)
		printf(" %16.0f %18.0f", r->sync_jobs_s, r->sync_min_s);
	else if (o->sync)
		printf(" %16s %18s", "FAILED", "-");
	printf("\n");
}

static void json_summary(FILE *f, const char *name, const struct summary *s)
{
	fprintf(f,
		"\"%s\": {\"p50_us\": %.3f, \"p99_us\": %.3f, \"mean_us\": %.3f, \"max_us\": %.3f}",
		name, s->p50, s->p99, s->mean, s->max);
}

/* A number, or null when its measurement failed. */
static void json_num(FILE *f, const char *sep, const char *name, bool ok, const char *fmt,
		     double v)
{
	fprintf(f, "%s\"%s\": ", sep, name);
	if (ok)
		fprintf(f, fmt, v);
	else
		fprintf(f, "null");
}

static void write_json(const struct options *o, const struct host_cost *h, bool h_ok,
		       const struct chain_cost *c, bool c_ok, const struct rate *rates,
		       int nrates)
{
	FILE *f = strcmp(o->json, "-") == 0 ? stdout : fopen(o->json, "w");
	if (!f) {
		fprintf(stderr, "bench_enqueue: %s: %s\n", o->json, strerror(errno));
		return;
	}
	fprintf(f, "{\"job\": {\"op\": \"rmsnorm_fwd\", \"rows\": %d, \"cols\": %d, \"dtype\": "
		   "\"bf16\"}, \"device\": %d,\n ",
		ROWS, COLS, o->device);
	if (h_ok)
		fprintf(f, "\"daemon_mps\": %s, \"client_mps\": %s,\n \"host_cost\": {\"calls\": %d, ",
			h->daemon_mps ? "true" : "false", h->client_mps ? "true" : "false",
			o->calls);
	else
		fprintf(f, "\"daemon_mps\": null, \"client_mps\": null,\n \"host_cost\": null");
	if (h_ok) {
		json_summary(f, "enqueue", &h->enqueue);
		fprintf(f, ", \"gap_us\": %d, ", o->gap_us);
		json_summary(f, "enqueue_gapped", &h->enqueue_gapped);
		if (o->sync) {
			fprintf(f, ", ");
			json_summary(f, "sync", &h->sync);
		}
		fprintf(f, "}");
	}
	if (c_ok) {
		fprintf(f, ",\n \"chain\": {\"jobs\": %d, \"segment\": %d, \"enqueue_gpu_us\": %.3f, "
			   "\"inproc_gpu_us\": %.3f, \"enqueue_host_us\": %.3f, "
			   "\"enqueue_wall_us\": %.3f, \"inproc_wall_us\": %.3f, "
			   "\"enqueue_span_us\": %.3f, \"inproc_span_us\": %.3f",
			c->jobs, c->segment, c->enqueue_gpu_us, c->inproc_gpu_us,
			c->enqueue_host_us, c->enqueue_wall_us, c->inproc_wall_us,
			c->enqueue_span_us, c->inproc_span_us);
		if (o->sync)
			fprintf(f, ", \"sync_wall_us\": %.3f", c->sync_wall_us);
		fprintf(f, "}");
	} else {
		fprintf(f, ",\n \"chain\": null");
	}
	fprintf(f, ",\n \"rate\": [");
	for (int i = 0; i < nrates; i++) {
		const struct rate *r = &rates[i];
		fprintf(f, "%s{\"procs\": %d, \"seconds\": %.2f", i ? ", " : "", r->procs,
			o->seconds);
		json_num(f, ", ", "enqueue_jobs_s", r->enqueue_ok, "%.0f", r->enqueue_jobs_s);
		json_num(f, ", ", "enqueue_slowest_proc_jobs_s", r->enqueue_ok, "%.0f",
			 r->enqueue_min_s);
		if (o->sync) {
			json_num(f, ", ", "sync_jobs_s", r->sync_ok, "%.0f", r->sync_jobs_s);
			json_num(f, ", ", "sync_slowest_proc_jobs_s", r->sync_ok, "%.0f",
				 r->sync_min_s);
		}
		fprintf(f, "}");
	}
	fprintf(f, "]}\n");
	if (f != stdout)
		fclose(f);
	else
		fflush(f);
}

/* ---- main -------------------------------------------------------------------------------------
 */

static int usage(void)
{
	fprintf(stderr, "usage: bench_enqueue [--socket PATH] [--device N] [--json FILE|-] "
			"[--calls N] [--chain N] [--seconds S] [--procs 1,4,16] [--no-sync] "
			"[--gap-us US] [--no-rate] [-- normd options...]\n");
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

/* A CUDA ordinal, or -1 when `v` is not a number of 0 to 1023. */
static int parse_device(const char *v)
{
	char *end;
	long n = strtol(v, &end, 10);
	return *v >= '0' && *v <= '9' && !*end && n < 1024 ? (int)n : -1;
}

static int parse(struct options *o, int argc, char **argv)
{
	*o = (struct options){.calls = 20000, .gap_us = 400, .chain = 2000, .seconds = 2.0, .sync = true,
			      .rate = true, .procs = {1, 4, 16}, .nprocs = 3};
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
		if (strcmp(a, "--no-rate") == 0) {
			o->rate = false;
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
		else if (strcmp(a, "--gap-us") == 0)
			o->gap_us = atoi(v);
		else if (strcmp(a, "--chain") == 0)
			o->chain = atoi(v);
		else if (strcmp(a, "--seconds") == 0)
			o->seconds = atof(v);
		else if (strcmp(a, "--device") == 0)
			o->device = parse_device(v);
		else if (strcmp(a, "--procs") != 0 || parse_procs(o, v) != 0)
			return -1;
	}
	return o->device >= 0 && o->calls >= 100 && o->calls <= 10000000 && o->gap_us >= 0 &&
			       o->gap_us <= 100000 && o->chain >= 1 &&
			       o->chain <= 10000000 && o->seconds > 0 && o->seconds <= 600
		       ? 0
		       : -1;
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

/* The last `lines` lines of normd's log (at debug level it has a line per job). */
static void dump_log_tail(const char *path, int lines)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return;
	long starts[256];
	int n = lines < 256 ? lines : 256, count = 0;
	char line[1024];
	long pos = 0;
	while (fgets(line, sizeof(line), f)) {
		if (strchr(line, '\n') || feof(f))
			starts[count++ % n] = pos;
		pos = ftell(f);
	}
	fprintf(stderr, "---- the last %d lines of normd's log (%s) ----\n", count < n ? count : n,
		path);
	if (count > 0) {
		fseek(f, starts[count < n ? 0 : count % n], SEEK_SET);
		while (fgets(line, sizeof(line), f))
			fputs(line, stderr);
	}
	fprintf(stderr, "-------------------\n");
	fclose(f);
}

/* Our own normd died: nothing after this can work. */
static bool daemon_gone(struct test_daemon *d, bool own)
{
	if (!own || test_daemon_alive(d))
		return false;
	fprintf(stderr, "bench_enqueue: normd exited\n");
	return true;
}

int main(int argc, char **argv)
{
	struct options o;
	start_us = now_us();
	if (parse(&o, argc, argv) != 0)
		return usage();
	signal(SIGPIPE, SIG_IGN);
	/*
	 * Kernels load when the context is made, not on their first launch: a
	 * lazy load waits for the whole context, a stream held by a gate included
	 * (the daemon sets the same for itself). The children inherit it.
	 */
	setenv("CUDA_MODULE_LOADING", "EAGER", 0);
	struct test_daemon d;
	bool own = !o.socket;
	if (own) {
		char ordinal[16];
		snprintf(ordinal, sizeof(ordinal), "%d", o.device);
		find_normd(argv[0]);
		progress("starting %s --device %s",
			 getenv("NORMD_BIN") ? getenv("NORMD_BIN") : "build/bin/normd", ordinal);
		if (test_daemon_start_on(&d, ordinal, o.daemon_args) != 0) {
			fprintf(stderr,
				"bench_enqueue: cannot start normd --device %s (set NORMD_BIN)\n",
				ordinal);
			return 1;
		}
		o.socket = d.socket;
		progress("normd runs (pid %d, socket %s, log %s)", (int)d.pid, d.socket, d.log);
	}
	struct host_cost h = {0};
	struct chain_cost c = {0};
	struct rate rates[MAX_PROCS] = {{0}};
	bool failed = false;

	bool h_ok = in_child("host cost", host_cost_child, &o, &h, sizeof(h)) == 0;
	failed |= !h_ok;
	print_header(&o, &h, h_ok);
	print_host_cost(&o, &h, h_ok);
	fflush(stdout);

	bool c_ok = false;
	if (!daemon_gone(&d, own))
		c_ok = in_child("chain", chain_child, &o, &c, sizeof(c)) == 0;
	failed |= !c_ok;
	print_chain(&o, &c, c_ok);
	fflush(stdout);

	if (!o.rate)
		o.nprocs = 0;
	else
		print_rate_header(&o);
	fflush(stdout);
	for (int i = 0; i < o.nprocs; i++) {
		struct rate *r = &rates[i];
		r->procs = o.procs[i];
		if (!daemon_gone(&d, own))
			r->enqueue_ok = rate_run(&o, r->procs, false, &r->enqueue_jobs_s,
						 &r->enqueue_min_s) == 0;
		if (o.sync && !daemon_gone(&d, own))
			r->sync_ok = rate_run(&o, r->procs, true, &r->sync_jobs_s,
					      &r->sync_min_s) == 0;
		if (!r->enqueue_ok || (o.sync && !r->sync_ok)) {
			fprintf(stderr, "bench_enqueue: the rate with %d processes failed\n",
				r->procs);
			failed = true;
		}
		print_rate_row(&o, r);
		fflush(stdout);
	}
	if (own) {
		if (failed)
			dump_log_tail(d.log, 80);
		progress("stopping normd");
		test_daemon_stop(&d);
	}
	if (o.json)
		write_json(&o, &h, h_ok, &c, c_ok, rates, o.nprocs);
	progress(failed ? "done, with failures" : "done");
	return failed ? 1 : 0;
}
