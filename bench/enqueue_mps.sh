#!/bin/sh
# Runs bench/bench_enqueue twice on GPU 0: without MPS (it starts its own
# normd), then under NVIDIA MPS (an MPS control daemon of our own, a fresh
# normd on a private socket, both with the same CUDA_MPS_* environment as
# the benchmark's client processes, all as this one user: docs/MPS.md).
# Never changes clocks or the compute mode. Writes to LOG_DIR:
#   no_mps.txt, no_mps.json     the benchmark without MPS
#   mps.txt, mps.json           the benchmark under MPS
#   normd_mps.log               the normd started under MPS
#   mps_control.log             what nvidia-cuda-mps-control said
# The benchmark's output (table on stdout, progress lines on stderr) shows
# as it comes, and each run ends after BENCH_TIMEOUT seconds at most (1800).
# Usage: sh bench/enqueue_mps.sh LOG_DIR [BUILD_DIR] [bench_enqueue options...]
set -u
logs=${1:?usage: sh bench/enqueue_mps.sh LOG_DIR [BUILD_DIR] [bench_enqueue options...]}
build=${2:-build}
[ $# -ge 2 ] && shift 2 || shift $#
mkdir -p "$logs"
# Libraries the GPU machine lacks (it has no Debian packages), copied by `make gpu-progs`.
export LD_LIBRARY_PATH="$build/lib/gpu-host${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bench="$build/bench/bench_enqueue"
normd="$build/bin/normd"
status=0
limit=${BENCH_TIMEOUT:-1800}

# run_bench TEXT_FILE COMMAND...: runs it with its output shown live and kept
# in TEXT_FILE; returns its exit status (124/137: it ran past $limit).
run_bench() {
	out=$1
	shift
	rcfile=$(mktemp /tmp/bench-enqueue-rc.XXXXXX)
	if command -v timeout >/dev/null 2>&1; then
		set -- timeout -k 15 "$limit" "$@"
	fi
	{
		"$@" 2>&1
		echo $? >"$rcfile"
	} | tee "$out"
	rc=$(cat "$rcfile")
	rm -f "$rcfile"
	return "${rc:-1}"
}

echo "== without MPS"
# An MPS daemon left running at the default pipe directory would capture the
# clients; say so rather than report MPS numbers as non-MPS ones.
if [ -e /tmp/nvidia-mps/control ] && [ -z "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
	echo "warning: an MPS control daemon seems to run at /tmp/nvidia-mps" >&2
fi
if ! run_bench "$logs/no_mps.txt" env NORMD_BIN="$normd" "$bench" --json "$logs/no_mps.json" "$@"; then
	echo "bench_enqueue without MPS FAILED (exit $rc; see $logs/no_mps.txt)"
	status=1
fi

echo "== with MPS"
ctl=$(command -v nvidia-cuda-mps-control || true)
[ -z "$ctl" ] && [ -x /usr/local/nvidia/bin/nvidia-cuda-mps-control ] &&
	ctl=/usr/local/nvidia/bin/nvidia-cuda-mps-control
if [ -z "$ctl" ]; then
	echo "nvidia-cuda-mps-control not found: the MPS run is skipped"
	exit 1
fi
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] && echo get_server_list | "$ctl" >/dev/null 2>&1; then
	echo "an MPS control daemon already runs at $CUDA_MPS_PIPE_DIRECTORY: not starting or stopping one"
	own_mps=0
else
	"$ctl" -d >"$logs/mps_control.log" 2>&1 || {
		echo "nvidia-cuda-mps-control -d failed:"
		cat "$logs/mps_control.log"
		exit 1
	}
	own_mps=1
fi
dir=$(mktemp -d /tmp/normd-mps-bench.XXXXXX)
sock="$dir/normd.sock"
normd_pid=""
cleanup() {
	if [ -n "$normd_pid" ]; then
		kill -TERM "$normd_pid" 2>/dev/null
		wait "$normd_pid" 2>/dev/null
		normd_pid=""
	fi
	if [ "$own_mps" = 1 ]; then
		echo quit | "$ctl" >>"$logs/mps_control.log" 2>&1
		own_mps=0
	fi
	rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
"$normd" --config /dev/null --device 0 --socket "$sock" --state-dir "$dir" \
	--log-level info >"$logs/normd_mps.log" 2>&1 &
normd_pid=$!
. "$(dirname "$0")/daemon.sh"
normd_wait_ready "$sock" "$normd_pid" "$logs/normd_mps.log" "$build" || exit 1
grep -h "event=device" "$logs/normd_mps.log" | head -2
if ! run_bench "$logs/mps.txt" "$bench" --socket "$sock" --json "$logs/mps.json" "$@"; then
	echo "bench_enqueue under MPS FAILED (exit $rc; see $logs/mps.txt)"
	status=1
fi
exit $status
