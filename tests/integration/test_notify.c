/*
 * sd_notify: started the way systemd starts a Type=notify service (with
 * $NOTIFY_SOCKET naming a datagram socket this test listens on), normd sends
 * READY=1 only once its socket accepts: a connection made the moment READY=1
 * arrives is answered. Then come STATUS= lines a person can read, updated
 * while it works; WATCHDOG=1 at half $WATCHDOG_USEC when $WATCHDOG_PID names
 * it (and none when it names another process); STOPPING=1 when SIGTERM starts
 * the drain. The abstract '@name' form works too, and a daemon that cannot
 * bind its socket never says READY=1.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "normclient.h"
#include "tests/support/testlib.h"

/* What the daemon's environment says about its supervisor. */
struct supervisor {
	const char *notify_socket; /* $NOTIFY_SOCKET; a '@' name is abstract */
	const char *watchdog_usec; /* $WATCHDOG_USEC, or NULL */
	const char *watchdog_pid;  /* $WATCHDOG_PID; "self": the daemon's own pid */
	const char *socket;	   /* --socket instead of the private one */
};

static int64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A bound datagram socket at `name` (a path, or '@' + an abstract name). */
static int notify_listen(const char *name)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	size_t len = strlen(name);
	assert_true(len < sizeof(addr.sun_path));
	memcpy(addr.sun_path, name, len);
	if (name[0] == '@')
		addr.sun_path[0] = '\0';
	int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	assert_true(fd >= 0);
	socklen_t alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len);
	assert_int_equal(bind(fd, (struct sockaddr *)&addr, alen), 0);
	return fd;
}

/* One notification within timeout_ms, NUL-terminated in buf; false on timeout. */
static bool notify_recv(int fd, char *buf, size_t len, int timeout_ms)
{
	struct pollfd pfd = {.fd = fd, .events = POLLIN};
	if (poll(&pfd, 1, timeout_ms) <= 0)
		return false;
	ssize_t n = recv(fd, buf, len - 1, 0);
	if (n < 0)
		return false;
	buf[n] = '\0';
	return true;
}

/* Waits for a notification containing `needle`; false after timeout_ms. */
static bool notify_expect(int fd, const char *needle, int timeout_ms, char *buf, size_t len)
{
	int64_t deadline = now_ms() + timeout_ms;
	for (int64_t left; (left = deadline - now_ms()) > 0;) {
		if (!notify_recv(fd, buf, len, (int)left))
			return false;
		if (strstr(buf, needle))
			return true;
	}
	return false;
}

/* Starts normd --device cpu under `sup`, filling d so test_daemon_stop() cleans up. */
static void spawn_supervised(struct test_daemon *d, const struct supervisor *sup)
{
	memset(d, 0, sizeof(*d));
	snprintf(d->dir, sizeof(d->dir), "/tmp/normd-notify.XXXXXX");
	assert_non_null(mkdtemp(d->dir));
	snprintf(d->socket, sizeof(d->socket), "%s/normd.sock", d->dir);
	snprintf(d->log, sizeof(d->log), "%s/normd.log", d->dir);
	const char *bin = getenv("NORMD_BIN") ? getenv("NORMD_BIN") : "build/bin/normd";
	const char *sock = sup->socket ? sup->socket : d->socket;
	d->pid = fork();
	assert_true(d->pid >= 0);
	if (d->pid > 0)
		return;
	int log = open(d->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	if (log >= 0)
		dup2(log, STDERR_FILENO);
	char pid[32];
	snprintf(pid, sizeof(pid), "%d", (int)getpid());
	setenv("NOTIFY_SOCKET", sup->notify_socket, 1);
	if (sup->watchdog_usec)
		setenv("WATCHDOG_USEC", sup->watchdog_usec, 1);
	if (sup->watchdog_pid)
		setenv("WATCHDOG_PID", strcmp(sup->watchdog_pid, "self") ? sup->watchdog_pid : pid,
		       1);
	execl(bin, bin, "--config", "/dev/null", "--device", "cpu", "--socket", sock, "--log-level",
	      "debug", (char *)NULL);
	_exit(127);
}

static void test_ready_status_stopping(void **state)
{
	(void)state;
	struct test_daemon d;
	char path[128], msg[1024];
	snprintf(path, sizeof(path), "/tmp/normd-notify-%d.sock", (int)getpid());
	unlink(path);
	int nfd = notify_listen(path);
	struct supervisor sup = {.notify_socket = path};
	spawn_supervised(&d, &sup);

	/* The first message is READY=1, and the socket answers at that very moment. */
	assert_true(notify_recv(nfd, msg, sizeof(msg), 10000));
	assert_non_null(strstr(msg, "READY=1"));
	int probe = raw_connect(d.socket);
	assert_true(probe >= 0);
	assert_int_equal(raw_hello(probe), 0);
	close(probe);
	assert_non_null(strstr(msg, "STATUS=CPU backend (host memory): ready"));

	/* Work shows up in the next STATUS= update (every 2 s). */
	nc_conn *conn;
	assert_int_equal(nc_connect(d.socket, "notify-test", 5000, &conn), NC_OK);
	assert_true(good_client_works(d.socket));
	bool seen = false;
	int64_t deadline = now_ms() + 6000;
	while (!seen && now_ms() < deadline) {
		if (!notify_expect(nfd, "STATUS=", 6000, msg, sizeof(msg)))
			break;
		seen = strstr(msg, "1 clients") && strstr(msg, "jobs/s") && strstr(msg, "2 done");
	}
	if (!seen)
		fprintf(stderr, "last notification: %s\n", msg);
	assert_true(seen);
	nc_close(conn);

	/* SIGTERM: STOPPING=1 as the drain begins, then a clean exit. */
	assert_int_equal(kill(d.pid, SIGTERM), 0);
	assert_true(notify_expect(nfd, "STOPPING=1", 5000, msg, sizeof(msg)));
	/* A second SIGTERM (test_daemon_stop's) could land after the handlers are gone. */
	for (int i = 0; i < 1000 && test_daemon_alive(&d); i++)
		usleep(10000);
	assert_false(test_daemon_alive(&d));
	assert_int_equal(test_daemon_stop(&d), 0);
	close(nfd);
	unlink(path);
}

static void test_abstract_socket_and_watchdog(void **state)
{
	(void)state;
	struct test_daemon d;
	char name[64], msg[1024];
	snprintf(name, sizeof(name), "@normd-notify-test-%d", (int)getpid());
	int nfd = notify_listen(name);
	struct supervisor sup = {
	    .notify_socket = name, .watchdog_usec = "200000", .watchdog_pid = "self"};
	spawn_supervised(&d, &sup);
	assert_true(notify_expect(nfd, "READY=1", 10000, msg, sizeof(msg)));
	/* Pings every 100 ms: at least five in a second. */
	int pings = 0;
	int64_t deadline = now_ms() + 1000;
	while (now_ms() < deadline) {
		if (notify_recv(nfd, msg, sizeof(msg), 200) && strstr(msg, "WATCHDOG=1"))
			pings++;
	}
	fprintf(stderr, "%d watchdog pings in 1 s\n", pings);
	assert_true(pings >= 5);
	assert_int_equal(test_daemon_stop(&d), 0);
	close(nfd);
}

static void test_watchdog_meant_for_another_process(void **state)
{
	(void)state;
	struct test_daemon d;
	char name[64], msg[1024];
	snprintf(name, sizeof(name), "@normd-notify-other-%d", (int)getpid());
	int nfd = notify_listen(name);
	struct supervisor sup = {
	    .notify_socket = name, .watchdog_usec = "100000", .watchdog_pid = "1"};
	spawn_supervised(&d, &sup);
	assert_true(notify_expect(nfd, "READY=1", 10000, msg, sizeof(msg)));
	assert_false(notify_expect(nfd, "WATCHDOG=1", 600, msg, sizeof(msg)));
	assert_int_equal(test_daemon_stop(&d), 0);
	close(nfd);
}

static void test_no_ready_when_the_socket_cannot_be_bound(void **state)
{
	(void)state;
	struct test_daemon d;
	char name[64], msg[1024];
	snprintf(name, sizeof(name), "@normd-notify-fail-%d", (int)getpid());
	int nfd = notify_listen(name);
	struct supervisor sup = {.notify_socket = name,
				 .socket = "/nonexistent-normd-dir/normd.sock"};
	spawn_supervised(&d, &sup);
	int status;
	assert_int_equal(waitpid(d.pid, &status, 0), d.pid);
	d.pid = 0;
	assert_true(WIFEXITED(status) && WEXITSTATUS(status) != 0);
	assert_false(notify_expect(nfd, "READY=1", 200, msg, sizeof(msg)));
	test_daemon_stop(&d);
	close(nfd);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_ready_status_stopping),
	    cmocka_unit_test(test_abstract_socket_and_watchdog),
	    cmocka_unit_test(test_watchdog_meant_for_another_process),
	    cmocka_unit_test(test_no_ready_when_the_socket_cannot_be_bound),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
