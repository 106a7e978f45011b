"""Under torch.compile with Inductor: the residual adds around normd's norms, fused into them.

Inductor fuses PyTorch's own norm with the add before it (a pre-norm
block's ``h = x + f(...)`` then ``norm(h)``) and the norm's backward with
the add of the gradient arriving at its input; an opaque op keeps both adds
as kernels of their own (BENCHMARKS.md, "Which fusions the opaque op
costs"). This post-grad pass gives them back to the daemon, whose variant
jobs do the same arithmetic in the norm's pass over memory (docs/VARIANTS.md):

- forward: ``s = add(a, b); norm_fwd(s, ...)`` becomes
  ``norm_variant_fwd(a, b, ...)``, whose ``s`` (rounded to the input dtype
  once, as the add rounds it) replaces the add's output everywhere;
- backward: ``dx = norm_bwd(...)[0]; add(dx, g)``, dx used by that add
  alone, becomes ``norm_variant_bwd(..., grad_s=g, ...)``, whose dx is the
  sum rounded once (the add rounded dx first: the fused sum differs from it
  by at most that rounding).

Only where nothing else changes: both operands of the add of the same shape,
dtype and device as the norm's input, no alpha, weights of the input's dtype
(or none), and a daemon that runs the residual variant. Installed when the
first normd op is traced for Inductor (the fake implementation calls
``install()``; torch._inductor is not imported for it), chained after a
post-grad pass the user set; ``NORMD_COMPILE_FUSION=0`` leaves Inductor's
configuration alone. ``stats`` counts the rewrites of this process.
"""

import operator
import os
import sys

import torch

from .. import _lib
from ..client import client_by_key
from . import variants as _variants

#: Rewrites made in this process: {"forward": n, "backward": n}.
stats = {"forward": 0, "backward": 0}

_VERSION = "normd-residual-fusion-1"
_installed = False


def enabled():
    return os.environ.get("NORMD_COMPILE_FUSION", "1") != "0"


def install():
    """Puts the pass into Inductor's post-grad passes once, if Inductor is in use."""
    global _installed
    if _installed or not enabled() or "torch._inductor.config" not in sys.modules:
        return
    _installed = True
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ResidualFusion(CustomGraphPass):
        def __init__(self, before):
            self.before = before

        def __call__(self, graph):
            if self.before is not None:
                self.before(graph)
            if enabled():
                fuse(graph)

        def uuid(self):
            before = None
            if self.before is not None:
                before = self.before.uuid() if hasattr(self.before, "uuid") else None
                if before is None:
                    return None  # a pass without an identity: no caching, as Inductor does
            return (_VERSION, before, enabled())

    config.post_grad_custom_post_pass = ResidualFusion(config.post_grad_custom_post_pass)


# ---- the rewrite -----------------------------------------------------------------------------


def _ops():
    ns = torch.ops.normd
    return (ns.layer_norm_fwd.default, ns.rms_norm_fwd.default, ns.layer_norm_bwd.default,
            ns.rms_norm_bwd.default, ns.norm_variant_fwd.default, ns.norm_variant_bwd.default)


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _same_tensor_kind(a, b):
    """Both tensors of one shape, dtype and device, and `a` contiguous (as the jobs take it)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device and a.is_contiguous())


def _plain_add(node):
    """The two operands of an add without alpha, or None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and
            node.target is torch.ops.aten.add.Tensor and len(node.args) == 2 and
            node.kwargs.get("alpha", 1) == 1):
        return None
    a, b = node.args
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return None
    return a, b


def _weights_fit(input_val, *weights):
    """Weights absent or of the input's dtype: the plain and variant ops then agree on dtypes."""
    return all(w is None or (_val(w) is not None and _val(w).dtype == input_val.dtype)
               for w in weights)


def _daemon_runs_residual(key):
    try:
        return _variants.daemon_runs(client_by_key(key), _lib.FEATURE_RESIDUAL)
    except Exception:  # no daemon, or a fallback that asks for an error: leave the graph alone
        return False


def _outputs(node):
    """{index: getitem node} of a multi-output node; None if used other than by getitem."""
    out = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return None
        out[user.args[1]] = user
    return out


def _emit(graph, before, op, args):
    """op(*args) and its getitems, before `before`, with the fake values Inductor reads."""
    vals = [_val(a) if isinstance(a, torch.fx.Node) else a for a in args]
    fake_mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with fake_mode:
        result = op(*vals)
    with graph.inserting_before(before):
        call = graph.call_function(op, tuple(args))
        call.meta["val"] = result
        items = []
        for i, v in enumerate(result):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta["val"] = v
            items.append(item)
    return items


def _fuse_forward(graph, node, rms, ops):
    """add + plain forward -> variant forward with a residual; True if rewritten."""
    if node.kwargs or len(node.args) != (7 if rms else 8):
        return False
    if rms:
        input, weight, shape, eps, mixed, memory_efficient, key = node.args
        bias = None
    else:
        input, weight, bias, shape, eps, mixed, memory_efficient, key = node.args
    operands = _plain_add(input)
    outputs = _outputs(node)
    if operands is None or outputs is None:
        return False
    a, b = operands
    s_val = _val(input)
    if not (_same_tensor_kind(_val(a), s_val) and _same_tensor_kind(_val(b), s_val) and
            _weights_fit(s_val, weight, bias) and _daemon_runs_residual(key)):
        return False
    y, s, mean, invvar = _emit(graph, node, ops[4], (a, b, weight, bias, shape, eps, rms, 0.0,
                                                    memory_efficient, key))
    stats_of = {0: y, 1: invvar} if rms else {0: y, 1: mean, 2: invvar}
    for index, item in outputs.items():
        item.replace_all_uses_with(stats_of[index])
        graph.erase_node(item)
    graph.erase_node(node)
    input.replace_all_uses_with(s)
    graph.erase_node(input)
    return True


def _fuse_backward(graph, node, rms, ops):
    """plain backward + add of its dx -> variant backward with grad_s; True if rewritten."""
    if node.kwargs or len(node.args) != (11 if rms else 14):
        return False
    if rms:
        (grad_y, saved, weight, invvar, shape, eps, mixed, memory_efficient, input_dtype,
         weight_grad, key) = node.args
        bias, mean, bias_grad = None, None, False
    else:
        (grad_y, saved, weight, bias, mean, invvar, shape, eps, mixed, memory_efficient,
         input_dtype, weight_grad, bias_grad, key) = node.args
    outputs = _outputs(node)
    if outputs is None or 0 not in outputs or len(outputs[0].users) != 1:
        return False
    dx = outputs[0]
    add = next(iter(dx.users))
    operands = _plain_add(add)
    if operands is None or dx not in operands or operands[0] is operands[1]:
        return False
    grad_s = operands[1] if operands[0] is dx else operands[0]
    saved_val = _val(saved)
    if not (_same_tensor_kind(_val(grad_s), _val(dx)) and saved_val is not None and
            saved_val.dtype == input_dtype == _val(dx).dtype and
            _weights_fit(saved_val, weight, bias) and _daemon_runs_residual(key)):
        return False
    new = _emit(graph, add, ops[5], (grad_y, grad_s, saved, weight, bias, mean, invvar, shape,
                                     eps, rms, 0.0, memory_efficient, weight_grad, bias_grad, key))
    add.replace_all_uses_with(new[0])
    graph.erase_node(add)
    for index, item in outputs.items():
        if index != 0:
            item.replace_all_uses_with(new[index])
        graph.erase_node(item)
    graph.erase_node(node)
    return True


def fuse(graph):
    """Rewrites every fusable pattern of `graph`; returns how many."""
    if not hasattr(torch.ops.normd, "norm_variant_fwd"):
        return 0
    ops = _ops()
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or getattr(node, "_erased", False):
            continue
        if node.target in (ops[0], ops[1]) and _fuse_forward(graph, node, node.target is ops[1],
                                                             ops):
            stats["forward"] += 1
            done += 1
        elif node.target in (ops[2], ops[3]) and _fuse_backward(graph, node,
                                                                node.target is ops[3], ops):
            stats["backward"] += 1
            done += 1
    if done:
        # New nodes sit where the norm was; users of the add's result may come before it.
        from torch._inductor.pattern_matcher import stable_topological_sort
        stable_topological_sort(graph)
        graph.lint()
    return done
