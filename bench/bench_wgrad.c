/*
 * WGRAD_ACCUM through normd on the GPU: TFLOP/s of main_grad (fp32) +=
 * dy^T x with bf16 x and dy, for the shapes of issue 8, measured as the
 * median device time the daemon reports (CUDA events around the cuBLAS call)
 * and as the median end-to-end wall time of the synchronous call.
 * FLOPs = 2 * tokens * in * out. Inputs are random (never zeros).
 * Prints one line per shape: "wgrad tokens in out device_tflops wall_tflops".
 * bench/bench_wgrad.py runs this next to PyTorch and prints the table.
 *
 * Usage: build/bench/bench_wgrad [reps]   (from the repository root)
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "client/tools/rng.h"
#include "kernels/norm_kernels.h"
#include "normclient.h"
#include "tests/support/testlib.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* Fills `bytes` of device memory with random bf16 values in [-1, 1), tiled from 64 MiB. */
static int fill_random_bf16(void *dst, size_t bytes, unsigned seed)
{
	size_t chunk = 64u << 20;
	uint16_t *host = malloc(chunk);
	if (!host)
		return -1;
	uint64_t state = seed;
	for (size_t i = 0; i < chunk / 2; i++)
		host[i] = nk_f32_to_bf16((float)rng_uniform(&state, -1.0, 1.0));
	for (size_t off = 0; off < bytes; off += chunk) {
		size_t n = bytes - off < chunk ? bytes - off : chunk;
		if (cudaMemcpy((char *)dst + off, host, n, cudaMemcpyHostToDevice) != cudaSuccess) {
			free(host);
			return -1;
		}
	}
	free(host);
	return 0;
}

static int bench_shape(nc_conn *conn, long tokens, long in, long out, int reps)
{
	size_t xb = (size_t)tokens * in * 2, dyb = (size_t)tokens * out * 2;
	size_t gb = (size_t)out * in * 4;
	void *x, *dy, *g;
	if (cudaMalloc(&x, xb) || cudaMalloc(&dy, dyb) || cudaMalloc(&g, gb))
		return -1;
	if (fill_random_bf16(x, xb, 1) || fill_random_bf16(dy, dyb, 2) ||
	    fill_random_bf16(g, gb, 3)) /* any non-zero bits will do as a start */
		return -1;
	struct nc_job job = {.op = NC_WGRAD_ACCUM, .rows = (uint64_t)tokens, .cols = (uint64_t)in,
			     .out_features = (uint64_t)out, .dtype = NC_BF16,
			     .weight_dtype = NC_F32};
	if (nc_tensor_device(conn, x, &job.x) || nc_tensor_device(conn, dy, &job.dy) ||
	    nc_tensor_device(conn, g, &job.main_grad)) {
		fprintf(stderr, "register: %s\n", nc_last_error());
		return -1;
	}
	double *dev = malloc(sizeof(double) * (size_t)reps), *wall = malloc(sizeof(double) * (size_t)reps);
	struct nc_job_result r;
	for (int i = -3; i < reps; i++) {
		double t0 = now_s();
		if (nc_job_run_on_stream(conn, &job, NULL, 60000, &r) != NC_OK) {
			fprintf(stderr, "job: %s\n", r.message);
			return -1;
		}
		if (i >= 0) {
			wall[i] = now_s() - t0;
			dev[i] = (double)r.device_us * 1e-6;
		}
	}
	qsort(dev, (size_t)reps, sizeof(double), cmp_double);
	qsort(wall, (size_t)reps, sizeof(double), cmp_double);
	double flops = 2.0 * (double)tokens * (double)in * (double)out;
	printf("wgrad %ld %ld %ld %.1f %.1f %s\n", tokens, in, out, flops / dev[reps / 2] / 1e12,
	       flops / wall[reps / 2] / 1e12, r.variant);
	fflush(stdout);
	free(dev);
	free(wall);
	cudaFree(x);
	cudaFree(dy);
	cudaFree(g);
	return 0;
}

int main(int argc, char **argv)
{
	int reps = argc > 1 ? atoi(argv[1]) : 10;
	struct test_daemon d;
	if (test_daemon_start_on(&d, "0", NULL) != 0) {
		fprintf(stderr, "cannot start normd --device 0\n");
		return 1;
	}
	nc_conn *conn;
	if (nc_connect(d.socket, "bench-wgrad", 10000, &conn)) {
		fprintf(stderr, "connect: %s\n", nc_last_error());
		test_daemon_stop(&d);
		return 1;
	}
	static const long shapes[][3] = {{8192, 4096, 4096}, {16384, 8192, 8192}, {4096, 12288, 49152}};
	int rc = 0;
	for (int s = 0; s < 3 && rc == 0; s++)
		rc = bench_shape(conn, shapes[s][0], shapes[s][1], shapes[s][2], reps);
	nc_close(conn);
	test_daemon_stop(&d);
	return rc ? 1 : 0;
}
