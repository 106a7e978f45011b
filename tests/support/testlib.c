/*
 * Test support (see testlib.h).
 */
#include "tests/support/testlib.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "proto/frame.h"

static void sleep_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

/* Removes the daemon's private directory and the files in it. */
static void remove_dir(const char *dir)
{
	DIR *dp = opendir(dir);
	struct dirent *e;
	char path[512];
	while (dp && (e = readdir(dp))) {
		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		unlink(path);
	}
	if (dp)
		closedir(dp);
	rmdir(dir);
}

int test_daemon_start(struct test_daemon *d, const char *const *extra)
{
	return test_daemon_start_on(d, "cpu", extra);
}

int test_daemon_start_on(struct test_daemon *d, const char *device, const char *const *extra)
{
	memset(d, 0, sizeof(*d));
	snprintf(d->dir, sizeof(d->dir), "/tmp/normd-test.XXXXXX");
	if (!mkdtemp(d->dir))
		return -1;
	snprintf(d->socket, sizeof(d->socket), "%s/normd.sock", d->dir);
	snprintf(d->log, sizeof(d->log), "%s/normd.log", d->dir);
	const char *bin = getenv("NORMD_BIN") ? getenv("NORMD_BIN") : "build/bin/normd";
	/* --config /dev/null: an installed /etc/normd/normd.conf must not change the tests. */
	const char *argv[64] = {bin, "--config", "/dev/null", "--device", device, "--socket",
				d->socket, "--log-level", "debug", "--state-dir", d->dir};
	int argc = 11;
	for (int i = 0; extra && extra[i] && argc < 63; i++)
		argv[argc++] = extra[i];
	argv[argc] = NULL;
	d->pid = fork();
	if (d->pid < 0)
		return -1;
	if (d->pid == 0) {
		/* A test killed by its timeout must not leave its daemon behind. */
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		int log = open(d->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		if (log >= 0)
			dup2(log, STDERR_FILENO);
		execv(bin, (char *const *)argv);
		_exit(127);
	}
	/*
	 * Up to 30 s: a daemon under valgrind starts slowly. The socket file
	 * appears at bind(), before listen() and before the signal handlers
	 * exist; "event=listening" is logged once both do.
	 */
	for (int i = 0; i < 3000; i++) {
		struct stat st;
		if (stat(d->socket, &st) == 0 && S_ISSOCK(st.st_mode) &&
		    test_daemon_log_contains(d, "event=listening"))
			return 0;
		if (!test_daemon_alive(d))
			break;
		sleep_ms(10);
	}
	test_daemon_dump_log(d);
	test_daemon_stop(d);
	return -1;
}

int test_read_within(int fd, void *buf, size_t len, int timeout_ms)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	int64_t deadline_ms = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + timeout_ms;
	size_t got = 0;
	while (got < len) {
		clock_gettime(CLOCK_MONOTONIC, &ts);
		int64_t left = deadline_ms - ((int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (left <= 0)
			return -1;
		int n = poll(&p, 1, (int)left);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -1;
		ssize_t r = read(fd, (char *)buf + got, len - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		got += (size_t)r;
	}
	return 0;
}

bool test_daemon_alive(struct test_daemon *d)
{
	if (d->pid <= 0 || d->exited)
		return false;
	if (waitpid(d->pid, &d->wait_status, WNOHANG) == d->pid) {
		d->exited = true;
		return false;
	}
	return true;
}

int test_daemon_stop(struct test_daemon *d)
{
	int status = 0;
	if (d->exited) {
		status = d->wait_status;
	} else if (d->pid > 0) {
		kill(d->pid, SIGTERM);
		int waited = 0;
		while (waitpid(d->pid, &status, WNOHANG) == 0) {
			if (++waited > 1500) { /* 15 s */
				kill(d->pid, SIGKILL);
				waitpid(d->pid, &status, 0);
				status = -1;
				break;
			}
			sleep_ms(10);
		}
	}
	d->pid = 0;
	remove_dir(d->dir);
	if (status == -1)
		return -1;
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void test_daemon_dump_log(const struct test_daemon *d)
{
	FILE *f = fopen(d->log, "r");
	char line[1024];
	if (!f)
		return;
	fprintf(stderr, "---- normd log ----\n");
	while (fgets(line, sizeof(line), f))
		fputs(line, stderr);
	fprintf(stderr, "-------------------\n");
	fclose(f);
}

bool test_daemon_log_contains(const struct test_daemon *d, const char *needle)
{
	FILE *f = fopen(d->log, "r");
	char line[2048];
	bool found = false;
	if (!f)
		return false;
	while (!found && fgets(line, sizeof(line), f))
		found = strstr(line, needle) != NULL;
	fclose(f);
	return found;
}

int test_daemon_fd_count(const struct test_daemon *d)
{
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/fd", (int)d->pid);
	DIR *dir = opendir(path);
	if (!dir)
		return -1;
	int count = 0;
	for (struct dirent *e; (e = readdir(dir));)
		count += e->d_name[0] != '.';
	closedir(dir);
	return count;
}

int raw_connect(const char *socket_path)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", socket_path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
		close(fd);
		return -1;
	}
	return fd;
}

int raw_write(int fd, const void *bytes, size_t len)
{
	const char *p = bytes;
	while (len > 0) {
		ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -1;
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

int test_memfd(size_t bytes, unsigned flags)
{
	int fd = memfd_create("normd-test", MFD_CLOEXEC | flags);
	if (fd >= 0 && ftruncate(fd, (off_t)bytes) != 0) {
		close(fd);
		fd = -1;
	}
	return fd;
}

void raw_register_init(Normd__Envelope *env, Normd__RegisterRegion *reg, uint64_t request_id,
		       uint64_t region_id, uint64_t size)
{
	normd__register_region__init(reg);
	reg->region_id = region_id;
	reg->kind = NORMD__REGION_KIND__HOST_MEMFD;
	reg->size = size;
	normd__envelope__init(env);
	env->has_request_id = true;
	env->request_id = request_id;
	env->body_case = NORMD__ENVELOPE__BODY_REGISTER_REGION;
	env->register_region = reg;
}

void raw_ping_init(Normd__Envelope *env, Normd__Ping *ping, uint64_t request_id)
{
	normd__ping__init(ping);
	normd__envelope__init(env);
	env->has_request_id = true;
	env->request_id = request_id;
	env->body_case = NORMD__ENVELOPE__BODY_PING;
	env->ping = ping;
}

int raw_send(int fd, Normd__Envelope *env)
{
	uint8_t *frame;
	size_t len;
	if (nc__frame_pack(env, UINT32_MAX, &frame, &len))
		return -1;
	int rc = raw_write(fd, frame, len);
	nc__free(frame);
	return rc;
}

int raw_send_with_fds(int fd, Normd__Envelope *env, const int *pass_fds, unsigned count)
{
	enum { MAX_FDS = 253 }; /* SCM_MAX_FD: what one sendmsg may carry */
	if (count == 0 || count > MAX_FDS)
		return -1;
	uint8_t *frame;
	size_t len;
	if (nc__frame_pack(env, UINT32_MAX, &frame, &len))
		return -1;
	union {
		char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
		struct cmsghdr align;
	} control;
	struct iovec iov = {.iov_base = frame, .iov_len = len};
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
			     .msg_controllen = CMSG_SPACE(sizeof(int) * count)};
	struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int) * count);
	memcpy(CMSG_DATA(cm), pass_fds, sizeof(int) * count);
	ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
	int rc = n < 0 ? -1 : raw_write(fd, frame + n, len - (size_t)n);
	nc__free(frame);
	return rc;
}

int raw_send_with_fd(int fd, Normd__Envelope *env, int pass_fd)
{
	return raw_send_with_fds(fd, env, &pass_fd, 1);
}

int raw_pack_into(Normd__Envelope *env, uint8_t *buf, size_t cap, size_t *len)
{
	uint8_t *frame;
	size_t frame_len;
	if (nc__frame_pack(env, UINT32_MAX, &frame, &frame_len))
		return -1;
	int rc = -1;
	if (frame_len <= cap - *len) {
		memcpy(buf + *len, frame, frame_len);
		*len += frame_len;
		rc = 0;
	}
	nc__free(frame);
	return rc;
}

Normd__Envelope *raw_hello_reply(int fd)
{
	Normd__Hello hello = NORMD__HELLO__INIT;
	hello.protocol_version = NORMD__PROTOCOL_VERSION__PROTOCOL_VERSION;
	hello.client_name = "raw-test";
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = 1;
	env.body_case = NORMD__ENVELOPE__BODY_HELLO;
	env.hello = &hello;
	if (raw_send(fd, &env))
		return NULL;
	Normd__Envelope *reply = raw_recv(fd, 5000);
	if (reply && reply->body_case != NORMD__ENVELOPE__BODY_HELLO_REPLY) {
		nc__envelope_free(reply);
		return NULL;
	}
	return reply;
}

int raw_hello(int fd)
{
	Normd__Envelope *reply = raw_hello_reply(fd);
	int rc = reply ? 0 : -1;
	nc__envelope_free(reply);
	return rc;
}

int raw_start(struct raw *r, const char *socket_path)
{
	r->fd = raw_connect(socket_path);
	r->next_id = 100;
	return r->fd >= 0 && raw_hello(r->fd) == 0 ? 0 : -1;
}

static int read_exact(int fd, uint8_t *buf, size_t len, int timeout_ms)
{
	size_t got = 0;
	while (got < len) {
		struct pollfd pfd = {.fd = fd, .events = POLLIN};
		if (poll(&pfd, 1, timeout_ms) <= 0)
			return -1;
		ssize_t n = recv(fd, buf + got, len - got, 0);
		if (n <= 0)
			return -1;
		got += (size_t)n;
	}
	return 0;
}

Normd__Envelope *raw_recv(int fd, int timeout_ms)
{
	uint8_t header[NC__FRAME_HEADER_BYTES];
	if (read_exact(fd, header, sizeof(header), timeout_ms))
		return NULL;
	uint32_t len = nc__frame_length(header);
	if (len > (1u << 24))
		return NULL;
	uint8_t *body = malloc(len ? len : 1);
	if (!body || read_exact(fd, body, len, timeout_ms)) {
		free(body);
		return NULL;
	}
	Normd__Envelope *env = nc__envelope_unpack(body, len, NULL);
	free(body);
	return env;
}

bool raw_closed(int fd, int timeout_ms)
{
	char buf[4096];
	for (;;) {
		struct pollfd pfd = {.fd = fd, .events = POLLIN};
		if (poll(&pfd, 1, timeout_ms) <= 0)
			return false;
		ssize_t n = recv(fd, buf, sizeof(buf), 0);
		if (n == 0 || (n < 0 && errno == ECONNRESET))
			return true;
		if (n < 0)
			return false;
	}
}

int test_run_checked(nc_conn *conn, const struct jobkit_spec *spec, int timeout_ms)
{
	struct jobkit kit;
	struct nc_job_result result = {0};
	struct jobkit_report report = {0};
	if (jobkit_create(conn, spec, &kit)) {
		fprintf(stderr, "%s: set-up failed: %s\n", jobkit_op_name(spec->op), nc_last_error());
		return -1;
	}
	int rc = nc_job_run_ext(conn, &kit.job, &kit.ext, timeout_ms, &result);
	bool ok = rc == NC_OK && jobkit_check(&kit, &report);
	char variants[64];
	if (!ok)
		fprintf(stderr, "%s%s %llux%llu (out %llu) dtype %d/%d me %d acc %d: %s (%s) %s\n",
			jobkit_op_name(spec->op), jobkit_variant_label(spec, variants, sizeof(variants)),
			(unsigned long long)spec->rows, (unsigned long long)spec->cols,
			(unsigned long long)spec->out_features, spec->dtype, spec->weight_dtype,
			spec->memory_efficient, spec->accumulate, nc_status_name(rc), result.message,
			report.detail);
	jobkit_destroy(&kit);
	return ok ? 0 : -1;
}

bool good_client_works(const char *socket_path)
{
	nc_conn *conn;
	if (nc_connect(socket_path, "good-client", 5000, &conn)) {
		fprintf(stderr, "good client: connect: %s\n", nc_last_error());
		return false;
	}
	struct jobkit_spec bwd = {.op = NC_LAYERNORM_BWD, .rows = 33, .cols = 257,
				  .dtype = NC_F32, .gamma = true, .beta = true, .seed = 7};
	struct jobkit_spec fwd = {.op = NC_RMSNORM_FWD, .rows = 17, .cols = 1000,
				  .dtype = NC_BF16, .gamma = true, .seed = 8};
	bool ok = test_run_checked(conn, &bwd, 30000) == 0 && test_run_checked(conn, &fwd, 30000) == 0;
	nc_close(conn);
	return ok;
}
