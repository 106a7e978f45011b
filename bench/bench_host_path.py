"""The host cost of one normd.normalization call, beside PyTorch's own norms.

What is timed: perf_counter around each call, nothing synchronized inside
the timed call; the median and 90th percentile over --calls calls per row,
taken in --rounds interleaved rounds (every row a slice in turn, so that
clock drift falls on all rows alike) after a warmup. Between batches of 100
calls, untimed, the GPU is synchronized and normd's asynchronous errors are
collected (Client.check). The tensors: x of --shape (default 8 x 1024) and
--dtype (bf16) requiring grad, weight and bias of the last dimension
requiring grad. Rows:

- F.layer_norm / F.rms_norm, forward, and forward + backward
  (``y.backward(dy)``; the gradients are set to None between calls, untimed);
- an empty torch.autograd.Function (returns a view, gradient through): the
  least any autograd Function costs;
- normd's FusedLayerNorm and FusedRMSNorm (affine), forward and forward +
  backward, in the enqueue completion mode through the compiled eager operator
  (normd.eager) and through the package's Python path (``--modes``: enqueue,
  enqueue-python, sync, event);
- the library alone: Client.enqueue_job of a job prepared once (ctypes,
  nc_job_enqueue: checking, encoding, the stream's semaphore operations,
  sending).

The "py calls" column counts the Python-level calls of one call
(sys.setprofile: Python functions and the builtins they call).

Two ways to run, chosen by whether torch sees a GPU (or --stub):

- GPU: everything is real. The daemon is $NORMD_SOCKET if set, else
  BUILD/bin/normd --device 0 started on a private socket.
- Stub (no GPU): the CUDA-only pieces are replaced and everything above
  them runs as on the GPU. CPU tensors pretend to be CUDA tensors (the
  ``is_cuda`` property answers True), torch.cuda's stream and capture
  queries return constants, and the libnormclient calls that need a GPU
  (nc_tensor_device, nc_job_enqueue, nc_job_enqueue_device) are replaced by
  a C function that returns 0, called through ctypes with the real
  prototypes, so the binding's Python and its ctypes marshalling are timed
  but not the library's work. torch's own rows compute on the CPU. A
  BUILD/bin/normd --device cpu is started (the client connects to it) and
  the library row is real: it enqueues a job on host memory to that daemon.

Usage:
    python3 bench/bench_host_path.py                       # stub here, real on a GPU
    LD_LIBRARY_PATH=build/lib/gpu-host python3 bench/bench_host_path.py --build build
    python3 bench/bench_host_path.py --profile normd_ln_fwd   # cProfile of one row
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# The enqueue rows use the compiled eager operator (normd's default), the
# enqueue-python rows the package's Python path (NORMD_EAGER=0 puts both there).

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bindings" / "python"), str(REPO / "tests" / "python")]

EPS = 1e-5
BATCH = 100
STUB_STREAM = 0x5EED
STUBBED_CALLS = ("nc_tensor_device", "nc_job_enqueue", "nc_job_enqueue_device",
                 "nc_job_enqueue_ext", "nc_tensor_device_range", "nc_job_enqueue_device_ext")
STUB_SOURCE = "int normd_bench_stub(void) { return 0; }\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=str(REPO / "build"), help="the build directory (build)")
    p.add_argument("--calls", type=int, default=5000, help="timed calls per row (5000)")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds (10)")
    p.add_argument("--warmup", type=int, default=300, help="untimed calls per row first (300)")
    p.add_argument("--shape", default="8x1024", help="x's shape, e.g. 8x1024 (8x1024)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--modes", default="enqueue,enqueue-python",
                   help="normd completion modes; enqueue-python: the enqueue mode on the "
                        "package's Python path (enqueue,enqueue-python)")
    p.add_argument("--rows", help="comma-separated row keys to run (all)")
    p.add_argument("--stub", action="store_true", help="stub the GPU pieces even with a GPU")
    p.add_argument("--profile", metavar="ROW", help="cProfile one row's calls instead")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


# ---- the stub: CUDA tensors and the GPU calls of libnormclient, without a GPU ---------------


class _StubStream:
    cuda_stream = STUB_STREAM


class _StubLibrary:
    """libnormclient with the GPU-only calls replaced by a C function that returns 0."""

    def __init__(self, real, stub_path, prototypes):
        import ctypes

        self._real = real
        stub = ctypes.CDLL(stub_path)
        for name in STUBBED_CALLS:
            fn = stub["normd_bench_stub"]  # a fresh function object per name
            restype, argtypes = prototypes.get(name, (ctypes.c_int, None))
            fn.restype = restype
            if argtypes is not None:
                fn.argtypes = argtypes
            setattr(self, name, fn)

    def __getattr__(self, name):
        return getattr(self._real, name)


def install_stub(workdir):
    """Makes CPU tensors pass for CUDA tensors and stubs the GPU calls; returns a description."""
    src = Path(workdir) / "stub.c"
    lib = Path(workdir) / "libnormd_bench_stub.so"
    src.write_text(STUB_SOURCE)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    # torch's CPU rows would otherwise spread tiny ops over an OpenMP pool that
    # competes with the daemon for the cores; on a GPU they run on one thread.
    torch.set_num_threads(1)
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.current_stream = lambda device=None: _StubStream()
    torch._C._cuda_getCurrentRawStream = lambda index: STUB_STREAM
    torch._C._cuda_isCurrentStreamCapturing = lambda: False

    from normd import _lib

    real_load = _lib.load
    prototypes = getattr(_lib, "_PROTOTYPES", {})
    stubbed = {}

    def load():
        real = real_load()
        if "lib" not in stubbed:
            stubbed["lib"] = _StubLibrary(real, str(lib), prototypes)
        return stubbed["lib"]

    _lib.load = load
    _lib.load_unstubbed = real_load
    # The compiled eager operator binds the stubbed calls and takes host tensors.
    from normd import eager

    eager.norm_op(host_tensors=True)
    return ("stub: CPU tensors as CUDA tensors; %s replaced by a C function returning 0 "
            "(ctypes with the real prototypes); torch.cuda stream/capture queries constant"
            % ", ".join(STUBBED_CALLS))


# ---- the rows -----------------------------------------------------------------------------


class EmptyFunction(torch.autograd.Function):
    """The least an autograd Function costs: a view out, the gradient through."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Row:
    def __init__(self, key, title, fn, mode=None, reset=None, client=None):
        self.key, self.title, self.fn, self.mode, self.reset = key, title, fn, mode, reset
        self.client = client  # whose errors settle() collects (None: the default client)
        self.times = []
        self.py_calls = None


def make_rows(device, dtype, shape, modes, client, library_job):
    import normd.normalization as N

    cols = shape[-1]
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(cols, device=device, dtype=dtype, requires_grad=True)
    b = torch.zeros(cols, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(*shape, device=device, dtype=dtype)
    ln = N.FusedLayerNorm(cols, eps=EPS).to(device=device, dtype=dtype)
    rms = N.FusedRMSNorm(cols, eps=EPS).to(device=device, dtype=dtype)
    add_rms = N.FusedAddRMSNorm(cols, eps=EPS).to(device=device, dtype=dtype)
    residual = torch.randn(*shape, device=device, dtype=dtype)
    params = (x, w, b, ln.weight, ln.bias, rms.weight, add_rms.weight)

    def reset():
        for p in params:
            p.grad = None

    torch_ln = torch.nn.LayerNorm(cols, eps=EPS).to(device=device, dtype=dtype)
    params += (torch_ln.weight, torch_ln.bias)
    # Like for like: function beside function (F.layer_norm, normd's functional
    # form) and module beside module (nn.LayerNorm, FusedLayerNorm).
    rows = [
        Row("torch_ln_fwd", "F.layer_norm forward", lambda: F.layer_norm(x, (cols,), w, b, EPS)),
        Row("torch_rms_fwd", "F.rms_norm forward", lambda: F.rms_norm(x, (cols,), w, EPS)),
        Row("torch_ln_module_fwd", "nn.LayerNorm module forward", lambda: torch_ln(x)),
        Row("empty_fn", "empty autograd.Function forward", lambda: EmptyFunction.apply(x)),
    ]
    for mode in modes:
        rows += [
            Row("normd_ln_fwd" + _suffix(mode), "normd FusedLayerNorm forward, %s" % mode,
                lambda: ln(x), mode),
            Row("normd_rms_fwd" + _suffix(mode), "normd FusedRMSNorm forward, %s" % mode,
                lambda: rms(x), mode),
            Row("normd_ln_functional" + _suffix(mode),
                "normd fused_layer_norm_affine forward, %s" % mode,
                lambda: N.fused_layer_norm_affine(x, w, b, (cols,), EPS), mode),
            Row("normd_add_rms_fwd" + _suffix(mode),
                "normd FusedAddRMSNorm forward (residual add), %s" % mode,
                lambda: add_rms(x, residual), mode),
        ]
    rows += [
        Row("torch_ln_fwd_bwd", "F.layer_norm forward+backward",
            lambda: F.layer_norm(x, (cols,), w, b, EPS).backward(dy), reset=reset),
        Row("torch_rms_fwd_bwd", "F.rms_norm forward+backward",
            lambda: F.rms_norm(x, (cols,), w, EPS).backward(dy), reset=reset),
    ]
    for mode in modes:
        rows += [
            Row("normd_ln_fwd_bwd" + _suffix(mode),
                "normd FusedLayerNorm forward+backward, %s" % mode,
                lambda: ln(x).backward(dy), mode, reset),
            Row("normd_rms_fwd_bwd" + _suffix(mode),
                "normd FusedRMSNorm forward+backward, %s" % mode,
                lambda: rms(x).backward(dy), mode, reset),
        ]
    job, stream = library_job
    rows.append(Row("library_enqueue", "Client.enqueue_job of a prepared job (library alone)",
                    lambda: client.enqueue_job(job, stream=stream), "enqueue", client=client))
    if device == "cuda":
        rows += library_device_rows(client, x, stream)
    return rows


def library_device_rows(client, x, stream):
    """GPU only: the library's lookup of a registered allocation, and a job by pointers."""
    ptr = x.data_ptr()
    rows = [Row("library_device_tensor", "Client.device_tensor of a registered allocation",
                lambda: client.device_tensor(ptr))]
    if hasattr(client, "_enqueue_device"):
        from normd import _lib
        from normd.client import norm_job

        rows_n, cols = x.numel() // x.shape[-1], x.shape[-1]
        y = torch.empty_like(x)
        stats = torch.empty(2, rows_n, device=x.device)
        code = {torch.bfloat16: _lib.DType.BF16, torch.float16: _lib.DType.F16,
                torch.float32: _lib.DType.F32}[x.dtype]
        job = norm_job(int(_lib.Op.RMSNORM_FWD), rows_n, cols, EPS, int(code), 0, 0)
        ptrs = _lib.pack_device_pointers(ptr, y.data_ptr(), 0, stats[1].data_ptr(), 0, 0, 0, 0,
                                         0, 0, 0)
        library_device_rows.keep = (y, stats)  # the job names these tensors
        rows.append(Row("library_enqueue_device",
                        "nc_job_enqueue_device of prepared pointers (library alone)",
                        lambda: client._enqueue_device(job, ptrs, stream), "enqueue"))
    return rows


def _suffix(mode):
    return "" if mode == "enqueue" else "_" + mode


def real_client(socket):
    """A client on the real library (stub mode: for the library-alone row)."""
    import normd
    from normd import _lib

    stubbed, _lib.load = _lib.load, _lib.load_unstubbed
    try:
        return normd.Client(socket=socket, name="bench_host_path:library")
    finally:
        _lib.load = stubbed


def prepare_library_job(client, device, stub, rows, cols):
    """A LayerNorm forward job built once, for the library-alone row: (job, stream)."""
    import numpy

    if stub:  # host memory of the CPU daemon, enqueued with a key of its own
        x = client.host_copy(numpy.random.default_rng(1).standard_normal((rows, cols),
                                                                         numpy.float32))
        tensors = dict(x=x, y=client.host_array((rows, cols), numpy.float32),
                       mean=client.host_array(rows, numpy.float32),
                       rstd=client.host_array(rows, numpy.float32))
        job, _ = client.make_job("LAYERNORM_FWD", rows, cols, eps=EPS, **tensors)
        return job, 7
    x = torch.randn(rows, cols, device=device)
    keep = dict(x=x, y=torch.empty_like(x), mean=torch.empty(rows, device=device),
                rstd=torch.empty(rows, device=device))
    job, _ = client.make_job("LAYERNORM_FWD", rows, cols, eps=EPS, **keep)
    prepare_library_job.keep = keep  # the job names these tensors: keep them allocated
    return job, torch.cuda.current_stream().cuda_stream


# ---- timing -------------------------------------------------------------------------------


@contextlib.contextmanager
def completion(mode):
    """The row's completion mode; "enqueue-python" is the enqueue mode without the compiled
    eager operator (normd.eager), on the package's Python path."""
    import normd

    python_path = mode == "enqueue-python"
    old = normd.set_completion_mode("enqueue" if python_path else mode) if mode else None
    try:
        with normd.eager.paused() if python_path else contextlib.nullcontext():
            yield
    finally:
        if mode:
            normd.set_completion_mode(old)


def settle(row, client, cuda):
    """Untimed, between batches: the GPU drained and the daemon's later errors raised."""
    if cuda:
        torch.cuda.synchronize()
    if row.mode:
        (row.client or client).check()


def run_slice(row, calls, client, cuda, timed):
    with completion(row.mode):
        done = 0
        while done < calls:
            n = min(BATCH, calls - done)
            for _ in range(n):
                if row.reset:
                    row.reset()
                start = time.perf_counter()
                row.fn()
                end = time.perf_counter()
                if timed:
                    row.times.append((end - start) * 1e6)
            done += n
            settle(row, client, cuda)


def count_calls(row):
    """Python-level calls (functions and builtins) of one call of the row."""
    count = [0]

    def hook(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1

    with completion(row.mode):
        if row.reset:
            row.reset()
        sys.setprofile(hook)
        try:
            row.fn()
        finally:
            sys.setprofile(None)
    return count[0] - 1  # the setprofile(None) call itself


def percentile(sorted_values, q):
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


# ---- the run ------------------------------------------------------------------------------


def git_commit():
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv):
    args = parse_args(argv)
    shape = tuple(int(d) for d in args.shape.lower().split("x"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    cuda = torch.cuda.is_available() and not args.stub
    workdir = tempfile.mkdtemp(prefix="normd-bench-host.")
    how = install_stub(workdir) if not cuda else "real: CUDA tensors, the daemon on GPU 0"

    import normd
    from normd_daemon import Daemon

    daemon = None
    socket = os.environ.get("NORMD_SOCKET") if cuda else None
    if not socket:
        daemon = Daemon(Path(args.build) / "bin" / "normd", "0" if cuda else "cpu",
                        log_level="info")
        socket = daemon.socket
    status = 0
    try:
        client = normd.Client(socket=socket, name="bench_host_path")
        normd.set_default_client(client)
        device = "cuda" if cuda else "cpu"
        rows_n = 1
        for d in shape[:-1]:
            rows_n *= d
        library_client = client if cuda else real_client(socket)
        library_job = prepare_library_job(library_client, device, not cuda, rows_n, shape[-1])
        rows = make_rows(device, dtype, shape, modes, library_client, library_job)
        if args.rows:
            wanted = set(args.rows.split(","))
            rows = [r for r in rows if r.key in wanted or r.key.startswith("torch_ln_fwd")]
        print_header(args, how, cuda, shape)
        if args.profile:
            return profile_row(args, rows, client, cuda)
        for row in rows:
            run_slice(row, args.warmup, client, cuda, timed=False)
            row.py_calls = count_calls(row)
        per_round = max(1, args.calls // args.rounds)
        for _ in range(args.rounds):
            for row in rows:
                run_slice(row, per_round, client, cuda, timed=True)
        report(args, rows, how, cuda, shape)
        client.check()
        client.close()
    finally:
        if daemon:
            rc = daemon.stop()
            if rc != 0:
                print("normd exited with %s; its log:\n%s" % (rc, daemon.log()))
                status = 1
            daemon.cleanup()
        for name in os.listdir(workdir):
            os.unlink(os.path.join(workdir, name))
        os.rmdir(workdir)
    return status


def print_header(args, how, cuda, shape):
    device = torch.cuda.get_device_name() if cuda else "none (CPU)"
    print("host cost of one call; %s UTC; commit %s" % (
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"), git_commit()))
    print("CPU: %s; GPU: %s; torch %s; Python %s" % (cpu_model(), device, torch.__version__,
                                                     platform.python_version()))
    print("x: %s %s requiring grad; %d calls a row in %d rounds; %s" % (
        "x".join(map(str, shape)), args.dtype, args.calls, args.rounds, how))
    sys.stdout.flush()


def report(args, rows, how, cuda, shape):
    ref = {}
    results = []
    for row in rows:
        t = sorted(row.times)
        results.append(dict(key=row.key, title=row.title, median_us=percentile(t, 0.5),
                            p90_us=percentile(t, 0.9), calls=len(t), py_calls=row.py_calls))
        if row.key in ("torch_ln_fwd", "torch_ln_fwd_bwd"):
            ref[row.key] = results[-1]["median_us"]
    print()
    print("| call | median us | p90 us | / F.layer_norm | py calls |")
    print("|---|---|---|---|---|")
    for r in results:
        base = ref.get("torch_ln_fwd_bwd" if "fwd_bwd" in r["key"] else "torch_ln_fwd")
        ratio = "%.2f" % (r["median_us"] / base) if base else "-"
        print("| %s | %.1f | %.1f | %s | %d |" % (r["title"], r["median_us"], r["p90_us"], ratio,
                                                  r["py_calls"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(how=how, cuda=cuda, shape=list(shape), dtype=args.dtype,
                           commit=git_commit(), torch=torch.__version__, cpu=cpu_model(),
                           rows=results), f, indent=1)


def profile_row(args, rows, client, cuda):
    import cProfile
    import pstats

    row = next((r for r in rows if r.key == args.profile), None)
    if row is None:
        print("no row %r; rows: %s" % (args.profile, ", ".join(r.key for r in rows)))
        return 2
    run_slice(row, args.warmup, client, cuda, timed=False)
    prof = cProfile.Profile()
    with completion(row.mode):
        prof.enable()
        for _ in range(args.calls):
            if row.reset:
                row.reset()
            row.fn()
        prof.disable()
    settle(row, client, cuda)
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
