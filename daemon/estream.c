/*
 * The enqueue mode: jobs ordered with a caller's stream through a semaphore
 * slot (two 32-bit words in a region of the connection; docs/ENQUEUE.md).
 *
 * An estream is one slot of one connection, created by the first job that
 * names it. Its jobs stay in seq order on its list from arrival to the end:
 *   - backends that order on the device (CUDA) take each job at once; their
 *     launcher threads watch the slot's ready word (host memory) and launch
 *     the job once it is set, followed by writes of done and of a
 *     daemon-private retired word. The backend posts the job once it is
 *     launched (it is answered then), and estream_poll() finishes it once
 *     the retired word says the device is past it;
 *   - other backends (CPU) get one job of a stream at a time, once the loop
 *     sees its ready word; the loop writes done when the job comes back.
 * A refused job still takes its turn: its outputs are poisoned (when its
 * tensors were valid) and its done word written, so the caller's stream is
 * never left waiting. When the client leaves, the daemon stops waiting for
 * ready words it will never get (the backend's stream_abandon, or failing
 * the jobs not yet started) and frees each stream once its jobs are done.
 */
#include "daemon/server.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "daemon/log.h"
#include "proto/frame.h"

#define ESTREAM_MAX_PER_CLIENT 64 /* caller streams a connection may enqueue on */
#define ESTREAM_POLL_MS 1         /* how often waiting streams are looked at */
/*
 * How often the polling loop reaps device-ordered streams: a reap reads
 * every busy stream's retired word, which the GPU writes (a cache miss
 * each), and only releases what the device is done with, which can wait.
 */
#define ESTREAM_REAP_NS 20000

static void estream_timer_cb(uv_timer_t *timer);

static void estream_busy_add(struct estream *es)
{
	struct server *srv = es->client->srv;
	if (es->busy)
		return;
	es->busy = true;
	es->busy_prev = NULL;
	es->busy_next = srv->busy_estreams;
	if (srv->busy_estreams)
		srv->busy_estreams->busy_prev = es;
	srv->busy_estreams = es;
	if (!uv_is_active((uv_handle_t *)&srv->estream_timer) && !srv->stopped)
		uv_timer_start(&srv->estream_timer, estream_timer_cb, ESTREAM_POLL_MS,
			       ESTREAM_POLL_MS);
}

static void estream_busy_remove(struct estream *es)
{
	struct server *srv = es->client->srv;
	if (!es->busy)
		return;
	es->busy = false;
	if (es->busy_prev)
		es->busy_prev->busy_next = es->busy_next;
	else
		srv->busy_estreams = es->busy_next;
	if (es->busy_next)
		es->busy_next->busy_prev = es->busy_prev;
	if (!srv->busy_estreams)
		uv_timer_stop(&srv->estream_timer);
}

/* Frees a stream without jobs whose client is gone. */
static void estream_close(struct estream *es)
{
	struct client *c = es->client;
	struct backend *backend = c->srv->backend;
	estream_busy_remove(es);
	for (struct estream **p = &c->estreams; *p; p = &(*p)->next) {
		if (*p == es) {
			*p = es->next;
			break;
		}
	}
	c->estream_count--;
	if (backend && backend->stream_close)
		backend->stream_close(backend, es);
	region_unref(es->sem);
	region_unref(es->done_region);
	nc__free(es);
}

/* The word `region` + `offset` names, `align`-aligned and 4 bytes inside; NULL and `why` if not. */
static struct region *estream_word(struct client *c, uint64_t region_id, uint64_t offset,
				   uint64_t align, const char *what, char *why, size_t why_len)
{
	struct region *r = region_lookup(&c->regions, region_id);
	if (!r) {
		snprintf(why, why_len, "enqueue: %s region %llu is not registered on this "
			 "connection", what, (unsigned long long)region_id);
		return NULL;
	}
	if (offset % align != 0 || offset > r->size || r->size - offset < 4) {
		snprintf(why, why_len, "enqueue: %s offset %llu is not a %llu-byte aligned word "
			 "inside region %llu (%llu bytes)", what, (unsigned long long)offset,
			 (unsigned long long)align, (unsigned long long)region_id,
			 (unsigned long long)r->size);
		return NULL;
	}
	return r;
}

/*
 * A slot's first job that no estream takes: nothing of the slot runs here,
 * so the caller's wait for `seq` is released now, by the daemon's CPU where
 * the done word is in host memory, else by closing the connection (the
 * library releases its streams then).
 */
static void estream_refuse_first(struct client *c, const struct region *done, void *done_word,
				 uint32_t seq)
{
	if (done->device < 0)
		atomic_store_explicit((_Atomic uint32_t *)done_word, seq, memory_order_release);
	else
		c->close_after_flush = true;
}

/* The device whose streams a new slot orders, or -2 with a reason (-1: the CPU backend's). */
static int estream_device(const struct client *c, const struct region *done,
			  const Normd__Enqueue *msg, char *why, size_t why_len)
{
	if (c->srv->backend->kind != NORMD__BACKEND_KIND__BACKEND_CUDA)
		return -1; /* one device, and Enqueue.device means nothing to it */
	if (done->device >= 0 && msg->has_device && msg->device != done->device) {
		snprintf(why, why_len, "enqueue: device %d named, but the done word is on device %d",
			 msg->device, done->device);
		return -2;
	}
	if (done->device >= 0)
		return done->device;
	if (!msg->has_device || msg->device < 0) {
		snprintf(why, why_len, "enqueue: a done word in host memory needs the slot's device "
			 "(Enqueue.device)");
		return -2;
	}
	return msg->device;
}

int estream_for_job(struct client *c, const Normd__Enqueue *msg, struct estream **out, char *why,
		    size_t why_len)
{
	struct backend *backend = c->srv->backend;
	uint64_t done_region = msg->has_done_region ? msg->done_region : msg->sem_region;
	uint64_t done_offset = msg->has_done_offset ? msg->done_offset
						    : msg->sem_offset + ESTREAM_DONE_OFFSET;
	struct region *sem = estream_word(c, msg->sem_region, msg->sem_offset, ESTREAM_SLOT_BYTES,
					  "ready", why, why_len);
	struct region *done = sem ? estream_word(c, done_region, done_offset, ESTREAM_DONE_OFFSET,
						 "done", why, why_len)
				  : NULL;
	if (!sem || !done)
		return NC_EOUT_OF_RANGE;
	void *done_word = (char *)done->base + done_offset;
	for (struct estream *es = c->estreams; es; es = es->next) {
		if (es->sem != sem || es->offset != msg->sem_offset)
			continue;
		if (es->done != done_word) {
			snprintf(why, why_len, "enqueue: the slot's done word moved");
			return NC_EINVALID_ARGUMENT;
		}
		if (!seq_reached(msg->seq, es->last_seq + 1)) {
			snprintf(why, why_len, "enqueue: seq %u does not follow %u on this slot",
				 msg->seq, es->last_seq);
			return NC_EINVALID_ARGUMENT;
		}
		*out = es;
		return 0;
	}
	int rc = 0;
	int device = estream_device(c, done, msg, why, why_len);
	struct estream *es = NULL;
	if (device == -2) {
		rc = NC_EINVALID_ARGUMENT;
	} else if (c->estream_count >= ESTREAM_MAX_PER_CLIENT) {
		snprintf(why, why_len, "enqueue: more than %d semaphore slots on one connection",
			 ESTREAM_MAX_PER_CLIENT);
		rc = NC_ERESOURCE_EXHAUSTED;
	} else if (!(es = nc__calloc(1, sizeof(*es)))) {
		snprintf(why, why_len, "out of memory for an enqueue stream");
		rc = NC_ERESOURCE_EXHAUSTED;
	}
	if (rc) {
		estream_refuse_first(c, done, done_word, msg->seq);
		return rc;
	}
	es->client = c;
	es->region_id = msg->sem_region;
	es->offset = msg->sem_offset;
	es->sem = sem;
	es->done_region = done;
	es->ready = (char *)sem->base + msg->sem_offset;
	es->done = done_word;
	es->device = device;
	es->last_seq = msg->seq - 1;
	rc = backend->stream_open ? backend->stream_open(backend, es, why, why_len) : 0;
	if (rc) {
		nc__free(es);
		estream_refuse_first(c, done, done_word, msg->seq);
		return rc;
	}
	region_ref(sem);
	region_ref(done);
	es->next = c->estreams;
	c->estreams = es;
	c->estream_count++;
	*out = es;
	return 0;
}

void estream_poison_host(const struct job *job)
{
	struct job_output out[JOB_MAX_OUTPUTS];
	unsigned n = job->bound ? job_outputs(job, out) : 0;
	for (unsigned i = 0; i < n; i++)
		memset(out[i].ptr, 0xff, (size_t)out[i].bytes);
}

/* The job at the head of its stream is over: count it, release it. True if `es` was freed. */
static bool estream_retire(struct job *job)
{
	struct estream *es = job->estream;
	struct client *c = es->client;
	struct server *srv = c->srv;
	es->head = job->es_next;
	if (!es->head)
		es->tail = NULL;
	stats_count_job(srv, job, job->t_start_ns != 0);
	bool was_paused = client_input_paused(c);
	c->jobs_in_flight--;
	srv->jobs_in_flight--;
	job_release(job);
	if (was_paused && !client_input_paused(c) && !c->closing)
		client_resume(c);
	bool freed = !es->head && c->closing;
	if (freed)
		estream_close(es);
	if (srv->draining)
		server_drain_check(srv);
	return freed;
}

/* Loop-ordered backends: the done word is the loop's to write. True if `es` was freed. */
static bool estream_finish_on_loop(struct job *job)
{
	struct estream *es = job->estream;
	if (job->status != NC_OK)
		estream_poison_host(job);
	atomic_store_explicit((_Atomic uint32_t *)es->done, job->seq, memory_order_release);
	if (!es->client->closing)
		reply_job(es->client, job);
	if (es->running == job)
		es->running = NULL;
	return estream_retire(job);
}

/* Loop-ordered backends: hands over the next job once its ready word is set. */
static void estream_pump(struct estream *es)
{
	struct server *srv = es->client->srv;
	while (!es->running && es->head) {
		struct job *job = es->head;
		uint32_t ready =
			atomic_load_explicit((_Atomic uint32_t *)es->ready, memory_order_acquire);
		if (job->status == NC_OK && es->abandoned) {
			job->status = NC_ESHUTTING_DOWN;
			snprintf(job->message, sizeof(job->message), "the client disconnected");
		}
		if (job->status == NC_OK && !seq_reached(ready, job->seq)) {
			estream_busy_add(es); /* look again on the timer */
			return;
		}
		if (job->status == NC_OK) {
			es->running = job;
			job->status = srv->backend->submit(srv->backend, job);
			if (job->status == NC_OK) {
				server_job_started(srv, 0);
				break;
			}
		}
		if (estream_finish_on_loop(job))
			return; /* freed with its last job */
	}
	estream_busy_remove(es);
}

void estream_push(struct estream *es, struct job *job)
{
	struct client *c = es->client;
	struct server *srv = c->srv;
	struct backend *backend = srv->backend;
	es->last_seq = job->seq;
	job->es_next = NULL;
	if (es->tail)
		es->tail->es_next = job;
	else
		es->head = job;
	es->tail = job;
	c->jobs_in_flight++;
	srv->jobs_in_flight++;
	if (!backend->orders_streams) {
		estream_pump(es);
		return;
	}
	int status = backend->submit(backend, job);
	if (status != NC_OK) {
		/* The device is gone: nothing can write done any more. */
		job->status = status;
		job->launched = true;
		reply_job(c, job);
		estream_busy_add(es);
		return;
	}
	server_job_started(srv, job->t_arrive_ns);
}

void estream_job_done(struct job *job)
{
	struct estream *es = job->estream;
	if (!es->client->srv->backend->orders_streams) {
		if (!estream_finish_on_loop(job))
			estream_pump(es);
		return;
	}
	/* Queued on the device: answer now, finish once the device is past it. */
	job->launched = true;
	if (!es->client->closing)
		reply_job(es->client, job);
	estream_busy_add(es);
}

/* Device-ordered backends: finishes the jobs the device is past. */
static void estream_reap(struct backend *backend, struct estream *es)
{
	if (!es->head || !es->head->launched)
		return; /* nothing to reap: spare the read of a word the device writes */
	uint32_t retired = backend->stream_retired(backend, es);
	while (es->head && es->head->launched && seq_reached(retired, es->head->seq)) {
		struct job *job = es->head;
		if (estream_retire(job))
			return; /* freed with its last job */
		if (!es->head) {
			estream_busy_remove(es);
			return;
		}
	}
}

void estream_poll(struct server *srv)
{
	struct backend *backend = srv->backend;
	struct estream *es = srv->busy_estreams;
	while (es) {
		struct estream *next = es->busy_next;
		if (backend && backend->orders_streams)
			estream_reap(backend, es);
		else if (backend)
			estream_pump(es);
		es = next;
	}
}

bool estream_poll_due(struct server *srv)
{
	if (!srv->backend || !srv->backend->orders_streams)
		return true; /* streams wait for ready words: look every time */
	uint64_t now = stats_now_ns();
	if (now - srv->estream_reaped_ns < ESTREAM_REAP_NS)
		return false;
	srv->estream_reaped_ns = now;
	return true;
}

static void estream_timer_cb(uv_timer_t *timer)
{
	estream_poll(timer->data);
}

void estream_abandon_all(struct client *c)
{
	struct backend *backend = c->srv->backend;
	struct estream *es = c->estreams;
	while (es) {
		struct estream *next = es->next;
		es->abandoned = true;
		if (!es->head)
			estream_close(es);
		else if (backend && backend->orders_streams && backend->stream_abandon)
			backend->stream_abandon(backend, es);
		else if (backend)
			estream_pump(es);
		es = next;
	}
}
