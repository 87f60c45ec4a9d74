"""Scatters of complex tensors written as scatters of their real views, so autograd runs them.

PyTorch's autograd refuses ``slice_scatter`` and ``select_scatter`` on complex outputs ("does not
support automatic differentiation for outputs with complex dtype") though it differentiates
``view_as_real``, the same scatters of real tensors and ``view_as_complex``. fxtools' graphs make
these scatters where a complex slice is written (``z[:, :3] = w``, functionalized), in the VJP of a
complex slice, and in PyTorch's own backward of ``torch.fft.rfft`` (the half spectrum padded to the
full one): run by autograd (a generated gradient called with tensors that require grad, a model's
parameters, or differentiated again), such code failed. Used by ``codegen/render.py`` on every
generated module and by ``capture/derived.py`` on the backward graphs it traces from PyTorch.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

_COMPLEX_SCATTERS = (aten.slice_scatter.default, aten.select_scatter.default)


def complex_scatters_on_real_views(gm: fx.GraphModule) -> None:
    """``slice_scatter`` / ``select_scatter`` of complex tensors -> the same scatter of their
    ``view_as_real`` views, viewed back with ``view_as_complex``: the same values, but code that
    autograd can run. PyTorch's autograd refuses these two ops on complex outputs ("does not
    support automatic differentiation for outputs with complex dtype"), so a generated gradient of
    ``torch.fft.rfft(x).abs()`` (whose backward pads the half spectrum with a ``slice_scatter``) or
    of a complex slice failed when called with tensors that require grad (a model's parameters,
    autograd over the generated gradient)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _COMPLEX_SCATTERS or node.kwargs:
            continue
        val = node.meta.get("val")
        base, src, dim, *rest = node.args
        if not (isinstance(val, torch.Tensor) and val.is_complex() and isinstance(dim, int)):
            continue
        if not all(isinstance(v, fx.Node) for v in (base, src)):
            continue
        dim = dim % val.dim()
        graph = gm.graph
        with graph.inserting_before(node):
            base_r = graph.call_function(aten.view_as_real.default, (base,))
            src_r = graph.call_function(aten.view_as_real.default, (src,))
            scattered = graph.call_function(node.target, (base_r, src_r, dim, *rest))
            # the scatter's result is laid out as ``empty_like`` of its real base: even strides
            out = graph.call_function(aten.view_as_complex.default, (scattered,))
        for new, like in ((base_r, base), (src_r, src), (scattered, None), (out, node)):
            new.meta = {k: v for k, v in node.meta.items() if k != "val"}
            try:
                if like is None:
                    new.meta["val"] = node.target(base_r.meta["val"], src_r.meta["val"], dim, *rest)
                elif new is out:
                    new.meta["val"] = val
                else:
                    new.meta["val"] = torch.view_as_real(like.meta["val"])
            except Exception:  # noqa: BLE001 - a value fxtools.show cannot print is only a comment less
                pass
        node.replace_all_uses_with(out)
        name = node.name
        graph.erase_node(node)
        out.name = name
        taken = {n.name for n in graph.nodes}
        for new, stem in ((base_r, base.name), (src_r, src.name), (scattered, name)):
            wanted = f"{stem}_real"
            while wanted in taken:
                wanted += "_"
            new.name = wanted  # unique in the graph: fx's namespace only adds the suffixes it needs
            taken.add(wanted)
