/*
 * normstress's parts, shared by the engine (normstress.c: the parent, its
 * client processes and chaos, the daemon's numbers, main) and the files
 * that hold the rest:
 *   stress_options.c   the command line
 *   stress_counters.c  counters and latency histograms shared by all processes
 *   stress_kit.c       kits: a job's memory, where it lives, and its check
 *   stress_expect.c    a kit's reference outputs on the GPU (enqueue mode, CUDA)
 *   stress_invalid.c   invalid requests and the status each must get
 *   stress_worker.c    a client thread and a client process
 *   stress_report.c    the summary as text and JSON
 * Each function is used from another of these files; what a file keeps to
 * itself is static there.
 */
#ifndef NORMD_STRESS_H
#define NORMD_STRESS_H

#include <cuda_runtime_api.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <math.h>
#include <sys/types.h>
#include <time.h>

#include "client/tools/jobkit.h"
#include "client/tools/rng.h"
#include "kernels/norm_kernels.h"
#include "normclient.h"

#define DEFAULT_SOCKET "/run/normd/0.sock"
#define MAX_SLOTS 4096            /* processes x threads */
#define MAX_INFLIGHT 1024         /* per thread */
#define MAX_SIZE (1ull << 26)     /* largest rows or cols accepted on the command line */
#define MAX_LIST 64
#define MAX_DEVICES 16            /* GPUs nc_server_info lists */
#define ROLES JK_ROLES            /* jobkit's tensor roles */
#define JOB_ROLES (JK_MAIN_GRAD + 1) /* of them, those of struct nc_job (the rest: nc_job_ext) */
#define ENQUEUE_MAX_STREAMS 64    /* streams one connection may enqueue on (normclient.h) */

_Static_assert(ATOMIC_LONG_LOCK_FREE == 2 && ATOMIC_BOOL_LOCK_FREE == 2,
	       "counters shared between processes must be lock-free atomics");

/* ---- options (stress_options.c) ------------------------------------------------------ */

enum stress_mode { MODE_SYNC, MODE_EVENT, MODE_ENQUEUE };

/* A set of sizes: an explicit list, or a range drawn log-uniformly. */
struct size_choice {
	uint64_t values[MAX_LIST];
	unsigned count; /* 0: the range lo..hi */
	uint64_t lo, hi;
};

struct stress_opts {
	const char *socket_path;
	unsigned procs, threads;
	unsigned inflight;       /* requests in flight per thread */
	uint64_t jobs;           /* requests in all; 0: no count bound */
	double duration_s;       /* 0: no time bound */
	int ops[8];              /* enum nc_op, drawn uniformly */
	unsigned n_ops;
	int dtypes[8];           /* enum nc_dtype, drawn uniformly */
	unsigned n_dtypes;
	struct size_choice rows, cols;
	enum stress_mode mode;
	double verify;           /* fraction of valid jobs checked */
	double kill_rate;        /* kills per second per process */
	double bad_rate;         /* fraction of requests made invalid */
	uint64_t seed;
	const char *json_path;   /* NULL: no JSON */
	int timeout_ms;          /* longest wait for one reply */
	unsigned kit_reuse;      /* jobs per kit before it is replaced; 0: never */
	bool on_device;          /* CUDA backend: kits live in cudaMalloc memory */
	int device;              /* ... on this GPU (a process's: devices[proc % n_devices]) */
	const char *devices_arg; /* --devices as given; NULL: the daemon's first GPU */
	int devices[MAX_DEVICES]; /* the GPUs the processes take in turn (preflight) */
	unsigned n_devices;
};

struct name_value {
	const char *name;
	int value;
};

#define OP_NAMES 10
extern const struct name_value op_names[OP_NAMES]; /* --ops names, short ones first */
extern const char *const mode_names[3];            /* by enum stress_mode */

/* Returns 0 to run, 1 after --help, 2 for a usage error (already explained). */
int stress_options_parse(int argc, char **argv, struct stress_opts *o);

/* ---- time and random numbers ------------------------------------------------------------ */

static inline uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void sleep_ns(uint64_t ns)
{
	struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
	nanosleep(&ts, NULL);
}

static inline uint64_t size_pick(const struct size_choice *c, uint64_t *state)
{
	if (c->count)
		return c->values[rng_below(state, c->count)];
	/* Log-uniform: every octave of the range is drawn equally often. */
	double lo = log((double)c->lo), hi = log((double)c->hi + 1.0);
	uint64_t v = (uint64_t)exp(lo + (hi - lo) * rng_unit(state));
	return v < c->lo ? c->lo : v > c->hi ? c->hi : v;
}

/* ---- counters shared by all processes (stress_counters.c) ------------------------------- */

/* Latency histogram: log-linear buckets over nanoseconds (stress_counters.c). */
#define HIST_SUB_BITS 5
#define HIST_SUB (1u << HIST_SUB_BITS)
#define HIST_BUCKETS (2 * HIST_SUB + 34 * HIST_SUB)

enum counter {
	C_JOBS_OK,      /* valid jobs answered OK */
	C_BYTES,        /* bytes those jobs read and wrote */
	C_VERIFIED,     /* of them, checked against the reference */
	C_MISMATCHES,   /* checked and wrong */
	C_BAD_SENT,     /* invalid requests sent */
	C_BAD_EXPECTED, /* invalid requests answered with the status they had to get */
	C_UNEXPECTED,   /* anything that should not have happened */
	C_IN_FLIGHT,    /* requests sent and not answered yet (lost if the process is killed) */
	C_KITS,         /* kits (registered regions) created */
	C_COUNTERS
};

/* Wire statuses 0..10, the library's codes 100..102 at 11..13, anything else at 15. */
#define STATUS_SLOTS 16

/* One thread's counters. Written by that thread only; read by the parent. */
struct slot {
	_Atomic uint64_t count[C_COUNTERS];
	_Atomic uint64_t valid_status[STATUS_SLOTS]; /* how valid jobs failed */
	_Atomic uint64_t bad_status[STATUS_SLOTS];   /* how invalid requests were answered */
	_Atomic uint64_t max_ns;                     /* slowest valid job */
	_Atomic uint64_t hist[HIST_BUCKETS];         /* latencies of valid jobs answered OK */
};

/* The shared anonymous mapping, made before the first fork. */
struct shared {
	atomic_bool stop;         /* set by the parent: finish what is in flight, then exit */
	atomic_uint ready;        /* threads connected with their regions made */
	atomic_bool go;           /* set by the parent once all are ready: the clock starts */
	_Atomic uint64_t tickets; /* requests claimed so far, against --jobs */
	struct slot slots[];      /* procs x threads */
};

/* Merged counters of every thread, for the progress line and the summary. */
struct totals {
	uint64_t count[C_COUNTERS];
	uint64_t valid_status[STATUS_SLOTS];
	uint64_t bad_status[STATUS_SLOTS];
	uint64_t max_ns;
	uint64_t hist[HIST_BUCKETS];
	uint64_t hist_total;
};

void slot_add(struct slot *s, enum counter c, uint64_t n);
/* Counts `status` in a STATUS_SLOTS table (valid_status or bad_status). */
void slot_status(_Atomic uint64_t *by_status, int status);
/* A valid job answered OK after `ns`. */
void slot_latency(struct slot *s, uint64_t ns);
/* The status name of slot `i` of a STATUS_SLOTS table ("OTHER" for the last). */
const char *status_slot_name(unsigned i);
struct stress;
void totals_merge(const struct stress *st, struct totals *t);
/* The latency at quantile q in microseconds (bucket upper bound, at most the maximum). */
double totals_quantile_us(const struct totals *t, double q);

/* ---- kits (stress_kit.c, stress_expect.c) ------------------------------------------------ */

/*
 * A kit is a jobkit. On the CPU backend that is one host memfd region
 * holding every tensor; on the CUDA backend one cudaMalloc allocation
 * registered through CUDA IPC, with inputs uploaded from a host staging copy
 * and outputs downloaded by jobkit_check(), and kit_rearm() uploading what it
 * resets on the in-flight slot's stream.
 */
struct kit {
	struct jobkit jk;
	bool busy;      /* a request naming its memory is in flight */
	unsigned uses;  /* jobs submitted on it since it was created */
	uint64_t bytes; /* bytes a job on it reads and writes */
	/* Enqueue mode on the CUDA backend, made for the kit's first verified job: */
	float *expect;  /* device: the reference outputs, fp32 */
	struct nk_check_output check[NK_CHECK_MAX_OUTPUTS]; /* what the GPU check compares */
	int n_check;
};

bool kit_op_is_backward(int op);
/* Whether jobkit role `role` is written by `op`. */
bool kit_role_is_output(int op, int role);
/*
 * A kit of a random op, shape, dtype and flags drawn from the options, and
 * of the norm variants the daemon runs (host kits only: the GPU check of
 * the enqueue mode compares plain outputs).
 */
int kit_create(nc_conn *conn, const struct stress_opts *o, uint64_t *rng, struct kit *k);
/* Frees the kit's region; accepts a kit that was never created. */
void kit_destroy(struct kit *k);
/* Makes a kit ready for its next job (see stress_kit.c). */
void kit_rearm(struct kit *k, bool verify, cudaStream_t stream, bool wait);
bool kit_check(const struct kit *k, struct jobkit_report *report);
/* "ln_bwd 37x1000 bf16/f32 gamma beta mem_eff acc" */
void kit_describe(const struct kit *k, char *buf, size_t len);
/* Enqueue mode, CUDA: the kit's reference outputs uploaded on `stream`, k->check filled. */
int kit_expect(struct kit *k, cudaStream_t stream);

/* ---- invalid requests (stress_invalid.c) ------------------------------------------------- */

enum bad_kind {
	BAD_OP,
	BAD_DTYPE,
	BAD_WEIGHT_DTYPE,
	BAD_ROWS,
	BAD_COLS,
	BAD_COLS_HUGE,
	BAD_SHAPE_OVERFLOW,
	BAD_EPS,
	BAD_REGION,
	BAD_OFFSET,
	BAD_OFFSET_OVERFLOW,
	BAD_MISSING_TENSOR,
	BAD_STRAY_TENSOR,
	BAD_FORWARD_FLAG,
	BAD_BETA_ALONE,
	BAD_KINDS
};

/* What each kind of invalid request is and the status it must get. */
struct bad_case {
	const char *name;
	int expect;
	bool enqueue_refuses; /* nc_job_enqueue returns `expect` without queueing */
};
extern const struct bad_case bad_cases[BAD_KINDS];

/* Whether `rc` is the status an invalid request of `kind` must get in `mode`. */
bool bad_status_ok(enum stress_mode mode, int kind, int rc);
/*
 * Turns `job`, a copy of the kit's valid job, into an invalid request of one
 * kind with exactly one fault. Returns false (job untouched) if that kind
 * does not apply to this kit.
 */
bool bad_apply(const struct kit *k, uint64_t *rng, int kind, struct nc_job *job);

/* ---- a client process (stress_worker.c) --------------------------------------------------- */

/*
 * Runs T client threads in a process forked by the parent, with their
 * counters in `sh`; returns the process's exit status.
 */
int worker_process_main(const struct stress_opts *o, struct shared *sh, pid_t parent,
			unsigned proc, unsigned generation);

/* ---- the parent (normstress.c) and its summary (stress_report.c) ------------------------- */

struct child {
	pid_t pid;             /* 0: not running */
	unsigned generation;   /* times it was started */
	uint64_t next_kill_ns; /* when chaos kills it next */
	bool killed;           /* chaos sent it SIGKILL */
	bool hung;             /* killed for not finishing after the stop */
};

struct stress {
	struct stress_opts opt;
	struct shared *sh;
	size_t sh_bytes;
	pid_t parent_pid;
	struct child *children;
	uint64_t rng;              /* the parent's: kill times */
	uint64_t t_launch_ns;      /* the clients were started */
	uint64_t t_start_ns, t_stop_ns, t_end_ns; /* t_start_ns: all ready (the clock) */
	bool going;                /* sh->go was set */
	bool stopping;
	unsigned kills;            /* children killed on purpose */
	unsigned child_failures;   /* children that crashed, failed or hung */
	uint64_t lost;             /* requests in flight in killed children */
	bool tty;                  /* stderr is a terminal: show progress */
	uint64_t last_progress_ns, last_progress_jobs;
	char backend[16];
	struct nc_stats before, after;
	bool have_before, have_after;
};

/* Every valid job succeeded and verified, every invalid one got its status, the daemon is up. */
bool run_passed(const struct stress *st, const struct totals *t);
/* The summary on stdout. */
void report_text(const struct stress *st, const struct totals *t, double elapsed);
/* The summary as JSON into --json FILE; 0 or -1 (said on stderr). */
int report_json(const struct stress *st, const struct totals *t, double elapsed);

#endif /* NORMD_STRESS_H */
