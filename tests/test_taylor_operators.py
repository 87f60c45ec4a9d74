"""Taylor-mode operators beyond the Laplacian (float64, against torch.func): the divergence of a
vector field (exact and Hutchinson), the bi-Laplacian, randomized weighted Laplacians, sigma of any
layout, and gradients of losses built on them with respect to parameters."""

from __future__ import annotations

import math

import pytest
import torch
from taylor_oracle import F64, close, rademacher, randn, trace_of_hessian

import fxtools

pytestmark = pytest.mark.usefixtures("float64")


W1, W2 = randn(4, 6, seed=1) / 2, randn(6, 4, seed=2) / 2


def field(x):
    """A vector field R^4 -> R^4 (a CNF's dynamics, a score)."""
    return torch.tanh(x @ W1) @ W2 * x.sin() + x.exp().sum()


def field_2d(x):
    return torch.sigmoid(x.reshape(4) @ W1 @ W2).reshape(2, 2) * x


def u(x):
    return torch.tanh(torch.tanh(x.reshape(-1) @ W1) @ W2).sum() * x.cos().sum()


@pytest.mark.parametrize("f, shape", [(field, (4,)), (field_2d, (2, 2))])
def test_divergence_is_the_trace_of_the_jacobian(f, shape):
    gm = fxtools.divergence(f, randn(*shape, seed=3))
    for seed in (4, 5):
        x = randn(*shape, seed=seed)
        out, div = gm(x)
        close(out, f(x))
        close(div, torch.func.jacrev(f)(x).reshape(x.numel(), x.numel()).trace())
    assert "out_div" in gm.code or "div" in gm.code


def test_hutchinson_divergence_is_seeded_and_unbiased():
    x = randn(4, seed=6)
    gm = fxtools.divergence(field, x, samples=3)
    torch.manual_seed(7)
    _, est = gm(x)
    torch.manual_seed(7)  # the same draws, made as the generated code makes them
    v = rademacher((3, 4))
    J = torch.func.jacrev(field)(x)
    close(est, torch.einsum("si,ij,sj->", v, J, v) / 3)
    torch.manual_seed(0)
    many = fxtools.divergence(field, x, samples=4000, distribution="normal")(x)[1]
    assert (many - J.trace()).abs() < 0.1 * J.abs().sum()


def test_divergence_refuses_other_than_a_vector_field():
    with pytest.raises(ValueError, match="vector field"):
        fxtools.divergence(lambda x: x.sum(), randn(4))


def test_bilaplacian_matches_fourth_derivatives():
    x = randn(4, seed=8)
    gm = fxtools.bilaplacian(u, x)
    for seed in (9, 10):
        x = randn(4, seed=seed)
        out, bilap = gm(x)
        close(out, u(x))
        close(bilap, torch.einsum("iijj->", torch.func.hessian(torch.func.hessian(u))(x)))


def test_randomized_weighted_laplacian():
    """``sigma`` with ``samples``: directions ``sigma @ v_s``, an unbiased estimate of ``tr(sigma^T H sigma)``."""
    x, sigma = randn(4, seed=11), randn(4, 3, seed=12)
    gm = fxtools.laplacian(u, x, sigma=sigma, samples=5)
    torch.manual_seed(13)
    _, est = gm(x, sigma)
    torch.manual_seed(13)
    dirs = rademacher((5, 3)) @ sigma.T
    H = torch.func.hessian(u)(x)
    close(est, torch.einsum("si,ij,sj->", dirs, H, dirs) / 5)


def test_sigma_of_any_layout():
    x = randn(2, 2, seed=14)
    H = torch.func.hessian(u)(x).reshape(4, 4)
    V = randn(5, 4, seed=15)
    for built in (V.T.contiguous(), V.T):
        gm = fxtools.laplacian(u, x, sigma=built)
        for sigma in (V.T, V.T.contiguous(), randn(4, 10, seed=16)[:, ::2], randn(4, 1, seed=17).expand(4, 5)):
            close(gm(x, sigma)[1], (sigma.T @ H @ sigma).trace())


def test_gradients_with_respect_to_parameters():
    """fxtools.grad of losses built on each operator, against torch.func in float64."""
    params = {"w1": W1.clone(), "w2": W2.clone()}
    x = randn(4, seed=18)

    def v(p, x):
        return torch.tanh(x @ p["w1"]) @ p["w2"] * x.sin()

    def s(p, x):
        return torch.tanh(torch.tanh(x @ p["w1"]) @ p["w2"]).sum()

    div = fxtools.divergence(v, params, x, argnums=1)
    bilap = fxtools.bilaplacian(s, params, x, argnums=1)

    def loss(p, x):
        return div(p, x)[1] ** 2 + bilap(p, x)[1] + (div(p, x)[0] ** 2).sum()

    def loss_ref(p, x):
        d = torch.func.jacrev(v, argnums=1)(p, x).trace()
        b = torch.einsum("iijj->", torch.func.hessian(torch.func.hessian(s, argnums=1), argnums=1)(p, x))
        return d**2 + b + (v(p, x) ** 2).sum()

    close(loss(params, x), loss_ref(params, x))
    got, want = fxtools.grad(loss, params, x)(params, x), torch.func.grad(loss_ref)(params, x)
    for k in params:
        close(got[k], want[k])


def along_curve(f, primals, series):
    """``d^k/dt^k f(x(t))`` at 0 for every primal moved along ``x + sum_k series[k-1] t^k / k!``
    (``series[k]`` a tuple with one term per primal), by nested torch.func.jvp."""

    def curve(t):
        return f(*(x + sum(s[i] * t**k / math.factorial(k) for k, s in enumerate(series, 1)) for i, x in enumerate(primals)))

    g, out = curve, []
    for _ in series:
        g = (lambda g: lambda t: torch.func.jvp(g, (t,), (torch.ones((), dtype=F64),))[1])(g)
        out.append(g(torch.zeros((), dtype=F64)))
    return out


def two(x, y):
    return (x.sin() * y.sum()).exp() + x @ W1[:3, :3] * y[0]


def test_jet_of_several_arguments_pytrees_and_order_zero():
    x, y = randn(3, seed=20), randn(2, seed=21)
    series = tuple((randn(2, seed=22 + k), randn(3, seed=32 + k)) for k in range(3))
    gm = fxtools.jet(two, x, y, order=3, argnums=(1, 0))  # each term: (y's, x's), as argnums
    out, got = gm(x, y, series)
    close(out, two(x, y))
    want = along_curve(two, (x, y), [(s[1], s[0]) for s in series])
    for k in range(3):
        close(got[k], want[k])
    params = {"a": x, "b": y}
    tree = fxtools.jet(lambda p: two(p["a"], p["b"]), params, order=2)
    _, got = tree(params, tuple({"a": s[1], "b": s[0]} for s in series[:2]))
    for k in range(2):
        close(got[k], want[k] if k == 0 else along_curve(two, (x, y), [(s[1], s[0]) for s in series[:2]])[k])
    zero = fxtools.jet(two, x, y, order=0)
    out, got = zero(x, y, ())
    close(out, two(x, y))
    assert got == ()


@pytest.mark.slow  # Inductor compiles C++: about a minute on 2 cores
def test_inductor_compiles_a_loss_on_the_divergence_and_bilaplacian():
    """Rows of matrices: fxtools.compile's ATen lowering refuses a vector-matrix product (``x @ W``
    with a 1-d ``x``: matmul's decomposition keeps an in-place ``squeeze_``), on main too."""
    params, x = {"w1": W1.clone(), "w2": W2.clone()}, randn(1, 4, seed=40)

    def v(p, x):
        return torch.tanh(x @ p["w1"]) @ p["w2"]

    div = fxtools.divergence(v, params, x, argnums=1)
    bilap = fxtools.bilaplacian(lambda p, x: v(p, x).sum(), params, x, argnums=1)

    def loss(p, x):
        return div(p, x)[1] ** 2 + bilap(p, x)[1]

    def loss_ref(p, x):
        b = torch.func.hessian(torch.func.hessian(lambda p, x: v(p, x).sum(), argnums=1), argnums=1)(p, x)
        j = torch.func.jacrev(v, argnums=1)(p, x).reshape(4, 4)
        return j.trace() ** 2 + torch.einsum("iijj->", b.reshape(4, 4, 4, 4))

    compiled = fxtools.compile(loss, params, x, compiler="inductor")
    leaves = {k: t.clone().requires_grad_(True) for k, t in params.items()}
    value = compiled(leaves, x)
    value.backward()
    close(value.detach(), loss_ref(params, x))
    want = torch.func.grad(loss_ref)(params, x)
    for k in params:
        close(leaves[k].grad, want[k])


def test_randomized_bilaplacian_is_seeded_and_unbiased():
    x = randn(3, seed=41)

    def w(x):
        return (x.sin() * x.sum()).sum() + (x * x).sum() ** 2

    exact = torch.einsum("iijj->", torch.func.hessian(torch.func.hessian(w))(x))
    gm = fxtools.bilaplacian(w, x, samples=2, distribution="normal")
    torch.manual_seed(42)
    first = gm(x)[1]
    torch.manual_seed(42)
    close(gm(x)[1], first)  # the draws come from PyTorch's generator
    torch.manual_seed(0)
    many = fxtools.bilaplacian(w, x, samples=3000)(x)[1]
    assert (many - exact).abs() < 0.05 * exact.abs() + 0.5, (many, exact)


def per_row_laplacian(f, X):
    return torch.func.vmap(lambda x: torch.func.hessian(lambda x: f(x[None])[0])(x).reshape(x.numel(), x.numel()).trace())(X)


def batch_mlp(X):
    h = torch.tanh(X @ W1 + 0.1)
    return (torch.tanh(h @ W2) * X.sin()).sum(-1) + torch.softmax(h, dim=1)[:, 0]


@pytest.mark.parametrize("shape", [(5, 4), (3, 2, 2)])
def test_batch_without_vmap_uses_one_rows_directions(shape):
    """Rows that depend on their own input row only: the directions of one row, pushed through all rows."""

    def f(X):
        return batch_mlp(X.reshape(X.shape[0], 4))

    X = randn(*shape, seed=50)
    gm = fxtools.laplacian(f, X)
    assert "torch.eye(4," in gm.code and f"torch.eye({X.numel()}," not in gm.code, gm.code
    for seed in (51, 52):
        X = randn(*shape, seed=seed)
        out, lap = gm(X)
        close(out, f(X))
        close(lap, per_row_laplacian(f, X))


def test_batch_without_vmap_is_the_vmapped_per_point_module_or_one_rows_directions():
    """The network on one row is the same program: fxtools.vmap of its per-point module. A program
    whose constants depend on the batch size (``X.shape[0]``) is not: one row's directions in all rows."""

    def scaled(X):
        return torch.tanh(X @ W1 * X.shape[0]).sum(1)

    X = randn(5, 4, seed=54)
    same, other = fxtools.laplacian(batch_mlp, X), fxtools.laplacian(scaled, X)
    assert "expand(" not in same.code and "expand([4, 5" in other.code, (same.code, other.code)
    for f, gm in ((batch_mlp, same), (scaled, other)):
        out, lap = gm(X)
        close(out, f(X))
        H = torch.func.hessian(f)(X).reshape(5, 20, 20)
        close(lap, H.diagonal(0, -2, -1).sum(-1))
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).to(F64)
    out, lap = fxtools.laplacian(net, X)(X)  # a module with two outputs per row
    close(out, net(X))
    close(lap, torch.stack([trace_of_hessian(lambda x: net(x[None])[0], x) for x in X]))


MIXING = {  # rows that see other rows: the exact route over every coordinate of every point
    "centered": lambda X: torch.tanh((X - X.mean(0)) @ W1).sum(1),
    "softmax_over_batch": lambda X: torch.softmax(X @ W1, dim=0).sum(1),
    "gram": lambda X: (X @ X.T).sum(1),
    "shifted": lambda X: torch.tanh(X.roll(1, 0) @ W1).sum(1) * X[:, 0],
    "transposed": lambda X: torch.tanh(X.T.reshape(5, 4) @ W1).sum(1),
}


@pytest.mark.parametrize("name", list(MIXING))
def test_rows_that_mix_take_the_exact_route(name):
    f = MIXING[name]
    X = randn(5, 4, seed=53)
    gm = fxtools.laplacian(f, X)
    assert "torch.eye(20," in gm.code
    out, lap = gm(X)
    H = torch.func.hessian(f)(X).reshape(5, 20, 20)
    close(lap, H.diagonal(0, -2, -1).sum(-1))


@pytest.mark.parametrize("order", [1, 3, 4])  # 2: the Laplacian, below
def test_collapsed_jet_sums_the_highest_term_over_the_curves(order):
    """Each curve's lower terms, and the sum over the curves of their highest one: ``R`` standard jets
    (nested torch.func.jvp), the summed highest series term split among the curves (it enters linearly)."""
    R = 3
    x, y = randn(3, seed=40), randn(2, seed=41)
    lower = [(randn(R, 3, seed=42 + k), randn(R, 2, seed=52 + k)) for k in range(order - 1)]
    top = (randn(3, seed=62), randn(2, seed=63))
    gm = fxtools.jet(two, x, y, order=order, argnums=(0, 1), directions=R)
    out, got = gm(x, y, (*lower, top))
    close(out, two(x, y))
    per_curve = [along_curve(two, (x, y), [(s[0][r], s[1][r]) for s in lower] + [(top[0] / R, top[1] / R)]) for r in range(R)]
    for k in range(order - 1):
        close(got[k], torch.stack([p[k] for p in per_curve]))
    close(got[order - 1], sum(p[order - 1] for p in per_curve))


def test_collapsed_jet_of_order_two_along_the_basis_is_the_laplacian():
    x = randn(4, seed=43)
    gm = fxtools.jet(u, x, order=2, directions=4)
    out, (d1, d2) = gm(x, (torch.eye(4, dtype=F64), torch.zeros(4, dtype=F64)))
    close(d2, torch.func.hessian(u)(x).trace())
    close(d1, torch.func.jacrev(u)(x))
    with pytest.raises(ValueError, match="directions must be a positive int"):
        fxtools.jet(u, x, order=2, directions=0)


def test_laplacian_of_a_pytree_output_keeps_its_containers():
    """Per-row Laplacians of an output holding a list inside a namedtuple inside an OrderedDict
    (refused before: the batched trace returned fx's immutable list, which code cannot spell);
    each leaf's against torch.func's Hessian trace, row by row."""
    import collections

    from torch.utils import _pytree as pytree

    Pair = collections.namedtuple("Pair", "a b")

    def f(x):
        return collections.OrderedDict(s=x.sin().sum(-1), l=[Pair(x.cos().sum(-1), {"k": (x.exp() * x).sum(-1)})])

    x = randn(3, 4, seed=6)
    out, lap = fxtools.laplacian(f, x)(x)
    assert str(pytree.tree_structure(lap)) == str(pytree.tree_structure(f(x)))
    close(out, f(x))
    for i, got in enumerate(pytree.tree_leaves(lap)):
        want = torch.stack([trace_of_hessian(lambda r, i=i: pytree.tree_leaves(f(r[None]))[i][0], row) for row in x])
        close(got, want)
