/*
 * A cmocka group around one daemon (see group.h).
 */
#include "tests/support/group.h"

#include <stdio.h>

struct test_daemon group_daemon;

static const char *const *group_extra;
static int group_daemon_exit = -1;

static int group_start(void **state)
{
	(void)state;
	return test_daemon_start(&group_daemon, group_extra);
}

static int group_stop(void **state)
{
	(void)state;
	group_daemon_exit = test_daemon_stop(&group_daemon);
	return group_daemon_exit == 0 ? 0 : -1;
}

int test_run_group_(const char *name, const struct CMUnitTest *tests, size_t count,
		    const char *const *extra)
{
	group_extra = extra;
	int failed = _cmocka_run_group_tests(name, tests, count, group_start, group_stop);
	if (group_daemon_exit != 0)
		fprintf(stderr, "normd exited with status %d\n", group_daemon_exit);
	return failed || group_daemon_exit != 0;
}

void assert_others_unharmed(void)
{
	assert_true(test_daemon_alive(&group_daemon));
	assert_true(good_client_works(group_daemon.socket));
}
