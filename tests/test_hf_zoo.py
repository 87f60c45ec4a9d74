"""A zoo of further Hugging Face architectures, one tiny random config each (nothing downloaded).

tests/test_hf_models.py checks the core models in depth (both attention implementations, both
dtypes, training mode); this file checks breadth: decoders with rotary, ALiBi and parallel
blocks, a state-space model, encoders with relative positions, vision models with windows,
depthwise and grouped convolutions, segmentation and masked autoencoding, speech (Whisper,
wav2vec 2.0) and a contrastive two-tower model (CLIP). For each, fxtools.grad of the model's own loss equals eager
autograd for every parameter in float64 (rtol 1e-5, atol 1e-7: the models' own losses, and some
softmaxes and routers, compute in float32 on purpose), and the model still runs eagerly afterwards, unchanged (tracing
must leave no FakeTensor in the model's caches).
"""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402

import fxtools  # noqa: E402

VOCAB, BATCH, SEQ = 97, 2, 7
_D = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


def _ids(seed):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _image(size):
    return torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(3))


def _text(model_cls, config_cls, **config):
    return lambda: (model_cls(config_cls(vocab_size=VOCAB, **config)), {"input_ids": _ids(1), "labels": _ids(2)})


def _vision(model_cls, config_cls, size, **config):
    return lambda: (model_cls(config_cls(num_labels=5, **config)), {"pixel_values": _image(size), "labels": torch.tensor([1, 3])})


ZOO = {
    "gpt_neox": _text(T.GPTNeoXForCausalLM, T.GPTNeoXConfig, **_D),
    "phi": _text(T.PhiForCausalLM, T.PhiConfig, resid_pdrop=0.0, embd_pdrop=0.0, **_D),
    "phi3": _text(T.Phi3ForCausalLM, T.Phi3Config, num_key_value_heads=2, pad_token_id=0, **_D),
    "gemma2": _text(T.Gemma2ForCausalLM, T.Gemma2Config, head_dim=8, num_key_value_heads=2, **_D),
    "falcon": _text(T.FalconForCausalLM, T.FalconConfig, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
    "gptj": _text(T.GPTJForCausalLM, T.GPTJConfig, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64),
    "bloom": _text(T.BloomForCausalLM, T.BloomConfig, hidden_size=32, n_layer=2, n_head=4),
    "gpt_bigcode": _text(T.GPTBigCodeForCausalLM, T.GPTBigCodeConfig, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "mamba": _text(T.MambaForCausalLM, T.MambaConfig, hidden_size=32, num_hidden_layers=2, state_size=4),
    "roberta": _text(T.RobertaForMaskedLM, T.RobertaConfig, pad_token_id=1, **_D),
    "distilbert": _text(T.DistilBertForMaskedLM, T.DistilBertConfig, dim=32, n_layers=2, n_heads=4, hidden_dim=64),
    "albert": _text(T.AlbertForMaskedLM, T.AlbertConfig, embedding_size=16, **_D),
    "deberta_v2": _text(T.DebertaV2ForMaskedLM, T.DebertaV2Config, **_D),
    "convnext": _vision(
        T.ConvNextForImageClassification, T.ConvNextConfig, 32, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=32
    ),
    "swin": _vision(
        T.SwinForImageClassification,
        T.SwinConfig,
        32,
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
    ),
    "mobilenet_v2": _vision(T.MobileNetV2ForImageClassification, T.MobileNetV2Config, 32, image_size=32, depth_multiplier=0.25),
    "regnet": _vision(
        T.RegNetForImageClassification, T.RegNetConfig, 32, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8
    ),
    "beit": _vision(
        T.BeitForImageClassification,
        T.BeitConfig,
        16,
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        use_relative_position_bias=True,
    ),
    "whisper": lambda: (
        T.WhisperForConditionalGeneration(
            T.WhisperConfig(
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                num_mel_bins=8,
                max_source_positions=16,
                max_target_positions=16,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        ),
        {"input_features": torch.randn(BATCH, 8, 32, generator=torch.Generator().manual_seed(1)), "labels": _ids(2)[:, :5]},
    ),
    "clip": lambda: (
        T.CLIPModel(
            T.CLIPConfig(
                text_config=dict(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=4,
                    max_position_embeddings=16,
                    bos_token_id=0,
                    eos_token_id=2,
                ),
                vision_config=dict(
                    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16, patch_size=4
                ),
                projection_dim=16,
            )
        ),
        {"input_ids": _ids(1), "pixel_values": _image(16), "return_loss": True},
    ),
    "wav2vec2": lambda: (
        T.Wav2Vec2ForSequenceClassification(
            T.Wav2Vec2Config(
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=4,
                intermediate_size=64,
                conv_dim=(16, 16),
                conv_stride=(5, 2),
                conv_kernel=(10, 3),
                num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4,
                num_labels=3,
                mask_time_prob=0.0,
            )
        ),
        {"input_values": torch.randn(BATCH, 400, generator=torch.Generator().manual_seed(1)), "labels": torch.tensor([0, 2])},
    ),
    "t5_classifier": lambda: (
        T.T5ForSequenceClassification(
            T.T5Config(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=1,
                num_heads=4,
                num_labels=3,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        ),  # picks each sequence's last EOS (id 1): a data-dependent select
        {
            "input_ids": torch.cat([_ids(1).clamp(min=2)[:, :-1], torch.ones(BATCH, 1, dtype=torch.long)], 1),
            "labels": torch.tensor([0, 2]),
        },
    ),
    "segformer": lambda: (
        T.SegformerForSemanticSegmentation(
            T.SegformerConfig(
                num_encoder_blocks=2,
                depths=[1, 1],
                sr_ratios=[2, 1],
                hidden_sizes=[8, 16],
                num_attention_heads=[1, 2],
                decoder_hidden_size=16,
                patch_sizes=[7, 3],
                strides=[4, 2],
                mlp_ratios=[2, 2],
                num_labels=3,
            )
        ),
        {"pixel_values": _image(32), "labels": torch.randint(0, 3, (BATCH, 32, 32), generator=torch.Generator().manual_seed(2))},
    ),
    "vit_mae": lambda: (
        T.ViTMAEForPreTraining(
            T.ViTMAEConfig(
                image_size=16,
                patch_size=4,
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=4,
                intermediate_size=64,
                decoder_hidden_size=16,
                decoder_num_hidden_layers=1,
                decoder_num_attention_heads=2,
                decoder_intermediate_size=32,
                mask_ratio=0.5,
            )
        ),
        {"pixel_values": _image(16)},
    ),  # random masking: the same generator state on both sides
    "dinov2": _vision(
        T.Dinov2ForImageClassification,
        T.Dinov2Config,
        16,
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        mlp_ratio=2,
    ),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_gradients_equal_eager_autograd(name):
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    model = model.double().eval()
    inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    reference = copy.deepcopy(model)

    f = fxtools.functional(model)
    params = dict(model.named_parameters())
    gm = fxtools.grad(lambda params, inputs: f(params, **inputs).loss, params, inputs)
    torch.manual_seed(1)
    got = gm(params, inputs)

    ref_params = {n: p.detach().clone().requires_grad_() for n, p in reference.named_parameters()}
    torch.manual_seed(1)
    loss = fxtools.functional(reference)(ref_params, **inputs).loss
    want = torch.autograd.grad(loss, list(ref_params.values()), allow_unused=True)
    for (n, p), w in zip(ref_params.items(), want):
        torch.testing.assert_close(
            got[n], torch.zeros_like(p) if w is None else w, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} {n}: {m}"
        )

    torch.manual_seed(1)
    after = model(**inputs).loss  # the traced model still runs eagerly, with real tensors
    assert type(after) is torch.Tensor
    torch.testing.assert_close(after.detach(), loss.detach(), rtol=1e-12, atol=0)


JVP_MODELS = ["gpt_neox", "phi3", "gemma2", "roberta", "distilbert", "albert", "deberta_v2"]


@pytest.mark.parametrize("name", JVP_MODELS)
def test_jvp_equals_torch_func(name):
    """Forward mode with respect to every parameter, against torch.func.jvp (eager attention:
    PyTorch has no forward-mode formula for its fused CPU attention)."""
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    model.config._attn_implementation = "eager"
    model = model.double().eval()
    f = fxtools.functional(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids = inputs["input_ids"]

    def logits(params, ids):
        return f(params, input_ids=ids).logits

    gm = fxtools.jvp(logits, params, ids)
    tangents = {k: torch.randn_like(v) for k, v in params.items()}
    out, tangent_out = gm(params, ids, tangents, None)
    value, want = torch.func.jvp(lambda p: logits(p, ids), (params,), (tangents,))
    torch.testing.assert_close(out, value, rtol=1e-9, atol=1e-9)
    # Rounding differs between fxtools' code and torch.func's formulas (which fuse multiply-adds);
    # in these random-weight models it is amplified by cancellation and scales with the largest
    # tangent (36 for Gemma 2, whose soft-capped logits are badly conditioned), not per element.
    torch.testing.assert_close(tangent_out, want, rtol=1e-5, atol=1e-6 * max(1.0, want.abs().max().item()))


HVP_MODELS = ["gpt_neox", "distilbert", "convnext", "swin", "roberta"]


@pytest.mark.parametrize("name", HVP_MODELS)
def test_hvp_equals_torch_func(name):
    """Hessian-vector products with respect to every parameter (eager attention; float32-level
    tolerance: the models compute their loss in float32), against
    torch.func's reverse over reverse. fxtools.hvp is reverse over reverse too; it also equals
    forward over reverse (``jvp(grad)``) wherever PyTorch's gradient is the derivative of the
    loss, which excludes RoBERTa: its embeddings' gradient skips the padding row, so the
    two orders differ there, in PyTorch as in fxtools."""
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    if hasattr(model.config, "_attn_implementation"):
        model.config._attn_implementation = "eager"
    model = model.double().eval()
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    f = fxtools.functional(model)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(params, inputs):
        return f(params, **inputs).loss

    v = {k: torch.randn_like(p) for k, p in params.items()}
    got = fxtools.hvp(loss, params, inputs)(params, inputs, v)
    grad = torch.func.grad(loss)
    want = torch.func.grad(lambda p: sum((grad(p, inputs)[k] * v[k]).sum() for k in v))(params)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")
    if name != "roberta":
        _, forward_over_reverse = torch.func.jvp(lambda p: grad(p, inputs), (params,), (v,))
        for k in want:
            torch.testing.assert_close(got[k], forward_over_reverse[k], rtol=1e-4, atol=1e-6)


def test_compiled_training_of_a_classifier_that_selects_by_mask():
    """T5's sequence classifier picks each sequence's EOS with a boolean mask (a data-dependent
    size): fxtools.compile trains it, dropout on, as eager does."""
    torch.manual_seed(0)
    model, inputs = ZOO["t5_classifier"]()
    model = model.double().train()
    reference = copy.deepcopy(model)
    compiled = fxtools.compile(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for step in range(2):
        for m, o in ((compiled, opt), (reference, ref_opt)):
            torch.manual_seed(step)
            o.zero_grad()
            m(**inputs).loss.backward()
            o.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_per_sample_gradients_of_a_sequence_classifier(name):
    """``fxtools.vmap(fxtools.grad(loss))`` over examples, against a loop of autograd gradients.
    (torch.func.vmap of torch.func.grad fails on GPT-2's classifier at a data-dependent step in
    transformers' code; fxtools batches the generated gradient code, where that step is ordinary
    ops.)"""
    torch.manual_seed(0)
    if name == "bert":
        model = T.BertForSequenceClassification(
            T.BertConfig(vocab_size=VOCAB, num_labels=3, attn_implementation="eager", **{**_D, "num_hidden_layers": 1})
        )
    else:
        model = T.GPT2ForSequenceClassification(
            T.GPT2Config(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=1,
                n_head=4,
                n_positions=32,
                num_labels=3,
                pad_token_id=0,
                attn_implementation="eager",
            )
        )
    model = model.double().eval()
    f = fxtools.functional(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids, labels = torch.randint(1, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 1])

    def loss(params, ids, label):
        return f(params, input_ids=ids[None], labels=label[None]).loss

    per_sample = fxtools.vmap(fxtools.grad(loss, params, ids[0], labels[0]), params, ids, labels, in_dims=(None, 0, 0))
    got = per_sample(params, ids, labels)
    for b in range(len(ids)):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        want = torch.autograd.grad(loss(p, ids[b], labels[b]), list(p.values()))
        for k, w in zip(p, want):
            torch.testing.assert_close(got[k][b], w, rtol=1e-9, atol=1e-12)
