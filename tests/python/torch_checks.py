"""Checks of normd.normalization against PyTorch, shared by two runners.

- tests/python/test_normalization.py runs them on CPU tensors routed to a
  CPU-backend daemon (NORMD_TORCH_CPU=daemon), when torch is installed.
- tests/gpu/test_python.py runs them on CUDA tensors against a daemon
  serving GPU 0 (make test-gpu).

Every check returns None when it passes and raises AssertionError with a
message naming the case and the numbers otherwise.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

import normd
from normd import normalization as N

EPS = 1e-5

#: Relative tolerance (error over max |reference|) per output dtype: a few
#: units in the last place for the 16-bit types; float32 allows for
#: reduction order over up to 64k columns.
TOL = {torch.float32: 5e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}

MODULES = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: (input shape, normalized_shape)
SHAPES = [((8, 64), (64,)), ((4, 16, 1024), (1024,)), ((3, 5, 12, 20), (12, 20)),
          ((2, 3, 4096), (4096,)), ((2, 65536), (65536,)), ((7, 1), (1,))]


def module_cases():
    """(module name, dtype, memory_efficient, elementwise_affine, shape, normalized_shape)."""
    for name in MODULES:
        for dtype in DTYPES:
            for memory_efficient in (False, True):
                for affine in ((True,) if name.startswith("Mixed") else (True, False)):
                    for shape, normalized in SHAPES:
                        yield name, dtype, memory_efficient, affine, shape, normalized


def case_id(case):
    name, dtype, memory_efficient, affine, shape, normalized = case
    return "%s-%s-%s-%s-%s-%s" % (name, str(dtype).replace("torch.", ""),
                                  "memeff" if memory_efficient else "x",
                                  "affine" if affine else "plain",
                                  "x".join(map(str, shape)), "x".join(map(str, normalized)))


def rms_reference(x, normalized, weight, eps):
    dims = tuple(range(-len(normalized), 0))
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return y * weight if weight is not None else y


def torch_reference(rms, x, normalized, weight, bias, eps):
    """What torch itself computes (F.layer_norm / F.rms_norm when it has it)."""
    if not rms:
        return F.layer_norm(x, normalized, weight, bias, eps)
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, normalized, weight, eps)
    return rms_reference(x, normalized, weight, eps)


def rel_error(got, ref):
    ref = ref.double()
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    return (got.double() - ref).abs().max().item() / scale if ref.numel() else 0.0


def expect_close(what, got, ref, tol):
    err = rel_error(got, ref)
    assert err <= tol, "%s: relative error %.3g over %.3g" % (what, err, tol)
    return err


def random_params(module, generator):
    with torch.no_grad():
        if module.weight is not None:
            w = torch.empty(module.weight.shape).uniform_(0.5, 1.5, generator=generator)
            sign = torch.randint(0, 2, module.weight.shape, generator=generator) * 2 - 1
            module.weight.copy_(w * sign)
        if getattr(module, "bias", None) is not None:
            module.bias.copy_(torch.randn(module.bias.shape, generator=generator))


def check_module(case, device, client=None, noncontiguous=False, seed=0):
    """One module's forward and backward against float64 autograd and torch in dtype."""
    name, dtype, memory_efficient, affine, shape, normalized = case
    label = case_id(case) + ("-noncontig" if noncontiguous else "")
    gen = torch.Generator().manual_seed(seed)
    rms = "RMS" in name
    mixed = name.startswith("Mixed")
    cls = getattr(N, name)
    if mixed:
        module = cls(normalized, eps=EPS, memory_efficient=memory_efficient, client=client)
    else:
        module = cls(normalized, eps=EPS, elementwise_affine=affine,
                     memory_efficient=memory_efficient, client=client)
    random_params(module, gen)
    # apex's plain modules expect weights of the input's dtype; the mixed ones fp32.
    module = module.to(device=device, dtype=torch.float32 if mixed else dtype)

    values = torch.randn(shape, generator=gen) * 2 + 0.3
    if noncontiguous:
        # The same values, laid out transposed in memory.
        values = values.transpose(0, -1).contiguous().transpose(0, -1)
    x = values.to(device=device, dtype=dtype)
    if noncontiguous:
        assert not x.is_contiguous() or x.dim() == 1
    x.requires_grad_(True)

    saved = []
    # Recorded as autograd saves them, the same way for the Python Functions and
    # the compiled eager operator's C++ node (whose saved_tensors Python cannot read).
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = module(x)
    out_dtype = torch.float32 if mixed else dtype
    assert y.dtype == out_dtype, "%s: output dtype %s, expected %s" % (label, y.dtype, out_dtype)
    assert y.shape == x.shape, label
    w = module.weight
    b = getattr(module, "bias", None)
    check_saved(label, saved, y, x, memory_efficient, rms, (w, b))

    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True) if w is not None else None
    b64 = b.detach().double().requires_grad_(True) if b is not None else None
    y64 = (rms_reference(x64, normalized, w64, EPS) if rms else
           F.layer_norm(x64, normalized, w64, b64, EPS))
    tol = TOL[out_dtype]
    expect_close(label + " y vs float64", y.detach(), y64.detach(), tol)
    # torch itself, in the same dtype (mixed: on the input converted to float32)
    with torch.no_grad():
        xt = x.float() if mixed else x
        yt = torch_reference(rms, xt, normalized, w, b, EPS)
    expect_close(label + " y vs torch", y.detach(), yt, 2 * tol)

    grad = torch.randn(shape, generator=gen).to(device=device, dtype=out_dtype)
    y.backward(grad)
    y64.backward(grad.double())
    # memory_efficient recomputes x from y, which was rounded to y's dtype.
    factor = 2.0 if memory_efficient else 1.0
    in_tol = max(TOL[dtype], TOL[out_dtype])
    assert x.grad.dtype == dtype, label + " grad dtype"
    expect_close(label + " dx", x.grad, x64.grad, in_tol * factor)
    if w is not None:
        w_tol = max(TOL[w.dtype], TOL[out_dtype] if memory_efficient else 0.0)
        assert w.grad is not None and w.grad.dtype == w.dtype, label + " dweight"
        expect_close(label + " dweight", w.grad, w64.grad, w_tol * factor)
    if b is not None:
        expect_close(label + " dbias", b.grad, b64.grad, TOL[b.dtype])


def check_saved(label, saved, y, x, memory_efficient, rms, params):
    """What the forward saved for backward, in order (None never appears).

    memory_efficient saves the output, else the input, first; invvar last;
    LayerNorm saves its mean too, unless memory_efficient.
    """
    assert len(saved) >= 2, label + ": saved %d tensors" % len(saved)
    first = saved[0]
    if memory_efficient:
        assert first.data_ptr() == y.data_ptr(), label + ": memory_efficient must save the output"
    else:
        assert first.data_ptr() == x.contiguous().data_ptr() or not x.is_contiguous(), \
            label + ": must save the input"
        assert first.dtype == x.dtype, label
    invvar = saved[-1]
    assert invvar.dtype == torch.float32 and invvar.dim() == 1, label + ": invvar"
    param_ptrs = {p.data_ptr() for p in params if p is not None}
    stats = [t for t in saved[1:-1] if t.data_ptr() not in param_ptrs]
    if rms or memory_efficient:
        assert not stats, label + ": saves no mean"
    else:
        assert len(stats) == 1 and stats[0].dtype == torch.float32 and stats[0].dim() == 1, \
            label + ": mean"
        assert stats[0].numel() == invvar.numel(), label + ": mean and invvar of every row"


FUNCTIONALS = {
    "fused_layer_norm_affine": ["input", "weight", "bias", "normalized_shape", "eps",
                                "memory_efficient"],
    "fused_layer_norm": ["input", "normalized_shape", "eps", "memory_efficient"],
    "mixed_dtype_fused_layer_norm_affine": ["input", "weight", "bias", "normalized_shape", "eps",
                                            "memory_efficient"],
    "fused_rms_norm_affine": ["input", "weight", "normalized_shape", "eps", "memory_efficient"],
    "fused_rms_norm": ["input", "normalized_shape", "eps", "memory_efficient"],
    "mixed_dtype_fused_rms_norm_affine": ["input", "weight", "normalized_shape", "eps",
                                          "memory_efficient"],
}


def check_signatures():
    """apex's argument names, order and defaults (eps=1e-6, memory_efficient=False)."""
    import inspect

    for name, params in FUNCTIONALS.items():
        sig = inspect.signature(getattr(N, name))
        assert list(sig.parameters) == params, name
        assert sig.parameters["eps"].default == 1e-6, name
        assert sig.parameters["memory_efficient"].default is False, name
    for name in ("FusedLayerNorm", "FusedRMSNorm"):
        sig = inspect.signature(getattr(N, name))
        assert list(sig.parameters)[:4] == ["normalized_shape", "eps", "elementwise_affine",
                                            "memory_efficient"], name
        assert sig.parameters["eps"].default == 1e-5
    for name in ("MixedFusedLayerNorm", "MixedFusedRMSNorm"):
        sig = inspect.signature(getattr(N, name))
        assert list(sig.parameters)[:2] == ["normalized_shape", "eps"], name
        assert sig.parameters["memory_efficient"].kind == inspect.Parameter.KEYWORD_ONLY


def check_functionals(device, client=None):
    """The functional forms agree with the modules' math on a 3-D input."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 4, 32, generator=gen) * 2).to(device)
    w = (torch.rand(32, generator=gen) + 0.5).to(device)
    b = torch.randn(32, generator=gen).to(device)
    x64, w64, b64 = x.double(), w.double(), b.double()
    eps = 1e-6
    cases = [
        (N.fused_layer_norm_affine(x, w, b, (32,), eps), F.layer_norm(x64, (32,), w64, b64, eps)),
        (N.fused_layer_norm(x, [32], eps, True), F.layer_norm(x64, (32,), None, None, eps)),
        (N.fused_rms_norm_affine(x, w, 32, eps), rms_reference(x64, (32,), w64, eps)),
        (N.fused_rms_norm(x, (32,), eps), rms_reference(x64, (32,), None, eps)),
        (N.mixed_dtype_fused_layer_norm_affine(x.bfloat16(), w, b, (32,), eps),
         F.layer_norm(x.bfloat16().double(), (32,), w64, b64, eps)),
        (N.mixed_dtype_fused_rms_norm_affine(x.half(), w, (32,), eps),
         rms_reference(x.half().double(), (32,), w64, eps)),
    ]
    for i, (got, ref) in enumerate(cases):
        expect_close("functional %d" % i, got, ref, TOL[torch.float32])
        assert got.dtype == torch.float32


def check_errors(device):
    """Shape and dtype mistakes raise what torch users expect."""
    x = torch.randn(4, 8, device=device)
    try:
        N.fused_layer_norm(x, (16,))
    except RuntimeError as err:
        assert "normalized_shape" in str(err)
    else:
        raise AssertionError("a wrong normalized_shape was accepted")
    try:
        N.fused_rms_norm_affine(x, torch.ones(8, device=device, dtype=torch.float16), (8,))
    except TypeError as err:
        assert "float32" in str(err)
    else:
        raise AssertionError("fp32 input with fp16 weights was accepted")
    try:
        N.MixedFusedLayerNorm(8, elementwise_affine=False)
    except RuntimeError:
        pass
    else:
        raise AssertionError("MixedFusedLayerNorm accepted elementwise_affine=False")


# ---- a small transformer trained with normd's norms and with torch's --------------------


class Block(nn.Module):
    """Pre-norm attention + MLP; LayerNorm before attention, RMSNorm before the MLP."""

    def __init__(self, dim, heads, layer_norm, rms_norm):
        super().__init__()
        self.norm1 = layer_norm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = rms_norm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, heads, seq, layer_norm, rms_norm):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads, layer_norm, rms_norm) for _ in range(2)])
        self.final = layer_norm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        seq = tokens.shape[1]
        mask = torch.triu(torch.full((seq, seq), float("-inf"), device=tokens.device), 1)
        x = self.embed(tokens) + self.pos[:seq]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.final(x))


def make_batches(steps, batch, seq, vocab, device, seed=3):
    """Sequences that step through the vocabulary by a per-sequence stride: learnable."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (steps, batch, 1), generator=gen)
    stride = torch.randint(1, 4, (steps, batch, 1), generator=gen)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    return seqs.to(device)


def train(model, batches, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check_training(device, steps=200, memory_efficient=False, client=None, vocab=64, dim=128,
                   heads=4, seq=32, batch=16, require_learning=True):
    """Loss curves of torch's norms and normd's agree within 1% at every step.

    Returns (torch's losses, normd's losses, the worst relative difference).
    """
    def torch_model():
        torch.manual_seed(11)
        return TinyLM(vocab, dim, heads, seq, lambda d: nn.LayerNorm(d, eps=EPS),
                      lambda d: nn.RMSNorm(d, eps=EPS))

    def normd_model():
        torch.manual_seed(11)
        return TinyLM(vocab, dim, heads, seq,
                      lambda d: N.FusedLayerNorm(d, eps=EPS, memory_efficient=memory_efficient,
                                                 client=client),
                      lambda d: N.FusedRMSNorm(d, eps=EPS, memory_efficient=memory_efficient,
                                               client=client))

    reference = torch_model().to(device)
    ours = normd_model().to(device)
    ours.load_state_dict(reference.state_dict())
    batches = make_batches(steps, batch, seq, vocab, device)
    torch_losses = train(reference, batches)
    daemon = client or normd.default_client()
    jobs_before = daemon.stats()["jobs_ok"]
    normd_losses = train(ours, batches)
    # 5 norms, forward and backward, every step: the daemon really ran them.
    ran = daemon.stats()["jobs_ok"] - jobs_before
    assert ran >= 10 * steps, "only %d normd jobs in %d steps" % (ran, steps)
    worst = max(abs(a - b) / b for a, b in zip(normd_losses, torch_losses))
    assert all(math.isfinite(v) for v in normd_losses), "normd's loss is not finite"
    assert not require_learning or torch_losses[-1] < 0.5 * torch_losses[0], \
        "the reference did not learn (%.3f -> %.3f)" % (torch_losses[0], torch_losses[-1])
    assert worst <= 0.01, "loss curves differ by %.3g%% at worst" % (100 * worst)
    return torch_losses, normd_losses, worst
