/*
 * Jobs: validation, submission to the backend, and completion.
 *
 * job_validate() checks everything a client controls before anything runs:
 * the op, shape, eps and dtypes; which tensors the op needs and which it must
 * not get; for each tensor, that its region is this connection's and that
 * offset + byte size lies inside it, with every product and sum checked for
 * 64-bit overflow; and that outputs overlap inputs only as the in-place
 * forms allow (proto/job_roles.h). Only then are region references taken
 * and the job handed to the backend, if the backend runs the job's variants.
 * Workers give finished jobs back through a lock-free stack and
 * uv_async_send; the loop drains the whole stack on each wake-up (libuv
 * coalesces wake-ups).
 */
#include "daemon/server.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "daemon/log.h"
#include "proto/frame.h"
#include "proto/job_roles.h"

/*
 * The tensor roles and what each op does with them are proto/job_roles.h's
 * table, shared with the library's check of enqueued jobs; a role is also
 * the index of its slot in struct job's regions.
 */
_Static_assert(NC__ROLE_COUNT == JOB_MAX_TENSORS, "a region slot per tensor role");
_Static_assert(NORMD__OP__LAYERNORM_FWD == 1 && NORMD__OP__LAYERNORM_BWD == 2 &&
		       NORMD__OP__RMSNORM_FWD == 3 && NORMD__OP__RMSNORM_BWD == 4 &&
		       NORMD__OP__WGRAD_ACCUM == NC__JOB_OPS,
	       "the columns of NC__JOB_ROLE_MAP follow normd.Op");

_Static_assert((int)NC_FEATURE_RESIDUAL == (int)NK_FEATURE_RESIDUAL &&
		       (int)NC_FEATURE_WEIGHT_OFFSET == (int)NK_FEATURE_WEIGHT_OFFSET &&
		       (int)NC_FEATURE_FP8_OUTPUT == (int)NK_FEATURE_FP8_OUTPUT,
	       "HelloReply.norm_features carries enum nk_features as enum nc_norm_features");
_Static_assert((int)NC_F8E4M3 == (int)NORMD__DTYPE__F8E4M3 &&
		       (int)NC_F8E5M2 == (int)NORMD__DTYPE__F8E5M2,
	       "enum nc_dtype follows normd.DType");

struct op_rules {
	enum nk_op nk_op;
	const char *name;
	bool backward;
};

static const struct op_rules rules_ln_fwd = {NK_LAYERNORM_FWD, "LAYERNORM_FWD", false};
static const struct op_rules rules_rms_fwd = {NK_RMSNORM_FWD, "RMSNORM_FWD", false};
static const struct op_rules rules_ln_bwd = {NK_LAYERNORM_BWD, "LAYERNORM_BWD", true};
static const struct op_rules rules_rms_bwd = {NK_RMSNORM_BWD, "RMSNORM_BWD", true};
/* nk_op is unused for this one: the job goes to the GEMM, not the norm kernels. */
static const struct op_rules rules_wgrad = {NK_LAYERNORM_FWD, "WGRAD_ACCUM", false};

static const struct op_rules *rules_for(Normd__Op op)
{
	switch (op) {
	case NORMD__OP__LAYERNORM_FWD:
		return &rules_ln_fwd;
	case NORMD__OP__RMSNORM_FWD:
		return &rules_rms_fwd;
	case NORMD__OP__LAYERNORM_BWD:
		return &rules_ln_bwd;
	case NORMD__OP__RMSNORM_BWD:
		return &rules_rms_bwd;
	case NORMD__OP__WGRAD_ACCUM:
		return &rules_wgrad;
	default:
		return NULL;
	}
}

/* x's and the weights' dtypes: FP8 is refused here (it is y_dtype's alone). */
static bool dtype_from_wire(Normd__DType wire, enum nk_dtype *out)
{
	switch (wire) {
	case NORMD__DTYPE__F32:
		*out = NK_F32;
		return true;
	case NORMD__DTYPE__F16:
		*out = NK_F16;
		return true;
	case NORMD__DTYPE__BF16:
		*out = NK_BF16;
		return true;
	default:
		return false;
	}
}

/* A refusal: status plus a one-line message naming the field and value. */
static int job_refuse(struct job *job, int status, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static int job_refuse(struct job *job, int status, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(job->message, sizeof(job->message), fmt, ap);
	va_end(ap);
	job->status = status;
	return status;
}

static Normd__Tensor *job_tensor(const Normd__Job *msg, enum nc__job_role role)
{
	Normd__Tensor *const tensors[JOB_MAX_TENSORS] = {
		msg->x,	       msg->y,		 msg->mean, msg->rstd,	msg->gamma, msg->beta,
		msg->dy,       msg->dx,		 msg->dgamma, msg->dbeta, msg->main_grad,
		msg->residual, msg->residual_out, msg->ds,   msg->scale, msg->amax,
	};
	return tensors[role];
}

/* Elements of a role (overflow was ruled out by job_check_shape). */
static uint64_t role_elems(const struct job *job, enum nc__job_role role)
{
	uint64_t rows = (uint64_t)job->args.rows, cols = (uint64_t)job->args.cols;
	if (job->wgrad) {
		uint64_t out = (uint64_t)job->gemm.out;
		if (role == NC__ROLE_X)
			return rows * cols;
		return role == NC__ROLE_DY ? rows * out : out * cols;
	}
	switch (role) {
	case NC__ROLE_SCALE:
	case NC__ROLE_AMAX:
		return 1;
	case NC__ROLE_MEAN:
	case NC__ROLE_RSTD:
		return rows;
	case NC__ROLE_GAMMA:
	case NC__ROLE_BETA:
	case NC__ROLE_DGAMMA:
	case NC__ROLE_DBETA:
		return cols;
	default:
		return rows * cols;
	}
}

static size_t role_elem_size(const struct job *job, enum nc__job_role role)
{
	const struct nk_norm_args *a = &job->args;
	if (role == NC__ROLE_MAIN_GRAD)
		return nk_dtype_size(job->gemm.grad_dtype);
	if (role == NC__ROLE_MEAN || role == NC__ROLE_RSTD || role == NC__ROLE_SCALE ||
	    role == NC__ROLE_AMAX)
		return sizeof(float);
	if (role == NC__ROLE_Y && a->y_fp8 != NK_FP8_NONE)
		return 1;
	if (role == NC__ROLE_GAMMA || role == NC__ROLE_BETA || role == NC__ROLE_DGAMMA ||
	    role == NC__ROLE_DBETA)
		return nk_dtype_size(a->weight_dtype);
	return nk_dtype_size(a->dtype);
}

static int job_check_shape(struct job *job, const Normd__Job *msg)
{
	uint64_t elems, bytes;
	if (msg->rows == 0)
		return job_refuse(job, NC_EINVALID_ARGUMENT, "rows must be at least 1 (got 0)");
	if (msg->cols == 0)
		return job_refuse(job, NC_EINVALID_ARGUMENT, "cols must be at least 1 (got 0)");
	if (msg->rows > INT64_MAX || __builtin_mul_overflow(msg->rows, msg->cols, &elems) ||
	    elems > INT64_MAX || __builtin_mul_overflow(elems, (uint64_t)8, &bytes))
		return job_refuse(job, NC_EOUT_OF_RANGE,
				  "rows*cols overflows (rows %llu, cols %llu)",
				  (unsigned long long)msg->rows, (unsigned long long)msg->cols);
	float eps = msg->has_eps ? msg->eps : 1e-5f;
	if (!(eps > 0.0f) || !isfinite(eps))
		return job_refuse(job, NC_EINVALID_ARGUMENT,
				  "eps must be positive and finite (got %g)", (double)eps);
	if (msg->op != NORMD__OP__WGRAD_ACCUM)
		return 0;
	uint64_t out = msg->has_out_features ? msg->out_features : 0, a, b;
	if (out == 0)
		return job_refuse(job, NC_EINVALID_ARGUMENT,
				  "WGRAD_ACCUM needs out_features of at least 1 (got 0)");
	if (out > INT64_MAX || __builtin_mul_overflow(msg->rows, out, &a) || a > INT64_MAX / 8 ||
	    __builtin_mul_overflow(out, msg->cols, &b) || b > INT64_MAX / 8)
		return job_refuse(job, NC_EOUT_OF_RANGE,
				  "tokens*out or out*in overflows (tokens %llu, in %llu, out %llu)",
				  (unsigned long long)msg->rows, (unsigned long long)msg->cols,
				  (unsigned long long)out);
	return 0;
}

/* WGRAD_ACCUM's own fields: the output width, main_grad's dtype, beta. */
static int job_check_wgrad(struct job *job, const Normd__Job *msg)
{
	struct nk_wgrad_args *g = &job->gemm;
	job->wgrad = true;
	g->tokens = (int64_t)msg->rows;
	g->in = (int64_t)msg->cols;
	g->out = (int64_t)msg->out_features;
	g->dtype = job->args.dtype;
	/* main_grad is fp32 unless the job names its dtype. */
	g->grad_dtype = msg->has_weight_dtype ? job->args.weight_dtype : NK_F32;
	if (msg->gemm_beta > 1)
		return job_refuse(job, NC_EINVALID_ARGUMENT,
				  "gemm_beta must be 0 (overwrite) or 1 (accumulate), got %u",
				  msg->gemm_beta);
	g->beta = (float)msg->gemm_beta;
	return 0;
}

static bool is_fp8(Normd__DType wire)
{
	return wire == NORMD__DTYPE__F8E4M3 || wire == NORMD__DTYPE__F8E5M2;
}

/* y_dtype: dtype itself, or an FP8 format for a norm forward (protocol 3). */
static int job_check_y_dtype(struct job *job, const Normd__Job *msg, const struct op_rules *r)
{
	struct nk_norm_args *a = &job->args;
	a->y_fp8 = NK_FP8_NONE;
	if (!msg->has_y_dtype || msg->y_dtype == msg->dtype)
		return 0;
	if (!is_fp8(msg->y_dtype))
		return job_refuse(job, NC_EINVALID_ARGUMENT,
				  "y_dtype %d must be dtype (%d) or F8E4M3/F8E5M2", (int)msg->y_dtype,
				  (int)msg->dtype);
	if (r->backward || msg->op == NORMD__OP__WGRAD_ACCUM)
		return job_refuse(job, NC_EINVALID_ARGUMENT,
				  "FP8 output (y_dtype %d) applies to forward norms, not %s",
				  (int)msg->y_dtype, r->name);
	a->y_fp8 = msg->y_dtype == NORMD__DTYPE__F8E4M3 ? NK_FP8_E4M3 : NK_FP8_E5M2;
	return 0;
}

static int job_check_types(struct job *job, const Normd__Job *msg, const struct op_rules *r)
{
	struct nk_norm_args *a = &job->args;
	if (is_fp8(msg->dtype) || (msg->has_weight_dtype && is_fp8(msg->weight_dtype)))
		return job_refuse(job, NC_EINVALID_ARGUMENT,
				  "FP8 (dtype %d) is an output format: name it in y_dtype; dtype and "
				  "weight_dtype are F32, F16 or BF16",
				  (int)(is_fp8(msg->dtype) ? msg->dtype : msg->weight_dtype));
	if (!dtype_from_wire(msg->dtype, &a->dtype))
		return job_refuse(job, NC_EINVALID_ARGUMENT, "dtype %d is not F32, F16 or BF16",
				  (int)msg->dtype);
	a->weight_dtype = a->dtype;
	if (msg->has_weight_dtype && !dtype_from_wire(msg->weight_dtype, &a->weight_dtype))
		return job_refuse(job, NC_EINVALID_ARGUMENT,
				  "weight_dtype %d is not F32, F16 or BF16", (int)msg->weight_dtype);
	if (a->weight_dtype != a->dtype && a->weight_dtype != NK_F32)
		return job_refuse(job, NC_EUNSUPPORTED,
				  "weight_dtype %s with dtype %s: weights must match dtype or be f32",
				  nk_dtype_name(a->weight_dtype), nk_dtype_name(a->dtype));
	if (!r->backward && (msg->memory_efficient || msg->accumulate) &&
	    msg->op != NORMD__OP__WGRAD_ACCUM)
		return job_refuse(job, NC_EINVALID_ARGUMENT,
				  "memory_efficient and accumulate apply to backward ops, not %s",
				  r->name);
	return job_check_y_dtype(job, msg, r);
}

/*
 * Where a tensor lies for the alias check: in a memfd by the file's
 * identity and offset (two registrations of one memfd are two mappings of
 * one memory), elsewhere (or a memfd of unknown identity: inode 0) by its
 * address in the daemon.
 */
static void job_span(const struct region *region, uint64_t offset, uint64_t bytes,
		     struct nc__span *span)
{
	span->present = true;
	span->bytes = bytes;
	if (region->kind == NORMD__REGION_KIND__HOST_MEMFD && region->file_ino != 0) {
		span->memory[0] = region->file_dev + 1; /* never 0, the address space's tag */
		span->memory[1] = region->file_ino;
		span->start = offset;
		return;
	}
	span->memory[0] = span->memory[1] = 0;
	span->start = (uint64_t)(uintptr_t)region->base + offset;
}

/* Resolves one tensor into a pointer, checking region and bounds. */
static int job_bind_tensor(struct job *job, const struct region_table *regions,
			   const Normd__Tensor *t, enum nc__job_role role, const void **out,
			   struct nc__span *span)
{
	const char *name = nc__job_role_name(role);
	struct region *region = region_lookup(regions, t->region_id);
	if (!region)
		return job_refuse(job, NC_ENOT_FOUND,
				  "tensor %s: region %llu is not registered on this connection",
				  name, (unsigned long long)t->region_id);
	uint64_t bytes, end;
	uint64_t elems = role_elems(job, role);
	uint64_t offset = t->has_offset ? t->offset : 0;
	if (__builtin_mul_overflow(elems, (uint64_t)role_elem_size(job, role), &bytes) ||
	    __builtin_add_overflow(offset, bytes, &end) || end > region->size)
		return job_refuse(job, NC_EOUT_OF_RANGE,
				  "tensor %s: offset %llu + %llu elements runs past region %llu "
				  "(%llu bytes)",
				  name, (unsigned long long)offset, (unsigned long long)elems,
				  (unsigned long long)t->region_id, (unsigned long long)region->size);
	/* Kernels load whole elements: an element must not straddle its natural alignment. */
	if ((((uintptr_t)region->base + offset) % role_elem_size(job, role)) != 0)
		return job_refuse(job, NC_EINVALID_ARGUMENT,
				  "tensor %s: offset %llu is not a multiple of its element size (%zu)",
				  name, (unsigned long long)offset, role_elem_size(job, role));
	region_ref(region);
	job->regions[job->region_count++] = region;
	job->bytes += bytes;
	*out = (const char *)region->base + offset;
	job_span(region, offset, bytes, span);
	return 0;
}

/* A forbidden overlap of two tensors (proto/job_roles.h), refused with both ranges named. */
static int job_check_aliases(struct job *job, const Normd__Job *msg,
			     const struct nc__span spans[JOB_MAX_TENSORS])
{
	enum nc__job_role a, b;
	enum nc__alias verdict = nc__job_alias_check(msg->op, spans, &a, &b);
	if (verdict == NC__ALIAS_OK)
		return 0;
	const Normd__Tensor *ta = job_tensor(msg, a), *tb = job_tensor(msg, b);
	return job_refuse(job, NC_EINVALID_ARGUMENT,
			  "tensor %s (region %llu, bytes %llu+%llu) overlaps %s (region %llu, "
			  "bytes %llu+%llu): %s",
			  nc__job_role_name(a), (unsigned long long)ta->region_id,
			  (unsigned long long)ta->offset, (unsigned long long)spans[a].bytes,
			  nc__job_role_name(b), (unsigned long long)tb->region_id,
			  (unsigned long long)tb->offset, (unsigned long long)spans[b].bytes,
			  nc__alias_why(verdict));
}

/* What the job's op does with a role: the memory-efficient backward reads y, not mean. */
static enum nc__role_use job_role_use(const Normd__Job *msg, enum nc__job_role role)
{
	if (role == NC__ROLE_MEAN && msg->memory_efficient)
		return NC__USE_NONE;
	return nc__job_role_use(msg->op, role);
}

/* Binds every tensor of the job, recording where each lies in spans[] (by role). */
static int job_bind_tensors(struct job *job, const struct region_table *regions,
			    const Normd__Job *msg, const struct op_rules *r,
			    struct nc__span spans[JOB_MAX_TENSORS])
{
	const void *ptr[JOB_MAX_TENSORS] = {0};
	for (int i = 0; i < NC__ROLE_COUNT; i++) {
		enum nc__job_role role = (enum nc__job_role)i;
		const Normd__Tensor *t = job_tensor(msg, role);
		enum nc__role_use use = job_role_use(msg, role);
		if (!t && use == NC__USE_REQ)
			return job_refuse(job, NC_EINVALID_ARGUMENT, "%s needs tensor %s", r->name,
					  nc__job_role_name(role));
		if (t && use == NC__USE_NONE)
			return job_refuse(job, NC_EINVALID_ARGUMENT,
					  "tensor %s is not used by %s%s", nc__job_role_name(role),
					  r->name,
					  role == NC__ROLE_MEAN && msg->memory_efficient
					      ? " with memory_efficient"
					      : "");
		if (t && job_bind_tensor(job, regions, t, role, &ptr[role], &spans[role]))
			return job->status;
	}
	/* A job runs where its memory is: every tensor on one device. */
	job->device = job->regions[0]->device;
	for (unsigned i = 1; i < job->region_count; i++) {
		if (job->regions[i]->device != job->device)
			return job_refuse(job, NC_EINVALID_ARGUMENT,
					  "tensors live on different devices (%d and %d)",
					  job->device, job->regions[i]->device);
	}
	struct nk_norm_args *a = &job->args;
	a->x = ptr[NC__ROLE_X];
	a->y = (void *)ptr[NC__ROLE_Y];
	a->mean = (float *)ptr[NC__ROLE_MEAN];
	a->rstd = (float *)ptr[NC__ROLE_RSTD];
	a->gamma = ptr[NC__ROLE_GAMMA];
	a->beta = ptr[NC__ROLE_BETA];
	a->dy = ptr[NC__ROLE_DY];
	a->dx = (void *)ptr[NC__ROLE_DX];
	a->dgamma = (void *)ptr[NC__ROLE_DGAMMA];
	a->dbeta = (void *)ptr[NC__ROLE_DBETA];
	a->residual = ptr[NC__ROLE_RESIDUAL];
	a->residual_out = (void *)ptr[NC__ROLE_RESIDUAL_OUT];
	a->ds = ptr[NC__ROLE_DS];
	a->scale = ptr[NC__ROLE_SCALE];
	a->amax = (float *)ptr[NC__ROLE_AMAX];
	job->main_grad = (void *)ptr[NC__ROLE_MAIN_GRAD];
	return 0;
}

int job_validate(struct job *job, const struct region_table *regions, const struct config *cfg,
		 const Normd__Job *msg)
{
	const struct op_rules *r = rules_for(msg->op);
	if (!r)
		return job_refuse(job, NC_EINVALID_ARGUMENT, "op %d is not a known operation",
				  (int)msg->op);
	if (job_check_shape(job, msg) || job_check_types(job, msg, r))
		return job->status;
	if (msg->op == NORMD__OP__WGRAD_ACCUM) {
		if ((msg->memory_efficient || msg->accumulate))
			return job_refuse(job, NC_EINVALID_ARGUMENT,
					  "WGRAD_ACCUM takes gemm_beta, not memory_efficient or "
					  "accumulate");
		if (msg->has_weight_offset && msg->weight_offset != 0.0f)
			return job_refuse(job, NC_EINVALID_ARGUMENT,
					  "WGRAD_ACCUM takes no weight_offset");
		if (job_check_wgrad(job, msg))
			return job->status;
	}
	struct nk_norm_args *a = &job->args;
	a->op = r->nk_op;
	a->rows = (int64_t)msg->rows;
	a->cols = (int64_t)msg->cols;
	a->eps = msg->has_eps ? msg->eps : 1e-5f;
	a->flags = (msg->memory_efficient ? NK_MEMORY_EFFICIENT : 0u) |
		   (msg->accumulate ? NK_ACCUMULATE : 0u);
	a->weight_offset = msg->has_weight_offset ? msg->weight_offset : 0.0f;
	/*
	 * max_cols is judged after binding, so that a refused enqueued job still
	 * has its outputs to poison; it is still the error reported first.
	 */
	struct nc__span spans[JOB_MAX_TENSORS] = {{0}};
	job->bound = job_bind_tensors(job, regions, msg, r, spans) == 0;
	if (msg->cols > cfg->max_cols)
		job_refuse(job, NC_EOUT_OF_RANGE, "cols %llu exceeds max_cols %llu",
			   (unsigned long long)msg->cols, (unsigned long long)cfg->max_cols);
	if (job->status || job_check_aliases(job, msg, spans))
		return job->status;
	if (msg->has_wait_event && msg->wait_event.len != 64)
		return job_refuse(job, NC_EINVALID_ARGUMENT,
				  "wait_event is %zu bytes; a CUDA IPC event handle has 64",
				  msg->wait_event.len);
	job->has_wait_event = msg->has_wait_event;
	if (msg->has_wait_event)
		memcpy(job->wait_event, msg->wait_event.data, 64);
	job->early_reply = msg->early_reply;
	if ((job->has_wait_event || job->early_reply) && job->device < 0)
		return job_refuse(job, NC_EUNSUPPORTED,
				  "wait_event and early_reply need device memory (the cuda backend)");
	if ((job->has_wait_event || job->early_reply) && msg->enqueue)
		return job_refuse(job, NC_EINVALID_ARGUMENT,
				  "enqueue orders the job by its semaphore slot; wait_event and "
				  "early_reply belong to the event mode");
	const char *why = NULL;
	if (job->wgrad) {
		job->gemm.x = a->x;
		job->gemm.dy = a->dy;
		job->gemm.main_grad = job->main_grad;
		if (nk_wgrad_check(&job->gemm, &why) != NK_OK)
			return job_refuse(job, NC_EINVALID_ARGUMENT, "%s", why);
		return 0;
	}
	if (nk_norm_check(a, &why) != NK_OK)
		return job_refuse(job, NC_EINVALID_ARGUMENT, "%s", why ? why : "invalid job");
	return 0;
}

unsigned job_outputs(const struct job *job, struct job_output out[JOB_MAX_OUTPUTS])
{
	static const enum nc__job_role fwd[] = {NC__ROLE_Y, NC__ROLE_RESIDUAL_OUT, NC__ROLE_AMAX,
						NC__ROLE_RSTD, NC__ROLE_MEAN};
	static const enum nc__job_role bwd[] = {NC__ROLE_DX, NC__ROLE_DGAMMA, NC__ROLE_DBETA};
	static const enum nc__job_role wgrad[] = {NC__ROLE_MAIN_GRAD};
	const struct nk_norm_args *a = &job->args;
	void *const ptr[JOB_MAX_TENSORS] = {
		[NC__ROLE_Y] = a->y,
		[NC__ROLE_MEAN] = a->mean,
		[NC__ROLE_RSTD] = a->rstd,
		[NC__ROLE_DX] = a->dx,
		[NC__ROLE_DGAMMA] = a->dgamma,
		[NC__ROLE_DBETA] = a->dbeta,
		[NC__ROLE_MAIN_GRAD] = job->main_grad,
		[NC__ROLE_RESIDUAL_OUT] = a->residual_out,
		[NC__ROLE_AMAX] = a->amax,
	};
	const enum nc__job_role *roles = fwd;
	unsigned count = sizeof(fwd) / sizeof(fwd[0]), n = 0;
	if (job->wgrad) {
		roles = wgrad;
		count = 1;
	} else if (rules_for(job->op)->backward) {
		roles = bwd;
		count = sizeof(bwd) / sizeof(bwd[0]);
	}
	for (unsigned i = 0; i < count; i++) {
		if (!ptr[roles[i]])
			continue;
		out[n].ptr = ptr[roles[i]];
		out[n].bytes = role_elems(job, roles[i]) * role_elem_size(job, roles[i]);
		n++;
	}
	return n;
}

void job_release(struct job *job)
{
	for (unsigned i = 0; i < job->region_count; i++)
		region_unref(job->regions[i]);
	nc__free(job);
}

/* The names of the variants of enum nk_features, for refusals. */
static const char *feature_names(unsigned features)
{
	if (features & NK_FEATURE_RESIDUAL)
		return "residual-add (residual, ds)";
	if (features & NK_FEATURE_WEIGHT_OFFSET)
		return "weight_offset (zero-centered gamma)";
	return "FP8 output (y_dtype F8E4M3/F8E5M2)";
}

/* A valid job whose variants the backend does not run is UNSUPPORTED, never run plain. */
static int job_check_backend(struct job *job, const struct backend *backend)
{
	if (job->wgrad)
		return 0;
	unsigned missing = nk_norm_features(&job->args) & ~backend->norm_features;
	if (!missing)
		return 0;
	return job_refuse(job, NC_EUNSUPPORTED,
			  "the %s backend does not run %s jobs yet (HelloReply.norm_features "
			  "lists what it runs; the cpu backend runs every variant)",
			  backend->name, feature_names(missing));
}

/*
 * A new job of `msg` for `c`, validated (job->status says how it went, the
 * refusal counted); NULL, answered, when out of memory.
 */
static struct job *job_new_validated(struct client *c, uint64_t request_id,
				     const Normd__Job *msg)
{
	struct server *srv = c->srv;
	struct job *job = nc__calloc(1, sizeof(*job));
	if (!job) {
		stats_count_rejection(srv, NC_REJECT_OUT_OF_MEMORY);
		reply_result(c, request_id, NC_ERESOURCE_EXHAUSTED, "out of memory for a job");
		return NULL;
	}
	job->client = c;
	job->request_id = request_id;
	job->op = msg->op;
	job->deadline_us = msg->has_deadline_us ? msg->deadline_us : 0;
	job->t_arrive_ns = stats_now_ns();
	if (job_validate(job, &c->regions, srv->cfg, msg) != 0 ||
	    job_check_backend(job, srv->backend) != 0)
		stats_count_rejection(srv, job->status == NC_ENOT_FOUND ? NC_REJECT_UNKNOWN_REGION
									: NC_REJECT_BAD_JOB);
	return job;
}

/*
 * The enqueue mode: every job whose slot is valid takes its turn on the
 * slot's stream, refused or not, so that its done word is written in order.
 * Input pauses at max_jobs_in_flight instead of refusing (client.c).
 */
static void job_submit_enqueued(struct client *c, uint64_t request_id, const Normd__Job *msg)
{
	struct server *srv = c->srv;
	struct estream *es = NULL;
	char why[160];
	int rc = estream_for_job(c, msg->enqueue, &es, why, sizeof(why));
	if (rc) {
		stats_count_rejection(srv, rc == NC_ENOT_FOUND ? NC_REJECT_UNKNOWN_REGION
							       : NC_REJECT_BAD_JOB);
		reply_result(c, request_id, rc, "%s", why);
		return;
	}
	struct job *job = job_new_validated(c, request_id, msg);
	if (!job) {
		/* Nothing can write this job's done word: closing lets the library release the stream. */
		c->close_after_flush = true;
		return;
	}
	job->estream = es;
	job->seq = msg->enqueue->seq;
	if (job->status == NC_OK && job->device != es->device) {
		job_refuse(job, NC_EINVALID_ARGUMENT,
			   "enqueue: the semaphore slot is on device %d, the job's tensors on %d",
			   es->device, job->device);
		stats_count_rejection(srv, NC_REJECT_BAD_JOB);
	} else if (job->status == NC_OK && srv->draining) {
		job_refuse(job, NC_ESHUTTING_DOWN, "the daemon is shutting down");
		stats_count_rejection(srv, NC_REJECT_SHUTTING_DOWN);
	}
	estream_push(es, job);
}

void job_submit(struct client *c, uint64_t request_id, const Normd__Job *msg)
{
	struct server *srv = c->srv;
	if (msg->enqueue) {
		job_submit_enqueued(c, request_id, msg);
		return;
	}
	if (srv->draining) {
		stats_count_rejection(srv, NC_REJECT_SHUTTING_DOWN);
		reply_result(c, request_id, NC_ESHUTTING_DOWN, "the daemon is shutting down");
		return;
	}
	if (c->jobs_in_flight >= srv->cfg->max_jobs_in_flight) {
		stats_count_rejection(srv, NC_REJECT_LIMIT_JOBS_IN_FLIGHT);
		reply_result(c, request_id, NC_ERESOURCE_EXHAUSTED,
			     "max_jobs_in_flight (%llu) reached; wait for replies first",
			     (unsigned long long)srv->cfg->max_jobs_in_flight);
		return;
	}
	struct job *job = job_new_validated(c, request_id, msg);
	if (!job)
		return;
	if (job->status == NC_OK)
		job->status = srv->backend->submit(srv->backend, job);
	if (job->status != NC_OK) {
		stats_count_job(srv, job, false);
		reply_job(c, job);
		job_release(job);
		return;
	}
	c->jobs_in_flight++;
	srv->jobs_in_flight++;
	server_job_started(srv, job->t_arrive_ns);
}

void job_post_completion(struct job *job)
{
	struct server *srv = job->client->srv;
	/*
	 * A lock-free push (every thread pushes, only the loop takes): a mutex
	 * here was contended by the loop's drain on every iteration it polls, and
	 * a contended lock costs a futex sleep and wake-up. All sequentially
	 * consistent, so that either the loop's last drain sees this job or this
	 * thread sees loop_polling clear (below).
	 */
	struct job *head = atomic_load(&srv->completed);
	do {
		job->next = head;
	} while (!atomic_compare_exchange_weak(&srv->completed, &head, job));
	/*
	 * A polling loop drains the queue each iteration; waking it would cost
	 * a write here and a read there. It clears loop_polling before its last
	 * drain, so a job queued after that drain sees the flag clear.
	 */
	if (!atomic_load(&srv->loop_polling))
		uv_async_send(&srv->completion_async);
}

/* Loop thread: answers one finished job and releases what it held. */
static void job_finish(struct job *job)
{
	struct client *c = job->client;
	struct server *srv = c->srv;
	if (job->estream) {
		estream_job_done(job);
		return;
	}
	if (job->notice) {
		/* The early reply of a job that is still running: answer, count nothing. */
		reply_job(c, job);
		nc__free(job);
		return;
	}
	stats_count_job(srv, job, true);
	if (!job->replied)
		reply_job(c, job); /* dropped if the client is gone */
	c->jobs_in_flight--;
	srv->jobs_in_flight--;
	job_release(job);
}

/* uv_async callback: drains every completed job (wake-ups coalesce). */
void job_drain_completions(uv_async_t *async)
{
	struct server *srv = async->data;
	/* The stack holds the newest first: reversed, jobs are answered in the order they finished. */
	struct job *stack = atomic_load(&srv->completed) ? atomic_exchange(&srv->completed, NULL)
							 : NULL;
	struct job *job = NULL;
	while (stack) {
		struct job *next = stack->next;
		stack->next = job;
		job = stack;
		stack = next;
	}
	while (job) {
		struct job *next = job->next;
		job_finish(job);
		job = next;
	}
	const char *fatal = srv->backend && srv->backend->fatal_error
				    ? srv->backend->fatal_error(srv->backend)
				    : NULL;
	if (srv->busy_estreams && estream_poll_due(srv))
		estream_poll(srv);
	if (fatal)
		server_fail(srv, fatal);
	if (srv->draining)
		server_drain_check(srv);
}
