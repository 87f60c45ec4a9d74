"""The last ops of the OpInfo sweep, tested beyond its samples, against eager PyTorch in float64.

- Random draws: a program that seeds the generator (``torch.manual_seed``), or saves and restores
  its state (``get_rng_state`` / ``set_rng_state``, ``torch.random.fork_rng``), draws in the
  generated code what it draws in eager mode, and leaves the generator in the state eager leaves
  it; a state fxtools cannot record is refused naming the line.
- ``prod`` and ``cumprod`` at zeros, infs and NaNs: autograd's values (NaN where the product of
  the others is ``0 * inf``; cumprod's of ``create_graph=True``), on random tensors with special
  values planted.
- ``ctc_loss`` with lengths as lists or tensors, every reduction, and a module reused with other
  lengths; ``as_strided`` on partial views; compressed sparse arguments refused naming the call.
"""

import pytest
import torch
import torch.nn.functional as F

import fxtools
from fxtools.errors import FxtoolsError
from fxtools.transforms.check import check_vjp

D = torch.float64


def _seeded_dropout(x):
    torch.manual_seed(7)
    return F.dropout(x.sin(), 0.4, training=True) * 2


def _frozen_state(x):
    state = torch.get_rng_state()
    torch.manual_seed(3)
    y = F.rrelu(x, 0.1, 0.4, training=True) + torch.rand_like(x)
    torch.set_rng_state(state)
    return F.dropout(y, 0.3, training=True).sum(0)


def _forked(x):
    with torch.random.fork_rng():
        torch.manual_seed(11)
        y = F.alpha_dropout(x, 0.5, training=True)
    return y * torch.randn_like(x)


def _two_seeds(x):
    torch.manual_seed(1)
    a = F.dropout(x, 0.5, training=True)
    torch.manual_seed(2)
    return a + torch.normal(x, 1.0)


PROGRAMS = {"seeded_dropout": _seeded_dropout, "frozen_state": _frozen_state, "forked": _forked, "two_seeds": _two_seeds}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("outer_seed", [0, 5])
def test_random_draws_match_eager(name, outer_seed):
    """Outputs, gradients and the generator's state afterwards equal eager's, for vjp and compile."""
    f = PROGRAMS[name]
    x = torch.randn(6, 5, dtype=D, generator=torch.Generator().manual_seed(outer_seed))
    gm = check_vjp(f, x, seed=outer_seed)  # both sides start from torch.manual_seed(outer_seed)
    ct = torch.randn(f(x).shape, dtype=D)
    torch.manual_seed(outer_seed)
    xr = x.clone().requires_grad_()
    want = f(xr)
    (want_grad,) = torch.autograd.grad(want, xr, ct)
    want_after = torch.rand(3)
    torch.manual_seed(outer_seed)
    got, (got_grad,) = gm(x, ct)
    assert torch.equal(torch.rand(3), want_after), "the generator's state after the call differs from eager's"
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(got_grad, want_grad)
    compiled = fxtools.compile(f, x)
    torch.manual_seed(outer_seed)
    xc = x.clone().requires_grad_()
    out = compiled(xc)
    out.backward(ct)
    assert torch.equal(torch.rand(3), want_after)
    torch.testing.assert_close(out.detach(), want.detach())
    torch.testing.assert_close(xc.grad, want_grad)


def test_generated_code_seeds_as_the_program_does():
    code = fxtools.vjp(_frozen_state, torch.randn(3, 2, dtype=D)).code
    for call in ("torch.get_rng_state()", "torch.manual_seed(3)", "torch.set_rng_state("):
        assert call in code


def test_foreign_rng_state_refused():
    saved = torch.get_rng_state()

    def f(x):
        torch.set_rng_state(saved)  # a state from outside the program
        return F.dropout(x, 0.5, training=True)

    with pytest.raises(FxtoolsError, match=r"set_rng_state at .*test_last_ops.py:\d+"):
        fxtools.vjp(f, torch.randn(4, dtype=D))


def test_capture_leaves_the_generator_alone():
    torch.manual_seed(123)
    fxtools.vjp(_two_seeds, torch.randn(4, dtype=D))
    after_capture = torch.rand(2)
    torch.manual_seed(123)
    torch.randn(4, dtype=D)
    assert torch.equal(torch.rand(2), after_capture)


SPECIAL = [0.0, float("inf"), -float("inf"), float("nan"), 0.0, -2.5]
PRODUCTS = {
    "prod": lambda x: x.prod(),
    "prod_dim": lambda x: x.prod(0),
    "prod_keepdim": lambda x: x.prod(-1, keepdim=True),
    "cumprod": lambda x: x.cumprod(0),
    "cumprod_last": lambda x: x.cumprod(-1),
}


def _with_specials(shape, g):
    x = torch.randn(shape, dtype=D, generator=g)
    for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
        i = int(torch.randint(0, x.numel(), (1,), generator=g))
        x.view(-1)[i] = SPECIAL[int(torch.randint(0, len(SPECIAL), (1,), generator=g))]
    return x


def _check_cumprod(f, x, gm):
    """cumprod's gradient against autograd's with ``create_graph=True``: on a tensor holding a zero,
    autograd's backward divides nowhere then (the formula its double backward differentiates),
    and without ``create_graph`` takes another formula, whose NaNs and infs differ where the
    tensor also holds an inf or NaN; fxtools has the first one."""
    ct = torch.randn(x.shape, dtype=D, generator=torch.Generator().manual_seed(1))
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(f(xr), xr, ct, create_graph=True)
    _, (got,) = gm(x, ct)
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-8, equal_nan=True)
    assert torch.equal(got.signbit() & (got == 0), want.signbit() & (want == 0))  # -0.0 where autograd's


@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_products_at_special_values_match_autograd(name):
    """Random tensors with zeros, infs and NaNs planted (one or several per line), several shapes;
    one module per shape, called with every tensor of that shape."""
    g = torch.Generator().manual_seed(len(name))
    for shape in [(6,), (3, 4), (2, 3, 3)]:
        gm = fxtools.vjp(PRODUCTS[name], torch.randn(shape, dtype=D))
        for _ in range(15):
            x = _with_specials(shape, g)
            if name.startswith("cumprod"):
                _check_cumprod(PRODUCTS[name], x, gm)
            else:
                check_vjp(PRODUCTS[name], x, gm=gm, rtol=1e-6, atol=1e-8)


def test_prod_zero_and_inf_is_nan_as_in_autograd():
    x = torch.tensor([0.0, float("inf"), 2.0], dtype=D)
    _, (grad,) = fxtools.vjp(lambda x: x.prod(0), x)(x, torch.tensor(1.0, dtype=D))
    assert torch.equal(grad.isnan(), torch.tensor([False, False, True]))


def _ctc_case(g, T=7, N=3, C=5, S=4):
    log_probs = torch.randn(T, N, C, dtype=D, generator=g).log_softmax(2)
    targets = torch.randint(1, C, (N, S), generator=g)
    input_lengths = torch.randint(S + 1, T + 1, (N,), generator=g)
    target_lengths = torch.randint(1, S + 1, (N,), generator=g)
    return log_probs, targets, input_lengths, target_lengths


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("lengths", ["tensors", "lists"])
def test_ctc_loss_matches_autograd(reduction, lengths):
    g = torch.Generator().manual_seed(0)
    lp, tg, il, tl = _ctc_case(g)
    if lengths == "lists":

        def f(lp, tg):
            return F.ctc_loss(lp, tg, il.tolist(), tl.tolist(), reduction=reduction, zero_infinity=True)

        check_vjp(f, lp, tg, rtol=1e-6, atol=1e-8)
        return

    def f(lp, tg, il, tl):
        return F.ctc_loss(lp, tg, il, tl, reduction=reduction)

    gm = check_vjp(f, lp, tg, il, tl, rtol=1e-6, atol=1e-8)
    for _ in range(3):  # one module for every length: they are tensors, read when it runs
        _, _, il2, tl2 = _ctc_case(g)
        check_vjp(f, lp, tg, il2, tl2, gm=gm, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("offset", [None, 0, 3, 7, 12])
def test_as_strided_on_partial_views_matches_autograd(offset):
    """``as_strided`` of a slice reads the storage around it; autograd differentiates at the slice."""
    base = torch.randn(20, dtype=D)
    x = base[5:15]
    kwargs = {} if offset is None else {"storage_offset": offset}

    def f(t):
        return torch.as_strided(t, (2, 3), (3, 1), **kwargs) * 2

    gm = fxtools.vjp(f, x)
    xr = x.detach().requires_grad_()
    want = f(xr)
    ct = torch.randn(2, 3, dtype=D)
    (want_grad,) = torch.autograd.grad(want, xr, ct)
    got, (got_grad,) = gm(x, ct)
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(got_grad, want_grad)


def test_compressed_sparse_refused_naming_the_call():
    a = torch.eye(3, dtype=D).to_sparse_csr()
    with pytest.raises(FxtoolsError, match=r"_sparse_mm \(at .*test_last_ops.py:\d+.*sparse_csr"):
        fxtools.vjp(lambda a, b: torch.sparse.mm(a, b, "sum"), a, torch.randn(3, 2, dtype=D))


def test_saved_module_seeds_as_eager(tmp_path):
    """fxtools.save writes the recorded calls as plain torch calls: the standalone module draws as eager."""
    import importlib.util

    x = torch.randn(5, 3, dtype=D)
    path = tmp_path / "seeded.py"
    fxtools.save(fxtools.vjp(_frozen_state, x), str(path))
    spec = importlib.util.spec_from_file_location("seeded", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(4)
    out, _ = module.forward(x, torch.ones(3, dtype=D))
    after = torch.rand(2)
    torch.manual_seed(4)
    assert torch.equal(out, _frozen_state(x))
    assert torch.equal(torch.rand(2), after)


def test_unrecorded_seeding_refused():
    """A seed set where fxtools cannot record it would be missing from the code: refused."""

    def f(x):
        torch.random.default_generator.manual_seed(5)
        return F.dropout(x, 0.5, training=True)

    x = torch.randn(4, dtype=D)
    before = torch.get_rng_state()
    with pytest.raises(FxtoolsError, match="random generator"):
        fxtools.vjp(f, x)
    assert torch.equal(torch.get_rng_state(), before), "the refusal leaves the generator as it was"
