"""Held-out programs a demanding PyTorch user writes (batch c), against ``torch.func`` in float64.

Each program is differentiated in its first argument through ``fxtools.vjp``, ``jvp`` and
``split`` at two sizes and a non-contiguous layout; the ones that found a defect also through the
transform that showed it. The whole batch (27 programs) was run once through grad, vjp, jvp,
hvp, vmap, jacrev, split and compile at three sizes and two layouts; the programs kept here
found something or are cheap.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fxtools

pytestmark = pytest.mark.usefixtures("float64")

TOL = dict(rtol=1e-9, atol=1e-9, equal_nan=True)


def _r(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _floats(o):
    return [t for t in pytree.tree_leaves(o) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _close(got, want):
    got, want = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        if b.is_floating_point():
            torch.testing.assert_close(a, b, **TOL)
        else:
            assert torch.equal(a, b)


def _noncontiguous(t):
    return torch.stack([t, t], -1)[..., 0] if isinstance(t, torch.Tensor) and t.dim() else t


def _check(f, *args, transforms=("vjp", "jvp", "split")):
    """``f`` differentiated in ``args[0]`` by each transform, against torch.func."""
    x, rest = args[0], args[1:]
    out, pullback = torch.func.vjp(lambda x: f(x, *rest), x)
    ct = pytree.tree_map(lambda t: _r(*t.shape, seed=1) if isinstance(t, torch.Tensor) and t.is_floating_point() else None, out)
    v = _r(*x.shape, seed=2)
    if "vjp" in transforms:
        got_out, got = fxtools.vjp(f, *args, argnums=0)(*args, ct)
        _close(got_out, out)
        _close(got, pullback(ct)[0])
    if "jvp" in transforms:
        _close(fxtools.jvp(f, *args, argnums=0)(*args, v), torch.func.jvp(lambda x: f(x, *rest), (x,), (v,)))
    if "jvp_by_reverse" in transforms:  # J @ v from reverse mode, where PyTorch's forward AD is wrong
        jac = torch.autograd.functional.jacobian(lambda x: f(x, *rest), x)  # one backward per row
        want = pytree.tree_map(lambda j: (j * v).flatten(j.dim() - v.dim()).sum(-1), jac)
        _close(fxtools.jvp(f, *args, argnums=0)(*args, v), (out, want))
    if "split" in transforms:
        sp = fxtools.split(f, *args)
        got_out, saved = sp.forward(*sp.flatten(*args))
        _close(got_out, out)
        _close(sp.backward(*saved, *sp.flatten_cotangent(ct))[0], pullback(ct)[0])
    if "hvp" in transforms:

        def loss(x, *rest):
            return sum((t.sin() * c).sum() for t, c in zip(_floats(f(x, *rest)), _floats(ct)))

        _, second = torch.func.vjp(lambda x: torch.func.grad(loss)(x, *rest), x)
        _close(fxtools.hvp(loss, *args, argnums=0)(*args, v), second(v)[0])
    if "compile" in transforms:
        compiled = fxtools.compile(f, *args)
        xr = x.detach().clone().requires_grad_()
        got_out = compiled(xr, *rest)
        _close(got_out, out)
        sum((a * c).sum() for a, c in zip(_floats(got_out), _floats(ct))).backward()
        _close(xr.grad, pullback(ct)[0])


# --- out= arguments: an out= op writing an intermediate was refused (a false refusal) ----------


def out_into_buffer(x):
    buf = torch.empty(x.shape[1], dtype=x.dtype)
    torch.sum(x.detach(), 0, out=buf)
    order = torch.empty(x.shape, dtype=torch.int64)
    torch.argsort(x.detach(), dim=1, stable=True, out=order)
    return x * buf + x.gather(1, order) * order


def out_into_empty(x):
    buf = torch.empty(0, dtype=x.dtype)  # eager resizes an empty out= tensor to the result
    torch.cumsum(x.detach(), 0, out=buf)
    return x * buf


def out_into_view(x):
    buf = torch.zeros(2, x.shape[1], dtype=x.dtype)
    torch.mul(x.detach()[0], 3.0, out=buf[1])
    return x * buf.sum(0)


def out_under_no_grad(x):
    buf = torch.empty_like(x)
    with torch.no_grad():
        torch.mul(x, x, out=buf)  # eager refuses out= only when an input carries a gradient
    return x * buf


@pytest.mark.parametrize("f", [out_into_buffer, out_into_empty, out_into_view, out_under_no_grad], ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(3, 4), (5, 2)])
def test_out_arguments(f, shape):
    # torch.func.jvp refuses out= under no_grad (forward AD ignores no_grad): no oracle there
    _check(f, _r(*shape), transforms=("vjp", "split", "hvp") + (("jvp",) if f is not out_under_no_grad else ()))


def test_out_argument_on_noncontiguous_input_and_compiled():
    _check(out_into_buffer, _noncontiguous(_r(3, 4)), transforms=("vjp", "compile"))


def test_out_resizing_a_non_empty_tensor_is_refused_naming_the_line():
    def f(x):
        buf = torch.zeros(2, dtype=x.dtype)
        torch.cumsum(x.detach(), 0, out=buf)  # eager warns and resizes
        return x * buf

    with pytest.raises(fxtools.FxtoolsError, match=r"test_heldout_c.py.*out= resizes"):
        fxtools.vjp(f, _r(3))


# --- scatter_reduce amin/amax ties with an excluded self: autograd's two modes disagree ----------


def test_scatter_reduce_tie_with_excluded_self_follows_forward_mode():
    """At a tie between scattered values and an excluded ``self`` (``include_self=False``) equal
    to the result, autograd's backward counts that self among the tied values (its gradient sums
    to 2/3 of the output's), ``torch.func.jvp`` does not. fxtools' one rule table (the JVP is the
    VJP transposed) follows forward mode, whose tied values share the whole gradient: its
    reverse Jacobian is torch.func.jacfwd's (docs/security.md, known gaps)."""
    idx = torch.tensor([[0, 1], [0, 1], [1, 1]])
    x = torch.tensor([[1.0, 0.0], [1.0, 2.0], [3.0, 0.0]])

    def f(x):
        return torch.zeros(3, 2).scatter_reduce(0, idx, x, "amin", include_self=False)

    forward = torch.func.jacfwd(f)(x)
    torch.testing.assert_close(fxtools.jacrev(f, x)(x), forward, rtol=0, atol=0)
    assert forward[1, 1].sum() == 1  # the two tied zeros share the whole derivative
    assert torch.func.jacrev(f)(x)[1, 1].sum() == pytest.approx(2 / 3)  # autograd: a third to self
    v = _r(3, 2)
    torch.testing.assert_close(fxtools.jvp(f, x)(x, v)[1], torch.func.jvp(f, (x,), (v,))[1], **TOL)


# --- the held-out batch: exact under every transform when it was run; kept as cheap checks ------


def inplace_on_views(x):
    y = x * 2.0 + 1.0
    y.narrow(1, 0, 2).mul_(x[:, :2])
    y.diagonal().add_(1.0)
    y[0].clamp_(max=2.0)
    return y


def where_with_scalars(x):
    a = torch.where(x > 0, x, 0.5)
    b = torch.where(x < 0.3, 2.0, x * x)
    return a * b + torch.where(x.abs() > 1, x, torch.tensor(0.0))


def ints_and_bools(x, idx, mask):
    y = x * (idx % 3) + mask
    z = (x > 0).float().double() * x + idx.float().double() / 7
    return y * z + x * torch.arange(x.shape[1])


def half_precision_operands(x, h, b):
    y = x + h  # float64 + float16 is float64
    z = x.to(torch.bfloat16).to(torch.float64) * x
    w = (x.half() * h).double()
    return y * b + z + w


def no_grad_and_enable_grad_inside(x):
    with torch.no_grad():
        s = x.norm(dim=1, keepdim=True)
        m = x.mean()
    y = x / s
    with torch.enable_grad():
        y = y * x.sum()
    return y - m


def item_as_a_scale(x):
    s = x.abs().max().item()
    return x / s + x[: x.shape[0] // 2].sum() * float(x.shape[1])


def loop_over_rows(x):
    acc = torch.zeros_like(x[0])
    for i in range(x.shape[0]):
        acc = acc * 0.5 + x[i] * (i + 1)
    return acc


def fully_masked_softmax(x, mask):
    s = x.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)  # a row with no True is NaN, as in eager
    q = torch.log_softmax(s.masked_fill(~mask.any(-1, keepdim=True), 0.0), -1)
    return p, q.nan_to_num(neginf=-30.0)


def scatter_reduce_duplicates(x, idx):
    a = torch.full((3, x.shape[1]), -9.0).scatter_reduce(0, idx, x, "amax", include_self=False)
    b = torch.ones(3, x.shape[1]).scatter_reduce(0, idx, x, "prod")
    c = torch.zeros(3, x.shape[1]).scatter_reduce(0, idx, x, "mean")
    return a, b, c, x.gather(0, idx.flip(0))


def accumulate_duplicates(x, i, j):
    y = torch.zeros(4, 4)
    y.index_put_((i, j), x, accumulate=True)
    return y * y, x.new_zeros(4).index_add(0, i, x * 2)


def unfold_then_fold(x):
    u = F.unfold(x, kernel_size=(2, 3), padding=1, stride=(1, 2))
    return F.fold(u * u, output_size=x.shape[-2:], kernel_size=(2, 3), padding=1, stride=(1, 2))


def _ties(n):
    x = _r(n, 4).round()
    x[1] = x[0]
    return x


def _scatter_args(n):
    x, idx = _ties(n), torch.randint(0, 2, (n, 4), generator=torch.Generator().manual_seed(0))
    idx[1] = idx[0]
    return x, idx


def _mask(n):
    mask = torch.rand(n, 4, generator=torch.Generator().manual_seed(0)) > 0.4
    mask[0] = False
    return mask


HELD_OUT = {
    "inplace_on_views": (inplace_on_views, lambda n: (_r(n, n),)),
    "where_with_scalars": (where_with_scalars, lambda n: (_r(n, 3),)),
    "ints_and_bools": (ints_and_bools, lambda n: (_r(n, 5), torch.arange(5 * n).view(n, 5) % 9, _r(n, 5, seed=1) > 0)),
    "half_precision_operands": (half_precision_operands, lambda n: (_r(n, 4), _r(n, 4, seed=1).half(), _r(4, seed=2).bfloat16())),
    "no_grad_and_enable_grad_inside": (no_grad_and_enable_grad_inside, lambda n: (_r(n, 3),)),
    "item_as_a_scale": (item_as_a_scale, lambda n: (_r(n, 3),)),
    "loop_over_rows": (loop_over_rows, lambda n: (_r(n, 3),)),
    "fully_masked_softmax": (fully_masked_softmax, lambda n: (_r(n, 4), _mask(n))),
    "scatter_reduce_duplicates": (scatter_reduce_duplicates, _scatter_args),
    "accumulate_duplicates": (accumulate_duplicates, lambda n: (_r(n + 2), torch.arange(n + 2) % 3, torch.arange(n + 2) % 2)),
    "unfold_then_fold": (unfold_then_fold, lambda n: (_r(1, 2, n, n + 2),)),
}


# PyTorch's forward AD of scatter_reduce(..., "prod") gives a zero tangent (torch.func.jvp), or
# none (torch.autograd.forward_ad): its JVP is checked against reverse mode's Jacobian instead
REVERSE_ORACLE = {"scatter_reduce_duplicates"}


@pytest.mark.parametrize("name", list(HELD_OUT))
def test_held_out_program(name):
    """At one size through vjp and jvp, and called with a non-contiguous layout."""
    f, make = HELD_OUT[name]
    _check(f, *make(3), transforms=("vjp", "jvp_by_reverse" if name in REVERSE_ORACLE else "jvp"))
    _check(f, *(_noncontiguous(a) for a in make(4)), transforms=("vjp",))


# --- second derivatives of prod at zeros: NaN (one zero) and 0 (two zeros) were silently wrong ---


@pytest.mark.parametrize("f", [lambda x: x.prod().sin(), lambda x: x.view(1, -1).prod(1).sin().sum()], ids=["prod", "prod_dim"])
@pytest.mark.parametrize(
    "x", [[0.0, 2.0, 3.0], [0.0, 0.0, 3.0], [0.0, 2.0, 0.0, -1.5]], ids=["one_zero", "two_zeros", "two_zeros_4"]
)
def test_hvp_of_prod_at_zeros(f, x):
    x = torch.tensor(x)
    v = torch.arange(1.0, x.numel() + 1) / 7
    _, second = torch.func.vjp(torch.func.grad(f), x)  # matches finite differences of the gradient
    torch.testing.assert_close(fxtools.hvp(f, x)(x, v), second(v)[0], **TOL)


# --- cumprod at zeros: its gradient's own derivative was 0 past the first zero (hvp off by 2.0) ---


def _zeros_at(positions):
    x = _r(3, 5, seed=3)
    x[:, positions] = 0
    if positions:
        x[0, 1] = 0  # one row with a zero more
    return x


@pytest.mark.parametrize("dim", [0, -1])
def test_cumprod_derivatives_at_zeros(dim):
    """hvp of cumprod against torch.func (whose second derivative matches finite differences,
    below), and at the last dim also its grad and jvp and prod's hvp: each module built once,
    called at zeros in one, two and three places (the first, the last, neighbours) and none."""
    w = _r(3, 5, seed=5)

    def f(x):
        return (torch.cumprod(x, dim) * w).sum()

    def g(x):
        return (torch.prod(x, dim) * w.sum(dim)).sum()

    def c(x):
        return torch.cumprod(x, dim)

    x0, v = _r(3, 5, seed=3), _r(3, 5, seed=4)
    hvp_f = fxtools.hvp(f, x0)
    for positions in ([], [0], [4], [0, 3], [1, 2], [0, 1, 4]):
        x = _zeros_at(positions)
        torch.testing.assert_close(hvp_f(x, v), torch.func.jvp(torch.func.grad(f), (x,), (v,))[1], **TOL)
    if dim == 0:
        return
    hvp_g, grad_f, jvp_c = fxtools.hvp(g, x0), fxtools.grad(f, x0), fxtools.jvp(c, x0)
    for positions in ([], [0], [4], [0, 3], [1, 2], [0, 1, 4]):
        x = _zeros_at(positions)
        torch.testing.assert_close(hvp_g(x, v), torch.func.jvp(torch.func.grad(g), (x,), (v,))[1], **TOL)
        torch.testing.assert_close(grad_f(x), torch.func.grad(f)(x), **TOL)
        _close(jvp_c(x, v), torch.func.jvp(c, (x,), (v,)))


def test_cumprod_hvp_at_a_zero_matches_finite_differences():
    def f(x):
        return torch.cumprod(x, 0).sum()

    x, v, eps = torch.tensor([0.0, 2.0, 3.0]), torch.tensor([1.0, -0.5, 2.0]), 1e-6
    grad = torch.func.grad(f)  # polynomial in x: central differences of the gradient are exact to ~1e-9
    fd = (grad(x + eps * v) - grad(x - eps * v)) / (2 * eps)
    got = fxtools.hvp(f, x)(x, v)
    torch.testing.assert_close(got, fd, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, torch.tensor([2.0, 4.0, 2.0]), **TOL)


# --- norms at an all-zero row: jvp gave NaN where torch.func.jvp (PyTorch's masked formula) gives 0 ---


NORMS_AT_ZERO = {
    **{f"vector_norm_{o}": (lambda o: lambda x: torch.linalg.vector_norm(x, o, dim=1))(o) for o in (1, 2, float("inf"), 3, 0.5)},
    "norm": lambda x: torch.norm(x, dim=1),
    "norm_p3": lambda x: torch.norm(x, p=3, dim=1),
    "normalize": lambda x: F.normalize(x, dim=1),
    "normalize_p3": lambda x: F.normalize(x, p=3, dim=1),
    "norm_all": lambda x: torch.linalg.vector_norm(x[1]),
    "std": lambda x: x.std(1),
}


@pytest.mark.parametrize("name", list(NORMS_AT_ZERO))
def test_norm_jvp_and_hvp_at_a_zero_row(name):
    f = NORMS_AT_ZERO[name]
    x, v = _r(3, 4, seed=6), _r(3, 4, seed=7)
    x[1] = 1.5 if name == "std" else 0  # std: a constant row
    _close(fxtools.jvp(f, x)(x, v), torch.func.jvp(f, (x,), (v,)))

    def loss(x):
        return (f(x) ** 2 + f(x).sin()).sum()

    torch.testing.assert_close(fxtools.hvp(loss, x)(x, v), torch.func.jvp(torch.func.grad(loss), (x,), (v,))[1], **TOL)


@pytest.mark.parametrize("p", [2.0, 3.0, 0.5, 1.5])
def test_cdist_jvp_at_a_zero_distance(p):
    """PyTorch has no forward AD for cdist: J @ v from reverse mode's Jacobian."""
    x, y = _r(3, 4, seed=8), _r(2, 4, seed=9)
    y[0] = x[1]
    _check(lambda x, y: torch.cdist(x, y, p=p), x, y, transforms=("jvp_by_reverse",))


# --- repeat_interleave by a tensor: jvp raised GuardOnDataDependentSymNode, jacrev "an unknown line" ---


def _repeat(x, repeats):
    return torch.repeat_interleave(x, repeats, dim=0).sin()


def test_repeat_interleave_by_a_tensor_jvp_vjp_hvp_at_other_repeats():
    x, v = _r(3, 2, seed=11), _r(3, 2, seed=12)
    built = fxtools.jvp(_repeat, x, torch.tensor([1, 0, 2]), argnums=0)
    back = fxtools.vjp(_repeat, x, torch.tensor([1, 0, 2]), argnums=0)
    hvp = fxtools.hvp(lambda x, r: _repeat(x, r).pow(2).sum(), x, torch.tensor([1, 0, 2]), argnums=0)
    for repeats in ([1, 0, 2], [3, 1, 0], [0, 0, 0]):  # output sizes 3, 4, 0
        r = torch.tensor(repeats)
        _close(built(x, r, v), torch.func.jvp(lambda x: _repeat(x, r), (x,), (v,)))
        out, pullback = torch.func.vjp(lambda x: _repeat(x, r), x)
        ct = _r(*out.shape, seed=13)
        _close(back(x, r, ct), (out, pullback(ct)[0]))
        want = torch.func.jvp(torch.func.grad(lambda x: _repeat(x, r).pow(2).sum()), (x,), (v,))[1]
        torch.testing.assert_close(hvp(x, r, v), want, **TOL)


def test_jacrev_of_a_data_dependent_output_size_names_the_line():
    x = _r(3, 2, seed=14)
    with pytest.raises(
        fxtools.errors.DataDependentError, match=r"repeat_interleave at .*test_heldout_c.py:\d+: return torch.repeat_interleave"
    ):
        fxtools.jacrev(_repeat, x, torch.tensor([1, 0, 2]))
    jac = fxtools.jacfwd(_repeat, x, torch.tensor([1, 0, 2]))(x, torch.tensor([1, 0, 2]))
    torch.testing.assert_close(jac, torch.func.jacfwd(_repeat)(x, torch.tensor([1, 0, 2])), **TOL)


@pytest.mark.parametrize(
    "f",
    [lambda x: x.index_select(0, torch.tensor([0, 2, 2])).sin().pow(2).sum(), lambda x: x[x > 0].sin().pow(2).sum()],
    ids=["index_select", "mask"],
)
def test_hessian_through_a_scatter_into_zeros(f):
    """The gradient's ``zeros.index_add_`` / ``index_put_`` (printed in place) batched by hessian:
    vmap refused writing batched rows into the unbatched zeros."""
    x = _r(3, 2, seed=15)
    torch.testing.assert_close(fxtools.hessian(f, x)(x), torch.func.hessian(f)(x), **TOL)
