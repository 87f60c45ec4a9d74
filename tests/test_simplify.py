"""Simplifications that make generated code read like hand-written code, checked on real outputs."""
import torch
import torch.nn.functional as F

import fxtools


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
    for name in ("grad_tanh", "grad_linear", "grad_params_0_weight", "grad_params_2_weight"):
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


def test_scalings_by_powers_of_two_merge_exactly():
    x, y = torch.randn(2, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    gm = fxtools.grad(F.mse_loss, x, y)  # 2 * (x - y) * (1 / 2)
    assert fxtools.simplify.count_compute_nodes(gm) == 1 and "grad_input_ = input_ - target" in gm.code
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(F.mse_loss(xr, y), xr)
    torch.testing.assert_close(gm(x, y), want, rtol=0, atol=0)

    t = torch.randn(5)
    merged = fxtools.vjp(lambda t: (t * 3) * 0.25, t)
    assert "t * 0.75" in merged.code
    torch.testing.assert_close(merged(t, torch.ones(5))[0], (t * 3) * 0.25, rtol=0, atol=0)
    kept = fxtools.vjp(lambda t: (t * 3) * 0.1, t)  # neither a power of two: rounding would differ
    assert "* 3" in kept.code and "* 0.1" in kept.code


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
    assert "x[(i, j)]" in gm.code and "aten.index" not in gm.code
    out, (grad_x,) = gm(x, torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(out, x[i, j] * 2, rtol=0, atol=0)
    want = torch.zeros_like(x)
    want[i, j] = 2
    torch.testing.assert_close(grad_x, want, rtol=0, atol=0)
