"""JVPs inside training losses (consistency models, MeanFlow): ``torch.func.jvp``, ``torch.autograd.forward_ad``
and ``fxtools.jvp`` called in the function fxtools differentiates, traced into fxtools' own forward mode.

Seeded random programs: a small DiT-like network (time embedding, adaptive norm modulation,
LayerNorm or RMSNorm, attention in several variants, GELU or SiLU MLP, an optional label
embedding) inside a MeanFlow loss, with and without ``.detach()`` of the target, each JVP
spelling, differentiated by ``fxtools.grad``, ``fxtools.split`` and ``fxtools.compile``.

The oracle is ``torch.func.grad`` of the same loss spelt with ``torch.func.jvp`` in float64, with
the MATH attention kernel (the only one with a forward-mode formula on CPU). One exception, said
where it is used: PyTorch's reverse mode over its forward-mode formula of ``native_layer_norm``
drops the statistics' derivatives (their outputs are marked non-differentiable), so the gradient
of an undetached tangent through ``nn.LayerNorm`` is wrong in torch.func (off by 1e-2 here); those
programs are checked against central finite differences of the loss along random directions.
"""

from __future__ import annotations

import copy
import random
import re

import meanflow
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fxtools
from fxtools.codegen.fold import flat_code

TOL = dict(rtol=1e-9, atol=1e-10)


class Attention(nn.Module):
    """Self-attention: ``kind`` is "plain", "causal", "bool mask", "float mask" or "gqa" (2 query heads, 1 kv head)."""

    def __init__(self, d: int, kind: str):
        super().__init__()
        self.kind, self.heads = kind, 2
        kv = 1 if kind == "gqa" else 2
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv * (d // 2))
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, d // 2).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, -1, d // 2).permute(2, 0, 3, 1, 4)
        kwargs: dict = {"is_causal": True} if self.kind == "causal" else {}
        if self.kind == "gqa":
            kwargs["enable_gqa"] = True
        if self.kind == "bool mask":
            kwargs["attn_mask"] = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if self.kind == "float mask":
            kwargs["attn_mask"] = torch.arange(t, dtype=x.dtype, device=x.device).sub(t / 2).abs().neg()[None, :] * 0.3
        a = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return self.proj(a.transpose(1, 2).reshape(b, t, d))


class DiT(nn.Module):
    """Tokens ``z`` [b, t, 4] and times ``r``, ``t`` [b] (and labels ``y`` [b]) -> a velocity like ``z``."""

    def __init__(self, d=8, attention="plain", norm="layer", act="gelu", labels=False):
        super().__init__()
        self.norm_kind = norm
        self.inp = nn.Linear(4, d)
        self.time = nn.Sequential(nn.Linear(2, d), nn.SiLU(), nn.Linear(d, 2 * d))  # shift, scale
        self.label = nn.Embedding(5, d) if labels else None
        self.norm = nn.LayerNorm(d, elementwise_affine=False) if norm == "layer" else nn.RMSNorm(d)
        self.attn = Attention(d, attention) if attention != "none" else None
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU() if act == "gelu" else nn.SiLU(), nn.Linear(2 * d, d))
        self.out = nn.Linear(d, 4)

    def forward(self, z, r, t, y=None):
        c = self.time(torch.stack([r, t], -1))
        if self.label is not None:
            c = c + self.label(y).repeat(1, 2)
        shift, scale = c[:, None, :].chunk(2, dim=-1)
        x = self.inp(z)
        h = self.norm(x) * (1 + scale) + shift  # adaptive norm modulation
        if self.attn is not None:
            x = x + self.attn(h)
        x = x + self.mlp(self.norm(x))
        return self.out(x)


def meanflow_jvp(net, spelling, z, r, t, v, y=None):
    """``u, dudt`` of ``net`` at (z, r, t) along (v, 0, 1), spelt as the program under test does."""
    zeros, ones = torch.zeros_like(r), torch.ones_like(t)
    call = (lambda z, r, t: net(z, r, t, y)) if y is not None else net
    if spelling == "torch.func.jvp":
        return torch.func.jvp(call, (z, r, t), (v, zeros, ones))
    if spelling == "functional_call":
        params = dict(net.named_parameters())
        return torch.func.jvp(lambda z, t: torch.func.functional_call(net, params, (z, r, t, y)), (z, t), (v, ones))
    if spelling == "forward_ad":
        with fwAD.dual_level():
            out = call(fwAD.make_dual(z, v), r, fwAD.make_dual(t, ones))
            u, dudt = fwAD.unpack_dual(out)
        return u, dudt
    if spelling == "fxtools.jvp":
        return fxtools.jvp(call, z, r, t, argnums=(0, 2))(z, r, t, v, ones)
    raise KeyError(spelling)


class MeanFlowLoss(nn.Module):
    def __init__(self, net, spelling="torch.func.jvp", detach=True):
        super().__init__()
        self.net, self.spelling, self.detach = net, spelling, detach

    def forward(self, z, r, t, v, y=None):
        u, dudt = meanflow_jvp(self.net, self.spelling, z, r, t, v, y)
        target = v - (t - r)[:, None, None] * dudt
        if self.detach:
            target = target.detach()
        return (u - target).pow(2).mean()


def batch(seed, b=3, t=5, labels=False):
    g = torch.Generator().manual_seed(seed)
    r, tt = torch.rand(b, generator=g, dtype=torch.float64), torch.rand(b, generator=g, dtype=torch.float64)
    out = [torch.randn(b, t, 4, generator=g, dtype=torch.float64), torch.minimum(r, tt), torch.maximum(r, tt)]
    out.append(torch.randn(b, t, 4, generator=g, dtype=torch.float64))
    if labels:
        out.append(torch.randint(0, 5, (b,), generator=g))
    return tuple(out)


def random_program(seed):
    rnd = random.Random(seed)
    config = dict(
        d=rnd.choice([8, 12]),
        attention=rnd.choice(["plain", "causal", "bool mask", "float mask", "gqa", "none"]),
        norm=rnd.choice(["layer", "rms"]),
        act=rnd.choice(["gelu", "silu"]),
        labels=rnd.random() < 0.3,
    )
    spelling = rnd.choice(["torch.func.jvp", "functional_call", "forward_ad", "fxtools.jvp"])
    torch.manual_seed(seed)
    net = DiT(**config).double()
    return net, spelling, rnd.random() < 0.5, config


def oracle_grads(net, detach, args, exact: bool):
    """torch.func's gradient (MATH attention) of the loss spelt with torch.func.jvp; with
    ``exact=False`` (an undetached tangent through LayerNorm, see the module docstring) a function
    checking gradients against central differences along random directions instead."""
    ref = MeanFlowLoss(copy.deepcopy(net), "torch.func.jvp", detach)
    loss = fxtools.functional(ref)
    params = {k: p.detach() for k, p in ref.named_parameters()}
    if exact:
        with sdpa_kernel(SDPBackend.MATH):
            return torch.func.grad(loss)(params, *args)

    def check(grads):
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            d = {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in params.items()}
            eps = 1e-6
            with sdpa_kernel(SDPBackend.MATH):
                plus = loss({k: p + eps * d[k] for k, p in params.items()}, *args)
                minus = loss({k: p - eps * d[k] for k, p in params.items()}, *args)
            fd = (plus - minus) / (2 * eps)
            got = sum((grads[k] * d[k]).sum() for k in d)
            torch.testing.assert_close(got, fd, rtol=1e-6, atol=1e-7)

    return check


def assert_grads(got, want):
    if callable(want):
        want(got)
        return
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("seed", range(8))
def test_random_meanflow_programs_grad(seed):
    """fxtools.grad of random MeanFlow losses equals torch.func's gradient (float64)."""
    net, spelling, detach, config = random_program(seed)
    args = batch(seed, labels=config["labels"])
    loss_module = MeanFlowLoss(net, spelling, detach)
    loss = fxtools.functional(loss_module)
    params = {k: p.detach() for k, p in loss_module.named_parameters()}
    got = fxtools.grad(loss, params, *args)(params, *args)
    assert_grads(got, oracle_grads(net, detach, args, exact=detach or config["norm"] != "layer"))


@pytest.mark.parametrize("seed", [20, 21])
def test_random_meanflow_programs_split(seed):
    """fxtools.split's forward and backward give torch.func's value and gradient."""
    net, spelling, detach, config = random_program(seed)
    args = batch(seed, labels=config["labels"])
    loss_module = MeanFlowLoss(net, spelling, detach)
    loss = fxtools.functional(loss_module)
    params = {k: p.detach() for k, p in loss_module.named_parameters()}
    sp = fxtools.split(loss, params, *args)
    out, saved = sp.forward(*sp.flatten(params, *args))
    grads = sp.backward(*saved, torch.ones_like(out))
    with sdpa_kernel(SDPBackend.MATH):
        torch.testing.assert_close(out, loss(params, *args), **TOL)
    assert_grads(grads[0], oracle_grads(net, detach, args, exact=detach or config["norm"] != "layer"))


@pytest.mark.parametrize("detach", [True, False])
def test_meanflow_adamw_steps_fxtools_compile_equal_eager(detach):
    """Several AdamW steps with fxtools.compile equal eager (torch.func.jvp, MATH attention) within 1e-10."""
    torch.manual_seed(0)
    net = DiT(d=8, attention="causal", norm="rms" if not detach else "layer").double()
    eager, compiled = MeanFlowLoss(net, detach=detach), MeanFlowLoss(copy.deepcopy(net), detach=detach)
    step = fxtools.compile(compiled)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    for i in range(3):
        args = batch(100 + i)
        for m, run, opt in zip((eager, compiled), (eager, step), opts):
            opt.zero_grad()
            with sdpa_kernel(SDPBackend.MATH):
                run(*args).backward()
            opt.step()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


def test_meanflow_code_reads_like_the_rest():
    """The user's names, the primal computed once, no zeros for the tangent of ``r``."""
    torch.manual_seed(0)
    net = DiT(d=8, attention="plain").double()
    loss_module = meanflow.MeanFlowLoss(net)  # the loss, as examples/meanflow.py writes it
    loss = fxtools.functional(loss_module)
    params = {k: p.detach() for k, p in loss_module.named_parameters()}
    args = batch(0)
    gm = fxtools.grad(loss, params, *args)
    code = flat_code(gm)
    assert code.count("scaled_dot_product_attention(") == 1, code  # the primal once: the tangent reuses its probabilities
    assert "torch.zeros" not in code and "zeros_like" not in code, code
    for name in ("u", "dudt", "target"):
        assert f"\n    {name} = " in code, (name, code)
    assert "(u - target)" in gm.code, gm.code
    with sdpa_kernel(SDPBackend.MATH):
        assert_grads(gm(params, *args), torch.func.grad(loss)(params, *args))


def test_inductor_meanflow_step():
    """fxtools.compile(compiler="inductor") of the MeanFlow loss: the gradient of eager's (float64)."""
    torch.manual_seed(0)
    net = DiT(d=8, attention="causal").double()
    eager, compiled = MeanFlowLoss(net), MeanFlowLoss(copy.deepcopy(net))
    args = batch(7)
    with sdpa_kernel(SDPBackend.MATH):
        eager(*args).backward()
    fxtools.compile(compiled, compiler="inductor")(*args).backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_budget_policy():
    """Within policies.budget the gradients are still exact."""
    torch.manual_seed(0)
    net = DiT(d=8, attention="gqa").double()
    loss_module = MeanFlowLoss(net, detach=True)
    loss = fxtools.functional(loss_module)
    params = {k: p.detach() for k, p in loss_module.named_parameters()}
    args = batch(3)
    sp = fxtools.split(loss, params, *args, policy=fxtools.policies.budget(0.3))
    out, saved = sp.forward(*sp.flatten(params, *args))
    assert sp.budget_choice is not None and sp.saved_bytes <= sp.budget_choice.limit
    assert_grads(sp.backward(*saved, torch.ones_like(out))[0], oracle_grads(net, True, args, exact=True))


def test_torch_func_jvp_api_inside_grad():
    """Several primals, pytrees, has_aux, a closure over a tensor computed earlier, jvp of a jvp."""

    def loss(w, x, v):
        h = torch.tanh(x @ w)

        def f(pair, scale):
            out = torch.sin(pair["a"] * h) + pair["b"] @ w * scale
            return {"out": out}, out.sum().detach()

        primals = ({"a": x, "b": x}, torch.tensor(2.0, dtype=x.dtype))
        tangents = ({"a": v, "b": torch.zeros_like(x)}, torch.tensor(1.0, dtype=x.dtype))
        out, tan, aux = torch.func.jvp(f, primals, tangents, has_aux=True)
        second = torch.func.jvp(lambda x: torch.func.jvp(lambda y: (y * w[0]).exp(), (x,), (v,))[1], (x,), (v,))[1]
        return (out["out"] * tan["out"]).sum() + aux + second.sum()

    g = torch.Generator().manual_seed(0)
    w, x, v = (torch.randn(3, 3, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(fxtools.grad(loss, w, x, v)(w, x, v), torch.func.grad(loss)(w, x, v), **TOL)
    torch.testing.assert_close(fxtools.value_and_grad(loss, w, x, v)(w, x, v), torch.func.grad_and_value(loss)(w, x, v)[::-1])


def test_hvp_and_vjp_of_a_loss_with_a_jvp():
    def loss(w, x, v):
        u, du = torch.func.jvp(lambda x: torch.tanh(x @ w), (x,), (v,))
        return (u * du).sum()

    g = torch.Generator().manual_seed(1)
    w, x, v, dw = (torch.randn(3, 3, generator=g, dtype=torch.float64) for _ in range(4))
    want = torch.func.jvp(lambda w: torch.func.grad(loss)(w, x, v), (w,), (dw,))[1]
    torch.testing.assert_close(fxtools.hvp(loss, w, x, v)(w, x, v, dw), want, **TOL)
    out, (gw,) = fxtools.vjp(loss, w, x, v, argnums=(0,))(w, x, v, torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(gw, torch.func.grad(loss)(w, x, v), **TOL)


def test_dropout_inside_the_jvp_applies_the_primal_mask():
    """Dropout and attention dropout (GQA, causal) between a JVP's primals and outputs: one draw, as
    eager PyTorch draws it, whose mask the tangent applies too; equal to torch.func under the same
    seed, through fxtools.grad and fxtools.compile (its fused rules)."""
    b, t = 2, 5

    def attention(x, w, wk):
        q = (x @ w).view(b, t, 2, 2).transpose(1, 2)
        k = (x @ wk).view(b, t, 1, 2).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, k * 2, dropout_p=0.3, enable_gqa=True, is_causal=True)
        return F.dropout(a.transpose(1, 2).reshape(b, t, 4), 0.5, training=True)

    def loss(w, wk, x, v):
        u, du = torch.func.jvp(lambda x: attention(x, w, wk), (x,), (v,))
        return (u * du).sum() + F.dropout(u, 0.2).pow(2).sum()

    g = torch.Generator().manual_seed(0)
    w, wk = torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64)
    x, v = (torch.randn(b, t, 4, generator=g, dtype=torch.float64) for _ in range(2))
    gm = fxtools.grad(loss, w, wk, x, v)
    code = flat_code(gm)
    assert len(re.findall(r"bernoulli_?\(", code)) == 3, code  # one draw per dropout: the tangent reads the primal's mask
    torch.manual_seed(5)
    got = gm(w, wk, x, v)
    with sdpa_kernel(SDPBackend.MATH):
        torch.manual_seed(5)
        want = torch.func.grad(loss)(w, wk, x, v)
    torch.testing.assert_close(got, want, **TOL)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.wk = nn.Parameter(w.clone()), nn.Parameter(wk.clone())

        def forward(self, x, v):
            return loss(self.w, self.wk, x, v)

    module = Loss()
    torch.manual_seed(5)
    fxtools.compile(module)(x, v).backward()
    torch.testing.assert_close(module.w.grad, want, **TOL)


def test_batch_norm_in_training_inside_the_jvp():
    """The JVP differentiates through the batch's statistics; the running statistics are updated once
    (by the program's own call). PyTorch's reverse over its forward-mode formula drops the statistics'
    second-order terms (as for LayerNorm, module docstring): checked against central differences."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4).double()

    def loss(w, x, v):
        with fwAD.dual_level():
            u, du = fwAD.unpack_dual(bn(torch.tanh(fwAD.make_dual(x, v) @ w)))
        return (u * du).sum()

    g = torch.Generator().manual_seed(1)
    w, x, v, d = (torch.randn(4, 4, generator=g, dtype=torch.float64) for _ in range(4))
    got = fxtools.grad(loss, w, x, v)(w, x, v)
    once = bn.running_mean.clone()
    bn.reset_running_stats()
    loss(w, x, v)
    torch.testing.assert_close(once, bn.running_mean, rtol=0, atol=1e-15)
    eps = 1e-6
    fd = (loss(w + eps * d, x, v) - loss(w - eps * d, x, v)) / (2 * eps)
    torch.testing.assert_close((got * d).sum(), fd, rtol=1e-6, atol=1e-8)


def test_random_draws_without_a_mask_inside_the_jvp():
    """A draw of the primal's values alone (``torch.normal(mean)``) has a zero tangent; a random op whose
    tangent needs its draw (``rrelu``'s slopes) is refused at build time naming the op and the line."""

    def noisy(w, x, v):
        u, du = torch.func.jvp(lambda x: torch.normal(x @ w, 1.0) + x, (x,), (v,))
        return (u * du).sum()

    def rrelu(w, x, v):
        u, du = torch.func.jvp(lambda x: F.rrelu(x @ w, training=True), (x,), (v,))
        return (u * du).sum()

    w = torch.randn(3, 3, dtype=torch.float64)
    torch.manual_seed(2)
    got = fxtools.grad(noisy, w, w, w)(w, w, w)
    torch.manual_seed(2)
    torch.testing.assert_close(got, torch.func.grad(noisy)(w, w, w), **TOL)
    with pytest.raises(fxtools.FxtoolsError, match=r"rrelu.*F.rrelu\(x @ w, training=True\)"):
        fxtools.grad(rrelu, w, w, w)


def test_backend_of_a_jvp_loss():
    """torch.compile(backend=fxtools.backend()) where Dynamo hands over the graph (a function of a Linear)."""
    lin = nn.Linear(4, 4).double()

    def step(x, t):
        with fwAD.dual_level():
            u, du = fwAD.unpack_dual(torch.tanh(lin(fwAD.make_dual(x, t))))
        v, dv = torch.func.jvp(lambda x: torch.tanh(lin(x)), (x,), (t,))
        return (u * du).sum() + (v - dv.detach()).pow(2).mean()

    g = torch.Generator().manual_seed(2)
    x, t = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(step(x, t), list(lin.parameters()))
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(step, backend=fxtools.backend())(x, t), list(lin.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_a_function_with_its_own_jvp_inside_the_jvp_is_refused():
    """Its jvp would be ignored (fxtools transposes its backward): refused, as fxtools.jvp refuses it."""

    class Sin(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x.sin()

        @staticmethod
        def setup_context(ctx, inputs, out):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            return g * ctx.saved_tensors[0].cos()

        @staticmethod
        def jvp(ctx, t):
            return t * 2

    def loss(x, v):
        u, du = torch.func.jvp(Sin.apply, (x,), (v,))
        return (u * du).sum()

    with pytest.raises(fxtools.FxtoolsError, match="defines its own jvp"):
        fxtools.grad(loss, torch.randn(3), torch.randn(3))


def test_flex_attention_with_score_mod_and_block_mask_inside_the_jvp():
    """flex_attention (score_mod, causal block mask) in the JVP'd function, against the same attention
    written densely under torch.func (which has no forward mode for flex_attention)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, h, t, d = 2, 2, 8, 4
    block_mask = create_block_mask(lambda b_, h_, q, k: q >= k, None, None, t, t, device="cpu")

    def attention(x, w, flex):
        q = (x @ w).view(b, t, h, d).transpose(1, 2)
        if flex:
            a = flex_attention(q, q, q, score_mod=lambda s, b_, h_, i, j: s + 0.1 * (i - j), block_mask=block_mask)
        else:
            i = torch.arange(t)
            s = q @ q.transpose(-1, -2) / d**0.5 + 0.1 * (i[:, None] - i[None, :])
            a = s.masked_fill(i[:, None] < i[None, :], float("-inf")).softmax(-1) @ q
        return a.transpose(1, 2).reshape(b, t, h * d)

    def loss(w, x, v, flex=True):
        u, dudt = torch.func.jvp(lambda x: attention(x, w, flex), (x,), (v,))
        return (u * dudt).sum()

    g = torch.Generator().manual_seed(0)
    w, x, v = torch.randn(8, 8, generator=g), torch.randn(b, t, 8, generator=g), torch.randn(b, t, 8, generator=g)
    w, x, v = w.double(), x.double(), v.double()
    want = torch.func.grad(lambda w, x, v: loss(w, x, v, flex=False))(w, x, v)
    torch.testing.assert_close(fxtools.grad(loss, w, x, v)(w, x, v), want, **TOL)


def test_jvp_of_a_loss_with_a_jvp_and_dynamic_sizes():
    """fxtools.jvp of such a loss (forward over forward), and a batch size marked dynamic."""
    from torch.export import Dim

    def loss(w, x, v):
        u, dudt = torch.func.jvp(lambda x: torch.tanh(x @ w), (x,), (v,))
        return (u * dudt).sum()

    g = torch.Generator().manual_seed(3)
    w, x, v, dw = (torch.randn(s, 3, generator=g, dtype=torch.float64) for s in (3, 4, 4, 3))
    got = fxtools.jvp(loss, w, x, v)(w, x, v, dw, torch.zeros_like(x), torch.zeros_like(v))[1]
    torch.testing.assert_close(got, torch.func.jvp(lambda w: loss(w, x, v), (w,), (dw,))[1], **TOL)
    b = Dim("b")
    gm = fxtools.grad(loss, w, x, v, dynamic_shapes=(None, {0: b}, {0: b}))
    x6, v6 = torch.randn(6, 3, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(gm(w, x6, v6), torch.func.grad(loss)(w, x6, v6), **TOL)


def test_backend_of_the_meanflow_loss_under_the_math_kernel():
    """Dynamo runs PyTorch's forward mode on fake tensors while it traces, so it needs an attention
    kernel with a forward-mode formula (MATH); the graph it hands over gets fxtools' own."""
    torch.manual_seed(0)
    net = DiT(d=8, attention="causal").double()
    eager, compiled = meanflow.MeanFlowLoss(net), meanflow.MeanFlowLoss(copy.deepcopy(net))
    args = batch(5)
    torch._dynamo.reset()
    step = torch.compile(compiled, backend=fxtools.backend())
    with sdpa_kernel(SDPBackend.MATH):
        eager(*args).backward()
        step(*args).backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_zero_tangents_of_parameters_are_no_tangents():
    """Parameters passed as primals with ``zeros_like`` tangents (the issue's functional MLP): no
    product with zeros, no zeros in the code, the forward once."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4)).double()

    def loss(params, x, v):
        zeros = {k: torch.zeros_like(p) for k, p in params.items()}
        u, dudt = torch.func.jvp(lambda p, x: torch.func.functional_call(mlp, p, (x,)), (params, x), (zeros, v))
        return (u - dudt.detach()).pow(2).mean()

    params = {k: p.detach() for k, p in mlp.named_parameters()}
    g = torch.Generator().manual_seed(4)
    x, v = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    gm = fxtools.grad(loss, params, x, v)
    code = flat_code(gm)
    assert "zeros" not in code and code.count("torch.tanh(") == 1, code
    assert_grads(gm(params, x, v), torch.func.grad(loss)(params, x, v))


def test_a_jvp_inside_no_grad_is_a_constant_and_not_merged_with_its_twin_outside():
    """The JVP's copy of ``x @ w`` inside ``no_grad`` and the loss's own outside are the same op on the
    same values, but only the outside one carries a gradient: merging them (common subexpressions
    across grad modes) made the whole loss a constant, a gradient of 0."""

    def loss(w, x, v):
        with torch.no_grad():
            u, du = torch.func.jvp(lambda x: torch.tanh(x @ w), (x,), (v,))
        return (torch.tanh(x @ w) - du).pow(2).sum() + (x @ w * u).sum()

    g = torch.Generator().manual_seed(3)
    w, x, v = (torch.randn(3, 3, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(fxtools.grad(loss, w, x, v)(w, x, v), torch.func.grad(loss)(w, x, v), **TOL)


def test_fxtools_jvp_inside_a_loss_torch_compile_traces():
    """``fxtools.jvp`` called in a loss that ``torch.compile(backend=fxtools.backend())`` compiles: Dynamo
    traced into fxtools' own capture and failed (an AttributeError from make_fx's internals); it is
    traced as ``torch.func.jvp``, whose markers the backend computes."""
    g = torch.Generator().manual_seed(4)
    w, x, v = (torch.randn(3, 3, generator=g, dtype=torch.float64) for _ in range(3))

    def loss(w, x, v):
        out, tan = fxtools.jvp(lambda x, s: torch.sin(x @ w) * s, x, 2.0, argnums=0)(x, 2.0, v)
        return (out * tan).sum()

    torch._dynamo.reset()
    want = torch.autograd.grad(loss(w.requires_grad_(), x, v), w)[0]
    w2 = w.detach().clone().requires_grad_()
    got = torch.autograd.grad(torch.compile(loss, backend=fxtools.backend())(w2, x, v), w2)[0]
    torch.testing.assert_close(got, want, **TOL)
