"""Structured control flow (issue 15): torch.cond, scan and while_loop, kept structured.

The oracle is torch.autograd in float64: of the same program where PyTorch differentiates it,
of the unrolled loop / the branch taken otherwise.
"""

from __future__ import annotations

import importlib.util
import io
import operator
import re

import pytest
import torch
from torch import nn
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

import fxtools
from fxtools.codegen.export import GUARDS_MARKER
from fxtools.errors import FxtoolsError

TOL = dict(atol=1e-10, rtol=1e-10)
cond_op, scan_op = torch.ops.higher_order.cond, torch.ops.higher_order.scan


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _autograd(f, args, argnums):
    args = [a.clone().requires_grad_(i in argnums) for i, a in enumerate(args)]
    return torch.autograd.grad(f(*args), [args[i] for i in argnums])


def _ops(gm, op) -> int:
    """How many times ``op`` is called in ``gm``'s graph and in its subgraphs."""
    count = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)
    return count + sum(_ops(m, op) for m in gm.children() if isinstance(m, torch.fx.GraphModule))


def _lines(gm) -> int:
    return len(gm.code.splitlines()) + sum(_lines(m) for m in gm.children() if isinstance(m, torch.fx.GraphModule))


# ---------------------------------------------------------------------------------------------
# torch.cond
# ---------------------------------------------------------------------------------------------


def _branchy(x, w):
    def true_fn(x, w):
        return torch.sin(x) @ w

    def false_fn(x, w):
        return torch.cos(x) * w.sum(0)

    return torch.cond(x.sum() > 0, true_fn, false_fn, (x, w)).tanh().sum()


def test_cond_grad_both_branches_one_module():
    x0, w = torch.randn(3, 3), torch.randn(3, 3)
    gm = fxtools.grad(_branchy, x0, w, argnums=(0, 1))
    assert _ops(gm, cond_op) == 2  # the forward (its value feeds the backward of tanh) and the backward
    for x in (x0.abs(), -x0.abs()):  # both predicate values, the same module
        got = gm(x, w)
        want = _autograd(_branchy, (x, w), (0, 1))
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, **TOL)


def test_cond_backward_is_a_cond_over_readable_branch_backwards():
    gm = fxtools.grad(lambda x: torch.cond(x.sum() > 0, torch.sin, torch.cos, (x,)).sum(), torch.randn(4))
    conds = [n for n in gm.graph.nodes if n.target is cond_op]
    assert len(conds) == 1  # the forward's value is not needed: only the backward cond remains
    true_bwd, false_bwd = (getattr(gm, a.target) for a in conds[0].args[1:3])
    assert [a.target for a in conds[0].args[1:3]] == ["true_branch_grad", "false_branch_grad"]
    assert "torch.cos(x)" in true_bwd.code and "torch.sin(x)" in false_bwd.code
    assert "torch.ops.aten" not in true_bwd.code + false_bwd.code
    shown = io.StringIO()
    fxtools.show(gm, file=shown)  # the branches follow the module's code, with shapes
    assert f"# self.{conds[0].args[1].target}:" in shown.getvalue() and "torch.cos(x)  # f64[4]" in shown.getvalue()


def test_cond_vjp_value_and_int_outputs():
    def f(x):
        a, n = torch.cond(x.sum() > 0, lambda x: (x.sin(), (x > 0).sum()), lambda x: (x.cos(), (x < 0).sum()), (x,))
        return a * n

    x0 = torch.randn(5)
    gm = fxtools.vjp(f, x0)
    ct = torch.randn(5)
    for x in (x0.abs(), -x0.abs()):
        out, (g,) = gm(x, ct)
        torch.testing.assert_close(out, f(x), **TOL)
        # PyTorch's own cond backward refuses an integer output: the branch taken is the oracle
        xr = x.clone().requires_grad_()
        ref = xr.sin() * (xr > 0).sum() if x.sum() > 0 else xr.cos() * (xr < 0).sum()
        torch.testing.assert_close(g, torch.autograd.grad(ref, xr, ct)[0], **TOL)


# ---------------------------------------------------------------------------------------------
# scan
# ---------------------------------------------------------------------------------------------


def _seed004_fn(a, w):
    """Seed 004's function: a few layers."""
    a = torch.sin(a)
    a = a @ w
    a = torch.cos(a)
    a = a @ w
    a = torch.sigmoid(a)
    return a


def _scanned(a0, xs, w):
    def step(a, x):
        a = _seed004_fn(a + x, w)
        return a, a.sum()

    last, ys = scan(step, a0, xs)
    return last.sum() + (ys**2).sum()


def _unrolled(a0, xs, w):
    a, total = a0, 0
    for x in xs:
        a = _seed004_fn(a + x, w)
        total = total + a.sum() ** 2
    return a.sum() + total


def _scan_args(steps):
    torch.manual_seed(0)
    return torch.randn(4, 4), torch.randn(steps, 4, 4) * 0.1, torch.randn(4, 4)


def test_scan_seed004_100_steps_equals_unrolled_autograd():
    args = _scan_args(100)
    gm = fxtools.grad(_scanned, *args, argnums=(0, 1, 2))
    for g, r in zip(gm(*args), _autograd(_unrolled, args, (0, 1, 2))):
        torch.testing.assert_close(g, r, **TOL)
    # the forward scan, and one reverse scan of the step's VJP
    assert _ops(gm, scan_op) == 2


def test_scan_code_does_not_grow_with_steps():
    short = fxtools.grad(_scanned, *_scan_args(10), argnums=(0, 1, 2))
    long = fxtools.grad(_scanned, *_scan_args(100), argnums=(0, 1, 2))
    assert _lines(short) == _lines(long)
    assert "for " not in long.code


def test_scan_split_reports_what_is_saved_per_step():
    args = _scan_args(12)
    s = fxtools.split(_scanned, *args)
    text = s.report(file=io.StringIO())
    assert "per step: float64[4, 4]" in text and "12 steps" in text
    per_step = [v for v in s.saved if v.note]
    assert len(per_step) == 1 and per_step[0].shape == (12, 4, 4)
    out, saved = s.forward(*args)
    torch.testing.assert_close(out, _scanned(*args), **TOL)
    grads = s.backward(*saved, torch.ones(()))
    for g, r in zip(grads, _autograd(_unrolled, args, (0, 1, 2))):
        torch.testing.assert_close(g, r, **TOL)


def test_scan_one_module_for_every_number_of_steps():
    steps = torch.export.Dim("steps", min=2, max=1000)
    gm = fxtools.grad(_tanh_scan, *_tanh_args(5), argnums=(0, 1, 2), dynamic_shapes=(None, {0: steps}, None))
    for n in (5, 17):
        args = _tanh_args(n)
        for g, r in zip(gm(*args), _autograd(_tanh_unrolled, args, (0, 1, 2))):
            torch.testing.assert_close(g, r, **TOL)


def _tanh_args(steps):
    return torch.randn(3), torch.randn(steps, 3), torch.randn(3, 3)


@pytest.mark.parametrize("policy", ["save_all", "dots_saveable", "recompute_cheap"])
def test_split_policies_cond_feeding_scan(policy):
    def f(x, w):
        y = torch.cond(x.sum() > 0, lambda x, w: torch.sin(x) @ w, lambda x, w: torch.cos(x) * 2, (x, w))

        def step(h, row):
            h = torch.tanh(h @ w + row)
            return h, h.sum()

        h, ys = scan(step, y[0], y)
        return h.sum() + ys.sum()

    x0, w = torch.randn(3, 3), torch.randn(3, 3)
    s = fxtools.split(f, x0, w, policy=policy)
    for x in (x0.abs(), -x0.abs()):
        out, saved = s.forward(x, w)
        for g, r in zip(s.backward(*saved, torch.ones(())), _autograd(f, (x, w), (0, 1))):
            torch.testing.assert_close(g, r, **TOL)


def test_cond_inside_scan_step():
    def f(h0, xs, w):
        def step(h, x):
            h2 = torch.cond(x.sum() > 0, lambda h, x: torch.tanh(h @ w + x), lambda h, x: torch.sin(h) * x, (h, x))
            return h2, h2.sum()

        h, ys = scan(step, h0, xs)
        return h.sum() + (ys**2).sum()

    def unrolled(h0, xs, w):
        h, total = h0, 0
        for x in xs:
            h = torch.tanh(h @ w + x) if x.sum() > 0 else torch.sin(h) * x
            total = total + h.sum() ** 2
        return h.sum() + total

    torch.manual_seed(1)
    args = (torch.randn(3), torch.randn(8, 3), torch.randn(3, 3))
    gm = fxtools.grad(f, *args, argnums=(0, 1, 2))
    for g, r in zip(gm(*args), _autograd(unrolled, args, (0, 1, 2))):
        torch.testing.assert_close(g, r, **TOL)


# ---------------------------------------------------------------------------------------------
# while_loop
# ---------------------------------------------------------------------------------------------


def test_while_loop_without_gradient_runs():
    def f(x):
        n, y = while_loop(lambda n, y: y.sum() < 10, lambda n, y: (n + 1, y * 2), (torch.tensor(0), x.detach().abs() + 0.1))
        return (x * n).sum() + y.sum()

    x = torch.randn(3)
    gm = fxtools.grad(f, x)
    torch.testing.assert_close(gm(x), _autograd(f, (x,), (0,))[0], **TOL)


def _loop(x, w, k):
    n, y = while_loop(lambda n, y: n < k, lambda n, y: (n + 1, torch.tanh(y @ w)), (torch.tensor(0), x))
    return (y**2).sum()


def _loop_unrolled(x, w, k):
    y = x
    for _ in range(int(k)):
        y = torch.tanh(y @ w)
    return (y**2).sum()


def test_while_loop_grad_one_module_for_every_number_of_steps():
    x, w = torch.randn(3), torch.randn(3, 3)
    gm = fxtools.grad(_loop, x, w, torch.tensor(4), argnums=(0, 1))
    assert _ops(gm, torch.ops.higher_order.while_loop) == 1  # the backward is a loop
    for k in (4, 1, 0, 9):  # no steps: the gradient of the identity
        k = torch.tensor(k)
        want = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        want = torch.autograd.grad(_loop_unrolled(*want, k), want, allow_unused=True, materialize_grads=True)
        for g, r in zip(gm(x, w, k), want):
            torch.testing.assert_close(g, r, **TOL)


def test_while_loop_split_reports_the_steps():
    x, w = torch.randn(3), torch.randn(3, 3)
    s = fxtools.split(_loop, x, w, torch.tensor(4))
    assert "the carry entering each step of the while_loop" in s.report(file=io.StringIO())
    out, saved = s.forward(x, w, torch.tensor(6))
    grads = s.backward(*saved, torch.ones(()))
    for g, r in zip(grads, _autograd(_loop_unrolled, (x, w, torch.tensor(6)), (0, 1))):
        torch.testing.assert_close(g, r, **TOL)


def test_while_loop_second_order_refused_naming_the_line():
    x, w = torch.randn(3), torch.randn(3, 3)
    # the while_loop's own line (it named the fxtools.hvp call before the gradient module kept the user's lines)
    with pytest.raises(
        FxtoolsError, match=r"gradient of a while_loop again \(at .*test_control_flow.py:\d+: +n, y = while_loop\("
    ):
        fxtools.hvp(lambda x, w: _loop(x, w, torch.tensor(3)), x, w, argnums=(0, 1))


def test_while_loop_with_a_python_number_carry_refused_naming_the_line():
    def f(x):
        n, y = while_loop(lambda n, y: n < 3, lambda n, y: (n + 1, torch.tanh(y * 2)), (0, x))
        return y.sum()

    with pytest.raises(FxtoolsError, match=r"while_loop \(at .*test_control_flow.py:\d+: n, y = while_loop.*a Python number"):
        fxtools.grad(f, torch.randn(3))


# ---------------------------------------------------------------------------------------------
# compile and save
# ---------------------------------------------------------------------------------------------


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.lin = nn.Linear(4, 4)

    def forward(self, h0, xs):
        def step(h, x):
            h = torch.tanh(self.lin(x) + h @ self.w)
            return h, h.sum(-1)

        h, ys = scan(step, h0, xs)
        pick = torch.cond(xs.sum() > 0, lambda h: (h**2).sum(), lambda h: h.sin().sum(), (h,))
        return pick + ys.sum()


def test_compile_trains_a_module_with_scan_and_cond():
    torch.manual_seed(0)
    model, eager = _Recurrent(), _Recurrent()
    eager.load_state_dict(model.state_dict())
    h0, xs = torch.randn(3, 4), torch.randn(6, 3, 4)
    compiled = fxtools.compile(model, h0, xs)
    opt, opt_eager = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager))
    for step in range(4):
        h0, xs = torch.randn(3, 4), torch.randn(6, 3, 4).abs() * (1 if step % 2 else -1)  # both branches
        losses = []
        for o, run in ((opt, compiled), (opt_eager, eager)):
            o.zero_grad()
            loss = run(h0, xs)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], **TOL)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, **TOL)


class _Looping(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3) * 0.5)

    def forward(self, x, k):
        n, y = while_loop(lambda n, y: n < k, lambda n, y: (n + 1, torch.tanh(y @ self.w)), (torch.tensor(0), x))
        return (y**2).sum()


def test_compile_trains_a_module_with_while_loop():
    # The oracle is the unrolled loop: torch 2.13's own while_loop backward differs from it here
    # (closed-over parameter, two or more steps), so eager autograd of this module is not one.
    torch.manual_seed(0)
    model = _Looping()
    x = torch.randn(3)
    compiled = fxtools.compile(model, x, torch.tensor(2))
    for k in (2, 5, 1):
        model.w.grad = None
        compiled(x, torch.tensor(k)).backward()
        want = _autograd(_loop_unrolled, (x, model.w.detach(), torch.tensor(k)), (1,))[0]
        torch.testing.assert_close(model.w.grad, want, **TOL)


def test_saved_module_keeps_control_flow_as_functions(tmp_path):
    x0, w = torch.randn(3, 3), torch.randn(3, 3)
    gm = fxtools.grad(_branchy, x0, w)
    path = tmp_path / "g.py"
    text = fxtools.save(gm, str(path))
    assert "fxtools" not in text.split('"""')[2]  # imports only torch
    functions = re.findall(r"^def (\w+)\(", text.split(GUARDS_MARKER)[0], flags=re.M)
    assert len(functions) == 5 and functions[-1] == "forward"  # and the forward's and the backward's branches
    spec = importlib.util.spec_from_file_location("g_saved", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for x in (x0.abs(), -x0.abs()):
        torch.testing.assert_close(module.forward(x, w), _autograd(_branchy, (x, w), (0,))[0], **TOL)


def test_save_title(tmp_path):
    text = fxtools.save(fxtools.grad(lambda x: x.sin().sum(), torch.randn(3)), str(tmp_path / "g.py"), name="Sine")
    assert text.startswith('"""Sine.')


def test_subgraph_placeholders_named_after_operands():
    gm = fxtools.grad(_branchy, torch.randn(3, 3), torch.randn(3, 3))
    node = next(n for n in gm.graph.nodes if n.target is cond_op and n.users)
    sub = getattr(gm, node.args[1].target)
    names = [n.name for n in sub.graph.nodes if n.op == "placeholder"]
    assert names[:2] == ["x", "w"]
    assert operator.contains(sub.code, "def forward(self, x, w")


# ---------------------------------------------------------------------------------------------
# forward mode and second order (through the transposed VJP: cond and scan again)
# ---------------------------------------------------------------------------------------------


def _branchy_taken(x, w):
    """``_branchy`` with the branch chosen in Python (torch.func cannot differentiate torch.cond)."""
    return (torch.sin(x) @ w if x.sum() > 0 else torch.cos(x) * w.sum(0)).tanh().sum()


def _tanh_scan(h0, xs, w):
    def step(h, x):
        h = torch.tanh(h @ w + x)
        return h, h.sum()

    h, ys = scan(step, h0, xs)
    return h.sum() + (ys**2).sum()


def _tanh_unrolled(h0, xs, w):
    h, total = h0, 0
    for x in xs:
        h = torch.tanh(h @ w + x)
        total = total + h.sum() ** 2
    return h.sum() + total


@pytest.mark.parametrize("case", ["cond", "scan"])
def test_jvp_and_hvp_through_control_flow(case):
    torch.manual_seed(2)
    if case == "cond":
        x0, w = torch.randn(3, 3), torch.randn(3, 3)
        f, oracle, points = _branchy, _branchy_taken, [(x0.abs(), w), (-x0.abs(), w)]
    else:
        f, oracle, points = _tanh_scan, _tanh_unrolled, [(torch.randn(3), torch.randn(5, 3), torch.randn(3, 3))]
    nums = tuple(range(len(points[0])))
    jvp = fxtools.jvp(f, *points[0])
    hvp = fxtools.hvp(f, *points[0], argnums=nums)
    for args in points:
        t = tuple(torch.randn_like(a) for a in args)
        out, tangent = jvp(*args, *t)
        want = torch.func.jvp(oracle, args, t)
        torch.testing.assert_close(out, want[0], **TOL)
        torch.testing.assert_close(tangent, want[1], **TOL)
        for g, r in zip(hvp(*args, t), torch.func.jvp(torch.func.grad(oracle, argnums=nums), args, t)[1]):
            torch.testing.assert_close(g, r, **TOL)


def test_one_element_tuple_results_print_as_one_element_unpacking():
    """A one-output cond and a split into one chunk return a one-element tuple / list: the code
    unpacks it with ``(y,) = ...`` (it once bound the tuple itself to ``y``)."""
    gm = fxtools.grad(lambda x: torch.split(x, 4)[0].sin().sum(), torch.randn(3))
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), torch.cos(x), **TOL)
    gm = fxtools.vjp(lambda x: torch.cond(x.sum() > 0, torch.sin, torch.cos, (x,)), torch.randn(4))
    assert ",) = torch.ops.higher_order.cond(" in gm.code
    for x in (torch.rand(4), -torch.rand(4)):
        out, (g,) = gm(x, torch.ones(4))
        torch.testing.assert_close(out, torch.sin(x) if x.sum() > 0 else torch.cos(x), **TOL)
