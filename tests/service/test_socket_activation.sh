#!/bin/sh
# Socket activation as normd@.socket does it, with systemd-socket-activate:
# it creates and listens on a socket, and on the first connection execs
# normd with that socket as fd 3 (LISTEN_FDS=1, LISTEN_PID). normd must take
# the inherited socket (not bind its own), serve jobs through it, drain on
# SIGTERM with exit 0, and leave the socket file to its owner. Its --socket
# names another path, which must stay unbound: normd used fd 3, not the path.
. tests/service/lib.sh
command -v systemd-socket-activate >/dev/null || fail "systemd-socket-activate is not installed"
S="$T/activation.sock"

systemd-socket-activate -l "$S" "$B/bin/normd" --config /dev/null --device cpu \
	--socket "$T/unused.sock" --log-level debug 2>"$T/normd.log" &
DAEMON_PID=$!
i=0
while [ ! -S "$S" ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i + 1)); done
[ -S "$S" ] || fail "systemd-socket-activate did not create $S"
grep -q 'event=listening' "$T/normd.log" && fail "normd started before the first connection"

"$B/bin/normctl" --socket "$S" ping >"$T/ping.log" 2>&1 || fail "ping through the activation socket"
grep -q "pid $DAEMON_PID" "$T/ping.log" || fail "the daemon is not the activated process: $(cat "$T/ping.log")"
grep -q "event=listening path=.* inherited=yes" "$T/normd.log" || fail "normd did not take fd 3"
[ -e "$T/unused.sock" ] && fail "normd bound --socket although it was given a socket"
check "the first connection starts normd on the inherited socket ($(cat "$T/ping.log"))"

"$B/bin/normctl" --socket "$S" demo --rows 16 --cols 128 >"$T/demo.log" 2>&1 ||
	fail "jobs through the activation socket: $(tail -n 5 "$T/demo.log")"
check "jobs run through it: $(tail -n 1 "$T/demo.log")"
"$B/bin/normctl" --socket "$S" stats --json | grep -q '"jobs_ok":[1-9]' || fail "stats"

kill -TERM "$DAEMON_PID"
wait_exit "$DAEMON_PID"
[ "$WAIT_RC" -eq 0 ] || fail "normd exited with $WAIT_RC after SIGTERM"
[ -S "$S" ] || fail "normd removed the socket file it did not create"
check "SIGTERM drains and exits 0; the activation socket file is left alone"
