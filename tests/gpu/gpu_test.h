/*
 * What the GPU test programs (tests/gpu/test_*.c) share: a CHECK that fails
 * the current check with a message, running a check in a child process
 * (every CUDA call happens in one: a process that has touched CUDA cannot
 * fork children that use it), a tally of checks, and asking a daemon for its
 * counters or waiting until it is idle. Header-only: each program is one
 * file plus the test support library.
 */
#ifndef NORMD_GPU_TEST_H
#define NORMD_GPU_TEST_H

#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "normclient.h"

/* Fails the enclosing check (returns 1) with a message when cond is false. */
#define CHECK(cond, ...)                                                                   \
	do {                                                                               \
		if (!(cond)) {                                                             \
			fprintf(stderr, "  check failed at line %d: %s: ", __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__);                                      \
			fprintf(stderr, "\n");                                             \
			return 1;                                                          \
		}                                                                          \
	} while (0)

static int gpu_tests_passed, gpu_tests_failed;

/* Ends a child process: _exit() skips stdio's flush, and stdout may be a file. */
static inline void child_exit(int status)
{
	fflush(NULL);
	_exit(status);
}

/* Runs fn in a child process; returns its exit status (0 = success). */
static inline int in_child(int (*fn)(void *), void *arg)
{
	fflush(NULL);
	pid_t pid = fork();
	if (pid < 0)
		return 127;
	if (pid == 0)
		child_exit(fn(arg));
	int status;
	if (waitpid(pid, &status, 0) != pid)
		return 127;
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/*
 * Runs fn(fd, arg) in a child process, where it writes `len` bytes to fd,
 * and reads them into buf. Returns 0, or -1 if the child failed or wrote
 * less. len must fit in a pipe's buffer (64 KiB), as the child writes
 * everything before this process reads.
 */
static inline int in_child_read(int (*fn)(int fd, void *arg), void *arg, void *buf, size_t len)
{
	int fds[2];
	if (pipe(fds) != 0)
		return -1;
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		close(fds[0]);
		child_exit(fn(fds[1], arg));
	}
	close(fds[1]);
	int status = 0;
	bool ok = pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
		  WEXITSTATUS(status) == 0 && read(fds[0], buf, len) == (ssize_t)len;
	close(fds[0]);
	return ok ? 0 : -1;
}

/* Device-wide free memory, read in a child so that the caller stays CUDA-free; -1 on failure. */
static inline int gpu_test_free_memory_child(int fd, void *arg)
{
	(void)arg;
	size_t free_b = 0, total = 0;
	if (cudaMemGetInfo(&free_b, &total) != cudaSuccess)
		return 1;
	unsigned long long v = free_b;
	return write(fd, &v, sizeof(v)) == sizeof(v) ? 0 : 1;
}

static inline long long device_free_bytes(void)
{
	unsigned long long v = 0;
	return in_child_read(gpu_test_free_memory_child, NULL, &v, sizeof(v)) == 0 ? (long long)v
										  : -1;
}

/* Prints one check's outcome and counts it. */
static inline void report(const char *name, int rc)
{
	printf("%-44s %s\n", name, rc == 0 ? "ok" : "FAILED");
	if (rc == 0)
		gpu_tests_passed++;
	else
		gpu_tests_failed++;
}

/* Prints "<program>: N passed, M failed"; returns the program's exit status. */
static inline int gpu_test_summary(const char *program)
{
	printf("%s: %d passed, %d failed\n", program, gpu_tests_passed, gpu_tests_failed);
	return gpu_tests_failed ? 1 : 0;
}

static inline nc_conn *gpu_test_connect(const char *socket_path, const char *name)
{
	nc_conn *conn = NULL;
	if (nc_connect(socket_path, name, 10000, &conn) != NC_OK)
		fprintf(stderr, "  connect: %s\n", nc_last_error());
	return conn;
}

/* The daemon's counters, on a connection of their own; 0 or a negative NC_E* code. */
static inline int gpu_test_stats(const char *socket_path, struct nc_stats *stats)
{
	nc_conn *conn = gpu_test_connect(socket_path, "stats");
	if (!conn)
		return -1;
	int rc = nc_stats_get(conn, 10000, stats);
	nc_close(conn);
	return rc;
}

/* Waits up to 10 s until the daemon holds no regions and runs no jobs; 0 or -1. */
static inline int gpu_test_wait_idle(const char *socket_path)
{
	struct nc_stats stats;
	for (int i = 0; i < 200; i++) {
		if (gpu_test_stats(socket_path, &stats) == 0 && stats.regions == 0 &&
		    stats.jobs_in_flight == 0)
			return 0;
		usleep(50 * 1000);
	}
	return -1;
}

#endif /* NORMD_GPU_TEST_H */
