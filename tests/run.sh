#!/bin/sh
# The test runner: every test program in its own process with a timeout,
# one line per program, then the closing summary line "N passed, N failed".
#   sh tests/run.sh BUILD_DIR
# NORMD_SUITES picks what runs (default: all of them): main (the build in
# BUILD_DIR), asan (BUILD_DIR/asan, make asan), valgrind (the daemon under
# memcheck) and fuzz (BUILD_DIR/fuzz, make fuzz-build; NORMD_TEST_FUZZ_SECONDS).
set -u
B=${1:-build}
export NORMD_BIN="$B/bin/normd"
export NORMCTL_BIN="$B/bin/normctl"
suites=${NORMD_SUITES:-main asan valgrind fuzz}
has_suite() { case " $suites " in *" $1 "*) return 0 ;; esac; return 1; }
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

if has_suite main; then
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
	# The wheel (make wheel) pip-installed into a fresh venv, run against a CPU daemon.
	run_one "python/wheel" 300 sh tests/python/test_wheel.sh "$B"
	# The service: systemd units offline, socket activation, install, metrics.
	for t in tests/service/test_*.sh; do
		run_one "service/$(basename "$t" .sh)" 120 sh "$t" "$B"
	done
fi
# The unit and integration tests and the demo once more, built with ASan +
# UBSan; a sanitizer report from a test, a child or its daemon fails it.
if has_suite asan; then
	[ -x "$B/asan/bin/normd" ] || run_one "asan/build" 1 false
	for t in "$B"/asan/tests/unit/test_* "$B"/asan/tests/integration/test_*; do
		[ -x "$t" ] && run_one "asan/$(basename "$(dirname "$t")")/$(basename "$t")" 600 \
			env NORMD_BIN="$B/asan/bin/normd" NORMCTL_BIN="$B/asan/bin/normctl" \
			sh tests/sanitize-run.sh "$logdir/san" "$t"
	done
	run_one "asan/demo" 300 sh tests/sanitize-run.sh "$logdir/san" sh tests/run-demo.sh "$B/asan"
fi
# The daemon under valgrind memcheck: no invalid access, no definite leak.
if has_suite valgrind; then
	for t in test_bad_input test_hardening test_client_death test_limits; do
		run_one "valgrind/$t" 600 sh tests/valgrind-run.sh "$B" "$t"
	done
fi
# The committed fuzz corpus replayed, then a minute of fuzzing from it.
if has_suite fuzz; then
	run_one "fuzz/fuzz_frame" 900 sh tests/fuzz/run.sh "$B/fuzz/fuzz_frame" \
		"${NORMD_TEST_FUZZ_SECONDS:-60}"
fi

rm -rf "$logdir"
[ -n "$failed_names" ] && echo "failed:$failed_names"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
