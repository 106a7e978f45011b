#!/bin/sh
# normstress against a real normd (CPU backend), with chaos:
#   1. warm-up: 8 processes x 2 threads for 8 s, the same load as below;
#   2. the daemon's RSS and heap in use are read (normctl stats --json);
#   3. 8 processes x 2 threads for 20 s, every result verified against the
#      float64 reference, client processes SIGKILLed and restarted, 5% of the
#      requests invalid: zero mismatches, zero unexpected errors (normstress
#      exits non-zero otherwise);
#   4. the daemon is still up, its heap in use within 16 KiB of the warm-up
#      reading (a leak of a byte a job or 20 a region would show) and its RSS
#      within 10% or 1 MiB (a 5 MiB daemon's arenas move by half a MiB);
#      the summary counts the jobs of each device; --devices (a CUDA option)
#      is refused;
#   5. killing normstress itself takes its client processes with it
#      (PR_SET_PDEATHSIG): the daemon sees their connections close;
#   6. SIGTERM: the daemon drains and exits 0.
#   sh tests/stress/normstress.sh BUILD_DIR
set -u
B=${1:-build}
dir=$(mktemp -d /tmp/normd-stress.XXXXXX)
sock="$dir/normd.sock"
pid=
fail() {
	echo "FAIL: $*" >&2
	[ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null
	echo "---- normd log (tail) ----" >&2
	tail -n 40 "$dir/normd.log" >&2
	rm -rf "$dir"
	exit 1
}
# One field of `normctl stats --json`.
stat_field() {
	"$B/bin/normctl" --socket "$sock" stats --json | sed -n "s/.*\"$1\":\([0-9]*\).*/\1/p"
}
# Waits (up to 5 s) until only normctl's own connection is left and no job runs,
# so that the memory read next is not that of sessions still being torn down.
settled() {
	i=0
	while { [ "$(stat_field clients)" -gt 1 ] || [ "$(stat_field jobs_in_flight)" -gt 0 ]; } &&
		[ $i -lt 50 ]; do
		sleep 0.1
		i=$((i + 1))
	done
}

# Without glibc's per-thread caches the heap in use is exact: with them, freed
# chunks parked in a worker's cache count as in use and drift by 100 KiB a run.
GLIBC_TUNABLES=glibc.malloc.tcache_count=0 \
	"$B/bin/normd" --device cpu --socket "$sock" --log-level warn 2>"$dir/normd.log" &
pid=$!
i=0
while [ ! -S "$sock" ] && [ $i -lt 100 ]; do
	kill -0 $pid 2>/dev/null || break
	sleep 0.05
	i=$((i + 1))
done
[ -S "$sock" ] || fail "normd did not start"

load="--socket $sock --procs 8 --threads 2 --kill-rate 0.1 --bad-rate 0.05"
# Every op, the weight-gradient GEMM included; any width from 1 column (jobkit
# judges dx against the size of the terms it cancels from).
load="$load --ops ln_fwd,ln_bwd,rms_fwd,rms_bwd,wgrad --rows 1-256 --cols 1-4096 --timeout 10000"

# The warm-up verifies little so that it runs many jobs: the daemon's heap
# reaches the high-water mark of this load (peak concurrent job buffers of
# the CPU kernels) before its RSS is taken as the baseline.
echo "== warm-up (10 s)"
"$B/bin/normstress" $load --verify 0.01 --duration 10 --seed 11 || fail "normstress warm-up run failed"
settled
rss_before=$(stat_field rss_bytes)
heap_before=$(stat_field heap_bytes)
[ -n "$rss_before" ] && [ -n "$heap_before" ] || fail "no RSS or heap from normctl stats"

echo "== chaos run (20 s)"
"$B/bin/normstress" $load --verify 1.0 --duration 20 --seed 12 --json "$dir/run.json" ||
	fail "normstress chaos run failed"
kill -0 $pid 2>/dev/null || fail "normd died during the run"
"$B/bin/normctl" --socket "$sock" ping || fail "normd does not answer after the run"
grep -q '"mismatches":0,' "$dir/run.json" || fail "verify mismatches: $(cat "$dir/run.json")"
grep -q '"unexpected_errors":0,' "$dir/run.json" || fail "unexpected errors: $(cat "$dir/run.json")"
grep -q '"kills":0,' "$dir/run.json" && fail "no client process was killed"
grep -q '"bad_sent":0,' "$dir/run.json" && fail "no invalid request was sent"
settled
rss_after=$(stat_field rss_bytes)
heap_after=$(stat_field heap_bytes)
[ -n "$rss_after" ] && [ -n "$heap_after" ] || fail "no RSS or heap from normctl stats"
echo "daemon RSS after warm-up $rss_before bytes, after the run $rss_after bytes"
echo "daemon heap in use after warm-up $heap_before bytes, after the run $heap_after bytes"
[ $((heap_after - heap_before)) -le 16384 ] || fail "daemon heap grew by $((heap_after - heap_before)) bytes"
rss_slack=$((rss_before / 10))
[ $rss_slack -ge 1048576 ] || rss_slack=1048576
[ $((rss_after - rss_before)) -le $rss_slack ] || fail "daemon RSS grew more than 10% or 1 MiB"
[ $((rss_before - rss_after)) -le $rss_slack ] || fail "daemon RSS shrank more than 10% or 1 MiB"

# The devices count the daemon's per-device jobs (the host, -1, on this backend);
# --devices is a CUDA option, refused here with exit status 2.
grep -q '"device_jobs":{"-1":[1-9]' "$dir/run.json" || fail "no per-device jobs: $(cat "$dir/run.json")"
out=$("$B/bin/normstress" --socket "$sock" --devices all --jobs 10 2>&1)
[ $? -eq 2 ] || fail "--devices on the cpu backend did not exit 2: $out"
case "$out" in *"needs the cuda backend"*) ;; *) fail "--devices on the cpu backend: $out" ;; esac
out=$("$B/bin/normstress" --socket "$sock" --devices 0,x --jobs 10 2>&1)
[ $? -eq 2 ] || fail "--devices 0,x did not exit 2: $out"

echo "== normstress killed: its clients must go too"
"$B/bin/normstress" --socket "$sock" --procs 4 --threads 1 --duration 60 >/dev/null &
spid=$!
sleep 1.5
[ "$(stat_field clients)" -ge 5 ] || fail "normstress clients did not connect"
kill -KILL $spid
wait $spid 2>/dev/null
settled
[ "$(stat_field clients)" -le 1 ] || fail "client processes outlived normstress"

kill -TERM $pid
wait $pid
drc=$?
pid=
[ $drc -eq 0 ] || fail "normd exited with $drc after SIGTERM"
rm -rf "$dir"
echo "PASS"
