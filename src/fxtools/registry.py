"""The table of VJP rules: which forward/backward pair differentiates which op.

A rule is a pair of plain Python functions, as in JAX's ``custom_vjp``:

- ``fwd(*args, **kwargs) -> (value, aux)`` computes the op's value and whatever the
  backward will need (``aux`` may be any Python structure of tensors and constants);
- ``bwd(aux, ct) -> arg cotangents``: one entry per positional argument of the op (a tensor,
  ``None`` for "no contribution", or a list for list arguments such as ``cat``'s). A single
  tensor may be returned for one-argument ops.

Rules run on FakeTensors while fxtools traces the derivative, so they may read ``x.shape``
and ``x.dtype`` freely; the torch calls they make become the generated code.

Complex tensors. A backward returns what autograd returns: for ``out = f(z)`` and cotangent
``ct``, the cotangent of ``z`` is ``ct * f'(z).conj()`` for a holomorphic ``f`` (the conjugate
Wirtinger derivative, PyTorch's "Autograd for Complex Numbers"); in general, for a real loss
``L``, the gradient of ``z = x + iy`` is ``dL/dx + i dL/dy``. ``vjp_rule`` rules are written as
the real formula (``ct * torch.cos(x)``) and, by default (``complex="holomorphic"``), receive
the op's complex arguments and outputs conjugated, which turns that formula into the convention
(``ct * torch.cos(x.conj())``); real tensors are passed as they are, so real code is unchanged.
A rule of a non-holomorphic op (``abs``, ``angle``, ``var``) says ``complex="convention"`` and
computes the convention itself; one written for real tensors only says ``complex="real"``, and
complex calls of its op are differentiated by PyTorch's decomposition or derivative formula.
``complex="complex"`` is the converse: a convention rule for complex calls only (real ones keep
PyTorch's formula, so their generated code is unchanged).

Keys are ``torch.ops.aten`` overload packets (``torch.ops.aten.sin``, covering every
overload) or single overloads (``torch.ops.aten.sum.dim_IntList``), which take precedence.

Rule sets. The table above holds the *readable* rules, the default. A named rule set (``"fused"``,
``rules/fused.py``) overrides some of them; ``with rule_set("fused"): ...`` makes every transform
traced inside look its rules up there first, then in the readable table. Rules a user registered
with ``register_vjp`` (into the default table) beat every rule set.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .graph.nodes import calls_with_grad_mode, is_float


@dataclass(frozen=True)
class Transform:
    """A public transform, declared once (``transforms.pipeline.uses_pipeline``): its name (the
    ``made_by`` of its modules, in messages and stamps) and the properties other stages ask about
    instead of its name (what the module returns is its function's docstring)."""

    name: str  # "fxtools.vjp"
    forward_mode: bool = False  # pushes tangents forward: a torch.autograd.Function's own jvp would go unused
    batches: bool = False  # maps f over the user's batch (below torch.func.vmap): custom Functions run their forward
    loss: bool = False  # differentiates a scalar loss: an nn.Module with parameters as f is ambiguous (calling.check_call)
    keywords: bool = True  # passes f's keyword arguments on, as inputs its module takes by keyword (calling.transform)
    returns: str = "result"  # what its modules return, as messages write the call: "out, grads = gm(x, grad_out)"
    extra: tuple[str, ...] = ()  # the module's own arguments after the function's, in that call

    def __str__(self) -> str:
        return self.name  # how messages name it


TRANSFORMS: dict[str, Transform] = {}  # every public transform's record, by name (``pipeline.uses_pipeline``)


@dataclass(frozen=True)
class Rule:
    fwd: Callable[..., tuple[Any, Any]]
    bwd: Callable[[Any, Any], Any]
    source: str = "hand-written"  # or "user", "derived", "fused"
    complex: str = "convention"  # the calls it handles (module docstring): all; "real" or "complex" ones only


COMPLEX_MODES = ("holomorphic", "convention", "real", "complex")


def _check_complex_mode(mode, allowed=COMPLEX_MODES):
    if mode not in allowed:
        raise ValueError(f"complex must be one of {', '.join(map(repr, allowed))}, not {mode!r}")


def conj_if_complex(x):
    """``x.conj()`` for a complex tensor or Python complex; anything else unchanged (no code)."""
    if isinstance(x, torch.Tensor):
        return x.conj() if x.is_complex() else x
    return x.conjugate() if isinstance(x, complex) else x


def cast_cotangent(g, dtype):
    """``g`` as a cotangent of a ``dtype`` value: a complex cotangent of a real value is its real
    part (autograd's convention: the imaginary part is the derivative along a direction the real
    value cannot move in), never a cast that warns and drops it."""
    if g.is_complex() and not dtype.is_complex:
        g = torch.real(g)
    return g if g.dtype == dtype else g.to(dtype)


def conj_complex_leaves(tree):
    """Every complex tensor or number of a pytree conjugated (the holomorphic rules' primals)."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(conj_if_complex, tree)


_RULES: dict[Any, Rule] = {}
_RULE_SETS: dict[str, dict[Any, Rule]] = {"readable": {}}  # name -> rules overriding _RULES
_ACTIVE = contextvars.ContextVar("fxtools_rule_set", default=("readable", _RULE_SETS["readable"]))


_BUILTIN: list[Callable[[], object]] = []  # imports fxtools' own rules (``fxtools/__init__.py`` sets it)


def load_builtin_rules_with(loader: Callable[[], object]) -> None:
    """``loader()`` registers fxtools' own rules: run before any table is read or written, so a
    user's rule replaces a built-in one however lazily the package was imported."""
    _BUILTIN[:] = [loader]


def _builtin() -> None:
    while _BUILTIN:
        _BUILTIN.pop()()  # popped first: the rules' own registrations come back here


def _table(rule_set):
    _builtin()
    return _RULES if rule_set is None else _RULE_SETS.setdefault(rule_set, {})


def _key(op):
    """Normalise torch.sin / aten.sin / aten.sin.default to an aten packet or overload."""
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return op
    if isinstance(op, str):
        name, _, overload = op.partition(".")
        packet = getattr(torch.ops.aten, name)
        return getattr(packet, overload) if overload else packet
    name = getattr(op, "__name__", None)
    if name and hasattr(torch.ops.aten, name):
        return getattr(torch.ops.aten, name)
    raise TypeError(
        f"register_vjp needs an ATen op such as torch.ops.aten.sin (got {op!r}); "
        "to give a whole Python function its own backward use fxtools.custom_vjp"
    )


def register_vjp(
    op, fwd: Callable, bwd: Callable, *, source: str = "user", rule_set: str | None = None, complex: str = "convention"
) -> Rule:
    """Add or replace the VJP rule of ``op`` (in the named ``rule_set``, default: the readable table).

    For complex tensors ``bwd`` must return autograd's convention (see the module docstring), or
    the rule says ``complex="real"`` and complex calls are differentiated by PyTorch's formula.

    ``op`` is an ATen op (``torch.ops.aten.sin``, ``torch.ops.aten.sum.dim_IntList``), its name
    (``"sin"``), or a torch function of the same name (``torch.sin``). Example::

        def sin_fwd(x):
            return torch.sin(x), x            # value, and what the backward needs
        def sin_bwd(x, ct):
            return ct * torch.cos(x)          # cotangent of the one argument
        fxtools.register_vjp(torch.ops.aten.sin, sin_fwd, sin_bwd)
    """
    _check_complex_mode(complex, ("convention", "real", "complex"))
    rule = Rule(fwd, bwd, source, complex)
    _table(rule_set)[_key(op)] = rule
    return rule


def _schema_names(op, n_args: int, keywords) -> list[str]:
    """The argument names of the overload of ``op`` a call with ``n_args`` positional arguments and
    these keywords binds to (a packet's overloads, such as ``conv2d``'s int and string padding,
    are tried in order)."""
    overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(op, name) for name in op.overloads()]
    for overload in overloads:
        names = [a.name for a in overload._schema.arguments if not a.is_out]
        if n_args <= len(names) and set(keywords) <= set(names):
            return names
    raise TypeError(f"{op} takes no {n_args} positional arguments with keywords {sorted(keywords)}")


def by_schema(op, fn: Callable, lead: int = 0) -> Callable:
    """``fn``, whose parameters end in ``**config``, called with the arguments of a call of ``op``:
    the op's arguments past ``fn``'s named parameters reach ``config`` under their schema names, as
    the call gave them (absent ones stay absent: ``fn`` supplies their defaults). This is how a rule
    receives an op's non-tensor configuration (a convolution's stride, padding, ...; a norm's
    momentum and eps) as one unit, to pass on to a backward kernel taking the same. ``lead``: the
    parameters before the op's arguments (a ``vjp_rule`` backward's ``ct, out``)."""
    named = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    n_named = len(named) - lead

    def call(*args, **kwargs):
        head, args = args[:lead], args[lead:]
        names = _schema_names(op, len(args), kwargs)
        config = dict(zip(names[n_named:], args[n_named:]))
        config.update((k, v) for k, v in kwargs.items() if k not in names[:n_named])
        named_kwargs = {k: v for k, v in kwargs.items() if k in names[:n_named]}
        return fn(*head, *args[:n_named], **named_kwargs, **config)

    return call


def _takes_config(fn) -> bool:
    """Whether ``fn``'s parameters end in ``**config`` with no ``*args`` (``by_schema``'s functions)."""
    kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
    return inspect.Parameter.VAR_KEYWORD in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds


def vjp_rule(op, *, rule_set: str | None = None, complex: str = "holomorphic", replay: bool = True):
    """Decorator for the common rule shape: the forward is the op itself.

    The decorated function is ``bwd(ct, out, *args, **kwargs) -> arg cotangents`` and sees the
    op's output and arguments; it becomes the pair (call the op and keep its inputs and output,
    this backward). This is how fxtools' own rules are written::

        @vjp_rule(aten.sin)
        def sin(ct, out, x):
            return ct * torch.cos(x)

    A backward whose parameters end in ``**config`` receives the op's arguments past its named
    ones by their schema names (``by_schema``): ``def convolution(ct, out, x, weight, bias, **conv)``.

    ``complex`` says how the rule treats complex tensors (module docstring): ``"holomorphic"``
    (conjugated arguments and output), ``"convention"``, ``"real"`` or ``"complex"``.
    ``replay=False``: the backward depends on more than its arguments' metadata (it reads the
    graph traced so far), so reverse mode never replays it from an earlier call
    (``transforms/replay.py``).
    """
    _check_complex_mode(complex)

    def register(bwd_of_inputs):
        rule = by_schema(op, bwd_of_inputs, lead=2) if _takes_config(bwd_of_inputs) else bwd_of_inputs

        def fwd(*args, **kwargs):
            out = op(*args, **kwargs)
            return out, (out, args, kwargs)

        def bwd(aux, ct):
            out, args, kwargs = conj_complex_leaves(aux) if complex == "holomorphic" else aux
            return rule(ct, out, *args, **kwargs)

        bwd.replayable = replay  # type: ignore[attr-defined]
        fwd.__name__ = bwd.__name__ = bwd_of_inputs.__name__
        fwd.__qualname__ = bwd.__qualname__ = bwd_of_inputs.__qualname__
        _table(rule_set)[_key(op)] = Rule(
            fwd, bwd, "hand-written" if rule_set is None else rule_set, "convention" if complex == "holomorphic" else complex
        )
        return bwd_of_inputs

    return register


def _find(table, op) -> Rule | None:
    _builtin()
    rule = table.get(op)
    if rule is None and isinstance(op, torch._ops.OpOverload):
        rule = table.get(op.overloadpacket)
    return rule


def lookup(op) -> Rule | None:
    """The rule for an op overload in the active rule set: the overload's own, else its packet's;
    the readable rule where the set has none; a user's ``register_vjp`` rule before either."""
    rule = _find(_RULES, op)
    overrides = _ACTIVE.get()[1]
    if overrides and not (rule is not None and rule.source == "user"):
        return _find(overrides, op) or rule
    return rule


def handles(rule: Rule | None, node) -> bool:
    """Whether ``rule`` differentiates ``node``: not a real-only rule called with complex tensors,
    nor a complex-only one called with real ones."""
    if rule is None:
        return False
    mode = getattr(rule, "complex", "convention")
    if mode == "convention":
        return True
    from torch.utils import _pytree as pytree

    vals = [a.meta.get("val") for a in node.all_input_nodes] + pytree.tree_leaves(node.meta.get("val"))
    return any(isinstance(v, torch.Tensor) and v.is_complex() for v in vals) == (mode == "complex")


def lookup_node(node) -> Rule | None:
    """The rule differentiating the call ``node``: ``lookup``'s, or, when that one is written for
    real tensors and the call has complex ones, the readable table's if it handles them (a fused
    rule's fallback); None when neither does (PyTorch's formula is then used)."""
    rule = lookup(node.target)
    if rule is not None and not handles(rule, node):
        readable = readable_rule(node.target)
        return readable if handles(readable, node) else None
    return rule


def readable_rule(op) -> Rule | None:
    """The rule of the default (readable) table, whatever set is active: a fused rule's fallback."""
    return _find(_RULES, op)


def rule_sets() -> list[str]:
    """Names of the rule sets ``rule_set`` accepts."""
    _builtin()
    return list(_RULE_SETS)


def active_rule_set() -> str:
    """The name of the rule set in effect (``"custom"`` for a table passed to ``rule_set``)."""
    return _ACTIVE.get()[0]


@contextlib.contextmanager
def rule_set(rules="readable"):
    """Use another rule set while transforms are traced: ``with fxtools.rule_set("fused"): ...``.

    ``rules`` is a name from ``rule_sets()`` (``"readable"``, the default set; ``"fused"``, rules
    whose backwards call PyTorch's fused backward kernels; ``"adjoint"``, the adjoint of the forward
    where PyTorch's gradient is not it: forward mode's), ``None`` (keep the current set), or a
    dict ``{op: (fwd, bwd)}`` of rules overriding the readable ones. Graphs already made are
    unaffected; the setting is per thread (and per asyncio task).
    """
    _builtin()
    if rules is None:
        yield
        return
    if isinstance(rules, str):
        if rules not in _RULE_SETS:
            raise ValueError(f"unknown rule set {rules!r}; known: {', '.join(map(repr, _RULE_SETS))}")
        entry = (rules, _RULE_SETS[rules])
    elif isinstance(rules, dict):
        entry = ("custom", {_key(op): r if isinstance(r, Rule) else Rule(*r, source="user") for op, r in rules.items()})
    else:
        raise TypeError(f"rules must be a rule set's name, None or a dict op -> (fwd, bwd), not {rules!r}")
    token = _ACTIVE.set(entry)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def registered_ops(rule_set: str | None = None) -> dict:
    """A copy of the readable rule table, or of a named set's own rules (op -> Rule)."""
    return dict(_table(rule_set))


_NONDIFFERENTIABLE: set = set()


def mark_nondifferentiable(*ops) -> None:
    """Declare ops whose output carries no gradient (``detach``, ``floor``, random fills, ...).

    Like autograd, fxtools then treats their outputs as constants: the gradient through them is
    zero, and no backward code is emitted for them.
    """
    _builtin()
    _NONDIFFERENTIABLE.update(_key(op) for op in ops)


def is_nondifferentiable(op) -> bool:
    _builtin()
    if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return op in _NONDIFFERENTIABLE
    return op in _NONDIFFERENTIABLE or (isinstance(op, torch._ops.OpOverload) and op.overloadpacket in _NONDIFFERENTIABLE)


def differentiable_nodes(gm: fx.GraphModule, wrt: set[fx.Node]) -> set[fx.Node]:
    """The nodes whose value depends differentiably on the placeholders in ``wrt``.

    Gradients stop at non-floating outputs, at ops declared non-differentiable (``detach``,
    ``floor``, comparisons), and inside ``torch.no_grad()`` regions.
    """
    need = set(wrt)
    for node, grad_enabled in calls_with_grad_mode(gm.graph):
        if not grad_enabled or is_nondifferentiable(node.target):
            continue
        inputs = node.all_input_nodes
        if not any(a in need for a in inputs):
            continue
        val = node.meta.get("val")
        if any(is_float(v) for v in pytree.tree_leaves(val)):
            need.add(node)
    return need
