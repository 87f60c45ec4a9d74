"""Symbolic sizes: ``dynamic_shapes=`` in torch.export's format.

``fxtools.grad(f, *args, dynamic_shapes=...)`` (and ``vjp``, ``value_and_grad``, ``jvp``,
``hvp``, ``vmap``, ``split``, ``compile``) accepts what ``torch.export.export`` accepts: a dict
by argument name or a tuple by position, nested like the arguments, whose tensor entries map
dims to a ``torch.export.Dim("batch", min=..., max=...)``, ``Dim.AUTO`` or ``Dim.DYNAMIC`` (a
dict ``{0: batch}`` or a tuple with one entry per dim). Unlike torch.export, ``None`` may stand
for a whole argument, and arguments left out of a dict are static.

The example arguments become FakeTensors whose marked sizes are symbols of one ``ShapeEnv``,
made by torch.export's own ``make_fake_inputs`` (so the rules are export's: equal ``Dim``\\ s are
one symbol; an example size of 0 or 1 cannot be symbolic, and is refused for a named ``Dim``).
Tracing records sizes as graph nodes (``aten.sym_size.int``) wherever code needs them;
``simplify`` rewrites each as arithmetic of the inputs' sizes (``batch * 4``, not
``pow_1.numel()``: ``dynamic_shapes.sizes_from_inputs``), and ``name_sizes`` names the reads
after their ``Dim`` (``batch = x.size(0)``). A mean divides by that count, a reshape or expand
takes it: the module serves every size in range.

Whatever tracing assumed about a marked size (a branch on ``x.shape[0] == 32``, a broadcast
with a static size) is recorded in the ``ShapeEnv`` as a guard. After tracing, ``check`` asks
torch.export's ``produce_guards_and_solve_constraints`` whether the guards contradict the
user's marks, and raises ``SymbolicSizeError`` naming the size and the user's line otherwise,
as torch.export does. ``Dim.AUTO`` sizes silently stay static where the program needs them so.

The module's guards (``fxtools.signature.guards``) then hold a ``Sym(name, min, max)`` for each symbolic
size (``guard_symbolic``): a call outside the range, or with sizes of one symbol that differ,
raises ``InputMismatch`` saying which. ``fxtools.compile(..., dynamic=True)`` marks every size
> 1 of every input tensor (not the parameters) ``Dim.AUTO``, as ``torch.compile``'s automatic
dynamic shapes do, and picks its splits by those guards.
"""

from __future__ import annotations

import collections
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import FxtoolsError, decision_line
from . import decisions


class SymbolicSizeError(FxtoolsError):
    """A size marked dynamic cannot stay symbolic (the program specialised it), or the marks are malformed."""


@dataclass
class Symbolic:
    """What ``check`` needs after tracing, and the names of the marked sizes."""

    fake_mode: Any
    equalities: Any
    signature: inspect.Signature
    dynamic_shapes: dict
    names: dict = field(default_factory=dict)  # sympy symbol -> Dim name ("batch")
    declared: dict = field(default_factory=dict)  # sympy symbol -> (min, max) the user's Dim declares;
    # ("root", symbol) -> (name, min, max) of a derived Dim's root

    @property
    def shape_env(self):
        return self.fake_mode.shape_env


def _static(arg):
    """``None`` for every leaf of ``arg``, nested as torch.export reads dynamic_shapes: dicts, lists
    and tuples as themselves, another registered pytree class (fxtools' ``ClosedOver``, a user's
    dataclass) as the list of its children."""
    node = pytree.SUPPORTED_NODES.get(type(arg))
    if node is None or arg is None:
        return None
    if type(arg) in (dict, list, tuple):
        return pytree.tree_map(lambda _: None, arg, is_leaf=lambda x: x is None)
    children, _ = node.flatten_fn(arg)
    return [_static(c) for c in children]


def _complete(arg, spec, where):
    """``spec`` for ``arg`` with ``None`` standing for a whole (sub)structure expanded to its leaves."""
    if isinstance(arg, torch.Tensor):
        return spec
    if spec is None:
        return _static(arg)
    if isinstance(arg, dict) and isinstance(spec, dict):
        unknown = set(spec) - set(arg)
        if unknown:
            raise SymbolicSizeError(
                f"dynamic_shapes{where} names {sorted(map(str, unknown))}, which "
                f"the argument{where} does not have (it has {sorted(map(str, arg))})"
            )
        return type(arg)((k, _complete(v, spec.get(k), f"{where}[{k!r}]")) for k, v in arg.items())
    if isinstance(arg, (list, tuple)) and isinstance(spec, (list, tuple)) and not hasattr(arg, "_fields"):
        if len(spec) != len(arg):
            raise SymbolicSizeError(f"dynamic_shapes{where} has {len(spec)} entries but the argument{where} has {len(arg)}")
        return type(arg)(_complete(a, s, f"{where}[{i}]") for i, (a, s) in enumerate(zip(arg, spec)))
    if not isinstance(arg, (dict, list, tuple)):
        if spec is not None:
            raise SymbolicSizeError(
                f"dynamic_shapes{where} marks a {type(arg).__name__}; only tensor sizes "
                "can be symbolic (Python numbers are specialised)"
            )
        return None
    raise SymbolicSizeError(
        f"dynamic_shapes{where} is a {type(spec).__name__} but the argument{where} is a "
        f"{type(arg).__name__}: nest dynamic_shapes like the argument (or use None)"
    )


def _by_name(f, args, dynamic_shapes) -> tuple[dict, inspect.Signature]:
    """``dynamic_shapes`` as a dict by parameter name covering every argument."""
    from .naming import arg_names

    names = arg_names(f.forward if isinstance(f, torch.nn.Module) else f, len(args))
    if isinstance(dynamic_shapes, dict):
        unknown = set(dynamic_shapes) - set(names)
        if unknown:
            raise SymbolicSizeError(
                f"dynamic_shapes names {sorted(unknown)}, which are not arguments (the arguments are {names})"
            )
        per_arg = [dynamic_shapes.get(n) for n in names]
    elif isinstance(dynamic_shapes, (list, tuple)):
        if len(dynamic_shapes) != len(args):
            raise SymbolicSizeError(f"dynamic_shapes has {len(dynamic_shapes)} entries for {len(args)} arguments")
        per_arg = list(dynamic_shapes)
    else:
        raise SymbolicSizeError(
            "dynamic_shapes must be a dict by argument name or a tuple by position, "
            f"as for torch.export.export (got a {type(dynamic_shapes).__name__})"
        )
    specs = {n: _complete(a, s, f"[{n!r}]") for n, a, s in zip(names, args, per_arg)}
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    return specs, inspect.Signature(params)


class _Signature(torch.nn.Module):
    """A stand-in module whose ``forward`` has the given signature (what make_fake_inputs reads)."""

    def __init__(self, signature):
        super().__init__()
        namespace: dict = {}
        exec(f"def forward({', '.join(signature.parameters)}):\n    pass\n", namespace)  # noqa: S102 - a signature only
        self.forward = namespace["forward"]


def _export_form(spec):
    """``spec`` as torch.export matches it: a dict subclass registered as its own pytree node (the
    keyword arguments ``fxtools.compile`` passes as one argument) by the list of its children."""
    if isinstance(spec, dict):
        done = {k: _export_form(v) for k, v in spec.items()}
        return type(spec)(done) if type(spec) in (dict, collections.OrderedDict) else list(done.values())
    if isinstance(spec, (list, tuple)) and not hasattr(spec, "_fields"):
        return type(spec)(_export_form(v) for v in spec)
    return spec


def fake_arguments(f, args: tuple, dynamic_shapes) -> tuple[tuple, Symbolic]:
    """``args`` with tensors made FakeTensors, marked sizes symbolic (torch.export's rules)."""
    from torch._export.non_strict_utils import make_fake_inputs

    specs, signature = _by_name(f, args, dynamic_shapes)
    # only tensors become fakes: other leaves (numbers, strings, objects) are specialised by capture
    leaves, spec = pytree.tree_flatten(tuple(args))
    tensor_only = pytree.tree_unflatten([x if isinstance(x, torch.Tensor) else None for x in leaves], spec)
    module = _Signature(signature)
    capped = _capped(specs)
    try:
        fake_mode, fake_args, _, equalities, _, _ = make_fake_inputs(module, tensor_only, {}, _export_form(capped))
    except FxtoolsError:
        raise
    except Exception as exc:  # torch.export's message for malformed dynamic_shapes
        raise SymbolicSizeError(f"dynamic_shapes: {exc}") from exc
    fakes = pytree.tree_leaves(fake_args, is_leaf=lambda x: x is None)
    it = iter(fakes)
    merged = [next(it) if isinstance(x, torch.Tensor) else (next(it), x)[1] for x in leaves]
    sym = Symbolic(fake_mode, equalities, signature, capped)
    sym.names, sym.declared = _dim_names(specs, pytree.tree_unflatten(merged, spec), signature)
    fake_mode.shape_env.fxtools_names = sym.names  # how size_text shows them
    fake_mode.shape_env.guards = _GuardLines(fake_mode.shape_env.guards)
    return pytree.tree_unflatten(merged, spec), sym


def _capped(specs: dict) -> dict:
    """``specs`` with each unbounded ``Dim`` (``max`` of ``int_oo``, the default) bounded at the
    largest size a tensor can have (``sys.maxsize - 1``: sizes are int64, and ``numel`` too). The
    same sizes, but a comparison with ``sys.maxsize`` is then decided without a guard: PyTorch's
    slice decomposition compares the size with a slice's end of ``sys.maxsize`` (``x[:, i]``'s
    backward under ``torch.autograd.grad`` or ``torch.func``), which recorded ``B < 2**63 - 1``
    and refused an unbounded ``Dim`` as specialised. The roots of derived Dims are left as they are."""
    from torch.export.dynamic_shapes import Dim, _DerivedDim
    from torch.utils._sympy.numbers import int_oo

    leaves = pytree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, Dim))
    roots = {id(getattr(d, "root", None)) for d in leaves if isinstance(d, _DerivedDim)}
    done: dict[str, Any] = {}

    def cap(d):
        if not isinstance(d, Dim) or isinstance(d, _DerivedDim) or id(d) in roots or d.max is not int_oo:
            return d
        if d.__name__ not in done:
            done[d.__name__] = Dim(d.__name__, min=d.min, max=sys.maxsize - 1)
        return done[d.__name__]

    return pytree.tree_map(cap, specs, is_leaf=lambda x: isinstance(x, Dim))


class _GuardLines(list):
    """A ShapeEnv's ``guards`` that also note where the program decided each (the user's line, see
    ``errors.decision_line``), for the conditions a module checks (``guard_symbolic``). Guards
    recorded in fxtools' own code (a pass computing a new node's shape) are not the program's
    decisions and get no line: the size fuzzer checks that fxtools' code stays general."""

    def __init__(self, items=()):
        super().__init__(items)
        self.where: dict[int, str] = {}

    def append(self, guard) -> None:
        where, checked = decision_line(skip=1), decisions.current()
        if not where.startswith("fxtools'"):  # the program's decisions; fxtools' own are its shape arithmetic
            self.where[id(guard)] = where
        elif checked is not None and (checked.where or checked.kind == "read"):  # a module traced again (hvp): what it checks
            self.where[id(guard)] = checked.where if checked.kind == "decided" else f"read at {checked.where}"
        super().append(guard)


def _dim_names(specs, fake_args, signature) -> tuple[dict, dict]:
    """symbol -> the user's Dim name for each named marked size (``Dim.AUTO`` ones get none),
    and symbol -> the (min, max) that Dim declares."""
    from torch.export.dynamic_shapes import Dim

    names, declared = {}, {}
    for name, arg in zip(signature.parameters, fake_args):
        spec = specs[name]
        if all(s is None for s in pytree.tree_leaves(spec)):  # nothing marked (a registered class: a list)
            continue

        def visit(t, s):
            if not isinstance(t, torch.Tensor) or s is None:
                return
            items = s.items() if isinstance(s, dict) else enumerate(s)
            for d, dim in items:
                size = t.shape[d]
                if isinstance(size, int) and size in (0, 1) and (isinstance(dim, Dim) or dim == Dim.DYNAMIC):
                    label = dim.__name__ if isinstance(dim, Dim) else "Dim.DYNAMIC"
                    raise SymbolicSizeError(
                        f"{name}{_path_text(t, arg)}.size({d}) is {size} in the example, but is marked dynamic "
                        f"({label}): torch treats sizes 0 and 1 as static while tracing (broadcasting depends "
                        "on them), as torch.export does. Give an example where this size is at least 2; the "
                        "module then also serves sizes 0 and 1 within the Dim's range."
                    )
                if isinstance(dim, Dim) and isinstance(size, torch.SymInt):
                    names.setdefault(size.node.expr, dim.__name__)
                    declared.setdefault(size.node.expr, (dim.min, dim.max))
                    root = getattr(dim, "root", None)  # a derived Dim (2*b): its root, for b
                    if isinstance(root, Dim):
                        declared.setdefault(("root", size.node.expr), (root.__name__, root.min, root.max))

        pytree.tree_map(visit, arg, spec, is_leaf=lambda x: isinstance(x, torch.Tensor) or x is None)
    return names, declared


def _path_text(t, arg) -> str:
    """``['w']`` for the leaf ``t`` of ``arg`` (empty for the argument itself)."""
    for path, leaf in pytree.tree_flatten_with_path(arg)[0]:
        if leaf is t:
            return pytree.keystr(path)
    return ""


def size_text(size) -> str:
    """A size as shape comments show it: ``batch`` for a size marked ``Dim("batch")``, ``4*batch``
    for a product, the ShapeEnv's ``s0`` for an unnamed one, the number for a static size."""
    if not isinstance(size, torch.SymInt):
        return str(size)
    env = size.node.shape_env
    names = getattr(env, "fxtools_names", None)
    expr = env.replace(size.node.expr) if env is not None else size.node.expr
    if names:
        import sympy

        expr = expr.xreplace(
            {env.replace(s): sympy.Symbol(n, integer=True, positive=True) for s, n in names.items() if env.replace(s).is_symbol}
        )
    return str(expr)


def _specialisations(sym: Symbolic) -> list[str]:
    """``  - batch == 32 (at model.py:16: if x.shape[0] == 32:)`` for each guard tracing recorded on a
    named size: the program's line (``_GuardLines``), else where PyTorch says it was decided."""
    import sympy
    from torch.utils._sympy.printers import PythonPrinter

    env = sym.shape_env
    named = {s: sympy.Symbol(n, integer=True) for s, n in sym.names.items()}
    lines = []
    noted = env.guards.where if isinstance(env.guards, _GuardLines) else {}
    for guard in env.guards:
        expr = guard.expr
        if not expr.free_symbols & set(named):
            continue
        loc = guard.sloc.framework_loc
        where = noted.get(id(guard))  # the program's line, where a library call (a view) decided it
        if where is None:
            where = f"{loc.filename}:{loc.lineno} in {loc.name}" if hasattr(loc, "lineno") else str(guard.sloc).strip("()")
        text = PythonPrinter().doprint(expr.xreplace(named))
        lines.append(f"  - {text} (at {where})")
    return lines


def check(sym: Symbolic | None, gm: fx.GraphModule) -> None:
    """Raise ``SymbolicSizeError`` if tracing specialised a size the user marked dynamic."""
    if sym is None:
        return
    from torch._export.non_strict_utils import produce_guards_and_solve_constraints
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    if sym.shape_env.frozen:
        return
    try:
        produce_guards_and_solve_constraints(sym.fake_mode, gm, sym.dynamic_shapes, sym.equalities, sym.signature)
    except ConstraintViolationError as exc:
        found = _specialisations(sym)
        raise SymbolicSizeError(
            "a size marked dynamic cannot stay symbolic: the program (or its derivative) needs it to "
            "have a particular value or to be in a narrower range than declared"
            + (":\n" + "\n".join(found) if found else ".")
            + "\nMark it static, widen or narrow its Dim as torch suggests below, use Dim.AUTO (static "
            f"wherever the program needs it so), or change the program. torch.export's analysis:\n{exc}"
        ) from None
    finally:
        sym.shape_env.frozen = False  # later passes (simplify) may still reason about sizes


def name_sizes(gm: fx.GraphModule, sym: Symbolic | None) -> None:
    """``sym_size_int = x.size(0)`` -> ``batch = x.size(0)``: size nodes take their Dim's name."""
    if sym is None:
        return
    names = sym.names
    used: dict = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" or not isinstance(val, torch.SymInt):
            continue
        env = val.node.shape_env
        name = next((n for sym, n in names.items() if env.replace(sym) == env.replace(val.node.expr)), None)
        if name is None or not _is_size_read(node):
            continue
        count = used.get(name, 0)
        used[name] = count + 1
        node._rename(name if count == 0 else f"{name}_{count}")


def _is_size_read(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.ops.aten.sym_size.int) or (
        node.op == "call_method" and node.target == "size"
    )


def _range(expr, sym: Symbolic):
    """(min, max) a symbol may take at run time: the shape environment's range (what tracing
    assumed, narrowed by the program's checks). torch traces a symbolic size as >= 2 even where a
    ``Dim`` declares ``min=0`` or ``1`` and decides ``size == 1`` (broadcasting, a user's branch)
    without a trace of it, so sizes 0 and 1 are refused rather than served on the example's path
    (torch.export serves them, unsoundly); a module for size 1 is built from an example of size 1."""
    env = sym.shape_env
    rng = env.var_to_range.get(expr)
    low = int(rng.lower) if rng is not None and rng.lower.is_Integer else 0
    high = int(rng.upper) if rng is not None and rng.upper.is_Integer else None
    return low, high


def _sizes(val, sym: Symbolic) -> list:
    """Each size of ``val``: an int, a symbol (sympy), or a derived expression."""
    env = sym.shape_env
    out = []
    for size in val.shape:
        expr = env.replace(size.node.expr) if isinstance(size, torch.SymInt) else size
        out.append(int(expr) if isinstance(size, int) or expr.is_Integer else expr)
    return out


def _pinned(path: str, sym: Symbolic) -> tuple:
    """``(dim, line)`` for each size of the argument leaf ``path`` that was marked dynamic and that
    the trace made a constant (``Dim.AUTO`` specialised by ``len(x)``, ``float(x.shape[0])``): the
    program's line that did, for the message refusing another size."""
    import re

    env = sym.shape_env
    lines = getattr(env.guards, "where", {})
    out = []
    for symbol, sources in env.var_to_sources.items():
        if not env.replace(symbol).is_Integer:
            continue
        for source in sources:
            match = re.fullmatch(r"L\['([^']*)'\](.*)\.size\(\)\[(\d+)\]", source.name)
            if match is None or match[1] + match[2] != path:
                continue
            where = next((lines[id(g)] for g in env.guards if id(g) in lines and symbol in g.expr.free_symbols), None)
            if where is not None:
                out.append((int(match[3]), where))
    return tuple(sorted(out))


@dataclass(frozen=True)
class TracedSizes:
    """What a module's guards take from its trace (``guard_symbolic``): the symbolic sizes (None:
    all static), the layout facts the program read (leaf path -> ``runtime.Read``\\ s), and the
    symbolic value of the placeholder of each example argument leaf that is a tensor (by ``id``)."""

    symbolic: Symbolic | None
    layout_reads: dict
    values: dict


def concrete(symbolic: Symbolic | None, examples):
    """``examples`` with FakeTensors (an output's example, for a cotangent) made real tensors of
    their example sizes, to build guards from without specialising their symbols (sizes marked
    dynamic only: data-dependent ones have no example size)."""
    if symbolic is None:
        return examples

    def real(x):
        if isinstance(x, torch._subclasses.FakeTensor) and all(
            not isinstance(s, torch.SymInt) or s.node.hint is not None for s in x.shape
        ):
            shape = [s.node.hint if isinstance(s, torch.SymInt) else s for s in x.shape]
            return torch.empty(shape, dtype=x.dtype)
        return x

    return pytree.tree_map(real, examples)


def guard_symbolic(guards, traced: TracedSizes, examples) -> None:
    """Make the guards of a module traced with symbolic sizes accept every size in range, and only
    the sizes on the example's side of every decision the trace made on them.

    ``examples`` are the module's example arguments (the captured function's arguments, then
    cotangents or tangents); a leaf that is one of the captured arguments, or a FakeTensor
    (an output's example), has symbolic sizes, which become ``guards.Sym`` entries named after
    the user's ``Dim`` (or ``x.size(0)``, where the size was first seen, for ``Dim.AUTO``). A
    derived size (``2*b``: torch.export's Dim arithmetic, or a size the program tied to others)
    is a ``Sym`` of its own with a condition relating it. Every guard the ShapeEnv recorded
    becomes a ``runtime.Cond`` (``_Relations.conditions``). The layout facts the program read
    (``traced.layout_reads``, with or without symbolic sizes) go to their leaves first.
    """
    if guards is not None:
        _guard_reads(guards, traced.layout_reads)
    sym = traced.symbolic
    if sym is None or guards is None:
        return
    symbolic_of = traced.values
    values = pytree.tree_leaves(examples)
    leaves = guards.leaves()
    if len(values) != len(leaves):
        return
    shaped = []
    for leaf, value in zip(leaves, values):
        val = value if isinstance(value, torch._subclasses.FakeTensor) else symbolic_of.get(id(value))
        if leaf.kind == "tensor" and val is not None:
            shaped.append((leaf, value, _sizes(val, sym)))
    for leaf in leaves:
        if leaf.kind == "tensor":
            leaf.pinned = _pinned(leaf.path, sym)
    rel = _Relations(sym)
    for leaf, _, exprs in shaped:  # plain symbols first: derived sizes are said in their terms
        for d, expr in enumerate(exprs):
            if not isinstance(expr, int) and expr.is_symbol:
                rel.name(expr, f"{leaf.path}.size({d})")
    for leaf, value, exprs in shaped:
        new = rel.leaf_sizes(leaf.path, exprs)
        if new is not None and new != list(leaf.sizes):
            leaf.sizes = tuple(new)
            if isinstance(leaf.layout, tuple):
                leaf.layout = "contiguous" if value.is_contiguous() else None
    guards.conditions = rel.conditions()


def _guard_reads(guards, reads: dict) -> None:
    """Attach the layout facts read from each input leaf (by its path) to its guard."""
    for leaf in guards.leaves():
        if leaf.kind in ("tensor", "optional") and leaf.path in reads and leaf.role is None:
            leaf.reads = reads[leaf.path]


class _Relations:
    """The symbolic sizes of one module's arguments as ``Sym``\\ s, and the conditions between them."""

    def __init__(self, sym: Symbolic):
        self.sym, self.env = sym, sym.shape_env
        self.syms: dict = {}  # Sym name -> Sym
        self.subs: dict = {}  # ShapeEnv symbol -> expression over printing symbols (one per Sym name)
        self.extra: list = []  # (condition over printing symbols, where)

    def _printing(self, name: str):
        import sympy

        return sympy.Symbol(name, integer=True, nonnegative=True)

    def name(self, expr, fallback: str) -> None:
        if expr in self.subs:
            return
        name = next((n for s, n in self.sym.names.items() if self.env.replace(s) == expr), fallback)
        low, high = _range(expr, self.sym)
        self.syms[name] = _guards_sym()(name, low, high)
        self.subs[expr] = self._printing(name)

    def _origin(self, expr, name: str) -> str:
        """Why the size ``name`` is ``expr``: the user's derived Dim, or the decision that tied it."""
        declared = next((n for s, n in self.sym.names.items() if self.env.replace(s) == expr), None)
        if declared is not None:
            return f"declared by dynamic_shapes: {name} is {declared}"
        lines = getattr(self.env.guards, "where", {})
        for guard in self.env.guards:
            if guard.expr.free_symbols & expr.free_symbols and self.env.replace(guard.expr) == True:  # noqa: E712 - sympy
                return f"decided at {lines.get(id(guard), guard.sloc)}"
        return "the trace tied it to the other sizes"

    def leaf_sizes(self, path: str, exprs) -> list | None:
        """The leaf's sizes as ints and Syms, or None to keep them static (a derived size whose
        symbols cannot be read from the arguments)."""
        new: list = []
        for d, expr in enumerate(exprs):
            if isinstance(expr, int):
                new.append(expr)
            elif expr in self.subs:
                new.append(self.syms[str(self.subs[expr])])
            else:
                sym = self._derived(expr, f"{path}.size({d})")
                if sym is None:
                    return None
                new.append(sym)
        return new

    def _derived(self, expr, name: str):
        """A Sym for the size ``expr`` (``2*s0``), related to the others by a condition; an unnamed
        symbol in it is solved for when ``expr`` is linear in it (``2*b`` alone: b = size // 2)."""
        import sympy
        from torch.utils._sympy.functions import FloorDiv, Mod

        me = self._printing(name)
        unknown = [s for s in expr.free_symbols if s not in self.subs]
        where = self._origin(expr, name)
        if len(unknown) > 1:
            return None
        if unknown:
            s = unknown[0]
            poly = sympy.Poly(expr, s) if expr.is_polynomial(s) else None
            if poly is None or poly.degree() != 1:
                return None
            a, c = poly.all_coeffs()
            if not (a.is_Integer and a > 0) or c.free_symbols - set(self.subs):
                return None
            c = c.xreplace(self.subs)
            self.subs[s] = FloorDiv(me - c, a)
            if a != 1:
                self.extra.append((sympy.Eq(Mod(me - c, a), 0), where))
            low, high = _range(s, self.sym)
            self.extra.append((self.subs[s] >= low, where))
            if high is not None:
                self.extra.append((self.subs[s] <= high, where))
        else:
            self.extra.append((sympy.Eq(me, expr.xreplace(self.subs)), where))
        bounds = self.env.bound_sympy(expr)
        high = int(bounds.upper) if bounds.upper.is_Integer else None
        self.syms[name] = _guards_sym()(name, 0, high)
        return self.syms[name]

    def conditions(self) -> tuple:
        """Every guard the ShapeEnv recorded on these sizes, and the derived sizes' relations, as Conds."""
        lines = getattr(self.env.guards, "where", {})
        found = list(self.extra)
        for guard in self.env.guards:
            expr, line = self.env.replace(guard.expr), lines.get(id(guard))
            if line is not None and expr.free_symbols and expr.free_symbols <= set(self.subs):
                found.append((expr.xreplace(self.subs), f"decided at {line}"))
        out, seen = [], set()
        for expr, where in found:
            cond = _cond(expr, where)
            if cond is not None and cond.test not in seen:
                seen.add(cond.test)
                out.append(cond)
        return tuple(out)


def _guards_sym():
    from .runtime import Sym

    return Sym


def _cond(expr, where: str):
    """``expr`` (a sympy condition over printing symbols named after Syms) as a ``runtime.Cond``,
    or None if it always holds."""
    import sympy
    from torch.utils._sympy.printers import PythonPrinter

    from .runtime import Cond

    if expr is sympy.true or expr == sympy.true:
        return None
    names = tuple(sorted(str(s) for s in expr.free_symbols))
    by_name = {str(s): s for s in expr.free_symbols}
    plain = {by_name[n]: sympy.Symbol(f"v{i}", integer=True, nonnegative=True) for i, n in enumerate(names)}
    printer = PythonPrinter()
    return Cond(printer.doprint(expr), printer.doprint(expr.xreplace(plain)), names, where)
