"""``flex_attention`` as its dense math, so that fxtools writes out its backward.

PyTorch runs ``torch.nn.attention.flex_attention`` through a higher-order op whose backward
exists only as a compiled kernel (on CPU: "FlexAttention does not support backward on CPU").
While fxtools captures, the op is replaced by PyTorch's own reference implementation
(``math_attention`` in ``torch/_higher_order_ops/flex_attention.py``, what eager CPU runs):
``q @ k^T * scale``, the ``score_mod`` and ``mask_mod`` applied to every score through
``torch.vmap`` (batched by ``capture/nested.py`` into ordinary tensor ops over index grids),
``torch.where`` with ``-inf`` off the mask, a softmax (rows that are masked out entirely give
zeros), then ``@ v``. Every op has a rule, so the gradient with respect to ``q``, ``k``, ``v``
and the tensors ``score_mod`` closes over (a learned bias) comes out as plain code. The block
mask's block sparsity only skips work: its ``mask_mod`` decides the mask, as in eager.
The logsumexp and maximum are computed only when the caller asks for them (``return_aux``).
"""

from __future__ import annotations

import contextlib
import math

import torch

__all__ = ["dense_flex_attention"]


def _dense(
    query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers=(), mask_mod_other_buffers=()
):
    """The flex_attention op: ``(out, logsumexp / ln 2, max / ln 2)``, as PyTorch's reference
    computes them, with no step that does nothing for these arguments (no grouped-query
    repetition for as many key as query heads, no mask for ``noop_mask``, no casts in float32/64)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.nn.attention.flex_attention import _identity, _vmap_for_bhqkv, noop_mask

    dtype = query.dtype
    if dtype not in (torch.float32, torch.float64):  # the reference works in float32 then
        query, key, value = query.float(), key.float(), value.float()
    groups = query.size(1) // key.size(1)
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if key.size(0) != query.size(0):
        key, value = key.expand(query.size(0), *key.shape[1:]), value.expand(query.size(0), *value.shape[1:])
    scores = query @ key.transpose(-2, -1) * scale
    b, h, m, n = (torch.arange(size, device=scores.device) for size in scores.shape)
    mask_mod = block_mask[-1]
    with TransformGetItemToIndex():  # score_mods index captured tensors with index tensors (bias[h])
        if score_mod is not _identity:
            batched = _vmap_for_bhqkv(score_mod, prefix=(0,), suffix=(None,) * len(score_mod_other_buffers))
            scores = batched(scores, b, h, m, n, *score_mod_other_buffers)
        if mask_mod is not noop_mask:
            batched = _vmap_for_bhqkv(mask_mod, prefix=(), suffix=(None,) * len(mask_mod_other_buffers))
            scores = torch.where(batched(b, h, m, n, *mask_mod_other_buffers), scores, -math.inf)
    # a row masked out entirely attends to nothing: zeros, as PyTorch's kernels give
    probs = torch._safe_softmax(scores, -1)
    out = probs @ value
    out = out if out.dtype == dtype else out.to(dtype)
    logsumexp = scores.logsumexp(-1)
    masked = (scores == -math.inf).all(-1)
    logsumexp = torch.where(masked, -math.inf, logsumexp)
    return out, logsumexp / math.log(2), scores.amax(-1) / math.log(2)


@contextlib.contextmanager
def dense_flex_attention():
    """While active, flex_attention ops run (and are traced as) their dense math: calls through
    ``torch.nn.attention.flex_attention`` and the op itself (in Dynamo's graphs)."""
    try:
        import torch.nn.attention.flex_attention as api
        from torch._higher_order_ops.flex_attention import FlexAttentionHOP
    except ImportError:  # pragma: no cover - a PyTorch without flex_attention
        yield
        return

    def call(self, *args, **kwargs):
        return _dense(*args, **kwargs)

    saved = FlexAttentionHOP.__dict__["__call__"], api._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    # the debug flag makes the eager path call the op directly instead of torch.compile-ing it;
    # its results are then in base 2 (as the reference's are)
    FlexAttentionHOP.__call__, api._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = call, True  # type: ignore[method-assign]  # patched while tracing
    try:
        yield
    finally:
        FlexAttentionHOP.__call__, api._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = saved  # type: ignore[method-assign]  # restored
