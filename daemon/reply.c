/*
 * Every message the daemon sends goes through these helpers: they build the
 * envelope, pack it into a frame, count the status and queue the frame on
 * the client. A reply that cannot be built (out of memory) closes the
 * connection rather than leave the client waiting forever.
 */
#include "daemon/server.h"

#include <malloc.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "daemon/log.h"
#include "normd_version.h"
#include "proto/frame.h"

static void reply_send(struct client *c, Normd__Envelope *env)
{
	uint8_t *frame;
	size_t len;
	if (c->closing)
		return;
	/* A small reply is packed where it waits to be written with the others (client.c). */
	size_t body = protobuf_c_message_get_packed_size(&env->base);
	uint8_t *room = client_defer_room(c, NC__FRAME_HEADER_BYTES + body);
	if (room) {
		nc__frame_pack_into(env, body, room);
		return;
	}
	if (c->closing)
		return;
	/* Replies may exceed the client's frame limit only by our own mistake. */
	int rc = nc__frame_pack(env, UINT32_MAX, &frame, &len);
	if (rc) {
		log_warn("event=alloc_failed client=%llu pid=%d what=reply "
			 "reason=\"out of memory packing a reply; closing\"",
			 (unsigned long long)c->id, (int)c->pid);
		client_close(c, "out of memory packing a reply");
		return;
	}
	client_send(c, frame, len);
}

void reply_result(struct client *c, uint64_t request_id, int status, const char *fmt, ...)
{
	char message[256] = "";
	if (fmt) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(message, sizeof(message), fmt, ap);
		va_end(ap);
	}
	if (status != NC_OK)
		log_debug("event=refused client=%llu request=%llu status=%s message=\"%s\"",
			  (unsigned long long)c->id, (unsigned long long)request_id,
			  nc_status_name(status), message);
	stats_count_status(c->srv, status);
	Normd__Result result = NORMD__RESULT__INIT;
	result.status = nc__status_to_wire(status);
	result.message = message;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = request_id;
	env.body_case = NORMD__ENVELOPE__BODY_RESULT;
	env.result = &result;
	reply_send(c, &env);
}

/* The configured limits, as HelloReply and StatsReply carry them. */
static void reply_fill_limits(const struct config *cfg, Normd__Limits *limits)
{
	normd__limits__init(limits);
	limits->has_max_frame = limits->has_max_regions = limits->has_max_mapped_bytes = true;
	limits->has_max_jobs_in_flight = limits->has_max_cols = true;
	limits->has_max_clients = limits->has_max_output_bytes = true;
	limits->max_frame = (uint32_t)cfg->max_frame;
	limits->max_regions = (uint32_t)cfg->max_regions;
	limits->max_mapped_bytes = cfg->max_mapped_bytes;
	limits->max_jobs_in_flight = (uint32_t)cfg->max_jobs_in_flight;
	limits->max_cols = cfg->max_cols;
	limits->max_clients = (uint32_t)cfg->max_clients;
	limits->max_output_bytes = cfg->max_output_bytes;
}

void reply_hello(struct client *c, uint64_t request_id)
{
	Normd__Limits limits;
	reply_fill_limits(c->srv->cfg, &limits);

	const struct backend *backend = c->srv->backend;
	Normd__Device devices[backend->device_count];
	Normd__Device *device_ptrs[backend->device_count];
	for (int i = 0; i < backend->device_count; i++) {
		const struct backend_device *d = &backend->devices[i];
		normd__device__init(&devices[i]);
		devices[i].index = d->index;
		devices[i].name = (char *)d->name;
		if (d->index >= 0) {
			devices[i].has_uuid = devices[i].has_sm_count = true;
			devices[i].has_total_memory = true;
			devices[i].uuid.data = (uint8_t *)d->uuid;
			devices[i].uuid.len = sizeof(d->uuid);
			devices[i].sm_count = d->sm_count;
			devices[i].total_memory = d->total_memory;
		}
		device_ptrs[i] = &devices[i];
	}

	Normd__HelloReply hello = NORMD__HELLO_REPLY__INIT;
	hello.status = NORMD__STATUS__OK;
	hello.server_version = NORMD_VERSION;
	hello.has_protocol_version = hello.has_backend = hello.has_server_pid = true;
	hello.protocol_version = NORMD__PROTOCOL_VERSION__PROTOCOL_VERSION;
	hello.backend = backend->kind;
	hello.n_devices = (size_t)backend->device_count;
	hello.devices = device_ptrs;
	hello.limits = &limits;
	hello.server_pid = (uint32_t)getpid();
	hello.has_mps = backend->kind == NORMD__BACKEND_KIND__BACKEND_CUDA;
	hello.mps = backend->mps;
	hello.has_norm_features = true;
	hello.norm_features = backend->norm_features;

	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = request_id;
	env.body_case = NORMD__ENVELOPE__BODY_HELLO_REPLY;
	env.hello_reply = &hello;
	stats_count_status(c->srv, NC_OK);
	reply_send(c, &env);
}

void reply_job(struct client *c, const struct job *job)
{
	Normd__JobReply reply = NORMD__JOB_REPLY__INIT;
	reply.status = nc__status_to_wire(job->status);
	reply.message = (char *)job->message;
	if (job->variant[0])
		reply.variant = (char *)job->variant;
	if (job->t_start_ns) {
		reply.has_device_us = reply.has_queue_us = true;
		reply.device_us = (job->t_end_ns - job->t_start_ns) / 1000;
		reply.queue_us = (job->t_start_ns - job->t_arrive_ns) / 1000;
	}
	if (job->notice) {
		reply.has_done_event = true;
		reply.done_event.data = (uint8_t *)job->done_event;
		reply.done_event.len = sizeof(job->done_event);
	}
	if (job->args.flags & NK_MEMORY_EFFICIENT) {
		reply.has_clamped_cols = true;
		reply.clamped_cols = job->clamped_cols;
	}
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = job->request_id;
	env.body_case = NORMD__ENVELOPE__BODY_JOB_REPLY;
	env.job_reply = &reply;
	stats_count_status(c->srv, job->status);
	reply_send(c, &env);
}

/* Resident set size of this process, from /proc. */
static uint64_t reply_rss_bytes(void)
{
	FILE *f = fopen("/proc/self/statm", "r");
	unsigned long long pages_total = 0, pages_rss = 0;
	if (!f)
		return 0;
	if (fscanf(f, "%llu %llu", &pages_total, &pages_rss) != 2)
		pages_rss = 0;
	fclose(f);
	return pages_rss * (uint64_t)sysconf(_SC_PAGESIZE);
}

/*
 * Bytes malloc has handed out and not had back, every arena: unlike the RSS,
 * it does not keep a peak's arena pages, so it returns to its level after a
 * load unless something leaked.
 */
#if defined(__GLIBC__)
#if __GLIBC_PREREQ(2, 33)
#define HAVE_MALLINFO2 1
#endif
#endif
static uint64_t reply_heap_bytes(void)
{
#ifdef HAVE_MALLINFO2
	struct mallinfo2 m = mallinfo2();
	return (uint64_t)m.uordblks + (uint64_t)m.hblkhd;
#else
	return 0; /* not reported */
#endif
}

void reply_stats(struct client *c, uint64_t request_id)
{
	struct server *srv = c->srv;
	Normd__StatsReply stats = NORMD__STATS_REPLY__INIT;
	stats.has_uptime_ms = stats.has_clients = stats.has_clients_total = true;
	stats.has_jobs_ok = stats.has_jobs_failed = stats.has_jobs_in_flight = true;
	stats.has_regions = stats.has_mapped_bytes = stats.has_rss_bytes = true;
	stats.has_bytes_processed = true;
	stats.uptime_ms = (stats_now_ns() - srv->start_ns) / 1000000;
	stats.clients = srv->client_count;
	stats.clients_total = srv->stats.clients_total;
	stats.jobs_ok = srv->stats.jobs_ok;
	stats.jobs_failed = srv->stats.jobs_failed;
	stats.jobs_in_flight = srv->jobs_in_flight;
	stats.regions = (uint32_t)region_live_count();
	stats.mapped_bytes = region_live_bytes();
	stats.rss_bytes = reply_rss_bytes();
	stats.heap_bytes = reply_heap_bytes();
	stats.has_heap_bytes = stats.heap_bytes != 0;
	stats.bytes_processed = srv->stats.bytes_processed;
	stats.n_errors_by_status = NORMD__STATUS__INTERNAL + 1;
	stats.errors_by_status = srv->stats.errors_by_status;
	stats.backend = (char *)srv->backend->name;
	stats.has_mps = srv->backend->kind == NORMD__BACKEND_KIND__BACKEND_CUDA;
	stats.mps = srv->backend->mps;
	stats_fill_reply(srv, &stats);
	Normd__Limits limits;
	reply_fill_limits(srv->cfg, &limits);
	stats.limits = &limits;
	stats.n_rejections = NC_REJECT_COUNT;
	stats.rejections = srv->stats.rejections;

	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = request_id;
	env.body_case = NORMD__ENVELOPE__BODY_STATS_REPLY;
	env.stats_reply = &stats;
	stats_count_status(srv, NC_OK);
	reply_send(c, &env);
}

void reply_pong(struct client *c, uint64_t request_id, uint64_t nonce)
{
	Normd__Pong pong = NORMD__PONG__INIT;
	pong.has_nonce = true;
	pong.nonce = nonce;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = request_id;
	env.body_case = NORMD__ENVELOPE__BODY_PONG;
	env.pong = &pong;
	reply_send(c, &env);
}

void reply_go_away(struct client *c, int status, const char *message)
{
	Normd__GoAway go_away = NORMD__GO_AWAY__INIT;
	go_away.status = nc__status_to_wire(status);
	go_away.message = (char *)message;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = 0;
	env.body_case = NORMD__ENVELOPE__BODY_GO_AWAY;
	env.go_away = &go_away;
	reply_send(c, &env);
}

void reply_variants(struct client *c, uint64_t request_id)
{
	struct backend *backend = c->srv->backend;
	size_t n = 0;
	struct variant_row *rows = backend->variants ? backend->variants(backend, &n) : NULL;
	Normd__VariantEntry *entries = nc__calloc(n ? n : 1, sizeof(*entries));
	Normd__VariantEntry **ptrs = nc__calloc(n ? n : 1, sizeof(*ptrs));
	if (!entries || !ptrs) {
		nc__free(rows);
		nc__free(entries);
		nc__free(ptrs);
		reply_result(c, request_id, NC_ERESOURCE_EXHAUSTED, "out of memory listing variants");
		return;
	}
	static const Normd__DType wire_dtype[] = {NORMD__DTYPE__F32, NORMD__DTYPE__F16,
						  NORMD__DTYPE__BF16};
	static const Normd__Op wire_op[] = {NORMD__OP__LAYERNORM_FWD, NORMD__OP__LAYERNORM_BWD,
					    NORMD__OP__RMSNORM_FWD, NORMD__OP__RMSNORM_BWD};
	for (size_t i = 0; i < n; i++) {
		Normd__VariantEntry *e = &entries[i];
		normd__variant_entry__init(e);
		e->has_device = e->has_op = e->has_dtype = e->has_weight_dtype = true;
		e->has_flags = e->has_cols = e->has_uses = true;
		e->device = rows[i].device;
		e->op = wire_op[rows[i].op];
		e->dtype = wire_dtype[rows[i].dtype];
		e->weight_dtype = wire_dtype[rows[i].weight_dtype];
		e->flags = rows[i].flags;
		e->cols = (uint64_t)rows[i].cols;
		e->variant = rows[i].variant;
		e->source = rows[i].source;
		e->uses = rows[i].uses;
		ptrs[i] = e;
	}
	Normd__VariantsReply variants = NORMD__VARIANTS_REPLY__INIT;
	variants.n_entries = n;
	variants.entries = ptrs;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = request_id;
	env.body_case = NORMD__ENVELOPE__BODY_VARIANTS_REPLY;
	env.variants_reply = &variants;
	stats_count_status(c->srv, NC_OK);
	reply_send(c, &env);
	nc__free(rows);
	nc__free(entries);
	nc__free(ptrs);
}
