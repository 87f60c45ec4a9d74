"""Graph arithmetic the partitioner and the budget solver share: the bytes a value spans, the
value whose memory a view lives in, a maximum flow / minimum cut (Dinic's algorithm), and the
order in which the forward and the backward compute a partition's nodes."""

from __future__ import annotations

import collections
import operator

import torch
import torch.fx as fx

from ..graph.data_dependent import upper_bound
from ..graph.nodes import ancestors, is_impure
from . import policies

INF = 1 << 62  # the capacity of an edge that is never cut


def nbytes(val) -> int:
    """Bytes of the memory a tensor spans (an expanded tensor counts once); for a size that
    depends on the data, its largest possible value."""
    if not isinstance(val, torch.Tensor):
        return 0
    shape, stride = [upper_bound(s) for s in val.shape], [upper_bound(s) for s in val.stride()]
    if 0 in shape:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride))
    return span * val.element_size()


def storage_root(node: fx.Node) -> fx.Node:
    """The node whose memory ``node``'s value lives in (following views)."""
    while node.op == "call_function":
        if node.target is operator.getitem:
            parent = node.args[0]
            if isinstance(parent, fx.Node) and policies.is_view(parent):
                node = parent.args[0]
                continue
            return node
        if policies.is_view(node) and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            continue
        return node
    return node


def _augment(head, to, cap, level, it, source, sink) -> int:
    """Push flow along one shortest augmenting path (iteratively: paths can be thousands of edges long)."""
    path, u = [], source
    while True:
        if u == sink:
            f = min(cap[e] for e in path)
            for e in path:
                cap[e] -= f
                cap[e ^ 1] += f
            return f
        while it[u] < len(head[u]):
            e = head[u][it[u]]
            if cap[e] > 0 and level[to[e]] == level[u] + 1:
                path.append(e)
                u = to[e]
                break
            it[u] += 1
        else:
            if u == source:
                return 0
            level[u] = -1  # a dead end for this phase
            e = path.pop()
            u = to[e ^ 1]
            it[u] += 1


def max_flow_min_cut(n: int, edges, source: int, sink: int, inf: int = INF):
    """The vertices that can still reach ``sink`` in the residual graph of a maximum flow
    (``inf``: the capacity meaning "never cut")."""
    head, to, cap = max_flow(n, edges, source, sink, inf)
    reach = {sink}
    queue = collections.deque([sink])
    while queue:
        v = queue.popleft()
        for e in head[v]:  # residual edge u -> v exists when the reverse slot e^1 has capacity
            u = to[e]
            if u not in reach and cap[e ^ 1] > 0:
                reach.add(u)
                queue.append(u)
    return reach


def max_flow(n: int, edges, source: int, sink: int, inf: int = INF):
    """Dinic's algorithm: the residual graph ``(head, to, cap)`` of a maximum flow (edge ``e``
    goes to ``to[e]``, its reverse is ``e ^ 1``)."""
    head = [[] for _ in range(n)]
    to, cap = [], []
    for u, v, c in edges:
        head[u].append(len(to))
        to.append(v)
        cap.append(c)
        head[v].append(len(to))
        to.append(u)
        cap.append(0)
    while True:
        level = [-1] * n
        level[source] = 0
        queue = collections.deque([source])
        while queue:
            u = queue.popleft()
            for e in head[u]:
                if cap[e] > 0 and level[to[e]] < 0:
                    level[to[e]] = level[u] + 1
                    queue.append(to[e])
        if level[sink] < 0:
            break
        it = [0] * n
        while True:
            f = _augment(head, to, cap, level, it, source, sink)
            if not f:
                break
            if f >= inf:
                raise RuntimeError("fxtools.split: no finite cut (a value can be neither saved nor recomputed)")
    return head, to, cap


def forward_nodes(part, saved, inputs: InputsOf | None = None) -> list[fx.Node]:
    """The joint graph's nodes the forward computes, in order: those the outputs, the saved
    values and the side effects (buffer updates) depend on."""
    if inputs is None:
        effects = (n for n in part.nodes if n.op == "call_function" and n not in part.bw and is_impure(n))
        keep = ancestors([*part.fw_outs, *saved, *effects])
        return [n for n in part.nodes if n in keep and n.op in ("call_function", "get_attr")]
    keep = set()  # ``ancestors``, with the inputs and the graph's lists of ``inputs`` (computed once)
    stack = [n for n in [*part.fw_outs, *saved, *inputs.effects(part)] if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in keep:
            keep.add(node)
            stack.extend(inputs[node])
    return [n for n in inputs.forward_ops(part) if n in keep]


class InputsOf(dict):
    """``node -> tuple(node.all_input_nodes)``, each computed once (orders and liveness of one
    graph are computed many times; ``all_input_nodes`` builds a list on every call); also the
    lists of one partition's nodes ``forward_nodes`` and ``backward_nodes`` go through."""

    def __init__(self):
        super().__init__()
        self.lists: dict = {}  # (what, partition) -> nodes; the partition is held: its id is never reused

    def __missing__(self, node: fx.Node) -> tuple:
        self[node] = value = tuple(node.all_input_nodes)
        return value

    def _list(self, what: str, part, make) -> list:
        key = (what, id(part))
        if key not in self.lists:
            self.lists[key] = (part, make())
        return self.lists[key][1]

    def effects(self, part) -> list[fx.Node]:
        """The forward's side effects (buffer updates): ``forward_nodes`` keeps what they read."""
        return self._list(
            "effects", part, lambda: [n for n in part.nodes if n.op == "call_function" and n not in part.bw and is_impure(n)]
        )

    def forward_ops(self, part) -> list[fx.Node]:
        return self._list("forward", part, lambda: [n for n in part.nodes if n.op in ("call_function", "get_attr")])

    def backward_ops(self, part) -> list[fx.Node]:
        return self._list("backward", part, lambda: [n for n in part.nodes if n in part.bw and n.op == "call_function"])


def backward_nodes(
    part, saved, recomputed, forget=None, inputs: InputsOf | None = None, limit: int | None = None
) -> list[fx.Node]:
    """The joint graph's nodes the backward computes, in order: the backward's own ops, each
    recomputed value placed just before its first use.

    ``limit``: raise ``OrderTooLong`` once the order would hold more than ``limit`` nodes (a ``forget`` inside a
    recurrence, an LSTM's two states each reading the step before, recomputes the chain
    exponentially often: the order of 10 steps grew past millions of nodes).

    ``forget`` (``node -> inputs``, from ``budget.refresh``) drops recomputed values early: after
    ``node`` is computed, those of its inputs no pending computation reads are forgotten, and a
    later use recomputes them again (the order then holds a node more than once; each occurrence
    is a new value, read by what comes after it)."""
    done, order = {*saved, *part.cts}, []
    forget = forget or {}
    inputs = InputsOf() if inputs is None else inputs
    bw = part.bw

    def emit(node):
        todo = [node]
        while todo:
            v = todo[-1]
            if v in done:
                todo.pop()
                continue
            missing = [a for a in inputs[v] if a not in done]
            if missing:
                for a in missing:
                    if a not in recomputed and a not in bw:
                        raise AssertionError(f"fxtools.split: {a} is neither saved nor recomputed")
                todo.extend(missing)
                continue
            done.add(v)
            order.append(v)
            if limit is not None and len(order) > limit:
                raise OrderTooLong(limit)
            todo.pop()
            pending = set(todo) - done if v in forget else ()
            for a in forget.get(v, ()):
                if a in recomputed and not any(u in pending for u in a.users):
                    done.discard(a)

    for n in inputs.backward_ops(part):
        if n in done:
            continue
        if n not in forget and all(a in done for a in inputs[n]):  # ``emit(n)``, its inputs all there
            done.add(n)
            order.append(n)
            if limit is not None and len(order) > limit:
                raise OrderTooLong(limit)
            continue
        emit(n)
    for g in part.grads:
        if isinstance(g, fx.Node):
            emit(g)
    return order


class OrderTooLong(Exception):
    """``backward_nodes``' order passed its ``limit``."""
