"""Held-out programs (batch t): ``torch.compile(backend=fxtools.backend())`` graphs that write an
input in place with a differentiable value.

Dynamo breaks a graph at a data-dependent read (``y[y < 0]``), so a tensor the program made and
then modifies arrives as an input of the graph that modifies it. Each such program "was" refused
(``InplaceError``), or, when no output of the graph read the written value, gave a silently wrong
gradient. The oracle is eager PyTorch in float64.
"""

from __future__ import annotations

import pytest
import torch

import fxtools

TOL = dict(rtol=1e-10, atol=1e-12)


def _leaky(x, w):
    y = x.clone()
    y[y < 0] = 0.1 * y[y < 0] * w
    return (y * w).sum()


def _view_then_leaky(x, w):  # graph 2 writes a view of its input, graph 3 the input itself
    y = x.clone()
    torch._dynamo.graph_break()
    y[:, 1:].mul_(w[1:])
    y[y < 0] = 0.1 * y[y < 0] * w[0]
    return (y * w).sum()


def _grads(fn, x, w):
    x, w = (t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w))
    out = fn(x, w)
    wrt = [t for t in (x, w) if t.requires_grad]
    return out.detach(), torch.autograd.grad(out, wrt)


@pytest.mark.parametrize(
    "program,shape", [(_leaky, (7,)), (_leaky, (5, 3)), (_view_then_leaky, (6, 4)), (_view_then_leaky, (3, 4))]
)
@pytest.mark.parametrize("x_grad", [True, False])
def test_graph_writing_its_input_matches_eager(float64, program, shape, x_grad):
    """was: InplaceError (the graph writes ``y``, its input); with a mutated input requiring grad
    or not, and a write through a view of the input (``y[:, 1:].mul_(w[1:])``, whose graph returns
    only ``y < 0``: its gradient was silently lost)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(shape).requires_grad_(x_grad)
    w = torch.randn(shape[-1] if program is _view_then_leaky else ()).requires_grad_()
    graphs = []

    def spy(gm, example_inputs):
        graphs.append(gm)
        return fxtools.backend()(gm, example_inputs)

    want = _grads(program, x, w)
    got = _grads(torch.compile(program, backend=spy), x, w)
    assert len(graphs) >= 2  # the graph break happened: an input of a later graph is written
    torch.testing.assert_close(got[0], want[0], **TOL)
    for g, r in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, r, **TOL)


def _scale(y, w):
    y.mul_(w)
    return (y * w).sum()


def test_written_input_seen_by_autograd_as_in_eager(float64):
    """The caller's tensor holds the new value and autograd sees the write (a later use of it
    differentiates through it); a view of a larger tensor writes into that tensor; a leaf that
    requires grad is refused as eager refuses it."""
    torch.manual_seed(1)
    x, w = torch.randn(5, 4), torch.randn(4)
    compiled = torch.compile(_scale, backend=fxtools.backend())
    results = []
    for fn in (_scale, compiled):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        base = xx * 2
        y = base[1:]  # the input is a view
        out = fn(y, ww)
        (out + (base**2).sum()).backward()
        results.append((out.detach(), base.detach(), xx.grad, ww.grad, y._version > 0))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, **TOL) if isinstance(want, torch.Tensor) else assert_same(got, want)
    # a leaf not requiring grad: written, and made to require grad, as in eager
    outs = []
    for fn in (_scale, compiled):
        leaf, ww = x.clone(), w.clone().requires_grad_()
        out = fn(leaf, ww)
        (out + leaf.sum()).backward()
        outs.append((out.detach(), leaf.detach(), ww.grad, leaf.requires_grad))
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, **TOL) if isinstance(want, torch.Tensor) else assert_same(got, want)
    with pytest.raises(Exception, match="leaf Variable that requires grad"):
        compiled(x.clone().requires_grad_(), w.clone().requires_grad_())


def assert_same(a, b):
    assert a == b


def _write_one_read_other(a, b, w):
    a.mul_(w)
    return (b * w).sum()


def test_written_input_sharing_memory_with_another_is_refused(float64):
    """Two inputs of one graph sharing memory, one written with a differentiable value: the write
    would have to reach the other (AOTAutograd's synthetic bases). Refused naming the line, both at
    compile time and when a graph made for separate inputs is called with overlapping ones."""
    torch._dynamo.reset()
    x, w = torch.randn(5, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    compiled = torch.compile(_write_one_read_other, backend=fxtools.backend())
    torch.testing.assert_close(compiled(x * 1, x[1:] * 1, w), _write_one_read_other(x * 1, x[1:] * 1, w), **TOL)
    base = x * 1
    with pytest.raises(fxtools.FxtoolsError, match=r"test_heldout_t.py:\d+: a.mul_\(w\) writes `a`.*`b`.*shares its memory"):
        compiled(base, base[1:], w)
    torch._dynamo.reset()
    base = x * 1
    with pytest.raises(Exception, match=r"a.mul_\(w\) writes `a`.*`b`.*shares its memory"):
        torch.compile(_write_one_read_other, backend=fxtools.backend())(base, base[1:], w)


def _spectral_energy(x):
    s = torch.stft(x, n_fft=8, hop_length=2, window=torch.hann_window(8), return_complex=True)
    return s.abs().sum()


def test_stft_in_another_layout_names_as_strided(float64):
    """``torch.stft`` frames its input with ``as_strided`` on the input's strides: a module made
    for a contiguous example refuses a transposed input saying so (it said ``.view``), and runs
    the contiguous one exactly."""
    torch.manual_seed(2)
    x = torch.randn(3, 40)
    g = fxtools.grad(_spectral_energy, x)
    torch.testing.assert_close(g(x), torch.func.grad(_spectral_energy)(x), **TOL)
    with pytest.raises(fxtools.FxtoolsError, match=r"uses as_strided on x's strides") as e:
        g(torch.randn(40, 3).t())
    assert ".view" not in str(e.value)
