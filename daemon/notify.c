/*
 * The systemd notification protocol (sd_notify(3)), spoken directly so the
 * daemon needs no libsystemd: each message is one datagram of
 * newline-separated `KEY=value` lines sent to the AF_UNIX socket named by
 * $NOTIFY_SOCKET (a path, or an abstract name written with a leading '@').
 *
 * What normd says and when:
 *   READY=1      once the listening socket is bound (or taken from systemd),
 *                the backend is initialised and the loop is about to run;
 *   STATUS=...   one line a person can read in `systemctl status`, at ready
 *                and then every NOTIFY_STATUS_INTERVAL_MS (clients, jobs/s);
 *   STOPPING=1   when SIGTERM/SIGINT starts the drain;
 *   WATCHDOG=1   every half $WATCHDOG_USEC when the unit sets WatchdogSec=
 *                (and $WATCHDOG_PID, if set, names this process).
 * Without $NOTIFY_SOCKET every call here is a no-op and no timer runs, so an
 * unsupervised daemon behaves exactly as before. Loop thread only.
 */
#include "daemon/server.h"

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/log.h"

#define NOTIFY_STATUS_INTERVAL_MS 2000

static int notify_fd = -1;	       /* datagram socket, or -1: not supervised */
static struct sockaddr_un notify_addr; /* where messages go */
static socklen_t notify_addr_len;
static uint64_t watchdog_interval_ms; /* 0: no watchdog */
static uint64_t status_last_ns;	      /* when jobs/s was last measured */
static uint64_t status_last_jobs;     /* jobs finished at that moment */

/* Parses $NOTIFY_SOCKET into notify_addr; false if unset or unusable. */
static bool notify_parse_address(void)
{
	const char *name = getenv("NOTIFY_SOCKET");
	if (!name || !name[0])
		return false;
	size_t len = strlen(name);
	if ((name[0] != '/' && name[0] != '@') || len >= sizeof(notify_addr.sun_path)) {
		log_warn("event=notify_disabled socket=\"%s\" error=\"not an absolute path or "
			 "@abstract name that fits sun_path\"",
			 name);
		return false;
	}
	memset(&notify_addr, 0, sizeof(notify_addr));
	notify_addr.sun_family = AF_UNIX;
	memcpy(notify_addr.sun_path, name, len);
	if (name[0] == '@')
		notify_addr.sun_path[0] = '\0'; /* abstract: no trailing NUL in the length */
	notify_addr_len =
	    (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + (name[0] == '/' ? 1 : 0));
	return true;
}

/* Reads $WATCHDOG_USEC (and $WATCHDOG_PID) into watchdog_interval_ms. */
static void notify_parse_watchdog(void)
{
	const char *usec = getenv("WATCHDOG_USEC"), *pid = getenv("WATCHDOG_PID");
	watchdog_interval_ms = 0;
	if (!usec)
		return;
	if (pid && strtol(pid, NULL, 10) != (long)getpid())
		return; /* meant for another process (e.g. our parent) */
	char *end;
	errno = 0;
	unsigned long long v = strtoull(usec, &end, 10);
	if (errno || end == usec || *end || v == 0) {
		log_warn("event=watchdog_disabled usec=\"%s\" error=\"not a positive number\"",
			 usec);
		return;
	}
	/* Ping at half the period, as sd_watchdog_enabled(3) recommends. */
	watchdog_interval_ms = v / 2000;
	if (watchdog_interval_ms == 0)
		watchdog_interval_ms = 1;
}

bool notify_enabled(void)
{
	return notify_fd >= 0;
}

void notify_send(const char *fmt, ...)
{
	if (notify_fd < 0)
		return;
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	int len = vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (len < 0)
		return;
	if ((size_t)len >= sizeof(msg))
		len = (int)sizeof(msg) - 1;
	ssize_t sent = sendto(notify_fd, msg, (size_t)len, MSG_NOSIGNAL | MSG_DONTWAIT,
			      (const struct sockaddr *)&notify_addr, notify_addr_len);
	if (sent < 0)
		log_debug("event=notify_failed error=\"%s\"", strerror(errno));
}

/* What is served, for STATUS=: "GPU 0 (NVIDIA H100 80GB HBM3)", "CPU backend". */
static void notify_devices(const struct server *srv, char *buf, size_t len)
{
	const struct backend *b = srv->backend;
	if (!b || b->device_count <= 0)
		snprintf(buf, len, "Device %s", srv->cfg->device);
	else if (b->devices[0].index < 0)
		snprintf(buf, len, "CPU backend (host memory)");
	else if (b->device_count == 1)
		snprintf(buf, len, "GPU %d (%s)", b->devices[0].index, b->devices[0].name);
	else
		snprintf(buf, len, "%d GPUs (%s, ...)", b->device_count, b->devices[0].name);
}

/* The one STATUS= line: what a person wants to see in `systemctl status`. */
static void notify_status(struct server *srv)
{
	uint64_t now = stats_now_ns();
	uint64_t jobs = srv->stats.jobs_ok + srv->stats.jobs_failed;
	double seconds = (double)(now - status_last_ns) / 1e9;
	double rate = seconds > 0 ? (double)(jobs - status_last_jobs) / seconds : 0.0;
	status_last_ns = now;
	status_last_jobs = jobs;
	if (srv->draining) {
		notify_send("STATUS=Draining: %u jobs in flight, %u clients", srv->jobs_in_flight,
			    srv->client_count);
		return;
	}
	char devices[160];
	notify_devices(srv, devices, sizeof(devices));
	notify_send("STATUS=%s: %u clients, %.1f jobs/s, %u in flight, %llu done, %llu failed",
		    devices, srv->client_count, rate, srv->jobs_in_flight,
		    (unsigned long long)srv->stats.jobs_ok,
		    (unsigned long long)srv->stats.jobs_failed);
}

static void notify_on_status_timer(uv_timer_t *timer)
{
	notify_status(timer->data);
}

static void notify_on_watchdog_timer(uv_timer_t *timer)
{
	(void)timer;
	notify_send("WATCHDOG=1");
}

int notify_start(struct server *srv)
{
	if (uv_timer_init(srv->loop, &srv->notify_status_timer) ||
	    uv_timer_init(srv->loop, &srv->notify_watchdog_timer))
		return -1;
	srv->notify_status_timer.data = srv->notify_watchdog_timer.data = srv;
	srv->notify_timers_ready = true;
	if (!notify_parse_address())
		return 0;
	notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (notify_fd < 0) {
		log_warn("event=notify_disabled error=\"socket: %s\"", strerror(errno));
		return 0;
	}
	notify_parse_watchdog();
	status_last_ns = stats_now_ns();
	status_last_jobs = srv->stats.jobs_ok + srv->stats.jobs_failed;
	char devices[160];
	notify_devices(srv, devices, sizeof(devices));
	notify_send("READY=1\nSTATUS=%s: ready for clients", devices);
	uv_timer_start(&srv->notify_status_timer, notify_on_status_timer, NOTIFY_STATUS_INTERVAL_MS,
		       NOTIFY_STATUS_INTERVAL_MS);
	if (watchdog_interval_ms) {
		notify_send("WATCHDOG=1");
		uv_timer_start(&srv->notify_watchdog_timer, notify_on_watchdog_timer,
			       watchdog_interval_ms, watchdog_interval_ms);
	}
	log_info("event=notify socket=%s watchdog_ms=%llu", getenv("NOTIFY_SOCKET"),
		 (unsigned long long)watchdog_interval_ms);
	return 0;
}

void notify_stopping(struct server *srv)
{
	notify_send("STOPPING=1\nSTATUS=Draining: %u jobs in flight, %u clients",
		    srv->jobs_in_flight, srv->client_count);
}

void notify_stop(struct server *srv)
{
	if (!srv->notify_timers_ready)
		return;
	srv->notify_timers_ready = false;
	uv_close((uv_handle_t *)&srv->notify_status_timer, NULL);
	uv_close((uv_handle_t *)&srv->notify_watchdog_timer, NULL);
}

void notify_close(void)
{
	if (notify_fd >= 0)
		close(notify_fd);
	notify_fd = -1;
}
