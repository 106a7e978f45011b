#!/bin/sh
# Runs bench/bench_norm (normd's kernels) and bench/bench_torch.py (PyTorch)
# on the same shapes and prints one combined table:
#   op, dtype, cols, normd GB/s, % of copy BW, torch GB/s, normd/torch,
#   plus the variant that ran and the best autotuning candidate.
# Then, unless COLS narrows the run to a few widths, bench/bench_enqueue: the
# enqueue mode's host cost, dependent-chain GPU time and aggregate rate beside
# the synchronous mode and in-process launches (bench/enqueue_mps.sh runs it
# with and without MPS).
# Usage: sh bench/run.sh BUILD_DIR [COLS]   (raw logs go to $BENCH_LOG_DIR or /tmp)
set -eu
build=${1:-build}
only=${2:-}
logs=${BENCH_LOG_DIR:-/tmp}
mkdir -p "$logs"
# Libraries the GPU machine lacks (it has no Debian packages), copied by `make gpu-progs`.
export LD_LIBRARY_PATH="$build/lib/gpu-host${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$build/bench/bench_norm" $only > "$logs/bench_normd.log"
python3 "$(dirname "$0")/bench_torch.py" $only > "$logs/bench_torch.log"
python3 - "$logs/bench_normd.log" "$logs/bench_torch.log" <<'PY'
import shlex, sys

def parse(path):
    out = []
    for line in open(path):
        parts = shlex.split(line)
        if parts:
            out.append((parts[0], dict(p.split("=", 1) for p in parts[1:] if "=" in p)))
    return out

normd, torch = parse(sys.argv[1]), parse(sys.argv[2])
info = {k: v for k, v in normd + torch if k in ("device", "copy", "torch")}
ref = {(v["op"], v["dtype"], v["cols"]): float(v["gbps"]) for k, v in torch if k == "torch" and "op" in v}
print(f"GPU: {info['device']['name']} ({info['device']['sms']} SMs); "
      f"copy bandwidth {info['copy']['gbps']} GB/s (D2D memcpy, read + write)")
print(f"PyTorch {torch[0][1].get('version', '?')}")
hdr = ("op", "dtype", "cols", "normd GB/s", "% copy", "torch GB/s", "normd/torch",
       "variant", "tuned GB/s", "tuned %", "tuned variant")
print("| " + " | ".join(hdr) + " |")
print("|" + "---|" * len(hdr))
for kind, v in normd:
    if kind != "normd":
        continue
    top = v["op"].replace("_memeff", "")
    t = ref.get((top, v["dtype"], v["cols"]))
    ratio = f"{float(v['gbps']) / t:.2f}" if t else "-"
    print(f"| {v['op']} | {v['dtype']} | {v['cols']} | {v['gbps']} | {v['pct']} | "
          f"{t if t else '-'} | {ratio} | {v['variant']} | {v['tuned_gbps']} | "
          f"{v['tuned_pct']} | {v['tuned_variant']} |")
PY
if [ -z "$only" ]; then
	echo
	rc=0
	NORMD_BIN="$build/bin/normd" "$build/bench/bench_enqueue" --json "$logs/bench_enqueue.json" \
		> "$logs/bench_enqueue.log" 2>&1 || rc=$?
	cat "$logs/bench_enqueue.log"
	exit $rc
fi
