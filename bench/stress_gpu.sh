#!/bin/sh
# normstress on the GPU machine (issue 6): normd --device 0, then the same
# random mix of every op, shape and flag from 1, 4, 16 and 64 client
# processes for 5 s each, and 64 processes for 1,000,000 jobs, in the
# synchronous and then the IPC-event completion mode; each run verifies 1%
# of its results against the CPU float64 reference. Prints each run's
# summary, and the daemon's RSS and GPU memory after warm-up and after each
# million-job run; the JSON summaries go to $OUT when it is set.
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
keep="^(normstress|jobs|latency|verify|invalid|errors|daemon|result)"
status=0
# Warm-up in both modes: the workers' scratch, cuBLAS, the event mode's done
# events and the cache of clients' events are made once and then reused.
for mode in sync event; do
	"$B/bin/normstress" $load --mode $mode --procs 16 --jobs 40000 --seed 2 >/dev/null ||
		status=1
done
echo "daemon after warm-up: rss $(rss) bytes, GPU memory $(gpu_mem) MiB"
for mode in sync event; do
	for procs in 1 4 16; do
		echo "== $mode mode, $procs processes x 2 threads, 5 s"
		"$B/bin/normstress" $load --mode $mode --procs $procs --duration 5 --seed $procs \
			--json "$dir/$mode-p$procs.json" | grep -E "$keep" || status=1
	done
	echo "== $mode mode, 64 processes x 2 threads, 1,000,000 jobs (the 64-process point too)"
	"$B/bin/normstress" $load --mode $mode --procs 64 --jobs 1000000 --seed 99 \
		--json "$dir/$mode-million.json" | grep -E "$keep" || status=1
	echo "daemon after the $mode million: rss $(rss) bytes, GPU memory $(gpu_mem) MiB"
done
sleep 1
echo "daemon at the end: rss $(rss) bytes, GPU memory $(gpu_mem) MiB"
if [ -n "${OUT:-}" ]; then # one file: each line names a run and holds its JSON
	for f in "$dir"/*.json; do printf '%s ' "$(basename "$f")"; cat "$f"; echo; done \
		>"$OUT/stress_json.txt"
fi
kill -TERM $pid
wait $pid || status=1
rm -rf "$dir"
exit $status
