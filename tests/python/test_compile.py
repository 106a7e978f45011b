"""normd.normalization under torch.compile and CUDA graphs (issue 18, item 3).

Skipped where torch is not installed, or has no torch.library.custom_op
(PyTorch < 2.4) or no torch.compile for this Python.

- Everywhere torch is: the ops (normd::layer_norm_fwd, ...) are registered,
  mutate nothing, carry the cudagraph_unsafe tag where PyTorch has it, give
  apex's shapes and dtypes on meta tensors, and pass torch.library.opcheck
  (schema, autograd registration, fake tensors, AOT dispatch) on CPU tensors
  staged through the session's CPU-backend daemon (NORMD_TORCH_CPU=daemon);
  torch.compile(fullgraph=True) of a small model with FusedLayerNorm and
  FusedRMSNorm runs its norms in the daemon (its jobs_ok counter moves by
  four a training step) and matches the same model with PyTorch's own
  norms, forward and backward; dynamic batch sizes compile once.
- Where torch sees a CUDA device and Triton imports: the same on CUDA
  tensors (bf16, fp32, the mixed form) against a daemon this module starts
  on GPU 0 (build/bin/normd --device 0, or $NORMD_BIN), compiled with
  Inductor; torch.compile(mode="reduce-overhead") over several steps with
  new inputs each (correct outputs and four daemon jobs every step, the ops
  running outside the CUDA graphs; on a PyTorch without the
  cudagraph_unsafe tag, a clear NormdError instead); and a normd job asked
  for inside torch.cuda.graph capture refused with NormdError UNSUPPORTED.
  On the GPU machine (tests/gpu/run.sh runs it):

      python3 -m pytest -q -p no:cacheprovider tests/python/test_compile.py
"""

import importlib.util
import os
import shutil
import time

import pytest

# CUDA IPC needs cudaMalloc memory: expandable segments would refuse every job.
os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import normd  # noqa: E402
import torch_checks as checks  # noqa: E402
from conftest import normd_bin  # noqa: E402
from normd import normalization as N  # noqa: E402
from normd.normalization import compile_fusion, custom_ops  # noqa: E402
from normd_daemon import Daemon  # noqa: E402

if not custom_ops.AVAILABLE:
    pytest.skip("torch %s has no torch.library.custom_op (PyTorch 2.4 or later)"
                % torch.__version__, allow_module_level=True)
if hasattr(torch, "_dynamo") and not torch._dynamo.is_dynamo_supported():
    pytest.skip("torch.compile does not support this Python", allow_module_level=True)

from torch._dynamo.utils import counters  # noqa: E402

EPS = 1e-5
DIM = 64
OPS = ("layer_norm_fwd", "rms_norm_fwd", "layer_norm_bwd", "rms_norm_bwd")
HAVE_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not (CUDA and HAVE_TRITON),
                                reason="needs a CUDA device and Triton (Inductor on CUDA)")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch and counts only its own graphs."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def staged(client, monkeypatch):
    """CPU tensors go to the session's CPU-backend daemon through the default client."""
    monkeypatch.setenv("NORMD_TORCH_CPU", "daemon")
    old = normd.set_default_client(client)
    yield client
    normd.set_default_client(old)


@pytest.fixture(scope="module")
def gpu_client():
    """A daemon serving GPU 0 for this module, and the default client connected to it."""
    if not (CUDA and HAVE_TRITON):
        pytest.skip("needs a CUDA device and Triton")
    daemon = Daemon(normd_bin(), "0", log_level="info", start_timeout=60, stop_timeout=30)
    client = normd.Client(daemon.socket, name="pytest-compile")
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


def jobs_ok(client, target=None, timeout=5.0):
    """The daemon's jobs_ok; with target, once it reaches it (a job counts when retired)."""
    deadline = time.monotonic() + timeout
    while True:
        now = client.stats()["jobs_ok"]
        if target is None or now >= target or time.monotonic() > deadline:
            return now
        time.sleep(0.01)


# ---- the ops themselves ------------------------------------------------------------------


def test_ops_registered():
    for name in OPS:
        op = getattr(torch.ops.normd, name).default
        schema = op._schema
        assert not schema.is_mutable, "%s declares a mutation" % schema
        assert all(a.alias_info is None for a in schema.arguments), schema
        assert all(r.alias_info is None for r in schema.returns), schema
        if hasattr(torch.Tag, "cudagraph_unsafe"):
            assert torch.Tag.cudagraph_unsafe in op.tags, (name, op.tags)
    assert custom_ops.CUDAGRAPH_UNSAFE_TAGGED == hasattr(torch.Tag, "cudagraph_unsafe")


def test_fake_shapes_and_dtypes():
    """apex's outputs on meta tensors: y like the input, mean/invvar fp32 per row."""
    x = torch.empty(5, 3, 4, 16, device="meta", dtype=torch.bfloat16)
    w = torch.empty(4, 16, device="meta")
    y, mean, invvar = torch.ops.normd.layer_norm_fwd(x, w, w, [4, 16], EPS, False, False, 0)
    assert (y.shape, y.dtype) == (x.shape, torch.bfloat16)
    assert (mean.shape, mean.dtype) == ((15,), torch.float32)
    assert (invvar.shape, invvar.dtype) == ((15,), torch.float32)
    y, invvar = torch.ops.normd.rms_norm_fwd(x, w, [4, 16], EPS, True, True, 0)
    assert (y.shape, y.dtype, invvar.shape) == (x.shape, torch.float32, (15,))
    y, _ = torch.ops.normd.rms_norm_fwd(x, None, [4, 16], EPS, True, False, 0)
    assert y.dtype == torch.bfloat16  # mixed without weights: the input's dtype
    dx, dgamma, dbeta = torch.ops.normd.layer_norm_bwd(
        y.float(), y.float(), w, w, mean, invvar, [4, 16], EPS, True, True, torch.bfloat16,
        True, False, 0)
    assert (dx.shape, dx.dtype) == (x.shape, torch.bfloat16)
    assert (dgamma.shape, dgamma.dtype) == (w.shape, torch.float32)
    assert dbeta.numel() == 0  # not asked for
    dx, dgamma = torch.ops.normd.rms_norm_bwd(x, x, None, invvar, [4, 16], EPS, False, False,
                                              torch.bfloat16, True, 0)
    assert (dx.shape, dx.dtype, dgamma.numel()) == (x.shape, torch.bfloat16, 0)


def _opcheck_cases():
    """(id, op name, argument builder) for torch.library.opcheck."""
    def fwd(rms, affine, dtype, wdtype, mixed, memory_efficient):
        def build():
            gen = torch.Generator().manual_seed(3)
            x = (torch.randn(6, 4, 32, generator=gen) * 2 + 0.3).to(dtype).requires_grad_()
            w = (torch.rand(4, 32, generator=gen) + 0.5).to(wdtype).requires_grad_()
            b = torch.randn(4, 32, generator=gen).to(wdtype).requires_grad_()
            if rms:
                return (x, w if affine else None, [4, 32], EPS, mixed, memory_efficient, 0)
            return (x, w if affine else None, b if affine else None, [4, 32], EPS, mixed,
                    memory_efficient, 0)
        return build

    for rms in (False, True):
        name = "rms_norm_fwd" if rms else "layer_norm_fwd"
        for affine in (True, False):
            for memory_efficient in (False, True):
                yield ("%s-%s-f32-%s" % (name, "affine" if affine else "plain",
                                         "memeff" if memory_efficient else "x"),
                       name, fwd(rms, affine, torch.float32, torch.float32, False,
                                 memory_efficient))
        yield (name + "-bf16-f32weights", name,
               fwd(rms, True, torch.bfloat16, torch.float32, False, False))
        yield (name + "-mixed-bf16", name,
               fwd(rms, True, torch.bfloat16, torch.float32, True, False))
        yield (name + "-mixed-bf16-memeff", name,
               fwd(rms, True, torch.bfloat16, torch.float32, True, True))

    def bwd(rms, weight_grad):
        def build():
            gen = torch.Generator().manual_seed(4)
            x = torch.randn(6, 32, generator=gen)
            w = torch.rand(32, generator=gen) + 0.5
            b = torch.randn(32, generator=gen)
            dy = torch.randn(6, 32, generator=gen)
            if rms:
                _, invvar = torch.ops.normd.rms_norm_fwd(x, w, [32], EPS, False, False, 0)
                return (dy, x, w, invvar, [32], EPS, False, False, torch.float32, weight_grad,
                        0)
            _, mean, invvar = torch.ops.normd.layer_norm_fwd(x, w, b, [32], EPS, False, False,
                                                             0)
            return (dy, x, w, b, mean, invvar, [32], EPS, False, False, torch.float32,
                    weight_grad, weight_grad, 0)
        return build

    for rms in (False, True):
        name = "rms_norm_bwd" if rms else "layer_norm_bwd"
        for weight_grad in (True, False):
            yield ("%s-%s" % (name, "dweight" if weight_grad else "dx-only"), name,
                   bwd(rms, weight_grad))


OPCHECK = list(_opcheck_cases())


@pytest.mark.parametrize("name,build", [c[1:] for c in OPCHECK], ids=[c[0] for c in OPCHECK])
def test_opcheck(staged, name, build):
    """Schema, autograd registration, fake tensors and AOT dispatch, on the daemon."""
    before = staged.stats()["jobs_ok"]
    results = torch.library.opcheck(getattr(torch.ops.normd, name).default, build())
    assert all(v == "SUCCESS" for v in results.values()), results
    assert staged.stats()["jobs_ok"] > before


# ---- a model compiled with normd's norms ---------------------------------------------------


class Net(nn.Module):
    """LayerNorm, a linear layer with a residual, RMSNorm."""

    def __init__(self, dim, layer_norm, rms_norm):
        super().__init__()
        self.norm1 = layer_norm(dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = rms_norm(dim)

    def forward(self, x):
        return self.norm2(self.proj(self.norm1(x)) + x)


def make_models(device, dtype, memory_efficient=False, client=None):
    """(PyTorch's norms, normd's norms): the same random parameters."""
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    ref = Net(DIM, lambda d: nn.LayerNorm(d, eps=EPS), lambda d: nn.RMSNorm(d, eps=EPS))
    ours = Net(DIM, lambda d: N.FusedLayerNorm(d, eps=EPS, memory_efficient=memory_efficient,
                                               client=client),
               lambda d: N.FusedRMSNorm(d, eps=EPS, memory_efficient=memory_efficient,
                                        client=client))
    with torch.no_grad():
        for norm in (ref.norm1, ref.norm2):
            norm.weight.copy_(torch.rand(DIM, generator=gen) + 0.5)
        ref.norm1.bias.copy_(torch.randn(DIM, generator=gen))
    ours.load_state_dict(ref.state_dict())
    return ref.to(device, dtype), ours.to(device, dtype)


def train_step(model, x, grad, mark_dynamic=False):
    """y, dx and every parameter's gradient of one forward and backward."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    if mark_dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    y = model(x)
    y.backward(grad)
    params = getattr(model, "_orig_mod", model).named_parameters()  # torch.compile's wrapper
    return y.detach().clone(), x.grad.clone(), {name: p.grad.clone() for name, p in params}


def expect_same_step(label, got, ref, dtype):
    tol = 2 * checks.TOL[dtype]
    assert got[0].dtype == ref[0].dtype and got[0].shape == ref[0].shape, label
    checks.expect_close(label + " y", got[0], ref[0], tol)
    checks.expect_close(label + " dx", got[1], ref[1], tol)
    for name, g in ref[2].items():
        assert got[2][name].dtype == g.dtype, (label, name)
        checks.expect_close("%s d%s" % (label, name), got[2][name], g, tol)


def run_steps(client, compiled, ref, device, dtype, batches, label, mark_dynamic=False):
    """Steps of `compiled` against `ref` with new inputs each; 4 daemon jobs a step."""
    gen = torch.Generator().manual_seed(9)
    for batch in batches:
        x = (torch.randn(batch, 6, DIM, generator=gen) * 2 + 0.3).to(device, dtype)
        grad = torch.randn(batch, 6, DIM, generator=gen).to(device, dtype)
        if device != "cpu":
            torch.cuda.synchronize()
        before = jobs_ok(client)
        eager_before = normd.eager.jobs()
        mark_step = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
        if mark_step is not None and device != "cpu":
            mark_step()
        got = train_step(compiled, x, grad, mark_dynamic)
        if device != "cpu":
            torch.cuda.synchronize()
            client.check()
        after = jobs_ok(client, before + 4)
        assert after == before + 4, "%s batch %d: the daemon ran %d jobs, expected 4 " \
            "(2 forward, 2 backward)" % (label, batch, after - before)
        if device != "cpu" and normd.eager.enabled():
            # The ops' C++ kernels sent them (a step after the first, which tells them the key).
            sent = normd.eager.jobs() - eager_before
            assert sent == 4 or (sent < 4 and batch == batches[0]), (label, batch, sent)
        expect_same_step("%s batch %d" % (label, batch), got, train_step(ref, x, grad), dtype)


def unique_graphs():
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["x", "memeff"])
def test_compile_fullgraph_cpu(staged, dtype, memory_efficient):
    ref, ours = make_models("cpu", dtype, memory_efficient)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    run_steps(staged, compiled, ref, "cpu", dtype, (4, 4), "aot_eager")
    assert unique_graphs() == 1
    # Eager calls still take the autograd Functions (the lower host cost).
    y = ours(torch.randn(3, DIM, dtype=dtype, requires_grad=True))
    assert type(y.grad_fn).__name__ == "FusedRMSNormAffineFunctionBackward", y.grad_fn


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                    reason="Inductor on CPU needs a C++ compiler")
def test_compile_inductor_cpu(staged):
    ref, ours = make_models("cpu", torch.float32)
    compiled = torch.compile(ours, fullgraph=True)
    run_steps(staged, compiled, ref, "cpu", torch.float32, (4, 7), "inductor", mark_dynamic=True)


needs_cxx = pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                               reason="Inductor on CPU needs a C++ compiler")


class PreNorm(nn.Module):
    """Pre-norm blocks (x = x + f(norm(x)), twice a block), then a final LayerNorm.

    Four of its five norms read a residual add, and four of the five norm
    backwards' dx meet the gradient of the residual stream in an add."""

    def __init__(self, layer_norm, rms_norm, blocks=2):
        super().__init__()
        self.norm1 = nn.ModuleList(layer_norm(DIM) for _ in range(blocks))
        self.proj1 = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(blocks))
        self.norm2 = nn.ModuleList(rms_norm(DIM) for _ in range(blocks))
        self.proj2 = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(blocks))
        self.final = layer_norm(DIM)

    def forward(self, x):
        for norm1, proj1, norm2, proj2 in zip(self.norm1, self.proj1, self.norm2, self.proj2):
            x = x + proj1(norm1(x))
            x = x + proj2(norm2(x))
        return self.final(x)


def pre_norm_models(dtype, memory_efficient=False):
    torch.manual_seed(6)
    ref = PreNorm(lambda d: nn.LayerNorm(d, eps=EPS), lambda d: nn.RMSNorm(d, eps=EPS))
    ours = PreNorm(lambda d: N.FusedLayerNorm(d, eps=EPS, memory_efficient=memory_efficient),
                   lambda d: N.FusedRMSNorm(d, eps=EPS, memory_efficient=memory_efficient))
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    ours.load_state_dict(ref.state_dict())
    return ref.to(dtype), ours.to(dtype)


def fused_steps(client, compiled, ref, dtype, batches, jobs_a_step):
    gen = torch.Generator().manual_seed(12)
    for batch in batches:
        x = (torch.randn(batch, 6, DIM, generator=gen) + 0.2).to(dtype)
        grad = torch.randn(batch, 6, DIM, generator=gen).to(dtype)
        before = jobs_ok(client)
        got = train_step(compiled, x, grad, mark_dynamic=True)
        assert jobs_ok(client) == before + jobs_a_step, batch
        expect_same_step("batch %d" % batch, got, train_step(ref, x, grad), dtype)


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["x", "memeff"])
def test_inductor_fuses_residual_adds_cpu(staged, dtype, memory_efficient):
    """Inductor's post-grad pass moves the residual adds into the norm jobs (compile_fusion):
    four forward adds and four backward adds of the model, the same jobs, the same results."""
    ref, ours = pre_norm_models(dtype, memory_efficient)
    before = dict(compile_fusion.stats)
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(ours, fullgraph=True)
        fused_steps(staged, compiled, ref, dtype, (4, 7, 3), 10)
    assert compile_fusion.stats["forward"] - before["forward"] == 4, compile_fusion.stats
    assert compile_fusion.stats["backward"] - before["backward"] == 4, compile_fusion.stats
    assert unique_graphs() == 1


@needs_cxx
def test_inductor_leaves_other_adds_cpu(staged):
    """Adds that are not a same-shape residual stay Inductor's: broadcasts."""
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.shift = nn.Parameter(torch.randn(DIM))
            self.norm1 = N.FusedLayerNorm(DIM, eps=EPS)
            self.norm2 = N.FusedRMSNorm(DIM, eps=EPS)

        def forward(self, x):
            h = self.norm1(x + self.shift)  # a row broadcast: not a residual
            return self.norm2(h + x.mean(-1, keepdim=True))  # a column broadcast

    class OddRef(Odd):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(DIM, eps=EPS)
            self.norm2 = nn.RMSNorm(DIM, eps=EPS)

    torch.manual_seed(7)
    ref = OddRef()
    ours = Odd()
    ours.load_state_dict(ref.state_dict())
    before = dict(compile_fusion.stats)
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(ours, fullgraph=True)
        fused_steps(staged, compiled, ref, torch.float32, (4,), 4)
    assert compile_fusion.stats["forward"] == before["forward"], compile_fusion.stats


@needs_cxx
def test_inductor_fusion_can_be_turned_off_cpu(staged, monkeypatch):
    monkeypatch.setenv("NORMD_COMPILE_FUSION", "0")
    ref, ours = pre_norm_models(torch.float32)
    before = dict(compile_fusion.stats)
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(ours, fullgraph=True)
        fused_steps(staged, compiled, ref, torch.float32, (4,), 10)
    assert compile_fusion.stats == before


@needs_cxx
def test_inductor_fusion_declines_what_it_cannot_rewrite_cpu(staged):
    """A weight computed from the add (the job would need its own output) stays unfused and
    correct; normalized_shape from a dynamic size (symbols in the list) fuses."""
    x, r = torch.randn(8, DIM), torch.randn(8, DIM)

    def weight_from_the_add(x, r):
        h = x + r
        return N.fused_rms_norm_affine(h, h[0], (DIM,), EPS)

    def symbolic_shape(x, r):
        return N.fused_layer_norm(x + r, x.shape[-1:], EPS)

    for f, fused in ((weight_from_the_add, 0), (symbolic_shape, 1)):
        torch._dynamo.reset()
        before = compile_fusion.stats["forward"]
        with torch._inductor.config.patch(fx_graph_cache=False):
            got = torch.compile(f, fullgraph=True, dynamic=True)(x, r)
        assert compile_fusion.stats["forward"] - before == fused, f.__name__
        checks.expect_close(f.__name__, got, f(x, r), 1e-5)


@needs_cxx
def test_inductor_fusion_outlives_a_config_patch_cpu(staged):
    """A compile inside config.patch(post_grad_custom_post_pass=...) chains the user's pass
    with normd's, and the next compile, after the patch put the old value back, fuses too."""
    seen = []

    def f(x, r):
        return N.fused_layer_norm(x + r, (DIM,), EPS)

    x, r = torch.randn(8, DIM), torch.randn(8, DIM)
    for patch in ({"post_grad_custom_post_pass": lambda graph: seen.append(1)}, {}):
        torch._dynamo.reset()
        before = compile_fusion.stats["forward"]
        with torch._inductor.config.patch(fx_graph_cache=False, **patch):
            torch.compile(f, fullgraph=True)(x, r)
        assert compile_fusion.stats["forward"] == before + 1, patch
    assert seen == [1]


@pytest.mark.parametrize("how", ["mark_dynamic", "dynamic=True"])
def test_dynamic_batch_compiles_once_cpu(staged, how):
    ref, ours = make_models("cpu", torch.float32)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager",
                             dynamic=True if how == "dynamic=True" else None)
    with torch._dynamo.config.patch(error_on_recompile=True):
        run_steps(staged, compiled, ref, "cpu", torch.float32, (3, 5, 8, 13), how,
                  mark_dynamic=how == "mark_dynamic")
    assert unique_graphs() == 1


def test_compile_functional_forms_cpu(staged):
    """The functions too, mixed dtypes included: output and gradient dtypes as apex's."""
    def f(x, w, b):
        y = N.mixed_dtype_fused_layer_norm_affine(x, w, b, (DIM,), EPS)
        return N.fused_rms_norm(y, (DIM,), EPS) + N.fused_rms_norm_affine(y, w, DIM, EPS)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, DIM, generator=gen).bfloat16().requires_grad_()
    w = (torch.rand(DIM, generator=gen) + 0.5).requires_grad_()
    b = torch.randn(DIM, generator=gen).requires_grad_()
    before = staged.stats()["jobs_ok"]
    y = compiled(x, w, b)
    y.sum().backward()
    assert staged.stats()["jobs_ok"] == before + 6
    assert y.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    h = torch.nn.functional.layer_norm(x64, (DIM,), w64, b64, EPS)
    y64 = checks.rms_reference(h, (DIM,), None, EPS) + checks.rms_reference(h, (DIM,), w64, EPS)
    y64.sum().backward()
    tol = 2 * checks.TOL[torch.bfloat16]
    checks.expect_close("mixed y", y.detach(), y64.detach(), checks.TOL[torch.float32] * 4)
    checks.expect_close("mixed dx", x.grad, x64.grad, tol)
    checks.expect_close("mixed dw", w.grad, w64.grad, 4 * checks.TOL[torch.float32])
    checks.expect_close("mixed db", b.grad, b64.grad, 4 * checks.TOL[torch.float32])


def test_compile_explicit_client_cpu(client, monkeypatch):
    """A module's client= is the one its compiled ops use."""
    monkeypatch.setenv("NORMD_TORCH_CPU", "daemon")
    monkeypatch.setenv("NORMD_SOCKET", "/nonexistent/normd.sock")
    old = normd.set_default_client(None)
    try:
        ref, ours = make_models("cpu", torch.float32, client=client)
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        run_steps(client, compiled, ref, "cpu", torch.float32, (4,), "client=")
    finally:
        normd.set_default_client(old)


def test_export_cpu(staged):
    """torch.export keeps normd's ops in the exported program, which runs them."""
    _, ours = make_models("cpu", torch.float32)
    x = torch.randn(4, 6, DIM)
    program = torch.export.export(ours, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"normd.layer_norm_fwd.default", "normd.rms_norm_fwd.default"} <= targets, targets
    before = staged.stats()["jobs_ok"]
    y = program.module()(x)
    assert staged.stats()["jobs_ok"] == before + 2
    checks.expect_close("exported", y, ours(x).detach(), 1e-6)


def test_compile_cpu_tensors_still_fall_back(client, monkeypatch):
    """Without NORMD_TORCH_CPU=daemon, compiled CPU code never reaches the daemon."""
    monkeypatch.delenv("NORMD_TORCH_CPU", raising=False)
    old = normd.set_default_client(client)
    try:
        ref, ours = make_models("cpu", torch.float32)
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        before = client.stats()["jobs_ok"]
        x, grad = torch.randn(4, DIM), torch.randn(4, DIM)
        expect_same_step("fallback", train_step(compiled, x, grad), train_step(ref, x, grad),
                         torch.float32)
        assert client.stats()["jobs_ok"] == before
    finally:
        normd.set_default_client(old)


# ---- on the GPU -----------------------------------------------------------------------------

CUDA_CASES = [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)]


@needs_cuda
@pytest.mark.parametrize("dtype,memory_efficient", CUDA_CASES,
                         ids=["bf16", "bf16-memeff", "f32"])
@pytest.mark.parametrize("mode", ["enqueue", "sync"])
def test_cuda_compile_fullgraph(gpu_client, dtype, memory_efficient, mode):
    old = normd.set_completion_mode(mode)
    try:
        ref, ours = make_models("cuda", dtype, memory_efficient)
        compiled = torch.compile(ours, fullgraph=True)
        run_steps(gpu_client, compiled, ref, "cuda", dtype, (8, 8), "cuda %s" % mode)
        assert unique_graphs() == 1
    finally:
        normd.set_completion_mode(old)


@needs_cuda
def test_cuda_dynamic_batch_compiles_once(gpu_client):
    ref, ours = make_models("cuda", torch.bfloat16)
    compiled = torch.compile(ours, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        run_steps(gpu_client, compiled, ref, "cuda", torch.bfloat16, (3, 6, 17, 40),
                  "cuda dynamic", mark_dynamic=True)
    assert unique_graphs() == 1


@needs_cuda
def test_cuda_compile_mixed_and_autocast(gpu_client):
    """MixedFusedLayerNorm (fp32 weights, bf16 input) and autocast, compiled."""
    mixed = N.MixedFusedLayerNorm(DIM, eps=EPS).cuda()
    compiled = torch.compile(mixed, fullgraph=True)
    x = (torch.randn(8, DIM, device="cuda") * 2).bfloat16().requires_grad_()
    torch.cuda.synchronize()
    before = jobs_ok(gpu_client)
    y = compiled(x)
    y.sum().backward()
    torch.cuda.synchronize()
    assert jobs_ok(gpu_client, before + 2) == before + 2
    assert y.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    ref = torch.nn.functional.layer_norm(x.detach().double(), (DIM,), eps=EPS)
    checks.expect_close("mixed compiled y", y.detach(), ref, checks.TOL[torch.float32])

    def under_autocast(x, w):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return N.fused_rms_norm_affine(x, w, (DIM,), EPS)

    x = torch.randn(8, DIM, device="cuda")
    w = torch.rand(DIM, device="cuda") + 0.5
    y = torch.compile(under_autocast, fullgraph=True)(x, w)
    assert y.dtype == torch.bfloat16
    checks.expect_close("autocast compiled y", y,
                        checks.rms_reference(x.bfloat16().double(), (DIM,),
                                             w.bfloat16().double(), EPS),
                        checks.TOL[torch.bfloat16])


def _capture_error(err):
    """The NormdError in an exception's chain (compiled code may wrap it), or None."""
    while err is not None:
        if isinstance(err, normd.NormdError):
            return err
        err = err.__cause__ or err.__context__
    return None


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_cuda_reduce_overhead(gpu_client, dtype):
    """Every step runs the daemon's jobs with that step's inputs; never a silent replay."""
    ref, ours = make_models("cuda", dtype)
    compiled = torch.compile(ours, fullgraph=True, mode="reduce-overhead")
    steps = (8,) * 6  # warm-up, recording, then replays
    if custom_ops.CUDAGRAPH_UNSAFE_TAGGED:
        run_steps(gpu_client, compiled, ref, "cuda", dtype, steps, "reduce-overhead")
        print("reduce-overhead: cudagraph skips %s (0: the norms ran between CUDA graphs of "
              "the rest)" % counters["inductor"].get("cudagraph_skips", 0))
        return
    # Without the tag the norms are captured: the capture must be refused, clearly.
    with pytest.raises(Exception) as info:
        run_steps(gpu_client, compiled, ref, "cuda", dtype, steps, "reduce-overhead")
    err = _capture_error(info.value)
    assert err is not None and err.status == "UNSUPPORTED", repr(info.value)
    assert "capturing a CUDA graph" in err.message, err.message


@needs_cuda
def test_cuda_graph_capture_refused(gpu_client):
    """A normd job asked for inside torch.cuda.graph capture: NormdError, nothing captured."""
    module = N.FusedLayerNorm(256, eps=EPS).cuda()
    x = torch.randn(8, 256, device="cuda")
    module(x)  # registers x's allocation before capture
    torch.cuda.synchronize()
    for call in (lambda: module(x),
                 lambda: torch.ops.normd.rms_norm_fwd(x, None, [256], EPS, False, False, 0)):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(normd.NormdError) as info:
            with torch.cuda.graph(graph):
                call()
        assert info.value.status == "UNSUPPORTED", str(info.value)
        assert "capturing a CUDA graph" in info.value.message
        assert "reduce-overhead" in info.value.message  # names the way out
    torch.cuda.synchronize()
    gpu_client.check()
    before = jobs_ok(gpu_client)
    y = module(x)  # the client still works after the refusals
    torch.cuda.synchronize()
    assert jobs_ok(gpu_client, before + 1) == before + 1
    checks.expect_close("after capture", y, torch.nn.functional.layer_norm(
        x.double(), (256,), eps=EPS), checks.TOL[torch.float32])
