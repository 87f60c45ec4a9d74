"""Random straight-line PyTorch programs for the differential fuzzer (``tests/test_fuzz.py``).

``program(index, seed=0)`` builds program number ``index``: a function ``f(x0, x1, ..., i0, ...)``
of float64 inputs ``x*`` and integer index inputs ``i*``, written as Python source and compiled,
together with example inputs. The same ``(seed, index)`` always gives the same program and the
same inputs (a ``random.Random`` and a ``torch.Generator`` seeded from both), so a failure is
reproduced from its index alone; ``python tests/fuzz_programs.py INDEX [SEED]`` prints it.

How a program is built: a pool of values starts with a few inputs; each step picks an op from the
vocabulary (pointwise unary, broadcasting binaries, views, reductions, matmuls, nn functions,
indexing, cat/stack/split), operands from the pool (or fresh inputs of a shape that fits), and
runs the statement at once, eagerly, on the example inputs *and* on ``BATCH`` further samples
(the rows the vmap and per-sample tests batch over). The statement is kept only if it runs, gives
finite values of moderate size (|v| < 1e3), and every sample is away from the points where the
op's derivative is undefined or convention-dependent:

- kinks (``abs``, ``relu``, ``leaky_relu``, ``hardtanh``, ``clamp``, ``elu``, ``maximum``,
  ``minimum``, ``norm``) are emitted only if every input element is at least ``MARGIN`` from the
  kink (for ``norm``: the norm is at least ``MARGIN``);
- ties (``amax``/``amin``, ``maximum``/``minimum``) likewise need a gap of ``MARGIN``;
- restricted domains need their input well inside (``log``, ``sqrt``, ``rsqrt``: x >= 0.1;
  ``reciprocal``, ``div``, ``prod``: |x| >= 0.2; ``exp``: |x| < 5; ``pow``: base >= 0.2).

So no test ever compares derivatives at a point where PyTorch's convention (``relu'(0) = 0``)
rather than the mathematics decides, and the transforms are compared at 1e-9 in float64.
Finally 1 to 3 values (preferably not yet used) are returned as a tensor, a tuple, a list or a
nested dict; sometimes an integer output (an ``argmax``), an input, a view of an input or one
value twice goes along. A few statements mutate fresh temporaries in place (``.mul_``, ``.add_``).
"""

from __future__ import annotations

import random
import re
import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

BATCH = 3  # samples the vmap and per-sample-gradient tests batch over
MARGIN = 1e-3  # distance kept from kinks and ties (no finite differences: exactness suffices)
MAX_ABS = 1e3


@dataclass(eq=False)
class Var:
    name: str
    vals: list  # one tensor per sample: [example, batch sample 1, ..., batch sample BATCH]
    is_input: bool = False
    used: int = 0

    @property
    def v(self):
        return self.vals[0]

    @property
    def shape(self):
        return tuple(self.vals[0].shape)

    @property
    def is_float(self):
        return self.vals[0].is_floating_point()


@dataclass
class Program:
    index: int
    seed: int
    source: str
    fn: object
    inputs: list  # Vars of the inputs, in argument order
    float_args: list = field(default_factory=list)  # argument positions of the float inputs

    @property
    def args(self):
        return tuple(v.vals[0] for v in self.inputs)

    def batched_args(self):
        """Float inputs stacked over the batch samples (dim 0), integer inputs as they are."""
        return tuple(torch.stack(v.vals[1:]) if v.is_float else v.vals[0] for v in self.inputs)

    def in_dims(self):
        return tuple(0 if v.is_float else None for v in self.inputs)

    def __str__(self):
        shapes = ", ".join(f"{v.name}: {'f64' if v.is_float else 'i64'}{list(v.shape)}" for v in self.inputs)
        return f"# fuzz program {self.index} (seed {self.seed}); inputs {shapes}\n{self.source}"


class _Reject(Exception):
    pass


class _Builder:
    def __init__(self, index, seed):
        self.rng = random.Random(f"fxtools-fuzz-{seed}-{index}")
        self.gen = torch.Generator().manual_seed(hash((seed, index)) % (2**62))
        self.inputs: list[Var] = []
        self.pool: list[Var] = []
        self.lines: list[str] = []
        self.counter = 0

    # -- values ------------------------------------------------------------------------------

    def fresh_input(self, shape, kind="float", high=None):
        if kind == "float":
            name = f"x{sum(v.is_float for v in self.inputs)}"
            vals = [torch.randn(shape, generator=self.gen, dtype=torch.float64) for _ in range(BATCH + 1)]
        else:
            name = f"i{sum(not v.is_float for v in self.inputs)}"
            t = torch.randint(0, high, shape, generator=self.gen)
            vals = [t] * (BATCH + 1)
        var = Var(name, vals, is_input=True)
        self.inputs.append(var)
        if kind == "float":
            self.pool.append(var)
        return var

    def random_shape(self, max_dim=3):
        nd = self.rng.choice([1, 2, 2, 2, 3, 3][: 2 * max_dim])
        return tuple(self.rng.randint(2, 4) for _ in range(nd))

    def floats(self, pred=lambda v: True):
        cands = [v for v in self.pool if v.is_float and pred(v)]
        if not cands:
            raise _Reject
        # prefer recent and unused values: programs then read as chains, with little dead code
        weights = [1 + 2 * (k >= len(cands) - 3) + 3 * (v.used == 0 and not v.is_input) for k, v in enumerate(cands)]
        return self.rng.choices(cands, weights)[0]

    # -- statements --------------------------------------------------------------------------

    def emit(self, expr, operands, check=None, names=1, write=None):
        """Run ``expr`` on every sample; keep it (returning the new Vars) if it passes ``check``.
        ``write``: a second statement that writes into the new value in place (``{out}[1:] += ...``,
        ``{out}``: its name), run after it."""
        outs_per_sample = []
        out_name = f"v{self.counter + 1}"
        for s in range(BATCH + 1):
            env = {"torch": torch, "F": F}
            env.update({v.name: v.vals[s] for v in operands})
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # mse_loss of mismatched shapes warns: not kept
                    out = eval(expr, env)
                    if write is not None:
                        env[out_name] = out
                        exec(write.format(out=out_name), env)
            except Exception as exc:  # noqa: BLE001 - a statement that does not run is not kept
                raise _Reject from exc
            if check is not None and not check(*[v.vals[s] for v in operands]):
                raise _Reject
            outs = list(out) if names > 1 else [out]
            for o in outs:
                if not isinstance(o, torch.Tensor) or o.numel() == 0:
                    raise _Reject
                if o.is_floating_point() and (not torch.isfinite(o).all() or o.abs().max() > MAX_ABS):
                    raise _Reject
            outs_per_sample.append(outs)
        new = []
        for k in range(names):
            self.counter += 1
            new.append(Var(f"v{self.counter}", [outs[k] for outs in outs_per_sample]))
        for v in operands:
            v.used += 1
        lhs = ", ".join(v.name for v in new)
        self.lines.append(f"    {lhs} = {expr}")
        if write is not None:
            self.lines.append("    " + write.format(out=out_name))
        self.pool.extend(new)
        return new

    def step(self):
        op = self.rng.choices(list(_OPS), [w for w, _ in _OPS.values()])[0]
        _OPS[op][1](self)

    # -- the program ---------------------------------------------------------------------------

    def finish(self, index, seed):
        cands = [v for v in self.pool if not v.is_input and v.is_float]
        if not cands:
            raise _Reject
        unused = [v for v in cands if v.used == 0]
        k = min(len(cands), self.rng.choice([1, 1, 1, 2, 2, 3]))
        outs = list(dict.fromkeys((unused[::-1] + cands[::-1])[:k]))
        names = [v.name for v in outs]
        r = self.rng.random()
        if r < 0.05:
            names.append(names[0])  # one value returned twice
        elif r < 0.1:
            names.append(self.rng.choice([v for v in self.inputs if v.is_float]).name)  # an input itself
        elif r < 0.15 and any(v.is_float and v.v.dim() >= 1 for v in self.inputs):
            src = self.rng.choice([v for v in self.inputs if v.is_float and v.v.dim() >= 1])
            (view,) = self.emit(f"{src.name}[0]", [src])  # a view of an input
            names.append(view.name)
        if self.rng.random() < 0.1:
            src = self.floats(lambda v: v.vals[0].dim() >= 1)
            (am,) = self.emit(f"torch.argmax({src.name}, -1)", [src])
            names.append(am.name)
        style = self.rng.choice(["plain", "tuple", "list", "dict", "nested"])
        if len(names) == 1 and style in ("plain", "list"):
            ret = names[0]
        elif style in ("plain", "tuple"):
            ret = "(" + ", ".join(names) + ",)"
        elif style == "list":
            ret = "[" + ", ".join(names) + "]"
        elif style == "dict" or len(names) == 1:
            ret = "{" + ", ".join(f"'{n}': {n}" for n in names) + "}"
        else:
            ret = f"{{'first': {names[0]}, 'rest': ({', '.join(names[1:])},)}}"
        self.lines.append(f"    return {ret}")
        args = ", ".join(v.name for v in self.inputs)
        source = f"def f({args}):\n" + "\n".join(self.lines) + "\n"
        env = {"torch": torch, "F": F}
        exec(compile(source, f"<fuzz program {index} (seed {seed})>", "exec"), env)
        fn = env["f"]
        fn.__fuzz_source__ = source
        return Program(index, seed, source, fn, self.inputs, [k for k, v in enumerate(self.inputs) if v.is_float])


def vmap_oracle(fn, in_dims, *args):
    """``torch.func.vmap(fn, in_dims)(*args)``; where it raises PyTorch's view error, ``fn`` on each
    sample, stacked (outputs at dim 0). A batched value is laid out as suits the batch, not as
    eager lays out one sample (``u.unsqueeze(1) * (A @ x)`` with ``A``, ``u`` unbatched is
    transposed per sample under vmap), so torch.func.vmap refuses some ``.view`` calls that a loop
    over the samples, vmap's meaning, runs. Likewise an in-place write of a batched value into an
    unbatched one (``v[:, 1:] = p.mean()`` with ``v`` made from an unbatched parameter), which
    torch.func.vmap refuses ("vmap: fill_(self, ...) is not possible") or fails on."""
    from torch.utils import _pytree as pytree

    try:
        return torch.func.vmap(fn, in_dims=in_dims)(*args)
    except RuntimeError as exc:
        refused = ("view size is not compatible", "is not possible because", "doesn't match the broadcast shape")
        if not any(text in str(exc) for text in refused):
            raise
    dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
    n = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    outs = [fn(*(a if d is None else a.select(d, b) for a, d in zip(args, dims))) for b in range(n)]
    leaves = [pytree.tree_flatten(o)[0] for o in outs]
    spec = pytree.tree_flatten(outs[0])[1]
    return pytree.tree_unflatten([torch.stack(col) for col in zip(*leaves)], spec)


# ------------------------------------------------------------------------------------------------
# The vocabulary: each entry (weight, builder) emits one statement or raises _Reject.


def _away(x, points=(0.0,)):
    return all(bool(((x - p).abs() >= MARGIN).all()) for p in points)


def _unary(b: _Builder):
    simple = [
        "torch.sin({a})",
        "torch.cos({a})",
        "torch.tanh({a})",
        "torch.sigmoid({a})",
        "F.gelu({a})",
        "F.gelu({a}, approximate='tanh')",
        "F.softplus({a})",
        "F.silu({a})",
        "F.mish({a})",
        "torch.erf({a})",
        "torch.atan({a})",
        "-{a}",
        "{a} * {a}",
        "{a}.pow(3)",
        "{a} ** 2",
        "F.logsigmoid({a})",
        "torch.square({a})",
        "{a} * 2.5",
        "{a} / 3",
        "1.5 - {a}",
        "{a} + 1",
        "torch.sinh({a})",
        "torch.asinh({a})",
        "{a}.cos().mul(2)",
        "torch.sin({a}).mul_(2)",
        "{a}.clone().tanh_()",
    ]
    guarded = [
        ("torch.exp({a})", lambda x: bool((x.abs() < 5).all())),
        ("torch.expm1({a})", lambda x: bool((x.abs() < 5).all())),
        ("torch.log({a})", lambda x: bool((x >= 0.1).all())),
        ("torch.log({a}.abs() + 0.5)", _away),
        ("torch.log1p({a} * {a})", None),
        ("torch.sqrt({a})", lambda x: bool((x >= 0.1).all())),
        ("torch.rsqrt({a})", lambda x: bool((x >= 0.1).all())),
        ("torch.reciprocal({a})", lambda x: bool((x.abs() >= 0.2).all())),
        ("torch.abs({a})", _away),
        ("torch.relu({a})", _away),
        ("F.leaky_relu({a}, 0.1)", _away),
        ("F.elu({a})", _away),
        ("F.hardtanh({a})", lambda x: _away(x, (-1.0, 1.0))),
        ("torch.clamp({a}, -0.5, 0.5)", lambda x: _away(x, (-0.5, 0.5))),
        ("torch.clamp({a}, min=0.2)", lambda x: _away(x, (0.2,))),
        ("{a}.sign() * {a}", _away),
    ]
    a = b.floats()
    if b.rng.random() < 0.55:
        expr, check = b.rng.choice(simple), None
    else:
        expr, check = b.rng.choice(guarded)
    b.emit(expr.format(a=a.name), [a], check)


def _broadcastable_to(b: _Builder, shape):
    """A shape that broadcasts with ``shape``: a suffix of it, with some dims set to 1."""
    k = b.rng.randint(0, len(shape))
    sub = list(shape[k:]) if k < len(shape) else list(shape[-1:])
    return tuple(1 if b.rng.random() < 0.3 else s for s in sub)


def _other_operand(b: _Builder, a: Var):
    try:
        same = [v for v in b.pool if v.is_float and v is not a and _broadcasts(v.shape, a.shape)]
    except Exception:  # noqa: BLE001
        same = []
    if same and b.rng.random() < 0.6:
        return b.rng.choice(same)
    r = b.rng.random()
    if r < 0.15:
        return a
    shape = a.shape if r < 0.5 else _broadcastable_to(b, a.shape)
    return b.fresh_input(shape)


def _broadcasts(s1, s2):
    try:
        torch.broadcast_shapes(s1, s2)
        return True
    except RuntimeError:
        return False


def _binary(b: _Builder):
    a = b.floats()
    c = _other_operand(b, a)
    if b.rng.random() < 0.5:
        a, c = c, a
    ops = [
        ("{a} + {c}", None),
        ("{a} - {c}", None),
        ("{a} * {c}", None),
        ("torch.add({a}, {c}, alpha=0.5)", None),
        ("{a} / {c}", lambda x, y: bool((y.abs() >= 0.2).all())),
        ("torch.maximum({a}, {c})", lambda x, y: _away(x - y)),
        ("torch.minimum({a}, {c})", lambda x, y: _away(x - y)),
        ("torch.atan2({a}, {c})", lambda x, y: bool((x * x + y * y >= 0.04).all())),
        ("torch.hypot({a}, {c})", lambda x, y: bool((x * x + y * y >= 0.04).all())),
        ("torch.pow({a}, {c})", lambda x, y: bool((x >= 0.2).all() and (y.abs() < 3).all())),
        ("torch.lerp({a}, {c}, 0.3)", None),
        ("({a} * {c}).sub_({c})", None),
        ("torch.where({a} > {c}, {a}, {c} * 2)", lambda x, y: _away(x - y)),
        ("{a}.masked_fill({c} < 0, 0.5)", None),
        ("F.mse_loss({a}, {c})", lambda x, y: x.shape == y.shape),
        ("F.mse_loss({a}, {c}, reduction='none')", lambda x, y: x.shape == y.shape),
    ]
    expr, check = b.rng.choice(ops)
    operands = [a] if a is c else [a, c]
    if check is not None and a is c:
        check0 = check
        check = lambda x: check0(x, x)  # noqa: E731
    b.emit(expr.format(a=a.name, c=c.name), operands, check)


def _view(b: _Builder):
    a = b.floats(lambda v: v.v.dim() >= 1)
    nd, shape, rng = len(a.shape), a.shape, b.rng
    choices = []
    if nd >= 2:
        d0, d1 = rng.sample(range(nd), 2)
        perm = list(range(nd))
        rng.shuffle(perm)
        choices += [
            f"{a.name}.transpose({d0}, {d1})",
            f"{a.name}.permute({perm})",
            f"{a.name}.mT",
            f"{a.name}.flatten()",
            f"{a.name}[{rng.randrange(shape[0])}]",
            f"{a.name}.select({d1}, {rng.randrange(shape[d1])})",
            f"{a.name}[:, 1:]",
            f"{a.name}.transpose({d0}, {d1}).contiguous().view(-1)",
        ]
    if nd == 2:
        choices.append(f"{a.name}.t()")
    n = a.v.numel()
    divisors = [d for d in range(2, n) if n % d == 0]
    if divisors:
        d = rng.choice(divisors)
        choices += [f"{a.name}.reshape({d}, {n // d})", f"{a.name}.reshape(-1, {d})", f"{a.name}.view({n})"]
    dim = rng.randint(0, nd)
    choices += [
        f"{a.name}.unsqueeze({dim})",
        f"{a.name}[..., ::2]",
        f"{a.name}[1:]",
        f"{a.name}.narrow({nd - 1}, 1, {shape[-1] - 1})",
        f"{a.name}.unsqueeze(0).expand({rng.randint(2, 3)}, {', '.join(map(str, shape))})",
        f"{a.name}.unsqueeze(-1).expand(*{a.name}.shape, 2)",
        f"{a.name}.flip({rng.randrange(nd)})",
        f"{a.name}.roll(1, {rng.randrange(nd)})",
        f"{a.name}.repeat({', '.join(['2'] + ['1'] * (nd - 1))})",
    ]
    b.emit(rng.choice(choices), [a])


def _gap(values, dim, largest=True):
    """The top two values along ``dim`` are at least MARGIN apart (no tie for amax/amin)."""
    if values.shape[dim] < 2:
        return True
    top = torch.topk(values, 2, dim=dim, largest=largest).values
    return bool(((top.select(dim, 0) - top.select(dim, 1)).abs() >= MARGIN).all())


def _reduction(b: _Builder):
    a = b.floats(lambda v: v.v.dim() >= 1)
    rng = b.rng
    nd = a.v.dim()
    dim = rng.randrange(-nd, nd)
    keep = rng.random() < 0.4
    ops = [
        (f"{a.name}.sum({dim}, keepdim={keep})", None),
        (f"{a.name}.mean({dim}, keepdim={keep})", None),
        (f"{a.name}.sum()", None),
        (f"{a.name}.mean()", None),
        (f"torch.logsumexp({a.name}, {dim}, keepdim={keep})", None),
        (f"{a.name}.var({dim}, keepdim={keep})", None),
        (f"{a.name}.var({dim}, correction=0)", None),
        (f"{a.name}.std({dim})", lambda x: bool((x.std(dim) >= MARGIN).all())),
        (f"{a.name}.amax({dim}, keepdim={keep})", lambda x: _gap(x, dim)),
        (f"{a.name}.amin({dim})", lambda x: _gap(x, dim, largest=False)),
        (f"{a.name}.max({dim}).values", lambda x: _gap(x, dim)),
        (f"torch.linalg.vector_norm({a.name}, 2, {dim}, keepdim={keep})", lambda x: bool((x.norm(dim=dim) >= MARGIN).all())),
        (f"{a.name}.norm()", lambda x: bool(x.norm() >= MARGIN)),
        (f"{a.name}.prod({dim})", lambda x: bool((x.abs() >= 0.2).all())),
        (f"{a.name}.cumsum({dim})", None),
        (f"torch.cummax({a.name}, {dim}).values", lambda x: _distinct(x, dim)),
        (f"torch.sort({a.name}, {dim}).values", lambda x: _distinct(x, dim)),
    ]
    if nd >= 2:
        ops.append((f"{a.name}.sum(({0}, {nd - 1}))", None))
    expr, check = rng.choice(ops)
    b.emit(expr, [a], check)


def _distinct(x, dim):
    """No two elements along ``dim`` within MARGIN of each other (cummax, sort: no ties)."""
    d = x.unsqueeze(dim) - x.unsqueeze(dim - 1 if dim < 0 else dim + 1)
    n = x.shape[dim]
    eye = torch.eye(n, dtype=torch.bool)
    return bool((d.abs() >= MARGIN).logical_or(eye.view(*([n, n] + [1] * (x.dim() - 1 - (dim % x.dim()))))).all())


def _matmul(b: _Builder):
    rng = b.rng
    a = b.floats(lambda v: 1 <= v.v.dim() <= 3)
    k = a.shape[-1]
    kind = rng.choice(["matmul", "matmul", "linear", "einsum", "bmm", "vec"])
    if kind == "bmm":
        if a.v.dim() != 3:
            raise _Reject
        w = _operand_of_shape(b, (a.shape[0], k, rng.randint(2, 4)))
        b.emit(f"torch.bmm({a.name}, {w.name})", [a, w])
    elif kind == "linear":
        w = _operand_of_shape(b, (rng.randint(2, 4), k))
        if rng.random() < 0.6:
            bias = _operand_of_shape(b, (w.shape[0],))
            b.emit(f"F.linear({a.name}, {w.name}, {bias.name})", [a, w, bias])
        else:
            b.emit(f"F.linear({a.name}, {w.name})", [a, w])
    elif kind == "einsum":
        if a.v.dim() == 2:
            w = _operand_of_shape(b, (k, rng.randint(2, 4)))
            eq = rng.choice(["ij,jk->ik", "ij,jk->ki", "ij,jk->k"])
        elif a.v.dim() == 3:
            w = _operand_of_shape(b, (a.shape[0], k, rng.randint(2, 4)))
            eq = rng.choice(["bij,bjk->bik", "bij,bjk->bk"])
        else:
            w = _operand_of_shape(b, (k,))
            eq = "i,i->"
        b.emit(f"torch.einsum('{eq}', {a.name}, {w.name})", [a, w])
    elif kind == "vec":
        w = _operand_of_shape(b, (k,))
        b.emit(f"{a.name} @ {w.name}", [a, w])
    else:
        w = _operand_of_shape(b, (k, rng.randint(2, 4)) if rng.random() < 0.8 else (a.shape[0] if a.v.dim() == 3 else 2, k, 3))
        b.emit(f"{a.name} @ {w.name}", [a, w])


def _operand_of_shape(b: _Builder, shape):
    cands = [v for v in b.pool if v.is_float and v.shape == tuple(shape)]
    if cands and b.rng.random() < 0.5:
        return b.rng.choice(cands)
    return b.fresh_input(tuple(shape))


def _nn(b: _Builder):
    rng = b.rng
    kind = rng.choice(
        [
            "softmax",
            "log_softmax",
            "layer_norm",
            "layer_norm_affine",
            "conv1d",
            "conv2d",
            "cross_entropy",
            "normalize",
            "dropout0",
            "glu",
            "embedding",
            "pad",
        ]
    )
    if kind in ("softmax", "log_softmax"):
        a = b.floats(lambda v: v.v.dim() >= 1)
        b.emit(f"F.{kind}({a.name}, {rng.randrange(-a.v.dim(), a.v.dim())})", [a])
    elif kind.startswith("layer_norm"):
        a = b.floats(lambda v: v.v.dim() >= 1 and v.shape[-1] >= 2)
        ok = lambda x: bool((x.var(-1) >= 0.01).all())  # noqa: E731 - a constant row has no direction
        if kind == "layer_norm":
            b.emit(f"F.layer_norm({a.name}, ({a.shape[-1]},))", [a], ok)
        else:
            w, bias = _operand_of_shape(b, a.shape[-1:]), _operand_of_shape(b, a.shape[-1:])
            b.emit(f"F.layer_norm({a.name}, ({a.shape[-1]},), {w.name}, {bias.name})", [a, w, bias], lambda x, *_: ok(x))
    elif kind == "conv1d":
        a = b.floats(lambda v: v.v.dim() == 3 and v.shape[-1] >= 2)
        w = _operand_of_shape(b, (rng.randint(1, 3), a.shape[1], 2))
        b.emit(f"F.conv1d({a.name}, {w.name}, padding={rng.randint(0, 1)})", [a, w])
    elif kind == "conv2d":
        a = b.floats(lambda v: v.v.dim() >= 2 and v.v.numel() >= 4)
        if a.v.dim() == 2:
            (a,) = b.emit(f"{a.name}.view(1, 1, {a.shape[0]}, {a.shape[1]})", [a])
        elif a.v.dim() == 3:
            (a,) = b.emit(f"{a.name}.unsqueeze(0)", [a])
        if a.v.dim() != 4 or min(a.shape[-2:]) < 2:
            raise _Reject
        w = _operand_of_shape(b, (2, a.shape[1], 2, 2))
        bias = _operand_of_shape(b, (2,))
        b.emit(f"F.conv2d({a.name}, {w.name}, {bias.name}, stride={rng.randint(1, 2)})", [a, w, bias])
    elif kind == "cross_entropy":
        a = b.floats(lambda v: v.v.dim() == 2)
        t = b.fresh_input((a.shape[0],), "int", high=a.shape[1])
        extra = rng.choice(["", ", reduction='sum'", ", label_smoothing=0.1", ", reduction='none'"])
        b.emit(f"F.cross_entropy({a.name}, {t.name}{extra})", [a, t])
    elif kind == "normalize":
        a = b.floats(lambda v: v.v.dim() >= 1)
        b.emit(f"F.normalize({a.name}, dim=-1)", [a], lambda x: bool((x.norm(dim=-1) >= 0.1).all()))
    elif kind == "dropout0":
        a = b.floats()
        b.emit(f"F.dropout({a.name}, 0.3, training=False)", [a])
    elif kind == "glu":
        a = b.floats(lambda v: v.v.dim() >= 1 and v.shape[-1] % 2 == 0)
        b.emit(f"F.glu({a.name}, -1)", [a])
    elif kind == "embedding":
        w = b.floats(lambda v: v.v.dim() == 2)
        i = b.fresh_input((rng.randint(2, 4),), "int", high=w.shape[0])
        b.emit(f"F.embedding({i.name}, {w.name})", [i, w])
    else:
        a = b.floats(lambda v: v.v.dim() >= 1)
        b.emit(f"F.pad({a.name}, (1, 0))", [a])


def _indexing(b: _Builder):
    rng = b.rng
    a = b.floats(lambda v: v.v.dim() >= 1)
    nd = a.v.dim()
    dim = rng.randrange(nd)
    kind = rng.choice(["gather", "index_select", "index", "where", "masked_fill", "scatter_add", "take_along"])
    if kind == "gather" or kind == "take_along":
        shape = list(a.shape)
        shape[dim] = rng.randint(1, 4)
        idx = b.fresh_input(tuple(shape), "int", high=a.shape[dim])
        if kind == "gather":
            b.emit(f"torch.gather({a.name}, {dim}, {idx.name})", [a, idx])
        else:
            b.emit(f"torch.take_along_dim({a.name}, {idx.name}, {dim})", [a, idx])
    elif kind == "index_select":
        idx = b.fresh_input((rng.randint(1, 4),), "int", high=a.shape[dim])
        b.emit(f"torch.index_select({a.name}, {dim}, {idx.name})", [a, idx])
    elif kind == "index":
        idx = b.fresh_input((rng.randint(1, 4),), "int", high=a.shape[0])
        b.emit(f"{a.name}[{idx.name}]", [a, idx])
    elif kind == "where":
        c = _other_operand(b, a)
        m = b.floats(lambda v: _broadcasts(v.shape, a.shape))
        ops = list(dict.fromkeys([a, c, m]))
        b.emit(f"torch.where({m.name} > 0, {a.name}, {c.name})", ops)
    elif kind == "masked_fill":
        b.emit(f"{a.name}.masked_fill({a.name} > 0.5, -1.0)", [a], lambda x: _away(x, (0.5,)))
    else:
        shape = list(a.shape)
        src = _operand_of_shape(b, tuple(shape))
        idx = b.fresh_input(tuple(shape), "int", high=a.shape[dim])
        b.emit(f"{a.name}.scatter_add({dim}, {idx.name}, {src.name})", [a, idx, src])


def _combine(b: _Builder):
    rng = b.rng
    a = b.floats(lambda v: v.v.dim() >= 1)
    nd = a.v.dim()
    dim = rng.randrange(nd)
    kind = rng.choice(["cat", "stack", "split", "chunk", "unbind"])
    if kind == "cat":
        shape = list(a.shape)
        shape[dim] = rng.randint(1, 3)
        c = _operand_of_shape(b, tuple(shape))
        b.emit(f"torch.cat([{a.name}, {c.name}], {dim})", [a, c])
    elif kind == "stack":
        c = _operand_of_shape(b, a.shape)
        b.emit(f"torch.stack([{a.name}, {c.name}], {rng.randint(0, nd)})", list(dict.fromkeys([a, c])))
    elif kind == "split":
        n = a.shape[dim]
        if n < 2:
            raise _Reject
        k = rng.randint(1, n - 1)
        b.emit(f"torch.split({a.name}, [{k}, {n - k}], {dim})", [a], names=2)
    elif kind == "chunk":
        if a.shape[dim] < 2:
            raise _Reject
        b.emit(f"{a.name}.chunk(2, {dim})", [a], names=2)
    else:
        if a.shape[dim] != 2:
            raise _Reject
        b.emit(f"{a.name}.unbind({dim})", [a], names=2)


def _write(b: _Builder):
    """A new value, then a write into a view of it in place (``v[..., 1:] += a[..., :-1].sin()``,
    ``v[0] = ...``, ``v.diagonal(...).mul_(...)``): slices with and without a step, selects and
    diagonals, assigned or updated, reading the value written into or another one."""
    a = b.floats(lambda v: v.v.dim() >= 1 and v.shape[-1] >= 2)
    rng, nd = b.rng, a.v.dim()
    c = b.floats()
    writes = [
        "{out}[..., 1:] += {a}[..., :-1].sin()",
        "{out}[..., ::2] *= {a}[..., ::2].cos()",
        "{out}[..., :1].mul_({a}[..., 1:2])",
        "{out}[..., -1] -= {c}.mean()",
        "{out}[0] = {a}[-1] * 2",
        "{out}[..., 1:] = {out}[..., :-1] * 0.5",
        "{out}[..., 0].zero_()",
        "{out}[..., 1:].add_({out}[..., 1:].tanh())",
    ]
    if nd >= 2:
        writes += [
            "{out}.diagonal(dim1=-2, dim2=-1).mul_({a}.diagonal(dim1=-2, dim2=-1).tanh())",
            "{out}.diagonal(dim1=-2, dim2=-1).add_({c}.sum())",
            "{out}[:, 1:] = {c}.mean()",
            "{out}[1:, 0] += {a}[:-1, -1]",
        ]
    write = rng.choice(writes)
    operands = list(dict.fromkeys([a, c] if "{c}" in write else [a]))
    expr = rng.choice(["{a} * 1.5", "{a}.sin()", "{a} - {a}.mean()", "{a}.clone()"])  # none saves its output
    b.emit(expr.format(a=a.name), operands, write=write.replace("{a}", a.name).replace("{c}", c.name))


_OPS = {
    "unary": (5, _unary),
    "binary": (5, _binary),
    "view": (3, _view),
    "reduction": (2.5, _reduction),
    "matmul": (2, _matmul),
    "nn": (2.5, _nn),
    "indexing": (1.5, _indexing),
    "combine": (1.5, _combine),
    "write": (1.5, _write),
}


def program(index: int, seed: int = 0, steps: tuple = (2, 6)) -> Program:
    """Program number ``index`` of the fuzzer's sequence ``seed`` (deterministic)."""
    b = _Builder(index, seed)
    for _ in range(b.rng.randint(1, 2)):
        b.fresh_input(b.random_shape())
    target = b.rng.randint(*steps)
    attempts = 0
    while b.counter < target and attempts < 40 * target:
        attempts += 1
        n_inputs = len(b.inputs)
        try:
            b.step()
        except _Reject:
            # fresh inputs made for a statement that was not kept are dropped with it
            dropped = {id(v) for v in b.inputs[n_inputs:]}
            del b.inputs[n_inputs:]
            b.pool = [v for v in b.pool if id(v) not in dropped]
    return b.finish(index, seed)


# ------------------------------------------------------------------------------------------------
# A varied subset (the fuzzers' default mode): fewer programs that together exercise everything a
# longer run of consecutive indices exercises, each thing several times.

_CALL = re.compile(r"torch\.[\w.]+|F\.\w+|\.\w+\(|@|\[")


def features(p: Program) -> set[str]:
    """What program ``p`` exercises: the op of each statement (its first ``torch.``/``F.`` function,
    method, ``@`` or indexing; else its arithmetic operators) and the keywords it is called with,
    in-place methods, each input's kind and rank, the number of inputs, and how the outputs are
    returned (plain, tuple, list, dict, nested; a value twice, an input itself)."""
    found = set()
    for line in p.source.splitlines()[1:]:
        line = line.strip()
        if line.startswith("return "):
            ret = line[len("return ") :]
            found.add("return " + {"{": "dict", "(": "tuple", "[": "list"}.get(ret[0], "plain"))
            names = re.findall(r"\b[vx]\d+\b", ret)
            if "'rest'" in ret:
                found.add("return nested")
            if len(set(names)) < len(names):
                found.add("return a value twice")
            if any(n.startswith("x") for n in names):
                found.add("return an input")
            continue
        if not re.match(r"\w+(, \w+)* = ", line):  # a write into a view of the value before it
            found.add("write " + re.sub(r"\b[vx]\d+\b", "_", line))
            continue
        expr = line.split(" = ", 1)[1]
        m = _CALL.search(expr)
        op = m.group(0) if m else "arithmetic " + "".join(sorted(set(re.findall(r"[-+*/]", expr))))
        found.add(op)
        found.update(f"{op} {kw}=" for kw in re.findall(r"(\w+)=", expr))
        if re.search(r"\.\w+_\(", expr):
            found.add("in-place")
    found.update(f"{'float' if v.is_float else 'integer'} input of rank {v.v.dim()}" for v in p.inputs)
    found.add(f"{min(len(p.inputs), 4)} inputs")
    return found


def varied(candidates, times: int, seed: int = 0, make=None) -> list[int]:
    """Indices of a subset of the programs ``candidates`` (indices) that exercises every feature
    (``features``) of the candidates at least ``times`` times (a rarer feature: as often as the
    candidates do), chosen greedily by features gained per statement; sorted. ``make(index)``
    builds a program (default ``program(index, seed)``; a caching function saves building again).
    Deterministic: the same arguments give the same indices."""
    make = make or (lambda i: program(i, seed))
    found, cost = {}, {}
    for i in candidates:
        p = make(i)
        found[i] = features(p)
        cost[i] = p.source.count("\n") - 1  # statements and the return
    need: dict[str, int] = {}
    for f in (f for fs in found.values() for f in fs):
        need[f] = min(times, need.get(f, 0) + 1)
    chosen, left = [], set(found)
    while any(need.values()):
        best = max(left, key=lambda i: (sum(need[f] > 0 for f in found[i]) / cost[i], -i))
        left.discard(best)
        chosen.append(best)
        for f in found[best]:
            need[f] = max(0, need[f] - 1)
    return sorted(chosen)


# ------------------------------------------------------------------------------------------------
# Programs that decide on sizes and layout (tests/test_fuzz_decisions.py): program ``index``'s
# ``f``, wrapped in a ``g`` that takes one Python branch on a size, two sizes, numel, a chunk
# count, contiguity or a stride of an input (decided by the example, as tracing decides it), and
# sometimes computes with a stride or a chunk count.

DECISIONS = [
    "{x}.shape[{d}] % 2 == 0",
    "{x}.shape[{d}] % 3 == 1",
    "{x}.shape[{d}] > 3",
    "{x}.shape[{d}] != 7",
    "{x}.numel() > 20",
    "{x}.shape[{d}] < {y}.shape[{e}]",
    "len(torch.split({x}, 3, {d})) == 2",
    "{x}.is_contiguous()",
    "{x}.stride({d}) == 1",
    "{x}.t().is_contiguous()",
]
TERMS = [
    "0.0",
    "({x} * {x}.stride(0)).sum()",
    "sum((i + 1) * (c * c).sum() for i, c in enumerate(torch.split({x}, 2, {d})))",
]


def decision_program(index: int, seed: int = 0) -> Program:
    """Program ``index`` of the fuzzer, returning also a value chosen by a decision (see above)."""
    p = program(index, seed)
    rng = random.Random(f"fxtools-fuzz-decision-{seed}-{index}")
    floats = [v for v in p.inputs if v.is_float and v.v.dim() >= 1]
    if not floats:
        return p
    x = rng.choice(floats)
    y = rng.choice([v for v in p.inputs if v.v.dim() >= 1])
    names = {"x": x.name, "y": y.name, "d": rng.randrange(x.v.dim()), "e": rng.randrange(y.v.dim())}
    decisions = [c for c in DECISIONS if ".t()" not in c or x.v.dim() == 2]
    cond = rng.choice(decisions).format(**names)
    term = rng.choice(TERMS).format(**names)
    args = ", ".join(v.name for v in p.inputs)
    source = (
        p.source
        + f"\n\ndef g({args}):\n    out = f({args})\n    if {cond}:\n        extra = ({x.name} * {x.name}).sum()\n"
        + f"    else:\n        extra = (3 * {x.name}.sin()).sum()\n    return out, extra + {term}\n"
    )
    env = {"torch": torch, "F": F}
    exec(compile(source, f"<fuzz decision program {index} (seed {seed})>", "exec"), env)
    return Program(index, seed, source, env["g"], p.inputs, p.float_args)


if __name__ == "__main__":
    idx = int(sys.argv[1])
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    print(program(idx, seed))


# ------------------------------------------------------------------------------------------------
# Programs as users write them around the straight-line ones (tests/test_fuzz_refusals.py, issue
# 32): program ``index``'s ``f`` called from a ``g`` whose arguments are named from fxtools' own
# vocabulary (``grad_x``, ``tangent_x``, ``x_1``, ``series_0``, ``batch``), that takes a keyword
# argument, computes a term inside a grad-mode block (``no_grad``, ``enable_grad``,
# ``set_grad_enabled(False)``, ``inference_mode``), and updates closed-over buffers in place several
# times (a counter and an EMA, sometimes under ``no_grad``). Built and called under an outer
# grad-mode context too (``outer``).

USER_NAMES = ["grad_x", "tangent_x", "x_1", "series_0", "batch", "grad_out", "tangent_out", "series", "sizes"]
INNER = ["torch.no_grad()", "torch.enable_grad()", "torch.set_grad_enabled(False)", "torch.inference_mode()"]
OUTER = ["none", "no_grad", "enable_grad", "inference_mode"]


@dataclass
class Variant:
    program: Program  # g, with its arguments renamed
    reference: object  # g without its buffer updates (torch.func refuses updates of captured tensors)
    buffers: dict  # name -> tensor, updated in place by each call of g
    outer: str  # the grad-mode context the module is built and called in
    scale: float  # the keyword argument's value


def variant(index: int, seed: int = 0) -> Variant:
    """Program ``index`` wrapped as described above (deterministic)."""
    import re

    p = program(index, seed)
    rng = random.Random(f"fxtools-fuzz-variant-{seed}-{index}")
    names = rng.sample(USER_NAMES, len(p.inputs))
    rename = dict(zip([v.name for v in p.inputs], names))
    source = re.sub(r"\b(x\d+|i\d+)\b", lambda m: rename.get(m.group(1), m.group(1)), p.source)
    x = next(rename[v.name] for v in p.inputs if v.is_float)
    args = ", ".join(names)
    inner = rng.choice(INNER)
    updates = rng.random() < 0.7
    buffer_block = "torch.no_grad()" if rng.random() < 0.5 else "contextlib.nullcontext()"
    header = f"def g({args}, *, scale=1.0):"
    body = [
        f"    with {inner}:",
        f"        side = {x}.sin() * 2",  # no gradient in reverse mode; a tangent in forward unless inference mode
        f"    out = f({args})",
        f"    extra = ({x} + side).sum() * scale",
        "    return out, extra",
    ]
    buffer_lines = [
        f"    with {buffer_block}:",
        "        count.add_(1)",
        f"        ema.mul_(0.9).add_({x}.detach().mean(0), alpha=0.1)",
        "        ema.add_(count * 0.01)",
    ]
    g_source = "\n".join([header, *(buffer_lines if updates else []), *body]) + "\n"
    shape = p.inputs[next(k for k, v in enumerate(p.inputs) if v.is_float)].shape[1:]
    buffers = {"count": torch.zeros((), dtype=torch.float64), "ema": torch.zeros(shape, dtype=torch.float64)}
    env = {"torch": torch, "F": F, "contextlib": __import__("contextlib"), **buffers}
    full = source + "\n\n" + g_source
    exec(compile(full, f"<fuzz variant {index} (seed {seed})>", "exec"), env)
    ref_env = {"torch": torch, "F": F}
    ref_source = source + "\n\n" + "\n".join([header, *body]) + "\n"
    exec(compile(ref_source, f"<fuzz variant reference {index} (seed {seed})>", "exec"), ref_env)
    inputs = [Var(rename[v.name], v.vals, v.is_input) for v in p.inputs]
    g = Program(index, seed, full, env["g"], inputs, p.float_args)
    return Variant(g, ref_env["g"], buffers, rng.choice(OUTER), rng.choice([1.0, 0.5, 2.0]))
