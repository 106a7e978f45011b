/*
 * normstress: load-test a running normd through libnormclient, with chaos.
 *
 *   normstress --socket PATH --procs N --threads T (--jobs J | --duration S)
 *              [--ops ln_fwd,ln_bwd,rms_fwd,rms_bwd] [--dtypes f32,f16,bf16]
 *              [--rows LIST|MIN-MAX] [--cols LIST|MIN-MAX] [--inflight K]
 *              [--mode sync|event|enqueue] [--verify FRACTION] [--seed S] [--json FILE]
 *              [--kill-rate R] [--bad-rate R] [--timeout MS] [--kit-reuse N]
 *
 * N client processes (fork) run T threads each; every thread has its own
 * connection and its own pool of registered regions ("kits": a job with its
 * buffers, see jobkit.h) of random ops, shapes, dtypes and flags, and keeps
 * K jobs in flight (nc_job_submit, then nc_job_wait). A kit is never
 * resubmitted while a request naming it is in flight, so a result can be
 * checked against the float64 reference (--verify, the fraction checked).
 * Kits are replaced after --kit-reuse jobs, so regions are registered and
 * unregistered under load too.
 *
 * Chaos: --kill-rate R SIGKILLs each client process at random moments (R per
 * second on average) and starts it again; the jobs it had in flight are lost,
 * which is counted but is not an error. --bad-rate R replaces that fraction
 * of requests with invalid ones (unknown op or dtype, impossible shape, bad
 * eps, unregistered region, offset out of range, missing or stray tensor...)
 * that must get their exact error status while valid jobs around them are
 * unaffected.
 *
 * The run ends after J requests or S seconds (whichever comes first when both
 * are given), or at SIGINT/SIGTERM; clients then finish what is in flight. The
 * counters and latency histograms of all threads live in one shared anonymous
 * mapping made before fork, so the parent merges them, also those of killed
 * processes. A progress line goes to stderr when it is a terminal; the
 * summary goes to stdout (and as JSON to --json FILE). The daemon's RSS is
 * read before the clients start and after they are gone.
 *
 * Exit status: 0 when every valid job succeeded and matched the reference and
 * every invalid one got its expected status; 1 otherwise (or when the daemon
 * is unreachable); 2 for a bad command line or a mode the daemon cannot run.
 *
 * --mode event (ordering with CUDA IPC events) and CUDA regions belong to the
 * CUDA backend; on the CPU backend --mode sync and enqueue run. The kit_*()
 * functions are the one place that knows where a kit's memory lives.
 *
 * On the CUDA backend every in-flight slot of a thread has its own stream.
 * --mode sync uploads a job's inputs on that stream, waits for the upload
 * and submits (nc_job_submit, replies collected with nc_job_wait); a job is
 * done when its reply comes. --mode event uploads on the stream and calls
 * nc_job_run_event on it, which returns once the daemon has queued the job
 * behind the upload; a job is done when an event recorded on the stream
 * after that call has completed, as this thread observes it. --mode enqueue
 * calls nc_job_enqueue on the stream and, for a verified job, queues a
 * kernel behind it that compares the outputs with the kit's reference on
 * the GPU (uploaded once per kit) and counts mismatches in device memory,
 * read back every CHECK_READ_NS; a job is done when an event recorded after
 * them has completed. On the CPU backend --mode enqueue uses each slot's
 * address as its stream key, waits with nc_stream_wait and checks on the
 * host. In the enqueue mode invalid requests are only of the kinds the
 * library refuses itself, whose return value is their answer.
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "kernels/norm_kernels.h"
#include "normclient.h"

#define DEFAULT_SOCKET "/run/normd/0.sock"
#define MAX_SLOTS 4096            /* processes x threads */
#define MAX_INFLIGHT 1024         /* per thread */
#define START_TIMEOUT_NS 120000000000ull /* longest wait for every client to be ready */
#define MAX_SIZE (1ull << 26)     /* largest rows or cols accepted on the command line */
#define MAX_LIST 64
#define DETAIL_LINES 5            /* failure descriptions each thread prints */
#define ROLES (JK_MAIN_GRAD + 1)  /* jobkit's tensor roles */
#define PROGRESS_NS 500000000ull  /* progress line refresh */
#define TICK_NS 10000000ull       /* the parent's polling period */
#define ENQUEUE_MAX_STREAMS 64    /* streams one connection may enqueue on (normclient.h) */
#define CHECK_READ_NS 100000000ull /* enqueue mode, CUDA: GPU check counters read period */

_Static_assert(ATOMIC_LONG_LOCK_FREE == 2 && ATOMIC_BOOL_LOCK_FREE == 2,
	       "counters shared between processes must be lock-free atomics");

/* ---- options ------------------------------------------------------------------ */

enum stress_mode { MODE_SYNC, MODE_EVENT, MODE_ENQUEUE };

static const char *const mode_names[] = {"sync", "event", "enqueue"};

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
	int device;              /* ... on this GPU (the daemon's first) */
};

struct name_value {
	const char *name;
	int value;
};

static const struct name_value op_names[] = {
	{"ln_fwd", NC_LAYERNORM_FWD},	     {"ln_bwd", NC_LAYERNORM_BWD},
	{"rms_fwd", NC_RMSNORM_FWD},	     {"rms_bwd", NC_RMSNORM_BWD},
	{"layernorm_fwd", NC_LAYERNORM_FWD}, {"layernorm_bwd", NC_LAYERNORM_BWD},
	{"rmsnorm_fwd", NC_RMSNORM_FWD},     {"rmsnorm_bwd", NC_RMSNORM_BWD},
	{"wgrad", NC_WGRAD_ACCUM},	     {"wgrad_accum", NC_WGRAD_ACCUM},
};

static const struct name_value dtype_names[] = {
	{"f32", NC_F32}, {"f16", NC_F16}, {"bf16", NC_BF16},
};

static const char usage_text[] =
	"usage: normstress [--socket PATH] [--procs N] [--threads T]\n"
	"                  (--jobs J | --duration S) [--ops LIST] [--dtypes LIST]\n"
	"                  [--rows LIST|MIN-MAX] [--cols LIST|MIN-MAX] [--inflight K]\n"
	"                  [--mode sync|event|enqueue] [--verify FRACTION] [--seed S]\n"
	"                  [--json FILE] [--kill-rate R] [--bad-rate R] [--timeout MS]\n"
	"                  [--kit-reuse N]\n"
	"\n"
	"  --socket PATH      the daemon's socket ($NORMD_SOCKET, else " DEFAULT_SOCKET ")\n"
	"  --procs N          client processes (1)\n"
	"  --threads T        threads per process, each with its own connection (1)\n"
	"  --jobs J           stop after J requests in all\n"
	"  --duration S       stop after S seconds (with --jobs: whichever comes first)\n"
	"  --ops LIST         ops to mix: ln_fwd,ln_bwd,rms_fwd,rms_bwd,wgrad\n"
	"                     (default: the four norm ops)\n"
	"  --dtypes LIST      input dtypes to mix: f32,f16,bf16 (all); half of the\n"
	"                     f16/bf16 jobs get f32 weights\n"
	"  --rows, --cols     sizes: a list (1,7,256) or a range drawn log-uniformly\n"
	"                     (rows 1-256, cols 1-4096)\n"
	"  --inflight K       requests in flight per thread (4)\n"
	"  --mode MODE        completion mode (sync): sync, event (CUDA backend only)\n"
	"                     or enqueue (nc_job_enqueue; norm ops, --inflight <= 64)\n"
	"  --verify FRACTION  fraction of results checked against the float64\n"
	"                     reference (0.01)\n"
	"  --seed S           seed of every random choice (1)\n"
	"  --json FILE        write the summary as JSON too\n"
	"  --kill-rate R      SIGKILL and restart each process R times a second (0)\n"
	"  --bad-rate R       fraction of requests replaced by invalid ones (0)\n"
	"  --timeout MS       longest wait for a reply before it is an error (30000)\n"
	"  --kit-reuse N      jobs per region before it is replaced; 0: never (100)\n"
	"\n"
	"Exit status: 0 if every valid job succeeded and verified and every invalid\n"
	"request got its expected error; 1 otherwise; 2 for usage errors.\n";

static void usage(FILE *f)
{
	fputs(usage_text, f);
}

static bool parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
	char *end;
	if (!s || *s < '0' || *s > '9')
		return false;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || *end || v < lo || v > hi)
		return false;
	*out = v;
	return true;
}

static bool parse_double(const char *s, double lo, double hi, double *out)
{
	char *end;
	errno = 0;
	double v = strtod(s, &end);
	if (errno || end == s || *end || !(v >= lo && v <= hi))
		return false;
	*out = v;
	return true;
}

/* A comma-separated list of names from `table` into out[]. */
static bool parse_names(const char *arg, const struct name_value *table, size_t n, int *out,
			unsigned max, unsigned *count)
{
	char buf[256], *save = NULL;
	if (snprintf(buf, sizeof(buf), "%s", arg) >= (int)sizeof(buf))
		return false;
	*count = 0;
	for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		size_t i = 0;
		while (i < n && strcmp(tok, table[i].name) != 0)
			i++;
		if (i == n || *count == max)
			return false;
		out[(*count)++] = table[i].value;
	}
	return *count > 0;
}

/* "A-B" (a range) or "A,B,C" (a list). */
static bool parse_sizes(const char *arg, struct size_choice *c)
{
	char buf[1024], *save = NULL;
	if (snprintf(buf, sizeof(buf), "%s", arg) >= (int)sizeof(buf))
		return false;
	memset(c, 0, sizeof(*c));
	char *dash = strchr(buf, '-');
	if (dash) {
		*dash = '\0';
		return parse_u64(buf, 1, MAX_SIZE, &c->lo) &&
		       parse_u64(dash + 1, c->lo, MAX_SIZE, &c->hi);
	}
	for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		if (c->count == MAX_LIST || !parse_u64(tok, 1, MAX_SIZE, &c->values[c->count]))
			return false;
		c->count++;
	}
	return c->count > 0;
}

static void options_default(struct stress_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->socket_path = getenv("NORMD_SOCKET") ? getenv("NORMD_SOCKET") : DEFAULT_SOCKET;
	o->procs = o->threads = 1;
	o->inflight = 4;
	for (unsigned i = 0; i < 4; i++)
		o->ops[i] = op_names[i].value;
	o->n_ops = 4;
	for (unsigned i = 0; i < 3; i++)
		o->dtypes[i] = dtype_names[i].value;
	o->n_dtypes = 3;
	o->rows.lo = 1;
	o->rows.hi = 256;
	o->cols.lo = 1;
	o->cols.hi = 4096;
	o->verify = 0.01;
	o->seed = 1;
	o->timeout_ms = 30000;
	o->kit_reuse = 100;
}

static const struct option long_options[] = {
	{"socket", required_argument, NULL, 's'},   {"procs", required_argument, NULL, 'p'},
	{"threads", required_argument, NULL, 't'},  {"jobs", required_argument, NULL, 'j'},
	{"duration", required_argument, NULL, 'd'}, {"ops", required_argument, NULL, 'o'},
	{"dtypes", required_argument, NULL, 'D'},   {"rows", required_argument, NULL, 'r'},
	{"cols", required_argument, NULL, 'c'},	    {"inflight", required_argument, NULL, 'k'},
	{"mode", required_argument, NULL, 'm'},	    {"verify", required_argument, NULL, 'v'},
	{"seed", required_argument, NULL, 'S'},	    {"json", required_argument, NULL, 'J'},
	{"kill-rate", required_argument, NULL, 'K'}, {"bad-rate", required_argument, NULL, 'B'},
	{"timeout", required_argument, NULL, 'T'},  {"kit-reuse", required_argument, NULL, 'R'},
	{"help", no_argument, NULL, 'h'},	    {NULL, 0, NULL, 0},
};

/* One option's value; false if it is malformed or out of bounds. */
static bool parse_one(struct stress_opts *o, int opt, const char *arg)
{
	uint64_t u = 0;
	bool ok = true;
	switch (opt) {
	case 's':
		o->socket_path = arg;
		break;
	case 'p':
		ok = parse_u64(arg, 1, MAX_SLOTS, &u);
		o->procs = (unsigned)u;
		break;
	case 't':
		ok = parse_u64(arg, 1, MAX_SLOTS, &u);
		o->threads = (unsigned)u;
		break;
	case 'j':
		ok = parse_u64(arg, 1, UINT64_MAX / 2, &o->jobs);
		break;
	case 'd':
		ok = parse_double(arg, 0.001, 1e7, &o->duration_s);
		break;
	case 'o':
		ok = parse_names(arg, op_names, sizeof(op_names) / sizeof(op_names[0]), o->ops, 8,
				 &o->n_ops);
		break;
	case 'D':
		ok = parse_names(arg, dtype_names, sizeof(dtype_names) / sizeof(dtype_names[0]),
				 o->dtypes, 8, &o->n_dtypes);
		break;
	case 'r':
		ok = parse_sizes(arg, &o->rows);
		break;
	case 'c':
		ok = parse_sizes(arg, &o->cols);
		break;
	case 'k':
		ok = parse_u64(arg, 1, MAX_INFLIGHT, &u);
		o->inflight = (unsigned)u;
		break;
	case 'm':
		ok = false;
		for (unsigned m = 0; m < sizeof(mode_names) / sizeof(mode_names[0]) && !ok; m++) {
			ok = strcmp(arg, mode_names[m]) == 0;
			o->mode = ok ? (enum stress_mode)m : o->mode;
		}
		break;
	case 'v':
		ok = parse_double(arg, 0, 1, &o->verify);
		break;
	case 'S':
		ok = parse_u64(arg, 0, UINT64_MAX, &o->seed);
		break;
	case 'J':
		o->json_path = arg;
		break;
	case 'K':
		ok = parse_double(arg, 0, 1000, &o->kill_rate);
		break;
	case 'B':
		ok = parse_double(arg, 0, 1, &o->bad_rate);
		break;
	case 'T':
		ok = parse_u64(arg, 1, 3600000, &u);
		o->timeout_ms = (int)u;
		break;
	case 'R':
		ok = parse_u64(arg, 0, UINT32_MAX, &u);
		o->kit_reuse = (unsigned)u;
		break;
	}
	return ok;
}

/*
 * The enqueue mode's limits: nc_job_enqueue runs LayerNorm and RMSNorm only,
 * and each in-flight slot is a stream of its own, up to the library's 64
 * per connection. Returns 0, or 2 after saying what is wrong.
 */
static int enqueue_options_check(const struct stress_opts *o)
{
	for (unsigned i = 0; i < o->n_ops; i++) {
		if (o->ops[i] == NC_WGRAD_ACCUM) {
			fprintf(stderr, "normstress: --mode enqueue runs the norm ops only "
					"(nc_job_enqueue refuses wgrad)\n");
			return 2;
		}
	}
	if (o->inflight > ENQUEUE_MAX_STREAMS) {
		fprintf(stderr,
			"normstress: --mode enqueue takes --inflight up to %d (a stream each)\n",
			ENQUEUE_MAX_STREAMS);
		return 2;
	}
	return 0;
}

/* Returns 0 to run, 1 after --help, 2 for a usage error (already explained). */
static int parse_options(int argc, char **argv, struct stress_opts *o)
{
	int opt, index = 0;
	options_default(o);
	while ((opt = getopt_long(argc, argv, "", long_options, &index)) != -1) {
		if (opt == 'h') {
			usage(stdout);
			return 1;
		}
		if (opt == '?') {
			usage(stderr);
			return 2;
		}
		if (!parse_one(o, opt, optarg)) {
			fprintf(stderr, "normstress: bad value for --%s: %s\n",
				long_options[index].name, optarg);
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "normstress: unexpected argument: %s\n", argv[optind]);
		return 2;
	}
	if (!o->jobs && o->duration_s == 0) {
		fprintf(stderr, "normstress: give --jobs J or --duration S (or both)\n");
		return 2;
	}
	if ((uint64_t)o->procs * o->threads > MAX_SLOTS) {
		fprintf(stderr, "normstress: --procs x --threads must be at most %d\n", MAX_SLOTS);
		return 2;
	}
	return o->mode == MODE_ENQUEUE ? enqueue_options_check(o) : 0;
}

/* ---- time and random numbers ---------------------------------------------------- */

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_ns(uint64_t ns)
{
	struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
	nanosleep(&ts, NULL);
}

/* splitmix64: small, seedable, and every thread gets its own stream. */
static uint64_t rng_next(uint64_t *state)
{
	uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static double rng_unit(uint64_t *state)
{
	return (double)(rng_next(state) >> 11) * 0x1.0p-53;
}

static uint64_t rng_below(uint64_t *state, uint64_t n)
{
	return n ? rng_next(state) % n : 0;
}

static uint64_t size_pick(const struct size_choice *c, uint64_t *state)
{
	if (c->count)
		return c->values[rng_below(state, c->count)];
	/* Log-uniform: every octave of the range is drawn equally often. */
	double lo = log((double)c->lo), hi = log((double)c->hi + 1.0);
	uint64_t v = (uint64_t)exp(lo + (hi - lo) * rng_unit(state));
	return v < c->lo ? c->lo : v > c->hi ? c->hi : v;
}

/* ---- latency histogram ----------------------------------------------------------- */

/*
 * Log-linear buckets over nanoseconds: exact below 64 ns, then 32 buckets per
 * power of two (about 3% resolution), up to ~2^40 ns (18 minutes); anything
 * longer lands in the last bucket. The exact maximum is kept separately.
 */
#define HIST_SUB_BITS 5
#define HIST_SUB (1u << HIST_SUB_BITS)
#define HIST_BUCKETS (2 * HIST_SUB + 34 * HIST_SUB)

static unsigned hist_index(uint64_t ns)
{
	if (ns < 2 * HIST_SUB)
		return (unsigned)ns;
	unsigned msb = 63u - (unsigned)__builtin_clzll(ns);
	unsigned shift = msb - HIST_SUB_BITS;
	uint64_t idx = 2 * HIST_SUB + (uint64_t)(shift - 1) * HIST_SUB + ((ns >> shift) - HIST_SUB);
	return idx < HIST_BUCKETS ? (unsigned)idx : HIST_BUCKETS - 1;
}

/* The largest value that falls into bucket `idx`. */
static uint64_t hist_upper(unsigned idx)
{
	if (idx < 2 * HIST_SUB)
		return idx;
	unsigned shift = (idx - 2 * HIST_SUB) / HIST_SUB + 1;
	uint64_t mantissa = (idx - 2 * HIST_SUB) % HIST_SUB + HIST_SUB;
	return ((mantissa + 1) << shift) - 1;
}

/* ---- counters shared by all processes ----------------------------------------------- */

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

static void slot_add(struct slot *s, enum counter c, uint64_t n)
{
	atomic_fetch_add_explicit(&s->count[c], n, memory_order_relaxed);
}

static unsigned status_slot(int status)
{
	int v = -status;
	if (v >= 0 && v <= 10)
		return (unsigned)v;
	if (v >= 100 && v <= 102)
		return (unsigned)(11 + v - 100);
	return STATUS_SLOTS - 1;
}

static const char *status_slot_name(unsigned i)
{
	if (i <= 10)
		return nc_status_name(-(int)i);
	if (i <= 13)
		return nc_status_name(-(int)(100 + i - 11));
	return "OTHER";
}

static void slot_status(_Atomic uint64_t *by_status, int status)
{
	atomic_fetch_add_explicit(&by_status[status_slot(status)], 1, memory_order_relaxed);
}

static void slot_latency(struct slot *s, uint64_t ns)
{
	atomic_fetch_add_explicit(&s->hist[hist_index(ns)], 1, memory_order_relaxed);
	if (ns > atomic_load_explicit(&s->max_ns, memory_order_relaxed))
		atomic_store_explicit(&s->max_ns, ns, memory_order_relaxed);
}

/* ---- kits: a job's memory, where it lives, and its check ------------------------------ */

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

static bool op_is_backward(int op)
{
	return op == NC_LAYERNORM_BWD || op == NC_RMSNORM_BWD;
}

/* Whether jobkit role `role` is written by `op`. */
static bool role_is_output(int op, int role)
{
	if (op == NC_WGRAD_ACCUM)
		return role == JK_MAIN_GRAD;
	if (op_is_backward(op))
		return role == JK_DX || role == JK_DGAMMA || role == JK_DBETA;
	return role == JK_Y || role == JK_MEAN || role == JK_RSTD;
}

static void kit_random_spec(const struct stress_opts *o, uint64_t *rng, struct jobkit_spec *s)
{
	memset(s, 0, sizeof(*s));
	s->op = (enum nc_op)o->ops[rng_below(rng, o->n_ops)];
	s->rows = size_pick(&o->rows, rng);
	s->cols = size_pick(&o->cols, rng);
	s->dtype = (enum nc_dtype)o->dtypes[rng_below(rng, o->n_dtypes)];
	/* Half-precision inputs get fp32 weights (apex's mixed variants) half the time. */
	if (s->dtype != NC_F32 && (rng_next(rng) & 1))
		s->weight_dtype = NC_F32;
	s->gamma = rng_below(rng, 4) != 0;
	s->beta = s->gamma && (rng_next(rng) & 1);
	/* jobkit drops the backward-only flags on forward ops. */
	s->memory_efficient = rng_next(rng) & 1;
	s->accumulate = rng_below(rng, 4) == 0;
	s->seed = rng_next(rng);
	s->on_device = o->on_device;
	s->device = o->device;
	if (s->op == NC_WGRAD_ACCUM) {
		/* The GEMM costs rows*cols*out: keep it to a few million multiply-adds. */
		s->cols = s->cols > 512 ? 1 + s->cols % 512 : s->cols;
		s->out_features = 1 + rng_below(rng, 64);
		s->accumulate = rng_next(rng) & 1; /* main_grad += (or =) */
		s->memory_efficient = false;
	}
}

static int kit_create(nc_conn *conn, const struct stress_opts *o, uint64_t *rng, struct kit *k)
{
	struct jobkit_spec spec;
	kit_random_spec(o, rng, &spec);
	memset(k, 0, sizeof(*k));
	int rc = jobkit_create(conn, &spec, &k->jk);
	if (rc)
		return rc;
	for (int role = 0; role < ROLES; role++)
		k->bytes += k->jk.bytes[role];
	return 0;
}

/* Frees the kit's region; accepts a kit that was never created. */
static void kit_destroy(struct kit *k)
{
	if (k->expect)
		cudaFree(k->expect);
	jobkit_destroy(&k->jk);
	memset(k, 0, sizeof(*k));
}

/*
 * Makes a kit ready for a job whose result will be verified: accumulated
 * outputs (dgamma/dbeta, main_grad) go back to their initial values (the
 * reference starts from those) and every other output is poisoned (NaN), so
 * an output the daemon failed to write cannot pass with the previous values.
 * Other jobs just accumulate on: the client then does no GPU work of its own
 * between jobs, so the run measures the daemon, not uploads (BENCHMARKS.md).
 */
static void kit_rearm(struct kit *k, bool verify, cudaStream_t stream, bool wait)
{
	struct jobkit *jk = &k->jk;
	bool copied = false;
	for (int role = 0; role < ROLES; role++) {
		if (!jk->ptr[role] || !role_is_output(jk->spec.op, role))
			continue;
		if (!verify)
			continue;
		if (jk->initial[role])
			memcpy(jk->ptr[role], jk->initial[role], jk->bytes[role]);
		else
			memset(jk->ptr[role], 0xff, jk->bytes[role]);
		/* Device kits: the staging copy was reset; the device copy must be too. */
		if (jk->spec.on_device) {
			size_t offset = (size_t)((char *)jk->ptr[role] - (char *)jk->staging);
			cudaMemcpyAsync((char *)jk->device_base + offset, jk->ptr[role],
					jk->bytes[role], cudaMemcpyHostToDevice, stream);
			copied = true;
		}
	}
	/*
	 * A copy from pageable memory may return before its DMA lands: in the
	 * synchronous mode the daemon's kernel must not run first (its outputs
	 * would be overwritten); in the event mode the daemon waits for it.
	 */
	if (copied && wait)
		cudaStreamSynchronize(stream);
}

static bool kit_check(const struct kit *k, struct jobkit_report *report)
{
	return jobkit_check(&k->jk, report);
}

/* "ln_bwd 37x1000 bf16/f32 gamma beta mem_eff acc" */
static void kit_describe(const struct kit *k, char *buf, size_t len)
{
	const struct jobkit_spec *s = &k->jk.spec;
	const char *op = "?";
	for (size_t i = 0; i < sizeof(op_names) / sizeof(op_names[0]); i++) {
		if (op_names[i].value == (int)s->op) {
			op = op_names[i].name;
			break;
		}
	}
	snprintf(buf, len, "%s %llux%llu %s/%s%s%s%s%s", op, (unsigned long long)s->rows,
		 (unsigned long long)s->cols, jobkit_dtype_name(s->dtype),
		 jobkit_dtype_name(s->weight_dtype ? s->weight_dtype : s->dtype),
		 s->gamma ? " gamma" : "", s->beta ? " beta" : "",
		 s->memory_efficient ? " mem_eff" : "", s->accumulate ? " acc" : "");
}

/* ---- a kit's reference outputs on the GPU (enqueue mode, CUDA backend) ---------------- */

/*
 * The enqueue mode checks a verified job on the GPU, in stream order after
 * it (kernels/norm_cuda_check.cu), against the reference outputs computed
 * here once per kit and uploaded as fp32. The rule is jobkit_check()'s: a
 * relative L2 tolerance (1e-5 for fp32 outputs, 1e-2 for 16-bit ones)
 * against the reference's norm, or against the norm of the terms an output
 * sums when cancellation makes that larger (dx, dgamma, dbeta, LayerNorm's
 * mean). jobkit keeps its reference and those norms to itself, so the few
 * lines that compute them are repeated here from jobkit.c.
 */

static enum nk_dtype nk_dtype_from(enum nc_dtype dtype)
{
	return dtype == NC_F16 ? NK_F16 : dtype == NC_BF16 ? NK_BF16 : NK_F32;
}

/* The storage dtype of a tensor role (jobkit's layout: statistics fp32, weights weight_dtype). */
static enum nk_dtype kit_role_dtype(const struct jobkit_spec *s, int role)
{
	if (role == JK_MEAN || role == JK_RSTD)
		return NK_F32;
	if (role == JK_GAMMA || role == JK_BETA || role == JK_DGAMMA || role == JK_DBETA)
		return nk_dtype_from(s->weight_dtype ? s->weight_dtype : s->dtype);
	return nk_dtype_from(s->dtype);
}

static double kit_load(const struct kit *k, int role, uint64_t i)
{
	return nk_load(kit_role_dtype(&k->jk.spec, role), k->jk.ptr[role], i);
}

/* The CPU reference's arguments for the kit's job over the tensors `ptr`. */
static void kit_ref_args(const struct kit *k, void *const ptr[ROLES], struct nk_norm_args *a)
{
	const struct jobkit_spec *s = &k->jk.spec;
	static const enum nk_op nk_ops[] = {
		[NC_LAYERNORM_FWD] = NK_LAYERNORM_FWD, [NC_LAYERNORM_BWD] = NK_LAYERNORM_BWD,
		[NC_RMSNORM_FWD] = NK_RMSNORM_FWD,     [NC_RMSNORM_BWD] = NK_RMSNORM_BWD,
	};
	memset(a, 0, sizeof(*a));
	a->op = nk_ops[s->op]; /* the enqueue mode runs norm ops only */
	a->rows = (int64_t)s->rows;
	a->cols = (int64_t)s->cols;
	a->eps = k->jk.job.eps;
	a->dtype = nk_dtype_from(s->dtype);
	a->weight_dtype = kit_role_dtype(s, JK_GAMMA);
	a->flags = (s->memory_efficient ? NK_MEMORY_EFFICIENT : 0u) |
		   (s->accumulate ? NK_ACCUMULATE : 0u);
	a->x = ptr[JK_X];
	a->y = ptr[JK_Y];
	a->mean = ptr[JK_MEAN];
	a->rstd = ptr[JK_RSTD];
	a->gamma = ptr[JK_GAMMA];
	a->beta = ptr[JK_BETA];
	a->dy = ptr[JK_DY];
	a->dx = ptr[JK_DX];
	a->dgamma = ptr[JK_DGAMMA];
	a->dbeta = ptr[JK_DBETA];
}

/* x_hat of element (r, c), as the backward recomputes it. */
static double kit_x_hat(const struct kit *k, uint64_t r, uint64_t c)
{
	const struct jobkit *jk = &k->jk;
	double in = kit_load(k, JK_X, r * jk->spec.cols + c);
	if (jk->spec.memory_efficient) {
		double g = jk->ptr[JK_GAMMA] ? kit_load(k, JK_GAMMA, c) : 1.0;
		double b = jk->ptr[JK_BETA] ? kit_load(k, JK_BETA, c) : 0.0;
		double eps = jk->job.eps;
		if (jk->ptr[JK_GAMMA] && fabs(g) < eps)
			g = g < 0 ? -eps : eps;
		return (in - b) / g;
	}
	double mean = jk->ptr[JK_MEAN] ? kit_load(k, JK_MEAN, r) : 0.0;
	return (in - mean) * kit_load(k, JK_RSTD, r);
}

/*
 * The squared norm of the terms an output sums (0: it is judged against
 * itself): rstd * dy * gamma for dx, the column sums of |dy * x_hat| and
 * |dy| for dgamma and dbeta, the row means of |x| for LayerNorm's mean.
 */
static double kit_terms_norm2(const struct kit *k, int role)
{
	const struct jobkit_spec *s = &k->jk.spec;
	bool by_rows = role == JK_DX || role == JK_MEAN;
	if (!by_rows && role != JK_DGAMMA && role != JK_DBETA)
		return 0;
	uint64_t outer = by_rows ? s->rows : s->cols, inner = by_rows ? s->cols : s->rows;
	double sum = 0;
	for (uint64_t i = 0; i < outer; i++) {
		double part = 0;
		for (uint64_t j = 0; j < inner; j++) {
			uint64_t r = by_rows ? i : j, c = by_rows ? j : i, at = r * s->cols + c;
			double g = k->jk.ptr[JK_GAMMA] ? kit_load(k, JK_GAMMA, c) : 1.0;
			if (role == JK_DX) {
				double t = kit_load(k, JK_RSTD, r) * g * kit_load(k, JK_DY, at);
				sum += t * t;
			} else if (role == JK_MEAN) {
				part += fabs(kit_load(k, JK_X, at));
			} else {
				double dy = kit_load(k, JK_DY, at);
				part += fabs(role == JK_DBETA ? dy : dy * kit_x_hat(k, r, c));
			}
		}
		part /= role == JK_MEAN ? (double)inner : 1.0;
		sum += part * part;
	}
	return sum;
}

/* Widens one reference output to fp32 at `host` and describes its check. */
static void kit_expect_output(struct kit *k, int role, const void *ref, float *host,
			      struct nk_check_output *check)
{
	const struct jobkit *jk = &k->jk;
	enum nk_dtype dtype = kit_role_dtype(&jk->spec, role);
	size_t n = jk->bytes[role] / nk_dtype_size(dtype);
	double ref2 = 0;
	for (size_t i = 0; i < n; i++) {
		double v = nk_load(dtype, ref, i);
		host[i] = (float)v;
		ref2 += isnan(v) ? 0.0 : v * v;
	}
	double norm2 = ref2 > 0 ? ref2 : 1.0, terms2 = kit_terms_norm2(k, role);
	if (terms2 > ref2 && terms2 > norm2)
		norm2 = terms2;
	size_t offset = (size_t)((const char *)jk->ptr[role] - (const char *)jk->staging);
	*check = (struct nk_check_output){
		.out = (const char *)jk->device_base + offset,
		.n = (int64_t)n,
		.dtype = dtype,
		.rtol = dtype == NK_F32 ? 1e-5f : 1e-2f,
		.ref_norm2 = norm2,
	};
}

/*
 * Computes the kit's reference outputs (from the initial values of the
 * accumulated ones, as kit_rearm() resets them before a verified job),
 * uploads them on `stream`, ahead of the check that reads them there, and
 * fills k->check. Returns 0 or a negative NC_E* code.
 */
static int kit_expect(struct kit *k, cudaStream_t stream)
{
	struct jobkit *jk = &k->jk;
	void *ptr[ROLES], *ref[ROLES] = {0};
	size_t at[ROLES] = {0}, floats = 0;
	float *host = NULL;
	int rc = NC_ENOMEM;
	memcpy(ptr, jk->ptr, sizeof(ptr));
	for (int role = 0; role < ROLES; role++) {
		if (!jk->ptr[role] || !role_is_output(jk->spec.op, role))
			continue;
		if (!(ref[role] = malloc(jk->bytes[role])))
			goto out_free;
		if (jk->initial[role])
			memcpy(ref[role], jk->initial[role], jk->bytes[role]);
		else
			memset(ref[role], 0xff, jk->bytes[role]);
		ptr[role] = ref[role];
		at[role] = floats;
		floats += jk->bytes[role] / nk_dtype_size(kit_role_dtype(&jk->spec, role));
	}
	if (!(host = malloc(floats * sizeof(float))))
		goto out_free;
	struct nk_norm_args a;
	struct nk_cpu_opts opts = {.precision = NK_CPU_REFERENCE, .threads = 2};
	kit_ref_args(k, ptr, &a);
	rc = nk_cpu_norm(&a, &opts, NULL) == NK_OK ? 0 : NC_EINTERNAL;
	k->n_check = 0;
	for (int role = 0; rc == 0 && role < ROLES; role++) {
		if (ref[role])
			kit_expect_output(k, role, ref[role], host + at[role],
					  &k->check[k->n_check++]);
	}
	/* A copy from pageable memory has taken its source once it returns. */
	size_t bytes = floats * sizeof(float);
	if (rc == 0 &&
	    (cudaMalloc((void **)&k->expect, bytes) != cudaSuccess ||
	     cudaMemcpyAsync(k->expect, host, bytes, cudaMemcpyHostToDevice, stream) != cudaSuccess)) {
		cudaGetLastError();
		rc = NC_EDEVICE_ERROR;
	}
	for (int i = 0, role = 0; rc == 0 && role < ROLES; role++) {
		if (ref[role])
			k->check[i++].expect = k->expect + at[role];
	}
out_free:
	if (rc && k->expect) {
		cudaFree(k->expect);
		k->expect = NULL;
	}
	free(host);
	for (int role = 0; role < ROLES; role++)
		free(ref[role]);
	return rc;
}

/* ---- invalid requests ---------------------------------------------------------------- */

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

/*
 * What each kind of invalid request is and the status it must get. In the
 * enqueue mode only the kinds nc_job_enqueue refuses itself are sent: their
 * status is its return value. Beta without gamma passes the library's check
 * and would be refused by the daemon later, an asynchronous error that
 * nc_stream_wait() or nc_conn_check() may report on any job of the
 * connection, so that mode never sends it.
 */
static const struct {
	const char *name;
	int expect;
	bool enqueue_refuses; /* nc_job_enqueue returns `expect` without queueing */
} bad_cases[BAD_KINDS] = {
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
static bool bad_status_ok(enum stress_mode mode, int kind, int rc)
{
	if (rc == bad_cases[kind].expect)
		return true;
	return mode == MODE_ENQUEUE && rc == NC_EINVALID_ARGUMENT &&
	       (kind == BAD_COLS_HUGE || kind == BAD_SHAPE_OVERFLOW);
}

static struct nc_tensor *job_tensor(struct nc_job *job, int role)
{
	struct nc_tensor *const tensors[ROLES] = {
		&job->x,  &job->y,  &job->mean,	  &job->rstd,  &job->gamma,	 &job->beta,
		&job->dy, &job->dx, &job->dgamma, &job->dbeta, &job->main_grad,
	};
	return tensors[role];
}

/* A random role the kit's job uses (x at least). */
static int random_present_role(const struct kit *k, uint64_t *rng)
{
	int start = (int)rng_below(rng, ROLES);
	for (int i = 0; i < ROLES; i++) {
		int role = (start + i) % ROLES;
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
static bool bad_apply(const struct kit *k, uint64_t *rng, int kind, struct nc_job *job)
{
	static const float bad_eps[] = {-1e-5f, -1.0f, INFINITY, NAN};
	bool forward = !op_is_backward(job->op);
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

/* ---- a client thread ------------------------------------------------------------------ */

/* One request in flight. */
struct flight {
	bool active;
	cudaStream_t stream; /* CUDA backend: this slot's uploads (and, event and enqueue, jobs) */
	cudaEvent_t done;    /* event and enqueue modes: recorded on `stream` after the job */
	struct nk_check_scratch *scratch; /* enqueue mode, CUDA: this stream's GPU checks */
	uint64_t request_id;
	unsigned kit;   /* index into the worker's kits */
	int bad_kind;   /* enum bad_kind, or -1 for a valid job */
	bool verify;    /* check the result against the reference */
	uint64_t t0_ns; /* when it was submitted */
};

struct worker {
	const struct stress_opts *opt;
	struct shared *sh;
	struct slot *slot;       /* this thread's counters */
	unsigned proc, thread;
	uint64_t rng;
	nc_conn *conn;
	struct kit *kits;
	unsigned n_kits;         /* more than opt->inflight, so one is always idle */
	struct flight *flights;  /* opt->inflight entries */
	unsigned in_flight;
	unsigned details;        /* failure lines printed so far */
	bool broken;             /* the connection cannot be trusted any more */
	bool running;            /* its thread was started */
	/* Enqueue mode on the CUDA backend, with --verify: */
	struct nk_check_counters *checks; /* device: what the GPU checks found */
	struct nk_check_scratch *scratch; /* device: one per in-flight slot */
	cudaStream_t check_read;          /* reads `checks` back */
	uint64_t mismatches_read;         /* GPU mismatches already counted */
	uint64_t checks_read_ns;          /* when `checks` was read last */
};

/* Prints one failure line (the first few per thread). */
static void worker_say(struct worker *w, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
static void worker_say(struct worker *w, const char *fmt, ...)
{
	char line[512];
	va_list ap;
	if (w->details++ >= DETAIL_LINES)
		return;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	fprintf(stderr, "normstress: process %u thread %u: %s\n", w->proc, w->thread, line);
}

/* Something went wrong that is nobody's intention: a valid job failed, a call broke. */
static void worker_unexpected(struct worker *w, int status)
{
	slot_add(w->slot, C_UNEXPECTED, 1);
	slot_status(w->slot->valid_status, status);
}

static bool worker_claim(struct worker *w)
{
	if (atomic_load_explicit(&w->sh->stop, memory_order_relaxed))
		return false;
	return !w->opt->jobs || atomic_fetch_add(&w->sh->tickets, 1) < w->opt->jobs;
}

static unsigned worker_idle_kit(struct worker *w)
{
	unsigned start = (unsigned)rng_below(&w->rng, w->n_kits);
	for (unsigned i = 0; i < w->n_kits; i++) {
		unsigned k = (start + i) % w->n_kits;
		if (!w->kits[k].busy)
			return k;
	}
	return start; /* not reached: the pool outnumbers the flights */
}

static int worker_new_kit(struct worker *w, struct kit *k)
{
	int rc = kit_create(w->conn, w->opt, &w->rng, k);
	if (rc) {
		worker_unexpected(w, rc);
		worker_say(w, "creating a region: %s: %s", nc_status_name(rc), nc_last_error());
		w->broken = true;
		return rc;
	}
	slot_add(w->slot, C_KITS, 1);
	return 0;
}

/* Replaces a kit that has run its share of jobs (unregister under load, register anew). */
static int worker_refresh_kit(struct worker *w, struct kit *k)
{
	if (!w->opt->kit_reuse || k->uses < w->opt->kit_reuse)
		return 0;
	kit_destroy(k);
	return worker_new_kit(w, k);
}

/* Fills `job` with the request to send on kit `k` and describes it in `f`. */
static void worker_prepare(struct worker *w, struct kit *k, struct flight *f, struct nc_job *job)
{
	*job = k->jk.job;
	f->bad_kind = -1;
	f->verify = false;
	if (w->opt->bad_rate > 0 && rng_unit(&w->rng) < w->opt->bad_rate) {
		int kind = (int)rng_below(&w->rng, BAD_KINDS);
		bool sendable = w->opt->mode != MODE_ENQUEUE || bad_cases[kind].enqueue_refuses;
		if (!sendable || !bad_apply(k, &w->rng, kind, job)) {
			kind = BAD_ROWS;
			bad_apply(k, &w->rng, kind, job);
		}
		f->bad_kind = kind;
		return;
	}
	f->verify = w->opt->verify > 0 && rng_unit(&w->rng) < w->opt->verify;
	/* The event and enqueue modes order the daemon's job after the copies on the GPU. */
	kit_rearm(k, f->verify, f->stream, w->opt->mode == MODE_SYNC);
}

/* Transport failures of nc_job_wait and nc_job_run_event (as opposed to a job's own status). */
static bool wait_failed(int rc)
{
	return rc == NC_EIO || rc == NC_ETIMEOUT || rc == NC_ENOMEM;
}

static void worker_complete(struct worker *w, struct flight *f, int rc,
			    const struct nc_job_result *res);

/* The request of `f` (on kit f->kit) was sent: it is in flight until worker_complete(). */
static void worker_flight_begin(struct worker *w, struct flight *f)
{
	struct kit *k = &w->kits[f->kit];
	f->active = k->busy = true;
	k->uses++;
	w->in_flight++;
	slot_add(w->slot, C_IN_FLIGHT, 1);
	if (f->bad_kind >= 0)
		slot_add(w->slot, C_BAD_SENT, 1);
}

/* Records `f->done` on the slot's stream after what was queued there for the job. */
static void worker_record_done(struct worker *w, struct flight *f)
{
	if (cudaEventRecord(f->done, f->stream) != cudaSuccess) {
		worker_unexpected(w, NC_EDEVICE_ERROR);
		worker_say(w, "cudaEventRecord after a job: %s",
			   cudaGetErrorString(cudaGetLastError()));
		w->broken = true;
	}
}

/* Enqueue mode, a verified job on the CUDA backend: the kit's reference is on the GPU. */
static bool worker_check_ready(struct worker *w, struct flight *f)
{
	struct kit *k = &w->kits[f->kit];
	int rc = k->expect ? 0 : kit_expect(k, f->stream);
	if (rc == 0)
		return true;
	worker_unexpected(w, rc);
	worker_say(w, "computing and uploading a kit's reference: %s", nc_status_name(rc));
	w->broken = true;
	return false;
}

/* Enqueue mode, CUDA backend: the verified job's outputs checked on the GPU, after it. */
static void worker_check_launch(struct worker *w, struct flight *f)
{
	const struct kit *k = &w->kits[f->kit];
	if (nk_cuda_check_outputs(k->check, k->n_check, w->checks, f->scratch, f->stream) == NK_OK)
		return;
	worker_unexpected(w, NC_EDEVICE_ERROR);
	worker_say(w, "launching the output check: %s", nk_cuda_last_error());
	w->broken = true;
}

/*
 * Enqueue mode: the job goes on the slot's stream (CUDA backend) or under
 * the slot's own key, its address (CPU backend); the call returns once the
 * request is sent. Invalid requests are of the kinds the library refuses
 * itself, so their answer is the return value. On the CUDA backend a
 * verified job's check follows it on the stream, then the event that marks
 * the slot free: no CPU waits for the job.
 */
static void worker_enqueue(struct worker *w, struct flight *f, const struct nc_job *job)
{
	bool device = w->opt->on_device;
	if (device && f->verify && !worker_check_ready(w, f))
		return;
	int rc = nc_job_enqueue(w->conn, job, device ? (void *)f->stream : (void *)f);
	if (f->bad_kind >= 0 && rc != NC_OK) {
		struct nc_job_result res = {.status = rc};
		snprintf(res.message, sizeof(res.message), "%s", nc_last_error());
		worker_flight_begin(w, f);
		worker_complete(w, f, rc, &res);
		return;
	}
	if (f->bad_kind >= 0) {
		/* Queued: its refusal would come back later, on whichever call looks first. */
		slot_add(w->slot, C_BAD_SENT, 1);
		slot_add(w->slot, C_UNEXPECTED, 1);
		worker_say(w, "invalid request (%s) was enqueued, not refused",
			   bad_cases[f->bad_kind].name);
		w->broken = true;
		return;
	}
	if (rc != NC_OK) {
		/* Nothing was queued; an earlier job's asynchronous error, or a lost daemon. */
		worker_unexpected(w, rc);
		worker_say(w, "enqueue: %s: %s", nc_status_name(rc), nc_last_error());
		w->broken = rc == NC_EDISCONNECTED || rc == NC_EIO || rc == NC_ENOMEM;
		return;
	}
	worker_flight_begin(w, f);
	if (device && f->verify)
		worker_check_launch(w, f);
	if (device && !w->broken)
		worker_record_done(w, f);
}

static void worker_submit(struct worker *w, struct flight *f)
{
	unsigned index = worker_idle_kit(w);
	struct kit *k = &w->kits[index];
	struct nc_job job;
	if (worker_refresh_kit(w, k))
		return;
	worker_prepare(w, k, f, &job);
	f->kit = index;
	f->t0_ns = now_ns();
	if (w->opt->mode == MODE_ENQUEUE)
		return worker_enqueue(w, f, &job);
	/* The event mode's call returns once the job is queued (or refused). */
	bool events = w->opt->mode == MODE_EVENT;
	struct nc_job_result res;
	int rc = events ? nc_job_run_event(w->conn, &job, f->stream, w->opt->timeout_ms, &res)
			: nc_job_submit(w->conn, &job, &f->request_id);
	if (events ? wait_failed(rc) : rc != NC_OK) {
		worker_unexpected(w, rc);
		worker_say(w, "submit: %s: %s", nc_status_name(rc), nc_last_error());
		w->broken = true;
		return;
	}
	worker_flight_begin(w, f);
	if (!events)
		return;
	if (rc != NC_OK) {
		/* Refused, or queued but its done event unusable: then stop using kits. */
		worker_complete(w, f, rc, &res);
		w->broken = rc == NC_EDEVICE_ERROR;
		return;
	}
	worker_record_done(w, f);
}

static void worker_verify(struct worker *w, const struct kit *k)
{
	struct jobkit_report report;
	char what[128];
	slot_add(w->slot, C_VERIFIED, 1);
	if (kit_check(k, &report))
		return;
	slot_add(w->slot, C_MISMATCHES, 1);
	kit_describe(k, what, sizeof(what));
	worker_say(w, "MISMATCH on %s: %s", what, report.detail);
}

/* An invalid request was answered: it must have the status its fault calls for. */
static void worker_bad_answered(struct worker *w, const struct flight *f, int rc,
				const struct nc_job_result *res)
{
	int expect = bad_cases[f->bad_kind].expect;
	slot_status(w->slot->bad_status, rc);
	if (bad_status_ok(w->opt->mode, f->bad_kind, rc)) {
		slot_add(w->slot, C_BAD_EXPECTED, 1);
		return;
	}
	char what[128];
	slot_add(w->slot, C_UNEXPECTED, 1);
	kit_describe(&w->kits[f->kit], what, sizeof(what));
	worker_say(w, "invalid request (%s) on %s got %s, expected %s: %s",
		   bad_cases[f->bad_kind].name, what, nc_status_name(rc), nc_status_name(expect),
		   rc ? res->message : "it ran");
}

static void worker_complete(struct worker *w, struct flight *f, int rc,
			    const struct nc_job_result *res)
{
	uint64_t ns = now_ns() - f->t0_ns;
	struct kit *k = &w->kits[f->kit];
	f->active = k->busy = false;
	w->in_flight--;
	atomic_fetch_sub_explicit(&w->slot->count[C_IN_FLIGHT], 1, memory_order_relaxed);
	if (f->bad_kind >= 0) {
		worker_bad_answered(w, f, rc, res);
		return;
	}
	if (rc != NC_OK) {
		char what[128];
		worker_unexpected(w, rc);
		kit_describe(k, what, sizeof(what));
		worker_say(w, "valid job %s failed: %s: %s", what, nc_status_name(rc),
			   res->message);
		return;
	}
	slot_add(w->slot, C_JOBS_OK, 1);
	slot_add(w->slot, C_BYTES, k->bytes);
	slot_latency(w->slot, ns);
	if (!f->verify)
		return;
	if (w->checks)
		slot_add(w->slot, C_VERIFIED, 1); /* checked on the GPU; worker_read_checks() */
	else
		worker_verify(w, k);
}

/*
 * Waits for the oldest request in flight, then takes every other reply that
 * has already arrived (without blocking), so a job that overtook the oldest
 * one is counted when it came back rather than when its turn came.
 */
static struct flight *worker_oldest(struct worker *w)
{
	struct flight *oldest = NULL;
	for (unsigned i = 0; i < w->opt->inflight; i++) {
		struct flight *f = &w->flights[i];
		if (f->active && (!oldest || f->t0_ns < oldest->t0_ns))
			oldest = f;
	}
	return oldest;
}

/*
 * Event mode: whether the job of `f` has finished on the GPU, waiting up to
 * `timeout_ms` (0: just look). Polls instead of cudaEventSynchronize so that
 * a daemon that died with the job queued cannot hang the run. Returns 1
 * (done), 0 (not yet) or -1 (a CUDA error, the thread is then broken).
 */
static int worker_event_done(struct worker *w, struct flight *f, int timeout_ms)
{
	uint64_t until = now_ns() + (uint64_t)timeout_ms * 1000000u;
	unsigned polls = 0;
	for (;;) {
		cudaError_t err = cudaEventQuery(f->done);
		if (err == cudaSuccess)
			return 1;
		if (err != cudaErrorNotReady) {
			worker_unexpected(w, NC_EDEVICE_ERROR);
			worker_say(w, "waiting for a job's event: %s", cudaGetErrorString(err));
			w->broken = true;
			return -1;
		}
		if (now_ns() >= until)
			return 0;
		if (++polls > 1000) /* past ~1000 polls, stop burning the core */
			nanosleep(&(struct timespec){.tv_nsec = 20000}, NULL);
	}
}

static void worker_collect_events(struct worker *w)
{
	static const struct nc_job_result ok; /* status NC_OK, no message */
	struct flight *oldest = worker_oldest(w);
	int done = worker_event_done(w, oldest, w->opt->timeout_ms);
	if (done == 0) {
		worker_unexpected(w, NC_ETIMEOUT);
		worker_say(w, "a queued job did not finish within %d ms", w->opt->timeout_ms);
		w->broken = true;
	}
	if (done <= 0)
		return;
	worker_complete(w, oldest, NC_OK, &ok);
	for (unsigned i = 0; i < w->opt->inflight && !w->broken; i++) {
		struct flight *f = &w->flights[i];
		if (f->active && worker_event_done(w, f, 0) == 1)
			worker_complete(w, f, NC_OK, &ok);
	}
}

/*
 * Enqueue mode, CUDA backend: adds the mismatches the GPU checks found
 * since the last read to the counters, at most every CHECK_READ_NS unless
 * `now` (a small copy and a wait for it, not for any job).
 */
static void worker_read_checks(struct worker *w, bool now)
{
	struct nk_check_counters seen;
	uint64_t t = now_ns();
	if (!w->checks || (!now && t < w->checks_read_ns + CHECK_READ_NS))
		return;
	w->checks_read_ns = t;
	if (cudaMemcpyAsync(&seen, w->checks, sizeof(seen), cudaMemcpyDeviceToHost,
			    w->check_read) != cudaSuccess ||
	    cudaStreamSynchronize(w->check_read) != cudaSuccess) {
		worker_unexpected(w, NC_EDEVICE_ERROR);
		worker_say(w, "reading the GPU check counters: %s",
			   cudaGetErrorString(cudaGetLastError()));
		w->broken = true;
		return;
	}
	if (seen.mismatched <= w->mismatches_read)
		return;
	uint64_t found = seen.mismatched - w->mismatches_read;
	w->mismatches_read = seen.mismatched;
	slot_add(w->slot, C_MISMATCHES, found);
	worker_say(w, "MISMATCH: %llu more of the jobs checked on the GPU (%llu so far) were wrong",
		   (unsigned long long)found, (unsigned long long)seen.checks);
}

/*
 * Enqueue mode, CPU backend: waits for the oldest slot's key, then takes
 * every other slot whose key is done. nc_stream_wait() returns once the
 * daemon has also answered every job of the connection, so the first wait
 * usually finds the whole window done. An error it returns may be any
 * enqueued job's (the library keeps the first one for whichever call comes
 * next), so it is counted against the job waited for.
 */
static void worker_wait_key(struct worker *w, struct flight *f, int timeout_ms)
{
	static const struct nc_job_result ok; /* status NC_OK, no message */
	struct nc_job_result failed = {0};
	int rc = nc_stream_wait(w->conn, f, timeout_ms);
	if (rc == NC_ETIMEOUT && timeout_ms == 0)
		return; /* not done yet */
	if (rc == NC_ETIMEOUT || rc == NC_EDISCONNECTED || rc == NC_EIO) {
		worker_unexpected(w, rc);
		worker_say(w, "waiting for an enqueued job: %s: %s", nc_status_name(rc),
			   nc_last_error());
		w->broken = true;
		return;
	}
	failed.status = rc;
	if (rc)
		snprintf(failed.message, sizeof(failed.message), "%s", nc_last_error());
	worker_complete(w, f, rc, rc ? &failed : &ok);
}

static void worker_collect_keys(struct worker *w)
{
	worker_wait_key(w, worker_oldest(w), w->opt->timeout_ms);
	for (unsigned i = 0; i < w->opt->inflight && !w->broken; i++) {
		if (w->flights[i].active)
			worker_wait_key(w, &w->flights[i], 0);
	}
}

static void worker_collect(struct worker *w)
{
	if (w->opt->mode == MODE_ENQUEUE && !w->opt->on_device)
		return worker_collect_keys(w);
	if (w->opt->mode != MODE_SYNC) {
		worker_collect_events(w);
		worker_read_checks(w, false);
		return;
	}
	struct flight *oldest = worker_oldest(w);
	struct nc_job_result res;
	int rc = nc_job_wait(w->conn, oldest->request_id, w->opt->timeout_ms, &res);
	if (wait_failed(rc)) {
		worker_unexpected(w, rc);
		worker_say(w, "waiting for a reply: %s: %s", nc_status_name(rc), res.message);
		w->broken = true;
		return;
	}
	worker_complete(w, oldest, rc, &res);
	for (unsigned i = 0; i < w->opt->inflight && !w->broken; i++) {
		struct flight *f = &w->flights[i];
		if (!f->active)
			continue;
		rc = nc_job_wait(w->conn, f->request_id, 0, &res);
		if (rc == NC_ETIMEOUT)
			continue;
		if (wait_failed(rc)) {
			worker_unexpected(w, rc);
			worker_say(w, "reading replies: %s: %s", nc_status_name(rc), res.message);
			w->broken = true;
			return;
		}
		worker_complete(w, f, rc, &res);
	}
}

static struct flight *worker_free_flight(struct worker *w)
{
	for (unsigned i = 0; i < w->opt->inflight; i++) {
		if (!w->flights[i].active)
			return &w->flights[i];
	}
	return NULL;
}

/* Keeps the window full until the run ends, then drains it. */
static void worker_run(struct worker *w)
{
	for (;;) {
		while (!w->broken && w->in_flight < w->opt->inflight && worker_claim(w))
			worker_submit(w, worker_free_flight(w));
		if (w->broken || w->in_flight == 0)
			return;
		worker_collect(w);
	}
}

/* CUDA backend: a stream for each in-flight slot (and, event mode, its event). */
static void worker_make_streams(struct worker *w)
{
	cudaSetDevice(w->opt->device); /* the kits' GPU, where the daemon runs their jobs */
	for (unsigned i = 0; i < w->opt->inflight && !w->broken; i++) {
		struct flight *f = &w->flights[i];
		if (cudaStreamCreateWithFlags(&f->stream, cudaStreamNonBlocking) != cudaSuccess ||
		    (w->opt->mode != MODE_SYNC &&
		     cudaEventCreateWithFlags(&f->done, cudaEventDisableTiming) != cudaSuccess)) {
			worker_unexpected(w, NC_EDEVICE_ERROR);
			worker_say(w, "creating a stream: %s", cudaGetErrorString(cudaGetLastError()));
			w->broken = true;
		}
	}
}

/* Enqueue mode on the CUDA backend with --verify: the GPU checks' counters and scratch. */
static void worker_make_checks(struct worker *w)
{
	size_t scratch = w->opt->inflight * sizeof(*w->scratch);
	if (cudaMalloc((void **)&w->checks, sizeof(*w->checks)) != cudaSuccess ||
	    cudaMalloc((void **)&w->scratch, scratch) != cudaSuccess ||
	    cudaMemset(w->checks, 0, sizeof(*w->checks)) != cudaSuccess ||
	    cudaMemset(w->scratch, 0, scratch) != cudaSuccess ||
	    cudaStreamCreateWithFlags(&w->check_read, cudaStreamNonBlocking) != cudaSuccess ||
	    cudaDeviceSynchronize() != cudaSuccess) {
		worker_unexpected(w, NC_EDEVICE_ERROR);
		worker_say(w, "allocating the GPU checks: %s",
			   cudaGetErrorString(cudaGetLastError()));
		w->broken = true;
		return;
	}
	for (unsigned i = 0; i < w->opt->inflight; i++)
		w->flights[i].scratch = &w->scratch[i];
}

/*
 * Enqueue mode, at the end: the daemon has answered everything (an error
 * of a job nobody waited for is reported here) and, on the CUDA backend,
 * the last checks are read.
 */
static void worker_finish_enqueue(struct worker *w)
{
	int rc = nc_conn_check(w->conn, w->opt->timeout_ms);
	if (rc != NC_OK) {
		worker_unexpected(w, rc);
		worker_say(w, "nc_conn_check at the end: %s: %s", nc_status_name(rc),
			   nc_last_error());
		w->broken = rc == NC_EDISCONNECTED || rc == NC_ETIMEOUT;
	}
	worker_read_checks(w, true);
}

/* Frees the GPU checks' memory and stream; accepts a worker that made none. */
static void worker_free_checks(struct worker *w)
{
	if (w->check_read)
		cudaStreamDestroy(w->check_read);
	cudaFree(w->checks);
	cudaFree(w->scratch);
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	const struct stress_opts *o = w->opt;
	char name[64];
	snprintf(name, sizeof(name), "normstress-p%u-t%u", w->proc, w->thread);
	int rc = nc_connect(o->socket_path, name, o->timeout_ms, &w->conn);
	if (rc) {
		worker_unexpected(w, rc);
		worker_say(w, "connect: %s", nc_last_error());
		w->broken = true;
		atomic_fetch_add(&w->sh->ready, 1); /* nothing to wait for here */
		return NULL;
	}
	w->n_kits = o->inflight + 2 < 6 ? 6 : o->inflight + 2;
	w->kits = calloc(w->n_kits, sizeof(*w->kits));
	w->flights = calloc(o->inflight, sizeof(*w->flights));
	if (!w->kits || !w->flights) {
		worker_unexpected(w, NC_ENOMEM);
		w->broken = true;
	}
	if (!w->broken && o->on_device)
		worker_make_streams(w);
	if (!w->broken && o->on_device && o->mode == MODE_ENQUEUE && o->verify > 0)
		worker_make_checks(w);
	for (unsigned i = 0; i < w->n_kits && !w->broken; i++)
		worker_new_kit(w, &w->kits[i]);
	/* Set-up (CUDA contexts above all) is not load: wait for every thread. */
	atomic_fetch_add(&w->sh->ready, 1);
	while (!atomic_load(&w->sh->go) && !atomic_load(&w->sh->stop))
		sleep_ns(1000000);
	if (!w->broken)
		worker_run(w);
	if (!w->broken && o->mode == MODE_ENQUEUE)
		worker_finish_enqueue(w);
	/*
	 * A broken connection (a reply that never came, a lost daemon) is left
	 * as it is: the process exits right after, which releases everything.
	 */
	if (w->broken)
		return NULL;
	for (unsigned i = 0; i < w->n_kits; i++)
		kit_destroy(&w->kits[i]);
	for (unsigned i = 0; i < o->inflight; i++) {
		if (w->flights[i].stream)
			cudaStreamDestroy(w->flights[i].stream);
		if (w->flights[i].done)
			cudaEventDestroy(w->flights[i].done);
	}
	worker_free_checks(w);
	nc_close(w->conn);
	free(w->kits);
	free(w->flights);
	return NULL;
}

/* ---- a client process ---------------------------------------------------------------- */

/* Runs in the forked child; its return value is the child's exit status. */
static int child_main(const struct stress_opts *o, struct shared *sh, pid_t parent,
		      unsigned proc, unsigned generation)
{
	/* Die with the parent, and leave SIGINT (a terminal's ^C) to it. */
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
		return 1;
	signal(SIGINT, SIG_IGN);
	signal(SIGTERM, SIG_DFL);
	struct worker *workers = calloc(o->threads, sizeof(*workers));
	pthread_t *tids = calloc(o->threads, sizeof(*tids));
	if (!workers || !tids)
		return 1;
	int status = 0;
	for (unsigned t = 0; t < o->threads; t++) {
		struct worker *w = &workers[t];
		w->opt = o;
		w->sh = sh;
		w->slot = &sh->slots[proc * o->threads + t];
		w->proc = proc;
		w->thread = t;
		w->rng = o->seed ^ (((uint64_t)proc << 40) | ((uint64_t)t << 20) | generation);
		rng_next(&w->rng);
		w->running = pthread_create(&tids[t], NULL, worker_main, w) == 0;
		if (!w->running)
			status = 1;
	}
	for (unsigned t = 0; t < o->threads; t++) {
		if (workers[t].running)
			pthread_join(tids[t], NULL);
		if (workers[t].broken)
			status = 1;
	}
	free(workers);
	free(tids);
	return status;
}

/* ---- the parent: processes, chaos, progress ------------------------------------------- */

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

/* SIGINT/SIGTERM seen: 1 stops the run gently, 2 kills the clients at once. */
static volatile sig_atomic_t interrupted;

static void on_interrupt(int sig)
{
	(void)sig;
	if (interrupted < 2)
		interrupted++;
}

static uint64_t next_kill_time(struct stress *st)
{
	if (st->opt.kill_rate <= 0)
		return UINT64_MAX;
	/* Exponential gaps: kills at random moments, R per second on average. */
	double gap_s = -log(1.0 - rng_unit(&st->rng)) / st->opt.kill_rate;
	return now_ns() + (uint64_t)(gap_s * 1e9);
}

static int child_start(struct stress *st, unsigned proc)
{
	struct child *c = &st->children[proc];
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	if (pid < 0) {
		fprintf(stderr, "normstress: fork: %s\n", strerror(errno));
		st->child_failures++;
		return -1;
	}
	if (pid == 0)
		_exit(child_main(&st->opt, st->sh, st->parent_pid, proc, c->generation));
	c->pid = pid;
	c->generation++;
	c->killed = c->hung = false;
	c->next_kill_ns = next_kill_time(st);
	return 0;
}

/* True once no new requests may start: stop was asked for or --jobs is used up. */
static bool run_over(const struct stress *st)
{
	return st->stopping ||
	       (st->opt.jobs && atomic_load(&st->sh->tickets) >= st->opt.jobs);
}

/* A killed child's requests in flight are lost; count them and clear its slots. */
static void child_count_lost(struct stress *st, unsigned proc)
{
	for (unsigned t = 0; t < st->opt.threads; t++) {
		struct slot *s = &st->sh->slots[proc * st->opt.threads + t];
		st->lost += atomic_exchange(&s->count[C_IN_FLIGHT], 0);
	}
}

static void child_exited(struct stress *st, unsigned proc, int status)
{
	struct child *c = &st->children[proc];
	pid_t pid = c->pid;
	c->pid = 0;
	if (c->killed && !c->hung && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
		st->kills++;
		child_count_lost(st, proc);
		if (!run_over(st))
			child_start(st, proc);
		return;
	}
	if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
		return;
	st->child_failures++;
	if (WIFSIGNALED(status))
		fprintf(stderr, "normstress: client process %u (pid %d) died of signal %d\n", proc,
			(int)pid, WTERMSIG(status));
	else
		fprintf(stderr, "normstress: client process %u (pid %d) exited with status %d\n",
			proc, (int)pid, WEXITSTATUS(status));
}

static void parent_reap(struct stress *st)
{
	int status;
	pid_t pid;
	while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
		for (unsigned p = 0; p < st->opt.procs; p++) {
			if (st->children[p].pid == pid)
				child_exited(st, p, status);
		}
	}
}

static void parent_chaos(struct stress *st, uint64_t now)
{
	for (unsigned p = 0; p < st->opt.procs; p++) {
		struct child *c = &st->children[p];
		if (c->pid > 0 && !c->killed && now >= c->next_kill_ns) {
			kill(c->pid, SIGKILL);
			c->killed = true;
		}
	}
}

/*
 * After stop, children get one reply timeout plus a margin to drain (or
 * until a second SIGINT); then they are killed, which counts as a failure.
 */
static void parent_kill_hung(struct stress *st, uint64_t now)
{
	uint64_t grace = (uint64_t)st->opt.timeout_ms * 1000000ull + 10000000000ull;
	if (!st->stopping || (now < st->t_stop_ns + grace && interrupted < 2))
		return;
	for (unsigned p = 0; p < st->opt.procs; p++) {
		struct child *c = &st->children[p];
		if (c->pid > 0 && !c->hung) {
			fprintf(stderr,
				"normstress: client process %u did not finish; killing it\n", p);
			kill(c->pid, SIGKILL); /* a failure, not chaos */
			c->hung = true;
		}
	}
}

static unsigned children_running(const struct stress *st)
{
	unsigned n = 0;
	for (unsigned p = 0; p < st->opt.procs; p++)
		n += st->children[p].pid > 0;
	return n;
}

static uint64_t next_wakeup(const struct stress *st, uint64_t now)
{
	uint64_t wake = now + TICK_NS;
	for (unsigned p = 0; !st->stopping && p < st->opt.procs; p++) {
		const struct child *c = &st->children[p];
		if (c->pid > 0 && !c->killed && c->next_kill_ns < wake)
			wake = c->next_kill_ns;
	}
	return wake;
}

/* ---- merging and reporting -------------------------------------------------------------- */

struct totals {
	uint64_t count[C_COUNTERS];
	uint64_t valid_status[STATUS_SLOTS];
	uint64_t bad_status[STATUS_SLOTS];
	uint64_t max_ns;
	uint64_t hist[HIST_BUCKETS];
	uint64_t hist_total;
};

static void totals_merge(const struct stress *st, struct totals *t)
{
	memset(t, 0, sizeof(*t));
	for (unsigned i = 0; i < st->opt.procs * st->opt.threads; i++) {
		struct slot *s = &st->sh->slots[i];
		for (int c = 0; c < C_COUNTERS; c++)
			t->count[c] += atomic_load_explicit(&s->count[c], memory_order_relaxed);
		for (int j = 0; j < STATUS_SLOTS; j++) {
			t->valid_status[j] += atomic_load_explicit(&s->valid_status[j],
								   memory_order_relaxed);
			t->bad_status[j] += atomic_load_explicit(&s->bad_status[j],
								 memory_order_relaxed);
		}
		uint64_t max = atomic_load_explicit(&s->max_ns, memory_order_relaxed);
		t->max_ns = max > t->max_ns ? max : t->max_ns;
		for (unsigned b = 0; b < HIST_BUCKETS; b++)
			t->hist[b] += atomic_load_explicit(&s->hist[b], memory_order_relaxed);
	}
	for (unsigned b = 0; b < HIST_BUCKETS; b++)
		t->hist_total += t->hist[b];
}

/* The latency at quantile q in microseconds (bucket upper bound, at most the maximum). */
static double totals_quantile_us(const struct totals *t, double q)
{
	if (!t->hist_total)
		return 0;
	uint64_t rank = (uint64_t)ceil(q * (double)t->hist_total), seen = 0;
	rank = rank < 1 ? 1 : rank;
	for (unsigned b = 0; b < HIST_BUCKETS; b++) {
		seen += t->hist[b];
		if (seen >= rank) {
			uint64_t v = hist_upper(b);
			return (double)(v < t->max_ns ? v : t->max_ns) / 1e3;
		}
	}
	return (double)t->max_ns / 1e3;
}

static void parent_progress(struct stress *st, uint64_t now)
{
	if (!st->tty || now < st->last_progress_ns + PROGRESS_NS)
		return;
	struct totals *t = malloc(sizeof(*t));
	if (!t)
		return;
	totals_merge(st, t);
	double dt = (double)(now - st->last_progress_ns) / 1e9;
	double rate = (double)(t->count[C_JOBS_OK] - st->last_progress_jobs) / dt;
	fprintf(stderr,
		"\r%7.1f s  %llu jobs  %.0f jobs/s  %llu errors  p99 %.3f ms  %u kills\033[K",
		(double)(now - st->t_start_ns) / 1e9, (unsigned long long)t->count[C_JOBS_OK], rate,
		(unsigned long long)(t->count[C_UNEXPECTED] + t->count[C_MISMATCHES]),
		totals_quantile_us(t, 0.99) / 1e3, st->kills);
	st->last_progress_ns = now;
	st->last_progress_jobs = t->count[C_JOBS_OK];
	free(t);
}

/*
 * Starts the clock once every client thread is ready (connected, regions
 * made), or after START_TIMEOUT_NS when some never get there: --duration,
 * jobs/s and the kill schedule then measure load, not start-up.
 */
static void parent_start_clock(struct stress *st, uint64_t now)
{
	if (st->going)
		return;
	unsigned threads = st->opt.procs * st->opt.threads;
	if (atomic_load(&st->sh->ready) < threads && now < st->t_launch_ns + START_TIMEOUT_NS &&
	    !interrupted && st->child_failures == 0)
		return; /* (a client that died setting up will never be ready) */
	st->going = true;
	st->t_start_ns = st->last_progress_ns = now;
	atomic_store(&st->sh->go, true);
}

/* Starts every client, then watches them until the run is over and all are gone. */
static void parent_run(struct stress *st)
{
	st->t_launch_ns = st->t_start_ns = now_ns();
	st->last_progress_ns = st->t_start_ns;
	for (unsigned p = 0; p < st->opt.procs; p++)
		child_start(st, p);
	for (;;) {
		uint64_t now = now_ns();
		parent_start_clock(st, now);
		bool time_up = st->going && st->opt.duration_s > 0 &&
			       now >= st->t_start_ns + (uint64_t)(st->opt.duration_s * 1e9);
		if (!st->stopping && (interrupted || time_up)) {
			st->stopping = true;
			st->t_stop_ns = now;
			atomic_store(&st->sh->stop, true);
		}
		parent_reap(st);
		if (!run_over(st) && st->going)
			parent_chaos(st, now);
		if (children_running(st) == 0)
			break;
		parent_kill_hung(st, now);
		parent_progress(st, now);
		uint64_t wake = next_wakeup(st, now);
		now = now_ns();
		if (wake > now)
			sleep_ns(wake - now);
	}
	st->t_end_ns = now_ns();
	if (st->tty)
		fprintf(stderr, "\r\033[K");
}

/* ---- the daemon's own numbers ------------------------------------------------------------ */

/*
 * Reads the daemon's counters on a fresh connection. With `settle`, first
 * waits (up to 3 s) until the daemon has noticed that the clients are gone:
 * no regions, no jobs, only this connection.
 */
static bool daemon_stats(const struct stress_opts *o, bool settle, struct nc_stats *out)
{
	nc_conn *conn;
	if (nc_connect(o->socket_path, "normstress", 10000, &conn))
		return false;
	int rc = nc_stats_get(conn, 10000, out);
	for (int i = 0; settle && rc == 0 && i < 150; i++) {
		if (out->clients <= 1 && out->regions == 0 && out->jobs_in_flight == 0)
			break;
		sleep_ns(20000000ull);
		rc = nc_stats_get(conn, 10000, out);
	}
	nc_close(conn);
	return rc == 0;
}

/*
 * Connects once before anything starts: the daemon must be there, and must
 * be able to run what was asked. Returns 0, or the exit status to end with.
 */
static int preflight(struct stress *st)
{
	const struct stress_opts *o = &st->opt;
	nc_conn *conn;
	if (nc_connect(o->socket_path, "normstress", 10000, &conn)) {
		fprintf(stderr, "normstress: %s\n", nc_last_error());
		return 1;
	}
	const struct nc_server_info *info = nc_server_info(conn);
	int status = 0;
	snprintf(st->backend, sizeof(st->backend), "%s", info->backend);
	if (strcmp(info->backend, "cpu") == 0 && o->mode == MODE_EVENT) {
		fprintf(stderr, "normstress: --mode event is not supported on the cpu backend "
				"(it orders jobs with CUDA IPC events); use --mode sync\n");
		status = 2;
	} else if (info->max_jobs_in_flight && o->inflight > info->max_jobs_in_flight) {
		fprintf(stderr,
			"normstress: --inflight %u exceeds the daemon's max_jobs_in_flight %u\n",
			o->inflight, info->max_jobs_in_flight);
		status = 2;
	}
	/* On the CUDA backend, kits are device memory on the daemon's first GPU. */
	st->opt.on_device = strcmp(info->backend, "cuda") == 0;
	st->opt.device = info->device_index[0];
	if (status == 0)
		st->have_before = nc_stats_get(conn, 10000, &st->before) == 0;
	nc_close(conn);
	return status;
}

static bool run_passed(const struct stress *st, const struct totals *t)
{
	return t->count[C_UNEXPECTED] == 0 && t->count[C_MISMATCHES] == 0 &&
	       st->child_failures == 0 && st->have_after;
}

static void print_status_map(const uint64_t *by_status)
{
	bool any = false;
	for (unsigned i = 1; i < STATUS_SLOTS; i++) {
		if (!by_status[i])
			continue;
		printf(" %s=%llu", status_slot_name(i), (unsigned long long)by_status[i]);
		any = true;
	}
	printf("%s\n", any ? "" : " none");
}

static void report_text(const struct stress *st, const struct totals *t, double elapsed)
{
	const struct stress_opts *o = &st->opt;
	const uint64_t *n = t->count;
	printf("normstress: %u processes x %u threads, %.1f s, %s backend, mode %s, seed %llu\n",
	       o->procs, o->threads, elapsed, st->backend, mode_names[o->mode],
	       (unsigned long long)o->seed);
	printf("jobs        %llu ok, %.1f jobs/s, %.1f MB/s\n", (unsigned long long)n[C_JOBS_OK],
	       (double)n[C_JOBS_OK] / elapsed, (double)n[C_BYTES] / elapsed / 1e6);
	printf("latency     p50 %.3f ms  p90 %.3f ms  p99 %.3f ms  p99.9 %.3f ms  max %.3f ms\n",
	       totals_quantile_us(t, 0.50) / 1e3, totals_quantile_us(t, 0.90) / 1e3,
	       totals_quantile_us(t, 0.99) / 1e3, totals_quantile_us(t, 0.999) / 1e3,
	       (double)t->max_ns / 1e9 * 1e3);
	printf("verify      %llu checked, %llu mismatches\n", (unsigned long long)n[C_VERIFIED],
	       (unsigned long long)n[C_MISMATCHES]);
	printf("invalid     %llu sent, %llu answered as expected; statuses:",
	       (unsigned long long)n[C_BAD_SENT], (unsigned long long)n[C_BAD_EXPECTED]);
	print_status_map(t->bad_status);
	printf("chaos       %u processes killed, %llu requests lost with them, "
	       "%llu regions created\n",
	       st->kills, (unsigned long long)st->lost, (unsigned long long)n[C_KITS]);
	printf("errors      %llu unexpected, %u client processes failed; valid jobs failed:",
	       (unsigned long long)n[C_UNEXPECTED], st->child_failures);
	print_status_map(t->valid_status);
	if (st->have_after)
		printf("daemon      up; rss %.1f MiB before, %.1f MiB after (%+.1f%%); %u regions, "
		       "%u jobs left\n",
		       (double)st->before.rss_bytes / 1048576.0,
		       (double)st->after.rss_bytes / 1048576.0,
		       st->before.rss_bytes ? 100.0 * ((double)st->after.rss_bytes /
							(double)st->before.rss_bytes - 1.0)
					    : 0.0,
		       st->after.regions, st->after.jobs_in_flight);
	else
		printf("daemon      NOT REACHABLE after the run\n");
	printf("result      %s\n", run_passed(st, t) ? "PASS" : "FAIL");
}

static void json_status_map(FILE *f, const char *key, const uint64_t *by_status)
{
	bool first = true;
	fprintf(f, "\"%s\":{", key);
	for (unsigned i = 1; i < STATUS_SLOTS; i++) {
		if (!by_status[i])
			continue;
		fprintf(f, "%s\"%s\":%llu", first ? "" : ",", status_slot_name(i),
			(unsigned long long)by_status[i]);
		first = false;
	}
	fprintf(f, "}");
}

static void json_body(FILE *f, const struct stress *st, const struct totals *t, double elapsed)
{
	const struct stress_opts *o = &st->opt;
	const uint64_t *n = t->count;
	fprintf(f, "{\"procs\":%u,\"threads\":%u,\"inflight\":%u,\"mode\":\"%s\","
		   "\"backend\":\"%s\",\"seed\":%llu,\"elapsed_s\":%.3f,\"jobs_ok\":%llu,"
		   "\"jobs_per_s\":%.1f,\"bytes\":%llu,\"bytes_per_s\":%.0f,",
		o->procs, o->threads, o->inflight, mode_names[o->mode],
		st->backend, (unsigned long long)o->seed, elapsed, (unsigned long long)n[C_JOBS_OK],
		(double)n[C_JOBS_OK] / elapsed, (unsigned long long)n[C_BYTES],
		(double)n[C_BYTES] / elapsed);
	fprintf(f, "\"latency_us\":{\"p50\":%.1f,\"p90\":%.1f,\"p99\":%.1f,\"p99_9\":%.1f,"
		   "\"max\":%.1f},",
		totals_quantile_us(t, 0.50), totals_quantile_us(t, 0.90),
		totals_quantile_us(t, 0.99), totals_quantile_us(t, 0.999), (double)t->max_ns / 1e3);
	fprintf(f, "\"verified\":%llu,\"mismatches\":%llu,\"bad_sent\":%llu,\"bad_expected\":%llu,",
		(unsigned long long)n[C_VERIFIED], (unsigned long long)n[C_MISMATCHES],
		(unsigned long long)n[C_BAD_SENT], (unsigned long long)n[C_BAD_EXPECTED]);
	json_status_map(f, "bad_by_status", t->bad_status);
	fprintf(f, ",\"unexpected_errors\":%llu,", (unsigned long long)n[C_UNEXPECTED]);
	json_status_map(f, "failed_by_status", t->valid_status);
	fprintf(f, ",\"kills\":%u,\"lost_in_flight\":%llu,\"regions_created\":%llu,"
		   "\"child_failures\":%u,\"daemon_up\":%s,",
		st->kills, (unsigned long long)st->lost, (unsigned long long)n[C_KITS],
		st->child_failures, st->have_after ? "true" : "false");
	fprintf(f, "\"daemon_rss_before\":%llu,\"daemon_rss_after\":%llu,"
		   "\"daemon_regions_after\":%u,\"passed\":%s}\n",
		(unsigned long long)st->before.rss_bytes, (unsigned long long)st->after.rss_bytes,
		st->after.regions, run_passed(st, t) ? "true" : "false");
}

static int report_json(const struct stress *st, const struct totals *t, double elapsed)
{
	FILE *f = fopen(st->opt.json_path, "w");
	if (!f) {
		fprintf(stderr, "normstress: cannot write %s: %s\n", st->opt.json_path,
			strerror(errno));
		return -1;
	}
	json_body(f, st, t, elapsed);
	if (fclose(f) != 0) {
		fprintf(stderr, "normstress: writing %s failed\n", st->opt.json_path);
		return -1;
	}
	return 0;
}

/* ---- main ---------------------------------------------------------------------------------- */

static int stress_setup(struct stress *st)
{
	size_t slots = (size_t)st->opt.procs * st->opt.threads;
	st->sh_bytes = sizeof(struct shared) + slots * sizeof(struct slot);
	st->sh = mmap(NULL, st->sh_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1,
		      0);
	if (st->sh == MAP_FAILED) {
		fprintf(stderr, "normstress: mmap of %zu bytes: %s\n", st->sh_bytes,
			strerror(errno));
		return -1;
	}
	st->children = calloc(st->opt.procs, sizeof(*st->children));
	if (!st->children) {
		fprintf(stderr, "normstress: out of memory\n");
		munmap(st->sh, st->sh_bytes);
		return -1;
	}
	st->parent_pid = getpid();
	st->rng = st->opt.seed ^ 0x5eedf00dull;
	st->tty = isatty(STDERR_FILENO);
	struct sigaction sa = {.sa_handler = on_interrupt};
	sigemptyset(&sa.sa_mask);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);
	return 0;
}

int main(int argc, char **argv)
{
	struct stress st;
	memset(&st, 0, sizeof(st));
	int rc = parse_options(argc, argv, &st.opt);
	if (rc)
		return rc == 1 ? 0 : 2;
	rc = preflight(&st);
	if (rc)
		return rc;
	if (stress_setup(&st))
		return 1;
	parent_run(&st);
	st.have_after = daemon_stats(&st.opt, true, &st.after);
	struct totals *t = malloc(sizeof(*t));
	if (!t) {
		fprintf(stderr, "normstress: out of memory\n");
		return 1;
	}
	totals_merge(&st, t);
	double elapsed = (double)(st.t_end_ns - st.t_start_ns) / 1e9;
	elapsed = elapsed > 1e-3 ? elapsed : 1e-3;
	report_text(&st, t, elapsed);
	bool passed = run_passed(&st, t);
	if (st.opt.json_path && report_json(&st, t, elapsed) != 0)
		passed = false;
	free(t);
	free(st.children);
	munmap(st.sh, st.sh_bytes);
	return passed ? 0 : 1;
}
