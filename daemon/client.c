/*
 * One connection: socket I/O, frame reassembly, the output queue and the
 * connection's lifetime.
 *
 * The socket is watched with a uv_poll_t and read with recvmsg() so that
 * memfds sent with SCM_RIGHTS arrive with the bytes they were sent with
 * (libuv's stream API cannot take them). Each received fd is tied to one
 * frame: a Unix stream socket hands fds over with the first byte of the
 * write they were sent with and ends that recvmsg() within the write, and a
 * client sends a frame's fds (one memfd, or a VMM region's chunks) with its
 * first byte, so the fds belong to the frame holding the last byte the
 * recvmsg() returned. They wait, in a small FIFO, until that frame is
 * dispatched; those the frame does not claim (anything but a RegisterRegion
 * of an fd kind, or fds past what it takes), are closed right after, so an
 * fd never reaches a later frame.
 *
 * A client is never freed inside its own callbacks: client_close() only marks
 * it and releases what it can, and the server's before-poll hook frees it
 * once its jobs have completed and its poll handle is closed.
 */
#include "daemon/server.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/log.h"
#include "proto/frame.h"

#define CLIENT_READ_CHUNK 65536
#define CLIENT_READ_ROOM 4096 /* least free room a read is given */

/*
 * Requests are decoded into this buffer rather than with a malloc per
 * submessage (a job is about eight): the loop decodes one at a time, and a
 * dispatch that decodes another client's input meanwhile does without.
 */
static _Alignas(16) unsigned char decode_arena_bytes[8192];
static struct nc__unpack_arena decode_arena = {decode_arena_bytes, sizeof(decode_arena_bytes), 0};
static bool decode_arena_busy;

static void client_on_poll(uv_poll_t *handle, int status, int events);
static int client_write_queue(struct client *c);
static void client_flush(struct client *c);

/* A block holds at least this much (less when max_output_bytes is small). */
#define OUT_BLOCK_BYTES 16384
/* A block of deferred replies: about a hundred job replies, one send (client_defer_room). */
#define DEFER_BLOCK_BYTES 4096

bool client_input_paused(const struct client *c)
{
	/* Enqueued jobs wait for the client's own GPU: at the limit, stop reading rather than refuse. */
	return c->mapping || c->output_paused ||
	       (c->estream_count > 0 && c->jobs_in_flight >= c->srv->cfg->max_jobs_in_flight);
}

static void client_update_poll(struct client *c)
{
	int events = 0;
	if (!c->closing && !c->close_after_flush && !client_input_paused(c))
		events |= UV_READABLE;
	else if (!c->closing)
		events |= UV_DISCONNECT; /* a paused client that leaves must still be seen leaving */
	if (c->out_head && !c->flush_pending)
		events |= UV_WRITABLE; /* deferred replies are written before the next poll anyway */
	if (events == c->poll_events)
		return;
	c->poll_events = events;
	if (events)
		uv_poll_start(&c->poll, events, client_on_poll);
	else
		uv_poll_stop(&c->poll);
}

int client_create(struct server *srv, int fd, pid_t pid, uid_t uid, gid_t gid)
{
	struct client *c = nc__calloc(1, sizeof(*c));
	if (!c)
		return NC_ENOMEM;
	c->srv = srv;
	c->id = ++srv->next_client_id;
	c->fd = fd;
	c->pid = pid;
	c->uid = uid;
	c->gid = gid;
	c->dispatch_frame = UINT64_MAX;
	c->accepted_ns = stats_now_ns();
	snprintf(c->name, sizeof(c->name), "-");
	region_table_init(&c->regions);
	if (uv_poll_init(srv->loop, &c->poll, fd) != 0) {
		nc__free(c);
		return NC_EINTERNAL;
	}
	c->poll.data = c;
	c->next = srv->clients;
	if (srv->clients)
		srv->clients->prev = c;
	srv->clients = c;
	srv->client_count++;
	srv->stats.clients_total++;
	client_update_poll(c);
	return 0;
}

static void client_on_handle_closed(uv_handle_t *handle)
{
	struct client *c = handle->data;
	c->poll_closed = true;
}

static void client_drop_output(struct client *c)
{
	while (c->out_head) {
		struct out_chunk *chunk = c->out_head;
		c->out_head = chunk->next;
		nc__free(chunk);
	}
	c->srv->freed_since_trim += c->out_bytes;
	c->srv->out_bytes_total -= c->out_bytes;
	c->out_tail = NULL;
	c->out_bytes = 0;
}

void client_close(struct client *c, const char *reason)
{
	if (c->closing)
		return;
	log_info("event=disconnect client=%llu pid=%d name=%s jobs_in_flight=%u reason=\"%s\"",
		 (unsigned long long)c->id, (int)c->pid, c->name, c->jobs_in_flight, reason);
	if (c->flush_pending)
		client_write_queue(c); /* an answer that says why we close, at least, goes out */
	c->closing = true;
	c->srv->client_count--;
	uv_poll_stop(&c->poll);
	uv_close((uv_handle_t *)&c->poll, client_on_handle_closed);
	close(c->fd);
	c->fd = -1;
	client_drop_output(c);
	for (unsigned i = 0; i < c->pending_fd_count; i++)
		close(c->pending_fds[i].fd);
	c->pending_fd_count = 0;
	estream_abandon_all(c);
	region_table_clear(&c->regions);
	c->srv->freed_since_trim += c->in_cap;
	nc__free(c->in_buf);
	c->in_buf = NULL;
	c->in_len = c->in_cap = 0;
}

bool client_try_free(struct client *c)
{
	if (!c->closing || !c->poll_closed || c->jobs_in_flight > 0 || c->mapping)
		return false;
	struct server *srv = c->srv;
	if (c->prev)
		c->prev->next = c->next;
	else
		srv->clients = c->next;
	if (c->next)
		c->next->prev = c->prev;
	nc__free(c);
	return true;
}

/*
 * Appends to the output queue: into the last block while it has room, else
 * into a new one. Each block is charged at its real cost (OUT_CHUNK_COST);
 * NC_ERESOURCE_EXHAUSTED when that would pass max_output_bytes.
 */
/*
 * Backpressure: read no more requests from a client with half its own cap
 * unread, or with anything unread while all clients together hold half the
 * daemon-wide cap. Called once the socket has refused bytes.
 */
static void client_check_backlog(struct client *c)
{
	if (c->out_bytes >= c->srv->cfg->max_output_bytes / 2 ||
	    (c->out_bytes > 0 && c->srv->out_bytes_total >= c->srv->cfg->max_output_bytes_total / 2))
		c->output_paused = true;
	client_update_poll(c);
}

/* The size of a new output block: OUT_BLOCK_BYTES, less when max_output_bytes is small. */
static size_t client_block_bytes(const struct client *c)
{
	size_t block = c->srv->cfg->max_output_bytes / 8;
	return block > OUT_BLOCK_BYTES ? OUT_BLOCK_BYTES : block;
}

/*
 * Adds an empty block of `cap` bytes to the output queue, charged at its
 * real cost (OUT_CHUNK_COST); NC_ERESOURCE_EXHAUSTED when that would pass
 * max_output_bytes or max_output_bytes_total.
 */
static int client_add_block(struct client *c, size_t cap)
{
	if (c->out_bytes + OUT_CHUNK_COST(cap) > c->srv->cfg->max_output_bytes ||
	    c->srv->out_bytes_total + OUT_CHUNK_COST(cap) > c->srv->cfg->max_output_bytes_total)
		return NC_ERESOURCE_EXHAUSTED;
	struct out_chunk *chunk = nc__malloc(sizeof(*chunk) + cap);
	if (!chunk)
		return NC_ENOMEM;
	chunk->next = NULL;
	chunk->len = 0;
	chunk->sent = 0;
	chunk->cap = cap;
	if (c->out_tail)
		c->out_tail->next = chunk;
	else
		c->out_head = chunk;
	c->out_tail = chunk;
	c->out_bytes += OUT_CHUNK_COST(cap);
	c->srv->out_bytes_total += OUT_CHUNK_COST(cap);
	return 0;
}

static int client_queue(struct client *c, const uint8_t *bytes, size_t len)
{
	struct out_chunk *tail = c->out_tail;
	if (!tail || tail->cap - tail->len < len) {
		size_t block = client_block_bytes(c);
		int rc = client_add_block(c, len > block ? len : block);
		if (rc)
			return rc;
		tail = c->out_tail;
	}
	memcpy(tail->bytes + tail->len, bytes, len);
	tail->len += len;
	return 0;
}

void client_send(struct client *c, uint8_t *bytes, size_t len)
{
	if (c->closing) {
		nc__free(bytes);
		return;
	}
	/*
	 * With nothing queued, the socket takes the frame at once; only what it
	 * does not take is queued, so the cap counts bytes the client has not
	 * read, not bytes we have not tried to write yet.
	 */
	size_t sent = 0;
	if (!c->out_head) {
		ssize_t n = send(c->fd, bytes, len, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (n < 0 && errno != EAGAIN && errno != EINTR) {
			nc__free(bytes);
			client_close(c, strerror(errno));
			return;
		}
		sent = n > 0 ? (size_t)n : 0;
		if (sent == len) {
			nc__free(bytes);
			return;
		}
	}
	int rc = client_queue(c, bytes + sent, len - sent);
	nc__free(bytes);
	if (rc == NC_ERESOURCE_EXHAUSTED) {
		log_warn("event=output_cap client=%llu pid=%d queued=%zu cap=%llu "
			 "queued_total=%zu cap_total=%llu",
			 (unsigned long long)c->id, (int)c->pid, c->out_bytes,
			 (unsigned long long)c->srv->cfg->max_output_bytes, c->srv->out_bytes_total,
			 (unsigned long long)c->srv->cfg->max_output_bytes_total);
		stats_count_rejection(c->srv, NC_REJECT_OUTPUT_CAP);
		client_close(c, "client does not read its replies (output queue full)");
		return;
	}
	if (rc) {
		stats_count_rejection(c->srv, NC_REJECT_OUT_OF_MEMORY);
		client_close(c, "out of memory queueing a reply");
		return;
	}
	client_check_backlog(c);
}

/*
 * Replies are not written one by one: each send() costs a system call and
 * a wake-up of the peer, and was the largest share of the daemon's CPU time
 * per enqueued job. A small frame goes at the end of the output queue while
 * the socket is not backed up, and client_flush_pending() writes each
 * connection's queue once per loop iteration, before the loop polls.
 */
uint8_t *client_defer_room(struct client *c, size_t len)
{
	size_t block = client_block_bytes(c);
	if (block > DEFER_BLOCK_BYTES)
		block = DEFER_BLOCK_BYTES;
	if (c->closing || (c->out_head && !c->flush_pending))
		return NULL; /* backed up: client_send queues behind what waits */
	struct out_chunk *tail = c->out_tail;
	if (tail && (len > block || tail->cap - tail->len < len)) {
		/* No room, or a large frame: what waits goes first, now. */
		if (client_write_queue(c) != 0) {
			client_close(c, strerror(errno));
			return NULL;
		}
		if (c->out_head) {
			client_check_backlog(c);
			return NULL;
		}
		tail = NULL;
	}
	if (len > block)
		return NULL; /* client_send writes it at once, as before */
	if (!tail) {
		if (client_add_block(c, block) != 0)
			return NULL; /* the caps: client_send decides, as for any frame */
		tail = c->out_tail;
	}
	uint8_t *room = tail->bytes + tail->len;
	tail->len += len;
	c->flush_pending = true;
	if (!c->flush_listed) {
		c->flush_listed = true;
		c->flush_next = c->srv->flush_list;
		c->srv->flush_list = c;
	}
	return room;
}

void client_flush_pending(struct server *srv)
{
	/* A flush may resume a paused client, whose requests defer more replies: until none is left. */
	while (srv->flush_list) {
		struct client *c = srv->flush_list;
		srv->flush_list = c->flush_next;
		c->flush_listed = false;
		c->flush_next = NULL;
		if (c->closing || !c->flush_pending)
			continue;
		client_flush(c);
		if (!c->closing && c->out_head)
			client_check_backlog(c);
	}
}

/*
 * Writes as much queued output as the socket takes, in one send for the
 * common case of one block. Returns 0, or -1 on a socket error (the caller
 * closes). The deferred replies have then all been tried.
 */
static int client_write_queue(struct client *c)
{
	/* Blocks written as soon as they were filled left no backlog behind: no trim for them. */
	bool deferred = c->flush_pending;
	c->flush_pending = false;
	while (c->out_head) {
		struct out_chunk *chunk = c->out_head;
		ssize_t n = send(c->fd, chunk->bytes + chunk->sent, chunk->len - chunk->sent,
				 MSG_NOSIGNAL | MSG_DONTWAIT);
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			break;
		if (n < 0)
			return -1;
		chunk->sent += (size_t)n;
		if (chunk->sent < chunk->len)
			break;
		c->out_head = chunk->next;
		if (!c->out_head)
			c->out_tail = NULL;
		c->out_bytes -= OUT_CHUNK_COST(chunk->cap);
		c->srv->out_bytes_total -= OUT_CHUNK_COST(chunk->cap);
		if (!deferred)
			c->srv->freed_since_trim += OUT_CHUNK_COST(chunk->cap);
		nc__free(chunk);
	}
	return 0;
}

/* Writes as much queued output as the socket takes. */
static void client_flush(struct client *c)
{
	if (client_write_queue(c) != 0) {
		client_close(c, strerror(errno));
		return;
	}
	if (!c->out_head && c->close_after_flush) {
		client_close(c, "protocol violation");
		return;
	}
	/* A client that has read everything resumes whatever others hold. */
	if (c->output_paused && c->out_bytes <= c->srv->cfg->max_output_bytes / 4 &&
	    (c->out_bytes == 0 ||
	     c->srv->out_bytes_total < c->srv->cfg->max_output_bytes_total / 2)) {
		c->output_paused = false;
		client_resume(c); /* requests read before the pause; re-arms UV_READABLE */
	} else {
		client_update_poll(c);
	}
	if (c->srv->draining)
		server_drain_check(c->srv);
}

/*
 * The stream offset of the frame that holds in_buf[at]: frames are walked
 * from in_buf[0], which always starts one.
 */
static uint64_t client_frame_at(const struct client *c, size_t at)
{
	size_t start = 0;
	while (start + NC__FRAME_HEADER_BYTES <= c->in_len) {
		size_t next = start + NC__FRAME_HEADER_BYTES + nc__frame_length(c->in_buf + start);
		if (next > at)
			break;
		start = next;
	}
	return c->in_base + start;
}

/*
 * Keeps fds that arrived with SCM_RIGHTS, tied to the frame that holds the
 * last byte received with them (in_buf[last]); closes any beyond the FIFO's
 * room.
 */
static void client_take_fds(struct client *c, struct msghdr *msg, size_t last)
{
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(msg); cm; cm = CMSG_NXTHDR(msg, cm)) {
		if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
			continue;
		size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		int fds[CLIENT_MAX_PENDING_FDS * 2];
		if (n > sizeof(fds) / sizeof(fds[0]))
			n = sizeof(fds) / sizeof(fds[0]);
		memcpy(fds, CMSG_DATA(cm), n * sizeof(int));
		uint64_t frame = client_frame_at(c, last);
		for (size_t i = 0; i < n; i++) {
			if (c->pending_fd_count < CLIENT_MAX_PENDING_FDS)
				c->pending_fds[c->pending_fd_count++] =
					(struct pending_fd){.fd = fds[i], .frame = frame};
			else
				close(fds[i]);
		}
	}
}

unsigned client_claim_fds(struct client *c, int *fds, unsigned max)
{
	unsigned found = 0, kept = 0;
	for (unsigned i = 0; i < c->pending_fd_count; i++) {
		struct pending_fd p = c->pending_fds[i];
		if (p.frame == c->dispatch_frame && found++ < max) {
			fds[found - 1] = p.fd;
			continue;
		}
		c->pending_fds[kept++] = p; /* another frame's, or one past `max` */
	}
	c->pending_fd_count = kept;
	return found;
}

/* Closes the fds of frames up to and including the one at stream offset `frame`. */
static void client_close_stray_fds(struct client *c, uint64_t frame)
{
	unsigned kept = 0;
	for (unsigned i = 0; i < c->pending_fd_count; i++) {
		if (c->pending_fds[i].frame > frame) {
			c->pending_fds[kept++] = c->pending_fds[i];
			continue;
		}
		log_debug("event=stray_fd_closed client=%llu", (unsigned long long)c->id);
		close(c->pending_fds[i].fd);
	}
	c->pending_fd_count = kept;
}

/*
 * Answers a frame that does not decode, naming the problem where the bytes
 * tell it, and closes after the reply: the client speaks something else.
 */
static void client_refuse_frame(struct client *c, const uint8_t *body, size_t len,
				const char *why)
{
	char detail[160];
	if (!strcmp(why, NC__WHY_NO_MEMORY)) {
		stats_count_rejection(c->srv, NC_REJECT_OUT_OF_MEMORY);
		reply_result(c, 0, NC_ERESOURCE_EXHAUSTED, "out of memory decoding a frame; closing");
	} else {
		nc__envelope_explain(body, len, detail, sizeof(detail));
		stats_count_rejection(c->srv, NC_REJECT_BAD_FRAME);
		reply_result(c, 0, NC_EPROTOCOL_ERROR, "undecodable frame (%s); closing",
			     strcmp(detail, "malformed envelope") ? detail : why);
	}
	c->close_after_flush = true;
}

/* Whether a frame may carry an fd: a RegisterRegion of a kind that needs one. */
static bool envelope_takes_fd(const Normd__Envelope *env)
{
	return env->body_case == NORMD__ENVELOPE__BODY_REGISTER_REGION &&
	       (env->register_region->kind == NORMD__REGION_KIND__HOST_MEMFD ||
		env->register_region->kind == NORMD__REGION_KIND__CUDA_VMM_FD);
}

/* Decodes and dispatches every complete frame in the input buffer. */
static void client_process_input(struct client *c)
{
	size_t pos = 0;
	while (!c->closing && !c->close_after_flush && !client_input_paused(c) &&
	       c->in_len - pos >= NC__FRAME_HEADER_BYTES) {
		uint32_t body = nc__frame_length(c->in_buf + pos);
		if (body > c->srv->cfg->max_frame) {
			stats_count_rejection(c->srv, NC_REJECT_FRAME_TOO_LARGE);
			reply_result(c, 0, NC_EPROTOCOL_ERROR,
				     "frame of %u bytes exceeds max_frame %llu; closing", body,
				     (unsigned long long)c->srv->cfg->max_frame);
			c->close_after_flush = true;
			break;
		}
		if (c->in_len - pos < NC__FRAME_HEADER_BYTES + body)
			break;
		const char *why = NULL;
		/* A dispatch may resume another client's input: that one decodes with malloc. */
		struct nc__unpack_arena *arena = decode_arena_busy ? NULL : &decode_arena;
		decode_arena_busy = true;
		Normd__Envelope *env = nc__envelope_unpack_arena(
			c->in_buf + pos + NC__FRAME_HEADER_BYTES, body, arena, &why);
		uint64_t frame = c->in_base + pos;
		pos += NC__FRAME_HEADER_BYTES + body;
		if (!env) {
			if (arena)
				decode_arena_busy = false;
			client_refuse_frame(c, c->in_buf + pos - body, body, why);
			break;
		}
		/* Fds sent with a frame that takes none are closed before it is answered. */
		if (!envelope_takes_fd(env))
			client_close_stray_fds(c, frame);
		c->dispatch_frame = frame;
		dispatch_envelope(c, env);
		nc__envelope_free_arena(env, arena);
		if (arena)
			decode_arena_busy = false;
		c->dispatch_frame = UINT64_MAX;
		client_close_stray_fds(c, frame); /* fds it came with and did not claim */
	}
	if (c->closing)
		return;
	memmove(c->in_buf, c->in_buf + pos, c->in_len - pos);
	c->in_len -= pos;
	c->in_base += pos;
	if (c->in_len == 0)
		c->frame_start_ns = 0;
	else if (pos > 0)
		c->frame_start_ns = stats_now_ns(); /* what is left began after what was taken */
	if (c->close_after_flush && !c->out_head)
		client_close(c, "protocol violation"); /* the error reply is already sent */
	else
		client_update_poll(c); /* a registration may have paused reading */
}

void client_resume(struct client *c)
{
	if (c->closing)
		return;
	/* A frame begun before the pause waited on us, not on the client: its clock restarts. */
	if (c->in_len > 0)
		c->frame_start_ns = stats_now_ns();
	client_process_input(c); /* frames that came behind the pause; re-arms the poll */
}

static int client_reserve_input(struct client *c)
{
	/*
	 * Room for the frame begun plus a little: the buffer stays at one read
	 * chunk unless a frame is larger, and never passes the next power of two
	 * above max_frame + its header + CLIENT_READ_ROOM (docs/SECURITY.md).
	 */
	size_t want = c->in_len + CLIENT_READ_ROOM;
	if (c->in_len >= NC__FRAME_HEADER_BYTES) {
		size_t frame = NC__FRAME_HEADER_BYTES + nc__frame_length(c->in_buf);
		bool allowed = frame <= NC__FRAME_HEADER_BYTES + c->srv->cfg->max_frame;
		if (allowed && frame + CLIENT_READ_ROOM > want)
			want = frame + CLIENT_READ_ROOM;
	}
	if (want <= c->in_cap)
		return 0;
	size_t cap = c->in_cap ? c->in_cap : CLIENT_READ_CHUNK;
	while (cap < want)
		cap *= 2;
	uint8_t *buf = nc__realloc(c->in_buf, cap);
	if (!buf)
		return NC_ENOMEM;
	c->in_buf = buf;
	c->in_cap = cap;
	return 0;
}

static void client_read(struct client *c)
{
	if (client_reserve_input(c)) {
		log_warn("event=alloc_failed client=%llu pid=%d what=input_buffer in_len=%zu "
			 "mappings=%llu/%llu reason=\"out of memory reading a frame; closing\"",
			 (unsigned long long)c->id, (int)c->pid, c->in_len,
			 (unsigned long long)region_mappings_live(),
			 (unsigned long long)region_mappings_cap());
		client_close(c, "out of memory reading a frame");
		return;
	}
	union {
		char buf[CMSG_SPACE(sizeof(int) * CLIENT_MAX_PENDING_FDS * 2)];
		struct cmsghdr align;
	} control;
	struct iovec iov = {.iov_base = c->in_buf + c->in_len, .iov_len = c->in_cap - c->in_len};
	struct msghdr msg = {
		.msg_iov = &iov,
		.msg_iovlen = 1,
		.msg_control = control.buf,
		.msg_controllen = sizeof(control.buf),
	};
	ssize_t n = recvmsg(c->fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n <= 0) {
		client_close(c, n == 0 ? "peer closed the connection" : strerror(errno));
		return;
	}
	if (c->in_len == 0)
		c->frame_start_ns = stats_now_ns();
	c->in_len += (size_t)n;
	client_take_fds(c, &msg, c->in_len - 1);
	if (msg.msg_flags & MSG_CTRUNC)
		log_warn("event=fds_truncated client=%llu", (unsigned long long)c->id);
	client_process_input(c);
}

/* Answers why, counts the rejection and closes at once (the peer may not read). */
static void client_expire(struct client *c, enum nc_reject_reason reason, const char *event,
			  const char *what, uint64_t limit_ms)
{
	log_warn("event=%s client=%llu pid=%d uid=%d limit_ms=%llu", event,
		 (unsigned long long)c->id, (int)c->pid, (int)c->uid, (unsigned long long)limit_ms);
	stats_count_rejection(c->srv, reason);
	reply_result(c, 0, NC_EPROTOCOL_ERROR, "%s within %llu ms; closing", what,
		     (unsigned long long)limit_ms);
	client_close(c, what);
}

void client_check_deadlines(struct client *c, uint64_t now_ns)
{
	const struct config *cfg = c->srv->cfg;
	if (c->closing)
		return;
	if (!c->hello_done && now_ns - c->accepted_ns > cfg->hello_timeout_ms * 1000000) {
		client_expire(c, NC_REJECT_HELLO_TIMEOUT, "hello_timeout", "no Hello",
			      cfg->hello_timeout_ms);
		return;
	}
	/* A paused client holds whole frames we have not read on; only a started one counts. */
	if (c->frame_start_ns && c->in_len > 0 && !client_input_paused(c) &&
	    now_ns - c->frame_start_ns > cfg->frame_timeout_ms * 1000000)
		client_expire(c, NC_REJECT_FRAME_TIMEOUT, "frame_timeout", "no complete frame",
			      cfg->frame_timeout_ms);
}

static void client_on_poll(uv_poll_t *handle, int status, int events)
{
	struct client *c = handle->data;
	if (status < 0) {
		client_close(c, uv_strerror(status));
		return;
	}
	if (events & UV_WRITABLE)
		client_flush(c);
	/* The flush may have paused input again: a paused client's bytes wait in the socket. */
	if (!c->closing && (events & UV_READABLE) && !client_input_paused(c))
		client_read(c);
	else if (!c->closing && (events & UV_DISCONNECT))
		client_close(c, "peer closed the connection");
}
