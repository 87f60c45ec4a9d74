"""What a torch.func / JAX user reaches for (issue 15): has_aux, argnums on vjp and jvp, jacrev,
jacfwd, linearize, custom_jvp, vmap's randomness and chunk_size. Oracle: torch.func in float64,
1e-10; every module is also called at another shape, which it must refuse."""

import collections

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fxtools

pytestmark = pytest.mark.usefixtures("float64")

TOL = dict(rtol=1e-10, atol=1e-10)


def close(a, b):
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert len(la) == len(lb) and str(sa) == str(sb), (sa, sb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, **TOL)
        else:
            assert x == y


def refuses_other_shape(gm, *args):
    """A module made for these shapes refuses an argument of another size (never a wrong answer)."""
    with pytest.raises(fxtools.InputMismatch):
        gm(*args)


def bigger(x):
    return torch.randn(x.shape[0] + 1, *x.shape[1:])


# ---------------------------------------------------------------------------------------------
# has_aux


def loss_with_aux(w, x):
    h = torch.tanh(x @ w)
    loss = (h**2).mean()
    return loss, {"h": h, "pred": h.argmax(1)}


@pytest.fixture
def wx():
    torch.manual_seed(0)
    return torch.randn(4, 3), torch.randn(5, 4)  # float64: the fixture runs after float64's


def test_grad_has_aux_as_torch_func(wx):
    W, X = wx
    gm = fxtools.grad(loss_with_aux, W, X, has_aux=True)
    grads, aux = gm(W, X)
    ref_grads, ref_aux = torch.func.grad(loss_with_aux, has_aux=True)(W, X)
    close((grads, aux), (ref_grads, ref_aux))
    refuses_other_shape(gm, W, bigger(X))


def test_value_and_grad_has_aux_is_value_aux_then_grads(wx):
    W, X = wx
    gm = fxtools.value_and_grad(loss_with_aux, W, X, argnums=(0, 1), has_aux=True)
    (value, aux), grads = gm(W, X)
    ref_grads, (ref_value, ref_aux) = torch.func.grad_and_value(loss_with_aux, argnums=(0, 1), has_aux=True)(W, X)
    close(((value, aux), grads), ((ref_value, ref_aux), ref_grads))
    refuses_other_shape(gm, W, bigger(X))


def test_vjp_has_aux_cotangent_mirrors_out_only(wx):
    W, X = wx

    def f(w, x):
        h = torch.tanh(x @ w)
        return h * 2, (h.sum(), 3)  # aux: a tensor (that would carry gradient) and a Python number

    gm = fxtools.vjp(f, W, X, has_aux=True)
    ct = torch.randn(5, 3)
    out, grads, aux = gm(W, X, ct)
    ref_out, vjp_fn, ref_aux = torch.func.vjp(lambda w, x: (f(w, x)[0], f(w, x)[1][0]), W, X, has_aux=True)
    close((out, grads, aux[0]), (ref_out, vjp_fn(ct), ref_aux))
    assert aux[1] == 3
    refuses_other_shape(gm, W, X, torch.randn(5, 4))  # a cotangent of the wrong shape


def test_jvp_has_aux_as_torch_func(wx):
    W, X = wx
    tw = torch.randn(4, 3)
    gm = fxtools.jvp(loss_with_aux, W, X, argnums=0, has_aux=True)
    out, tangent_out, aux = gm(W, X, tw)
    ref = torch.func.jvp(lambda w: loss_with_aux(w, X), (W,), (tw,), has_aux=True)
    close((out, tangent_out, aux), ref)
    refuses_other_shape(gm, W, X, torch.randn(4, 4))


def test_has_aux_needs_a_pair(wx):
    W, X = wx
    with pytest.raises(ValueError, match=r"has_aux=True\) needs f to return a pair"):
        fxtools.grad(lambda x: (x**2).sum(), W, has_aux=True)


def test_grad_without_has_aux_suggests_it(wx):
    W, X = wx
    with pytest.raises(ValueError, match="has_aux=True if f returns"):
        fxtools.grad(loss_with_aux, W, X)


def test_none_cotangent_for_an_extra_output_is_refused_pointing_to_has_aux():
    """The workaround users try (a None cotangent for the auxiliary output) is refused with the fix."""

    def f(x):
        y = torch.sin(x)
        return y.sum(), {"a": y * 2, "n": 3}

    x = torch.randn(3)
    gm = fxtools.vjp(f, x)
    with pytest.raises(fxtools.InputMismatch, match="has_aux=True") as info:
        gm(x, (torch.tensor(1.0), None))
    assert "def forward" not in str(info.value)
    gm = fxtools.vjp(lambda x: (torch.sin(x).sum(), x * 2), x)
    with pytest.raises(fxtools.InputMismatch, match="has_aux=True"):
        gm(x, (torch.tensor(1.0), None))


# ---------------------------------------------------------------------------------------------
# argnums on vjp and jvp


def two_args(x, w, c):
    return torch.tanh(w @ x) * c["s"], x.sum()


@pytest.fixture
def xwc():
    torch.manual_seed(0)
    return torch.randn(3), torch.randn(2, 3), {"s": torch.randn(2), "k": torch.tensor([1, 2])}


@pytest.mark.parametrize("argnums", [1, (1, 0), (0,)])
def test_vjp_argnums(argnums, xwc):
    XV, WV, C = xwc
    gm = fxtools.vjp(two_args, XV, WV, C, argnums=argnums)
    ct = (torch.randn(2), torch.randn(()))
    out, grads = gm(XV, WV, C, ct)
    nums = (argnums,) if isinstance(argnums, int) else argnums
    ref_out, vjp_fn = torch.func.vjp(
        lambda *d: two_args(*[d[nums.index(i)] if i in nums else a for i, a in enumerate((XV, WV, C))]),
        *[(XV, WV, C)[i] for i in nums],
    )
    ref = vjp_fn(ct)
    close((out, grads), (ref_out, ref[0] if isinstance(argnums, int) else ref))
    refuses_other_shape(gm, torch.randn(4), WV, C, ct)


@pytest.mark.parametrize("argnums", [1, (1, 0)])
def test_jvp_argnums_tangents_in_argnums_order(argnums, xwc):
    XV, WV, C = xwc
    gm = fxtools.jvp(two_args, XV, WV, C, argnums=argnums)
    tangents = {0: torch.randn(3), 1: torch.randn(2, 3)}
    nums = (argnums,) if isinstance(argnums, int) else argnums
    out, tangent_out = gm(XV, WV, C, *[tangents[i] for i in nums])
    full = [tangents.get(0, torch.zeros(3)) if 0 in nums else torch.zeros(3), tangents[1]]
    ref = torch.func.jvp(lambda x, w: two_args(x, w, C), (XV, WV), tuple(full))
    close((out, tangent_out), ref)
    refuses_other_shape(gm, XV, WV, C, *[torch.randn(5) for _ in nums])


def test_jvp_argnums_refuses_a_repeated_argument(xwc):
    XV, WV, C = xwc
    with pytest.raises(ValueError, match="twice"):
        fxtools.jvp(two_args, XV, WV, C, argnums=(1, 1))


# ---------------------------------------------------------------------------------------------
# jacrev, jacfwd


class MLP(nn.Module):
    def __init__(self, n_out=3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, n_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def mlp_case(n_out=3):
    torch.manual_seed(0)
    model = MLP(n_out)
    params = {k: v.detach() for k, v in model.named_parameters()}
    return torch.func.functional_call, model, params, torch.randn(2, 4)


@pytest.mark.parametrize("which", ["jacrev", "jacfwd"])
def test_jacobian_of_an_mlp_wrt_params_and_input(which):
    call, model, params, x = mlp_case()

    def f(params, x):
        return call(model, params, (x,))

    ours, theirs = getattr(fxtools, which), getattr(torch.func, which)
    for argnums in (0, 1, (1, 0)):
        gm = ours(f, params, x, argnums=argnums)
        close(gm(params, x), theirs(f, argnums=argnums)(params, x))
    refuses_other_shape(gm, params, bigger(x))


@pytest.mark.parametrize("which", ["jacrev", "jacfwd"])
def test_jacobian_of_two_arguments_with_pytree_output(which):
    def f(x, w):
        return {"a": torch.tanh(w @ x), "b": (x * x).sum()}

    x, w = torch.randn(3), torch.randn(2, 3)
    ours, theirs = getattr(fxtools, which), getattr(torch.func, which)
    for argnums in (0, 1, (0, 1), (1, 0)):
        close(ours(f, x, w, argnums=argnums)(x, w), theirs(f, argnums=argnums)(x, w))
    gm = ours(f, x, w, argnums=(0, 1), chunk_size=2)
    close(gm(x, w), theirs(f, argnums=(0, 1))(x, w))
    refuses_other_shape(gm, torch.randn(4), w)


Pair = collections.namedtuple("Pair", "a b")


@pytest.mark.parametrize("which", ["jacrev", "jacfwd"])
def test_jacobians_and_aux_keep_the_programs_own_containers(which):
    """torch.func's structure exactly: the arguments' containers for each output leaf (an
    OrderedDict, a namedtuple holding a list), and aux as ``f`` returned it. jacrev's were fx's
    immutable dicts and lists (and a list inside a namedtuple could not be written into code)."""

    def f(p, q):
        y = (p["w"] * q.a).sin() + q.b[1]
        out = collections.OrderedDict(y=y, z=[(p["b"] * q.b[0]).cos()])
        return out, collections.OrderedDict(n=Pair(y.sum(), {"k": [y.max()]}))

    p = collections.OrderedDict(w=torch.randn(3), b=torch.randn(3))
    q = Pair(torch.randn(3), [torch.randn(3), torch.randn(3)])
    ours, theirs = getattr(fxtools, which), getattr(torch.func, which)
    for argnums in (0, 1, (1, 0)):
        close(ours(f, p, q, argnums=argnums, has_aux=True)(p, q), theirs(f, argnums=argnums, has_aux=True)(p, q))
        close(ours(lambda p, q: f(p, q)[0], p, q, argnums=argnums)(p, q), theirs(lambda p, q: f(p, q)[0], argnums=argnums)(p, q))


def test_linearize_output_keeps_the_programs_own_containers():
    def f(x):
        return collections.OrderedDict(m=x.sin(), l=[x.exp(), Pair(x.cos(), {"k": x * x})])

    x, t = torch.randn(3), torch.randn(3)
    out, lin = fxtools.linearize(f, x)
    want, want_lin = torch.func.linearize(f, x)
    close(out, want)
    close(lin(t), want_lin(t))


@pytest.mark.parametrize("which", ["jacrev", "jacfwd"])
def test_jacobian_is_batched_code_not_a_loop(which):
    """One basis of all output (input) elements at once: the code does not grow with their number."""
    call, model, params, x = mlp_case(n_out=3)
    _, model12, params12, _ = mlp_case(n_out=12)
    make = getattr(fxtools, which)
    small = make(lambda x: call(model, params, (x,)), x)
    large = make(lambda x: call(model12, params12, (x,)), x)
    assert len(small.code.splitlines()) == len(large.code.splitlines())
    assert "torch.eye(" in small.code
    close(large(x), getattr(torch.func, which)(lambda x: call(model12, params12, (x,)))(x))


def test_jacrev_chunk_size_matches_torch_func():
    def f(x):
        return torch.sin(x).cumsum(0) * x

    x = torch.randn(6)
    gm = fxtools.jacrev(f, x, chunk_size=4)
    close(gm(x), torch.func.jacrev(f, chunk_size=4)(x))
    assert gm.code.count("torch.eye(") == 1


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_jacobian_with_dropout_draws_once_as_torch_func(chunk_size):
    """torch.func.jacrev runs the forward once (one dropout mask for every row); jacfwd needs
    randomness="same" for that. The same numbers after the same seed, the generator left alike."""

    def f(x):
        return F.dropout(torch.tanh(x), 0.5, training=True) * x

    x = torch.randn(5)
    cases = [
        (fxtools.jacrev(f, x, chunk_size=chunk_size), torch.func.jacrev(f, chunk_size=chunk_size)),
        (fxtools.jacfwd(f, x, randomness="same", chunk_size=chunk_size), torch.func.jacfwd(f, randomness="same")),
    ]
    for ours, theirs in cases:
        torch.manual_seed(3)
        got, after = ours(x), torch.rand(2)
        torch.manual_seed(3)
        want, want_after = theirs(x), torch.rand(2)
        close(got, want)
        torch.testing.assert_close(after, want_after, rtol=0, atol=0)
        assert ours.code.count("torch.bernoulli(") == 1


def test_jacobian_refuses_integer_outputs():
    with pytest.raises(ValueError, match="floating-point"):
        fxtools.jacrev(lambda x: (x.sin(), x.argmax()), torch.randn(3))


# ---------------------------------------------------------------------------------------------
# linearize


def test_linearize_as_torch_func():
    def f(x, w):
        return {"a": torch.tanh(w @ x), "b": (torch.sin(x) * x).sum()}

    x, w = torch.randn(3), torch.randn(2, 3)
    out, lin = fxtools.linearize(f, x, w)
    ref_out, ref_lin = torch.func.linearize(f, x, w)
    close(out, ref_out)
    for _ in range(2):
        tx, tw = torch.randn(3), torch.randn(2, 3)
        close(lin(tx, tw), ref_lin(tx, tw))
    # the forward ran once: the linear map's code reads residuals, it computes no tanh or sin
    assert "torch.tanh(" not in lin.code and "torch.sin(" not in lin.code and "self." in lin.code
    refuses_other_shape(lin, torch.randn(4), tw)


# ---------------------------------------------------------------------------------------------
# custom_jvp


@fxtools.custom_jvp
def softplus(x):
    return torch.log1p(torch.exp(x))


@softplus.defjvp
def softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return softplus(x), t * torch.sigmoid(x)


@fxtools.custom_jvp
def ste_round(x, scale):
    """Rounding, with the straight-through derivative (not round's zero derivative)."""
    return torch.round(x * scale) / scale


@ste_round.defjvp
def ste_round_jvp(primals, tangents):
    x, scale = primals
    t, _ = tangents
    return ste_round(x, scale), t


def uses_custom_jvp(x, w):
    return (softplus(x * w) * ste_round(x, 4.0)).sum()


def reference(x, w):
    """The same function with the rules spelled in autograd: ``x + (round(x) - x).detach()``."""
    st = x + (torch.round(x * 4.0) / 4.0 - x).detach()
    return (torch.log1p(torch.exp(x * w)) * st).sum()


def test_custom_jvp_through_grad_uses_the_transposed_rule():
    x, w = torch.randn(5), torch.randn(5)
    gm = fxtools.grad(uses_custom_jvp, x, w, argnums=(0, 1))
    close(gm(x, w), torch.func.grad(reference, argnums=(0, 1))(x, w))
    assert "_set_grad_enabled" not in gm.code and "round" in gm.code
    refuses_other_shape(gm, torch.randn(6), torch.randn(6))


def test_custom_jvp_through_jvp_and_hvp():
    x, w = torch.randn(5), torch.randn(5)
    tx, tw = torch.randn(5), torch.randn(5)
    gm = fxtools.jvp(uses_custom_jvp, x, w)
    close(gm(x, w, tx, tw), torch.func.jvp(reference, (x, w), (tx, tw)))
    h = fxtools.hvp(lambda x: softplus(x).sum(), x)
    s = torch.sigmoid(x)
    torch.testing.assert_close(h(x, tx), tx * s * (1 - s), **TOL)


def test_custom_jvp_eager_and_without_rule():
    x = torch.randn(3)
    torch.testing.assert_close(softplus(x), F.softplus(x), **TOL)

    @fxtools.custom_jvp
    def no_rule(x):
        return x * 2

    with pytest.raises(fxtools.CustomFunctionError, match="defjvp"):
        fxtools.grad(lambda x: no_rule(x).sum(), x)


# ---------------------------------------------------------------------------------------------
# vmap: randomness and chunk_size; per-sample gradients with dropout


def dropout_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(params, x, y):
        return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()

    return loss, params, torch.randn(6, 4), torch.randn(6, 2)


@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_per_sample_grads_with_dropout_draw_as_torch_func(randomness, chunk_size):
    """Each sample's mask as torch.func.vmap draws it: the same numbers after the same seed, and
    the generator left where torch.func leaves it."""
    loss, params, xs, ys = dropout_case()
    g = fxtools.grad(loss, params, xs[0], ys[0])
    per_sample = fxtools.vmap(g, params, xs, ys, in_dims=(None, 0, 0), randomness=randomness, chunk_size=chunk_size)
    ref_fn = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0), randomness=randomness, chunk_size=chunk_size)
    for seed in (1, 2):
        torch.manual_seed(seed)
        ours, after = per_sample(params, xs, ys), torch.rand(3)
        torch.manual_seed(seed)
        ref, ref_after = ref_fn(params, xs, ys), torch.rand(3)
        close(ours, ref)
        torch.testing.assert_close(after, ref_after, rtol=0, atol=0)
    if randomness == "same":
        assert per_sample.code.count("torch.bernoulli(") == 1  # one draw for every sample (and chunk)
    refuses_other_shape(per_sample, params, bigger(xs), bigger(ys))


def test_vmap_chunk_size_matches_torch_func():
    def f(x, w):
        return torch.tanh(x @ w).sum(-1)

    xs, w = torch.randn(7, 3), torch.randn(3, 2)
    gm = fxtools.vmap(f, xs, w, in_dims=(0, None), chunk_size=3)
    close(gm(xs, w), torch.func.vmap(f, in_dims=(0, None), chunk_size=3)(xs, w))
    assert gm.code.count("torch.tanh(") == 3  # ceil(7 / 3) chunks


def test_vmap_random_op_in_error_mode_names_the_flag_not_the_code():
    loss, params, xs, ys = dropout_case()
    g = fxtools.grad(loss, params, xs[0], ys[0])
    with pytest.raises(fxtools.FxtoolsError, match="randomness='different'") as info:
        fxtools.vmap(g, params, xs, ys, in_dims=(None, 0, 0))
    message = str(info.value)
    assert "def forward" not in message and "fxtools.grad module" in message and len(message) < 700


def test_vmap_options_are_checked():
    with pytest.raises(ValueError, match="randomness"):
        fxtools.vmap(torch.sin, torch.randn(3), randomness="sometimes")
    with pytest.raises(ValueError, match="chunk_size"):
        fxtools.vmap(torch.sin, torch.randn(3), chunk_size=0)
