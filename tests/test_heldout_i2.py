"""Held-out programs (batch i2): autograd idioms inside traced programs.

Each test is a program that gave a silent wrong gradient, a crash or a false refusal before its
fix: ``torch.no_grad()`` / ``.detach()`` inside a JVP taken inside a loss (and inside nested
``torch.func.vjp`` / ``jacrev`` / ``jacfwd``), a buffer updated in place under ``no_grad`` in a
program differentiated with respect to other arguments, ``.item()`` of a buffer the program
itself wrote, and a dynamic size narrowed by a library call. The oracle is torch.func /
torch.autograd in float64, at several sizes; where PyTorch's own answer is wrong (reverse mode
over ``native_layer_norm``'s forward-mode formula drops the statistics' derivatives), central
finite differences.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim

import fxtools

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)
SIZES = [3, 7]


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + n)
    w = torch.randn(n, dtype=D, generator=g)
    x = torch.randn(n, dtype=D, generator=g)
    return w, x


# --- no_grad / detach inside a JVP inside a loss: the values computed there, and their tangents, are
# constants of the outer gradient (as in eager forward_ad + autograd and in torch.func); fxtools
# differentiated the tangent of the no_grad value, silently giving another gradient. Under
# inference_mode the tangent itself stops (fxtools let it through) ---


def _body(cut: str):
    def g(w, x):
        h = torch.tanh(w * x)
        if cut == "no_grad":
            with torch.no_grad():
                s = torch.sin(h * w) + w.exp()
        elif cut == "inference_mode":  # forward AD stops there too: no tangent
            with torch.inference_mode():
                s = torch.sin(h * w) + w.exp()
            s = s.clone()
        else:
            s = (torch.sin(h * w) + w.exp()).detach()
        return h * s + torch.exp(w) * x

    return g


def _jvp(spelling: str, g, w, x):
    tw, tx = torch.ones_like(w), x.cos()
    if spelling == "torch.func":
        return torch.func.jvp(g, (w, x), (tw, tx))
    if spelling == "fxtools":
        return fxtools.jvp(g, w, x)(w, x, tw, tx)
    with fwAD.dual_level():
        out = g(fwAD.make_dual(w, tw), fwAD.make_dual(x, tx))
        return fwAD.unpack_dual(out)


def _loss(spelling: str, cut: str):
    g = _body(cut)

    def loss(w, x):
        y, t = _jvp(spelling, g, w, x)
        return (y * t).sum() + (t**2).mean()

    return loss


@pytest.mark.parametrize(
    "spelling, cut, n",
    [("torch.func", "no_grad", 3), ("torch.func", "no_grad", 7), ("fxtools", "no_grad", 5), ("forward_ad", "no_grad", 4)]
    + [("fxtools", "detach", 6), ("torch.func", "inference_mode", 5)],
)
def test_no_grad_inside_a_jvp_inside_a_loss(spelling, cut, n):
    w, x = _inputs(n)
    want = torch.func.grad(_loss("torch.func", cut))(w, x)
    loss = _loss(spelling, cut)
    if n % 2:
        torch.testing.assert_close(fxtools.grad(loss, w, x)(w, x), want, **TOL)
        return
    value, grad = fxtools.value_and_grad(loss, w, x)(w, x)
    torch.testing.assert_close(grad, want, **TOL)
    torch.testing.assert_close(value, _loss("torch.func", cut)(w, x), **TOL)


@pytest.mark.parametrize("n", [5])
def test_no_grad_inside_a_jvp_split(n):
    w, x = _inputs(n, seed=1)
    loss = _loss("torch.func", "no_grad")
    sp = fxtools.split(loss, w, x)
    out, saved = sp.forward(*sp.flatten(w, x))
    grads = sp.backward(*saved, torch.ones_like(out))
    torch.testing.assert_close(grads[0], torch.func.grad(loss)(w, x), **TOL)


def _finite_difference_grad(loss, w, *rest, eps=1e-5):
    """Central differences of ``loss`` along each coordinate of ``w`` (error ~ eps**2)."""
    grad = torch.zeros_like(w)
    for i in range(w.numel()):
        e = torch.zeros_like(w).view(-1)
        e[i] = eps
        e = e.view_as(w)
        grad.view(-1)[i] = (loss(w + e, *rest) - loss(w - e, *rest)) / (2 * eps)
    return grad


@pytest.mark.parametrize("n", [5])
def test_no_grad_statistics_beside_layer_norm_inside_a_jvp(n):
    """A layer norm in grad mode and a scale computed under no_grad, in a JVP inside a loss.

    Oracle: central finite differences of the loss with the scale and its tangent frozen at the
    point (what no_grad means), the JVP taken by torch.func (exact in forward mode). torch.func.grad
    over it is not: PyTorch's reverse mode over native_layer_norm's forward-mode formula drops the
    statistics' derivatives (see test_jvp_in_loss.py)."""
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, dtype=D, generator=g), torch.randn(3, n, dtype=D, generator=g)

    def normed(w, x):
        return torch.tanh(F.layer_norm(x * w, (n,)))

    def net(w, x):
        h = F.layer_norm(x * w, (n,))
        with torch.no_grad():
            scale = (h * w).norm() + 1
        return torch.tanh(h) * scale

    def loss(w, x):
        y, t = torch.func.jvp(net, (w, x), (w.cos(), torch.ones_like(x)))
        return (y * t).sum()

    def scale(w, x):
        return (F.layer_norm(x * w, (n,)) * w).norm() + 1

    s, s_dot = torch.func.jvp(scale, (w, x), (w.cos(), torch.ones_like(x)))

    def frozen(v, x):
        h, h_dot = torch.func.jvp(normed, (v, x), (v.cos(), torch.ones_like(x)))
        return (h * s * (h_dot * s + h * s_dot)).sum()

    torch.testing.assert_close(frozen(w, x), loss(w, x), **TOL)
    want = _finite_difference_grad(frozen, w, x)
    torch.testing.assert_close(fxtools.grad(loss, w, x)(w, x), want, rtol=1e-7, atol=1e-8)


class ScaledNet(nn.Module):
    """A JVP of a layer whose scale is a no_grad statistic of its own output: the scale's tangent
    depends on the inputs and parameters alone, so fxtools' placement of tangent code hoisted it
    out of its no_grad block and the gradient differentiated it, silently."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=D)

    def net(self, z):
        h = torch.tanh(self.lin(z))
        with torch.no_grad():
            scale = (h * h).mean() + 1
        return h * scale

    def forward(self, z, v):
        u, du = torch.func.jvp(self.net, (z,), (v,))
        return (u * du).sum()


@pytest.mark.parametrize("d", [3, 6])
def test_a_no_grad_statistic_of_the_inputs_alone_inside_a_jvp(d):
    torch.manual_seed(d)
    model = ScaledNet(d)
    z, v = torch.randn(2, d, dtype=D), torch.randn(2, d, dtype=D)
    loss = fxtools.functional(model)
    params = {k: p.detach() for k, p in model.named_parameters()}
    want = torch.func.grad(loss)(params, z, v)
    got = fxtools.grad(loss, params, z, v)(params, z, v)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL)
    if d == 3:
        compiled = fxtools.compile(model, z, v)
        compiled(z, v).backward()
        for k in want:
            torch.testing.assert_close(model.get_parameter(k).grad, want[k], **TOL)


def test_no_grad_inside_two_nested_jvps_inside_a_loss():
    """Forward mode passes through no_grad at both levels; the reverse pass stops there."""
    w, x = _inputs(4, seed=6)
    g = _body("no_grad")

    def inner(w, x):
        return torch.func.jvp(g, (w, x), (torch.ones_like(w), x.cos()))[1]

    def loss(w, x):
        y, t = torch.func.jvp(inner, (w, x), (w.sin(), torch.ones_like(x)))
        return (y * t).sum() + (y**2).sum()

    torch.testing.assert_close(fxtools.grad(loss, w, x)(w, x), torch.func.grad(loss)(w, x), **TOL)


# --- the same inside nested torch.func.vjp / jacrev / jacfwd, replayed as plain ops ---


def _nested(kind: str):
    g = _body("no_grad")

    def loss(w, x):
        if kind == "vjp":
            _, pull = torch.func.vjp(lambda w: g(w, x), w)
            j = pull(x.cos())[0]
        else:
            j = getattr(torch.func, kind)(g)(w, x)
        return (j**2).sum()

    return loss


@pytest.mark.parametrize("kind, n", [("vjp", 3), ("vjp", 7), ("jacrev", 4), ("jacfwd", 5)])
def test_no_grad_inside_a_nested_transform_inside_a_loss(kind, n):
    w, x = _inputs(n, seed=2)
    loss = _nested(kind)
    torch.testing.assert_close(fxtools.grad(loss, w, x)(w, x), torch.func.grad(loss)(w, x), **TOL)


# --- a buffer updated in place under no_grad, passed as an argument that is not differentiated: refused
# ("an input that may be differentiated") although eager autograd runs it ---


def _running(w, buf, x):
    h = x * w
    with torch.no_grad():
        buf.mul_(0.9).add_(h.mean(0) * 0.1)
    return ((h - buf) ** 2).sum()


@pytest.mark.parametrize("transform, n", [("grad", 3), ("grad", 7), ("value_and_grad", 5)])
def test_a_buffer_updated_under_no_grad_of_an_undifferentiated_argument(transform, n):
    w, x = _inputs(n, seed=3)
    x = x.expand(4, n) * torch.arange(1, 5, dtype=D)[:, None]
    gm = getattr(fxtools, transform)(_running, w, torch.zeros(n, dtype=D), x)
    buf, eager_buf = torch.ones(n, dtype=D), torch.ones(n, dtype=D)
    got = gm(w, buf, x)
    wr = w.clone().requires_grad_()
    loss = _running(wr, eager_buf, x)
    (want,) = torch.autograd.grad(loss, wr)
    torch.testing.assert_close(got if transform == "grad" else got[1], want, **TOL)
    torch.testing.assert_close(buf, eager_buf, **TOL)


@pytest.mark.parametrize("n", SIZES)
def test_a_buffer_updated_under_no_grad_in_split_and_compile(n):
    w, x = _inputs(n, seed=4)
    x = x.expand(4, n) * torch.arange(1, 5, dtype=D)[:, None]
    sp = fxtools.split(_running, w, torch.zeros(n, dtype=D), x, grad_leaves=[True, False, False])
    buf, eager_buf = torch.ones(n, dtype=D), torch.ones(n, dtype=D)
    out, saved = sp.forward(*sp.flatten(w, buf, x))
    grads = sp.backward(*saved, torch.ones_like(out))
    wr = w.clone().requires_grad_()
    (want,) = torch.autograd.grad(_running(wr, eager_buf, x), wr)
    torch.testing.assert_close(grads[0], want, **TOL)
    torch.testing.assert_close(buf, eager_buf, **TOL)

    if n != SIZES[0]:
        return  # fxtools.compile (slow to build) at one size
    wc = w.clone().requires_grad_()  # which leaves need a gradient: the one fxtools.compile differentiates
    compiled = fxtools.compile(_running, wc, torch.zeros(n, dtype=D), x)
    buf = torch.ones(n, dtype=D)
    compiled(wc, buf, x).backward()
    torch.testing.assert_close(wc.grad, want, **TOL)
    torch.testing.assert_close(buf, eager_buf, **TOL)


def test_a_buffer_that_is_differentiated_is_still_refused():
    w, x = _inputs(3, seed=5)
    with pytest.raises(fxtools.FxtoolsError, match="under torch.no_grad"):
        fxtools.grad(_running, w, torch.zeros(3, dtype=D), x, argnums=(0, 1))


# --- .item() of a buffer the program itself wrote: crashed inside make_fx ("a tracing tensor") ---


class Counter(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, dtype=D))
        self.register_buffer("count", torch.zeros((), dtype=D))

    def forward(self, x):
        self.count.add_(1)
        return (x * self.w).sum() / self.count.item()


@pytest.mark.parametrize("n", [4])
def test_item_of_a_buffer_the_program_wrote_is_a_data_dependent_error(n):
    m = Counter(n)
    with pytest.raises(fxtools.DataDependentError, match=r"test_heldout_i2.py:\d+: return .*self.count.item\(\)"):
        fxtools.grad(fxtools.functional(m), dict(m.named_parameters()), torch.randn(n, dtype=D))
    assert m.count.item() == 0  # tracing did not write the real buffer


# --- a dynamic size narrowed inside a library call: the error named torch's line, not the user's ---


def test_a_size_narrowed_by_a_view_names_the_users_line():
    def f(x):
        return x.view(-1, 2, 3).tanh().sum()

    with pytest.raises(fxtools.SymbolicSizeError, match=r"test_heldout_i2.py:\d+: return x.view\(-1, 2, 3\)"):
        fxtools.grad(f, torch.randn(8, 3, dtype=D), dynamic_shapes={"x": {0: Dim("batch", min=2, max=64)}})


# --- a tensor's backward hook or retain_grad in the program: failed inside PyTorch ("cannot register a
# hook on a tensor that doesn't require gradient"); refused naming the line, as module backward hooks are ---


@pytest.mark.parametrize("call", ["register_hook", "retain_grad"])
def test_a_tensor_hook_in_the_program_is_refused_naming_the_line(call):
    def f(w, x):
        h = torch.tanh(w * x)
        getattr(h, call)(*([lambda g: g * 2] if call == "register_hook" else []))
        return (h * h).sum()

    w, x = _inputs(4, seed=7)
    with pytest.raises(fxtools.FxtoolsError, match=rf"test_heldout_i2.py:\d+: getattr\(h, call\).*Tensor.{call}\(\)"):
        fxtools.grad(f, w, x)
    wr = w.clone().requires_grad_()
    f(wr, x).backward()  # eager runs it (the hook doubles the gradient through h)
    assert wr.grad is not None


def test_a_buffer_updated_under_no_grad_in_a_hessian_vector_product():
    """The Hessian-vector product differentiates the generated gradient again: the write reads its
    value detached there (it was refused, from an unknown line)."""
    w, x = _inputs(5, seed=8)
    x = x.expand(4, 5) * torch.arange(1, 5, dtype=D)[:, None]
    v = torch.randn(5, dtype=D, generator=torch.Generator().manual_seed(9))
    gm = fxtools.hvp(_running, w, torch.zeros(5, dtype=D), x, argnums=0)
    buf = torch.ones(5, dtype=D)
    got = gm(w, buf, x, v)
    want = torch.autograd.functional.hvp(lambda w: _running(w, torch.ones(5, dtype=D), x), w, v)[1]
    torch.testing.assert_close(got, want, **TOL)
    eager_buf = torch.ones(5, dtype=D)
    _running(w, eager_buf, x)
    torch.testing.assert_close(buf, eager_buf, **TOL)
