"""The ``"fused"`` rule set: backwards that call PyTorch's fused backward kernels.

The readable rules write each backward out as math (layer norm's is about fifteen pointwise and
reduction ops). The rules here compute the same cotangents with the one ATen kernel PyTorch's own
autograd calls (``native_layer_norm_backward``, ``gelu_backward``, ``convolution_backward``, ...):
fewer nodes and less memory traffic, at the price of code that reads as a kernel call. Each
forward saves exactly what its kernel needs (layer norm's mean and rstd, max pooling's indices,
attention's logsumexp). They are used inside ``with fxtools.rule_set("fused")`` and, by default,
by ``fxtools.compile`` and ``fxtools.backend``; ops without a rule here keep their readable one.

Where a kernel does not apply (``padding="same"`` convolutions, attention with dropout or a
mask, soft-label cross entropy, cotangents of normalisation statistics), a rule falls back to the
readable rule of its op.

Second derivatives: ``fxtools.hvp``, ``fxtools.hessian`` and forward mode (``fxtools.jvp``,
which transposes a VJP) always use the readable rules. Graphs
made with this set can be differentiated again where PyTorch decomposes or differentiates the
kernel (every kernel here except CPU flash attention's backward).
"""

from __future__ import annotations

import torch

from ..registry import by_schema, register_vjp, vjp_rule
from . import nn

aten = torch.ops.aten

FUSED = "fused"
MEAN = nn.MEAN


def fused(op):
    """A fused rule: real tensors only (complex calls use the readable rules)."""
    return vjp_rule(op, rule_set=FUSED, complex="real")


def _mask(*present):
    """``output_mask`` of a multi-output backward kernel: which cotangents to compute."""
    return [p is not None and p is not False for p in present]


# ---------------------------------------------------------------------------------------------
# activations


@fused(aten.relu)
def relu(ct, out, x):
    return aten.threshold_backward(ct, out, 0)


@fused(aten.threshold)
def threshold(ct, out, x, threshold, value):
    return aten.threshold_backward(ct, x, threshold)


@fused(aten.gelu)
def gelu(ct, out, x, approximate="none"):
    return aten.gelu_backward(ct, x, approximate=approximate)


def _kernel_of_input(op, kernel):
    """The rule ``ct, x -> kernel(ct, x)`` (the activations whose kernel reads only the input)."""

    @fused(op)
    def rule(ct, out, x):
        return kernel(ct, x)

    rule.__name__ = rule.__qualname__ = op.__name__


for _op, _kernel in (
    (aten.silu, aten.silu_backward),
    (aten.mish, aten.mish_backward),
    (aten.hardswish, aten.hardswish_backward),
    (aten.hardsigmoid, aten.hardsigmoid_backward),
):
    _kernel_of_input(_op, _kernel)


@fused(aten.hardtanh)
def hardtanh(ct, out, x, min_val=-1, max_val=1):
    return aten.hardtanh_backward(ct, x, min_val, max_val)


@fused(aten.leaky_relu)
def leaky_relu(ct, out, x, negative_slope=0.01):
    return aten.leaky_relu_backward(ct, x, negative_slope, False)


@fused(aten.elu)
def elu(ct, out, x, alpha=1, scale=1, input_scale=1):
    return aten.elu_backward(ct, alpha, scale, input_scale, False, x)


@fused(aten.softplus)
def softplus(ct, out, x, beta=1, threshold=20):
    return aten.softplus_backward(ct, x, beta, threshold)


@fused(aten.sigmoid)
def sigmoid(ct, out, x):
    return aten.sigmoid_backward(ct, out)


@fused(aten.tanh)
def tanh(ct, out, x):
    return aten.tanh_backward(ct, out)


# ---------------------------------------------------------------------------------------------
# softmax


@fused(aten.softmax)
@fused(aten._safe_softmax)
def softmax(ct, out, x, dim, dtype=None):
    return aten._softmax_backward_data(ct, out, dim, out.dtype)


@fused(aten._softmax)
def _softmax(ct, out, x, dim, half_to_float):
    return aten._softmax_backward_data(ct, out, dim, x.dtype)


@fused(aten.log_softmax)
def log_softmax(ct, out, x, dim, dtype=None):
    return aten._log_softmax_backward_data(ct, out, dim, out.dtype)


@fused(aten._log_softmax)
def _log_softmax(ct, out, x, dim, half_to_float):
    return aten._log_softmax_backward_data(ct, out, dim, x.dtype)


# ---------------------------------------------------------------------------------------------
# normalisation


def layer_norm_bwd(aux, ct):
    """The forward is the readable rule's: ``native_layer_norm``, keeping mean and rstd."""
    x, shape, weight, bias, mean, rstd = aux
    dx, dw, db = aten.native_layer_norm_backward(ct, x, shape, mean, rstd, weight, bias, _mask(x, weight, bias))
    return dx, None, dw, db


register_vjp(aten.layer_norm, nn.layer_norm_fwd, layer_norm_bwd, source=FUSED, rule_set=FUSED, complex="real")


@fused(aten.native_layer_norm)
def native_layer_norm(ct, out, x, normalized_shape, weight, bias, eps):
    if ct[1] is not None or ct[2] is not None:  # cotangents of the statistics: second derivatives
        return nn.native_layer_norm(ct, out, x, normalized_shape, weight, bias, eps)
    dx, dw, db = aten.native_layer_norm_backward(ct[0], x, normalized_shape, out[1], out[2], weight, bias, _mask(x, weight, bias))
    return dx, None, dw, db


def batch_norm_fwd(x, weight, bias, running_mean, running_var, **norm):
    """``native_batch_norm`` in both modes: in training it also returns the batch mean and
    inverse std (and updates the running statistics in place); in evaluation the backward reads
    the running statistics. ``norm``: training, momentum, eps, cudnn_enabled."""
    training, eps = norm["training"] or running_mean is None, norm["eps"]
    out, mean, invstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var, training, norm["momentum"], eps)
    stats = (None, None, mean, invstd) if training else (running_mean, running_var, None, None)
    return out, (x, weight, bias, stats, training, eps)


def batch_norm_bwd(aux, ct):
    x, weight, bias, stats, training, eps = aux
    dx, dw, db = aten.native_batch_norm_backward(ct, x, weight, *stats, training, eps, _mask(x, weight, bias))
    return dx, dw, db, None, None


register_vjp(
    aten.batch_norm, by_schema(aten.batch_norm, batch_norm_fwd), batch_norm_bwd, source=FUSED, rule_set=FUSED, complex="real"
)


def _native_batch_norm(ct, out, x, weight, bias, running, eps, readable):
    """``running``: the running (mean, var) evaluation normalises with; None in training.
    ``readable()``: the readable rule, for the statistics' cotangents."""
    training = running is None
    if training and (ct[1] is not None or ct[2] is not None):  # statistics' cotangents: second derivatives
        return readable()
    if ct[0] is None:
        return None
    stats = (None, None, out[1], out[2]) if training else (*running, None, None)
    return aten.native_batch_norm_backward(ct[0], x, weight, *stats, training, eps, _mask(x, weight, bias))


@fused(aten.native_batch_norm)
def native_batch_norm(ct, out, x, weight, bias, running_mean, running_var, **norm):
    running = None if norm["training"] or running_mean is None else (running_mean, running_var)

    def readable():
        return nn.native_batch_norm(ct, out, x, weight, bias, running_mean, running_var, **norm)

    return _native_batch_norm(ct, out, x, weight, bias, running, norm["eps"], readable)


@fused(aten._native_batch_norm_legit.default)
def _native_batch_norm_legit(ct, out, x, weight, bias, running_mean, running_var, **norm):
    running = None if norm["training"] else (running_mean, running_var)

    def readable():
        return nn.native_batch_norm_legit(ct, out, x, weight, bias, running_mean, running_var, **norm)

    return _native_batch_norm(ct, out, x, weight, bias, running, norm["eps"], readable)


@fused(aten._native_batch_norm_legit.no_stats)
def _native_batch_norm_legit_no_stats(ct, out, x, weight, bias, training, momentum, eps):
    def readable():
        return nn.native_batch_norm_legit_no_stats(ct, out, x, weight, bias, training, momentum, eps)

    return _native_batch_norm(ct, out, x, weight, bias, None, eps, readable)


@fused(aten._native_batch_norm_legit_no_training)
def _native_batch_norm_legit_no_training(ct, out, x, weight, bias, running_mean, running_var, **norm):
    return _native_batch_norm(ct, out, x, weight, bias, (running_mean, running_var), norm["eps"], None)


# ---------------------------------------------------------------------------------------------
# embedding, convolution, pooling


@fused(aten.embedding)
def embedding(ct, out, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if padding_idx < 0 and not scale_grad_by_freq:  # the readable rows scattered into zeros: the same
        # kernel (printed in place), and a tied weight's other gradient is accumulated into (passes/accumulate.py)
        return nn.embedding(ct, out, weight, indices)
    return aten.embedding_dense_backward(ct, indices, weight.shape[0], padding_idx, scale_grad_by_freq), None


def _convolution(ct, x, weight, bias, conv: nn.Conv):
    """``convolution_backward`` (which wants a batch dimension and explicit lists)."""
    nd = weight.dim() - 2
    unbatched = x.dim() == nd + 1
    if unbatched:
        x, ct = x.unsqueeze(0), ct.unsqueeze(0)
    bias_sizes = None if bias is None else list(bias.shape)
    dx, dw, db = aten.convolution_backward(ct, x, weight, bias_sizes, *conv.expanded(nd), _mask(x, weight, bias))
    return (dx.squeeze(0) if unbatched else dx), dw, db


@fused(aten.convolution)
def convolution(ct, out, x, weight, bias, **conv):
    return _convolution(ct, x, weight, bias, nn.Conv(**conv))


def conv_nd(ct, out, x, weight, bias=None, **conv):
    """``padding="same"`` may pad asymmetrically, which the kernel cannot: the readable rule does."""
    if isinstance(conv.get("padding"), str):
        return nn.conv_nd(ct, out, x, weight, bias, **conv)
    return _convolution(ct, x, weight, bias, nn.Conv(**conv))


def conv_transpose_nd(ct, out, x, weight, bias=None, **conv):
    return _convolution(ct, x, weight, bias, nn.Conv(**conv, transposed=True))


for _op in (aten.conv1d, aten.conv2d, aten.conv3d):
    fused(_op)(conv_nd)
for _op in (aten.conv_transpose1d, aten.conv_transpose2d.input, aten.conv_transpose3d.input):
    fused(_op)(conv_transpose_nd)


_MAX_POOL_BACKWARD = {2: aten.max_pool2d_with_indices_backward, 3: aten.max_pool3d_with_indices_backward}


def _max_pool_rule(op, nd):
    """Max pooling's forward keeps the argmax indices; the kernel routes cotangents through them."""

    def fwd(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        out, indices = nn.MAX_POOL[nd](x, kernel_size, stride or None, padding, dilation, ceil_mode, return_indices=True)
        return out, (x, [nn.ntuple(v, nd) for v in (kernel_size, stride or kernel_size, padding, dilation)], ceil_mode, indices)

    def bwd(aux, ct):
        x, (kernel, stride, padding, dilation), ceil_mode, indices = aux
        return _MAX_POOL_BACKWARD[nd](ct, x, kernel, stride, padding, dilation, ceil_mode, indices)

    register_vjp(op, fwd, bwd, source=FUSED, rule_set=FUSED, complex="real")


def _max_pool_with_indices_rule(op, nd):
    def max_pool_with_indices(ct, out, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        lists = [nn.ntuple(v, nd) for v in (kernel_size, stride or kernel_size, padding, dilation)]
        return _MAX_POOL_BACKWARD[nd](ct[0], x, *lists, ceil_mode, out[1])

    max_pool_with_indices.__name__ = op.__name__
    fused(op)(max_pool_with_indices)


for _nd in (2, 3):
    _max_pool_rule(getattr(aten, f"max_pool{_nd}d"), _nd)
    _max_pool_with_indices_rule(getattr(aten, f"max_pool{_nd}d_with_indices"), _nd)


@fused(aten.adaptive_avg_pool2d)
@fused(aten._adaptive_avg_pool2d)
def adaptive_avg_pool2d(ct, out, x, output_size):
    return aten._adaptive_avg_pool2d_backward(ct, x)


# ---------------------------------------------------------------------------------------------
# attention


def _flash_applies(q, k, v, attn_mask, dropout_p):
    """Whether CPU flash attention computes this call: no mask, no dropout, equal head counts."""
    return (
        q.device.type == "cpu"
        and attn_mask is None
        and dropout_p == 0
        and q.dim() == 4
        and k.shape[:-1] == v.shape[:-1]
        and q.shape[:2] == k.shape[:2]
        and q.shape[-1] == v.shape[-1]
        and q.dtype == k.dtype == v.dtype
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    )


def sdpa_fwd(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """Flash attention keeps its output and the rows' logsumexp, from which its backward
    recomputes the probabilities block by block (they are never stored)."""
    if not _flash_applies(q, k, v, attn_mask, dropout_p):
        out, aux = nn.sdpa_fwd(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return out, ("readable", aux)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return out, ("flash", (q, k, v, out, lse, is_causal, scale))


def sdpa_bwd(aux, ct):
    kind, aux = aux
    if kind == "readable":
        return nn.sdpa_bwd(aux, ct)
    q, k, v, out, lse, is_causal, scale = aux
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(ct, q, k, v, out, lse, 0.0, is_causal, scale=scale)
    return dq, dk, dv, None


register_vjp(aten.scaled_dot_product_attention, sdpa_fwd, sdpa_bwd, source=FUSED, rule_set=FUSED, complex="real")


# ---------------------------------------------------------------------------------------------
# losses


_NLL = {
    2: (aten.nll_loss_forward, aten.nll_loss_backward),
    1: (aten.nll_loss_forward, aten.nll_loss_backward),
    4: (aten.nll_loss2d_forward, aten.nll_loss2d_backward),
}


def cross_entropy_fwd(x, target, weight=None, reduction=MEAN, ignore_index=-100, label_smoothing=0.0):
    """Class indices: ``log_softmax`` then ``nll_loss_forward``, keeping the log-probabilities and
    the total weight for the two backward kernels. Soft labels, label smoothing and other ranks
    take the readable rule."""
    if target.is_floating_point() or label_smoothing or x.dim() not in _NLL:
        out = aten.cross_entropy_loss(x, target, weight, reduction, ignore_index, label_smoothing)
        return out, ("readable", (out, (x, target, weight, reduction, ignore_index, label_smoothing), {}))
    cdim = 1 if x.dim() > 1 else 0
    log_probs = torch.log_softmax(x, cdim)
    loss, total_weight = _NLL[x.dim()][0](log_probs, target, weight, reduction, ignore_index)
    return loss, ("fused", (log_probs, target, weight, reduction, ignore_index, total_weight, cdim))


def cross_entropy_bwd(aux, ct):
    kind, aux = aux
    if kind == "readable":
        out, args, kwargs = aux
        return nn.cross_entropy_loss(ct, out, *args, **kwargs)
    log_probs, target, weight, reduction, ignore_index, total_weight, cdim = aux
    grad = _NLL[log_probs.dim()][1](ct, log_probs, target, weight, reduction, ignore_index, total_weight)
    return aten._log_softmax_backward_data(grad, log_probs, cdim, log_probs.dtype), None, None


register_vjp(aten.cross_entropy_loss, cross_entropy_fwd, cross_entropy_bwd, source=FUSED, rule_set=FUSED, complex="real")


@fused(aten.nll_loss_forward)
def nll_loss_forward(ct, out, x, target, weight, reduction, ignore_index):
    """The total weight (output 1) carries no gradient, as in autograd."""
    if ct[0] is None:
        return None
    return aten.nll_loss_backward(ct[0], x, target, weight, reduction, ignore_index, out[1]), None, None


@fused(aten.nll_loss2d_forward)
def nll_loss2d_forward(ct, out, x, target, weight, reduction, ignore_index):
    if ct[0] is None:
        return None
    return aten.nll_loss2d_backward(ct[0], x, target, weight, reduction, ignore_index, out[1]), None, None


def nll_loss_fwd(x, target, weight=None, reduction=MEAN, ignore_index=-100):
    """``F.nll_loss`` as ``nll_loss_forward`` (or the 2-d variant), which also returns the total
    weight its backward divides by; other ranks take the readable rule."""
    if x.dim() not in _NLL:
        out = aten.nll_loss_nd(x, target, weight, reduction, ignore_index)
        return out, ("readable", (out, (x, target, weight, reduction, ignore_index)))
    loss, total_weight = _NLL[x.dim()][0](x, target, weight, reduction, ignore_index)
    return loss, ("fused", (x, target, weight, reduction, ignore_index, total_weight))


def nll_loss_bwd(aux, ct):
    kind, aux = aux
    if kind == "readable":
        out, args = aux
        return nn.nll_loss_nd(ct, out, *args)
    x, target, weight, reduction, ignore_index, total_weight = aux
    return _NLL[x.dim()][1](ct, x, target, weight, reduction, ignore_index, total_weight), None, None


register_vjp(aten.nll_loss_nd, nll_loss_fwd, nll_loss_bwd, source=FUSED, rule_set=FUSED, complex="real")
register_vjp(aten.nll_loss, nll_loss_fwd, nll_loss_bwd, source=FUSED, rule_set=FUSED, complex="real")
