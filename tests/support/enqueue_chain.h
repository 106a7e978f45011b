/*
 * A long chain of enqueued LayerNorm jobs on one GPU, for the GPU tests that
 * kill someone mid-chain (tests/gpu/test_enqueue.c, test_multi_gpu.c): the
 * caller's stream holds seconds of daemon work, and what the client saw
 * (how many calls worked, when its stream was released, what nc_conn_check
 * said) comes back as a struct enqueue_chain_outcome.
 */
#ifndef NORMD_ENQUEUE_CHAIN_H
#define NORMD_ENQUEUE_CHAIN_H

#include <stdbool.h>
#include <stdint.h>

struct enqueue_chain {
	const char *socket_path;
	int device;       /* the GPU of the chain's memory and stream */
	uint64_t rows, cols;
	int jobs;
	int signal_after; /* write one byte to go_fd after this many jobs were enqueued */
	int go_fd;        /* -1: none */
	bool backward;    /* alternate forward and backward jobs */
};

struct enqueue_chain_outcome {
	int enqueued;      /* calls that returned NC_OK */
	int enqueue_rc;    /* the first call that did not (0: none) */
	int cuda_rc;       /* cudaStreamSynchronize */
	int check_rc;      /* nc_conn_check afterwards */
	int64_t synced_ns; /* when cudaStreamSynchronize returned (enqueue_chain_now_ns) */
};

/* CLOCK_MONOTONIC in nanoseconds: system-wide, so comparable between processes. */
int64_t enqueue_chain_now_ns(void);

/*
 * Runs the chain (x, y, dy, dx [rows, cols] bf16, gamma, beta [cols], mean,
 * rstd in one cudaMalloc allocation on c->device) and writes the outcome to
 * out_fd when it is >= 0. Says "go" on c->go_fd once signal_after jobs
 * are enqueued, or at once when the set-up fails. Returns 0 when every call
 * worked, 1 when one did not, 2 or 3 when the set-up or the report failed.
 * Call it in a process of its own (it makes a CUDA context).
 */
int enqueue_chain_run(const struct enqueue_chain *c, int out_fd);

#endif
