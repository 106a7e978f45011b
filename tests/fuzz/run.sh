#!/bin/sh
# Runs the fuzz target of tests/fuzz/fuzz_frame.c: first every input of the
# committed corpus once (a replay: any crash there is a regression), then
# SECONDS of fuzzing that starts from that corpus. New inputs go to a scratch
# directory, never into the tree; a crash leaves its input there and fails.
#   sh tests/fuzz/run.sh FUZZ_BINARY [SECONDS]
set -u
bin=$1
seconds=${2:-60}
corpus=tests/fuzz/corpus
if [ ! -x "$bin" ]; then
	echo "no fuzz target at $bin (make fuzz-build)" >&2
	exit 1
fi
work=$(mktemp -d /tmp/normd-fuzz.XXXXXX)
mkdir -p "$work/new" "$work/crashes"
count=$(ls "$corpus" | wc -l)
if [ "$count" -eq 0 ]; then
	echo "the seed corpus $corpus is empty (make fuzz-corpus)" >&2
	exit 1
fi
echo "replaying $count corpus inputs"
if ! "$bin" -artifact_prefix="$work/crashes/" "$corpus"/* >"$work/replay.log" 2>&1; then
	tail -n 60 "$work/replay.log"
	echo "the committed corpus crashes the target; inputs kept in $work" >&2
	exit 1
fi
echo "fuzzing for $seconds s"
"$bin" -max_total_time="$seconds" -max_len=65540 -timeout=10 -rss_limit_mb=2048 \
	-print_final_stats=1 -artifact_prefix="$work/crashes/" "$work/new" "$corpus" \
	>"$work/fuzz.log" 2>&1
rc=$?
grep -E "^(stat::number_of_executed_units|stat::new_units_added|Done )" "$work/fuzz.log"
if [ $rc -ne 0 ]; then
	tail -n 80 "$work/fuzz.log"
	echo "fuzzing found a failure; its input is in $work/crashes (add it to $corpus once fixed)" >&2
	exit 1
fi
rm -rf "$work"
