"""Inline ``call_module`` nodes: a graph that calls submodules becomes one flat graph of ops.

``fxtools.save`` writes a graph as plain code, so a node that calls a submodule (``self.fc1(x)``
in a ``torch.fx.symbolic_trace`` graph, ``self.submod_0(x)`` after ``split_module``) is replaced
by the ops of that submodule's forward: a GraphModule's own graph, any other module's forward
traced through every layer down to torch functions. Forwards that branch on the input's shape
(BatchNorm checks ``input.dim()``) are traced with shape-only ``meta`` tensors when the graph
knows the shapes of the call's inputs (``node.meta['val']`` or ``['tensor_meta']``).
"""

from __future__ import annotations

import inspect
import operator
import re
import warnings

import torch
import torch.fx as fx

from ..errors import FxtoolsError


class InlineError(FxtoolsError):
    """A submodule whose forward cannot be written as a graph of ops."""


class _Through(fx.Tracer):
    """Traces every submodule's forward instead of recording calls of built-in layers."""

    def is_leaf_module(self, m, module_qualified_name):
        return False


def _meta_example(arg):
    if not isinstance(arg, fx.Node):
        return None
    val = arg.meta.get("val")
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    tm = arg.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return torch.empty(tm.shape, dtype=tm.dtype, device="meta")
    return None


def _trace_with_shapes(sub: torch.nn.Module, node: fx.Node):
    """Trace ``sub`` with meta tensors shaped like the call's inputs (None if any is unknown)."""
    from torch.fx.experimental.meta_tracer import MetaTracer

    class Through(MetaTracer):
        def is_leaf_module(self, m, module_qualified_name):
            return False

    params = list(inspect.signature(sub.forward).parameters)
    bound = dict(zip(params, node.args)) | dict(node.kwargs)
    meta_args, concrete = {}, {}
    for name, arg in bound.items():
        example = _meta_example(arg)
        if example is not None:
            meta_args[name] = example
        elif isinstance(arg, fx.Node):
            return None
        else:
            concrete[name] = arg
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Through().trace(sub, meta_args=meta_args, concrete_args=concrete or None)


def _graph_of(sub: torch.nn.Module, node: fx.Node):
    """``(graph, owner)``: the ops of ``sub``'s forward, and the module its get_attr targets name."""
    if isinstance(sub, fx.GraphModule) and type(sub.graph._codegen) is fx.graph.CodeGen:
        return sub.graph, sub
    buffers = {k: b.detach().clone() for k, b in sub.named_buffers()}  # tracing runs buffer updates eagerly
    try:
        try:
            graph = _Through().trace(sub)
        except Exception as plain_error:
            graph = _trace_with_shapes(sub, node)
            if graph is None:
                raise InlineError(
                    f"node {node.name} calls submodule {node.target!r} ({type(sub).__name__}), whose forward "
                    f"cannot be traced into ops without the shapes of its inputs ({plain_error}); give the "
                    "graph shapes first, e.g. torch.fx.passes.shape_prop.ShapeProp(gm).propagate(*example_inputs)"
                ) from None
    except InlineError:
        raise
    except Exception as exc:
        raise InlineError(
            f"node {node.name} calls submodule {node.target!r} ({type(sub).__name__}), whose "
            f"forward cannot be written as a graph of ops: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        with torch.no_grad():
            for k, b in sub.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])
    return graph, fx.GraphModule(sub, graph)


def _inline_one(graph: fx.Graph, node: fx.Node, sub: torch.nn.Module, constants: dict) -> None:
    sub_graph, owner = _graph_of(sub, node)
    placeholders = [n for n in sub_graph.nodes if n.op == "placeholder"]
    env = {}
    for i, ph in enumerate(placeholders):
        if i < len(node.args):
            env[ph] = node.args[i]
        elif ph.target in node.kwargs:
            env[ph] = node.kwargs[ph.target]
        elif ph.args:
            env[ph] = ph.args[0]  # the parameter's default
        else:
            raise InlineError(f"node {node.name} calls submodule {node.target!r} without its argument {ph.target!r}")
    result = None
    with graph.inserting_before(node):
        for n in sub_graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = fx.node.map_arg(n.args[0], env.__getitem__)
                continue
            new = graph.node_copy(n, env.__getitem__)
            if n.op in ("get_attr", "call_module"):  # call_module: inlined on the next round
                constants[new] = _resolve(owner, n.target)
                new.target = f"{node.target}.{n.target}"  # a readable name: body.0.weight
                new._rename(re.sub(r"\W", "_", new.target))
            env[n] = new
    if isinstance(result, fx.Node):
        for key in ("val", "tensor_meta"):  # the call's shape, for the next calls and the docstring
            if key in node.meta:
                result.meta.setdefault(key, node.meta[key])
        node.replace_all_uses_with(result)
    elif isinstance(result, (tuple, list, dict)):
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem and user.args[0] is node:
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
            else:
                raise InlineError(
                    f"submodule {node.target!r} returns a {type(result).__name__} that "
                    f"{user.name} uses whole; only items of it can be inlined"
                )
    elif node.users:
        raise InlineError(f"submodule {node.target!r} returns {result!r}, not a tensor")
    graph.erase_node(node)


def _resolve(root, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def inline_submodules(graph: fx.Graph, root: torch.nn.Module) -> dict:
    """Replace every ``call_module`` node of ``graph`` (whose targets name submodules of ``root``).

    Returns ``{get_attr node: value}`` for the get_attr nodes the inlined forwards brought in,
    whose targets are relative to their own submodule, not to ``root``.
    """
    constants: dict[fx.Node, object] = {}
    for _ in range(64):
        calls = [n for n in graph.nodes if n.op == "call_module"]
        if not calls:
            return {n: v for n, v in constants.items() if n.graph is graph and n.op == "get_attr"}
        for node in calls:
            sub = constants.pop(node) if node in constants else _resolve(root, node.target)
            _inline_one(graph, node, sub, constants)
    raise InlineError("submodules nest more than 64 levels deep")
