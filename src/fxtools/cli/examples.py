"""Built-in example programs, shared by ``fxtools demo``, the tests and the benchmarks.

Two kinds of example:

- small functions of tensors (``sin_plus_x``, ``foo``, ``bar``): each builder returns
  ``(fn, example_args)``;
- models (``MLP``, ``SmallCNN``, ``GPT``): each builder (``mlp``, ``small_cnn``, ``gpt``)
  returns ``(model, example_inputs)``, where ``model(*example_inputs)`` is a scalar loss.
  ``fxtools.functional(model)`` turns a model into ``loss_fn(params, *inputs)``, a function of
  the dict of its parameters, which is what ``fxtools.grad`` differentiates;
  ``as_loss(model, inputs)`` returns ``(loss_fn, (params, *inputs))`` directly.

``EXAMPLES`` maps every example's name to a builder of ``(fn, example_args)``; ``example(name)``
calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..functional import functional

__all__ = [
    "sin_plus_x",
    "foo",
    "bar",
    "MLP",
    "mlp",
    "SmallCNN",
    "small_cnn",
    "GPTConfig",
    "GPT",
    "gpt_config",
    "gpt",
    "parameters_of",
    "as_loss",
    "EXAMPLES",
    "example",
]


def _dtype(dtype):
    return torch.get_default_dtype() if dtype is None else dtype


def _generator(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------
# Seed examples: small functions of one tensor.
# --------------------------------------------------------------------------------------------


def sin_plus_x(dtype=None, seed=0):
    """f(x) = sin(x) + x on a vector of 13 elements."""

    def f(x):
        return torch.sin(x) + x

    f.__doc__ = sin_plus_x.__doc__
    return f, (torch.randn(13, dtype=_dtype(dtype), generator=_generator(seed)),)


def foo(dtype=None, seed=0):
    """f(x) = sin(trace(x)) * x on a 3x3 matrix."""

    def f(x):
        w = torch.trace(x)
        w = torch.sin(w)
        return w * x

    f.__doc__ = foo.__doc__
    return f, (torch.randn(3, 3, dtype=_dtype(dtype), generator=_generator(seed)),)


def bar(dtype=None, seed=0):
    """f(x) = x^T @ x (a Gram matrix) on a 5x2 matrix."""

    def f(x):
        return torch.transpose(x, 1, 0) @ x

    f.__doc__ = bar.__doc__
    return f, (torch.randn(5, 2, dtype=_dtype(dtype), generator=_generator(seed)),)


# --------------------------------------------------------------------------------------------
# Models. Each forward returns a scalar loss.
# --------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Linear -> ReLU (or GELU) -> Linear, trained with cross-entropy."""

    def __init__(self, n_in=8, n_hidden=16, n_out=4, activation="relu"):
        super().__init__()
        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu', not {activation!r}")
        self.fc1 = nn.Linear(n_in, n_hidden)
        self.act = nn.ReLU() if activation == "relu" else nn.GELU()
        self.fc2 = nn.Linear(n_hidden, n_out)

    def forward(self, x, targets):
        logits = self.fc2(self.act(self.fc1(x)))
        return F.cross_entropy(logits, targets)


def mlp(activation="relu", batch=6, n_in=8, n_hidden=16, n_out=4, dtype=None, seed=0):
    """An MLP classifier and a batch ``(x, targets)``."""
    torch.manual_seed(seed)
    model = MLP(n_in, n_hidden, n_out, activation).to(_dtype(dtype))
    g = _generator(seed + 1)
    x = torch.randn(batch, n_in, dtype=_dtype(dtype), generator=g)
    targets = torch.randint(0, n_out, (batch,), generator=g)
    return model, (x, targets)


class SmallCNN(nn.Module):
    """Conv-BatchNorm-ReLU-MaxPool twice, global average pooling, a Linear head, cross-entropy."""

    def __init__(self, in_channels=3, n_classes=5, width=8):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.MaxPool2d(2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, n_classes)

    def forward(self, x, targets):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = torch.flatten(self.gap(x), 1)
        return F.cross_entropy(self.fc(x), targets)


def small_cnn(batch=4, in_channels=3, size=8, n_classes=5, width=8, dtype=None, seed=0):
    """A SmallCNN in training mode (BatchNorm uses batch statistics) and a batch ``(x, targets)``."""
    torch.manual_seed(seed)
    model = SmallCNN(in_channels, n_classes, width).to(_dtype(dtype)).train()
    g = _generator(seed + 1)
    x = torch.randn(batch, in_channels, size, size, dtype=_dtype(dtype), generator=g)
    targets = torch.randint(0, n_classes, (batch,), generator=g)
    return model, (x, targets)


# --------------------------------------------------------------------------------------------
# GPT: a nanoGPT-style decoder-only transformer.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in the Linear layers and LayerNorms
    attention: str = "sdpa"  # "sdpa": F.scaled_dot_product_attention; "explicit": softmax(q k^T) v


_GPT_SIZES = {
    "tiny": GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=16),
    "gpt2": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


def gpt_config(size="tiny", **overrides) -> GPTConfig:
    """A GPTConfig: ``"tiny"`` (tests) or ``"gpt2"`` (GPT-2 small, 124M parameters), with overrides."""
    if size not in _GPT_SIZES:
        raise ValueError(f"size must be one of {sorted(_GPT_SIZES)}, not {size!r}")
    return replace(_GPT_SIZES[size], **overrides)


class CausalSelfAttention(nn.Module):
    mask: torch.Tensor  # the causal mask buffer of explicit attention

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError("n_embd must be a multiple of n_head")
        if config.attention not in ("sdpa", "explicit"):
            raise ValueError(f"attention must be 'sdpa' or 'explicit', not {config.attention!r}")
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.attention = config.attention
        if self.attention == "explicit":
            mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style language model; ``forward(idx, targets)`` is the next-token cross-entropy."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence of length {t} is longer than the block size {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def gpt(size="tiny", attention="sdpa", batch=2, seq_len=None, dtype=None, seed=0, **overrides):
    """A GPT (``gpt_config(size)``) and a batch of token ids ``(idx, targets)``.

    ``seq_len`` defaults to the block size for ``"gpt2"`` and to half of it otherwise (so the
    causal mask is sliced, as in generation).
    """
    config = gpt_config(size, attention=attention, **overrides)
    torch.manual_seed(seed)
    model = GPT(config).to(_dtype(dtype))
    if seq_len is None:
        seq_len = config.block_size if size == "gpt2" else max(1, config.block_size // 2)
    g = _generator(seed + 1)
    idx = torch.randint(0, config.vocab_size, (batch, seq_len), generator=g)
    targets = torch.randint(0, config.vocab_size, (batch, seq_len), generator=g)
    return model, (idx, targets)


# --------------------------------------------------------------------------------------------
# Models as functions of their parameters.
# --------------------------------------------------------------------------------------------


def parameters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as a dict of plain (detached) tensors; tied weights appear once."""
    return {name: p.detach() for name, p in model.named_parameters()}


def as_loss(model: nn.Module, inputs: tuple):
    """``(loss_fn, (params, *inputs))`` for ``fxtools.grad(loss_fn, *args)``."""
    return functional(model), (parameters_of(model), *inputs)


def _as_loss_example(build):
    def make(**kwargs):
        model, inputs = build(**kwargs)
        return as_loss(model, inputs)

    make.__name__ = build.__name__
    make.__doc__ = build.__doc__
    return make


EXAMPLES = {
    "sin_plus_x": sin_plus_x,
    "foo": foo,
    "bar": bar,
    "mlp": _as_loss_example(mlp),
    "cnn": _as_loss_example(small_cnn),
    "gpt": _as_loss_example(gpt),
}


def example(name: str, **kwargs):
    """``(fn, example_args)`` of the example called ``name`` (a key of ``EXAMPLES``)."""
    try:
        build = EXAMPLES[name]
    except KeyError:
        raise ValueError(f"unknown example {name!r}; choose one of {', '.join(EXAMPLES)}") from None
    return build(**kwargs)
