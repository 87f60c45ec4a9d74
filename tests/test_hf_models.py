"""Real models from the ecosystem: Hugging Face ``transformers`` models built from tiny configs
with random weights (nothing is downloaded), differentiated by fxtools and compared, parameter
by parameter, with eager autograd.

The eager reference runs on a deep copy of the model made before fxtools sees it, so buffers
(BatchNorm's running statistics) can be compared after one call each. Tolerances: float32
rtol 1e-4 / atol 1e-6; float64 rtol 1e-9 / atol 1e-11, except where the model itself computes in
float32 (see FLOAT32_SOFTMAX).
"""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

import fxtools  # noqa: E402
from fxtools.errors import FxtoolsError  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-6), torch.float64: dict(rtol=1e-9, atol=1e-11)}
VOCAB, BATCH, SEQ = 97, 2, 7
ATTENTION = ["eager", "sdpa"]
DTYPES = [torch.float32, torch.float64]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _ids(seed=1, seq=SEQ):
    return torch.randint(0, VOCAB, (BATCH, seq), generator=_gen(seed))


# --------------------------------------------------------------------------------------------
# Losses. ``f`` is ``fxtools.functional(model)``; every loss returns a scalar tensor.
# --------------------------------------------------------------------------------------------


def next_token_loss(f, params, input_ids, labels, attention_mask=None):
    """Causal-LM cross-entropy computed from the logits in the model's dtype.

    The models' own ``labels=`` loss upcasts the logits to float32 (a float64 model then gets a
    float32 loss), so float64 cases use this equivalent loss instead.
    """
    logits = f(params, input_ids=input_ids, attention_mask=attention_mask).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def hf_loss(f, params, *inputs, keys):
    """The model's own loss: ``model(**inputs, labels=...).loss`` (a ModelOutput field)."""
    return f(params, **dict(zip(keys, inputs))).loss


# --------------------------------------------------------------------------------------------
# Tiny configs. Each builder returns (model, loss(f, params, *inputs), inputs); dropout is 0.
# --------------------------------------------------------------------------------------------


class _Later:
    """``later.Name(...)`` calls ``transformers.Name(...)``, looked up then: collecting the tests
    imports no model's module (transformers imports each on first use, a second or more each)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: getattr(transformers, name)(*args, **kwargs)


later = _Later()


def _causal_lm(model_cls, config_cls, **config):
    def build(attention, dtype):
        model = model_cls(config_cls(vocab_size=VOCAB, attn_implementation=attention, **config))
        labels = _ids()
        labels[0, :3] = -100  # ignored positions
        if dtype == torch.float64:
            return model, next_token_loss, (_ids(), labels)
        return model, lambda f, p, *a: hf_loss(f, p, *a, keys=("input_ids", "labels")), (_ids(), labels)

    return build


_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=0.0,
)

gpt2 = _causal_lm(
    later.GPT2LMHeadModel,
    later.GPT2Config,
    n_positions=32,
    n_embd=32,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
llama = _causal_lm(later.LlamaForCausalLM, later.LlamaConfig, **_DECODER)
mistral = _causal_lm(later.MistralForCausalLM, later.MistralConfig, sliding_window=4, **_DECODER)
qwen2 = _causal_lm(later.Qwen2ForCausalLM, later.Qwen2Config, **_DECODER)
opt = _causal_lm(
    later.OPTForCausalLM,
    later.OPTConfig,
    hidden_size=32,
    ffn_dim=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    word_embed_proj_dim=32,
    dropout=0.0,
    attention_dropout=0.0,
)


def _moe(model_cls, config_cls, **config):
    """A mixture-of-experts decoder; the float32 loss (the model's own) adds the router's load-balancing loss.

    transformers' ``grouped_mm`` experts call ``torch._grouped_mm`` in eager mode (while fxtools
    traces, ``torch.compiler.is_compiling()`` makes float32 take its ``grouped_mm_fallback`` op);
    the CPU kernel has no float64, so float64 cases use the ``batched_mm`` experts (``bmm``).
    """

    def build(attention, dtype):
        experts = "grouped_mm" if dtype == torch.float32 else "batched_mm"
        return _causal_lm(
            model_cls, config_cls, experts_implementation=experts, output_router_logits=True, num_experts_per_tok=2, **config
        )(attention, dtype)

    return build


mixtral = _moe(later.MixtralForCausalLM, later.MixtralConfig, num_local_experts=4, **_DECODER)
qwen2_moe = _moe(
    later.Qwen2MoeForCausalLM,
    later.Qwen2MoeConfig,
    num_experts=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    **_DECODER,
)
stablelm = _causal_lm(later.StableLmForCausalLM, later.StableLmConfig, **_DECODER)

_BERT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def bert_mlm(attention, dtype):
    model = transformers.BertForMaskedLM(transformers.BertConfig(attn_implementation=attention, **_BERT))
    ids = _ids()
    labels = torch.full_like(ids, -100)
    labels[:, [1, 4, 5]] = ids[:, [1, 4, 5]]  # predict three masked positions
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding
    keys = ("input_ids", "attention_mask", "labels")
    return model, lambda f, p, *a: hf_loss(f, p, *a, keys=keys), (ids, mask, labels)


def bert_classifier(attention, dtype):
    model = transformers.BertForSequenceClassification(
        transformers.BertConfig(attn_implementation=attention, num_labels=3, **_BERT)
    )
    token_types = torch.tensor([[0] * 4 + [1] * (SEQ - 4)] * BATCH)
    keys = ("input_ids", "token_type_ids", "labels")
    return model, lambda f, p, *a: hf_loss(f, p, *a, keys=keys), (_ids(), token_types, torch.tensor([0, 2]))


def _seq2seq(model_cls, config_cls, **config):
    def build(attention, dtype):
        model = model_cls(config_cls(vocab_size=VOCAB, attn_implementation=attention, **config))
        keys = ("input_ids", "labels")
        return model, lambda f, p, *a: hf_loss(f, p, *a, keys=keys), (_ids(), _ids(seed=2, seq=5))

    return build


bart = _seq2seq(
    later.BartForConditionalGeneration,
    later.BartConfig,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)
t5 = _seq2seq(
    later.T5ForConditionalGeneration,
    later.T5Config,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    dropout_rate=0.0,
    decoder_start_token_id=0,
    pad_token_id=0,
)


def _images(dtype, size):
    x = torch.randn(BATCH, 3, size, size, generator=_gen(3), dtype=dtype)
    keys = ("pixel_values", "labels")
    return (lambda f, p, *a: hf_loss(f, p, *a, keys=keys)), (x, torch.tensor([1, 3]))


def vit(attention, dtype):
    model = transformers.ViTForImageClassification(
        transformers.ViTConfig(
            image_size=16,
            patch_size=4,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=5,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation=attention,
        )
    )
    return (model, *_images(dtype, 16))


def resnet(attention, dtype):
    """A two-stage ResNet: convolutions, BatchNorm, residual connections, pooling."""
    model = transformers.ResNetForImageClassification(
        transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5)
    )
    return (model, *_images(dtype, 32))


MODELS = {
    "gpt2": gpt2,
    "llama": llama,
    "bert_mlm": bert_mlm,
    "bert_classifier": bert_classifier,
    "mistral": mistral,
    "qwen2": qwen2,
    "opt": opt,
    "bart": bart,
    "t5": t5,
    "vit": vit,
    "resnet": resnet,
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "stablelm": stablelm,
}
# Eager attention of these models takes the softmax in float32 whatever the model's dtype
# (``softmax(..., dtype=torch.float32)``), so in float64 both gradients carry float32 rounding.
FLOAT32_SOFTMAX = {"llama", "mistral", "qwen2", "opt", "vit"}
# Mixtral's router takes its softmax and normalises the top-k weights in float32 in any attention
# (``router_logits.float()``); with a float64 router the gradients agree to float64 tolerance.
FLOAT32_ROUTER = {"mixtral"}


def tolerance(name, attention, dtype):
    if dtype == torch.float64 and ((attention == "eager" and name in FLOAT32_SOFTMAX) or name in FLOAT32_ROUTER):
        return TOL[torch.float32]
    return TOL[dtype]


def build(name, attention, dtype, train=False):
    torch.manual_seed(0)
    model, loss, inputs = MODELS[name](attention, dtype)
    model = model.to(dtype).train(train)
    return model, loss, inputs


def eager_grads(model, loss, inputs):
    """Reference: the loss and d loss / d params by torch.autograd."""
    f = fxtools.functional(model)
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    value = loss(f, params, *inputs)
    return value.detach(), dict(zip(params, torch.autograd.grad(value, list(params.values()))))


def assert_grads_close(got, want, tol):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")


def check(name, attention, dtype, train=False):
    """fxtools.grad of the loss against autograd, for every parameter; returns both models."""
    model, loss, inputs = build(name, attention, dtype, train)
    reference = copy.deepcopy(model)
    f = fxtools.functional(model)
    params = dict(model.named_parameters())
    assert all(p.dtype == dtype for p in params.values())

    def loss_fn(params, *inputs):
        return loss(f, params, *inputs)

    gm = fxtools.grad(loss_fn, params, *inputs)
    got = gm(params, *inputs)
    _, want = eager_grads(reference, loss, inputs)
    assert_grads_close(got, want, tolerance(name, attention, dtype))
    return model, reference


# GPT-2, LLaMA and BERT in both attention implementations and both dtypes; the other models
# in eager attention (float32) and SDPA (float64); ResNet has no attention.
CORE = ["gpt2", "llama", "bert_mlm", "bert_classifier"]
CASES = [(name, attention, dtype) for name in CORE for attention in ATTENTION for dtype in DTYPES]
CASES += [
    (name, attention, dtype)
    for name in MODELS
    if name not in CORE
    for attention, dtype in zip(["eager", "eager" if name == "resnet" else "sdpa"], DTYPES)
]


@pytest.mark.parametrize("name, attention, dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_gradients_match_autograd(name, attention, dtype):
    check(name, attention, dtype)


@pytest.mark.parametrize("name, attention", [("gpt2", "sdpa"), ("llama", "eager"), ("bert_mlm", "sdpa"), ("bart", "eager")])
def test_train_mode_with_zero_dropout(name, attention):
    check(name, attention, torch.float64, train=True)


@pytest.mark.parametrize("reentrant", [False, True])
def test_llama_with_activation_checkpointing(reentrant):
    """Checkpointed layers (the reentrant kind runs its function under no_grad) get gradients."""
    model, loss, inputs = build("llama", "sdpa", torch.float64, train=True)
    # Checkpointing changes what is stored, not the gradient. The reference runs without it:
    # reentrant checkpointing cannot feed torch.autograd.grad, nor functional_call's parameters.
    _, want = eager_grads(copy.deepcopy(model), loss, inputs)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    assert model.model.layers[0].gradient_checkpointing
    f = fxtools.functional(model)
    params = dict(model.named_parameters())
    got = fxtools.grad(lambda p, *a: loss(f, p, *a), params, *inputs)(params, *inputs)
    assert_grads_close(got, want, TOL[torch.float64])


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_in_bfloat16_differentiates_into_grouped_products(name):
    """bfloat16 experts run ``torch._grouped_mm`` even while fxtools traces (float32 ones then take
    transformers' fallback op). Each of a layer's two grouped products gets two more in the
    gradient code, since the routing (top-k, sort, histc, cumsum) has static shapes; the MoE
    layers' gradients agree with eager autograd to bfloat16 accuracy (2% as a norm; its epsilon is 0.8%)."""
    model, _, (ids, labels) = build(name, "sdpa", torch.float32)
    model = model.to(torch.bfloat16)
    reference = copy.deepcopy(model)
    f = fxtools.functional(model)
    params = dict(model.named_parameters())
    gm = fxtools.grad(lambda p, *a: next_token_loss(f, p, *a), params, ids, labels)
    grouped = [n for n in gm.graph.nodes if n.target is torch.ops.aten._grouped_mm.default]
    assert len(grouped) == 6 * model.config.num_hidden_layers
    got = gm(params, ids, labels)
    _, want = eager_grads(reference, next_token_loss, (ids, labels))
    moe = [n for n in want if ".mlp." in n]
    assert any("experts" in n for n in moe) and any("gate" in n for n in moe)
    for n in moe:
        assert (got[n].float() - want[n].float()).norm() <= 2e-2 * want[n].float().norm(), n


def test_gpt2_tied_embedding_gets_one_summed_gradient():
    model, loss, inputs = build("gpt2", "sdpa", torch.float64)
    assert model.lm_head.weight is model.transformer.wte.weight
    params = dict(model.named_parameters())
    assert "lm_head.weight" not in params
    f = fxtools.functional(model)
    got = fxtools.grad(lambda p, *a: loss(f, p, *a), params, *inputs)(params, *inputs)
    want = eager_grads(model, loss, inputs)[1]
    torch.testing.assert_close(got["transformer.wte.weight"], want["transformer.wte.weight"], **TOL[torch.float64])
    # Both uses contribute: the gradient differs from that of the embedding lookup alone.
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    lookup_only = eager_grads(untied, loss, inputs)[1]["transformer.wte.weight"]
    assert not torch.allclose(got["transformer.wte.weight"], lookup_only)


def test_resnet_batchnorm_statistics_match_eager_in_train_mode():
    model, reference = check("resnet", "eager", torch.float64, train=True)
    buffers, want = dict(model.named_buffers()), dict(reference.named_buffers())
    assert any(name.endswith("running_mean") for name in buffers)
    for name in buffers:  # one generated call and one eager call have updated them alike
        torch.testing.assert_close(buffers[name], want[name], **TOL[torch.float64], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert_mlm"])
def test_graph_built_without_padding_runs_with_padding(name, attention):
    """Nothing about the example's token ids or attention mask is baked into the graph."""
    model, _, _ = build(name, attention, torch.float32)
    f = fxtools.functional(model)

    def loss(f, params, input_ids, attention_mask, labels):
        return f(params, input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    def loss_fn(params, *inputs):
        return loss(f, params, *inputs)

    ids = _ids()
    params = dict(model.named_parameters())
    gm = fxtools.value_and_grad(loss_fn, params, ids, torch.ones_like(ids), ids)
    new_ids, mask = _ids(seed=5), torch.ones_like(ids)
    if name == "bert_mlm":
        mask[1, 4:] = 0  # right padding
    else:
        mask[0, :3] = 0  # left padding
    labels = new_ids.masked_fill(mask == 0, -100)
    value, got = gm(params, new_ids, mask, labels)
    want_value, want = eager_grads(model, loss, (new_ids, mask, labels))
    torch.testing.assert_close(value, want_value, **TOL[torch.float32])
    assert_grads_close(got, want, TOL[torch.float32])


def test_model_output_is_a_pytree_for_vjp():
    model, _, (ids, _) = build("gpt2", "sdpa", torch.float64)
    f = fxtools.functional(model)
    params = dict(model.named_parameters())

    def logits(params, ids):
        return f(params, input_ids=ids, use_cache=False)

    gm = fxtools.vjp(logits, params, ids)
    out = logits(params, ids)
    assert list(out.keys()) == ["logits"]
    ct = type(out)(logits=torch.randn(out.logits.shape, dtype=torch.float64, generator=_gen(7)))
    got_out, (got, _) = gm(params, ids, ct)
    torch.testing.assert_close(got_out.logits, out.logits, **TOL[torch.float64])
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    want = torch.autograd.grad(logits(leaves, ids).logits, list(leaves.values()), ct.logits)
    assert_grads_close(got, dict(zip(leaves, want)), TOL[torch.float64])


def test_returning_a_cache_object_is_a_clear_error():
    model, _, (ids, _) = build("gpt2", "sdpa", torch.float32)
    f = fxtools.functional(model)
    params = dict(model.named_parameters())
    # the path names the output field holding the cache (its name varies across transformers versions)
    with pytest.raises(FxtoolsError, match=r"return value\[.+\] is a transformers\.\S*Cache.*use_cache=False"):
        fxtools.vjp(lambda p, ids: f(p, input_ids=ids, use_cache=True), params, ids)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_compiled_training_steps_called_with_keywords_equal_eager(name):
    """``fxtools.compile(model)`` called as Hugging Face models are (``model(**batch)``), trained
    with AdamW in float64: parameters equal eager's after each step."""
    model, _, (ids, labels) = build(name, "sdpa", torch.float64, train=True)
    reference = copy.deepcopy(model)
    compiled = fxtools.compile(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    for _ in range(3):
        for m, o in ((compiled, opt), (reference, ref_opt)):
            o.zero_grad()
            m(input_ids=ids, labels=labels, use_cache=False).loss.backward()
            o.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)
    assert [s.name for s in compiled.split.signature][-2:] == ["input_ids", "labels"]
