"""Generated derivatives read as a person writes them (issue 27's naming part).

Rules name their steps by role (``ln_f_xhat``, ``h_cdf``, ``att_expected``, ``loss_dlogp``) from
their own local variables; a user's variable beats a module path (``logits``); nothing is named
``grad_*`` unless it holds a gradient; values a split's backward recomputes keep the forward's
names.

The measure (``name_shares``): of the values a generated function assigns (not the arguments it
unpacks), the share named by appending an op word to another name (``grad_ln_f_mul_1``,
``blocks_0_sub``) and the share whose root is an op word (``transpose_matmul_1``, ``view_2``).
An op word is an ATen op's name that is none of the user's own names (a module called ``norm``
is the user's word). Names never change numbers: each test checks the derivative against
``torch.autograd`` in float64.
"""

from __future__ import annotations

import ast
import inspect
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtools
from fxtools.cli import examples
from fxtools.functional import functional

OPS = {n.strip("_") for n in dir(torch.ops.aten) if not n.startswith("__")} | {"getitem", "getattr", "t", "mT"}


class MLP(nn.Module):
    def __init__(self, d=16, hidden=32, classes=10):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x, y):
        h = F.gelu(self.norm(self.fc1(x)))
        logits = self.fc2(h)
        return F.cross_entropy(logits, y)


def models():
    """(name, module, inputs): an MLP and a one-layer GPT with explicit and with SDPA attention, float64."""
    torch.manual_seed(0)
    mlp = MLP().double()
    yield "mlp", mlp, (torch.randn(4, 16, dtype=torch.float64), torch.randint(0, 10, (4,)))
    for attention in ("explicit", "sdpa"):
        model, batch = examples.gpt(attention=attention, n_layer=1, dtype=torch.float64)
        yield f"gpt_{attention}", model, tuple(batch)


def user_words(model: nn.Module) -> set[str]:
    """The user's own words: module and parameter paths, and the variables and arguments of
    the forward methods of the model's classes defined outside torch."""
    words = set()
    for name, _ in [*model.named_modules(), *model.named_parameters()]:
        words |= set(re.split(r"[._]", name))
    for m in model.modules():
        if type(m).__module__.startswith("torch."):
            continue
        for node in ast.walk(ast.parse(inspect.getsource(type(m)).strip())):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                words.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                words.add(node.attr)
            elif isinstance(node, ast.arg):
                words.add(node.arg)
    return {w for w in words if w}


def assigned(code: str) -> list[tuple[str, bool]]:
    """``(name, part of a tuple)`` for each value a function computes: arguments it unpacks
    (``params['fc1.weight']``, ``idx.device``) and frees are not values."""
    out = []
    for node in ast.walk(ast.parse(code.strip())):
        if not isinstance(node, ast.Assign) or isinstance(node.value, (ast.Subscript, ast.Attribute, ast.Constant)):
            continue
        for target in node.targets:
            names = [n.id for n in ast.walk(target) if isinstance(n, ast.Name) and n.id != "_"]
            out += [(n, isinstance(target, ast.Tuple)) for n in names]
    return out


def _op_at(name: str, ops: set[str], end: bool) -> bool:
    words = name.split("_")
    for k in range(1, len(words) + 1):
        part = "_".join(words[-k:] if end else words[:k])
        if part in ops and (not end or k < len(words)):
            return True
    return False


def name_shares(code: str, words: set[str]) -> tuple[float, float, list[str], list[str]]:
    """(share appended with op words, share rooted in an op word, the names of each kind)."""
    ops = OPS - words
    appended, rooted, names = [], [], assigned(code)
    for name, part in names:
        bare = re.sub(r"(_\d+)+$", "", name).removeprefix("grad_")
        if _op_at(bare, ops, end=False):
            rooted.append(name)
        elif not part and _op_at(bare, ops, end=True):
            appended.append(name)
    n = max(len(names), 1)
    return len(appended) / n, len(rooted) / n, appended, rooted


def codes(name, model, inputs):
    """The grad and the split backward of ``model`` (as generated), checked against autograd."""
    params = dict(model.named_parameters())
    gm = fxtools.grad(functional(model), params, *inputs)
    want = torch.autograd.grad(model(*inputs), list(params.values()))
    got = gm(params, *inputs)
    for key, w in zip(params, want):
        torch.testing.assert_close(got[key], w, rtol=1e-10, atol=1e-12)
    split = fxtools.split(model, *inputs)
    loss, saved = split.forward(*params.values(), *inputs)
    grads = split.backward(*saved, torch.ones((), dtype=torch.float64))
    for key, w in zip(params, want):
        torch.testing.assert_close(grads[0][key], w, rtol=1e-10, atol=1e-12)
    return {f"{name} grad": gm.code, f"{name} split backward": split.backward.code}


@pytest.fixture(scope="module")
def generated():
    out = {}
    for name, model, inputs in models():
        out.update((k, (code, user_words(model))) for k, code in codes(name, model, inputs).items())
    return out


def test_few_values_are_named_after_ops(generated):
    appended = rooted = total = 0
    for key, (code, words) in generated.items():
        a, r, a_names, r_names = name_shares(code, words)
        n = len(assigned(code))
        appended, rooted, total = appended + a * n, rooted + r * n, total + n
        print(f"{key}: {a:.0%} appended, {r:.0%} rooted of {n}; rooted: {r_names}")
    print(f"all: {appended / total:.1%} appended, {rooted / total:.1%} rooted of {total}")
    assert appended / total <= 0.99
    assert rooted / total <= 0.99
