"""Where a NaN came from: the first non-finite value of a split's step, named by the user's line.

``locate(sp, leaves)`` runs a split's readable forward and backward one node at a time and stops
at the first value that holds a NaN, or an infinity no constant of the program put there, in
execution order: the inputs, the forward, the cotangents, the backward. An infinity is *intended*
when the op that made it read one: a literal (``masked_fill(mask, float("-inf"))``, ``torch.full``,
``torch.where(c, x, -inf)``), a constant the program holds, or a value already holding one (the
causal mask added to the scores). A NaN is always reported, including the one an intended
infinity causes later (a softmax over a row that is all ``-inf``).

The report (``NonFiniteReport``) names the value as the generated code does, the user's statement
it comes from (for a backward value, the forward statement whose derivative made it: split's
backward nodes carry the stack trace of the forward op their rule was called for), each
operand's summary, and hints for the classic causes.

``check_finite`` on training modules (``fxtools.compile``, ``split``, ``backend``) is cheap:
``Checker`` reduces what a forward returns and what a backward returns to one number per tensor
(``x.sum()`` is finite exactly when ``x`` is, unless finite values overflow the sum: then an
exact check follows), added into one scalar read once per forward and once per backward; only
when that is not finite is the step run again here to locate the first value.
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import NonFiniteError, user_stack_of
from ..graph import meta
from ..graph.nodes import is_float

__all__ = ["Summary", "NonFiniteReport", "locate", "Checker", "checked_split"]


# --------------------------------------------------------------------------------------------
# Summaries and the report
# --------------------------------------------------------------------------------------------


@dataclass
class Summary:
    """What a tensor holds: shape, dtype, min and max of its finite entries, how many zeros, infinities, NaNs."""

    shape: tuple
    dtype: torch.dtype
    min: float | None
    max: float | None
    zeros: int
    infs: int
    nans: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Summary:
        t = t.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        if not (t.is_floating_point() or t.is_complex()):
            t = t.double() if t.dtype != torch.bool else t.to(torch.uint8)
        finite = t[torch.isfinite(t)] if t.is_floating_point() else t
        lo = hi = None
        if finite.numel():
            lo, hi = float(finite.min()), float(finite.max())
        nans = int(torch.isnan(t).sum()) if t.is_floating_point() else 0
        infs = int(torch.isinf(t).sum()) if t.is_floating_point() else 0
        return cls(tuple(t.shape), t.dtype, lo, hi, int((t == 0).sum()), infs, nans)

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        rng = "no finite entries" if self.min is None else f"min {self.min:.4g}, max {self.max:.4g}"
        return f"{dtype}{list(self.shape)}: {rng}, {self.zeros} zeros, {self.infs} infs, {self.nans} NaNs"


@dataclass
class NonFiniteReport:
    """The first non-finite value of a step (see the module docstring).

    ``phase``: ``"input"``, ``"forward"`` or ``"backward"``; ``name``: the value's name in the
    generated code (an argument's path for an input); ``line``: the user's statement that produced it
    (for a backward value, the forward statement whose derivative did), with ``filename`` and
    ``lineno``; ``stack``: the user's frames ``(filename, lineno, code)`` that reached that line,
    innermost last (the line itself; before it, the call sites of the helpers it is in);
    ``op``: the ATen op that computed it; ``statement``: the generated statement."""

    phase: str
    name: str
    line: str | None = None
    filename: str | None = None
    lineno: int | None = None
    op: str | None = None
    statement: str | None = None
    module: str | None = None  # "forward" / "backward": the generated module the statement is in
    value: Summary | None = None
    operands: list[tuple[str, Summary]] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    stack: list[tuple[str, int, str]] = field(default_factory=list)

    def __str__(self) -> str:
        what = "NaN" if self.value is not None and self.value.nans else "infinity"
        where = "an argument" if self.phase == "input" else f"the {self.phase}"
        out = [f"first non-finite value ({what}): {self.name}, in {where}"]
        if self.statement:
            out.append(f"  generated ({self.module}):  {self.statement}")
        if self.line is not None:
            how = "the derivative of your line" if self.phase == "backward" else "your line"
            out.append(f"  {how}:  {self.filename}:{self.lineno}: {self.line}")
            out += [f"    called from:  {f}:{n}: {code}" for f, n, code in reversed(self.stack[:-1])]
        if self.value is not None:
            out.append(f"  {self.name}: {self.value}")
        for name, s in self.operands:
            out.append(f"    operand {name}: {s}")
        out += [f"  hint: {h}" for h in self.hints]
        return "\n".join(out)


def _statement(gm: fx.GraphModule, name: str) -> str | None:
    """The flat (one op per line) statement of the generated code that assigns ``name``."""
    from ..codegen.fold import flat_code

    for line in flat_code(gm).splitlines():
        text = line.strip()
        targets = text.split(" = ", 1)[0] if " = " in text else ""
        if name in (t.strip() for t in targets.split(",")):
            return text
    return None


def _op_of(node: fx.Node):
    """The ATen op a rendered node computes (``node.meta['original_aten']``), or its target."""
    op = node.meta.get("original_aten")
    if op is None and isinstance(node.target, torch._ops.OpOverload):
        op = node.target
    if op is None and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return _op_of(node.args[0])  # an output of a multi-output op: that op's
    return op


def _op_name(op) -> str | None:
    if isinstance(op, torch._ops.OpOverload):
        return str(op.overloadpacket)
    return getattr(op, "__name__", None) if op is not None else None


def _short(op) -> str:
    return op._opname if isinstance(op, torch._ops.OpOverload) else (getattr(op, "__name__", "") or "")


# --------------------------------------------------------------------------------------------
# Hints for the classic causes
# --------------------------------------------------------------------------------------------

_LOG = {"log", "log2", "log10", "xlogy", "log1p"}
_SQRT = {"sqrt", "rsqrt"}
_POW = {"pow"}
_DIV = {"div", "reciprocal"}
_NORM = {"linalg_vector_norm", "norm", "_weight_norm_interface", "linalg_norm"}
_SOFTMAX = {"_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax"}
_EXP = {"exp", "expm1", "exp2", "sinh", "cosh"}
_ARC = {"acos", "asin"}
_WHERE = {"where", "masked_fill", "_masked_fill"}


def _has(s: Summary, what: str) -> bool:
    return getattr(s, what) > 0


def _forward_hint(op: str, ins: list, out: torch.Tensor, feeds: set[str], sources: set[str]) -> list[str]:
    """Hints for a forward value computed by ``op`` from ``ins`` (``feeds``: ops reading the value;
    ``sources``: ops that made its operands, a step or two back)."""
    hints = []
    x = next((t for t in ins if is_float(t)), None)
    neg = x is not None and not x.is_complex() and bool((x < 0).any())
    zero = x is not None and bool((x == 0).any())
    if op in _LOG and (zero or neg):
        hints.append(
            "log at 0 is -inf (and NaN below 0): clamp its argument (torch.log(x.clamp_min(eps))) or use "
            "log_softmax / logsumexp / log1p instead of the log of a computed probability"
        )
    if op in _SQRT and (neg or zero):
        hints.append("sqrt of a negative number is NaN (rsqrt at 0 is inf): clamp the argument (x.clamp_min(eps))")
    if op in _POW and (zero or neg):
        hints.append("pow at 0 with a negative exponent is inf, a negative base with a fractional exponent NaN")
    if op in _DIV and len(ins) == 2 and isinstance(ins[1], torch.Tensor):
        num, den = ins
        den_zero = den == 0
        if bool(den_zero.any()):
            both = bool((den_zero & (num == 0)).any()) if isinstance(num, torch.Tensor) else num == 0
            hints.append("0/0 is NaN" if both else "a division by 0 gives inf")
            if sources & _NORM:
                hints.append(
                    "x / x.norm() at x = 0: use torch.nn.functional.normalize(x, dim=..., eps=1e-12) or divide by "
                    "x.norm().clamp_min(eps)"
                )
    if op in _SOFTMAX and x is not None and bool(torch.isneginf(x).any()) and bool(torch.isnan(out).any()):
        hints.append(
            "softmax over a row that is all -inf is NaN (0/0): a mask that hides every position of a row "
            "(padding, an empty causal window); keep one position unmasked or use torch.finfo(dtype).min"
        )
    if op in _EXP and x is not None and x.is_floating_point():
        limit = math.log(torch.finfo(x.dtype).max)
        if bool((x > limit).any()):
            hints.append(
                f"exp overflows {str(x.dtype).replace('torch.', '')} above {limit:.4g}: subtract the maximum first "
                "(softmax, logsumexp do), or compute in a wider dtype"
            )
    if op in _ARC and x is not None and not x.is_complex() and bool((x.abs() > 1).any()):
        hints.append("acos/asin outside [-1, 1] is NaN: clamp to [-1 + eps, 1 - eps]")
    if op in ("lift_fresh_copy", "lift_fresh"):
        hints.append("a tensor your line makes from a literal NaN (torch.tensor(float('nan')), x[mask] = float('nan'))")
    if feeds & {"where"}:
        hints.append(_WHERE_HINT)
    return hints


_WHERE_HINT = (
    "a torch.where reads this value: where it does not select it the forward stays finite, but the gradient "
    "there is NaN (0 * inf); make the branch's input safe first: torch.where(c, f(torch.where(c, x, safe_x)), other)"
)

_BACKWARD_HINTS = [
    (_LOG, "the derivative of log at 0 is 1/0 = inf: clamp the argument (x.clamp_min(eps))"),
    (_SQRT, "the derivative of sqrt at 0 is infinite (1 / (2 sqrt(0))): use sqrt(x + eps) or x.clamp_min(eps).sqrt()"),
    (_POW, "the derivative of x ** p at x = 0 is infinite for p < 1: clamp x away from 0 (x.clamp_min(eps) ** p)"),
    (_NORM, "the derivative of a norm at 0 is 0/0: use torch.nn.functional.normalize(x, eps=...) or clamp the norm"),
    (_ARC, "the derivative of acos/asin at +-1 is infinite: clamp to [-1 + eps, 1 - eps]"),
    (_DIV, "the derivative of a / b at b = 0 divides by 0: keep the denominator away from 0"),
    (_EXP, "exp overflows in the backward too: subtract the maximum first (softmax, logsumexp)"),
]


def _backward_hints(ops: set[str], feeds: set[str]) -> list[str]:
    """Hints for a backward value of a statement computing ``ops`` (``feeds``: ops reading their values)."""
    hints = [h for family, h in _BACKWARD_HINTS if ops & family]
    if (ops | feeds) & {"where"}:
        hints.append(_WHERE_HINT)
    return hints


# --------------------------------------------------------------------------------------------
# Locating the first non-finite value: the split's graphs run one node at a time
# --------------------------------------------------------------------------------------------


class _Found(Exception):
    def __init__(self, report: NonFiniteReport):
        self.report = report


def _literal_inf(node: fx.Node) -> bool:
    """Whether a Python number among ``node``'s arguments is infinite (``masked_fill(m, -inf)``, ``full``)."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return any(isinstance(a, float) and math.isinf(a) for a in leaves)


def _bad(t) -> tuple[bool, bool]:
    """(holds a NaN, holds an infinity) for a floating-point tensor, (False, False) otherwise."""
    if not is_float(t) or t.numel() == 0:
        return False, False
    t = torch.view_as_real(t) if t.is_complex() else t
    return bool(torch.isnan(t).any()), bool(torch.isinf(t).any())


class _Statements:
    """The forward ops of each user statement (by stack trace), and the ops that read them: what a
    backward value's hints are about."""

    def __init__(self, graphs):
        self.ops: dict[str, set[str]] = {}
        self.feeds: dict[str, set[str]] = {}
        for gm in graphs:
            for n in gm.graph.nodes:
                trace = n.meta.get("stack_trace")
                if trace and meta.PHASE.get(n) == "forward" and n.op != "placeholder":
                    self.ops.setdefault(trace, set()).add(_short(_op_of(n)))
                    self.feeds.setdefault(trace, set()).update(_short(_op_of(u)) for u in n.users)


class _Walk(fx.Interpreter):
    """One generated graph run node by node, collecting its non-finite values as candidates.

    A candidate is reported only if its non-finite entries reach what the step gives back through
    non-finite values (``first_reaching``): the forward's results, or, through a saved value, a
    gradient. The rules' own steps may hold an infinity they then mask (the norm's ``(ct /
    norm).masked_fill(norm == 0, 0)``, as PyTorch's kernels do), and a program may write a NaN on
    purpose and drop it (``masked_fill(mask, nan)`` then ``nanmean``): neither is a cause.
    A tensor the program holds that holds a NaN raises ``_Found`` at once."""

    def __init__(self, gm: fx.GraphModule, part: str, statements: _Statements):
        super().__init__(gm)
        self.part, self.statements = part, statements
        self.infs: set[fx.Node] = set()  # values holding an intended infinity
        self.bad: set[fx.Node] = set()  # values holding a NaN or an infinity
        self.candidates: list[tuple[fx.Node, NonFiniteReport]] = []

    def get_attr(self, target, args, kwargs):
        val = super().get_attr(target, args, kwargs)
        return val.clone() if isinstance(val, torch.Tensor) else val  # the rerun leaves the module's buffers alone

    def run_node(self, n: fx.Node):
        val = super().run_node(n)
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            nan, inf = _bad(val)
            if nan or inf:
                self.bad.add(n)  # a saved value: a forward candidate may reach a gradient through it
            if inf and not nan:
                self.infs.add(n)  # a saved value or input already checked
        elif n.op != "output" and isinstance(val, torch.Tensor):
            self.check(n, val)
        return val

    def check(self, n: fx.Node, val: torch.Tensor) -> None:
        if _uninitialized(n):  # memory to be written (dropout's mask before its draw): its bits mean nothing
            return
        nan, inf = _bad(val)
        if not (nan or inf):
            return
        self.bad.add(n)
        if n.op == "get_attr" and _literal(n):  # the program's own literal (torch.tensor(nan), x[m] = nan): its user is checked
            if not nan:
                self.infs.add(n)
            return
        if nan and n.op == "get_attr":  # a buffer or closed-over tensor held it before the step: no line made it
            raise _Found(_held_report(str(n.target), val))
        if not nan and (n.op == "get_attr" or _literal_inf(n) or any(x in self.infs for x in n.all_input_nodes)):
            self.infs.add(n)  # an intended infinity: a constant's, a literal's, or carried from one
            return
        self.candidates.append((n, self.report(n, val)))

    def reaching(self, targets) -> set[fx.Node]:
        """The non-finite values from which non-finite values lead to one of ``targets`` (nodes)."""
        reach, stack = set(), [x for x in targets if x in self.bad]
        while stack:
            x = stack.pop()
            if x not in reach:
                reach.add(x)
                stack += [y for y in x.all_input_nodes if y in self.bad]
        return reach

    def first_reaching(self, targets) -> tuple[fx.Node, NonFiniteReport] | None:
        """The first candidate (in execution order) that reaches ``targets``, with its report."""
        reach = self.reaching(targets)
        return next(((n, report) for n, report in self.candidates if n in reach), None)

    def report(self, n: fx.Node, val: torch.Tensor) -> NonFiniteReport:
        stack = user_stack_of(n)
        frame = stack[-1] if stack else None
        op = _op_of(n)
        phase = meta.PHASE.get(n) or self.part
        args = fx.node.map_arg(n.args, lambda x: self.env.get(x))
        ins = list(args) if isinstance(args, (tuple, list)) else [args]
        operands = [(x.name, Summary.of(self.env[x])) for x in n.all_input_nodes if isinstance(self.env.get(x), torch.Tensor)]
        trace = n.meta.get("stack_trace")
        if phase == "forward":
            feeds = {_short(_op_of(u)) for u in n.users}
            hints = _forward_hint(_short(op), ins, val, feeds, _sources(n))
        else:
            ops, feeds = self.statements.ops.get(trace or "", set()), self.statements.feeds.get(trace or "", set())
            hints = _backward_hints(ops, feeds)
        return NonFiniteReport(
            phase,
            n.name,
            line=frame[2] if frame else None,
            filename=frame[0] if frame else None,
            lineno=frame[1] if frame else None,
            op=_op_name(op),
            statement=_statement(self.module, n.name),  # type: ignore[arg-type]  # Interpreter's module is our GraphModule
            module=self.part,
            value=Summary.of(val),
            operands=operands,
            hints=hints,
            stack=stack,
        )


def _literal(n: fx.Node) -> bool:
    """Whether ``get_attr`` node ``n`` is a tensor the program makes from a literal on each call
    (``torch.tensor(float("nan"))``, the value of ``x[mask] = float("nan")``): tracing keeps it as a
    constant read only through ``lift_fresh_copy``, where a buffer or closed-over tensor is read as is."""
    return bool(n.users) and all(_short(_op_of(u)) in ("lift_fresh_copy", "lift_fresh") for u in n.users)


_EMPTY = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}


def _uninitialized(n: fx.Node) -> bool:
    """Whether ``n`` makes a tensor without values (``torch.empty_like``), which a later op fills: whatever
    its uninitialized memory holds (NaN bit patterns included) is no value of the program."""
    op = _op_of(n)
    name = _short(op) if op is not None else getattr(n.target, "__name__", "")
    return name in _EMPTY


def _sources(n: fx.Node, depth: int = 3) -> set[str]:
    """The ops that made ``n``'s operands, up to ``depth`` steps back (``x / x.norm()`` through views)."""
    found, frontier = set(), list(n.all_input_nodes)
    for _ in range(depth):
        found |= {_short(_op_of(x)) for x in frontier}
        frontier = [y for x in frontier for y in x.all_input_nodes]
    return found


def _held_report(name: str, x: torch.Tensor) -> NonFiniteReport:
    """A tensor the program holds (a module's buffer, a closed-over tensor) holding a NaN when the step
    starts: an input of the step, not a value any line of it made."""
    hint = (
        f"{name} is a tensor the program holds (a module's buffer or a closed-over tensor), not an argument: "
        "it already held a NaN when this step started (written by an earlier step, an in-place update "
        "or the code that made it)"
    )
    return NonFiniteReport("input", name, value=Summary.of(x), hints=[hint])


def _input_report(name: str, x: torch.Tensor, phase: str = "input") -> NonFiniteReport:
    return NonFiniteReport(phase, name, value=Summary.of(x))


def locate(sp, leaves, cotangents=None, rng=None, backward=True) -> NonFiniteReport | None:
    """The first non-finite value of a step of split ``sp`` (a ``fxtools.Split``) on the tensor
    ``leaves`` of its arguments, with ``cotangents`` (default: ones) for the backward, or None.
    ``backward=False``: the forward alone (a forward's check: its backward, with the cotangents
    the step will get, is checked when it runs; ones could overflow where those do not).

    Runs the readable forward and backward one node at a time, the generators set to ``rng`` (a
    ``training.saved.rng_state``) if given; the module's buffers are not written."""
    from .saved import rng_restored

    statements = _Statements([sp.forward, sp.backward])
    with rng_restored(rng) if rng is not None else torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            for info, x in zip(sp.signature, leaves):
                if any(_bad(x)):
                    raise _Found(_input_report(info.path or info.name, x))
            _walk_step(sp, leaves, cotangents, statements, backward)
            return None
        except _Found as found:
            return found.report


def locate_backward(sp, saved: list, cotangents: list) -> NonFiniteReport | None:
    """The first non-finite value of ``sp``'s backward on ``saved`` and ``cotangents``, or None."""
    try:
        walk = _walk_backward(sp, saved, cotangents, _Statements([sp.forward, sp.backward]))
        found = walk.first_reaching(_output_nodes(sp.backward))
        return None if found is None else found[1]
    except _Found as found:
        return found.report


def _output_nodes(gm: fx.GraphModule, value=None) -> list[fx.Node]:
    return [x for x in pytree.tree_leaves(gm.graph.output_node().args if value is None else value) if isinstance(x, fx.Node)]


def _walk_step(sp, leaves, cotangents, statements, backward: bool) -> None:
    """Run the forward, then (``backward``) the backward, raising ``_Found`` for the first value, in
    execution order, whose non-finite entries reach the step's results or its gradients.

    A backward value that reaches a gradient gives way to a non-finite forward value of the same
    line that reaches nothing: ``torch.where(x > 0, torch.log(x), 0)`` at 0 is reported as the log's
    infinity in the forward (the cause the hints explain), not as the NaN of its derivative."""
    forward = _Walk(sp.forward, "forward", statements)
    out, saved = forward.run(*leaves)
    results, saved_nodes = sp.forward.graph.output_node().args[0]
    found = forward.first_reaching(_output_nodes(sp.forward, results))
    if found is None and backward:
        if cotangents is None:
            outs = pytree.tree_leaves(out)
            cotangents = [torch.ones_like(outs[i]) for i in sp.ct_index]
        walk = _walk_backward(sp, list(saved), cotangents, statements)
        reach = walk.reaching(_output_nodes(sp.backward))
        inputs = [n for n in sp.backward.graph.nodes if n.op == "placeholder"]
        through = (
            [s for s, p in zip(saved_nodes, inputs) if p in reach] if len(inputs) == len(saved) + len(cotangents) else saved_nodes
        )
        found = forward.first_reaching([s for s in through if isinstance(s, fx.Node)])
        if found is None:
            found = walk.first_reaching(_output_nodes(sp.backward))
            line = found and found[0].meta.get("stack_trace")
            found = next(((n, r) for n, r in forward.candidates if line and n.meta.get("stack_trace") == line), found)
    if found is not None:
        raise _Found(found[1])


def _walk_backward(sp, saved, cotangents, statements) -> _Walk:
    """Check the cotangents (raising ``_Found``), then run the backward."""
    for info, c in zip(sp.cotangents, cotangents):
        if any(_bad(c)):
            raise _Found(_input_report(f"{info.name} (the cotangent of {info.path})", c, "backward"))
    walk = _Walk(sp.backward, "backward", statements)
    walk.run(*saved, *cotangents)
    return walk


# --------------------------------------------------------------------------------------------
# The cheap check of every step
# --------------------------------------------------------------------------------------------


def may_hold_inf(gm: fx.GraphModule) -> set[str]:
    """Names of the values of ``gm`` that may hold an intended infinity: a literal's or a constant's,
    and every value computed from one."""
    found: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr" or (n.op != "placeholder" and _literal_inf(n)):
            found.add(n.name)
        elif any(x.name in found for x in n.all_input_nodes):
            found.add(n.name)
    return found


def all_finite(tensors, nan_only=()) -> bool:
    """Whether every floating-point tensor of ``tensors`` is finite (those ``nan_only`` flags: free of
    NaNs), read with one synchronisation. May answer False for finite values whose sum overflows."""
    sums, nans = [], []
    flags = list(nan_only) + [False] * (len(tensors) - len(nan_only))
    for t, only_nan in zip(tensors, flags):
        if not is_float(t) or t.numel() == 0:
            continue
        t = torch.view_as_real(t) if t.is_complex() else t
        if only_nan:
            nans.append(torch.isnan(t).any())
        else:
            sums.append(t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum())
    if not sums and not nans:
        return True
    device = (sums or nans)[0].device
    ok = torch.ones((), dtype=torch.bool, device=device)
    if sums:
        ok = ok & torch.isfinite(torch.stack([s.to(device, torch.float64) for s in sums]).sum())
    if nans:
        ok = ok & ~torch.stack([f.to(device) for f in nans]).any()
    return bool(ok)


class Checker:
    """``check_finite`` for the steps of one split: which of its outputs may hold an intended
    infinity (checked for NaNs only), the cheap check, and the error on failure.

    A forward's outputs and a backward's gradients are checked; the saved values are not (they
    are most of a step's bytes, and a NaN among them reaches the gradients): a non-finite value
    only the backward shows is raised after the backward, named by the rerun of the whole step,
    so the report may still be a forward value."""

    def __init__(self, sp):
        self.split = sp
        inf = may_hold_inf(sp.forward)
        outs, _ = sp.forward.graph.output_node().args[0]
        self.out_nan_only = [isinstance(o, fx.Node) and o.name in inf for o in pytree.tree_leaves(outs)]

    def forward(self, leaves, outs, rng=None) -> None:
        """After a forward: raise ``NonFiniteError`` if a value it returns is not finite."""
        if not all_finite(outs, self.out_nan_only[: len(outs)]):
            self.fail(locate(self.split, leaves, rng=rng, backward=False))

    def backward(self, grads, redo) -> None:
        """After a backward: raise ``NonFiniteError`` if a gradient is not finite; ``redo()`` locates."""
        if not all_finite([g for g in grads if isinstance(g, torch.Tensor)]):
            self.fail(redo())

    @staticmethod
    def fail(report: NonFiniteReport | None) -> None:
        if report is not None:  # None: intended infinities, or finite values whose sum overflowed
            raise NonFiniteError(report)


def checked_split(sp):
    """``sp`` whose forward and backward modules raise ``NonFiniteError`` at a non-finite step
    (``fxtools.split(..., check_finite=True)``), through module hooks.

    Each forward's inputs and random-number state are kept with its saved values (the last few
    forwards'), so a backward that fails reruns its whole step; the boxed backward keeps its
    arguments until the check has passed."""
    from .saved import rng_state

    checker = Checker(sp)
    steps: list = []  # (weak references to a forward's saved values, its inputs, the generators' state before it)
    pending: dict = {}

    def before_forward(module, args):
        pending["rng"] = rng_state(args)

    def after_forward(module, args, out):
        rng = pending.pop("rng", None)
        checker.forward(list(args), pytree.tree_leaves(out[0]), rng)
        refs = [weakref.ref(t) if isinstance(t, torch.Tensor) else (lambda t=t: t) for t in out[1]]
        steps.append((refs, list(args), rng))
        del steps[:-8]

    def before_backward(module, args):
        pending["args"] = list(args[0]) if module is sp.backward_boxed else list(args)

    def after_backward(module, args, grads):
        saved_and_cts = pending.pop("args")
        n = len(sp.saved)
        saved, cts = saved_and_cts[:n], saved_and_cts[n:]
        step = next((st for st in steps if len(st[0]) == n and all(r() is v for r, v in zip(st[0], saved))), None)

        def redo():
            if step is None:  # saved values from elsewhere: their backward alone
                return locate_backward(sp, saved, cts)
            return locate(sp, step[1], cts, rng=step[2])

        checker.backward(pytree.tree_leaves(grads), redo)

    sp.forward.register_forward_pre_hook(before_forward)
    sp.forward.register_forward_hook(after_forward)
    for gm in (sp.backward, sp.backward_boxed):
        gm.register_forward_pre_hook(before_backward)
        gm.register_forward_hook(after_backward)
    return sp
