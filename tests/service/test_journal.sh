#!/bin/sh
# journald priorities, as systemd hands normd its stream (no journald needed):
# systemd connects stderr to a Unix stream socket and sets $JOURNAL_STREAM to
# that socket's "DEVICE:INODE"; journald reads a leading "<N>" on each line
# as its priority (sd-daemon(3)). The test plays systemd's part with a
# socketpair: normd, at --log-level debug and with a $NOTIFY_SOCKET it
# warns about (every run here), serves `normctl demo` and drains on SIGTERM,
# and a second one fails to bind; every line must carry the priority of its
# level (<3> error, <4> warn, <6> info, <7> debug). With no $JOURNAL_STREAM,
# or one naming another file (a variable inherited by a process whose stderr
# was redirected), lines carry no prefix, as before.
. tests/service/lib.sh
PY=/usr/bin/python3

# Runs normd with stderr on one end of a socketpair, $JOURNAL_STREAM as $1
# says (stream: that socket, other: another file, none: unset), the socket
# $2 and the rest of the arguments on its command line; what arrives at the
# other end goes to stdout. It runs `normctl demo` on the socket, then sends
# SIGTERM; with $2 unbindable it waits for normd to give up.
journal_run() {
	$PY - "$B" "$T" "$@" <<'PYEOF'
import os, socket, subprocess, sys, time
build, tmp, mode, path, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
env = dict(os.environ)
env.pop("JOURNAL_STREAM", None)
env["NOTIFY_SOCKET"] = "not-absolute"  # for a warning (event=notify_disabled)
if mode != "none":
    st = os.fstat(theirs.fileno()) if mode == "stream" else os.stat(tmp)
    env["JOURNAL_STREAM"] = "%d:%d" % (st.st_dev, st.st_ino)
daemon = subprocess.Popen([build + "/bin/normd", "--config", "/dev/null", "--device", "cpu",
                           "--socket", path] + args, stderr=theirs, env=env)
theirs.close()
if os.path.isdir(os.path.dirname(path)):
    for _ in range(200):
        if subprocess.run([build + "/bin/normctl", "--socket", path, "ping"],
                          capture_output=True).returncode == 0:
            break
        time.sleep(0.05)
    else:
        sys.exit("normd did not answer on " + path)
    subprocess.run([build + "/bin/normctl", "--socket", path, "demo", "--rows", "8", "--cols", "64"],
                   check=True, capture_output=True)
    daemon.terminate()
daemon.wait(timeout=30)
out = b""
while True:
    chunk = ours.recv(65536)
    if not chunk:
        break
    out += chunk
sys.stdout.write(out.decode())
PYEOF
}

# Checks that every line of file $1 starts with the priority of its level.
priorities_match() {
	awk '
	{ level = ""; for (i = 1; i <= NF; i++) if ($i ~ /^level=/) { level = substr($i, 7); break } }
	level == "error" && /^<3>normd / { next }
	level == "warn" && /^<4>normd / { next }
	level == "info" && /^<6>normd / { next }
	level == "debug" && /^<7>normd / { next }
	{ print "line without its priority: " $0; bad = 1 }
	END { exit bad }' "$1"
}

journal_run stream "$T/n.sock" --log-level debug >"$T/serve.log" ||
	fail "normd under a journal stream"
priorities_match "$T/serve.log" >"$T/mismatch.log" || fail "$(cat "$T/mismatch.log")"
grep -q '^<4>normd level=warn event=notify_disabled' "$T/serve.log" || fail "no <4> notify_disabled"
grep -q '^<6>normd level=info event=listening' "$T/serve.log" || fail "no <6> event=listening"
grep -q '^<7>normd level=debug event=register' "$T/serve.log" || fail "no <7> event=register"
journal_run stream /nonexistent-normd-dir/n.sock >"$T/bind.log"
priorities_match "$T/bind.log" >"$T/mismatch.log" || fail "$(cat "$T/mismatch.log")"
grep -q '^<3>normd level=error event=listen_failed' "$T/bind.log" || fail "no <3> for listen_failed"
check "on the journal's stream: $(wc -l <"$T/serve.log") + $(wc -l <"$T/bind.log") lines, each with its level's priority (<3>, <4>, <6>, <7>)"

for mode in none other; do
	journal_run "$mode" "$T/n.sock" --log-level debug >"$T/plain.log" ||
		fail "normd with JOURNAL_STREAM $mode"
	[ -s "$T/plain.log" ] || fail "no log lines with JOURNAL_STREAM $mode"
	grep -v '^normd level=' "$T/plain.log" >"$T/mismatch.log" &&
		fail "JOURNAL_STREAM $mode: lines not as before: $(cat "$T/mismatch.log")"
done
check "with no \$JOURNAL_STREAM, or one naming another file, lines are as before"
