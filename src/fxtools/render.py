"""Render ATen graphs with PyTorch's public names, so ``gm.code`` reads like user code.

``torch.ops.aten.mul.Tensor(a, b)`` becomes ``a * b``, ``aten.sin.default(x)`` becomes
``torch.sin(x)``, ``aten.view.default(x, [2, 3])`` becomes ``x.view([2, 3])`` and
``aten.linear.default(x, w, b)`` becomes ``torch.nn.functional.linear(x, w, b)``. Arguments
equal to their schema default are dropped. An op is only renamed to a public function whose
behaviour on those arguments is the op itself; anything else keeps its ``torch.ops.aten`` name.
"""
from __future__ import annotations

import inspect
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

aten = torch.ops.aten

_OPERATORS = {
    aten.add.Tensor: operator.add, aten.sub.Tensor: operator.sub, aten.mul.Tensor: operator.mul,
    aten.div.Tensor: operator.truediv, aten.matmul.default: operator.matmul,
    aten.pow.Tensor_Scalar: operator.pow, aten.pow.Tensor_Tensor: operator.pow,
    aten.neg.default: operator.neg, aten.eq.Tensor: operator.eq, aten.eq.Scalar: operator.eq,
    aten.ne.Tensor: operator.ne, aten.ne.Scalar: operator.ne, aten.lt.Tensor: operator.lt,
    aten.lt.Scalar: operator.lt, aten.le.Tensor: operator.le, aten.le.Scalar: operator.le,
    aten.gt.Tensor: operator.gt, aten.gt.Scalar: operator.gt, aten.ge.Tensor: operator.ge,
    aten.ge.Scalar: operator.ge, aten.bitwise_not.default: operator.invert,
    aten.remainder.Tensor: operator.mod, aten.remainder.Scalar: operator.mod,
}
_METHODS = {
    aten.view.default: "view", aten.expand.default: "expand", aten.contiguous.default: "contiguous",
    aten._unsafe_view.default: "reshape", aten.to.dtype: "to", aten._to_copy.default: "to",
    aten.type_as.default: "type_as", aten.new_zeros.default: "new_zeros", aten.new_ones.default: "new_ones",
    aten.new_full.default: "new_full", aten.new_empty.default: "new_empty", aten.expand_as.default: "expand_as",
    aten.view_as.default: "view_as", aten.repeat.default: "repeat", aten.unflatten.int: "unflatten",
}
_REORDERED = {  # aten op -> (public function, positions of the aten arguments in the call)
    aten.embedding.default: (F.embedding, (1, 0)),
}
_NAMESPACES = (torch, F, torch.special, torch.linalg, torch.fft)


_NOISE = {"pin_memory": (False, None), "layout": (torch.strided, None)}


def _schema_args(op: torch._ops.OpOverload, args, kwargs):
    """Arguments as (name, value) pairs in schema order, dropping trailing ones equal to their default."""
    schema = op._schema.arguments
    pairs = [(a.name, v) for a, v in zip(schema, args)]
    pairs += [(a.name, kwargs[a.name]) for a in schema[len(args):] if a.name in kwargs]
    defaults = {a.name: a.default_value for a in schema if a.has_default_value()}
    return [(n, v) for n, v in pairs if not (n in defaults and _equal(v, defaults[n]))
            and not (n in _NOISE and any(v is x for x in _NOISE[n]))], schema


def _equal(v, d):
    if isinstance(v, fx.Node) or isinstance(d, fx.Node):
        return False
    try:
        return type(v) is type(d) and v == d or (v is None and d is None) or (
            isinstance(v, (int, float)) and isinstance(d, (int, float)) and not isinstance(v, bool) and v == d)
    except Exception:  # noqa: BLE001
        return False


def _public_function(op: torch._ops.OpOverload):
    name = op.overloadpacket.__name__
    for ns in _NAMESPACES:
        fn = getattr(ns, name, None)
        if fn is None or not callable(fn):
            continue
        if ns is torch and not inspect.isbuiltin(fn) and getattr(fn, "__module__", "").startswith("torch._refs"):
            continue
        return fn
    return None


def _python_params(fn):
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None  # a builtin bound to native_functions.yaml: it takes the schema's names


def _call(op, args, kwargs):
    """(kind, target, args, kwargs) for the public spelling of ``op(*args, **kwargs)``, or None."""
    if op in _OPERATORS and not kwargs and (op is not aten.div.Tensor or len(args) == 2):
        if op is aten.add.Tensor or op is aten.sub.Tensor:
            if len(args) > 2:
                return None
        return "call_function", _OPERATORS[op], args, {}
    pairs, schema = _schema_args(op, args, kwargs)
    names = [n for n, _ in pairs]
    positional = [a.name for a in schema if not a.kwarg_only]
    if op in _METHODS:
        return _split("call_method", _METHODS[op], pairs, positional)
    if op in _REORDERED:
        fn, order = _REORDERED[op]
        if len(args) <= len(order) and not kwargs:
            return "call_function", fn, tuple(args[i] for i in order if i < len(args)), {}
        return None
    if op.overloadpacket.__name__.startswith("_"):
        return None
    fn = _public_function(op)
    if fn is None:
        return None
    params = _python_params(fn)
    if params is not None:
        if params[: len(names)] != names[: len(params)] and not set(names) <= set(params):
            return None
        if not set(names) <= set(params):
            return None
    return _split("call_function", fn, pairs, positional)


def _split(kind, target, pairs, positional):
    """Leading arguments that are in schema position become positional; the rest keywords."""
    args, kwargs = [], {}
    for i, (name, value) in enumerate(pairs):
        if not kwargs and i < len(positional) and positional[i] == name:
            args.append(value)
        else:
            kwargs[name] = value
    return kind, target, tuple(args), kwargs


def render(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``gm`` in place to call public PyTorch functions, operators and methods."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        spelled = _call(node.target, node.args, node.kwargs)
        if spelled is None:
            continue
        kind, target, args, kwargs = spelled
        if kind == "call_method":
            node.op, node.target, node.args, node.kwargs = kind, target, args, kwargs
        else:
            node.target, node.args, node.kwargs = target, args, kwargs
    gm.recompile()
    return gm
