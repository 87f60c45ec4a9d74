"""Expand ops that have no VJP rule into ops that do, using PyTorch's own decompositions.

Runs on the captured graph before differentiation. A node whose op has no rule is replaced by
the trace of its decomposition (the op's CompositeImplicitAutograd definition, or an entry of
``torch._decomp``'s table), repeatedly, until every node has a rule. An op with neither gets a
rule derived from PyTorch's own derivative formula (``capture/derived.py``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._decomp import decomposition_table
from torch.fx.experimental.proxy_tensor import make_fx

from .. import registry
from ..errors import FxtoolsError
from ..graph import meta
from ..graph.data_dependent import known_true
from ..graph.nodes import is_float
from ..signature.naming import short_op
from .derived import derived_rule
from .functionalize import functionalize
from .trace import realize_constants

_MAX_ROUNDS = 20


def decompositions(op):
    """Candidate decompositions of ``op``, best first: ``torch._decomp``'s entry, then the op's
    CompositeImplicitAutograd definition (used when the table's entry is rejected, e.g. because
    it is written in prims, as ``alpha_dropout``'s is)."""
    if not isinstance(op, torch._ops.OpOverload):
        return []
    found = []
    if op in decomposition_table:
        found.append(decomposition_table[op])
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        found.append(op.decompose)
    return found


def _needs_work(node) -> bool:
    """An op with no rule for this call: none at all, or one written for real tensors only called
    with complex ones (PyTorch's decomposition or formula then gives autograd's convention)."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and registry.lookup_node(node) is None
        and not registry.is_nondifferentiable(node.target)
        and not meta.RULE.on(node)
        and not _is_size(node.meta.get("val"))
    )


def _is_size(val) -> bool:
    """A size (``aten.size``, ``sym_size`` under symbolic sizes): nothing to differentiate."""
    return isinstance(val, (int, torch.SymInt)) or (
        isinstance(val, (list, tuple)) and bool(val) and all(isinstance(v, (int, torch.SymInt)) for v in val)
    )


def _nondifferentiable_outputs(op, args, kwargs) -> list[int]:
    """Float outputs that PyTorch's autograd formula for ``op`` declares non-differentiable
    (``_batch_norm_with_update``'s saved mean and inverse std): a decomposition must not let
    gradients flow through them, or fxtools would differentiate a different function than autograd."""
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    if not any(is_float(a) for a in flat):
        return []
    written = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    bound = dict(zip([a.name for a in op._schema.arguments], args)) | dict(kwargs)
    written_ids = {id(bound[n]) for n in written if n in bound}  # updated in place: cannot require grad
    fake_mode = torch._guards.detect_fake_mode(flat)
    try:
        with fake_mode, torch.enable_grad():
            flat = [a.detach().requires_grad_() if is_float(a) and id(a) not in written_ids else a for a in flat]
            a, k = torch.utils._pytree.tree_unflatten(flat, spec)
            outs = torch.utils._pytree.tree_leaves(op(*a, **k))
    except Exception:  # noqa: BLE001 - cannot tell: keep every output differentiable
        return []
    return [i for i, o in enumerate(outs) if is_float(o) and not o.requires_grad]


def inline_decomposition(gm: fx.GraphModule, node: fx.Node, decomp) -> bool:
    """Replace ``node`` in place by the ATen ops of ``decomp`` traced at its fake values; False
    (``gm`` untouched) where the decomposition does not apply or reads less well than the op."""
    traced = _trace_decomposition(node, decomp)
    if traced is None:
        return False
    sub, tensor_pos = traced
    result, made = _copy_into(gm, node, sub, tensor_pos)
    result = _detach_nondifferentiable(gm, node, result)
    _replace(gm, node, result, made)
    return True


def _values(node: fx.Node):
    """``node``'s arguments and keyword arguments, with its input nodes' (fake) values."""
    return fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])


def _trace_decomposition(node: fx.Node, decomp):
    """``(graph, tensor positions)``: ``decomp`` traced by ``make_fx`` with the tensors among
    ``node``'s flattened arguments as its inputs, functional and free of prims; None if it fails."""
    args, kwargs = _values(node)
    fake_mode = torch._guards.detect_fake_mode([node.meta.get("val")])
    flat_args, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    tensor_pos = [i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor)]
    wanted = torch.utils._pytree.tree_leaves(node.meta.get("val"))

    def fn(*tensors):
        full = list(flat_args)
        for i, t in zip(tensor_pos, tensors):
            full[i] = t
        a, k = torch.utils._pytree.tree_unflatten(full, spec)
        out = decomp(*a, **k)
        if out is NotImplemented:
            raise NotImplementedError(f"no decomposition of {node.target} for these arguments")
        outs = list(torch.utils._pytree.tree_leaves(out))
        if len(outs) == len(wanted):
            outs = [_in_layout_of(o, w) for o, w in zip(outs, wanted)]
        return outs

    try:
        with fake_mode:
            sub = make_fx(fn)(*[flat_args[i] for i in tensor_pos])
    except Exception:  # noqa: BLE001 - a decomposition that does not apply: try the next tool
        return None
    try:
        realize_constants(sub)
    except FxtoolsError:
        return None
    if any(isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "prims" for n in sub.graph.nodes):
        return None  # a reference implementation in prims: less readable than PyTorch's formula
    try:
        functionalize(sub)  # decompositions may use in-place ops internally
    except FxtoolsError:
        return None
    return sub, tensor_pos


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether ``a`` and ``b`` (of one shape) have the same strides (those of size-1 dimensions
    aside); None where symbolic strides leave it unknown."""
    same = True
    for size, x, y in zip(a.shape, a.stride(), b.stride()):
        if known_true(size <= 1) or known_true(x == y):
            continue
        if known_true(x != y):
            same = False
        else:
            return None
    return same


def _in_layout_of(out, want):
    """``out`` (a decomposition's result) in the memory layout of ``want`` (the op's own result,
    the FakeTensor the trace recorded): the graph after the op was traced at the op's strides (a
    ``view`` valid only at those, ``_scaled_dot_product_flash_attention_for_cpu``'s output, whose
    decomposition lays it out otherwise), so the decomposition must give them too. A dense layout
    is made by a copy in its order of dimensions; another one refuses the decomposition (the op
    is then differentiated through PyTorch's formula)."""
    if not isinstance(out, torch.Tensor) or not isinstance(want, torch.Tensor) or out.dim() != want.dim():
        return out
    if _same_layout(out, want) is not False:
        return out  # the same strides, or not known to differ (symbolic): as traced
    strides = list(want.stride())
    if not all(type(v) is int for v in [*strides, *want.shape]):
        raise NotImplementedError("a decomposition whose symbolic strides differ from the op's")
    order = sorted(range(want.dim()), key=lambda d: -strides[d])  # outermost dimension first (stable)
    inverse = sorted(range(want.dim()), key=order.__getitem__)
    laid = out.permute(order).contiguous().permute(inverse)
    if _same_layout(laid, want) is not True:
        raise NotImplementedError("a decomposition whose result is not laid out as the op's")
    return laid


def _copy_into(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule, tensor_pos: list):
    """``sub``'s nodes copied before ``node``, reading ``node``'s tensor arguments; returns the
    copied outputs and the nodes made. The copies are steps of the user's value: named after
    ``node``, marked intermediate, with its source line and markers."""
    flat_nodes, _ = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    env = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], [flat_nodes[i] for i in tensor_pos]))
    trace = node.meta.get("stack_trace")
    made: list[fx.Node] = []
    result = None
    with gm.graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "get_attr":
                name = f"_decomp_const_{len(list(gm.graph.nodes))}"
                setattr(gm, name, getattr(sub, sn.target))
                env[sn] = gm.graph.get_attr(name)
                env[sn].meta = dict(sn.meta)
                continue
            if sn.op == "output":
                result = fx.node.map_arg(sn.args[0], env.__getitem__)
                break
            new = gm.graph.node_copy(sn, env.__getitem__)
            new.meta = dict(sn.meta)
            new._rename(f"{node.name}_{short_op(new)}")  # the steps of the user's value (see capture/names.py)
            meta.INTERMEDIATE.set(new, True)
            meta.DECOMPOSED.set(new, True)
            made.append(new)
            if trace:
                new.meta["stack_trace"] = trace
            if "custom" in node.meta:  # markers such as fxtools.split's checkpoint regions
                new.meta["custom"] = node.meta["custom"]
            env[sn] = new
    return result, made


def _detach_nondifferentiable(gm: fx.GraphModule, node: fx.Node, result):
    """``result`` with the outputs PyTorch does not differentiate (``_nondifferentiable_outputs``) detached."""
    nondiff = _nondifferentiable_outputs(node.target, *_values(node))
    if not nondiff:
        return result
    result = list(result)
    with gm.graph.inserting_before(node):
        for i in nondiff:
            if i < len(result) and isinstance(result[i], fx.Node):
                detached = gm.graph.call_function(torch.ops.aten.detach.default, (result[i],))
                detached.meta = dict(result[i].meta)
                result[i] = detached
    return result


def _replace(gm: fx.GraphModule, node: fx.Node, result, made: list) -> None:
    """Uses of ``node`` (or of its items) now read ``result``; ``node`` is erased, and a copied
    output that is the user's value takes its name."""
    if isinstance(node.meta.get("val"), (tuple, list)):
        if len(result) != len(node.meta["val"]) or any(isinstance(v, (tuple, list)) for v in node.meta["val"]):
            raise NotImplementedError(f"cannot inline the decomposition of {node.target}")
        named = {}
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                named[result[user.args[1]]] = (user.name, meta.INTERMEDIATE.get(user))
                gm.graph.erase_node(user)
    else:
        node.replace_all_uses_with(result[0])
        named = {result[0]: (node.name, meta.INTERMEDIATE.get(node))}
    gm.graph.erase_node(node)
    for value, (name, weak) in named.items():  # the decomposition's result is the user's value
        if value in made:
            value.name = name  # the erased node's name: unique, and still reserved in the namespace
            if not weak:
                meta.INTERMEDIATE.pop(value)


def expand(gm: fx.GraphModule) -> fx.GraphModule:
    """Decompose rule-less ops in place; attach derived rules where no decomposition exists."""
    for _ in range(_MAX_ROUNDS):
        todo = [n for n in gm.graph.nodes if _needs_work(n)]
        if not todo:
            break
        progressed = False
        for node in todo:
            if any(inline_decomposition(gm, node, decomp) for decomp in decompositions(node.target)):
                progressed = True
                continue
            rule = derived_rule(node)
            if rule is not None:
                meta.RULE.set(node, rule)
                progressed = True
        if not progressed:
            break
    gm.recompile()
    return gm
