/*
 * The server: the listening socket, accepting (with peer credentials and the
 * allow lists), signals, the SIGTERM drain, and the before-poll hook that
 * frees closed clients. The counters behind Stats are in stats.c.
 */
#include "daemon/server.h"

#include <errno.h>
#include <grp.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/log.h"
#include "proto/frame.h"

struct server *server_instance;
uint64_t server_test_fail_alloc;

/* ---- the listening socket ------------------------------------------------------ */

/* Takes a socket passed by systemd (LISTEN_FDS), if it is a listening Unix stream. */
static int server_inherited_socket(void)
{
	const char *pid = getenv("LISTEN_PID"), *fds = getenv("LISTEN_FDS");
	if (!pid || !fds || strtol(pid, NULL, 10) != (long)getpid() || strtol(fds, NULL, 10) < 1)
		return -1;
	int fd = 3, type = 0, listening = 0;
	struct sockaddr_un addr;
	socklen_t len = sizeof(type), alen = sizeof(addr);
	if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) || type != SOCK_STREAM)
		return -1;
	len = sizeof(listening);
	if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) || !listening)
		return -1;
	if (getsockname(fd, (struct sockaddr *)&addr, &alen) || addr.sun_family != AF_UNIX)
		return -1;
	unsetenv("LISTEN_PID");
	unsetenv("LISTEN_FDS");
	unsetenv("LISTEN_FDNAMES");
	return fd;
}

static int server_socket_permissions(const struct config *cfg)
{
	if (chmod(cfg->socket, (mode_t)cfg->socket_mode) != 0) {
		log_error("event=listen_failed path=%s error=\"chmod: %s\"", cfg->socket,
			  strerror(errno));
		return -1;
	}
	if (!cfg->socket_group[0])
		return 0;
	struct group *gr = getgrnam(cfg->socket_group);
	if (!gr || chown(cfg->socket, (uid_t)-1, gr->gr_gid) != 0) {
		log_error("event=listen_failed path=%s error=\"cannot give the socket to group %s\"",
			  cfg->socket, cfg->socket_group);
		return -1;
	}
	return 0;
}

/* Binds the configured path; refuses to steal it from a live daemon. */
static int server_bind_socket(const struct config *cfg)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	if (strlen(cfg->socket) >= sizeof(addr.sun_path)) {
		log_error("event=listen_failed path=%s error=\"path too long\"", cfg->socket);
		return -1;
	}
	strcpy(addr.sun_path, cfg->socket);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) == 0) {
		log_error("event=listen_failed path=%s error=\"another daemon is listening there\"",
			  cfg->socket);
		close(fd);
		return -1;
	}
	unlink(cfg->socket);
	mode_t old_mask = umask(0177); /* no window with a too-open socket */
	int rc = bind(fd, (struct sockaddr *)&addr, sizeof(addr));
	umask(old_mask);
	if (rc != 0 || listen(fd, 512) != 0) {
		log_error("event=listen_failed path=%s error=\"%s\"", cfg->socket,
			  strerror(errno));
		close(fd);
		return -1;
	}
	if (server_socket_permissions(cfg) != 0) {
		close(fd);
		unlink(cfg->socket);
		return -1;
	}
	return fd;
}

/* ---- accepting ------------------------------------------------------------------ */

static bool id_allowed(const uint32_t *ids, int count, uint32_t id)
{
	for (int i = 0; i < count; i++) {
		if (ids[i] == id)
			return true;
	}
	return false;
}

/* True if one of the peer's supplementary groups (SO_PEERGROUPS) is allowed. */
static bool server_peer_groups_allowed(const struct server *srv, int fd)
{
	gid_t groups[256];
	socklen_t len = sizeof(groups);
	if (srv->allowed_gid_count <= 0 ||
	    getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) != 0)
		return false;
	for (size_t i = 0; i < len / sizeof(gid_t); i++) {
		if (id_allowed(srv->allowed_gids, srv->allowed_gid_count, groups[i]))
			return true;
	}
	return false;
}

/* Allowed: no lists, or the uid, the primary gid or a supplementary gid is listed. */
static bool server_peer_allowed(const struct server *srv, int fd, const struct ucred *cred)
{
	if (srv->allowed_uid_count <= 0 && srv->allowed_gid_count <= 0)
		return true;
	return id_allowed(srv->allowed_uids, srv->allowed_uid_count, cred->uid) ||
	       id_allowed(srv->allowed_gids, srv->allowed_gid_count, cred->gid) ||
	       server_peer_groups_allowed(srv, fd);
}

/* Answers a connection we will not serve with one Result frame, then closes it. */
static void server_refuse(int fd, int status, const char *message)
{
	Normd__Result result = NORMD__RESULT__INIT;
	result.status = nc__status_to_wire(status);
	result.message = (char *)message;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_RESULT;
	env.result = &result;
	uint8_t *frame;
	size_t len;
	if (nc__frame_pack(&env, UINT32_MAX, &frame, &len) == 0) {
		ssize_t ignored = send(fd, frame, len, MSG_NOSIGNAL | MSG_DONTWAIT);
		(void)ignored;
		nc__free(frame);
	}
	close(fd);
}

static void server_accept_one(struct server *srv, int fd)
{
	struct ucred cred = {0};
	socklen_t len = sizeof(cred);
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
		close(fd);
		return;
	}
	if (!server_peer_allowed(srv, fd, &cred)) {
		log_warn("event=refused pid=%d uid=%d gid=%d reason=\"uid/gid not allowed\"",
			 (int)cred.pid, (int)cred.uid, (int)cred.gid);
		stats_count_rejection(srv, NC_REJECT_PEER_NOT_ALLOWED);
		server_refuse(fd, NC_EINVALID_ARGUMENT,
			      "permission denied: this uid/gid is not in allow_uid/allow_gid");
		return;
	}
	if (srv->client_count >= srv->cfg->max_clients) {
		log_warn("event=refused pid=%d uid=%d reason=\"max_clients reached\"", (int)cred.pid,
			 (int)cred.uid);
		stats_count_rejection(srv, NC_REJECT_LIMIT_CLIENTS);
		server_refuse(fd, NC_ERESOURCE_EXHAUSTED, "max_clients reached; try again later");
		return;
	}
	if (client_create(srv, fd, cred.pid, cred.uid, cred.gid) != 0) {
		log_warn("event=alloc_failed pid=%d uid=%d what=client "
			 "reason=\"out of memory for a new client; refused\"",
			 (int)cred.pid, (int)cred.uid);
		stats_count_rejection(srv, NC_REJECT_OUT_OF_MEMORY);
		server_refuse(fd, NC_ERESOURCE_EXHAUSTED, "out of memory for a new client");
		return;
	}
	log_info("event=accept client=%llu pid=%d uid=%d gid=%d",
		 (unsigned long long)srv->next_client_id, (int)cred.pid, (int)cred.uid,
		 (int)cred.gid);
}

static void server_on_listen(uv_poll_t *handle, int status, int events)
{
	struct server *srv = handle->data;
	(void)events;
	if (status < 0 || srv->draining)
		return;
	for (int i = 0; i < 64; i++) {
		int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
				log_warn("event=accept_failed error=\"%s\"", strerror(errno));
			return;
		}
		server_accept_one(srv, fd);
	}
}

/* ---- the loop's housekeeping ------------------------------------------------------- */

/*
 * While jobs run on a backend that asks for it, and for loop_spin_us after
 * the last one arrived, the loop does not sleep: each iteration drains the
 * completion queue and polls the sockets without blocking, so a finished job
 * is answered, and a client's next request read, without a wake-up (tens of
 * microseconds on a VM). A client's send that wakes a sleeping loop pays for
 * the wake-up itself, several times the send's own cost: a training step's
 * jobs come a few hundred microseconds apart. Costs one core while clients
 * send jobs.
 */
static void server_poll_completions(uv_idle_t *handle)
{
	struct server *srv = handle->data;
	job_drain_completions(&srv->completion_async);
	uint64_t linger_ns = srv->cfg->loop_spin_us * 1000;
	if (srv->jobs_in_flight == 0 && stats_now_ns() - srv->last_job_ns > linger_ns) {
		/* From here workers wake the loop again; take what came meanwhile. */
		atomic_store(&srv->loop_polling, false);
		uv_idle_stop(handle);
		job_drain_completions(&srv->completion_async);
	}
}

void server_job_started(struct server *srv, uint64_t now_ns)
{
	if (!srv->backend->poll_completions)
		return; /* last_job_ns only times the polling below */
	srv->last_job_ns = now_ns ? now_ns : stats_now_ns();
	if (!uv_is_active((uv_handle_t *)&srv->completion_poll)) {
		uv_idle_start(&srv->completion_poll, server_poll_completions);
		atomic_store(&srv->loop_polling, true);
	}
}

/* Client buffers freed past this go back to the system (malloc_trim) before the next poll. */
#define SERVER_TRIM_BYTES (4u << 20)

/*
 * Many small replies freed leave the heap fragmented, and glibc gives back
 * only its top on its own: without this, the memory of clients that flooded
 * and left stayed in the daemon's RSS. Trims once `least` bytes of client
 * buffers have been freed since the last trim.
 */
static void server_trim(struct server *srv, size_t least)
{
	if (srv->freed_since_trim == 0 || srv->freed_since_trim < least)
		return;
	srv->freed_since_trim = 0;
	malloc_trim(0);
}

static void server_reap(uv_prepare_t *handle)
{
	struct server *srv = handle->data;
	client_flush_pending(srv); /* the replies of this iteration, one send per connection */
	struct client *c = srv->clients;
	while (c) {
		struct client *next = c->next;
		client_try_free(c);
		c = next;
	}
	server_trim(srv, SERVER_TRIM_BYTES);
}

static void server_sweep_deadlines(uv_timer_t *timer)
{
	struct server *srv = timer->data;
	uint64_t now = stats_now_ns();
	for (struct client *c = srv->clients; c; c = c->next)
		client_check_deadlines(c, now);
	server_trim(srv, 1); /* what the reaper's threshold left, at most a sweep late */
}

/*
 * One timer checks every client's deadlines, a quarter of the shorter
 * deadline apart (10 ms to 1 s): a connection is closed at most that late.
 */
static void server_start_sweep(struct server *srv)
{
	uint64_t shorter = srv->cfg->hello_timeout_ms < srv->cfg->frame_timeout_ms
				   ? srv->cfg->hello_timeout_ms
				   : srv->cfg->frame_timeout_ms;
	uint64_t every = shorter / 4;
	every = every < 10 ? 10 : every > 1000 ? 1000 : every;
	uv_timer_start(&srv->deadline_timer, server_sweep_deadlines, every, every);
}

static void server_close_handle(uv_handle_t *handle)
{
	if (!uv_is_closing(handle))
		uv_close(handle, NULL);
}

/* Closes every handle so that uv_run() returns. */
static void server_shutdown(struct server *srv)
{
	if (srv->stopped)
		return;
	srv->stopped = true;
	for (struct client *c = srv->clients; c; c = c->next)
		client_close(c, "daemon shutting down");
	server_close_handle((uv_handle_t *)&srv->listen_poll);
	server_close_handle((uv_handle_t *)&srv->sig_term);
	server_close_handle((uv_handle_t *)&srv->sig_int);
	/* Workers may still post completions; the async handle lives on, unreferenced. */
	uv_unref((uv_handle_t *)&srv->completion_async);
	server_close_handle((uv_handle_t *)&srv->drain_timer);
	server_close_handle((uv_handle_t *)&srv->deadline_timer);
	server_close_handle((uv_handle_t *)&srv->estream_timer);
	server_close_handle((uv_handle_t *)&srv->reaper);
	atomic_store(&srv->loop_polling, false); /* completions wake the loop again */
	server_close_handle((uv_handle_t *)&srv->completion_poll);
	notify_stop(srv);
}

void server_drain_check(struct server *srv)
{
	if (!srv->draining || srv->stopped || srv->jobs_in_flight > 0)
		return;
	for (struct client *c = srv->clients; c; c = c->next) {
		if (!c->closing && (c->out_head || c->mapping))
			return; /* replies still on their way, or a registration */
	}
	log_info("event=drained");
	server_shutdown(srv);
}

static void server_on_drain_timeout(uv_timer_t *timer)
{
	struct server *srv = timer->data;
	log_error("event=drain_timeout jobs_in_flight=%u", srv->jobs_in_flight);
	srv->exit_code = 1;
	server_shutdown(srv);
}

static void server_stop_listening(struct server *srv)
{
	server_close_handle((uv_handle_t *)&srv->listen_poll);
	close(srv->listen_fd);
	srv->listen_fd = -1;
	if (!srv->listen_fd_inherited)
		unlink(srv->cfg->socket);
}

/* Stops taking work, tells every client why, and waits for jobs in flight. */
static void server_begin_drain(struct server *srv, int status, const char *why)
{
	srv->draining = true;
	notify_stopping(srv);
	server_stop_listening(srv);
	for (struct client *c = srv->clients; c; c = c->next)
		reply_go_away(c, status, why);
	uv_timer_start(&srv->drain_timer, server_on_drain_timeout, srv->cfg->drain_timeout_ms, 0);
	server_drain_check(srv);
}

static void server_on_signal(uv_signal_t *handle, int signum)
{
	struct server *srv = handle->data;
	if (srv->draining)
		return;
	log_info("event=drain signal=%d jobs_in_flight=%u clients=%u", signum, srv->jobs_in_flight,
		 srv->client_count);
	server_begin_drain(srv, NC_ESHUTTING_DOWN, "the daemon is shutting down");
}

void server_fail(struct server *srv, const char *why)
{
	if (srv->exit_code != 0)
		return;
	log_error("event=fatal error=\"%s\" action=\"failing all jobs and exiting for a restart\"",
		  why);
	srv->exit_code = 1;
	if (!srv->draining)
		server_begin_drain(srv, NC_EDEVICE_ERROR, why);
}

/* ---- start and run -------------------------------------------------------------- */

/* The test hook's allocation has just failed (any thread; log_msg does not allocate). */
static void server_on_injected_failure(uint64_t n)
{
	log_warn("event=test_alloc_failure_injected n=%llu", (unsigned long long)n);
}

static int server_init_access(struct server *srv)
{
	srv->allowed_uid_count = config_parse_ids(srv->cfg->allow_uid, srv->allowed_uids,
						  CONFIG_MAX_IDS);
	srv->allowed_gid_count = config_parse_ids(srv->cfg->allow_gid, srv->allowed_gids,
						  CONFIG_MAX_IDS);
	if (srv->allowed_uid_count < 0 || srv->allowed_gid_count < 0) {
		log_error("event=bad_config error=\"allow_uid/allow_gid must be comma-separated "
			  "numbers (at most %d)\"",
			  CONFIG_MAX_IDS);
		return -1;
	}
	return 0;
}

static int server_init_handles(struct server *srv)
{
	uv_loop_t *loop = srv->loop;
	if (uv_async_init(loop, &srv->completion_async, job_drain_completions) ||
	    uv_poll_init(loop, &srv->listen_poll, srv->listen_fd) ||
	    uv_signal_init(loop, &srv->sig_term) || uv_signal_init(loop, &srv->sig_int) ||
	    uv_prepare_init(loop, &srv->reaper) || uv_timer_init(loop, &srv->drain_timer) ||
	    uv_idle_init(loop, &srv->completion_poll) || uv_timer_init(loop, &srv->estream_timer) ||
	    uv_timer_init(loop, &srv->deadline_timer))
		return -1;
	srv->estream_timer.data = srv->deadline_timer.data = srv;
	srv->completion_poll.data = srv;
	srv->completion_async.data = srv->listen_poll.data = srv->sig_term.data = srv;
	srv->sig_int.data = srv->reaper.data = srv->drain_timer.data = srv;
	uv_poll_start(&srv->listen_poll, UV_READABLE, server_on_listen);
	uv_signal_start(&srv->sig_term, server_on_signal, SIGTERM);
	uv_signal_start(&srv->sig_int, server_on_signal, SIGINT);
	uv_prepare_start(&srv->reaper, server_reap);
	server_start_sweep(srv);
	return 0;
}

int server_run(const struct config *cfg, struct backend *backend)
{
	static struct server srv;
	memset(&srv, 0, sizeof(srv));
	srv.loop = uv_default_loop();
	srv.cfg = cfg;
	srv.backend = backend;
	srv.start_ns = stats_now_ns();
	server_instance = &srv;
	if (server_init_access(&srv))
		return 1;
	srv.listen_fd = server_inherited_socket();
	srv.listen_fd_inherited = srv.listen_fd >= 0;
	if (srv.listen_fd < 0)
		srv.listen_fd = server_bind_socket(cfg);
	if (srv.listen_fd < 0)
		return 1;
	if (server_init_handles(&srv)) {
		log_error("event=init_failed error=\"libuv handles\"");
		return 1;
	}
	log_info("event=listening path=%s inherited=%s backend=%s pid=%d", cfg->socket,
		 srv.listen_fd_inherited ? "yes" : "no", backend->name, (int)getpid());
	/* READY=1 goes out only now: the socket accepts and the backend is up. */
	if (notify_start(&srv)) {
		log_error("event=init_failed error=\"libuv timers\"");
		return 1;
	}
	if (server_test_fail_alloc) {
		log_warn("event=test_alloc_failure_armed n=%llu",
			 (unsigned long long)server_test_fail_alloc);
		nc__alloc_fail_after(server_test_fail_alloc, server_on_injected_failure);
	}
	uv_run(srv.loop, UV_RUN_DEFAULT);
	/* Workers finish what they hold; answer (to nobody) and free it. */
	backend->destroy(backend);
	srv.backend = NULL;
	job_drain_completions(&srv.completion_async);
	uv_close((uv_handle_t *)&srv.completion_async, NULL);
	uv_run(srv.loop, UV_RUN_DEFAULT);
	while (srv.clients && client_try_free(srv.clients))
		;
	uv_loop_close(srv.loop);
	notify_close();
	log_info("event=exit code=%d", srv.exit_code);
	return srv.exit_code;
}
