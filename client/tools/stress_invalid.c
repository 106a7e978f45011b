/*
 * normstress's invalid requests: each kind has exactly one fault and the
 * status it must get (stress.h).
 */
#include "client/tools/stress.h"

#include <math.h>

/*
 * What each kind of invalid request is and the status it must get. In the
 * enqueue mode only the kinds nc_job_enqueue refuses itself are sent: their
 * status is its return value. Beta without gamma passes the library's check
 * and would be refused by the daemon later, an asynchronous error that
 * nc_stream_wait() or nc_conn_check() may report on any job of the
 * connection, so that mode never sends it.
 */
const struct bad_case bad_cases[BAD_KINDS] = {
	[BAD_OP] = {"unknown op", NC_EINVALID_ARGUMENT, true},
	[BAD_DTYPE] = {"unknown dtype", NC_EINVALID_ARGUMENT, true},
	[BAD_WEIGHT_DTYPE] = {"weight dtype neither dtype nor f32", NC_EUNSUPPORTED, true},
	[BAD_ROWS] = {"rows = 0", NC_EINVALID_ARGUMENT, true},
	[BAD_COLS] = {"cols = 0", NC_EINVALID_ARGUMENT, true},
	[BAD_COLS_HUGE] = {"cols = 2^40", NC_EOUT_OF_RANGE, true},
	[BAD_SHAPE_OVERFLOW] = {"rows * cols overflows", NC_EOUT_OF_RANGE, true},
	[BAD_EPS] = {"eps <= 0, infinite or NaN", NC_EINVALID_ARGUMENT, true},
	[BAD_REGION] = {"unregistered region", NC_ENOT_FOUND, true},
	[BAD_OFFSET] = {"tensor runs past its region", NC_EOUT_OF_RANGE, true},
	[BAD_OFFSET_OVERFLOW] = {"offset + size overflows", NC_EOUT_OF_RANGE, true},
	[BAD_MISSING_TENSOR] = {"x absent", NC_EINVALID_ARGUMENT, true},
	[BAD_STRAY_TENSOR] = {"tensor the op does not use", NC_EINVALID_ARGUMENT, true},
	[BAD_FORWARD_FLAG] = {"backward flag on a forward op", NC_EINVALID_ARGUMENT, true},
	[BAD_BETA_ALONE] = {"beta without gamma", NC_EINVALID_ARGUMENT, false},
};

/*
 * Whether `rc` is the status an invalid request of `kind` must get. For a
 * shape whose element count overflows nc_job_enqueue answers
 * INVALID_ARGUMENT where the daemon answers OUT_OF_RANGE (its check is
 * rows * cols <= INT64_MAX / 8 as an argument error), so in the enqueue
 * mode the two overflow kinds take either.
 */
bool bad_status_ok(enum stress_mode mode, int kind, int rc)
{
	if (rc == bad_cases[kind].expect)
		return true;
	return mode == MODE_ENQUEUE && rc == NC_EINVALID_ARGUMENT &&
	       (kind == BAD_COLS_HUGE || kind == BAD_SHAPE_OVERFLOW);
}

static struct nc_tensor *job_tensor(struct nc_job *job, int role)
{
	struct nc_tensor *const tensors[JOB_ROLES] = {
		&job->x,  &job->y,  &job->mean,	  &job->rstd,  &job->gamma,	 &job->beta,
		&job->dy, &job->dx, &job->dgamma, &job->dbeta, &job->main_grad,
	};
	return tensors[role];
}

/* A random role of struct nc_job the kit's job uses (x at least). */
static int random_present_role(const struct kit *k, uint64_t *rng)
{
	int start = (int)rng_below(rng, JOB_ROLES);
	for (int i = 0; i < JOB_ROLES; i++) {
		int role = (start + i) % JOB_ROLES;
		if (k->jk.ptr[role])
			return role;
	}
	return JK_X;
}

/* The tensor faults: region and offset. */
static void bad_tensor(const struct kit *k, uint64_t *rng, int kind, struct nc_job *job)
{
	int role = random_present_role(k, rng);
	struct nc_tensor *t = job_tensor(job, role);
	uint64_t size = nc_region_size(k->jk.region), bytes = k->jk.bytes[role];
	if (kind == BAD_REGION)
		t->region = UINT64_MAX - rng_below(rng, 1024); /* ids are handed out from 1 up */
	else if (kind == BAD_OFFSET)
		t->offset = size - bytes + 1 + rng_below(rng, bytes); /* 1..bytes too far */
	else
		t->offset = UINT64_MAX - rng_below(rng, 64);
}

/*
 * Turns `job`, a copy of the kit's valid job, into an invalid request of one
 * kind with exactly one fault. Returns false (job untouched) if that kind
 * does not apply to this kit.
 */
bool bad_apply(const struct kit *k, uint64_t *rng, int kind, struct nc_job *job)
{
	static const float bad_eps[] = {-1e-5f, -1.0f, INFINITY, NAN};
	bool forward = !kit_op_is_backward(job->op);
	switch (kind) {
	case BAD_OP:
		job->op = (enum nc_op)(rng_next(rng) & 1 ? 0 : 77);
		return true;
	case BAD_DTYPE:
		job->dtype = (enum nc_dtype)(4 + rng_below(rng, 60));
		return true;
	case BAD_WEIGHT_DTYPE:
		job->weight_dtype = job->dtype == NC_F16 ? NC_BF16 : NC_F16;
		return true;
	case BAD_ROWS:
		job->rows = 0;
		return true;
	case BAD_COLS:
		job->cols = 0;
		return true;
	case BAD_COLS_HUGE:
		job->cols = 1ull << 40;
		return true;
	case BAD_SHAPE_OVERFLOW:
		job->rows = 1ull << 62;
		return true;
	case BAD_EPS:
		job->eps = bad_eps[rng_below(rng, 4)];
		return true;
	case BAD_REGION:
	case BAD_OFFSET:
	case BAD_OFFSET_OVERFLOW:
		bad_tensor(k, rng, kind, job);
		return true;
	case BAD_MISSING_TENSOR:
		job->x.region = 0;
		return true;
	case BAD_STRAY_TENSOR:
		*(forward ? &job->dx : &job->y) = job->x;
		return true;
	case BAD_FORWARD_FLAG:
		if (!forward)
			return false;
		job->flags |= rng_next(rng) & 1 ? NC_MEMORY_EFFICIENT : NC_ACCUMULATE;
		return true;
	case BAD_BETA_ALONE:
		if (!job->beta.region)
			return false;
		job->gamma.region = job->dgamma.region = 0;
		return true;
	}
	return false;
}
