#!/usr/bin/env python3
"""normd's norms side by side with PyTorch (eager, compiled) and Liger-Kernel, in one run.

Issues 17 and 19; `make bench-gpu` runs it. For each dtype (bf16, f16, f32)
and width (bench_norm's nine, 128..32768 columns, 2^28 elements a shape), the
rows are LayerNorm and RMSNorm forward, backward and memory-efficient backward,
plain and with the norm variants of docs/VARIANTS.md: "+add" (s = x + residual,
y = norm(s); backward with ds), LayerNorm "+zero_centered" and RMSNorm "+offset"
(weight 1 + w) and "+fp8_e4m3" (forward, y one byte an element). Who runs them:

- normd: its kernels in-process, timed by build/bench/bench_norm (the C bench
  of `sh bench/run.sh`: CUDA-event medians of 25 launches after 3, queued back
  to back), run here as a subprocess before this process touches the GPU; its
  default variant, and "tuned", the best autotuning candidate.
- torch: F.layer_norm / F.rms_norm eager; +add adds first, +offset passes
  1 + w, +fp8 computes y, amax = max |y| and the scaled, clamped e4m3 cast.
- compile: the same functions under torch.compile(dynamic=False), compiled
  afresh for each shape (torch._dynamo.reset()); by default bf16 and the plain
  and +add rows only (--compile-dtypes, --compile-families: compilation
  dominates the run time).
- liger: Liger-Kernel's Triton kernels through their autograd Functions:
  LigerLayerNormFunction (liger_kernel.ops.layer_norm), LigerRMSNormFunction
  (liger_kernel.ops.rms_norm: casting mode "llama", backward in place in dy as
  its default; +offset with offset 1.0 and "gemma", Gemma's rule, which is
  normd's) and LigerFusedAddRMSNormFunction (liger_kernel.ops.fused_add_rms_norm)
  for rms +add. Liger has no fused add + LayerNorm, no LayerNorm weight offset
  and no FP8 output: those cells say so. Where liger_kernel cannot be
  imported, every Liger cell says why and the run goes on.
- daemon: normd's Python package (normd.normalization's fused_*_affine,
  fused_add_*, fused_*_offset, fused_*_fp8) against a normd on GPU 0 started
  here (tests/python/normd_daemon.py), or $NORMD_SOCKET: the path a PyTorch
  user takes, handshake included. Shown beside the in-process rows, never a
  peer. The variant fallback is set to "error", so nothing is timed that
  torch computed instead.

Timing and bytes: every peer is timed as bench/bench_torch.py times PyTorch
(its median_us: CUDA events around each call, 25 after 3, the host waiting
once); a forward is called with inputs that require grad (the training
forward, which writes the statistics normd's forward writes), a backward is
torch.autograd.grad of the forward's outputs (retain_graph) for the inputs and
the weights, fed dy (and ds for +add). Peers have no memory-efficient
backward: a _memeff row shows their standard backward, as bench/run.sh does.
The bytes of every row, normd's and the peers', come from one place,
bench_norm.c's job_bytes, through `bench_norm --plan`: every tensor read or
written once (x or y, dy, dx, residual, s, ds, weights, their gradients, fp32
mean and rstd, scale and amax); this script checks them against the tensor
lists of MOVES before it measures anything. "% copy" is relative to the copy
bandwidth bench_norm measured (2 GiB device-to-device, read + write); this
process measures it again the same way and prints both. "normd / best" is the
fastest peer's time over normd's (= the ratio of GB/s). Before a peer is
timed, its first call's outputs (and gradients) are compared with PyTorch
eager's on the first 256 rows (relative L2 within CHECK_TOL), to catch a
misused API, not to grade numerics.

Printed: one line per measurement as it runs (`peer op=... impl=... us=...`),
then the table, the variants against the plain norms, the targets of issues
17 and 19 (met or missed, row by row) and the notes (skipped cells, errors).

Liger on the GPU machine (it has torch and triton, not liger-kernel; a pure
Python wheel, carried as the device README says). Here, in the repository
root (/.whl/ is in .gitignore; never commit wheels):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 -d .whl liger-kernel==0.8.5

and the GPU command carries `.whl` and starts with

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;

Run time on an H100 (an estimate; this script has not run on a GPU yet):
normd's rows about 1 min; eager, daemon and Liger 2-5 min (Triton compiles
Liger's kernels for every width and dtype); torch.compile about 5 s a function
and shape, 4 functions a bf16 shape by default, about 3 min. 7-10 min in all:
split it (--dtypes bf16, then --dtypes f16,f32) where one command may take 10
minutes. --cols, --families, --dirs, --impls narrow it further.

`--device cpu` runs the peers' code (torch, compile, the daemon on its CPU
backend) on 64-row shapes with a wall-clock timer: a smoke test of this
script where torch has no GPU, its numbers meaningless.

Usage:
    LD_LIBRARY_PATH=build/lib/gpu-host python3 bench/bench_peers.py --build build
    python3 bench/bench_peers.py --dry-run          # the plan, its bytes checked; no GPU
    python3 bench/bench_peers.py --dtypes bf16 --cols 4096 --families plain,add
"""

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

try:
    import torch
    import torch._dynamo
    import torch._functorch.config
    import torch.nn.functional as F
except ImportError:  # --dry-run and --help need no torch
    torch = F = None

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "bindings" / "python"),
                str(REPO / "tests" / "python")]

EPS = 1e-5
TOTAL = 1 << 28
WEIGHT_OFFSET = 1.0  # +zero_centered, +offset: bench_norm.c's WEIGHT_OFFSET
FP8_SCALE = 64.0     # +fp8_e4m3: bench_norm.c's FP8_SCALE
E4M3_MAX = 448.0
CHECK_ROWS = 256
SMOKE_ROWS = 64  # --device cpu: rows of every shape
CHECK_TOL = {"bf16": 3e-2, "f16": 3e-2, "f32": 1e-3, "fp8": 0.15}
DTYPES = ("bf16", "f16", "f32")
FAMILIES = ("plain", "add", "offset", "fp8")
DIRS = ("fwd", "bwd")
IMPLS = ("normd", "torch", "compile", "liger", "daemon")
PEERS = ("torch", "compile", "liger")  # "best peer" is the fastest of these
SUFFIX_FAMILY = {"": "plain", "add": "add", "zero_centered": "offset", "offset": "offset",
                 "fp8_e4m3": "fp8"}

# What each row reads -> writes, as bench_norm.c's job_bytes counts it: the check of
# the plan's bytes. Row tensors are rows x cols of the dtype, weights cols of it,
# mean and rstd rows of fp32, y8 one byte an element, scale and amax one fp32.
MOVES = {
    "ln_fwd": ("x gamma beta", "y mean rstd"),
    "rms_fwd": ("x gamma", "y rstd"),
    "ln_bwd": ("x dy mean rstd gamma", "dx dgamma dbeta"),
    "ln_bwd_memeff": ("y dy rstd gamma beta", "dx dgamma dbeta"),
    "rms_bwd": ("x dy rstd gamma", "dx dgamma"),
    "rms_bwd_memeff": ("y dy rstd gamma", "dx dgamma"),
}
VARIANT_MOVES = {  # (reads added, writes added, tensor replaced -> by), by suffix and direction
    ("add", "fwd"): ("residual", "s", None),
    ("add", "bwd"): ("ds", "", ("x", "s")),
    ("fp8_e4m3", "fwd"): ("scale", "amax", ("y", "y8")),
}
KIND = {**dict.fromkeys("x y dy dx residual s ds".split(), "row"),
        **dict.fromkeys("gamma beta dgamma dbeta".split(), "weight"),
        **dict.fromkeys("mean rstd".split(), "stat"), "y8": "byte", "scale": "word",
        "amax": "word"}
ELEMENT = {"bf16": 2, "f16": 2, "f32": 4}


# ---- rows: the plan, and what each row moves ----------------------------------------------


class Row:
    """One row of the table: an op (with its variant suffix) at a dtype and width."""

    def __init__(self, fields):
        self.op, self.dtype = fields["op"], fields["dtype"]
        self.cols, self.rows = int(fields["cols"]), int(fields["rows"])
        self.bytes = int(float(fields["bytes"]))
        self.base, _, self.suffix = self.op.partition("+")
        self.family = SUFFIX_FAMILY[self.suffix]
        self.rms = self.base.startswith("rms")
        self.bwd = "_bwd" in self.base
        self.memeff = self.base.endswith("_memeff")
        self.normd = None  # bench_norm's fields for this row
        self.cells = {}    # impl -> Cell

    @property
    def key(self):
        return (self.op, self.dtype, self.cols)

    @property
    def direction(self):
        return "bwd" if self.bwd else "fwd"

    def moves(self):
        """(reads, writes): the tensor names this row counts."""
        reads, writes = (part.split() for part in MOVES[self.base])
        extra = VARIANT_MOVES.get((self.suffix, self.direction))
        if extra:
            more_reads, more_writes, swap = extra
            if swap and not self.memeff:
                reads, writes = ([swap[1] if t == swap[0] else t for t in part]
                                 for part in (reads, writes))
            reads, writes = reads + more_reads.split(), writes + more_writes.split()
        return reads, writes

    def expected_bytes(self):
        size = {"row": self.rows * self.cols * ELEMENT[self.dtype],
                "weight": self.cols * ELEMENT[self.dtype], "stat": self.rows * 4,
                "byte": self.rows * self.cols, "word": 4}
        reads, writes = self.moves()
        return sum(size[KIND[t]] for t in reads + writes)


def parse_lines(text):
    """bench_norm's output: (kind, {key: value}) per line."""
    out = []
    for line in text.splitlines():
        parts = shlex.split(line)
        if parts:
            out.append((parts[0], dict(p.split("=", 1) for p in parts[1:] if "=" in p)))
    return out


def bench_norm_words(args):
    words = list(args.dtype_list) + [str(c) for c in args.col_list]
    words += [f for f in args.family_list]
    if len(args.dir_list) == 1:
        words += args.dir_list
    return words


def bench_norm_env(args):
    gpu_host = str(args.build / "lib" / "gpu-host")
    old = os.environ.get("LD_LIBRARY_PATH")
    return dict(os.environ, LD_LIBRARY_PATH=gpu_host + (":" + old if old else ""))


def read_plan(args):
    """The rows bench_norm would measure, with their bytes (bench_norm --plan)."""
    binary = args.build / "bench" / "bench_norm"
    if not os.access(binary, os.X_OK):
        sys.exit("bench_peers: %s is missing: build it with `make gpu-progs` (the plan and "
                 "its bytes come from it)" % binary)
    done = subprocess.run([str(binary), "--plan"] + bench_norm_words(args), text=True,
                          capture_output=True, env=bench_norm_env(args))
    if done.returncode != 0:
        sys.exit("bench_peers: bench_norm --plan failed:\n" + done.stderr)
    return [Row(f) for kind, f in parse_lines(done.stdout) if kind == "plan"]


def check_bytes(plan):
    """Where bench_norm's bytes and rows differ from MOVES and 2^28 // cols: messages."""
    bad = []
    for row in plan:
        if row.rows != TOTAL // row.cols:
            bad.append("%s %s %d: %d rows, not 2^28 // cols" % (*row.key, row.rows))
        if row.bytes != row.expected_bytes():
            reads, writes = row.moves()
            bad.append("%s %s %d: bench_norm counts %d bytes, %s -> %s make %d" % (
                *row.key, row.bytes, " ".join(reads), " ".join(writes), row.expected_bytes()))
    return bad


# ---- options --------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--build", default=str(REPO / "build"), help="the build directory (build)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="bf16,f16,f32")
    p.add_argument("--cols", default="", help="widths, e.g. 1024,4096 (bench_norm's nine)")
    p.add_argument("--families", default=",".join(FAMILIES), help="plain,add,offset,fp8")
    p.add_argument("--dirs", default=",".join(DIRS), help="fwd,bwd")
    p.add_argument("--impls", default=",".join(IMPLS), help=",".join(IMPLS))
    p.add_argument("--compile-dtypes", default="bf16",
                   help="dtypes whose torch.compile cells run (bf16; 'all')")
    p.add_argument("--compile-families", default="plain,add",
                   help="families whose torch.compile cells run (plain,add; 'all')")
    p.add_argument("--normd-log", metavar="FILE",
                   help="normd's rows from this bench_norm output instead of running it")
    p.add_argument("--log-dir", default=os.environ.get("BENCH_LOG_DIR", "/tmp"),
                   help="bench_norm's raw output goes here ($BENCH_LOG_DIR or /tmp)")
    p.add_argument("--json", metavar="FILE", help="also write every row as JSON")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run of the peers' code (torch, compile, daemon) on "
                        "%d-row shapes, wall-clock timed: no meaningful numbers" % SMOKE_ROWS)
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (rows, bytes, who runs each) and check its bytes; "
                        "no GPU, no torch needed")
    args = p.parse_args(argv)
    args.build = Path(args.build)
    args.dtype_list = pick(args.dtypes, DTYPES, "--dtypes", p)
    args.family_list = pick(args.families, FAMILIES, "--families", p)
    args.dir_list = pick(args.dirs, DIRS, "--dirs", p)
    args.impl_list = pick(args.impls, IMPLS, "--impls", p)
    args.compile_list = (DTYPES if args.compile_dtypes == "all" else
                         pick(args.compile_dtypes, DTYPES, "--compile-dtypes", p))
    args.compile_families = (FAMILIES if args.compile_families == "all" else
                             pick(args.compile_families, FAMILIES, "--compile-families", p))
    try:
        args.col_list = [int(c) for c in args.cols.split(",") if c.strip()]
    except ValueError:
        p.error("--cols: widths are integers")
    if any(c < 128 or c > 65536 for c in args.col_list):
        p.error("--cols: bench_norm takes 128..65536 columns")
    return args


def pick(text, allowed, flag, parser):
    chosen = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in chosen if w not in allowed]
    if bad or not chosen:
        parser.error("%s: choose from %s" % (flag, ", ".join(allowed)))
    return chosen


# ---- who runs a row, and why not -------------------------------------------------------------


def liger_lacks(row):
    """Why Liger-Kernel has no kernel for this row (None: it has one)."""
    if row.family == "fp8":
        return "Liger-Kernel has no FP8-output norm"
    if not row.rms and row.family == "add":
        return "Liger-Kernel has no fused add + LayerNorm"
    if not row.rms and row.family == "offset":
        return "Liger-Kernel's LayerNorm has no weight offset"
    return None


def static_skip(args, row, impl, env):
    """(short, why) when impl does not run this row for a reason known before measuring."""
    if impl == "compile" and (row.dtype not in args.compile_list or
                              row.family not in args.compile_families):
        return "off", "torch.compile runs for --compile-dtypes %s and --compile-families " \
            "%s only" % (",".join(args.compile_list), ",".join(args.compile_families))
    if impl == "liger" and liger_lacks(row):
        return "n/a", liger_lacks(row)
    if impl == "liger" and env["liger_error"]:
        return "no liger", "liger-kernel " + env["liger_error"] + "; see the recipe in " \
            "bench/bench_peers.py's docstring"
    if impl == "daemon" and env.get("daemon_error"):
        return "no daemon", env["daemon_error"]
    return None


def probe_liger():
    """(version, None) if liger-kernel's norm Functions import, else (None, why not)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None, "not installed (no module liger_kernel on sys.path)"
    if torch is None:
        return None, "not importable here: no torch"
    try:
        load_liger()
    except Exception as e:  # ImportError, or anything a broken install raises on import
        return None, "not importable (%s)" % error_text(e)
    try:
        return importlib.metadata.version("liger-kernel"), None
    except importlib.metadata.PackageNotFoundError:
        return "unknown version", None


def load_liger():
    names = {"layer_norm": "LigerLayerNormFunction", "rms_norm": "LigerRMSNormFunction",
             "fused_add_rms_norm": "LigerFusedAddRMSNormFunction"}
    return {cls: getattr(importlib.import_module("liger_kernel.ops." + mod), cls)
            for mod, cls in names.items()}


def error_text(e):
    return " ".join(("%s: %s" % (type(e).__name__, e)).split())[:300]


# ---- the functions timed ----------------------------------------------------------------------
# Every implementation is called as fn(rms, x, r, w, b, scale) and returns a tuple of
# outputs; r, b and scale are None where the row has none.


def norm(rms, x, w, b):
    shape = x.shape[-1:]
    return F.rms_norm(x, shape, w, EPS) if rms else F.layer_norm(x, shape, w, b, EPS)


def torch_plain(rms, x, r, w, b, scale):
    return (norm(rms, x, w, b),)


def torch_add(rms, x, r, w, b, scale):
    s = x + r
    return norm(rms, s, w, b), s


def torch_offset(rms, x, r, w, b, scale):
    return (norm(rms, x, WEIGHT_OFFSET + w, b),)


def torch_fp8(rms, x, r, w, b, scale):
    y = norm(rms, x, w, b)
    amax = y.abs().amax().float()
    return (y.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), amax


TORCH_FNS = {"plain": torch_plain, "add": torch_add, "offset": torch_offset, "fp8": torch_fp8}


def liger_fn(liger, row):
    if row.family == "add":
        return lambda rms, x, r, w, b, scale: liger["LigerFusedAddRMSNormFunction"].apply(
            x, r, w, EPS)
    if row.family == "offset":
        return lambda rms, x, r, w, b, scale: (liger["LigerRMSNormFunction"].apply(
            x, w, EPS, WEIGHT_OFFSET, "gemma"),)
    if row.rms:
        return lambda rms, x, r, w, b, scale: (liger["LigerRMSNormFunction"].apply(x, w, EPS),)
    return lambda rms, x, r, w, b, scale: (liger["LigerLayerNormFunction"].apply(
        x, w, b, EPS),)


def daemon_fn(row, device):
    from normd import normalization as N

    me, off = row.memeff, WEIGHT_OFFSET
    if row.family == "add":
        if row.rms:
            return lambda rms, x, r, w, b, scale: N.fused_add_rms_norm(
                x, r, w, EPS, memory_efficient=me)
        return lambda rms, x, r, w, b, scale: N.fused_add_layer_norm(
            x, r, w, b, EPS, memory_efficient=me)
    if row.family == "offset":
        if row.rms:
            return lambda rms, x, r, w, b, scale: (N.fused_rms_norm_offset(
                x, w, x.shape[-1:], EPS, offset=off, memory_efficient=me),)
        return lambda rms, x, r, w, b, scale: (N.fused_layer_norm_offset(
            x, w, b, x.shape[-1:], EPS, offset=off, memory_efficient=me),)
    if row.family == "fp8":
        amax = torch.empty(1, device=device, dtype=torch.float32)
        if row.rms:
            return lambda rms, x, r, w, b, scale: (N.fused_rms_norm_fp8(
                x, w, x.shape[-1:], EPS, scale=scale, amax=amax), amax)
        return lambda rms, x, r, w, b, scale: (N.fused_layer_norm_fp8(
            x, w, b, x.shape[-1:], EPS, scale=scale, amax=amax), amax)
    if row.rms:
        return lambda rms, x, r, w, b, scale: (N.fused_rms_norm_affine(
            x, w, x.shape[-1:], EPS, memory_efficient=me),)
    return lambda rms, x, r, w, b, scale: (N.fused_layer_norm_affine(
        x, w, b, x.shape[-1:], EPS, memory_efficient=me),)


# ---- measuring -------------------------------------------------------------------------------


class Cell:
    """One implementation's result on one row: a time, or why there is none."""

    def __init__(self, us=None, short=None, why=None, std_bwd=False):
        self.us, self.short, self.why, self.std_bwd = us, short, why, std_bwd
        self.check = None  # relative L2 against PyTorch eager, where checked


class Shape:
    """The tensors of one dtype and width; the inputs of every row of that shape."""

    def __init__(self, dtype, cols, with_residual, device):
        dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
        rows = TOTAL // cols if device == "cuda" else SMOKE_ROWS
        on = dict(device=device, dtype=dt)
        self.x = torch.empty(rows, cols, **on).uniform_(-2.0, 2.6).requires_grad_()
        self.dy = torch.empty(rows, cols, **on).uniform_(-1.0, 1.0)
        self.w = torch.empty(cols, **on).uniform_(0.5, 1.5).requires_grad_()
        self.b = torch.empty(cols, **on).uniform_(-0.5, 0.5).requires_grad_()
        self.r = self.ds = None
        if with_residual:
            self.r = torch.empty(rows, cols, **on).uniform_(-1.0, 1.0).requires_grad_()
            self.ds = torch.empty(rows, cols, **on).uniform_(-1.0, 1.0)
        self.scale = torch.full((1,), FP8_SCALE, device=device, dtype=torch.float32)

    def args(self, row):
        return (row.rms, self.x, self.r if row.family == "add" else None, self.w,
                None if row.rms else self.b, self.scale)

    def diff_inputs(self, row):
        ins = [self.x] + ([self.r] if row.family == "add" else []) + [self.w]
        return tuple(ins + ([] if row.rms else [self.b]))

    def grads(self, row, private_dy):
        dy = self.dy.clone() if private_dy else self.dy
        return (dy, self.ds) if row.family == "add" else (dy,)


def head(t):
    """What the check compares: the first CHECK_ROWS rows of a row tensor, else all of it."""
    t = t.detach()
    return (t[:CHECK_ROWS] if t.dim() == 2 else t).float().clone()


def rel_l2(got, ref):
    got, ref = head(got), head(ref)
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


class PeerRun:
    """The peers of every row: one process, one GPU, shape by shape."""

    def __init__(self, args, plan, env, report):
        from bench_torch import median_us

        self.args, self.plan, self.env, self.report = args, plan, env, report
        self.device = args.device
        self.median_us = median_us if self.device == "cuda" else wall_median_us
        self.liger = load_liger() if "liger" in args.impl_list and not env["liger_error"] \
            else None
        self.daemon = self.client = None
        # Compiled backwards run again and again on one graph (retain_graph=True),
        # which buffers donated to the backward would forbid.
        torch._functorch.config.donated_buffer = False

    def copy_gbps(self):
        """The device's copy bandwidth as bench_norm measures it: 2 GiB D2D, read + write."""
        n = 2 << 30
        src = torch.ones(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return 2 * n / (self.median_us(lambda: dst.copy_(src)) * 1e-6) / 1e9

    def start_daemon(self):
        """normd on GPU 0 (or $NORMD_SOCKET) for the daemon cells; why not, on failure."""
        try:
            import normd
            from normd import normalization as N

            socket = os.environ.get("NORMD_SOCKET")
            if not socket:
                from normd_daemon import Daemon

                if self.device == "cpu":
                    # CPU tensors go to the CPU-backend daemon instead of torch's fallback.
                    os.environ["NORMD_TORCH_CPU"] = "daemon"
                self.daemon = Daemon(self.args.build / "bin" / "normd",
                                     "0" if self.device == "cuda" else "cpu",
                                     log_level="info", start_timeout=60, stop_timeout=30)
                socket = self.daemon.socket
            self.client = normd.Client(socket, name="bench_peers")
            normd.set_default_client(self.client)
            N.set_variant_fallback("error")
            return None
        except Exception as e:  # the daemon's cells then say why
            return "normd daemon not started: " + error_text(e)

    def stop_daemon(self):
        if self.client is not None:
            import normd

            normd.set_default_client(None)
            self.client.close()
        if self.daemon is not None:
            rc = self.daemon.stop()
            if rc != 0:
                self.report.error("daemon", "normd exited %s on SIGTERM; log ends:\n%s"
                                  % (rc, self.daemon.log()[-2000:]))
            self.daemon.cleanup()

    def run(self):
        shapes = {}
        for row in self.plan:
            shapes.setdefault((row.dtype, row.cols), []).append(row)
        for (dtype, cols), rows in shapes.items():
            torch._dynamo.reset()  # each shape compiles afresh, far below dynamo's limits
            shape = Shape(dtype, cols, any(r.family == "add" for r in rows), self.device)
            for group in groups_of(rows):
                self.run_group(shape, group)
            del shape
            torch.cuda.empty_cache()

    def run_group(self, shape, group):
        """The rows of one norm and variant at one shape: forward, backward, memeff."""
        first = next(iter(group.values()))
        ref = self.reference(shape, first, group)
        peer_fns = self.functions(first)
        for impl in self.args.impl_list:
            for direction in ("fwd", "bwd", "bwd_memeff"):
                row = group.get(direction)
                if impl != "normd" and row is not None:
                    row.cells[impl] = self.cell(shape, group, row, impl, peer_fns, ref)

    def functions(self, row):
        """The peers' functions for a group's rows; torch.compile compiles once a group."""
        compiled = {}

        def compile_once():
            if "fn" not in compiled:
                compiled["fn"] = torch.compile(TORCH_FNS[row.family], dynamic=False)
            return compiled["fn"]

        return {"torch": lambda: TORCH_FNS[row.family], "compile": compile_once,
                "liger": lambda: liger_fn(self.liger, row)}

    def cell(self, shape, group, row, impl, peer_fns, ref):
        """impl's result on row: skipped, the standard backward's (peers' memeff), or timed."""
        skip = static_skip(self.args, row, impl, self.env)
        if skip:
            return Cell(short=skip[0], why=skip[1])
        std = group.get("bwd")
        if row.memeff and impl in PEERS and std is not None and impl in std.cells:
            done = std.cells[impl]
            return Cell(us=done.us, short=done.short, why=done.why, std_bwd=True)
        fn = daemon_fn(row, self.device) if impl == "daemon" else peer_fns[impl]()
        return self.measure(shape, row, impl, fn, ref)

    def reference(self, shape, row, group):
        """PyTorch eager's outputs and gradients (their heads) for the checks; None if it
        fails (the checks are then skipped, and the error reported)."""
        fn, args = TORCH_FNS[row.family], shape.args(row)
        try:
            with torch.no_grad() if row.family == "fp8" else torch.enable_grad():
                outs = fn(*args)
            ref = {"fwd": [head(o) for o in outs]}
            if any(r.bwd for r in group.values()):
                grads = torch.autograd.grad(outs, shape.diff_inputs(row),
                                            shape.grads(row, False))
                ref["bwd"] = [head(g) for g in grads]
            return ref
        except Exception as e:  # the peers are still timed, unchecked
            self.report.error("check", "%s %s %d: no PyTorch eager reference: %s"
                              % (*row.key, error_text(e)))
            return None

    def measure(self, shape, row, impl, fn, ref):
        """Times fn on the row; the first call's results are checked against ref."""
        args = shape.args(row)
        want = ref and ref.get(row.direction)
        try:
            if not row.bwd:
                with torch.no_grad() if row.family == "fp8" else torch.enable_grad():
                    cell = self.timed(lambda: fn(*args), want, row)
            else:
                outs = fn(*args)
                inputs, grads = shape.diff_inputs(row), shape.grads(row, impl == "liger")
                cell = self.timed(lambda: torch.autograd.grad(outs, inputs, grads,
                                                              retain_graph=True),
                                  want, row)
                del outs
        except Exception as e:  # a peer that fails on a shape: its cell says so
            self.report.error(impl, "%s %s %d: %s" % (*row.key, error_text(e)))
            return Cell(short="error", why=error_text(e))
        gbps = row.bytes / (cell.us * 1e-6) / 1e9
        print("peer op=%s dtype=%s cols=%d impl=%s us=%.1f gbps=%.1f check=%s"
              % (*row.key, impl, cell.us, gbps,
                 "-" if cell.check is None else "%.1e" % cell.check), flush=True)
        return cell

    def timed(self, call, want, row):
        """The median time of call; its first results against want (None: unchecked)."""
        got = call()
        errs = [rel_l2(g, r) for g, r in zip(got, want)] if want else []
        del got
        cell = Cell(us=self.median_us(call))
        tol = CHECK_TOL["fp8" if row.family == "fp8" else row.dtype]
        cell.check = max(errs) if errs else None
        if errs and cell.check > tol:
            self.report.error("check", "%s %s %d: outputs differ from PyTorch eager's by %.2e "
                              "(relative L2; tolerance %.0e)" % (*row.key, cell.check, tol))
        return cell


def wall_median_us(fn, reps=5):
    """--device cpu: the median wall time of reps calls after one (a smoke run's timer)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e6


def groups_of(rows):
    """{(norm, family): {"fwd": row, "bwd": row, "bwd_memeff": row}} in plan order."""
    out = {}
    for row in rows:
        direction = row.base.split("_", 1)[1]  # fwd, bwd, bwd_memeff
        out.setdefault((row.rms, row.family), {})[direction] = row
    return list(out.values())


# ---- normd's rows ----------------------------------------------------------------------------


def normd_rows(args, plan, env):
    """Runs bench_norm (or reads --normd-log) and joins its rows with the plan's."""
    if args.normd_log:
        text = Path(args.normd_log).read_text()
        source = args.normd_log
    else:
        log = Path(args.log_dir) / "bench_peers_normd.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = [str(args.build / "bench" / "bench_norm")] + bench_norm_words(args)
        print("normd: %s > %s" % (" ".join(argv), log), flush=True)
        start = time.monotonic()
        with open(log, "w") as out:
            rc = subprocess.run(argv, stdout=out, env=bench_norm_env(args)).returncode
        text = log.read_text()
        source = "%s (%.0f s, exit %d)" % (log, time.monotonic() - start, rc)
        if rc != 0:
            print("normd: bench_norm exited %d; its rows so far are used" % rc, flush=True)
            env["failed"] = True
    by_key = {row.key: row for row in plan}
    for kind, f in parse_lines(text):
        if kind in ("device", "copy"):
            env["normd_" + kind] = f
        elif kind == "normd":
            row = by_key.get((f["op"], f["dtype"], int(f["cols"])))
            if row is not None:
                row.normd = f
                if int(float(f.get("bytes", row.bytes))) != row.bytes:
                    sys.exit("bench_peers: %s counts %s bytes for %s %s %s, the plan %d"
                             % (source, f["bytes"], *row.key, row.bytes))
    env["normd_source"] = source


# ---- the report ------------------------------------------------------------------------------


class Report:
    """Errors and check failures as they come; the tables at the end."""

    def __init__(self):
        self.errors = []

    def error(self, who, text):
        self.errors.append((who, text))
        print("error (%s): %s" % (who, text), flush=True)


def copy_reference(env):
    normd = env.get("normd_copy", {}).get("gbps")
    return float(normd) if normd else env.get("own_copy")


def gbps_pct(row, us, copy):
    gbps = row.bytes / (us * 1e-6) / 1e9
    return gbps, (100.0 * gbps / copy if copy else float("nan"))


def best_peer(row):
    timed = [(c.us, impl) for impl, c in row.cells.items() if impl in PEERS and c.us]
    return min(timed) if timed else None


def cell_text(row, impl, copy):
    cell = row.cells.get(impl)
    if cell is None:
        return "-"
    if cell.us is None:
        return cell.short
    gbps, pct = gbps_pct(row, cell.us, copy)
    return "%.1f (%.1f)%s" % (gbps, pct, "*" if cell.std_bwd else "")


def print_table(args, plan, env):
    copy = copy_reference(env)
    impls = [i for i in args.impl_list if i != "normd"]
    hdr = ["op", "dtype", "cols", "MB", "normd GB/s", "% copy", "tuned %"]
    hdr += ["%s GB/s (%%)" % i for i in impls if i in PEERS] + ["best peer", "normd / best"]
    hdr += ["daemon GB/s (%)"] if "daemon" in impls else []
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for row in plan:
        n = row.normd or {}
        best = best_peer(row)
        ratio = "%.2f" % (best[0] / float(n["us"])) if best and n.get("us") else "-"
        cells = [row.op, row.dtype, str(row.cols), "%.0f" % (row.bytes / 1e6),
                 n.get("gbps", "-"), n.get("pct", "-"), n.get("tuned_pct", "-")]
        cells += [cell_text(row, i, copy) for i in impls if i in PEERS]
        cells += [best[1] if best else "-", ratio]
        cells += [cell_text(row, "daemon", copy)] if "daemon" in impls else []
        print("| " + " | ".join(cells) + " |")
    if any(c.std_bwd for row in plan for c in row.cells.values()):
        print("* a peer's standard backward (it has no memory-efficient one)")


def print_variants(plan):
    """normd's variants against its plain norm of the same op, dtype and width."""
    plain = {(r.base, r.dtype, r.cols): r for r in plan if r.family == "plain" and r.normd}
    lines = []
    for row in plan:
        base = plain.get((row.base, row.dtype, row.cols))
        if row.family == "plain" or not row.normd or base is None:
            continue
        ratio = float(row.normd["us"]) / float(base.normd["us"])
        lines.append("| %s | %s | %d | %s | %s | %.3f |" % (
            row.op, row.dtype, row.cols, base.normd["pct"], row.normd["pct"], ratio))
    if lines:
        print("\nnormd's variants against its plain norm (time ratio: the same bytes for "
              "+offset and +zero_centered, more for +add, fewer for +fp8)")
        print("| op | dtype | cols | plain % copy | variant % copy | variant time / plain |")
        print("|---|---|---|---|---|---|")
        print("\n".join(lines))


def targets(plan):
    """(issue, what, row, met) for every target of issues 17 and 19 that a row can show."""
    by_key = {row.key: row for row in plan}
    out = []
    for row in plan:
        if not row.normd:
            continue
        pct, us = float(row.normd["pct"]), float(row.normd["us"])
        liger = row.cells.get("liger")
        vs_liger = liger.us / us if liger is not None and liger.us else None
        if row.family == "plain":
            out += plain_targets(row, pct, vs_liger, by_key)
        elif row.family == "add" and row.dtype == "bf16":
            if not row.bwd and 1024 <= row.cols <= 16384:
                out.append(("19", "+add forward >= 98% copy", row, pct >= 98))
                if vs_liger:
                    out.append(("19", "+add forward >= 1.00x Liger", row, vs_liger >= 1.0))
            elif row.bwd:
                out.append(("19", "+add backward >= 90% copy", row, pct >= 90))
                if vs_liger and not row.memeff:
                    out.append(("19", "+add backward >= 2x Liger", row, vs_liger >= 2.0))
        elif row.family == "offset":
            plain = by_key.get((row.base, row.dtype, row.cols))
            if plain and plain.normd:
                out.append(("19", "weight offset within 1% of plain", row,
                            us <= 1.01 * float(plain.normd["us"])))
        elif row.family == "fp8":
            out.append(("19", "FP8 forward >= 95% copy", row, pct >= 95))
    return out


def plain_targets(row, pct, vs_liger, by_key):
    """Issue 17: 16-bit forward >= 99% (97% at 128 columns), backward >= 95%; fp32 >= 95% up
    to 16384 columns; every forward >= 1.00x Liger; memory-efficient within 2%."""
    out = []
    if not row.bwd and vs_liger:
        out.append(("17", "forward >= 1.00x Liger", row, vs_liger >= 1.0))
    if row.dtype == "f32":
        floor, what = (95, "f32 >= 95% copy") if row.cols <= 16384 else (None, None)
    elif not row.bwd:
        floor = 97 if row.cols < 512 else 99
        what = "16-bit forward >= %d%% copy" % floor
    else:
        floor, what = 95, "16-bit backward >= 95% copy"
    if floor is not None:
        out.append(("17", what, row, pct >= floor))
    std = by_key.get((row.base.replace("_memeff", ""), row.dtype, row.cols))
    if row.memeff and std and std.normd:
        out.append(("17", "memory-efficient within 2% of standard", row,
                    float(row.normd["us"]) <= 1.02 * float(std.normd["us"])))
    return out


def print_targets(plan):
    found = targets(plan)
    if not found:
        return
    print("\nTargets (issues 17 and 19; one run: the issues ask for the median of three)")
    kinds = {}
    for issue, what, row, met in found:
        kinds.setdefault((issue, what), []).append((row, met))
    for (issue, what), rows in kinds.items():
        missed = [r for r, met in rows if not met]
        print("- issue %s, %s: %d of %d rows%s" % (
            issue, what, len(rows) - len(missed), len(rows),
            "; missed: " + ", ".join("%s %s %d" % r.key for r in missed) if missed else ""))


def print_notes(plan, report):
    why = {}
    for row in plan:
        for impl, cell in row.cells.items():
            if cell.us is None and cell.short != "error":
                why.setdefault((impl, cell.short, cell.why), []).append(row)
    if why:
        print("\nSkipped cells")
        for (impl, short, text), rows in why.items():
            print("- %s \"%s\" (%d rows): %s" % (impl, short, len(rows), text))
    if report.errors:
        print("\nErrors")
        for who, text in report.errors:
            print("- %s: %s" % (who, text))


def print_header(env):
    nd = env.get("normd_device", {})
    own = env.get("own_copy")
    print("\nGPU: %s; torch %s; triton %s; liger-kernel %s" % (
        nd.get("name") or env.get("gpu", "?"), env.get("torch", "-"), env.get("triton", "-"),
        env["liger_version"] or env["liger_error"]))
    by_bench_norm = env.get("normd_copy", {}).get("gbps", "-")
    print("copy bandwidth: %s GB/s by bench_norm (the %% columns' reference), %s GB/s in this "
          "process (D2D 2 GiB, read + write)" % (by_bench_norm, "%.1f" % own if own else "-"))
    print("date %s; normd rows: %s" % (env["date"], env.get("normd_source", "not run")))


def write_json(path, args, plan, env, report):
    rows = []
    for row in plan:
        cells = {impl: {k: v for k, v in vars(c).items() if v is not None}
                 for impl, c in row.cells.items()}
        rows.append(dict(op=row.op, dtype=row.dtype, cols=row.cols, rows=row.rows,
                         bytes=row.bytes, normd=row.normd, impls=cells))
    config = {k: v for k, v in env.items() if isinstance(v, (str, int, float, dict, type(None)))}
    with open(path, "w") as f:
        json.dump(dict(config=config, argv=sys.argv[1:], rows=rows,
                       errors=[dict(who=w, text=t) for w, t in report.errors]), f, indent=1)


# ---- the plan alone --------------------------------------------------------------------------


def print_plan(args, plan, env):
    widths = ",".join(str(c) for c in sorted({r.cols for r in plan}))
    print("bench_peers --dry-run: %d rows; dtypes %s, widths %s; %s; %s; impls %s" % (
        len(plan), ",".join(args.dtype_list), widths, ",".join(args.family_list),
        ",".join(args.dir_list), ",".join(args.impl_list)))
    print("torch: %s; liger-kernel: %s; bench_norm: %s; normd: %s" % (
        env.get("torch", "not importable here"), env["liger_version"] or env["liger_error"],
        args.build / "bench" / "bench_norm", args.build / "bin" / "normd"))
    print("\nWhat each row counts (bench_norm.c job_bytes; checked against MOVES):")
    seen = set()
    for row in plan:
        if row.op not in seen:
            seen.add(row.op)
            reads, writes = row.moves()
            print("  %-24s reads %s; writes %s" % (row.op, ", ".join(reads), ", ".join(writes)))
    impls = [i for i in args.impl_list if i != "normd"]
    print("\n| op | dtype | cols | rows | MB | " + " | ".join(impls) + " |")
    print("|" + "---|" * (5 + len(impls)))
    for row in plan:
        who = []
        for impl in impls:
            skip = static_skip(args, row, impl, env)
            std = row.memeff and impl in PEERS
            who.append(skip[0] if skip else "std bwd" if std else "run")
        print("| %s | %s | %d | %d | %.0f | %s |" % (row.op, row.dtype, row.cols, row.rows,
                                                     row.bytes / 1e6, " | ".join(who)))
    notes = {}
    for row in plan:
        for impl in impls:
            skip = static_skip(args, row, impl, env)
            if skip:
                notes.setdefault((impl, skip[0], skip[1]), 0)
                notes[(impl, skip[0], skip[1])] += 1
    for (impl, short, why), n in notes.items():
        print("- %s \"%s\" (%d rows): %s" % (impl, short, n, why))


# ---- main ------------------------------------------------------------------------------------


def main(argv):
    args = parse_args(argv)
    plan = read_plan(args)
    bad = check_bytes(plan)
    print("byte accounting: %d rows from bench_norm --plan, %s" % (
        len(plan), "%d differ from MOVES:" % len(bad) if bad else "all as MOVES lists them"),
        flush=True)
    for line in bad:
        print("  " + line)
    if bad:
        return 1
    version, why = probe_liger() if "liger" in args.impl_list else (None, "not asked for")
    env = dict(liger_version=version, liger_error=why,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    if torch is not None:
        env["torch"] = torch.__version__
    if args.dry_run:
        print_plan(args, plan, env)
        return 0
    if "normd" in args.impl_list:
        normd_rows(args, plan, env)
    report = Report()
    peers = [i for i in args.impl_list if i != "normd"]
    if peers:
        if torch is None or (args.device == "cuda" and not torch.cuda.is_available()):
            sys.exit("bench_peers: the peers need torch with a GPU (--impls normd, "
                     "--device cpu or --dry-run run without)")
        measure_peers(args, plan, env, report)
    print_header(env)
    print_table(args, plan, env)
    print_variants(plan)
    print_targets(plan)
    print_notes(plan, report)
    if args.json:
        write_json(args.json, args, plan, env, report)
    return 1 if report.errors or env.get("failed") else 0


def measure_peers(args, plan, env, report):
    try:
        env["triton"] = importlib.import_module("triton").__version__
    except ImportError:
        env["triton"] = "not importable"
    run = PeerRun(args, plan, env, report)
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["own_copy"] = run.copy_gbps()
        torch.cuda.empty_cache()
        print("copy gbps=%.1f (this process)" % env["own_copy"], flush=True)
    if "daemon" in args.impl_list:
        env["daemon_error"] = run.start_daemon()
    try:
        run.run()
    finally:
        run.stop_daemon()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
