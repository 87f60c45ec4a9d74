"""Assemble the user-facing GraphModule: pytree arguments in, nested results out.

The flat graph from ``reverse`` takes one placeholder per tensor leaf. The final graph takes
the user's positional arguments as they are (tensors, dicts, lists, tuples), unpacks them with
ordinary indexing (``fc1_weight = params['fc1.weight']``), and returns nested Python
structures, so its code stands alone: no pytree specs, no flattening helpers.

Dict keys and returned constants are user data: they reach the code only as plain built-in
literals (``naming.plain_literal``), never through their own ``repr``.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.fx.graph_module import _copy_attr
from torch.utils import _pytree as pytree
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey

from ..errors import FxtoolsError
from ..signature.guards import GuardedGraphModule
from ..signature.naming import identifier, is_plain_identifier, plain_literal, repr_safe, unique


def _key_text(key) -> str:
    return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))


def _leaf_getters(graph: fx.Graph, arg_nodes: list[fx.Node], paths):
    """For each key path, a node that extracts it from the placeholders (None if not expressible)."""
    cache = {}
    out = []
    for path in paths:
        node = arg_nodes[path[0].idx]
        for depth, key in enumerate(path[1:], start=1):
            ck = (path[0].idx, tuple(path[1 : depth + 1]))
            if ck in cache:
                node = cache[ck]
                continue
            where = f"the dict key of {arg_nodes[path[0].idx].target}{pytree.keystr(path[1 : depth + 1])}"
            if isinstance(key, MappingKey):
                node = graph.call_function(operator.getitem, (node, plain_literal(key.key, where, key=True)))
            elif isinstance(key, SequenceKey):
                node = graph.call_function(operator.getitem, (node, int(key.idx)))
            elif isinstance(key, GetAttrKey):
                node = graph.call_function(getattr, (node, plain_literal(key.name, where)))
            else:
                return None
            cache[ck] = node
        out.append(node)
    return out


def returnable(graph: fx.Graph, value, where="the return value"):
    """``value`` (nested results holding nodes) as an fx output that rebuilds its containers.

    fx returns tuples, lists, plain dicts and namedtuples as they are, but turns dict subclasses
    (``OrderedDict``, transformers' ``ModelOutput``) into plain dicts and cannot spell dataclass
    instances in code; those are built by a call of their class with keyword arguments. Keys and
    constants become plain literals (an error if they cannot); fx's immutable lists and dicts
    (what an Interpreter over a generated module returns, in composed transforms) are written as
    lists and dicts; a dict whose keys or values fx
    would print with ``repr`` although they are no literals (enum members) is built by ``dict``
    from its pairs, which fx prints element by element.
    """

    def rebuild(v, path):
        return returnable(graph, v, where + path)

    if isinstance(value, fx.Node):
        return value
    if type(value) is fx.immutable_collections.immutable_list:  # fx's own list, an Interpreter's result
        value = list(value)
    elif type(value) is fx.immutable_collections.immutable_dict:
        value = dict(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        items = [rebuild(v, f".{f}") for f, v in zip(value._fields, value)]
        return type(value)(*items) if repr_safe(items) else graph.call_function(type(value), tuple(items))
    if type(value) in (tuple, list):
        return type(value)(rebuild(v, f"[{i}]") for i, v in enumerate(value))
    if pytree.is_structseq_instance(value):  # torch.return_types.max(values, indices)
        return graph.call_function(type(value), (tuple(rebuild(v, f"[{i}]") for i, v in enumerate(value)),))
    if isinstance(value, tuple):  # torch.Size and other tuple subclasses: fx prints them as tuples
        return tuple(rebuild(v, f"[{i}]") for i, v in enumerate(value))
    if isinstance(value, dict):
        items = {}
        for k, v in value.items():
            k = plain_literal(k, f"a key of {where}")
            items[k] = rebuild(v, f"[{k!r}]")
        if type(value) is not dict and all(is_plain_identifier(k) for k in items):
            return graph.call_function(type(value), (), items)
        if repr_safe(items):
            return items
        return graph.call_function(dict, (list(items.items()),))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: rebuild(getattr(value, f.name), f".{f.name}") for f in dataclasses.fields(value) if f.init}
        bad = [f for f in fields if not is_plain_identifier(f)]
        if bad:
            raise FxtoolsError(
                f"{where} is a {type(value).__qualname__} with a field named {bad[0]!r}, "
                "which fxtools cannot write as a keyword argument"
            )
        return graph.call_function(type(value), (), fields)
    if isinstance(value, (slice, range, type(...), torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return value
    return plain_literal(value, where)


def assemble(
    flat: fx.GraphModule,
    arg_names: list[str],
    args: tuple,
    tensor_leaf: list[bool],
    leaf_names: list[str],
    build_output,
    extra_args=(),
) -> fx.GraphModule:
    """Wrap ``flat`` (placeholders: tensor leaves of ``args`` then ``extra_args``' leaves).

    ``extra_args`` is a list of ``(name, example)`` appended to the signature (cotangents);
    ``build_output(flat_results)`` nests the flat graph's outputs into the returned structure.
    The graph is built inside the returned module, whose code is not generated yet: the caller
    recompiles it after its last pass (code generation takes long on big graphs; once is enough).
    """
    gm = GuardedGraphModule(flat, fx.Graph(), class_name=flat.__class__.__name__)  # checks fxtools.signature.guards
    graph = gm.graph
    extra = [n for n, _ in extra_args]
    all_names = unique(list(arg_names), taken=extra) + extra  # the user's `grad_out` is `grad_out_1`
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
    graph.output(returnable(graph, build_output(list(flat_outs))))
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            _copy_attr(flat, gm, node.target)  # what fx.GraphModule(flat, graph) copies
    return gm
