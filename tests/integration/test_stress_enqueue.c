/*
 * normstress --mode enqueue against a real daemon (CPU backend): several
 * client processes of two threads enqueue jobs under one key per in-flight
 * slot, every result is checked against the float64 reference, client
 * processes are SIGKILLed and restarted, and 5% of the requests are invalid
 * ones the library must refuse itself. The run must pass with no mismatch
 * and no unexpected error, and the daemon must serve others afterwards.
 *
 * normstress is $NORMSTRESS_BIN, else the normstress next to the daemon
 * ($NORMD_BIN, else build/bin/normd); a build without it (the ASan build
 * makes none) skips these tests.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/support/group.h"

static char normstress[512];

/* Finds normstress; false if there is none to run. */
static bool normstress_found(void)
{
	const char *env = getenv("NORMSTRESS_BIN");
	if (env) {
		snprintf(normstress, sizeof(normstress), "%s", env);
	} else {
		char daemon[512];
		snprintf(daemon, sizeof(daemon), "%s",
			 getenv("NORMD_BIN") ? getenv("NORMD_BIN") : "build/bin/normd");
		snprintf(normstress, sizeof(normstress), "%s/normstress", dirname(daemon));
	}
	return access(normstress, X_OK) == 0;
}

/* Runs normstress with `args` (NULL-terminated) on the group's daemon; its exit status. */
static int normstress_run(const char *const *args)
{
	const char *argv[48] = {normstress, "--socket", group_daemon.socket};
	int argc = 3;
	for (int i = 0; args[i] && argc < 47; i++)
		argv[argc++] = args[i];
	argv[argc] = NULL;
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		execv(normstress, (char *const *)argv);
		_exit(127);
	}
	int status;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* The text of a small file, or fails the test. */
static void read_file(const char *path, char *buf, size_t len)
{
	FILE *f = fopen(path, "r");
	assert_non_null(f);
	size_t n = fread(buf, 1, len - 1, f);
	buf[n] = '\0';
	fclose(f);
}

/* The unsigned value of "key": in a JSON summary, or fails the test. */
static unsigned long long json_number(const char *json, const char *key)
{
	char pattern[64];
	snprintf(pattern, sizeof(pattern), "\"%s\":", key);
	const char *at = strstr(json, pattern);
	if (!at)
		fail_msg("no %s in %s", key, json);
	return strtoull(at + strlen(pattern), NULL, 10);
}

static void test_enqueue_with_chaos_verifies(void **state)
{
	(void)state;
	if (!normstress_found())
		skip();
	char json_path[192], json[4096];
	snprintf(json_path, sizeof(json_path), "%s/enqueue.json", group_daemon.dir);
	const char *const args[] = {
		"--mode", "enqueue", "--procs", "3", "--threads", "2", "--inflight", "6",
		"--duration", "4", "--verify", "1.0", "--bad-rate", "0.05", "--kill-rate", "0.3",
		"--rows", "1-64", "--cols", "1-1024", "--kit-reuse", "20", "--timeout", "10000",
		"--seed", "7", "--json", json_path, NULL,
	};
	assert_int_equal(normstress_run(args), 0);
	read_file(json_path, json, sizeof(json));
	assert_non_null(strstr(json, "\"mode\":\"enqueue\""));
	assert_non_null(strstr(json, "\"backend\":\"cpu\""));
	assert_non_null(strstr(json, "\"passed\":true"));
	assert_int_equal(json_number(json, "mismatches"), 0);
	assert_int_equal(json_number(json, "unexpected_errors"), 0);
	assert_int_equal(json_number(json, "child_failures"), 0);
	assert_true(json_number(json, "jobs_ok") > 0);
	assert_int_equal(json_number(json, "verified"), json_number(json, "jobs_ok"));
	assert_true(json_number(json, "bad_sent") > 0);
	assert_int_equal(json_number(json, "bad_expected"), json_number(json, "bad_sent"));
	assert_others_unharmed();
}

/* The enqueue mode's limits are usage errors (exit 2), found before any load. */
static void test_enqueue_refuses_what_it_cannot_run(void **state)
{
	(void)state;
	if (!normstress_found())
		skip();
	const char *const wgrad[] = {"--mode", "enqueue", "--ops", "ln_fwd,wgrad",
				     "--jobs", "10", NULL};
	const char *const streams[] = {"--mode", "enqueue", "--inflight", "65", "--jobs", "10",
				       NULL};
	assert_int_equal(normstress_run(wgrad), 2);
	assert_int_equal(normstress_run(streams), 2);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_enqueue_with_chaos_verifies),
		cmocka_unit_test(test_enqueue_refuses_what_it_cannot_run),
	};
	static const char *const extra[] = {"--cpu-workers", "2", "--cpu-threads", "1",
					    "--log-level", "info", NULL};
	return test_run_group(tests, extra);
}
