"""Values whose shape depends on tensor data: ``x[mask]``, ``masked_select``, ``nonzero``.

``make_fx(tracing_mode="fake")`` traces with a ``ShapeEnv`` that lets such ops run: the inputs
keep their static shapes, and each data-dependent size becomes an *unbacked* SymInt (``u0``),
a symbol with no example value. Ops on those values are recorded as usual; where a size is
needed as an argument (``grad.expand([n, 3])``), the graph reads it back from a tensor with
``aten.sym_size.int``. The generated code therefore runs for any number of selected elements.

This module holds what the pipeline's stages need to carry such symbols along:

- ``reverse`` re-traces the captured graph (the VJP template). A cotangent of an output with a
  data-dependent shape must be a FakeTensor of *that* shape, so the template is traced in the
  capture's own fake mode (``cotangent_example``), and each re-run op producing new symbols is
  tied to the captured ones (``tie``), so that the backward's shapes are those of the forward.
- ``simplify`` compares shapes only where the answer is known without the data
  (``same_shape``); a comparison such as ``u0 == 3`` is not known, and is not a no-op.
- ``fxtools.split`` (and so ``fxtools.compile``) weighs saved tensors in bytes; a data-dependent
  size counts with its largest possible value (``upper_bound``), and the backward reads sizes
  back from the saved tensors. ``fxtools.save`` and ``fxtools.jvp`` work unchanged.
- ``capture`` traces ``torch.combinations`` through (``capture_decompositions``) and specialises
  a tensor that sets a *number of results* to its example value, checked at run time
  (``CountsFromExamples``).

A graph without data-dependent ops never meets any of this: its shapes stay plain integers.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .nodes import is_input_leaf


def _unbacked(val) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return bool(free_unbacked_symbols(val))
    except Exception:  # noqa: BLE001 - values that hold no sizes
        return False


def symbolic_mode(vals):
    """The fake mode of the first of ``vals`` with a symbolic size marked dynamic (``signature/sizes.py``),
    else None. Data-dependent sizes of inputs do not count: those stand-ins are made as before."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for val in vals:
        if isinstance(val, torch._subclasses.FakeTensor) and any(
            isinstance(s, torch.SymInt) and not free_unbacked_symbols(s) for s in val.shape
        ):
            return val.fake_mode  # (a size specialised to a number while tracing is still a SymInt)
    return None


def is_dynamic(val) -> bool:
    """Whether a node value (a FakeTensor, a SymInt, or a pytree of them) has data-dependent sizes."""
    if isinstance(val, torch.Tensor) and _static(val):
        return False  # most values: no symbol to look for
    return any(_unbacked(v) for v in pytree.tree_leaves(val) if isinstance(v, (torch.Tensor, torch.SymInt)))


def _static(t: torch.Tensor) -> bool:
    """Whether ``t``'s sizes, strides and offset are all plain numbers (where symbols would be)."""
    try:
        if t.layout != torch.strided:
            return False  # sparse: asked the long way
        return type(t.storage_offset()) is int and all(type(s) is int for s in (*t.shape, *t.stride()))
    except Exception:  # noqa: BLE001 - a tensor without strides or storage: asked the long way
        return False


def dynamic_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` whose value has a data-dependent size, in graph order."""
    return [n for n in gm.graph.nodes if is_dynamic(n.meta.get("val"))]


def cotangent_example(val, fake_mode=None):
    """An example cotangent for an output of value ``val`` (a FakeTensor).

    Static shapes give a real zero tensor, as always. A data-dependent shape, or any shape when
    sizes were marked dynamic (``fake_mode`` given, see ``signature/sizes.py``), gives an empty FakeTensor
    of the capture's fake mode with the same symbolic sizes, so the template is traced in that
    mode and the cotangent's sizes are the output's.
    """
    if not isinstance(val, torch.Tensor):
        return val
    if fake_mode is None and not _unbacked(val):
        return torch.zeros(val.shape, dtype=val.dtype, device="cpu")
    with fake_mode or val.fake_mode:
        return torch.empty(val.shape, dtype=val.dtype, device=val.device)


def tie(new, old) -> None:
    """Assert that the re-traced ``new`` has the sizes of the captured ``old`` (pytrees of tensors).

    Re-running ``nonzero`` on FakeTensors makes a fresh symbol each time; telling the shape
    environment that it equals the captured one lets the backward mix the two (the cotangent
    and the recomputed value) and lets later passes see that their shapes are equal. Only
    symbols of the same shape environment can be related; elsewhere there is nothing to tie.
    """
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    pairs = []
    for n, o in zip(pytree.tree_leaves(new), pytree.tree_leaves(old)):
        if isinstance(n, torch.Tensor) and isinstance(o, torch.Tensor) and n.dim() == o.dim():
            pairs.extend(zip(n.shape, o.shape))
        elif isinstance(n, torch.SymInt):
            pairs.append((n, o))
    with disable_proxy_modes_tracing():  # a fact for the shape environment, not code to generate
        for a, b in pairs:
            if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.shape_env is b.node.shape_env:
                torch._check(a == b)


def same_shape(a, b) -> bool:
    """``a == b`` for two shapes, where data-dependent sizes count as equal only if provably so."""
    return len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b))


def capture_decompositions() -> dict:
    """Ops to trace through (not keep as one node) when capturing.

    ``combinations`` selects its result internally with ``masked_select``; kept as one node, the
    sizes it makes inside have no graph node to be read from, and tracing fails. Traced through,
    each step is an op with a rule.
    """
    aten = torch.ops.aten
    return {op: op.decompose for op in (aten.combinations.default,)}


def known_true(condition) -> bool:
    """Whether ``condition`` (of ints or symbolic sizes) holds whatever the data, without a new guard."""
    if isinstance(condition, bool):
        return condition
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(condition)


def known_equal(a, b) -> bool:
    """``a == b`` for two sizes, true only if it holds whatever the data (see ``same_shape``)."""
    return known_true(a == b)


def broadcasts_into(a, b) -> bool:
    """Whether shape ``a`` broadcasts to exactly shape ``b``, whatever the data."""
    return len(a) <= len(b) and all(known_equal(x, 1) or known_equal(x, y) for x, y in zip(reversed(a), reversed(b)))


def shape_arg(node: fx.Node, val) -> list:
    """A shape argument for a new node shaped like ``node`` (whose value is ``val``).

    Static: the sizes themselves. Data-dependent: the node's own shape argument, whose sizes are
    graph nodes (a SymInt object in an argument would not be code).
    """
    return list(val.shape) if not is_dynamic(val) else list(node.args[1])


class CountsFromExamples(TorchFunctionMode):
    """While capturing: a tensor that sets *how many* results a call has takes its example value.

    ``torch.tensor_split(x, sections)`` with a 0-d tensor ``sections`` returns ``sections``
    tensors: no graph can return a data-dependent number of values. As shapes and Python numbers
    are, that count is specialised to the example (``fakes[i]`` traces ``reals[i]``), and the
    generated code asserts at run time that ``sections`` still has that value.
    """

    def __init__(self, fakes, reals):
        super().__init__()
        self.real_of = {id(f): r for f, r in zip(fakes, reals)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor_split, torch.Tensor.tensor_split):
            out = self._tensor_split(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)

    def _tensor_split(self, input, sections, dim=0):
        real = self.real_of.get(id(sections)) if isinstance(sections, torch.Tensor) else None
        if real is None or real.dim() != 0 or real.dtype != torch.int64:
            return NotImplemented
        n = int(real)
        torch._assert_async(
            sections == n,
            f"tensor_split: fxtools specialised the number of sections to the example's {n}; this call has a different number",
        )
        return torch.tensor_split(input, n, dim)


def upper_bound(n) -> int:
    """``n``, or for a data-dependent size the largest value it can take (what a memory estimate
    must assume); a size with no known bound counts as 1."""
    if not isinstance(n, torch.SymInt):
        return int(n)
    node = n.node
    try:
        upper = node.shape_env.bound_sympy(node.expr).upper
        return int(upper) if upper.is_finite else 1
    except Exception:  # noqa: BLE001 - an expression the shape environment cannot bound
        return 1


def materialize(graph: fx.Graph, before: fx.Node, args, inputs_only=False):
    """``args`` (a pytree) with each symbolic size replaced by a graph node computing it.

    A pass that builds a node from a value's shape (``x.new_ones(list(v.shape))``) meets SymInt
    objects where sizes are symbolic (marked dynamic, ``signature/sizes.py``); code needs nodes. A size
    some node before ``before`` already holds is reused; a plain symbol is read from the first
    tensor having it as a size (``x.size(0)``); a product or sum is built from its parts.
    ``inputs_only``: read sizes from the inputs only (``sizes_from_inputs``).
    """
    if not any(isinstance(a, torch.SymInt) for a in pytree.tree_leaves(args)):
        return args
    return pytree.tree_map(_SizeWriter(graph, before, inputs_only).convert, args)


def _size_key(size: torch.SymInt):
    """The sympy expression of ``size``, with the shape environment's replacements applied."""
    return size.node.shape_env.replace(size.node.expr) if size.node.shape_env is not None else size.node.expr


class _SizeWriter:
    """Writes symbolic sizes as nodes inserted before ``before`` (see ``materialize``).

    ``found`` maps an expression to the node holding it, and ``("size", symbol)`` to the first
    ``(tensor node, dim, size)`` having that symbol as a size.
    """

    def __init__(self, graph: fx.Graph, before: fx.Node, inputs_only: bool):
        self.graph, self.before = graph, before
        self.found: dict = {}
        for node in graph.nodes:
            if node is before or inputs_only:
                break
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt):
                self.found.setdefault(_size_key(val), node)
        for node in graph.nodes:  # sizes of tensors, read with x.size(d) when needed
            if node is before:
                break
            if inputs_only and not is_input_leaf(node):
                continue
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and not isinstance(val, torch.nn.Parameter):
                for d, size in enumerate(val.shape):
                    if isinstance(size, torch.SymInt) and _size_key(size).is_symbol:
                        self.found.setdefault(("size", _size_key(size)), (node, d, size))

    def convert(self, a):
        """``a`` itself, or for a SymInt its number or a node computing it."""
        if not isinstance(a, torch.SymInt):
            return a
        expr = _size_key(a)
        return int(expr) if expr.is_Integer else self.build(expr)

    def build(self, expr):
        """A node (or number) computing ``expr``: a size read, or arithmetic of its parts."""
        import sympy
        from torch.utils._sympy.functions import FloorDiv, PythonMod

        found = self.found
        if expr in found and isinstance(found[expr], fx.Node):
            return found[expr]
        if expr.is_Integer:
            return int(expr)
        if expr.is_symbol and ("size", expr) in found:
            source, d, size = found[("size", expr)]
            node = self._call(torch.ops.aten.sym_size.int, (source, d), size)
        elif isinstance(expr, (sympy.Mul, sympy.Add)):
            op = operator.mul if isinstance(expr, sympy.Mul) else operator.add
            parts = sorted((self.build(a) for a in expr.args), key=lambda p: isinstance(p, int))  # batch * 4
            node = parts[0]
            for part in parts[1:]:
                node = self._call(op, (node, part), op(_val_of(node), _val_of(part)))
        elif isinstance(expr, (FloorDiv, PythonMod)):  # sizes of reshape(-1, 12) and the like
            op = operator.floordiv if isinstance(expr, FloorDiv) else operator.mod
            a, b = (self.build(e) for e in expr.args)
            node = self._call(op, (a, b), op(_val_of(a), _val_of(b)))
        else:
            raise _Unwritable(expr)
        found[expr] = node
        return node

    def _call(self, target, args, val) -> fx.Node:
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(target, args)
        node.meta["val"] = val
        return node


class _Unwritable(NotImplementedError):
    """A size expression materialize cannot spell as code (FloorDiv, Max, ...)."""

    def __init__(self, expr):
        super().__init__(f"fxtools cannot write the size {expr} as code")


def sizes_from_inputs(gm: fx.GraphModule) -> bool:
    """Compute every symbolic size from the inputs' sizes: ``pow_1.numel()`` -> ``batch * 4``.

    Tracing reads a size from whatever tensor is at hand (a mean's backward takes the numel of
    its input), which keeps that tensor alive and hides what the size is. Sizes marked dynamic
    are sizes of the inputs, so each is rewritten as arithmetic of ``x.size(d)`` reads of input
    tensors; data-dependent sizes (``u0``) stay as they are.
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    graph, changed = gm.graph, False
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.SymInt) or free_unbacked_symbols(val):
            continue
        if node.target is torch.ops.aten.sym_size.int and is_input_leaf(node.args[0]):
            continue
        try:
            new = materialize(graph, node, val, inputs_only=True)
        except _Unwritable:
            continue
        if new is not node:
            node.replace_all_uses_with(new)
            changed = True
    return changed


def _val_of(x):
    return x.meta["val"] if isinstance(x, fx.Node) else x
