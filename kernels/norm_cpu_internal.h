/*
 * What kernels/norm_cpu.c (jobs, blocks, threads) and kernels/norm_cpu_row.h
 * (the row math, compiled once per compute type) share: one job's state,
 * the table of row functions of one compute type, and the constants that
 * cut a job into blocks and rows. Private to those two files.
 */
#ifndef NORMD_NORM_CPU_INTERNAL_H
#define NORMD_NORM_CPU_INTERNAL_H

#include "norm_kernels.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* Upper bound on blocks, hence on dgamma/dbeta partials and on threads. */
#define MAX_BLOCKS 32
/* A block holds at least this many elements where the job is that large. */
#define BLOCK_MIN_ELEMS (64 * 1024)
/* Jobs of at most this many elements run on the calling thread alone. */
#define THREADED_MIN_ELEMS (256 * 1024)

/* Rows of scratch (each `cols` of the compute type) one worker needs:
 * x_hat (then ds), dy (then dx), and the chunk partials of dgamma and
 * dbeta; a forward uses two, the row and its residual. */
#define SCRATCH_ROWS 4
/* Backward sums this many rows into a chunk partial before adding it to
 * its block's partial. */
#define ROW_CHUNK 64
/* Sums over more elements than this are split in halves (pairwise). */
#define PAIRWISE_LEAF 256

struct cpu_job;

/* The row math of one compute type (norm_cpu_row.h, compiled per type). */
struct cpu_kernels {
	size_t real_size; /* sizeof the compute type */
	/* Converts gamma/beta to the compute type; returns the clamped count. */
	uint32_t (*prepare)(struct cpu_job *job);
	/* Runs the rows of one block with a scratch of SCRATCH_ROWS rows. */
	void (*run_block)(struct cpu_job *job, int64_t block, void *scratch);
	/* Sums the dgamma/dbeta partials into the outputs (backward only). */
	void (*finish)(struct cpu_job *job, void *scratch);
};

/* One call of nk_cpu_norm. The `void *` arrays hold the compute type. */
struct cpu_job {
	const struct nk_norm_args *args;
	const struct cpu_kernels *kernels;
	int64_t rows, cols;
	int64_t nblocks;	      /* blocks of consecutive rows, see block_rows() */
	bool layernorm;		      /* LayerNorm, not RMSNorm */
	bool backward;		      /* a backward op */
	bool mem_eff;		      /* backward reads y and recomputes x_hat */
	bool residual;		      /* forward: normalizes s = x + residual, stores s */
	double scale;		      /* FP8 output: y * scale is what is rounded */
	double part_amax[MAX_BLOCKS]; /* FP8 output: max |y| of each block, NaN skipped */
	void *gamma;		      /* [cols] weight_offset + gamma, or ones when absent */
	void *beta;		      /* [cols] beta, or zeros when absent */
	void *gamma_div;	      /* [cols] clamp(weight), divides y (mem-eff only) */
	void *part_dgamma;	      /* [nblocks][cols] per-block sums of dy*xh, or NULL */
	void *part_dbeta;	      /* [nblocks][cols] per-block sums of dy, or NULL */
	atomic_llong next_block;      /* the next block a worker takes */
};

/* Rows [*first, *end) of a block: blocks differ in size by at most one row. */
static inline void block_rows(const struct cpu_job *job, int64_t block, int64_t *first,
			      int64_t *end)
{
	int64_t q = job->rows / job->nblocks, r = job->rows % job->nblocks;

	*first = block * q + (block < r ? block : r);
	*end = *first + q + (block < r ? 1 : 0);
}

/* Float statistics are read and written bytewise: any alignment works. */
static inline float load_stat(const float *base, int64_t row)
{
	float f;
	memcpy(&f, (const unsigned char *)base + (size_t)row * sizeof(f), sizeof(f));
	return f;
}

static inline void store_stat(float *base, int64_t row, float f)
{
	memcpy((unsigned char *)base + (size_t)row * sizeof(f), &f, sizeof(f));
}

/* The row math for float (NK_CPU_FP32) and double (NK_CPU_REFERENCE). */
extern const struct cpu_kernels norm_cpu_kernels_f32;
extern const struct cpu_kernels norm_cpu_kernels_f64;

#endif /* NORMD_NORM_CPU_INTERNAL_H */
