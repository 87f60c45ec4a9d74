"""Simplification passes that make generated graphs read like hand-written code.

They work on the ATen graph, where every node carries its FakeTensor value
(``node.meta['val']``), and run to a fixed point:

- algebraic identities: ``x * 1``, ``x + 0``, ``x - 0``, ``x / 1``, ``-(-x)``, ``x * -1 -> -x``,
  where "1" is anything known to be a tensor full of ones (``ones_like``, an expanded one, ...);
- no-op shape ops: view/reshape/expand/squeeze/conversion to the same shape and dtype,
  a view of a view, a transpose of a transpose, a permute of a permute;
- common subexpressions (never of random or mutating ops);
- dead code (keeping ops that mutate buffers, such as BatchNorm's running statistics).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default,
          aten.alias.default, aten.flatten.using_ints, aten.detach.default}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CONVERSIONS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default}
_CONSTANT_FILLS = {aten.ones_like.default: 1, aten.zeros_like.default: 0, aten.ones.default: 1,
                   aten.zeros.default: 0, aten.new_ones.default: 1, aten.new_zeros.default: 0}
_STATEFUL_NORMS = {aten.batch_norm.default, aten.instance_norm.default,
                   aten._native_batch_norm_legit.default, aten.native_batch_norm.default,
                   aten._native_batch_norm_legit_functional.default}


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def _same_type(a, b) -> bool:
    va, vb = _val(a), _val(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.shape == vb.shape and va.dtype == vb.dtype)


def constant_value(node):
    """The scalar a node is known to be filled with (e.g. 1 for ``ones_like(x).expand(...)``), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    t = node.target
    if t in _CONSTANT_FILLS:
        return _CONSTANT_FILLS[t]
    if t in (aten.full_like.default, aten.new_full.default):
        return node.args[1] if isinstance(node.args[1], (int, float)) else None
    if t is aten.full.default:
        return node.args[1] if isinstance(node.args[1], (int, float)) else None
    if t is aten.scalar_tensor.default:
        return node.args[0]
    if t in _VIEWS or t in _CONVERSIONS or t in (aten.clone.default, aten.contiguous.default):
        return constant_value(node.args[0])
    return None


def is_impure(node: fx.Node) -> bool:
    """Nodes dead-code elimination and CSE must keep: mutation, randomness, stateful norms."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op != "call_function":
        return False
    t = node.target
    if t in _STATEFUL_NORMS:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
        return bool(training)
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags
    return node.is_impure()


def fake_mode_of(graph):
    for n in graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch._subclasses.FakeTensor):
            return v.fake_mode
    return None


def _new(graph, before, target, args, fake_mode):
    with graph.inserting_before(before):
        node = graph.create_node("call_function", target, args, name=target.overloadpacket.__name__)
    vals = fx.node.map_arg(args, _val)
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*vals)
    return node


def _rewrite(node: fx.Node, fake_mode):
    """A node (existing or new) that computes the same as ``node`` more simply, or None."""
    t, args = node.target, node.args
    if node.op != "call_function" or not args:
        return None
    x = args[0]
    if t in (aten.mul.Tensor, aten.div.Tensor) and len(args) == 2:
        if constant_value(args[1]) == 1 or args[1] == 1:
            return x if _same_type(x, node) else None
        if t is aten.mul.Tensor and constant_value(x) == 1 and _same_type(args[1], node):
            return args[1]
        if t is aten.mul.Tensor and (args[1] == -1 or constant_value(args[1]) == -1) and _same_type(x, node):
            return _new(node.graph, node, aten.neg.default, (x,), fake_mode)
    if t in (aten.add.Tensor, aten.sub.Tensor) and len(args) == 2 and not node.kwargs:
        if args[1] == 0 or constant_value(args[1]) == 0:
            return x if _same_type(x, node) else None
        if t is aten.add.Tensor and constant_value(x) == 0 and _same_type(args[1], node):
            return args[1]
    if t is aten.neg.default and isinstance(x, fx.Node) and x.target is aten.neg.default:
        return x.args[0]
    if t is aten.detach.default:
        return x  # generated code runs without autograd: detach only blocks gradients, already handled
    if t in _VIEWS or t in _CONVERSIONS or t is aten.contiguous.default:
        if isinstance(x, fx.Node) and _same_type(x, node) and (t not in _CONVERSIONS or _same_device(x, node)) \
                and (t is not aten.contiguous.default or _val(x).is_contiguous()):
            return x  # contiguous() of a transposed tensor is not a no-op: a later .view needs it
    if t in _RESHAPES and isinstance(x, fx.Node) and x.target in _RESHAPES:
        return _new(node.graph, node, aten.reshape.default if aten.reshape.default in (t, x.target) else t,
                    (x.args[0], list(_val(node).shape)), fake_mode)
    if t is aten.transpose.int and isinstance(x, fx.Node) and x.target is aten.transpose.int:
        nd = _val(x).dim()
        if {a % nd for a in args[1:]} == {a % nd for a in x.args[1:]}:
            return x.args[0]
    if t is aten.sum.dim_IntList and len(args) == 2 and not node.kwargs and _val(node).dim() == 0:
        return _new(node.graph, node, aten.sum.default, (x,), fake_mode)
    if t in (aten.t.default, aten.mT.default, aten.transpose.int) and isinstance(x, fx.Node):
        nd = _val(x).dim()
        if nd < 2 and t is not aten.transpose.int:
            return x
        dims = sorted(d % nd for d in args[1:3]) if t is aten.transpose.int else [nd - 2, nd - 1]
        if dims[0] == dims[1]:
            return x
        if t is not aten.transpose.int or list(args[1:3]) != dims:
            return _new(node.graph, node, aten.transpose.int, (x, *dims), fake_mode)
    if t is aten.permute.default and isinstance(x, fx.Node) and x.target is aten.permute.default:
        inner, outer = list(x.args[1]), list(args[1])
        composed = [inner[o] for o in outer]
        if composed == sorted(composed):
            return x.args[0]
        return _new(node.graph, node, aten.permute.default, (x.args[0], composed), fake_mode)
    return None


def _same_device(a, b):
    return _val(a).device == _val(b).device


def identities(gm: fx.GraphModule) -> bool:
    changed = False
    fake_mode = fake_mode_of(gm.graph)
    for node in list(gm.graph.nodes):
        if not node.users and not is_impure(node):
            continue
        fresh = set(gm.graph.nodes)
        new = _rewrite(node, fake_mode)
        if new is not None and new is not node:
            node.replace_all_uses_with(new)
            if new not in fresh:
                name = node.name
                gm.graph.erase_node(node)
                if name.startswith("grad_"):
                    new._rename(name)
            changed = True
    return changed


def _hashable(x):
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_hashable(i) for i in x))
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    if isinstance(x, float) and x != x:
        return ("nan",)
    if isinstance(x, torch.Tensor):
        return ("tensor", id(x))
    return (type(x).__name__, x)


def cse(gm: fx.GraphModule) -> bool:
    seen, changed = {}, False
    written = {a for n in gm.graph.nodes if _mutates(n) for a in n.all_input_nodes}
    for node in list(gm.graph.nodes):
        if node in written:
            continue  # its value changes in place later: it is not interchangeable with a twin
        if _mutates(node):
            seen.clear()  # a read after a mutation is not the same value as the read before it
            continue
        if node.op not in ("call_function", "call_method", "get_attr") or is_impure(node):
            continue
        try:
            key = (node.op, node.target, _hashable(node.args), _hashable(node.kwargs))
            hash(key)
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            changed = True
        else:
            seen[key] = node
    return changed


def _mutates(node: fx.Node) -> bool:
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable or t in _STATEFUL_NORMS and is_impure(node)
    return node.op == "call_method" and isinstance(t, str) and t.endswith("_")


def dce(gm: fx.GraphModule) -> bool:
    changed = False
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and not is_impure(node):
            gm.graph.erase_node(node)
            changed = True
    return changed


def simplify(gm: fx.GraphModule) -> fx.GraphModule:
    """Run every pass to a fixed point; returns ``gm`` (changed in place)."""
    while True:
        changed = identities(gm)
        changed |= cse(gm)
        changed |= dce(gm)
        if not changed:
            break
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def count_compute_nodes(gm: fx.GraphModule) -> int:
    """Nodes doing work: calls other than getitem and attribute/placeholder plumbing."""
    return sum(1 for n in gm.graph.nodes
               if n.op in ("call_function", "call_method", "call_module") and n.target is not operator.getitem)
