"""Small helpers shared by the rule families."""

from __future__ import annotations

import torch

from ..graph.data_dependent import known_equal, same_shape  # noqa: F401 (re-exported for the rule families)
from ..registry import cast_cotangent, conj_if_complex  # noqa: F401 (re-exported for the rule families)


def unbroadcast(g, like):
    """Reduce cotangent ``g`` to the shape and dtype of ``like`` (the undoing of broadcasting; a
    complex ``g`` of a real ``like`` keeps its real part, as autograd does).

    Returns ``None`` when ``like`` is not a tensor (a Python number gets no cotangent) and ``g``
    itself, emitting no code, when nothing needs reducing.
    """
    if g is None or not isinstance(like, torch.Tensor):
        return None
    shape = like.shape
    if len(shape) == 0 and g.dim() > 0:
        g = g.sum()
    if not same_shape(g.shape, shape):
        lead = g.dim() - len(shape)
        dims = list(range(lead)) + [
            lead + i for i, n in enumerate(shape) if known_equal(n, 1) and not known_equal(g.shape[lead + i], 1)
        ]
        if dims:
            g = g.sum(dims, keepdim=False) if not lead else g.sum(dims)
            if lead:
                g = g.reshape(shape) if not same_shape(g.shape, shape) else g
            elif not same_shape(g.shape, shape):
                g = g.reshape(shape)
    return cast_cotangent(g, like.dtype)


def normalize_dims(dims, ndim):
    """Dims as a sorted list of non-negative ints; ``None`` or ``[]`` mean every dim."""
    if dims is None or dims == [] or dims == ():
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % max(ndim, 1) for d in dims)


def is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)
