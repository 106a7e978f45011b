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
(or none), no input of the new job computed from what it replaces, and a
daemon that runs the residual variant. A case the pass cannot judge is left
as it is; it never fails a compile. Installed when a normd op is traced
(the fake implementation calls ``install()``, which puts the pass back if a
``config.patch``, ``torch.compile(options=...)`` or the user replaced it,
chained after the pass it finds there); ``NORMD_COMPILE_FUSION=0`` leaves
Inductor's configuration alone.
Inductor's caches key compiled graphs by this file's text, not by the
daemon: a graph cached against a daemon with the residual variant, loaded
where the daemon lacks it (one older than protocol 3), fails its job with
UNSUPPORTED. ``stats`` counts the rewrites of this process.
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

_pass_class = None


def enabled():
    return os.environ.get("NORMD_COMPILE_FUSION", "1") != "0"


def _make_pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class ResidualFusion(CustomGraphPass):
        """normd's pass, after the post-grad pass that was set before it (if any)."""

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
            return (get_hash_for_files((__file__,)), before, enabled())

    return ResidualFusion


def install():
    """Puts the pass into Inductor's post-grad passes, unless it is there; never raises."""
    global _pass_class
    if _pass_class is False or not enabled() or "torch._inductor.config" not in sys.modules:
        return
    try:
        from torch._inductor import config
        if _pass_class is None:
            _pass_class = _make_pass_class()
        current = config.post_grad_custom_post_pass
        if not isinstance(current, _pass_class):
            config.post_grad_custom_post_pass = _pass_class(current)
    except Exception:  # an Inductor without custom graph passes (PyTorch < 2.6): no fusion
        _pass_class = False


# ---- the rewrite -----------------------------------------------------------------------------


def _ops():
    ns = torch.ops.normd
    return (ns.layer_norm_fwd.default, ns.rms_norm_fwd.default, ns.layer_norm_bwd.default,
            ns.rms_norm_bwd.default, ns.norm_variant_fwd.default, ns.norm_variant_bwd.default)


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def _named_args(node):
    """The call's arguments by their schema names, or None if any is not positional."""
    names = [a.name for a in node.target._schema.arguments]
    if node.kwargs or len(node.args) != len(names):
        return None
    return dict(zip(names, node.args))


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
    return all(w is None or (isinstance(_val(w), torch.Tensor) and
                             _val(w).dtype == input_val.dtype) for w in weights)


def _daemon_runs_residual(key):
    try:
        return _variants.daemon_runs(client_by_key(key), _lib.FEATURE_RESIDUAL)
    except Exception:  # no daemon, or a fallback that asks for an error: leave the graph alone
        return False


def _outputs(node):
    """{index: getitem node} of a multi-output node; None if used other than by one getitem
    an output."""
    out = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or \
                user.args[1] in out:
            return None
        out[user.args[1]] = user
    return out


def _reaches(sources, targets):
    """Whether any of `targets` is among `sources` or what they are computed from."""
    seen, todo = set(), [n for n in sources if isinstance(n, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n in targets:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def _fake_call(op, args):
    """op on the arguments' fake values (what Inductor reads of the new nodes), or None."""
    vals = torch.fx.node.map_arg(args, _val)
    tensors = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    fake_mode = torch._guards.detect_fake_mode(tensors)
    if fake_mode is None:
        return None
    with fake_mode:
        return op(*vals)


def _emit(graph, before, op, args, result):
    """op(*args) and its getitems, before `before`, with their fake values."""
    with graph.inserting_before(before):
        call = graph.call_function(op, tuple(args))
        call.meta["val"] = result
        items = []
        for i, v in enumerate(result):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta["val"] = v
            items.append(item)
    return items


def _forward_plan(node, rms, ops):
    """The rewrite of add + plain forward (see _rewrite), or None."""
    a = _named_args(node)
    outputs = _outputs(node)
    if a is None or outputs is None:
        return None
    add = a["input"]
    operands = _plain_add(add)
    if operands is None:
        return None
    weight, bias = a["weight"], a.get("bias")
    s_val = _val(add)
    if not (_same_tensor_kind(_val(operands[0]), s_val) and
            _same_tensor_kind(_val(operands[1]), s_val) and _weights_fit(s_val, weight, bias)
            and not _reaches((weight, bias), {add, node}) and
            _daemon_runs_residual(a["client"])):
        return None
    args = (operands[0], operands[1], weight, bias, a["normalized_shape"], a["eps"], rms, 0.0,
            a["memory_efficient"], a["client"])

    def swap(new):
        y, s, mean, invvar = new
        stats_of = {0: y, 1: invvar} if rms else {0: y, 1: mean, 2: invvar}
        return [(item, stats_of[i]) for i, item in outputs.items()] + [(node, None), (add, s)]

    return ops[4], args, node, swap


def _backward_plan(node, rms, ops):
    """The rewrite of a plain backward + the add of its dx (see _rewrite), or None."""
    a = _named_args(node)
    outputs = _outputs(node)
    if a is None or outputs is None or 0 not in outputs or len(outputs[0].users) != 1:
        return None
    dx = outputs[0]
    add = next(iter(dx.users))
    operands = _plain_add(add)
    if operands is None or dx not in operands or operands[0] is operands[1]:
        return None
    grad_s = operands[1] if operands[0] is dx else operands[0]
    saved, weight, bias = a["saved"], a["weight"], a.get("bias")
    saved_val, dx_val = _val(saved), _val(dx)
    if not (_same_tensor_kind(_val(grad_s), dx_val) and isinstance(saved_val, torch.Tensor) and
            saved_val.dtype == a["input_dtype"] == dx_val.dtype and
            _weights_fit(saved_val, weight, bias) and not _reaches((grad_s,), {node}) and
            _daemon_runs_residual(a["client"])):
        return None
    args = (a["grad_output"], grad_s, saved, weight, bias, a.get("mean"), a["invvar"],
            a["normalized_shape"], a["eps"], rms, 0.0, a["memory_efficient"], a["weight_grad"],
            a.get("bias_grad", False), a["client"])

    def swap(new):
        return [(add, new[0])] + [(item, new[i] if i else None) for i, item in outputs.items()] \
            + [(node, None)]

    return ops[5], args, add, swap


def _rewrite(graph, planner, node, rms, ops):
    """Rewrites one case; False where the planner declines or raises (the graph unchanged).

    A plan is (variant op, its arguments, the node to insert before, swap):
    swap(new getitems) lists (old node, its replacement or None), erased in order.
    """
    try:
        plan = planner(node, rms, ops)
        if plan is None:
            return False
        op, args, where, swap = plan
        result = _fake_call(op, args)
    except Exception:  # a shape the checks cannot decide (unbacked sizes, say): left as it is
        return False
    if result is None:
        return False
    for old, new in swap(_emit(graph, where, op, args, result)):
        if new is not None:
            old.replace_all_uses_with(new)
        graph.erase_node(old)
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
        if node.target in (ops[0], ops[1]) and _rewrite(graph, _forward_plan, node,
                                                        node.target is ops[1], ops):
            stats["forward"] += 1
            done += 1
        elif node.target in (ops[2], ops[3]) and _rewrite(graph, _backward_plan, node,
                                                          node.target is ops[3], ops):
            stats["backward"] += 1
            done += 1
    if done:
        # New nodes sit where the norm was; users of the add's result may come before it.
        from torch._inductor.pattern_matcher import stable_topological_sort
        stable_topological_sort(graph)
        graph.lint()
    return done
