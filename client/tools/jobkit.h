/*
 * jobkit: one normalization job with its buffers and its check against the
 * float64 reference, shared by normctl demo, normstress and the tests.
 *
 * jobkit_create() allocates one host region on a connection, lays out every
 * tensor the op uses in it (16-byte aligned), fills the inputs with seeded
 * random data (never zeros), makes backward inputs consistent (mean, rstd and
 * y come from a reference forward of x), poisons the outputs, and fills in
 * the struct nc_job (and struct nc_job_ext for the norm variants: submit
 * both with the *_ext calls). After the daemon ran the job, jobkit_check()
 * recomputes it with the CPU reference (fp64 compute) and compares every
 * output.
 * Uses only the public client API plus the CPU kernels.
 */
#ifndef NORMD_JOBKIT_H
#define NORMD_JOBKIT_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/norm_kernels.h"
#include "normclient.h"

struct jobkit_spec {
	enum nc_op op;
	uint64_t rows, cols;
	enum nc_dtype dtype;
	enum nc_dtype weight_dtype; /* 0: same as dtype */
	bool gamma, beta;           /* affine parameters present */
	bool memory_efficient;
	bool accumulate;
	float eps;                  /* 0: 1e-5 */
	uint64_t seed;
	uint64_t out_features;      /* NC_WGRAD_ACCUM: out (rows = tokens, cols = in);
				       accumulate = main_grad += (else =) */
	bool on_device;             /* tensors in cudaMalloc memory (CUDA backend) */
	int device;                 /* which GPU, when on_device */
	void *device_memory;        /* on_device: lay the tensors out from here instead (the
				       caller's device memory, jobkit_bytes() of it; VMM memory
				       for one), each named by nc_tensor_device_range() */
	/* The norm variants (docs/VARIANTS.md): */
	bool residual;              /* forward: s = x + residual into residual_out; backward:
				       x holds s and ds (the gradient at s) is added */
	float weight_offset;        /* the weight is weight_offset + gamma (needs gamma) */
	enum nc_dtype y_dtype;      /* forward: 0 (dtype), NC_F8E4M3 or NC_F8E5M2 */
	bool in_place;              /* y over x and residual_out over residual (where the
				       sizes match), or dx over dy */
};

struct jobkit {
	struct jobkit_spec spec;
	nc_region *region;          /* host memfd, or the device allocation */
	void *device_base;          /* on_device: the cudaMalloc allocation (or device_memory) */
	void *staging;              /* on_device: host copy that ptr[] points into */
	size_t total;               /* bytes of all tensors */
	struct nc_job job;          /* ready to submit */
	struct nc_job_ext ext;      /* its variants (zero for a plain job) */
	size_t bytes[16];           /* bytes of each tensor, by role (0: absent) */
	void *ptr[16];              /* each tensor in the region, by role */
	void *initial[16];          /* accumulate: dgamma/dbeta/main_grad before the run */
	void *saved[16];            /* in_place: the inputs an output overwrites, as created */
};

/* Tensor roles, the order of ptr[] and bytes[] (proto/job_roles.h's order). */
enum jobkit_role { JK_X, JK_Y, JK_MEAN, JK_RSTD, JK_GAMMA, JK_BETA, JK_DY, JK_DX, JK_DGAMMA,
		   JK_DBETA, JK_MAIN_GRAD, JK_RESIDUAL, JK_RESIDUAL_OUT, JK_DS, JK_SCALE, JK_AMAX };
#define JK_ROLES 16

struct jobkit_report {
	double max_abs_err;  /* largest |out - ref| over all outputs */
	double max_rel_err;  /* largest max|out - ref| / max|ref| of one output */
	double rel_l2_err;   /* largest ||out - ref|| / ||ref|| of one output */
	double tolerance;    /* what rel_l2_err had to stay under */
	bool ok;             /* every output written and within tolerance */
	char detail[160];    /* which output failed and why */
};

const char *jobkit_role_name(int role);
const char *jobkit_op_name(enum nc_op op);
const char *jobkit_dtype_name(enum nc_dtype dtype);

/* Returns 0 or a negative NC_E* code (message in nc_last_error()). */
int jobkit_create(nc_conn *conn, const struct jobkit_spec *spec, struct jobkit *kit);
/* The bytes of memory the spec's tensors take (what device_memory must hold). */
size_t jobkit_bytes(const struct jobkit_spec *spec);

/* Checks the outputs against the reference; returns report->ok. */
bool jobkit_check(const struct jobkit *kit, struct jobkit_report *report);

/*
 * The storage dtype of a tensor role: statistics, scale and amax fp32,
 * weights weight_dtype, the rest dtype (an FP8 y has none: see jobkit_y_fp8).
 */
enum nk_dtype jobkit_role_dtype(const struct jobkit_spec *spec, int role);

/* The FP8 format of the spec's y (NK_FP8_NONE: y has dtype). */
enum nk_fp8 jobkit_y_fp8(const struct jobkit_spec *spec);

/* The CPU reference's arguments for the kit's job over the tensors at `ptr` (by role). */
void jobkit_args(const struct jobkit *kit, void *const ptr[JK_ROLES], struct nk_norm_args *args);

/* A short name of the spec's variants ("+add+zero_centered+fp8_e4m3"), "" for none. */
const char *jobkit_variant_label(const struct jobkit_spec *spec, char *buf, size_t len);

/* The variants (enum nc_norm_features) the spec's job uses. */
uint32_t jobkit_features(const struct jobkit_spec *spec);

/* Frees the region (unregisters it) and the kit's copies. Accepts a zeroed kit. */
void jobkit_destroy(struct jobkit *kit);

#endif /* NORMD_JOBKIT_H */
