"""Per-point independence along a batch dimension: does row ``b`` of every output depend on row ``b``
of the input only?

A network written on a batch, ``u(X)``, computes each output row from its own input row when every
op it applies acts row by row: pointwise ops, products with a constant on the right, reductions and
views that leave the leading dimension alone. Then the Laplacian of output row ``b`` with respect to
all of ``X`` is the Laplacian with respect to row ``b`` alone, and collapsed Taylor mode may push
the directions ``e_d`` of one row through all rows at once (``D`` directions of one point instead of
``B x D``): the cost of ``vmap`` of the per-point module, without vmap.

The analysis is a whitelist over the captured graph: a node is ``ROW`` (leading dimension the
batch, each row from its own input row), ``CONST`` (does not depend on the input) or neither; any
op not listed, or listed but used across the batch dimension (a sum over it, a transpose moving it,
a product with the batch on the right), makes its value neither, and the caller keeps the exact
route over all ``B x D`` directions. It never claims independence that the graph does not have.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

aten = torch.ops.aten

__all__ = ["rows_independent"]

ROW, CONST = "row", "const"

_SAME = {aten.clone, aten._to_copy, aten.contiguous, aten.alias, aten.detach, aten.lift_fresh_copy}
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.expand}
_DIM_ARG = {  # ops acting along args[1] (an int or a list of ints): row-wise unless it names dimension 0
    aten.sum,
    aten.mean,
    aten.amax,
    aten.amin,
    aten.logsumexp,
    aten._softmax,
    aten.softmax,
    aten._log_softmax,
    aten.log_softmax,
    aten.unsqueeze,
    aten.squeeze,
    aten.select,
    aten.slice,
    aten.narrow,
    aten.index_select,
    aten.cumsum,
    aten.max,
    aten.min,
    aten.var,
    aten.std,
    aten.var_mean,
}
_PRODUCTS = {aten.mm, aten.matmul, aten.linear, aten.mv}


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _rows(val, batch: int) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() >= 1 and val.shape[0] == batch


def _dims(node, ndim: int):
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return None  # over every dimension
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [d % max(ndim, 1) for d in dims] if all(isinstance(d, int) for d in dims) else None


def _row_op(node, states, batch: int) -> bool:
    """Whether ``node`` (some argument ``ROW``, none mixed) keeps each row to itself."""
    packet = getattr(node.target, "overloadpacket", None)
    out = _val(node)
    outs = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (tuple, list)) else []
    if not outs or not all(_rows(o, batch) for o in outs if isinstance(o, torch.Tensor)):
        return False
    row_args = [a for a in node.all_input_nodes if states.get(a) == ROW]
    first = node.args[0] if node.args else None
    if torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return all(_val(a).dim() == out.dim() for a in row_args)
    if packet in _SAME or packet in _VIEWS:
        return row_args == [first] and (packet is not aten.expand or node.args[1][0] in (batch, -1))
    if packet in _PRODUCTS:
        return row_args == [first] and _val(first).dim() >= 2
    if packet in _DIM_ARG:
        dims = _dims(node, _val(first).dim())
        return row_args == [first] and dims is not None and 0 not in dims
    if packet in (aten.permute,):
        return row_args == [first] and node.args[1][0] % _val(first).dim() == 0
    if packet in (aten.transpose,):
        return row_args == [first] and 0 not in [d % _val(first).dim() for d in node.args[1:3]]
    if packet in (aten.cat, aten.stack):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        return dim % out.dim() != 0 and all(_rows(_val(a), batch) for a in node.args[0])
    return False


def rows_independent(gm: fx.GraphModule, x_node: fx.Node) -> bool:
    """Whether every floating-point output's row ``b`` depends on row ``b`` of ``x_node`` only (the
    leading dimension of ``x_node`` and of the outputs being the batch)."""
    x = _val(x_node)
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return False
    batch = x.shape[0]
    states: dict = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            states[node] = ROW if node is x_node else CONST
        elif node.op == "get_attr":
            states[node] = CONST
        elif node.op == "call_function":
            found = {states.get(a) for a in node.all_input_nodes}
            if found <= {CONST}:
                states[node] = CONST
            elif None in found:
                states[node] = None
            elif node.target is operator.getitem:
                states[node] = ROW if _rows(_val(node), batch) else None
            else:
                states[node] = ROW if _row_op(node, states, batch) else None
        elif node.op == "output":
            outs = [o for o in pytree.tree_leaves(node.args[0]) if isinstance(o, fx.Node)]
            return all(states.get(o) in (ROW, CONST) for o in outs) and any(states.get(o) == ROW for o in outs)
        else:
            states[node] = None
    return False
