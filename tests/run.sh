#!/bin/sh
# The test runner: every test program in its own process with a timeout,
# one line per program, then the closing summary line "N passed, N failed".
#   sh tests/run.sh BUILD_DIR
set -u
B=${1:-build}
export NORMD_BIN="$B/bin/normd"
passed=0
failed=0
failed_names=""
logdir=$(mktemp -d /tmp/normd-tests.XXXXXX)

run_one() { # name timeout command...
	name=$1
	limit=$2
	shift 2
	start=$(date +%s)
	if timeout --kill-after=10 "$limit" "$@" >"$logdir/$(echo "$name" | tr / _).log" 2>&1; then
		passed=$((passed + 1))
		echo "PASS  $name ($(($(date +%s) - start)) s)"
	else
		rc=$?
		failed=$((failed + 1))
		failed_names="$failed_names $name"
		echo "FAIL  $name (exit $rc, $(($(date +%s) - start)) s); its output:"
		sed "s/^/    /" "$logdir/$(echo "$name" | tr / _).log" | tail -n 60
	fi
}

for t in "$B"/tests/unit/test_*; do
	[ -x "$t" ] && run_one "unit/$(basename "$t")" 300 "$t"
done
for t in "$B"/tests/integration/test_*; do
	[ -x "$t" ] && run_one "integration/$(basename "$t")" 300 "$t"
done
run_one "demo" 120 sh tests/run-demo.sh "$B"
run_one "stress/normstress" 120 sh tests/stress/normstress.sh "$B"
# The Python binding (bindings/python) with numpy against a CPU daemon.
run_one "python/pytest" 300 sh tests/python/run.sh "$B"
# The service: systemd units offline, socket activation, install, metrics.
for t in tests/service/test_*.sh; do
	run_one "service/$(basename "$t" .sh)" 120 sh "$t" "$B"
done

rm -rf "$logdir"
[ -n "$failed_names" ] && echo "failed:$failed_names"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
