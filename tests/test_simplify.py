"""Simplifications that make generated code read like hand-written code, checked on real outputs."""

import pinn_mlp
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fxtools
from fxtools.graph.nodes import count_compute_nodes
from fxtools.passes.simplify import simplify


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


def _mse(model):
    def loss(params, x, y):
        return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    return loss


def test_grad_does_not_compute_an_unused_loss():
    """``grad`` needs the loss only for the shape of its seed: the folded seed leaves it dead."""
    model = _mlp()
    params = dict(model.named_parameters())
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    gm = fxtools.grad(_mse(model), params, x, y)
    assert "mse_loss" not in gm.code and "ones_like" not in gm.code
    want = torch.autograd.grad(_mse(model)(params, x, y), list(params.values()))
    for got, w in zip(gm(params, x, y).values(), want):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-14)


def test_masked_seed_folds_into_a_number():
    def f(x, mask):
        return (x.sin() * mask).sum() / 3

    x, mask = torch.randn(4, 3, dtype=torch.float64), (torch.rand(4, 3) > 0.5).double()
    gm = fxtools.grad(f, x, mask)
    assert "ones_like" not in gm.code and "full_like" not in gm.code
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(f(xr, mask), xr)
    torch.testing.assert_close(gm(x, mask), want, rtol=0, atol=0)


def test_folding_keeps_float32_results_bit_exact():
    def f(x):
        return (x * x).mean()

    x = torch.randn(7, 3)
    gm = fxtools.grad(f, x)
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(f(xr), xr)
    assert gm(x).dtype == torch.float32
    torch.testing.assert_close(gm(x), want, rtol=1e-6, atol=0)


def test_per_sample_gradients_keep_the_names_of_the_gradient_code():
    model = _mlp()
    params = dict(model.named_parameters())
    xs, ys = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    g = fxtools.grad(_mse(model), params, xs[0], ys[0])
    per_sample = fxtools.vmap(g, params, xs, ys, in_dims=(None, 0, 0))
    code = per_sample.code
    assert "def forward(self, params, x, y)" in code
    for name in ("grad_model_1", "grad_model_0", "grad_params_0_weight", "grad_params_2_weight"):
        assert f"{name} = " in code, name
    want = torch.func.vmap(torch.func.grad(_mse(model)), in_dims=(None, 0, 0))(params, xs, ys)
    got = per_sample(params, xs, ys)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-13)


def test_number_wrapped_by_vmap_becomes_a_number_again():
    """Under vmap, ``t / 2`` is traced as ``t / _to_copy(2)``; the code says ``t / 2``."""

    def f(t):
        return t / 2 + t.cos()

    xs = torch.randn(3, 4, dtype=torch.float64)
    gm = fxtools.vmap(fxtools.grad(lambda t: f(t).sum(), xs[0]), xs)
    assert "_to_copy" not in gm.code and ".to(" not in gm.code
    want = torch.func.vmap(torch.func.grad(lambda t: f(t).sum()))(xs)
    torch.testing.assert_close(gm(xs), want, rtol=0, atol=0)


def test_grad_seeds_from_an_input_and_value_and_grad_keeps_the_loss():
    """``grad``'s seed needs only the loss's shape: it is made from an input, and the loss is not
    computed; ``value_and_grad`` returns the loss, so it is computed once and seeds from itself."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()
    params = dict(model.named_parameters())
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0])

    def loss(params, x, y):
        return F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

    g = fxtools.grad(loss, params, x, y)
    assert "cross_entropy(" not in g.code and "x.new_ones([])" in g.code
    vg = fxtools.value_and_grad(loss, params, x, y)
    assert vg.code.count("cross_entropy(") == 1 and "new_ones" not in vg.code
    want = torch.autograd.grad(loss(params, x, y), list(params.values()))
    value, grads = vg(params, x, y)
    torch.testing.assert_close(value, loss(params, x, y), rtol=0, atol=0)
    for got_g, got_vg, w in zip(g(params, x, y).values(), grads.values(), want):
        torch.testing.assert_close(got_g, w, rtol=0, atol=1e-15)
        torch.testing.assert_close(got_vg, w, rtol=0, atol=1e-15)


def _bits_equal(got, want):
    """Bit for bit where it matters: values, NaN positions and the signs of zeros."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok]), (got, want)
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok])), (got, want)


def _value(f, *args):
    """The forward value of fxtools' generated code for ``f`` (through ``vjp``)."""
    gm = fxtools.vjp(f, *args)
    out, _ = gm(*args, torch.ones_like(f(*args)))
    return gm, out


def test_scalings_are_not_merged_even_by_powers_of_two():
    """``(x * 2) * 0.5`` is not ``x``: at 3e38 in float32 eager overflows to inf (it was merged
    and returned 3e38); ``(x * 0.5) * 2`` loses the last bit of a subnormal ``x``."""
    big = torch.tensor([3e38, -3e38, 1.0])
    gm, out = _value(lambda x: (x * 2) * 0.5, big)
    _bits_equal(out, (big * 2) * 0.5)
    assert torch.isinf(out[:2]).all()
    tiny = torch.tensor([3 * 2.0**-149, 1.0])  # an odd multiple of float32's smallest subnormal
    _, out = _value(lambda x: (x * 0.5) * 2, tiny)
    _bits_equal(out, (tiny * 0.5) * 2)
    assert out[0] != tiny[0]

    x, y = torch.randn(2, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    gm = fxtools.grad(F.mse_loss, x, y)  # 2 * (x - y) * (1 / 2): kept as computed
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(F.mse_loss(xr, y), xr)
    torch.testing.assert_close(gm(x, y), want, rtol=0, atol=0)


def test_adding_zero_keeps_the_sign_of_zero():
    """``x + 0`` is ``+0.0`` at ``x = -0.0``: not simplified to ``x``; ``x - 0`` and ``x + (-0.0)``
    are ``x`` for every ``x`` and are."""
    x = torch.tensor([-0.0, 0.0, float("nan"), -float("inf"), 1.5])
    for f in (
        lambda x: x + torch.zeros_like(x),
        lambda x: torch.zeros_like(x) + x,
        lambda x: x + 0.0,
        lambda x: x - torch.full_like(x, -0.0),
    ):
        gm, out = _value(f, x)
        _bits_equal(out, f(x))
        assert not torch.signbit(out[0])
    for f in (lambda x: x - torch.zeros_like(x), lambda x: x + torch.full_like(x, -0.0), lambda x: x - 0.0):
        gm, out = _value(f, x)
        _bits_equal(out, f(x))
        assert torch.signbit(out[0])
        assert count_compute_nodes(gm) == 0, gm.code
    i = torch.tensor([3, -1])
    gm = fxtools.vjp(lambda x, i: x * (i + torch.zeros_like(i)), x[-2:], i)
    assert "zeros" not in gm.code, gm.code  # integers have one zero


def test_zero_and_negative_zero_fills_are_not_one_subexpression():
    def f(x):
        return x + torch.full_like(x, -0.0), x + torch.full_like(x, 0.0)

    x = torch.tensor([-0.0, 2.0])
    gm = fxtools.vjp(f, x)
    (a, b), _ = gm(x, (torch.ones(2), torch.ones(2)))
    want_a, want_b = f(x)
    _bits_equal(a, want_a)
    _bits_equal(b, want_b)
    assert torch.signbit(a[0]) and not torch.signbit(b[0])


def test_exact_identities_apply_at_nan_inf_and_negative_zero():
    """``x * 1``, ``x / 1``, ``--x``, ``x * -1 -> -x``, transpose of transpose, NaN/inf fills."""
    x = torch.tensor([[-0.0, 0.0, float("nan")], [float("inf"), -float("inf"), -2.5]])
    cases = {
        lambda x: x * torch.ones_like(x): 0,
        lambda x: torch.ones_like(x) * x / torch.ones_like(x): 0,
        lambda x: -(-x): 0,
        lambda x: x * torch.full_like(x, -1.0): 1,
        lambda x: x.t().t(): 0,
        lambda x: x.transpose(0, 1).transpose(1, 0): 0,
        lambda x: x * torch.full_like(x, float("nan")): 1,
        lambda x: x + torch.full_like(x, float("inf")): 1,
        lambda x: x * (torch.full_like(x, -float("inf")) / 2): 1,
    }
    for f, nodes in cases.items():
        gm, out = _value(f, x)
        _bits_equal(out, f(x))
        forward = fxtools.vjp(f, x)
        assert "full_like" not in forward.code and "ones_like" not in forward.code, forward.code
    gm = fxtools.vjp(lambda x: x * torch.full_like(x, float("nan")), x)
    assert "x * nan" in gm.code, gm.code


def test_division_by_a_fill_becomes_a_number_only_with_an_exact_reciprocal():
    """CUDA divides by a number as a multiplication by its rounded reciprocal, by a tensor exactly:
    ``t / full_like(t, 3.)`` stays a tensor division; ``t / full_like(t, 4.)`` is ``t / 4.0``."""
    t = torch.randn(5)
    kept = fxtools.vjp(lambda t: t / torch.full_like(t, 3.0), t)
    assert "full_like" in kept.code or "new_full" in kept.code, kept.code
    folded = fxtools.vjp(lambda t: t / torch.full_like(t, 4.0), t)
    assert "t / 4.0" in folded.code, folded.code
    for gm, d in ((kept, 3.0), (folded, 4.0)):
        out, (g,) = gm(t, torch.ones(5))
        _bits_equal(out, t / torch.full_like(t, d))
    # a fill divided by a number folds when the fill is 1 (1 * (1 / n) is 1 / n), not when it is 3
    assert "ones_like" not in fxtools.vjp(lambda t: t * (torch.ones_like(t) / 7), t).code
    assert "/ 7" in fxtools.vjp(lambda t: t * (torch.full_like(t, 3.0) / 7), t).code


def test_factories_take_their_device_from_an_input():
    def f(idx, table):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return (table[idx] + table[pos]).sum()

    idx, table = torch.tensor([[1, 2, 0]]), torch.randn(4, 2, dtype=torch.float64)
    gm = fxtools.grad(f, idx, table, argnums=1)
    assert "idx_device = idx.device" in gm.code and "device(type=" not in gm.code
    tr = table.clone().requires_grad_()
    (want,) = torch.autograd.grad(f(idx, tr), tr)
    torch.testing.assert_close(gm(idx, table), want, rtol=0, atol=0)


def test_tensor_indexing_reads_as_subscripts():
    x = torch.randn(4, 5, dtype=torch.float64)
    i, j = torch.tensor([0, 2]), torch.tensor([1, 3])
    gm = fxtools.vjp(lambda x: x[i, j] * 2, x)
    assert "x[i, j]" in gm.code and "aten.index" not in gm.code
    out, (grad_x,) = gm(x, torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(out, x[i, j] * 2, rtol=0, atol=0)
    want = torch.zeros_like(x)
    want[i, j] = 2
    torch.testing.assert_close(grad_x, want, rtol=0, atol=0)


def test_an_integer_times_a_float64_scalar_tensor_stays_float64():
    """``i * scalar_tensor(2., float64)`` is float64; ``i * 2.0`` would be the default dtype
    (float32 rounds 2**25 + 1)."""

    def f(x, i):
        return x * (i * torch.scalar_tensor(2.0, dtype=torch.float64))

    x, i = torch.ones(2, dtype=torch.float64), torch.tensor([2**25 + 1, 3])
    out, _ = fxtools.vjp(f, x, i)(x, i, torch.ones(2, dtype=torch.float64))
    _bits_equal(out, f(x, i))


def _cloned_in_place(x):
    h = x.sin()
    c = h.clone()
    c.mul_(2)  # written in place: the copy stays
    return h + c


def _cloned(x):
    h = x.sin()
    return (h.clone() * h + torch.zeros(3, dtype=x.dtype).clone()).sum()


def test_a_clone_of_a_new_tensor_is_the_tensor():
    """``clone`` of a tensor just computed (``zeros``, ``sin(x)``; ``vmap(hessian)`` of a SiLU MLP
    made ``torch.clone(torch.zeros([6]))``) copies nothing worth a line; it stays where the copy is
    written in place, or where the module returns both (two outputs must not be one tensor)."""
    x = torch.rand(4, 3, dtype=torch.float64)
    gm = fxtools.grad(_cloned, x)
    assert "torch.clone(" not in gm.code
    torch.testing.assert_close(gm(x), torch.func.grad(_cloned)(x), rtol=1e-12, atol=1e-12)
    traced = make_fx(_cloned_in_place, tracing_mode="fake")(x)  # not functionalized: mul_ writes the copy
    simplify(traced).recompile()
    assert "aten.clone" in traced.code
    torch.testing.assert_close(traced(x), _cloned_in_place(x), rtol=0, atol=0)

    def both(x):
        h = x.sin()
        return h, h.clone()

    vm = fxtools.vmap(both, x)
    a, b = vm(x)
    assert "torch.clone(" in vm.code and a.data_ptr() != b.data_ptr()
    torch.testing.assert_close((a, b), torch.func.vmap(both)(x), rtol=0, atol=0)


def test_a_product_with_ones_is_the_other_operand():
    """``ones.view(n, 1) * w2`` (the seed of ``torch.autograd.grad(u, x, ones_like(u))`` times the
    last layer) is ``w2`` broadcast: no ones tensor in the code. A module's output stays a new
    tensor (its caller may write it in place), not a broadcast view of the argument."""

    def residual(p, x):
        x = x.requires_grad_()
        u = pinn_mlp.u(p, x)
        (du,) = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)
        return du.pow(2).sum()

    p, x = pinn_mlp.mlp_params(3), torch.rand(5, 2, dtype=torch.float64)
    gm = fxtools.grad(residual, p, x)
    assert "ones" not in gm.code and "w2.expand([5, 6])" in gm.code
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    want = torch.autograd.grad(residual(leaves, x.clone()), list(leaves.values()))
    torch.testing.assert_close(list(gm(p, x).values()), list(want), rtol=1e-10, atol=1e-12)

    def spread(w):
        return torch.ones(5, 1, dtype=w.dtype) * w

    w = torch.rand(3, dtype=torch.float64)
    vm = fxtools.vmap(spread, w[None].expand(2, 3).clone())
    out = vm(w[None].expand(2, 3).clone())
    out.add_(1)  # a new tensor, as eager's product
    torch.testing.assert_close(out, torch.func.vmap(spread)(w[None].expand(2, 3)) + 1, rtol=0, atol=0)


def test_sweeps_sharing_one_rewriter_give_the_code_of_fresh_ones(monkeypatch):
    """``simplify`` keeps the fills it found and CSE's facts from one sweep to the next (build
    time); the code must be what sweeps starting afresh give, on a GPT (readable and fused rules)
    and on a program whose fills become known only once a conversion is rewritten."""
    from fxtools.cli import examples
    from fxtools.passes import simplify as simplify_module

    model, (idx, targets) = examples.gpt("tiny", "explicit", n_layer=1)
    params = dict(model.named_parameters())

    def f(x):
        scale = torch.ones_like(x).to(torch.float64) * 2.0
        return (x * (scale / 4) * torch.full_like(x, -1.0)).sum()

    x = torch.randn(3, 4, dtype=torch.float64)

    def codes():
        out = []
        for rules in ("readable", "fused"):
            sp = fxtools.split(fxtools.functional(model), params, idx, targets, rules=rules)
            out += [sp.forward.code, sp.backward.code]
        sp = fxtools.split(f, x)
        return [*out, sp.forward.code, sp.backward.code, fxtools.grad(f, x).code]

    shared = codes()

    def afresh(self):
        self._known = {}

    monkeypatch.setattr(simplify_module._Rewriter, "next_sweep", afresh)
    monkeypatch.setattr(simplify_module, "_mutates_memo", lambda node, keys: simplify_module._mutates(node))
    assert codes() == shared


def _fake_value(t, x):
    """What the code generator and the passes read of a value: its metadata, mode, and whether it views ``x``."""
    same_storage = t.untyped_storage()._cdata == x.untyped_storage()._cdata
    return (
        type(t),
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.dtype,
        t.device,
        t.requires_grad,
        t._is_view(),
        t._base is x,
        same_storage,
        t.fake_mode,
    )


def test_a_view_made_by_a_rewrite_has_the_value_the_fake_mode_gives():
    """simplify's rewrites make a view's value by its meta kernel alone (no fake dispatch): the same
    value FakeTensorMode gives, a view of its input (the frees in the code read that); a view the
    strides refuse, an op of several outputs and an op that is no view take the fake mode's path."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import snapshot_fake
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fxtools.passes import simplify as simplify_module

    aten = torch.ops.aten
    mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    with mode:
        base = torch.empty(3, 6, 4)
    x = snapshot_fake(base[1])  # as make_fx records a value: an offset into its storage, not a view itself
    cases = [
        (aten.transpose.int, (x, 0, 1)),
        (aten.t.default, (x,)),
        (aten.view.default, (x, [24])),
        (aten.expand.default, (x, [2, 6, 4])),
        (aten.permute.default, (x, [1, 0])),
        (aten.unsqueeze.default, (x, 0)),
        (aten.slice.Tensor, (x, 1, 1, 3)),
    ]
    for op, args in cases:
        got = simplify_module._view_value(mode, op, args, {})
        with mode:
            want = op(*args)
        assert _fake_value(got, x) == _fake_value(want, x), op
    xt = simplify_module._view_value(mode, aten.t.default, (x,), {})
    assert simplify_module._view_value(mode, aten.view.default, (xt, [24]), {}) is None  # strides refuse it
    assert simplify_module._view_value(mode, aten.split.Tensor, (x, 2), {}) is None
    assert simplify_module._view_value(mode, aten.neg.default, (x,), {}) is None
