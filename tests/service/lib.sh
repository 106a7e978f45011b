# Shared by the shell tests in tests/service (sourced, POSIX sh).
# Each test runs from the repository root as `sh tests/service/X.sh BUILD_DIR`,
# prints what it checks, and exits non-zero at the first failure.

B=${1:-build}
# A private directory, removed at exit (with any daemon still running).
T=$(mktemp -d /tmp/normd-service.XXXXXX)
DAEMON_PID=
cleanup() {
	if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
		kill -KILL "$DAEMON_PID" 2>/dev/null
	fi
	rm -rf "$T"
}
trap cleanup EXIT

fail() {
	echo "FAIL: $*" >&2
	for log in "$T"/*.log; do
		[ -f "$log" ] && { echo "---- $log" >&2; tail -n 30 "$log" >&2; }
	done
	exit 1
}

check() { # description
	echo "ok: $*"
}

# Waits until $1 is a socket that accepts (at most 10 s).
wait_socket() {
	i=0
	while [ $i -lt 200 ]; do
		if [ -S "$1" ] && "$B/bin/normctl" --socket "$1" ping >/dev/null 2>&1; then
			return 0
		fi
		sleep 0.05
		i=$((i + 1))
	done
	return 1
}

# Waits for process $1 to exit (at most 15 s); sets WAIT_RC to its status.
wait_exit() {
	wait "$1"
	WAIT_RC=$?
}
