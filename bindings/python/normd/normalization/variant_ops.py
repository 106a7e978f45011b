"""The norm variants as torch.library custom ops: what torch.compile sees.

As custom_ops.py does for the plain norms: under torch.compile (and
torch.export) the variant modules and functions call these ops instead of
FusedNormVariantFunction, so the daemon keeps computing in compiled code.
The ops, in the namespace ``normd``:

- ``norm_variant_fwd(input, residual?, weight?, bias?, normalized_shape,
  eps, rms, weight_offset, memory_efficient, client) -> (y, s, mean,
  invvar)``: s is empty without residual, mean empty for RMSNorm. Autograd
  is registered: it saves what FusedNormVariantFunction saves and calls
- ``norm_variant_bwd(grad_y?, grad_s?, saved, weight?, bias?, mean?,
  invvar, normalized_shape, eps, rms, weight_offset, memory_efficient,
  weight_grad, bias_grad, client) -> (dx, dgamma, dbeta)`` (dgamma/dbeta
  empty when not asked for).
- ``norm_variant_fp8(input, residual?, weight?, bias?, scale, amax,
  normalized_shape, eps, rms, weight_offset, fp8_dtype, client) -> (y8,
  s)``: writes amax (its one declared mutation); no autograd.

Every output is freshly allocated. ``client`` is a normd.Client's key (0:
the default client). The ops carry the ``cudagraph_unsafe`` tag where
PyTorch has it (see custom_ops).

Whether compiled code uses the ops or computes the variants with torch is
decided while tracing, by variants' rule, from the features of the
daemon the client is connected to (``route()``, which torch.compile treats
as a constant: a daemon's features do not change while it serves a
connection). The in-place forms have no op: under compile they are
computed by torch.

Unless ``NORMD_EAGER=0``, norm_variant_fwd and norm_variant_bwd have C++
CUDA kernels (normd/csrc/eager_norm.cpp), as the plain ops do: the enqueue
mode's common case runs there, every other call in the Python below.
"""

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._lib import DType
from ..client import client_by_key
from . import custom_ops
from . import variants as _variants
from .fused_layer_norm import _normalized_shape

AVAILABLE = custom_ops.AVAILABLE and hasattr(getattr(torch, "compiler", None),
                                               "assume_constant_result")


def _route(key, need):
    """True: the ops (the daemon); False: torch; or NormdError UNSUPPORTED (strict)."""
    return _variants.daemon_runs(client_by_key(key), need)


route = torch.compiler.assume_constant_result(_route) if AVAILABLE else _route


def norm(rms, input, residual, weight, bias, shape, eps, weight_offset, memory_efficient, client):
    """One call of a variant module or function through the ops: (y, s or None)."""
    key = 0 if client is None else client._key
    y, s, _, _ = torch.ops.normd.norm_variant_fwd(input, residual, weight, bias, shape, eps, rms,
                                                  weight_offset, memory_efficient, key)
    return y, (s if residual is not None else None)


def fp8(rms, input, residual, weight, bias, shape, eps, weight_offset, scale, amax, fp8_dtype,
        client):
    """One FP8 forward through the op: y8, or (y8, s) with a residual."""
    key = 0 if client is None else client._key
    scratch = amax if amax is not None else scale.new_empty(1)
    y8, s = torch.ops.normd.norm_variant_fp8(input, residual, weight, bias, scale, scratch,
                                             shape, eps, rms, weight_offset, fp8_dtype, key)
    return y8 if residual is None else (y8, s)


# ---- what the ops run -----------------------------------------------------------------


def _placeholder(like, dtype=None):
    return like.new_empty(0, dtype=dtype)


def _fwd(input: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
         bias: Optional[Tensor], normalized_shape: Sequence[int], eps: float, rms: bool,
         weight_offset: float, memory_efficient: bool,
         client: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    # custom_ops._client: also tells the operator's kernels the key (eager_norm.cpp).
    y, s, mean, invvar, _, _ = _variants._forward(
        custom_ops._client(client), rms, input, residual, weight, bias,
        _normalized_shape(normalized_shape), eps, weight_offset)
    return (y, _placeholder(input) if s is None else s,
            _placeholder(invvar) if mean is None else mean, invvar)


class _BackwardArgs:
    """The attributes variants._backward reads from an autograd ctx."""

    def __init__(self, client, shape, eps, rms, weight_offset, memory_efficient, weight, saved):
        self.client = custom_ops._client(client)
        self.shape = _normalized_shape(shape)
        self.eps = eps
        self.rms = rms
        self.weight_offset = weight_offset
        self.memory_efficient = memory_efficient
        self.weight_dtype = (None if weight is None or weight.dtype == saved.dtype
                             else DType.F32)


def _bwd(grad_y: Optional[Tensor], grad_s: Optional[Tensor], saved: Tensor,
         weight: Optional[Tensor], bias: Optional[Tensor], mean: Optional[Tensor],
         invvar: Tensor, normalized_shape: Sequence[int], eps: float, rms: bool,
         weight_offset: float, memory_efficient: bool, weight_grad: bool, bias_grad: bool,
         client: int) -> Tuple[Tensor, Tensor, Tensor]:
    want_w, want_b = weight_grad and weight is not None, bias_grad and bias is not None
    saved = saved.contiguous()
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    if grad_y is None:  # only s was used: dnorm(s) is zero
        dx = grad_s.to(saved.dtype, copy=True, memory_format=torch.contiguous_format)
        dgamma = torch.zeros_like(weight) if want_w else None
        dbeta = torch.zeros_like(bias) if want_b else None
    else:
        args = _BackwardArgs(client, normalized_shape, eps, rms, weight_offset,
                             memory_efficient, weight, saved)
        dx, dgamma, dbeta = _variants._backward(args, saved, grad_y, grad_s, weight, bias, mean,
                                                invvar, want_w, want_b)
    return (dx, _placeholder(invvar) if dgamma is None else dgamma,
            _placeholder(invvar) if dbeta is None else dbeta)


def _fp8(input: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
         bias: Optional[Tensor], scale: Tensor, amax: Tensor, normalized_shape: Sequence[int],
         eps: float, rms: bool, weight_offset: float, fp8_dtype: torch.dtype,
         client: int) -> Tuple[Tensor, Tensor]:
    out = amax if amax.is_contiguous() else amax.clone()
    y8, s, _, _, _, _ = _variants._forward(
        client_by_key(client), rms, input, residual, weight, bias,
        _normalized_shape(normalized_shape), eps, weight_offset, fp8=fp8_dtype,
        scale=scale.contiguous(), amax=out, stats=False)
    if out is not amax:
        amax.copy_(out)
    return y8, _placeholder(input) if s is None else s


# ---- fake implementations: shapes and dtypes ----------------------------------------------


def _fwd_fake(input, residual, weight, bias, normalized_shape, eps, rms, weight_offset,
              memory_efficient, client):
    rows = input.numel() // math.prod(normalized_shape)
    s = input.new_empty(input.shape) if residual is not None else _placeholder(input)
    mean = _placeholder(input, torch.float32) if rms else \
        input.new_empty((rows,), dtype=torch.float32)
    return input.new_empty(input.shape), s, mean, input.new_empty((rows,), dtype=torch.float32)


def _bwd_fake(grad_y, grad_s, saved, weight, bias, mean, invvar, normalized_shape, eps, rms,
              weight_offset, memory_efficient, weight_grad, bias_grad, client):
    dgamma = weight.new_empty(weight.shape) if weight_grad and weight is not None else \
        _placeholder(invvar)
    dbeta = bias.new_empty(bias.shape) if bias_grad and bias is not None else \
        _placeholder(invvar)
    return saved.new_empty(saved.shape), dgamma, dbeta


def _fp8_fake(input, residual, weight, bias, scale, amax, normalized_shape, eps, rms,
              weight_offset, fp8_dtype, client):
    s = input.new_empty(input.shape) if residual is not None else _placeholder(input)
    return input.new_empty(input.shape, dtype=fp8_dtype), s


# ---- autograd -------------------------------------------------------------------------------


def _setup(ctx, inputs, output):
    input, residual, weight, bias, shape, eps, rms, weight_offset, memory_efficient, client = \
        inputs
    y, s, mean, invvar = output
    has_residual = residual is not None
    saved = y if memory_efficient else (s if has_residual else input)
    ctx.save_for_backward(saved, weight, bias, None if memory_efficient or rms else mean, invvar)
    ctx.args = (shape, eps, rms, weight_offset, memory_efficient)
    ctx.has_residual = has_residual
    ctx.client = client


def _backward(ctx, grad_y, grad_s, grad_mean, grad_invvar):
    saved, weight, bias, mean, invvar = ctx.saved_tensors
    want_w = weight is not None and ctx.needs_input_grad[2]
    want_b = bias is not None and ctx.needs_input_grad[3]
    dx, dgamma, dbeta = torch.ops.normd.norm_variant_bwd(
        grad_y, grad_s if ctx.has_residual else None, saved, weight, bias, mean, invvar,
        *ctx.args, want_w, want_b, ctx.client)
    return (dx if ctx.needs_input_grad[0] else None,
            dx if ctx.has_residual and ctx.needs_input_grad[1] else None,
            dgamma if want_w else None, dbeta if want_b else None,
            None, None, None, None, None, None)


# ---- registration -----------------------------------------------------------------------------


def _register():
    tag = custom_ops._CUDAGRAPH_UNSAFE
    tags = {"tags": (tag,)} if tag is not None else {}
    ops = {}
    for name, impl, fake, mutates in (("norm_variant_fwd", _fwd, _fwd_fake, ()),
                                      ("norm_variant_bwd", _bwd, _bwd_fake, ()),
                                      ("norm_variant_fp8", _fp8, _fp8_fake, ("amax",))):
        op = torch.library.custom_op("normd::" + name, impl, mutates_args=mutates, **tags)
        op.register_fake(fake)
        ops[name] = op
    ops["norm_variant_fwd"].register_autograd(_backward, setup_context=_setup)
    return ops


#: The CustomOpDef objects by name (empty where PyTorch has no custom_op).
OPS = _register() if AVAILABLE else {}
