#!/bin/sh
# Runs one program of the ASan + UBSan build (make asan) and fails if any
# sanitizer wrote a report: from the program, a child it forked, or the
# daemon it started. Reports go to files, because a daemon's stderr is its
# log, which the tests delete, and a child that _exit()s has no exit status
# of its own to fail with.
#   sh tests/sanitize-run.sh REPORT_DIR command...
set -u
dir=$1
shift
rm -rf "$dir"
mkdir -p "$dir"
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:log_path=$dir/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$dir/ubsan"
"$@"
rc=$?
if ls "$dir"/* >/dev/null 2>&1; then
	cat "$dir"/*
	echo "sanitizer reports above (exit status $rc)" >&2
	rc=1
fi
exit $rc
