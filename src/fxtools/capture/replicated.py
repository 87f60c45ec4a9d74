"""Which traced values are the same on every rank of a process group.

Each rank's graph of a DTensor program is differentiated as a function of its local tensors
(``capture/subclasses.py``), and summing a value over a group is a collective unless the value is
known to be the same on every rank of the group: then the sum is the value times the group's
size, and no collective runs (as none runs in eager DTensor's backward, which knows the
placements). ``replicated(t, group)`` answers for a tensor being traced, from the graph the
trace has made so far: a value is replicated over a group when

- it is the result of an ``all_reduce`` or ``all_gather_into_tensor`` over that group,
- it was asserted replicated (``assert_replicated``: where eager DTensor takes a value as
  ``Replicate`` without checking it, as ``to_local()``'s backward takes its gradient), or
- every tensor it is computed from is (a constant is replicated over every group), by an op
  that draws no random numbers.

Anything else (a placeholder nothing asserted, a ``reduce_scatter_tensor`` over the group, a value
an op later writes into in place) is taken as differing between ranks: the answer errs on the
side of communicating.
"""

from __future__ import annotations

import operator
import weakref

import torch
import torch.fx as fx
from torch.fx.experimental import proxy_tensor

__all__ = ["assert_replicated", "group_rank", "group_size", "replicated"]

c10d = torch.ops._c10d_functional
_REPLICATING = {c10d.all_reduce.default, c10d.all_gather_into_tensor.default}

# graph -> {node: group names it was asserted replicated over}; not in node.meta, which copies of
# recorded rule calls (transforms/replay.py) take over to other nodes
_ASSERTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _traced_node(t):
    """``(node, constant)``: the node of a tensor being traced; ``constant`` if it is none's."""
    mode = proxy_tensor.get_innermost_proxy_mode()
    if mode is None:
        return None, False
    slot = proxy_tensor.get_proxy_slot(t, mode.tracer, None)
    if slot is None or slot.constant is not None:
        return None, True
    return slot.proxy.node, False


def assert_replicated(t, groups) -> None:
    """Take the traced tensor ``t`` as the same on every rank of each of ``groups`` (names)."""
    node, _ = _traced_node(t)
    if node is not None and groups:
        _ASSERTED.setdefault(node.graph, {}).setdefault(node, set()).update(groups)


def _group_of(node: fx.Node):
    names = [a.name for a in node.target._schema.arguments]
    i = names.index("group_name")
    return node.args[i] if i < len(node.args) else node.kwargs["group_name"]


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` is an op writing into ``node`` in place (``zeros.scatter_add_(...)``)."""
    target = user.target
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return False
    args = target._schema.arguments
    return any(
        a.alias_info is not None and a.alias_info.is_write and i < len(user.args) and user.args[i] is node
        for i, a in enumerate(args)
    )


def _depends(node: fx.Node, group: str, asserted: dict):
    """``(known, inputs)``: whether ``node`` is replicated by itself (True / False), or None and
    the nodes it is replicated if all of them are."""
    if any(_writes(user, node) for user in node.users):
        return False, ()  # its value changes after it is made: not judged by what made it
    if group in asserted.get(node, ()):
        return True, ()
    if node.op == "get_attr":
        return True, ()
    if node.op != "call_function":
        return False, ()
    target = node.target
    if target is operator.getitem:
        return None, (node.args[0],)
    if isinstance(target, torch._ops.OpOverload):
        if target in _REPLICATING and _group_of(node) == group:
            return True, ()
        if target.namespace == "_c10d_functional" and target.__name__.split(".")[0] != "wait_tensor":
            if _group_of(node) == group:
                return False, ()  # a reduce-scatter or all-to-all over the group: each rank its part
        if torch.Tag.nondeterministic_seeded in target.tags:
            return False, ()
    return None, tuple(node.all_input_nodes)


def replicated(t, group: str) -> bool:
    """Whether the traced tensor ``t`` is the same on every rank of process group ``group``."""
    if not isinstance(t, torch.Tensor):
        return True
    node, constant = _traced_node(t)
    if node is None:
        return constant
    asserted = _ASSERTED.get(node.graph, {})
    known: dict[fx.Node, bool] = {}
    stack = [node]
    while stack:  # depth first, without recursion (graphs are deep)
        n = stack[-1]
        if n in known:
            stack.pop()
            continue
        answer, inputs = _depends(n, group, asserted)
        if answer is not None:
            known[n] = answer
            stack.pop()
            continue
        pending = [a for a in inputs if a not in known]
        if pending:
            stack.extend(pending)
            continue
        known[n] = all(known[a] for a in inputs)
        stack.pop()
    return known[node]


def group_size(group: str) -> int:
    """The number of ranks in process group ``group`` (by name)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(group).size()  # type: ignore[arg-type]


def group_rank(group: str) -> int:
    """This process's rank within process group ``group`` (by name): a constant of its graphs."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    pg = distributed_c10d._resolve_process_group(group)  # type: ignore[arg-type]
    return dist.get_group_rank(pg, dist.get_rank())
