/*
 * A normstress client: a process forked by the parent runs T threads, each
 * with its own connection and pool of kits, keeping K requests in flight in
 * the chosen completion mode until the parent says stop (stress.h).
 */
#include "client/tools/stress.h"

#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#define DETAIL_LINES 5            /* failure descriptions each thread prints */
#define CHECK_READ_NS 100000000ull /* enqueue mode, CUDA: GPU check counters read period */

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
	const struct nc_job_ext *ext = &w->kits[f->kit].jk.ext;
	int rc = nc_job_enqueue_ext(w->conn, job, ext, device ? (void *)f->stream : (void *)f);
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
	int rc = events ? nc_job_run_event_ext(w->conn, &job, &k->jk.ext, f->stream,
					       w->opt->timeout_ms, &res)
			: nc_job_submit_ext(w->conn, &job, &k->jk.ext, &f->request_id);
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

/*
 * Enqueue mode, after a queued job timed out: whether the daemon answered
 * (launched) every job of the connection tells a job it never saw ready
 * from one the GPU never finished. An asynchronous job error that comes
 * back instead is an unexpected error of its own.
 */
static void worker_say_answered(struct worker *w)
{
	int rc = nc_conn_check(w->conn, 1000);
	if (rc == NC_OK || rc == NC_ETIMEOUT) {
		worker_say(w, "every job of the connection answered by the daemon: %s",
			   rc == NC_OK ? "yes (the GPU did not finish it)" : "no");
		return;
	}
	worker_unexpected(w, rc);
	worker_say(w, "and an earlier job failed: %s: %s", nc_status_name(rc), nc_last_error());
}

static void worker_collect_events(struct worker *w)
{
	static const struct nc_job_result ok; /* status NC_OK, no message */
	struct flight *oldest = worker_oldest(w);
	int done = worker_event_done(w, oldest, w->opt->timeout_ms);
	if (done == 0) {
		const struct jobkit_spec *sp = &w->kits[oldest->kit].jk.spec;
		worker_unexpected(w, NC_ETIMEOUT);
		worker_say(w, "a queued job did not finish within %d ms (%s %llux%llu %s%s)",
			   w->opt->timeout_ms, jobkit_op_name(sp->op), (unsigned long long)sp->rows,
			   (unsigned long long)sp->cols, jobkit_dtype_name(sp->dtype),
			   oldest->verify ? ", verified" : "");
		if (w->opt->mode == MODE_ENQUEUE)
			worker_say_answered(w);
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
	/* A lost daemon's jobs never ran; the library released their streams, so their checks ran. */
	int alive = nc_ping(w->conn, w->opt->timeout_ms);
	if (alive == NC_EDISCONNECTED || alive == NC_EIO) {
		worker_say(w, "%llu more GPU checks failed after the daemon was lost: outputs of jobs "
			   "it may never have run (not counted as mismatches)",
			   (unsigned long long)found);
		return;
	}
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

/* ---- the process ------------------------------------------------------------------------ */

/* Runs in the forked child; its return value is the child's exit status. */
int worker_process_main(const struct stress_opts *all, struct shared *sh, pid_t parent,
			unsigned proc, unsigned generation)
{
	/* This process's GPU: the processes take the --devices in turn. */
	struct stress_opts mine = *all;
	const struct stress_opts *o = &mine;
	if (all->n_devices)
		mine.device = all->devices[proc % all->n_devices];
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
