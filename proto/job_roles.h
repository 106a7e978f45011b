/*
 * The tensors a job names, written once for the two places that check them:
 * the daemon's job validation (daemon/job.c) and the library's check of an
 * enqueued job before it is sent (client/lib/enqueue.c). Private to those
 * two: nothing here is part of normclient.h.
 *
 * NC__JOB_ROLE_MAP(ENTRY) calls ENTRY(ROLE, name, ln_fwd, ln_bwd, rms_fwd,
 * rms_bwd, wgrad) once per role, in the order of the tensor fields of
 * struct nc_job and normd.Job. The last five say what each op (in the order
 * of enum nc_op and normd.Op, 1 to 5) does with the role: REQ, it needs it;
 * OPT, it may take it; NONE, it must not get it. A memory_efficient
 * backward job takes no mean: its users drop mean themselves.
 */
#ifndef NORMD_JOB_ROLES_H
#define NORMD_JOB_ROLES_H

/* clang-format off */
#define NC__JOB_ROLE_MAP(ENTRY)                                                             \
	/*     role       name         LN_FWD  LN_BWD  RMS_FWD  RMS_BWD  WGRAD_ACCUM */     \
	ENTRY(X,         "x",         REQ,    REQ,    REQ,     REQ,     REQ)                \
	ENTRY(Y,         "y",         REQ,    NONE,   REQ,     NONE,    NONE)               \
	ENTRY(MEAN,      "mean",      OPT,    REQ,    NONE,    NONE,    NONE)               \
	ENTRY(RSTD,      "rstd",      OPT,    REQ,    OPT,     REQ,     NONE)               \
	ENTRY(GAMMA,     "gamma",     OPT,    OPT,    OPT,     OPT,     NONE)               \
	ENTRY(BETA,      "beta",      OPT,    OPT,    NONE,    NONE,    NONE)               \
	ENTRY(DY,        "dy",        NONE,   REQ,    NONE,    REQ,     REQ)                \
	ENTRY(DX,        "dx",        NONE,   REQ,    NONE,    REQ,     NONE)               \
	ENTRY(DGAMMA,    "dgamma",    NONE,   OPT,    NONE,    OPT,     NONE)               \
	ENTRY(DBETA,     "dbeta",     NONE,   OPT,    NONE,    NONE,    NONE)               \
	ENTRY(MAIN_GRAD, "main_grad", NONE,   NONE,   NONE,    NONE,    REQ)
/* clang-format on */

enum nc__job_role {
#define NC__JOB_ROLE_ENUM(role, name, ln_fwd, ln_bwd, rms_fwd, rms_bwd, wgrad) NC__ROLE_##role,
	NC__JOB_ROLE_MAP(NC__JOB_ROLE_ENUM)
#undef NC__JOB_ROLE_ENUM
	NC__ROLE_COUNT
};

/* What an op does with a role. */
enum nc__role_use { NC__USE_NONE = 0, NC__USE_REQ, NC__USE_OPT };

/* The ops of the table's columns: enum nc_op and normd.Op values 1 to NC__JOB_OPS. */
#define NC__JOB_OPS 5

/* The name of a role in messages ("x", "main_grad"). */
static inline const char *nc__job_role_name(enum nc__job_role role)
{
	static const char *const names[NC__ROLE_COUNT] = {
#define NC__JOB_ROLE_NAME(role, name, ln_fwd, ln_bwd, rms_fwd, rms_bwd, wgrad) name,
		NC__JOB_ROLE_MAP(NC__JOB_ROLE_NAME)
#undef NC__JOB_ROLE_NAME
	};
	return names[role];
}

/* What op `op` (1 to NC__JOB_OPS; the caller has checked it) does with `role`. */
static inline enum nc__role_use nc__job_role_use(int op, enum nc__job_role role)
{
	static const unsigned char uses[NC__ROLE_COUNT][NC__JOB_OPS] = {
#define NC__JOB_ROLE_USES(role, name, ln_fwd, ln_bwd, rms_fwd, rms_bwd, wgrad)                     \
	{NC__USE_##ln_fwd, NC__USE_##ln_bwd, NC__USE_##rms_fwd, NC__USE_##rms_bwd, NC__USE_##wgrad},
		NC__JOB_ROLE_MAP(NC__JOB_ROLE_USES)
#undef NC__JOB_ROLE_USES
	};
	return (enum nc__role_use)uses[role][op - 1];
}

#endif /* NORMD_JOB_ROLES_H */
