"""The norm variants for PyTorch: residual add, zero-centered and offset weights, FP8 output.

docs/VARIANTS.md says what each computes; issue 19 says why. This module
holds what the variants share: where a call computes, the job runner, the
autograd Function, the torch implementation, the weight-offset modules
``FusedLayerNormOffset``/``FusedRMSNormOffset`` and their functions, and
the FP8 forward (``fused_rms_norm_fp8``, ``fused_layer_norm_fp8``).
``fused_add.py`` has the residual-add modules and functions built on it.

Where a call computes, one rule for every variant:

1. As for the plain norms (see fused_layer_norm): CPU tensors (unless
   ``NORMD_TORCH_CPU=daemon``), float64, empty inputs, TorchScript and
   tracing are computed by torch, with the numerics below.
2. Otherwise the daemon computes, when its backend runs every variant the
   call uses (``Client.norm_features``: residual add, weight offset, FP8
   output; the CPU and CUDA backends report all three). This is decided
   per call, from what the connected daemon reports.
3. When the backend does not run them (a daemon older than protocol 3, or
   a backend built without the variant kernels): torch computes
   (``variant_fallback() == "torch"``, the default), or, when
   ``NORMD_VARIANT_FALLBACK=error`` (read at each call) or
   ``set_variant_fallback("error")`` asks for strictness, the call raises
   ``NormdError`` UNSUPPORTED before anything is sent.

Under torch.compile (and torch.export) the same rule is applied while
tracing: the daemon's variants through the custom ops of variant_ops
(normd::norm_variant_fwd/bwd/fp8), or torch's implementation traced into
the graph; the strict error then comes wrapped by torch.compile (the
NormdError is its context). The in-place forms have no op: compiled, torch
computes them.

The torch implementation follows the daemon's numerics: s = x + residual
rounded once to the input's dtype and normalized as stored; the weight
``weight_offset + w`` formed in float32 (float64 for float64 input), never
rounded to the weight's dtype; the norm in float32; FP8 codes
``saturate(round_to_nearest_even(y * scale))`` of the float32 y, NaN as
0x7f, amax the largest |y| with NaN skipped. Its gradients come from
autograd.

Weight offsets: ``zero_centered_gamma=True`` is ``offset=1.0`` (Megatron's
apply_layernorm_1p, TransformerEngine's zero_centered_gamma, Gemma's
``1 + w``); ``offset`` takes any value (Liger's). They are two spellings of
one number: giving both is a ValueError. The offset is rounded to float32,
as the job carries it. Modules with an offset start with the weight at
``1 - offset`` (zeros when zero-centered), so the effective weight starts
at one.
"""

import importlib
import math
import os

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from .. import _lib
from .. import eager as _eager
from .._lib import STATUS_CODES, DType, Op
from ..client import completion_mode, default_client, norm_job
from ..errors import NormdError
from ..job_ext import feature_names
from .fused_layer_norm import (_CAPTURE_MESSAGE, _DTYPES, FusedLayerNorm, FusedRMSNorm,
                               _any_autocast, _autocast_cast, _autocast_enabled, _capturing,
                               _check_param, _daemon_input, _is_compiling, _normalized_shape,
                               _raw_stream, _rows_cols, _run_staged)

# The module, not the package's function of the same name (fused_layer_norm._eager_op).
_fln = importlib.import_module(__package__ + ".fused_layer_norm")

__all__ = [
    "FALLBACK_MODES", "FusedLayerNormOffset", "FusedNormVariantFunction", "FusedRMSNormOffset",
    "fused_layer_norm_fp8", "fused_layer_norm_offset", "fused_rms_norm_fp8",
    "fused_rms_norm_offset", "set_variant_fallback", "variant_fallback",
]

#: torch's FP8 dtypes (PyTorch 2.1 and later) -> the job's y_dtype, and their largest finite value.
FP8_DTYPES = {getattr(torch, name): code for name, code in
              (("float8_e4m3fn", DType.F8E4M3), ("float8_e5m2", DType.F8E5M2))
              if hasattr(torch, name)}
FP8_MAX = {getattr(torch, name): value for name, value in
           (("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0)) if hasattr(torch, name)}
_FP8_NAN = 0x7F  # the NaN code the daemon writes in both formats
_E4M3 = getattr(torch, "float8_e4m3fn", None)

FALLBACK_MODES = ("torch", "error")
_fallback = None  # set_variant_fallback()'s choice; None: $NORMD_VARIANT_FALLBACK


#: Roles a forward and a backward write (copied back in the staged CPU mode); a backward
#: reads mean and rstd, so copying them back would bump their autograd versions.
_FWD_OUTPUTS = frozenset(("y", "mean", "rstd", "residual_out", "amax"))
_BWD_OUTPUTS = frozenset(("dx", "dgamma", "dbeta"))

# ---- where a call computes -------------------------------------------------------------


# These two are fused_layer_norm's questions, asked here in their plain form:
# that module's per-call path is tuned separately and keeps its own.
def _scripting():
    return torch.jit.is_scripting() or torch.jit.is_tracing()


def _dynamo_compiling():
    """True while torch.compile / torch.export traces the caller."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler and getattr(compiler, "is_compiling", None) and compiler.is_compiling())


def _checked_fallback(mode, what):
    name = str(mode).strip().lower()
    if name not in FALLBACK_MODES:
        raise ValueError("%s=%r: one of %s" % (what, mode, ", ".join(FALLBACK_MODES)))
    return name


def variant_fallback():
    """What a call does when the daemon's backend lacks a variant it uses: "torch" or "error".

    "torch" (the default): torch computes it (same numerics; module doc).
    "error": NormdError UNSUPPORTED is raised before anything is sent.
    set_variant_fallback() decides for this process; until it is called
    (or after set_variant_fallback(None)), $NORMD_VARIANT_FALLBACK does,
    read at each call.
    """
    if _fallback is not None:
        return _fallback
    env = os.environ.get("NORMD_VARIANT_FALLBACK", "").strip()
    return _checked_fallback(env, "NORMD_VARIANT_FALLBACK") if env else "torch"


def set_variant_fallback(mode):
    """Sets variant_fallback() for this process (None: back to the variable); returns the old."""
    global _fallback
    old, _fallback = _fallback, None if mode is None else _checked_fallback(mode, "fallback")
    return old


def _float32(value):
    """value rounded to the nearest float32 (ties to even), as a Python float.

    Plain arithmetic rather than ctypes or struct, so that torch.compile
    traces through it (the offsets are constants there).
    """
    if value == 0 or not math.isfinite(value):
        return value
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= |m| < 1
    bits = 24 - max(0, -125 - exponent)  # float32 subnormals keep fewer bits
    rounded = math.ldexp(round(math.ldexp(mantissa, bits)), exponent - bits)
    if abs(rounded) >= 2.0 ** 128:
        return math.copysign(math.inf, value)
    return math.copysign(rounded, value)  # keeps -0.0 for a negative value rounding to zero


def weight_offset_of(zero_centered_gamma, offset):
    """The job's weight_offset (a float32 value) for zero_centered_gamma or offset."""
    if zero_centered_gamma and offset != 0:
        raise ValueError("zero_centered_gamma=True is offset=1.0: give one of them, not both "
                         "(got offset=%r)" % (offset,))
    value = _float32(1.0 if zero_centered_gamma else float(offset))
    if not math.isfinite(value):
        raise ValueError("offset must be finite in float32 (got %r)" % (offset,))
    return value


def _features(residual, weight_offset, fp8):
    return ((_lib.FEATURE_RESIDUAL if residual is not None else 0) |
            (_lib.FEATURE_WEIGHT_OFFSET if weight_offset else 0) |
            (_lib.FEATURE_FP8_OUTPUT if fp8 else 0))


def daemon_runs(client, need):
    """Whether `client`'s daemon runs the variants `need` (FEATURE_* bits): True, or False when
    torch is to compute them, or NormdError UNSUPPORTED when variant_fallback() is "error"."""
    features = client.norm_features
    missing = need & ~features
    if not missing:
        return True
    if variant_fallback() == "error":
        raise NormdError(STATUS_CODES["UNSUPPORTED"],
                         "the daemon's %s backend does not run %s jobs (nc_server_norm_features "
                         "0x%x), and NORMD_VARIANT_FALLBACK / set_variant_fallback asks for "
                         "an error rather than computing them with torch"
                         % (client.backend, feature_names(missing), features))
    return False


def _route(input, need, client):
    """Where one call computes (module doc): ("daemon", client), ("ops", None) or ("torch", None).

    "ops": code being compiled, which calls the custom ops of variant_ops.
    """
    if _scripting() or not _daemon_input(input):
        return "torch", None
    if _dynamo_compiling():
        if not _variant_ops.AVAILABLE:
            return "torch", None
        key = 0 if client is None else client._key
        return ("ops" if _variant_ops.route(key, need) else "torch"), None
    client = client or default_client()
    return ("daemon" if daemon_runs(client, need) else "torch"), client


def _plan(input, residual, weight, bias, shape, weight_offset):
    """Checks a call's arguments; returns (rows, cols, the job's weight_dtype)."""
    rows, cols = _rows_cols(input, shape)
    if residual is not None:
        if residual.shape != input.shape:
            raise RuntimeError("residual has shape %s but the input %s"
                               % (list(residual.shape), list(input.shape)))
        if residual.dtype != input.dtype:
            raise TypeError("residual is %s but the input %s (they must match)"
                            % (residual.dtype, input.dtype))
        if residual.device != input.device:
            raise RuntimeError("residual is on %s but the input is on %s"
                               % (residual.device, input.device))
    _check_param("weight", weight, input, shape)
    _check_param("bias", bias, input, shape)
    if bias is not None and (weight is None or bias.dtype != weight.dtype):
        raise TypeError("bias must have the weight's dtype (weight %s, bias %s)"
                        % (None if weight is None else weight.dtype, bias.dtype))
    if weight_offset and weight is None:
        raise ValueError("a weight offset (zero_centered_gamma or offset) needs a weight")
    if weight is None or weight.dtype == input.dtype or input.dtype not in _DTYPES:
        return rows, cols, None
    if weight.dtype == torch.float32:
        return rows, cols, DType.F32
    raise TypeError("normd: weights must have the input's dtype or be float32 (input %s, "
                    "weight %s)" % (input.dtype, weight.dtype))


def _check_fp8_args(input, scale, amax, fp8_dtype):
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError("fp8_dtype must be one of %s (got %r)"
                        % (", ".join(str(d) for d in FP8_DTYPES), fp8_dtype))
    for name, t in (("scale", scale), ("amax", amax)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
            raise TypeError("%s must be a float32 tensor of one element" % name)
        if t.device != input.device:
            raise RuntimeError("%s is on %s but the input is on %s" % (name, t.device,
                                                                       input.device))


# ---- running one job on torch tensors ---------------------------------------------------


# nc_job_enqueue_device_ext's pointer slot of each role.
_POINTER_SLOTS = {role: i for i, role in enumerate(_lib.TENSOR_ROLES + _lib.EXT_TENSOR_ROLES)}

_job_exts = {}


def _job_ext(weight_offset, y_dtype):
    """A struct nc_job_ext without tensors, made once per (offset, y_dtype): not to be changed."""
    key = (weight_offset, y_dtype)
    ext = _job_exts.get(key)
    if ext is None:
        ext = _lib.NcJobExt(weight_offset=weight_offset, y_dtype=y_dtype)
        if len(_job_exts) < 64:
            _job_exts[key] = ext
    return ext


def _run(client, op, rows, cols, args, tensors):
    """Runs one job whose tensors are torch tensors (CUDA, or CPU when staged).

    args: make_job_ext()'s plain arguments (eps, weight_dtype, weight_offset,
    y_dtype, memory_efficient); tensors by role, None where absent. A
    tensor given for two roles is one memory (the in-place forms).
    """
    tensors = {role: t for role, t in tensors.items() if t is not None}
    x = tensors["x"]
    args["dtype"] = _DTYPES[x.dtype]
    if not x.is_cuda:
        outputs = _BWD_OUTPUTS if op in (Op.LAYERNORM_BWD, Op.RMSNORM_BWD) else _FWD_OUTPUTS
        _run_staged(client, op, rows, cols, args, tensors, outputs, ext=True)
        return
    if _capturing():
        raise NormdError(STATUS_CODES["UNSUPPORTED"], _CAPTURE_MESSAGE)
    stream = _raw_stream(x.get_device())
    mode = completion_mode()
    if mode == "enqueue":
        # As fused_layer_norm._run: the temporaries and outputs were
        # allocated on this current stream, so the caching allocator reuses
        # them only after the job. The callers made the tensors what the job
        # needs; the library checks regions, bounds and aliasing.
        eps = args.get("eps")
        job = norm_job(op, rows, cols, 0.0 if eps is None else float(eps), int(args["dtype"]),
                       int(args.get("weight_dtype") or 0),
                       _lib.MEMORY_EFFICIENT if args.get("memory_efficient") else 0)
        ext = _job_ext(float(args.get("weight_offset") or 0.0), int(args.get("y_dtype") or 0))
        ptrs = [0] * _lib.ALL_JOB_TENSORS
        for role, t in tensors.items():
            ptrs[_POINTER_SLOTS[role]] = t.data_ptr()
        client._enqueue_device_ext(job, ext, _lib.pack_all_device_pointers(*ptrs), stream)
    else:
        client.run_ext(op, rows, cols, stream=stream, event=(mode == "event"), **args,
                       **tensors)


def _forward(client, rms, input, residual, weight, bias, shape, eps, weight_offset, *,
             fp8=None, scale=None, amax=None, in_place=False, stats=True):
    """Runs one forward job with its variants.

    Returns (y, s, mean, invvar, weight_dtype, x): s None without residual,
    mean None for RMSNorm or without stats, x the contiguous input the job
    read. in_place: y over the input and s over the residual (both
    contiguous, the caller checked).
    """
    rows, cols, weight_dtype = _plan(input, residual, weight, bias, shape, weight_offset)
    x = input.contiguous()
    r = residual.contiguous() if residual is not None else None
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    if in_place:
        y, s = x, r
    else:
        y = torch.empty(x.shape, dtype=fp8 or x.dtype, device=x.device)
        s = torch.empty_like(x, memory_format=torch.contiguous_format) if r is not None else None
    mean = torch.empty(rows, dtype=torch.float32, device=x.device) if stats and not rms else None
    invvar = torch.empty(rows, dtype=torch.float32, device=x.device) if stats else None
    args = dict(eps=eps, weight_dtype=weight_dtype, weight_offset=weight_offset,
                y_dtype=FP8_DTYPES[fp8] if fp8 is not None else None)
    _run(client, Op.RMSNORM_FWD if rms else Op.LAYERNORM_FWD, rows, cols, args,
         dict(x=x, y=y, mean=mean, rstd=invvar, gamma=weight, beta=bias, residual=r,
              residual_out=s, scale=scale, amax=amax))
    return y, s, mean, invvar, weight_dtype, x


# ---- the autograd Function ---------------------------------------------------------------


class FusedNormVariantFunction(torch.autograd.Function):
    """LayerNorm or RMSNorm with a residual add and/or a weight offset, by the daemon.

    apply(input, residual, weight, bias, normalized_shape, eps, rms,
    weight_offset, memory_efficient, client) -> (y, s): s = input +
    residual rounded once (None without residual), y = norm(s or input) *
    (weight_offset + weight) [+ bias]. Saves s (or the input without
    residual), or y with memory_efficient, and weight, bias, mean (LayerNorm,
    not memory_efficient) and invvar. Backward takes the gradients of y and
    s and returns one dx = dnorm + ds for both input and residual. Call it
    through the modules and functions, which decide where a call computes.
    """

    @staticmethod
    def forward(ctx, input, residual, weight, bias, normalized_shape, eps, rms, weight_offset,
                memory_efficient, client):
        ctx.set_materialize_grads(False)
        shape = _normalized_shape(normalized_shape)
        y, s, mean, invvar, weight_dtype, x = _forward(client, rms, input, residual, weight,
                                                       bias, shape, eps, weight_offset)
        ctx.client, ctx.rms, ctx.shape, ctx.eps = client, rms, shape, eps
        ctx.weight_offset, ctx.memory_efficient = weight_offset, memory_efficient
        ctx.weight_dtype, ctx.has_residual = weight_dtype, residual is not None
        saved = y if memory_efficient else (s if s is not None else x)
        ctx.save_for_backward(saved, weight.contiguous() if weight is not None else None,
                              bias.contiguous() if bias is not None else None,
                              None if memory_efficient else mean, invvar)
        return y, s

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, ds):
        saved, weight, bias, mean, invvar = ctx.saved_tensors
        want_w = weight is not None and ctx.needs_input_grad[2]
        want_b = bias is not None and ctx.needs_input_grad[3]
        if dy is None:  # only s was used: dnorm(s) is zero
            dx = ds.to(saved.dtype).contiguous()
            dgamma = torch.zeros_like(weight) if want_w else None
            dbeta = torch.zeros_like(bias) if want_b else None
        else:
            dx, dgamma, dbeta = _backward(ctx, saved, dy, ds, weight, bias, mean, invvar,
                                          want_w, want_b)
        d_input = dx if ctx.needs_input_grad[0] else None
        d_residual = dx if ctx.has_residual and ctx.needs_input_grad[1] else None
        return d_input, d_residual, dgamma, dbeta, None, None, None, None, None, None


def _backward(ctx, saved, dy, ds, weight, bias, mean, invvar, want_w, want_b):
    """The backward job: dx = dnorm(saved) + ds, dgamma, dbeta."""
    rows, cols = _rows_cols(saved, ctx.shape)
    dy = dy.contiguous()
    if dy.dtype != saved.dtype:
        dy = dy.to(saved.dtype)
    if ds is not None:
        ds = ds.contiguous() if ds.dtype == saved.dtype else ds.to(saved.dtype).contiguous()
    dx = torch.empty_like(saved, memory_format=torch.contiguous_format)
    dgamma = torch.empty_like(weight) if want_w else None
    dbeta = torch.empty_like(bias) if want_b else None
    args = dict(eps=ctx.eps, weight_dtype=ctx.weight_dtype, weight_offset=ctx.weight_offset,
                memory_efficient=ctx.memory_efficient)
    _run(ctx.client, Op.RMSNORM_BWD if ctx.rms else Op.LAYERNORM_BWD, rows, cols, args,
         dict(x=saved, dy=dy, mean=mean, rstd=invvar, gamma=weight, beta=bias, dx=dx,
              dgamma=dgamma, dbeta=dbeta, ds=ds))
    return dx, dgamma, dbeta


# ---- the torch implementation ----------------------------------------------------------------


def torch_norm_variant(rms, input, residual, weight, bias, normalized_shape, eps,
                       weight_offset=0.0):
    """The variants computed by torch, autograd-capable: (y in the compute type, s).

    s = input + residual in the input's dtype (one rounding) or None; y =
    norm(s or input) * (weight_offset + weight) [+ bias], computed in float32
    (float64 for float64 input) and not rounded: the callers round it to the
    output dtype or to FP8.
    """
    shape = _normalized_shape(normalized_shape)
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    s = input + residual if residual is not None else None
    v = (input if s is None else s).to(compute)
    w = weight.to(compute) if weight is not None else None
    if w is not None and weight_offset:
        w = w + weight_offset
    if rms:
        dims = tuple(range(-len(shape), 0))
        y = v * torch.rsqrt(v.pow(2).mean(dims, keepdim=True) + eps)
        if w is not None:
            y = y * w
    else:
        y = F.layer_norm(v, shape, w, bias.to(compute) if bias is not None else None, eps)
    return y, s


def torch_fp8(y, scale, amax, fp8_dtype):
    """FP8 codes of y * scale as the daemon writes them; amax (if given) gets max |y|, NaN skipped.

    y * scale is formed in y's dtype (float32, or float64) and rounded once
    to nearest even; magnitudes past the format's largest finite value
    (infinities too) saturate to it; NaN becomes 0x7f.
    """
    magnitude = y.detach().abs()
    magnitude = torch.where(torch.isnan(magnitude), torch.zeros_like(magnitude), magnitude)
    if amax is not None:
        top = magnitude.max() if magnitude.numel() else magnitude.new_zeros(())
        amax.copy_(top.to(torch.float32).reshape(amax.shape))
    scaled = y * scale.to(y.dtype)
    limit = FP8_MAX[fp8_dtype]
    codes = scaled.clamp(-limit, limit).to(fp8_dtype).view(torch.uint8)
    # torch keeps a NaN's sign (0xff); the daemon writes 0x7f for every NaN.
    return codes.masked_fill(torch.isnan(scaled), _FP8_NAN).view(fp8_dtype)


# ---- dispatch -----------------------------------------------------------------------------------


def variant_norm(rms, input, residual, weight, bias, normalized_shape, eps, weight_offset,
                 memory_efficient, client):
    """One call of a variant module or function: (y, s), s None without residual."""
    # With autocast off, the block below would change nothing: eager calls skip it.
    compiling = _is_compiling is not None and _is_compiling()
    if input.is_cuda and (compiling or (_any_autocast() and _autocast_enabled())):
        input, residual, weight, bias = _autocast_cast(input, residual, weight, bias)
        with torch.autocast("cuda", enabled=False):
            return _variant_norm(rms, input, residual, weight, bias, normalized_shape, eps,
                                 weight_offset, memory_efficient, client)
    if input.is_cuda:
        out = _eager_straight(rms, input, residual, weight, bias, normalized_shape, eps,
                              weight_offset, memory_efficient, client)
        if out is not None:
            return out
    # The operator, if it could take the call, has just said no: not asked twice.
    return _variant_norm(rms, input, residual, weight, bias, normalized_shape, eps,
                         weight_offset, memory_efficient, client, eager=False)


def _conn_features(client):
    """The daemon's FEATURE_* bits, asked once a connection (a daemon's features do not change
    while it serves one)."""
    conn = client._conn
    features = conn.norm_features
    if features is None:
        features = conn.norm_features = client.norm_features
    return features


def _eager_straight(rms, input, residual, weight, bias, normalized_shape, eps, weight_offset,
                    memory_efficient, client):
    """An eager CUDA call straight to the variants' operator (_run_eager), before the checks
    and routing of _variant_norm: (y, s), or None where that path takes it. The operator
    hands every call it does not take (arguments _plan would refuse among them) back as a
    fallback, so the errors stay the checked path's."""
    if torch._C._get_tracing_state() is not None or input.dtype not in _DTYPES:
        return None
    client = client or default_client()
    if _features(residual, weight_offset, False) & ~_conn_features(client):
        return None
    return _run_eager(rms, input, residual, weight, bias,
                      _fln._cached_normalized_shape(normalized_shape), eps, weight_offset,
                      memory_efficient, client)


def _run_eager(rms, input, residual, weight, bias, shape, eps, weight_offset, memory_efficient,
               client):
    """The call through the compiled variants' operator (normd.eager): (y, s), or None where
    FusedNormVariantFunction takes it (the operator off, another completion mode, a case
    the operator leaves to Python, which raises the errors)."""
    # eager.paused() and NORMD_EAGER=0 turn off both operators (fused_layer_norm._eager_op).
    if _fln._eager_op is False:
        return None
    op = _eager.variant_op()
    if op is None or completion_mode() != "enqueue":
        return None
    if type(eps) is not float:
        eps = 0.0 if eps is None else float(eps)
    out = _fln._operator_call(op, client, input, residual, weight, bias, shape, eps, rms,
                              float(weight_offset or 0.0), memory_efficient)
    if out is None:
        return None
    y, s = out
    return y, (s if residual is not None else None)


def _variant_norm(rms, input, residual, weight, bias, normalized_shape, eps, weight_offset,
                  memory_efficient, client, eager=True):
    shape = _normalized_shape(normalized_shape)
    _plan(input, residual, weight, bias, shape, weight_offset)
    where, daemon = _route(input, _features(residual, weight_offset, False), client)
    if where == "daemon":
        if input.is_cuda and eager:
            out = _run_eager(rms, input, residual, weight, bias, shape, eps, weight_offset,
                             memory_efficient, daemon)
            if out is not None:
                return out
        return FusedNormVariantFunction.apply(input, residual, weight, bias, shape, eps, rms,
                                              weight_offset, memory_efficient, daemon)
    if where == "ops":
        return _variant_ops.norm(rms, input, residual, weight, bias, shape, eps, weight_offset,
                                 memory_efficient, client)
    y, s = torch_norm_variant(rms, input, residual, weight, bias, shape, eps, weight_offset)
    return y.to(input.dtype), s


def fp8_norm(rms, input, residual, weight, bias, normalized_shape, eps, weight_offset, scale,
             amax, fp8_dtype, client):
    """The FP8 forward: y8, or (y8, s) with a residual. No autograd (module doc)."""
    shape = _normalized_shape(normalized_shape)
    _check_fp8_args(input, scale, amax, fp8_dtype)
    if scale is None:
        raise TypeError("FP8 output needs scale (a float32 tensor of one element)")
    _plan(input, residual, weight, bias, shape, weight_offset)
    with torch.no_grad():
        where, daemon = _route(input, _features(residual, weight_offset, True), client)
        if where == "ops":
            return _variant_ops.fp8(rms, input, residual, weight, bias, shape, eps,
                                    weight_offset, scale, amax, fp8_dtype, client)
        if where == "torch":
            y, s = torch_norm_variant(rms, input, residual, weight, bias, shape, eps,
                                      weight_offset)
            y8 = torch_fp8(y, scale, amax, fp8_dtype)
        else:
            # The job writes amax in place: a contiguous float32 element of its own.
            out = amax if amax is None or amax.is_contiguous() else amax.clone()
            y8, s, _, _, _, _ = _forward(daemon, rms, input, residual, weight, bias, shape, eps,
                                         weight_offset, fp8=fp8_dtype,
                                         scale=scale.contiguous(), amax=out, stats=False)
            if out is not amax:
                amax.copy_(out)
    return y8 if residual is None else (y8, s)


def _default_shape(normalized_shape, input, weight):
    if normalized_shape is not None:
        return normalized_shape
    return tuple(weight.shape) if weight is not None else tuple(input.shape[-1:])


# ---- weight offsets on the plain norms ----------------------------------------------------


def fused_layer_norm_offset(input, weight, bias, normalized_shape, eps=1e-6, *,
                            zero_centered_gamma=False, offset=0.0, memory_efficient=False,
                            client=None):
    """fused_layer_norm_affine with the weight offset + weight (1 + weight when zero-centered)."""
    return variant_norm(False, input, None, weight, bias, normalized_shape, eps,
                        weight_offset_of(zero_centered_gamma, offset), memory_efficient,
                        client)[0]


def fused_rms_norm_offset(input, weight, normalized_shape, eps=1e-6, *,
                          zero_centered_gamma=False, offset=0.0, memory_efficient=False,
                          client=None):
    """fused_rms_norm_affine with the weight offset + weight (Gemma: offset=1.0)."""
    return variant_norm(True, input, None, weight, None, normalized_shape, eps,
                        weight_offset_of(zero_centered_gamma, offset), memory_efficient,
                        client)[0]


class _OffsetMixin:
    """zero_centered_gamma / offset on a FusedLayerNorm-like module (module doc)."""

    def _init_offset(self, zero_centered_gamma, offset, elementwise_affine):
        # Set before nn.Module.__init__: reset_parameters, called from there, reads them.
        weight_offset_of(zero_centered_gamma, offset)
        if (zero_centered_gamma or offset) and not elementwise_affine:
            raise ValueError("a weight offset (zero_centered_gamma or offset) needs "
                             "elementwise_affine=True")
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.offset = float(offset)

    @property
    def weight_offset(self):
        """What the job adds to the weight (float32): 1 when zero-centered, else offset."""
        return weight_offset_of(self.zero_centered_gamma, self.offset)

    def reset_parameters(self):
        """weight = 1 - offset (the effective weight starts at one), bias = 0."""
        with torch.no_grad():
            if self.weight is not None:
                self.weight.fill_(1.0 - self.weight_offset)
            if self.bias is not None:
                self.bias.zero_()

    def _offset_repr(self):
        return ", zero_centered_gamma=%s, offset=%s" % (self.zero_centered_gamma, self.offset)


class FusedLayerNormOffset(_OffsetMixin, FusedLayerNorm):
    """FusedLayerNorm whose weight is offset + weight (zero_centered_gamma: offset 1).

    FusedLayerNormOffset(normalized_shape, eps=1e-5, elementwise_affine=True,
    memory_efficient=False, zero_centered_gamma=False, offset=0.0, *,
    client=None). The weight starts at 1 - offset. A FusedLayerNorm whose
    forward goes through the variants' path (module doc of
    normd.normalization.variants).
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 memory_efficient=False, zero_centered_gamma=False, offset=0.0, *, client=None):
        self._init_offset(zero_centered_gamma, offset, elementwise_affine)
        super().__init__(normalized_shape, eps, elementwise_affine, memory_efficient,
                         client=client)

    def forward(self, input):
        return variant_norm(self._rms, input, None, self.weight, self.bias,
                            self.normalized_shape, self.eps, self.weight_offset,
                            self.memory_efficient, self.client)[0]

    def extra_repr(self):
        return super().extra_repr() + self._offset_repr()


class FusedRMSNormOffset(FusedLayerNormOffset, FusedRMSNorm):
    """FusedRMSNorm whose weight is offset + weight (Gemma's RMSNorm: offset=1.0).

    Arguments as FusedLayerNormOffset's.
    """

    _rms = True


# ---- FP8 output ------------------------------------------------------------------------------


def fused_rms_norm_fp8(input, weight, normalized_shape=None, eps=1e-6, *, scale, amax=None,
                       fp8_dtype=_E4M3, residual=None, zero_centered_gamma=False,
                       offset=0.0, client=None):
    """RMSNorm written as FP8: saturate(round_to_nearest_even(y * scale)), no gradient.

    scale: float32 tensor of one element (read). amax: float32 tensor of one
    element or None; gets max |y| before scaling (NaN skipped), written, not
    accumulated. fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
    residual: add it first (s = input + residual, rounded once) and return
    (y8, s). normalized_shape: default the weight's shape (the last
    dimension without weight). Returns y8 of the input's shape in fp8_dtype.
    """
    return fp8_norm(True, input, residual, weight, None,
                    _default_shape(normalized_shape, input, weight), eps,
                    weight_offset_of(zero_centered_gamma, offset), scale, amax, fp8_dtype,
                    client)


def fused_layer_norm_fp8(input, weight, bias, normalized_shape=None, eps=1e-6, *, scale,
                         amax=None, fp8_dtype=_E4M3, residual=None,
                         zero_centered_gamma=False, offset=0.0, client=None):
    """LayerNorm written as FP8 (see fused_rms_norm_fp8)."""
    return fp8_norm(False, input, residual, weight, bias,
                    _default_shape(normalized_shape, input, weight), eps,
                    weight_offset_of(zero_centered_gamma, offset), scale, amax, fp8_dtype,
                    client)


# The ops call this module's helpers, so they are defined once it is complete.
from . import variant_ops as _variant_ops  # noqa: E402
