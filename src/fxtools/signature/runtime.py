"""The runtime of guards: the data a generated module checks its arguments against, and the check.

This module's block between the ``runtime (begin)`` and ``runtime (end)`` markers is the source that
``fxtools.save`` copies verbatim into the modules it writes (``codegen/guard_source.py``), after the
derivative code: a saved module's ``forward`` starts with one line,
``forward_accepts.check((params, x, y))``, and still needs only torch and dataclasses (it raises
its own ``InputMismatch(ValueError)``). In the package, ``signature/guards.py`` builds these
records from example arguments and attaches them to modules.

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
  ``"contiguous"``; a tuple of strides; or ``"views"``: any strides on which the code's
  ``.view`` calls succeed, as they give eager's values or raise, which
  ``refuse_view`` turns into an error naming the argument). A layout is required only when the code has
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
Each such check goes through ``Guards.deciding``, which in fxtools (``signature/guards.py``) records
the decision being checked while a module is traced inside another (``hvp`` traces a ``grad``
module; ``signature/decisions.py``), so the outer module keeps it; a saved module just checks.

``Guards.check(args)`` raises ``InputMismatch`` or returns the tensor leaves in the order of
``torch.utils._pytree.tree_flatten`` of the example (``fxtools.split``'s placeholder order), so
checking and flattening are one walk. ``fxtools.compile`` picks its cached graphs with it.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import FxtoolsError

__all__ = [
    "InputMismatch",
    "Sym",
    "Cond",
    "Read",
    "Leaf",
    "Node",
    "Guards",
    "dense_strides",
    "tensor_text",
    "value_text",
    "snapshot_value",
    "same_value",
]


class InputMismatch(FxtoolsError, ValueError):
    """A generated module was called with arguments it was not made for (see ``fxtools.signature.guards``)."""


# ---- runtime (begin): copied verbatim into modules written by fxtools.save; torch and dataclasses only ----


@dataclasses.dataclass(frozen=True)
class Sym:
    """A symbolic size: any value in [min, max] (max None: unbounded); equal wherever the name recurs."""

    name: str
    min: int = 0
    max: int | None = None

    def excludes(self, value) -> bool:
        return bool(value < self.min or (self.max is not None and value > self.max))


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
    pinned: tuple = ()  # (dim, the user's line) for a size marked dynamic that the program made static
    layout_by: str | None = None  # what relies on the layout, when not ``.view``: "as_strided (from file:line: code)"


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
        try:
            return bool(eval(code, names, scope))  # noqa: S307 - fxtools' own printed sympy (torch's PythonPrinter)
        except ZeroDivisionError:  # a size outside the traced range (0: ``x.chunk(3)``'s ``n // ceil(n / 3)``)
            return False


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


def _snapshot(obj, depth=0, budget=None):
    """A plain object's state as nested tuples of built-in values (its class name and attributes),
    or None if any part is not plain: two objects whose snapshots are the same give the code the
    same constants (``c.scale`` read while tracing). An object of more than ``_SNAPSHOT_LIMIT``
    parts (a library's registry of dicts) is not plain: it is read by identity instead."""
    if obj is None or type(obj) in (bool, int, float, complex, str):
        return obj
    budget = [_SNAPSHOT_LIMIT] if budget is None else budget
    budget[0] -= 1
    if depth > 8 or budget[0] < 0 or isinstance(obj, (torch.Tensor, torch.nn.Module)):  # tensors: read by reference
        return None
    if type(obj) is dict:
        pairs = []
        for k, v in obj.items():
            s = _snapshot(v, depth + 1, budget)
            if type(k) is not str or (s is None and v is not None):
                return None
            pairs.append((k, s))
        return ("dict", tuple(pairs))
    if type(obj) in (tuple, list):
        items = []
        for v in obj:
            s = _snapshot(v, depth + 1, budget)
            if s is None and v is not None:
                return None
            items.append(s)
        return (type(obj).__name__, tuple(items))
    state = vars(obj) if hasattr(obj, "__dict__") else _slot_state(obj)  # a user's object: read by introspection
    if type(state) is not dict or callable(obj) or isinstance(obj, type):
        return None
    items = []
    for k in sorted(state, key=str):
        v = _snapshot(state[k], depth + 1, budget)
        if type(k) is not str or (v is None and state[k] is not None):
            return None
        items.append((k, v))
    return (type(obj).__qualname__, tuple(items))


_SNAPSHOT_LIMIT = 10_000


def _slot_state(obj) -> dict | None:
    """The attributes an object without a ``__dict__`` keeps in the ``__slots__`` its classes
    declare (``@dataclass(slots=True)``), those set now; None for an object of no such class."""
    names = []
    for cls in type(obj).__mro__:
        slots = vars(cls).get("__slots__")
        if slots is not None:
            names += [slots] if isinstance(slots, str) else list(slots)
    names = [n for n in dict.fromkeys(names) if n not in ("__dict__", "__weakref__")]
    if not names:
        return None
    missing = object()
    return {n: v for n in names if (v := getattr(obj, n, missing)) is not missing}


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


def _autocast_devices() -> tuple:
    found = []
    for device in ("cpu", "cuda", "xpu", "mps", "hpu"):
        try:
            torch.is_autocast_enabled(device)
            found.append(device)
        except RuntimeError:  # a device type this build of PyTorch does not know
            continue
    return tuple(found)


_AUTOCAST_DEVICES = _autocast_devices()


def autocast_state() -> tuple:
    """``(device type, dtype)`` of each device type on which ``torch.autocast`` is on now."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))


def _autocast_text(state) -> str:
    if not state:
        return "with torch.autocast off"
    return "inside " + " and ".join(f"torch.autocast({d!r}, dtype={t})" for d, t in state)


@dataclasses.dataclass
class Guards:
    """What a generated module accepts: one spec (Node or Leaf) per positional argument."""

    made_by: str
    names: tuple
    args: tuple
    conditions: tuple = ()  # Conds: decisions on symbolic sizes
    autocast: tuple = ()  # autocast_state() where it was made: its casts are ops of the code
    # a module whose code writes tensor leaves in place (``written``: their positions): the
    # groups of its tensor leaves holding one of them that shared memory in the example; None
    # where the code writes no argument (sharing is then harmless)
    shared: tuple | None = None
    written: tuple = ()

    def check(self, args, layout=True):
        """Raise InputMismatch unless ``args`` (a tuple) is what the module was made for;
        return the tensor leaves, in pytree flattening order."""
        amp = autocast_state()
        if amp and amp != self.autocast:  # made in a region, its code holds the casts and runs anywhere
            self.fail(
                f"it was made {_autocast_text(self.autocast)} and is called {_autocast_text(amp)}; its code "
                "holds the casts (or none) of where it was made, and runs with autocast off",
                "Generate the module inside the region it is called in (one module per autocast state), "
                "or use fxtools.compile, which makes graphs for each autocast state it is called in.",
            )
        if len(args) != len(self.args):
            self.fail(
                f"it takes {len(self.args)} argument{'s' if len(self.args) != 1 else ''} "
                f"({', '.join(self.names)}), got {len(args)}",
                f"Call it with exactly the arguments it was made for, gm({', '.join(self.names)}): the "
                "function's own, then the cotangents or tangents, if any.",
            )
        tensors, bound, paths = [], {}, []
        for spec, value in zip(self.args, args):
            self._walk(spec, value, tensors, bound, layout, paths)
        if self.shared is not None and len(tensors) > 1:
            self._check_shared(tensors, paths)
        for cond in self.conditions:
            if all(n in bound for n in cond.names):
                if not self.deciding(cond.where, "decided", cond.holds, [bound[n][0] for n in cond.names]):
                    self._cond_fail(cond, bound)
        return tensors

    def deciding(self, where, kind, test, value):
        """``test(value)``: repeating a decision the trace made at ``where`` (``kind``: "decided" on
        sizes, or "read" of a layout). fxtools records it while a module is traced inside another."""
        return test(value)

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

    def refuse_view(self, args, exc):
        """Raise InputMismatch naming the non-contiguous arguments a ``.view`` of the code failed
        on (their layout ``"views"``): eager's ``.view`` raises there too, or a reshape the trace
        made a view on a contiguous example."""
        found: list = []
        for spec, value in zip(self.args, args):
            self._viewed(spec, value, found)
        if found:
            first = str(exc).splitlines()[0]
            self.fail(
                f"{' and '.join(f'{p} has strides {st}' for p, st in found)}, a layout the code's .view cannot view ({first})",
                f"Pass {found[0][0]}.contiguous(), or generate the module again with an example of this layout.",
            )

    def _viewed(self, spec, value, found):
        if type(spec) is not Leaf:
            for k, child in zip(spec.keys, spec.children):
                try:
                    item = getattr(value, k) if spec.kind == "attrs" else value[k]
                except (KeyError, IndexError, AttributeError, TypeError):
                    continue
                self._viewed(child, item, found)
        elif spec.layout == "views" and isinstance(value, torch.Tensor) and not value.is_contiguous():
            found.append((spec.path, tuple(value.stride())))

    def fail(self, problem, fix=None):
        raise InputMismatch(f"{self.made_by} module: {problem}. {fix or _HOW + '.'}")

    def _check_shared(self, tensors, paths):
        """Refuse arguments sharing memory where the example's did not, or the reverse: the code
        writes in place, and what a write changes for the other arguments is eager's only when
        they share memory as the example's did (``f(n, n)`` of a program writing ``n`` and
        reading its second argument)."""
        got = shared_groups(tensors, self.written)
        want = self.shared or ()
        if got is None or got == want:
            return
        new = [g for g in got if g not in want]
        pair = new[0] if new else next(g for g in want if g not in got)
        names = " and ".join(paths[i] for i in pair)
        how = "share memory, where the example's did not" if new else "do not share memory, where the example's did"
        self.fail(
            f"{names} {how}; the code writes in place, and what a write changes is eager's only where "
            "arguments share memory as the example's did",
            "Pass separate tensors (.clone() one of them), or generate the module from arguments sharing memory as these do.",
        )

    def _walk(self, spec, value, tensors, bound, layout, paths=None):
        """Check ``value`` against ``spec`` (a Leaf or a Node), appending its tensors to ``tensors``
        and recording in ``bound`` the dynamic sizes it gives (their value and where it is)."""
        if type(spec) is not Leaf:
            self._container(spec, value, tensors, bound, layout, paths)
        elif spec.kind == "tensor" or (spec.kind == "optional" and value is not None):
            self._tensor(spec, value, bound, layout)
            tensors.append(value)
            if paths is not None:
                paths.append(spec.path)
        else:
            self._constant(spec, value)

    def _container(self, spec, value, tensors, bound, layout, paths=None):
        """A dict, list, tuple or dataclass-like object of the example's structure; its items walked."""
        kind = spec.kind
        if kind == "dict":
            if not isinstance(value, dict):
                self._node_fail(spec, value)
            if len(value) != len(spec.keys) or any(k not in value for k in spec.keys):
                self._node_fail(spec, value)
            for k, child in zip(spec.keys, spec.children):
                self._walk(child, value[k], tensors, bound, layout, paths)
        elif kind == "list" or kind == "tuple":
            if not isinstance(value, list if kind == "list" else tuple) or len(value) != len(spec.children):
                self._node_fail(spec, value)
            for v, child in zip(value, spec.children):
                self._walk(child, v, tensors, bound, layout, paths)
        else:
            if type(value).__name__ != spec.type_name:
                self._node_fail(spec, value)
            for k, child in zip(spec.keys, spec.children):
                self._walk(child, getattr(value, k), tensors, bound, layout, paths)

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
                outside = self.deciding(reason, "decided", want.excludes, got)  # (what narrowed the range)
                if outside:
                    cond = self._narrowed_by(want.name, got)
                    if cond is not None:
                        self._cond_fail(cond, {want.name: (got, spec.path, d)})
                    self.size_one = got == 1 and lo == 2  # a module that can build its size-1 variant does
                    self.fail(
                        f"{spec.path}.size({d}) is {got}, outside the range [{lo}, "
                        f"{'inf' if hi is None else hi}] of the dynamic size {want.name} the module was made "
                        "with",
                        f"Build a module from an example of size {got} for such calls: torch traces a dynamic size "
                        "as at least 2 and decides size == 1 (broadcasting, a branch) without a trace, so one "
                        "module cannot serve both (a module fxtools' transforms return builds it on the first "
                        "such call; a saved one cannot)."
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
                pinned = dict(spec.pinned).get(d)
                self._leaf_fail(
                    spec,
                    f"{spec.path}.size({d}) is {got}, but the module was made for {want} "
                    f"({spec.path}: made for shape {_desc(spec.sizes)}, got {_desc(shape)})"
                    + (
                        f"; the size was marked dynamic, but the program needs it to be {want} "
                        f"(decided at {pinned}), so it is a constant of the code"
                        if pinned is not None
                        else ""
                    ),
                    "Generate the module again with an example of this shape, or write the program without "
                    "that use of the size as a Python number."
                    if pinned is not None
                    else "Sizes are constants in the generated code: generate the module again with an "
                    "example of this shape, or make this size symbolic by marking it dynamic "
                    "(dynamic_shapes=, with torch.export.Dim) when generating the module.",
                )

    def _layout(self, spec, value):
        if spec.layout == "views":  # only .view reads it: any layout on which the views succeed
            return
        uses = (
            f"its code uses {spec.layout_by} on {spec.path}'s strides (reading memory by offset)"
            if spec.layout_by
            else "its code uses .view, which relies on the layout"
        )
        if spec.layout == "contiguous":
            if not value.is_contiguous() and not torch._C._functorch.is_batchedtensor(value):
                self.fail(
                    f"{spec.path} is not contiguous (strides {tuple(value.stride())}), but the module was "
                    f"made for a contiguous tensor and {uses}",
                    f"Pass {spec.path}.contiguous(), or generate the module again with an example of this layout.",
                )
        elif not torch._C._functorch.is_batchedtensor(value) and tuple(value.stride()) != tuple(spec.layout):
            self.fail(
                f"{spec.path} has strides {tuple(value.stride())}, but the module was made for strides "
                f"{tuple(spec.layout)} and {uses}",
                "Generate the module again with an example of this layout.",
            )

    def _reads(self, spec, value):
        for read in spec.reads:
            if not self.deciding(read.where, "read", read.holds, value):
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
                elif leaf.layout == "views":
                    text += ", any strides its .view calls take"
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


def shared_groups(tensors, written=None):
    """The groups (tuples of positions, two or more) of ``tensors`` sharing a storage (the
    example's FakeTensors share theirs as the tensors they stand for do); None where a tensor has
    no storage to compare (a wrapper subclass). ``written``: only the groups holding one of
    these positions."""
    from torch.multiprocessing.reductions import StorageWeakRef

    groups = {}
    for i, t in enumerate(tensors):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            return None
        if storage.nbytes() == 0:  # nothing to share
            continue
        groups.setdefault(StorageWeakRef(storage), []).append(i)
    return tuple(tuple(g) for g in groups.values() if len(g) > 1 and (written is None or any(i in written for i in g)))


# ---- runtime (end) ----

# The runtime's helpers under public names, for the package (saved modules carry them as written above).
tensor_text, value_text, snapshot_value, same_value = _desc, _got, _snapshot, _same
