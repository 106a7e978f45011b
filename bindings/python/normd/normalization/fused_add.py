"""Residual add + norm: FusedAddLayerNorm, FusedAddRMSNorm and their functions.

A pre-norm block's ``s = x + residual; y = norm(s)`` in one job (docs/VARIANTS.md):

- ``FusedAddRMSNorm(normalized_shape, eps=1e-5, elementwise_affine=True,
  memory_efficient=False, zero_centered_gamma=False, offset=0.0, *,
  client=None)`` and ``FusedAddLayerNorm`` (same arguments, with a bias):
  ``forward(input, residual) -> (y, s)``. s is input + residual rounded once
  to the input's dtype (the next block's residual), y = norm(s) * (offset +
  weight) [+ bias] in the input's dtype. Backward: the gradients of y and of
  s flow in; one dx = dnorm(s) + ds is the gradient of both input and
  residual. ``memory_efficient`` saves y instead of s (backward recomputes
  the normalized s from it), as apex's modules do for the input.
- ``fused_add_rms_norm(input, residual, weight, eps=1e-6, *,
  normalized_shape=None, memory_efficient=False, zero_centered_gamma=False,
  offset=0.0, client=None) -> (y, s)`` and ``fused_add_layer_norm(input,
  residual, weight, bias, eps=1e-6, ...)``; normalized_shape defaults to the
  weight's shape (the last dimension without weight).
- ``fused_add_rms_norm_(input, residual, weight, eps=1e-6, ...)`` and
  ``fused_add_layer_norm_``: vLLM's in-place form, residual <- input +
  residual, input <- norm(residual) * weight; returns (input, residual). The
  daemon writes y over the input and s over the residual (the aliasing
  rule's allowed form); the two must not share memory (ValueError). For
  inference: it records no autograd, and raises if grad mode is on and a
  tensor requires grad. Non-contiguous tensors are computed out of place
  and copied back.

Dtypes: input and residual share a dtype (float32, float16, bfloat16 on
the daemon); the weights have it or are float32; outputs have the
input's. There are no Mixed* (weight-dtype output) forms. Where a call
computes (the daemon, or torch when its backend lacks the residual add) is
normd.normalization.variants' rule.
"""

import torch
from torch import nn
from torch.nn import init

from .fused_layer_norm import _normalized_shape
from .variants import (_default_shape, _dynamo_compiling, _features, _forward, _plan, _route,
                       torch_norm_variant, variant_norm, weight_offset_of)

__all__ = [
    "FusedAddLayerNorm", "FusedAddRMSNorm", "fused_add_layer_norm", "fused_add_layer_norm_",
    "fused_add_rms_norm", "fused_add_rms_norm_",
]


class FusedAddLayerNorm(nn.Module):
    """Residual add + layer normalization: forward(input, residual) -> (y, s).

    s = input + residual (rounded once), y = (s - mean) / sqrt(var + eps) *
    (offset + weight) + bias. The weight starts at 1 - offset (zeros when
    zero_centered_gamma), the bias at zeros. zero_centered_gamma=True is
    offset=1.0; give one of them. memory_efficient saves y instead of s.
    client: the normd.Client (default normd.default_client()).
    """

    _rms = False

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 memory_efficient=False, zero_centered_gamma=False, offset=0.0, *, client=None):
        super().__init__()
        weight_offset_of(zero_centered_gamma, offset)
        if (zero_centered_gamma or offset) and not elementwise_affine:
            raise ValueError("a weight offset (zero_centered_gamma or offset) needs "
                             "elementwise_affine=True")
        self.normalized_shape = torch.Size(_normalized_shape(normalized_shape))
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.offset = float(offset)
        self.client = client
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(*self.normalized_shape))
            if self._rms:
                self.register_parameter("bias", None)
            else:
                self.bias = nn.Parameter(torch.empty(*self.normalized_shape))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    @property
    def weight_offset(self):
        """What the job adds to the weight (float32): 1 when zero-centered, else offset."""
        return weight_offset_of(self.zero_centered_gamma, self.offset)

    def reset_parameters(self):
        """weight = 1 - offset (the effective weight starts at one), bias = 0."""
        if self.weight is not None:
            init.constant_(self.weight, 1.0 - self.weight_offset)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, input, residual):
        return variant_norm(self._rms, input, residual, self.weight, self.bias,
                            self.normalized_shape, self.eps, self.weight_offset,
                            self.memory_efficient, self.client)

    def extra_repr(self):
        return ("{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}, "
                "memory_efficient={memory_efficient}, zero_centered_gamma="
                "{zero_centered_gamma}, offset={offset}".format(**self.__dict__))


class FusedAddRMSNorm(FusedAddLayerNorm):
    """Residual add + RMS normalization: forward(input, residual) -> (y, s).

    s = input + residual (rounded once), y = s / sqrt(mean(s^2) + eps) *
    (offset + weight). Arguments as FusedAddLayerNorm's (no bias).
    """

    _rms = True


def fused_add_layer_norm(input, residual, weight, bias, eps=1e-6, *, normalized_shape=None,
                         memory_efficient=False, zero_centered_gamma=False, offset=0.0,
                         client=None):
    """(y, s): s = input + residual, y = LayerNorm(s) * (offset + weight) + bias."""
    return variant_norm(False, input, residual, weight, bias,
                        _default_shape(normalized_shape, input, weight), eps,
                        weight_offset_of(zero_centered_gamma, offset), memory_efficient, client)


def fused_add_rms_norm(input, residual, weight, eps=1e-6, *, normalized_shape=None,
                       memory_efficient=False, zero_centered_gamma=False, offset=0.0,
                       client=None):
    """(y, s): s = input + residual, y = RMSNorm(s) * (offset + weight)."""
    return variant_norm(True, input, residual, weight, None,
                        _default_shape(normalized_shape, input, weight), eps,
                        weight_offset_of(zero_centered_gamma, offset), memory_efficient, client)


def fused_add_layer_norm_(input, residual, weight, bias, eps=1e-6, *, normalized_shape=None,
                          zero_centered_gamma=False, offset=0.0, client=None):
    """In place: residual <- input + residual, input <- LayerNorm(residual); (input, residual)."""
    return _add_norm_in_place(False, input, residual, weight, bias, normalized_shape, eps,
                              weight_offset_of(zero_centered_gamma, offset), client)


def fused_add_rms_norm_(input, residual, weight, eps=1e-6, *, normalized_shape=None,
                        zero_centered_gamma=False, offset=0.0, client=None):
    """vLLM's fused_add_rms_norm: residual <- input + residual, input <- RMSNorm(residual) * w.

    Returns (input, residual). See the module doc for the rules.
    """
    return _add_norm_in_place(True, input, residual, weight, None, normalized_shape, eps,
                              weight_offset_of(zero_centered_gamma, offset), client)


def _byte_span(t):
    """[start, end) of the bytes a tensor may touch (its storage for a non-contiguous one)."""
    if t.is_contiguous():
        start = t.data_ptr()
        return start, start + t.numel() * t.element_size()
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _add_norm_in_place(rms, input, residual, weight, bias, normalized_shape, eps, weight_offset,
                       client):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (input, residual, weight, bias)):
        raise RuntimeError("the in-place fused add + norm records no autograd: call it under "
                           "torch.no_grad() / torch.inference_mode(), or use the out-of-place "
                           "form (fused_add_rms_norm / fused_add_layer_norm)")
    shape = _normalized_shape(_default_shape(normalized_shape, input, weight))
    _plan(input, residual, weight, bias, shape, weight_offset)
    with torch.no_grad():
        if _dynamo_compiling():  # no op for the in-place form: torch computes it
            where, daemon = "torch", None
        else:
            (a0, a1), (b0, b1) = _byte_span(input), _byte_span(residual)
            if input.device == residual.device and a0 < b1 and b0 < a1:
                raise ValueError("input and residual share memory: the in-place form writes y "
                                 "over the input and s over the residual, which must not "
                                 "overlap")
            where, daemon = _route(input, _features(residual, weight_offset, False), client)
        if where == "daemon" and input.is_contiguous() and residual.is_contiguous():
            _forward(daemon, rms, input, residual, weight, bias, shape, eps, weight_offset,
                     in_place=True, stats=False)
            return input, residual
        if where == "daemon":
            y, s, _, _, _, _ = _forward(daemon, rms, input, residual, weight, bias, shape, eps,
                                        weight_offset, stats=False)
        else:
            y, s = torch_norm_variant(rms, input, residual, weight, bias, shape, eps,
                                      weight_offset)
        residual.copy_(s)
        input.copy_(y)
    return input, residual
