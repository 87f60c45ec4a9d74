"""A zoo of the model patterns people write, each trained with fxtools.compile against eager.

Every pattern is a tiny ``nn.Module`` whose forward returns a scalar loss: attention (explicit,
SDPA, masks held as buffers, nanoGPT's causal slicing), position tables and rotary caches held as
buffers, LayerNorm / RMSNorm / GroupNorm / BatchNorm (training and evaluation), convolutions and
pooling, tied embeddings, dropout, top-k mixture-of-experts routing, and small Hugging Face GPT-2,
Llama, BERT and ViT models built from configs (nothing downloaded).

Each is trained 3 AdamW steps by ``fxtools.compile`` and, from a deep copy, eagerly: with
``compiler="inductor"`` for one pattern of each way fxtools' graphs meet Inductor (``INDUCTOR``),
through the ATen graphs themselves checked by a strict fake mode for the others. The oracle is eager PyTorch in float32 (Inductor only compiles float32 kernels
here): after every step the losses, the gradients and the parameters agree within rtol 1e-4,
atol 1e-5 (torch.compile's own training tests use 1e-4), and the buffers (running statistics)
agree at the end. AdamW runs with ``eps=1e-5``: its step divides the gradient by its running
root mean square plus ``eps``, so a parameter whose gradient is zero in exact arithmetic (the
key projection's bias under softmax, a bias just before a BatchNorm) and is computed as rounding
noise (~1e-9, of either sign) would move by about +-lr with the default 1e-8 whatever the noise;
1e-5 bounds that amplification while the gradients themselves are compared directly. Dropout is compared exactly: both runs draw from the same seed and Inductor
calls PyTorch's own random kernels (``fallback_random``, as torch.compile's tests compare
dropout), so the masks are the same bits.

Inductor compiles are CPU-heavy: sizes are tiny and shared between patterns (Inductor's kernel
cache serves a kernel already compiled in this run), and ``compile_threads=1`` avoids starting a
pool of compile workers on a 2-core machine.
"""

import copy
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxtools  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-5)
B, T, D, H, V = 2, 8, 16, 2, 31  # batch, tokens, width, heads, vocabulary


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=_gen(seed))


def _ids(seed=2):
    return torch.randint(0, V, (B, T), generator=_gen(seed))


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention in the ways people write it; ``mask``: how the causal mask is made."""

    def __init__(self, mask="none", sdpa=False, block=T):
        super().__init__()
        self.qkv, self.proj, self.mask, self.sdpa = nn.Linear(D, 3 * D), nn.Linear(D, D), mask, sdpa
        if mask in ("buffer", "bool_buffer"):  # nanoGPT: a (1, 1, block, block) lower triangle, sliced to T
            tril = torch.tril(torch.ones(block, block)).view(1, 1, block, block)
            self.register_buffer("bias", tril.bool() if mask == "bool_buffer" else tril)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        if self.sdpa:
            if self.mask == "bool_buffer":
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:, :, :t, :t])
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=self.mask == "causal")
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            if self.mask == "buffer":
                att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            elif self.mask == "triu":
                att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    """A pre-norm transformer block around ``attn`` with a GELU MLP."""

    def __init__(self, attn, norm=nn.LayerNorm):
        super().__init__()
        self.ln1, self.attn, self.ln2 = norm(D), attn, norm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Regress(nn.Module):
    """``body(x)`` against a fixed random target (mean squared error)."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, target):
        return F.mse_loss(self.body(x), target)


def _seq(body):
    return lambda: (Regress(body()), (_x(B, T, D), _x(B, T, D, seed=3)))


# --------------------------------------------------------------------------------------------
# Positions
# --------------------------------------------------------------------------------------------


class SinusoidalPositions(nn.Module):
    """``x + pe[:T]`` with the sinusoidal table of "Attention is all you need" as a buffer."""

    def __init__(self, block=4 * T):
        super().__init__()
        pos = torch.arange(block).unsqueeze(1)
        freq = torch.exp(torch.arange(0, D, 2) * (-math.log(10000.0) / D))
        pe = torch.zeros(block, D)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
        self.register_buffer("pe", pe)
        self.attn = Attention("buffer", block=block)

    def forward(self, x):
        return self.attn(x + self.pe[: x.size(1)])


class Rotary(nn.Module):
    """Rotary position embeddings from cos / sin caches held as buffers (Llama's rotate-half)."""

    def __init__(self, block=4 * T):
        super().__init__()
        dh = D // H
        inv = 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
        freqs = torch.outer(torch.arange(block).float(), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)
        self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)

    @staticmethod
    def rotate_half(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat([-b, a], dim=-1)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        cos, sin = self.cos_cached[:t], self.sin_cached[:t]
        q, k = q * cos + self.rotate_half(q) * sin, k * cos + self.rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    """Llama's gated MLP, with RMSNorm in front and a residual."""

    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(D)
        self.gate, self.up, self.down = (
            nn.Linear(D, 2 * D, bias=False),
            nn.Linear(D, 2 * D, bias=False),
            nn.Linear(2 * D, D, bias=False),
        )

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


# --------------------------------------------------------------------------------------------
# Language models: tied embeddings, dropout, mixture of experts
# --------------------------------------------------------------------------------------------


class TinyLM(nn.Module):
    """Token and learned position embeddings, ``body``, and a head tied to the token embedding."""

    def __init__(self, body, dropout=0.0):
        super().__init__()
        self.wte, self.wpe, self.drop = nn.Embedding(V, D), nn.Embedding(T, D), nn.Dropout(dropout)
        self.body, self.ln_f = body, nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        logits = self.head(self.ln_f(self.body(x)))
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))


class TopKMoE(nn.Module):
    """A top-2-of-4 mixture of experts with static shapes: every expert runs on every token, and
    the router's renormalised top-k weights (scattered into a dense matrix) combine them."""

    def __init__(self, experts=4, k=2):
        super().__init__()
        self.router, self.k = nn.Linear(D, experts, bias=False), k
        self.w1 = nn.Parameter(torch.randn(experts, D, 2 * D) * 0.2)
        self.w2 = nn.Parameter(torch.randn(experts, 2 * D, D) * 0.2)

    def forward(self, x):
        logits = self.router(x)
        top, idx = logits.topk(self.k, dim=-1)
        weights = torch.zeros_like(logits).scatter(-1, idx, top.softmax(dim=-1))
        h = F.gelu(torch.einsum("btd,edf->btef", x, self.w1))
        y = torch.einsum("btef,efd->bted", h, self.w2)
        return x + (y * weights.unsqueeze(-1)).sum(dim=2)


def _lm(body, dropout=0.0):
    return lambda: (TinyLM(body(), dropout), (_ids(), _ids(4)))


# --------------------------------------------------------------------------------------------
# Convolutions and normalisation
# --------------------------------------------------------------------------------------------


class Classify(nn.Module):
    """``body(image)`` pooled and classified, cross-entropy against fixed labels."""

    def __init__(self, body, channels):
        super().__init__()
        self.body, self.fc = body, nn.Linear(channels, 5)

    def forward(self, image, labels):
        h = F.adaptive_avg_pool2d(self.body(image), 1).flatten(1)
        return F.cross_entropy(self.fc(h), labels)


def _image(channels=3, size=8):
    return (_x(B, channels, size, size), torch.tensor([1, 3]))


def _conv_bn(eval_mode=False):
    def build():
        body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3))
        model = Classify(body, 8)
        if eval_mode:
            with torch.no_grad():  # non-trivial running statistics
                model.body[1].running_mean.uniform_(-0.5, 0.5)
                model.body[1].running_var.uniform_(0.5, 2.0)
            model.eval()
        return model, _image()

    return build


class ResidualConv(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN, a strided 1x1 shortcut, ReLU; then average pooling."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.short = nn.Sequential(nn.Conv2d(3, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8))

    def forward(self, x):
        h = F.relu(self.b1(self.c1(x)))
        return F.avg_pool2d(F.relu(self.b2(self.c2(h)) + self.short(x)), 2)


class DepthwiseConv1d(nn.Module):
    """A ConvNeXt-style 1-d block over a sequence: depthwise conv, LayerNorm, pointwise MLP."""

    def __init__(self):
        super().__init__()
        self.dw, self.norm = nn.Conv1d(D, D, 3, padding=1, groups=D), nn.LayerNorm(D)
        self.pw1, self.pw2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        h = self.dw(x.transpose(1, 2)).transpose(1, 2)
        return x + self.pw2(F.gelu(self.pw1(self.norm(h))))


class BatchNormMLP(nn.Module):
    """Linear, BatchNorm1d (training), SiLU, Linear on flattened tokens."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(D, 2 * D), nn.BatchNorm1d(2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.fc2(F.silu(self.bn(self.fc1(x.flatten(0, 1))))).view_as(x)


# --------------------------------------------------------------------------------------------
# Hugging Face models (tiny configs, random weights)
# --------------------------------------------------------------------------------------------


class HFLoss(nn.Module):
    """A Hugging Face model called as its users call it: ``model(**batch).loss``."""

    def __init__(self, model, *keys):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *inputs):
        return self.model(**dict(zip(self.keys, inputs))).loss


def _hf(name):
    def build():
        import transformers as tr

        small = dict(hidden_size=D, intermediate_size=2 * D, num_hidden_layers=1, num_attention_heads=H)
        if name == "gpt2":
            cfg = tr.GPT2Config(
                vocab_size=V, n_positions=T, n_embd=D, n_layer=1, n_head=H, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
            )
            return HFLoss(tr.GPT2LMHeadModel(cfg), "input_ids", "labels", "use_cache"), (_ids(), _ids(4), False)
        if name == "llama":
            cfg = tr.LlamaConfig(vocab_size=V, num_key_value_heads=1, max_position_embeddings=T, **small)
            return HFLoss(tr.LlamaForCausalLM(cfg), "input_ids", "labels", "use_cache"), (_ids(), _ids(4), False)
        if name == "bert":
            cfg = tr.BertConfig(
                vocab_size=V, max_position_embeddings=T, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small
            )
            return HFLoss(tr.BertForMaskedLM(cfg), "input_ids", "labels"), (_ids(), _ids(4))
        cfg = tr.ViTConfig(
            image_size=8,
            patch_size=4,
            num_channels=3,
            num_labels=5,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **small,
        )
        return HFLoss(tr.ViTForImageClassification(cfg), "pixel_values", "labels"), _image()

    return build


def _mlp(dropout=0.0):
    return nn.Sequential(nn.Linear(D, 2 * D), nn.Dropout(dropout), nn.GELU(), nn.Linear(2 * D, D))


ZOO = {
    "attention_explicit": _seq(Attention),
    "attention_explicit_triu_mask": _seq(lambda: Attention("triu")),
    "attention_causal_buffer_nanogpt": _seq(lambda: Attention("buffer", block=2 * T)),
    "attention_sdpa": _seq(lambda: Attention(sdpa=True)),
    "attention_sdpa_causal": _seq(lambda: Attention("causal", sdpa=True)),
    "attention_sdpa_bool_mask_buffer": _seq(lambda: Attention("bool_buffer", sdpa=True, block=2 * T)),
    "transformer_block_layernorm": _seq(lambda: Block(Attention("buffer"))),
    "sinusoidal_position_table": _seq(SinusoidalPositions),
    "rotary_cache": _seq(lambda: nn.Sequential(RMSNorm(D), Rotary())),
    "rmsnorm_swiglu": _seq(SwiGLU),
    "layernorm_dropout_eval": lambda: (
        Regress(nn.Sequential(_mlp(0.5), nn.LayerNorm(D))).eval(),
        (_x(B, T, D), _x(B, T, D, seed=3)),
    ),
    "groupnorm_conv": lambda: (
        Classify(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU()), 8),
        _image(),
    ),
    "batchnorm2d_train": _conv_bn(),
    "batchnorm2d_eval": _conv_bn(eval_mode=True),
    "batchnorm1d_train": _seq(BatchNormMLP),
    "resnet_block": lambda: (Classify(ResidualConv(), 8), _image()),
    "depthwise_conv1d": _seq(DepthwiseConv1d),
    "tied_embeddings_lm": _lm(_mlp),
    "dropout_lm": _lm(lambda: _mlp(0.25), dropout=0.1),
    "topk_moe": _lm(TopKMoE),
    "torch_transformer_layer": _seq(
        lambda: nn.TransformerEncoderLayer(D, H, 2 * D, dropout=0.0, batch_first=True, norm_first=True)
    ),
    "hf_gpt2": _hf("gpt2"),
    "hf_llama": _hf("llama"),
    "hf_bert": _hf("bert"),
    "hf_vit": _hf("vit"),
}


# Inductor compiles a C++ kernel for each fused group (1 to 1.5 s of CPU each from a fresh clone,
# about 170 for the whole zoo): these patterns, one for each way fxtools' graphs meet Inductor
# (buffers as graph inputs, masks held as buffers, running statistics updated in place, PyTorch's
# own random kernels, tied weights, data-dependent routing, convolutions and norms, a Hugging Face
# decoder), train under Inductor; the others train through the same ATen graphs run as compiled
# (``_strict``: a strict fake mode first, as Inductor's FakeTensorProp), which is where fxtools'
# part of a compiled step is: the graphs and their signature.
INDUCTOR = [
    "attention_sdpa_causal",
    "attention_causal_buffer_nanogpt",
    "transformer_block_layernorm",
    "rotary_cache",
    "groupnorm_conv",
    "batchnorm2d_train",
    "dropout_lm",
    "topk_moe",
    "hf_gpt2",
]


@pytest.fixture(scope="module")
def inductor_settings():
    """One compile thread (no pool of workers on a small machine) and PyTorch's own random
    kernels (so dropout draws the bits eager draws)."""
    from torch._inductor import config

    with config.patch(compile_threads=1, fallback_random=True):
        yield


def _assert_close(got, want, what):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _strict(graphs):
    """A compiler that checks that a strict fake mode runs each graph (it raises on a real tensor
    the graph holds, as Inductor's FakeTensorProp does), records it in ``graphs`` and runs it as is."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def compiler(gm, example_inputs):
        assert not [n for n in gm.graph.nodes if n.op == "get_attr"], gm.code
        FakeTensorProp(gm, FakeTensorMode()).propagate(*example_inputs)
        graphs.append(gm)
        return gm

    return compiler


def _trains_like_eager(name, compiler):
    """Three AdamW steps of ``fxtools.compile(model, compiler=compiler)`` against eager from a deep copy."""
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    reference = copy.deepcopy(model)
    compiled = fxtools.compile(model, compiler=compiler)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5) for m in (model, reference)]
    for step in range(3):
        losses = []
        for m, opt in zip((compiled, reference), opts):
            torch.manual_seed(100 + step)  # the same dropout draws in both
            opt.zero_grad()
            loss = m(*inputs)
            loss.backward()
            losses.append(loss.detach())
        _assert_close(*losses, f"step {step} loss")
        for (k, p), q in zip(model.named_parameters(), reference.parameters()):
            _assert_close(p.grad, q.grad, f"step {step} grad {k}")
        for opt in opts:
            opt.step()
        for (k, p), q in zip(model.named_parameters(), reference.parameters()):
            _assert_close(p, q, f"step {step} parameter {k}")
    for (k, b), c in zip(model.named_buffers(), reference.buffers()):
        _assert_close(b, c, f"buffer {k}")
    assert len(compiled._runners) == 1, "one compilation serves the three steps"


@pytest.mark.parametrize("name", INDUCTOR)
def test_trains_like_eager_with_inductor(name, inductor_settings):
    _trains_like_eager(name, "inductor")


@pytest.mark.parametrize("name", [name for name in ZOO if name not in INDUCTOR])
def test_trains_like_eager_through_strict_aten_graphs(name):
    graphs: list = []
    _trains_like_eager(name, _strict(graphs))
    assert len(graphs) == 2, "one forward and one backward graph"


BUFFER_PATTERNS = ["attention_causal_buffer_nanogpt", "sinusoidal_position_table", "rotary_cache", "batchnorm2d_eval"]


@pytest.mark.parametrize("name", BUFFER_PATTERNS)
def test_aten_graphs_take_the_tensors_they_read_as_inputs(name):
    """Without Inductor (quick): the ATen graphs compilers get hold no tensor, so a strict fake
    mode (as Inductor's FakeTensorProp) runs them; the tensors are ``"buffer"`` inputs of the
    forward and the backward, and the graphs, run as compiled, train as eager does."""
    graphs: list = []
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    reference = copy.deepcopy(model)
    compiled = fxtools.compile(model, compiler=_strict(graphs))
    loss, want = compiled(*inputs), reference(*inputs)
    loss.backward()
    want.backward()
    _assert_close(loss, want, "loss")
    for (k, p), q in zip(model.named_parameters(), reference.parameters()):
        _assert_close(p.grad, q.grad, f"grad {k}")
    forward, backward = graphs
    kinds = [n.meta["desc"].kind for n in forward.graph.nodes if n.op == "placeholder"]
    assert "buffer" in kinds
    bw_kinds = [n.meta["desc"].kind for n in backward.graph.nodes if n.op == "placeholder"]
    assert bw_kinds == sorted(bw_kinds, key=["saved", "cotangent", "buffer"].index)
