"""A gradient added to a scatter into zeros is scattered into directly: one pass, no zero table.

A weight used twice gets two gradients that reverse mode adds: with tied embeddings, the head's
``logits_gw`` (a matmul) and the embedding's ``index_add(zeros_like(weight), 0, idx, rows)``. The
sum reads and writes the vocabulary-sized table three times (fill, scatter's copy, add). The same
sum is ``index_add(logits_gw, 0, idx, rows)``: the rows scattered into the other gradient, which
``codegen/inplace.py`` then prints in place when nothing else reads it.

This is the one rewrite here that is not bit for bit: it changes the order of the additions (each
scattered row is added to the other gradient rather than to the zeros first), as autograd's own
order of accumulating a tied weight's gradients is unspecified; the result is the same sum.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph.data_dependent import same_shape

aten = torch.ops.aten

_ZEROS = {aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default}


def _is_zeros(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in _ZEROS


def _accumulating_scatter(node) -> bool:
    """``node`` adds its source into a zero tensor: index_add, scatter_add, index_put(accumulate=True)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args or not _is_zeros(node.args[0]):
        return False
    if node.target in (aten.index_add.default, aten.scatter_add.default):
        return True
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    return node.target is aten.index_put.default and accumulate is True


def _same(a, b) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (
        isinstance(va, torch.Tensor)
        and isinstance(vb, torch.Tensor)
        and same_shape(va.shape, vb.shape)
        and va.dtype == vb.dtype
        and va.device == vb.device
    )


def accumulate_into_scatters(gm: fx.GraphModule) -> bool:
    """``g + scatter(zeros, ...)`` -> ``scatter(g, ...)`` where the scatter is read only by the add
    and ``g`` has the sum's shape, dtype and device; returns whether the graph changed (the
    scatter and its zeros are left to ``simplify``'s dead-code elimination)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
            continue
        for g, s in (node.args, node.args[::-1]):
            if (
                isinstance(g, fx.Node)
                and _accumulating_scatter(s)
                and len(s.users) == 1
                and g is not s.args[0]
                and _same(g, node)
                and _same(s, node)
            ):
                node.target = s.target
                node.args = (g, *s.args[1:])
                node.kwargs = dict(s.kwargs)
                changed = True
                break
    return changed
