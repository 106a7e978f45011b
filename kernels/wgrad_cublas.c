/*
 * The weight-gradient GEMM through cuBLAS (see wgrad.h), loaded with dlopen.
 *
 * Row-major main_grad[out, in] = dy^T x is, read column-major, the in x out
 * matrix x_cm * dy_cm^T, where x_cm is x read as a column-major in x tokens
 * matrix and dy_cm is dy read as out x tokens. So one cublasGemmEx_64 call:
 * transa = N, transb = T, m = in, n = out, k = tokens, lda = in, ldb = out,
 * ldc = in, fp32 compute (tensor cores for fp16/bf16 inputs; plain fp32 for
 * fp32 inputs, no TF32), alpha = 1, beta = 0 or 1.
 */
#include "kernels/wgrad.h"

#include <cublas_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

typedef cublasStatus_t (*create_fn)(cublasHandle_t *);
typedef cublasStatus_t (*destroy_fn)(cublasHandle_t);
typedef cublasStatus_t (*set_stream_fn)(cublasHandle_t, cudaStream_t);
typedef cublasStatus_t (*set_workspace_fn)(cublasHandle_t, void *, size_t);
typedef cublasStatus_t (*set_math_mode_fn)(cublasHandle_t, cublasMath_t);
typedef cublasStatus_t (*gemm_ex_fn)(cublasHandle_t, cublasOperation_t, cublasOperation_t,
				     int64_t, int64_t, int64_t, const void *, const void *,
				     cudaDataType, int64_t, const void *, cudaDataType, int64_t,
				     const void *, void *, cudaDataType, int64_t,
				     cublasComputeType_t, cublasGemmAlgo_t);

static struct {
	create_fn create;
	destroy_fn destroy;
	set_stream_fn set_stream;
	set_workspace_fn set_workspace;
	set_math_mode_fn set_math_mode;
	gemm_ex_fn gemm_ex;
	const char *error; /* why loading failed, or NULL */
} cublas;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;

static void cublas_load(void)
{
	static const char *const names[] = {
		"libcublas.so.13",
		"libcublas.so.12",
		"/usr/local/cuda/lib64/libcublas.so.13",
		"/usr/local/cuda/lib64/libcublas.so.12",
		"libcublas.so",
	};
	const char *configured = getenv("NORMD_CUBLAS");
	void *lib = configured ? dlopen(configured, RTLD_NOW | RTLD_LOCAL) : NULL;
	for (size_t i = 0; !lib && i < sizeof(names) / sizeof(names[0]); i++)
		lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		cublas.error = "cuBLAS (libcublas.so) not found; set NORMD_CUBLAS to its path";
		return;
	}
	cublas.create = (create_fn)dlsym(lib, "cublasCreate_v2");
	cublas.destroy = (destroy_fn)dlsym(lib, "cublasDestroy_v2");
	cublas.set_stream = (set_stream_fn)dlsym(lib, "cublasSetStream_v2");
	cublas.set_workspace = (set_workspace_fn)dlsym(lib, "cublasSetWorkspace_v2");
	cublas.set_math_mode = (set_math_mode_fn)dlsym(lib, "cublasSetMathMode");
	cublas.gemm_ex = (gemm_ex_fn)dlsym(lib, "cublasGemmEx_64");
	if (!cublas.create || !cublas.destroy || !cublas.set_stream || !cublas.set_workspace ||
	    !cublas.set_math_mode || !cublas.gemm_ex)
		cublas.error = "the cuBLAS found lacks cublasGemmEx_64 (needs CUDA 12 or newer)";
}

struct nk_cublas {
	cublasHandle_t handle;
};

int nk_cublas_create(void *stream, void *workspace, size_t workspace_bytes,
		     struct nk_cublas **out, const char **why)
{
	pthread_once(&load_once, cublas_load);
	if (cublas.error) {
		*why = cublas.error;
		return NK_EUNSUPPORTED;
	}
	struct nk_cublas *h = calloc(1, sizeof(*h));
	if (!h) {
		*why = "out of memory";
		return NK_ENOMEM;
	}
	if (cublas.create(&h->handle) != CUBLAS_STATUS_SUCCESS) {
		free(h);
		*why = "cublasCreate failed";
		return NK_EDEVICE;
	}
	if (cublas.set_stream(h->handle, (cudaStream_t)stream) != CUBLAS_STATUS_SUCCESS ||
	    cublas.set_workspace(h->handle, workspace, workspace_bytes) != CUBLAS_STATUS_SUCCESS ||
	    cublas.set_math_mode(h->handle, CUBLAS_DEFAULT_MATH) != CUBLAS_STATUS_SUCCESS) {
		cublas.destroy(h->handle);
		free(h);
		*why = "cannot bind the cuBLAS handle to its stream and workspace";
		return NK_EDEVICE;
	}
	*out = h;
	return NK_OK;
}

void nk_cublas_destroy(struct nk_cublas *h)
{
	if (!h)
		return;
	cublas.destroy(h->handle);
	free(h);
}

static cudaDataType cuda_type(enum nk_dtype dtype)
{
	return dtype == NK_F16 ? CUDA_R_16F : dtype == NK_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

int nk_cublas_wgrad(struct nk_cublas *h, const struct nk_wgrad_args *a, const char **why)
{
	if (nk_wgrad_check(a, why) != NK_OK)
		return NK_EINVAL;
	const float alpha = 1.0f, beta = a->beta;
	cudaDataType in_type = cuda_type(a->dtype), out_type = cuda_type(a->grad_dtype);
	cublasStatus_t st = cublas.gemm_ex(h->handle, CUBLAS_OP_N, CUBLAS_OP_T, a->in, a->out,
					   a->tokens, &alpha, a->x, in_type, a->in, a->dy, in_type,
					   a->out, &beta, a->main_grad, out_type, a->in,
					   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
	if (st != CUBLAS_STATUS_SUCCESS) {
		*why = st == CUBLAS_STATUS_NOT_SUPPORTED ? "cuBLAS does not support this combination"
							 : "cublasGemmEx failed";
		return st == CUBLAS_STATUS_NOT_SUPPORTED ? NK_EUNSUPPORTED : NK_EDEVICE;
	}
	return NK_OK;
}
