#!/bin/sh
# `make run`: start normd on a private socket, run `normctl demo` through it,
# print the results, stop the daemon. Uses the first GPU when the daemon can
# (a CUDA build on a GPU host), else the CPU backend.
set -u
B=${1:-build}
dir=$(mktemp -d /tmp/normd-run.XXXXXX)
sock="$dir/normd.sock"
device=${NORMD_DEVICE:-cpu}
"$B/bin/normd" --config /dev/null --device "$device" --socket "$sock" --log-level warn 2>"$dir/normd.log" &
pid=$!
i=0
while [ ! -S "$sock" ] && [ $i -lt 100 ]; do
	kill -0 $pid 2>/dev/null || break
	sleep 0.05
	i=$((i + 1))
done
if [ ! -S "$sock" ]; then
	echo "normd did not start:" >&2
	cat "$dir/normd.log" >&2
	rm -rf "$dir"
	exit 1
fi
"$B/bin/normctl" --socket "$sock" demo
rc=$?
kill -TERM $pid
wait $pid
drc=$?
[ $drc -eq 0 ] || { echo "normd exited with $drc" >&2; cat "$dir/normd.log" >&2; rc=1; }
rm -rf "$dir"
exit $rc
