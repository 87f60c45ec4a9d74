"""Tuple targets assigned from a comprehension, and the values a split backward recomputes (issue 33).

``q, k, v = (t.view(B, T, h, hd).transpose(1, 2) for t in (q, k, v))`` names its elements ``q``,
``k``, ``v`` (``q_1`` ... where the names are taken), in the forward and wherever a backward
recomputes them; values stay exact (torch.autograd in float64 is the oracle).
"""

from __future__ import annotations

import math
import operator
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtools

OP_WORD = re.compile(
    r"^(view|transpose|reshape|matmul|mul|add|sub|div|softmax|expand|permute|unsqueeze|squeeze|sum|t|"
    r"clone|where|masked_fill|getitem|split|cat|slice|select|index|scaled_dot_product_attention)(_\d+)*$"
)


class GenAttention(nn.Module):
    """One GPT attention layer, its heads made by a comprehension (as the issue's model writes it)."""

    def __init__(self, kind="generator", sdpa=False, C=8, h=2):
        super().__init__()
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.h, self.kind, self.sdpa = h, kind, sdpa

    def forward(self, x):
        B, T, C = x.shape
        h, hd = self.h, C // self.h
        q, k, v = self.c_attn(x).split(C, dim=2)
        if self.kind == "generator":
            q, k, v = (t.view(B, T, h, hd).transpose(1, 2) for t in (q, k, v))
        else:
            q, k, v = [t.view(B, T, h, hd).transpose(1, 2) for t in (q, k, v)]
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        return (torch.tanh(self.c_proj(y)) ** 2).sum()


def _op_rooted(gm):
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and OP_WORD.match(n.name)]


def _check_grads(model, x, grads):
    params = dict(model.named_parameters())
    want = torch.autograd.grad(model(x), list(params.values()))
    for k, w in zip(params, want):
        torch.testing.assert_close(grads[k], w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["generator", "list"])
@pytest.mark.parametrize("sdpa", [False, True], ids=["explicit", "sdpa"])
def test_comprehension_elements_named_in_split_and_grad(kind, sdpa):
    torch.manual_seed(0)
    model = GenAttention(kind, sdpa).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    with fxtools.rule_set("readable"):
        sp = fxtools.split(model, x)
        gm = fxtools.grad(fxtools.functional(model), dict(model.named_parameters()), x)
    fw = sp.forward.code
    for name in ("q_1", "k_1", "v_1"):
        assert re.search(rf"\b{name} = torch\.transpose\(", fw), fw
    for g in (sp.forward, sp.backward, gm):
        assert _op_rooted(g) == [], g.code
    recomputed = {n.name for n in sp.backward.graph.nodes if n.op == "call_function"}
    forward_names = {n.name for n in sp.forward.graph.nodes if n.op == "call_function"}
    if not sdpa:  # the attention backward recomputes the heads: under the forward's names
        assert {"q_1", "k_1", "v_1"} & recomputed <= forward_names
        assert {"q_1", "k_1", "v_1"} & recomputed, sp.backward.code
    params = dict(model.named_parameters())
    _check_grads(model, x, gm(params, x))
    compiled = fxtools.compile(model, x, rules="readable")
    model.zero_grad(set_to_none=True)
    compiled(x).backward()
    _check_grads(model, x, {k: p.grad for k, p in model.named_parameters()})


def test_comprehension_whose_elements_differ_is_not_split_by_position():
    """Elements computed by different ops (``a`` one op, ``b`` two): no element takes a name its
    iteration did not compute; values exact."""

    def f(x):
        a, b = (torch.sin(t) if i == 0 else torch.cos(t) * 2 for i, t in enumerate((x, x + 1)))
        return (a * b).sum()

    x = torch.randn(5, dtype=torch.float64)
    gm = fxtools.grad(f, x)
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    if "b" in nodes:
        assert nodes["b"].target in (torch.mul, operator.mul), gm.code
    if "a" in nodes:
        assert nodes["a"].target is torch.sin, gm.code
    xr = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(f(xr), [xr])
    torch.testing.assert_close(gm(x), want)
