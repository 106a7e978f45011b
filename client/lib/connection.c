/*
 * The connection: connect and Hello, sending frames, and routing replies to
 * the threads that wait for them.
 *
 * Any thread may send (send_lock keeps frames whole). Replies are read by
 * whichever waiting thread finds nobody else reading: it reads one frame,
 * files it under its request id, wakes the others and looks again. So no
 * background thread exists and a connection used by one thread never
 * context-switches.
 */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client/lib/internal.h"
#include "proto/frame.h"

#define NC__READ_CHUNK 16384

uint64_t nc__now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int64_t now_ms(void)
{
	return (int64_t)(nc__now_ns() / 1000000);
}

/* Milliseconds left before `deadline` (-1: none), for poll(). */
static int ms_left(int64_t deadline)
{
	if (deadline < 0)
		return -1;
	int64_t left = deadline - now_ms();
	return left < 0 ? 0 : (int)(left > 1000000000 ? 1000000000 : left);
}

/* ---- sets of request ids (awaited, enqueued) --------------------------------------- */

static size_t idset_slot(uint64_t id, size_t cap)
{
	return (size_t)(id * 11400714819323198485ull >> 32) & (cap - 1);
}

static bool idset_contains(const struct nc__idset *set, uint64_t id)
{
	if (!set->cap)
		return false;
	for (size_t i = idset_slot(id, set->cap); set->slots[i]; i = (i + 1) & (set->cap - 1)) {
		if (set->slots[i] == id)
			return true;
	}
	return false;
}

static void idset_place(uint64_t *slots, size_t cap, uint64_t id)
{
	size_t i = idset_slot(id, cap);
	while (slots[i])
		i = (i + 1) & (cap - 1);
	slots[i] = id;
}

int nc__idset_add(struct nc__idset *set, uint64_t id)
{
	if ((set->count + 1) * 2 > set->cap) {
		size_t cap = set->cap ? set->cap * 2 : 64;
		uint64_t *slots = nc__calloc(cap, sizeof(*slots));
		if (!slots)
			return NC_ENOMEM;
		for (size_t i = 0; i < set->cap; i++) {
			if (set->slots[i])
				idset_place(slots, cap, set->slots[i]);
		}
		nc__free(set->slots);
		set->slots = slots;
		set->cap = cap;
	}
	idset_place(set->slots, set->cap, id);
	set->count++;
	return 0;
}

bool nc__idset_remove(struct nc__idset *set, uint64_t id)
{
	if (!set->cap)
		return false;
	size_t mask = set->cap - 1, i = idset_slot(id, set->cap);
	while (set->slots[i] && set->slots[i] != id)
		i = (i + 1) & mask;
	if (!set->slots[i])
		return false;
	set->slots[i] = 0;
	set->count--;
	for (size_t j = (i + 1) & mask; set->slots[j]; j = (j + 1) & mask) {
		uint64_t moved = set->slots[j];
		set->slots[j] = 0;
		idset_place(set->slots, set->cap, moved);
	}
	return true;
}

static int request_begin(nc_conn *conn, uint64_t *request_id)
{
	pthread_mutex_lock(&conn->lock);
	uint64_t id = ++conn->next_request_id;
	int rc = nc__idset_add(&conn->pending, id);
	pthread_mutex_unlock(&conn->lock);
	if (rc)
		return nc__fail(rc, "out of memory tracking a request");
	*request_id = id;
	return 0;
}

static void request_abandon(nc_conn *conn, uint64_t request_id)
{
	pthread_mutex_lock(&conn->lock);
	nc__idset_remove(&conn->pending, request_id);
	pthread_mutex_unlock(&conn->lock);
}

/* ---- sending ------------------------------------------------------------------------ */

static int send_all(int fd, const uint8_t *bytes, size_t len, const int *pass_fds,
		    unsigned pass_count)
{
	size_t sent = 0;
	while (sent < len) {
		struct iovec iov = {.iov_base = (void *)(bytes + sent), .iov_len = len - sent};
		union {
			char buf[CMSG_SPACE(sizeof(int) * NC_VMM_MAX_CHUNKS)];
			struct cmsghdr align;
		} control;
		struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
		if (pass_count > 0 && sent == 0) {
			/* The fds travel with the first bytes of their frame. */
			msg.msg_control = control.buf;
			msg.msg_controllen = CMSG_SPACE(sizeof(int) * pass_count);
			struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
			cm->cmsg_level = SOL_SOCKET;
			cm->cmsg_type = SCM_RIGHTS;
			cm->cmsg_len = CMSG_LEN(sizeof(int) * pass_count);
			memcpy(CMSG_DATA(cm), pass_fds, sizeof(int) * pass_count);
		}
		ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return nc__fail(NC_EIO, "send to normd failed: %s", strerror(errno));
		sent += (size_t)n;
	}
	return 0;
}

int nc__pack(nc_conn *conn, const Normd__Envelope *env, uint8_t **frame, size_t *len)
{
	int rc = nc__frame_pack(env, conn->info.max_frame, frame, len);
	if (rc == NC_EINVALID_ARGUMENT)
		return nc__fail(rc, "request larger than the daemon's max_frame (%u bytes)",
				conn->info.max_frame);
	if (rc)
		return nc__fail(rc, "out of memory packing a request");
	return 0;
}

static int send_packed_fds(nc_conn *conn, const uint8_t *frame, size_t len, const int *fds,
			   unsigned count)
{
	pthread_mutex_lock(&conn->send_lock);
	int rc = conn->broken ? nc__fail(conn->broken, "%s", conn->broken_message)
			      : send_all(conn->fd, frame, len, fds, count);
	pthread_mutex_unlock(&conn->send_lock);
	return rc;
}

int nc__send_packed(nc_conn *conn, const uint8_t *frame, size_t len)
{
	return send_packed_fds(conn, frame, len, NULL, 0);
}

/* Sends one envelope with `count` fds (at most NC_VMM_MAX_CHUNKS) attached to its first byte. */
static int send_fds(nc_conn *conn, const Normd__Envelope *env, const int *fds, unsigned count)
{
	if (count > NC_VMM_MAX_CHUNKS)
		return nc__fail(NC_EINVALID_ARGUMENT, "%u fds for one frame; at most %d", count,
				NC_VMM_MAX_CHUNKS);
	uint8_t *frame;
	size_t len;
	int rc = nc__pack(conn, env, &frame, &len);
	if (rc)
		return rc;
	rc = send_packed_fds(conn, frame, len, fds, count);
	nc__free(frame);
	return rc;
}

int nc__send(nc_conn *conn, const Normd__Envelope *env, int fd)
{
	return send_fds(conn, env, &fd, fd >= 0 ? 1 : 0);
}

/* ---- receiving ---------------------------------------------------------------------- */

/*
 * Microseconds a waiting reader spins before sleeping in poll(): a reply to
 * a small job comes within tens of microseconds, sooner than a sleeping
 * thread wakes up. NORMD_CLIENT_SPIN_US overrides it; 0 never spins.
 */
static int64_t spin_us(void)
{
	static int64_t value = -1;
	if (value < 0) {
		const char *env = getenv("NORMD_CLIENT_SPIN_US");
		value = env ? strtoll(env, NULL, 10) : 100;
		if (value < 0)
			value = 0;
	}
	return value;
}

/*
 * Whether this wait should spin first: not after SPIN_GIVE_UP waits in a row
 * whose replies came later than the spin (a loaded daemon, big jobs), when
 * spinning only takes a core from the threads that would answer; every
 * SPIN_RETRY-th wait tries again, so short replies bring spinning back.
 */
#define SPIN_GIVE_UP 4
#define SPIN_RETRY 32
static bool spin_worthwhile(nc_conn *conn, int64_t deadline)
{
	if (spin_us() == 0 || ms_left(deadline) == 0)
		return false; /* a look without waiting neither spins nor counts */
	if (conn->spin_misses < SPIN_GIVE_UP || ++conn->spin_skips >= SPIN_RETRY) {
		conn->spin_skips = 0;
		return true;
	}
	return false;
}

/* Spins until `fd` is readable or the spin (or the deadline) runs out. */
static bool spin_for_data(int fd, int64_t deadline)
{
	int64_t start = (int64_t)(nc__now_ns() / 1000), now = start;
	while (now - start < spin_us() && (deadline < 0 || now / 1000 < deadline)) {
		struct pollfd pfd = {.fd = fd, .events = POLLIN};
		if (poll(&pfd, 1, 0) > 0)
			return true;
		sched_yield(); /* on a loaded host, let the thread that will answer run */
		now = (int64_t)(nc__now_ns() / 1000);
	}
	return false;
}

/* Reader only: returns one decoded frame, NC_ETIMEOUT, or an error. */
static int read_frame(nc_conn *conn, int64_t deadline, Normd__Envelope **out)
{
	for (;;) {
		if (conn->in_len >= NC__FRAME_HEADER_BYTES) {
			uint32_t body = nc__frame_length(conn->in_buf);
			if (body > NC__DEFAULT_MAX_FRAME * 256u)
				return nc__fail(NC_EPROTOCOL_ERROR, "daemon sent a %u-byte frame",
						body);
			if (conn->in_len >= NC__FRAME_HEADER_BYTES + body) {
				const char *why = NULL;
				*out = nc__envelope_unpack(conn->in_buf + NC__FRAME_HEADER_BYTES,
							   body, &why);
				size_t used = NC__FRAME_HEADER_BYTES + body;
				memmove(conn->in_buf, conn->in_buf + used, conn->in_len - used);
				conn->in_len -= used;
				if (!*out)
					return nc__fail(NC_EPROTOCOL_ERROR,
							"undecodable reply from normd (%s)", why);
				return 0;
			}
			if (conn->in_cap < NC__FRAME_HEADER_BYTES + body) {
				uint8_t *buf = nc__realloc(conn->in_buf, NC__FRAME_HEADER_BYTES + body);
				if (!buf)
					return nc__fail(NC_ENOMEM, "out of memory reading a reply");
				conn->in_buf = buf;
				conn->in_cap = NC__FRAME_HEADER_BYTES + body;
			}
		}
		if (conn->in_cap - conn->in_len < NC__READ_CHUNK / 4) {
			uint8_t *buf = nc__realloc(conn->in_buf, conn->in_cap + NC__READ_CHUNK);
			if (!buf)
				return nc__fail(NC_ENOMEM, "out of memory reading a reply");
			conn->in_buf = buf;
			conn->in_cap += NC__READ_CHUNK;
		}
		/*
		 * A look without waiting (an enqueue's, once a millisecond or 32
		 * requests) is one recv, not poll + recv; nc__poll_replies's none
		 * once a recv found less than it asked for.
		 */
		bool look = ms_left(deadline) == 0;
		if (look && conn->polling && conn->drained)
			return NC_ETIMEOUT;
		if (!look && spin_worthwhile(conn, deadline)) {
			if (spin_for_data(conn->fd, deadline)) {
				conn->spin_misses = 0;
				goto readable;
			}
			conn->spin_misses++;
		}
		if (!look) {
			struct pollfd pfd = {.fd = conn->fd, .events = POLLIN};
			int ready = poll(&pfd, 1, ms_left(deadline));
			if (ready < 0 && errno == EINTR)
				continue;
			if (ready == 0)
				return NC_ETIMEOUT;
		}
readable:;
		ssize_t n = recv(conn->fd, conn->in_buf + conn->in_len, conn->in_cap - conn->in_len,
				 MSG_DONTWAIT);
		if (n < 0 && errno == EAGAIN && look)
			return NC_ETIMEOUT;
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			continue;
		if (n <= 0)
			return nc__fail(NC_EIO, "connection to normd lost: %s",
					n == 0 ? "closed by the daemon" : strerror(errno));
		conn->drained = (size_t)n < conn->in_cap - conn->in_len;
		conn->in_len += (size_t)n;
	}
}

/* Files an arrived envelope (lock held). Unsolicited messages may break the connection. */
static void file_reply(nc_conn *conn, Normd__Envelope *env)
{
	uint64_t id = env->has_request_id ? env->request_id : 0;
	if (id != 0 && nc__idset_remove(&conn->enqueued, id)) {
		nc__enqueue_answered(conn, env); /* an enqueued job's reply: only errors matter */
		nc__envelope_free(env);
		pthread_cond_broadcast(&conn->cond);
		return;
	}
	if (id != 0 && idset_contains(&conn->pending, id)) {
		struct nc__reply *r = nc__malloc(sizeof(*r));
		if (r) {
			r->env = env;
			r->next = conn->replies;
			conn->replies = r;
			return;
		}
		conn->broken = NC_ENOMEM;
		snprintf(conn->broken_message, sizeof(conn->broken_message),
			 "out of memory filing a reply");
	} else if (env->body_case == NORMD__ENVELOPE__BODY_RESULT && id == 0) {
		/* The daemon refused the connection or closes it for a protocol error. */
		conn->broken = nc__status_from_wire(env->result->status);
		snprintf(conn->broken_message, sizeof(conn->broken_message), "normd: %s",
			 env->result->message ? env->result->message : "connection refused");
	} else if (env->body_case == NORMD__ENVELOPE__BODY_GO_AWAY) {
		/* Jobs in flight still complete; new work will be refused. */
	}
	nc__envelope_free(env);
}

static Normd__Envelope *take_reply(nc_conn *conn, uint64_t id)
{
	for (struct nc__reply **p = &conn->replies; *p; p = &(*p)->next) {
		if ((*p)->env->request_id != id)
			continue;
		struct nc__reply *r = *p;
		Normd__Envelope *env = r->env;
		*p = r->next;
		nc__free(r);
		nc__idset_remove(&conn->pending, id);
		return env;
	}
	return NULL;
}

/*
 * Called with conn->lock held when no other thread reads: reads one frame,
 * letting the lock go meanwhile, and files it. Returns 0, NC_ETIMEOUT, or the
 * error that broke the connection (then recorded in conn->broken).
 */
static int read_one_locked(nc_conn *conn, int64_t deadline)
{
	conn->reader_active = true;
	pthread_mutex_unlock(&conn->lock);
	Normd__Envelope *env = NULL;
	int rc = read_frame(conn, deadline, &env);
	pthread_mutex_lock(&conn->lock);
	conn->reader_active = false;
	pthread_cond_broadcast(&conn->cond);
	if (rc == 0) {
		file_reply(conn, env);
	} else if (rc != NC_ETIMEOUT) {
		conn->broken = rc;
		snprintf(conn->broken_message, sizeof(conn->broken_message), "%s", nc_last_error());
	}
	return rc;
}

static void deadline_to_timespec(int64_t deadline_ms, struct timespec *ts)
{
	/* The condition variable uses CLOCK_MONOTONIC (see nc_connect). */
	ts->tv_sec = deadline_ms / 1000;
	ts->tv_nsec = (deadline_ms % 1000) * 1000000;
}

/* Waits (conn->lock held) for another thread's read or the deadline (-1: none); false at the deadline. */
static bool wait_for_reader_locked(nc_conn *conn, int64_t deadline)
{
	if (deadline < 0) {
		pthread_cond_wait(&conn->cond, &conn->lock);
		return true;
	}
	struct timespec ts;
	deadline_to_timespec(deadline, &ts);
	return pthread_cond_timedwait(&conn->cond, &conn->lock, &ts) != ETIMEDOUT;
}

int nc__await(nc_conn *conn, uint64_t request_id, int timeout_ms, Normd__Envelope **out)
{
	int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
	int rc = 0;
	pthread_mutex_lock(&conn->lock);
	if (!idset_contains(&conn->pending, request_id)) {
		pthread_mutex_unlock(&conn->lock);
		return nc__fail(NC_ENOT_FOUND, "request %llu is not awaited on this connection",
				(unsigned long long)request_id);
	}
	for (;;) {
		if ((*out = take_reply(conn, request_id)))
			break;
		if (conn->broken) {
			rc = nc__fail(conn->broken, "%s", conn->broken_message);
			break;
		}
		if (!conn->reader_active) {
			if (read_one_locked(conn, deadline) == NC_ETIMEOUT) {
				rc = nc__fail(NC_ETIMEOUT, "no reply from normd within %d ms",
					      timeout_ms);
				break;
			}
			continue; /* a broken connection is seen above */
		}
		if (!wait_for_reader_locked(conn, deadline)) {
			if (!(*out = take_reply(conn, request_id)))
				rc = nc__fail(NC_ETIMEOUT, "no reply from normd within %d ms",
					      timeout_ms);
			break;
		}
	}
	pthread_mutex_unlock(&conn->lock);
	return rc;
}

/* nc__submit with `count` fds attached to the frame. */
static int submit_fds(nc_conn *conn, Normd__Envelope *env, const int *fds, unsigned count,
		      uint64_t *request_id)
{
	uint64_t id = 0;
	int rc = request_begin(conn, &id);
	if (rc)
		return rc;
	env->has_request_id = true;
	env->request_id = id;
	rc = send_fds(conn, env, fds, count);
	if (rc) {
		request_abandon(conn, id);
		return rc;
	}
	*request_id = id;
	return 0;
}

int nc__submit(nc_conn *conn, Normd__Envelope *env, int fd, uint64_t *request_id)
{
	return submit_fds(conn, env, &fd, fd >= 0 ? 1 : 0, request_id);
}

int nc__call(nc_conn *conn, Normd__Envelope *env, int fd, int timeout_ms,
	     Normd__Envelope **reply)
{
	uint64_t id = 0;
	int rc = nc__submit(conn, env, fd, &id);
	return rc ? rc : nc__await(conn, id, timeout_ms, reply);
}

int nc__call_result_fds(nc_conn *conn, Normd__Envelope *env, const int *fds, unsigned count,
			int timeout_ms)
{
	Normd__Envelope *reply;
	uint64_t id = 0;
	int rc = submit_fds(conn, env, fds, count, &id);
	if (rc == 0)
		rc = nc__await(conn, id, timeout_ms, &reply);
	if (rc)
		return rc;
	if (reply->body_case != NORMD__ENVELOPE__BODY_RESULT) {
		rc = nc__fail(NC_EPROTOCOL_ERROR, "unexpected reply type %d", (int)reply->body_case);
	} else {
		rc = nc__status_from_wire(reply->result->status);
		if (rc)
			nc__fail(rc, "%s", reply->result->message ? reply->result->message : "");
	}
	nc__envelope_free(reply);
	return rc;
}

int nc__call_result(nc_conn *conn, Normd__Envelope *env, int fd, int timeout_ms)
{
	return nc__call_result_fds(conn, env, &fd, fd >= 0 ? 1 : 0, timeout_ms);
}

int nc__call_expect(nc_conn *conn, Normd__Envelope *env, int timeout_ms,
		    Normd__Envelope__BodyCase expected, const char *what, Normd__Envelope **reply)
{
	int rc = nc__call(conn, env, -1, timeout_ms, reply);
	if (rc)
		return rc;
	if ((*reply)->body_case != expected) {
		nc__envelope_free(*reply);
		*reply = NULL;
		return nc__fail(NC_EPROTOCOL_ERROR, "unexpected reply to %s", what);
	}
	return 0;
}

/*
 * How often enqueue calls look at the socket: each look is a recv, costly
 * inside a training step (BENCHMARKS.md), and an enqueued job's reply only
 * matters when it carries an error, which is reported asynchronously anyway.
 * The request bound keeps replies from piling up.
 */
#define NC__REPLY_LOOK_NS 1000000ull
#define NC__REPLY_LOOK_REQUESTS 32

/*
 * Reads and files what has arrived, without waiting: enqueued jobs' replies
 * are taken in passing by a later call. Does nothing while another thread reads.
 */
void nc__poll_replies(nc_conn *conn)
{
	pthread_mutex_lock(&conn->lock);
	uint64_t now = nc__now_ns();
	bool due = now - conn->last_look_ns >= NC__REPLY_LOOK_NS ||
		   conn->next_request_id - conn->last_look_id >= NC__REPLY_LOOK_REQUESTS;
	if (due && !conn->reader_active && !conn->broken) {
		conn->last_look_ns = now;
		conn->last_look_id = conn->next_request_id;
		conn->polling = true;
		conn->drained = false;
		while (read_one_locked(conn, (int64_t)(now / 1000000)) == 0)
			;
		conn->polling = false;
	}
	pthread_mutex_unlock(&conn->lock);
}

int nc__await_enqueued(nc_conn *conn, int timeout_ms)
{
	int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
	int rc = 0;
	pthread_mutex_lock(&conn->lock);
	while (conn->enqueued.count > 0 && !conn->broken) {
		if (!conn->reader_active) {
			if (read_one_locked(conn, deadline) == NC_ETIMEOUT) {
				rc = NC_ETIMEOUT;
				break;
			}
			continue;
		}
		if (!wait_for_reader_locked(conn, deadline) && conn->enqueued.count > 0) {
			rc = NC_ETIMEOUT;
			break;
		}
	}
	pthread_mutex_unlock(&conn->lock);
	if (rc == NC_ETIMEOUT)
		return nc__fail(rc, "normd has not answered every enqueued job within %d ms",
				timeout_ms);
	return 0;
}

/* ---- connect and close -------------------------------------------------------------- */

static int connect_socket(const char *path, int *out)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof(addr.sun_path))
		return nc__fail(NC_EINVALID_ARGUMENT, "socket path too long: %s", path);
	strcpy(addr.sun_path, path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return nc__fail(NC_EIO, "socket: %s", strerror(errno));
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
		int err = errno;
		close(fd);
		return nc__fail(NC_EIO, "cannot connect to normd at %s: %s", path, strerror(err));
	}
	*out = fd;
	return 0;
}

static void keep_server_info(nc_conn *conn, const Normd__HelloReply *hello)
{
	struct nc_server_info *info = &conn->info;
	nc__copy_string(info->version, sizeof(info->version), hello->server_version);
	nc__copy_string(info->backend, sizeof(info->backend),
		    hello->backend == NORMD__BACKEND_KIND__BACKEND_CUDA ? "cuda" : "cpu");
	info->server_pid = hello->server_pid;
	info->mps = hello->mps;
	conn->norm_features = hello->has_norm_features ? hello->norm_features : 0;
	info->device_count = (uint32_t)hello->n_devices;
	for (size_t i = 0; i < hello->n_devices && i < 16; i++)
		info->device_index[i] = hello->devices[i]->index;
	if (hello->limits) {
		info->max_frame = hello->limits->max_frame;
		info->max_regions = hello->limits->max_regions;
		info->max_jobs_in_flight = hello->limits->max_jobs_in_flight;
		info->max_mapped_bytes = hello->limits->max_mapped_bytes;
	}
	if (info->max_frame == 0)
		info->max_frame = NC__DEFAULT_MAX_FRAME;
}

/*
 * A daemon that refuses a connection (allow lists, max_clients) sends one
 * Result and closes, maybe before our Hello is written. Report that Result
 * rather than the bare I/O error of the failed send.
 */
static int refusal_reason(nc_conn *conn, int rc)
{
	Normd__Envelope *env = NULL;
	char saved[256];
	snprintf(saved, sizeof(saved), "%s", nc_last_error());
	if (read_frame(conn, now_ms(), &env) == 0 && env->body_case == NORMD__ENVELOPE__BODY_RESULT &&
	    env->result->status != NORMD__STATUS__OK) {
		rc = nc__status_from_wire(env->result->status);
		nc__fail(rc, "normd: %s",
			 env->result->message ? env->result->message : "connection refused");
	} else {
		nc__fail(rc, "%s", saved);
	}
	nc__envelope_free(env);
	return rc;
}

static int say_hello(nc_conn *conn, const char *client_name, int timeout_ms)
{
	Normd__Hello hello = NORMD__HELLO__INIT;
	hello.protocol_version = NORMD__PROTOCOL_VERSION__PROTOCOL_VERSION;
	hello.client_name = (char *)(client_name ? client_name : "libnormclient");
	hello.has_pid = true;
	hello.pid = (uint32_t)getpid();
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_HELLO;
	env.hello = &hello;
	Normd__Envelope *reply;
	int rc = nc__call(conn, &env, -1, timeout_ms, &reply);
	if (rc == NC_EIO)
		return refusal_reason(conn, rc);
	if (rc)
		return rc;
	if (reply->body_case == NORMD__ENVELOPE__BODY_HELLO_REPLY) {
		keep_server_info(conn, reply->hello_reply);
	} else if (reply->body_case == NORMD__ENVELOPE__BODY_RESULT) {
		rc = nc__status_from_wire(reply->result->status);
		nc__fail(rc ? rc : NC_EPROTOCOL_ERROR, "normd refused Hello: %s",
			 reply->result->message ? reply->result->message : "");
		rc = rc ? rc : NC_EPROTOCOL_ERROR;
	} else {
		rc = nc__fail(NC_EPROTOCOL_ERROR, "unexpected reply to Hello");
	}
	nc__envelope_free(reply);
	return rc;
}

NC_API int nc_connect(const char *socket_path, const char *client_name, int timeout_ms,
		      nc_conn **out)
{
	if (!socket_path || !out)
		return nc__fail(NC_EINVALID_ARGUMENT, "socket_path and out must not be NULL");
	nc_conn *conn = nc__calloc(1, sizeof(*conn));
	if (conn && nc__region_index_init(&conn->index) != 0) {
		nc__free(conn);
		conn = NULL;
	}
	if (!conn)
		return nc__fail(NC_ENOMEM, "out of memory for a connection");
	conn->fd = -1;
	conn->info.max_frame = NC__DEFAULT_MAX_FRAME;
	pthread_condattr_t attr;
	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_mutex_init(&conn->lock, NULL);
	pthread_mutex_init(&conn->send_lock, NULL);
	pthread_cond_init(&conn->cond, &attr);
	pthread_condattr_destroy(&attr);
	int rc = connect_socket(socket_path, &conn->fd);
	if (rc == 0)
		rc = say_hello(conn, client_name, timeout_ms);
	if (rc) {
		char saved[256];
		snprintf(saved, sizeof(saved), "%s", nc_last_error());
		nc_close(conn);
		return nc__fail(rc, "%s", saved);
	}
	*out = conn;
	return 0;
}

NC_API void nc_close(nc_conn *conn)
{
	if (!conn)
		return;
	if (conn->fd >= 0 && !conn->broken) {
		Normd__Goodbye bye = NORMD__GOODBYE__INIT;
		Normd__Envelope env = NORMD__ENVELOPE__INIT;
		env.body_case = NORMD__ENVELOPE__BODY_GOODBYE;
		env.goodbye = &bye;
		nc__send(conn, &env, -1);
	}
	nc__enqueue_stop(conn); /* before the fd closes: its watcher polls it */
	if (conn->fd >= 0)
		close(conn->fd);
	nc__enqueue_release(conn);
	nc__regions_release_all(conn);
	nc__events_release(conn);
	while (conn->replies) {
		struct nc__reply *r = conn->replies;
		conn->replies = r->next;
		nc__envelope_free(r->env);
		nc__free(r);
	}
	pthread_cond_destroy(&conn->cond);
	pthread_mutex_destroy(&conn->lock);
	pthread_mutex_destroy(&conn->send_lock);
	nc__free(conn->pending.slots);
	nc__free(conn->enqueued.slots);
	nc__free(conn->in_buf);
	nc__free(conn);
}

NC_API const struct nc_server_info *nc_server_info(const nc_conn *conn)
{
	return conn ? &conn->info : NULL;
}
