/*
 * A cmocka group of tests around one real daemon (CPU backend): started
 * before the first test, stopped with SIGTERM after the last. cmocka does
 * not fail a program whose group teardown fails, so test_run_group() also
 * fails it when the daemon did not exit 0 (a crash at shutdown, or a leak
 * or error that a sanitizer or valgrind wrapper reports through the status).
 */
#ifndef NORMD_TEST_GROUP_H
#define NORMD_TEST_GROUP_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "tests/support/testlib.h"

/* The group's daemon, running while the tests run. */
extern struct test_daemon group_daemon;

/* Runs `tests` around a daemon started with the NULL-terminated `extra` args. */
#define test_run_group(tests, extra)                                                       \
	test_run_group_(#tests, tests, sizeof(tests) / sizeof((tests)[0]), extra)
int test_run_group_(const char *name, const struct CMUnitTest *tests, size_t count,
		    const char *const *extra);

/* The group's daemon is alive and still serves a well-behaved client correctly. */
void assert_others_unharmed(void);

#endif /* NORMD_TEST_GROUP_H */
