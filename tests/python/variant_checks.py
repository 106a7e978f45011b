"""Checks of normd.normalization's norm variants against float64 references.

tests/python/test_variants.py runs them on CPU tensors staged to a
CPU-backend daemon, on CUDA tensors against a daemon serving GPU 0 where
there is one (make test-gpu), and with the daemon's features masked, on
the torch fallback. Each check raises AssertionError naming the case and
the numbers; the module checks return the number of daemon jobs they saw.
"""

import time

import numpy as np
import torch
import torch.nn.functional as F
from fp8_reference import check_codes
from torch_checks import EPS, TOL, expect_close

import normd
from normd import normalization as N

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: name -> the modules' and functions' keyword arguments, and the weight offset they mean.
OFFSETS = {"plain": ({}, 0.0), "zero_centered": ({"zero_centered_gamma": True}, 1.0),
           "offset": ({"offset": -0.375}, -0.375)}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def jobs_ok(client, device="cpu", target=None, timeout=5.0):
    """The daemon's jobs_ok; on a GPU after synchronizing, and with target once it reaches it.

    An enqueued job counts when the daemon retires it, a little after the
    stream has run it.
    """
    client = client or normd.default_client()
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    deadline = time.monotonic() + timeout
    now = client.stats()["jobs_ok"]
    while True:
        if target is not None and (now >= target or time.monotonic() > deadline):
            return now
        if target is None and not cuda:
            return now
        time.sleep(0.02)
        later = client.stats()["jobs_ok"]
        # Without a target: settled once 20 ms pass without a retirement (the
        # daemon's loop looks at retired jobs at least every millisecond).
        if target is None and (later == now or time.monotonic() > deadline):
            return later
        now = later


def expect_jobs(label, client, device, before, expected):
    """Exactly `expected` jobs ran in the daemon since `before`."""
    ran = jobs_ok(client, device, before + expected) - before
    assert ran == expected, "%s: %d daemon jobs, expected %d" % (label, ran, expected)
    return ran


def rel_l2(got, ref):
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def norm64(rms, v, shape, w, b, eps=EPS):
    """The float64 norm of v (autograd-capable)."""
    if rms:
        dims = tuple(range(-len(shape), 0))
        y = v * torch.rsqrt(v.pow(2).mean(dims, keepdim=True) + eps)
        return y * w if w is not None else y
    return F.layer_norm(v, shape, w, b, eps)


def reference(rms, x, residual, weight, bias, shape, offset, eps=EPS):
    """float64 leaves and (y64, s64): s64 has the value of s rounded once to x's dtype.

    The rounding is applied as a constant correction, so gradients flow
    through s64 as through the exact sum (the rounding's derivative is one).
    """
    leaves = [t.detach().double().requires_grad_(True) if t is not None else None
              for t in (x, residual, weight, bias)]
    x64, r64, w64, b64 = leaves
    if r64 is not None:
        exact = x64 + r64
        stored = (x.detach().double() + residual.detach().double()).to(x.dtype).double()
        s64 = exact + (stored - exact).detach()
    else:
        s64 = x64
    w_eff = w64 + offset if w64 is not None else None
    return leaves, norm64(rms, s64, shape, w_eff, b64, eps), (s64 if r64 is not None else None)


def make_inputs(shape, dtype, device, gen):
    x = (torch.randn(shape, generator=gen) * 2 + 0.3).to(device=device, dtype=dtype)
    r = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return x, r


def random_weights(normalized, offset, gen, bias=True):
    """Effective weights (offset + weight) of both signs, away from zero; a bias."""
    eff = torch.empty(normalized).uniform_(0.5, 1.5, generator=gen)
    eff = eff * (torch.randint(0, 2, normalized, generator=gen) * 2 - 1)
    b = torch.randn(normalized, generator=gen) if bias else None
    return eff - offset, b


def check_saved(label, saved, y, s, memory_efficient):
    """memory_efficient saves y, else s (first of the tensors autograd saved)."""
    want = y if memory_efficient else s
    assert saved and saved[0].data_ptr() == want.data_ptr(), label + ": saves the wrong tensor"


def check_add_module(name, dtype, memory_efficient, affine, offset_name, shape, normalized,
                     device, client=None, seed=0, expect_daemon=True):
    """FusedAdd{LayerNorm,RMSNorm}: forward (y, s) and backward (dx for x and residual)."""
    kwargs, offset = OFFSETS[offset_name]
    label = "%s-%s-%s-%s-%s-%s" % (name, str(dtype)[6:], "memeff" if memory_efficient else "x",
                                   "affine" if affine else "plain", offset_name,
                                   "x".join(map(str, shape)))
    gen = torch.Generator().manual_seed(seed)
    rms = "RMS" in name
    module = getattr(N, name)(normalized, eps=EPS, elementwise_affine=affine,
                              memory_efficient=memory_efficient, client=client, **kwargs)
    if affine:
        w, b = random_weights(normalized, offset, gen, bias=not rms)
        with torch.no_grad():
            module.weight.copy_(w)
            if b is not None:
                module.bias.copy_(b)
    module = module.to(device=device, dtype=dtype)
    x, r = make_inputs(shape, dtype, device, gen)
    x.requires_grad_(True)
    r.requires_grad_(True)
    before = jobs_ok(client, device)
    saved = []
    # Recorded as autograd saves them: the compiled eager operator's C++ node has no
    # saved_tensors that Python can read.
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y, s = module(x, r)
    assert y.dtype == dtype and s.dtype == dtype and y.shape == x.shape == s.shape, label
    (x64, r64, w64, b64), y64, s64 = reference(rms, x, r, module.weight,
                                               getattr(module, "bias", None), normalized, offset)
    assert torch.equal(s.detach().double(), s64.detach()), label + ": s is not x + r rounded once"
    tol = TOL[dtype]
    expect_close(label + " y", y.detach(), y64.detach(), tol)
    if dtype == torch.float32:
        assert rel_l2(y.detach(), y64.detach()) <= 1e-6, label + " y: relative L2 over 1e-6"
    if expect_daemon:
        check_saved(label, saved, y, s, memory_efficient)

    dy = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    ds = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    torch.autograd.backward([y, s], [dy, ds])
    torch.autograd.backward([y64, s64], [dy.double(), ds.double()])
    factor = 2.0 if memory_efficient else 1.0
    expect_close(label + " dx", x.grad, x64.grad, tol * factor)
    expect_close(label + " dresidual", r.grad, r64.grad, tol * factor)
    assert torch.equal(x.grad, r.grad), label + ": x and residual get the same gradient"
    assert x.grad.data_ptr() != r.grad.data_ptr(), label + ": the two .grad share memory"
    if affine:
        expect_close(label + " dweight", module.weight.grad, w64.grad, tol * 2 * factor)
        if b64 is not None:
            expect_close(label + " dbias", module.bias.grad, b64.grad, tol * 2)
    return expect_jobs(label, client, device, before, 2 if expect_daemon else 0)


def check_offset_module(name, dtype, memory_efficient, offset_name, device, client=None,
                        seed=1, expect_daemon=True):
    """Fused{LayerNorm,RMSNorm}Offset: a FusedLayerNorm/FusedRMSNorm with offset + weight."""
    kwargs, offset = OFFSETS[offset_name]
    label = "%s-%s-%s-%s" % (name, str(dtype)[6:], memory_efficient, offset_name)
    gen = torch.Generator().manual_seed(seed)
    rms = "RMS" in name
    shape, normalized = (4, 3, 48), (48,)
    module = getattr(N, name)(normalized, eps=EPS, memory_efficient=memory_efficient,
                              client=client, **kwargs)
    assert isinstance(module, N.FusedRMSNorm if rms else N.FusedLayerNorm), label
    assert torch.all(module.weight == 1.0 - offset), label + ": the weight starts at 1 - offset"
    w, b = random_weights(normalized, offset, gen, bias=not rms)
    with torch.no_grad():
        module.weight.copy_(w)
        if b is not None:
            module.bias.copy_(b)
    module = module.to(device=device, dtype=dtype)
    x, _ = make_inputs(shape, dtype, device, gen)
    x.requires_grad_(True)
    before = jobs_ok(client, device)
    y = module(x)
    (x64, _, w64, b64), y64, _ = reference(rms, x, None, module.weight,
                                           getattr(module, "bias", None), normalized, offset)
    expect_close(label + " y", y.detach(), y64.detach(), TOL[dtype])
    dy = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    y.backward(dy)
    y64.backward(dy.double())
    factor = 2.0 if memory_efficient else 1.0
    expect_close(label + " dx", x.grad, x64.grad, TOL[dtype] * factor)
    expect_close(label + " dweight", module.weight.grad, w64.grad, TOL[dtype] * 2 * factor)
    return expect_jobs(label, client, device, before, 2 if expect_daemon else 0)


def check_functionals(device, client=None):
    """fused_add_* and fused_*_offset agree with the reference (3-D input, default shapes)."""
    gen = torch.Generator().manual_seed(7)
    x, r = make_inputs((3, 4, 32), torch.float32, device, gen)
    w = (torch.rand(32, generator=gen) + 0.5).to(device)
    b = torch.randn(32, generator=gen).to(device)
    eps = 1e-6
    shape = (32,)
    cases = [
        (N.fused_add_rms_norm(x, r, w, eps, client=client), True, w, None, 0.0),
        (N.fused_add_rms_norm(x, r, w, eps, zero_centered_gamma=True, client=client), True, w,
         None, 1.0),
        (N.fused_add_layer_norm(x, r, w, b, eps, offset=0.5, client=client), False, w, b, 0.5),
        (N.fused_add_layer_norm(x, r, None, None, eps, client=client), False, None, None, 0.0),
    ]
    for i, ((y, s), rms, weight, bias, offset) in enumerate(cases):
        _, y64, s64 = reference(rms, x, r, weight, bias, shape, offset, eps)
        expect_close("functional %d y" % i, y, y64.detach(), TOL[torch.float32])
        assert torch.equal(s.double(), s64.detach()), "functional %d s" % i
    y = N.fused_rms_norm_offset(x, w, (32,), eps, offset=0.25, client=client)
    _, y64, _ = reference(True, x, None, w, None, shape, 0.25, eps)
    expect_close("fused_rms_norm_offset", y, y64.detach(), TOL[torch.float32])
    y = N.fused_layer_norm_offset(x, w, b, 32, eps, zero_centered_gamma=True, client=client)
    _, y64, _ = reference(False, x, None, w, b, shape, 1.0, eps)
    expect_close("fused_layer_norm_offset", y, y64.detach(), TOL[torch.float32])


def check_fp8(rms, dtype, fmt, with_residual, offset_name, device, client=None, seed=3):
    """FP8 output: codes equal to the correctly rounded scaled reference except near ties."""
    kwargs, offset = OFFSETS[offset_name]
    label = "fp8-%s-%s-%s-%s-%s" % ("rms" if rms else "ln", str(dtype)[6:], fmt,
                                    "add" if with_residual else "x", offset_name)
    gen = torch.Generator().manual_seed(seed)
    shape, normalized = (12, 136), (136,)
    x, r = make_inputs(shape, dtype, device, gen)
    x[5, 7] = float("nan")  # a NaN row: every code NaN (0x7f), skipped by amax
    w, b = random_weights(normalized, offset, gen, bias=not rms)
    w, b = w.to(device=device, dtype=dtype), (b.to(device=device, dtype=dtype)
                                              if b is not None else None)
    x.requires_grad_(True)
    scale = torch.tensor([23.5], device=device)
    amax = torch.full((1,), -1.0, device=device)
    residual = r if with_residual else None
    args = dict(scale=scale, amax=amax, fp8_dtype=FP8[fmt], residual=residual, client=client,
                **kwargs)
    if rms:
        out = N.fused_rms_norm_fp8(x, w, normalized, EPS, **args)
    else:
        out = N.fused_layer_norm_fp8(x, w, b, normalized, EPS, **args)
    y8, s = out if with_residual else (out, None)
    assert y8.dtype == FP8[fmt] and y8.shape == x.shape, label
    assert not y8.requires_grad, label + ": FP8 output carries no gradient"
    _, y64, s64 = reference(rms, x, residual, w, b, normalized, offset)
    if with_residual:
        assert torch.allclose(s.double(), s64.detach(), rtol=0, atol=0, equal_nan=True), \
            label + ": s"
    ref = (y64.detach() * 23.5).cpu().numpy()
    codes = y8.view(torch.uint8).cpu().numpy()
    check_codes(label, codes, ref, fmt)
    assert np.all(codes[5] == 0x7F), label + ": the NaN row"
    finite = y64.detach().abs()
    finite = finite[torch.isfinite(finite)].max().item()
    assert abs(amax.item() - finite) <= 1e-5 * finite, "%s: amax %r, reference %r" % (
        label, amax.item(), finite)


def check_fp8_amax_exact(device, client=None):
    """amax is max |y| of the float32 y the FP8 codes were made from (float32 input)."""
    gen = torch.Generator().manual_seed(4)
    x, r = make_inputs((9, 200), torch.float32, device, gen)
    w = torch.randn(200, generator=gen).to(device)
    amax = torch.zeros(1, device=device)
    N.fused_rms_norm_fp8(x, w, scale=torch.ones(1, device=device), amax=amax, residual=r,
                         offset=0.5, client=client)
    y, _ = N.fused_add_rms_norm(x, r, w, offset=0.5, client=client)
    assert amax.item() == y.abs().max().item(), "amax %r, max |y| %r" % (amax.item(),
                                                                        y.abs().max().item())


def check_fp8_saturation(device, client=None):
    """Past the largest finite value: +-448 (e4m3) and +-57344 (e5m2), never NaN or infinity."""
    x = torch.tensor([[1.0, -1.0, 0.5, -0.25]], device=device)
    w = torch.ones(4, device=device)
    for fmt, top in (("e4m3", 0x7E), ("e5m2", 0x7B)):
        y8 = N.fused_rms_norm_fp8(x, w, scale=torch.tensor([1e30], device=device),
                                  fp8_dtype=FP8[fmt], client=client)
        codes = y8.view(torch.uint8).cpu().tolist()[0]
        assert codes == [top, top | 0x80, top, top | 0x80], (fmt, codes)


def check_in_place(rms, dtype, offset_name, device, client=None, expect_daemon=True):
    """vLLM's in-place form equals the out-of-place one; the daemon saw y over x, s over r."""
    kwargs, offset = OFFSETS[offset_name]
    gen = torch.Generator().manual_seed(5)
    x, r = make_inputs((6, 72), dtype, device, gen)
    w, b = random_weights((72,), offset, gen, bias=not rms)
    w, b = w.to(device=device, dtype=dtype), (b.to(device=device, dtype=dtype)
                                              if b is not None else None)
    if rms:
        y, s = N.fused_add_rms_norm(x, r, w, 1e-6, client=client, **kwargs)
    else:
        y, s = N.fused_add_layer_norm(x, r, w, b, 1e-6, client=client, **kwargs)
    before = jobs_ok(client, device)
    with torch.no_grad():
        if rms:
            out = N.fused_add_rms_norm_(x, r, w, 1e-6, client=client, **kwargs)
        else:
            out = N.fused_add_layer_norm_(x, r, w, b, 1e-6, client=client, **kwargs)
    assert out[0] is x and out[1] is r
    assert torch.equal(x, y) and torch.equal(r, s), "in place differs from out of place"
    return expect_jobs("in place", client, device, before, 1 if expect_daemon else 0)
