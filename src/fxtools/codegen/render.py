"""Render ATen graphs with PyTorch's public names, so ``gm.code`` reads like user code.

``torch.ops.aten.mul.Tensor(a, b)`` becomes ``a * b``, ``aten.sin.default(x)`` becomes
``torch.sin(x)``, ``aten.view.default(x, [2, 3])`` becomes ``x.view([2, 3])`` and
``aten.linear.default(x, w, b)`` becomes ``torch.nn.functional.linear(x, w, b)``. Arguments
equal to their schema default are dropped. An op is only renamed to a public function whose
behaviour on those arguments is the op itself; anything else keeps its ``torch.ops.aten`` name.

Last, ``check_code_data`` makes sure the code holds no text from user data other than
identifiers and plain built-in literals (see ``signature/naming.py``).
"""

from __future__ import annotations

import inspect
import operator
import sys
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ..errors import FxtoolsError
from ..graph import meta
from ..graph.nodes import is_input_leaf
from ..passes.complex_scatters import complex_scatters_on_real_views
from ..passes.subgraphs import name_subgraph_inputs, subgraphs
from ..signature.naming import SHADOWS, is_plain_identifier, plain_literal, repr_safe
from .pycode import use_readable_code

aten = torch.ops.aten

_OPERATORS = {
    aten.add.Tensor: operator.add,
    aten.sub.Tensor: operator.sub,
    aten.mul.Tensor: operator.mul,
    aten.div.Tensor: operator.truediv,
    aten.matmul.default: operator.matmul,
    aten.pow.Tensor_Scalar: operator.pow,
    aten.pow.Tensor_Tensor: operator.pow,
    aten.neg.default: operator.neg,
    aten.eq.Tensor: operator.eq,
    aten.eq.Scalar: operator.eq,
    aten.ne.Tensor: operator.ne,
    aten.ne.Scalar: operator.ne,
    aten.lt.Tensor: operator.lt,
    aten.lt.Scalar: operator.lt,
    aten.le.Tensor: operator.le,
    aten.le.Scalar: operator.le,
    aten.gt.Tensor: operator.gt,
    aten.gt.Scalar: operator.gt,
    aten.ge.Tensor: operator.ge,
    aten.ge.Scalar: operator.ge,
    aten.bitwise_not.default: operator.invert,
    aten.remainder.Tensor: operator.mod,
    aten.remainder.Scalar: operator.mod,
    aten.__and__.Tensor: operator.and_,
    aten.__or__.Tensor: operator.or_,
    aten.__xor__.Tensor: operator.xor,
    aten.bitwise_and.Tensor: operator.and_,
    aten.bitwise_or.Tensor: operator.or_,
}
_SWAPPED = {aten.rsub.Scalar: operator.sub, aten.rsub.Tensor: operator.sub}  # rsub(x, c) is c - x
_METHODS = {
    aten.view.default: "view",
    aten.expand.default: "expand",
    aten.contiguous.default: "contiguous",
    aten._unsafe_view.default: "reshape",
    aten.to.dtype: "to",
    aten._to_copy.default: "to",
    aten.type_as.default: "type_as",
    aten.new_zeros.default: "new_zeros",
    aten.new_ones.default: "new_ones",
    aten.new_full.default: "new_full",
    aten.new_empty.default: "new_empty",
    aten.expand_as.default: "expand_as",
    aten.view_as.default: "view_as",
    aten.repeat.default: "repeat",
    aten.unflatten.int: "unflatten",
    aten.split.Tensor: "split",
    aten.split_with_sizes.default: "split",
    aten._conj.default: "conj",  # the lazy conjugate that Tensor.conj() of a complex tensor is
    # sizes and values read back from tensors when they depend on the data (graph/data_dependent.py)
    aten.sym_size.int: "size",
    aten.sym_numel.default: "numel",
    aten._local_scalar_dense.default: "item",
}
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # at::Reduction as torch.nn.functional spells it
_REORDERED = {  # aten op -> (public function, positions of the aten arguments in the call)
    aten.embedding.default: (F.embedding, (1, 0)),
}
_NAMESPACES = (torch, F, torch.special, torch.linalg, torch.fft)


_ENUM_DEFAULTS = {"reduction"}  # the Python bindings' default differs from the schema's (at::Reduction::Mean)
_NOISE = {"pin_memory": (False, None), "layout": (torch.strided, None)}


class _Schema:
    """What code generation reads of an op's schema, read once per op (a schema's arguments are
    made anew by each ``op._schema.arguments``): the arguments, their defaults, those written by
    position (see the comment at ``_none_in_optional_tensor_list``) and those of type ``Tensor?[]``."""

    __slots__ = ("arguments", "defaults", "op", "optional_tensor_lists", "positional")

    def __init__(self, op: torch._ops.OpOverload):
        self.op = op
        self.arguments = op._schema.arguments
        self.defaults = {a.name: a.default_value for a in self.arguments if a.has_default_value()}
        self.positional = [a.name for a in self.arguments if not a.kwarg_only and not a.has_default_value()]
        self.optional_tensor_lists = frozenset(a.name for a in self.arguments if str(a.type) == "List[Optional[Tensor]]")


_SCHEMAS: dict[int, _Schema] = {}  # id(op) -> its _Schema


def _schema_of(op: torch._ops.OpOverload) -> _Schema:
    found = _SCHEMAS.get(id(op))
    if found is None or found.op is not op:
        found = _SCHEMAS[id(op)] = _Schema(op)
    return found


def _schema_args(op: torch._ops.OpOverload, args, kwargs):
    """Arguments as (name, value) pairs in schema order, dropping trailing ones equal to their default."""
    read = _schema_of(op)
    schema = read.arguments
    pairs = [(a.name, v) for a, v in zip(schema, args)]
    pairs += [
        (a.name, kwargs[a.name] if a.name in kwargs else a.default_value)
        for a in schema[len(args) :]
        if a.name in kwargs or a.name in _ENUM_DEFAULTS
    ]
    defaults = read.defaults
    return [
        (n, v)
        for n, v in pairs
        if not (n in defaults and _equal(v, defaults[n]) and n not in _ENUM_DEFAULTS)
        and not (n in _NOISE and any(v is x for x in _NOISE[n]))
    ], schema


def _equal(v, d) -> bool:
    """Whether argument ``v`` is its schema default ``d`` (then it is left out of the call).

    Only Python values can be defaults: a node or a tensor never is; a size not known until run
    time (an unbacked symbol) is not known to be one, so it is printed."""
    if isinstance(v, (fx.Node, torch.Tensor)) or isinstance(d, (fx.Node, torch.Tensor)):
        return False
    try:
        return bool(
            (type(v) is type(d) and v == d)
            or (v is None and d is None)
            or (isinstance(v, (int, float)) and isinstance(d, (int, float)) and not isinstance(v, bool) and v == d)
        )
    except GuardOnDataDependentSymNode:
        return False


_ALIASES: dict = {}


def public_alias(fn, namespace, name):
    """``fn`` as FX will print it: ``torch.nn.functional.linear`` rather than ``torch._C._nn.linear``.

    FX prints a torch function by its ``__module__``; builtins often live in private modules.
    The alias only carries the public name: the generated code calls the public function itself.
    """
    module = namespace.__name__
    if getattr(fn, "__module__", None) == module and getattr(fn, "__name__", None) == name:
        return fn
    key = (module, name)
    if key not in _ALIASES:

        def alias(*args, **kwargs):
            return fn(*args, **kwargs)

        alias.__module__, alias.__name__, alias.__qualname__ = module, name, name
        _ALIASES[key] = alias
    return _ALIASES[key]


_RENAMED = {"cross_entropy_loss": (F, "cross_entropy"), "nll_loss_nd": (F, "nll_loss"), "layer_norm": (F, "layer_norm")}
_PREFIXED = (("linalg_", torch.linalg), ("special_", torch.special), ("fft_", torch.fft))


_PUBLIC: dict[int, tuple] = {}  # id(op) -> (op, _public_function's answer)


def _public_function(op: torch._ops.OpOverload):
    """(function, namespace, name) of the public function named like ``op``, or None (looked up once per op)."""
    found = _PUBLIC.get(id(op))
    if found is None or found[0] is not op:
        found = _PUBLIC[id(op)] = (op, _find_public_function(op))
    return found[1]


def _find_public_function(op: torch._ops.OpOverload):
    name = op.overloadpacket.__name__
    if name in _RENAMED:
        ns, attr = _RENAMED[name]
        return getattr(ns, attr), ns, attr
    candidates = [(ns, name) for ns in _NAMESPACES]
    candidates = [(ns, name[len(prefix) :]) for prefix, ns in _PREFIXED if name.startswith(prefix)] + candidates
    for ns, attr in candidates:
        fn = getattr(ns, attr, None)
        if fn is None or not callable(fn) or isinstance(fn, type):
            continue
        if not inspect.isbuiltin(fn) and getattr(fn, "__module__", "").startswith(("torch._refs", "torch._decomp")):
            continue
        return fn, ns, attr
    return None


_SIGNATURES: dict[int, tuple] = {}  # id(fn) -> (fn, _python_signature's answer)


def _python_signature(fn):
    """Parameters of a Python function; None for builtins (whose arguments follow the ATen schema).
    Read once per function (``inspect.signature`` is slow); the caller only reads the dict."""
    found = _SIGNATURES.get(id(fn))
    if found is None or found[0] is not fn:
        found = _SIGNATURES[id(fn)] = (fn, _read_signature(fn))
    return found[1]


def _read_signature(fn):
    if inspect.isbuiltin(fn):
        return None
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _call(op, args, kwargs):
    """(kind, target, args, kwargs) for the public spelling of ``op(*args, **kwargs)``, or None."""
    if op in _OPERATORS and not kwargs and (op is not aten.div.Tensor or len(args) == 2):
        if op is aten.add.Tensor or op is aten.sub.Tensor:
            if len(args) > 2:
                return None
        return "call_function", _OPERATORS[op], args, {}
    if op in _SWAPPED and len(args) == 2 and not kwargs:
        return "call_function", _SWAPPED[op], (args[1], args[0]), {}
    pairs, schema = _schema_args(op, args, kwargs)
    if op in _METHODS:
        return _split("call_method", _METHODS[op], pairs, _schema_of(op).positional)
    if _none_in_optional_tensor_list(_schema_of(op), pairs):
        return None  # torch.index_put(x, [None, i], v) is rejected by the Python binding
    positional = _schema_of(op).positional
    name = op.overloadpacket.__name__
    if name.endswith("_") and not name.startswith("_") and schema and schema[0].is_write and hasattr(torch.Tensor, name):
        return _split("call_method", name, pairs, positional)  # a kept in-place update: buffer.add_(1)
    if op is aten.einsum.default and len(args) == 2 and not kwargs:
        return "call_function", public_alias(torch.einsum, torch, "einsum"), (args[0], *args[1]), {}
    if op in _REORDERED:
        fn, order = _REORDERED[op]
        if len(args) <= len(order) and not kwargs:
            return "call_function", public_alias(fn, F, fn.__name__), tuple(args[i] for i in order if i < len(args)), {}
        return None
    if op.overloadpacket.__name__.startswith("_"):
        return None
    found = _public_function(op)
    if found is None:
        return None
    fn, namespace, name = found
    target = public_alias(fn, namespace, name)
    params = _python_signature(fn)
    if params is None:  # a builtin bound to native_functions.yaml: it takes the schema's arguments
        return _split("call_function", target, pairs, positional)
    return _python_call(target, params, pairs, schema)


def _python_call(target, params, pairs, schema):
    """Call a Python-level public function (``F.silu``) only where the arguments surely mean the same.

    The first argument (``self``/``input``) is passed by position; every other one must be a
    parameter of the same name whose default has the same type (``reduction`` is an int in ATen
    but a string in ``torch.nn.functional``, so such calls keep the ATen op).
    """
    if not pairs or pairs[0][0] != schema[0].name:
        return None
    kwargs = {}
    for name, value in pairs[1:]:
        p = params.get(name)
        if p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return None
        default = p.default
        if name == "reduction" and isinstance(value, int) and isinstance(default, str):
            if value not in _REDUCTIONS:
                return None
            value = _REDUCTIONS[value]
            if value == default:
                continue
        if default is not inspect.Parameter.empty and default is not None and value is not None:
            numeric = (int, float)
            same = type(value) is type(default) or (
                isinstance(value, numeric)
                and isinstance(default, numeric)
                and not isinstance(value, bool)
                and not isinstance(default, bool)
            )
            if not same:
                return None
        kwargs[name] = value
    order = list(params)
    if params[order[0]].kind is inspect.Parameter.VAR_POSITIONAL:  # torch.broadcast_tensors(*tensors): the list spread
        return ("call_function", target, tuple(pairs[0][1]), kwargs) if isinstance(pairs[0][1], (list, tuple)) else None
    args = [pairs[0][1]]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for name in list(kwargs):
        # only parameters that may be passed by position (torch.meshgrid's indexing is keyword-only)
        if (
            len(args) < len(order)
            and order[len(args)] == name
            and params[name].kind in positional
            and params[name].default is inspect.Parameter.empty  # options by keyword, as in _split
            and params[order[0]].kind in positional
        ):
            args.append(kwargs.pop(name))
        else:
            break
    return "call_function", target, tuple(args), kwargs


def _none_in_optional_tensor_list(schema: _Schema, pairs) -> bool:
    """Whether a ``Tensor?[]`` argument (``index``'s indices) holds a None: only the ATen op accepts it."""
    lists = schema.optional_tensor_lists
    return bool(lists) and any(n in lists and isinstance(v, (list, tuple)) and any(i is None for i in v) for n, v in pairs)


# Arguments written by position (``_Schema.positional``): the schema's required ones. Those with a
# default (options such as ``keepdim``, ``stride``, ``dim=0``) are written by keyword, so that every
# call of a function reads in one style whichever defaults were dropped: ``torch.sum(x, [1], keepdim=True)``.


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
    """Rewrite ``gm``'s graph in place to call public PyTorch functions, operators and methods.

    The caller recompiles ``gm`` (once, after its last pass).
    """
    _devices_from_inputs(gm)
    _layer_norms_without_statistics(gm)
    complex_scatters_on_real_views(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if _as_subscript(node) or _as_narrow(node):
            continue
        spelled = _call(node.target, node.args, node.kwargs)
        if spelled is None:
            continue
        kind, target, args, kwargs = spelled
        node.op, node.target = kind, target
        _set_arguments(node, args, kwargs)
    check_code_data(gm)
    use_readable_code(gm.graph)
    name_subgraph_inputs(gm)
    for sub in subgraphs(gm):  # control flow's functions
        render(sub)
        sub.recompile()
    return gm


_TORCH_CONSTANTS = (
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch._ops.OpOverload,
    torch._ops.HigherOrderOperator,
    type(...),
)


def _code_value(value, where: str):
    """``value`` as torch.fx may print it: nodes, plain literals, torch constants, containers of
    them (subclasses of built-in types and numpy scalars converted, everything else refused)."""
    if isinstance(value, (fx.Node, *_TORCH_CONSTANTS)):
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # fx prints its items with repr
        items = [_code_value(v, where) for v in value]
        if not repr_safe(items):
            raise FxtoolsError(f"{where} holds a {type(value).__qualname__} of values fxtools cannot print")
        return type(value)(*items)
    if isinstance(value, (tuple, list)):  # fx's immutable_list, torch.Size, torch.return_types
        items = [_code_value(v, where) for v in value]
        if hasattr(type(value), "n_fields"):
            return type(value)(items)
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):  # fx prints it with repr
        items = {plain_literal(k, f"a dict key in {where}"): _code_value(v, where) for k, v in value.items()}
        if not repr_safe(items):
            raise FxtoolsError(f"{where} holds a dict of values fxtools cannot print")
        return items
    if isinstance(value, slice):
        return slice(*(_code_value(v, where) for v in (value.start, value.stop, value.step)))
    if isinstance(value, range):
        return range(*(plain_literal(v, where) for v in (value.start, value.stop, value.step)))
    return plain_literal(value, where)


def check_code_data(gm) -> None:
    """Make every constant in ``gm``'s graph a plain literal and check every name it writes.

    fx prints constants with ``repr``: a ``str`` subclass with its own ``__repr__`` would put
    arbitrary code into ``gm.code``. Names (arguments, attributes, methods) must be identifiers
    in normal form (Python reads ``self.ﬁ`` as ``self.fi``) that shadow nothing the code uses.
    Takes a GraphModule or a Graph.
    """
    for node in getattr(gm, "graph", gm).nodes:
        where = f"a constant of {node.name} in the generated code"
        if node.op == "placeholder":
            if not is_plain_identifier(node.target.lstrip("*")) or node.target.lstrip("*") in SHADOWS:
                raise FxtoolsError(f"cannot name an argument {node.target!r} in generated code")
        elif node.op in ("get_attr", "call_module"):
            if not all(is_plain_identifier(part) and part != "self" for part in node.target.split(".")):
                raise FxtoolsError(f"cannot write the attribute name {node.target!r} in generated code")
        elif node.op == "call_method" and not is_plain_identifier(node.target):
            raise FxtoolsError(f"cannot write the method name {node.target!r} in generated code")
        if node.op != "placeholder":
            kwargs = {plain_literal(k, where): _code_value(v, where) for k, v in node.kwargs.items()}
            _set_arguments(node, _code_value(tuple(node.args), where), kwargs)


def _set_arguments(node: fx.Node, args: tuple, kwargs: dict) -> None:
    """``node.args, node.kwargs = args, kwargs``, unless the node holds them already, with its
    inputs listed in their order (setting them re-registers every input: a tenth of code
    generation when done for every node; and ``replace_all_uses_with`` lists a replaced input
    last, which setting puts back in order, for the code generator's frees and views)."""
    if _same(node.args, args) and _same(node.kwargs, kwargs):
        inputs: dict = {}
        fx.node.map_arg((args, kwargs), inputs.setdefault)
        if list(inputs) == node.all_input_nodes:
            return
    node.args, node.kwargs = args, kwargs


def _same(old, new) -> bool:
    """Whether ``node.args = new`` (or ``kwargs``) would store what ``old`` is: the same objects,
    in containers of the same kinds (fx stores a list as its ``immutable_list``)."""
    if old is new:
        return True
    if type(new) is list:
        same_kind = type(old) in (list, fx.immutable_collections.immutable_list)
    elif type(new) is dict:
        same_kind = type(old) in (dict, fx.immutable_collections.immutable_dict)
        return same_kind and list(old) == list(new) and all(_same(old[k], new[k]) for k in new)
    else:
        same_kind = isinstance(new, tuple) and type(old) is type(new)
    return same_kind and len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new))


def _devices_from_inputs(gm: fx.GraphModule) -> None:
    """``device=device(type='cpu')`` in factories -> ``device=x.device`` for an input ``x`` on it.

    Tracing turns ``torch.arange(n, device=idx.device)`` into a constant device; reading it from
    an input again keeps the code readable and lets it run wherever its inputs are.
    """
    inputs = [n for n in gm.graph.nodes if is_input_leaf(n)]
    found: dict = {}
    for node in list(gm.graph.nodes):
        device = node.kwargs.get("device") if node.op == "call_function" else None
        if not isinstance(device, torch.device):
            continue
        if device not in found:
            source = next(
                (n for n in inputs if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].device == device), None
            )
            if source is None:
                found[device] = None
                continue
            with gm.graph.inserting_after(source):
                found[device] = gm.graph.call_function(getattr, (source, "device"))
            found[device]._rename(f"{source.name}_device")
            if meta.PART.on(node):  # the part of the program its first reader is in (fxtools.draw)
                meta.PART.set(found[device], meta.PART.get(node))
        if found[device] is not None:
            node.kwargs = {**node.kwargs, "device": found[device]}


def _as_narrow(node: fx.Node) -> bool:
    """``aten.slice(x, dim, start, end)`` (step 1, static sizes) -> ``x.narrow(dim, start, length)``,
    which is that slice (``torch.ops.aten.slice.Tensor`` has no public spelling as a call)."""
    if node.target is not torch.ops.aten.slice.Tensor or node.kwargs:
        return False
    parts: list[Any] = [*node.args, *(0, None, None, 1)[len(node.args) - 1 :]]
    x, dim, start, end, step = parts[:5]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(dim, int):
        return False
    if step != 1:
        return _as_slice_subscript(node, x, dim % val.dim(), start, end, step)
    if not isinstance(start or 0, int):
        return False
    size = val.shape[dim]
    if not isinstance(size, int):  # x[1:3] at every size: Python's slicing is aten.slice's
        return _as_slice_subscript(node, x, dim % val.dim(), start, end, step)
    if not (end is None or isinstance(end, int)):
        return False
    start = start or 0
    start = max(start + size, 0) if start < 0 else min(start, size)
    end = size if end is None else max(end + size, 0) if end < 0 else min(end, size)
    node.op, node.target, node.args = "call_method", "narrow", (x, dim, start, max(end - start, 0))
    return True


def _as_slice_subscript(node: fx.Node, x: fx.Node, dim: int, start, end, step) -> bool:
    """``aten.slice(x, 1, 0, end, 2)`` -> ``x[:, ::2]``: a slice with a step, or of a symbolic size,
    as Python writes it (bounds as Python's slicing reads them; an ``end`` past any size is left out)."""
    if not all(v is None or type(v) is int for v in (start, end, step)):
        return False
    end = None if end is not None and end >= sys.maxsize else end
    node.target = operator.getitem
    node.args = (x, (*(slice(None),) * dim, slice(start or None, end, step)))
    return True


def _layer_norms_without_statistics(gm: fx.GraphModule) -> None:
    """``out, _, _ = torch.native_layer_norm(x, ...)`` -> ``out = F.layer_norm(x, ...)`` where nothing
    reads the mean and reciprocal standard deviation: the same kernel (``aten.layer_norm`` calls
    ``native_layer_norm``), written as users write it."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.native_layer_norm.default or node.kwargs:
            continue
        users = list(node.users)
        if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0:
            continue
        part = users[0]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(aten.layer_norm.default, tuple(node.args))
        new.meta = {**part.meta}
        part.replace_all_uses_with(new)
        name = part.name
        gm.graph.erase_node(part)
        gm.graph.erase_node(node)
        new.name = name  # the erased part's name: unique, and still reserved in the namespace


def _number_like(index) -> bool:
    """A 0-dim integer index tensor: PyTorch's ``x[t]`` reads it as a number (``t.item()``), which a
    graph interpreted on FakeTensors (``fxtools.to_aten``) cannot; ``aten.index`` never reads it."""
    val = index.meta.get("val") if isinstance(index, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype not in (torch.bool, torch.uint8)


def _as_subscript(node: fx.Node) -> bool:
    """``aten.index(x, [mask])`` -> ``x[mask]``, ``aten.index(x, [i, j])`` -> ``x[i, j]``,
    ``aten.index(x, [None, t])`` -> ``x[:, t]``: advanced indexing is what a subscript spells
    (``codegen/pycode.py`` prints the full slices as ``:``)."""
    if node.target is not torch.ops.aten.index.Tensor or len(node.args) != 2 or node.kwargs:
        return False
    x, indices = node.args
    if not indices or not all(isinstance(i, fx.Node) or i is None for i in indices):
        return False
    if not any(isinstance(i, fx.Node) for i in indices):
        return False
    if any(_number_like(i) for i in indices):
        return False  # a 0-dim integer index: printed as a subscript, kept aten.index (codegen/pycode.py)
    node.target = operator.getitem
    entries = tuple(slice(None) if i is None else i for i in indices)
    node.args = (x, entries[0] if len(entries) == 1 else entries)
    return True
