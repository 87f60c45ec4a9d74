"""Problems an earlier session saw and left alone: each test failed before its fix."""

import os
import subprocess
import sys

import pytest
import torch

import fxtools

TOL = dict(rtol=1e-10, atol=1e-10)


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _repeat_loss(x, r):
    return torch.repeat_interleave(x, r, dim=0).sin().pow(2).sum()


def _nonzero_loss(x):
    return x[torch.nonzero(x > 0)[:, 0]].sin().pow(2).sum()


@pytest.mark.parametrize(
    "make, op",
    [
        (lambda x, r: fxtools.hessian(_repeat_loss, x, r), "repeat_interleave"),
        (lambda x, r: fxtools.hessian(_nonzero_loss, x), "nonzero"),
        (lambda x, r: fxtools.jacrev(fxtools.jacrev(_repeat_loss, x, r), x, r), "repeat_interleave"),
    ],
    ids=["hessian-repeat", "hessian-nonzero", "jacrev-of-jacrev"],
)
def test_second_derivative_of_a_data_dependent_size_names_the_line(make, op):
    """Batching the gradient's own data-dependent op was refused at "an unknown line"."""
    x, r = _r(3, 2, seed=1), torch.tensor([1, 0, 2])
    with pytest.raises(fxtools.errors.DataDependentError, match=rf"{op} at .*test_left_alone.py:\d+: (def|return)"):
        make(x, r)


def test_hessian_where_a_data_dependent_size_batches():
    """``x[mask]``'s second derivative batches (its gradient is an index_put): no refusal."""

    def f(x):
        return x[x > 0].sin().pow(2).sum()

    x = _r(3, 2, seed=2)
    torch.testing.assert_close(fxtools.hessian(f, x)(x), torch.func.hessian(f)(x), **TOL)
    torch.testing.assert_close(
        fxtools.hvp(_repeat_loss, x, torch.tensor([1, 0, 2]))(x, torch.tensor([2, 1, 0]), x),
        torch.func.jvp(torch.func.grad(lambda y: _repeat_loss(y, torch.tensor([2, 1, 0]))), (x,), (x,))[1],
        **TOL,
    )


# --- cumprod: one division-free formula at zeros (it was two formulas side by side, 58 calls at n=5) ---


def _cumprod_line(n, zeros, g):
    x = torch.randn(n, dtype=torch.float64, generator=g)
    for i in torch.randperm(n, generator=g)[:zeros].tolist():
        x[i] = -0.0 if i % 2 else 0.0
    return x


def test_cumprod_derivatives_with_zeros_along_every_dim():
    """grad, hvp, autograd over the gradient and (at the last dim) jvp against autograd /
    torch.func in float64, with 0, 1 and 2 zeros (±0.0, at the ends too) in a line, along every dim."""
    shape = (2, 3, 4)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(shape, dtype=torch.float64, generator=g)
    for dim in range(len(shape)):

        def f(x, dim=dim):
            return (x.cumprod(dim) * w).sum()

        x0 = torch.randn(shape, dtype=torch.float64, generator=g)
        grad, hvp = fxtools.grad(f, x0), fxtools.hvp(f, x0)
        jvp = fxtools.jvp(lambda x, dim=dim: x.cumprod(dim), x0) if dim == 2 else None
        for zeros in (0, 1, 2):
            x = torch.randn(shape, dtype=torch.float64, generator=g).movedim(dim, -1).contiguous()
            for line in x.reshape(-1, shape[dim]):
                line.copy_(_cumprod_line(shape[dim], min(zeros, shape[dim]), g))
            x, v = x.movedim(-1, dim).contiguous(), torch.randn(shape, dtype=torch.float64, generator=g)
            torch.testing.assert_close(grad(x), torch.func.grad(f)(x), **TOL)
            torch.testing.assert_close(hvp(x, v), torch.func.jvp(torch.func.grad(f), (x,), (v,))[1], **TOL)
            if jvp is not None:
                torch.testing.assert_close(jvp(x, v), torch.func.jvp(lambda x, dim=dim: x.cumprod(dim), (x,), (v,)), **TOL)
            xr = x.clone().requires_grad_()  # autograd's double backward through the generated gradient
            (gg,) = torch.autograd.grad((grad(xr) * v).sum(), xr)
            (want_gg,) = torch.autograd.grad((torch.autograd.grad(f(xr), xr, create_graph=True)[0] * v).sum(), xr)
            torch.testing.assert_close(gg, want_gg, **TOL)


def test_cumprod_lengths_one_to_seven_with_zeros():
    """A line of every length 1..7 with 0, 1, 2 zeros: hvp against torch.func (the gradient: in
    tests/test_last_ops.py at special values)."""
    g = torch.Generator().manual_seed(7)
    for n in range(1, 8):
        ct = torch.randn(n, dtype=torch.float64, generator=g)

        def f(x):
            return (x.cumprod(0) * ct).sum()

        hvp = fxtools.hvp(f, torch.randn(n, dtype=torch.float64))
        for zeros in (0, 1, 2):
            x, v = _cumprod_line(n, min(zeros, n), g), torch.randn(n, dtype=torch.float64, generator=g)
            torch.testing.assert_close(hvp(x, v), torch.func.jvp(torch.func.grad(f), (x,), (v,))[1], **TOL)


def test_cumprod_gradient_reads_short():
    """Its generated VJP at n=5: 58 calls with two formulas side by side, 30 with an n x n one
    (O(n^2) memory and time). The O(n log n), O(n)-memory one takes 101: the quotient, the doubling
    scan (about 9 per doubling of n) and, from counts of zeros, infs and NaNs, autograd's
    NaNs and infs where a zero meets an inf or NaN (about 55; the scan alone gets them wrong)."""
    gm = fxtools.vjp(lambda x: x.cumprod(0), torch.randn(5, dtype=torch.float64))
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert len(calls) <= 101, gm.code


def test_cumprod_gradient_of_a_long_line_builds_no_square_tensor():
    """A cumprod over n=4096 had an n x n tensor in its gradient (memory and time O(n^2)); now no
    tensor of the generated graph exceeds 9 n elements, and it stays exact with a zero."""
    n = 4096
    gm = fxtools.vjp(lambda x: x.cumprod(0), torch.randn(n, dtype=torch.float64))
    sizes = [nd.meta["val"].numel() for nd in gm.graph.nodes if isinstance(nd.meta.get("val"), torch.Tensor)]
    assert sizes and max(sizes) <= 9 * n
    g = torch.Generator().manual_seed(5)
    x = 1 + torch.rand(n, dtype=torch.float64, generator=g) / n  # products stay finite
    x[[7, 3000]] = 0.0
    ct = torch.randn(n, dtype=torch.float64, generator=g)
    torch.testing.assert_close(gm(x, ct)[1][0], torch.func.vjp(lambda x: x.cumprod(0), x)[1](ct)[0], **TOL)


# --- logcumsumexp: its VJP took log(ct) split by sign (not linear in ct): jvp and hvp were NaN ---


def _logcumsumexp_checks(x, dim, v, forward_mode=True):
    def f(x):
        return torch.logcumsumexp(x, dim)

    def loss(x):
        return f(x).sin().sum()

    want_vjp = torch.func.vjp(f, x)[1](v)[0]
    torch.testing.assert_close(fxtools.vjp(f, x)(x, v)[1][0], want_vjp, equal_nan=True, **TOL)
    if forward_mode:
        want_jvp, want_hvp = torch.func.jvp(f, (x,), (v,))[1], torch.func.jvp(torch.func.grad(loss), (x,), (v,))[1]
    else:  # the Jacobian and Hessian of autograd's backward mode applied to v (see the caller)
        want_jvp = torch.einsum("...ij,ij->...", torch.func.jacrev(f)(x), v)
        want_hvp = torch.einsum("...ij,ij->...", torch.func.jacrev(torch.func.grad(loss))(x), v)
    torch.testing.assert_close(fxtools.jvp(f, x)(x, v)[1], want_jvp, equal_nan=True, **TOL)
    torch.testing.assert_close(fxtools.hvp(loss, x)(x, v), want_hvp, equal_nan=True, **TOL)


def test_logcumsumexp_jvp_and_hvp_of_the_issue():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0]], dtype=torch.float64)
    _logcumsumexp_checks(x, -1, torch.tensor([[0.3, -1.0, 2.0, 0.5]], dtype=torch.float64))


def test_logcumsumexp_derivatives_random_large_and_minus_inf():
    """vjp, jvp, hvp against torch.func in float64 along each dim; at x ~ +-800 (no overflow) jvp
    and hvp against the Jacobian / Hessian of autograd's backward mode (which finite differences
    confirm): torch's forward-mode formula shifts by the line's max and sets to 0 where the shifted
    sum is below 1e-13, wrong there. -inf entries inside a line; a leading one makes autograd's
    backward NaN in that column (so here, also in the jvp), where its forward mode gives 0."""
    g = torch.Generator().manual_seed(11)
    for dim in (0, 1):
        x, v = (torch.randn(3, 5, dtype=torch.float64, generator=g) for _ in range(2))
        _logcumsumexp_checks(x, dim, v)
    x = torch.tensor([[1.0, -800.0, 800.0, -800.0, 799.0], [-790.0, 805.0, 0.0, 803.0, -1.0]], dtype=torch.float64)
    _logcumsumexp_checks(x, 1, torch.randn(2, 5, dtype=torch.float64, generator=g), forward_mode=False)
    x = torch.tensor([[0.5, -torch.inf, 2.0, -torch.inf], [-torch.inf, 1.0, -torch.inf, 3.0]], dtype=torch.float64)
    _logcumsumexp_checks(x[:1], 1, torch.randn(1, 4, dtype=torch.float64, generator=g))
    _logcumsumexp_checks(x[1:], 1, torch.randn(1, 4, dtype=torch.float64, generator=g), forward_mode=False)


# --- torch.compile of a JVP inside a checkpoint after fxtools captured a program ---

_COMPILE_AFTER_CAPTURE = """
import torch, torch.utils.checkpoint as cp
import fxtools

fxtools.vjp(lambda x: torch.func.jvp(torch.sin, (x,), (x,))[1].sum(), torch.randn(3))  # a capture first


def inner(x, w):
    return torch.func.jvp(lambda x: (x * w).sin(), (x,), (torch.ones_like(x),))[1]


def loss(x, w):
    return cp.checkpoint(inner, x, w, use_reentrant=False).pow(2).sum()


x, w = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64, requires_grad=True)
got = torch.compile(loss, backend="eager", fullgraph=True)(x, w)
(got_grad,) = torch.autograd.grad(got, w)
want = loss(x, w)
torch.testing.assert_close(got, want)
torch.testing.assert_close(got_grad, torch.autograd.grad(want, w)[0])
print("ok")
"""


def test_torch_compile_of_a_jvp_in_a_checkpoint_after_a_capture():
    """fxtools' capture wraps functorch's context managers while it runs; Dynamo, first imported
    then, kept the wrappers in its table of them and later inlined the real ones (failing in
    ``arg_tree_leaves``). A fresh interpreter: in this one Dynamo may be imported already."""
    src = os.path.dirname(os.path.dirname(fxtools.__file__))
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_AFTER_CAPTURE], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# --- fxtools.compile(dynamic=True) of conv models with Inductor ---


class _Convs(torch.nn.Module):
    """Conv2d with bias, stride and padding; Conv2d without bias, dilated and grouped; the result
    flattened (a product of symbolic sizes in the ATen graphs) into a Conv1d with bias, strided."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.b = torch.nn.Conv2d(4, 4, 2, dilation=2, groups=2, bias=False)
        self.c = torch.nn.Conv1d(4, 3, 3, stride=2, padding=1)

    def forward(self, x, t):
        y = self.c(self.b(self.a(x).tanh()).flatten(2))
        return (y - t).pow(2).mean()


def _conv_case(batch, h, w, g):
    x = torch.randn(batch, 2, h, w, dtype=torch.float64, generator=g)
    n = ((h + 1) // 2 - 2) * ((w + 1) // 2 - 2)
    return x, torch.randn(batch, 3, (n + 1) // 2, dtype=torch.float64, generator=g)


def test_dynamic_inductor_compile_of_conv_models():
    """The ATen forward held ``operator.mul`` of two sizes (the flatten's), refused as "not an ATen
    op". One compiled pair serves two other batch and spatial sizes, exact against eager."""
    g = torch.Generator().manual_seed(0)
    model = _Convs().double()
    compiled = fxtools.compile(model, *_conv_case(2, 9, 8, g), dynamic=True, compiler="inductor")
    for batch, h, w in [(2, 9, 8), (3, 11, 13), (5, 14, 10)]:
        x, t = _conv_case(batch, h, w, g)
        model.zero_grad()
        got = compiled(x, t)
        got.backward()
        got_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        want = model(x, t)
        want.backward()
        torch.testing.assert_close(got, want, **TOL)
        for a, b in zip(got_grads, [p.grad for p in model.parameters()]):
            torch.testing.assert_close(a, b, **TOL)
    # one pair for every size: the backward's example strides were read as numbers, which
    # specialised the width (a guard), so each new width compiled a new pair
    assert len(compiled._runners) == 1


def test_dynamic_compile_of_a_function_closing_over_a_module():
    """The lifted closed-over parameters (fxtools' ``ClosedOver`` argument) broke torch.export's
    dynamic_shapes matching; they are static, the batch symbolic."""
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(3, 2).double()

    def loss(x, t):
        return (lin(x) - t).pow(2).mean()

    compiled = fxtools.compile(loss, torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64), dynamic=True)
    for n in (4, 7):
        x, t = torch.randn(n, 3, dtype=torch.float64, generator=g), torch.randn(n, 2, dtype=torch.float64, generator=g)
        lin.zero_grad()
        compiled(x, t).backward()
        got = lin.weight.grad.clone()
        lin.zero_grad()
        loss(x, t).backward()
        torch.testing.assert_close(got, lin.weight.grad, **TOL)
    assert len(compiled._runners) == 1
