/*
 * End-to-end latency of a tiny job (rows = 1, cols = 1024, bf16 RMSNorm
 * forward) through normd on the GPU, beside the two floors it is built from,
 * all measured in this one run on this machine:
 *   - a bare Unix-socket round trip between two processes (64-byte ping-pong),
 *   - a bare kernel launch + stream synchronize of the same job in-process.
 * Completion modes: synchronous (nc_job_run_on_stream) and IPC events
 * (nc_job_run_event, then a stream synchronize so that the time covers the
 * job's completion).
 * Target (issue 4): sync p50 within 1.5x of (round trip + launch/sync), p99 < 100 us.
 *
 * To show where the time goes it also measures a ping through normd (the
 * library and the daemon's loop, no GPU) and prints the medians of the
 * synchronous replies' queue_us (arrival to a worker taking the job) and
 * device_us (launch to the end of the worker's stream wait).
 *
 * Usage: build/bench/bench_latency [iterations] [normd options...]
 *        (run from the repository root; options go to the daemon, e.g.
 *        --cuda-workers 1 or --busy-poll-us 0)
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/norm_kernels.h"
#include "normclient.h"
#include "tests/support/testlib.h"

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

struct summary {
	double p50, p99, max;
};

static struct summary summarize(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(double), cmp_double);
	struct summary s = {v[n / 2], v[(int)(n * 0.99)], v[n - 1]};
	return s;
}

/* Round trips of 64 bytes over a Unix socket to an echoing child process. */
static struct summary socket_round_trip(int iters)
{
	char path[] = "/tmp/normd-rtt.XXXXXX";
	int tmp = mkstemp(path);
	close(tmp);
	unlink(path);
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
	int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
	if (bind(lfd, (struct sockaddr *)&addr, sizeof(addr)) || listen(lfd, 1))
		exit(1);
	pid_t pid = fork();
	if (pid == 0) {
		int c = accept(lfd, NULL, NULL);
		char buf[64];
		while (recv(c, buf, sizeof(buf), MSG_WAITALL) == sizeof(buf))
			send(c, buf, sizeof(buf), 0);
		_exit(0);
	}
	int fd = socket(AF_UNIX, SOCK_STREAM, 0);
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)))
		exit(1);
	double *v = malloc(sizeof(double) * (size_t)iters);
	char buf[64] = {1};
	for (int i = -100; i < iters; i++) {
		double t0 = now_us();
		send(fd, buf, sizeof(buf), 0);
		recv(fd, buf, sizeof(buf), MSG_WAITALL);
		if (i >= 0)
			v[i] = now_us() - t0;
	}
	close(fd);
	waitpid(pid, NULL, 0);
	close(lfd);
	unlink(path);
	struct summary s = summarize(v, iters);
	free(v);
	return s;
}

/* The tiny job's tensors in one allocation: x, y, gamma. */
struct tiny {
	char *base;
	struct nk_norm_args args;
};

static void tiny_init(struct tiny *t)
{
	size_t bytes = 3 * 4096;
	cudaMalloc((void **)&t->base, bytes);
	cudaMemset(t->base, 0x3c, bytes); /* bf16 1.07: non-zero data */
	memset(&t->args, 0, sizeof(t->args));
	t->args.op = NK_RMSNORM_FWD;
	t->args.rows = 1;
	t->args.cols = 1024;
	t->args.eps = 1e-5f;
	t->args.dtype = t->args.weight_dtype = NK_BF16;
	t->args.x = t->base;
	t->args.y = t->base + 4096;
	t->args.gamma = t->base + 8192;
}

/* In-process launch + synchronize: the device floor. */
static struct summary launch_sync(struct tiny *t, int iters)
{
	struct nk_device_info dev = {0};
	struct cudaDeviceProp prop;
	cudaGetDeviceProperties(&prop, 0);
	dev.sm_count = prop.multiProcessorCount;
	dev.max_threads_per_sm = prop.maxThreadsPerMultiProcessor;
	dev.max_smem_per_block_optin = prop.sharedMemPerBlockOptin;
	dev.cc_major = prop.major;
	dev.cc_minor = prop.minor;
	dev.mem_gbps = nk_cuda_mem_gbps(0);
	struct nk_variant v;
	nk_cuda_variant_default(&t->args, &dev, &v);
	void *ws = NULL;
	size_t ws_bytes = nk_cuda_workspace_bytes(&t->args, &dev, &v);
	cudaMalloc(&ws, ws_bytes ? ws_bytes : 1);
	cudaStream_t stream;
	cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
	struct nk_cuda_exec exec = {stream, ws, ws_bytes, NULL};
	double *samples = malloc(sizeof(double) * (size_t)iters);
	for (int i = -100; i < iters; i++) {
		double t0 = now_us();
		nk_cuda_norm(&t->args, &dev, &v, &exec, NULL);
		cudaStreamSynchronize(stream);
		if (i >= 0)
			samples[i] = now_us() - t0;
	}
	cudaStreamDestroy(stream);
	cudaFree(ws);
	struct summary s = summarize(samples, iters);
	free(samples);
	return s;
}

/* nc_ping round trips through normd: the library and the loop, no GPU. */
static int ping_normd(const char *socket_path, int iters, struct summary *out)
{
	nc_conn *conn;
	if (nc_connect(socket_path, "bench-latency-ping", 10000, &conn)) {
		fprintf(stderr, "connect: %s\n", nc_last_error());
		return -1;
	}
	double *samples = malloc(sizeof(double) * (size_t)iters);
	int rc = 0;
	for (int i = -200; i < iters && rc == 0; i++) {
		double t0 = now_us();
		rc = nc_ping(conn, 10000);
		if (i >= 0)
			samples[i] = now_us() - t0;
	}
	if (rc == 0)
		*out = summarize(samples, iters);
	else
		fprintf(stderr, "ping: %s\n", nc_last_error());
	free(samples);
	nc_close(conn);
	return rc ? -1 : 0;
}

/* Medians of the synchronous replies' own timings. */
struct breakdown {
	double queue_us, device_us;
};

/* The same job through normd, in the synchronous or the IPC-event mode. */
static int through_normd(struct tiny *t, const char *socket_path, int iters, bool events,
			 struct summary *out, struct breakdown *parts)
{
	nc_conn *conn;
	if (nc_connect(socket_path, "bench-latency", 10000, &conn)) {
		fprintf(stderr, "connect: %s\n", nc_last_error());
		return -1;
	}
	struct nc_job job = {.op = NC_RMSNORM_FWD, .rows = 1, .cols = 1024, .dtype = NC_BF16};
	if (nc_tensor_device(conn, t->args.x, &job.x) || nc_tensor_device(conn, t->args.y, &job.y) ||
	    nc_tensor_device(conn, t->args.gamma, &job.gamma)) {
		fprintf(stderr, "register: %s\n", nc_last_error());
		nc_close(conn);
		return -1;
	}
	double *samples = malloc(sizeof(double) * (size_t)iters);
	double *queue = malloc(sizeof(double) * (size_t)iters);
	double *device = malloc(sizeof(double) * (size_t)iters);
	struct nc_job_result result;
	cudaStream_t stream;
	cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
	for (int i = -200; i < iters; i++) {
		double t0 = now_us();
		/* Event mode: the call returns at once; done when the stream is. */
		int rc = events ? nc_job_run_event(conn, &job, stream, 10000, &result)
				: nc_job_run_on_stream(conn, &job, stream, 10000, &result);
		if (events && rc == NC_OK)
			cudaStreamSynchronize(stream);
		if (rc != NC_OK) {
			fprintf(stderr, "job: %s\n", result.message);
			free(samples);
			free(queue);
			free(device);
			nc_close(conn);
			return -1;
		}
		if (i >= 0) {
			samples[i] = now_us() - t0;
			queue[i] = (double)result.queue_us;
			device[i] = (double)result.device_us;
		}
	}
	*out = summarize(samples, iters);
	parts->queue_us = summarize(queue, iters).p50;
	parts->device_us = summarize(device, iters).p50;
	printf("  (%s mode, variant %s)\n", events ? "event" : "sync", result.variant);
	free(samples);
	free(queue);
	free(device);
	cudaStreamDestroy(stream);
	nc_close(conn);
	return 0;
}

int main(int argc, char **argv)
{
	int iters = argc > 1 ? atoi(argv[1]) : 20000;
	if (iters < 100) {
		fprintf(stderr, "usage: bench_latency [iterations >= 100] [normd options...]\n");
		return 2;
	}
	struct test_daemon d;
	/* Start the daemon before this process touches CUDA (it forks). */
	if (test_daemon_start_on(&d, "0", argc > 2 ? (const char *const *)argv + 2 : NULL) != 0) {
		fprintf(stderr, "cannot start normd --device 0\n");
		return 1;
	}
	struct summary rtt = socket_round_trip(iters);
	struct tiny t;
	tiny_init(&t);
	struct summary launch = launch_sync(&t, iters);
	struct summary sync = {0}, event = {0}, ping = {0};
	struct breakdown sync_parts = {0}, event_parts = {0};
	int rc = ping_normd(d.socket, iters, &ping);
	if (rc == 0)
		rc = through_normd(&t, d.socket, iters, false, &sync, &sync_parts);
	if (rc == 0)
		rc = through_normd(&t, d.socket, iters, true, &event, &event_parts);
	test_daemon_stop(&d);
	if (rc)
		return 1;
	double floor = rtt.p50 + launch.p50;
	printf("tiny job: RMSNorm fwd, rows=1, cols=1024, bf16; %d iterations each\n", iters);
	printf("%-36s %9s %9s %9s\n", "measurement", "p50_us", "p99_us", "max_us");
	printf("%-36s %9.1f %9.1f %9.1f\n", "unix socket round trip (2 procs)", rtt.p50, rtt.p99,
	       rtt.max);
	printf("%-36s %9.1f %9.1f %9.1f\n", "kernel launch + sync (in-process)", launch.p50,
	       launch.p99, launch.max);
	printf("%-36s %9.1f %9.1f %9.1f\n", "normd ping (library + loop, no GPU)", ping.p50,
	       ping.p99, ping.max);
	printf("%-36s %9.1f %9.1f %9.1f\n", "normd sync mode (end to end)", sync.p50, sync.p99,
	       sync.max);
	printf("%-36s %9.1f %9s %9s\n", "  of which queue_us (daemon, p50)", sync_parts.queue_us,
	       "-", "-");
	printf("%-36s %9.1f %9s %9s\n", "  of which device_us (daemon, p50)", sync_parts.device_us,
	       "-", "-");
	printf("%-36s %9.1f %9.1f %9.1f\n", "normd event mode (call + stream sync)", event.p50,
	       event.p99, event.max);
	printf("%-36s %9.1f %9s %9s\n", "  of which device_us (daemon, p50)", event_parts.device_us,
	       "-", "-");
	printf("sync p50 / (rtt p50 + launch p50) = %.2f (target <= 1.5); sync p99 %.1f us "
	       "(target < 100)\n",
	       sync.p50 / floor, sync.p99);
	cudaFree(t.base);
	return 0;
}
