/*
 * The per-thread "last error" message (the status names live in proto/frame.c,
 * which the daemon shares).
 */
#include <stdarg.h>
#include <stdio.h>

#include "client/lib/internal.h"

static _Thread_local char last_error[256];

NC_API const char *nc_last_error(void)
{
	return last_error;
}

int nc__fail(int status, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
	return status;
}
