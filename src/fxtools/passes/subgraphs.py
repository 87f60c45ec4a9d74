"""Subgraphs: the functions of control-flow ops (``torch.cond``'s branches, ``scan``'s step).

Capture records a higher-order op as one node whose function arguments are GraphModules held
as attributes of the module and read by ``get_attr`` nodes. The passes that clean up and print
a graph apply to these subgraphs as well, through ``subgraphs``.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..graph import meta

__all__ = ["subgraphs", "drop_unused_subgraphs", "name_subgraph_inputs"]


def subgraphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The GraphModules ``gm``'s graph reads with ``get_attr`` (each once)."""
    found: dict[int, fx.GraphModule] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if isinstance(value, fx.GraphModule):
                found.setdefault(id(value), value)
    return list(found.values())


def drop_unused_subgraphs(gm: fx.GraphModule) -> None:
    """Delete the GraphModule attributes no ``get_attr`` node reads any more."""
    read = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    for name, value in list(gm.named_children()):
        if isinstance(value, fx.GraphModule) and name not in read:
            delattr(gm, name)


_GENERIC = re.compile(r"arg\d+_\d+")
_TRACED = re.compile(r"(true|false|scan_combine|while_loop_cond|while_loop_body)_graph_\d+")
_ROLES = {
    "cond": ("true_branch", "false_branch"),
    "scan": ("step",),
    "while_loop": ("loop_cond", "loop_body"),
    "while_loop_stack_output": ("loop_cond", "loop_body"),
}
_FLIP = re.compile(r"flip(_\d+)?")


def name_subgraph_inputs(gm: fx.GraphModule) -> None:
    """Name a subgraph's generic placeholders (``arg0_1``) after the values the call passes it.

    A control-flow op passes its subgraphs the values after its last function argument, flattened
    (``cond(pred, t, f, (x, w))``: ``x, w``; ``scan(step, init, xs, consts)``: ``*init, *xs, *consts``).
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        fns = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"]
        if not fns:
            continue
        values = pytree.tree_leaves(node.args[fns[-1] + 1 :])
        for v in values:  # a scan's backward reads its inputs reversed: ``xs_reversed``
            if isinstance(v, fx.Node) and v.op == "call_function" and _FLIP.fullmatch(v.name) and isinstance(v.args[0], fx.Node):
                v._rename(f"{v.args[0].name}_reversed")
        _name_functions(gm, node, fns)
        for i in fns:
            sub = getattr(gm, node.args[i].target)
            if not isinstance(sub, fx.GraphModule):
                continue
            placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
            if len(placeholders) != len(values):
                continue
            for p, v in zip(placeholders, values):
                if isinstance(v, fx.Node) and _GENERIC.fullmatch(p.name):
                    p._rename(v.name)
                    p.target = p.name


def _name_functions(gm: fx.GraphModule, node: fx.Node, fns: list[int]) -> None:
    """Name the functions of a control-flow call by their role (``true_branch``, ``step``,
    ``loop_body``; ``..._grad`` for a backward's) rather than as tracing did (``true_graph_1``)."""
    roles = _ROLES.get(node.target.name())
    if roles is None or len(roles) != len(fns):
        return
    for i, role in zip(fns, roles):
        attr = node.args[i]
        if not _TRACED.fullmatch(str(attr.target)) or len(attr.users) != 1:
            continue
        base = f"{role}_grad" if meta.GRAD_OF_CONTROL_FLOW.get(node) else role
        name, k = base, 1
        while hasattr(gm, name):
            name, k = f"{base}_{k}", k + 1
        setattr(gm, name, getattr(gm, str(attr.target)))
        delattr(gm, str(attr.target))
        attr.target = name
        attr._rename(name)
