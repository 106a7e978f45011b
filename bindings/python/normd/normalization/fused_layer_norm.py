"""apex.normalization's modules and functions, computed by the normd daemon.

The public names, argument order and defaults follow
``apex.normalization.fused_layer_norm``; the autograd Functions save what
apex saves (the input, or with ``memory_efficient`` the output; the mean
(LayerNorm) and the inverse standard deviation ``invvar``, fp32, one per
row), so a model's memory use does not change when it swaps apex for normd.

Where the daemon computes: CUDA tensors of float32, float16 or bfloat16,
through the default client (``normd.default_client()``, or the module's
``client=``), on the current CUDA stream. By default in the enqueue mode
(``nc_job_enqueue``): the job is ordered with the current stream on the
GPU and the call returns once it is sent, as a CUDA kernel launch does, so
the outputs are ready for work queued afterwards on that stream; an error
the daemon reports later (the outputs are then NaN) is raised by a later
call, as CUDA's asynchronous errors are. ``normd.set_completion_mode()`` or
``NORMD_COMPLETION=sync|event`` pick the synchronous mode (the call waits
for the job) or the IPC-event mode instead (see normd.completion_mode).
The tensors are registered with
the daemon on first use: one registration per cudaMalloc allocation of
PyTorch's caching allocator (CUDA IPC), or, with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, per run of a
segment's chunks that a tensor covers (each chunk passed as a POSIX fd; a
chunk unmapped and mapped again is registered anew). Memory from
``backend:cudaMallocAsync`` cannot be exported: NormdError UNSUPPORTED
says so.

Where torch computes instead (documented fallback, as apex's modules do for
non-CUDA input): CPU tensors, float64, empty inputs, and TorchScript /
tracing. The fallback computes in float32 (float64 for float64 input) and
returns the dtype the daemon path would. Setting ``NORMD_TORCH_CPU=daemon``
sends CPU tensors to the daemon instead (through shared-memory copies; for
testing the binding against a CPU-backend daemon).

Under torch.compile (and torch.export) the modules and functions call
normd's torch.library ops instead of the autograd Functions, so the daemon
still computes (see normd.normalization.custom_ops); the Functions
themselves are for eager code. A CUDA graph cannot hold a normd job (a
replay would not reach the daemon): a job asked for while the current
stream is capturing raises NormdError UNSUPPORTED, and the ops carry
PyTorch's ``cudagraph_unsafe`` tag so that
``torch.compile(mode="reduce-overhead")`` leaves them out of its graphs.

Dtypes: ``FusedLayerNorm``/``FusedRMSNorm`` and the ``fused_*`` functions
return the input's dtype; their weights are the input's dtype or float32
(float32 weights with half input use the daemon's mixed kernels). The
``Mixed*``/``mixed_dtype_*`` forms return the weights' dtype, as apex's do:
with float32 weights and half input the output is float32 (computed from
the input converted to float32) and the input's gradient is returned in
the input's dtype.

Under CUDA autocast, the functions cast their tensor arguments to the
autocast dtype and run with autocast off, as apex's do.
"""

import math
import numbers
import os
import warnings

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F
from torch.nn import init

from .._lib import MEMORY_EFFICIENT, STATUS_CODES, TENSOR_ROLES, DType, Op, pack_device_pointers
from .. import eager as _eager
from ..client import completion_mode, default_client, norm_job
from ..errors import NormdError

__all__ = [
    "FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm",
    "fused_layer_norm_affine", "fused_layer_norm", "fused_rms_norm_affine", "fused_rms_norm",
    "mixed_dtype_fused_layer_norm_affine", "mixed_dtype_fused_rms_norm_affine",
    "FusedLayerNormAffineFunction", "FusedLayerNormFunction", "FusedRMSNormAffineFunction",
    "FusedRMSNormFunction", "FusedLayerNormAffineMixedDtypesFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
]

_DTYPES = {torch.float32: DType.F32, torch.float16: DType.F16, torch.bfloat16: DType.BF16}

# Plain ints for the per-call path: hashing an IntEnum member costs more than an int's.
_DTYPE_CODES = {t: int(d) for t, d in _DTYPES.items()}
_LN_FWD, _LN_BWD = int(Op.LAYERNORM_FWD), int(Op.LAYERNORM_BWD)
_RMS_FWD, _RMS_BWD = int(Op.RMSNORM_FWD), int(Op.RMSNORM_BWD)

#: The norm ops' tensor roles, in struct nc_job's order: a job's tensors travel as such tuples.
_ROLES = TENSOR_ROLES[:10]

#: Roles the daemon writes, by op (copied back in the staged CPU mode).
_OUTPUTS = {_LN_FWD: ("y", "mean", "rstd"), _RMS_FWD: ("y", "rstd"),
            _LN_BWD: ("dx", "dgamma", "dbeta"), _RMS_BWD: ("dx", "dgamma")}

_STAGE_ALIGN = 64
_STAGE_KEY = 0  # the CPU backend's order key of staged jobs in the enqueue mode

_CAPTURE_MESSAGE = (
    "normd: the current CUDA stream is capturing a CUDA graph, and a normd job cannot be "
    "captured (a graph replays kernels, not the call that sends the job to the daemon, so "
    "every replay would skip the job). Run normd's norms outside capture: torch.compile(mode="
    "\"reduce-overhead\") keeps them out of its CUDA graphs on PyTorch >= 2.9 (the "
    "cudagraph_unsafe tag); with torch.cuda.graph, capture the work before and after the norm "
    "as separate graphs")

# ---- when the daemon computes ---------------------------------------------------


# torch.jit.is_tracing() without its Python wrapper (the same answer outside TorchScript).
_is_tracing = getattr(torch._C, "_is_tracing", None) or torch.jit.is_tracing

# True while torch.compile / torch.export traces the caller.
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)


# The CUDA queries of each job, without the Python wrappers of torch.cuda
# (is_current_stream_capturing, current_stream(device).cuda_stream).
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or \
    torch.cuda.is_current_stream_capturing
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
    (lambda index: torch.cuda.current_stream(index).cuda_stream)


def _staged_cpu():
    return os.environ.get("NORMD_TORCH_CPU", "torch").strip().lower() == "daemon"


def _daemon_input(input):
    """Whether the daemon can compute on `input` (dtype, size, device)."""
    if input.dtype not in _DTYPES or input.numel() == 0:
        return False
    return input.is_cuda or (input.device.type == "cpu" and _staged_cpu())


# normalized_shape values seen (tuples, torch.Size) -> their tuple of ints.
_shapes = {}
_SHAPES_MAX = 256


def _normalized_shape(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(d) for d in normalized_shape)


def _cached_normalized_shape(normalized_shape):
    """_normalized_shape(), remembered for the tuples (torch.Size) of eager calls."""
    try:
        return _shapes[normalized_shape]
    except (KeyError, TypeError):  # new, or unhashable (a list)
        pass
    shape = _normalized_shape(normalized_shape)
    if isinstance(normalized_shape, tuple):
        if len(_shapes) >= _SHAPES_MAX:
            _shapes.clear()
        _shapes[normalized_shape] = shape
    return shape


def _rows_cols(input, shape):
    """(rows, cols) of input's [rows, cols] view over the normalized dimensions."""
    n = len(shape)
    dims = input.shape
    if n == 1:  # the common case, without slicing the shape
        matches = len(dims) != 0 and dims[-1] == shape[0]
    else:
        matches = n != 0 and len(dims) >= n and dims[len(dims) - n:] == shape
    if not matches:
        raise RuntimeError(
            "Given normalized_shape=%s, expected input with shape [*, %s], but got input of "
            "size %s" % (list(shape), ", ".join(str(d) for d in shape), list(input.shape)))
    cols = shape[0] if n == 1 else math.prod(shape)
    return input.numel() // cols, cols


def _check_param(name, param, input, shape):
    if param is None:
        return
    if param.shape != shape:
        raise RuntimeError("Expected %s to be of shape %s, but got %s of shape %s"
                           % (name, list(shape), name, list(param.shape)))
    if param.device != input.device:
        raise RuntimeError("%s is on %s but the input is on %s" % (name, param.device,
                                                                   input.device))


def _check_backward_inputs(saved, grad_output, mean, invvar, weight, bias, shape):
    """Refuses backward inputs that do not fit `saved` (the ops may be called directly).

    The autograd Functions get these from their forward, which made them
    right; the library checks only that each lies inside its allocation.
    """
    rows, cols = _rows_cols(saved, shape)
    wanted = (("grad_output", grad_output, rows * cols, None),
              ("mean", mean, rows, torch.float32), ("invvar", invvar, rows, torch.float32),
              ("weight", weight, cols, None), ("bias", bias, cols, None))
    for name, t, elems, dtype in wanted:
        if t is None:
            continue
        if t.numel() < elems:
            raise ValueError("tensor %s holds %d elements; the job needs %d"
                             % (name, t.numel(), elems))
        if dtype is not None and t.dtype != dtype:
            raise TypeError("tensor %s is %s but the job needs %s" % (name, t.dtype, dtype))
        if t.device != saved.device:
            raise RuntimeError("%s is on %s but the input is on %s"
                               % (name, t.device, saved.device))


def _plan(input_dtype, weight, bias, mixed):
    """(upcast, weight_dtype) for the job, or TypeError for unsupported dtypes.

    upcast: the mixed forms with float32 weights and half input compute on
    input.float() so that the output is float32, as apex's are.
    """
    if bias is not None and (weight is None or bias.dtype != weight.dtype):
        raise TypeError("bias must have the weight's dtype (weight %s, bias %s)"
                        % (None if weight is None else weight.dtype, bias.dtype))
    if weight is None or weight.dtype == input_dtype:
        return False, None
    if weight.dtype == torch.float32:
        return mixed, None if mixed else DType.F32
    raise TypeError("normd: weights must have the input's dtype or be float32 (input %s, "
                    "weight %s)" % (input_dtype, weight.dtype))


# ---- running one job on torch tensors -------------------------------------------


def _run(client, op, rows, cols, eps, memory_efficient, weight_dtype, tensors):
    """Runs one job whose tensors are torch tensors (CUDA, or CPU when staged).

    tensors: the job's tensors in the order of _ROLES (x first), None where
    it has none. The callers made them what the job needs (dtypes, sizes,
    contiguous, one device), so they go to the library without checks of
    their own here; the library still checks regions and bounds.
    """
    x = tensors[0]
    dtype = _DTYPE_CODES[x.dtype]
    if x.is_cuda:
        stream = _raw_stream(x.get_device())
        mode = completion_mode()
        if mode == "enqueue":
            # The call returns before the GPU ran the job. What the job reads
            # and writes stays valid until then: the temporaries made for it
            # (.contiguous() / .float() / .to() copies, the freshly allocated
            # outputs y, mean, invvar, dx, dgamma, dbeta) were all allocated
            # on this same current stream, and PyTorch's caching allocator
            # reuses a freed block only in that stream's order, that is after
            # the job (the stream waits for the job's done word before any
            # later work). The caller's own tensors follow torch's rule for
            # any kernel: one allocated on another stream needs record_stream.
            if type(eps) is not float:
                eps = 0.0 if eps is None else float(eps)
            job = norm_job(op, rows, cols, eps, dtype, int(weight_dtype or 0),
                           MEMORY_EFFICIENT if memory_efficient else 0)
            try:
                # The library refuses a capturing stream itself (one query fewer here).
                client._enqueue_device(job, _pointers(*tensors), stream)
            except NormdError as e:
                raise _worded(e) from None
        else:
            if _capturing():
                raise NormdError(STATUS_CODES["UNSUPPORTED"], _CAPTURE_MESSAGE)
            client.run(op, rows, cols, stream=stream, event=(mode == "event"),
                       **_job_args(eps, memory_efficient, weight_dtype, dtype),
                       **_by_role(tensors))
    else:
        _run_staged(client, op, rows, cols, _job_args(eps, memory_efficient, weight_dtype, dtype),
                    _by_role(tensors), _OUTPUTS[op])


def _worded(error):
    """The library's refusal of a capturing stream in PyTorch's words (others unchanged)."""
    if error.message.startswith("the stream is capturing"):
        return NormdError(error.code, _CAPTURE_MESSAGE)
    return error


def _pointers(x, y, mean, rstd, gamma, beta, dy, dx, dgamma, dbeta):
    """The device pointers of a job's tensors as nc_job_enqueue_device takes them (x is there)."""
    return pack_device_pointers(
        x.data_ptr(), 0 if y is None else y.data_ptr(), 0 if mean is None else mean.data_ptr(),
        0 if rstd is None else rstd.data_ptr(), 0 if gamma is None else gamma.data_ptr(),
        0 if beta is None else beta.data_ptr(), 0 if dy is None else dy.data_ptr(),
        0 if dx is None else dx.data_ptr(), 0 if dgamma is None else dgamma.data_ptr(),
        0 if dbeta is None else dbeta.data_ptr(), 0)


def _job_args(eps, memory_efficient, weight_dtype, dtype):
    return dict(eps=eps, memory_efficient=memory_efficient, weight_dtype=weight_dtype,
                dtype=dtype)


def _by_role(tensors):
    """The tensors of a job (in _ROLES order) by role name, the absent ones left out."""
    return {role: t for role, t in zip(_ROLES, tensors) if t is not None}


def _run_staged(client, op, rows, cols, args, tensors, outputs, ext=False):
    """CPU tensors through one shared-memory region: copy in, run, copy `outputs` out.

    ext: the job goes through the variants' *_ext calls. Roles naming the
    same tensor (the same address and size) share one place in the region,
    so the daemon sees an in-place form as it would on a GPU and checks it
    by the same rule.
    """
    places, offsets, total = {}, {}, 0
    for role, t in tensors.items():
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key not in places:
            total = -(-total // _STAGE_ALIGN) * _STAGE_ALIGN
            places[key] = total
            total += key[1]
        offsets[role] = places[key]
    region = client.host_region(total)
    try:
        staged = {}
        for role, t in tensors.items():
            raw = torch.frombuffer(region.buffer, dtype=torch.uint8,
                                   count=t.numel() * t.element_size(), offset=offsets[role])
            staged[role] = raw.view(t.dtype).view(t.shape)
            staged[role].copy_(t)
        staged_tensors = {role: (region, offsets[role]) for role in tensors}
        enqueue, run = (client.enqueue_ext, client.run_ext) if ext else (client.enqueue,
                                                                          client.run)
        if completion_mode() == "enqueue":
            # The enqueue mode on the CPU backend: the stream argument is a
            # key naming an order, and stream_wait() waits for its jobs (and
            # raises the daemon's later errors); the copies are read after.
            enqueue(op, rows, cols, stream=_STAGE_KEY, **args, **staged_tensors)
            client.stream_wait(_STAGE_KEY)
        else:  # "event" needs CUDA: the CPU backend runs it synchronously
            run(op, rows, cols, **args, **staged_tensors)
        for role in outputs:
            if role in tensors:
                tensors[role].copy_(staged[role])
    finally:
        region.free()


def _forward(client, rms, input, weight, bias, shape, eps, mixed):
    """Runs the forward job.

    Returns (output, mean, invvar, upcast, job weight_dtype, x, weight, bias):
    mean is None for RMSNorm; upcast and weight_dtype are _plan()'s; x, weight
    and bias are the contiguous tensors the job read (x converted to float32
    when upcast).
    """
    rows, cols = _rows_cols(input, shape)
    _check_param("weight", weight, input, shape)
    _check_param("bias", bias, input, shape)
    upcast, weight_dtype = _plan(input.dtype, weight, bias, mixed)
    x = input.contiguous()
    if upcast:
        x = x.float()
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mean = None if rms else torch.empty(rows, dtype=torch.float32, device=x.device)
    invvar = torch.empty(rows, dtype=torch.float32, device=x.device)
    _run(client, _RMS_FWD if rms else _LN_FWD, rows, cols, eps, False, weight_dtype,
         (x, y, mean, invvar, weight, bias, None, None, None, None))
    return y, mean, invvar, upcast, weight_dtype, x, weight, bias


def _backward(ctx, rms, grad_output, saved, weight, bias, mean, invvar):
    """Runs the backward job; returns (grad_input, grad_weight, grad_bias)."""
    rows, cols = _rows_cols(saved, ctx.normalized_shape)
    x = saved.float() if ctx.upcast else saved
    dy = grad_output.contiguous()
    if dy.dtype != x.dtype:
        dy = dy.to(x.dtype)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dgamma = torch.empty_like(weight) if weight is not None and ctx.needs_weight_grad else None
    dbeta = torch.empty_like(bias) if bias is not None and ctx.needs_bias_grad else None
    _run(ctx.client, _RMS_BWD if rms else _LN_BWD, rows, cols, ctx.eps, ctx.memory_efficient,
         ctx.weight_dtype, (x, None, mean, invvar, weight, bias, dy, dx, dgamma, dbeta))
    if dx.dtype != ctx.input_dtype:
        dx = dx.to(ctx.input_dtype)
    return dx, dgamma, dbeta


def _setup(ctx, client, shape, eps, memory_efficient, input, upcast, weight_dtype,
           needs_weight_grad, needs_bias_grad):
    ctx.client = client
    ctx.normalized_shape = shape
    ctx.eps = eps
    ctx.memory_efficient = memory_efficient
    ctx.upcast = upcast and not memory_efficient  # the saved output is float32 already
    ctx.weight_dtype = weight_dtype
    ctx.input_dtype = input.dtype
    ctx.needs_weight_grad = needs_weight_grad
    ctx.needs_bias_grad = needs_bias_grad


# ---- autograd Functions (apex's names and argument order, plus client) ------------


def _affine_forward(ctx, rms, mixed, input, weight, bias, normalized_shape, eps,
                    memory_efficient, client):
    """The forward of the affine Functions; saves what apex saves."""
    client = client or default_client()
    shape = _cached_normalized_shape(normalized_shape)
    y, mean, invvar, upcast, wdt, x, weight, bias = _forward(client, rms, input, weight, bias,
                                                             shape, eps, mixed)
    _setup(ctx, client, shape, eps, memory_efficient, input, upcast, wdt,
           ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
    # What the job read is input.contiguous(), unless it was converted to float32.
    saved = y if memory_efficient else (input.contiguous() if upcast else x)
    if rms:
        ctx.save_for_backward(saved, weight, invvar)
    else:
        ctx.save_for_backward(saved, weight, bias, None if memory_efficient else mean, invvar)
    return y


def _plain_forward(ctx, rms, input, normalized_shape, eps, memory_efficient, client):
    """The forward of the Functions without parameters; saves what apex saves."""
    client = client or default_client()
    shape = _cached_normalized_shape(normalized_shape)
    y, mean, invvar, upcast, wdt, x, _, _ = _forward(client, rms, input, None, None, shape, eps,
                                                     False)
    _setup(ctx, client, shape, eps, memory_efficient, input, upcast, wdt, False, False)
    # What the job read is input.contiguous(), unless it was converted to float32.
    saved = y if memory_efficient else (input.contiguous() if upcast else x)
    if rms:
        ctx.save_for_backward(saved, invvar)
    else:
        ctx.save_for_backward(saved, None if memory_efficient else mean, invvar)
    return y


class FusedLayerNormAffineFunction(torch.autograd.Function):
    """LayerNorm with weight and bias.

    apply(input, weight, bias, normalized_shape, eps, memory_efficient=False,
    client=None); saves (input or output, weight, bias, mean or None, invvar).
    """

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False,
                client=None):
        return _affine_forward(ctx, False, False, input, weight, bias, normalized_shape, eps,
                               memory_efficient, client)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        saved, weight, bias, mean, invvar = ctx.saved_tensors
        dx, dw, db = _backward(ctx, False, grad_output, saved, weight, bias, mean, invvar)
        return dx, dw, db, None, None, None, None


class FusedLayerNormAffineMixedDtypesFunction(FusedLayerNormAffineFunction):
    """FusedLayerNormAffineFunction whose output has the weight's dtype."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False,
                client=None):
        return _affine_forward(ctx, False, True, input, weight, bias, normalized_shape, eps,
                               memory_efficient, client)


class FusedLayerNormFunction(torch.autograd.Function):
    """LayerNorm without parameters.

    apply(input, normalized_shape, eps, memory_efficient=False, client=None);
    saves (input or output, mean or None, invvar).
    """

    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False, client=None):
        return _plain_forward(ctx, False, input, normalized_shape, eps, memory_efficient, client)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        saved, mean, invvar = ctx.saved_tensors
        dx, _, _ = _backward(ctx, False, grad_output, saved, None, None, mean, invvar)
        return dx, None, None, None, None


class FusedRMSNormAffineFunction(torch.autograd.Function):
    """RMSNorm with weight.

    apply(input, weight, normalized_shape, eps, memory_efficient=False,
    client=None); saves (input or output, weight, invvar).
    """

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False, client=None):
        return _affine_forward(ctx, True, False, input, weight, None, normalized_shape, eps,
                               memory_efficient, client)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        saved, weight, invvar = ctx.saved_tensors
        dx, dw, _ = _backward(ctx, True, grad_output, saved, weight, None, None, invvar)
        return dx, dw, None, None, None, None


class FusedRMSNormAffineMixedDtypesFunction(FusedRMSNormAffineFunction):
    """FusedRMSNormAffineFunction whose output has the weight's dtype."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False, client=None):
        return _affine_forward(ctx, True, True, input, weight, None, normalized_shape, eps,
                               memory_efficient, client)


class FusedRMSNormFunction(torch.autograd.Function):
    """RMSNorm without weight.

    apply(input, normalized_shape, eps, memory_efficient=False, client=None);
    saves (input or output, invvar).
    """

    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False, client=None):
        return _plain_forward(ctx, True, input, normalized_shape, eps, memory_efficient, client)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        saved, invvar = ctx.saved_tensors
        dx, _, _ = _backward(ctx, True, grad_output, saved, None, None, None, invvar)
        return dx, None, None, None, None


# ---- torch fallback ------------------------------------------------------------------


def _torch_norm(rms, input, shape, weight, bias, eps, mixed):
    """The same result computed by torch (autograd-capable); see the module doc."""
    _rows_cols(input, shape)
    _check_param("weight", weight, input, shape)
    _check_param("bias", bias, input, shape)
    if input.dtype in _DTYPES:
        _plan(input.dtype, weight, bias, mixed)  # the same dtype rules as the daemon path
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    out_dtype = weight.dtype if mixed and weight is not None else input.dtype
    x = input.to(compute)
    w = weight.to(compute) if weight is not None else None
    if rms:
        dims = tuple(range(-len(shape), 0))
        y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
        if w is not None:
            y = y * w
    else:
        y = F.layer_norm(x, shape, w, bias.to(compute) if bias is not None else None, eps)
    return y.to(out_dtype)


# ---- autocast, as apex's functions do -----------------------------------------------


def _autocast_enabled():
    try:
        return torch.is_autocast_enabled("cuda")
    except TypeError:  # torch before 2.4
        return torch.is_autocast_enabled()


# Whether any device's autocast is on: one cheap query before the CUDA one, for eager calls.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)


def _autocast_dtype():
    getter = getattr(torch, "get_autocast_dtype", None)
    return getter("cuda") if getter else torch.get_autocast_gpu_dtype()


def _autocast_cast(*tensors):
    """Casts CUDA floating-point tensors (not float64) to the autocast dtype when it is on."""
    if not _autocast_enabled():
        return tensors
    dtype = _autocast_dtype()
    return tuple(t.to(dtype) if t is not None and t.is_cuda and t.is_floating_point() and
                 t.dtype != torch.float64 else t for t in tensors)


def _norm(rms, mixed, input, weight, bias, normalized_shape, eps, memory_efficient, client):
    """Dispatches one call: the daemon through the right Function or op, or torch."""
    compiling = _is_compiling is not None and _is_compiling()
    # Under torch.compile the cache would be a guarded global changing between calls.
    shape = (_normalized_shape if compiling else _cached_normalized_shape)(normalized_shape)
    # Dynamo cannot trace torch._C._is_tracing; torch.jit.is_tracing it folds to False.
    tracing = torch.jit.is_tracing() if compiling else _is_tracing()
    if torch.jit.is_scripting() or tracing or not _daemon_input(input):
        return _torch_norm(rms, input, shape, weight, bias, eps, mixed)
    if compiling:
        if not _custom_ops.AVAILABLE:
            return _torch_norm(rms, input, shape, weight, bias, eps, mixed)
        run = _custom_ops.norm
    else:
        run = _apply
    if input.is_cuda and (compiling or (_any_autocast() and _autocast_enabled())):
        # With autocast off, the block below would change nothing: eager calls skip it.
        input, weight, bias = _autocast_cast(input, weight, bias)
        with torch.autocast("cuda", enabled=False):
            return run(rms, mixed, input, weight, bias, shape, eps, memory_efficient, client)
    return run(rms, mixed, input, weight, bias, shape, eps, memory_efficient, client)


# The compiled eager operator (normd.eager): None until the first eager call asks.
_eager_op = None


def _run_eager(rms, input, weight, bias, shape, eps, memory_efficient, client):
    """The call through the compiled operator, or None where the Python path takes it."""
    global _eager_op
    op = _eager_op
    if op is None:
        op = _eager_op = _eager.norm_op() or False
    if op is False or completion_mode() != "enqueue":
        return None
    if type(eps) is not float:
        eps = 0.0 if eps is None else float(eps)
    return _operator_call(op, client, input, weight, bias, shape, eps, rms, memory_efficient)


def _operator_call(op, client, *args):
    """op(*args, the client's handle): a compiled eager operator's outputs, or None where
    the Python path takes the call; the library's refusals raise NormdError."""
    # Held here for the call and by the autograd node for backward, as the
    # Python path's ctx.client is: a client garbage collected in between
    # would close its connection under the operator.
    client = client or default_client()
    conn = client._conn
    handle = conn.handle if conn.eager_bound else _eager.conn_key(conn)
    if handle is None:
        conn.checked_handle()  # raises: the client is closed
    try:
        out = op(*args, handle)
    except RuntimeError as e:
        what = _eager.error(e)
        if what is None:
            raise
        if what == "fallback":
            return None
        raise _worded(what) from None
    node = (out[0] if isinstance(out, tuple) else out).grad_fn
    if node is not None:
        node.metadata["normd_client"] = client
    return out


def _apply(rms, mixed, input, weight, bias, shape, eps, memory_efficient, client):
    """Runs the call: the compiled eager operator where it takes it, else the Function that fits."""
    # `_eager_op is not False`: with the operator off, no call more than before it existed.
    if _eager_op is not False and input.is_cuda and \
            (not mixed or weight is None or weight.dtype == input.dtype):
        y = _run_eager(rms, input, weight, bias, shape, eps, memory_efficient, client)
        if y is not None:
            return y
    if weight is None:
        fn = FusedRMSNormFunction if rms else FusedLayerNormFunction
        return fn.apply(input, shape, eps, memory_efficient, client)
    if rms:
        fn = FusedRMSNormAffineMixedDtypesFunction if mixed else FusedRMSNormAffineFunction
        return fn.apply(input, weight, shape, eps, memory_efficient, client)
    fn = FusedLayerNormAffineMixedDtypesFunction if mixed else FusedLayerNormAffineFunction
    return fn.apply(input, weight, bias, shape, eps, memory_efficient, client)


# ---- functional forms (apex's signatures) ---------------------------------------------


def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6,
                            memory_efficient=False):
    """LayerNorm over the trailing normalized_shape dims, scaled by weight, shifted by bias."""
    return _norm(False, False, input, weight, bias, normalized_shape, eps, memory_efficient,
                 None)


def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """LayerNorm over the trailing normalized_shape dims, without affine parameters."""
    return _norm(False, False, input, None, None, normalized_shape, eps, memory_efficient, None)


def mixed_dtype_fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6,
                                        memory_efficient=False):
    """fused_layer_norm_affine whose output has the weight's dtype (e.g. float32)."""
    return _norm(False, True, input, weight, bias, normalized_shape, eps, memory_efficient,
                 None)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMSNorm over the trailing normalized_shape dims, scaled by weight."""
    return _norm(True, False, input, weight, None, normalized_shape, eps, memory_efficient,
                 None)


def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMSNorm over the trailing normalized_shape dims, without weight."""
    return _norm(True, False, input, None, None, normalized_shape, eps, memory_efficient, None)


def mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6,
                                      memory_efficient=False):
    """fused_rms_norm_affine whose output has the weight's dtype (e.g. float32)."""
    return _norm(True, True, input, weight, None, normalized_shape, eps, memory_efficient, None)


# ---- modules ------------------------------------------------------------------------------


class FusedLayerNorm(nn.Module):
    """Layer normalization over the trailing `normalized_shape` dimensions.

    y = (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance;
    weight starts at ones and bias at zeros when `elementwise_affine`.
    `memory_efficient` keeps the output instead of the input for backward,
    which recomputes the normalized input from it. `client`: the normd.Client
    to use (default: normd.default_client()). CPU/float64 input is computed
    by torch (see the module doc).
    """

    _rms = False
    _mixed = False

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 memory_efficient=False, *, client=None):
        super().__init__()
        self.normalized_shape = torch.Size(_normalized_shape(normalized_shape))
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
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

    def reset_parameters(self):
        """weight = 1, bias = 0."""
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, input):
        # Registered parameters straight from _parameters: self.weight would go
        # through nn.Module.__getattr__; anything else named so (a
        # parametrization's property) is read as an attribute.
        params = self._parameters
        weight = params["weight"] if "weight" in params else self.weight
        bias = params["bias"] if "bias" in params else self.bias
        return _norm(self._rms, self._mixed, input, weight, bias, self.normalized_shape,
                     self.eps, self.memory_efficient, self.client)

    def extra_repr(self):
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}, " \
               "memory_efficient={memory_efficient}".format(**self.__dict__)


class FusedRMSNorm(FusedLayerNorm):
    """RMS normalization over the trailing `normalized_shape` dimensions.

    y = x / sqrt(mean(x^2) + eps) * weight; weight starts at ones when
    `elementwise_affine`. Arguments as FusedLayerNorm's.
    """

    _rms = True


def _mixed_init(cls, module, normalized_shape, eps, memory_efficient, kwargs):
    client = kwargs.pop("client", None)
    if "elementwise_affine" in kwargs:
        warnings.warn("%s does not take `elementwise_affine`" % cls.__name__)
        if not kwargs.pop("elementwise_affine"):
            raise RuntimeError("%s does not support elementwise_affine=False" % cls.__name__)
    if kwargs:
        raise TypeError("%s got unexpected arguments %s" % (cls.__name__, sorted(kwargs)))
    super(cls, module).__init__(normalized_shape, eps, True, memory_efficient, client=client)


class MixedFusedLayerNorm(FusedLayerNorm):
    """FusedLayerNorm whose output has the parameters' dtype.

    Made for float32 parameters with bfloat16/float16 input: the output (and
    the parameters' gradients) are float32, the input's gradient has the
    input's dtype. Always affine.
    """

    _mixed = True

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _mixed_init(MixedFusedLayerNorm, self, normalized_shape, eps, memory_efficient, kwargs)


class MixedFusedRMSNorm(FusedRMSNorm):
    """FusedRMSNorm whose output has the parameter's dtype (see MixedFusedLayerNorm)."""

    _mixed = True

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _mixed_init(MixedFusedRMSNorm, self, normalized_shape, eps, memory_efficient, kwargs)


# The ops use this module's helpers, so they are defined once it is complete.
from . import custom_ops as _custom_ops  # noqa: E402
