"""VJP rules of neural-network ops: softmax, normalisation, attention, convolution, pooling, losses.

Conventions used below:

- normalisations keep PyTorch's fused forward (``torch.native_layer_norm`` ...) because it also
  returns the statistics (mean and reciprocal standard deviation) that the backward needs;
- the backward of a normalisation is written once, in ``_normalized_grad``;
- ops with randomness (dropout) draw their mask once in the forward and reuse it;
- losses take ``reduction`` as PyTorch's enum: 0 none, 1 mean, 2 sum;
- an op's configuration past its tensors (a convolution's stride, padding, ...; a norm's training,
  momentum and eps) reaches its rule as ``**config`` under the schema's names (``registry.by_schema``),
  to be passed on as one unit (``Conv``, ``Pool``);
- complex tensors: the normalisations, attention, convolutions and ``l1_loss`` are written for real
  tensors (``complex="real"``); their complex calls use PyTorch's decompositions (a complex
  convolution is three real ones) or formulas.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import torch.nn.modules.linear_cross_entropy  # noqa: F401 - registers torch_nn._linear_cross_entropy_*

from ..errors import RuleRefusal
from ..registry import by_schema, register_vjp, vjp_rule
from .common import unbroadcast

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2


def ntuple(v, n):
    """An int-or-list conv/pool parameter as a list of length n."""
    if isinstance(v, (list, tuple)):
        return list(v) * n if len(v) == 1 else list(v)
    return [v] * n


# ---------------------------------------------------------------------------------------------
# softmax


# The rules' local variables name the values they compute in generated code (``att_expected``,
# ``ln_f_xhat``: capture/names.py), so they are the textbook's names.


def _softmax_grad(ct, probs, dim):
    """Cotangent of x for probs = softmax(x): probs * (ct - E_probs[ct])."""
    weighted = ct * probs
    expected = weighted.sum(dim, keepdim=True)
    centered = ct - expected
    return probs * centered


def _log_softmax_grad(ct, logp, dim):
    """Cotangent of x for logp = log_softmax(x): ct - probs * sum(ct)."""
    probs = logp.exp()
    total = ct.sum(dim, keepdim=True)
    return ct - probs * total


@vjp_rule(aten.softmax)
def softmax(ct, out, x, dim, dtype=None):
    return _softmax_grad(ct, out, dim)


@vjp_rule(aten._softmax)
def _softmax(ct, out, x, dim, half_to_float):
    return _softmax_grad(ct, out, dim)


@vjp_rule(aten._safe_softmax)
def _safe_softmax(ct, out, x, dim, dtype=None):
    return _softmax_grad(ct, out, dim)


@vjp_rule(aten.log_softmax)
def log_softmax(ct, out, x, dim, dtype=None):
    return _log_softmax_grad(ct, out, dim)


@vjp_rule(aten._log_softmax)
def _log_softmax(ct, out, x, dim, half_to_float):
    return _log_softmax_grad(ct, out, dim)


# ---------------------------------------------------------------------------------------------
# normalisation


def _normalized_grad(dxhat, xhat, rstd, dims):
    """Cotangent of x for xhat = (x - x.mean(dims)) * rstd, given the cotangent dxhat of xhat."""
    mean_dxhat = dxhat.mean(dims, keepdim=True)
    dxhat_xhat = dxhat * xhat
    mean_dxhat_xhat = dxhat_xhat.mean(dims, keepdim=True)
    dxhat_centered = dxhat - mean_dxhat
    projection = xhat * mean_dxhat_xhat
    dxhat_orth = dxhat_centered - projection
    return rstd * dxhat_orth


def _stats_grad(ct_mean, ct_rstd, xhat, rstd, n):
    """Cotangent of x through the statistics themselves (when the op returns mean and rstd)."""
    g = None
    if ct_mean is not None:
        g = ct_mean.expand(xhat.shape) / n
    if ct_rstd is not None:
        h = -ct_rstd * rstd * rstd * xhat / n
        g = h if g is None else g + h
    return g


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _sum_leading(t, ndim):
    """Sum the leading dims of t, leaving its last ndim (the shape of an affine weight)."""
    return t.sum(list(range(t.dim() - ndim))) if t.dim() > ndim else t


def _layer_norm_grads(ct, x, shape, weight, bias, mean, rstd):
    dims = list(range(x.dim() - len(shape), x.dim()))
    centered = x - mean
    xhat = centered * rstd
    dxhat = ct * weight if weight is not None else ct
    dx = _normalized_grad(dxhat, xhat, rstd, dims)
    dw = None
    if weight is not None:
        dy_xhat = ct * xhat
        dw = _sum_leading(dy_xhat, len(shape))
    db = _sum_leading(ct, len(shape)) if bias is not None else None
    return dx, dw, db


def layer_norm_fwd(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
    return out, (x, normalized_shape, weight, bias, mean, rstd)


def layer_norm_bwd(aux, ct):
    x, shape, weight, bias, mean, rstd = aux
    dx, dw, db = _layer_norm_grads(ct, x, shape, weight, bias, mean, rstd)
    return dx, None, dw, db


register_vjp(aten.layer_norm, layer_norm_fwd, layer_norm_bwd, source="hand-written", complex="real")


@vjp_rule(aten.native_layer_norm, complex="real")
def native_layer_norm(ct, out, x, normalized_shape, weight, bias, eps):
    # The statistics (outputs 1 and 2) are functions of x too: generated backward code reads
    # them, so differentiating it again (hvp, jvp) needs their cotangents.
    dx = dw = db = None
    if ct[0] is not None:
        dx, dw, db = _layer_norm_grads(ct[0], x, normalized_shape, weight, bias, out[1], out[2])
    if ct[1] is not None or ct[2] is not None:
        xhat = (x - out[1]) * out[2]
        dx = _add(dx, _stats_grad(ct[1], ct[2], xhat, out[2], math.prod(normalized_shape)))
    return dx, None, dw, db


def _opmath(t):
    """``t`` in the dtype PyTorch's kernels compute half-precision values in (float32)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _opmath_or_none(t):
    return t if t is None or not t.is_floating_point() else _opmath(t)


def _cast(t, dtype):
    return t if t is None or t.dtype == dtype else t.to(dtype)


def rms_norm_fwd(x, normalized_shape, weight=None, eps=None):
    """As eager's: in float32 (with float32's eps) for a half-precision ``x``, in ``x``'s dtype."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    xo = _opmath(x)
    eps = torch.finfo(xo.dtype).eps if eps is None else eps
    rstd = torch.rsqrt(xo.pow(2).mean(dims, keepdim=True) + eps)
    out = xo * rstd
    if weight is not None:
        out = out * weight
    return _cast(out, x.dtype), (x, normalized_shape, weight, rstd)


def rms_norm_bwd(aux, ct):
    x, shape, weight, rstd = aux
    dims = list(range(x.dim() - len(shape), x.dim()))
    xhat = _opmath(x) * rstd
    ct = _cast(ct, xhat.dtype if weight is None else torch.promote_types(xhat.dtype, weight.dtype))
    g = ct * weight if weight is not None else ct
    dx = rstd * (g - xhat * (g * xhat).mean(dims, keepdim=True))
    dw = _sum_leading(ct * xhat, len(shape)) if weight is not None else None
    return _cast(dx, x.dtype), None, None if dw is None else _cast(dw, weight.dtype), None


register_vjp(aten.rms_norm, rms_norm_fwd, rms_norm_bwd, source="hand-written", complex="real")


def _channel_shape(x):
    """Shape broadcasting a per-channel vector (dim 1) against x."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _group_norm_grads(ct, x, weight, bias, groups, stats, ct_stats=(None, None)):
    """Cotangents (x, weight, bias) of group norm; ``stats`` (mean, rstd) and their cotangents
    ``ct_stats`` are per sample and group."""
    n = x.shape[0]
    xg = x.reshape(n, groups, -1)
    mean, rstd = (s.reshape(n, groups, 1) for s in stats)
    ct_mean, ct_rstd = ct_stats
    xhat = (xg - mean) * rstd
    g = ct * weight.view(_channel_shape(x)) if weight is not None else ct
    dx = _normalized_grad(g.reshape(n, groups, -1), xhat, rstd, [-1])
    if ct_mean is not None or ct_rstd is not None:
        dx = _add(
            dx,
            _stats_grad(
                None if ct_mean is None else ct_mean.reshape(n, groups, 1),
                None if ct_rstd is None else ct_rstd.reshape(n, groups, 1),
                xhat,
                rstd,
                xg.shape[-1],
            ),
        )
    others = [0] + list(range(2, x.dim()))
    dw = (ct * xhat.reshape(x.shape)).sum(others) if weight is not None else None
    db = ct.sum(others) if bias is not None else None
    return dx.reshape(x.shape), dw, db


def group_norm_fwd(x, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    # As eager's group_norm: the kernel reads a contiguous input.
    x = x.contiguous()
    n, c = x.shape[0], x.shape[1]
    out, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, x[0, 0].numel(), num_groups, eps)
    return out, (x, num_groups, weight, bias, mean, rstd)


def group_norm_bwd(aux, ct):
    x, groups, weight, bias, mean, rstd = aux
    dx, dw, db = _group_norm_grads(ct, x, weight, bias, groups, (mean, rstd))
    return dx, None, dw, db


register_vjp(aten.group_norm, group_norm_fwd, group_norm_bwd, source="hand-written", complex="real")


@vjp_rule(aten.native_group_norm, complex="real")
def native_group_norm(ct, out, x, weight, bias, **norm):
    """``norm``: N, C, HxW, group, eps."""
    ct_out, *ct_stats = ct
    if ct_out is None:
        ct_out = torch.zeros_like(x)
    dx, dw, db = _group_norm_grads(ct_out, x, weight, bias, norm["group"], out[1:], ct_stats)
    return dx, dw, db


def _batch_norm_grads(ct, x, weight, bias, mean, rstd, training):
    """Cotangents (x, weight, bias) of batch norm; mean and rstd are per channel, shape (C,)."""
    others = [0] + list(range(2, x.dim()))
    mean, rstd = mean.view(_channel_shape(x)), rstd.view(_channel_shape(x))
    xhat = (x - mean) * rstd
    g = ct * weight.view(_channel_shape(x)) if weight is not None else ct
    if training:
        dx = _normalized_grad(g, xhat, rstd, others)
    else:
        dx = g * rstd
    dw = (ct * xhat).sum(others) if weight is not None else None
    db = ct.sum(others) if bias is not None else None
    return dx, dw, db


def batch_norm_fwd(x, weight, bias, running_mean, running_var, **norm):
    """``norm``: training, momentum, eps, cudnn_enabled."""
    training, momentum, eps = norm["training"], norm["momentum"], norm["eps"]
    if training or running_mean is None:
        # One call: it normalises with the batch statistics, returns them, and updates the
        # running statistics in place.
        out, mean, rstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var, True, momentum, eps)
    else:
        out = torch.batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps, norm.get("cudnn_enabled", True))
        mean, rstd = running_mean, torch.rsqrt(running_var + eps)
    return out, (x, weight, bias, mean, rstd, training or running_mean is None)


def batch_norm_bwd(aux, ct):
    x, weight, bias, mean, rstd, training = aux
    dx, dw, db = _batch_norm_grads(ct, x, weight, bias, mean, rstd, training)
    return dx, dw, db, None, None


register_vjp(aten.batch_norm, by_schema(aten.batch_norm, batch_norm_fwd), batch_norm_bwd, source="hand-written", complex="real")


def _native_batch_norm_bwd(ct, out, x, weight, bias, running, eps):
    """``running``: the running (mean, var) evaluation normalises with; None in training."""
    # In training the batch statistics (outputs 1 and 2) are functions of x too: generated
    # backward code reads them, so differentiating it again (hvp, jvp) needs their cotangents.
    training = running is None
    if training:
        mean, rstd = out[1], out[2]
    else:
        mean, rstd = running[0], torch.rsqrt(running[1] + eps)
    dx = dw = db = None
    if ct[0] is not None:
        dx, dw, db = _batch_norm_grads(ct[0], x, weight, bias, mean, rstd, training)
    stats = [c if training else None for c in ct[1:3]]
    if any(c is not None for c in stats):
        shape = _channel_shape(x)
        m, r = mean.view(shape), rstd.view(shape)
        dx = _add(
            dx,
            _stats_grad(
                None if stats[0] is None else stats[0].view(shape),
                None if stats[1] is None else stats[1].view(shape),
                (x - m) * r,
                r,
                x.numel() // x.shape[1],
            ),
        )
    return dx, dw, db


@vjp_rule(aten.native_batch_norm, complex="real")
def native_batch_norm(ct, out, x, weight, bias, running_mean, running_var, **norm):
    """``norm``: training, momentum, eps (as for the other batch norms)."""
    running = None if norm["training"] or running_mean is None else (running_mean, running_var)
    return _native_batch_norm_bwd(ct, out, x, weight, bias, running, norm["eps"])


@vjp_rule(aten._native_batch_norm_legit.default, complex="real")
def native_batch_norm_legit(ct, out, x, weight, bias, running_mean, running_var, **norm):
    running = None if norm["training"] else (running_mean, running_var)
    return _native_batch_norm_bwd(ct, out, x, weight, bias, running, norm["eps"])


@vjp_rule(aten._native_batch_norm_legit.no_stats, complex="real")
def native_batch_norm_legit_no_stats(ct, out, x, weight, bias, training, momentum, eps):
    return _native_batch_norm_bwd(ct, out, x, weight, bias, None, eps)


@vjp_rule(aten._native_batch_norm_legit_no_training, complex="real")
def _native_batch_norm_legit_no_training(ct, out, x, weight, bias, running_mean, running_var, **norm):
    return _native_batch_norm_bwd(ct, out, x, weight, bias, (running_mean, running_var), norm["eps"])


# ---------------------------------------------------------------------------------------------
# embedding


@vjp_rule(aten.embedding)
def embedding(ct, out, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if padding_idx >= 0:
        ct = ct.masked_fill((indices == padding_idx).unsqueeze(-1), 0)
    flat = indices.reshape(-1)
    grad_rows = ct.reshape(-1, weight.shape[-1])
    if scale_grad_by_freq:
        counts = torch.zeros(weight.shape[0], dtype=ct.dtype, device=ct.device).index_add(
            0, flat, torch.ones_like(flat, dtype=ct.dtype)
        )
        grad_rows = grad_rows / counts[flat].unsqueeze(-1)
    table = torch.zeros_like(weight)
    grad_weight = table.index_add(0, flat, grad_rows)
    return grad_weight, None


def embedding_bag(ct, out, weight, indices, offsets, **config):
    """Bags of embeddings reduced by sum (mode 0), mean (1) or max (2); ``indices`` is 1-D. ``config``:
    scale_grad_by_freq, mode, sparse, per_sample_weights, include_last_offset, padding_idx."""
    mode, per_sample_weights, padding_idx = config.get("mode", 0), config.get("per_sample_weights"), config.get("padding_idx", -1)
    ct = ct[0]
    if mode == 2:  # each output element came from one row, its argmax (empty bags: none)
        filled = (out[2] > 0).unsqueeze(-1)
        return torch.zeros_like(weight).scatter_add(0, out[3], ct * filled), None, None, None
    position = torch.arange(indices.shape[0], device=indices.device)
    bag = torch.searchsorted(offsets, position, right=True) - 1
    keep = (indices != padding_idx).unsqueeze(-1) if padding_idx is not None and padding_idx >= 0 else None
    grad = ct[bag]
    if mode == 1:  # out[2] is the size of each bag (padding excluded)
        grad = grad / out[2][bag].unsqueeze(-1)
    if keep is not None:
        grad = grad * keep
    grad_psw = None
    if per_sample_weights is not None:
        grad_psw = (grad * weight[indices]).sum(-1)
        grad = grad * per_sample_weights.unsqueeze(-1)
    if config.get("scale_grad_by_freq", False):
        counts = torch.zeros(weight.shape[0], dtype=ct.dtype, device=ct.device).index_add(
            0, indices, torch.ones_like(indices, dtype=ct.dtype)
        )
        grad = grad / counts[indices].unsqueeze(-1)
    grads = [torch.zeros_like(weight).index_add(0, indices, grad), None, None, None, None, None, grad_psw]
    return tuple(grads)


vjp_rule(aten.embedding_bag)(embedding_bag)


# ---------------------------------------------------------------------------------------------
# convolution

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_CONV_WEIGHT = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}


def _right_padding(shape, target):
    """F.pad's argument growing the trailing dims of ``shape`` to ``target`` on the right."""
    pad = []
    for n, m in zip(reversed(shape), reversed(target)):
        pad += [0, m - n]
    return pad


class Conv(NamedTuple):
    """A convolution's configuration: ``aten.convolution``'s arguments after its tensors (the
    ``**conv`` of the rules below), in the order ``aten.convolution_backward`` takes them."""

    stride: Any = 1
    padding: Any = 0
    dilation: Any = 1
    transposed: bool = False
    output_padding: Any = 0
    groups: int = 1

    def expanded(self, nd: int) -> Conv:
        """The sizes as lists of ``nd`` (what the backward kernels take)."""
        stride, padding, dilation, output_padding = (
            ntuple(v, nd) for v in (self.stride, self.padding, self.dilation, self.output_padding)
        )
        return self._replace(stride=stride, padding=padding, dilation=dilation, output_padding=output_padding)


def _conv_grads(ct, x, weight, bias, conv: Conv):
    """Cotangents (input, weight, bias) of a (transposed) convolution with symmetric padding."""
    nd = weight.dim() - 2
    stride, padding, dilation, transposed, _, groups = conv.expanded(nd)
    unbatched = x.dim() == nd + 1
    if unbatched:
        x, ct = x.unsqueeze(0), ct.unsqueeze(0)
    if transposed:
        dx = _CONV[nd](ct, weight, None, stride, padding, dilation, groups)
        # With output_padding >= stride, the last positions of dx meet no input: zeros of x.
        x_full = F.pad(x, _right_padding(x.shape[2:], dx.shape[2:])) if dx.shape != x.shape else x
        dw = _CONV_WEIGHT[nd](ct, weight.shape, x_full, stride, padding, dilation, groups)
    else:
        kernel = weight.shape[2:]
        extra = [
            n + 2 * p - (d * (k - 1) + 1) - (o - 1) * s
            for n, o, k, s, p, d in zip(x.shape[2:], ct.shape[2:], kernel, stride, padding, dilation)
        ]
        dx = _CONV_T[nd](ct, weight, None, stride, padding, extra, groups, dilation)
        dw = _CONV_WEIGHT[nd](x, weight.shape, ct, stride, padding, dilation, groups)
    db = ct.sum([0] + list(range(2, ct.dim()))) if bias is not None else None
    if dx.shape != x.shape:
        dx = dx[(...,) + tuple(slice(0, n) for n in x.shape[2:])]
    return (dx.squeeze(0) if unbatched else dx), dw, db


def _conv_string_padding(ct, x, weight, bias, conv: Conv):
    """padding='valid' or 'same' ('same' pads one more on the right when the total is odd)."""
    nd = weight.dim() - 2
    if conv.padding == "valid":
        return _conv_grads(ct, x, weight, bias, conv._replace(padding=0))
    total = [d * (k - 1) for d, k in zip(ntuple(conv.dilation, nd), weight.shape[2:])]
    left = conv._replace(padding=[t // 2 for t in total])
    if all(t % 2 == 0 for t in total):
        return _conv_grads(ct, x, weight, bias, left)
    extra = [n + t % 2 for n, t in zip(x.shape[-nd:], total)]
    dx, dw, db = _conv_grads(ct, F.pad(x, _right_padding(x.shape[-nd:], extra)), weight, bias, left)
    return dx[(...,) + tuple(slice(0, n) for n in x.shape[-nd:])], dw, db


def conv_nd(ct, out, x, weight, bias=None, **conv):
    """``conv``: stride, padding (sizes, or "valid" / "same"), dilation, groups."""
    if isinstance(conv.get("padding"), str):
        return _conv_string_padding(ct, x, weight, bias, Conv(**conv))
    return _conv_grads(ct, x, weight, bias, Conv(**conv))


def _conv_transpose_nd(ct, out, x, weight, bias=None, **conv):
    """``conv``: stride, padding, output_padding, groups, dilation."""
    return _conv_grads(ct, x, weight, bias, Conv(**conv, transposed=True))


# Complex convolutions: PyTorch's decomposition into real ones (the kernels are real-only).
for _op in (aten.conv1d, aten.conv2d, aten.conv3d):
    vjp_rule(_op, complex="real")(conv_nd)
for _op in (aten.conv_transpose1d, aten.conv_transpose2d.input, aten.conv_transpose3d.input):
    vjp_rule(_op, complex="real")(_conv_transpose_nd)


@vjp_rule(aten.convolution, complex="real")
def convolution(ct, out, x, weight, bias, **conv):
    return _conv_grads(ct, x, weight, bias, Conv(**conv))


# ---------------------------------------------------------------------------------------------
# pooling


def _scatter_max(ct, x, indices, nd):
    """Route each pooled cotangent to the input position its max came from."""
    start = x.dim() - nd
    grad = torch.zeros_like(x).flatten(start).scatter_add(-1, indices.flatten(start), ct.flatten(start))
    return grad.view_as(x)


MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _max_pool_rule(op, nd):
    def fwd(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        out, indices = MAX_POOL[nd](x, kernel_size, stride or None, padding, dilation, ceil_mode, return_indices=True)
        return out, (x, indices)

    def bwd(aux, ct):
        x, indices = aux
        return _scatter_max(ct, x, indices, nd)

    register_vjp(op, fwd, bwd, source="hand-written")


for _nd, _op in ((1, aten.max_pool1d), (2, aten.max_pool2d), (3, aten.max_pool3d)):
    _max_pool_rule(_op, _nd)


def _max_with_indices_rule(op, nd):
    @vjp_rule(op)
    def max_pool_with_indices(ct, out, x, *args):
        return _scatter_max(ct[0], x, out[1], nd)

    max_pool_with_indices.__name__ = op.__name__


for _nd, _op in (
    (1, aten.max_pool1d_with_indices),
    (2, aten.max_pool2d_with_indices),
    (3, aten.max_pool3d_with_indices),
    (1, aten.adaptive_max_pool1d),
    (2, aten.adaptive_max_pool2d),
    (3, aten.adaptive_max_pool3d),
):
    _max_with_indices_rule(_op, _nd)


@vjp_rule(aten.avg_pool1d)
def avg_pool1d(ct, out, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True):
    k, s, p = ntuple(kernel_size, 1), ntuple(stride or kernel_size, 1), ntuple(padding, 1)
    grad = torch.ops.aten.avg_pool2d_backward(
        ct.unsqueeze(-2), x.unsqueeze(-2), [1, *k], [1, *s], [0, *p], ceil_mode, count_include_pad, None
    )
    return grad.squeeze(-2)


class Pool(NamedTuple):
    """An average pooling's configuration after its kernel size (the ``**pool`` of its rules), in
    the order its backward kernel takes it."""

    stride: Any = ()  # empty: the kernel size
    padding: Any = 0
    ceil_mode: bool = False
    count_include_pad: bool = True
    divisor_override: Any = None


@vjp_rule(aten.avg_pool2d)
def avg_pool2d(ct, out, x, kernel_size, **pool):
    stride, *rest = Pool(**pool)
    return torch.ops.aten.avg_pool2d_backward(ct, x, kernel_size, stride or kernel_size, *rest)


@vjp_rule(aten.avg_pool3d)
def avg_pool3d(ct, out, x, kernel_size, **pool):
    stride, *rest = Pool(**pool)
    return torch.ops.aten.avg_pool3d_backward(ct, x, kernel_size, stride or kernel_size, *rest)


def _adaptive_avg_grad(ct, x, nd):
    spatial = x.shape[x.dim() - nd :]
    if all(n == 1 for n in ct.shape[ct.dim() - nd :]):  # global average pooling
        return ct.expand(x.shape) / math.prod(spatial)
    if nd == 1:
        return torch.ops.aten._adaptive_avg_pool2d_backward(ct.unsqueeze(-2), x.unsqueeze(-2)).squeeze(-2)
    if nd == 2:
        return torch.ops.aten._adaptive_avg_pool2d_backward(ct, x)
    return torch.ops.aten._adaptive_avg_pool3d_backward(ct, x)


def _adaptive_avg_rule(op, nd):
    def adaptive_avg_pool(ct, out, x, output_size):
        return _adaptive_avg_grad(ct, x, nd)

    adaptive_avg_pool.__name__ = op.__name__
    vjp_rule(op)(adaptive_avg_pool)


for _nd, _op in (
    (1, aten.adaptive_avg_pool1d),
    (2, aten.adaptive_avg_pool2d),
    (2, aten._adaptive_avg_pool2d),
    (3, aten.adaptive_avg_pool3d),
    (3, aten._adaptive_avg_pool3d),
):
    _adaptive_avg_rule(_op, _nd)


# ---------------------------------------------------------------------------------------------
# upsampling (interpolate): PyTorch's backward kernels, except nearest upsampling by whole factors


def _upsample_scales(rest, nd):
    """The scales of an upsample call: ``.vec`` passes a list (or None), other overloads floats."""
    if len(rest) == 1 and (rest[0] is None or isinstance(rest[0], (list, tuple))):
        return [None] * nd if rest[0] is None else list(rest[0])
    return list(rest) + [None] * (nd - len(rest))


def _linear_upsample_grad(ct, x, align, scales):
    """The gradient of linear interpolation (linear, bilinear, trilinear) at symbolic sizes, one
    spatial dimension at a time as two ``index_add`` (PyTorch's backward kernels have no meta
    function for symbolic sizes); source indices and weights as PyTorch's kernels compute them."""
    dtype = torch.float64 if ct.dtype == torch.float64 else torch.float32  # the kernels' opmath type
    grad = ct
    for k in range(x.dim() - 2):
        d, in_size, out_size = 2 + k, x.shape[2 + k], ct.shape[2 + k]
        i = torch.arange(out_size, device=ct.device).to(dtype)
        if align:
            src = i * (in_size - 1) / (out_size - 1) if isinstance(out_size, torch.SymInt) or out_size > 1 else i * 0
        elif scales[k] is not None and scales[k] > 0:
            src = (i + 0.5) / scales[k] - 0.5
        else:
            src = (i + 0.5) * in_size / out_size - 0.5
        src = src.clamp(min=0.0)
        lo = src.to(torch.int64)
        hi = (lo + 1).clamp(max=in_size - 1)
        weight = (src - lo).clamp(0.0, 1.0).to(ct.dtype).reshape([-1] + [1] * (x.dim() - 1 - d))
        shape = list(grad.shape)
        shape[d] = in_size
        grad = grad.new_zeros(shape).index_add(d, lo, grad * (1 - weight)).index_add(d, hi, grad * weight)
    return grad


def _upsample_rule(op, backward, nd, align_corners, nearest=False, linear=False):
    def rule(ct, out, x, output_size, *rest):
        if align_corners:
            align, rest = rest[0], rest[1:]
        scales = _upsample_scales(rest, nd)
        in_size, out_size = list(x.shape[2:]), list(ct.shape[2:])
        factors = [o // i for o, i in zip(out_size, in_size)]
        whole = all(o == f * i and (s is None or s == f) for o, i, f, s in zip(out_size, in_size, factors, scales))
        if nearest and whole:  # each input element was copied to a block of factors: sum the block
            blocks = list(x.shape[:2])
            for i, f in zip(in_size, factors):
                blocks += [i, f]
            return ct.reshape(blocks).sum(list(range(3, 3 + 2 * nd, 2)))
        if any(isinstance(n, torch.SymInt) for n in (*in_size, *out_size)):
            if linear:
                return _linear_upsample_grad(ct, x, align, scales)
            raise RuleRefusal(
                f"{op.__name__} at symbolic sizes: PyTorch's {backward.__name__} has no meta function for them "
                "(it fails with an internal assert); keep these sizes static (leave them out of dynamic_shapes, "
                "or dynamic=False), or interpolate with mode='bilinear'"
            )
        extra = [align] if align_corners else []
        return backward(ct, out_size, list(x.shape), *extra, *scales)

    rule.__name__ = op.__name__
    vjp_rule(op)(rule)


for _op, _bw, _nd, _align, *_nearest in (
    (aten.upsample_nearest1d, aten.upsample_nearest1d_backward, 1, False, True),
    (aten.upsample_nearest2d, aten.upsample_nearest2d_backward, 2, False, True),
    (aten.upsample_nearest3d, aten.upsample_nearest3d_backward, 3, False, True),
    (aten._upsample_nearest_exact1d, aten._upsample_nearest_exact1d_backward, 1, False, True),
    (aten._upsample_nearest_exact2d, aten._upsample_nearest_exact2d_backward, 2, False, True),
    (aten._upsample_nearest_exact3d, aten._upsample_nearest_exact3d_backward, 3, False, True),
    (aten.upsample_linear1d, aten.upsample_linear1d_backward, 1, True, False, True),
    (aten.upsample_bilinear2d, aten.upsample_bilinear2d_backward, 2, True, False, True),
    (aten.upsample_bicubic2d, aten.upsample_bicubic2d_backward, 2, True),
    (aten.upsample_trilinear3d, aten.upsample_trilinear3d_backward, 3, True, False, True),
):
    _upsample_rule(_op, _bw, _nd, _align, *_nearest)


@vjp_rule(aten.cosine_similarity)
def cosine_similarity(ct, out, x1, x2, dim=1, eps=1e-8):
    norm1 = x1.norm(dim=dim, keepdim=True).clamp_min(eps)
    norm2 = x2.norm(dim=dim, keepdim=True).clamp_min(eps)
    g, cos = ct.unsqueeze(dim), out.unsqueeze(dim)
    grad1 = g * (x2 / norm2 - x1 / norm1 * cos) / norm1
    grad2 = g * (x1 / norm1 - x2 / norm2 * cos) / norm2
    return unbroadcast(grad1, x1), unbroadcast(grad2, x2)


@vjp_rule(aten.pdist)  # its torch._decomp entry (through a matrix product and sqrt) is NaN at 0
@vjp_rule(aten._pdist_forward)
def _pdist_forward(ct, out, x, p=2.0):
    """pdist's rows i < j (``triu_indices`` order): the p-norm's gradient for each pair, zero
    where the distance is zero (PyTorch's subgradient), added to row i and subtracted from row j."""
    n = x.shape[0]
    idx = torch.triu_indices(n, n, 1, device=x.device)
    i, j = idx[0], idx[1]
    diff = x.index_select(0, i) - x.index_select(0, j)
    dist = out.unsqueeze(-1)
    if p == 0:
        return torch.zeros_like(x)
    if p == 1:
        g = torch.sign(diff)
    elif p == math.inf:
        g = torch.sign(diff) * (diff.abs() == dist)
    else:
        nonzero = dist != 0
        safe = torch.where(nonzero, dist, 1)
        if p == 2:
            g = diff / safe
        else:
            g = torch.sign(diff) * diff.abs().pow(p - 1) / safe.pow(p - 1)
            if p < 1:  # |diff| ** (p - 1) is infinite at diff == 0, where sign(diff) is 0
                g = torch.where(diff == 0, 0, g)
        g = torch.where(nonzero, g, 0)
    g = g * ct.unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, i, g).index_add(0, j, -g)


@vjp_rule(aten.pixel_shuffle)
def pixel_shuffle(ct, out, x, upscale_factor):
    return F.pixel_unshuffle(ct, upscale_factor)


@vjp_rule(aten.pixel_unshuffle)
def pixel_unshuffle(ct, out, x, downscale_factor):
    return F.pixel_shuffle(ct, downscale_factor)


# ---------------------------------------------------------------------------------------------
# dropout: one mask, drawn in the forward (as eager PyTorch draws it) and reused by the backward


def dropout_fwd(x, p, train):
    if not train or p == 0:
        return x, None
    if p == 1:
        return x * 0, 0.0
    mask = torch.empty_like(x).bernoulli_(1 - p) / (1 - p)
    return x * mask, mask


def dropout_bwd(mask, ct):
    return ct if mask is None else ct * mask, None, None


register_vjp(aten.dropout, dropout_fwd, dropout_bwd, source="hand-written")


def feature_dropout_fwd(x, p, train):
    """Dropout of whole channels (dropout1d/2d/3d): one draw per (sample, channel)."""
    if not train or p == 0:
        return x, None
    if p == 1:
        return x * 0, 0.0
    mask = x.new_empty([x.shape[0], x.shape[1]] + [1] * (x.dim() - 2)).bernoulli_(1 - p) / (1 - p)
    return x * mask, mask


register_vjp(aten.feature_dropout, feature_dropout_fwd, dropout_bwd, source="hand-written")


@vjp_rule(aten.native_dropout)
def native_dropout(ct, out, x, p, train):
    ct = ct[0]
    if ct is None:
        return None
    if not train:
        return ct, None, None
    return ct * out[1] / (1 - p) if p < 1 else ct * 0, None, None


# ---------------------------------------------------------------------------------------------
# attention


def _attention_probs(q, k, attn_mask, is_causal, scale):
    kt = k.transpose(-2, -1)
    qk = q @ kt
    scores = qk * scale
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = causal.logical_not()
        scores = scores.masked_fill(mask, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
            return torch.softmax(scores, -1).nan_to_num(0.0)  # a fully masked row attends to nothing
        scores = scores + attn_mask
    return torch.softmax(scores, -1)


def _repeat_heads(t, q, enable_gqa):
    """Key/value heads repeated to match the query's (grouped-query attention)."""
    if enable_gqa and t.shape[-3] != q.shape[-3]:
        return t.repeat_interleave(q.shape[-3] // t.shape[-3], -3)
    return t


def _sum_heads(g, t):
    if g.dim() >= 3 and t.dim() >= 3 and g.shape[-3] != t.shape[-3] and t.shape[-3] != 1:
        return g.unflatten(-3, (t.shape[-3], -1)).sum(-3)
    return g


def sdpa_fwd(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    given, scale = scale, 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    keep = None
    if dropout_p == 0:  # the call as written (``scale`` as given): the same call as the program's, shared
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=given, enable_gqa=enable_gqa)
    else:
        probs = _attention_probs(q, _repeat_heads(k, q, enable_gqa), attn_mask, is_causal, scale)
        keep = torch.empty_like(probs).bernoulli_(1 - dropout_p) / (1 - dropout_p)
        out = (probs * keep) @ _repeat_heads(v, q, enable_gqa)
    return out, (q, k, v, attn_mask, is_causal, scale, enable_gqa, keep)


def sdpa_bwd(aux, ct):
    q, k, v, attn_mask, is_causal, scale, enable_gqa, keep = aux
    if q.dtype in (torch.float16, torch.bfloat16):  # in float32, as eager's kernels compute it
        grads = sdpa_bwd((*map(_opmath_or_none, (q, k, v, attn_mask)), is_causal, scale, enable_gqa, keep), _opmath(ct))
        return tuple(_cast(g, t.dtype) if g is not None else None for g, t in zip(grads, (q, k, v, attn_mask)))
    kr, vr = _repeat_heads(k, q, enable_gqa), _repeat_heads(v, q, enable_gqa)
    probs = _attention_probs(q, kr, attn_mask, is_causal, scale)
    dropped = probs if keep is None else probs * keep
    grad_v = dropped.transpose(-2, -1) @ ct
    dprobs = ct @ vr.transpose(-2, -1)
    if keep is not None:
        dprobs = dprobs * keep
    dscores = _softmax_grad(dprobs, probs, -1)
    grad_q = dscores @ kr * scale
    grad_k = dscores.transpose(-2, -1) @ q * scale
    grad_mask = None
    if attn_mask is not None and attn_mask.is_floating_point():
        grad_mask = unbroadcast(dscores, attn_mask)
    return (unbroadcast(grad_q, q), unbroadcast(_sum_heads(grad_k, k), k), unbroadcast(_sum_heads(grad_v, v), v), grad_mask)


register_vjp(aten.scaled_dot_product_attention, sdpa_fwd, sdpa_bwd, source="hand-written", complex="real")


# ---------------------------------------------------------------------------------------------
# losses


def _reduced(ct, reduction, n):
    """The per-element cotangent scale of a loss reduced by ``reduction`` over ``n`` elements."""
    return ct / n if reduction == MEAN else ct


def _class_grad(ct, x, target, weight, reduction, ignore_index, smoothing=0.0):
    """Cotangent of log-probabilities ``x`` (classes in dim 1, or 0 unbatched) for class-index targets."""
    cdim = 1 if x.dim() > 1 else 0
    valid = target != ignore_index
    target = torch.where(valid, target, 0)
    w = weight[target] if weight is not None else 1.0
    coef = ct * valid
    if reduction == MEAN:
        count = valid.sum() if weight is None else (w * valid).sum()
        coef = coef / count
    scaled = -(1 - smoothing) * coef
    if weight is not None:
        scaled = scaled * w
    picked = scaled.unsqueeze(cdim)
    zeros = torch.zeros_like(x)
    index = target.unsqueeze(cdim)
    dlogp = zeros.scatter(cdim, index, picked)
    if smoothing:
        classes = x.shape[cdim]
        spread = coef.unsqueeze(cdim) if weight is None else coef.unsqueeze(cdim) * _class_view(weight, x, cdim)
        dlogp = dlogp - smoothing / classes * spread
    return dlogp


def _class_view(weight, x, cdim):
    return weight.view([-1] + [1] * (x.dim() - cdim - 1))


@vjp_rule(aten.nll_loss_nd)
def nll_loss_nd(ct, out, x, target, weight=None, reduction=MEAN, ignore_index=-100):
    return _class_grad(ct, x, target, weight, reduction, ignore_index), None, None


@vjp_rule(aten.nll_loss)
def nll_loss(ct, out, x, target, weight=None, reduction=MEAN, ignore_index=-100):
    return _class_grad(ct, x, target, weight, reduction, ignore_index), None, None


@vjp_rule(aten.nll_loss2d)
def nll_loss2d(ct, out, x, target, weight=None, reduction=MEAN, ignore_index=-100):
    return _class_grad(ct, x, target, weight, reduction, ignore_index), None, None


@vjp_rule(aten.nll_loss_forward)
def nll_loss_forward(ct, out, x, target, weight, reduction, ignore_index):
    if ct[0] is None:  # only the total weight (output 1) was used: it carries no gradient
        return None
    return _class_grad(ct[0], x, target, weight, reduction, ignore_index), None, None


@vjp_rule(aten.nll_loss2d_forward)
def nll_loss2d_forward(ct, out, x, target, weight, reduction, ignore_index):
    if ct[0] is None:
        return None
    return _class_grad(ct[0], x, target, weight, reduction, ignore_index), None, None


@vjp_rule(aten.cross_entropy_loss)
def cross_entropy_loss(ct, out, x, target, weight=None, reduction=MEAN, ignore_index=-100, label_smoothing=0.0):
    cdim = 1 if x.dim() > 1 else 0
    grad_target = grad_weight = None
    if target.is_floating_point():  # class probabilities
        classes = x.shape[cdim]
        coef = ct.unsqueeze(cdim) if reduction == NONE else _reduced(ct, reduction, x.numel() // classes)
        w = _class_view(weight, x, cdim) if weight is not None else 1.0
        log_probs = torch.log_softmax(x, cdim)
        grad_target = -(1 - label_smoothing) * coef * w * log_probs
        smoothed = target * (1 - label_smoothing) + label_smoothing / classes if label_smoothing else target
        dlogp = -coef * w * smoothed
        if weight is not None:
            grad_weight = (-coef * smoothed * log_probs).sum([d for d in range(x.dim()) if d != cdim])
    else:
        dlogp = _class_grad(ct, x, target, weight, reduction, ignore_index, label_smoothing)
    probs = torch.softmax(x, cdim)
    total = dlogp.sum(cdim, keepdim=True)
    probs_total = probs * total
    grad_x = dlogp - probs_total
    return grad_x, grad_target, grad_weight


@vjp_rule(aten.mse_loss)
def mse_loss(ct, out, x, target, reduction=MEAN):
    grad = 2 * (x - target) * _reduced(ct, reduction, max(x.numel(), target.numel()))
    return unbroadcast(grad, x), unbroadcast(-grad, target)


@vjp_rule(aten.l1_loss, complex="real")
def l1_loss(ct, out, x, target, reduction=MEAN):
    grad = torch.sign(x - target) * _reduced(ct, reduction, max(x.numel(), target.numel()))
    return unbroadcast(grad, x), unbroadcast(-grad, target)


@vjp_rule(aten.smooth_l1_loss)
def smooth_l1_loss(ct, out, x, target, reduction=MEAN, beta=1.0):
    diff = x - target
    slope = diff.clamp(-beta, beta) / beta if beta > 0 else torch.sign(diff)
    grad = slope * _reduced(ct, reduction, diff.numel())
    return unbroadcast(grad, x), unbroadcast(-grad, target)


@vjp_rule(aten.huber_loss)
def huber_loss(ct, out, x, target, reduction=MEAN, delta=1.0):
    diff = x - target
    grad = diff.clamp(-delta, delta) * _reduced(ct, reduction, diff.numel())
    return unbroadcast(grad, x), unbroadcast(-grad, target)


@vjp_rule(aten.binary_cross_entropy)
def binary_cross_entropy(ct, out, x, target, weight=None, reduction=MEAN):
    coef = _reduced(ct, reduction, x.numel())
    if weight is not None:
        coef = coef * weight
    grad_x = coef * (x - target) / ((1 - x) * x).clamp(min=1e-12)
    grad_target = coef * (torch.log1p(-x).clamp(min=-100) - torch.log(x).clamp(min=-100))
    return grad_x, grad_target, None


@vjp_rule(aten.binary_cross_entropy_with_logits)
def binary_cross_entropy_with_logits(ct, out, x, target, weight=None, pos_weight=None, reduction=MEAN):
    coef = _reduced(ct, reduction, x.numel())
    if weight is not None:
        coef = coef * weight
    sig = torch.sigmoid(x)
    if pos_weight is None:
        grad_x = coef * (sig - target)
        grad_target = -coef * x
    else:
        grad_x = coef * ((1 - target) * sig - pos_weight * target * (1 - sig))
        grad_target = -coef * (pos_weight * F.logsigmoid(x) - F.logsigmoid(-x))
    return unbroadcast(grad_x, x), unbroadcast(grad_target, target), None, None


@vjp_rule(aten.kl_div)
def kl_div(ct, out, x, target, reduction=MEAN, log_target=False):
    coef = _reduced(ct, reduction, max(x.numel(), target.numel()))
    if log_target:
        grad_x = -coef * target.exp()
        grad_target = coef * target.exp() * (target - x + 1)
    else:
        grad_x = -coef * target
        grad_target = coef * (torch.log(target) + 1 - x)
    return unbroadcast(grad_x, x), unbroadcast(grad_target, target)


# ---------------------------------------------------------------------------------------------
# chunked linear + cross entropy (PyTorch's custom op behind F.linear_cross_entropy's options)

_lce_chunked = torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default


def linear_cross_entropy_chunked_fwd(input, linear_weight, target, linear_bias, *options):
    """The op computes the loss and, when asked by its last three flags, the gradients of input,
    weight and bias in the same chunked pass; its own backward scales them by the cotangent.
    PyTorch's wrapper sets the flags from ``requires_grad``, False while fxtools traces, so the
    forward asks for all three (the extra outputs, empty in the traced call, hold them)."""
    out = _lce_chunked(input, linear_weight, target, linear_bias, *options[:-3], True, True, linear_bias is not None)
    return out, (out[1:], linear_weight.dtype, linear_bias.dtype if linear_bias is not None else None)


def linear_cross_entropy_chunked_bwd(aux, ct):
    (gi, gw, gb), w_dtype, b_dtype = aux
    ct = ct[0] if isinstance(ct, (tuple, list)) else ct
    if ct is None:
        return (None,) * 15
    grad_w, grad_b = gw * ct, None if b_dtype is None else gb * ct
    if grad_w.dtype != w_dtype:  # the op's gradients are in the input's dtype (mixed precision)
        grad_w, grad_b = grad_w.to(w_dtype), None if grad_b is None else grad_b.to(b_dtype)
    return (gi * ct, grad_w, None, grad_b) + (None,) * 11


register_vjp(
    _lce_chunked, linear_cross_entropy_chunked_fwd, linear_cross_entropy_chunked_bwd, source="hand-written", complex="real"
)


def ctc_loss_tensor_fwd(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=MEAN, zero_infinity=False):
    """``F.ctc_loss`` with the lengths as tensors, as ATen's ``ctc_loss`` computes it, but through
    ``_ctc_loss``'s ``.Tensor`` overload: its composite definition turns the lengths into Python
    lists, which a trace cannot do."""
    batched = log_probs.dim() == 3
    lp = log_probs if batched else log_probs.unsqueeze(1)
    if not batched:
        targets, input_lengths, target_lengths = targets.unsqueeze(0), input_lengths.reshape(1), target_lengths.reshape(1)
    targets, input_lengths, target_lengths = targets.long(), input_lengths.long(), target_lengths.long()
    nll, log_alpha = aten._ctc_loss.Tensor(lp, targets, input_lengths, target_lengths, blank, zero_infinity)
    res = torch.where(nll == math.inf, 0, nll) if zero_infinity else nll
    scale = target_lengths.to(res.dtype).clamp_min(1)
    if reduction == MEAN:
        out = (res / scale).mean()
    elif reduction == SUM:
        out = res.sum()
    else:
        out = res if batched else res.squeeze(0)
    return out, (lp, targets, input_lengths, target_lengths, nll, log_alpha, blank, reduction, zero_infinity, scale, batched)


def ctc_loss_tensor_bwd(aux, ct):
    """``_ctc_loss_backward`` of the per-sample cotangent (``zero_infinity`` zeroes it at infinite losses)."""
    lp, targets, input_lengths, target_lengths, nll, log_alpha, blank, reduction, zero_infinity, scale, batched = aux
    if reduction == MEAN:
        per_sample = ct / scale / scale.shape[0]
    elif reduction == SUM:
        per_sample = ct.expand(nll.shape)
    else:
        per_sample = ct if batched else ct.unsqueeze(0)
    grad = aten._ctc_loss_backward.Tensor(
        per_sample, lp, targets, input_lengths, target_lengths, nll, log_alpha, blank, zero_infinity
    )
    return grad if batched else grad.squeeze(1), None, None, None, None, None, None


register_vjp(aten.ctc_loss.Tensor, ctc_loss_tensor_fwd, ctc_loss_tensor_bwd, source="hand-written", complex="real")
