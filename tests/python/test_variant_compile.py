"""The norm variants under torch.compile: the normd::norm_variant_* custom ops.

- The ops are registered (fwd and bwd mutate nothing, fp8 writes amax only),
  carry the cudagraph_unsafe tag where PyTorch has it, give the right shapes
  and dtypes on meta tensors, and pass torch.library.opcheck on CPU tensors
  staged through the session's CPU-backend daemon.
- torch.compile(fullgraph=True) of a pre-norm block with FusedAddRMSNorm or
  FusedAddLayerNorm runs its norm in the daemon (two jobs a training step)
  and matches eager code, outputs and gradients; the FP8 forward compiles
  with its amax written; a daemon without the variants (features masked)
  gives a graph computed by torch, or with the strict setting the error
  UNSUPPORTED; the in-place form compiles (computed by torch).
- Where torch sees a CUDA device and Triton imports: the block compiled by
  Inductor on CUDA tensors against a daemon this module starts on GPU 0
  (tests/gpu/run.sh runs this file).
"""

import importlib.util
import os

import pytest

# CUDA IPC needs cudaMalloc memory: expandable segments would refuse every job.
os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import normd  # noqa: E402
import variant_checks as checks  # noqa: E402
from conftest import normd_bin  # noqa: E402
from normd import _lib  # noqa: E402
from normd import normalization as N  # noqa: E402
from normd.normalization import variant_ops  # noqa: E402
from normd_daemon import Daemon  # noqa: E402

if not variant_ops.AVAILABLE:
    pytest.skip("torch %s has no torch.library.custom_op (PyTorch 2.4 or later)"
                % torch.__version__, allow_module_level=True)
if hasattr(torch, "_dynamo") and not torch._dynamo.is_dynamo_supported():
    pytest.skip("torch.compile does not support this Python", allow_module_level=True)

EPS = 1e-5
DIM = 48
OPS = ("norm_variant_fwd", "norm_variant_bwd", "norm_variant_fp8")
CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def staged(client, monkeypatch):
    """CPU tensors go to the session's CPU-backend daemon through the default client."""
    monkeypatch.setenv("NORMD_TORCH_CPU", "daemon")
    monkeypatch.delenv("NORMD_VARIANT_FALLBACK", raising=False)
    old = normd.set_default_client(client)
    yield client
    normd.set_default_client(old)


@pytest.fixture(scope="module")
def gpu_client():
    if not CUDA:
        pytest.skip("needs a CUDA device and Triton")
    daemon = Daemon(normd_bin(), "0", log_level="info", start_timeout=60, stop_timeout=30)
    client = normd.Client(daemon.socket, name="pytest-variant-compile")
    old = normd.set_default_client(client)
    try:
        yield client
    finally:
        normd.set_default_client(old)
        client.close()
        rc = daemon.stop()
        log = daemon.log()
        daemon.cleanup()
    assert rc == 0, "normd --device 0 exited with %s on SIGTERM; its log:\n%s" % (rc, log)


def mask_features(monkeypatch, features):
    monkeypatch.setattr(normd.Client, "norm_features", property(lambda self: features))


# ---- the ops themselves ----------------------------------------------------------------


def test_ops_registered():
    for name in OPS:
        op = getattr(torch.ops.normd, name).default
        schema = op._schema
        written = [a.name for a in schema.arguments if a.alias_info is not None and
                   a.alias_info.is_write]
        assert written == (["amax"] if name == "norm_variant_fp8" else []), schema
        assert all(r.alias_info is None for r in schema.returns), schema
        if hasattr(torch.Tag, "cudagraph_unsafe"):
            assert torch.Tag.cudagraph_unsafe in op.tags, (name, op.tags)


def test_fake_shapes_and_dtypes():
    x = torch.empty(5, 3, 16, device="meta", dtype=torch.bfloat16)
    w = torch.empty(16, device="meta")
    y, s, mean, invvar = torch.ops.normd.norm_variant_fwd(x, x, w, w, [16], EPS, False, 1.0,
                                                          False, 0)
    assert (y.shape, y.dtype, s.shape, s.dtype) == (x.shape, x.dtype, x.shape, x.dtype)
    assert (mean.shape, mean.dtype, invvar.shape) == ((15,), torch.float32, (15,))
    y, s, mean, _ = torch.ops.normd.norm_variant_fwd(x, None, w, None, [16], EPS, True, 0.0,
                                                     True, 0)
    assert (s.numel(), mean.numel()) == (0, 0)
    dx, dgamma, dbeta = torch.ops.normd.norm_variant_bwd(x, None, x, w, None, None, invvar,
                                                         [16], EPS, True, 1.0, False, True,
                                                         False, 0)
    assert (dx.shape, dx.dtype, dgamma.shape, dgamma.dtype, dbeta.numel()) == \
        (x.shape, x.dtype, (16,), torch.float32, 0)
    amax = torch.empty(1, device="meta")
    y8, s = torch.ops.normd.norm_variant_fp8(x, x, w, None, amax, amax, [16], EPS, True, 0.0,
                                             torch.float8_e5m2, 0)
    assert (y8.shape, y8.dtype, s.shape) == (x.shape, torch.float8_e5m2, x.shape)


def _opcheck_cases():
    def fwd(rms, residual, offset, memory_efficient, dtype, wdtype):
        def build():
            gen = torch.Generator().manual_seed(3)
            x = (torch.randn(6, 4, 32, generator=gen) * 2 + 0.3).to(dtype).requires_grad_()
            r = torch.randn(6, 4, 32, generator=gen).to(dtype).requires_grad_()
            w = (torch.rand(32, generator=gen) + 0.5).to(wdtype).requires_grad_()
            b = torch.randn(32, generator=gen).to(wdtype).requires_grad_()
            return (x, r if residual else None, w, None if rms else b, [32], EPS, rms, offset,
                    memory_efficient, 0)
        return build

    for rms in (True, False):
        for residual in (True, False):
            for memeff in (False, True):
                yield ("fwd-%s-%s-%s" % ("rms" if rms else "ln", "add" if residual else "x",
                                         "memeff" if memeff else "x"),
                       "norm_variant_fwd", fwd(rms, residual, 1.0, memeff, torch.float32,
                                               torch.float32))
        yield ("fwd-%s-bf16-f32weights" % ("rms" if rms else "ln"), "norm_variant_fwd",
               fwd(rms, True, -0.25, False, torch.bfloat16, torch.float32))

    def fp8(rms, residual):
        def build():
            gen = torch.Generator().manual_seed(4)
            x = torch.randn(5, 32, generator=gen)
            return (x, torch.randn(5, 32, generator=gen) if residual else None,
                    torch.rand(32, generator=gen) + 0.5, None if rms else torch.randn(32),
                    torch.tensor([3.0]), torch.zeros(1), [32], EPS, rms, 0.0,
                    torch.float8_e4m3fn, 0)
        return build

    for rms in (True, False):
        yield ("fp8-%s" % ("rms" if rms else "ln"), "norm_variant_fp8", fp8(rms, not rms))


OPCHECK = list(_opcheck_cases())


@pytest.mark.parametrize("name,build", [c[1:] for c in OPCHECK], ids=[c[0] for c in OPCHECK])
def test_opcheck(staged, name, build):
    """Schema, autograd registration, fake tensors and AOT dispatch, on the daemon."""
    before = staged.stats()["jobs_ok"]
    results = torch.library.opcheck(getattr(torch.ops.normd, name).default, build())
    assert all(v == "SUCCESS" for v in results.values()), results
    assert staged.stats()["jobs_ok"] > before


# ---- compiled code ----------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm block's norm: (mlp(norm(x + residual)), x + residual)."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, x, residual):
        y, s = self.norm(x, residual)
        return self.mlp(y), s


def make_block(name, device, dtype, **kwargs):
    torch.manual_seed(6)
    block = Block(getattr(N, name)(DIM, eps=EPS, **kwargs))
    with torch.no_grad():
        block.norm.weight.uniform_(-0.5, 0.5)
        if getattr(block.norm, "bias", None) is not None:
            block.norm.bias.normal_()
    return block.to(device, dtype)


def step(block, x, r, gy, gs):
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    r = r.detach().clone().requires_grad_()
    y, s = block(x, r)
    torch.autograd.backward([y, s], [gy, gs])
    params = getattr(block, "_orig_mod", block).named_parameters()
    return [y.detach(), s.detach(), x.grad, r.grad] + [p.grad for _, p in sorted(params)]


def run_compiled(block, device, dtype, jobs_per_step, backend="aot_eager"):
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(8)
    for batch in (4, 7):
        x, r, gy, gs = (torch.randn(batch, 3, DIM, generator=gen).to(device, dtype)
                        for _ in range(4))
        before = checks.jobs_ok(None, device)
        got = step(compiled, x, r, gy, gs)
        checks.expect_jobs("compiled", None, device, before, jobs_per_step)
        want = step(block, x, r, gy, gs)
        for i, (a, b) in enumerate(zip(got, want)):
            checks.expect_close("compiled output %d" % i, a, b, 2 * checks.TOL[dtype])


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["x", "memeff"])
@pytest.mark.parametrize("name,kwargs", [("FusedAddRMSNorm", {"zero_centered_gamma": True}),
                                         ("FusedAddLayerNorm", {"offset": 0.5}),
                                         ("FusedAddRMSNorm", {})],
                         ids=["rms-zc", "ln-offset", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_compile_block(staged, name, kwargs, dtype, memory_efficient):
    block = make_block(name, "cpu", dtype, memory_efficient=memory_efficient, **kwargs)
    run_compiled(block, "cpu", dtype, 2)


def test_compile_offset_module(staged):
    """FusedRMSNormOffset compiled: forward and backward in the daemon."""
    norm = N.FusedRMSNormOffset(DIM, offset=1.0)
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, DIM, requires_grad=True)
    before = staged.stats()["jobs_ok"]
    compiled(x).sum().backward()
    assert staged.stats()["jobs_ok"] == before + 2
    x2 = x.detach().clone().requires_grad_()
    norm(x2).sum().backward()
    checks.expect_close("dx", x.grad, x2.grad, 1e-6)


def test_compile_fp8(staged):
    def f(x, r, w, scale, amax):
        y8, s = N.fused_rms_norm_fp8(x, w, scale=scale, amax=amax, residual=r, offset=1.0)
        return y8, s * 2

    gen = torch.Generator().manual_seed(2)
    x, r = torch.randn(6, DIM, generator=gen), torch.randn(6, DIM, generator=gen)
    w, scale = torch.randn(DIM, generator=gen), torch.tensor([5.0])
    amax, amax_eager = torch.zeros(1), torch.zeros(1)
    before = staged.stats()["jobs_ok"]
    y8, s2 = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w, scale, amax)
    assert staged.stats()["jobs_ok"] == before + 1
    y8_eager, s2_eager = f(x, r, w, scale, amax_eager)
    assert torch.equal(y8.view(torch.uint8), y8_eager.view(torch.uint8))
    assert torch.equal(s2, s2_eager) and amax.item() == amax_eager.item() > 0


def test_compile_without_the_variants(staged, monkeypatch):
    """A daemon without them: the compiled graph computes with torch (no job)."""
    mask_features(monkeypatch, _lib.FEATURE_FP8_OUTPUT)
    block = make_block("FusedAddLayerNorm", "cpu", torch.float32, zero_centered_gamma=True)
    run_compiled(block, "cpu", torch.float32, 0)


def test_compile_strict(staged, monkeypatch):
    mask_features(monkeypatch, 0)
    monkeypatch.setenv("NORMD_VARIANT_FALLBACK", "error")
    block = make_block("FusedAddRMSNorm", "cpu", torch.float32)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="UNSUPPORTED") as err:
        compiled(torch.randn(2, DIM), torch.randn(2, DIM))
    # Raised while tracing: torch.compile wraps it, the NormdError is its cause or context.
    cause = err.value
    while cause is not None and not isinstance(cause, normd.NormdError):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None and cause.status == "UNSUPPORTED", repr(err.value)
    assert "residual add" in cause.message


def test_compile_in_place(staged):
    """The in-place form compiles (torch computes it) and matches the eager daemon's."""
    def f(x, r, w):
        N.fused_add_rms_norm_(x, r, w, 1e-6, offset=1.0)
        return x, r

    gen = torch.Generator().manual_seed(1)
    x, r, w = torch.randn(4, DIM, generator=gen), torch.randn(4, DIM, generator=gen), \
        torch.randn(DIM, generator=gen)
    x2, r2 = x.clone(), r.clone()
    with torch.no_grad():
        torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w)
        f(x2, r2, w)
    assert torch.equal(r, r2)
    checks.expect_close("in place y", x, x2, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_compile_block(gpu_client, dtype):
    if not gpu_client.norm_features & _lib.FEATURE_RESIDUAL:
        pytest.skip("the GPU daemon does not run the residual add")
    block = make_block("FusedAddRMSNorm", "cuda", dtype, zero_centered_gamma=True)
    run_compiled(block, "cuda", dtype, 2, backend="inductor")
