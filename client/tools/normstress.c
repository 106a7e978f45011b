/*
 * normstress: load-test a running normd through libnormclient, with chaos.
 *
 *   normstress --socket PATH --procs N --threads T (--jobs J | --duration S)
 *              [--ops ln_fwd,ln_bwd,rms_fwd,rms_bwd] [--dtypes f32,f16,bf16]
 *              [--rows LIST|MIN-MAX] [--cols LIST|MIN-MAX] [--inflight K]
 *              [--mode sync|event|enqueue] [--verify FRACTION] [--seed S] [--json FILE]
 *              [--kill-rate R] [--bad-rate R] [--timeout MS] [--kit-reuse N]
 *              [--devices LIST|all]
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
 * is unreachable); 2 for a bad command line, a mode the daemon cannot run, or
 * --devices naming a GPU it does not serve.
 *
 * --mode event (ordering with CUDA IPC events) and CUDA regions belong to the
 * CUDA backend; on the CPU backend --mode sync and enqueue run. The kit_*()
 * functions are the one place that knows where a kit's memory lives.
 *
 * This file is the engine: the parent process, which starts the clients,
 * brings chaos, shows progress, reads the daemon's numbers and decides the
 * result. The parts it drives (options, counters, kits, invalid requests,
 * the client threads, the summary) are client/tools/stress_*.c, declared
 * in stress.h.
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
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/tools/stress.h"

#define START_TIMEOUT_NS 120000000000ull /* longest wait for every client to be ready */
#define PROGRESS_NS 500000000ull  /* progress line refresh */
#define TICK_NS 10000000ull       /* the parent's polling period */

/* ---- the parent: processes, chaos, progress ------------------------------------------- */

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
		_exit(worker_process_main(&st->opt, st->sh, st->parent_pid, proc, c->generation));
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
 * On the CUDA backend kits are device memory: on the daemon's first GPU, or
 * on the GPUs --devices names, which must be ones the daemon serves ("all":
 * every one). Returns 0, or 2 after saying what is wrong.
 */
static int devices_resolve(struct stress_opts *o, const struct nc_server_info *info)
{
	unsigned served = info->device_count < MAX_DEVICES ? info->device_count : MAX_DEVICES;
	if (o->devices_arg && !o->on_device) {
		fprintf(stderr,
			"normstress: --devices needs the cuda backend; the daemon runs %s\n",
			info->backend);
		return 2;
	}
	if (!o->devices_arg) {
		o->devices[0] = o->device = info->device_index[0];
		o->n_devices = 1;
		return 0;
	}
	if (strcmp(o->devices_arg, "all") == 0) {
		for (unsigned i = 0; i < served; i++)
			o->devices[i] = info->device_index[i];
		o->n_devices = served;
	}
	for (unsigned i = 0; i < o->n_devices; i++) {
		bool listed = false;
		for (unsigned j = 0; j < served && !listed; j++)
			listed = info->device_index[j] == o->devices[i];
		if (!listed) {
			fprintf(stderr, "normstress: --devices names GPU %d, which the daemon does "
					"not serve\n", o->devices[i]);
			return 2;
		}
	}
	if (o->n_devices == 0) {
		fprintf(stderr, "normstress: --devices all: the daemon lists no GPU\n");
		return 2;
	}
	o->device = o->devices[0];
	return 0;
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
	st->opt.on_device = strcmp(info->backend, "cuda") == 0;
	if (status == 0)
		status = devices_resolve(&st->opt, info);
	if (status == 0)
		st->have_before = nc_stats_get(conn, 10000, &st->before) == 0;
	nc_close(conn);
	return status;
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
	int rc = stress_options_parse(argc, argv, &st.opt);
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
