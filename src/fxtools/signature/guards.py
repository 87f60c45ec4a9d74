"""Guards: every generated module checks on entry that it was made for the arguments it is given.

fxtools specialises the code it generates to the example arguments: the pytree structure, each
tensor's sizes, dtype and device type, and the value of each Python number, string or flag are
constants in the code (a mean over a batch of 32 multiplies by ``1/32``). Called with anything
else, the code would silently compute something else. So every module refuses, with one error
type (``fxtools.InputMismatch``, a ``ValueError``), any argument that differs from what it was
made for, naming the argument by its path (``params['fc1.weight']``, ``x``, ``grad_out[0]``),
what the module was made for, what it got, and how to get a module that accepts it.

This module builds the guards (``build``, ``install``) from the example arguments, as records of
``signature/runtime.py`` (``Guards``, ``Leaf``, ``Node``, ``Sym``; its docstring describes the data
and the check), and gives modules the class that checks them on every call
(``GuardedGraphModule``). ``fxtools.save`` writes the same data and checking code into the
modules it writes (``codegen/guard_source.py``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import user_line_of
from ..registry import TRANSFORMS
from . import runtime
from .decisions import Decision, checking
from .naming import plain_literal
from .runtime import InputMismatch, Leaf, Node, Sym, snapshot_value

__all__ = [  # the records (Sym, Cond, Read, Leaf, Node) are runtime's
    "InputMismatch",
    "Guards",
    "GuardedGraphModule",
    "build",
    "install",
    "is_scalar",
]


class Guards(runtime.Guards):
    """``runtime.Guards`` that record the decision each check repeats (``signature/decisions.py``):
    a module traced inside another (``hvp`` traces a ``grad`` module) passes its decisions on."""

    def deciding(self, where, kind, test, value):
        with checking(Decision(where, kind)):
            return test(value)


# --------------------------------------------------------------------------------------------
# Building guards from example arguments
# --------------------------------------------------------------------------------------------

_VIEW_OPS = frozenset({"view", "_unsafe_view", "view_copy"})
_LAYOUT_OPS = _VIEW_OPS | {"as_strided", "as_strided_", "as_strided_scatter"}


def stride_sensitive_paths(gm: fx.GraphModule, names, ops=_LAYOUT_OPS) -> set:
    """Paths of the argument leaves whose strides the code relies on: those a ``.view`` (or
    ``as_strided``; any of ``ops``) in ``gm`` reads, directly or through other ops (a pointwise op
    keeps its input's strides). Placeholders are ``names``; leaves are read by ``[key]`` /
    ``.attr`` chains."""
    return _sensitive_paths(gm, names, [n for n in gm.graph.nodes if _layout_op(n, ops)])


def _sensitive_paths(gm: fx.GraphModule, names, layout_nodes) -> set:
    """``stride_sensitive_paths`` of the layout ops ``layout_nodes``."""
    ph = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), names))
    seen: set = set()
    stack = [node.args[0] for node in layout_nodes if node.args and isinstance(node.args[0], fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            if not _fresh_layout(node):
                stack.extend(n for n in node.all_input_nodes if not _metadata_read(n))
    paths = set()
    for node in seen:
        keys, cur = [], node
        while cur.op == "call_function" and cur.target in (operator.getitem, getattr) and isinstance(cur.args[0], fx.Node):
            key = cur.args[1]
            keys.append(pytree.GetAttrKey(str(key)) if cur.target is getattr else pytree.MappingKey(key))
            cur = cur.args[0]
        if cur in ph:
            paths.add(ph[cur] + pytree.keystr(tuple(reversed(keys))))
    return paths


_METADATA = {"device", "dtype", "shape", "ndim", "layout", "size", "dim", "numel", "is_cuda", "requires_grad"}


def _metadata_read(node) -> bool:
    """``x.device``, ``x.size()`` and the like: a value made from it (``torch.eye(n, device=x.device)``)
    does not take ``x``'s strides, so a ``.view`` of it relies on no layout of ``x``."""
    if node.op == "call_method":
        return node.target in _METADATA
    return node.op == "call_function" and node.target is getattr and node.args[1] in _METADATA


def _fresh_layout(node) -> bool:
    """A copy into the contiguous layout: what reads it relies on its strides, not its input's."""
    return (
        node.op == "call_function"
        and node.kwargs.get("memory_format") is torch.contiguous_format
        and (getattr(node.target, "overloadpacket", node.target) in (torch.ops.aten.clone, torch.clone))
    )


def _layout_op(node, ops=_LAYOUT_OPS) -> bool:
    if node.op == "call_method":
        return node.target in ops
    if node.op == "call_function":
        target = node.target
        return getattr(getattr(target, "overloadpacket", target), "__name__", None) in ops
    return False


def layout_needs(gm: fx.GraphModule, names) -> dict:
    """For each argument leaf whose strides the code relies on, what it needs: ``"views"`` where
    only ``.view`` reads them (a view gives the values eager's would, or raises: any layout on
    which it succeeds will do), the example's layout where ``as_strided`` does (``torch.stft``
    frames its input so): there, the op and the user's line (``"as_strided (from file:line: code)"``),
    for the message of a call in another layout."""
    return {**dict.fromkeys(stride_sensitive_paths(gm, names, _VIEW_OPS), "views"), **_strided_reads(gm, names)}


def _strided_reads(gm: fx.GraphModule, names) -> dict:
    """For each argument leaf an ``as_strided`` of ``gm`` reads the strides of, that op and its
    user's line where ``gm`` still records it (``"as_strided (from file:line: code)"``; the
    emitted code's graph, which guards are built from, does not: there, the op alone)."""
    strict: dict = {}
    for node in gm.graph.nodes:
        if _layout_op(node, _LAYOUT_OPS - _VIEW_OPS):
            op = getattr(getattr(node.target, "overloadpacket", node.target), "__name__", str(node.target))
            where = user_line_of(node)
            for path in _sensitive_paths(gm, names, [node]):
                if where or path not in strict:
                    strict[path] = f"{op} (from {where})" if where else op
    return strict


def is_scalar(x) -> bool:
    return isinstance(x, (bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format, torch.layout)) or (
        isinstance(x, tuple) and all(map(is_scalar, x))
    )


def _size_spec(n):
    """An int, or for a symbolic size of the example (a data-dependent output size ``u0``) a Sym
    of that name: any value, equal wherever the symbol recurs."""
    if isinstance(n, torch.SymInt):
        expr = n.node.expr
        if not expr.is_number:
            return Sym(str(expr), 0, None)
    return int(n)


class OptionalTensor:
    """In example arguments: None or a tensor like ``example`` (a Leaf of kind "optional")."""

    def __init__(self, example):
        self.example = example


def _leaf_spec(value, path, layout, role):
    if isinstance(value, OptionalTensor):
        leaf = _leaf_spec(value.example, path, layout, role)
        leaf.kind = "optional"
        return leaf
    if isinstance(value, torch.Tensor):
        wanted = (
            (layout.get(path, False) if isinstance(layout, dict) else path in layout)
            if isinstance(layout, (set, frozenset, dict))
            else layout
        )
        strided = wanted and value.layout == torch.strided
        # cotangents and tangents are traced contiguous (as callers make them)
        lay = None if not strided else "contiguous" if role or value.is_contiguous() else tuple(value.stride())
        if strided and wanted == "views" and not role:
            lay = "views"
        by = wanted if strided and isinstance(wanted, str) and wanted != "views" else None
        return Leaf(
            path,
            "tensor",
            tuple(_size_spec(n) for n in value.shape),
            value.dtype,
            value.device.type,
            lay,
            role=role,
            layout_by=by,
        )
    if value is None:
        return Leaf(path, "none", role=role)
    if is_scalar(value):
        return Leaf(path, "scalar", value=value, role=role)
    state = snapshot_value(value)
    if state is not None:
        return Leaf(path, "state", value=state, role=role)
    return Leaf(path, "object", value=value, role=role)


def _spec(value, path, layout, role):
    if pytree.tree_is_leaf(value):
        return _leaf_spec(value, path, layout, role(path) if callable(role) else role)
    handler = pytree.SUPPORTED_NODES[pytree._get_node_type(value)]
    if handler.flatten_with_keys_fn is not None:
        keyed, _ = handler.flatten_with_keys_fn(value)
    else:
        children, _ = handler.flatten_fn(value)
        keyed = [(pytree.SequenceKey(i), c) for i, c in enumerate(children)]
    keys = [
        pytree.MappingKey(plain_literal(k.key, f"the key {k.key!r} of {path or 'an argument'}", key=True))
        if isinstance(k, pytree.MappingKey)
        else k
        for k, _ in keyed
    ]  # never a user repr in code
    specs = tuple(_spec(c, path + pytree.keystr((k,)), layout, role) for k, (_, c) in zip(keys, keyed))
    name = type(value).__name__
    if isinstance(value, dict) and all(isinstance(k, pytree.MappingKey) for k in keys):
        return Node(path, "dict", name, tuple(k.key for k in keys if isinstance(k, pytree.MappingKey)), specs)
    if isinstance(value, (list, tuple)) and all(isinstance(k, pytree.SequenceKey) for k in keys):
        return Node(path, "tuple" if isinstance(value, tuple) else "list", name, tuple(range(len(keys))), specs)
    if all(isinstance(k, pytree.GetAttrKey) for k in keys):
        return Node(path, "attrs", name, tuple(k.name for k in keys if isinstance(k, pytree.GetAttrKey)), specs)
    raise NotImplementedError(f"fxtools cannot guard an argument of type {type(value).__name__}")


def build(made_by: str, names, args, *, layout=False, roles=None) -> Guards:
    """Guards for a module made at example ``args`` (one per positional argument named ``names``).

    ``layout``: whether the code relies on every tensor's strides, or the set of leaf paths
    whose strides it relies on (``stride_sensitive_paths``); ``roles``: for each
    argument index, None or a function ``path -> role text`` (cotangents, tangents).
    """
    names, args = tuple(names), tuple(args)
    roles = roles or {}
    specs = tuple(_spec(a, n, layout, roles.get(i)) for i, (n, a) in enumerate(zip(names, args)))
    return Guards(made_by, names, specs, autocast=runtime.autocast_state())


def without_autocast(state):
    """A context turning off autocast on the device types of ``state`` (an ``autocast_state()``):
    code made inside a region holds its casts, and runs as it was traced."""
    stack = contextlib.ExitStack()
    for device, _ in state:
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def cotangent_role(out_name="out"):
    """Role texts for a cotangent argument ``grad_out`` shaped like the output ``out``."""

    def role(path):
        rest = path[path.find("[") :] if "[" in path else ""
        return f"the cotangent of {out_name}{rest}"

    return role


def tangent_role(arg_name):
    def role(path):
        rest = path[path.find("[") :] if "[" in path else ""
        return f"the tangent of {arg_name}{rest}"

    return role


# --------------------------------------------------------------------------------------------
# The module class that checks them
# --------------------------------------------------------------------------------------------


# what each transform's module returns, and the arguments it takes after the function's own
def module_call(made_by: str, names) -> str:
    """How a module ``made_by`` makes is called, as code: ``out, grads = gm(x, grad_out)`` (``names``
    its arguments, or the function's alone, in which case the transform's own are added; what it
    returns and adds is its ``registry.Transform`` record's)."""
    record = TRANSFORMS.get(made_by)
    result, extra = (record.returns, list(record.extra)) if record is not None else ("result", [])
    args = list(names) + ([] if len(names) > 1 or not extra or extra[0] in names else extra)
    return f"{result} = gm({', '.join(args)})"


class GuardedGraphModule(fx.GraphModule):
    """A GraphModule whose calls check ``self.guards`` first (``forward`` itself is unchecked).

    Its repr says what made it and how it is called (the class fx generates is named after the
    user's function, often ``<lambda>``), and unpacking it (``out, fn = fxtools.vjp(f, x)``, the
    torch.func habit) says how to call it instead.
    """

    guards: Guards | None = None  # what its calls must pass (``install``)
    closures: Any = None  # a signature.closures.Closures: what it read from outside its arguments
    size_one_variant: Any = None  # builds the module again for a call with a dynamic size of 1 (transforms/calling.py)
    layout_variant: Any = None  # builds the module again for a call whose layout its .view calls cannot view
    keywords: tuple[str, ...] = ()  # its inputs that are the function's keyword arguments (transforms/calling.py)

    def __init__(self, root, graph, class_name: str = "GraphModule", *, generate_code: bool = True):
        """As ``fx.GraphModule``'s; ``generate_code=False`` leaves the code to the caller's own
        ``recompile()`` (``pipeline.emit``, once the graph is respelled and renamed) instead of
        generating it here too, only to be thrown away."""
        self.__dict__["_code_deferred"] = not generate_code
        try:
            super().__init__(root, graph, class_name)
        finally:
            del self.__dict__["_code_deferred"]

    def recompile(self):
        if self.__dict__.get("_code_deferred"):
            return None
        return super().recompile()

    def __repr__(self):
        guards = self.guards
        if guards is None:
            return super().__repr__()
        return f"<{guards.made_by} module: {module_call(guards.made_by, guards.names)}; gm.code is its code, gm.guards what it accepts>"

    def __iter__(self):
        guards = self.guards
        made_by = guards.made_by if guards is not None else "an fxtools"
        call = module_call(made_by, guards.names) if guards is not None else "gm(*args)"
        raise TypeError(
            f"{made_by} returns one module, not a pair such as torch.func.vjp's (out, vjp_fn): call it, {call} "
            "(its arguments are the function's, then the cotangents or tangents, if any)"
        )

    def __call__(self, *args, **kwargs):
        guards = self.guards
        if self.keywords:
            args, kwargs = self._keywords_in_place(args, kwargs), {}
        if guards is not None:
            guards.size_one = False
            try:
                guards.check(args if not kwargs else self._positional(guards, args, kwargs))
            except InputMismatch:
                if not (guards.size_one and self.size_one_variant is not None and not kwargs):
                    raise
                return self._size_one(args)
        if self.closures is not None:  # what the program read from outside its arguments (signature/closures.py)
            self.closures.check(self)
        try:
            if guards is not None and guards.autocast and runtime.autocast_state():
                with without_autocast(guards.autocast):
                    out = super().__call__(*args, **kwargs)
            else:
                out = super().__call__(*args, **kwargs)
        except RuntimeError as exc:
            if guards is None or "view size is not compatible" not in str(exc):
                raise
            return self._relaid(guards, args, kwargs, exc)
        if guards is not None and _has_dict(guards.args):
            out = follow_key_orders(args if not kwargs else self._positional(guards, args, kwargs), out)
        return out

    def _relaid(self, guards, args, kwargs, exc):
        """The call ``args``, in a layout a ``.view`` of the code cannot view, run by a module built
        from them (once per strides, then kept), as eager runs the function on them; refused,
        naming the argument, where that cannot be built (eager's own ``.view`` raises there)."""
        positional = args if not kwargs else self._positional(guards, args, kwargs)
        tensors = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        if self.layout_variant is None or kwargs or not all(map(_plain, tensors)) or _writes(self.graph):
            guards.refuse_view(positional, exc)
            raise exc
        key = tuple(tuple(a.stride()) if isinstance(a, torch.Tensor) else None for a in pytree.tree_leaves(args))
        built = self.__dict__.setdefault("_layout_modules", {})
        if key not in built:
            try:
                built[key] = self.layout_variant(args)
                built[key].__dict__["layout_variant"] = None  # made for this layout: its views take it
            except Exception:  # noqa: BLE001 - the function itself cannot run on this layout
                guards.refuse_view(positional, exc)
                raise
        return built[key](*args)

    def _size_one(self, args):
        """The call ``args``, whose dynamic size is 1, run by a module built for their shapes (once per
        shapes, then kept): torch traces a dynamic size as at least 2 and decides ``size == 1``
        (broadcasting, a branch) without a trace, so a module traced symbolically cannot serve it."""
        key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in pytree.tree_leaves(args))
        built = self.__dict__.setdefault("_size_one_modules", {})
        if key not in built:
            built[key] = self.size_one_variant(args)
        return built[key](*args)

    def _keywords_in_place(self, args, kwargs):
        """``gm(x, grad_out, scale=2.0)`` as ``gm(x, scale, grad_out)``: the function's keyword
        arguments are inputs after its positional ones (``keywords``), passed by keyword as torch.func
        passes them; the positional arguments fill the other inputs in order."""
        params = list(inspect.signature(self.forward).parameters)
        rest = [p for p in params if p not in kwargs]
        missing = [k for k in self.keywords if k not in kwargs]
        if len(args) == len(rest) - len(missing) and missing and self.guards is not None:
            made = ", ".join(f"{k}=..." for k in self.keywords)
            self.guards.fail(
                f"it was made with the function's keyword arguments {made} and got no {', '.join(missing)}",
                f"Pass them as when it was made: gm(..., {made}).",
            )
        if set(kwargs) - set(params) or len(args) != len(rest):
            return self._positional(self.guards, args, kwargs) if self.guards is not None else args
        given = dict(zip(rest, args), **kwargs)
        return tuple(given[p] for p in params)

    def _positional(self, guards, args, kwargs):
        try:
            bound = inspect.signature(self.forward).bind(*args, **kwargs)
        except TypeError as exc:
            guards.fail(str(exc), "Pass the arguments the module was made for.")
        return tuple(bound.arguments.values())

    def __reduce__(self):
        _, (body, import_block) = super().__reduce__()
        body.pop("closures", None)  # a saved module is a snapshot of what it read (signature/closures.py)
        body.pop("size_one_variant", None)  # it holds the user's function; a saved module refuses size 1
        body.pop("_size_one_modules", None)
        body.pop("layout_variant", None)
        body.pop("_layout_modules", None)
        return _restore, (body, import_block)

    def __deepcopy__(self, memo):
        closures, self.closures = self.closures, None  # a copy is a snapshot (signature/closures.py)
        try:
            res = super().__deepcopy__(memo)  # keeps only the attributes the graph reads
        finally:
            self.closures = closures
        if self.guards is not None:
            res.guards = copy.deepcopy(self.guards, memo)
        res.size_one_variant = self.size_one_variant  # builds from the user's function, not copied
        return res


def _has_dict(specs) -> bool:
    return any(type(s) is Node and (s.kind == "dict" or _has_dict(s.children)) for s in specs)


def _key_orders(value, orders: dict) -> None:
    """frozenset(keys) -> the order of the dicts in ``value`` with those keys (None where two disagree)."""
    if isinstance(value, dict):
        keys = tuple(value)
        orders[frozenset(keys)] = keys if orders.get(frozenset(keys), keys) == keys else None
        value = value.values()
    if isinstance(value, (list, tuple, type({}.values()))):
        for v in value:
            _key_orders(v, orders)


def follow_key_orders(args, out):
    """``out`` with each dict in the key order of the argument dict with the same keys, as
    torch.func returns them (values are matched by key, never by position; the code itself
    builds its dicts in the example's order)."""
    orders: dict = {}
    _key_orders(args, orders)

    def walk(value):
        if isinstance(value, dict) and type(value) is dict:
            order = orders.get(frozenset(value))
            items = {k: walk(v) for k, v in value.items()}
            return {k: items[k] for k in order} if order is not None and tuple(value) != order else items
        if type(value) in (list, tuple):
            return type(value)(walk(v) for v in value)
        return value

    return walk(out)


def _restore(body, import_block):
    """Unpickle a GuardedGraphModule (as ``torch.fx.graph_module.reduce_graph_module`` does)."""
    from torch.fx.graph_module import _deserialize_graph_module, _forward_from_src

    forward = _forward_from_src(import_block + (body.get("_code") or body["code"]), {})
    gm = _deserialize_graph_module(forward, body, graph_module_cls=GuardedGraphModule)
    gm.guards = body.get("guards")  # restored only where the class has no such attribute
    return gm


def guarded(gm: fx.GraphModule) -> GuardedGraphModule:
    """``gm`` as a GuardedGraphModule sharing its graph, attributes and metadata."""
    if isinstance(gm, GuardedGraphModule):
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph._codegen = gm.graph._codegen
    new = GuardedGraphModule(gm, graph, class_name=gm.__class__.__name__)
    attributes = vars(new)  # every attribute a stage attached to ``gm``, whichever: copied as they are
    for k, v in vars(gm).items():
        attributes.setdefault(k, v)
    new.meta = gm.meta
    return new


def _writes(graph: fx.Graph) -> bool:
    """Whether the code writes in place (an argument, a buffer): such a call, stopped by a failed
    ``.view`` after a write, cannot be run again without writing twice, so it is refused."""
    return any(_in_place(n) for n in graph.nodes)


def _in_place(node: fx.Node) -> bool:
    """Whether ``node`` is an in-place call (``x.add_(1)``, ``torch.relu_``, ``aten.copy_``): a name
    ending in ``_``, but for Python's operators (``operator.and_`` computes ``a & b``)."""
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if target in (operator.and_, operator.or_, operator.xor, operator.not_, operator.truth):
        return False
    name = target if isinstance(target, str) else getattr(getattr(target, "overloadpacket", target), "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _written_by(node: fx.Node) -> list:
    """What ``node`` writes in place: the arguments its ATen schema marks written, or the first
    operand of a method or function whose name ends in ``_``."""
    from ..graph.nodes import written_args

    if node.op not in ("call_function", "call_method"):
        return []
    if isinstance(node.target, torch._ops.OpOverload):
        return written_args(node.target, node.args, node.kwargs)
    return [node.args[0]] if node.args and _in_place(node) else []


def _is_fresh(node: fx.Node) -> bool:
    """A tensor the code makes (``torch.zeros``, a factory): writing it changes no argument."""
    return node.op in ("call_function", "call_method") and not any(isinstance(a, fx.Node) for a in node.args)


def _plain(t: torch.Tensor) -> bool:
    """A tensor holding its values: no FakeTensor, no functorch wrapper (a trace or a vmap)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor) and not torch._C._functorch.is_functorch_wrapped_tensor(t)


def install(gm: fx.GraphModule, made_by: str, names, args, *, roles=None) -> GuardedGraphModule:
    """Attach guards for example ``args`` to ``gm`` (made a GuardedGraphModule if it is not one);
    layouts are required where its code relies on strides."""
    gm = guarded(gm)
    gm.guards = build(made_by, names, args, layout=layout_needs(gm, names), roles=roles)
    guard_sharing(gm, args, own=len(args) - len(roles or {}))
    return gm


def guard_sharing(gm: fx.GraphModule, args, guards: Guards | None = None, written: tuple | None = None, own=None) -> tuple:
    """Where ``gm``'s code writes arguments in place, its guards (or ``guards``, of the arguments
    ``args``) require the example's sharing of memory between a written tensor argument and the
    others (``Guards.shared``). ``written``: the positions among ``args``' tensor leaves of those
    written, if known (else read from ``gm``, whose placeholders are ``args``); returned."""
    if not _writes(gm.graph):
        return ()
    guards = gm.guards if guards is None else guards
    tensors = [a for a in pytree.tree_leaves(tuple(args)) if isinstance(a, torch.Tensor)]
    written = _written_leaves(gm, tuple(args)) if written is None else written
    if written:
        mine = [a for a in pytree.tree_leaves(tuple(args)[:own]) if isinstance(a, torch.Tensor)] if own is not None else tensors
        guards.written = written
        guards.shared = runtime.shared_groups(mine, written)
    return written


def _written_leaves(gm: fx.GraphModule, args: tuple) -> tuple:
    """The positions among the tensor leaves of ``args`` (``gm``'s placeholders, in order) of
    those ``gm``'s code may write in place: every leaf of an argument a write's target is
    computed from (through its first operands: views, items), all where that is not known."""
    counts = [sum(isinstance(a, torch.Tensor) for a in pytree.tree_leaves(arg)) for arg in args]
    everything = tuple(range(sum(counts)))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        return everything
    start = {p: sum(counts[:i]) for i, p in enumerate(placeholders)}
    written: set = set()
    for n in gm.graph.nodes:
        for target in _written_by(n):
            base = target
            while isinstance(base, fx.Node) and base.op not in ("placeholder", "get_attr"):
                base = base.args[0] if base.args else None  # a view's, an item's, a write's operand
            if isinstance(base, fx.Node) and base.op == "placeholder":
                i = placeholders.index(base)
                written.update(range(start[base], start[base] + counts[i]))
            elif base is None and not (isinstance(target, fx.Node) and _is_fresh(target)):
                return everything  # cannot tell what it writes
    return tuple(sorted(written))
