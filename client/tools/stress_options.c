/*
 * normstress's command line: the options, their defaults and bounds, and
 * the usage text (stress.h).
 */
#include "client/tools/stress.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const mode_names[3] = {"sync", "event", "enqueue"};

const struct name_value op_names[OP_NAMES] = {
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
	"                  [--kit-reuse N] [--devices LIST|all]\n"
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
	"  --devices LIST|all CUDA backend: the GPUs whose memory the jobs use, taken\n"
	"                     in turn by the processes (0,1 or all: every GPU the\n"
	"                     daemon serves; default: its first)\n"
	"\n"
	"Exit status: 0 if every valid job succeeded and verified and every invalid\n"
	"request got its expected error; 1 otherwise; 2 for usage errors (a GPU\n"
	"--devices names that the daemon does not serve included).\n";

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

/* --devices: "all" (resolved against the daemon's list by preflight) or ordinals "0,1". */
static bool parse_devices(const char *arg, struct stress_opts *o)
{
	char buf[256], *save = NULL;
	uint64_t u;
	o->devices_arg = arg;
	o->n_devices = 0;
	if (strcmp(arg, "all") == 0)
		return true;
	if (snprintf(buf, sizeof(buf), "%s", arg) >= (int)sizeof(buf))
		return false;
	for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		if (o->n_devices == MAX_DEVICES || !parse_u64(tok, 0, 1023, &u))
			return false;
		o->devices[o->n_devices++] = (int)u;
	}
	return o->n_devices > 0;
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
	{"devices", required_argument, NULL, 'G'},  {"help", no_argument, NULL, 'h'},
	{NULL, 0, NULL, 0},
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
	case 'G':
		ok = parse_devices(arg, o);
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
int stress_options_parse(int argc, char **argv, struct stress_opts *o)
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
