"""normd's norms as torch.library custom ops: what torch.compile sees.

Under torch.compile (and torch.export) normd.normalization's modules and
functions call these ops instead of its autograd Functions, so the daemon
keeps computing in compiled code (eager code keeps the Functions, whose host
cost is lower). The ops, in the namespace ``normd``:

- ``layer_norm_fwd(input, weight?, bias?, normalized_shape, eps, mixed,
  memory_efficient, client) -> (y, mean, invvar)``
- ``rms_norm_fwd(input, weight?, normalized_shape, eps, mixed,
  memory_efficient, client) -> (y, invvar)``
- ``layer_norm_bwd(grad_output, saved, weight?, bias?, mean?, invvar,
  normalized_shape, eps, mixed, memory_efficient, input_dtype, weight_grad,
  bias_grad, client) -> (dx, dgamma, dbeta)``
- ``rms_norm_bwd(grad_output, saved, weight?, invvar, normalized_shape, eps,
  mixed, memory_efficient, input_dtype, weight_grad, client) -> (dx, dgamma)``

The outputs are apex's: y of the input's shape (the weight's dtype for the
mixed forms, else the input's), mean and invvar float32 of one value per
row; dx in the input's dtype and shape, dgamma/dbeta of the weight's shape
and dtype. A gradient that was not asked for (weight_grad/bias_grad false,
or no weight) comes back as an empty float32 tensor, because an op's
outputs cannot be optional. ``saved`` is the forward's input, or its output
with ``memory_efficient`` (what apex saves). ``client`` names the
normd.Client by its key (0: the default client). Every output is freshly
allocated: no op mutates or aliases its arguments.

Each op has a fake implementation (shapes and dtypes only, symbolic sizes
allowed, so dynamic batch sizes compile once) and the forward ops have
autograd registered, whose backward calls the backward op.

Unless ``NORMD_EAGER=0``, the ops' CUDA kernels are C++ (normd/csrc/eager_norm.cpp,
loaded by normd.eager): they run the enqueue mode's common case without the
Python below, and hand every other call to it (another completion mode, the
mixed forms' float32 copies, arguments it would refuse, a client key they
have not been told); the schemas, fake implementations and autograd stay
these. A job the library refuses there raises a RuntimeError whose message
starts ``normd error CODE (STATUS):`` rather than a NormdError.

CUDA graphs: a graph replays kernels, not the Python that sends a job to the
daemon, so a captured job would never run again. The ops carry PyTorch's
``cudagraph_unsafe`` tag (PyTorch >= 2.9), which makes
``torch.compile(mode="reduce-overhead")`` run them eagerly between the CUDA
graphs of the rest of the model (or, without graph partitioning, skip CUDA
graphs for that graph); and any normd job asked for while the current
stream is capturing raises NormdError UNSUPPORTED instead of being
captured.
"""

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import eager as _eager
from ..client import client_by_key
from .fused_layer_norm import (_backward, _check_backward_inputs, _check_param, _forward,
                               _normalized_shape, _plan, _rows_cols)

#: torch.library.custom_op with register_autograd: PyTorch 2.4 and later.
AVAILABLE = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_autograd")

_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)

#: Whether reduce-overhead keeps the ops out of its CUDA graphs (else capture raises).
CUDAGRAPH_UNSAFE_TAGGED = AVAILABLE and _CUDAGRAPH_UNSAFE is not None


def norm(rms, mixed, input, weight, bias, shape, eps, memory_efficient, client):
    """One call of normalization's modules or functions, through the ops (returns y)."""
    # The eager path's argument errors, raised while tracing rather than from the op.
    _rows_cols(input, shape)
    _check_param("weight", weight, input, shape)
    _check_param("bias", bias, input, shape)
    _plan(input.dtype, weight, bias, mixed)
    key = 0 if client is None else client._key
    if rms:
        return torch.ops.normd.rms_norm_fwd(input, weight, shape, eps, mixed, memory_efficient,
                                            key)[0]
    return torch.ops.normd.layer_norm_fwd(input, weight, bias, shape, eps, mixed,
                                          memory_efficient, key)[0]


# ---- what the ops run -----------------------------------------------------------------


def _client(key):
    """The Client a key names.

    Unless NORMD_EAGER=0, the compiled operator is loaded here (at run time:
    never while Dynamo traces) and its kernels learn the key, so that they
    take the op's next calls (normd.eager).
    """
    client = client_by_key(key)
    if _eager.norm_op() is not None:
        _eager.bind_key(key, client)
    return client


class _BackwardArgs:
    """The attributes fused_layer_norm._backward reads from an autograd ctx."""

    def __init__(self, client, shape, eps, mixed, memory_efficient, input_dtype, weight,
                 bias, weight_grad, bias_grad):
        upcast, weight_dtype = _plan(input_dtype, weight, bias, mixed)
        self.client = _client(client)
        self.normalized_shape = _normalized_shape(shape)
        self.eps = eps
        self.memory_efficient = memory_efficient
        self.upcast = upcast and not memory_efficient  # the saved output is float32 already
        self.weight_dtype = weight_dtype
        self.input_dtype = input_dtype
        self.needs_weight_grad = weight_grad and weight is not None
        self.needs_bias_grad = bias_grad and bias is not None


def _contiguous(t):
    return t.contiguous() if t is not None else None


def _no_grad_placeholder(invvar):
    return invvar.new_empty(0)


def _layer_norm_fwd(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                    normalized_shape: Sequence[int], eps: float, mixed: bool,
                    memory_efficient: bool, client: int) -> Tuple[Tensor, Tensor, Tensor]:
    y, mean, invvar = _forward(_client(client), False, input, weight, bias,
                               _normalized_shape(normalized_shape), eps, mixed)[:3]
    return y, mean, invvar


def _rms_norm_fwd(input: Tensor, weight: Optional[Tensor], normalized_shape: Sequence[int],
                  eps: float, mixed: bool, memory_efficient: bool,
                  client: int) -> Tuple[Tensor, Tensor]:
    y, _, invvar = _forward(_client(client), True, input, weight, None,
                            _normalized_shape(normalized_shape), eps, mixed)[:3]
    return y, invvar


def _layer_norm_bwd(grad_output: Tensor, saved: Tensor, weight: Optional[Tensor],
                    bias: Optional[Tensor], mean: Optional[Tensor], invvar: Tensor,
                    normalized_shape: Sequence[int], eps: float, mixed: bool,
                    memory_efficient: bool, input_dtype: torch.dtype, weight_grad: bool,
                    bias_grad: bool, client: int) -> Tuple[Tensor, Tensor, Tensor]:
    args = _BackwardArgs(client, normalized_shape, eps, mixed, memory_efficient, input_dtype,
                         weight, bias, weight_grad, bias_grad)
    _check_backward_inputs(saved, grad_output, mean, invvar, weight, bias, args.normalized_shape)
    dx, dgamma, dbeta = _backward(args, False, grad_output, saved.contiguous(),
                                  _contiguous(weight), _contiguous(bias), mean, invvar)
    return (dx, _no_grad_placeholder(invvar) if dgamma is None else dgamma,
            _no_grad_placeholder(invvar) if dbeta is None else dbeta)


def _rms_norm_bwd(grad_output: Tensor, saved: Tensor, weight: Optional[Tensor], invvar: Tensor,
                  normalized_shape: Sequence[int], eps: float, mixed: bool,
                  memory_efficient: bool, input_dtype: torch.dtype, weight_grad: bool,
                  client: int) -> Tuple[Tensor, Tensor]:
    args = _BackwardArgs(client, normalized_shape, eps, mixed, memory_efficient, input_dtype,
                         weight, None, weight_grad, False)
    _check_backward_inputs(saved, grad_output, None, invvar, weight, None, args.normalized_shape)
    dx, dgamma, _ = _backward(args, True, grad_output, saved.contiguous(), _contiguous(weight),
                              None, None, invvar)
    return dx, _no_grad_placeholder(invvar) if dgamma is None else dgamma


# ---- fake implementations: shapes and dtypes ------------------------------------------


def _forward_fake(input, weight, normalized_shape, mixed, stats):
    """y and `stats` float32 tensors of one value per row."""
    rows = input.numel() // math.prod(normalized_shape)
    out_dtype = weight.dtype if mixed and weight is not None else input.dtype
    y = input.new_empty(input.shape, dtype=out_dtype)
    return (y,) + tuple(input.new_empty((rows,), dtype=torch.float32) for _ in range(stats))


def _install_fusion():
    """Tracing for a compiler: the residual adds' pass joins Inductor's (compile_fusion)."""
    from . import compile_fusion
    compile_fusion.install()


def _layer_norm_fwd_fake(input, weight, bias, normalized_shape, eps, mixed, memory_efficient,
                         client):
    _install_fusion()
    return _forward_fake(input, weight, normalized_shape, mixed, 2)


def _rms_norm_fwd_fake(input, weight, normalized_shape, eps, mixed, memory_efficient, client):
    _install_fusion()
    return _forward_fake(input, weight, normalized_shape, mixed, 1)


def _grad_fake(param, wanted, invvar):
    if wanted and param is not None:
        return param.new_empty(param.shape)
    return _no_grad_placeholder(invvar)


def _layer_norm_bwd_fake(grad_output, saved, weight, bias, mean, invvar, normalized_shape, eps,
                         mixed, memory_efficient, input_dtype, weight_grad, bias_grad, client):
    return (saved.new_empty(saved.shape, dtype=input_dtype),
            _grad_fake(weight, weight_grad, invvar), _grad_fake(bias, bias_grad, invvar))


def _rms_norm_bwd_fake(grad_output, saved, weight, invvar, normalized_shape, eps, mixed,
                       memory_efficient, input_dtype, weight_grad, client):
    return (saved.new_empty(saved.shape, dtype=input_dtype),
            _grad_fake(weight, weight_grad, invvar))


# ---- autograd ------------------------------------------------------------------------------


def _layer_norm_setup(ctx, inputs, output):
    input, weight, bias, shape, eps, mixed, memory_efficient, client = inputs
    y, mean, invvar = output
    # What apex saves: the output instead of the input (and no mean) when memory_efficient.
    ctx.save_for_backward(y if memory_efficient else input, weight, bias,
                          None if memory_efficient else mean, invvar)
    ctx.args = (shape, eps, mixed, memory_efficient, input.dtype)
    ctx.client = client


def _layer_norm_backward(ctx, grad_y, grad_mean, grad_invvar):
    saved, weight, bias, mean, invvar = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[1]
    bias_grad = bias is not None and ctx.needs_input_grad[2]
    dx, dgamma, dbeta = torch.ops.normd.layer_norm_bwd(grad_y, saved, weight, bias, mean,
                                                       invvar, *ctx.args, weight_grad,
                                                       bias_grad, ctx.client)
    return (dx, dgamma if weight_grad else None, dbeta if bias_grad else None,
            None, None, None, None, None)


def _rms_norm_setup(ctx, inputs, output):
    input, weight, shape, eps, mixed, memory_efficient, client = inputs
    y, invvar = output
    ctx.save_for_backward(y if memory_efficient else input, weight, invvar)
    ctx.args = (shape, eps, mixed, memory_efficient, input.dtype)
    ctx.client = client


def _rms_norm_backward(ctx, grad_y, grad_invvar):
    saved, weight, invvar = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[1]
    dx, dgamma = torch.ops.normd.rms_norm_bwd(grad_y, saved, weight, invvar, *ctx.args,
                                              weight_grad, ctx.client)
    return dx, dgamma if weight_grad else None, None, None, None, None, None


# ---- registration -------------------------------------------------------------------------


def _define(name, impl, fake):
    tags = {"tags": (_CUDAGRAPH_UNSAFE,)} if _CUDAGRAPH_UNSAFE is not None else {}
    op = torch.library.custom_op("normd::" + name, impl, mutates_args=(), **tags)
    op.register_fake(fake)
    return op


def _register():
    ops = {
        "layer_norm_fwd": _define("layer_norm_fwd", _layer_norm_fwd, _layer_norm_fwd_fake),
        "rms_norm_fwd": _define("rms_norm_fwd", _rms_norm_fwd, _rms_norm_fwd_fake),
        "layer_norm_bwd": _define("layer_norm_bwd", _layer_norm_bwd, _layer_norm_bwd_fake),
        "rms_norm_bwd": _define("rms_norm_bwd", _rms_norm_bwd, _rms_norm_bwd_fake),
    }
    ops["layer_norm_fwd"].register_autograd(_layer_norm_backward,
                                            setup_context=_layer_norm_setup)
    ops["rms_norm_fwd"].register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)
    return ops


#: The CustomOpDef objects by name (empty where PyTorch has no custom_op).
OPS = _register() if AVAILABLE else {}
