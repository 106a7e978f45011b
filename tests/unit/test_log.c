/*
 * Log lines and journald (daemon/log.c): when stderr is the stream that
 * $JOURNAL_STREAM ("DEVICE:INODE") names, as systemd sets it for a service
 * whose output goes to the journal, every line starts with its sd-daemon
 * priority (<3> error, <4> warn, <6> info, <7> debug), so journald files it
 * at that priority; with no variable, a variable naming another file, or
 * one that does not parse, lines are written as before. Each test points
 * stderr at a file of its own and reads back what was written.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/log.c"

static char test_dir[64];
static char log_path[128];
static char other_path[128];
static int saved_stderr = -1;

/* Points stderr at a fresh log file; log.c looks at the journal again. */
static int stderr_to_file(void **state)
{
	(void)state;
	int fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	if (fd < 0 || dup2(fd, STDERR_FILENO) < 0)
		return -1;
	close(fd);
	unsetenv("JOURNAL_STREAM");
	atomic_store(&stderr_journal, -1);
	threshold = LOG_LEVEL_INFO;
	return 0;
}

/* Gives cmocka its stderr back. */
static int stderr_restore(void **state)
{
	(void)state;
	dup2(saved_stderr, STDERR_FILENO);
	unlink(log_path);
	return 0;
}

static int setup(void **state)
{
	(void)state;
	snprintf(test_dir, sizeof(test_dir), "/tmp/normd-log.XXXXXX");
	if (!mkdtemp(test_dir))
		return -1;
	snprintf(log_path, sizeof(log_path), "%s/stderr", test_dir);
	snprintf(other_path, sizeof(other_path), "%s/other", test_dir);
	int fd = open(other_path, O_WRONLY | O_CREAT, 0600);
	if (fd < 0)
		return -1;
	close(fd);
	saved_stderr = dup(STDERR_FILENO);
	return saved_stderr < 0 ? -1 : 0;
}

static int teardown(void **state)
{
	(void)state;
	close(saved_stderr);
	unlink(other_path);
	rmdir(test_dir);
	return 0;
}

/* Sets $JOURNAL_STREAM to the device and inode of `path`. */
static void journal_stream_names(const char *path)
{
	struct stat st;
	assert_int_equal(stat(path, &st), 0);
	char value[64];
	snprintf(value, sizeof(value), "%llu:%llu", (unsigned long long)st.st_dev,
		 (unsigned long long)st.st_ino);
	assert_int_equal(setenv("JOURNAL_STREAM", value, 1), 0);
}

/*
 * What was written to stderr since stderr_to_file(). Gives stderr back
 * first, so that a failed assertion's message reaches the terminal.
 */
static const char *written(void)
{
	static char text[8192];
	dup2(saved_stderr, STDERR_FILENO);
	FILE *f = fopen(log_path, "r");
	assert_non_null(f);
	size_t n = fread(text, 1, sizeof(text) - 1, f);
	fclose(f);
	text[n] = '\0';
	return text;
}

/* One line at every level, the threshold at debug. */
static void log_every_level(void)
{
	assert_int_equal(log_set_level("debug"), 0);
	log_error("event=e n=%d", 1);
	log_warn("event=w");
	log_info("event=i");
	log_debug("event=d");
}

static void test_journal_stream_gets_priorities(void **state)
{
	(void)state;
	journal_stream_names(log_path);
	log_every_level();
	assert_string_equal(written(), "<3>normd level=error event=e n=1\n"
				       "<4>normd level=warn event=w\n"
				       "<6>normd level=info event=i\n"
				       "<7>normd level=debug event=d\n");
}

static void test_no_journal_stream_means_plain_lines(void **state)
{
	(void)state;
	log_every_level();
	assert_string_equal(written(), "normd level=error event=e n=1\n"
				       "normd level=warn event=w\n"
				       "normd level=info event=i\n"
				       "normd level=debug event=d\n");
}

/* An inherited variable whose stream is not our stderr (output redirected). */
static void test_journal_stream_of_another_file_means_plain_lines(void **state)
{
	(void)state;
	journal_stream_names(other_path);
	log_every_level();
	assert_string_equal(written(), "normd level=error event=e n=1\n"
				       "normd level=warn event=w\n"
				       "normd level=info event=i\n"
				       "normd level=debug event=d\n");
}

static void test_unparsable_journal_stream_means_plain_lines(void **state)
{
	(void)state;
	struct stat st;
	assert_int_equal(stat(log_path, &st), 0);
	char good[64], bad[5][80];
	snprintf(good, sizeof(good), "%llu:%llu", (unsigned long long)st.st_dev,
		 (unsigned long long)st.st_ino);
	snprintf(bad[0], sizeof(bad[0]), "%s:", good);
	snprintf(bad[1], sizeof(bad[1]), "%sx", good);
	snprintf(bad[2], sizeof(bad[2]), "%llu", (unsigned long long)st.st_dev);
	snprintf(bad[3], sizeof(bad[3]), ":%llu", (unsigned long long)st.st_ino);
	snprintf(bad[4], sizeof(bad[4]), "%s", "");
	for (int i = 0; i < 5; i++) {
		setenv("JOURNAL_STREAM", bad[i], 1);
		atomic_store(&stderr_journal, -1);
		log_error("event=bad case=%d", i);
	}
	assert_string_equal(written(), "normd level=error event=bad case=0\n"
				       "normd level=error event=bad case=1\n"
				       "normd level=error event=bad case=2\n"
				       "normd level=error event=bad case=3\n"
				       "normd level=error event=bad case=4\n");
}

/* The threshold still applies, and an over-long line keeps its prefix and newline. */
static void test_threshold_and_truncation_under_journal(void **state)
{
	(void)state;
	journal_stream_names(log_path);
	assert_int_equal(log_set_level("warn"), 0);
	log_info("event=hidden");
	char big[2000];
	memset(big, 'x', sizeof(big) - 1);
	big[sizeof(big) - 1] = '\0';
	log_warn("event=long value=%s", big);
	const char *text = written();
	assert_null(strstr(text, "hidden"));
	assert_int_equal(strncmp(text, "<4>normd level=warn event=long value=xxx", 40), 0);
	size_t len = strlen(text);
	assert_int_equal(len, 1023);
	assert_int_equal(text[len - 1], '\n');
	assert_ptr_equal(strchr(text, '\n'), text + len - 1);
}

int main(void)
{
#define LOG_TEST(fn) cmocka_unit_test_setup_teardown(fn, stderr_to_file, stderr_restore)
	const struct CMUnitTest tests[] = {
	    LOG_TEST(test_journal_stream_gets_priorities),
	    LOG_TEST(test_no_journal_stream_means_plain_lines),
	    LOG_TEST(test_journal_stream_of_another_file_means_plain_lines),
	    LOG_TEST(test_unparsable_journal_stream_means_plain_lines),
	    LOG_TEST(test_threshold_and_truncation_under_journal),
	};
	return cmocka_run_group_tests(tests, setup, teardown);
}
