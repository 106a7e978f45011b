/*
 * Who may connect. The socket's mode is the first gate (0660 by default:
 * another user cannot even connect); --allow-uid / --allow-gid are the
 * second, checked against the peer's credentials (SO_PEERCRED, and the
 * supplementary groups from SO_PEERGROUPS) at accept: a refused peer gets
 * one Result naming the reason and a close, and is counted.
 *
 * The tests fork children that drop to an unprivileged uid (65534, "nobody"),
 * so they need root, which CI has; elsewhere they are skipped. Each daemon
 * here runs with --socket-mode 0666 (unless the test is about the mode) in a
 * temporary directory opened to 0755, so that the socket's reach is decided
 * by normd alone.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "normclient.h"
#include "proto/frame.h"
#include "tests/support/testlib.h"

#define NOBODY 65534
#define SPARE_GID 4242 /* a group nobody belongs to */

/* How a child's connection attempt ended (its exit status). */
enum outcome {
	SERVED = 10,  /* Hello answered, a job ran correctly */
	REFUSED = 11, /* a Result naming the allow lists, then a close */
	NO_ACCESS = 12, /* connect() itself failed with EACCES */
	CHILD_ERROR = 13,
};

/* The daemon of the running test; the teardown stops it even when the test failed. */
static struct test_daemon current;

static struct test_daemon *start(const char *const *extra)
{
	assert_int_equal(test_daemon_start(&current, extra), 0);
	assert_int_equal(chmod(current.dir, 0755), 0);
	return &current;
}

static void stop(struct test_daemon *d)
{
	assert_int_equal(test_daemon_stop(d), 0);
}

static int teardown(void **state)
{
	(void)state;
	if (current.pid > 0)
		test_daemon_stop(&current);
	return 0;
}

/* In a child: becomes uid/gid (with `group` as its one supplementary group) and connects. */
static int child_connect(const char *socket_path, uid_t uid, gid_t gid, gid_t group)
{
	if (setgroups(1, &group) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
		return CHILD_ERROR;
	if (getuid() != uid || geteuid() != uid)
		return CHILD_ERROR;
	/* Raw first: the refusal is one Result frame, then EOF. */
	int fd = raw_connect(socket_path);
	if (fd < 0)
		return errno == EACCES ? NO_ACCESS : CHILD_ERROR;
	Normd__Envelope *env = raw_recv(fd, 1000);
	if (env) {
		bool refused = env->body_case == NORMD__ENVELOPE__BODY_RESULT &&
			       env->result->status == NORMD__STATUS__INVALID_ARGUMENT &&
			       env->result->message &&
			       strstr(env->result->message, "not in allow_uid/allow_gid") &&
			       raw_closed(fd, 5000);
		nc__envelope_free(env);
		close(fd);
		if (!refused)
			return CHILD_ERROR;
		/* The library says the same. */
		nc_conn *conn = NULL;
		int rc = nc_connect(socket_path, "refused", 5000, &conn);
		if (rc != NC_EINVALID_ARGUMENT || !strstr(nc_last_error(), "permission denied"))
			return CHILD_ERROR;
		return REFUSED;
	}
	/* Nothing sent unasked: the peer is being served; prove it with a real job. */
	if (raw_hello(fd) != 0)
		return CHILD_ERROR;
	close(fd);
	return good_client_works(socket_path) ? SERVED : CHILD_ERROR;
}

static int run_child(const char *socket_path, uid_t uid, gid_t gid, gid_t group)
{
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0)
		_exit(child_connect(socket_path, uid, gid, group));
	int status;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	return WEXITSTATUS(status);
}

static uint64_t rejections(const char *socket_path, int reason)
{
	nc_conn *conn;
	struct nc_stats stats;
	assert_int_equal(nc_connect(socket_path, "stats", 5000, &conn), NC_OK);
	assert_int_equal(nc_stats_get(conn, 5000, &stats), NC_OK);
	nc_close(conn);
	return stats.rejections[reason];
}

static void skip_unless_root(void)
{
	if (geteuid() != 0) {
		fprintf(stderr, "not root: cannot switch uid to test access control\n");
		skip();
	}
}

/* The default mode 0660 (root:root here) keeps other users from connecting at all. */
static void test_socket_mode_gates(void **state)
{
	(void)state;
	skip_unless_root();
	struct test_daemon *d = start(NULL);
	struct stat st;
	assert_int_equal(stat(d->socket, &st), 0);
	assert_int_equal(st.st_mode & 0777, 0660);
	assert_int_equal(run_child(d->socket, NOBODY, NOBODY, NOBODY), NO_ACCESS);
	assert_true(good_client_works(d->socket));
	stop(d);
}

/* --allow-uid 0: nobody is refused (and counted); root is served. */
static void test_uid_not_allowed_is_refused(void **state)
{
	(void)state;
	skip_unless_root();
	static const char *const extra[] = {"--socket-mode", "0666", "--allow-uid", "0", NULL};
	struct test_daemon *d = start(extra);
	assert_int_equal(run_child(d->socket, NOBODY, NOBODY, NOBODY), REFUSED);
	/* The raw attempt and the library's attempt: two refusals. */
	assert_int_equal(rejections(d->socket, NC_REJECT_PEER_NOT_ALLOWED), 2);
	assert_true(test_daemon_log_contains(d, "event=refused"));
	assert_true(test_daemon_log_contains(d, "uid=65534"));
	assert_true(good_client_works(d->socket));
	stop(d);
}

/* --allow-uid 65534: nobody is served, and root, not listed, is refused. */
static void test_allowed_uid_is_served(void **state)
{
	(void)state;
	skip_unless_root();
	static const char *const extra[] = {"--socket-mode", "0666", "--allow-uid", "65534",
					    NULL};
	struct test_daemon *d = start(extra);
	assert_int_equal(run_child(d->socket, NOBODY, NOBODY, NOBODY), SERVED);
	assert_true(test_daemon_log_contains(d, "event=accept"));
	nc_conn *conn = NULL;
	assert_int_equal(nc_connect(d->socket, "root", 5000, &conn), NC_EINVALID_ARGUMENT);
	assert_non_null(strstr(nc_last_error(), "permission denied"));
	stop(d);
}

/* --allow-gid: the primary gid or any supplementary group of the peer counts. */
static void test_allowed_gid(void **state)
{
	(void)state;
	skip_unless_root();
	static const char *const extra[] = {"--socket-mode", "0666", "--allow-gid", "4242",
					    NULL};
	struct test_daemon *d = start(extra);
	assert_int_equal(run_child(d->socket, NOBODY, SPARE_GID, NOBODY), SERVED);
	assert_int_equal(run_child(d->socket, NOBODY, NOBODY, SPARE_GID), SERVED);
	assert_int_equal(run_child(d->socket, NOBODY, NOBODY, NOBODY), REFUSED);
	stop(d);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_teardown(test_socket_mode_gates, teardown),
		cmocka_unit_test_teardown(test_uid_not_allowed_is_refused, teardown),
		cmocka_unit_test_teardown(test_allowed_uid_is_served, teardown),
		cmocka_unit_test_teardown(test_allowed_gid, teardown),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
