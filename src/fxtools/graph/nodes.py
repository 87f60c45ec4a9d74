"""Small facts about torch.fx nodes that every stage asks: is a value floating point, is a node
impure, which arguments an op writes, which fake mode a graph was traced in."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import operator
import re
from collections.abc import Callable

import torch
import torch.fx as fx

from . import meta

aten = torch.ops.aten


def is_float(x) -> bool:
    """A floating-point or complex tensor: a value that carries a gradient."""
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


STATEFUL_NORMS = {
    aten.batch_norm.default,
    aten.instance_norm.default,
    aten._native_batch_norm_legit.default,
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit_functional.default,
}


def calls_with_grad_mode(graph: fx.Graph):
    """``(node, grad_enabled)`` for each ``call_function`` node of ``graph``, with the grad mode it
    runs in: the graph's ``torch._C._set_grad_enabled`` nodes (not yielded) switch it, starting
    from on, as a transform builds (``no_grad`` blocks of the program are what turns it off)."""
    grad_enabled = True
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch._C._set_grad_enabled:
            grad_enabled = bool(node.args[0])
            continue
        yield node, grad_enabled


def count_compute_nodes(gm: fx.GraphModule) -> int:
    """Nodes doing work: calls other than getitem, getattr (``x.device``) and placeholder plumbing."""
    return sum(
        1
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method", "call_module") and n.target not in (operator.getitem, getattr)
    )


# Ops PyTorch tags random that draw nothing when their arguments say so: (index, name, default)
# of the dropout probability, and of the training flag (None: the op has none).
_MAY_DRAW = {
    aten.scaled_dot_product_attention.default: ((4, "dropout_p", 0.0), None),
    aten._scaled_dot_product_attention_math.default: ((4, "dropout_p", 0.0), None),
    aten._scaled_dot_product_flash_attention_for_cpu.default: ((3, "dropout_p", 0.0), None),
    aten._scaled_dot_product_flash_attention.default: ((3, "dropout_p", 0.0), None),
    aten._scaled_dot_product_efficient_attention.default: ((5, "dropout_p", 0.0), None),
    aten.dropout.default: ((1, "p", None), (2, "train", None)),
    aten.native_dropout.default: ((1, "p", None), (2, "train", None)),
}


def _arg(node: fx.Node, spec):
    index, name, default = spec
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def is_impure(node: fx.Node) -> bool:
    """Nodes dead-code elimination and CSE must keep: mutation, randomness, stateful norms."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op != "call_function":
        return False
    t = node.target
    if t in STATEFUL_NORMS:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
        return bool(training)
    if t in _MAY_DRAW:  # attention without dropout, dropout with p=0 or in eval mode: pure
        p, train = _MAY_DRAW[t]
        return _arg(node, p) != 0 and (train is None or bool(_arg(node, train)))
    if isinstance(t, torch._ops.OpOverload):
        known = _IMPURE_OPS.get()
        impure = known.get(t) if known is not None else None
        if impure is None:
            impure = t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags or node.is_impure()  # _assert_async
            if known is not None:
                known[t] = impure
        return impure
    return node.is_impure()


# op -> whether it is impure, while a transform builds (``op_facts_kept``); None: not kept
_IMPURE_OPS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fxtools_impure_ops", default=None)


@contextlib.contextmanager
def op_facts_kept():
    """While a transform builds (the outermost, if nested): remember for each op whether
    ``is_impure`` found it impure. The passes ask it of every node, several times (about 20 us
    each, mostly ``torch.fx.Node.is_impure``'s registry look-ups); an ``OpOverload``'s answer is its
    schema's, its tags' and torch's registries of side-effectful ops (which read a node's
    arguments only for higher-order ops), and nothing registers an op as side-effectful in the
    middle of a build."""
    if _IMPURE_OPS.get() is not None:
        yield
        return
    token = _IMPURE_OPS.set({})
    try:
        yield
    finally:
        _IMPURE_OPS.reset(token)


def fake_mode_of(source, create: bool = False):
    """The FakeTensorMode ``source`` (a graph, or traced values) was traced in; if none,
    None, or a new mode (accepting real tensors) with ``create=True``."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    if isinstance(source, fx.Graph):
        vals = (n.meta.get("val") for n in source.nodes)
        mode = next((v.fake_mode for v in vals if isinstance(v, torch._subclasses.FakeTensor)), None)
    else:
        mode = detect_fake_mode(source)
    if mode is None and create:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def is_input_leaf(n: fx.Node) -> bool:
    """A placeholder, or a leaf taken out of one (``params['fc1.weight']``)."""
    return n.op == "placeholder" or (
        n.op == "call_function"
        and n.target is operator.getitem
        and isinstance(n.args[0], fx.Node)
        and n.args[0].op == "placeholder"
    )


def reads_tracked_tensor(node: fx.Node, module: torch.nn.Module | None = None) -> bool:
    """Whether ``node`` reads a tensor the code closes over that autograd tracks (a ``get_attr`` of
    a parameter, or of any tensor that requires grad) from ``module`` (the graph's own by default)."""
    module = node.graph.owning_module if module is None else module
    if node.op != "get_attr" or module is None:
        return False
    value = getattr(module, str(node.target), None)
    return isinstance(value, torch.Tensor) and value.requires_grad


def has_generic_name(node: fx.Node) -> bool:
    """The node is named after its op (``mm_2``, or an intermediate ``scores_mm``): a better name may replace it.

    Only a value computed for the one node it replaces takes that node's name: a forward value
    that the backward happens to reuse keeps its own.
    """
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if meta.INTERMEDIATE.on(node):  # a rule's step, also one named after the rule's variable (``h_slope``)
        return True
    op = re.escape(node.target.overloadpacket.__name__.strip("_"))
    return re.fullmatch(rf"(\w+_)?_*{op}_*(_\d+)?", node.name) is not None


def written_args(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list:
    """The arguments a call of ``op`` writes: those its schema marks ``(a!)``, and in training the
    running statistics of a batch or instance norm (their kernels update them unannounced).
    ``op`` may be a copy (from a node's copied ``meta``): it is matched by name."""
    names = [a.name for a in op._schema.arguments]
    bound = {**dict(zip(names, args)), **kwargs}
    written = [bound.get(a.name) for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if str(op) in {str(o) for o in STATEFUL_NORMS} and bound.get(names[5]):  # training / use_input_stats
        written += [bound.get(names[3]), bound.get(names[4])]  # running_mean, running_var
    return [w for w in written if w is not None]


def ancestors(nodes, keep: Callable[[fx.Node], bool] | None = None) -> set[fx.Node]:
    """``nodes`` and every node they depend on; with ``keep``, only the nodes ``keep`` accepts,
    reached through such nodes (the part of the graph a gradient flows through, say)."""
    seen: set[fx.Node] = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen or (keep is not None and not keep(node)):
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def copy_args(new: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
    """Give ``new`` (made with no arguments) ``args`` and ``kwargs``; returns it.

    ``Graph.create_node`` walks every argument with pytree to warn of raw symbolic scalars, a
    walk that costs as much as making the node. A copy of a node already in a graph (``fxtools.split``'s
    forward and backward, a replayed rule) has arguments that were checked when the node was
    made: it is made without arguments, then given them, which leaves the same node."""
    new.args = args
    if kwargs:
        new.kwargs = kwargs
    return new


def node_copy(graph: fx.Graph, node: fx.Node, env) -> fx.Node:
    """``graph.node_copy(node, env.__getitem__)`` without the argument walk (``copy_args``)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
    new = copy_args(graph.create_node(node.op, node.target, (), None, node.name, node.type), args, kwargs)
    new.meta = copy.copy(node.meta)
    return new


def is_reshaped_view(node: fx.Node) -> bool:
    """A node of a ``.view`` that one sample allows and the batched layout refuses, which
    ``fxtools.vmap`` computes as ``reshape`` (``meta.RESHAPED_VIEW``): a copy where eager's
    per-sample view aliases its input."""
    return meta.RESHAPED_VIEW.on(node)


_VIEW_REFUSALS = ("view size is not compatible with input tensor's size and stride", "Cannot view a tensor with shape")


def is_view_refusal(exc: BaseException) -> bool:
    """The error of a ``.view`` whose input's strides cannot give the new shape: eager's kernel
    (``view size is not compatible``) or the FakeTensor kernel a trace runs (``Cannot view``)."""
    return isinstance(exc, (RuntimeError, ValueError)) and any(m in str(exc) for m in _VIEW_REFUSALS)


def view_strides(shape, stride, new_shape) -> list[int] | None:
    """The strides ``x.view(new_shape)`` gives a tensor of ``shape`` and ``stride``, or None where
    PyTorch's view kernel refuses it (ATen's ``computeStride``: each run of dimensions the new
    shape merges or splits must be one contiguous block of memory). ``new_shape`` may hold one -1.
    Sizes must be ints (a symbolic size: the caller decides without this)."""
    shape, stride, new_shape = list(shape), list(stride), list(new_shape)
    numel = 1
    for s in shape:
        numel *= s
    if -1 in new_shape:
        known = 1
        for s in new_shape:
            known *= s if s != -1 else 1
        new_shape[new_shape.index(-1)] = numel // known if known else 0
    if not shape:
        return [1] * len(new_shape)
    if numel == 0:
        return [0] * len(new_shape)  # any view of an empty tensor is allowed
    new_stride = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base = stride[-1] if stride else 1
    tensor_numel = view_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and stride[d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_stride[view_d] = view_numel * chunk_base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk_base = stride[d - 1]
                tensor_numel = view_numel = 1
    return new_stride if view_d == -1 else None
