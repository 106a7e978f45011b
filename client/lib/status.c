/*
 * Status texts and the per-thread "last error" message: nc_strerror and
 * nc_reject_name from their X-macro tables in normclient.h. nc_status_name
 * lives in proto/frame.c, which the daemon shares, since the daemon logs
 * with it.
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

NC_API const char *nc_strerror(int status)
{
	switch (status) {
	case NC_OK:
		return "ok";
#define NC__STATUS_TEXT(name, value, text)                                                 \
	case NC_E##name:                                                                   \
		return text;
		NC_STATUS_MAP(NC__STATUS_TEXT)
#undef NC__STATUS_TEXT
	default:
		return "unknown status";
	}
}

NC_API const char *nc_reject_name(int reason)
{
	switch (reason) {
#define NC__REJECT_TEXT(name, value, text)                                                 \
	case NC_REJECT_##name:                                                             \
		return text;
		NC_REJECT_MAP(NC__REJECT_TEXT)
#undef NC__REJECT_TEXT
	default:
		return "unknown";
	}
}
