/*
 * The daemon-wide cap on mappings of client memory (issue 20, item 2).
 * Every memfd region is one mmap in the daemon, and every process's mappings
 * are bounded by vm.max_map_count: clients that each stay within their own
 * limits could together fill it, after which every mmap the daemon makes
 * fails, for every client (a new client's Hello was answered with a bare
 * close). Against a daemon started with --max-mappings 200, clients
 * register tiny regions until refused; the refusal is RESOURCE_EXHAUSTED,
 * names the cap, and is counted as limit_mappings; a new client still
 * connects, and runs jobs once room is freed; the count goes back down
 * when the hoarding clients leave.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "normclient.h"
#include "proto/frame.h"
#include "tests/support/group.h"

#define MAX_MAPPINGS 200
#define HOARDERS 4
#define PER_HOARDER 80 /* 4 x 80 > 200: the third hoarder reaches the cap */

static void sleep_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

static void get_stats(struct nc_stats *stats)
{
	nc_conn *conn = NULL;
	assert_int_equal(nc_connect(group_daemon.socket, "stats", 5000, &conn), NC_OK);
	assert_int_equal(nc_stats_get(conn, 5000, stats), NC_OK);
	nc_close(conn);
}

/* Waits until the daemon reports `regions` live regions; fails after 5 s. */
static void wait_regions(uint32_t regions)
{
	struct nc_stats stats;
	for (int i = 0; i < 500; i++) {
		get_stats(&stats);
		if (stats.regions == regions)
			return;
		sleep_ms(10);
	}
	fail_msg("the daemon holds %u regions, expected %u", stats.regions, regions);
}

/* Lines of the daemon's /proc/<pid>/maps: its mappings. */
static int daemon_mappings(void)
{
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/maps", (int)group_daemon.pid);
	FILE *f = fopen(path, "r");
	assert_non_null(f);
	int lines = 0, ch;
	while ((ch = getc(f)) != EOF)
		lines += ch == '\n';
	fclose(f);
	return lines;
}

static int raw_open(void)
{
	int fd = raw_connect(group_daemon.socket);
	assert_true(fd >= 0);
	assert_int_equal(raw_hello(fd), 0);
	return fd;
}

/*
 * Registers a 4 KiB memfd as region `id`; returns the reply's status, and
 * checks that a refusal names the cap.
 */
static Normd__Status register_tiny(int fd, uint64_t id)
{
	int memfd = test_memfd(4096, MFD_ALLOW_SEALING);
	assert_true(memfd >= 0);
	Normd__RegisterRegion reg;
	Normd__Envelope env;
	raw_register_init(&env, &reg, 1000 + id, id, 4096);
	assert_int_equal(raw_send_with_fd(fd, &env, memfd), 0);
	close(memfd);
	Normd__Envelope *reply = raw_recv(fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_RESULT);
	assert_int_equal(reply->request_id, 1000 + id);
	Normd__Status status = reply->result->status;
	if (status != NORMD__STATUS__OK && (status != NORMD__STATUS__RESOURCE_EXHAUSTED ||
					    !strstr(reply->result->message, "max_mappings (200)")))
		fail_msg("region %llu: status %d \"%s\"", (unsigned long long)id, (int)status,
			 reply->result->message);
	nc__envelope_free(reply);
	return status;
}

static void unregister(int fd, uint64_t id)
{
	Normd__UnregisterRegion unreg = NORMD__UNREGISTER_REGION__INIT;
	unreg.region_id = id;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.has_request_id = true;
	env.request_id = 2000 + id;
	env.body_case = NORMD__ENVELOPE__BODY_UNREGISTER_REGION;
	env.unregister_region = &unreg;
	assert_int_equal(raw_send(fd, &env), 0);
	Normd__Envelope *reply = raw_recv(fd, 5000);
	assert_non_null(reply);
	assert_int_equal(reply->body_case, NORMD__ENVELOPE__BODY_RESULT);
	assert_int_equal(reply->result->status, NORMD__STATUS__OK);
	nc__envelope_free(reply);
}

/* Registers regions 1.. on `fd` until refused or `most` are in; returns how many. */
static unsigned register_until_refused(int fd, unsigned most, unsigned *refusals)
{
	unsigned ok = 0;
	for (uint64_t id = 1; id <= most; id++) {
		if (register_tiny(fd, id) != NORMD__STATUS__OK) {
			(*refusals)++;
			break;
		}
		ok++;
	}
	return ok;
}

/* Checks that rejections grew by `count` under limit_mappings and nothing else. */
static void assert_rejected(const struct nc_stats *before, uint64_t count)
{
	struct nc_stats after;
	get_stats(&after);
	for (int i = 0; i < NC_REJECT_COUNT; i++) {
		uint64_t want = i == NC_REJECT_LIMIT_MAPPINGS ? count : 0;
		if (after.rejections[i] - before->rejections[i] != want)
			fail_msg("rejections[%s] grew by %llu, expected %llu", nc_reject_name(i),
				 (unsigned long long)(after.rejections[i] - before->rejections[i]),
				 (unsigned long long)want);
	}
}

static void test_cap_is_logged(void **state)
{
	(void)state;
	assert_true(test_daemon_log_contains(&group_daemon,
					     "event=mapping_cap max_mappings=200 source=config"));
	assert_string_equal(nc_reject_name(NC_REJECT_LIMIT_MAPPINGS), "limit_mappings");
}

/*
 * Clients fill the cap; a new one still connects and, once one hoarder has
 * left, runs jobs correctly; when all have left the count is back to zero.
 */
static void test_hoarders_leave_room(void **state)
{
	(void)state;
	/* Start the daemon's threads (their stacks and arenas are mappings too) first. */
	assert_true(good_client_works(group_daemon.socket));
	wait_regions(0);
	int maps_before = daemon_mappings();
	struct nc_stats before;
	get_stats(&before);

	int hoarder[HOARDERS];
	unsigned held[HOARDERS], total = 0, refusals = 0;
	for (int h = 0; h < HOARDERS; h++) {
		hoarder[h] = raw_open();
		held[h] = register_until_refused(hoarder[h], PER_HOARDER, &refusals);
		total += held[h];
	}
	assert_int_equal(total, MAX_MAPPINGS);
	assert_int_equal(held[0], PER_HOARDER);
	assert_int_equal(held[HOARDERS - 1], 0);
	assert_int_equal(refusals, 2); /* the third hoarder's last try, the fourth's first */
	wait_regions(MAX_MAPPINGS);
	assert_true(daemon_mappings() >= maps_before + MAX_MAPPINGS);

	/* A new client is still served: Hello, Stats, and a refusal that says why. */
	int late = raw_open();
	assert_int_equal(register_tiny(late, 1), NORMD__STATUS__RESOURCE_EXHAUSTED);
	/* The cap counts live mappings: one out, one in. */
	unregister(hoarder[0], 1);
	assert_int_equal(register_tiny(late, 1), NORMD__STATUS__OK);
	assert_int_equal(register_tiny(hoarder[0], 1), NORMD__STATUS__RESOURCE_EXHAUSTED);
	assert_rejected(&before, 4);

	/* One hoarder leaves: a well-behaved client registers and runs jobs. */
	close(hoarder[0]);
	wait_regions(MAX_MAPPINGS - (PER_HOARDER - 1));
	assert_true(good_client_works(group_daemon.socket));

	/* Everyone leaves: the daemon's mappings and its count go back down. */
	for (int h = 1; h < HOARDERS; h++)
		close(hoarder[h]);
	close(late);
	wait_regions(0);
	int maps_after = daemon_mappings();
	if (maps_after > maps_before + 16)
		fail_msg("the daemon has %d mappings, %d before the hoarders", maps_after,
			 maps_before);
	int again = raw_open();
	unsigned again_refused = 0;
	assert_int_equal(register_until_refused(again, MAX_MAPPINGS + 1, &again_refused),
			 MAX_MAPPINGS);
	assert_int_equal(again_refused, 1);
	close(again);
	wait_regions(0);
	assert_rejected(&before, 5);
	assert_others_unharmed();
}

/* Without max_mappings the cap comes from vm.max_map_count, with headroom. */
static void test_cap_from_max_map_count(void **state)
{
	(void)state;
	struct test_daemon d;
	assert_int_equal(test_daemon_start(&d, NULL), 0);
	bool logged = test_daemon_log_contains(&d, "event=mapping_cap max_mappings=") &&
		      test_daemon_log_contains(&d, "source=max_map_count");
	if (!logged)
		test_daemon_dump_log(&d);
	assert_int_equal(test_daemon_stop(&d), 0);
	assert_true(logged);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_cap_is_logged),
	    cmocka_unit_test(test_hoarders_leave_room),
	    cmocka_unit_test(test_cap_from_max_map_count),
	};
	static const char *const extra[] = {"--max-mappings", "200", NULL};
	return test_run_group(tests, extra);
}
