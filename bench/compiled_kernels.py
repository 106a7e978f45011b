#!/usr/bin/env python3
"""Which fusions normd's opaque norm op costs a compiled training step.

Issue 18 asks, beside the compiled step's time, which fusions the opaque
op costs. This script compiles bench_train.py's model
(torch.compile(fullgraph=True)) twice per norm kind, with PyTorch's norms
and with normd's (torch.library custom ops that Inductor cannot look
into), runs the steps in interleaved rounds, then profiles a few steps of
each (torch.profiler, CUDA activity) and prints, per variant:

- the step's median wall time and its ratio to the compiled PyTorch step;
- every GPU kernel the caller's process ran, by name (Inductor's names
  list the aten ops fused into a kernel, e.g.
  `triton_per_fused_add_native_layer_norm_2`), with launches and GPU
  microseconds a step;
- the kernels whose names mention a norm in PyTorch's step (what Inductor
  fused the norm with), and the kernels normd's step runs instead around
  its jobs. normd's own kernels run in the daemon's process, so the
  profiler of the caller does not see them; the script prints the
  daemon's job count a step instead (its stats), which proves that no
  norm fell back to PyTorch.

The daemon: $NORMD_SOCKET, else BUILD/bin/normd --device 0 on a private
socket, started and stopped here. Run it under MPS as the training step
is deployed (export CUDA_MPS_PIPE_DIRECTORY and start the control daemon
first). GPU only.

    LD_LIBRARY_PATH=build/lib/gpu-host python3 bench/compiled_kernels.py --build build
"""

import argparse
import collections
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "bindings" / "python"), str(REPO / "tests" / "python")]

import bench_train as bt  # noqa: E402  (the model, its norms and its step)
import normd  # noqa: E402
from normd import normalization as N  # noqa: E402

NORM_WORDS = ("layer_norm", "rms_norm", "rsqrt", "norm")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default=str(REPO / "build"), help="the build directory (build)")
    p.add_argument("--d-models", default="1024", help="comma-separated d_model values (1024)")
    p.add_argument("--norms", default="layernorm,rmsnorm", help="layernorm,rmsnorm")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (4)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (20)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds (4)")
    p.add_argument("--profile-steps", type=int, default=5, help="profiled steps (5)")
    p.add_argument("--residual", choices=("separate", "fused"), default="separate",
                   help="bench_train.py's --residual: the attention's residual add before "
                        "norm2, or in its call (normd's FusedAdd* modules)")
    p.add_argument("--cpu-profile", action="store_true",
                   help="also print the host's busiest ops in normd's compiled step")
    return p.parse_args(argv)


def kernel_key(name):
    """A kernel's name without Inductor's trailing index or template arguments."""
    name = re.sub(r"_\d+$", "", name)
    return name if len(name) <= 96 else name[:93] + "..."


def profile_kernels(step, steps):
    """{kernel: [launches, GPU us]} a step, from torch.profiler over `steps` steps."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    table = collections.defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if e.name.startswith(("Memcpy", "Memset", "cudaStream")):
            continue
        entry = table[kernel_key(e.name)]
        entry[0] += 1.0 / steps
        entry[1] += e.time_range.elapsed_us()
    for entry in table.values():
        entry[1] /= steps
    return dict(table)


def jobs_done(client):
    """The daemon's jobs_ok once it stops moving (the last jobs are answered at launch)."""
    last = client.stats()["jobs_ok"]
    for _ in range(50):
        time.sleep(0.02)
        now = client.stats()["jobs_ok"]
        if now == last:
            break
        last = now
    return last


def main(argv):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("compiled_kernels: no CUDA device; this script profiles GPU kernels")
        return 2
    daemon = None
    socket = os.environ.get("NORMD_SOCKET")
    if not socket:
        from normd_daemon import Daemon  # tests/python: a private normd
        daemon = Daemon(Path(args.build) / "bin" / "normd", "0", log_level="warn")
        socket = daemon.socket
    client = normd.Client(socket, name="compiled_kernels")
    normd.set_default_client(client)
    bt.N = N
    print("GPU: %s; torch %s; MPS: %s (normd's stats)"
          % (torch.cuda.get_device_name(0), torch.__version__,
             "yes" if client.stats()["mps"] else "no"))
    try:
        for norm in [n for n in args.norms.split(",") if n]:
            for d in [int(v) for v in args.d_models.split(",") if v]:
                one_shape(args, client, norm, d)
    finally:
        client.close()
        if daemon:
            daemon.stop()
            daemon.cleanup()
    return 0


def one_shape(args, client, norm, d):
    x = torch.randn(4, 2048, d, device="cuda", dtype=torch.bfloat16)
    target = torch.randn(4, 2048, d, device="cuda", dtype=torch.bfloat16)
    steps = {}
    for impl in ("torch", "normd"):
        torch.manual_seed(d)
        with torch.device("cuda"):
            add_norm = bt.add_norm_factory(impl, norm) if args.residual == "fused" else None
            model = bt.Model(d, args.layers, 128, bt.norm_factory(impl, norm, None), add_norm)
        model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=bt.LR, fused=True)
        fn = torch.compile(model, fullgraph=True)
        steps[impl] = (lambda fn=fn, opt=opt: bt.train_step(fn, opt, x, target))
        t = time.perf_counter()
        for _ in range(3):
            steps[impl]()
        torch.cuda.synchronize()
        print("%s %s d %d: compiled and warmed in %.1f s" % (norm, impl, d, time.perf_counter() - t))
    times = {impl: [] for impl in steps}
    host = {impl: [] for impl in steps}  # until the step's last launch returned
    for _ in range(args.rounds):
        for impl, step in steps.items():
            for _ in range(max(1, args.steps // args.rounds)):
                torch.cuda.synchronize()
                t = time.perf_counter()
                step()
                h = time.perf_counter()
                torch.cuda.synchronize()
                times[impl].append((time.perf_counter() - t) * 1e3)
                host[impl].append((h - t) * 1e3)
    base = statistics.median(times["torch"])
    print("\n### %s, d_model %d, compiled, median of %d steps" % (bt.NORM_TITLES[norm], d,
                                                                  len(times["torch"])))
    print("| norms | step ms | / torch | host ms (share) |\n| --- | --- | --- | --- |")
    for impl in steps:
        ms, host_ms = statistics.median(times[impl]), statistics.median(host[impl])
        print("| %s | %.2f | %.3fx | %.2f (%.2f) |" % (impl, ms, ms / base, host_ms, host_ms / ms))
    kernels = {}
    for impl, step in steps.items():
        before = jobs_done(client)
        kernels[impl] = profile_kernels(step, args.profile_steps)
        after = jobs_done(client)
        if impl == "normd":
            print("normd: %.1f daemon jobs a step" % ((after - before) / args.profile_steps))
    if args.cpu_profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile_steps):
                steps["normd"]()
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                        max_name_column_width=60))
    for impl, table in kernels.items():
        total = sum(v[1] for v in table.values())
        print("\n%s step: %d kernels, %.0f launches, %.0f us of GPU time a step in this process"
              % (impl, len(table), sum(v[0] for v in table.values()), total))
        print("| kernel | launches a step | us a step |\n| --- | --- | --- |")
        for name, (count, us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            print("| `%s` | %.0f | %.1f |" % (name, count, us))
    torch_norm = {k: v for k, v in kernels["torch"].items() if any(w in k for w in NORM_WORDS)}
    only_normd = {k: v for k, v in kernels["normd"].items() if k not in kernels["torch"]}
    stray = [k for k in kernels["normd"] if "layer_norm" in k or "rms_norm" in k]
    print("\nfusions: PyTorch's compiled step runs its norm in %d kernels (%.0f us a step):"
          % (len(torch_norm), sum(v[1] for v in torch_norm.values())))
    for k, (count, us) in sorted(torch_norm.items(), key=lambda kv: -kv[1][1]):
        print("  %s: %.0f a step, %.1f us" % (k, count, us))
    print("kernels only normd's compiled step runs (%.0f us a step):"
          % sum(v[1] for v in only_normd.values()))
    for k, (count, us) in sorted(only_normd.items(), key=lambda kv: -kv[1][1]):
        print("  %s: %.0f a step, %.1f us" % (k, count, us))
    if stray:
        print("warning: normd's step ran PyTorch norm kernels: %s" % ", ".join(stray))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
