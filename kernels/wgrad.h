/*
 * The weight-gradient accumulation job (Megatron's gradient_accumulation_fusion):
 *
 *   main_grad[out, in] = beta * main_grad + dy[tokens, out]^T x[tokens, in]
 *
 * with x and dy in fp32, fp16 or bf16, main_grad in fp32 or the activation
 * dtype, beta 0 (overwrite) or 1 (accumulate), the products summed in fp32.
 * Row-major everywhere. Two implementations behind one C ABI:
 *   - nk_cpu_wgrad (kernels/wgrad_cpu.c): a blocked GEMM on the CPU, fp32
 *     compute, or fp64 in reference mode: the CPU backend and the oracle;
 *   - nk_cublas_wgrad (kernels/wgrad_cublas.c): cublasGemmEx_64 with fp32
 *     compute (tensor cores for fp16/bf16 inputs). cuBLAS is loaded at run
 *     time with dlopen, so nothing links it and a host without it still
 *     starts; only this job then answers UNSUPPORTED.
 */
#ifndef NORMD_WGRAD_H
#define NORMD_WGRAD_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/norm_kernels.h"

struct nk_wgrad_args {
	int64_t tokens, in, out;   /* each >= 1 */
	enum nk_dtype dtype;       /* x and dy */
	enum nk_dtype grad_dtype;  /* main_grad: NK_F32 or dtype */
	float beta;                /* 0 or 1 */
	const void *x;             /* [tokens, in] */
	const void *dy;            /* [tokens, out] */
	void *main_grad;           /* [out, in] */
};

/* Checks dtypes, beta and shape; NK_OK or NK_EINVAL with a static reason. */
int nk_wgrad_check(const struct nk_wgrad_args *args, const char **why);

/* The CPU GEMM (opts as for nk_cpu_norm). Results do not depend on threads. */
int nk_cpu_wgrad(const struct nk_wgrad_args *args, const struct nk_cpu_opts *opts);

/* A cuBLAS handle bound to one stream and a caller-owned workspace. */
struct nk_cublas;

/*
 * Loads cuBLAS (once per process) and creates a handle on the current device
 * for `stream` (a cudaStream_t). Returns NK_OK, NK_EUNSUPPORTED when cuBLAS
 * cannot be loaded (*why says so), or NK_EDEVICE.
 */
int nk_cublas_create(void *stream, void *workspace, size_t workspace_bytes,
		     struct nk_cublas **out, const char **why);
void nk_cublas_destroy(struct nk_cublas *handle);

/* Enqueues the GEMM on the handle's stream; never synchronizes. */
int nk_cublas_wgrad(struct nk_cublas *handle, const struct nk_wgrad_args *args,
		    const char **why);

#endif /* NORMD_WGRAD_H */
