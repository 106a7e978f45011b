/*
 * Test support: start and stop a real normd on a private socket, and talk
 * to it below the client library (raw frames) to send what a well-behaved
 * client never would. Used with cmocka.
 */
#ifndef NORMD_TESTLIB_H
#define NORMD_TESTLIB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "normd.pb-c.h"

struct test_daemon {
	pid_t pid;        /* 0 once reaped */
	bool exited;      /* it exited by itself; wait_status holds how */
	int wait_status;
	char dir[64];     /* private temporary directory */
	char socket[128]; /* its socket */
	char log[128];    /* its stderr */
};

/*
 * Starts build/bin/normd (or $NORMD_BIN) with --device cpu on a private
 * socket plus `extra` arguments (NULL-terminated, may be NULL) and waits
 * until it accepts. Returns 0 or -1.
 */
int test_daemon_start(struct test_daemon *d, const char *const *extra);
/* The same on `device` ("cpu", "0", "all"), with a private --state-dir. */
int test_daemon_start_on(struct test_daemon *d, const char *device, const char *const *extra);
/* True while the daemon process is alive. */
bool test_daemon_alive(struct test_daemon *d);
/* SIGTERM, wait; returns the exit status (or -1 if it had to be killed). */
int test_daemon_stop(struct test_daemon *d);
/* Prints the daemon's log to stderr (for failures). */
void test_daemon_dump_log(const struct test_daemon *d);
/* True if the daemon's log so far contains `needle`. */
bool test_daemon_log_contains(const struct test_daemon *d, const char *needle);
/* Open file descriptors of the daemon process (from /proc), or -1. */
int test_daemon_fd_count(const struct test_daemon *d);

/*
 * Reads exactly len bytes from fd within timeout_ms (a signal's EINTR is
 * retried); 0, or -1 on timeout, EOF or error. For results a child process
 * writes to a pipe.
 */
int test_read_within(int fd, void *buf, size_t len, int timeout_ms);

/* A memfd of `bytes` (memfd_create flags `flags` besides MFD_CLOEXEC), or -1. */
int test_memfd(size_t bytes, unsigned flags);
/* Makes `env` RegisterRegion request `request_id` (body `reg`) of a HOST_MEMFD region. */
void raw_register_init(Normd__Envelope *env, Normd__RegisterRegion *reg, uint64_t request_id,
		       uint64_t region_id, uint64_t size);

/* Makes `env` Ping request `request_id` (body `ping`). */
void raw_ping_init(Normd__Envelope *env, Normd__Ping *ping, uint64_t request_id);

/* Raw connection: returns a connected fd or -1. */
int raw_connect(const char *socket_path);
/* Writes all bytes; returns 0 or -1. */
int raw_write(int fd, const void *bytes, size_t len);
/* Packs and sends one envelope (request_id set by the caller). */
int raw_send(int fd, Normd__Envelope *env);
/* Like raw_send, with `pass_fd` attached by SCM_RIGHTS to the frame's first byte. */
int raw_send_with_fd(int fd, Normd__Envelope *env, int pass_fd);
/* The same with `count` fds (1 to 253, what one sendmsg carries). */
int raw_send_with_fds(int fd, Normd__Envelope *env, const int *pass_fds, unsigned count);
/* Appends one packed frame to buf (cap bytes, *len used); returns 0 or -1. */
int raw_pack_into(Normd__Envelope *env, uint8_t *buf, size_t cap, size_t *len);
/* Sends Hello (request id 1) and reads the HelloReply; returns 0 or -1. */
int raw_hello(int fd);
/* A raw connection that has said Hello, and the request id its next request takes. */
struct raw {
	int fd;
	uint64_t next_id;
};
/* Connects r to the daemon at socket_path and says Hello, next_id 100; returns 0 or -1. */
int raw_start(struct raw *r, const char *socket_path);
/*
 * The same, returning the whole reply (body HELLO_REPLY, with the devices the
 * public nc_server_info does not describe), or NULL. Free with nc__envelope_free().
 */
Normd__Envelope *raw_hello_reply(int fd);
/* Reads one envelope within timeout_ms; NULL on timeout, EOF or garbage. */
Normd__Envelope *raw_recv(int fd, int timeout_ms);
/* True if the peer closed the connection within timeout_ms (EOF seen). */
bool raw_closed(int fd, int timeout_ms);

struct jobkit_spec;
struct nc_conn;
/*
 * Creates the spec's job (jobkit, variants included), runs it, checks it
 * against the reference and prints what went wrong to stderr. Returns 0
 * when the result is right.
 */
int test_run_checked(struct nc_conn *conn, const struct jobkit_spec *spec, int timeout_ms);

/*
 * Runs one well-behaved client: connects, runs a LayerNorm backward and an
 * RMSNorm forward through the library and checks them against the reference.
 * Returns true when both were correct.
 */
bool good_client_works(const char *socket_path);

#endif /* NORMD_TESTLIB_H */
