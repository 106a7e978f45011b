/* A long chain of enqueued LayerNorm jobs (enqueue_chain.h). */
#include "tests/support/enqueue_chain.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "normclient.h"

int64_t enqueue_chain_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The forward and backward jobs over one allocation (*base_out, ours to free). */
static int chain_jobs(nc_conn *conn, const struct enqueue_chain *c, struct nc_job *fwd,
		      struct nc_job *bwd, void **base_out)
{
	size_t t = c->rows * c->cols * 2, w = c->cols * 2, r = c->rows * 4;
	size_t total = 4 * t + 2 * w + 2 * r;
	char *base = NULL;
	if (cudaMalloc((void **)&base, total) != cudaSuccess ||
	    cudaMemset(base, 0x3c, total) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
		return -1;
	*base_out = base;
	char *p[8] = {base, base + t, base + 2 * t, base + 3 * t, base + 4 * t, base + 4 * t + w,
		      base + 4 * t + 2 * w, base + 4 * t + 2 * w + r};
	struct nc_tensor ts[8];
	for (int i = 0; i < 8; i++)
		if (nc_tensor_device(conn, p[i], &ts[i]) != NC_OK)
			return -1;
	*fwd = (struct nc_job){.op = NC_LAYERNORM_FWD, .rows = c->rows, .cols = c->cols,
			       .dtype = NC_BF16, .x = ts[0], .y = ts[1], .gamma = ts[4],
			       .beta = ts[5], .mean = ts[6], .rstd = ts[7]};
	*bwd = (struct nc_job){.op = NC_LAYERNORM_BWD, .rows = c->rows, .cols = c->cols,
			       .dtype = NC_BF16, .x = ts[0], .dy = ts[2], .dx = ts[3],
			       .gamma = ts[4], .beta = ts[5], .mean = ts[6], .rstd = ts[7]};
	return 0;
}

/* Says "go" once on c->go_fd (if any), so that a waiting test never waits for a chain in vain. */
static void chain_signal(const struct enqueue_chain *c, bool *signalled)
{
	if (!*signalled && c->go_fd >= 0)
		*signalled = write(c->go_fd, "g", 1) == 1;
}

int enqueue_chain_run(const struct enqueue_chain *c, int out_fd)
{
	struct enqueue_chain_outcome o = {0};
	nc_conn *conn = NULL;
	struct nc_job fwd, bwd;
	void *base = NULL;
	cudaStream_t s = NULL;
	bool signalled = false;
	int status = 2;
	cudaError_t err = cudaSetDevice(c->device);
	if (err == cudaSuccess)
		err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
	if (err != cudaSuccess) {
		fprintf(stderr, "  chain set-up on GPU %d: %s\n", c->device,
			cudaGetErrorString(err));
		goto out;
	}
	if (nc_connect(c->socket_path, "enqueue-chain", 10000, &conn) != NC_OK ||
	    chain_jobs(conn, c, &fwd, &bwd, &base) != 0) {
		fprintf(stderr, "  chain set-up on GPU %d: %s (CUDA: %s)\n", c->device,
			nc_last_error(), cudaGetErrorString(cudaGetLastError()));
		goto out;
	}
	for (int k = 0; k < c->jobs && o.enqueue_rc == 0; k++) {
		int rc = nc_job_enqueue(conn, c->backward && k % 2 ? &bwd : &fwd, s);
		if (rc == NC_OK)
			o.enqueued++;
		else
			o.enqueue_rc = rc;
		if (k + 1 == c->signal_after || rc != NC_OK)
			chain_signal(c, &signalled);
	}
	chain_signal(c, &signalled);
	o.cuda_rc = (int)cudaStreamSynchronize(s);
	o.synced_ns = enqueue_chain_now_ns();
	o.check_rc = nc_conn_check(conn, 5000);
	status = o.enqueue_rc == 0 && o.cuda_rc == 0 && o.check_rc == 0 ? 0 : 1;
	if (out_fd >= 0 && write(out_fd, &o, sizeof(o)) != sizeof(o))
		status = 3;
out:
	chain_signal(c, &signalled);
	nc_close(conn);
	if (base && cudaFree(base) != cudaSuccess)
		fprintf(stderr, "  chain: cudaFree: %s\n", cudaGetErrorString(cudaGetLastError()));
	if (s && cudaStreamDestroy(s) != cudaSuccess)
		fprintf(stderr, "  chain: cudaStreamDestroy: %s\n",
			cudaGetErrorString(cudaGetLastError()));
	return status;
}
