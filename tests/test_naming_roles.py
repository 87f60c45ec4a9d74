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
from fxtools.codegen import flat_code
from fxtools.functional import functional
from fxtools.graph import meta

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
    return {f"{name} grad": gm, f"{name} split backward": split.backward}


@pytest.fixture(scope="module")
def generated():
    out = {}
    for name, model, inputs in models():
        out.update((k, (gm.code, user_words(model), gm)) for k, gm in codes(name, model, inputs).items())
    return out


def test_few_values_are_named_after_ops(generated):
    """Measured when the rules' variables first named their steps: 12.6% appended, 0% rooted (on
    main before: 59% appended); the goal is at most 15% and 3%."""
    appended = rooted = total = 0
    for key, (code, words, _) in generated.items():
        a, r, a_names, r_names = name_shares(code, words)
        n = len(assigned(code))
        appended, rooted, total = appended + a * n, rooted + r * n, total + n
        print(f"{key}: {a:.0%} appended, {r:.0%} rooted of {n}; appended: {a_names}")
        assert a <= 0.16 and r <= 0.01, (key, a, r, a_names, r_names, code)
    print(f"all: {appended / total:.1%} appended, {rooted / total:.1%} rooted of {total}")
    assert appended / total <= 0.14
    assert rooted / total <= 0.01


def test_the_measure_sees_op_names():
    code = "def f(x):\n    view_2 = x.view(-1)\n    grad_transpose_1 = view_2.t()\n    x_mul_1 = x * 2\n    h_cdf = x\n"
    a, r, appended, rooted = name_shares(code, {"x"})
    assert (appended, rooted) == (["x_mul_1"], ["view_2", "grad_transpose_1"])
    assert name_shares("def f(norm):\n    norm_xhat = norm * 2\n", {"norm"})[:2] == (0, 0)


def test_gradients_alone_are_named_grad(generated):
    """A value named ``grad_*`` holds a floating gradient: masks and counts are named for what they are."""
    for key, (_, _, gm) in generated.items():
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.name.startswith("grad_") and isinstance(val, torch.Tensor):
                assert val.is_floating_point(), (key, node.name, node.format_node())


def _vjp_code(f, *args):
    """The vjp of ``f`` at float64 ``args``, checked against autograd; its code."""
    gm = fxtools.vjp(f, *args)
    out = f(*args)
    ct = torch.randn_like(out)
    leaves = [a.detach().clone().requires_grad_() for a in args]
    want = torch.autograd.grad(f(*leaves), leaves, ct)
    _, got = gm(*args, ct)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    return flat_code(gm)  # every value's name, also of the steps printed inside their user


def _names(code: str) -> set[str]:
    return {n for n, _ in assigned(code)}


def layer_norm(x, weight, bias):
    y = F.layer_norm(x, (x.shape[-1],), weight, bias)
    return y


def gelu(x):
    h = F.gelu(x)
    return h


def softmax(scores):
    att = torch.softmax(scores, dim=-1)
    return att


def cross_entropy(logits, target):
    loss = F.cross_entropy(logits, target)
    return loss


def attention(q, k, v):
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y


@pytest.mark.parametrize("seed", [0, 1])
def test_rule_families_name_their_steps_by_role(seed):
    torch.manual_seed(seed)
    n, d = 3 + seed, 5 + 2 * seed
    x, w, b = torch.randn(n, d, dtype=torch.float64), torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    names = _names(_vjp_code(layer_norm, x, w, b))
    assert {"y_centered", "y_xhat", "y_dxhat", "y_mean_dxhat", "y_mean_dxhat_xhat", "y_dy_xhat", "grad_x"} <= names, names
    assert {"h_cdf", "h_pdf", "h_slope", "grad_x"} <= _names(_vjp_code(gelu, x)), _vjp_code(gelu, x)
    assert {"att_weighted", "att_expected", "att_centered", "grad_scores"} <= _names(_vjp_code(softmax, x))
    target = torch.randint(0, d, (n,))
    names = _names(_vjp_code(lambda logits: cross_entropy(logits, target), x))
    assert {"loss_valid", "loss_count", "loss_dlogp", "loss_probs", "loss_total", "grad_logits"} <= names, names
    q, k, v = torch.randn(3, 2, 2, n, d, dtype=torch.float64).unbind(0)
    names = _names(_vjp_code(attention, q, k, v))
    assert {"y_scores", "y_causal", "y_mask", "y_probs", "y_dprobs", "y_dscores", "grad_q", "grad_k", "grad_v"} <= names, names
    assert not [m for m in names if m.startswith("grad_y_")], names  # the mask is no gradient


def test_module_values_take_the_users_variable(generated):
    """``h = F.gelu(self.norm(self.fc1(x)))`` and ``logits = self.fc2(h)``: ``h`` and ``logits``;
    values the user did not name keep their module's path (``fc1``, ``norm``)."""
    split = fxtools.split(MLP().double(), torch.randn(4, 16, dtype=torch.float64), torch.randint(0, 10, (4,)))
    code = split.forward.code
    for line in ("fc1 = ", "norm = ", "h = torch.nn.functional.gelu(norm)", "logits = torch.nn.functional.linear(h,"):
        assert line in code, code
    assert "fc2 = " not in code, code


@pytest.mark.parametrize("policy", ["recompute_cheap", "recompute_all"])
def test_recomputed_values_keep_the_forwards_names(policy):
    """What a split's backward recomputes reads as the forward wrote it (``q_1``, ``att_3``), never op names."""
    model, batch = examples.gpt(attention="explicit", n_layer=1, dtype=torch.float64)
    split = fxtools.split(model, *batch, policy=(lambda node: "recompute") if policy == "recompute_all" else policy)
    forward_names = {n.name for n in split.forward.graph.nodes}
    recomputed = [n for n in split.backward.graph.nodes if meta.PART.get(n) == "recompute"]
    assert len(recomputed) > 10
    for node in recomputed:
        if not isinstance(node.meta.get("val"), (tuple, list)):  # a multi-output op is written unpacked
            assert node.name in forward_names, (node.name, split.forward.code)
    a, r, appended, rooted = name_shares(split.backward.code, user_words(model))
    assert not rooted, rooted


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        twice = 2 * x
        return grad * twice


def squared(x):
    sq = Square.apply(x)
    return sq


def test_a_users_rule_names_its_steps_by_its_variables():
    x = torch.randn(5, dtype=torch.float64)
    names = _names(_vjp_code(squared, x))
    assert {"sq_twice", "grad_x"} <= names, names
    code = fxtools.grad(lambda x: squared(x).sum(), x).code
    assert "grad_x = " in code, code  # the gradient equal to a step takes the gradient's name
