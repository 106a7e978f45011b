/*
 * The weight-gradient GEMM on the CPU (see wgrad.h): main_grad = beta *
 * main_grad + dy^T x. Written from the definition: each output row o of
 * main_grad is the sum over tokens t of dy[t, o] * x[t, :]. Rows of the
 * output are processed in blocks of OUT_BLOCK so that one pass over a row of
 * x serves several outputs; each thread owns whole output blocks, and every
 * sum runs over tokens in order, so no result depends on the thread count.
 * The compute type is float (the backend) or double (the reference).
 */
#include "kernels/wgrad.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define OUT_BLOCK 8
#define MAX_THREADS 64

int nk_wgrad_check(const struct nk_wgrad_args *a, const char **why)
{
	const char *reason = NULL;
	if (!a)
		reason = "no arguments";
	else if (a->tokens < 1 || a->in < 1 || a->out < 1)
		reason = "tokens, in and out must be at least 1";
	else if (nk_dtype_size(a->dtype) == 0)
		reason = "unknown dtype";
	else if (a->grad_dtype != NK_F32 && a->grad_dtype != a->dtype)
		reason = "main_grad must be f32 or the activation dtype";
	else if (a->beta != 0.0f && a->beta != 1.0f)
		reason = "beta must be 0 (overwrite) or 1 (accumulate)";
	else if (!a->x || !a->dy || !a->main_grad)
		reason = "x, dy and main_grad are required";
	if (why)
		*why = reason;
	return reason ? NK_EINVAL : NK_OK;
}

struct wgrad_job {
	const struct nk_wgrad_args *args;
	bool reference;
	atomic_llong next_block;
	atomic_int failed;
};

#define WGRAD_BLOCK(REAL, NAME)                                                            \
	static int NAME(const struct nk_wgrad_args *a, int64_t o0, int64_t o1)              \
	{                                                                                  \
		int64_t n = o1 - o0;                                                       \
		REAL *acc = calloc((size_t)(n * a->in), sizeof(REAL));                     \
		REAL *xrow = malloc((size_t)a->in * sizeof(REAL));                          \
		if (!acc || !xrow) {                                                       \
			free(acc);                                                         \
			free(xrow);                                                        \
			return NK_ENOMEM;                                                  \
		}                                                                          \
		for (int64_t t = 0; t < a->tokens; t++) {                                  \
			for (int64_t i = 0; i < a->in; i++)                                \
				xrow[i] = (REAL)nk_load(a->dtype, a->x, (size_t)(t * a->in + i)); \
			for (int64_t o = 0; o < n; o++) {                                  \
				REAL d = (REAL)nk_load(a->dtype, a->dy,                    \
						       (size_t)(t * a->out + o0 + o));     \
				REAL *row = acc + o * a->in;                               \
				for (int64_t i = 0; i < a->in; i++)                        \
					row[i] += d * xrow[i];                             \
			}                                                                  \
		}                                                                          \
		for (int64_t o = 0; o < n; o++) {                                          \
			for (int64_t i = 0; i < a->in; i++) {                              \
				size_t at = (size_t)((o0 + o) * a->in + i);                \
				REAL v = acc[o * a->in + i];                               \
				if (a->beta != 0.0f)                                       \
					v += (REAL)nk_load(a->grad_dtype, a->main_grad, at);   \
				nk_store(a->grad_dtype, a->main_grad, at, (double)v);      \
			}                                                                  \
		}                                                                          \
		free(acc);                                                                 \
		free(xrow);                                                                \
		return NK_OK;                                                              \
	}

WGRAD_BLOCK(float, wgrad_block_f32)
WGRAD_BLOCK(double, wgrad_block_f64)

static void *wgrad_worker(void *arg)
{
	struct wgrad_job *job = arg;
	const struct nk_wgrad_args *a = job->args;
	int64_t blocks = (a->out + OUT_BLOCK - 1) / OUT_BLOCK;
	for (;;) {
		int64_t b = atomic_fetch_add(&job->next_block, 1);
		if (b >= blocks)
			break;
		int64_t o0 = b * OUT_BLOCK, o1 = o0 + OUT_BLOCK < a->out ? o0 + OUT_BLOCK : a->out;
		int rc = job->reference ? wgrad_block_f64(a, o0, o1) : wgrad_block_f32(a, o0, o1);
		if (rc != NK_OK)
			atomic_store(&job->failed, rc);
	}
	return NULL;
}

int nk_cpu_wgrad(const struct nk_wgrad_args *args, const struct nk_cpu_opts *opts)
{
	if (nk_wgrad_check(args, NULL) != NK_OK)
		return NK_EINVAL;
	struct wgrad_job job = {.args = args,
				.reference = opts && opts->precision == NK_CPU_REFERENCE};
	atomic_init(&job.next_block, 0);
	atomic_init(&job.failed, NK_OK);
	int threads = opts && opts->threads > 1 ? opts->threads : 1;
	int64_t work = args->tokens * args->in * args->out;
	if (threads > MAX_THREADS)
		threads = MAX_THREADS;
	if (work < (1 << 20))
		threads = 1;
	pthread_t tids[MAX_THREADS];
	int started = 0;
	for (; started < threads - 1; started++) {
		if (pthread_create(&tids[started], NULL, wgrad_worker, &job) != 0)
			break;
	}
	wgrad_worker(&job);
	for (int i = 0; i < started; i++)
		pthread_join(tids[i], NULL);
	return atomic_load(&job.failed);
}
