/*
 * Structured log lines on stderr: `normd level=info event=... key=value`.
 * journald adds time and unit; a terminal gets the same lines. When stderr
 * is the journal's stream ($JOURNAL_STREAM), each line starts with its
 * sd-daemon priority (<3> error, <4> warn, <6> info, <7> debug), which
 * journald strips and files the line under.
 */
#ifndef NORMD_LOG_H
#define NORMD_LOG_H

enum log_level { LOG_LEVEL_ERROR = 0, LOG_LEVEL_WARN, LOG_LEVEL_INFO, LOG_LEVEL_DEBUG };

/* Sets the threshold from a name; returns -1 for an unknown name. */
int log_set_level(const char *name);
enum log_level log_get_level(void);

void log_msg(enum log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define log_error(...) log_msg(LOG_LEVEL_ERROR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_LEVEL_WARN, __VA_ARGS__)
#define log_info(...) log_msg(LOG_LEVEL_INFO, __VA_ARGS__)
#define log_debug(...) log_msg(LOG_LEVEL_DEBUG, __VA_ARGS__)

#endif /* NORMD_LOG_H */
