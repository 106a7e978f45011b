/*
 * Logging: one line per event, written with a single write() so lines from
 * the loop and the worker threads never interleave.
 */
#include "daemon/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static enum log_level threshold = LOG_LEVEL_INFO;
static const char *const level_names[] = {"error", "warn", "info", "debug"};

int log_set_level(const char *name)
{
	for (int i = 0; i <= LOG_LEVEL_DEBUG; i++) {
		if (!strcmp(name, level_names[i])) {
			threshold = (enum log_level)i;
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
	int used = snprintf(line, sizeof(line), "normd level=%s ", level_names[level]);
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
