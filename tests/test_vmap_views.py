"""``.view`` calls whose input's layout decides whether they run, under every transform.

A batched value is laid out as suits the batch, not as eager lays out one sample: with ``A`` and
``u`` unbatched, ``u.unsqueeze(1) * (A @ x)`` is transposed per sample under vmap (``A @ x`` is
computed as ``A @ xs.T``) and contiguous in eager, so ``torch.func.vmap`` refuses a ``.view`` of it
that a loop over the samples (vmap's meaning) runs. ``fxtools.vmap`` computes such a view as
``reshape``, and refuses, naming the user's line, a view that one sample's layout refuses as
eager does. The non-batched transforms refuse at build time what eager's ``.view`` refuses.
Oracles: ``torch.func`` in float64, or a loop over samples where ``torch.func.vmap`` itself raises
the view error (``fuzz_programs.vmap_oracle``).
"""

import fuzz_programs
import pytest
import torch
import torch.fx as fx

import fxtools
from fxtools.capture.trace import check_views
from fxtools.graph.nodes import view_strides

pytestmark = pytest.mark.usefixtures("float64")

TOL = dict(rtol=1e-9, atol=1e-9)


def loop(fn, xs, in_dim=0):
    return torch.stack([fn(xs.select(in_dim, b)) for b in range(xs.shape[in_dim])])


def transposed_per_sample(n, k):
    """``f(x)`` whose ``.view`` torch.func.vmap refuses and eager runs on each sample."""
    gen = torch.Generator().manual_seed(n * 10 + k)
    A, u = torch.randn(n, k, generator=gen), torch.randn(k + 1, generator=gen)

    def f(x):
        y = u.unsqueeze(1) * (A @ x)
        return y.view(-1).sin() * 2

    return f


@pytest.mark.parametrize("n,k,batch", [(4, 3, 5), (2, 5, 2), (3, 2, 1)])
def test_vmap_view_refused_by_the_batched_layout_runs_as_a_loop(n, k, batch):
    f = transposed_per_sample(n, k)
    xs = torch.randn(batch, k)
    if batch > 1:
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            torch.func.vmap(f)(xs)
    gm = fxtools.vmap(f, xs)
    torch.testing.assert_close(gm(xs), loop(f, xs), **TOL)
    torch.testing.assert_close(gm(xs), fuzz_programs.vmap_oracle(f, 0, xs), **TOL)
    if batch > 1:
        assert ".reshape(" in gm.code and "clone" not in gm.code, gm.code


@pytest.mark.parametrize("n,k", [(4, 3), (2, 5)])
def test_per_sample_grads_through_such_a_view(n, k):
    f = transposed_per_sample(n, k)

    def loss(w, x):
        return (f(x) * w).sum()

    w, xs = torch.randn(n * (k + 1)), torch.randn(6, k)
    g = fxtools.grad(loss, w, xs[0], argnums=(0, 1))
    got = fxtools.vmap(g, w, xs, in_dims=(None, 0))(w, xs)
    want = [torch.stack(c) for c in zip(*(torch.func.grad(loss, argnums=(0, 1))(w, x) for x in xs))]
    torch.testing.assert_close(list(got), want, **TOL)
    # vmap of the per-sample function, then its gradient: the reshape is differentiated as reshape
    gm = fxtools.vmap(f, xs)
    torch.testing.assert_close(
        fxtools.grad(lambda x: gm(x).sum(), xs)(xs), torch.func.grad(lambda x: loop(f, x).sum())(xs), **TOL
    )


def test_vmap_refuses_a_view_one_sample_refuses_naming_the_line():
    def f(x):
        return x.t().view(-1) * 2  # one sample (3, 4): its transpose cannot be viewed flat

    with pytest.raises(fxtools.FxtoolsError, match=r"test_vmap_views.py:\d+: return x.t\(\).view\(-1\)"):
        fxtools.vmap(f, torch.randn(5, 3, 4))

    def h(x):
        return x.view(-1).sin()

    xs = torch.randn(3, 5, 4)  # samples along dim 1: each (3, 4) with strides (20, 1)
    with pytest.raises(RuntimeError, match="view size"):
        h(xs[:, 0])
    with pytest.raises(fxtools.FxtoolsError, match=r"return x.view\(-1\).sin\(\) refuses one sample's layout"):
        fxtools.vmap(h, xs, in_dims=1)
    torch.testing.assert_close(fxtools.vmap(h, xs, in_dims=2)(xs), loop(h, xs, 2), **TOL)  # (3, 5) strides (20, 4): viewable


def test_per_sample_grads_refuse_a_view_one_sample_refuses():
    def loss(x):
        return x.view(-1).sin().sum()

    xs = torch.randn(3, 5, 4)
    g = fxtools.grad(loss, xs[:, 0].contiguous())
    with pytest.raises(fxtools.FxtoolsError, match=r"return x.view\(-1\).sin\(\).sum\(\) refuses one sample's layout"):
        fxtools.vmap(g, xs, in_dims=1)
    samples = xs.transpose(0, 1).contiguous()
    torch.testing.assert_close(fxtools.vmap(g, samples)(samples), torch.func.vmap(torch.func.grad(loss))(samples), **TOL)


def test_vmap_refuses_writes_through_a_view_computed_as_a_copy():
    f = transposed_per_sample(4, 3)
    A, u = f.__closure__[0].cell_contents, f.__closure__[1].cell_contents

    def g(x):
        y = u.unsqueeze(1) * (A @ x)
        z = y.view(-1)
        z.add_(1)  # eager: y changes too
        return y

    xs = torch.randn(5, 3)
    with pytest.raises(fxtools.FxtoolsError, match=r"z.add_\(1\).*z = y.view\(-1\)"):
        fxtools.vmap(g, xs)

    def before(x):
        y = u.unsqueeze(1) * (A @ x)
        y.mul_(2)  # before the view: nothing is shared yet
        return y.view(-1)

    torch.testing.assert_close(fxtools.vmap(before, xs)(xs), loop(before, xs), **TOL)


LAYOUTS = {
    "transpose": (lambda x: x.transpose(0, 1).view(-1).sin(), lambda s: (s[0], s[1])),
    "permute": (lambda x: x.permute(2, 0, 1).view(x.shape[2], -1).cos(), lambda s: (s[0], s[1], s[2])),
    "expand": (lambda x: x.unsqueeze(0).expand(2, *x.shape).reshape(2, -1).view(-1).tanh(), lambda s: (s[0], s[1])),
    "contiguous": (lambda x: x.mT.contiguous().view(-1).exp(), lambda s: (s[0], s[1])),
    "split_dim": (lambda x: x.transpose(0, 1).view(x.shape[1], x.shape[0], 1).sum(-1), lambda s: (s[0], s[1])),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("sizes", [(1, 4, 2), (3, 1, 1), (3, 4, 2)])
def test_views_after_layout_changes_under_every_transform(name, sizes):
    """What eager runs runs (size-1 dimensions let a transpose be viewed), exact against torch.func;
    what eager refuses is refused at build time, naming the line, by every transform."""
    fn, shape_of = LAYOUTS[name]
    x = torch.randn(shape_of(sizes))
    try:
        out = fn(x)
    except RuntimeError as exc:
        assert "view size" in str(exc)
        for transform in (fxtools.vjp, fxtools.jvp, fxtools.split):
            with pytest.raises(fxtools.FxtoolsError, match=r"test_vmap_views.py:\d+:.*\.view"):
                transform(fn, x)
        with pytest.raises(fxtools.FxtoolsError, match=r"one sample's layout"):
            fxtools.vmap(fn, torch.stack([x, x]))
        return
    ct, t = torch.randn(out.shape), torch.randn(x.shape)
    got_out, (got_grad,) = fxtools.vjp(fn, x)(x, ct)
    torch.testing.assert_close(got_out, out, **TOL)
    torch.testing.assert_close(got_grad, torch.func.vjp(fn, x)[1](ct)[0], **TOL)
    torch.testing.assert_close(fxtools.jvp(fn, x)(x, t)[1], torch.func.jvp(fn, (x,), (t,))[1], **TOL)
    sp = fxtools.split(fn, x)
    _, saved = sp.forward(*sp.flatten(x))
    torch.testing.assert_close(sp.backward(*saved, ct)[0], got_grad, **TOL)
    xs = torch.randn(3, *x.shape)
    torch.testing.assert_close(fxtools.vmap(fn, xs)(xs), fuzz_programs.vmap_oracle(fn, 0, xs), **TOL)

    def loss(x):
        return (fn(x) ** 2).sum()

    g = fxtools.grad(loss, x)
    torch.testing.assert_close(fxtools.vmap(g, xs)(xs), fuzz_programs.vmap_oracle(torch.func.grad(loss), 0, xs), **TOL)


def test_view_strides_is_the_view_kernel():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        nd = int(torch.randint(1, 4, (), generator=gen))
        shape = [int(s) for s in torch.randint(1, 4, (nd,), generator=gen)]
        x = torch.empty(shape).permute(*torch.randperm(nd, generator=gen).tolist())
        if bool(torch.rand((), generator=gen) < 0.3):
            x = x[..., ::2]
        for new in ([-1], [x.numel(), 1], [1, -1], list(x.shape)[::-1]):
            try:
                want = list(x.view(new).stride())
            except RuntimeError:
                want = None
            assert view_strides(x.shape, x.stride(), new) == want, (x.shape, x.stride(), new)


def test_check_views_refuses_a_graph_view_the_kernel_refuses():
    """A rewrite of a traced graph that made such a view is refused, naming the line, not run."""
    gm = fx.symbolic_trace(lambda x: x)
    graph = gm.graph
    x = next(n for n in graph.nodes if n.op == "placeholder")
    x.meta["val"] = torch.empty(4, 3).t()
    with graph.inserting_after(x):
        v = graph.call_function(torch.ops.aten.view.default, (x, [12]))
    v.meta["stack_trace"] = '  File "/home/u/model.py", line 7, in f\n    y = x.view(12)\n'
    with pytest.raises(fxtools.FxtoolsError, match=r"model.py:7: y = x.view\(12\)"):
        check_views(gm)
    x.meta["val"] = torch.empty(3, 4)
    check_views(gm)
