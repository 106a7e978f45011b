"""normd.normalization's norm variants against a real daemon (skipped without torch).

Every check runs on CPU tensors staged to the session's CPU-backend daemon
(NORMD_TORCH_CPU=daemon: the autograd Function, the jobs' variants and the
aliasing of the in-place forms are the ones a GPU run uses) and, where
there is a CUDA device (make test-gpu runs this file), on CUDA tensors
against a daemon serving GPU 0 that the module starts. With the daemon's
features masked (a daemon without the variants) the same checks run on
the torch fallback, and the strict setting raises UNSUPPORTED.
"""

import inspect
import os
import struct

import pytest

# CUDA IPC needs cudaMalloc memory: expandable segments would refuse every job.
os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)

torch = pytest.importorskip("torch")

import variant_checks as checks  # noqa: E402
from conftest import normd_bin  # noqa: E402
from normd_daemon import Daemon  # noqa: E402

import normd  # noqa: E402
from normd import _lib  # noqa: E402
from normd import normalization as N  # noqa: E402
from normd.normalization import variants  # noqa: E402

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def gpu_client():
    """A daemon serving GPU 0 for this module, and a client of it."""
    if not CUDA:
        pytest.skip("needs a CUDA device")
    daemon = Daemon(normd_bin(), "0", log_level="info", start_timeout=60, stop_timeout=30)
    client = normd.Client(daemon.socket, name="pytest-variants")
    try:
        yield client
    finally:
        client.close()
        rc = daemon.stop()
        log = daemon.log()
        daemon.cleanup()
    assert rc == 0, "normd --device 0 exited with %s on SIGTERM; its log:\n%s" % (rc, log)


@pytest.fixture(params=["cpu", "cuda"])
def device(request, monkeypatch):
    """"cpu" (staged to the CPU-backend daemon) or "cuda" (GPU 0), through the default client."""
    if request.param == "cpu":
        client = request.getfixturevalue("client")
        monkeypatch.setenv("NORMD_TORCH_CPU", "daemon")
    else:
        client = request.getfixturevalue("gpu_client")
    monkeypatch.delenv("NORMD_VARIANT_FALLBACK", raising=False)
    old = normd.set_default_client(client)
    yield request.param
    normd.set_default_client(old)


@pytest.fixture
def staged(client, monkeypatch):
    """CPU tensors to the CPU-backend daemon only (checks that do not depend on the device)."""
    monkeypatch.setenv("NORMD_TORCH_CPU", "daemon")
    monkeypatch.delenv("NORMD_VARIANT_FALLBACK", raising=False)
    old = normd.set_default_client(client)
    yield client
    normd.set_default_client(old)


def mask_features(monkeypatch, features):
    """Makes every Client report `features` (a backend without the other variants)."""
    monkeypatch.setattr(normd.Client, "norm_features", property(lambda self: features))


def daemon_jobs(device):
    return checks.jobs_ok(None, device)


ADD_CASES = [(name, dtype, memeff, affine, offset)
             for name in ("FusedAddRMSNorm", "FusedAddLayerNorm")
             for dtype in checks.DTYPES
             for memeff in (False, True)
             for affine, offset in ((True, "plain"), (True, "zero_centered"), (True, "offset"),
                                    (False, "plain"))]
ADD_IDS = ["%s-%s-%s-%s-%s" % (n, str(d)[6:], "memeff" if m else "x", "affine" if a else "plain",
                               o) for n, d, m, a, o in ADD_CASES]


@pytest.mark.parametrize("case", ADD_CASES, ids=ADD_IDS)
def test_add_module(device, case):
    name, dtype, memeff, affine, offset = case
    checks.check_add_module(name, dtype, memeff, affine, offset, (5, 2, 48), (48,), device)


@pytest.mark.parametrize("shape,normalized", [((7, 1), (1,)), ((3, 5, 12, 20), (12, 20)),
                                              ((2, 4096), (4096,))])
@pytest.mark.parametrize("name", ["FusedAddRMSNorm", "FusedAddLayerNorm"])
def test_add_module_shapes(device, name, shape, normalized):
    checks.check_add_module(name, torch.float32, False, True, "zero_centered", shape, normalized,
                            device)


@pytest.mark.parametrize("mode", ["sync", "event"])
def test_add_module_other_modes(device, mode):
    old = normd.set_completion_mode(mode)
    try:
        checks.check_add_module("FusedAddLayerNorm", torch.bfloat16, True, True, "offset",
                                (4, 64), (64,), device)
        checks.check_fp8(True, torch.float16, "e4m3", True, "zero_centered", device)
    finally:
        normd.set_completion_mode(old)


def test_add_module_mixed_weights(device):
    """float32 weights with bfloat16 activations: the job's weight_dtype F32."""
    m = N.FusedAddRMSNorm(32, zero_centered_gamma=True).to(device)
    x = torch.randn(4, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    r = torch.randn(4, 32, dtype=torch.bfloat16, device=device)
    y, s = m(x, r)
    assert y.dtype == s.dtype == torch.bfloat16
    y.float().sum().backward()
    assert m.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_gradient_of_s_alone(device):
    """Only s is used: dx = ds for both, and no backward job."""
    x = torch.randn(3, 16, device=device, requires_grad=True)
    r = torch.randn(3, 16, device=device, requires_grad=True)
    m = N.FusedAddRMSNorm(16).to(device)
    y, s = m(x, r)
    ds = torch.randn(3, 16, device=device)
    before = daemon_jobs(device)
    s.backward(ds)
    assert torch.equal(x.grad, ds) and torch.equal(r.grad, ds)
    assert daemon_jobs(device) == before
    assert torch.count_nonzero(m.weight.grad) == 0


def test_backward_twice(device):
    """retain_graph: a second backward sees the saved mean and rstd unmodified."""
    x = torch.randn(4, 32, device=device, requires_grad=True)
    r = torch.randn(4, 32, device=device, requires_grad=True)
    m = N.FusedAddLayerNorm(32).to(device)
    y, s = m(x, r)
    dy = torch.randn(4, 32, device=device)
    first = torch.autograd.grad(y, (x, m.weight), dy, retain_graph=True)
    second = torch.autograd.grad(y, (x, m.weight), dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("offset", ["plain", "zero_centered", "offset"])
@pytest.mark.parametrize("memeff", [False, True], ids=["x", "memeff"])
@pytest.mark.parametrize("dtype", checks.DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", ["FusedRMSNormOffset", "FusedLayerNormOffset"])
def test_offset_module(device, name, dtype, memeff, offset):
    checks.check_offset_module(name, dtype, memeff, offset, device)


def test_functionals(device):
    checks.check_functionals(device)


FP8_CASES = [(rms, dtype, fmt, add, offset)
             for rms in (True, False) for dtype in checks.DTYPES for fmt in ("e4m3", "e5m2")
             for add, offset in ((False, "plain"), (True, "zero_centered"), (True, "offset"))]


@pytest.mark.parametrize("case", FP8_CASES, ids=["%s-%s-%s-%s-%s" % (
    "rms" if c[0] else "ln", str(c[1])[6:], c[2], "add" if c[3] else "x", c[4])
    for c in FP8_CASES])
def test_fp8(device, case):
    before = daemon_jobs(device)
    checks.check_fp8(*case, device)
    checks.expect_jobs("fp8", None, device, before, 1)


def test_fp8_amax_exact(device):
    checks.check_fp8_amax_exact(device)


def test_fp8_saturation(device):
    checks.check_fp8_saturation(device)


def test_fp8_argument_errors(staged):
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(TypeError, match="scale must be a float32"):
        N.fused_rms_norm_fp8(x, w, scale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="amax must be a float32"):
        N.fused_rms_norm_fp8(x, w, scale=torch.ones(1), amax=torch.ones(2))
    with pytest.raises(TypeError, match="fp8_dtype"):
        N.fused_rms_norm_fp8(x, w, scale=torch.ones(1), fp8_dtype=torch.float16)
    with pytest.raises(TypeError, match="scale"):
        N.fused_rms_norm_fp8(x, w)  # scale is required


def test_fp8_non_contiguous_amax(device):
    amax = torch.zeros(4, device=device)[::2][:1]
    N.fused_rms_norm_fp8(torch.randn(2, 8, device=device), torch.ones(8, device=device),
                         scale=torch.ones(1, device=device), amax=amax)
    assert amax.item() > 0


@pytest.mark.parametrize("offset", ["plain", "zero_centered"])
@pytest.mark.parametrize("dtype", checks.DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_in_place(device, rms, dtype, offset):
    checks.check_in_place(rms, dtype, offset, device)


def test_in_place_sends_aliases(device, monkeypatch):
    """The job names y at x's bytes and residual_out at the residual's (the allowed alias)."""
    seen = {}
    for name in ("enqueue_ext", "run_ext"):  # whichever the completion mode uses
        real = getattr(normd.Client, name)

        def spy(self, op, rows, cols, _real=real, **kwargs):
            seen.update(kwargs)
            return _real(self, op, rows, cols, **kwargs)

        monkeypatch.setattr(normd.Client, name, spy)
    real_pointers = normd.Client._enqueue_device_ext  # the enqueue mode on CUDA tensors

    def spy_pointers(self, job, ext, ptrs, stream):
        roles = _lib.TENSOR_ROLES + _lib.EXT_TENSOR_ROLES
        seen.update((role, p) for role, p in
                    zip(roles, struct.unpack("@%dP" % len(roles), ptrs)) if p)
        return real_pointers(self, job, ext, ptrs, stream)

    monkeypatch.setattr(normd.Client, "_enqueue_device_ext", spy_pointers)
    x, r = torch.randn(4, 32, device=device), torch.randn(4, 32, device=device)
    with torch.no_grad():
        N.fused_add_rms_norm_(x, r, torch.ones(32, device=device), 1e-6)
    checks.jobs_ok(None, device)

    def same(a, b):  # one device pointer or torch tensor (CUDA), or (region, offset) (staged)
        return a is b or (isinstance(a, (int, tuple)) and a == b)

    assert same(seen["y"], seen["x"]) and same(seen["residual_out"], seen["residual"])
    assert not same(seen["x"], seen["residual"])


def test_in_place_rules(device):
    def randn(*shape):
        return torch.randn(*shape, device=device)

    x, r, w = randn(4, 32), randn(4, 32), torch.ones(32, device=device)
    with pytest.raises(ValueError, match="share memory"):
        with torch.no_grad():
            N.fused_add_rms_norm_(x, x, w)
    both = randn(8, 32)
    with pytest.raises(ValueError, match="share memory"):
        with torch.no_grad():
            N.fused_add_rms_norm_(both[:5], both[3:], w)
    with pytest.raises(RuntimeError, match="no autograd"):
        N.fused_add_rms_norm_(x, r, torch.ones(32, device=device, requires_grad=True))
    # Non-contiguous tensors: computed out of place, copied back.
    xt, rt = randn(32, 4).t(), randn(32, 4).t()
    y, s = N.fused_add_rms_norm(xt, rt, w, 1e-6)
    with torch.no_grad():
        N.fused_add_rms_norm_(xt, rt, w, 1e-6)
    assert torch.equal(xt, y) and torch.equal(rt, s)


def test_errors(staged):
    m = N.FusedAddRMSNorm(16)
    with pytest.raises(RuntimeError, match="residual has shape"):
        m(torch.randn(2, 16), torch.randn(3, 16))
    with pytest.raises(TypeError, match="residual is torch.float16"):
        m(torch.randn(2, 16), torch.randn(2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="give one of them"):
        N.FusedAddLayerNorm(16, zero_centered_gamma=True, offset=0.5)
    with pytest.raises(ValueError, match="elementwise_affine"):
        N.FusedAddRMSNorm(16, elementwise_affine=False, offset=1.0)
    with pytest.raises(ValueError, match="elementwise_affine"):
        N.FusedRMSNormOffset(16, elementwise_affine=False, zero_centered_gamma=True)
    with pytest.raises(ValueError, match="needs a weight"):
        N.fused_add_rms_norm(torch.randn(2, 16), torch.randn(2, 16), None, offset=1.0)
    with pytest.raises(ValueError, match="finite"):
        N.fused_add_rms_norm(torch.randn(2, 16), torch.randn(2, 16), torch.ones(16),
                             offset=1e39)
    with pytest.raises(TypeError, match="float32"):
        N.fused_add_rms_norm(torch.randn(2, 16), torch.randn(2, 16),
                             torch.ones(16, dtype=torch.float16))


def test_signatures():
    for cls in (N.FusedAddRMSNorm, N.FusedAddLayerNorm, N.FusedRMSNormOffset,
                N.FusedLayerNormOffset):
        params = inspect.signature(cls).parameters
        assert list(params)[:6] == ["normalized_shape", "eps", "elementwise_affine",
                                    "memory_efficient", "zero_centered_gamma", "offset"], cls
        assert params["eps"].default == 1e-5 and params["offset"].default == 0.0
        assert params["client"].kind == inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(N.fused_add_rms_norm).parameters)[:4] == \
        ["input", "residual", "weight", "eps"]
    assert list(inspect.signature(N.fused_add_rms_norm_).parameters)[:4] == \
        ["input", "residual", "weight", "eps"]
    assert list(inspect.signature(N.fused_add_layer_norm).parameters)[:5] == \
        ["input", "residual", "weight", "bias", "eps"]
    m = N.FusedAddRMSNorm(8, zero_centered_gamma=True)
    assert torch.all(m.weight == 0) and "zero_centered_gamma=True" in repr(m)
    assert torch.all(N.FusedAddLayerNorm(8, offset=0.25).weight == 0.75)


# ---- where a call computes: the fallback rule --------------------------------------------


@pytest.mark.parametrize("name", ["FusedAddRMSNorm", "FusedAddLayerNorm"])
def test_fallback_when_the_backend_lacks_the_variant(device, monkeypatch, name):
    mask_features(monkeypatch, 0)
    for dtype in checks.DTYPES:
        checks.check_add_module(name, dtype, False, True, "zero_centered", (5, 48), (48,), device,
                                expect_daemon=False)
    checks.check_offset_module(name.replace("Add", "") + "Offset", torch.bfloat16, False,
                               "offset", device, expect_daemon=False)
    checks.check_in_place("RMS" in name, torch.float16, "plain", device, expect_daemon=False)


def test_fallback_fp8(device, monkeypatch):
    mask_features(monkeypatch, _lib.FEATURE_RESIDUAL | _lib.FEATURE_WEIGHT_OFFSET)
    before = daemon_jobs(device)
    for dtype in checks.DTYPES:
        for fmt in ("e4m3", "e5m2"):
            checks.check_fp8(True, dtype, fmt, True, "offset", device)
            checks.check_fp8(False, dtype, fmt, False, "plain", device)
    checks.check_fp8_saturation(device)
    assert daemon_jobs(device) == before


def test_fallback_is_per_variant(device, monkeypatch):
    """A backend with the residual add but not offsets runs the plain add, not the offset."""
    mask_features(monkeypatch, _lib.FEATURE_RESIDUAL)
    checks.check_add_module("FusedAddRMSNorm", torch.float32, False, True, "plain", (3, 32),
                            (32,), device)
    checks.check_add_module("FusedAddRMSNorm", torch.float32, False, True, "offset", (3, 32),
                            (32,), device, expect_daemon=False)


@pytest.mark.parametrize("how", ["env", "setting"])
def test_strict_raises_unsupported(device, monkeypatch, how):
    mask_features(monkeypatch, _lib.FEATURE_WEIGHT_OFFSET)
    if how == "env":
        monkeypatch.setenv("NORMD_VARIANT_FALLBACK", "error")
        old = None
    else:
        old = N.set_variant_fallback("error")
    try:
        assert N.variant_fallback() == "error"
        before = daemon_jobs(device)
        x, r = torch.randn(2, 8, device=device), torch.randn(2, 8, device=device)
        w = torch.ones(8, device=device)
        for call in (lambda: N.FusedAddRMSNorm(8).to(device)(x, r),
                     lambda: N.fused_rms_norm_fp8(x, w, scale=torch.ones(1, device=device)),
                     lambda: N.fused_add_layer_norm_(x, r, w, None)):
            with pytest.raises(normd.NormdError, match="residual add|FP8 output") as err:
                with torch.no_grad():
                    call()
            assert err.value.status == "UNSUPPORTED"
        # What the backend runs still runs.
        N.fused_rms_norm_offset(x, w, 8, offset=1.0)
        checks.expect_jobs("strict", None, device, before, 1)
    finally:
        if how == "setting":
            N.set_variant_fallback(old)


def test_fallback_setting():
    assert N.set_variant_fallback("error") is None
    assert N.variant_fallback() == "error"
    assert N.set_variant_fallback(None) == "error"
    with pytest.raises(ValueError):
        N.set_variant_fallback("maybe")


def test_cpu_tensors_and_float64_use_torch(client, monkeypatch):
    """Without NORMD_TORCH_CPU=daemon (and for float64), torch computes, as for the plain norms."""
    monkeypatch.delenv("NORMD_TORCH_CPU", raising=False)
    old = normd.set_default_client(client)
    try:
        before = client.stats()["jobs_ok"]
        checks.check_add_module("FusedAddLayerNorm", torch.float32, True, True, "offset", (3, 40),
                                (40,), "cpu", client=client, expect_daemon=False)
        checks.check_fp8(True, torch.bfloat16, "e4m3", True, "zero_centered", "cpu",
                         client=client)
        monkeypatch.setenv("NORMD_TORCH_CPU", "daemon")
        y, s = N.fused_add_rms_norm(torch.randn(2, 8, dtype=torch.float64),
                                    torch.randn(2, 8, dtype=torch.float64), torch.ones(8))
        assert y.dtype == s.dtype == torch.float64
        assert client.stats()["jobs_ok"] == before
    finally:
        normd.set_default_client(old)


def test_variant_fallback_env_is_checked(monkeypatch):
    monkeypatch.setenv("NORMD_VARIANT_FALLBACK", "sometimes")
    with pytest.raises(ValueError, match="NORMD_VARIANT_FALLBACK"):
        variants.variant_fallback()
