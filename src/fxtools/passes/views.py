"""Chains of reshapes that end where they started.

Batching rules reshape their results freely (``unsqueeze(x, 1).view([4, 3])``,
``mm(...).reshape([4, 1, 2]).squeeze(1)``); a chain of shape-only ops whose end has its start's
shape (and the start is contiguous) is its start. Used on ``fxtools.vmap``'s results and on the
batched code of a ``torch.vmap`` inside a captured function.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph.data_dependent import same_shape
from ..graph.nodes import has_generic_name

aten = torch.ops.aten

__all__ = ["collapse_view_chains"]

_SHAPE_ONLY = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
}


def collapse_view_chains(gm: fx.GraphModule) -> bool:
    """A chain of reshapes/squeezes/unsqueezes that ends in its start's shape is its start."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.slice.Tensor and node.users:
            x = node.args[0]
            a, b = (x.meta.get("val") if isinstance(x, fx.Node) else None), node.meta.get("val")
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_shape(a.shape, b.shape):
                node.replace_all_uses_with(x)  # a slice of the whole dimension
                changed = True
                continue
        if node.op != "call_function" or node.target not in _SHAPE_ONLY or not node.users:
            continue
        start = node
        while isinstance(start, fx.Node) and start.op == "call_function" and start.target in _SHAPE_ONLY:
            start = start.args[0]
        if start is node.args[0] or not isinstance(start, fx.Node):
            continue
        a, b = start.meta.get("val"), node.meta.get("val")
        if (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and same_shape(a.shape, b.shape)
            and a.dtype == b.dtype
            and a.is_contiguous()
        ):
            only_for_this = len(start.users) == 1 and has_generic_name(start)
            node.replace_all_uses_with(start)
            if only_for_this and not has_generic_name(node):
                name = node.name
                gm.graph.erase_node(node)
                start.name = name  # the erased node's name: unique, and still reserved
            changed = True
    return changed
