"""``torch.utils.checkpoint`` regions: while tracing, each checkpointed call's ops get a region id.

``capture`` traces under ``checkpoint_regions()``; ``split``'s policies recompute those regions
in the backward (``policies.checkpoint_region``).
"""

from __future__ import annotations

import contextlib
import itertools

from torch.fx.experimental import proxy_tensor

from ..graph import meta


@contextlib.contextmanager
def checkpoint_regions():
    """While tracing, mark the ops each ``torch.utils.checkpoint`` call runs with a region id.

    Tracing inlines checkpointed functions without a trace of the call (and the reentrant
    variant would run them under ``no_grad``). Inside this context both variants just call the
    function, and every node created meanwhile gets ``node.meta['custom']['fxtools_checkpoint']``,
    which the later passes carry along like the stack trace. ``context_fn`` is ignored.
    """
    import torch.utils.checkpoint as cp

    ids = itertools.count()

    def tracer_graph():
        mode = proxy_tensor.get_innermost_proxy_mode()
        return None if mode is None else mode.tracer.graph

    def mark(graph, before):
        if graph is None:
            return
        region = next(ids)
        for node in graph.nodes:
            if node not in before and node.op == "call_function":
                custom = dict(node.meta.get("custom") or {})
                custom[meta.CHECKPOINT.name] = region  # the outermost region wins
                node.meta["custom"] = custom

    def non_reentrant(function, *rest, **kwargs):
        graph = tracer_graph()
        before = set(graph.nodes) if graph is not None else set()
        yield  # checkpoint() runs the function here
        mark(graph, before)

    class Reentrant:
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            graph = tracer_graph()
            before = set(graph.nodes) if graph is not None else set()
            out = function(*args)
            mark(graph, before)
            return out

    saved = cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction
    cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction = non_reentrant, Reentrant  # type: ignore[misc, assignment]  # patched while tracing
    try:
        yield
    finally:
        cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction = saved  # type: ignore[misc]  # restored
