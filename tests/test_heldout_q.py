"""Held-out programs (batch q): composed transforms through ``torch.cond``.

Transforms of fxtools-generated modules (``jacfwd``/``vmap`` of a ``grad`` module whose code has a
``cond``), called at other layouts than the example. Each gave a crash or a false refusal before
its fix; the oracle is PyTorch in float64 on the same program with a Python ``if`` (torch.func
cannot batch ``torch.cond`` over these branches): ``torch.func`` transforms, or a loop over
samples.
"""

import sys

import pytest
import torch
from torch.func import grad, jacrev
from torch.utils import _pytree as pytree

import fxtools

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import fuzz_programs as fp  # noqa: E402

TOL = dict(atol=1e-10, rtol=1e-10)


pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py


def _strided(t):
    """``t``'s values in a non-contiguous layout (every other element, dimensions reversed)."""
    if not t.is_floating_point() or t.dim() == 0:
        return t
    dims = list(reversed(range(t.dim())))
    big = torch.zeros(*reversed(t.shape), 2)
    big[..., 0] = t.permute(dims)
    return big[..., 0].permute(dims)


def _branches(loss, k):
    """``loss`` or ``loss.cos()`` by the sign of argument ``k``'s sum: as ``torch.cond`` and as ``if``."""

    def with_cond(*a):
        return torch.cond(a[k].sum() > 0, lambda *b: loss(*b), lambda *b: loss(*b).cos(), tuple(a))

    def with_if(*a):
        return loss(*a) if a[k].sum() > 0 else loss(*a).cos()

    return with_cond, with_if


def _signed(args, k, sign):
    a = list(args)
    a[k] = sign * (a[k].abs() + 0.1)
    return a


def test_jacfwd_of_grad_module_through_cond_with_a_scatter_in_the_backward():
    # the branch's backward scatters (max's indices) into a fresh tensor; under vmap the branch
    # wrote batched rows into an unbatched tensor: refused ("vmap: scatter_ ... is not possible")
    def loss(x):
        return torch.sigmoid(x).max(-1).values.sin().sum() + (x * x.t()).sum()

    f_cond, f_if = _branches(loss, 0)
    x = torch.randn(3, 3)
    g = fxtools.grad(f_cond, x)
    h = fxtools.jacfwd(g, x)
    h_direct = fxtools.jacfwd(f_cond, x)
    for sign in (1, -1):
        (xs,) = _signed((x,), 0, sign)
        want = jacrev(grad(f_if))(xs)
        torch.testing.assert_close(h(_strided(xs)), want, **TOL)
        torch.testing.assert_close(h_direct(_strided(xs)), jacrev(f_if)(xs), **TOL)


def test_per_sample_grad_through_cond_with_an_unbatched_matmul_operand():
    # ``ones * w`` (w unbatched) was simplified to ``w.expand(...)``, which the branch's ``.view``
    # cannot view: crash in simplify (ValueError: Cannot view a tensor ... strides (0, ...))
    def loss(x0, x1, x2):
        return (x1 @ x2).sin().sum() + (x0 * x0).sum()

    f_cond, f_if = _branches(loss, 0)
    x0, x1, x2 = torch.randn(3), torch.randn(2, 3, 2), torch.randn(2, 2)
    g = fxtools.grad(f_cond, x0, x1, x2, argnums=(0, 1))
    xb = torch.randn(4, 3)
    xb[:2] = xb[:2].abs() + 0.1
    xb[2:] = -xb[2:].abs() - 0.1
    v = fxtools.vmap(g, xb, x1, x2, in_dims=(0, None, None))
    got = v(xb, _strided(x1), x2)
    want = [torch.stack(c) for c in zip(*[grad(f_if, argnums=(0, 1))(xb[i], x1, x2) for i in range(4)])]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def _float_loss(f, k):
    def loss(*a):
        leaves = [t for t in pytree.tree_flatten(f(*a))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return sum(t.sin().sum() for t in leaves) + 0.0 * a[k].sum()

    return loss


@pytest.mark.parametrize("index", [1, 4, 30])  # seed 7: max, gather, index_add backwards
def test_fuzz_programs_in_cond_branches_second_order_and_batched(index):
    p = fp.program(index, seed=7)
    k = p.float_args[0]
    f_cond, f_if = _branches(_float_loss(p.fn, k), k)
    g = fxtools.grad(f_cond, *p.args, argnums=k)
    h = fxtools.jacfwd(g, *p.args, argnums=k)
    for sign in (1, -1):
        args = _signed(p.args, k, sign)
        strided = [_strided(a) for a in args]
        torch.testing.assert_close(g(*strided), grad(f_if, argnums=k)(*args), **TOL)
        # jacrev of grad: torch.func.hessian (jacfwd over jacrev) is itself wrong on some programs
        # (layer_norm whose weight is its input), the reverse-over-reverse one is not
        torch.testing.assert_close(h(*strided), jacrev(grad(f_if, argnums=k), argnums=k)(*args), **TOL)
    batched, dims = list(p.batched_args()), p.in_dims()
    batched[k] = batched[k].clone()
    batched[k][0] = -batched[k][0].abs() - 0.1
    batched[k][1:] = batched[k][1:].abs() + 0.1
    v = fxtools.vmap(g, *batched, in_dims=dims)
    samples = [[b.select(d, j) if d is not None else b for b, d in zip(batched, dims)] for j in range(fp.BATCH)]
    want = torch.stack([grad(f_if, argnums=k)(*s) for s in samples])
    torch.testing.assert_close(v(*batched), want, **TOL)
