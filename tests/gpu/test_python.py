#!/usr/bin/env python3
"""The Python binding on a GPU: normd.normalization against PyTorch.

Run by tests/gpu/run.sh (make test-gpu) where python3 can import torch:

    python3 tests/gpu/test_python.py BUILD_DIR

It starts its own daemon (BUILD_DIR/bin/normd --device 0) on a socket in a
temporary directory, with that directory as --state-dir, and stops it with
SIGTERM at the end (it must exit 0). The client side finds
BUILD_DIR/lib/libnormclient.so through $NORMD_LIBRARY, which this script
sets.

Checks (tests/python/torch_checks.py holds the shared ones):
- every module (FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm,
  MixedFusedRMSNorm) in fp32, fp16 and bf16, memory_efficient off and on,
  elementwise_affine on and off, six normalized shapes up to 65536 columns:
  the output against float64 and against torch's own F.layer_norm /
  F.rms_norm in the same dtype; dx, dweight, dbias against float64 autograd
  on the same inputs; what autograd saved (output with memory_efficient,
  else input; mean and invvar in fp32);
- non-contiguous inputs, the functional forms, apex's signatures, errors,
  autocast (apex casts to the autocast dtype);
- ordering with the current stream (a side stream with pending work);
- the completion modes: the enqueue mode is the default (FusedLayerNorm and
  FusedRMSNorm forward and backward against torch's own, the calls going
  through the client's enqueue calls and none through run_job, the daemon's
  jobs_ok counter moving by one per job, a dependent chain queued without
  synchronizing, the call returning before work queued ahead of it on the
  stream finished); the sync mode (normd.set_completion_mode and
  NORMD_COMPLETION=sync: run_job, waits for that work) and the event mode
  likewise; a slice of the module matrix in the sync mode (the full matrix
  runs in the default enqueue mode); Client.enqueue / stream_wait / check
  with CUDA tensors and WGRAD_ACCUM refused (UNSUPPORTED);
- Client.run with CUDA tensors (RMSNORM_FWD, WGRAD_ACCUM);
- one registration per caching-allocator segment;
- jobs follow memory that changes between calls: another storage, segments
  freed by empty_cache and allocated again, another stream;
- a small transformer trained 200 steps with normd's norms and with
  torch's (memory_efficient off and on): loss curves within 1%;
- PyTorch's expandable segments, switched on at run time, are registered
  as VMM regions and give torch's results (last: it changes the allocator's
  settings; tests/gpu/test_vmm_torch.py runs a process under them from the
  start).

Prints one line per check (failures with their message), then
"N passed, N failed"; exits non-zero if anything failed.
"""

import faulthandler
import os
import sys
import time
import traceback
from pathlib import Path

# A crash in native code (the library, the compiled operator) shows the Python frames.
faulthandler.enable()
REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "bindings" / "python"), str(REPO / "tests" / "python")]

# CUDA IPC needs cudaMalloc memory: the test owns its allocator settings.
_alloc_conf = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import normd  # noqa: E402
import torch_checks as checks  # noqa: E402
from normd_daemon import Daemon  # noqa: E402
from normd import normalization as N  # noqa: E402

DEVICE = "cuda:0"


class Runner:
    """Counts checks; prints failures with their message."""

    def __init__(self):
        self.passed = 0
        self.failed = 0
        self.skipped = 0

    def run(self, name, fn, *args, quiet=False, **kwargs):
        start = time.monotonic()
        try:
            out = fn(*args, **kwargs)
        except Skip as why:
            self.skipped += 1
            print("SKIP  %s: %s" % (name, why), flush=True)
            return None
        except Exception:  # a failed check, or anything it raised
            self.failed += 1
            print("FAIL  %s" % name, flush=True)
            print("      " + traceback.format_exc().strip().replace("\n", "\n      "), flush=True)
            return None
        self.passed += 1
        if not quiet:
            print("PASS  %s (%.1f s)" % (name, time.monotonic() - start), flush=True)
        return out


class Skip(Exception):
    pass


# ---- GPU-only checks -----------------------------------------------------------------


def check_stream_ordering():
    """A job on a side stream sees the work queued before it on that stream."""
    side = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device=DEVICE)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        x = a
        for _ in range(8):  # long enough to be still running when the job is sent
            x = torch.tanh(x @ a) * 0.5
        y = N.fused_layer_norm(x, (2048,), 1e-5)
        ref = F.layer_norm(x.double(), (2048,), eps=1e-5)
    torch.cuda.synchronize()
    checks.expect_close("side stream", y, ref, checks.TOL[torch.float32])


# ---- the completion modes ----------------------------------------------------------------


class CallCounter:
    """Counts the client's enqueued jobs and run_job calls (and run_job's event=True ones).

    A job is enqueued through enqueue_job, through _enqueue_device (the
    Python path of normd.normalization: nc_job_enqueue_device), or by the
    compiled eager operator (normd.eager, counted by its own counter).
    """

    def __init__(self, client):
        self.client = client
        self.enqueued = self.ran = self.events = 0
        self.eager_before = self.eager = 0

    def __enter__(self):
        self.eager_before = normd.eager.jobs()
        enqueue_job, run_job = self.client.enqueue_job, self.client.run_job
        enqueue_device = self.client._enqueue_device

        def counted_enqueue(*args, **kwargs):
            self.enqueued += 1
            return enqueue_job(*args, **kwargs)

        def counted_enqueue_device(*args, **kwargs):
            self.enqueued += 1
            return enqueue_device(*args, **kwargs)

        def counted_run(*args, **kwargs):
            self.ran += 1
            self.events += bool(kwargs.get("event"))
            return run_job(*args, **kwargs)

        self.client.enqueue_job, self.client.run_job = counted_enqueue, counted_run
        self.client._enqueue_device = counted_enqueue_device
        return self

    def __exit__(self, *exc):
        # Back to the class's methods.
        del self.client.enqueue_job, self.client.run_job, self.client._enqueue_device
        self.eager = normd.eager.jobs() - self.eager_before
        self.enqueued += self.eager


def check_eager_path(daemon):
    """The compiled eager operator: in use, its errors, a client closed before backward.

    Fresh clients of their own, so that closing one leaves the default client alone.
    """
    if not normd.eager.enabled():
        raise Skip("the operator is off (NORMD_EAGER=0)")
    assert normd.eager.norm_op() is not None, normd.eager.status()
    x = (torch.randn(64, 512, device=DEVICE) * 3 + 1).to(torch.bfloat16).requires_grad_()
    module = N.FusedRMSNorm(512, client=None).to(DEVICE, torch.bfloat16)
    c = normd.Client(daemon.socket, name="eager-check")
    try:
        module.client = c
        before = normd.eager.jobs()
        y = module(x)
        torch.cuda.synchronize()
        c.check()
        assert normd.eager.jobs() == before + 1, (before, normd.eager.jobs())
        ref = F.rms_norm(x.double(), (512,), module.weight.double(), 1e-5)
        assert torch.allclose(y.double(), ref, atol=2e-2, rtol=2e-2), (y.double() - ref).abs().max()
        # A shape the operator leaves to the Python path: the Python path's error.
        try:
            N.fused_rms_norm(x, (256,), 1e-5)
        except RuntimeError as e:
            assert "expected input with shape [*, 256]" in str(e), e
        else:
            raise AssertionError("a wrong normalized_shape was accepted")
        # The client closed between forward and backward: an error, never a dangling handle.
        y = module(x)
    finally:
        c.close()
    try:
        y.backward(torch.ones_like(y))
    except RuntimeError as e:
        assert "client is closed" in str(e), e
    else:
        raise AssertionError("backward ran on a closed client")
    # And a closed client's forward: NormdError, as on the Python path.
    try:
        module(x)
    except normd.NormdError as e:
        assert e.status == "INVALID_ARGUMENT" and "closed" in e.message, e
    else:
        raise AssertionError("forward ran on a closed client")


def wait_jobs_ok(client, target, timeout=5.0):
    """The daemon's jobs_ok once it reaches target (it counts a job when it retires it)."""
    deadline = time.monotonic() + timeout
    while True:
        now = client.stats()["jobs_ok"]
        if now >= target or time.monotonic() > deadline:
            return now
        time.sleep(0.01)


def fwd_bwd_against_torch(client, mode, dtype):
    """FusedLayerNorm and FusedRMSNorm forward+backward in `mode`; checks what ran where.

    Fresh random values every call, so a job that did nothing cannot pass on
    what a reused block held.
    """
    assert normd.completion_mode() == mode, (normd.completion_mode(), mode)
    tol = checks.TOL[dtype]
    for name in ("FusedLayerNorm", "FusedRMSNorm"):
        rms = name == "FusedRMSNorm"
        module = getattr(N, name)((8, 256), eps=1e-5, client=client).to(DEVICE, dtype)
        with torch.no_grad():
            module.weight.uniform_(0.5, 1.5)
            if not rms:
                module.bias.normal_()
        x = (torch.randn(4, 16, 8, 256, device=DEVICE) * 2 + 0.3).to(dtype).requires_grad_()
        grad = torch.randn(4, 16, 8, 256, device=DEVICE).to(dtype)
        torch.cuda.synchronize()
        before = client.stats()["jobs_ok"]
        with CallCounter(client) as calls:
            y = module(x)
            y.backward(grad)
            # Queued after the jobs on the same stream, before any synchronization.
            y2 = y.detach() * 2
            dx2 = x.grad * 2
        torch.cuda.synchronize()
        if mode == "enqueue":
            client.check()
            assert (calls.enqueued, calls.ran) == (2, 0), (name, calls.enqueued, calls.ran)
            # Through the compiled operator unless NORMD_EAGER=0 turns it off.
            eager = 2 if normd.eager.enabled() else 0
            assert calls.eager == eager, (name, calls.eager, normd.eager.status())
        else:
            assert (calls.enqueued, calls.ran, calls.events) == \
                (0, 2, 2 if mode == "event" else 0), (name, calls.enqueued, calls.ran)
        after = wait_jobs_ok(client, before + 2)
        assert after == before + 2, "%s: the daemon's jobs_ok moved %d -> %d, expected +2" \
            % (name, before, after)
        x_ref = x.detach().clone().requires_grad_()
        w_ref = module.weight.detach().clone().requires_grad_()
        b_ref = None if rms else module.bias.detach().clone().requires_grad_()
        y_ref = checks.torch_reference(rms, x_ref, (8, 256), w_ref, b_ref, 1e-5)
        y_ref.backward(grad)
        label = "%s %s %s" % (mode, name, str(dtype).replace("torch.", ""))
        checks.expect_close(label + " y", y2 / 2, y_ref.detach(), 2 * tol)
        checks.expect_close(label + " dx", dx2 / 2, x_ref.grad, 2 * tol)
        checks.expect_close(label + " dweight", module.weight.grad, w_ref.grad, 2 * tol)
        if not rms:
            checks.expect_close(label + " dbias", module.bias.grad, b_ref.grad, 2 * tol)


def check_enqueue_is_default(client):
    """Without a setting the enqueue mode runs: results, calls and counters (fp32, bf16)."""
    os.environ.pop("NORMD_COMPLETION", None)
    old = normd.set_completion_mode(None)
    try:
        assert normd.completion_mode() == "enqueue"
        for dtype in (torch.float32, torch.bfloat16):
            fwd_bwd_against_torch(client, "enqueue", dtype)
    finally:
        normd.set_completion_mode(old)


def check_other_mode(client, mode, through_env):
    """The sync or event mode, chosen by NORMD_COMPLETION or normd.set_completion_mode."""
    old = normd.set_completion_mode(None if through_env else mode)
    if through_env:
        os.environ["NORMD_COMPLETION"] = mode
    try:
        for dtype in (torch.float32, torch.bfloat16):
            fwd_bwd_against_torch(client, mode, dtype)
    finally:
        os.environ.pop("NORMD_COMPLETION", None)
        normd.set_completion_mode(old)


def check_enqueue_chain():
    """20 dependent norms and matmuls queued without synchronizing, against torch's chain."""
    os.environ.pop("NORMD_COMPLETION", None)
    assert normd.completion_mode() == "enqueue"
    a = torch.randn(1024, 1024, device=DEVICE) / 32
    x = torch.randn(512, 1024, device=DEVICE)
    ref = x.clone()
    for _ in range(20):
        x = N.fused_rms_norm(x, (1024,), 1e-5) @ a
        ref = checks.rms_reference(ref, (1024,), None, 1e-5) @ a
    torch.cuda.synchronize()
    checks.expect_close("enqueued chain", x, ref, 1e-3)


def busy_work(a, iters):
    x = a
    for _ in range(iters):
        x = torch.tanh(x @ a) * 0.5
    return x


def check_enqueue_returns_early(client):
    """The enqueue call returns before work queued ahead of it ran; the sync call waits."""
    a = torch.randn(4096, 4096, device=DEVICE) / 64
    busy_work(a, 2)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    busy_work(a, 10)
    end.record()
    torch.cuda.synchronize()
    iters = max(10, int(10 * 300.0 / max(start.elapsed_time(end), 1e-3)))  # about 300 ms
    timings = {}
    for mode in ("enqueue", "sync", "enqueue"):  # the first enqueue warms up (registration)
        old = normd.set_completion_mode(mode)
        try:
            pending = busy_work(a, iters)
            t0 = time.monotonic()
            y = N.fused_layer_norm(pending, (4096,), 1e-5)
            timings[mode] = time.monotonic() - t0
            ref = F.layer_norm(pending, (4096,), eps=1e-5)
            torch.cuda.synchronize()
            t_all = time.monotonic() - t0
            checks.expect_close("%s after pending work" % mode, y, ref.double(), 1e-4)
        finally:
            normd.set_completion_mode(old)
    print("      pending GPU work %.0f ms: the call took %.1f ms (enqueue), %.1f ms (sync)"
          % (t_all * 1e3, timings["enqueue"] * 1e3, timings["sync"] * 1e3))
    assert timings["enqueue"] < 0.25 * t_all, timings
    assert timings["sync"] > 0.5 * t_all, timings
    client.check()


def sync_module_cases():
    """A slice of the module matrix for the sync mode (the full one runs in the default)."""
    for case in checks.module_cases():
        if case[4] in ((8, 64), (3, 5, 12, 20)):
            yield case


def check_raw_enqueue(client):
    """Client.enqueue with CUDA tensors on a side stream; stream_wait, check; WGRAD refused."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the tensors are allocated on the job's stream
        x = torch.randn(64, 1024, device=DEVICE, dtype=torch.bfloat16) * 3
        y = torch.full_like(x, float("nan"))
        rstd = torch.empty(64, device=DEVICE)
        before = client.stats()["jobs_ok"]
        client.enqueue("RMSNORM_FWD", 64, 1024, x=x, y=y, rstd=rstd)  # the current stream
    client.stream_wait(side.cuda_stream)
    assert side.query(), "stream_wait returned before the stream was idle"
    client.check()
    checks.expect_close("raw enqueue", y, checks.rms_reference(x.double(), (1024,), None, 1e-5),
                        checks.TOL[torch.bfloat16])
    assert wait_jobs_ok(client, before + 1) == before + 1
    tokens, n_in, n_out = 64, 128, 96
    wx = torch.randn(tokens, n_in, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(tokens, n_out, device=DEVICE, dtype=torch.bfloat16)
    main_grad = torch.zeros(n_out, n_in, device=DEVICE)
    try:
        client.enqueue("WGRAD_ACCUM", tokens, n_in, out_features=n_out, x=wx, dy=dy,
                       main_grad=main_grad)
    except normd.NormdError as err:
        assert err.status == "UNSUPPORTED", str(err)
    else:
        raise AssertionError("WGRAD_ACCUM was enqueued")
    client.check()


def check_registration_cache(client):
    """Tensors of one allocation share one registration, made once."""
    t = torch.empty(4096, device=DEVICE)
    before = client.stats()["regions"]
    first = client.tensor(t[:1024])
    middle = client.stats()["regions"]
    second = client.tensor(t[2048:])
    after = client.stats()["regions"]
    assert first.region == second.region, "one allocation, two regions: %r %r" % (first, second)
    assert second.offset - first.offset == 2048 * 4, (first, second)
    assert middle - before <= 1 and after == middle, (before, middle, after)
    print("      the daemon holds %d regions for this client (segments of the caching "
          "allocator)" % after)
    assert 0 < after < client.server_info["max_regions"]


def check_memory_changes(client):
    """Jobs follow the memory as it changes between calls (enqueue mode, nothing stale).

    The same tensor object given another storage; the caching allocator's
    free segments given back (empty_cache) and memory allocated again, maybe
    at the same addresses, which the library must then register anew;
    another stream; the weight moved to another allocation. Each output
    against torch's.
    """
    module = N.FusedRMSNorm(1024, eps=1e-5, client=client).to(DEVICE)
    x = torch.randn(64, 1024, device=DEVICE)

    def expect(label, stream=None):
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            y = module(x)
            ref = checks.torch_reference(True, x.double(), (1024,), module.weight.double(),
                                         None, 1e-5)
        torch.cuda.synchronize()
        client.check()
        checks.expect_close(label, y, ref, checks.TOL[torch.float32])

    expect("first call")
    x.data = torch.randn(64, 1024, device=DEVICE) * 3  # the same tensor, another storage
    expect("another storage")
    regions = client.stats()["regions"]
    module.cpu()
    x = x.cpu()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the free segments back to the driver
    module.to(DEVICE)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
    x = x.to(DEVICE) + 1
    expect("after empty_cache")
    expect("another stream", torch.cuda.Stream())
    with torch.no_grad():
        module.weight.data = module.weight.data.clone() * 2
    expect("weight in another allocation")
    print("      regions for this client: %d before empty_cache, %d after"
          % (regions, client.stats()["regions"]))


def check_raw_client(client):
    """Client.run with CUDA torch tensors: dtypes inferred, the current stream used."""
    x = torch.randn(32, 512, device=DEVICE, dtype=torch.bfloat16) * 3
    y = torch.empty_like(x)
    rstd = torch.empty(32, device=DEVICE)
    res = client.run("RMSNORM_FWD", 32, 512, x=x, y=y, rstd=rstd)
    assert res.status == "OK" and res.variant, res
    checks.expect_close("raw RMSNORM_FWD", y, checks.rms_reference(x.double(), (512,), None,
                                                                    1e-5),
                        checks.TOL[torch.bfloat16])
    tokens, n_in, n_out = 64, 128, 96
    x = torch.randn(tokens, n_in, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(tokens, n_out, device=DEVICE, dtype=torch.bfloat16)
    main_grad = torch.ones(n_out, n_in, device=DEVICE)
    client.run("WGRAD_ACCUM", tokens, n_in, out_features=n_out, x=x, dy=dy, main_grad=main_grad)
    ref = 1 + dy.double().T @ x.double()
    checks.expect_close("raw WGRAD_ACCUM", main_grad, ref, 1e-4)


def check_server(client):
    info = client.server_info
    assert info["backend"] == "cuda", info
    assert 0 in info["device_index"], info
    variants = client.variants()
    assert variants, "no kernel variants after the jobs"
    print("      %d variants cached, e.g. %s" % (len(variants), variants[0]["variant"]))


def check_autocast():
    """Under autocast, the functions cast to the autocast dtype (as apex does)."""
    x = torch.randn(16, 256, device=DEVICE)
    w = torch.rand(256, device=DEVICE) + 0.5
    b = torch.randn(256, device=DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = N.fused_layer_norm_affine(x, w, b, (256,), 1e-5)
    assert y.dtype == torch.bfloat16, y.dtype
    ref = F.layer_norm(x.bfloat16().double(), (256,), w.bfloat16().double(),
                       b.bfloat16().double(), 1e-5)
    checks.expect_close("autocast", y, ref, checks.TOL[torch.bfloat16])


def check_training_run(client, memory_efficient):
    torch_losses, normd_losses, worst = checks.check_training(
        DEVICE, steps=200, memory_efficient=memory_efficient, client=client)
    print("      loss %.4f -> %.4f (torch) / %.4f -> %.4f (normd); worst step differs by %.4f%%"
          % (torch_losses[0], torch_losses[-1], normd_losses[0], normd_losses[-1], 100 * worst))


def check_expandable_segments(client):
    """Memory from expandable segments (VMM chunks exported as POSIX fds) works."""
    settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if settings is None:
        raise Skip("this torch cannot change allocator settings at run time")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    settings("expandable_segments:True")
    x = w = None
    try:
        # 64 MiB: a new segment of the large pool, over several 20 MiB chunks.
        x = torch.randn(4096, 4096, device=DEVICE).requires_grad_(True)
        w = torch.randn(4096, device=DEVICE).requires_grad_(True)
        if not any(s.get("is_expandable") for s in torch.cuda.memory_snapshot()):
            raise Skip("the allocator setting did not take effect (no expandable segment)")
        y = N.fused_rms_norm_affine(x, w, (4096,))
        y.sum().backward()
        torch.cuda.synchronize()
        client.check()
        xr = x.detach().clone().requires_grad_(True)
        wr = w.detach().clone().requires_grad_(True)
        ref = checks.torch_reference(True, xr, (4096,), wr, None, 1e-5)
        ref.sum().backward()
        checks.expect_close("y", y, ref, checks.TOL[torch.float32])
        checks.expect_close("dx", x.grad, xr.grad, checks.TOL[torch.float32])
        checks.expect_close("dw", w.grad, wr.grad, 4 * checks.TOL[torch.float32])
    finally:
        del x, w
        torch.cuda.synchronize()
        settings("expandable_segments:False")
        torch.cuda.empty_cache()


# ---- main --------------------------------------------------------------------------------


def main(argv):
    build = Path(argv[1]) if len(argv) > 1 else REPO / "build"
    build = build if build.is_absolute() else Path.cwd() / build
    os.environ["NORMD_LIBRARY"] = str(build / "lib" / "libnormclient.so")
    if _alloc_conf:
        print("note: ignoring PYTORCH_CUDA_ALLOC_CONF=%s for this test" % _alloc_conf)
    if not torch.cuda.is_available():
        print("error: torch %s sees no CUDA device" % torch.__version__, file=sys.stderr)
        print("0 passed, 1 failed")
        return 1
    print("torch %s on %s; library %s" % (torch.__version__, torch.cuda.get_device_name(0),
                                          os.environ["NORMD_LIBRARY"]), flush=True)
    # The default completion mode (enqueue) runs unless a check picks another.
    os.environ.pop("NORMD_COMPLETION", None)
    print("completion mode: %s (default)" % normd.completion_mode(), flush=True)
    start = time.monotonic()
    normd.eager.norm_op()  # built here (once per torch) rather than inside a timed check
    print("%s (%.1f s)" % (normd.eager.status(), time.monotonic() - start), flush=True)
    runner = Runner()
    daemon = Daemon(build / "bin" / "normd", "0", log_level="info", start_timeout=60,
                    stop_timeout=30)
    client = None
    try:
        client = normd.Client(daemon.socket, name="test_python")
        normd.set_default_client(client)
        cases = list(checks.module_cases())
        start = time.monotonic()
        before = runner.failed
        for case in cases:
            runner.run("module " + checks.case_id(case), checks.check_module, case, DEVICE,
                       quiet=True)
        print("%s  %d module cases (%d failed, %.1f s)"
              % ("PASS" if runner.failed == before else "FAIL", len(cases),
                 runner.failed - before, time.monotonic() - start), flush=True)
        for name in checks.MODULES:
            case = (name, torch.bfloat16, False, True, (6, 5, 40), (5, 40))
            runner.run("non-contiguous " + name, checks.check_module, case, DEVICE,
                       noncontiguous=True)
        runner.run("functional forms", checks.check_functionals, DEVICE)
        runner.run("apex signatures", checks.check_signatures)
        runner.run("errors", checks.check_errors, DEVICE)
        runner.run("autocast", check_autocast)
        runner.run("stream ordering", check_stream_ordering)
        runner.run("enqueue mode is the default", check_enqueue_is_default, client)
        runner.run("compiled eager operator", check_eager_path, daemon)
        runner.run("sync mode (set_completion_mode)", check_other_mode, client, "sync", False)
        runner.run("sync mode (NORMD_COMPLETION=sync)", check_other_mode, client, "sync", True)
        runner.run("event mode (set_completion_mode)", check_other_mode, client, "event", False)
        runner.run("enqueued dependent chain", check_enqueue_chain)
        runner.run("enqueue returns before the stream's work", check_enqueue_returns_early,
                   client)
        runner.run("Client.enqueue with CUDA tensors", check_raw_enqueue, client)
        old_mode = normd.set_completion_mode("sync")
        try:
            cases = list(sync_module_cases())
            before = runner.failed
            for case in cases:
                runner.run("sync module " + checks.case_id(case), checks.check_module, case,
                           DEVICE, quiet=True)
            print("%s  %d module cases in the sync mode (%d failed)"
                  % ("PASS" if runner.failed == before else "FAIL", len(cases),
                     runner.failed - before), flush=True)
        finally:
            normd.set_completion_mode(old_mode)
        runner.run("Client.run with CUDA tensors", check_raw_client, client)
        runner.run("registration cache", check_registration_cache, client)
        runner.run("memory changing between calls", check_memory_changes, client)
        runner.run("server info and variants", check_server, client)
        runner.run("training (memory_efficient off)", check_training_run, client, False)
        runner.run("training (memory_efficient on)", check_training_run, client, True)
        runner.run("expandable segments (VMM regions)", check_expandable_segments, client)
    finally:
        if client is not None:
            normd.set_default_client(None)
            client.close()
        rc = daemon.stop()
        log = daemon.log()
        daemon.cleanup()
        if rc == 0:
            runner.passed += 1
            print("PASS  daemon exited 0 on SIGTERM")
        else:
            runner.failed += 1
            print("FAIL  daemon exited %s on SIGTERM" % rc)
    if runner.failed:
        print("---- the daemon's log, last 40 lines ----\n" + "\n".join(log.splitlines()[-40:]))
    print("%d passed, %d failed%s" % (runner.passed, runner.failed,
                                      ", %d skipped" % runner.skipped if runner.skipped else ""))
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
