#!/bin/sh
# One normd serving every GPU of the host (issue 21), on a machine with two
# or more GPUs; with fewer it says so and exits 0. Never changes clocks or
# the compute mode. Writes its logs to LOG_DIR and prints a summary:
#
#   1. the aggregate rate: normstress against `normd --device all` with 4
#      processes x 2 threads on GPU 0 alone, then as many on every GPU
#      (--devices all), in the sync and enqueue modes, for two mixes: the
#      load test's mix of small and mid-sized jobs (rows 1-512, cols
#      1-8192, 1% verified), whose rate the daemon's CPU side bounds, and
#      large jobs (16384 x 4096 bf16, 128 MiB a tensor, not verified: the
#      float64 reference of such a job takes the client longer than the GPU
#      takes to run hundreds), whose rate the GPUs bound; beside each run,
#      the cores normd used, its busiest thread, and how busy the host was;
#   2. chaos on every GPU at once: client kills and bad requests in the sync
#      and enqueue modes (0 mismatches, every invalid request answered);
#   3. under NVIDIA MPS (one control daemon of our own serving every GPU,
#      normd --device all under it): bench_enqueue's dependent chain on each
#      GPU alone, then on every GPU at once from a process each, and on a
#      normd --device 0 (one GPU's daemon) for comparison; and the
#      enqueue-mode rate of step 1 on one GPU and on all.
#
# Usage: sh bench/multi_gpu.sh LOG_DIR [BUILD_DIR]   (SECONDS_EACH: each rate run, 8)
set -u
logs=${1:?usage: sh bench/multi_gpu.sh LOG_DIR [BUILD_DIR]}
B=${2:-build}
mkdir -p "$logs"
rm -f "$logs"/*.json # the summary reads every JSON here: none from an earlier run
export LD_LIBRARY_PATH="$B/lib/gpu-host${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
seconds=${SECONDS_EACH:-8}
# The GPUs CUDA will show normd: CUDA_VISIBLE_DEVICES's list where it is set.
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
	gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
else
	gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
fi
if [ "$gpus" -lt 2 ]; then
	echo "multi_gpu: skipped: $gpus GPU(s); needs 2"
	exit 0
fi
nvidia-smi --query-gpu=index,name,uuid --format=csv,noheader
status=0
normd_pid=""
bench_pids=""
own_mps=0
ctl=$(command -v nvidia-cuda-mps-control || true)
[ -z "$ctl" ] && [ -x /usr/local/nvidia/bin/nvidia-cuda-mps-control ] &&
	ctl=/usr/local/nvidia/bin/nvidia-cuda-mps-control

. "$(dirname "$0")/daemon.sh"

# start_normd NAME [DEVICE]: normd --device DEVICE (all) on $logs/NAME.sock, logging to $logs/NAME.log.
start_normd() {
	sock="$logs/$1.sock"
	rm -f "$sock"
	"$B/bin/normd" --config /dev/null --device "${2:-all}" --socket "$sock" \
		--state-dir "$logs" --log-level info >"$logs/$1.log" 2>&1 &
	normd_pid=$!
	normd_wait_ready "$sock" "$normd_pid" "$logs/$1.log" "$B"
}

stop_normd() {
	[ -n "$normd_pid" ] || return 0
	kill -TERM "$normd_pid"
	wait "$normd_pid" || { echo "normd exited with $?"; status=1; }
	normd_pid=""
}

cleanup() {
	for p in $bench_pids; do kill -KILL "$p" 2>/dev/null; done
	[ -n "$normd_pid" ] && kill -KILL "$normd_pid" 2>/dev/null
	[ "$own_mps" = 1 ] && echo quit | "$ctl" >>"$logs/mps_control.log" 2>&1
	own_mps=0
}
trap cleanup EXIT
trap 'exit 1' INT TERM

keep="^(normstress|jobs|verify|invalid|chaos|errors|devices|result)"
small="--rows 1-512 --cols 1-8192 --inflight 8"
large="--rows 16384 --cols 4096 --dtypes bf16 --inflight 4 --verify 0 --kit-reuse 0"

# cpu_snap FILE: each normd thread's CPU ticks ("tid ticks"), then the host's busy and all ticks.
cpu_snap() {
	for t in /proc/"$normd_pid"/task/*; do
		printf '%s %s\n' "${t##*/}" "$(sed 's/.*) //' "$t/stat" | awk '{print $12 + $13}')"
	done >"$1"
	awk '/^cpu / {b = $2 + $3 + $4 + $7 + $8 + $9; print "host", b, b + $5 + $6}' /proc/stat >>"$1"
}

# cpu_report BEFORE AFTER SECONDS: normd's cores in use, its busiest thread, the host's load.
cpu_report() {
	awk -v s="$3" -v hz="$(getconf CLK_TCK)" -v ncpu="$(nproc)" '
		FNR == NR { if ($1 == "host") { hb = $2; ht = $3 } else t0[$1] = $2; next }
		$1 == "host" { host = ($2 - hb) / ($3 - ht + 1e-9); next }
		{ d = $2 - t0[$1]; sum += d; if (d > max) max = d }
		END { printf "cpu         normd %.2f cores, busiest thread %.0f%%; host %.0f%% of %d cores busy\n",
			sum / hz / s, 100 * max / hz / s, 100 * host, ncpu }' "$1" "$2"
}

# stress NAME MODE DEVICES PROCS SIZES [more normstress options]: one run, its JSON kept.
stress() {
	name=$1 mode=$2 devices=$3 procs=$4 sizes=$5
	shift 5
	echo "== $name: $mode mode, $procs processes x 2 threads on GPU(s) $devices"
	cpu_snap "$logs/cpu.before"
	t0=$(date +%s.%N)
	# shellcheck disable=SC2086
	"$B/bin/normstress" --socket "$sock" --mode "$mode" --devices "$devices" --procs "$procs" \
		--threads 2 --verify 0.01 $sizes --timeout 60000 --seed "$procs" \
		--json "$logs/$name.json" "$@" >"$logs/$name.txt" 2>&1 || status=1
	t1=$(date +%s.%N)
	grep -E "$keep" "$logs/$name.txt"
	cpu_snap "$logs/cpu.after"
	cpu_report "$logs/cpu.before" "$logs/cpu.after" "$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')"
}

# rates LABEL MODE...: the two mixes on GPU 0 alone and on every GPU, per mode.
rates() {
	label=$1
	shift
	for mode in "$@"; do
		for mix in small large; do
			eval "sizes=\$$mix"
			stress "$label-$mode-$mix-gpu0" "$mode" 0 4 "$sizes" --duration "$seconds"
			stress "$label-$mode-$mix-all" "$mode" all $((4 * gpus)) "$sizes" \
				--duration "$seconds"
		done
	done
}

echo "#### without MPS"
start_normd nomps || exit 1
# Warm-up: each GPU's worker scratch, streams and variant cache.
"$B/bin/normstress" --socket "$sock" --devices all --procs $((2 * gpus)) --jobs 20000 \
	$small >/dev/null || status=1
rates nomps sync enqueue
for mode in sync enqueue; do
	stress "nomps-$mode-chaos-all" "$mode" all $((8 * gpus)) "$small" --duration 20 \
		--kill-rate 0.1 --bad-rate 0.05
done
stop_normd

echo "#### under MPS"
if [ -z "$ctl" ]; then
	echo "nvidia-cuda-mps-control not found: the MPS part is skipped"
	status=1
else
	export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
	mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
	if [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] &&
		echo get_server_list | "$ctl" >/dev/null 2>&1; then
		echo "an MPS control daemon already runs at $CUDA_MPS_PIPE_DIRECTORY: using it"
	elif "$ctl" -d >"$logs/mps_control.log" 2>&1; then
		own_mps=1
	else
		echo "nvidia-cuda-mps-control -d failed: $(cat "$logs/mps_control.log")"
		exit 1
	fi
	start_normd mps || exit 1
	grep -h "event=device" "$logs/mps.log" | head -"$gpus"
	chain="--socket $sock --no-sync --no-rate --calls 5000 --chain 2000"
	for g in $(seq 0 $((gpus - 1))); do
		echo "== bench_enqueue chain, GPU $g alone"
		# shellcheck disable=SC2086
		"$B/bench/bench_enqueue" $chain --device "$g" --json "$logs/chain-alone-$g.json" \
			>"$logs/chain-alone-$g.txt" 2>&1 || status=1
		grep -v "^bench_enqueue: \[" "$logs/chain-alone-$g.txt"
	done
	echo "== bench_enqueue chain, every GPU at once (a process each)"
	for g in $(seq 0 $((gpus - 1))); do
		# shellcheck disable=SC2086
		"$B/bench/bench_enqueue" $chain --device "$g" --json "$logs/chain-together-$g.json" \
			>"$logs/chain-together-$g.txt" 2>&1 &
		bench_pids="$bench_pids $!"
	done
	for p in $bench_pids; do wait "$p" || status=1; done
	bench_pids=""
	for g in $(seq 0 $((gpus - 1))); do
		echo "-- GPU $g"
		grep -v "^bench_enqueue: \[" "$logs/chain-together-$g.txt"
	done
	rates mps enqueue
	stress "mps-enqueue-chaos-all" enqueue all $((8 * gpus)) "$small" --duration 20 \
		--kill-rate 0.1 --bad-rate 0.05
	stop_normd
	echo "== bench_enqueue chain, GPU 0 of a normd --device 0 (one GPU's daemon)"
	start_normd mps0 0 || exit 1
	"$B/bench/bench_enqueue" --socket "$sock" --no-sync --no-rate --calls 5000 --chain 2000 \
		--device 0 --json "$logs/chain-onegpu-0.json" >"$logs/chain-onegpu-0.txt" 2>&1 ||
		status=1
	grep -v "^bench_enqueue: \[" "$logs/chain-onegpu-0.txt"
	stop_normd
fi

echo "#### summary (jobs/s; GB/s counts the bytes each job must move)"
python3 - "$logs" <<'PY' || status=1
import glob, json, os, sys
logs = sys.argv[1]
runs = {os.path.basename(p)[:-5]: json.load(open(p)) for p in glob.glob(f"{logs}/*.json")
        if not os.path.basename(p).startswith("chain")}
for label in ("nomps", "mps"):
    for mode in ("sync", "enqueue"):
        for mix in ("small", "large"):
            one, every = runs.get(f"{label}-{mode}-{mix}-gpu0"), runs.get(f"{label}-{mode}-{mix}-all")
            if not one or not every:
                continue
            print(f"{label:5} {mode:7} {mix:5}: GPU 0 alone {one['jobs_per_s']:9.0f} jobs/s "
                  f"{one['bytes_per_s'] / 1e9:7.1f} GB/s; every GPU {every['jobs_per_s']:9.0f} "
                  f"jobs/s {every['bytes_per_s'] / 1e9:7.1f} GB/s "
                  f"({every['jobs_per_s'] / max(one['jobs_per_s'], 1):.2f}x); per GPU "
                  f"{every.get('device_jobs')}; passed {one['passed'] and every['passed']}")
for name, r in sorted(runs.items()):
    if "chaos" in name:
        print(f"{name}: {r['jobs_ok']} jobs, {r['verified']} verified, {r['mismatches']} "
              f"mismatches, {r['bad_sent']} invalid sent / {r['bad_expected']} as expected, "
              f"{r['kills']} kills, {r['unexpected_errors']} unexpected, regions left "
              f"{r['daemon_regions_after']}, per GPU {r.get('device_jobs')}, passed {r['passed']}")
for kind in ("onegpu", "alone", "together"):
    for p in sorted(glob.glob(f"{logs}/chain-{kind}-*.json")):
        c = json.load(open(p)).get("chain") or {}
        print(f"chain {kind:8} GPU {json.load(open(p)).get('device')}: enqueue "
              f"{c.get('enqueue_gpu_us', float('nan')):.2f} us/job gated, in-process "
              f"{c.get('inproc_gpu_us', float('nan')):.2f}; ungated wall "
              f"{c.get('enqueue_wall_us', float('nan')):.2f} vs {c.get('inproc_wall_us', float('nan')):.2f}")
PY
exit $status
