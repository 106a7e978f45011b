#!/bin/sh
# normstress on the GPU machine (issue 6): normd --device 0, then the same
# random mix of every op, shape and flag from 1, 4, 16 and 64 client
# processes, and finally 64 processes for at least 1,000,000 jobs, each run
# verifying 1% of its results against the CPU float64 reference. Prints each
# run's summary, and the daemon's RSS and GPU memory before and after.
# Usage: sh bench/stress_gpu.sh BUILD_DIR   (from the repository root)
set -u
B=${1:-build}
dir=$(mktemp -d /tmp/normd-gpu-stress.XXXXXX)
sock="$dir/normd.sock"
"$B/bin/normd" --device 0 --socket "$sock" --state-dir "$dir" --log-level warn \
	--config /dev/null 2>"$dir/normd.log" &
pid=$!
i=0
while [ ! -S "$sock" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
[ -S "$sock" ] || { cat "$dir/normd.log"; exit 1; }

gpu_mem() { # MiB the daemon holds on the GPU
	nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits |
		awk -F', ' -v p="$pid" '$1 == p {print $2}'
}
rss() { "$B/bin/normctl" --socket "$sock" stats --json | sed 's/.*"rss_bytes":\([0-9]*\).*/\1/'; }

load="--socket $sock --threads 2 --inflight 4 --verify 0.01 --ops ln_fwd,ln_bwd,rms_fwd,rms_bwd,wgrad"
load="$load --rows 1-512 --cols 1-8192 --timeout 60000"
status=0
"$B/bin/normstress" $load --procs 4 --jobs 20000 --seed 1 >/dev/null || status=1 # warm-up
echo "daemon after warm-up: rss $(rss) bytes, GPU memory $(gpu_mem) MiB"
for procs in 1 4 16; do
	jobs=$((procs * 10000))
	echo "== $procs processes x 2 threads, $jobs jobs"
	"$B/bin/normstress" $load --procs $procs --jobs $jobs --seed $procs \
		--json "$dir/p$procs.json" | grep -E "^(jobs|latency|verify|errors|daemon|result)" ||
		status=1
done
echo "== 64 processes x 2 threads, 1,000,000 jobs (also the 64-process point of the curve)"
"$B/bin/normstress" $load --procs 64 --jobs 1000000 --seed 99 --json "$dir/million.json" |
	grep -E "^(normstress|jobs|latency|verify|invalid|errors|daemon|result)" || status=1
sleep 1
echo "daemon at the end: rss $(rss) bytes, GPU memory $(gpu_mem) MiB"
[ -n "${OUT:-}" ] && cp "$dir"/*.json "$OUT"/ 2>/dev/null
kill -TERM $pid
wait $pid || status=1
rm -rf "$dir"
exit $status
