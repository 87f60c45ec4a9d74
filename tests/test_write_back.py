"""A differentiable value written in place into an argument, under ``fxtools.compile`` and
``fxtools.split`` (``training/written.py``): the new value is computed out of place, returned by
the forward, and written into the argument after the autograd.Function with autograd recording,
so a later backward through the argument reaches what the write read, as in eager. The oracle is
eager PyTorch in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxtools

TOL = dict(rtol=1e-10, atol=1e-12)


def _scale_columns(y, w):  # no output reads the written value
    y[:, 1:].mul_(w[1:])
    return (y < 0).sum() + w.sum()


def _y(kind, shape, seed):
    """The written argument and the leaf its gradient reaches (None: none)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "leaf":
        return torch.randn(shape, generator=g), None
    base = torch.randn(shape[0] + 1, shape[1], generator=g).requires_grad_()
    y = base * 1 if kind == "non_leaf" else (base * 1)[1:]  # view: the write reaches the base's rows 1:
    return y, base


def _step(fn, kind, shape, seed):
    y, base = _y(kind, shape, seed)
    w = torch.randn(shape[1], generator=torch.Generator().manual_seed(seed + 1)).requires_grad_()
    out = fn(y, w)
    (out + (y * y.detach().sign() * 2).sum() + (y**2).sum()).backward()
    return out.detach(), y.detach().clone(), y._version > 0, w.grad, None if base is None else base.grad


@pytest.mark.parametrize("kind,compiler", [("leaf", None), ("non_leaf", None), ("view", None), ("non_leaf", "aten")])
def test_write_no_output_reads_matches_eager(float64, kind, compiler):
    """was: the write ran outside autograd: ``w.grad`` was ``[1, 1, 1]`` and the old ``y``'s part
    was lost. At two shapes (a second pair of graphs), with the ATen graphs a compiler gets too."""
    compiled = fxtools.compile(_scale_columns, compiler=None if compiler is None else (lambda gm, example: gm))
    for seed, shape in enumerate([(4, 3), (6, 5)]):
        want = _step(_scale_columns, kind, shape, seed)
        got = _step(compiled, kind, shape, seed)
        for g, r in zip(got, want, strict=True):
            if isinstance(r, torch.Tensor):
                torch.testing.assert_close(g, r, **TOL)
            else:
                assert g == r
    assert len(compiled._runners) == 2
    assert [w.path for w in compiled.split.written] == ["y"]


def test_leaf_requiring_grad_refused_as_in_eager(float64):
    compiled = fxtools.compile(_scale_columns)
    w = torch.randn(3, requires_grad=True)
    for fn in (_scale_columns, compiled):
        y = torch.randn(4, 3, requires_grad=True)
        before = y.detach().clone()
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place operation"):
            fn(y, w)
        torch.testing.assert_close(y.detach(), before)
    with torch.no_grad():  # eager writes a leaf under no_grad: so does the compiled function
        y, yc = torch.randn(4, 3, requires_grad=True), None
        yc = y.detach().clone().requires_grad_()
        _scale_columns(y, w), compiled(yc, w)
        torch.testing.assert_close(yc, y, **TOL)


def _two(a, b, w):
    a.mul_(w)
    b.add_(w * a)
    return (w**2).sum()


def _returned(y, w):
    y.mul_(w)
    return y, w.sum()


def _returned_view(y, w):
    y.mul_(w)
    return y[1:], w.sum()


def test_an_output_viewing_the_written_argument_is_a_view_of_it(float64):
    """``return y[1:]`` after writing ``y``: the output is a view of the caller's ``y``, as in
    eager (an in-place update of one shows in the other), with eager's gradients."""
    compiled = fxtools.compile(_returned_view)
    results = []
    for fn in (_returned_view, compiled):
        base = torch.randn(3, 2, generator=torch.Generator().manual_seed(11)).requires_grad_()
        w = torch.randn(2, generator=torch.Generator().manual_seed(12)).requires_grad_()
        y = base * 1
        o, s = fn(y, w)
        assert o._base is y._base or o._base is y
        ((o**2).sum() + s + (y * 3).sum()).backward()
        with torch.no_grad():
            o.mul_(2)
        results.append((y.detach(), base.grad, w.grad))
    for g, r in zip(*reversed(results), strict=True):
        torch.testing.assert_close(g, r, **TOL)


def test_two_written_arguments_and_a_returned_one(float64):
    torch.manual_seed(3)
    a0, b0, w0 = torch.randn(2, 3), torch.randn(2, 3), torch.randn(3)
    compiled_two, compiled_ret = fxtools.compile(_two), fxtools.compile(_returned)
    results = []
    for two, ret in ((_two, _returned), (compiled_two, compiled_ret)):
        xa, xb, w = (t.clone().requires_grad_() for t in (a0, b0, w0))
        a, b = xa * 1, xb * 1
        out = two(a, b, w)
        (out + (a * b).sum()).backward()
        row = [out.detach(), a.detach(), b.detach(), xa.grad, xb.grad, w.grad]
        xy, w = a0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = xy * 1
        o, s = ret(y, w)
        assert o is y  # an output that is the written argument is that argument, as in eager
        ((o**2).sum() + s + y.sum()).backward()
        results.append([*row, y.detach(), xy.grad, w.grad])
    for g, r in zip(*reversed(results), strict=True):
        torch.testing.assert_close(g, r, **TOL)
    assert [w.path for w in compiled_two.split.written] == ["a", "b"]


def _write_one_read_other(a, b, w):
    a.mul_(w)
    return (b * w).sum()


def test_written_argument_sharing_memory_is_refused(float64):
    """The write would have to reach the other argument (AOTAutograd's synthetic bases): refused
    naming the line, for a view of the written argument and for the same tensor twice."""
    torch.manual_seed(4)
    x, w = torch.randn(5, 4), torch.randn(4, requires_grad=True)
    compiled = fxtools.compile(_write_one_read_other)
    a, b = x * 1, x[1:] * 1
    want = _write_one_read_other(a.clone(), b.clone(), w)
    torch.testing.assert_close(compiled(a, b, w), want, **TOL)
    for other in (lambda t: t[1:], lambda t: t):
        base = x.clone()
        with pytest.raises(fxtools.FxtoolsError, match=r"test_write_back.py:\d+: a.mul_\(w\) writes `a`.*`b`.*shares its memory"):
            compiled(base, other(base), w)
        torch.testing.assert_close(base, x)


def test_split_returns_the_new_value_and_takes_its_cotangent(float64):
    """``fxtools.split``'s documented signature for such a program: the forward leaves the
    argument alone and returns ``((out, (new y,)), saved)``; the backward takes a cotangent for the
    new value after out's, and gives the gradient of both, as autograd does."""
    torch.manual_seed(5)
    y, w = torch.randn(4, 3), torch.randn(3)
    sp = fxtools.split(_scale_columns, y, w)
    (info,) = sp.written
    assert info.path == "y" and "y[:, 1:].mul_(w[1:])" in info.line and "test_write_back.py" in info.line
    assert [c.path for c in sp.cotangents] == ["out[0]", "out[1][0]"] and sp.cotangents[1].name == "grad_y_written"
    assert "writes y in place" in sp.report()
    before = y.clone()
    (out, (new_y,)), saved = sp.forward(y, w)
    torch.testing.assert_close(y, before)  # the forward writes nothing
    ct_out, ct_y = torch.randn(()), torch.randn(4, 3)
    grads = sp.backward(*saved, ct_out, ct_y)
    yy, ww = before.clone().requires_grad_(), w.clone().requires_grad_()
    copy = yy.clone()
    want_out = _scale_columns(copy, ww)
    torch.testing.assert_close(out, want_out.detach(), **TOL)
    torch.testing.assert_close(new_y, copy.detach(), **TOL)
    for g, r in zip(grads, torch.autograd.grad((want_out, copy), (yy, ww), (ct_out, ct_y)), strict=True):
        torch.testing.assert_close(g, r, **TOL)
    sp.vjp(y, w)  # Split.vjp writes the new value, as the program does
    torch.testing.assert_close(y, copy.detach(), **TOL)


def _accumulate(x, buf):
    buf.add_(x.detach())
    with torch.no_grad():
        buf.mul_(0.5)
    return (x * buf).sum()


def test_writes_autograd_does_not_record_stay_in_place(float64):
    """No regression: a write of a detached value or under ``no_grad`` (running statistics) is
    made in place by the graphs, once per call, and the split's signature is unchanged."""
    torch.manual_seed(6)
    x0 = torch.randn(5)
    compiled = fxtools.compile(_accumulate)
    bufs = [torch.zeros(5), torch.zeros(5)]
    for _ in range(2):
        grads = []
        for fn, buf in zip((_accumulate, compiled), bufs):
            x = x0.clone().requires_grad_()
            fn(x, buf).backward()
            grads.append(x.grad)
        torch.testing.assert_close(bufs[1], bufs[0], **TOL)
        torch.testing.assert_close(grads[1], grads[0], **TOL)
    assert not bufs[1].requires_grad and compiled.split.written == []
    sp = fxtools.split(_accumulate, x0, torch.zeros(5), grad_leaves=[True, False])
    out, saved = sp.forward(x0, torch.zeros(5))
    assert isinstance(out, torch.Tensor) and sp.written == []

    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1))
    ref = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1))
    ref.load_state_dict(model.state_dict())
    compiled_model = fxtools.compile(model)
    for step in range(2):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        compiled_model(x).sum().backward()
        ref(x).sum().backward()
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, **TOL, msg=name)
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, **TOL)
    assert compiled_model.split.written == []


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, state):
        state.mul_(torch.sigmoid(self.lin(x)))
        return self.lin(x).pow(2).mean()


def test_module_writing_its_input(float64):
    """A module's forward writing an input with a value of its parameters: their ``.grad`` gets
    the part that flows through the input's later use."""
    torch.manual_seed(8)
    model = _Gate()
    ref = _Gate()
    ref.load_state_dict(model.state_dict())
    compiled = fxtools.compile(model)
    x, s0 = torch.randn(4, 3), torch.randn(4, 3)
    states = []
    for m, fn in ((ref, ref), (model, compiled)):
        state = s0.clone()
        (fn(x, state) + (state**2).sum()).backward()
        states.append(state.detach())
    torch.testing.assert_close(states[1], states[0], **TOL)
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, **TOL)


def _scale(y, w):
    y.mul_(w)
    return w.sum()


def _scale_and_unsqueeze(y, w):
    y.mul_(w).unsqueeze_(0)
    return w.sum()


def test_strided_argument_and_a_change_of_shape(float64):
    """A written argument with gaps between its elements (``b[:, ::2]``) keeps its layout; a write
    changing the argument's shape is refused naming the line (a gap: eager runs it)."""

    def run(fn):
        base = torch.randn(4, 6, generator=torch.Generator().manual_seed(9)).requires_grad_()
        b = base * 1
        w = torch.randn(3, generator=torch.Generator().manual_seed(10)).requires_grad_()
        out = fn(b[:, ::2], w)
        (out + (b**2).sum()).backward()
        return b.detach(), base.grad, w.grad

    for got, want in zip(run(fxtools.compile(_scale)), run(_scale), strict=True):
        torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(fxtools.FxtoolsError, match=r"test_write_back.py:\d+: y.mul_\(w\).unsqueeze_\(0\) changes the shape"):
        fxtools.compile(_scale_and_unsqueeze)(torch.randn(3), torch.randn(3, requires_grad=True))
