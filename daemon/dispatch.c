/*
 * What each request does. Every request gets exactly one reply (a Result
 * unless the request has its own reply type); jobs are answered when they
 * complete. Until Hello has been accepted, anything else is a protocol error
 * that closes the connection.
 */
#include "daemon/server.h"

#include <string.h>
#include <unistd.h>

#include "daemon/log.h"
#include "proto/frame.h"

#define REGISTER_WHY_BYTES 192

static void dispatch_hello(struct client *c, uint64_t request_id, const Normd__Hello *hello)
{
	if (c->hello_done) {
		stats_count_rejection(c->srv, NC_REJECT_BAD_REQUEST);
		reply_result(c, request_id, NC_EPROTOCOL_ERROR, "Hello sent twice");
		return;
	}
	/*
	 * Each version only adds to the one before (2: the enqueue mode; 3: the
	 * norm variants; 4: Enqueue.device), and an older client never sends
	 * what it lacks: all are served.
	 */
	if (hello->protocol_version < 1 ||
	    hello->protocol_version > NORMD__PROTOCOL_VERSION__PROTOCOL_VERSION) {
		stats_count_rejection(c->srv, NC_REJECT_BAD_VERSION);
		reply_result(c, request_id, NC_EPROTOCOL_ERROR,
			     "protocol_version %u is not supported (server speaks %u); closing",
			     hello->protocol_version, NORMD__PROTOCOL_VERSION__PROTOCOL_VERSION);
		c->close_after_flush = true;
		return;
	}
	if (hello->client_name) {
		/* Keep the name printable and free of spaces for the logs. */
		size_t i = 0;
		for (; hello->client_name[i] && i + 1 < sizeof(c->name); i++) {
			char ch = hello->client_name[i];
			c->name[i] = (ch > ' ' && ch < 127 && ch != '"') ? ch : '_';
		}
		c->name[i] = '\0';
	}
	c->hello_done = true;
	c->protocol_version = hello->protocol_version;
	log_info("event=hello client=%llu pid=%d uid=%d name=%s protocol=%u",
		 (unsigned long long)c->id, (int)c->pid, (int)c->uid, c->name,
		 hello->protocol_version);
	reply_hello(c, request_id);
}

/*
 * Files a mapped region (or reports why there is none) and answers the
 * request. `reserved`: mappings of the daemon-wide cap taken for it; a
 * region made from them owns them from here, and a failure gives them back.
 */
static void register_finish(struct client *c, uint64_t request_id, uint64_t region_id, int rc,
			    struct region *region, unsigned reserved, char *why)
{
	if (rc && reserved)
		region_mapping_release_n(reserved); /* nothing was mapped */
	if (c->closing) {
		if (rc == 0)
			region_unref(region); /* the client left while its memory was mapped */
		return;
	}
	if (rc == 0) {
		rc = region_insert(&c->regions, region);
		if (rc) {
			region_unref(region);
			snprintf(why, REGISTER_WHY_BYTES, "out of memory");
		}
	}
	if (rc) {
		stats_count_rejection(c->srv, rc == NC_ENOMEM || rc == NC_ERESOURCE_EXHAUSTED
						  ? NC_REJECT_OUT_OF_MEMORY
						  : NC_REJECT_BAD_REGION);
		reply_result(c, request_id, rc, "region %llu: %s", (unsigned long long)region_id,
			     why);
		return;
	}
	log_debug("event=register client=%llu region=%llu size=%llu device=%d",
		  (unsigned long long)c->id, (unsigned long long)region_id,
		  (unsigned long long)region->size, region->device);
	reply_result(c, request_id, NC_OK, NULL);
}

/*
 * A registration mapped on libuv's thread pool. Its connection reads nothing
 * meanwhile (c->mapping), so requests behind it (a job naming the region,
 * say) still see it registered, and no other registration of the connection
 * can change the limits checked before it was queued.
 */
struct register_work {
	uv_work_t req;
	struct client *c;
	uint64_t request_id;
	Normd__RegisterRegion msg; /* a copy: the envelope is freed meanwhile */
	uint8_t handle[64];
	uint64_t chunk_sizes[NC_VMM_MAX_CHUNKS];
	int fds[NC_VMM_MAX_CHUNKS]; /* the frame's, owned until region_map takes them */
	unsigned fd_count;
	unsigned reserved; /* mappings of the cap it holds (register_finish) */
	int rc;
	struct region *region;
	char why[REGISTER_WHY_BYTES];
};

static void register_work_run(uv_work_t *req)
{
	struct register_work *w = req->data;
	struct backend *backend = w->c->srv->backend;
	w->rc = backend->region_map(backend, NULL, &w->msg, w->fds, w->fd_count, &w->region,
				    w->why, sizeof(w->why));
}

static void register_work_done(uv_work_t *req, int status)
{
	struct register_work *w = req->data;
	struct client *c = w->c;
	(void)status; /* never cancelled */
	c->mapping = false;
	register_finish(c, w->request_id, w->msg.region_id, w->rc, w->region, w->reserved, w->why);
	nc__free(w);
	client_resume(c);
	if (c->srv->draining)
		server_drain_check(c->srv); /* it may have waited for this registration */
}

static void close_fds(const int *fds, unsigned count)
{
	for (unsigned i = 0; i < count; i++)
		close(fds[i]);
}

static void register_off_loop(struct client *c, uint64_t request_id,
			      const Normd__RegisterRegion *msg, const int *fds, unsigned fd_count,
			      unsigned reserved)
{
	struct register_work *w = nc__calloc(1, sizeof(*w));
	if (!w) {
		close_fds(fds, fd_count);
		if (reserved)
			region_mapping_release_n(reserved);
		stats_count_rejection(c->srv, NC_REJECT_OUT_OF_MEMORY);
		reply_result(c, request_id, NC_ENOMEM, "region %llu: out of memory",
			     (unsigned long long)msg->region_id);
		return;
	}
	w->req.data = w;
	w->c = c;
	w->request_id = request_id;
	memcpy(w->fds, fds, fd_count * sizeof(int)); /* at most NC_VMM_MAX_CHUNKS (checked) */
	w->fd_count = fd_count;
	w->reserved = reserved;
	w->msg = *msg;
	w->msg.base.n_unknown_fields = 0;
	w->msg.base.unknown_fields = NULL;
	w->msg.handle.data = w->handle; /* read only when its length is 64 */
	if (msg->has_handle && msg->handle.len == 64)
		memcpy(w->handle, msg->handle.data, 64);
	w->msg.chunk_sizes = w->chunk_sizes; /* at most NC_VMM_MAX_CHUNKS (checked) */
	if (msg->n_chunk_sizes) /* chunk_sizes is NULL without any */
		memcpy(w->chunk_sizes, msg->chunk_sizes, msg->n_chunk_sizes * sizeof(uint64_t));
	c->mapping = true;
	if (uv_queue_work(c->srv->loop, &w->req, register_work_run, register_work_done) != 0) {
		/* Not reached with libuv's own pool; map here rather than fail. */
		c->mapping = false;
		register_work_run(&w->req);
		register_finish(c, request_id, w->msg.region_id, w->rc, w->region, reserved,
				w->why);
		nc__free(w);
	}
}

/* The fds a registration's frame brought: HOST_MEMFD takes one, CUDA_VMM_FD one per chunk. */
static unsigned register_claim_fds(struct client *c, const Normd__RegisterRegion *msg, int *fds)
{
	if (msg->kind == NORMD__REGION_KIND__HOST_MEMFD)
		return client_claim_fds(c, fds, 1) ? 1 : 0; /* more are closed as strays */
	if (msg->kind == NORMD__REGION_KIND__CUDA_VMM_FD)
		return client_claim_fds(c, fds, CLIENT_MAX_PENDING_FDS);
	return 0;
}

/* Mappings of the daemon-wide cap a new region takes: one per VMM chunk, else one. */
static unsigned register_mappings(const Normd__RegisterRegion *msg)
{
	return msg->kind == NORMD__REGION_KIND__CUDA_VMM_FD ? (unsigned)msg->n_chunk_sizes : 1;
}

static void dispatch_register(struct client *c, uint64_t request_id,
			      const Normd__RegisterRegion *msg)
{
	const struct config *cfg = c->srv->cfg;
	/* Claim the fds first so that a refused request never leaves them queued. */
	int fds[CLIENT_MAX_PENDING_FDS];
	unsigned fd_count = register_claim_fds(c, msg, fds);
	char why[REGISTER_WHY_BYTES];
	int rc = 0;
	enum nc_reject_reason reason = NC_REJECT_BAD_REGION;
	struct region *twin = NULL;
	if (msg->kind == NORMD__REGION_KIND__CUDA_IPC && msg->has_handle && msg->handle.len == 64)
		twin = region_find_handle(&c->regions, msg->handle.data,
					  msg->has_device ? msg->device : 0);
	/* Every memfd and VMM region is mapped anew; an IPC handle only when no region shares it. */
	unsigned new_mappings = twin ? 0 : register_mappings(msg);
	if (msg->region_id == 0 || msg->size == 0) {
		rc = NC_EINVALID_ARGUMENT;
		snprintf(why, sizeof(why), "region_id (%llu) and size (%llu) must be non-zero",
			 (unsigned long long)msg->region_id, (unsigned long long)msg->size);
	} else if ((rc = region_check_chunks(msg, fd_count, why, sizeof(why))) != 0) {
		reason = NC_REJECT_BAD_REGION;
	} else if (region_lookup(&c->regions, msg->region_id)) {
		rc = NC_EALREADY_EXISTS;
		snprintf(why, sizeof(why), "region %llu is already registered",
			 (unsigned long long)msg->region_id);
	} else if (c->regions.count >= cfg->max_regions) {
		rc = NC_ERESOURCE_EXHAUSTED;
		reason = NC_REJECT_LIMIT_REGIONS;
		snprintf(why, sizeof(why), "max_regions (%llu) reached",
			 (unsigned long long)cfg->max_regions);
	} else if (msg->size > cfg->max_mapped_bytes - c->regions.mapped_bytes) {
		rc = NC_ERESOURCE_EXHAUSTED;
		reason = NC_REJECT_LIMIT_MAPPED_BYTES;
		snprintf(why, sizeof(why), "size %llu would exceed max_mapped_bytes (%llu)",
			 (unsigned long long)msg->size, (unsigned long long)cfg->max_mapped_bytes);
	} else if (new_mappings && !region_mapping_reserve_n(new_mappings)) {
		rc = NC_ERESOURCE_EXHAUSTED;
		reason = NC_REJECT_LIMIT_MAPPINGS;
		snprintf(why, sizeof(why),
			 "max_mappings (%llu) reached: all clients' regions together hold that "
			 "many mappings; retry once regions are freed",
			 (unsigned long long)region_mappings_cap());
	}
	if (rc) {
		close_fds(fds, fd_count < CLIENT_MAX_PENDING_FDS ? fd_count : CLIENT_MAX_PENDING_FDS);
		stats_count_rejection(c->srv, reason);
		reply_result(c, request_id, rc, "%s", why);
		return;
	}
	if (!twin) {
		register_off_loop(c, request_id, msg, fds, fd_count, new_mappings);
		return;
	}
	struct backend *backend = c->srv->backend;
	struct region *region = NULL;
	rc = backend->region_map(backend, twin, msg, fds, fd_count, &region, why, sizeof(why));
	register_finish(c, request_id, msg->region_id, rc, region, new_mappings, why);
}

static void dispatch_unregister(struct client *c, uint64_t request_id,
				const Normd__UnregisterRegion *msg)
{
	struct region *region = region_remove(&c->regions, msg->region_id);
	if (!region) {
		stats_count_rejection(c->srv, NC_REJECT_UNKNOWN_REGION);
		reply_result(c, request_id, NC_ENOT_FOUND, "region %llu is not registered",
			     (unsigned long long)msg->region_id);
		return;
	}
	region_unref(region);
	reply_result(c, request_id, NC_OK, NULL);
}

void dispatch_envelope(struct client *c, const Normd__Envelope *env)
{
	uint64_t id = env->has_request_id ? env->request_id : 0;
	Normd__Envelope__BodyCase body = env->body_case;
	if (!c->hello_done && body != NORMD__ENVELOPE__BODY_HELLO) {
		stats_count_rejection(c->srv, NC_REJECT_BEFORE_HELLO);
		reply_result(c, id, NC_EPROTOCOL_ERROR, "the first message must be Hello; closing");
		c->close_after_flush = true;
		return;
	}
	switch (body) {
	case NORMD__ENVELOPE__BODY_HELLO:
		dispatch_hello(c, id, env->hello);
		break;
	case NORMD__ENVELOPE__BODY_REGISTER_REGION:
		dispatch_register(c, id, env->register_region);
		break;
	case NORMD__ENVELOPE__BODY_UNREGISTER_REGION:
		dispatch_unregister(c, id, env->unregister_region);
		break;
	case NORMD__ENVELOPE__BODY_JOB:
		job_submit(c, id, env->job);
		break;
	case NORMD__ENVELOPE__BODY_STATS:
		reply_stats(c, id);
		break;
	case NORMD__ENVELOPE__BODY_VARIANTS:
		reply_variants(c, id);
		break;
	case NORMD__ENVELOPE__BODY_PING:
		reply_pong(c, id, env->ping->has_nonce ? env->ping->nonce : 0);
		break;
	case NORMD__ENVELOPE__BODY_GOODBYE:
		client_close(c, "goodbye");
		break;
	default:
		stats_count_rejection(c->srv, NC_REJECT_BAD_REQUEST);
		reply_result(c, id, NC_EPROTOCOL_ERROR,
			     "message type %d is not a request the daemon accepts", (int)body);
		break;
	}
}
