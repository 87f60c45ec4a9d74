"""Folding (``codegen/fold.py``): single-use cheap values printed inside their user's expression.

The oracle is the flat code of the same graph (``fold.flat()``): the folded module must make the
same ATen calls in the same order (recorded with a ``TorchDispatchMode``) and return bit-for-bit
the same tensors (``torch.equal``), in float64 and float32, on random programs and on the
derivatives of LayerNorm, GELU, softmax, cross-entropy and attention; and those derivatives,
against ``torch.autograd``.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import fuzz_programs
import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fxtools
from fxtools.codegen.fold import MAX_DEPTH, MAX_LINE, flat, flat_code
from fxtools.codegen.show import annotated_code


class _Calls(TorchDispatchMode):
    """Records every ATen call, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def run(gm, args):
    with _Calls() as calls:
        out = gm(*args)
    return out, calls.ops


def statements(code: str) -> int:
    """Statements of a function body, frees (``del``) left out."""
    return sum(1 for line in code.splitlines() if line.startswith("    ") and not line.lstrip().startswith(("del ", "def ")))


def assert_same_as_flat(gm, args) -> tuple[str, str]:
    """Run ``gm`` folded and flat: the same calls, equal results. Returns (folded, flat) code."""
    folded = gm.code
    out, ops = run(gm, args)
    with flat():
        gm.recompile()
    flat_src = gm.code
    try:
        assert flat_src == flat_code(gm)
        out_flat, ops_flat = run(gm, args)
    finally:
        gm.recompile()
    assert gm.code == folded, "recompiling gives the folded code again"
    assert ops == ops_flat, (folded, flat_src)
    got, want = pytree.tree_leaves(out), pytree.tree_leaves(out_flat)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert type(a) is type(b) and (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), (folded, flat_src)
    for line in set(folded.splitlines()) - set(flat_src.splitlines()):
        assert len(line) <= MAX_LINE, line  # folding writes no line longer than MAX_LINE
    return folded, flat_src


def as_dtype(tree, dtype):
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_random_programs_fold_to_the_same_calls_and_bits(dtype):
    """vjp, jvp and split's backward of random programs: folded and flat code agree exactly."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        shorter = total = 0
        for i in range(8) if dtype == torch.float64 else range(8, 16):
            p = fuzz_programs.program(i, seed=1)
            args = as_dtype(p.args, dtype)
            fn = p.fn
            out = fn(*args)
            ct = pytree.tree_map(
                lambda x: torch.randn_like(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else None, out
            )
            tangents = pytree.tree_map(lambda x: torch.randn_like(x) if x.is_floating_point() else None, args)
            modules = [(fxtools.vjp(fn, *args), (*args, ct)), (fxtools.jvp(fn, *args), (*args, *tangents))]
            sp = fxtools.split(fn, *args)
            _, saved = sp.forward(*sp.flatten(*args))
            cts = [torch.randn(c.shape, dtype=c.dtype) for c in sp.cotangents]
            modules.append((sp.backward, (*saved, *cts)))
            for gm, call_args in modules:
                folded, flat_src = assert_same_as_flat(gm, call_args)
                total += 1
                shorter += statements(folded) < statements(flat_src)
    finally:
        torch.set_default_dtype(old)
    assert shorter >= total // 3, (shorter, total)  # folding happens: not a test that cannot fail


def layer_norm(x, w, b):
    y = F.layer_norm(x, [8], w, b)
    return y.sin().sum()


def gelu(x):
    y = F.gelu(x)
    return y.sin().sum()


def softmax(x):
    p = torch.softmax(x, -1)
    return p.sin().sum()


def cross_entropy(x, t):
    return F.cross_entropy(x, t)


def attention(q, k, v):
    w = torch.softmax(q @ k.mT / 8**0.5, -1)
    return (w @ v).sin().sum()


x8 = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
CASES = {
    "layer_norm": (layer_norm, (x8, x8[0] + 1, x8[1])),
    "gelu": (gelu, (x8,)),
    "softmax": (softmax, (x8,)),
    "cross_entropy": (cross_entropy, (x8, torch.tensor([1, 0, 7, 3]))),
    "attention": (attention, (x8.view(2, 2, 8),) * 3),
}
N = r"[A-Za-z_]\w*"  # any name: the names are the naming stage's business, the shape of the formula is folding's
FORMULAS = {  # what each derivative's code must hold, as a person writes it
    "layer_norm": [
        rf"= \({N} - {N}\) \* {N}$",
        rf"= {N} \* \({N} - {N} - {N} \* {N}\)$",
    ],  # xhat; rstd * (dxhat - mean - xhat * mean)
    "gelu": [
        rf"\(torch\.erf\({N} \* 0\.7071067811865476\) \+ 1\) \* 0\.5$",
        rf"= torch\.exp\({N} \* -0\.5 \* {N}\) / 2\.5066282746310002$",  # pdf, a rule's variable, keeps its line
        rf"= {N} \* \({N} \+ {N} \* {N}\)$",  # grad * (cdf + x * pdf)
    ],
    "softmax": [rf"{N} - torch\.sum\({N} \* {N}, \[-1\], keepdim=True\)$|= {N} \* \({N} - {N}\)$"],
    "cross_entropy": [rf"-\({N} \* {N} / torch\.sum\({N}\)\)", rf"= {N} - {N} \* torch\.sum\({N}, \[1\], keepdim=True\)$"],
    "attention": [rf"torch\.cos\({N}\) @ torch\.transpose\({N}, 1, 2\)$", rf"torch\.softmax\({N} / 2\.8284271247461903, -1\)$"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_derivatives_read_as_their_formulas(name):
    f, args = CASES[name]
    gm = fxtools.grad(f, *args)
    folded, flat_src = assert_same_as_flat(gm, args)
    for pattern in FORMULAS[name]:
        assert re.search(pattern, folded, re.M), (pattern, folded)
    assert statements(folded) < statements(flat_src)
    xs = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    want = torch.autograd.grad(f(*xs), xs[0])
    torch.testing.assert_close(gm(*args)[0] if isinstance(gm(*args), tuple) else gm(*args), want[0], rtol=1e-12, atol=1e-12)
    assert_bounded(folded)


def assert_bounded(code: str) -> None:
    """No statement nests calls deeper than MAX_DEPTH (a method's receiver and the left operand
    of the same operator level, ``x.view(s).t()`` and ``a - b - c``, read left to right: depth 0)."""
    for line in code.splitlines():
        stmt = ast.parse(line.strip()).body[0] if line.startswith("    ") and " = " in line else None
        if isinstance(stmt, ast.Assign):
            assert _depth(stmt.value) <= MAX_DEPTH, line


def _depth(e) -> int:
    kids: list = []  # (operand, how much nesting it adds)
    if isinstance(e, ast.Call):
        if isinstance(e.func, ast.Attribute):
            kids.append((e.func.value, 0))
        for a in [*e.args, *(k.value for k in e.keywords)]:
            kids += [(x, 1) for x in (a.elts if isinstance(a, (ast.List, ast.Tuple)) else [a])]
    elif isinstance(e, ast.BinOp):
        same = isinstance(e.left, ast.BinOp) and _level(e.left.op) == _level(e.op) < 2
        kids += [(e.left, 0 if same else 1), (e.right, 1)]
    elif isinstance(e, ast.UnaryOp):
        kids.append((e.operand, 1))
    elif isinstance(e, ast.Compare):
        kids += [(x, 1) for x in [e.left, *e.comparators]]
    elif isinstance(e, ast.Subscript):
        kids += [(e.value, 0), (e.slice, 1)]
    return max((_depth(k) + step for k, step in kids if _is_op(k)), default=0)


def _is_op(e) -> bool:
    literal = isinstance(e, ast.UnaryOp) and isinstance(e.operand, ast.Constant)
    return isinstance(e, (ast.Call, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Subscript)) and not literal


def _level(op) -> int:
    return 0 if isinstance(op, (ast.Add, ast.Sub)) else 1 if isinstance(op, (ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)) else 2


def test_gpt_backward_folds_and_frees_as_before():
    """A GPT block's grad and split backward: fewer lines; a value that must be freed at its
    point keeps its line and its ``del``; the same calls and bits as flat."""
    from fxtools.cli import examples

    f, args = examples.example("gpt", n_layer=1, dtype=torch.float64)
    gm = fxtools.grad(f, *args)
    folded, flat_src = assert_same_as_flat(gm, args)
    assert statements(folded) <= 0.8 * statements(flat_src), (statements(folded), statements(flat_src))
    assert "del " in folded
    freed = {n for line in flat_src.splitlines() if line.lstrip().startswith("del ") for n in line.split("del ")[1].split(", ")}
    for name in freed:  # a freed value is either still freed or no longer has a name
        assert re.search(rf"\b{name}\b", folded) is None or re.search(rf"del .*\b{name}\b", folded), name
    assert "# f" in annotated_code(gm)  # shapes are still shown on folded lines
    model, inputs = examples.gpt(n_layer=1, dtype=torch.float64)
    loss, largs = examples.as_loss(model, inputs)
    sp = fxtools.split(loss, *largs)
    out, saved = sp.forward(*sp.flatten(*largs))
    folded, flat_src = assert_same_as_flat(sp.backward, (*saved, *[torch.ones(c.shape, dtype=c.dtype) for c in sp.cotangents]))
    assert statements(folded) <= 0.8 * statements(flat_src)


def test_folding_keeps_the_peak_memory():
    """Large values: the folded code frees exactly as the flat code does (same peak)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from bench_memory import _peak_of_call

    def f(x, w):
        h = torch.nn.functional.gelu(x @ w)
        return (h * h.sigmoid()).sum()

    x = torch.randn(512, 512)
    gm = fxtools.grad(f, x, x)
    assert "del " in gm.code and statements(gm.code) < statements(flat_code(gm))
    gm(x, x)
    folded = _peak_of_call(gm.forward, (x, x))
    with flat():
        gm.recompile()
    gm(x, x)
    assert _peak_of_call(gm.forward, (x, x)) == folded


def test_random_and_in_place_values_are_never_folded():
    def f(x, buf):
        buf.add_(x.detach().sum(0) * 0.1)
        return (F.dropout(x.sin(), 0.5, training=True) * buf).sum()

    x, buf = torch.randn(4, 8), torch.zeros(8)
    gm = fxtools.grad(f, x, buf.clone())
    code = gm.code
    assert re.search(r"^\s+\w+ = \w+\.bernoulli_\(", code, re.M), code  # the random draw has its own line
    b1, b2 = buf.clone(), buf.clone()
    torch.manual_seed(0)
    want = gm(x, b1)
    with flat():
        gm.recompile()
    torch.manual_seed(0)
    got = gm(x, b2)
    assert torch.equal(want, got) and torch.equal(b1, b2)


def test_folded_code_survives_save_and_torch_compile(tmp_path):
    f, args = CASES["gelu"]
    gm = fxtools.grad(f, *args)
    want = gm(*args)
    path = tmp_path / "gelu_grad.py"
    fxtools.save(gm, str(path))
    source = path.read_text()
    assert "(torch.erf(" in source, source  # the written module is folded too
    spec = importlib.util.spec_from_file_location("gelu_grad", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert torch.equal(module.forward(*args), want)
    torch._dynamo.reset()
    compiled = torch.compile(gm, backend="eager", fullgraph=True)
    assert torch.equal(compiled(*args), want)


def test_print_readable_and_flat_code_are_one_op_per_line():
    f, args = CASES["layer_norm"]
    gm = fxtools.grad(f, *args)
    readable = gm.print_readable(print_output=False)
    flat_src = flat_code(gm)
    assert statements(flat_src) > statements(gm.code)
    for line in flat_src.splitlines():
        if " = " in line and not line.lstrip().startswith("def"):
            assert re.search(rf"\b{line.split(' = ')[0].strip()}\b", readable), line


def test_parentheses_keep_the_meaning():
    """Operators of every precedence folded into each other: parentheses exactly where needed."""
    from fxtools.codegen.pycode import ReadableCodeGen

    def f(a, b, c):
        d = (a - b) - (b - c) * -(a**2) / ((-a) ** 2 + 1) - (a - (b - c))
        e = ((d < a) == (c >= a)) | ~(b > c)
        return (d * d + 1) ** (c - b) % 3 - d @ (a.t() * 2), e & (a != b)

    gm = torch.fx.symbolic_trace(f)
    gm.graph.set_codegen(ReadableCodeGen())
    gm.recompile()
    a, b, c = torch.randn(3, 4, 4, dtype=torch.float64).unbind(0)
    c = c.abs() + 1
    want = f(a, b, c)
    folded, flat_src = assert_same_as_flat(gm, (a, b, c))
    assert statements(folded) <= statements(flat_src) // 2, folded
    for text in [
        "(b - c) * -a ** 2 / ((-a) ** 2 + 1)",
        " - (a - (b - c))",
        " < a) == (c >= a)",
        "~(b > c)",
        " + 1) ** (c - b) % 3",
    ]:
        assert text in folded, (text, folded)
    assert "& (a != b)" in folded and "a.t() * 2" in folded
    got = gm(a, b, c)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
