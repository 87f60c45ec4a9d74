"""Guards: every generated module checks on entry that it was made for the arguments it is given.

fxtools specialises the code it generates to the example arguments: the pytree structure, each
tensor's sizes, dtype and device type, and the value of each Python number, string or flag are
constants in the code (a mean over a batch of 32 multiplies by ``1/32``). Called with anything
else, the code would silently compute something else. So every module refuses, with one error
type (``fxtools.InputMismatch``, a ``ValueError``), any argument that differs from what it was
made for, naming the argument by its path (``params['fc1.weight']``, ``x``, ``grad_out[0]``),
what the module was made for, what it got, and how to get a module that accepts it.

Where the checks live
---------------------
Not in the code: ``gm.code`` is exactly the derivative, as before. The checks are data,
``gm.guards`` (a ``Guards``; ``print(gm.guards)`` lists what the module accepts), and the
module's class (``GuardedGraphModule``, a ``torch.fx.GraphModule``) checks them in ``__call__``
before running ``forward``. So ``gm(*args)`` is checked; ``gm.forward(*args)`` runs the bare
code (``fxtools.compile`` calls it so, after choosing its graphs by these same guards). Guards
survive ``copy.deepcopy`` and ``torch.save`` (loading then needs fxtools). ``fxtools.save``
writes the same data and the same checking code (the "runtime" part of this file, copied
verbatim) into the module it writes, after the derivative code: its ``forward`` starts with one
line, ``forward_accepts.check((params, x, y))``, and the written module still needs only torch
(it raises its own ``InputMismatch(ValueError)``).

The data (the interface for symbolic sizes)
-------------------------------------------
``Guards(made_by, names, args)``: ``names`` are the positional arguments' names, ``args`` one
spec per positional argument. A spec is a ``Node`` (a container: ``kind`` "dict" / "list" /
"tuple" / "attrs", ``type_name``, ``keys``, ``children``; a dict must have exactly these keys,
in any order; "attrs" is a namedtuple, dataclass or other class read by attribute) or a
``Leaf``:

- ``path``: how messages name it, ``"params['fc1.weight']"``;
- ``kind``: ``"tensor"``, ``"optional"`` (None, or a tensor as for "tensor": the cotangent of
  a floating-point output with no gradient path, which the code ignores), ``"scalar"`` (a Python value compared by value: ints, bools, strings,
  dtypes, floats bitwise, so ``-0.0 != 0.0`` and NaN equals NaN), ``"none"`` (must be None),
  ``"state"`` (a plain object, such as a config, whose attributes are built-in values: its class
  name and attributes, as ``_snapshot`` gives them, compared as scalars are, so an equal new
  instance is accepted and a changed attribute refused), ``"object"`` (compared with ``==``) or
  ``"type"`` (only the type's name is checked; what ``fxtools.save`` writes for objects it
  cannot spell);
- tensors: ``sizes``, a tuple with per dimension either an ``int`` (that size exactly) or a
  ``Sym(name, min, max)``: any size in ``[min, max]`` (``max=None``: unbounded), and all
  dimensions (of any arguments) with the same ``Sym`` name must be equal at call time;
  ``dtype`` (a ``torch.dtype``), ``device`` (a device *type*, ``"cpu"``, ``"cuda"``: the code
  takes devices from its inputs, so the index is free), ``layout`` (``None``: any strides;
  ``"contiguous"``; or a tuple of strides). A layout is required only when the code has
  ``.view`` / ``as_strided``, which rely on strides (simplify drops a ``.contiguous()`` before
  a ``.view`` when the example was contiguous), and is not checked inside ``torch.func.vmap``,
  where fxtools runs modules with ``.reshape`` instead;
- scalars and objects: ``value``;
- ``role``: for cotangents and tangents, what it must match (``"the cotangent of out[0]"``):
  the message then reads as autograd's for a wrong ``grad_output``.

A module with symbolic sizes replaces entries of ``Leaf.sizes`` by ``Sym``s (in ``gm.guards``,
which every call reads; ``Guards.leaves()`` lists the leaves in placeholder order). Sizes of the
example that are symbols already (a data-dependent output size ``u0``, which a cotangent must
have) become ``Sym("u0", 0, None)``: any size, equal wherever it recurs. A cotangent of such a
size is checked only against the other values of that size, not against the output computed in
the same call.

What the trace decided is checked too (``docs/guards_decisions.md``): ``Guards.conditions`` holds
a ``Cond`` per decision the program made on symbolic sizes (``x.size(0) % 2 == 0``, with the
user's line; built by ``signature/sizes.py``), evaluated on the ``Sym`` values of each call, and
``Leaf.reads`` a ``Read`` per layout fact the program read from that argument
(``capture/layout_reads.py``: ``is_contiguous()``, strides), checked even where ``layout`` is not.
``CHECKING`` names the decision being checked while a module is traced inside another (``hvp``
traces a ``grad`` module), so the outer module keeps it.

``Guards.check(args)`` raises ``InputMismatch`` or returns the tensor leaves in the order of
``torch.utils._pytree.tree_flatten`` of the example (``fxtools.split``'s placeholder order), so
checking and flattening are one walk. ``fxtools.compile`` picks its cached graphs with it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import operator
import sys
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import FxtoolsError
from .naming import literal, plain_literal

__all__ = [
    "InputMismatch",
    "Sym",
    "Cond",
    "Read",
    "Leaf",
    "Node",
    "Guards",
    "GuardedGraphModule",
    "build",
    "install",
    "runtime_source",
    "render",
    "is_scalar",
    "tensor_text",
    "value_text",
    "snapshot_value",
    "same_value",
]


class InputMismatch(FxtoolsError, ValueError):
    """A generated module was called with arguments it was not made for (see ``fxtools.signature.guards``)."""


# ---- runtime (begin): copied verbatim into modules written by fxtools.save; torch and dataclasses only ----


CHECKING: list = []  # where the condition or layout read being checked was decided (innermost last)


@dataclasses.dataclass(frozen=True)
class Sym:
    """A symbolic size: any value in [min, max] (max None: unbounded); equal wherever the name recurs."""

    name: str
    min: int = 0
    max: int | None = None


@dataclasses.dataclass
class Leaf:
    """What one leaf of the arguments must be (see the fxtools.signature.guards docstring)."""

    path: str
    kind: str
    sizes: tuple = ()
    dtype: torch.dtype | None = None
    device: str | None = None
    layout: object = None
    value: object = None
    role: str | None = None
    reads: tuple = ()  # layout facts the program read (Read), checked like ``layout``


@dataclasses.dataclass(frozen=True)
class Cond:
    """A decision the traced program made on symbolic sizes, which every call must repeat.

    ``test`` is Python over ``v0, v1, ...``, the values of the ``Sym``s named ``names``; ``text``
    is the same condition over those names (``x.size(0) % 2 == 0``); ``where`` the user's line
    that decided it."""

    text: str
    test: str
    names: tuple
    where: str

    def holds(self, values) -> bool:
        scope = {f"v{i}": v for i, v in enumerate(values)}
        names = {"__builtins__": {}, "max": max, "min": min, "round": round, "abs": abs, "math": _Math, "torch": torch}
        code = compile(self.test, "<fxtools guard>", "eval")  # (a file name that is not the user's program)
        return bool(eval(code, names, scope))  # noqa: S307 - fxtools' own printed sympy (torch's PythonPrinter)


class _Math:
    """The ``math.*`` functions torch's printer writes into conditions, on ints, floats and SymInts."""

    floor = staticmethod(lambda v: v.__floor__())
    ceil = staticmethod(lambda v: v.__ceil__())
    trunc = staticmethod(lambda v: v.__trunc__())


@dataclasses.dataclass(frozen=True)
class Read:
    """A layout fact the program read from a tensor argument (``x.is_contiguous()``, ``x.stride(0)``).

    ``kind``: "is_contiguous" (``want``: (memory format name, result)), "strides" (``want``: the
    example's strides: the code is exact for exactly these), "dense" (``want``: the dims from the
    outermost to the innermost stride: strides of a dense tensor in that order, whatever the sizes)
    or "storage_offset" (``want``: (the offset,)); ``where`` is the user's line that read it."""

    kind: str
    want: tuple
    where: str

    def holds(self, value) -> bool:
        if self.kind == "is_contiguous":
            fmt, result = self.want
            return value.is_contiguous(memory_format=getattr(torch, fmt)) == result
        if self.kind == "strides":
            return tuple(value.stride()) == tuple(self.want)
        if self.kind == "dense":
            return tuple(value.stride()) == dense_strides(value.shape, self.want)
        return (value.storage_offset(),) == self.want

    def expected(self) -> str:
        if self.kind == "is_contiguous":
            fmt, result = self.want
            return f"is_contiguous({'' if fmt == 'contiguous_format' else 'memory_format=torch.' + fmt}) to be {result}"
        if self.kind == "strides":
            return f"strides {tuple(self.want)}"
        if self.kind == "dense":
            return f"the strides of a dense tensor with dims ordered {tuple(self.want)} (outermost first)"
        return f"storage_offset() {self.want[0]}"


def dense_strides(shape, order):
    """The strides of a dense tensor of ``shape`` whose dims, outermost first, are ``order``."""
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = step
        step *= max(int(shape[d]), 1)
    return tuple(strides)


@dataclasses.dataclass
class Node:
    """A container the module indexes: kind "dict", "list", "tuple" or "attrs"."""

    path: str
    kind: str
    type_name: str
    keys: tuple
    children: tuple


_NO_COTANGENT = (
    "A cotangent may be None only for an output that carries no gradient. To differentiate some outputs "
    "and return others as they are, make the others auxiliary data: fxtools.vjp(f, *args, has_aux=True) "
    "with f returning (out, aux), then out, grads, aux = gm(*args, grad_out)."
)


def _cotangent_below(spec) -> bool:
    if isinstance(spec, Leaf):
        return spec.role is not None and "cotangent" in spec.role
    return any(_cotangent_below(c) for c in spec.children)


_HOW = "Its code is specialised to the arguments it was made for: generate the module again with an example like this one"


def _desc(sizes, dtype=None, device=None):
    text = "[" + ", ".join(s.name if isinstance(s, Sym) else str(s) for s in sizes) + "]"
    return (str(dtype).replace("torch.", "") + text if dtype is not None else text) + (f" on {device}" if device else "")


def _got(value):
    if isinstance(value, torch.Tensor):
        return f"a tensor {_desc(value.shape, value.dtype, value.device.type)}"
    if value is None:
        return "None"
    if isinstance(value, (bool, int, float, complex, str)):
        return f"{type(value).__name__} {value!r}"
    return f"a {type(value).__name__}"


def _snapshot(obj, depth=0):
    """A plain object's state as nested tuples of built-in values (its class name and attributes),
    or None if any part is not plain: two objects whose snapshots are the same give the code the
    same constants (``c.scale`` read while tracing)."""
    if obj is None or type(obj) in (bool, int, float, complex, str):
        return obj
    if depth > 8:
        return None
    if type(obj) in (tuple, list):
        items = tuple(_snapshot(v, depth + 1) for v in obj)
        return None if any(v is None and x is not None for v, x in zip(items, obj)) else (type(obj).__name__, items)
    state = vars(obj) if hasattr(obj, "__dict__") else None  # a user's object: read by introspection
    if type(state) is not dict or callable(obj) or isinstance(obj, type):
        return None
    items = []
    for k in sorted(state, key=str):
        v = _snapshot(state[k], depth + 1)
        if type(k) is not str or (v is None and state[k] is not None):
            return None
        items.append((k, v))
    return (type(obj).__qualname__, tuple(items))


def _same(a, b):
    """Python values as the code saw them: same type, and floats bitwise (NaN == NaN, -0.0 != 0.0)."""
    if type(a) is not type(b) and not (
        isinstance(a, float) and isinstance(b, float) and not isinstance(a, bool) and not isinstance(b, bool)
    ):
        return False
    if isinstance(a, float):
        return (a == b and repr(a) == repr(b)) or (a != a and b != b)  # repr: -0.0 is not 0.0
    if isinstance(a, complex):
        return _same(a.real, b.real) and _same(a.imag, b.imag)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _equal(a, b):
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a truthful ==: not the same
        return False


@dataclasses.dataclass
class Guards:
    """What a generated module accepts: one spec (Node or Leaf) per positional argument."""

    made_by: str
    names: tuple
    args: tuple
    conditions: tuple = ()  # Conds: decisions on symbolic sizes

    def check(self, args, layout=True):
        """Raise InputMismatch unless ``args`` (a tuple) is what the module was made for;
        return the tensor leaves, in pytree flattening order."""
        if len(args) != len(self.args):
            self.fail(
                f"it takes {len(self.args)} argument{'s' if len(self.args) != 1 else ''} "
                f"({', '.join(self.names)}), got {len(args)}",
                f"Call it with exactly the arguments it was made for, gm({', '.join(self.names)}): the "
                "function's own, then the cotangents or tangents, if any.",
            )
        tensors, bound = [], {}
        for spec, value in zip(self.args, args):
            self._walk(spec, value, tensors, bound, layout)
        for cond in self.conditions:
            CHECKING.append(cond.where)  # a module traced inside another (hvp): its decisions carry over
            try:
                if all(n in bound for n in cond.names) and not cond.holds([bound[n][0] for n in cond.names]):
                    self._cond_fail(cond, bound)
            finally:
                CHECKING.pop()
        return tensors

    def _cond_fail(self, cond, bound):
        got = ", ".join(
            f"{n} is {bound[n][0]}"
            if n == f"{bound[n][1]}.size({bound[n][2]})"
            else f"{n} ({bound[n][1]}.size({bound[n][2]})) is {bound[n][0]}"
            for n in cond.names
        )
        self.fail(
            f"{got}, but the module was made for sizes where {cond.text} ({cond.where}); its code holds only there",
            "Pass sizes related as dynamic_shapes declares."
            if cond.where.startswith("declared")
            else "Generate a module from an example on this side of the condition (one module per side), "
            "or write the program without a Python decision on this size.",
        )

    def _narrowed_by(self, name, got):
        """The recorded decision on the size ``name`` alone that ``got`` contradicts, if any."""
        return next((c for c in self.conditions if c.names == (name,) and not c.holds([got])), None)

    def fail(self, problem, fix=None):
        raise InputMismatch(f"{self.made_by} module: {problem}. {fix or _HOW + '.'}")

    def _walk(self, spec, value, tensors, bound, layout):
        """Check ``value`` against ``spec`` (a Leaf or a Node), appending its tensors to ``tensors``
        and recording in ``bound`` the dynamic sizes it gives (their value and where it is)."""
        if type(spec) is not Leaf:
            self._container(spec, value, tensors, bound, layout)
        elif spec.kind == "tensor" or (spec.kind == "optional" and value is not None):
            self._tensor(spec, value, bound, layout)
            tensors.append(value)
        else:
            self._constant(spec, value)

    def _container(self, spec, value, tensors, bound, layout):
        """A dict, list, tuple or dataclass-like object of the example's structure; its items walked."""
        kind = spec.kind
        if kind == "dict":
            if not isinstance(value, dict):
                self._node_fail(spec, value)
            if len(value) != len(spec.keys) or any(k not in value for k in spec.keys):
                self._node_fail(spec, value)
            for k, child in zip(spec.keys, spec.children):
                self._walk(child, value[k], tensors, bound, layout)
        elif kind == "list" or kind == "tuple":
            if not isinstance(value, list if kind == "list" else tuple) or len(value) != len(spec.children):
                self._node_fail(spec, value)
            for v, child in zip(value, spec.children):
                self._walk(child, v, tensors, bound, layout)
        else:
            if type(value).__name__ != spec.type_name:
                self._node_fail(spec, value)
            for k, child in zip(spec.keys, spec.children):
                self._walk(child, getattr(value, k), tensors, bound, layout)

    def _tensor(self, spec, value, bound, layout):
        """A tensor of the example's sizes (or within a dynamic size's range), dtype, device, and
        where the code relies on it, layout."""
        if not isinstance(value, torch.Tensor):
            self._leaf_fail(
                spec,
                f"{spec.path} is {_got(value)}, but the module was made for a tensor "
                f"{_desc(spec.sizes, spec.dtype, spec.device)}",
            )
        if value.shape != spec.sizes:
            self._sizes(spec, value, bound)
        if value.dtype != spec.dtype:
            self._leaf_fail(
                spec,
                f"{spec.path} has dtype {str(value.dtype).replace('torch.', '')}, but the "
                f"module was made for {str(spec.dtype).replace('torch.', '')}",
                f"Convert it with .to({spec.dtype}), or generate the module again with an "
                "example of this dtype (dtypes are fixed in the generated code).",
            )
        if spec.device is not None and not (value.is_cpu if spec.device == "cpu" else value.device.type == spec.device):
            self._leaf_fail(
                spec,
                f"{spec.path} is on {value.device.type}, but the module was made for {spec.device} tensors",
                f"Move it with .to('{spec.device}'), or generate the module again with an example on this device.",
            )
        if layout and spec.layout is not None:
            self._layout(spec, value)
        if spec.reads and not torch._C._functorch.is_batchedtensor(value):
            self._reads(spec, value)

    def _constant(self, spec, value):
        """A value the code was specialised to: a Python scalar, None, a plain object's attributes,
        a type, the very module the code reads, or anything equal to the example's."""
        if spec.kind == "scalar":
            if not _same(value, spec.value):
                made = f"{spec.path} = {spec.value!r}" + (
                    f" (a Python {type(spec.value).__name__})" if type(value) is not type(spec.value) else ""
                )
                self.fail(
                    f"{spec.path} is {_got(value)}, but the module was made with {made}, a value its code uses as a constant",
                    f"Generate the module again with {spec.path} = {value!r} (or with a 0-dim tensor "
                    "there, which makes the value an input of the generated code).",
                )
        elif spec.kind == "none":
            # a cotangent where the output carries no gradient (integer indices, ``ceil``) is
            # ignored, as torch.func.vjp ignores it: None or a tensor
            if value is not None and not (spec.role and isinstance(value, torch.Tensor)):
                self._leaf_fail(spec, f"{spec.path} must be None (the module was made with None there), got {_got(value)}")
        elif spec.kind == "state":
            if not _same(_snapshot(value), spec.value):
                self.fail(
                    f"{spec.path} is a {type(value).__name__} whose attributes differ from those of the "
                    f"example the module was made with ({spec.value!r}); its code uses them as constants"
                )
        elif spec.kind == "type":
            if type(value).__name__ != spec.value:
                self.fail(f"{spec.path} is {_got(value)}, but the module was made for a {spec.value}")
        elif isinstance(spec.value, torch.nn.Module) and value is not spec.value:
            self.fail(
                f"{spec.path} is {_got(value)} other than the module the code was made with (whose parameters "
                "it reads at each call, and whose structure and flags it is specialised to)",
                "Pass that module, or generate the module again with this one (or differentiate "
                "fxtools.functional(module), which takes the parameters as an argument).",
            )
        elif not _equal(value, spec.value):
            self.fail(f"{spec.path} is {value!r}, but the module was made with {spec.value!r}, which its code is specialised to")

    def _sizes(self, spec, value, bound):
        shape = tuple(value.shape)
        if len(shape) != len(spec.sizes):
            self._leaf_fail(
                spec,
                f"{spec.path} has {len(shape)} dimension{'s' if len(shape) != 1 else ''} "
                f"(shape {_desc(shape)}), but the module was made for shape {_desc(spec.sizes)}",
            )
        for d, (got, want) in enumerate(zip(shape, spec.sizes)):
            if isinstance(want, Sym):
                lo, hi = want.min, want.max
                reason = next((c.where for c in self.conditions if c.names == (want.name,)), "")
                CHECKING.append(reason)  # (what narrowed the range, for a module traced again)
                try:
                    outside = bool(got < lo or (hi is not None and got > hi))
                finally:
                    CHECKING.pop()
                if outside:
                    cond = self._narrowed_by(want.name, got)
                    if cond is not None:
                        self._cond_fail(cond, {want.name: (got, spec.path, d)})
                    self.fail(
                        f"{spec.path}.size({d}) is {got}, outside the range [{lo}, "
                        f"{'inf' if hi is None else hi}] of the dynamic size {want.name} the module was made "
                        "with",
                        f"Build a module from an example of size {got} for such calls: torch traces a dynamic size "
                        "as at least 2 and decides size == 1 (broadcasting, a branch) without a trace, so one "
                        "module cannot serve both."
                        if got < 2 <= lo
                        else f"Generate the module again with a range that includes {got} "
                        f"(torch.export.Dim({want.name!r}, min=..., max=...)).",
                    )
                first = bound.setdefault(want.name, (got, spec.path, d))
                if first[0] != got:
                    self.fail(
                        f"{spec.path}.size({d}) is {got}, but {first[1]}.size({first[2]}) is {first[0]}; "
                        f"both are the dynamic size {want.name}, which must be equal in every argument "
                        "where the module was made with it",
                        "Pass arguments whose sizes agree.",
                    )
            elif got != want:
                self._leaf_fail(
                    spec,
                    f"{spec.path}.size({d}) is {got}, but the module was made for {want} "
                    f"({spec.path}: made for shape {_desc(spec.sizes)}, got {_desc(shape)})",
                    "Sizes are constants in the generated code: generate the module again with an "
                    "example of this shape, or make this size symbolic by marking it dynamic "
                    "(dynamic_shapes=, with torch.export.Dim) when generating the module.",
                )

    def _layout(self, spec, value):
        if spec.layout == "contiguous":
            if not value.is_contiguous() and not torch._C._functorch.is_batchedtensor(value):
                self.fail(
                    f"{spec.path} is not contiguous (strides {tuple(value.stride())}), but the module was "
                    "made for a contiguous tensor and its code uses .view, which relies on the layout",
                    f"Pass {spec.path}.contiguous(), or generate the module again with an example of this layout.",
                )
        elif not torch._C._functorch.is_batchedtensor(value) and tuple(value.stride()) != tuple(spec.layout):
            self.fail(
                f"{spec.path} has strides {tuple(value.stride())}, but the module was made for strides "
                f"{tuple(spec.layout)} and its code uses .view, which relies on the layout",
                "Generate the module again with an example of this layout.",
            )

    def _reads(self, spec, value):
        for read in spec.reads:
            CHECKING.append(f"read at {read.where}")
            try:
                holds = read.holds(value)
            finally:
                CHECKING.pop()
            if not holds:
                self.fail(
                    (
                        f"{spec.path} has storage_offset() {value.storage_offset()}"
                        if read.kind == "storage_offset"
                        else f"{spec.path} has strides {tuple(value.stride())}"
                    )
                    + (f" (contiguous: {value.is_contiguous()})" if read.kind == "is_contiguous" else "")
                    + f", but the module was made for {read.expected()} (the program read the layout at "
                    f"{read.where}); its code follows what the example's layout gave there",
                    f"Pass a tensor of the example's layout (e.g. {spec.path}.contiguous() if the example was "
                    "contiguous), or generate the module again with an example of this layout.",
                )

    def _leaf_fail(self, spec, problem, fix=None):
        if spec.role and problem.startswith(f"{spec.path} is None,") and "cotangent" in spec.role:
            self.fail(f"{problem}; it is {spec.role}", _NO_COTANGENT)
        if spec.role:
            self.fail(
                f"{problem}; it is {spec.role}, so it must have that value's shape and dtype ({_desc(spec.sizes, spec.dtype)})"
                if spec.kind == "tensor"
                else f"{problem}; it is {spec.role}",
                "Pass a value of that shape and dtype (cotangents and tangents are not broadcast, as in torch.autograd)."
                if spec.kind == "tensor"
                else "Pass None there.",
            )
        self.fail(problem, fix)

    def _node_fail(self, spec, value):
        if spec.kind == "dict":
            want = f"a dict with keys {list(spec.keys)}"
            got = _got(value)
            if isinstance(value, dict):
                missing = [k for k in spec.keys if k not in value]
                extra = [k for k in value if k not in spec.keys]
                got = (
                    "a dict"
                    + (f" without {missing}" if missing else "")
                    + (" and" if missing and extra else "")
                    + (f" with the extra keys {extra}" if extra else "")
                )
        elif spec.kind in ("list", "tuple"):
            want = f"a {spec.kind} of {len(spec.children)} items"
            got = f"a {type(value).__name__} of {len(value)} items" if isinstance(value, (list, tuple)) else _got(value)
        else:
            want, got = f"a {spec.type_name}", _got(value)
        fix = "Pass arguments with the structure of the example, or generate the module again with this structure."
        if value is None and _cotangent_below(spec):
            fix = _NO_COTANGENT
        self.fail(f"{spec.path} must be {want} (the structure the module was made for), got {got}", fix)

    def leaves(self):
        """Every Leaf, in pytree flattening order."""
        out = []

        def walk(spec):
            if type(spec) is Leaf:
                out.append(spec)
            else:
                for c in spec.children:
                    walk(c)

        for a in self.args:
            walk(a)
        return out

    def __str__(self):
        lines = [f"{self.made_by} module accepting ({', '.join(self.names)}):"]
        for leaf in self.leaves():
            if leaf.kind in ("tensor", "optional"):
                text = f"{leaf.path}: {_desc(leaf.sizes, leaf.dtype, leaf.device)}"
                if leaf.kind == "optional":
                    text += " or None"
                if leaf.layout == "contiguous":
                    text += ", contiguous"
                elif leaf.layout is not None:
                    text += f", strides {tuple(leaf.layout)}"
            elif leaf.kind == "none":
                text = f"{leaf.path}: None"
            elif leaf.kind == "type":
                text = f"{leaf.path}: a {leaf.value}"
            else:
                text = f"{leaf.path} = {leaf.value!r}"
            lines.append("  " + text + (f"  ({leaf.role})" if leaf.role else ""))
        syms = {s for leaf in self.leaves() for s in leaf.sizes if isinstance(s, Sym)}
        for s in sorted(syms, key=lambda s: s.name):
            lines.append(f"  {s.name}: any size in [{s.min}, {'inf' if s.max is None else s.max}]")
        for c in self.conditions:
            lines.append(f"  where {c.text}  ({c.where})")
        for leaf in self.leaves():
            for r in getattr(leaf, "reads", ()):
                lines.append(f"  {leaf.path}: {r.expected()}  (read at {r.where})")
        return "\n".join(lines)


# ---- runtime (end) ----

# The runtime's helpers under public names, for the package (saved modules carry them as written above).
tensor_text, value_text, snapshot_value, same_value = _desc, _got, _snapshot, _same


# --------------------------------------------------------------------------------------------
# Building guards from example arguments
# --------------------------------------------------------------------------------------------

_LAYOUT_OPS = {"view", "_unsafe_view", "as_strided", "as_strided_", "as_strided_scatter", "view_copy"}


def stride_sensitive_paths(gm: fx.GraphModule, names) -> set:
    """Paths of the argument leaves whose strides the code relies on: those a ``.view`` (or
    ``as_strided``) in ``gm`` reads, directly or through other ops (a pointwise op keeps its
    input's strides). Placeholders are ``names``; leaves are read by ``[key]`` / ``.attr`` chains."""
    ph = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), names))
    seen, stack = set(), []
    for node in gm.graph.nodes:
        if _layout_op(node) and node.args and isinstance(node.args[0], fx.Node):
            stack.append(node.args[0])
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    paths = set()
    for node in seen:
        keys, cur = [], node
        while cur.op == "call_function" and cur.target in (operator.getitem, getattr) and isinstance(cur.args[0], fx.Node):
            key = cur.args[1]
            keys.append(pytree.GetAttrKey(str(key)) if cur.target is getattr else pytree.MappingKey(key))  # type: ignore[type-var]
            cur = cur.args[0]
        if cur in ph:
            paths.add(ph[cur] + pytree.keystr(tuple(reversed(keys))))
    return paths


def _layout_op(node) -> bool:
    if node.op == "call_method":
        return node.target in _LAYOUT_OPS
    if node.op == "call_function":
        target = node.target
        return getattr(getattr(target, "overloadpacket", target), "__name__", None) in _LAYOUT_OPS
    return False


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
        wanted = path in layout if isinstance(layout, (set, frozenset)) else layout
        strided = wanted and value.layout == torch.strided
        # cotangents and tangents are traced contiguous (as callers make them)
        lay = None if not strided else "contiguous" if role or value.is_contiguous() else tuple(value.stride())
        return Leaf(path, "tensor", tuple(_size_spec(n) for n in value.shape), value.dtype, value.device.type, lay, role=role)
    if value is None:
        return Leaf(path, "none", role=role)
    if is_scalar(value):
        return Leaf(path, "scalar", value=value, role=role)
    state = _snapshot(value)
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
        return Node(path, "dict", name, tuple(k.key for k in keys), specs)
    if isinstance(value, (list, tuple)) and all(isinstance(k, pytree.SequenceKey) for k in keys):
        return Node(path, "tuple" if isinstance(value, tuple) else "list", name, tuple(range(len(keys))), specs)
    if all(isinstance(k, pytree.GetAttrKey) for k in keys):
        return Node(path, "attrs", name, tuple(k.name for k in keys), specs)
    raise NotImplementedError(f"fxtools cannot guard an argument of type {type(value).__name__}")


def build(made_by: str, names, args, *, layout=False, roles=None) -> Guards:
    """Guards for a module made at example ``args`` (one per positional argument named ``names``).

    ``layout``: whether the code relies on every tensor's strides, or the set of leaf paths
    whose strides it relies on (``stride_sensitive_paths``); ``roles``: for each
    argument index, None or a function ``path -> role text`` (cotangents, tangents).
    """
    names, args = tuple(names), tuple(args)
    roles = roles or {}
    return Guards(made_by, names, tuple(_spec(a, n, layout, roles.get(i)) for i, (n, a) in enumerate(zip(names, args))))


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
_RESULTS = {
    "fxtools.vjp": ("out, grads", ["grad_out"]),
    "fxtools.grad": ("grads", []),
    "fxtools.value_and_grad": ("value, grads", []),
    "fxtools.jvp": ("out, tangent_out", ["tangent_x"]),
    "fxtools.hvp": ("hvp", ["v"]),
    "fxtools.linearize": ("tangent_out", []),
    "fxtools.split": ("out, saved", []),
}


def module_call(made_by: str, names) -> str:
    """How a module ``made_by`` makes is called, as code: ``out, grads = gm(x, grad_out)`` (``names``
    its arguments, or the function's alone, in which case the transform's own are added)."""
    result, extra = _RESULTS.get(made_by, ("result", []))
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
        if guards is not None:
            guards.check(args if not kwargs else self._positional(guards, args, kwargs))
        if self.closures is not None:  # what the program read from outside its arguments (signature/closures.py)
            self.closures.check(self)
        out = super().__call__(*args, **kwargs)
        if guards is not None and _has_dict(guards.args):
            out = follow_key_orders(args if not kwargs else self._positional(guards, args, kwargs), out)
        return out

    def _positional(self, guards, args, kwargs):
        try:
            bound = inspect.signature(self.forward).bind(*args, **kwargs)
        except TypeError as exc:
            guards.fail(str(exc), "Pass the arguments the module was made for.")
        return tuple(bound.arguments.values())

    def __reduce__(self):
        _, (body, import_block) = super().__reduce__()
        body.pop("closures", None)  # a saved module is a snapshot of what it read (signature/closures.py)
        return _restore, (body, import_block)

    def __deepcopy__(self, memo):
        closures, self.closures = self.closures, None  # a copy is a snapshot (signature/closures.py)
        try:
            res = super().__deepcopy__(memo)  # keeps only the attributes the graph reads
        finally:
            self.closures = closures
        if self.guards is not None:
            res.guards = copy.deepcopy(self.guards, memo)
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


def install(gm: fx.GraphModule, made_by: str, names, args, *, roles=None) -> GuardedGraphModule:
    """Attach guards for example ``args`` to ``gm`` (made a GuardedGraphModule if it is not one);
    layouts are required where its code relies on strides."""
    gm = guarded(gm)
    gm.guards = build(made_by, names, args, layout=stride_sensitive_paths(gm, names), roles=roles)
    return gm


# --------------------------------------------------------------------------------------------
# Writing guards into a standalone module (fxtools.save)
# --------------------------------------------------------------------------------------------


def runtime_source() -> str:
    """The checking code, as written into standalone modules (after an InputMismatch class)."""
    text = inspect.getsource(sys.modules[__name__])
    start = text.index("# ---- runtime (begin)")
    start = text.index("\n", start) + 1
    end = text.index("# ---- runtime (end) ----")
    return (
        "class InputMismatch(ValueError):\n"
        '    """Arguments the module was not made for."""\n\n\n' + text[start:end].strip() + "\n"
    )


def _literal(v) -> str:
    if v is None or type(v) in (bool, int, float, complex, str):  # exactly: a subclass's repr is user code
        return literal(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(map(_literal, v)) + ("," if len(v) == 1 else "") + ")"
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, torch.device):
        return f"torch.device({str(v)!r})"
    if isinstance(v, Sym):
        return f"Sym({v.name!r}, {v.min!r}, {v.max!r})"
    if isinstance(v, Cond):
        return f"Cond({v.text!r}, {v.test!r}, {_literal(tuple(v.names))}, {v.where!r})"
    if isinstance(v, Read):
        return f"Read({v.kind!r}, {_literal(v.want)}, {v.where!r})"
    if isinstance(v, (torch.memory_format, torch.layout)):
        return str(v)
    raise TypeError(type(v))


def render(guards: Guards, indent: str = "") -> str:
    """Python source that rebuilds ``guards`` with the runtime classes (for fxtools.save)."""

    def spec(s, ind):
        if type(s) is Leaf:
            kind, value = s.kind, s.value
            if kind == "object":
                try:
                    value_text = _literal(value)
                except TypeError:
                    kind, value_text = "type", repr(type(value).__name__)
            else:
                value_text = _literal(value)
            fields = [repr(s.path), repr(kind)]
            extra = [
                ("sizes", _literal(tuple(s.sizes)) if s.sizes else None),
                ("dtype", str(s.dtype) if s.dtype is not None else None),
                ("device", repr(s.device) if s.device is not None else None),
                ("layout", repr(s.layout) if s.layout is not None else None),
                ("value", value_text if value is not None else None),
                ("role", repr(s.role) if s.role else None),
                ("reads", _literal(tuple(s.reads)) if s.reads else None),
            ]
            fields += [f"{k}={v}" for k, v in extra if v is not None]
            return f"{ind}Leaf({', '.join(fields)})"
        inner = ",\n".join(spec(c, ind + "    ") for c in s.children)
        head = f"{ind}Node({s.path!r}, {s.kind!r}, {s.type_name!r}, {_literal(tuple(s.keys))}, ("
        return f"{head}\n{inner},\n{ind}))" if s.children else head + "))"

    args = ",\n".join(spec(a, indent + "    ") for a in guards.args)
    conds = "".join(f"\n{indent}    {_literal(c)}," for c in guards.conditions)
    conditions = f", conditions=({conds}\n{indent})" if conds else ""
    return f"Guards({guards.made_by!r}, {_literal(tuple(guards.names))}, (\n{args},\n{indent}){conditions})"
