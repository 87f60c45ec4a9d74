"""Rules of nn ops (fxtools/rules/nn.py): correctness beyond the OpInfo samples, readability,
stateful BatchNorm and dropout's random mask."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

import fxtools
from fxtools.transforms.check import check_vjp

aten = torch.ops.aten


def r(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def calls(gm):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


# ---------------------------------------------------------------------------------------------
# correctness against autograd, for cases OpInfo does not sample

idx = torch.tensor([1, 0, 3, 3, 2])
_chunked = LinearCrossEntropyOptions(batch_chunk_size=2)  # F.linear_cross_entropy's chunked custom op
idx2d = torch.tensor([[1, 0, 3], [2, 2, -100]])
class_w = torch.tensor([0.5, 2.0, 1.0, 1.5], dtype=torch.float64)
bag_idx = torch.tensor([1, 2, 4, 5, 4, 3])
bag_off = torch.tensor([0, 3, 3, 5])  # the second bag is empty
bag_off_last = torch.tensor([0, 3, 3, 6])
stats = (torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))  # running mean, var
row_w = torch.tensor([[0.5], [2.0], [1.0]], dtype=torch.float64)
bool_mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) > 0.3
empty_row_mask = bool_mask.clone()
empty_row_mask[1] = False

CASES = {
    "softmax": (lambda x: torch.softmax(x, 1), (r(3, 4, 5),)),
    "_softmax": (lambda x: aten._softmax(x, -1, False), (r(3, 4),)),
    "_log_softmax": (lambda x: aten._log_softmax(x, 0, False), (r(3, 4),)),
    "log_softmax": (lambda x: F.log_softmax(x, -1), (r(3, 4),)),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (4, 5), w, b), (r(2, 3, 4, 5), r(4, 5), r(4, 5))),
    "layer_norm_noaffine": (lambda x: F.layer_norm(x, (5,)), (r(3, 5),)),
    "native_layer_norm": (lambda x, w: torch.native_layer_norm(x, [5], w, None, 1e-5)[0], (r(3, 5), r(5))),
    "rms_norm": (lambda x, w: F.rms_norm(x, (5,), w, 1e-6), (r(2, 3, 5), r(5))),
    "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b), (r(2, 4, 3, 3), r(4), r(4))),
    "instance_norm": (lambda x, w, b: F.instance_norm(x, weight=w, bias=b), (r(2, 3, 4, 4), r(3), r(3))),
    "batch_norm_train": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), (r(4, 3, 2, 2), r(3), r(3))),
    "batch_norm_train_noaffine": (lambda x: F.batch_norm(x, None, None, training=True), (r(5, 3),)),
    "batch_norm_eval": (
        lambda x, w, b, m, v: F.batch_norm(x, m.detach(), v.detach(), w, b, training=False),
        (r(4, 3, 5), r(3), r(3), r(3), r(3).abs() + 0.5),
    ),
    "native_batch_norm": (lambda x, w: torch.native_batch_norm(x, w, None, None, None, True, 0.1, 1e-5)[0], (r(4, 3), r(3))),
    "legit": (lambda x, w: aten._native_batch_norm_legit(x, w, None, stats[0], stats[1], True, 0.1, 1e-5)[0], (r(4, 3, 2), r(3))),
    "legit_no_stats": (lambda x, w: aten._native_batch_norm_legit(x, w, None, True, 0.1, 1e-5)[0], (r(4, 3, 2), r(3))),
    "legit_no_training": (
        lambda x, b: aten._native_batch_norm_legit_no_training(x, None, b, stats[0], stats[1], 0.1, 1e-5)[0],
        (r(4, 3, 2), r(3)),
    ),
    "embedding_padding_idx": (lambda w: F.embedding(idx, w, padding_idx=3), (r(5, 4),)),
    "embedding_scale_grad": (lambda w: F.embedding(idx.view(5, 1), w, scale_grad_by_freq=True), (r(6, 2),)),
    "embedding_bag_2d": (lambda w: F.embedding_bag(idx2d.clamp(min=0), w), (r(6, 3),)),
    "embedding_bag_sum": (lambda w: F.embedding_bag(bag_idx, w, bag_off, mode="sum", padding_idx=4), (r(6, 3),)),
    "embedding_bag_mean": (lambda w: F.embedding_bag(bag_idx, w, bag_off, mode="mean", padding_idx=4), (r(6, 3),)),
    "embedding_bag_max": (lambda w: F.embedding_bag(bag_idx, w, bag_off, mode="max"), (r(6, 3),)),
    "embedding_bag_psw": (
        lambda w, p: F.embedding_bag(bag_idx, w, bag_off_last, per_sample_weights=p, mode="sum", include_last_offset=True),
        (r(6, 3), r(6)),
    ),
    "conv2d_groups": (
        lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2),
        (r(2, 4, 7, 8), r(6, 2, 3, 3), r(6)),
    ),
    "conv2d_same_even": (lambda x, w: F.conv2d(x, w, padding="same", dilation=(1, 1)), (r(1, 2, 6, 5), r(3, 2, 4, 3))),
    "conv1d_same_dilated": (lambda x, w: F.conv1d(x, w, padding="same", dilation=3), (r(2, 2, 9), r(2, 2, 2))),
    "conv2d_valid": (lambda x, w: F.conv2d(x, w, padding="valid"), (r(1, 2, 6, 5), r(3, 2, 2, 2))),
    "conv2d_unbatched": (lambda x, w: F.conv2d(x, w, stride=2), (r(2, 6, 7), r(3, 2, 3, 3))),
    "conv3d": (lambda x, w: F.conv3d(x, w, stride=2, padding=1), (r(1, 2, 5, 5, 6), r(2, 2, 3, 3, 3))),
    "conv_transpose2d": (
        lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1, groups=2, dilation=2),
        (r(2, 4, 3, 4), r(4, 3, 3, 3), r(6)),
    ),
    "convolution": (lambda x, w: torch.convolution(x, w, None, [2], [1], [1], False, [0], 1), (r(2, 3, 9), r(4, 3, 3))),
    "convolution_transposed": (lambda x, w: torch.convolution(x, w, None, [2], [1], [1], True, [1], 1), (r(2, 3, 5), r(3, 4, 3))),
    "_adaptive_avg_pool2d": (lambda x: aten._adaptive_avg_pool2d(x, [3, 2]), (r(2, 3, 7, 6),)),
    "_adaptive_avg_pool3d": (lambda x: aten._adaptive_avg_pool3d(x, [2, 1, 3]), (r(1, 2, 5, 4, 6),)),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True), (r(2, 3, 7, 6),)),
    "max_pool2d_indices": (lambda x: F.max_pool2d(x, 2, return_indices=True)[0], (r(3, 6, 6),)),
    "max_pool1d": (lambda x: F.max_pool1d(x, 3, dilation=2), (r(2, 3, 9),)),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2), (r(1, 2, 4, 4, 4),)),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 3, 2, 1, count_include_pad=False), (r(2, 3, 9),)),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, divisor_override=2), (r(2, 3, 7, 6),)),
    "avg_pool3d": (lambda x: F.avg_pool3d(x, 2, padding=1), (r(1, 2, 4, 4, 5),)),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, (3, 2)), (r(2, 3, 7, 6),)),
    "adaptive_avg_pool2d_global": (lambda x: F.adaptive_avg_pool2d(x, 1), (r(2, 3, 7, 6),)),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x, 4), (r(2, 3, 9),)),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, (3, 2)), (r(2, 3, 7, 6),)),
    "upsample_nearest2d": (lambda x: F.interpolate(x, scale_factor=2), (r(2, 3, 3, 4),)),
    "upsample_nearest2d_size": (lambda x: F.interpolate(x, size=(5, 7)), (r(2, 3, 3, 4),)),
    "upsample_nearest3d": (lambda x: F.interpolate(x, scale_factor=(1, 2, 3)), (r(1, 2, 2, 3, 2),)),
    "upsample_nearest_exact": (lambda x: F.interpolate(x, size=(5, 7), mode="nearest-exact"), (r(2, 3, 3, 4),)),
    "upsample_nearest_exact3d": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest-exact"), (r(1, 2, 2, 3, 2),)),
    "upsample_bilinear2d": (lambda x: F.interpolate(x, scale_factor=1.7, mode="bilinear"), (r(2, 3, 3, 4),)),
    "upsample_bilinear2d_align": (lambda x: F.interpolate(x, size=(6, 5), mode="bilinear", align_corners=True), (r(2, 3, 3, 4),)),
    "cosine_similarity": (lambda x, y: F.cosine_similarity(x, y, dim=-1), (r(3, 4), r(2, 1, 4))),
    "pixel_shuffle": (lambda x: F.pixel_shuffle(x, 2), (r(2, 8, 3, 3),)),
    "dropout_eval": (lambda x: F.dropout(x, 0.5, training=False), (r(3, 4),)),
    "dropout_p0": (lambda x: F.dropout(x, 0.0), (r(3, 4),)),
    "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (r(2, 3, 4, 8), r(2, 3, 6, 8), r(2, 3, 6, 5))),
    "sdpa_causal_scale": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
        (r(2, 4, 8), r(2, 4, 8), r(2, 4, 8)),
    ),
    "sdpa_float_mask": (
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        (r(2, 3, 4, 8), r(2, 3, 6, 8), r(2, 3, 6, 5), r(4, 6)),
    ),
    "sdpa_bool_mask": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask),
        (r(2, 3, 4, 8), r(2, 3, 6, 8), r(2, 3, 6, 5)),
    ),
    "sdpa_bool_mask_empty_row": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=empty_row_mask),
        (r(2, 4, 8), r(2, 6, 8), r(2, 6, 5)),
    ),
    "sdpa_gqa": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        (r(2, 4, 3, 8), r(2, 2, 5, 8), r(2, 2, 5, 8)),
    ),
    "cross_entropy": (lambda x: F.cross_entropy(x, idx), (r(5, 4),)),
    "cross_entropy_everything": (
        lambda x: F.cross_entropy(x, idx2d, class_w, ignore_index=-100, label_smoothing=0.2),
        (r(2, 4, 3),),
    ),
    "cross_entropy_ignore_sum": (lambda x: F.cross_entropy(x, idx, ignore_index=3, reduction="sum"), (r(5, 4),)),
    "cross_entropy_none_weight": (lambda x: F.cross_entropy(x, idx, class_w, reduction="none", label_smoothing=0.1), (r(5, 4),)),
    "cross_entropy_unbatched": (lambda x: F.cross_entropy(x, torch.tensor(2)), (r(4),)),
    "cross_entropy_probs": (lambda x, t: F.cross_entropy(x, t.softmax(1), label_smoothing=0.3), (r(3, 4, 2), r(3, 4, 2))),
    "cross_entropy_probs_none": (lambda x, t, w: F.cross_entropy(x, t, w, reduction="none"), (r(3, 4), r(3, 4), r(4))),
    "nll_loss": (lambda x: F.nll_loss(x, idx2d, class_w, ignore_index=-100), (r(2, 4, 3),)),
    "nll_loss_aten": (lambda x: aten.nll_loss(x, idx, None, 2, 3), (r(5, 4),)),
    "nll_loss2d_aten": (lambda x: aten.nll_loss2d(x, idx2d.clamp(min=0).view(2, 3, 1), None, 1, -100), (r(2, 4, 3, 1),)),
    "nll_loss_forward": (lambda x: aten.nll_loss_forward(x, idx, None, 1, -100)[0], (r(5, 4),)),
    "nll_loss2d_forward": (
        lambda x: aten.nll_loss2d_forward(x, idx2d.clamp(min=0).view(2, 3, 1), None, 2, 0)[0],
        (r(2, 4, 3, 1),),
    ),
    "mse_loss": (lambda x, y: F.mse_loss(x, y), (r(3, 4), r(3, 4))),
    "l1_loss": (lambda x, y: F.l1_loss(x, y, reduction="sum"), (r(3, 4), r(3, 4))),
    "smooth_l1_loss": (lambda x, y: F.smooth_l1_loss(x, y, beta=0.5), (r(3, 4), r(3, 4))),
    "smooth_l1_loss_beta0": (lambda x, y: F.smooth_l1_loss(x, y, beta=0.0), (r(3, 4), r(3, 4))),
    "huber_loss": (lambda x, y: F.huber_loss(x, y, reduction="none", delta=0.7), (r(3, 4), r(3, 4))),
    "bce": (lambda x, y, w: F.binary_cross_entropy(x.sigmoid(), y.sigmoid(), w.detach()), (r(3, 4), r(3, 4), r(4))),
    "bce_with_logits": (
        lambda x, y: F.binary_cross_entropy_with_logits(x, y, row_w, pos_weight=class_w, reduction="sum"),
        (r(3, 4), r(3, 4).sigmoid()),
    ),
    "bce_with_logits_none": (
        lambda x, y: F.binary_cross_entropy_with_logits(x, y, reduction="none"),
        (r(3, 4), r(3, 4).sigmoid()),
    ),
    "kl_div": (lambda x, y: F.kl_div(x, y, reduction="batchmean"), (r(3, 4), r(3, 4).sigmoid())),
    "kl_div_log_target": (lambda x, y: F.kl_div(x, y, reduction="sum", log_target=True), (r(3, 4), r(3, 4))),
    "linear_cross_entropy_chunked": (
        lambda x, w, b: F.linear_cross_entropy(x, w, idx.clamp(min=0), linear_bias=b, options=_chunked),
        (r(5, 3), r(4, 3), r(4)),
    ),
    "linear_cross_entropy_chunked_sum": (
        lambda x, w: F.linear_cross_entropy(x, w, idx.clamp(min=0), reduction="sum", options=_chunked),
        (r(5, 3), r(4, 3)),
    ),
}


def test_chunked_linear_cross_entropy_scales_the_gradients_its_forward_computes():
    """The chunked op returns the gradients with the loss; the backward only multiplies."""
    f, args = CASES["linear_cross_entropy_chunked"]
    gm = check_vjp(f, *args)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert sum(getattr(t, "__name__", "").startswith("_linear_cross_entropy") for t in ops) == 1
    assert "matmul" not in gm.code and "@" not in gm.code


@pytest.mark.parametrize("name", list(CASES))
def test_nn_rule_matches_autograd(name):
    f, args = CASES[name]
    check_vjp(f, *args, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# readable code


def test_softmax_backward_is_four_ops():
    gm = fxtools.vjp(lambda x: torch.softmax(x, -1), r(3, 4))
    backward = [n for n in calls(gm) if "softmax" not in str(n.target)]
    assert len(backward) <= 4, gm.code
    assert "sum" in gm.code


def test_log_softmax_backward_is_short():
    gm = fxtools.vjp(lambda x: F.log_softmax(x, -1), r(3, 4))
    assert len(calls(gm)) <= 5, gm.code


def test_cross_entropy_backward_is_short():
    gm = fxtools.grad(lambda x: F.cross_entropy(x, idx), r(5, 4))
    assert len(calls(gm)) <= 16, gm.code
    assert "softmax" in gm.code and "scatter" in gm.code


def test_layer_norm_keeps_one_fused_forward():
    gm = fxtools.vjp(lambda x, w, b: F.layer_norm(x, (5,), w, b), r(3, 5), r(5), r(5))
    assert gm.code.count("native_layer_norm(") == 1, gm.code
    assert len(calls(gm)) <= 20, gm.code


def test_conv2d_backward_uses_conv_transpose():
    gm = fxtools.vjp(lambda x, w: F.conv2d(x, w, stride=2, padding=1), r(1, 2, 7, 7), r(3, 2, 3, 3))
    assert "conv_transpose2d" in gm.code, gm.code


# ---------------------------------------------------------------------------------------------
# BatchNorm in training mode updates its running statistics exactly once


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_running_stats_updated_once(affine):
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3, affine=affine).double().train()
    with torch.no_grad():
        bn.running_mean.uniform_()
        bn.running_var.uniform_(0.5, 2.0)
    eager = copy.deepcopy(bn)
    x = r(4, 3, 5, 5)
    gm = fxtools.vjp(bn, x)
    # tracing must not have touched the real buffers
    assert torch.equal(bn.running_mean, eager.running_mean) and torch.equal(bn.running_var, eager.running_var)
    assert gm.code.count("batch_norm(") == 1, gm.code
    ct = r(4, 3, 5, 5)
    out, (grad_x,) = gm(x, ct)
    xr = x.clone().requires_grad_()
    want = eager(xr)
    (want_grad,) = torch.autograd.grad(want, xr, ct)
    torch.testing.assert_close(out, want.detach())
    torch.testing.assert_close(grad_x, want_grad)
    torch.testing.assert_close(bn.running_mean, eager.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(bn.running_var, eager.running_var, rtol=0, atol=0)
    assert bn.num_batches_tracked.item() == eager.num_batches_tracked.item() == 1


def test_batch_norm_eval_mode_leaves_stats_alone():
    bn = torch.nn.BatchNorm1d(3).double().eval()
    with torch.no_grad():
        bn.running_mean.uniform_()
        bn.running_var.uniform_(0.5, 2.0)
    before = (bn.running_mean.clone(), bn.running_var.clone())
    x = r(6, 3)
    check_vjp(bn, x, rtol=1e-6, atol=1e-8)
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])


# ---------------------------------------------------------------------------------------------
# dropout: one mask, drawn in the forward, reused by the backward


@pytest.mark.parametrize(
    "fn, shape",
    [
        (lambda x: F.dropout(x, 0.3), (6, 7)),
        (lambda x: F.dropout2d(x, 0.4), (3, 5, 2, 2)),
        (lambda x: torch.native_dropout(x, 0.3, True)[0], (6, 7)),
    ],
)
def test_dropout_same_mask_forward_and_backward(fn, shape):
    x, ct = r(*shape), r(*shape)
    gm = fxtools.vjp(fn, x)
    torch.manual_seed(123)
    out, (grad_x,) = gm(x, ct)
    kept = out != 0
    assert 0 < kept.sum() < kept.numel()
    # the backward passes the cotangent exactly where the forward kept the input
    torch.testing.assert_close(grad_x, torch.where(kept, ct * out / x, torch.zeros_like(ct)))
    # and it is the mask eager PyTorch draws from the same seed
    torch.manual_seed(123)
    xr = x.clone().requires_grad_()
    want = fn(xr)
    (want_grad,) = torch.autograd.grad(want, xr, ct)
    if "native_dropout" not in gm.code:
        torch.testing.assert_close(out, want.detach())
        torch.testing.assert_close(grad_x, want_grad)


def test_sdpa_dropout_consistent():
    q, k, v = r(2, 4, 8), r(2, 5, 8), r(2, 5, 3)
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # noqa: E731
    gm = fxtools.vjp(f, q, k, v)
    ct = r(2, 4, 3)
    torch.manual_seed(0)
    out, grads = gm(q, k, v, ct)
    # replay the same mask in eager math and differentiate that with autograd
    torch.manual_seed(0)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    probs = torch.softmax(qr @ kr.transpose(-2, -1) / 8**0.5, -1)
    keep = torch.empty_like(probs).bernoulli_(0.5) / 0.5
    want = (probs * keep) @ vr
    want_grads = torch.autograd.grad(want, (qr, kr, vr), ct)
    torch.testing.assert_close(out, want.detach())
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w)
