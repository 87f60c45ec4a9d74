"""Composable transforms (float64, against torch.func): jvp, hvp, hessian, vmap, per-sample
gradients, custom_vjp, autograd.Function, the op log."""

import pytest
import torch
import torch.nn.functional as F

import fxtools
from fxtools.cli import examples
from fxtools.graph.nodes import count_compute_nodes

TOL = dict(rtol=1e-10, atol=1e-10)


pytestmark = pytest.mark.usefixtures("float64")


def close(a, b):
    torch.testing.assert_close(a, b, **TOL)


def model_case(name):
    """(loss_fn, params, inputs) for the MLP, the CNN (eval mode) and the tiny GPT."""
    if name == "mlp":
        model, inputs = examples.mlp(activation="gelu")
    elif name == "cnn":
        model, inputs = examples.small_cnn()
        model.eval()
    else:
        # torch.func has no forward-mode rule for scaled_dot_product_attention (the reference)
        model, inputs = examples.gpt("tiny", attention="explicit", seq_len=4)
    loss, args = examples.as_loss(model, inputs)
    return loss, args[0], args[1:]


def random_like(tree, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in tree.items()}


MODELS = ["mlp", "cnn", "gpt"]


# ------------------------------------------------------------------ jvp


def test_jvp_sin_plus_x_is_small_and_correct():
    fn, (x,) = examples.sin_plus_x()
    gm = fxtools.jvp(fn, x)
    assert count_compute_nodes(gm) <= 5, gm.code  # sin, add; cos, mul, add
    assert "cos" in gm.code and "grad" not in gm.code, gm.code
    t = torch.randn_like(x)
    out, tan = gm(x, t)
    want_out, want_tan = torch.func.jvp(fn, (x,), (t,))
    close(out, want_out)
    close(tan, want_tan)


def test_jvp_of_sin_reads_cos_times_tangent():
    gm = fxtools.jvp(torch.sin, torch.randn(3))
    assert count_compute_nodes(gm) == 3, gm.code  # sin, cos, mul
    assert "torch.cos(" in gm.code


def test_jvp_pytrees_and_non_float_outputs():
    def f(d, k):
        m, i = torch.max(d["a"] @ d["b"], 1)
        return {"m": m * k, "i": i}

    d = {"a": torch.randn(4, 3), "b": torch.randn(3, 5)}
    t = {"a": torch.randn(4, 3), "b": torch.randn(3, 5)}
    gm = fxtools.jvp(f, d, 2.0)
    out, tan = gm(d, 2.0, t, None)
    want_out, want_tan = torch.func.jvp(lambda d: f(d, 2.0)["m"], (d,), (t,))
    close(out["m"], want_out)
    close(tan["m"], want_tan)
    assert tan["i"] is None and torch.equal(out["i"], f(d, 2.0)["i"])


@pytest.mark.parametrize("name", MODELS)
def test_jvp_models_match_torch_func(name):
    loss, params, inputs = model_case(name)
    tangents = random_like(params)
    gm = fxtools.jvp(loss, params, *inputs)
    no_tangents = [torch.zeros_like(x) if x.is_floating_point() else None for x in inputs]
    out, tan = gm(params, *inputs, tangents, *no_tangents)
    want_out, want_tan = torch.func.jvp(lambda p: loss(p, *inputs), (params,), (tangents,))
    close(out, want_out)
    close(tan, want_tan)


def test_jvp_under_the_fused_rules_matches_torch_func():
    """jvp differentiates a VJP again: it uses the readable rules, as hvp does (the fused set's CPU
    flash-attention backward kernel has no derivative: was a MissingRuleError)."""

    def block(q, k, v, w):
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.gelu(F.layer_norm(h, (4,), w)).sum()

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=g) for _ in range(3)]
    args.append(torch.randn(4, dtype=torch.float64, generator=g))
    tangents = [torch.randn_like(a) for a in args]
    with fxtools.rule_set("fused"):
        gm = fxtools.jvp(block, *args)
    out, tan = gm(*args, *tangents)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):  # CPU flash attention has no forward AD in PyTorch
        want_out, want_tan = torch.func.jvp(block, tuple(args), tuple(tangents))
    close(out, want_out)
    close(tan, want_tan)


def test_jvp_of_grad_module():
    def f(x):
        return (torch.sin(x) * x).sum()

    x, v = torch.randn(5), torch.randn(5)
    g = fxtools.grad(f, x)
    gm = fxtools.jvp(g, x)
    _, tan = gm(x, v)
    close(tan, torch.func.jvp(torch.func.grad(f), (x,), (v,))[1])


# ------------------------------------------------------------------ higher order


def test_grad_of_grad():
    def f(x):
        return torch.tanh(x).pow(3).sum()

    x = torch.randn(4)
    g = fxtools.grad(f, x)
    gg = fxtools.grad(lambda x: g(x).sum(), x)
    close(gg(x), torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(x))


def test_hvp_and_hessian_of_small_function():
    def f(x):
        return (torch.sin(x) * x).sum()

    x, v = torch.randn(4), torch.randn(4)
    hv = fxtools.hvp(f, x)
    close(hv(x, v), torch.func.jvp(torch.func.grad(f), (x,), (v,))[1])
    H = fxtools.hessian(f, x)
    close(H(x), torch.func.hessian(f)(x))


@pytest.mark.parametrize("name", MODELS)
def test_hvp_models_match_torch_func(name):
    loss, params, inputs = model_case(name)
    v = random_like(params, seed=1)
    gm = fxtools.hvp(loss, params, *inputs)
    got = gm(params, *inputs, v)
    want = torch.func.jvp(lambda p: torch.func.grad(loss)(p, *inputs), (params,), (v,))[1]
    assert set(got) == set(want)
    for k in want:
        close(got[k], want[k])


def test_hvp_gpt_sdpa_matches_reverse_over_reverse():
    model, inputs = examples.gpt("tiny", attention="sdpa", seq_len=4)
    loss, (params, *inputs) = examples.as_loss(model, inputs)
    v = random_like(params, seed=2)
    got = fxtools.hvp(loss, params, *inputs)(params, *inputs, v)
    # torch cannot differentiate sdpa twice: the reference is the same model with explicit attention
    reference, _ = examples.gpt("tiny", attention="explicit", seq_len=4)
    ref_loss = fxtools.functional(reference)
    want = torch.func.jvp(lambda p: torch.func.grad(ref_loss)(p, *inputs), (params,), (v,))[1]
    for k in want:
        close(got[k], want[k])


HESSIAN_PARAMS = {
    "mlp": None,
    "cnn": ["fc.weight", "fc.bias", "bn2.weight"],
    "gpt": ["transformer.ln_f.weight", "transformer.h.1.mlp.c_proj.bias"],
}


@pytest.mark.parametrize("name", MODELS)
def test_hessian_models_match_torch_func(name):
    loss, params, inputs = model_case(name)
    keys = HESSIAN_PARAMS[name] or list(params)
    sub = {k: params[k] for k in keys}
    rest = {k: v for k, v in params.items() if k not in sub}

    def f(sub, *inputs):
        return loss({**rest, **sub}, *inputs)

    H = fxtools.hessian(f, sub, *inputs)(sub, *inputs)
    if name != "gpt":
        want = torch.func.hessian(f)(sub, *inputs)
    else:
        # torch.func.hessian (and jacrev of jacrev) give a wrong, non-symmetric block
        # H[ln_f.weight][c_proj.bias] on this model (finite differences of the exact gradient agree
        # with fxtools to 1e-11); the reference is torch.func.jvp(grad) on each basis vector.
        want = {i: {} for i in keys}
        for j in keys:
            for b in range(sub[j].numel()):
                e = {k: torch.zeros_like(x) for k, x in sub.items()}
                e[j].view(-1)[b] = 1
                col = torch.func.jvp(lambda s: torch.func.grad(f)(s, *inputs), (sub,), (e,))[1]
                for i in keys:
                    want[i].setdefault(j, torch.zeros(*sub[i].shape, *sub[j].shape))
                    want[i][j].view(sub[i].numel(), -1)[:, b] = col[i].reshape(-1)
    for i in keys:
        for j in keys:
            close(H[i][j], want[i][j])


# ------------------------------------------------------------------ vmap


def test_vmap_is_batched_code():
    def f(x, w):
        return torch.tanh(x @ w)

    x, w = torch.randn(6, 3), torch.randn(3, 2)
    gm = fxtools.vmap(f, x, w, in_dims=(0, None))
    assert "for " not in gm.code and count_compute_nodes(gm) <= 3, gm.code
    close(gm(x, w), torch.func.vmap(f, in_dims=(0, None))(x, w))


def test_vmap_out_dims():
    def f(x):
        return x.sum(0), x * 2

    x = torch.randn(3, 4, 5)
    gm = fxtools.vmap(f, x, in_dims=1, out_dims=(0, 1))
    for a, b in zip(gm(x), torch.func.vmap(f, in_dims=1, out_dims=(0, 1))(x)):
        close(a, b)


@pytest.mark.parametrize("name", MODELS)
def test_per_sample_gradients_match_torch_func(name):
    loss, params, inputs = model_case(name)

    def per_example(params, *example):
        return loss(params, *[e.unsqueeze(0) for e in example])

    firsts = [e[0] for e in inputs]
    g = fxtools.grad(per_example, params, *firsts)
    in_dims = (None,) + (0,) * len(inputs)
    gm = fxtools.vmap(g, params, *inputs, in_dims=in_dims)
    got = gm(params, *inputs)
    want = torch.func.vmap(torch.func.grad(per_example), in_dims=in_dims)(params, *inputs)
    for k in want:
        assert got[k].shape == (inputs[0].shape[0], *params[k].shape)
        close(got[k], want[k])


def test_grad_of_vmap():
    def f(x, w):
        return torch.sin(x @ w)

    x, w = torch.randn(6, 3), torch.randn(3, 2)
    vm = fxtools.vmap(f, x, w, in_dims=(0, None))
    g = fxtools.grad(lambda x, w: vm(x, w).sum(), x, w, argnums=1)
    close(g(x, w), torch.func.grad(lambda w: torch.func.vmap(f, in_dims=(0, None))(x, w).sum())(w))


def test_vmap_of_data_dependent_code_names_the_line():
    def f(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(fxtools.FxtoolsError, match="test_transforms.py"):
        fxtools.vmap(f, torch.randn(3, 2))


@pytest.mark.parametrize("norm", ["layer", "batch"])
def test_hvp_through_normalisation_statistics(norm):
    """Generated backward code reads the mean/rstd outputs of native_layer_norm/batch_norm:
    differentiating it again needs their cotangents (a silent error before)."""
    w, b = torch.randn(4), torch.randn(4)
    if norm == "layer":

        def f(x):
            return (F.layer_norm(x, (4,), w, b) ** 3).sum()
    else:

        def f(x):
            return (F.batch_norm(x, None, None, w, b, training=True) ** 3).sum()

    x, v = torch.randn(5, 4), torch.randn(5, 4)
    close(fxtools.hvp(f, x)(x, v), torch.func.jvp(torch.func.grad(f), (x,), (v,))[1])


# ------------------------------------------------------------------ op log


def test_log_prints_ops_with_shapes(capsys):
    fn, (x,) = examples.sin_plus_x()
    out = fxtools.log(fn)(x)
    close(out, fn(x))
    text = capsys.readouterr().out
    assert "aten.sin.default(t0)" in text and "f64[13]" in text, text
    gm = fxtools.vjp(fn, x)
    out, (g,) = fxtools.log(gm)(x, torch.ones_like(x))
    text = capsys.readouterr().out
    assert "sin: f64[13] = torch.sin(x)" in text and "grad_x: f64[13]" in text, text


def test_jvp_of_an_embedding_with_padding_is_the_derivative_of_its_forward():
    """PyTorch's embedding gradient skips the padding row; its forward does not, and neither do
    torch.func.jvp nor fxtools.jvp (padding_idx and scale_grad_by_freq only shape the gradient)."""
    w = torch.randn(10, 3, dtype=torch.float64)
    i = torch.tensor([[1, 2, 2, 5]])
    for kwargs in ({"padding_idx": 1}, {"padding_idx": 2, "scale_grad_by_freq": True}):

        def f(w):
            return torch.nn.functional.embedding(i, w, **kwargs)

        t = torch.randn_like(w)
        out, tangent = fxtools.jvp(f, w)(w, t)
        value, want = torch.func.jvp(f, (w,), (t,))
        torch.testing.assert_close(out, value, rtol=0, atol=0)
        torch.testing.assert_close(tangent, want, rtol=0, atol=0)


# ------------------------------------------------------------------ second order through tanh


def _tanh_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    )
    x, y = torch.randn(7, 4), torch.randn(7, 3)
    f = fxtools.functional(model)

    def loss(params, x, y):
        return ((f(params, x) - y) ** 2).mean()  # torch.func.jvp of grad of F.mse_loss raises (ZeroTensor)

    return loss, {k: v.detach() for k, v in model.named_parameters()}, (x, y)


def _hf_gpt2():
    """Hugging Face GPT-2 from a tiny config, random weights (its MLP's ``gelu_new`` uses tanh)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=31,
        n_positions=8,
        n_embd=8,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config).double().eval()
    ids = torch.randint(0, 31, (2, 5), generator=torch.Generator().manual_seed(1))
    f = fxtools.functional(model)

    def loss(params, ids):
        logits = f(params, input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    return loss, {k: v.detach() for k, v in model.named_parameters()}, (ids,)


SECOND_ORDER = {"tanh_mlp": _tanh_mlp, "hf_gpt2": _hf_gpt2}


def test_hvp_of_tanh_of_a_product():
    """Crashed with 'Tried to erase Node mul_5 but it still had 1 users' (the addcmul fusion)."""

    def f(x, w):
        return torch.tanh(x @ w).pow(2).sum()

    x, w, v = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 4)
    got = fxtools.hvp(f, x, w)(x, w, v)
    close(got, torch.func.jvp(lambda x: torch.func.grad(f)(x, w), (x,), (v,))[1])


def test_jvp_does_not_fuse_into_addcmul_which_rounds_once():
    """``a + b * c`` is not ``torch.addcmul(a, b, c)``: PyTorch's kernel may round once (fused
    multiply-add) and stays finite where ``b * c`` overflows. Forward values are eager's, bit for bit."""

    def f(a, b, c):
        return a + b * c

    a = torch.tensor([-3e38, 1.0], dtype=torch.float32)
    b = torch.tensor([2e19, 1 + 2**-20], dtype=torch.float32)
    c = torch.tensor([2e19, 1 + 2**-22], dtype=torch.float32)
    gm = fxtools.jvp(f, a, b, c)
    assert "addcmul" not in gm.code, gm.code
    out, tangent = gm(a, b, c, torch.ones_like(a), torch.ones_like(a), torch.ones_like(a))
    assert torch.equal(out, f(a, b, c)), (out, f(a, b, c))
    assert torch.isinf(out[0])
    torch.testing.assert_close(tangent, torch.func.jvp(f, (a, b, c), (torch.ones_like(a),) * 3)[1])


@pytest.mark.parametrize("name", list(SECOND_ORDER))
def test_second_order_through_tanh_matches_torch_func(name):
    """jvp, hvp and hessian of a tanh MLP and of Hugging Face GPT-2 (float64) against torch.func."""
    loss, params, inputs = SECOND_ORDER[name]()
    t = random_like(params, seed=3)

    no_tangents = [torch.zeros_like(x) if x.is_floating_point() else None for x in inputs]
    out, tan = fxtools.jvp(loss, params, *inputs)(params, *inputs, t, *no_tangents)
    want_out, want_tan = torch.func.jvp(lambda p: loss(p, *inputs), (params,), (t,))
    close(out, want_out)
    close(tan, want_tan)

    got = fxtools.hvp(loss, params, *inputs)(params, *inputs, t)
    want = torch.func.jvp(lambda p: torch.func.grad(loss)(p, *inputs), (params,), (t,))[1]
    assert set(got) == set(want)
    for k in want:
        close(got[k], want[k])

    keys = [k for k in params if k.endswith("bias")][-2:]  # a Hessian block small enough to compare
    sub, rest = {k: params[k] for k in keys}, {k: v for k, v in params.items() if k not in keys}

    def f(sub, *inputs):
        return loss({**rest, **sub}, *inputs)

    H = fxtools.hessian(f, sub, *inputs)(sub, *inputs)
    # reference: torch.func.jvp of grad along every basis vector (jacfwd of jacrev, column by column)
    for j in keys:
        for b in range(sub[j].numel()):
            e = {k: torch.zeros_like(x) for k, x in sub.items()}
            e[j].view(-1)[b] = 1
            col = torch.func.jvp(lambda s: torch.func.grad(f)(s, *inputs), (sub,), (e,))[1]
            for i in keys:
                close(H[i][j].reshape(sub[i].numel(), -1)[:, b], col[i].reshape(-1))
