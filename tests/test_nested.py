"""torch.func transforms and flex_attention inside the differentiated function (float64, 1e-10).

The oracles: ``torch.func`` (grad, jvp) of the same function for nested transforms, and for
``flex_attention`` the same attention written with an explicit mask and softmax, differentiated
by ``torch.func`` (PyTorch has no flex_attention backward on CPU).
"""

import inspect
import math
import re
import warnings

import pytest
import torch
from torch.func import vmap
from torch.utils import _pytree as pytree

import fxtools
from fxtools.graph.nodes import count_compute_nodes

pytestmark = [pytest.mark.usefixtures("float64"), pytest.mark.filterwarnings("ignore::UserWarning")]


def close(got, want):
    got, want = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def line_of(fn, text):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def where(fn, text):
    """A regex for 'this file:line' of ``text`` in ``fn``."""
    return rf"test_nested.py:{line_of(fn, text)}\b"


def per_row(x, w):
    return vmap(lambda r: (r @ w).sin())(x).sum()


def in_out_dims(x, w):
    y = vmap(lambda c, w: torch.tanh(c.sum() * w.sum(1)) * c[:3], in_dims=(1, None), out_dims=1)(x, w)
    return (y**2).sum()


def nested_twice(x, w):
    h = x @ w
    return vmap(vmap(lambda a, b: a * torch.exp(b)), in_dims=(0, None))(h, w[0]).sum()


def closes_over_an_intermediate(x, w):
    scale = (x * x).sum(0)  # computed in f: its gradient flows back to x through the vmap
    return vmap(lambda r: torch.cos(r * scale) @ w)(x).pow(2).sum()


def tuple_outputs(x, w):
    a, b = vmap(lambda r: (r.sin(), (r @ w).exp()), out_dims=(0, 1))(x)
    return a.sum() * b.mean()


VMAPPED = [per_row, in_out_dims, nested_twice, closes_over_an_intermediate, tuple_outputs]


def examples(rows=4):
    torch.manual_seed(0)
    return torch.randn(rows, 3), torch.randn(3, 2)


@pytest.mark.parametrize("f", VMAPPED, ids=lambda f: f.__name__)
def test_vmap_inside_grad_jvp_and_split(f):
    x, w = examples()
    want = torch.func.grad(f, argnums=(0, 1))(x, w)
    close(fxtools.grad(f, x, w, argnums=(0, 1))(x, w), want)
    tx, tw = torch.randn_like(x), torch.randn_like(w)
    close(fxtools.jvp(f, x, w)(x, w, tx, tw), torch.func.jvp(f, (x, w), (tx, tw)))
    split = fxtools.split(f, x, w)
    out, saved = split.forward(x, w)
    close(out, f(x, w))
    close(split.backward(*saved, torch.ones(())), want)


def test_vmap_inside_is_batched_code_without_a_loop():
    """One matrix product on the whole batch, and the same code for 4 rows as for 32."""
    codes = []
    for rows in (4, 32):
        x, w = examples(rows)
        gm = fxtools.grad(per_row, x, w, argnums=(0, 1))
        close(gm(x, w), torch.func.grad(per_row, argnums=(0, 1))(x, w))
        codes.append(re.sub(r"\b4\b|\b32\b", "N", gm.code))
    assert codes[0] == codes[1]
    assert codes[0].count("torch.mm(") + codes[0].count(" @ ") == 3  # forward, and one per gradient
    assert "vmap" not in codes[0] and "functorch" not in codes[0]
    assert count_compute_nodes(gm) <= 7


def test_vmap_inside_through_compile():
    x, w = examples()
    compiled = fxtools.compile(per_row, x, w)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = compiled(xg, wg)
    loss.backward()
    close(loss, per_row(x, w))
    close((xg.grad, wg.grad), torch.func.grad(per_row, argnums=(0, 1))(x, w))


def transforms_everywhere(x, w):
    y = vmap(lambda r: (r @ w).sin())(x * 2).sum()
    g = torch.func.grad(lambda w: (x @ w).tanh().sum())(w)
    j = torch.func.jvp(lambda w: (x @ w).tanh().sum(), (w,), (torch.ones_like(w),))[1]
    return y + g.pow(2).sum() + j + nested_twice(x, w)


def test_transforms_inside_through_the_torch_compile_backend():
    """Dynamo writes each transform out as functorch's bookkeeping; fxtools traces it below functorch."""
    x, w = examples()
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch._dynamo.reset()
    loss = torch.compile(transforms_everywhere, backend=fxtools.backend())(xg, wg)
    loss.backward()
    close(loss, transforms_everywhere(x, w))
    close((xg.grad, wg.grad), torch.func.grad(transforms_everywhere, argnums=(0, 1))(x, w))
    assert torch._C._functorch.maybe_current_level() is None


def inner_grad(x, w):
    return torch.func.grad(lambda w: (x @ w).tanh().sum())(w).pow(2).sum()


def inner_grad_and_value(x, w):
    g, v = torch.func.grad_and_value(lambda w: (x @ w).tanh().sum())(w)
    return (g * v).sum()


def inner_jvp(x, w):
    return torch.func.jvp(lambda w: (x @ w).tanh().sum(), (w,), (torch.ones_like(w),))[1]


def inner_vjp(x, w):
    out, vjp_fn = torch.func.vjp(lambda w: (x @ w).tanh(), w)
    return vjp_fn(torch.ones_like(out))[0].pow(2).sum() + out.sum()


def inner_jacrev(x, w):
    return torch.func.jacrev(lambda w: (x @ w).tanh())(w).pow(2).sum()


def inner_jacfwd(x, w):
    return torch.func.jacfwd(lambda w: (x @ w).tanh())(w).pow(2).sum()


def inner_hessian(x, w):
    return torch.func.hessian(lambda w: (x @ w).tanh().sum())(w).sum()


def per_sample_grads(x, w):
    """vmap of grad inside f: per-sample gradient norms as a penalty."""
    g = vmap(torch.func.grad(lambda w, r: (r @ w).tanh().sum()), in_dims=(None, 0))(w, x)
    return g.pow(2).sum()


INNER = [inner_grad, inner_grad_and_value, inner_jvp, inner_vjp, inner_jacrev, inner_jacfwd, inner_hessian, per_sample_grads]


@pytest.mark.parametrize("f", INNER, ids=lambda f: f.__name__)
def test_torch_func_transforms_inside(f):
    x, w = examples()
    close(fxtools.grad(f, x, w, argnums=(0, 1))(x, w), torch.func.grad(f, argnums=(0, 1))(x, w))


def test_grad_inside_through_jvp_and_split():
    x, w = examples()
    tx, tw = torch.randn_like(x), torch.randn_like(w)
    close(fxtools.jvp(inner_grad, x, w)(x, w, tx, tw), torch.func.jvp(inner_grad, (x, w), (tx, tw)))
    split = fxtools.split(inner_jacrev, x, w)
    _, saved = split.forward(x, w)
    close(split.backward(*saved, torch.ones(())), torch.func.grad(inner_jacrev, argnums=(0, 1))(x, w))


class RowWise(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.out(vmap(lambda r: torch.tanh(self.fc(r)))(x)).sum()


def test_vmap_over_a_module_inside_its_forward():
    """Parameters the vmapped function reads through the module get their gradients."""
    torch.manual_seed(0)
    model, x = RowWise(), torch.randn(5, 3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    got = fxtools.grad(fxtools.functional(model), params, x)(params, x)
    close(got, torch.func.grad(lambda p, x: torch.func.functional_call(model, p, (x,)))(params, x))


def test_ensemble_of_stacked_parameters_is_one_batched_product():
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2) for _ in range(4)]
    stacked, _ = torch.func.stack_module_state(models)
    stacked = {k: v.detach() for k, v in stacked.items()}
    x = torch.randn(5, 3)

    def ensemble(params, x):
        return vmap(lambda p: torch.func.functional_call(models[0], p, (x,)))(params).pow(2).sum()

    gm = fxtools.grad(ensemble, stacked, x)
    close(gm(stacked, x), torch.func.grad(ensemble)(stacked, x))
    assert gm.code.count("bmm(") + gm.code.count(" @ ") == 2  # forward and weight gradient, no loop


def test_no_functorch_state_leaks():
    """Capturing leaves no functorch level behind (a leaked vmap level breaks later random ops)."""
    x, w = examples()
    fxtools.grad(nested_twice, x, w)
    fxtools.grad(inner_hessian, x, w)
    assert torch._C._functorch.maybe_current_level() is None
    torch.randn(2)


# ---------------------------------------------------------------------------------------------
# Refusals name the user's line


def test_error_inside_a_vmap_names_both_lines():
    def f(x):
        return vmap(lambda r: r + torch.rand_like(r))(x).sum()  # randomness="error"

    with pytest.raises(fxtools.FxtoolsError, match=rf"torch.func vmap at .*{where(f, 'rand_like')}.*randomness"):
        fxtools.grad(f, torch.randn(3, 2))

    def g(x, w):
        return vmap(lambda c: c * w.sum(1), in_dims=1)(x).sum()  # columns of 4 times 3 numbers: a mistake

    with pytest.raises(fxtools.FxtoolsError, match=rf"{where(g, 'c * w.sum(1)')}.*broadcast"):
        fxtools.grad(g, *examples())


def test_data_dependent_value_inside_a_vmap_names_the_line():
    def f(x):
        return vmap(lambda r: r * 2 if r.sum() > 0 else r)(x).sum()

    with pytest.raises(fxtools.FxtoolsError, match=where(f, "r.sum() > 0")):
        fxtools.grad(f, torch.randn(3, 2))


def test_transform_fxtools_cannot_trace_names_the_line():
    def f(x):
        out, jvp_fn = torch.func.linearize(torch.sin, x)
        return jvp_fn(torch.ones_like(x)).sum() + out.sum()

    with pytest.raises(fxtools.FxtoolsError, match=where(f, "linearize")):
        fxtools.grad(f, torch.randn(3))


class Clip(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.clamp(-1, 1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g  # straight-through: not the derivative of the forward


def test_function_with_its_own_backward_inside_a_vmap_is_refused():
    def f(x):
        return vmap(lambda r: Clip.apply(r * 3))(x).sum()

    with pytest.raises(fxtools.CustomFunctionError, match=rf"Clip .*{where(f, 'Clip.apply')}.*own backward"):
        fxtools.grad(f, torch.randn(3, 2))


# ---------------------------------------------------------------------------------------------
# flex_attention

flex_attention = pytest.importorskip("torch.nn.attention.flex_attention")
B, H, S, D = 2, 3, 8, 4


def qkv(kv_heads=H):
    torch.manual_seed(0)
    return torch.randn(B, H, S, D), torch.randn(B, kv_heads, S, D), torch.randn(B, kv_heads, S, D)


def attention(q, k, v, bias=None, mask=None):
    """The reference: explicit scores, mask and softmax (rows masked out entirely give zeros)."""
    k, v = k.repeat_interleave(q.size(1) // k.size(1), 1), v.repeat_interleave(q.size(1) // v.size(1), 1)
    s = q @ k.transpose(-2, -1) / math.sqrt(D)
    if bias is not None:
        s = s + bias
    if mask is None:
        return s.softmax(-1) @ v
    p = s.masked_fill(~mask, -math.inf).softmax(-1)
    return torch.where(mask.any(-1, keepdim=True), p, 0) @ v


def causal(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -math.inf)


def distances():
    i = torch.arange(S)
    return i[None, :] - i[:, None]  # kv_idx - q_idx


slopes = torch.linspace(0.25, 1.0, H, dtype=torch.float64)


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)  # a captured tensor, indexed by the head


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx > kv_idx) & (q_idx - kv_idx <= 3)  # strictly causal: row 0 attends to nothing


def check_flex(f, ref, args, argnums):
    close(f(*args), ref(*args))  # PyTorch's own CPU forward agrees with the reference
    want = torch.func.grad(ref, argnums=argnums)(*args)
    close(fxtools.grad(f, *args, argnums=argnums)(*args), want)
    split = fxtools.split(f, *args)
    _, saved = split.forward(*args)
    grads = split.backward(*saved, torch.ones(()))
    close([grads[i] for i in argnums], want)
    compiled = fxtools.compile(f, *args)
    leaves = [a.clone().requires_grad_() for a in args]
    compiled(*leaves).backward()
    close([leaves[i].grad for i in argnums], want)


def test_flex_attention_causal_score_mod():
    def f(q, k, v):
        return flex_attention.flex_attention(q, k, v, score_mod=causal).pow(2).sum()

    def ref(q, k, v):
        return attention(q, k, v, mask=torch.ones(S, S, dtype=torch.bool).tril()).pow(2).sum()

    check_flex(f, ref, qkv(), (0, 1, 2))


def test_flex_attention_alibi_score_mod_with_a_captured_tensor():
    def f(q, k, v):
        return flex_attention.flex_attention(q, k, v, score_mod=alibi).pow(2).sum()

    def ref(q, k, v):
        return attention(q, k, v, bias=slopes[:, None, None] * distances()).pow(2).sum()

    check_flex(f, ref, qkv(), (0, 1, 2))
    code = fxtools.grad(f, *qkv()).code
    assert "_tensor_constant" not in code  # the captured tensor is named after the user's variable


def test_flex_attention_gradient_of_a_learned_bias():
    """The score_mod's captured tensor is an argument: it gets its gradient too."""

    def f(q, k, v, w):
        out = flex_attention.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + w[h] * (j - i))
        return out.pow(2).sum()

    def ref(q, k, v, w):
        return attention(q, k, v, bias=w[:, None, None] * distances()).pow(2).sum()

    check_flex(f, ref, (*qkv(), slopes.clone()), (0, 1, 2, 3))


def test_flex_attention_block_mask_and_grouped_heads():
    block_mask = flex_attention.create_block_mask(sliding_window, None, None, S, S, device="cpu", BLOCK_SIZE=4)
    mask = distances() <= -1
    mask &= distances() >= -3

    def f(q, k, v):
        return flex_attention.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True).pow(2).sum()

    def ref(q, k, v):
        return attention(q, k, v, mask=mask).pow(2).sum()

    check_flex(f, ref, qkv(kv_heads=1), (0, 1, 2))


def test_flex_attention_logsumexp_and_code():
    def f(q, k, v):
        out, aux = flex_attention.flex_attention(q, k, v, score_mod=causal, return_aux=flex_attention.AuxRequest(lse=True))
        return out.sum() + aux.lse.exp().sum()

    def ref(q, k, v):
        s = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -math.inf)
        return (s.softmax(-1) @ v).sum() + s.logsumexp(-1).exp().sum()

    q, k, v = qkv()
    close(fxtools.grad(f, q, k, v, argnums=(0, 1, 2))(q, k, v), torch.func.grad(ref, argnums=(0, 1, 2))(q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = fxtools.grad(lambda q, k, v: flex_attention.flex_attention(q, k, v).sum(), q, k, v).code
    # no mask and no score_mod: scores, softmax, product; nothing repeated, cast or masked
    assert not re.search(r"repeat_interleave|where|arange|\.to\(|functorch|flex", code), code
