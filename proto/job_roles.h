/*
 * The tensors a job names, written once for the two places that check them:
 * the daemon's job validation (daemon/job.c) and the library's check of an
 * enqueued job before it is sent (client/lib/enqueue.c). Private to those
 * two: nothing here is part of normclient.h.
 *
 * NC__JOB_ROLE_MAP(ENTRY) calls ENTRY(ROLE, name, row, ln_fwd, ln_bwd,
 * rms_fwd, rms_bwd, wgrad) once per role, in the order of the tensor fields
 * of struct nc_job and normd.Job. `row` is ROW for a [rows, cols] tensor
 * whose rows a norm job reads (or writes) one at a time, WHOLE for the
 * rest. The last five say what each op (in the order of enum nc_op and
 * normd.Op, 1 to 5) does with the role: IN, it reads it and needs it;
 * IN_OPT, it may read it; OUT, it writes it and needs it; OUT_OPT, it may
 * write it; NONE, it must not get it. Rules between roles (residual with
 * residual_out, scale with FP8 y) are the checkers' own. A
 * memory_efficient backward job takes no mean: its users drop mean
 * themselves.
 *
 * Aliasing (docs/VARIANTS.md): inputs may overlap each other freely. An
 * output may overlap an input only by being exactly the same bytes (same
 * memory, start and size), and only when both are ROW tensors: a kernel
 * reads a row's inputs before it writes that row's outputs, so the
 * in-place forms (y over x, residual_out over residual, dx over dy) are
 * safe, while a partial overlap, or an output over a tensor every row
 * reads (gamma, mean), would race. Outputs never overlap each other.
 */
#ifndef NORMD_JOB_ROLES_H
#define NORMD_JOB_ROLES_H

#include <stdbool.h>
#include <stdint.h>

/* clang-format off */
#define NC__JOB_ROLE_MAP(ENTRY)                                                                     \
	/*     role          name            row    LN_FWD   LN_BWD   RMS_FWD  RMS_BWD  WGRAD */      \
	ENTRY(X,            "x",            ROW,   IN,      IN,      IN,      IN,      IN)           \
	ENTRY(Y,            "y",            ROW,   OUT,     NONE,    OUT,     NONE,    NONE)         \
	ENTRY(MEAN,         "mean",         WHOLE, OUT_OPT, IN,      NONE,    NONE,    NONE)         \
	ENTRY(RSTD,         "rstd",         WHOLE, OUT_OPT, IN,      OUT_OPT, IN,      NONE)         \
	ENTRY(GAMMA,        "gamma",        WHOLE, IN_OPT,  IN_OPT,  IN_OPT,  IN_OPT,  NONE)         \
	ENTRY(BETA,         "beta",         WHOLE, IN_OPT,  IN_OPT,  NONE,    NONE,    NONE)         \
	ENTRY(DY,           "dy",           ROW,   NONE,    IN,      NONE,    IN,      IN)           \
	ENTRY(DX,           "dx",           ROW,   NONE,    OUT,     NONE,    OUT,     NONE)         \
	ENTRY(DGAMMA,       "dgamma",       WHOLE, NONE,    OUT_OPT, NONE,    OUT_OPT, NONE)         \
	ENTRY(DBETA,        "dbeta",        WHOLE, NONE,    OUT_OPT, NONE,    NONE,    NONE)         \
	ENTRY(MAIN_GRAD,    "main_grad",    WHOLE, NONE,    NONE,    NONE,    NONE,    OUT)          \
	ENTRY(RESIDUAL,     "residual",     ROW,   IN_OPT,  NONE,    IN_OPT,  NONE,    NONE)         \
	ENTRY(RESIDUAL_OUT, "residual_out", ROW,   OUT_OPT, NONE,    OUT_OPT, NONE,    NONE)         \
	ENTRY(DS,           "ds",           ROW,   NONE,    IN_OPT,  NONE,    IN_OPT,  NONE)         \
	ENTRY(SCALE,        "scale",        WHOLE, IN_OPT,  NONE,    IN_OPT,  NONE,    NONE)         \
	ENTRY(AMAX,         "amax",         WHOLE, OUT_OPT, NONE,    OUT_OPT, NONE,    NONE)
/* clang-format on */

enum nc__job_role {
#define NC__JOB_ROLE_ENUM(role, name, row, ln_fwd, ln_bwd, rms_fwd, rms_bwd, wgrad) NC__ROLE_##role,
	NC__JOB_ROLE_MAP(NC__JOB_ROLE_ENUM)
#undef NC__JOB_ROLE_ENUM
	NC__ROLE_COUNT
};

/* What an op does with a role. */
enum nc__role_use { NC__USE_NONE = 0, NC__USE_REQ, NC__USE_OPT };

/* The table's words, as stored: how an op uses a role and in which direction. */
enum nc__role_entry { NC__E_NONE, NC__E_IN, NC__E_IN_OPT, NC__E_OUT, NC__E_OUT_OPT };

/* The ops of the table's columns: enum nc_op and normd.Op values 1 to NC__JOB_OPS. */
#define NC__JOB_OPS 5

/* The name of a role in messages ("x", "main_grad"). */
static inline const char *nc__job_role_name(enum nc__job_role role)
{
	static const char *const names[NC__ROLE_COUNT] = {
#define NC__JOB_ROLE_NAME(role, name, row, ln_fwd, ln_bwd, rms_fwd, rms_bwd, wgrad) name,
		NC__JOB_ROLE_MAP(NC__JOB_ROLE_NAME)
#undef NC__JOB_ROLE_NAME
	};
	return names[role];
}

/* The table's entry for op `op` (1 to NC__JOB_OPS; the caller has checked it) and `role`. */
static inline enum nc__role_entry nc__job_role_entry(int op, enum nc__job_role role)
{
	static const unsigned char entries[NC__ROLE_COUNT][NC__JOB_OPS] = {
#define NC__JOB_ROLE_USES(role, name, row, ln_fwd, ln_bwd, rms_fwd, rms_bwd, wgrad)                \
	{NC__E_##ln_fwd, NC__E_##ln_bwd, NC__E_##rms_fwd, NC__E_##rms_bwd, NC__E_##wgrad},
		NC__JOB_ROLE_MAP(NC__JOB_ROLE_USES)
#undef NC__JOB_ROLE_USES
	};
	return (enum nc__role_entry)entries[role][op - 1];
}

/* What op `op` (1 to NC__JOB_OPS; the caller has checked it) does with `role`. */
static inline enum nc__role_use nc__job_role_use(int op, enum nc__job_role role)
{
	switch (nc__job_role_entry(op, role)) {
	case NC__E_IN:
	case NC__E_OUT:
		return NC__USE_REQ;
	case NC__E_IN_OPT:
	case NC__E_OUT_OPT:
		return NC__USE_OPT;
	default:
		return NC__USE_NONE;
	}
}

/* Whether op `op` writes `role`. */
static inline bool nc__job_role_is_output(int op, enum nc__job_role role)
{
	enum nc__role_entry e = nc__job_role_entry(op, role);
	return e == NC__E_OUT || e == NC__E_OUT_OPT;
}

/* Whether `role` is a per-row [rows, cols] tensor (the table's ROW). */
static inline bool nc__job_role_is_row(enum nc__job_role role)
{
	enum { WHOLE = 0, ROW = 1 };
	static const unsigned char rows[NC__ROLE_COUNT] = {
#define NC__JOB_ROLE_ROW(role, name, row, ln_fwd, ln_bwd, rms_fwd, rms_bwd, wgrad) row,
		NC__JOB_ROLE_MAP(NC__JOB_ROLE_ROW)
#undef NC__JOB_ROLE_ROW
	};
	return rows[role] == ROW;
}

/*
 * A tensor as the alias check sees it: the memory object it lies in
 * (`memory`, two words the caller chooses: a file's device and inode, or
 * 0 and an address space) and its bytes [start, start + bytes) there.
 */
struct nc__span {
	bool present;
	uint64_t memory[2];
	uint64_t start, bytes;
};

/* How two tensors of a job may share memory. */
enum nc__alias {
	NC__ALIAS_OK = 0,      /* disjoint, two inputs, or an allowed exact in-place pair */
	NC__ALIAS_OUTPUTS,     /* two outputs overlap */
	NC__ALIAS_PARTIAL,     /* an output overlaps an input, but not exactly */
	NC__ALIAS_NOT_PER_ROW, /* an output is exactly an input, but one of them is not per-row */
};

/* How tensors `a` and `b` of op `op` (1 to NC__JOB_OPS) overlap, by the rules above. */
static inline enum nc__alias nc__job_alias_pair(int op, enum nc__job_role a,
						const struct nc__span *sa, enum nc__job_role b,
						const struct nc__span *sb)
{
	bool out_a = nc__job_role_is_output(op, a), out_b = nc__job_role_is_output(op, b);
	if (!sa->present || !sb->present || sa->memory[0] != sb->memory[0] ||
	    sa->memory[1] != sb->memory[1])
		return NC__ALIAS_OK;
	/* Bounds were checked first: start + bytes cannot overflow. */
	if (sa->start + sa->bytes <= sb->start || sb->start + sb->bytes <= sa->start)
		return NC__ALIAS_OK;
	if (!out_a && !out_b)
		return NC__ALIAS_OK;
	if (out_a && out_b)
		return NC__ALIAS_OUTPUTS;
	if (sa->start != sb->start || sa->bytes != sb->bytes)
		return NC__ALIAS_PARTIAL;
	if (!nc__job_role_is_row(a) || !nc__job_role_is_row(b))
		return NC__ALIAS_NOT_PER_ROW;
	return NC__ALIAS_OK;
}

/*
 * Checks every pair of a job's tensors (spans[] by role). Returns
 * NC__ALIAS_OK, or the first forbidden overlap with its two roles in *a
 * and *b (an output first).
 */
static inline enum nc__alias nc__job_alias_check(int op, const struct nc__span spans[],
						 enum nc__job_role *a, enum nc__job_role *b)
{
	for (int i = 0; i < NC__ROLE_COUNT; i++) {
		for (int j = i + 1; j < NC__ROLE_COUNT; j++) {
			enum nc__job_role ri = (enum nc__job_role)i, rj = (enum nc__job_role)j;
			enum nc__alias verdict = nc__job_alias_pair(op, ri, &spans[i], rj, &spans[j]);
			if (verdict == NC__ALIAS_OK)
				continue;
			bool i_out = nc__job_role_is_output(op, ri);
			*a = i_out ? ri : rj;
			*b = i_out ? rj : ri;
			return verdict;
		}
	}
	return NC__ALIAS_OK;
}

/* A one-line explanation of a verdict, for messages ("may alias an input only exactly"). */
static inline const char *nc__alias_why(enum nc__alias verdict)
{
	switch (verdict) {
	case NC__ALIAS_OUTPUTS:
		return "two outputs must not overlap";
	case NC__ALIAS_PARTIAL:
		return "an output may overlap an input only as exactly the same bytes (same "
		       "region, offset and size)";
	case NC__ALIAS_NOT_PER_ROW:
		return "only per-row tensors may be used in place (y or residual_out over x or "
		       "residual, dx over x, dy or ds)";
	default:
		return "no overlap";
	}
}

#endif /* NORMD_JOB_ROLES_H */
