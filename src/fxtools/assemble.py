"""Assemble the user-facing GraphModule: pytree arguments in, nested results out.

The flat graph from ``reverse`` takes one placeholder per tensor leaf. The final graph takes
the user's positional arguments as they are (tensors, dicts, lists, tuples), unpacks them with
ordinary indexing (``fc1_weight = params['fc1.weight']``), and returns nested Python
structures, so its code stands alone: no pytree specs, no flattening helpers.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.fx.graph_module import _copy_attr
from torch.utils import _pytree as pytree
from torch.utils._pytree import MappingKey, GetAttrKey, SequenceKey

from .guards import GuardedGraphModule
from .naming import identifier


def _key_text(key) -> str:
    return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))


def _leaf_getters(graph: fx.Graph, arg_nodes: list[fx.Node], paths):
    """For each key path, a node that extracts it from the placeholders (None if not expressible)."""
    cache = {}
    out = []
    for path in paths:
        node = arg_nodes[path[0].idx]
        for depth, key in enumerate(path[1:], start=1):
            ck = (path[0].idx, tuple(path[1:depth + 1]))
            if ck in cache:
                node = cache[ck]
                continue
            if isinstance(key, MappingKey):
                node = graph.call_function(operator.getitem, (node, key.key))
            elif isinstance(key, SequenceKey):
                node = graph.call_function(operator.getitem, (node, key.idx))
            elif isinstance(key, GetAttrKey):
                node = graph.call_function(getattr, (node, key.name))
            else:
                return None
            cache[ck] = node
        out.append(node)
    return out


def _returnable(graph: fx.Graph, value):
    """``value`` (nested results holding nodes) as an fx output that rebuilds its containers.

    fx returns tuples, lists, plain dicts and namedtuples as they are, but turns dict subclasses
    (``OrderedDict``, transformers' ``ModelOutput``) into plain dicts and cannot spell dataclass
    instances in code; those are built by a call of their class with keyword arguments.
    """
    def rebuild(v):
        return _returnable(graph, v)

    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*map(rebuild, value))
    if type(value) in (tuple, list):
        return type(value)(map(rebuild, value))
    if isinstance(value, dict):
        items = {k: rebuild(v) for k, v in value.items()}
        if type(value) is dict or not all(isinstance(k, str) and k.isidentifier() for k in items):
            return items
        return graph.call_function(type(value), (), items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: rebuild(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return graph.call_function(type(value), (), fields)
    return value


def assemble(flat: fx.GraphModule, arg_names: list[str], args: tuple, tensor_leaf: list[bool],
             leaf_names: list[str], build_output, extra_args=()) -> fx.GraphModule:
    """Wrap ``flat`` (placeholders: tensor leaves of ``args`` then ``extra_args``' leaves).

    ``extra_args`` is a list of ``(name, example)`` appended to the signature (cotangents);
    ``build_output(flat_results)`` nests the flat graph's outputs into the returned structure.
    The graph is built inside the returned module, whose code is not generated yet: the caller
    recompiles it after its last pass (code generation takes long on big graphs; once is enough).
    """
    gm = GuardedGraphModule(flat, fx.Graph(), class_name=flat.__class__.__name__)  # checks fxtools.guards
    graph = gm.graph
    all_names = list(arg_names) + [n for n, _ in extra_args]
    all_args = tuple(args) + tuple(v for _, v in extra_args)
    paths_leaves, _ = pytree.tree_flatten_with_path(all_args)
    paths = [p for p, _ in paths_leaves]
    n_main = len(tensor_leaf)
    extra_names = [identifier("_".join([all_names[p[0].idx], *map(_key_text, p[1:])])) for p in paths[n_main:]]
    arg_nodes = [graph.placeholder(n) for n in all_names]
    simple = all(len(p) == 1 for p in paths)
    getters = [arg_nodes[p[0].idx] for p in paths] if simple else _leaf_getters(graph, arg_nodes, paths)
    if getters is None:
        raise NotImplementedError("fxtools needs pytree arguments made of dicts, lists, tuples and attributes")
    for node, name in zip(getters, list(leaf_names) + extra_names):
        if node.op != "placeholder":
            node._rename(name)
    tensor_mask = list(tensor_leaf) + [isinstance(v, torch.Tensor) for _, v in paths_leaves[n_main:]]
    flat_inputs = [g for g, t in zip(getters, tensor_mask) if t]
    flat_ph = [n for n in flat.graph.nodes if n.op == "placeholder"]
    env = dict(zip(flat_ph, flat_inputs))
    for ph, node in env.items():
        node.meta.setdefault("val", ph.meta.get("val"))
    flat_outs = graph.graph_copy(flat.graph, env)
    graph.output(_returnable(graph, build_output(list(flat_outs))))
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            _copy_attr(flat, gm, node.target)  # what fx.GraphModule(flat, graph) copies
    return gm
