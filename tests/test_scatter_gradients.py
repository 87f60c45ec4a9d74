"""Gradients scattered into large tensors: one allocation, accumulated into (issue 33).

The embedding's gradient is a scatter into zeros, printed in place on the fresh zeros
(``codegen/inplace.py``); a tied weight's second gradient is scattered into the first
(``passes/accumulate.py``). The oracle is torch.autograd in float64, with repeated indices (where
the order of additions changes), on ``fxtools.grad`` and on ``fxtools.compile``'s readable split.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fxtools

aten = torch.ops.aten


class TiedLM(nn.Module):
    def __init__(self, vocab=11, width=6):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        logits = self.head(self.ln(torch.tanh(self.wte(idx))))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _lm(seed, batch, seq, vocab=11):
    torch.manual_seed(seed)
    model = TiedLM(vocab).double()
    idx = torch.randint(0, 4, (batch, seq))  # few distinct tokens: repeated rows
    targets = torch.randint(0, vocab, (batch, seq))
    return model, idx, targets


def _autograd(model, idx, targets):
    params = dict(model.named_parameters())
    return dict(zip(params, torch.autograd.grad(model(idx, targets), list(params.values()))))


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("seed,batch,seq", [(0, 2, 5), (1, 3, 7), (2, 1, 1)])
def test_tied_embedding_grad_scattered_into_head_gradient(seed, batch, seq):
    model, idx, targets = _lm(seed, batch, seq)
    params = dict(model.named_parameters())
    with fxtools.rule_set("readable"):
        gm = fxtools.grad(fxtools.functional(model), params, idx, targets)
    got = gm(params, idx, targets)
    want = _autograd(model, idx, targets)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)
    code = gm.code
    assert "zeros_like(wte_weight)" not in code and ".index_add_(0, " in code, code
    with _Calls() as calls:
        gm(params, idx, targets)
    assert aten.index_add.default not in calls.ops  # no out-of-place copy of the table
    assert aten.index_add_.default in calls.ops


@pytest.mark.parametrize("rules", ["readable", "fused"])
def test_tied_embedding_compiled_steps_match_autograd(rules):
    model, idx, targets = _lm(3, 2, 6)
    compiled = fxtools.compile(model, idx, targets, rules=rules)
    for step in range(2):  # the second step runs on gradients the first left: none leak between calls
        model.zero_grad(set_to_none=True)
        compiled(idx, targets).backward()
        got = {k: p.grad.clone() for k, p in model.named_parameters()}
        want = _autograd(model, idx, targets)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12, msg=f"step {step}: {k}")


def test_untied_embedding_writes_into_fresh_zeros():
    torch.manual_seed(4)
    emb = nn.Embedding(9, 5).double()
    idx = torch.tensor([[1, 1, 3], [8, 1, 0]])

    def loss(params, idx):
        return torch.sin(torch.func.functional_call(emb, params, (idx,))).sum()

    params = {k: v.detach() for k, v in emb.named_parameters()}
    with fxtools.rule_set("readable"):
        gm = fxtools.grad(loss, params, idx)
    assert re.search(r"= \w+\.index_add_\(0, |torch\.zeros_like\(weight\)\.index_add_\(0, ", gm.code), gm.code
    w = params["weight"].clone().requires_grad_(True)
    (want,) = torch.autograd.grad(loss({"weight": w}, idx), [w])
    torch.testing.assert_close(gm(params, idx)["weight"], want, rtol=1e-12, atol=1e-12)


def test_scatter_backwards_match_autograd_and_print_in_place():
    """max over a dim (a scatter into zeros), x[i] with repeated indices (index_put accumulating)."""
    torch.manual_seed(5)
    x = torch.randn(4, 6, dtype=torch.float64)
    i = torch.tensor([0, 2, 2, 3])

    def f(x, i):
        return (x.max(dim=1).values * 2).sum() + (x[i] ** 2).sum() + (x[:, i] * 3).sum()

    with fxtools.rule_set("readable"):
        gm = fxtools.grad(f, x, i)
    xr = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(f(xr, i), [xr])
    torch.testing.assert_close(gm(x, i), want, rtol=1e-12, atol=1e-12)
    assert re.search(r"\.(scatter|index_put|index_add)_\(", gm.code), gm.code
    with _Calls() as calls:
        gm(x, i)
    assert not {aten.scatter.src, aten.index_put.default, aten.index_add.default} & set(calls.ops)


def test_scatter_into_an_argument_or_a_shared_tensor_stays_out_of_place():
    """In place only on a fresh tensor nothing else reads: never on an argument, never on zeros
    the program reads again."""
    x = torch.randn(5, 3, dtype=torch.float64)
    i = torch.tensor([0, 4, 4])
    s = torch.randn(3, 3, dtype=torch.float64)

    def f(x, i, s):
        z = torch.zeros_like(x)
        return torch.index_add(x, 0, i, s), torch.index_add(z, 0, i, s) + z

    gm = fxtools.vjp(f, x, i, s)
    x0 = x.clone()
    cts = (torch.ones(5, 3, dtype=torch.float64), torch.ones(5, 3, dtype=torch.float64))
    out, _ = gm(x, i, s, cts)
    assert torch.equal(x, x0)
    torch.testing.assert_close(out, f(x, i, s))
    assert "x.index_add_" not in gm.code


def _writes(idx):
    return {
        "index_put": lambda x, v: x.index_put((idx,), v * 2).sin(),
        "scatter": lambda x, v: x.scatter(0, idx, v.exp()) * x,
    }


@pytest.mark.parametrize("op", ["index_put", "scatter"])
def test_jvp_of_writes_to_indices_and_its_convention_at_repeats(op):
    """fxtools' jvp is torch.func.jvp's, at distinct and at repeated indices (the tangent of the
    write that won: forward mode transposes the adjoint, the "adjoint" rule set). Its grad is
    autograd's, which gives each repeated write the gradient (PyTorch's convention): with distinct
    indices the two are each other's transpose, <J t, u> = <t, J^T u>, float64."""
    g = torch.Generator().manual_seed(7)
    for idx in (torch.tensor([1, 3, 0, 4]), torch.tensor([1, 3, 1, 0])):
        f = _writes(idx)[op]
        x, v, tx, tv, u = (torch.rand(n, dtype=torch.float64, generator=g) for n in (5, 4, 5, 4, 5))
        out, tangent = fxtools.jvp(f, x, v)(x, v, tx, tv)[:2]
        torch.testing.assert_close(out, f(x, v), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(tangent, torch.func.jvp(f, (x, v), (tx, tv))[1], rtol=1e-12, atol=1e-12)
        xr, vr = x.clone().requires_grad_(), v.clone().requires_grad_()
        gx, gv = torch.autograd.grad(f(xr, vr), (xr, vr), u)
        torch.testing.assert_close(fxtools.vjp(f, x, v)(x, v, u)[1], (gx, gv), rtol=1e-12, atol=1e-12)
        if len(set(idx.tolist())) == len(idx):
            torch.testing.assert_close((tangent * u).sum(), (gx * tx).sum() + (gv * tv).sum(), rtol=1e-12, atol=1e-12)
