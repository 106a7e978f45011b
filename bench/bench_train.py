#!/usr/bin/env python3
"""A pre-norm transformer training step with PyTorch's, apex's and normd's norms.

Issue 18, item 6; `make bench-gpu` runs it. One run measures, on GPU 0:

- The training step: a stack of pre-norm transformer blocks in bf16
  (norm -> fused QKV projection -> F.scaled_dot_product_attention (causal)
  -> output projection -> residual; norm -> MLP 4x with GELU -> residual),
  a final norm, a linear head, an MSE loss against a fixed random target,
  backward and a fused AdamW step. Defaults: d_model 1024, 2048 and 4096,
  8192 tokens (batch 4 x sequence 2048), heads of 128 (d_model/128 of
  them), 4 layers. The norms (LayerNorm, then RMSNorm) come from
  - PyTorch: nn.LayerNorm / nn.RMSNorm, the baseline;
  - apex: apex.normalization.FusedLayerNorm / FusedRMSNorm, where apex
    imports (otherwise its column says why it was skipped);
  - normd: normd.normalization.FusedLayerNorm / FusedRMSNorm, once per
    completion mode (enqueue, event, sync: normd.set_completion_mode; and
    enqueue-python, the enqueue mode on the package's Python path rather
    than its compiled eager operator, normd.eager).
  With `--residual fused` each block's attention residual add goes into
  norm2's call: normd's FusedAddLayerNorm / FusedAddRMSNorm (one job for
  the add and the norm) against PyTorch's add then norm, as stacks with a
  fused add + norm write the block (apex has no such module: skipped).
  Each eager and compiled (torch.compile of the model, fullgraph=True, one
  compilation serving normd's three modes, which are read when the op
  runs; apex's Function calls its CUDA extension, which dynamo need not
  trace, so apex compiles with graph breaks allowed and the notes count
  them). A step's time is wall time from a synchronized GPU to a
  synchronized GPU (torch.cuda.synchronize + perf_counter), so the host
  cost of sending normd's jobs counts as it does in a training loop that
  reads its loss every step; a third table gives the host's part (until the
  step's last launch returned), which says whether the Python thread or the
  GPU bounds the step. The variants of one d_model take their steps
  in interleaved rounds (a few steps each, in turn), so that clock and
  thermal drift fall on all of them alike, after as many untimed rounds
  of one step each (the variants share the caching allocator, and normd
  registers a segment the first time one of its tensors lands there: a
  training process pays that once, so the timed steps should not); the
  table gives the median step and its ratio to PyTorch's own (eager to
  eager, compiled to compiled), and stderr the regions normd registered
  during the timed steps.
- The correctness guard, before timing: one step (loss and every
  parameter's gradient) of each variant from the same initial weights
  (norm weights and biases randomized) and inputs against PyTorch's eager
  model; loss within 2% and each gradient within 10% relative L2 (loose:
  bf16 rounding differs between kernels and grows through the layers),
  and for normd, the daemon's jobs_ok counter moved by one job per norm
  forward and backward (no norm fell back to torch). A variant outside
  that is reported and still timed.
- The host cost of one call, on an 8 x 1024 bf16 tensor that requires
  grad: F.layer_norm, nn.LayerNorm, an empty torch.autograd.Function, an
  empty torch.library.custom_op, and normd's FusedLayerNorm (each
  completion mode) and FusedRMSNorm forward: the median and 90th
  percentile of perf_counter around each call, with no synchronization
  inside the timed call (the GPU is synchronized between batches of 100).

Failures stay in their cell (the error is printed under the table) and the
run goes on; the exit status is 1 if any cell failed or any check was out
of tolerance, 2 if a measurement process could not run at all.

The daemon: $NORMD_SOCKET if set; otherwise the measurement process starts
BUILD/bin/normd --config /dev/null --device 0 (or cpu) on a socket in a
private directory, also its --state-dir, and stops it at the end.

MPS: `--mps` runs the measurement twice, each in a process of its own,
because MPS must be chosen before CUDA initialises: first without MPS
(where an MPS control daemon of someone else's already listens, the
child's CUDA_MPS_PIPE_DIRECTORY names an empty private directory so that
it does not capture the child), then under an MPS control daemon this
script starts (nvidia-cuda-mps-control -d, from PATH or
/usr/local/nvidia/bin, with private pipe and log directories exported
before the child and its normd start) and stops (quit) at the end. Each
run prints "MPS: yes/no" as normd's stats report it. Where the control
daemon cannot be found or started, the script says so and skips that run.
`--mps only` runs under MPS alone.

Run time: compilation dominates (three models per d_model and norm kind);
--norms, --d-models, --impls, --modes and --no-compile split a run into
pieces that fit a time limit.

Usage (GPU machine, after `make gpu-progs`; bench-gpu does this):

    LD_LIBRARY_PATH=build/lib/gpu-host python3 bench/bench_train.py --build build --mps
    python3 bench/bench_train.py --quick      # a smoke run: tiny shapes; on CPU
                                              # where torch sees no GPU (normd's
                                              # CPU backend, staged tensors)
"""

import argparse
import contextlib
import datetime
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Importing torch does not initialise CUDA, so the top level may import it
# and still choose MPS for the measurement processes it starts.
import torch
import torch.nn.functional as F
from torch import nn

# The enqueue variants use the compiled eager operator (normd's default),
# enqueue-python the package's Python path (NORMD_EAGER=0 puts both there).

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bindings" / "python"), str(REPO / "tests" / "python")]

EPS = 1e-5
LOSS_RTOL = 2e-2
GRAD_RTOL = 1e-1
LR = 1e-5
# enqueue-python: the enqueue mode on the package's Python path instead of the
# compiled eager operator (normd.eager).
MODES = ("enqueue", "enqueue-python", "event", "sync")
IMPLS = ("torch", "apex", "normd")
NORMS = ("layernorm", "rmsnorm")
NORM_TITLES = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
HOST_BATCH = 100
HOST_WARMUP = 50

# Full-size defaults, and the tiny ones of --quick (an explicit option wins over both).
FULL = dict(d_models="1024,2048,4096", layers=4, tokens=8192, seq=2048, head_dim=128,
            steps=20, rounds=4, warmup=3, host_calls=2000)
QUICK = dict(d_models="64,128", layers=2, tokens=256, seq=128, head_dim=32, steps=4,
             rounds=2, warmup=1, host_calls=200)


# ---- options ---------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-models", help="comma-separated d_model values (1024,2048,4096)")
    p.add_argument("--layers", type=int, help="transformer blocks (4)")
    p.add_argument("--tokens", type=int, help="tokens a step, batch x seq (8192)")
    p.add_argument("--seq", type=int, help="sequence length; batch = tokens/seq (2048)")
    p.add_argument("--head-dim", type=int, help="attention head width; heads = d/this (128)")
    p.add_argument("--steps", type=int, help="timed steps per variant (20)")
    p.add_argument("--rounds", type=int, help="interleaved rounds the steps are split into (4)")
    p.add_argument("--warmup", type=int, help="untimed steps per variant after the check (3)")
    p.add_argument("--host-calls", type=int, help="calls per host-cost row; 0 skips it (2000)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="normd completion modes to time (enqueue,event,sync)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="norm implementations (torch,apex,normd); torch always runs")
    p.add_argument("--norms", default=",".join(NORMS), help="layernorm,rmsnorm")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--residual", choices=("separate", "fused"), default="separate",
                   help="the attention's residual add: before norm2 (separate, default) or "
                        "in its call (fused: normd's FusedAdd* modules, PyTorch's add then "
                        "norm; apex is skipped)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA where torch sees a GPU, else CPU (--quick only)")
    p.add_argument("--mps", nargs="?", const="both", default="off",
                   choices=("off", "both", "only"),
                   help="--mps: without MPS, then under an MPS daemon of our own; "
                        "--mps only: under MPS alone")
    p.add_argument("--build", default="build", help="the build directory (build)")
    p.add_argument("--daemon-args", default="",
                   help="more options for the normd it starts, e.g. \"--busy_poll_us 5000\"")
    p.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--mps-label", default="off", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.d_model_list = [int(d) for d in args.d_models.split(",") if d.strip()]
    args.mode_list = pick(args.modes, MODES, "--modes", p)
    args.impl_list = ["torch"] + [i for i in pick(args.impls, IMPLS, "--impls", p)
                                  if i != "torch"]
    args.norm_list = pick(args.norms, NORMS, "--norms", p)
    if min(args.layers, args.tokens, args.seq, args.head_dim, args.steps, args.rounds) < 1 \
            or args.warmup < 0 or args.host_calls < 0 or not args.d_model_list:
        p.error("sizes and counts must be positive")
    if args.tokens % args.seq:
        p.error("--tokens must be a multiple of --seq")
    for d in args.d_model_list:
        if d % args.head_dim:
            p.error("d_model %d is not a multiple of --head-dim %d" % (d, args.head_dim))
    return args


def pick(text, allowed, flag, parser):
    chosen = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in chosen if w not in allowed]
    if bad:
        parser.error("%s: unknown %s (choose from %s)" % (flag, ", ".join(bad),
                                                          ", ".join(allowed)))
    return chosen


# ---- the top level: one measurement process per MPS setting --------------------------


def mps_control_binary():
    """nvidia-cuda-mps-control on PATH, or where NVIDIA's container runtime puts it."""
    found = shutil.which("nvidia-cuda-mps-control")
    alt = "/usr/local/nvidia/bin/nvidia-cuda-mps-control"
    return found or (alt if os.access(alt, os.X_OK) else None)


class MpsControl:
    """An MPS control daemon of this script's own, on private pipe and log directories."""

    def __init__(self, binary):
        self.binary = binary
        self.dir = tempfile.mkdtemp(prefix="normd-bench-mps.")
        self.env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=os.path.join(self.dir, "pipe"),
                        CUDA_MPS_LOG_DIRECTORY=os.path.join(self.dir, "log"))
        os.makedirs(self.env["CUDA_MPS_PIPE_DIRECTORY"])
        os.makedirs(self.env["CUDA_MPS_LOG_DIRECTORY"])
        self.running = False

    def start(self):
        """Starts it; returns None, or why it could not."""
        try:
            out = subprocess.run([self.binary, "-d"], env=self.env, capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return "%s -d: %s" % (self.binary, e)
        if out.returncode != 0:
            return "%s -d exited %d: %s" % (self.binary, out.returncode,
                                            (out.stderr or out.stdout).strip())
        self.running = True
        control = os.path.join(self.env["CUDA_MPS_PIPE_DIRECTORY"], "control")
        deadline = time.monotonic() + 10
        while not os.path.exists(control):
            if time.monotonic() > deadline:
                return "no control pipe at %s after 10 s; its log:\n%s" % (control, self.log())
            time.sleep(0.05)
        return None

    def log(self):
        path = os.path.join(self.env["CUDA_MPS_LOG_DIRECTORY"], "control.log")
        try:
            return Path(path).read_text(errors="replace")[-2000:]
        except OSError:
            return "(no %s)" % path

    def stop(self):
        """Asks it to quit (which stops its MPS server too) and removes its directories."""
        if self.running:
            try:
                subprocess.run([self.binary], input="quit\n", env=self.env, text=True,
                               capture_output=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired) as e:
                print("warning: stopping the MPS control daemon: %s" % e, flush=True)
            self.running = False
        shutil.rmtree(self.dir, ignore_errors=True)


def run_worker(argv, env, label):
    """Runs the measurement in a child process; returns (exit status, its JSON or None)."""
    fd, path = tempfile.mkstemp(prefix="bench_train.", suffix=".json")
    os.close(fd)
    try:
        # The child ignores --mps and --json: it writes its results to `path`.
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", path,
               "--mps-label", label]
        rc = subprocess.call(cmd, env=env)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None
        return rc, data
    finally:
        os.unlink(path)


def run_without_mps(argv):
    """The run without MPS; (status, JSON)."""
    env, empty = dict(os.environ), None
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    if os.path.exists(os.path.join(pipe, "control")):
        # Someone's MPS control daemon would capture the child: CUDA looks for the
        # control pipe in CUDA_MPS_PIPE_DIRECTORY, and an empty directory has none.
        print("note: an MPS control daemon listens at %s; this run points "
              "CUDA_MPS_PIPE_DIRECTORY at an empty directory instead" % pipe, flush=True)
        empty = tempfile.mkdtemp(prefix="normd-bench-nomps.")
        env["CUDA_MPS_PIPE_DIRECTORY"] = empty
        env.pop("CUDA_MPS_LOG_DIRECTORY", None)
    try:
        rc, data = run_worker(argv, env, "off")
    finally:
        if empty:
            shutil.rmtree(empty, ignore_errors=True)
    return rc, data or {"mps_requested": False, "exit_status": rc}


def run_with_mps(argv):
    """The run under an MPS daemon of our own; (status, JSON), saying why if none ran."""
    binary = mps_control_binary()
    if binary is None:
        why = "nvidia-cuda-mps-control is neither on PATH nor in /usr/local/nvidia/bin"
        print("MPS: cannot run under MPS: %s; the MPS run is skipped" % why, flush=True)
        return 0, {"mps_requested": True, "skipped": why}
    mps = MpsControl(binary)
    try:
        why = mps.start()
        if why:
            print("MPS: cannot start an MPS control daemon: %s; the MPS run is skipped" % why,
                  flush=True)
            return 0, {"mps_requested": True, "skipped": why}
        print("MPS control daemon started (%s, pipe directory %s)"
              % (binary, mps.env["CUDA_MPS_PIPE_DIRECTORY"]), flush=True)
        rc, data = run_worker(argv, mps.env, "on")
        if rc == 2:
            print("the MPS control daemon's log ends:\n%s" % mps.log(), flush=True)
        return rc, data or {"mps_requested": True, "exit_status": rc}
    finally:
        mps.stop()


def top_level(args, argv):
    """Runs the measurement without and/or with MPS, merges the JSON; returns the status."""
    runs, status = [], 0
    if args.mps in ("off", "both"):
        if args.mps == "both":
            print("== without MPS", flush=True)
        rc, data = run_without_mps(argv)
        status, runs = max(status, rc), runs + [data]
    if args.mps in ("both", "only"):
        print("\n== with MPS", flush=True)
        rc, data = run_with_mps(argv)
        status, runs = max(status, rc), runs + [data]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
        print("\nJSON: %s" % args.json, flush=True)
    return status


# ---- the model ------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block: attention and a 4x GELU MLP, each with a residual.

    add_norm: a constructor d -> module(input, residual) -> (norm(s), s) with
    s = input + residual: the attention's residual add then goes into norm2's
    call (--residual fused), as stacks with a fused add + norm write it.
    """

    def __init__(self, d, head_dim, norm, add_norm=None):
        super().__init__()
        self.heads = d // head_dim
        self.norm1 = norm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fused_residual = add_norm is not None
        self.norm2 = add_norm(d) if add_norm else norm(d)
        self.fc1 = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = self.proj(a.transpose(1, 2).reshape(b, s, d))
        if self.fused_residual:
            h, x = self.norm2(a, x)
        else:
            x = x + a
            h = self.norm2(x)
        return x + self.fc2(F.gelu(self.fc1(h)))


class Model(nn.Module):
    """Blocks, a final norm, a linear head; returns the MSE against `target`."""

    def __init__(self, d, layers, head_dim, norm, add_norm=None):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, head_dim, norm, add_norm) for _ in range(layers))
        self.norm = norm(d)
        self.head = nn.Linear(d, d, bias=False)

    def forward(self, x, target):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(self.norm(x)).float(), target.float())


def norm_factory(impl, norm, apex):
    """A constructor d -> norm module of this implementation and kind."""
    rms = norm == "rmsnorm"
    if impl == "torch":
        cls = nn.RMSNorm if rms else nn.LayerNorm
    elif impl == "apex":
        cls = apex.normalization.FusedRMSNorm if rms else apex.normalization.FusedLayerNorm
    else:
        cls = N.FusedRMSNorm if rms else N.FusedLayerNorm
    return lambda d: cls(d, eps=EPS)


class TorchAddLayerNorm(nn.LayerNorm):
    """PyTorch's add then LayerNorm, in the fused modules' form: forward(input, residual) -> (y, s)."""

    def forward(self, input, residual):
        s = input + residual
        return super().forward(s), s


class TorchAddRMSNorm(nn.RMSNorm):
    """PyTorch's add then RMSNorm: forward(input, residual) -> (y, s)."""

    def forward(self, input, residual):
        s = input + residual
        return super().forward(s), s


def add_norm_factory(impl, norm):
    """For --residual fused: a constructor d -> add + norm module of this implementation."""
    rms = norm == "rmsnorm"
    if impl == "torch":
        cls = TorchAddRMSNorm if rms else TorchAddLayerNorm
    elif impl == "normd":
        cls = N.FusedAddRMSNorm if rms else N.FusedAddLayerNorm
    else:
        raise ValueError("%s has no residual add + norm module" % impl)
    return lambda d: cls(d, eps=EPS)


def train_step(fn, opt, x, target):
    opt.zero_grad(set_to_none=True)
    loss = fn(x, target)
    loss.backward()
    opt.step()
    return loss


@contextlib.contextmanager
def completion(mode):
    """normd's completion mode for the block (None: leave it; see MODES)."""
    python_path = mode == "enqueue-python"
    old = normd.set_completion_mode("enqueue" if python_path else mode) if mode else None
    try:
        with normd.eager.paused() if python_path else contextlib.nullcontext():
            yield
    finally:
        if mode:
            normd.set_completion_mode(old)


# ---- one d_model: every variant ----------------------------------------------------------


class Variant:
    """One cell: an implementation, a completion mode (normd), eager or compiled."""

    def __init__(self, impl, mode, compiled):
        self.impl, self.mode, self.compiled = impl, mode, compiled
        self.fn = None
        self.times = []
        self.host_times = []  # until the step's last launch returned, before the sync
        self.check = None
        self.error = None
        self.skipped = None
        self.first_step_s = None
        self.graph_breaks = None
        self.regions_added = 0  # normd: the daemon's regions gained over the timed steps

    @property
    def column(self):
        return "normd %s" % self.mode if self.impl == "normd" else self.impl

    def record(self, norm, d, base_ms):
        ms = statistics.median(self.times) if self.times and not self.error else None
        host_ms = statistics.median(self.host_times) if ms and self.host_times else None
        return dict(norm=norm, d_model=d, impl=self.impl, mode=self.mode,
                    compiled=self.compiled, column=self.column, ms=ms, host_ms=host_ms,
                    ratio=ms / base_ms if ms and base_ms else None, step_ms=self.times,
                    check=self.check, error=self.error, skipped=self.skipped,
                    first_step_s=self.first_step_s, graph_breaks=self.graph_breaks,
                    regions_added=self.regions_added)


class Group:
    """The models of one (norm kind, d_model), their shared inputs and the reference step."""

    def __init__(self, worker, norm, d):
        self.w, self.args, self.norm, self.d = worker, worker.args, norm, d
        self.models, self.opts, self.errors, self.compiled_fns = {}, {}, {}, {}
        args, dev = self.args, worker.device
        gen = torch.Generator(device=dev).manual_seed(1000 + d)
        shape = (args.tokens // args.seq, args.seq, d)
        self.x = torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16)
        self.target = torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16)
        for impl in args.impl_list:
            self.build(impl)
        self.ref_state, self.ref_loss, self.ref_grads = None, None, None
        if "torch" in self.models:
            try:
                self.reference()
            except Exception as e:
                self.errors["torch"] = "the reference step failed: " + error_text(e)

    def build(self, impl):
        if impl == "apex" and self.w.apex is None:
            self.errors[impl] = "skipped: apex " + self.w.apex_error
            return
        if impl == "apex" and self.args.residual == "fused":
            self.errors[impl] = "skipped: apex has no residual add + norm module"
            return
        try:
            torch.manual_seed(self.d)  # the same Linear weights for every model
            with torch.device(self.w.device):
                add_norm = add_norm_factory(impl, self.norm) \
                    if self.args.residual == "fused" else None
                model = Model(self.d, self.args.layers, self.args.head_dim,
                              norm_factory(impl, self.norm, self.w.apex), add_norm)
            self.models[impl] = model.to(dtype=torch.bfloat16)
            fused = {"fused": True} if self.w.cuda else {}
            self.opts[impl] = torch.optim.AdamW(model.parameters(), lr=LR, **fused)
        except Exception as e:
            self.errors[impl] = error_text(e)

    def reference(self):
        """Randomizes the norms' parameters; PyTorch's eager step gives loss and gradients."""
        model = self.models["torch"]
        gen = torch.Generator(device=self.w.device).manual_seed(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    shift = 1.0 if name.endswith("weight") else 0.0
                    p.copy_(shift + 0.2 * torch.rand(p.shape, generator=gen,
                                                     device=p.device) - 0.1)
        self.ref_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.zero_grad(set_to_none=True)
        loss = model(self.x, self.target)
        loss.backward()
        self.ref_loss = loss.item()
        self.ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)

    def free(self):
        self.models = self.opts = self.compiled_fns = {}
        self.ref_state = self.ref_grads = None
        self.x = self.target = None

    # ---- one eager or compiled pass over the variants ---------------------------------

    def variants(self, compiled):
        out = []
        for impl in self.args.impl_list:
            for mode in (self.args.mode_list if impl == "normd" else [None]):
                v = Variant(impl, mode, compiled)
                error = self.errors.get(impl) or (self.w.compile_error if compiled else None)
                if error and error.startswith("skipped: "):
                    v.skipped = error[len("skipped: "):]
                elif error:
                    v.error = error
                elif compiled and mode == "enqueue-python":
                    # Compiled code calls the torch.library ops, whose C++ kernels serve
                    # both once loaded: the row would time the enqueue row's path again.
                    v.skipped = "compiled code takes the ops' C++ kernels either way"
                out.append(v)
        return out

    def run(self, compiled):
        """Checks, warms up and times every variant; returns their records."""
        if compiled:
            torch._dynamo.reset()  # each pass compiles afresh, far below dynamo's cache limit
        variants = self.variants(compiled)
        live = [v for v in variants if not (v.error or v.skipped)]
        for v in live:
            self.attempt(v, self.prepare)
        live = [v for v in live if not v.error]
        # The variants share the caching allocator, so each one's tensors land in blocks
        # the others left: untimed interleaved rounds first, so that normd's first use of
        # a segment (a registration) falls there rather than in the timed steps.
        for r in range(self.args.rounds):
            for v in (v for v in live if not v.error):
                self.attempt(v, lambda v: self.untimed_step(v))
        per_round = -(-self.args.steps // self.args.rounds)
        for r in range(self.args.rounds):
            count = min(per_round, self.args.steps - r * per_round)
            for v in (v for v in live if not v.error and count > 0):
                self.attempt(v, lambda v: self.time_steps(v, count))
        for v in (v for v in live if v.impl == "normd" and not v.error):
            print("  %-14s %-8s daemon regions gained over the timed steps: %d" % (
                v.column, "compiled" if v.compiled else "eager", v.regions_added),
                file=sys.stderr, flush=True)
        base = next((v for v in variants if v.impl == "torch"), None)
        base_ms = statistics.median(base.times) if base and base.times and not base.error \
            else None
        return [v.record(self.norm, self.d, base_ms) for v in variants]

    def attempt(self, v, what):
        """Runs what(v); an exception becomes the cell's error (and normd's later errors too)."""
        try:
            what(v)
            if v.impl == "normd":
                self.w.client.check()
        except Exception as e:
            v.error = error_text(e)
            print("  %s %s: %s" % (v.column, "compiled" if v.compiled else "eager", v.error),
                  file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                self.w.sync()
                self.w.client.check()  # so that the next cell does not inherit the error

    def fn_for(self, v):
        model = self.models[v.impl]
        if not v.compiled:
            return model
        if v.impl not in self.compiled_fns:
            # apex's autograd Function calls its extension directly: dynamo breaks the graph.
            self.compiled_fns[v.impl] = torch.compile(model, fullgraph=(v.impl != "apex"))
        return self.compiled_fns[v.impl]

    def prepare(self, v):
        """The correctness step from the reference weights (and compiling), then warm-up."""
        from torch._dynamo.utils import counters
        if self.ref_state is None:
            raise RuntimeError("no reference weights: PyTorch's model failed first")
        model, opt = self.models[v.impl], self.opts[v.impl]
        v.fn = self.fn_for(v)
        model.load_state_dict(self.ref_state)
        counters.clear()
        jobs_before = self.w.settled_jobs_ok()
        with completion(v.mode):
            start = time.perf_counter()
            model.zero_grad(set_to_none=True)
            loss = v.fn(self.x, self.target)
            loss.backward()
            self.w.sync()
            v.first_step_s = time.perf_counter() - start
            if v.compiled:
                v.graph_breaks = sum(counters["graph_break"].values())
            # Every norm, forward and backward, must have been a daemon job (none fell back).
            expected = 2 * (2 * self.args.layers + 1) if v.impl == "normd" else 0
            jobs = self.w.jobs_ok(jobs_before + expected) - jobs_before
            v.check = self.compare(model, loss.item(), jobs, expected)
            print("  %-14s %-8s first step %.2f s; check %s" % (
                v.column, "compiled" if v.compiled else "eager", v.first_step_s,
                check_text(v.check)), file=sys.stderr, flush=True)
            for _ in range(self.args.warmup):
                train_step(v.fn, opt, self.x, self.target)
            self.w.sync()

    def compare(self, model, loss, jobs, expected_jobs):
        """Loss and gradients against PyTorch's eager step from the same weights."""
        if self.ref_grads is None:
            return None
        loss_rel = abs(loss - self.ref_loss) / max(abs(self.ref_loss), 1e-30)
        worst, worst_name = 0.0, None
        for name, p in model.named_parameters():
            ref = self.ref_grads[name].float()
            if p.grad is None:
                worst, worst_name = math.inf, name + " (no gradient)"
                break
            rel = ((p.grad.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            rel = math.inf if math.isnan(rel) else rel
            if rel > worst or worst_name is None:
                worst, worst_name = rel, name
        ok = loss_rel <= LOSS_RTOL and worst <= GRAD_RTOL and jobs == expected_jobs
        return dict(ok=ok, loss=loss, ref_loss=self.ref_loss, loss_rel=loss_rel,
                    grad_rel=worst, grad_param=worst_name, daemon_jobs=jobs,
                    expected_jobs=expected_jobs)

    def untimed_step(self, v):
        with completion(v.mode):
            train_step(v.fn, self.opts[v.impl], self.x, self.target)
            self.w.sync()

    def time_steps(self, v, count):
        """`count` steps, each from a synchronized GPU to a synchronized GPU; also the
        host's part, until the step's last launch (and normd job) has been sent."""
        opt = self.opts[v.impl]
        # Regions registered while timing (none once the allocator's blocks repeat).
        regions = self.w.client.stats()["regions"] if v.impl == "normd" else 0
        with completion(v.mode):
            for _ in range(count):
                self.w.sync()
                start = time.perf_counter()
                loss = train_step(v.fn, opt, self.x, self.target)
                launched = time.perf_counter()
                self.w.sync()
                v.times.append((time.perf_counter() - start) * 1e3)
                v.host_times.append((launched - start) * 1e3)
        if v.impl == "normd":
            v.regions_added += self.w.client.stats()["regions"] - regions
        if not torch.isfinite(loss).item():
            raise RuntimeError("the loss is %s" % loss.item())


def check_text(check):
    if check is None:
        return "n/a (no reference)"
    jobs = check["daemon_jobs"] != check["expected_jobs"]
    if check["ok"] or not jobs:
        return "%s loss %.2g%%, grad %.2g%%%s" % (
            "ok" if check["ok"] else "OUT OF TOLERANCE", 100 * check["loss_rel"],
            100 * check["grad_rel"], "" if check["ok"] else " (%s)" % check["grad_param"])
    return "WRONG: the daemon ran %d jobs, not %d" % (check["daemon_jobs"],
                                                      check["expected_jobs"])


# ---- the measurement process -------------------------------------------------------------


class Worker:
    """One measurement: its daemon, the host-cost table, the training-step tables."""

    def __init__(self, args):
        self.args = args
        self.failures = 0
        self.client = self.daemon = None
        self.out = {"mps_requested": args.mps_label == "on", "config": {}, "host_cost": [],
                    "train": []}

    def main(self):
        try:
            self.setup()
        except Exception as e:  # nothing can be measured without normd and a daemon
            print("error: %s" % error_text(e), flush=True)
            self.teardown()
            self.write_json()
            return 2
        try:
            self.print_header()
            if self.args.host_calls > 0:
                self.host_cost_table()
            for norm in self.args.norm_list:
                self.train_table(norm)
        finally:
            self.teardown()
            self.write_json()
        return 1 if self.failures else 0

    def setup(self):
        global normd, N
        args = self.args
        build = Path(args.build)
        self.build = build if build.is_absolute() else Path.cwd() / build
        lib = self.build / "lib" / "libnormclient.so"
        if lib.exists():
            os.environ.setdefault("NORMD_LIBRARY", str(lib))
        self.cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        if self.cuda and not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch %s sees no CUDA device"
                               % torch.__version__)
        if not self.cuda and not args.quick:
            raise RuntimeError("torch %s sees no CUDA device (only --quick runs on CPU)"
                               % torch.__version__)
        if not self.cuda:
            # CPU tensors go to the CPU-backend daemon instead of torch's fallback.
            os.environ["NORMD_TORCH_CPU"] = "daemon"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        import normd
        from normd import normalization as N
        socket = os.environ.get("NORMD_SOCKET")
        if not socket:
            from normd_daemon import Daemon
            self.daemon = Daemon(self.build / "bin" / "normd", "0" if self.cuda else "cpu",
                                 *shlex.split(args.daemon_args), log_level="info",
                                 start_timeout=60, stop_timeout=30)
            socket = self.daemon.socket
        self.client = normd.Client(socket, name="bench_train")
        normd.set_default_client(self.client)
        if self.cuda:
            normd.eager.norm_op()  # built now (once per torch), not inside a step
            print(normd.eager.status(), flush=True)
        self.apex, self.apex_error = load_apex()
        self.compile_error = None if hasattr(torch, "compile") else \
            "torch %s has no torch.compile" % torch.__version__

    def teardown(self):
        if self.client is not None:
            normd.set_default_client(None)
            self.client.close()
        if self.daemon is not None:
            rc = self.daemon.stop()
            if rc != 0:
                print("warning: normd exited %s on SIGTERM; its log ends:\n%s"
                      % (rc, self.daemon.log()[-3000:]), flush=True)
                self.failures += 1
            self.daemon.cleanup()

    def write_json(self):
        with open(self.args.worker, "w") as f:
            json.dump(self.out, f, indent=1)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def settled_jobs_ok(self):
        """The daemon's jobs_ok once two readings 20 ms apart agree (1 s at most)."""
        deadline, last = time.monotonic() + 1, self.jobs_ok()
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = self.jobs_ok()
            if now == last:
                break
            last = now
        return last

    def jobs_ok(self, target=None):
        """The daemon's jobs_ok; with target, once it reaches it (5 s at most)."""
        deadline = time.monotonic() + 5
        while True:
            now = self.client.stats()["jobs_ok"]
            if target is None or now >= target or time.monotonic() > deadline:
                return now
            time.sleep(0.01)

    def print_header(self):
        args, stats = self.args, self.client.stats()
        mps = "n/a (CPU backend)" if not stats["has_mps"] else ("yes" if stats["mps"] else "no")
        gpu = torch.cuda.get_device_name(0) if self.cuda else "none (CPU tensors)"
        batch = args.tokens // args.seq
        info = dict(
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            commit=git_commit(), gpu=gpu, torch=torch.__version__,
            apex=self.apex_error or getattr(self.apex, "__version__", "imported"),
            normd_library=normd.library_path(),
            normd_server=self.client.server_info["version"],
            daemon=("own, " + self.daemon.socket) if self.daemon else
            ("$NORMD_SOCKET=" + self.client.socket), daemon_args=args.daemon_args,
            mps=mps, mps_requested=self.out["mps_requested"],
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            layers=args.layers, tokens=args.tokens, batch=batch, seq=args.seq,
            head_dim=args.head_dim, steps=args.steps, rounds=args.rounds, warmup=args.warmup)
        self.out["config"] = info
        print("GPU: %s; torch %s; apex: %s" % (gpu, info["torch"], info["apex"]))
        print("normd %s, daemon %s%s; library %s"
              % (info["normd_server"], info["daemon"],
                 " " + args.daemon_args if self.daemon and args.daemon_args else "",
                 info["normd_library"]))
        print("MPS: %s (normd's stats)%s" % (mps, "; an MPS daemon of ours was started"
                                             if info["mps_requested"] else ""))
        print("date %s, commit %s" % (info["date"], info["commit"]))
        if info["alloc_conf"]:
            print("PYTORCH_CUDA_ALLOC_CONF=%s" % info["alloc_conf"])
        print("model: pre-norm blocks x%d, bf16, %d tokens (batch %d x seq %d), heads of %d, "
              "MLP 4x GELU, linear head + MSE, AdamW; residual add %s; median of %d steps in "
              "%d rounds after %d warm-up"
              % (args.layers, args.tokens, batch, args.seq, args.head_dim,
                 "in norm2's call (--residual fused)" if args.residual == "fused"
                 else "before the norm", args.steps, args.rounds, args.warmup), flush=True)

    def host_cost_table(self):
        calls = self.args.host_calls
        print("\n### Host cost of one call (8 x 1024 bf16, requires grad; %d calls)\n" % calls)
        print("| call | median us | p90 us | / F.layer_norm |")
        print("|---|---|---|---|")
        base = None
        for name, mode, fn in host_cost_calls(self.device):
            row = {"call": name, "mode": mode}
            try:
                times = time_calls(fn, calls, mode, self.client, self.sync)
                row.update(median_us=statistics.median(times), p90_us=percentile(times, 0.9))
                if name == "F.layer_norm":
                    base = row["median_us"]
                ratio = "%.2f" % (row["median_us"] / base) if base else "-"
                print("| %s | %.1f | %.1f | %s |" % (name, row["median_us"], row["p90_us"],
                                                     ratio), flush=True)
            except Exception as e:
                row["error"] = error_text(e)
                self.failures += 1
                print("| %s | error: %s | | |" % (name, row["error"][:300]), flush=True)
                with contextlib.suppress(Exception):
                    self.sync()
                    self.client.check()
            self.out["host_cost"].append(row)

    def train_table(self, norm):
        records = []
        for d in self.args.d_model_list:
            print("[%s d_model=%d]" % (norm, d), file=sys.stderr, flush=True)
            group = None
            try:
                group = Group(self, norm, d)
                for compiled in (False, True):
                    if not (compiled and self.args.no_compile):
                        records += group.run(compiled)
            except Exception as e:  # what no cell caught (the inputs, say): the row says it
                records.append(dict(norm=norm, d_model=d, impl="torch", mode=None,
                                    compiled=False, column="torch", ms=None, ratio=None,
                                    error=error_text(e), check=None, skipped=None))
            finally:
                if group is not None:
                    group.free()
                del group
                if not self.args.no_compile:
                    torch._dynamo.reset()  # compiled code must not keep the models alive
                if self.cuda:
                    torch.cuda.empty_cache()
        self.out["train"].extend(records)
        self.failures += sum(1 for r in records if r.get("error") or
                             (r.get("check") and not r["check"]["ok"]))
        print_train_tables(norm, records, self.args)


def git_commit():
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10)
        if head.returncode == 0:
            return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown (no git checkout here)"


def load_apex():
    """apex (with apex.normalization imported), or (None, why not)."""
    try:
        import apex
        import apex.normalization  # noqa: F401
        return apex, None
    except Exception as e:  # ImportError, or a broken build that raises anything on import
        first = str(e).splitlines()[0] if str(e) else ""
        return None, "not importable (%s: %s)" % (type(e).__name__, first)


def error_text(e):
    return " ".join(("%s: %s" % (type(e).__name__, e)).split())[:600]


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- printing the training-step tables ---------------------------------------------------


def print_train_tables(norm, records, args):
    columns = []
    for r in records:
        if r["column"] not in columns:
            columns.append(r["column"])
    cells = {(r["d_model"], r["compiled"], r["column"]): r for r in records}
    rows = [(d, c) for d in args.d_model_list for c in (False, True)
            if any((d, c, col) in cells for col in columns)]
    notes = []

    def note(text):
        if text not in notes:
            notes.append(text)
        return "[%d]" % (notes.index(text) + 1)

    def timing(r):
        if r is None:
            return "-"
        if r.get("skipped"):
            return "skipped " + note(r["skipped"])
        if r.get("error"):
            return "error " + note(r["error"])
        return "%.2f" % r["ms"] if r["ratio"] is None or r["impl"] == "torch" else \
            "%.2f (%.3fx)" % (r["ms"], r["ratio"])

    def checked(r):
        if r is None or r.get("skipped") or not r.get("check"):
            return "-"
        return check_text(r["check"]).replace("OUT OF TOLERANCE", "OUT")

    title = NORM_TITLES[norm]
    head = "| d_model | | " + " | ".join(columns) + " |\n|" + "---|" * (len(columns) + 2)
    print("\n### %s: median training step, ms (ratio to PyTorch's own)\n" % title)
    print(head)
    for d, c in rows:
        print("| %d | %s | %s |" % (d, "compiled" if c else "eager",
                                    " | ".join(timing(cells.get((d, c, col))) for col in columns)))
    print("\n%s check, one step against PyTorch eager from the same weights: loss and worst "
          "gradient, relative (tolerance %g%% / %g%%)\n"
          % (title, 100 * LOSS_RTOL, 100 * GRAD_RTOL))
    print(head)
    for d, c in rows:
        print("| %d | %s | %s |" % (d, "compiled" if c else "eager",
                                    " | ".join(checked(cells.get((d, c, col))) for col in columns)))

    def host(r):
        if r is None or not r.get("host_ms"):
            return "-"
        return "%.2f (%.2f)" % (r["host_ms"], r["host_ms"] / r["ms"])

    print("\n%s: the host's part of the step, ms until its last launch returned (share of "
          "the step; near 1: bound by the Python thread, well below: by the GPU)\n" % title)
    print(head)
    for d, c in rows:
        print("| %d | %s | %s |" % (d, "compiled" if c else "eager",
                                    " | ".join(host(cells.get((d, c, col))) for col in columns)))
    compiled = [r for r in records if r["compiled"] and r.get("first_step_s") is not None]
    if compiled:
        print("\nCompiled, first step (compilation and check), s: " + "; ".join(
            "%d %s %.1f%s" % (r["d_model"], r["column"], r["first_step_s"],
                              " (%d graph breaks)" % r["graph_breaks"] if r["graph_breaks"]
                              else "") for r in compiled if r["impl"] != "normd" or
            r["mode"] == args.mode_list[0]))
    for i, text in enumerate(notes):
        print("[%d] %s" % (i + 1, text))
    sys.stdout.flush()


# ---- host cost of one call ------------------------------------------------------------------


class EmptyFunction(torch.autograd.Function):
    """The least an autograd Function costs: a view out, the gradient through."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def empty_custom_op():
    """A custom op that allocates its output and does nothing else (None before 2.4)."""
    if not (hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_autograd")):
        return None

    @torch.library.custom_op("normd_bench::empty", mutates_args=())
    def empty(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    # Registered like normd's ops, with autograd, so that it is timed the same way.
    torch.library.register_autograd("normd_bench::empty", lambda ctx, grad: grad)
    return empty


def host_cost_calls(device):
    """(name, normd completion mode or None, fn) for each row of the host-cost table."""
    x = torch.randn(8, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    b = torch.zeros(1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    ln = nn.LayerNorm(1024, eps=EPS, device=device, dtype=torch.bfloat16)
    ours_ln = N.FusedLayerNorm(1024, eps=EPS).to(device=device, dtype=torch.bfloat16)
    ours_rms = N.FusedRMSNorm(1024, eps=EPS).to(device=device, dtype=torch.bfloat16)
    rows = [("F.layer_norm", None, lambda: F.layer_norm(x, (1024,), w, b, EPS)),
            ("nn.LayerNorm", None, lambda: ln(x)),
            ("empty autograd.Function", None, lambda: EmptyFunction.apply(x))]
    empty_op = empty_custom_op()
    if empty_op is not None:
        rows.append(("empty custom_op (returns empty_like)", None, lambda: empty_op(x)))
    rows += [("normd FusedLayerNorm, %s" % m, m, lambda: ours_ln(x)) for m in MODES]
    rows += [("normd FusedRMSNorm, %s" % m, m, lambda: ours_rms(x)) for m in MODES]
    return rows


def time_calls(fn, calls, mode, client, sync):
    """perf_counter around each call; the GPU is synchronized between batches, untimed."""
    with completion(mode):
        for _ in range(min(HOST_WARMUP, calls)):
            fn()
        sync()
        times = []
        while len(times) < calls:
            for _ in range(min(HOST_BATCH, calls - len(times))):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e6)
            sync()
            if mode:
                client.check()  # the enqueue mode's later errors surface here
        return times


def main(argv):
    args = parse_args(argv)
    if args.worker:
        return Worker(args).main()
    return top_level(args, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
