/*
 * Logging: one line per event, written with a single write() so lines from
 * the loop and the worker threads never interleave.
 *
 * When stderr is the journal's stream (systemd sets $JOURNAL_STREAM to the
 * "DEVICE:INODE" of the stream it connects, systemd.exec(5)), each line
 * starts with its sd-daemon(3) priority, "<3>" for error, "<4>" warn, "<6>"
 * info, "<7>" debug: journald takes the prefix off and files the line at
 * that priority, so `journalctl -p warning` shows warnings and errors.
 * Anywhere else (a terminal, a file, a pipe) lines are written as they are.
 */
#include "daemon/log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static enum log_level threshold = LOG_LEVEL_INFO;
static const char *const level_names[] = {"error", "warn", "info", "debug"};
/* sd-daemon(3) priorities: LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG. */
static const char *const journal_prefixes[] = {"<3>", "<4>", "<6>", "<7>"};

/* 1 when stderr is the journal's stream, 0 when not, -1 until looked at. */
static atomic_int stderr_journal = -1;

/* Parses "DEVICE:INODE" (two decimal numbers) as systemd writes $JOURNAL_STREAM. */
static bool journal_stream_parse(const char *text, unsigned long long *dev, unsigned long long *ino)
{
	char *end;
	errno = 0;
	*dev = strtoull(text, &end, 10);
	if (end == text || *end != ':' || errno)
		return false;
	const char *ino_text = end + 1;
	*ino = strtoull(ino_text, &end, 10);
	return end != ino_text && *end == '\0' && !errno;
}

/*
 * Whether stderr is the stream $JOURNAL_STREAM names. A variable inherited
 * by a process whose stderr was redirected names another file, so it is
 * compared with stderr itself, as sd-daemon(3) says to.
 */
static bool stderr_is_journal(void)
{
	const char *env = getenv("JOURNAL_STREAM");
	unsigned long long dev, ino;
	if (!env || !journal_stream_parse(env, &dev, &ino))
		return false;
	struct stat st;
	if (fstat(STDERR_FILENO, &st) != 0)
		return false;
	return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

/*
 * Looks once. In the daemon that is in log_set_level(), on the main thread
 * before any other thread runs; the relaxed atomic is for callers that log
 * before setting a level (tests), where threads agree on the answer anyway.
 */
static bool log_to_journal(void)
{
	int known = atomic_load_explicit(&stderr_journal, memory_order_relaxed);
	if (known < 0) {
		known = stderr_is_journal();
		atomic_store_explicit(&stderr_journal, known, memory_order_relaxed);
	}
	return known == 1;
}

int log_set_level(const char *name)
{
	for (int i = 0; i <= LOG_LEVEL_DEBUG; i++) {
		if (!strcmp(name, level_names[i])) {
			threshold = (enum log_level)i;
			log_to_journal();
			return 0;
		}
	}
	return -1;
}

enum log_level log_get_level(void)
{
	return threshold;
}

void log_msg(enum log_level level, const char *fmt, ...)
{
	if (level > threshold)
		return;
	char line[1024];
	int used = snprintf(line, sizeof(line), "%snormd level=%s ",
			    log_to_journal() ? journal_prefixes[level] : "", level_names[level]);
	va_list ap;
	va_start(ap, fmt);
	int more = vsnprintf(line + used, sizeof(line) - (size_t)used - 1, fmt, ap);
	va_end(ap);
	size_t len = (size_t)used + (size_t)(more < 0 ? 0 : more);
	if (len > sizeof(line) - 2)
		len = sizeof(line) - 2;
	line[len++] = '\n';
	ssize_t ignored = write(STDERR_FILENO, line, len);
	(void)ignored;
}
