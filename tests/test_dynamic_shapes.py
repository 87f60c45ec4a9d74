"""Ops whose output shape depends on tensor values (``x[mask]``, ``masked_select``, ``nonzero``).

Each generated module is built once, at one example, and then called on inputs that select a
*different* number of elements; results are compared with torch.autograd in float64.
"""

import importlib.util

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fxtools

D = torch.float64


def autograd_vjp(f, args, ct):
    """(out, grads) of ``f`` at ``args`` with cotangent ``ct`` by torch.autograd (None for non-float)."""
    xs = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = f(*xs)
    pairs = [(o, c) for o, c in zip(pytree.tree_leaves(out), pytree.tree_leaves(ct)) if c is not None]
    diff = [x for x in xs if x.requires_grad]
    got = torch.autograd.grad([o for o, _ in pairs], diff, [c for _, c in pairs], allow_unused=True)
    it = iter(got)
    grads = [(lambda g, x: torch.zeros_like(x) if g is None else g)(next(it), x) if x.requires_grad else None for x in xs]
    return pytree.tree_map(lambda o: o.detach(), out), grads


def random_cotangent(out):
    return pytree.tree_map(lambda o: torch.randn_like(o) if o.is_floating_point() else None, out)


def assert_vjp_matches(gm, f, args):
    ct = random_cotangent(f(*args))
    out, grads = gm(*args, ct)
    want_out, want_grads = autograd_vjp(f, args, ct)
    torch.testing.assert_close(pytree.tree_leaves(out), pytree.tree_leaves(want_out))
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w)


MASK_A = torch.tensor([True, False, True, True, False, False])
MASK_B = torch.tensor([False, True, True, True, True, True])  # a different count


def test_boolean_mask_indexing_runs_for_other_counts():
    x = torch.randn(6, 3, dtype=D)

    def f(x, m):
        return x[m].sin() * 2

    gm = fxtools.vjp(f, x, MASK_A)
    for m in (MASK_A, MASK_B, torch.zeros(6, dtype=torch.bool)):
        assert_vjp_matches(gm, f, (x, m))


def test_masked_select_backward_scatters_into_zeros():
    x = torch.randn(6, 3, dtype=D)

    def f(x, m):
        return torch.masked_select(x, m[:, None]).exp()

    gm = fxtools.vjp(f, x, MASK_A)
    assert "masked_scatter" in gm.code
    for m in (MASK_A, MASK_B):
        assert_vjp_matches(gm, f, (x, m))


def test_nonzero_indexing():
    x = torch.randn(6, 3, dtype=D)

    def f(x, m):
        idx = m.nonzero()[:, 0]
        return (x[idx] * x[idx].sum(0, keepdim=True)).tanh().mean()

    gm = fxtools.vjp(f, x, MASK_A)
    assert "torch.nonzero(m)" in gm.code
    for m in (MASK_A, MASK_B):
        assert_vjp_matches(gm, f, (x, m))


def test_greater_than_zero_selection_reshaped():
    def f(x):
        return x[x > 0].reshape(-1, 1).cumsum(0).pow(2).sum()

    gm = fxtools.vjp(f, torch.randn(7, dtype=D))
    for x in (torch.randn(7, dtype=D), torch.randn(7, dtype=D).abs(), -torch.randn(7, dtype=D).abs()):
        assert_vjp_matches(gm, f, (x,))


def test_tensor_split_with_tensor_indices():
    x = torch.randn(6, 2, dtype=D)

    def f(x, i):
        return [p.sum(0) * (k + 1) for k, p in enumerate(torch.tensor_split(x, i))] + [torch.tensor_split(x, i)[1]]

    gm = fxtools.vjp(f, x, torch.tensor([1, 3]))
    for i in (torch.tensor([1, 3]), torch.tensor([2, 5]), torch.tensor([0, 6])):
        assert_vjp_matches(gm, f, (x, i))


def test_tensor_split_count_from_a_tensor_is_specialised_and_checked():
    x = torch.randn(6, 2, dtype=D)

    def f(x, n):
        return [p.sum() for p in torch.tensor_split(x, n)]

    gm = fxtools.vjp(f, x, torch.tensor(3))
    assert_vjp_matches(gm, f, (x, torch.tensor(3)))
    with pytest.raises(RuntimeError, match="number of sections"):
        gm(x, torch.tensor(2), [torch.ones((), dtype=D)] * 3)


def test_combinations():
    def f(v):
        return torch.combinations(v, 2).prod(1)

    gm = fxtools.vjp(f, torch.randn(4, dtype=D))
    assert_vjp_matches(gm, f, (torch.randn(4, dtype=D),))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, tokens, labels, mask):
        logits = self.head(torch.tanh(self.hidden(self.embed(tokens))))
        return F.cross_entropy(logits[mask], labels[mask])  # loss over the non-padding tokens only


def test_masked_token_cross_entropy_one_module_two_masks():
    torch.manual_seed(0)
    model = TinyLM().to(D)
    loss = fxtools.functional(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    tokens = torch.randint(0, 11, (3, 5))
    labels = torch.randint(0, 11, (3, 5))
    mask_a = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    mask_b = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    gm = fxtools.grad(loss, params, tokens, labels, mask_a)
    for mask in (mask_a, mask_b):
        got = gm(params, tokens, labels, mask)
        model.zero_grad()
        model(tokens, labels, mask).backward()
        assert set(got) == {k for k, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name], p.grad)


def test_value_and_grad():
    x = torch.randn(6, 3, dtype=D)

    def f(x, m):
        return x[m].pow(2).mean()

    gm = fxtools.value_and_grad(f, x, MASK_A)
    for m in (MASK_A, MASK_B):
        value, g = gm(x, m)
        xr = x.clone().requires_grad_()
        want = f(xr, m)
        want.backward()
        torch.testing.assert_close(value, want.detach())
        torch.testing.assert_close(g, xr.grad)


def test_jvp():
    x, t = torch.randn(6, 3, dtype=D), torch.randn(6, 3, dtype=D)

    def f(x, m):
        return x[m].sin().sum(0)

    gm = fxtools.jvp(f, x, MASK_A)
    for m in (MASK_A, MASK_B):
        out, tangent = gm(x, m, t, None)
        want_out, want_tangent = torch.func.jvp(lambda x: f(x, m), (x,), (t,))
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(tangent, want_tangent)


def test_generated_code_reads_sizes_from_tensors():
    gm = fxtools.grad(lambda x, m: x[m].sum(), torch.randn(6, 3, dtype=D), MASK_A)
    assert ".size(0)" in gm.code and "sym_size" not in gm.code.replace("sym_size_int", "")
    static = fxtools.grad(lambda x: x.sum(), torch.randn(6, 3, dtype=D))
    assert "size(" not in static.code  # graphs without data-dependent ops are unchanged


def test_saved_module_runs_for_other_counts(tmp_path):
    x = torch.randn(6, 3, dtype=D)

    def f(x, m):
        return x[m].sin().sum()

    fxtools.save(fxtools.grad(f, x, MASK_A), tmp_path / "g.py")
    spec = importlib.util.spec_from_file_location("g_dynamic", tmp_path / "g.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for m in (MASK_A, MASK_B):
        torch.testing.assert_close(module.forward(x, m), autograd_vjp(f, (x, m), torch.ones((), dtype=D))[1][0])


def test_data_dependent_control_flow_still_names_the_line():
    def f(x, m):
        y = x[m]
        if y.sum() > 0:  # the offending line
            return y
        return -y

    with pytest.raises(fxtools.DataDependentError, match=r"test_dynamic_shapes.py:\d+: if y.sum\(\) > 0"):
        fxtools.vjp(f, torch.randn(6, 3, dtype=D), MASK_A)


def test_split_and_compile_serve_every_mask():
    """A masked loss through fxtools.split and fxtools.compile: the saved values' sizes are
    symbolic (their report shows ``u0``), and other masks give autograd's gradients."""
    lin = nn.Linear(4, 3).double()

    def loss(params, x, y, mask):
        logits = torch.func.functional_call(lin, params, (x,))
        return F.cross_entropy(logits[mask], y[mask])

    params = {k: v.detach() for k, v in lin.named_parameters()}
    x, y = torch.randn(6, 4, dtype=D), torch.tensor([0, 1, 2, 0, 1, 2])
    sp = fxtools.split(loss, params, x, y, MASK_A)
    assert any("u0" in str(list(s.shape)) for s in sp.saved)
    compiled = fxtools.compile(loss)
    for mask in (MASK_A, ~MASK_A, torch.ones(6, dtype=torch.bool)):
        ref = {k: v.clone().requires_grad_() for k, v in params.items()}
        value = loss(ref, x, y, mask)
        want = torch.autograd.grad(value, list(ref.values()))
        out, saved = sp.forward(*sp.flatten(params, x, y, mask))
        grads = sp.backward(*saved, torch.ones((), dtype=D))[0]
        torch.testing.assert_close(out, value.detach(), rtol=0, atol=1e-15)
        for g, w in zip(grads.values(), want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-15)
        trained = {k: v.clone().requires_grad_() for k, v in params.items()}
        compiled(trained, x, y, mask).backward()
        for p, w in zip(trained.values(), want):
            torch.testing.assert_close(p.grad, w, rtol=0, atol=1e-15)


def test_last_selected_row_per_sequence():
    """Hugging Face's sequence classifiers pick each sequence's last EOS token this way:
    ``h[ids == eos].view(batch, -1, width)[:, -1, :]`` (a select at a data-dependent size)."""

    def f(h, ids):
        return (h[ids.eq(5), :].view(2, -1, 3)[:, -1, :] ** 2).sum()

    h = torch.randn(2, 4, 3, dtype=torch.float64)
    gm = fxtools.grad(f, h, torch.tensor([[1, 5, 2, 5], [5, 3, 3, 5]]))
    for ids in (torch.tensor([[1, 5, 2, 5], [5, 3, 3, 5]]), torch.tensor([[5, 5, 5, 1], [5, 5, 3, 5]])):
        hr = h.clone().requires_grad_()
        (want,) = torch.autograd.grad(f(hr, ids), hr)
        torch.testing.assert_close(gm(h, ids), want, rtol=0, atol=0)


def test_functions_of_tensors_given_one_by_one():
    """``torch.broadcast_tensors(*tensors)`` (kept with dynamic sizes after an in-place write, from
    F.mse_loss's broadcast) is written with its tensors one by one: the ATen op takes them as a
    list, which the Python function read as one tensor ("expected Tensor as element 0 ..., but got
    list", fuzz seed 59)."""
    from torch.export import Dim

    def f(x, w, b):
        v = x * 1.5
        v.diagonal(dim1=-2, dim2=-1).add_(x.sum())
        d = F.mse_loss(v, x, reduction="none")
        return (F.conv2d(d.view(1, 1, 2, 4), w, b) ** 2).sum() + F.log_softmax(d, 0).sum()

    args = [torch.randn(*s, dtype=torch.float64) for s in ((2, 4), (2, 1, 2, 2), (2,))]
    auto = tuple(dict.fromkeys(range(a.dim()), Dim.AUTO) for a in args)
    g = fxtools.grad(f, *args, argnums=(0, 1, 2), dynamic_shapes=auto)
    assert "broadcast_tensors([" not in g.code, g.code
    torch.testing.assert_close(g(*args), torch.func.grad(f, argnums=(0, 1, 2))(*args))
