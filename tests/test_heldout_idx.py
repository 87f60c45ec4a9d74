"""Held-out programs: indexing with 0-dim integer tensors, and writes through views and their bases.

Eager PyTorch reads a 0-dim integer tensor used as an index as a Python int (``x[t]`` is
``x.select(0, t.item())``, a view). Before these fixes fxtools refused such programs (a
data-dependent value), computed ``narrow`` with a tensor start as a copy that missed later writes
into its base (a silent wrong answer), and wrapped negative indices in the index VJP with ``%``
(an out-of-range index silently wrapped). The oracle is eager PyTorch (torch.func) in float64,
at the example's index and at other indices, negative and out of range.
"""

import pytest
import torch
from torch.export import Dim

import fxtools

D = torch.float64


def r(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=D)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


T = torch.tensor

# --- reading x[...] with 0-dim tensors: each program, its gradient at the example's index and others


READS = {
    "x[t]": lambda x, t: x[t],
    "x[:, t]": lambda x, t: x[:, t],
    "x[..., t]": lambda x, t: x[..., t],
    "x[t, 1:]": lambda x, t: x[t, 1:],
    "x[None, t]": lambda x, t: x[None, t],
    "x[t, :, t]": lambda x, t: x[t, :, t],
    # eager selects at t first, then indexes with the vector: (3, 5) from (3, 5, 4)[idx, :, t]
    "x[idx, :, t]": lambda x, t: x[T([2, 0, 2])][:, :, t] + x[T([2, 0, 2]), :, t],
    "x[:, idx, t] (adjacent)": lambda x, t: x[:, T([1, 1]), t],
    "x[t][t]": lambda x, t: x[t][t],
    "select(x, 2, t)": lambda x, t: torch.select(x, 2, t) + x.select(-1, t),
    "x[int32 t]": lambda x, t: x[t.int()] * x[:, t.to(torch.int16)].sum(),
}


@pytest.mark.parametrize("name", list(READS))
def test_reading_with_a_0dim_tensor_index_is_exact_at_every_index(name):
    read = READS[name]
    x, w = r(3, 5, 4), r(3, 5, 4, seed=1)

    def f(x, t):
        y = read(x, t)
        return (y.sin() * y).sum()

    gm = fxtools.grad(f, x, T(1))
    for t in (1, 0, 2, -1, -3):
        close(gm(x, T(t)), torch.func.grad(f)(x, T(t)))
    close(gm(w, T(-2)), torch.func.grad(f)(w, T(-2)))


@pytest.mark.parametrize("t", [3, -4, 7])
def test_an_out_of_range_index_raises_as_in_eager(t):
    x = r(3, 4)

    def f(x, t):
        return x[t].sum() + x[:, t].sum()  # the gradient reads only t, not x[t]

    gm = fxtools.grad(f, x, T(0))
    with pytest.raises(IndexError):
        torch.func.grad(f)(x, T(t))
    with pytest.raises((IndexError, RuntimeError)):
        gm(x, T(t))


@pytest.mark.parametrize("i", [[4], [-5], [1, 7], [-9, 0]])
def test_the_index_gradient_refuses_out_of_range_indices_as_eager_does(i):
    """The VJP of ``x[:, i]`` made negative indices non-negative with ``% size``, which silently
    wrapped an out-of-range index (4 -> 0) when only the gradient was computed."""
    x = r(3, 4)

    def f(x, i):
        return (x[:, i] * 2).sum()

    gm = fxtools.grad(f, x, T([1, -1]))
    close(gm(x, T([3, -4])), torch.func.grad(f)(x, T([3, -4])))
    i = i * 2 if len(i) == 1 else i
    with pytest.raises(IndexError):
        torch.func.grad(f)(x, T(i))
    with pytest.raises((IndexError, RuntimeError)):
        gm(x, T(i))


def test_x_of_t_prints_as_a_subscript():
    gm = fxtools.grad(lambda x, t: (x[:, t] ** 2).sum() + (x[t] * x[t - 1]).sum(), r(3, 4), T(1))
    assert "x[:, t]" in gm.code and "x[t]" in gm.code, gm.code
    assert "aten" not in gm.code and "%" not in gm.code, gm.code


# --- writing y[...] = v with 0-dim tensors


def _assign(kind):
    def f(x, v, t):
        y = x * 1
        if kind == "y[t] = v":
            y[t] = v
        elif kind == "y[:, t] = 2.5":
            y[:, t] = 2.5
        elif kind == "y[t, 1:] = v":
            y[t, 1:] = v[1:]
        elif kind == "y[t] = y[0]":
            y[t] = y[0]
        elif kind == "y[t] += v":
            y[t] += v
        elif kind == "y[t] = v[None]":
            y[t] = v[None]
        elif kind == "y[..., t] = v[:3]":
            y[..., t] = v[:3]
        elif kind == "y[t][1] = v[0]":
            y[t][1] = v[0]
        elif kind == "y[t].mul_(v)":
            y[t].mul_(v)
        return (y.sin() * x).sum()

    return f


ASSIGNS = [
    "y[t] = v",
    "y[:, t] = 2.5",
    "y[t, 1:] = v",
    "y[t] = y[0]",
    "y[t] += v",
    "y[t] = v[None]",
    "y[..., t] = v[:3]",
    "y[t][1] = v[0]",
    "y[t].mul_(v)",
]


@pytest.mark.parametrize("kind", ASSIGNS)
def test_assigning_with_a_0dim_tensor_index_is_exact_at_every_index(kind):
    f = _assign(kind)
    x, v = r(3, 4), r(4, seed=1)
    gm = fxtools.grad(f, x, v, T(1), argnums=(0, 1))
    for t in (1, 0, 2, -1, -3):
        got = gm(x, v, T(t))
        want = torch.func.grad(f, argnums=(0, 1))(x, v, T(t))
        close(got[0], want[0])
        close(got[1], want[1])


def test_assigning_into_an_argument_mutates_it_as_eager_does():
    def f(w, buf, t):
        buf[t] = buf[0] * 2
        buf[:, t] += 1
        return (buf * w).sum()

    w, buf = r(4), r(4, 4, seed=1)
    gm = fxtools.grad(f, w, buf.clone(), T(1))
    for t in (1, 3, -2):
        mine, theirs = buf.clone(), buf.clone()
        close(gm(w, mine, T(t)), torch.func.grad(f)(w, theirs, T(t)))
        close(mine, theirs)


# --- the copy that stands for eager's view, and writes into it or into its base


def _views(kind):
    def f(x, t):
        y = x * 1
        if kind == "narrow, then write base":
            v = y.narrow(0, t, 2)
            y.mul_(3)
        elif kind == "x[t], then write base":
            v = y[t]
            y[1:].add_(x[:-1])
        elif kind == "x[t], write into it":
            v = y[t]
            v.mul_(y[0].clone())
            v = y
        elif kind == "narrow, write a view of it":
            v = y.narrow(1, t, 2)
            v[0].mul_(3)
            v = y * v.sum()
        elif kind == "two copies of one base":
            v1, v2 = y[t], y[:, t]
            v1.mul_(2)
            v = v2 * y[0, 0]
        elif kind == "copy of a copy":
            v1 = y[t]
            v2 = v1.narrow(0, t, 2)
            v2.add_(1)
            v = y * v1.sum()
        elif kind == "copy of a copy, then write base":
            v2 = y[t].narrow(0, t, 2)
            y.mul_(3)
            v = v2
        elif kind == "base is a view":
            z = y[1:]
            v = z[t]
            y.mul_(2)
            v = v * z.sum()
        elif kind == "write, then read the copy again":
            v = y[:, t]
            y.add_(1)
            v.mul_(2)
            y.sub_(1)
            v = v + y.sum()
        return (v.sin() * v).sum()

    return f


VIEWS = [
    "narrow, then write base",
    "x[t], then write base",
    "x[t], write into it",
    "narrow, write a view of it",
    "two copies of one base",
    "copy of a copy",
    "copy of a copy, then write base",
    "base is a view",
    "write, then read the copy again",
]


@pytest.mark.parametrize("kind", VIEWS)
def test_writes_through_a_copy_standing_for_a_view_are_seen_as_in_eager(kind):
    f = _views(kind)
    x = r(4, 4)
    gm = fxtools.grad(f, x, T(1))
    for t in (1, 0, 2, -2):
        close(gm(x, T(t)), torch.func.grad(f)(x, T(t)))


def test_vjp_jvp_and_split_of_an_indexed_write():
    def f(x, t):
        y = x.sin()
        v = y[:, t]
        y[t] = v * 2
        return y[t - 1] * v

    x, t = r(4, 4), T(2)
    vjp = fxtools.vjp(f, x, t)
    jvp = fxtools.jvp(f, x, t)
    sp = fxtools.split(f, x, t)
    for s in (2, 0, -1):
        ct, tan = r(4, seed=s + 5), r(4, 4, seed=s + 9)
        out, vjp_fn = torch.func.vjp(lambda x: f(x, T(s)), x)
        got_out, (got_g, _) = vjp(x, T(s), ct)
        close(got_out, out)
        close(got_g, vjp_fn(ct)[0])
        want = torch.func.jvp(lambda x: f(x, T(s)), (x,), (tan,))
        got = jvp(x, T(s), tan, None)
        close(got[0], want[0])
        close(got[1], want[1])
        fw, saved = sp.forward(x, T(s))
        close(fw, out)
        close(sp.backward(*saved, ct)[0], vjp_fn(ct)[0])


def test_vmap_of_indexing_with_a_fixed_and_a_batched_index():
    def f(x, t):
        return x[t] * x[:, t].sum()

    xs, ts = r(5, 3, 3), T([0, 2, -1, 1, -3])
    fixed = fxtools.vmap(f, xs, T(1), in_dims=(0, None))
    for t in (1, -1, 2):
        close(fixed(xs, T(t)), torch.func.vmap(f, in_dims=(0, None))(xs, T(t)))
    batched = fxtools.vmap(f, xs, ts)
    close(batched(xs, ts), torch.func.vmap(f)(xs, ts))
    close(batched(xs, ts.flip(0)), torch.func.vmap(f)(xs, ts.flip(0)))


def test_grad_of_indexing_at_another_size():
    def f(x, t):
        y = x * 1
        y[t] = y[t - 1] * 2
        return (y[:, t].sin() * y.narrow(0, t, 2).sum()).sum()

    n = Dim("n", min=3, max=64)
    gm = fxtools.grad(f, r(5, 5), T(1), dynamic_shapes=({0: n, 1: n}, None))
    for size, t in ((5, 1), (8, 6), (3, -2), (6, 0)):
        x = r(size, size, seed=size)
        close(gm(x, T(t)), torch.func.grad(f)(x, T(t)))


def test_writes_into_x_of_t_under_vmap_follow_eager():
    """With ``t`` not batched eager's ``y[t]`` is a view (the write reaches ``y``); with ``t``
    batched vmap indexes with it as with any tensor, a copy (the write does not)."""

    def f(x, t):
        y = x * 1
        v = y[t]
        v.mul_(2)
        return y * v.sum()

    xs, ts = r(3, 4, 4), T([0, 2, -1])
    fixed = fxtools.vmap(f, xs, T(1), in_dims=(0, None))
    batched = fxtools.vmap(f, xs, ts)
    for t in (1, -2):
        close(fixed(xs, T(t)), torch.func.vmap(f, in_dims=(0, None))(xs, T(t)))
    close(batched(xs, ts), torch.func.vmap(f)(xs, ts))
    close(batched(xs, ts.flip(0)), torch.func.vmap(f)(xs, ts.flip(0)))


def test_narrow_with_a_batched_start_then_a_write_is_refused_not_wrong():
    def f(x, t):
        y = x * 1
        v = y.narrow(0, t, 2)
        y.mul_(3)
        return v * 1

    xs, ts = r(3, 4, 4), T([0, 2, 1])
    with pytest.raises(RuntimeError, match="Batching rule not implemented"):
        torch.func.vmap(f)(xs, ts)  # eager cannot either
    with pytest.raises(fxtools.FxtoolsError, match="narrow with a tensor start"):
        fxtools.vmap(f, xs, ts)


# --- a differentiated value written into an argument through a view, then read: the gradient
# through the read was silently dropped (the read goes through the argument's placeholder)


@pytest.mark.parametrize("index", ["0", "t"])
def test_a_differentiated_write_into_an_argument_then_read_is_refused_not_wrong(index):
    def f(w, buf, t):
        buf[0 if index == "0" else t] = w * 2
        return (buf * w).sum()

    w, buf = r(4), r(5, 4, seed=1)
    with pytest.raises(fxtools.FxtoolsError, match=r"test_heldout_idx.py:\d+: buf\[0 if index"):
        fxtools.grad(f, w, buf, T(1))

    def g(w, buf, t):  # the caller sees the write, and the gradient is exact:
        if index == "0":  # read again only through .detach(), which takes no gradient
            buf[0] = w * 3
            return (w * buf.detach()).sum()
        buf[t] = w * 2  # never read again
        return (w * 3).sum()

    gm = fxtools.grad(g, w, buf.clone(), T(1))
    mine, theirs = buf.clone(), buf.clone()
    close(gm(w, mine, T(2)), torch.func.grad(g)(w, theirs, T(2)))
    close(mine, theirs)


def test_a_buffer_written_at_a_tensor_position_as_eager_writes_it():
    """A cache updated at a position given as a tensor (``cache[pos] = k``), read at another."""

    class Cache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(6, 3, dtype=D))

        def forward(self, x, pos):
            self.cache[pos] = x.detach() * 2
            row = self.cache[pos - 1]
            self.cache[:, 0] += 1
            return (self.cache * x).sum() + (row * x).sum()

    mine, theirs, x = Cache(), Cache(), r(3)
    gm = fxtools.grad(lambda x, pos: mine(x, pos), x, T(2))
    for pos in (2, 4, -1, 0):
        xr = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(theirs(xr, T(pos)), xr)
        close(gm(x, T(pos)), want)
        close(mine.cache, theirs.cache)


def test_hessian_of_indexing_at_other_indices():
    def f(x, t):
        return (x[t] ** 3).sum() * x[:, t].sin().sum()

    x = r(4, 4)
    h = fxtools.hessian(f, x, T(1))
    for t in (1, -1, 3):
        close(h(x, T(t)), torch.func.hessian(f)(x, T(t)))


def test_the_aten_graphs_a_compiler_gets_keep_the_index_a_tensor():
    """The printed code says ``x[:, t]``; the graph keeps ``aten.index``, which a compiler's ATen
    form (traced on FakeTensors) can run where ``x[:, t]`` would read ``t`` as a number."""

    def f(x, t):
        y = x * 1
        y[t] = y[t - 1] * 2
        return (y[:, t] * x[t]).sum()

    graphs = []
    compiled = fxtools.compile(f, r(4, 4), T(1), compiler=lambda gm, example: graphs.append(gm) or gm)
    assert graphs and all("aten.index" in g.code for g in graphs)
    for t in (1, -1, 2):
        mine, theirs = r(4, 4).requires_grad_(), r(4, 4).requires_grad_()
        compiled(mine, T(t)).backward()
        f(theirs, T(t)).backward()
        close(mine.grad, theirs.grad)
