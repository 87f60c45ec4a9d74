"""Memory budgets for ``fxtools.split``: the least recompute for a given number of saved bytes.

``policies.budget(b)`` asks the partitioner for the saved set with the smallest estimated
recompute cost among those whose saved bytes fit ``b``. This module solves that problem on the
joint graph's min-cut structure (the one ``recompute_cheap`` uses):

- **the problem.** Each forward value the backward depends on is saved (costs its bytes), or
  recomputed (costs its recompute cost; its inputs must then be saved or recomputed too), or not
  needed. Random ops and ops with side effects are always saved, the insides of
  ``torch.utils.checkpoint`` regions always recomputed (``_Partition._forced``); a view is never
  saved itself (it would hold its base's storage): it is recomputed, free, from its base.
- **the cost model.** A node's recompute cost is its FLOPs as ``torch.utils.flop_counter``
  counts them (matrix products, convolutions, attention; run on the node's FakeTensor values)
  plus one per output element for every op (pointwise math, reductions, norms: one pass over
  memory). Views, items of multi-output ops and constants cost nothing; a higher-order op costs
  its bodies' costs (a ``scan``'s times its steps).
- **small problems, exactly.** With at most ``EXACT_LIMIT`` values free to be saved or not,
  every choice is enumerated: the frontier is exact, and a budget gets the least recompute.
- **the solver.** For a weight ``w``, minimising ``bytes + w * cost`` is one minimum cut
  (``save`` edges carry bytes, ``recompute`` edges carry cost). Sweeping ``w`` (bisection on the
  slopes) gives every point of the lower convex hull of the bytes/recompute frontier, exactly;
  the cuts are nested, so along the hull saved bytes grow as recompute falls. On each hull edge
  every minimum cut at that weight lies on the edge; a fixed walk through them (strongly
  connected components of the residual graph, Picard-Queyranne) adds points between the
  vertices. A byte budget takes the point with the most bytes that fit. Every such point is
  optimal for its own bytes; for a budget ``B`` between hull vertices ``(b0, c0)`` and
  ``(b1, c1)`` (``b0 <= B < b1``) its cost exceeds the optimum by at most ``c0 - c1``, and no
  saved set within ``B`` recomputes less than the Lagrangian bound
  ``c0 - (B - b0) (c0 - c1) / (b1 - b0)`` (``Choice.lower_bound``, printed by the report).
- **between the levels.** A hull leaves gaps (on the small GPT of ``bench_memory.py``, 0.52 MB
  saved for 1.69e8 and 1.05 MB for 1.35e8); ``Problem.between`` adds, as levels of their own,
  the frontier's points with one more value saved (one a larger point saves) where that
  recomputes less than the frontier at the same bytes (0.92 MB for 1.44e8 there).
- **monotone by construction.** The points are ordered (bytes up, cost down); a byte budget
  takes its level's choice in ``Problem.byte_table``: a smaller budget never saves more bytes,
  never recomputes less and never peaks higher (predicted), and among such chains of choices
  the levels take the one with the least recompute summed over the budgets.
- **planned for Inductor** (``policies.budget(b, fused=True)``, which ``fxtools.compile`` asks
  for when Inductor compiles the backward): a value is recomputed a second time only where
  Inductor does not compute the second copy in the first's kernel (``effective_forget``), and
  a smaller budget's predicted peak is at most ``FUSED_PEAK_SLACK`` above every larger one's
  (``Problem._least_total_within``): Inductor orders the backward itself, and holding fxtools'
  predicted peak exactly would recompute matrix products twice for a peak its code does not have.
- **one solve per program.** ``problem_of`` keeps the last few solved problems, keyed by
  ``program_key`` (ops, arguments, dtypes, sizes, strides, checkpoint regions, inputs and
  outputs): splitting the same program again at another budget moves the solved frontier and
  byte table onto the new trace's nodes instead of solving again.
- **infeasible budgets.** Below the frontier's first point (every recomputable value recomputed)
  no split fits: ``FxtoolsError`` says the minimum, in bytes and as a fraction.

The predicted peak memory (``predicted_peak``) is liveness over the two graphs: the inputs and
the forward's outputs are held by the caller, every other value lives from the op that makes it
to its last use (views share their base's storage), saved values until their last use in the
backward. ``budget(peak=p)`` lowers the peak of each of the frontier's points by saving, greedily,
values it recomputes (``Problem.peak_candidates``: the peak is not a function of the saved bytes;
a block's saved output lets the backward recompute the block late), and of a few of them by
recomputing values a second time instead of keeping them through the backward (``refresh``), and
takes the cheapest whose predicted peak fits; the candidates do not depend on ``p``, so a larger
peak never recomputes more.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import operator
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import flop_counter
from torch.utils._pytree import tree_leaves as pytree_leaves

from ..errors import FxtoolsError
from ..graph import meta
from ..graph.data_dependent import upper_bound
from ..graph.nodes import fake_mode_of
from . import policies
from .cuts import InputsOf, OrderTooLong, backward_nodes, forward_nodes, max_flow, max_flow_min_cut, nbytes, storage_root


@dataclass(frozen=True)
class Point:
    """One saved set: its saved bytes (beyond the inputs), estimated recompute cost and the nodes."""

    bytes: int
    cost: int
    saved: frozenset = field(compare=False, repr=False)
    recomputed: frozenset = field(compare=False, repr=False)
    forget: dict = field(default_factory=dict, compare=False, repr=False)  # values recomputed again (``refresh``)


@dataclass
class Choice:
    """What a budget chose, for ``Split.report``."""

    limit: int | None  # the budget in bytes (None for a peak budget)
    peak_limit: int | None
    point: Point
    lower_bound: float | None  # no saved set within the budget recomputes less than this (byte budgets)
    save_all_bytes: int
    frontier: list[Point]
    method: str  # "exact" (every saved set enumerated) or "hull" (minimum cuts on the convex hull)


# --------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------


def _flops(node: fx.Node) -> int:
    """FLOPs ``torch.utils.flop_counter`` counts for running ``node`` once on its fake values."""

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    vals = [v for v in pytree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    target = node.target
    if not vals or not callable(target):
        return 0
    counter = flop_counter.FlopCounterMode(display=False)
    try:
        with fake_mode_of(vals, create=True), counter:
            target(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - said, not hidden: the plan then counts this op's elements only
        warnings.warn(f"fxtools: no FLOP count for {node.name} ({target}): {type(exc).__name__}: {exc}", stacklevel=2)
        return 0
    flops = upper_bound(counter.get_total_flops())  # a data-dependent size counts at its largest
    if not flops and "scaled_dot_product" in str(node.target) and len(args) >= 3:
        flops = upper_bound(flop_counter.sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
    return flops


def _elements(val) -> int:
    vals = val if isinstance(val, (tuple, list)) else [val]
    total = 0
    for v in vals:
        if isinstance(v, torch.Tensor):
            total += math.prod(upper_bound(s) for s in v.shape)  # a data-dependent size at its largest
    return total


def _body_cost(node: fx.Node) -> int:
    """A higher-order op's cost (``scan``, ``cond``): its bodies' costs, a scan's times its steps."""
    owner = node.graph.owning_module
    names = [str(a.target) for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
    bodies = [b for b in (getattr(owner, name, None) for name in names) if isinstance(b, fx.GraphModule)]
    if not bodies:
        return 0
    total = max(sum((recompute_cost(n) for n in b.graph.nodes), 0) for b in bodies)
    if node.target is torch.ops.higher_order.scan:
        xs = [a.meta.get("val") for a in pytree_leaves(node.args[2]) if isinstance(a, fx.Node)]
        steps = [v.shape[0] for v in xs if isinstance(v, torch.Tensor) and v.dim()]
        if steps:
            try:
                total *= int(steps[0])
            except (TypeError, ValueError, RuntimeError):  # a symbolic number of steps
                pass
    return total


def recompute_cost(node: fx.Node) -> int:
    """Estimated cost of computing ``node`` again: FLOPs (flop_counter) plus one per output element;
    a higher-order op (``scan``) counts its bodies (a scan's times its steps)."""
    if node.op != "call_function" or policies.is_view(node) or policies.is_factory(node):
        return 0
    if node.target is operator.getitem:
        return 0
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return _body_cost(node) + _elements(node.meta.get("val"))
    return _flops(node) + _elements(node.meta.get("val"))


# --------------------------------------------------------------------------------------------
# The min-cut family
# --------------------------------------------------------------------------------------------


EXACT_LIMIT = 12  # enumerate every saved set when at most this many values are free to save or not
REFRESH_MODES = ("union", "singles", "cheapest")  # the ways ``Problem.refresh_steps`` recomputes values twice
# Planned for a fusing compiler (``policies.budget(..., fused=True)``, Inductor), a smaller byte
# budget's predicted peak is at most this fraction above a larger budget's, not at most equal: the
# compiler orders and fuses the backward itself, and the peaks it reaches differ from the
# predicted ones by about this much (on the benchmark's small GPT, measured / predicted 0.92 to
# 1.03). Holding the predicted peak exactly would recompute matrix products twice for a peak the
# compiled code does not have.
FUSED_PEAK_SLACK = 0.08


class Problem:
    """The save/recompute choice of a ``_Partition`` as a family of minimum cuts."""

    def __init__(self, part, exact_limit: int = EXACT_LIMIT, fused: bool = False):

        self.part, self.exact_limit, self.method = part, exact_limit, ""
        self.fused = fused  # planned for a compiler fusing pointwise ops by shared reads (``effective_forget``)
        self.slack = FUSED_PEAK_SLACK if fused else 0.0  # how far a smaller level's peak may exceed a larger's
        self.memo = _Memo()
        self._table: list[tuple[int, Point, int]] | None = None
        self._refreshed: dict = {}
        self.unreached: set = set()  # byte_table's levels that took their least peak
        cand, stack = set(), list(part.needed)
        while stack:
            v = stack.pop()
            if v in cand or v in part.bw or v.op == "get_attr":
                continue
            cand.add(v)
            stack.extend(v.all_input_nodes)
        self.cand = [n for n in part.nodes if n in cand]
        self.index = {n: i for i, n in enumerate(self.cand)}
        self.size, self.cost, self.can_save, self.must_save = {}, {}, {}, {}
        for n in self.cand:
            forced = part._forced(n)
            tensor = isinstance(n.meta.get("val"), torch.Tensor)
            view = storage_root(n) is not n
            self.must_save[n] = forced == policies.SAVE and n.target is not operator.getitem
            self.can_save[n] = n.op == "placeholder" or (tensor and not view and forced != policies.RECOMPUTE)
            self.size[n] = 0 if n.op == "placeholder" else max(nbytes(n.meta.get("val")), 1)
            self.cost[n] = 0 if n.op == "placeholder" else recompute_cost(n)
        # Ops a fusing compiler computes in a kernel of its own making (no FLOPs: pointwise math,
        # reductions, norms, gathers; views are no kernel at all), as opposed to the matrix
        # products, convolutions, attention and higher-order ops it calls as they are.
        self.fusible = {
            n
            for n in self.cand
            if n.op == "call_function"
            and not isinstance(n.target, torch._ops.HigherOrderOperator)
            and self.cost[n] in (0, _elements(n.meta.get("val")))
        }
        self.total_bytes = sum(self.size.values())
        self.total_cost = sum(self.cost.values())

    def moved_to(self, part) -> Problem:
        """This problem, solved as far as it is, for ``part``: the same program traced again
        (``problem_of`` checks that), its nodes matched by position."""
        nodes = dict(zip(self.part.nodes, part.nodes, strict=True))
        new = Problem.__new__(Problem)
        for name, value in vars(self).items():
            setattr(new, name, _moved(value, nodes) if name not in ("part", "memo") else None)
        new.part, new.memo = part, _Memo()
        return new

    def _edges(self, wb: int, wc: int):
        """The cut graph for ``wb * bytes + wc * cost``: vertex ``2i`` is candidate ``i`` computed,
        ``2i + 1`` it available; the sink side of a cut recomputes or saves."""
        inf = (wb * self.total_bytes + wc * self.total_cost + 1) * 4
        source = 2 * len(self.cand)
        edges = []
        for n, i in self.index.items():
            edges.append((2 * i, 2 * i + 1, wb * self.size[n] if self.can_save[n] else inf))
            edges.append((source, 2 * i, inf if self.must_save[n] else wc * self.cost[n]))
            for a in n.all_input_nodes:
                if a in self.index:
                    edges.append((2 * self.index[a] + 1, 2 * i, inf))
        for n in self.part.needed:
            if n in self.index:
                edges.append((2 * self.index[n] + 1, source + 1, inf))
        return edges, inf

    def _point(self, sink_side) -> Point:
        saved = frozenset(n for n, i in self.index.items() if 2 * i not in sink_side and 2 * i + 1 in sink_side)
        recomputed = frozenset(n for n, i in self.index.items() if 2 * i in sink_side)
        return self._make(saved, recomputed)

    def _make(self, saved: frozenset, recomputed: frozenset) -> Point:
        """The point, its recomputed set completed with the constants (``get_attr``) the backward reads."""
        consts = {a for n in recomputed for a in n.all_input_nodes if a.op == "get_attr"}
        consts |= {n for n in self.part.needed if n.op == "get_attr"}
        cost = sum(self.cost[n] for n in recomputed)
        return Point(self.saved_bytes(saved), cost, saved, recomputed | consts)

    def solve(self, wb: int, wc: int) -> Point:
        """The saved set minimising ``wb * bytes + wc * cost`` (ties: the least recomputed)."""

        edges, inf = self._edges(wb, wc)
        n = 2 * len(self.cand) + 2
        return self._point(max_flow_min_cut(n, edges, n - 2, n - 1, inf=inf))

    def saved_bytes(self, saved) -> int:
        """Bytes of the storages ``saved`` holds beyond the inputs (each storage once), as ``Split.saved_bytes``."""

        roots: dict = {}
        for s in saved:
            r, size = self.memo.root(s), self.memo.size(s)
            if r.op != "placeholder":
                roots[r] = max(roots.get(r, 0), self.memo.size(r), size)
        return sum(roots.values())

    def hull(self) -> list[Point]:
        """The vertices of the lower convex hull of (bytes, recompute cost), bytes ascending."""
        if not hasattr(self, "_hull"):
            least_bytes = self.solve(self.total_cost + 1, 1)
            least_cost = self.solve(1, self.total_bytes + 1)
            inner = self._between(least_bytes, least_cost) if least_cost.bytes > least_bytes.bytes else []
            points = [least_bytes, *inner, least_cost]
            self._hull = [p for k, p in enumerate(points) if k == 0 or p.bytes > points[k - 1].bytes]
        return self._hull

    def frontier(self) -> list[Point]:
        """The points a budget chooses from, bytes ascending and cost descending. With at most
        ``exact_limit`` free choices, every saved set (``exact_points``): the true frontier.
        Otherwise the hull's vertices and, on each hull edge, the minimum cuts met on one fixed
        walk from one end to the other (``_edge_points``): all on the hull, so each is optimal
        for its own bytes."""
        if not hasattr(self, "_frontier"):
            points = self.exact_points()
            self.method = "exact" if points is not None else "hull"
            if points is None:
                hull = self.hull()
                points = list(hull)
                for lo, hi in itertools.pairwise(hull):
                    points += self._edge_points(lo, hi)
            points.sort(key=lambda p: (p.bytes, p.cost))
            stair: list[Point] = []
            for p in points:
                if not stair or p.cost < stair[-1].cost:
                    stair.append(p)
            self._frontier = stair
        return self._frontier

    def exact_points(self) -> list[Point] | None:
        """Every feasible saved set, by enumerating the free choices (None when there are more
        than ``exact_limit``): each subset of the saveable values is offered, the backward then
        recomputes what it needs and is not offered, and what it reads is saved."""
        free = [n for n in self.cand if self.can_save[n] and not self.must_save[n] and n.op != "placeholder"]
        if len(free) > self.exact_limit:
            return None
        fixed = {n for n in self.cand if n.op == "placeholder" or (self.must_save[n] and self.can_save[n])}
        points = []
        for mask in range(1 << len(free)):
            offered = fixed | {n for k, n in enumerate(free) if mask >> k & 1}
            p = self._closure(offered)
            if p is not None:
                points.append(p)
        return points

    def _closure(self, offered) -> Point | None:
        """The saved set when the forward offers ``offered``: None if something needed can be neither."""
        saved, recomputed = set(), set()
        stack = [n for n in self.part.needed if n in self.index]
        while stack:
            v = stack.pop()
            if v in saved or v in recomputed:
                continue
            if v in offered:
                saved.add(v)
            elif self.must_save[v]:
                return None
            else:
                recomputed.add(v)
                stack.extend(a for a in v.all_input_nodes if a in self.index)
        if any(not self.can_save[v] and v.op != "placeholder" for v in saved):
            return None
        return self._make(frozenset(saved), frozenset(recomputed))

    def lower_peak(self, point: Point, rounds: int = 6) -> tuple[Point, int]:
        """``point`` with values it recomputes saved instead, greedily, while that lowers the
        predicted peak (saving a block's output lets the backward recompute the block late, just
        before its gradient, instead of with everything after it). Each round saves the first
        value, in program order, among the smaller half of the recomputed tensors, that lowers
        the peak. Recompute never grows."""
        fixed = {n for n in self.cand if n.op == "placeholder" or (self.must_save[n] and self.can_save[n])}
        peak = predicted_peak(self.part, point.saved, point.recomputed, self.memo)
        for _ in range(rounds):
            options = [
                v
                for v in point.recomputed
                if v in self.index and self.can_save[v] and isinstance(v.meta.get("val"), torch.Tensor)
            ]
            small = sorted(self.size[v] for v in options)[len(options) // 2] if options else 0
            for v in sorted((v for v in options if self.size[v] <= small), key=self.index.__getitem__):
                q = self._closure(fixed | point.saved | {v})
                if q is not None and (qp := predicted_peak(self.part, q.saved, q.recomputed, self.memo)) < peak:
                    point, peak = q, qp
                    break
            else:
                break
        return point, peak

    def peak_candidates(self, spread: int = 4) -> list[tuple[Point, int]]:
        """Points for a peak budget, with their predicted peaks: every frontier point as it is, and
        ``spread`` of them (evenly spaced, the least-bytes one first) after ``lower_peak``."""
        points = self.frontier()
        out = [(p, predicted_peak(self.part, p.saved, p.recomputed, self.memo)) for p in points]
        picks = sorted({round(k * (len(points) - 1) / max(spread - 1, 1)) for k in range(spread)})
        out += [self.lower_peak(points[k]) for k in picks]
        return out + [self.refreshed(p, peak) for p, peak in [*(out[k] for k in picks), *out[len(points) :]]]

    def byte_table(self) -> list[tuple[int, Point, int]]:
        """What a byte budget takes at each level of the frontier: ``(level bytes, point, its
        predicted peak)``, bytes ascending; a budget ``B`` takes the last level ``<= B``.

        Every level's choice saves at most its bytes, and a smaller level's choice never saves
        more, never recomputes less and never has a higher predicted peak than a larger level's:
        saved bytes, peak and recompute are all monotone in the budget. Among the chains of
        choices that are, the levels take the one with the least recompute summed over the
        budgets (each level weighted by the bytes of budgets that take it: ``_least_total``).
        The levels are the bytes of the frontier's points and of ``between``'s. The candidates
        are those points, the frontier's each after every round of recomputing values
        twice (``refresh_steps``: a little more recompute for a little less peak), and what a
        greedy descent (``_descend``) adds where nothing fits. A level no chain reaches is
        chosen greedily (``_descend``): it takes its least peak and is listed in ``unreached``,
        the one place the peak may rise as the budget falls (a level of a few bytes that cannot
        save the value whose recomputation makes a larger level's peak)."""
        if self._table is not None:
            return self._table
        points, between = self.frontier(), self.between()
        pool = [(p, predicted_peak(self.part, p.saved, p.recomputed, self.memo)) for p in [*points, *between]]
        pool += [c for p in points for mode in REFRESH_MODES for c in self.refresh_steps(p, mode)]
        points = sorted([*points, *between], key=lambda p: (p.bytes, p.cost))
        self._descend(sorted({p.bytes for p in points}), pool, fill=True)  # adds what the levels need
        distinct = {(p.bytes, p.cost, pk): (p, pk) for p, pk in pool}
        levels = sorted({p.bytes for p in points})
        self._table = self._least_total(levels, sorted(distinct.values(), key=lambda c: c[1]))
        return self._table

    def between(self) -> list[Point]:
        """Points between the frontier's levels, off its hull: each frontier point with one more
        value saved, among those a larger point saves, where that recomputes less than the
        frontier does at the same bytes. A budget between two levels has more to choose from
        (on the small GPT of ``bench_memory.py``, 0.92 MB saved for 1.44e8 recomputed, where
        the frontier has 0.52 MB for 1.69e8 and 1.05 MB for 1.35e8)."""
        points = self.frontier()
        if self.method == "exact":
            return []
        fixed = {n for n in self.cand if n.op == "placeholder" or (self.must_save[n] and self.can_save[n])}
        values = sorted({v for p in points for v in p.saved if v.op != "placeholder"}, key=self.index.__getitem__)
        known = {p.saved for p in points}
        out: dict = {}
        for p in points:
            for v in values:
                q = None if v in p.saved else self._closure(fixed | p.saved | {v})
                if q is None or q.saved in known or q.saved in out:
                    continue
                below = [f.cost for f in points if f.bytes <= q.bytes]
                if below and q.cost < below[-1]:
                    out[q.saved] = q
        return sorted(out.values(), key=lambda q: (q.bytes, q.cost))

    def _descend(self, levels: list[int], pool: list, fill: bool, top=(math.inf, math.inf, 0)):
        """Going down from the largest level, each takes the least recompute that saves at most
        its bytes and the larger levels' choices' bytes, peaks at most at their peaks and
        recomputes at least what they do (``top``: bytes, peak, cost above). With ``fill``,
        where nothing fits, ``_lower_within`` adds to ``pool`` points that recompute values
        twice and that save a few more values within the level's bytes. Where still nothing
        fits, the level takes its least peak (``unreached``)."""
        table, self.unreached = [], set()
        top_bytes, top_peak, floor = top
        for level in reversed(levels):
            room, allowed = min(level, top_bytes), top_peak * (1 + self.slack)
            best = _cheapest(pool, room, allowed, floor)
            if best is None and fill:
                pool += self._lower_within(self.frontier(), room, allowed)
                best = _cheapest(pool, room, allowed, floor)
            if best is None:
                fitting = [c for c in pool if c[0].bytes <= room]
                best = min([c for c in fitting if c[0].cost >= floor] or fitting, key=lambda c: (c[1], c[0].cost))
                self.unreached.add(level)
            table.append((level, *best))
            top_bytes, top_peak, floor = min(top_bytes, best[0].bytes), min(top_peak, best[1]), best[0].cost
        return table[::-1]

    def _least_total(self, levels: list[int], pool: list) -> list[tuple[int, Point, int]]:
        """The monotone chain of choices (see ``byte_table``) with the least recompute summed
        over the levels, each weighted by the bytes from it to the next (dynamic programming
        from the largest level down; ties: the lower peak). From the first level no chain
        reaches, the levels are chosen by ``_descend``."""
        import numpy as np

        if self.slack:
            return self._least_total_within(levels, pool)
        nb = np.array([p.bytes for p, _ in pool], dtype=np.float64)
        nc = np.array([p.cost for p, _ in pool], dtype=np.float64)
        nk = np.array([pk for _, pk in pool], dtype=np.float64)
        scale = max(levels[-1], 1) * max(float(nc.max()), 1.0)
        total = np.zeros(len(pool))
        alive = np.ones(len(pool), dtype=bool)  # the chains above may end at each candidate
        backs: list[np.ndarray] = []
        for i in range(len(levels) - 1, -1, -1):
            weight = (levels[i + 1] - levels[i] if i + 1 < len(levels) else 0) + 1
            new_total, back = np.full(len(pool), np.inf), np.full(len(pool), -1)
            within = np.flatnonzero(nb <= levels[i])
            if not backs:  # the largest level: every candidate within it starts a chain
                new_total[within], back[within] = weight * nc[within] / scale, within
            # each candidate within the level follows the chain above it totalling least (the
            # first such), among those saving no less, recomputing no more, peaking no lower;
            # in blocks of candidates, a block's comparisons at most ~4M booleans
            step = max(1, (1 << 22) // max(len(pool), 1))
            for lo in range(0, len(within) if backs else 0, step):
                ks = within[lo : lo + step]
                ok = alive & (nb >= nb[ks, None]) & (nc <= nc[ks, None]) & (nk >= nk[ks, None])
                reached = ok.any(axis=1)
                j = np.where(ok, total, np.inf).argmin(axis=1)[reached]
                ks = ks[reached]
                new_total[ks], back[ks] = total[j] + weight * nc[ks] / scale, j
            if not np.isfinite(new_total).any():
                return self._chain(levels, pool, backs, total, i)
            total, alive = new_total, np.isfinite(new_total)
            backs.append(back)
        return self._chain(levels, pool, backs, total, -1)

    def _least_total_within(self, levels: list[int], pool: list) -> list[tuple[int, Point, int]]:
        """``_least_total`` where a smaller level's peak may exceed each larger level's by the
        fraction ``slack``: the bound is the least peak of the chain above, not the peak just
        above, so the slack does not compound. A chain is then more than its last candidate: the
        states are ``(candidate, least peak above and at it)``, each candidate's kept while no
        other of its states has both a larger least peak and a smaller total."""
        import numpy as np

        nb = np.array([p.bytes for p, _ in pool], dtype=np.float64)
        nc = np.array([p.cost for p, _ in pool], dtype=np.float64)
        nk = np.array([pk for _, pk in pool], dtype=np.float64)
        scale = max(levels[-1], 1) * max(float(nc.max()), 1.0)
        # the states of the level above: candidate, least peak, total, and the state above it
        cand, least, total = np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0)
        steps: list[tuple[np.ndarray, np.ndarray]] = []  # per level from the top: (candidates, parents)
        for i in range(len(levels) - 1, -1, -1):
            weight = (levels[i + 1] - levels[i] if i + 1 < len(levels) else 0) + 1
            out_c, out_l, out_t, out_p = [], [], [], []
            cand_b, cand_c, cand_k = nb[cand], nc[cand], least * (1 + self.slack)  # the states above, once a level
            for k in np.flatnonzero(nb <= levels[i]):
                if not steps:  # the largest level: every candidate within it starts a chain
                    out_c.append(np.array([k]))
                    out_l.append(nk[k : k + 1])
                    out_t.append(np.array([weight * nc[k] / scale]))
                    out_p.append(np.array([-1]))
                    continue
                idx = np.flatnonzero((cand_b >= nb[k]) & (cand_c <= nc[k]) & (cand_k >= nk[k]))
                if not idx.size:
                    continue
                r, t = np.minimum(least[idx], nk[k]), total[idx]
                order = np.lexsort((t, -r))  # least peak descending, then total ascending
                r, t, idx = r[order], t[order], idx[order]
                before = np.minimum.accumulate(np.concatenate(([np.inf], t[:-1])))
                keep = t < before  # no state with a larger (or equal) least peak totals less
                out_c.append(np.full(int(keep.sum()), k))
                out_l.append(r[keep])
                out_t.append(t[keep] + weight * nc[k] / scale)
                out_p.append(idx[keep])
            if not out_c:
                return self._chain_within(levels, pool, steps, total, i)
            cand, least, total = np.concatenate(out_c), np.concatenate(out_l), np.concatenate(out_t)
            steps.append((cand, np.concatenate(out_p)))
        return self._chain_within(levels, pool, steps, total, -1)

    def _chain_within(self, levels, pool, steps, total, stop: int) -> list[tuple[int, Point, int]]:
        """``_chain`` for ``_least_total_within``'s states."""
        import numpy as np

        s = int(np.argmin(total))
        chosen: dict[int, tuple[Point, int]] = {}
        for t in range(len(steps) - 1, -1, -1):
            cands, parents = steps[t]
            chosen[len(levels) - 1 - t] = pool[int(cands[s])]
            s = int(parents[s])
        return self._finish_chain(levels, pool, chosen, stop)

    def _chain(self, levels, pool, backs, total, stop: int) -> list[tuple[int, Point, int]]:
        """The best chain (``_least_total``) for the levels above ``stop``, and ``_descend``'s
        choices below them; ``backs[t]`` links the ``t``-th level from the top to the one above."""
        import numpy as np

        chosen: dict[int, tuple[Point, int]] = {}
        k = int(np.argmin(total))
        for t in range(len(backs) - 1, -1, -1):
            chosen[len(levels) - 1 - t] = pool[k]
            k = int(backs[t][k])
        return self._finish_chain(levels, pool, chosen, stop)

    def _finish_chain(self, levels, pool, chosen: dict[int, tuple[Point, int]], stop: int) -> list[tuple[int, Point, int]]:
        """The chain's ``chosen`` points for the levels above ``stop``, after ``_descend``'s
        choices below them (bounded by the least peak above)."""
        self.unreached = set()
        top = (math.inf, math.inf, 0)
        if stop + 1 in chosen:
            p, _ = chosen[stop + 1]
            top = (p.bytes, min(c[1] for c in chosen.values()), p.cost)  # the least peak above
        below = self._descend(levels[: stop + 1], pool, fill=False, top=top) if stop >= 0 else []
        return below + [(levels[i], *chosen[i]) for i in range(stop + 1, len(levels))]

    def byte_choice(self, limit: int) -> tuple[Point, int]:
        """The point (and its predicted peak) a byte budget of ``limit`` takes (``byte_table``)."""
        fits = [(p, pk) for b, p, pk in self.byte_table() if b <= limit]
        if not fits:
            raise ValueError(f"{limit} is below the frontier")
        return fits[-1]

    def _lower_within(self, points: list[Point], room: float, target: float, rounds: int = 3) -> list[tuple[Point, int]]:
        """Candidates within ``room`` bytes with a lower peak: the frontier's points within it
        recomputing twice (``refreshed``), then, from the largest such point on, up to
        ``rounds`` more values saved one at a time (each round the one whose ``refreshed`` peak
        is least, among values whose saving keeps the bytes within ``room``), until the peak is
        at most ``target``."""
        within = [p for p in points if p.bytes <= room][::-1]
        out = []
        for p in within:
            out.append(self.refreshed(p, predicted_peak(self.part, p.saved, p.recomputed, self.memo)))
        steps = [c for p in within for mode in REFRESH_MODES for c in self.refresh_steps(p, mode)]
        if not within or min(pk for _, pk in out) <= target:
            return out + steps
        fixed = {n for n in self.cand if n.op == "placeholder" or (self.must_save[n] and self.can_save[n])}
        for start in out[:]:
            out += self._save_more(start, fixed, room, target, rounds)
            if out[-1][1] <= target:
                break
        return out + steps

    def _save_more(
        self, start: tuple[Point, int], fixed: set, room: float, target: float, rounds: int
    ) -> list[tuple[Point, int]]:
        """From ``start``, save one more value a round, the one whose ``refreshed`` peak is least."""
        (point, peak), out = start, []
        for _ in range(rounds):
            step = None
            for v in sorted(point.recomputed & set(self.index), key=self.index.__getitem__):
                if not (self.can_save[v] and isinstance(v.meta.get("val"), torch.Tensor)):
                    continue
                q = self._closure(fixed | point.saved | {v})
                if q is None or q.bytes > room:
                    continue
                r = self.refreshed(q, predicted_peak(self.part, q.saved, q.recomputed, self.memo))
                if r[1] < (step[1] if step else peak):
                    step = r
            if step is None:
                break
            out.append(step)
            point, peak = step
            if peak <= target:
                break
        return out

    def refreshed(self, point: Point, peak: int) -> tuple[Point, int]:
        """``point`` with the backward recomputing values again rather than keeping them, where
        that lowers its predicted peak (``refresh``) the most; its cost counts every recomputation."""
        steps = self.refresh_steps(point)
        return steps[-1] if steps and steps[-1][1] < peak else (point, peak)

    def refresh_steps(self, point: Point, mode: str = "union") -> list[tuple[Point, int]]:
        """``point`` after each round of ``refresh`` that lowers its predicted peak, with that peak:
        recompute up, peak down. ``mode``: what each round tries first, all the storages at once
        (``"union"``) or one at a time (``"singles"``), or the one recomputing least per byte of
        peak removed (``"cheapest"``)."""
        key = (point, mode)
        if key not in self._refreshed:
            out: list[tuple[Point, int]] = []
            fw_peak = forward_peak(self.part, point.saved, self.memo)
            costs = self.cost if mode == "cheapest" else None
            steps = refresh(
                self.part,
                point.saved,
                point.recomputed,
                self.memo,
                singles_first=mode == "singles",
                trail=True,
                cost=costs,
                fusible=self.fusible if self.fused else None,
            )
            least = max(fw_peak, steps[0][2])
            for forget, order, bw_peak in steps[1:]:
                if max(fw_peak, bw_peak) < least:
                    least = max(fw_peak, bw_peak)
                    cost = sum(self.cost.get(n, 0) for n in order if n not in self.part.bw)
                    out.append((Point(point.bytes, cost, point.saved, point.recomputed, forget), least))
            self._refreshed[key] = out
        return self._refreshed[key]

    def _between(self, a: Point, b: Point) -> list[Point]:
        """Hull points strictly between ``a`` (fewer bytes) and ``b`` (less cost)."""
        out, todo = [], [(a, b)]
        while todo:
            lo, hi = todo.pop()
            if lo.cost <= hi.cost or hi.bytes <= lo.bytes:
                continue
            wb, wc = lo.cost - hi.cost, hi.bytes - lo.bytes
            p = self.solve(wb, wc)
            if wb * p.bytes + wc * p.cost < wb * lo.bytes + wc * lo.cost:
                out.append(p)
                todo += [(lo, p), (p, hi)]
        return sorted(out, key=lambda p: p.bytes)

    def _edge_points(self, lo: Point, hi: Point) -> list[Point]:
        """Minimum cuts at the weight of the hull edge ``lo``-``hi``: every such cut's sink side
        lies between the least and the largest, and is closed under residual predecessors
        (Picard-Queyranne). Starting from the largest (most recompute), strongly connected
        components of the residual graph leave it one at a time, earliest in the program first
        among those whose successors have left: each step is a cut on the edge."""

        edges, inf = self._edges(lo.cost - hi.cost, hi.bytes - lo.bytes)
        n = 2 * len(self.cand) + 2
        head, to, cap = max_flow(n, edges, n - 2, n - 1, inf)
        t_min = _residual_reach(head, to, cap, n - 1, backward=True)
        s_min = _residual_reach(head, to, cap, n - 2, backward=False)
        middle = {v for v in range(n) if v not in t_min and v not in s_min}
        succ = {v: {to[e] for e in head[v] if cap[e] > 0 and to[e] in middle} for v in middle}
        comps, comp_of = _components(sorted(middle), succ)
        out_deg = [len({comp_of[u] for v in c for u in succ[v]} - {k}) for k, c in enumerate(comps)]
        preds: list[set] = [set() for _ in comps]
        for k, c in enumerate(comps):
            for u in {comp_of[u] for v in c for u in succ[v]} - {k}:
                preds[u].add(k)
        ready = [(min(c), k) for k, c in enumerate(comps) if out_deg[k] == 0]
        heapq.heapify(ready)
        sink_side, points = t_min | middle, []
        while ready:
            _, k = heapq.heappop(ready)
            sink_side -= comps[k]
            points.append(self._point(sink_side))
            for p in preds[k]:
                out_deg[p] -= 1
                if out_deg[p] == 0:
                    heapq.heappush(ready, (min(comps[p]), p))
        return points


def _residual_reach(head, to, cap, start: int, backward: bool) -> set:
    """Vertices reachable from ``start`` in the residual graph (``backward``: that reach ``start``)."""
    seen, stack = {start}, [start]
    while stack:
        v = stack.pop()
        for e in head[v]:
            u = to[e]
            if u not in seen and (cap[e ^ 1] if backward else cap[e]) > 0:
                seen.add(u)
                stack.append(u)
    return seen


def _components(vertices, succ) -> tuple[list[set], dict]:
    """Strongly connected components (Kosaraju, iterative) of the graph ``succ`` on ``vertices``."""
    order, seen = [], set()
    for s in vertices:
        if s in seen:
            continue
        seen.add(s)
        stack = [(s, iter(succ[s]))]
        while stack:
            v, it = stack[-1]
            u = next(it, None)
            if u is None:
                stack.pop()
                order.append(v)
            elif u not in seen:
                seen.add(u)
                stack.append((u, iter(succ[u])))
    pred: dict = {v: [] for v in vertices}
    for v in vertices:
        for u in succ[v]:
            pred[u].append(v)
    comps: list[set] = []
    comp_of: dict = {}
    for s in reversed(order):
        if s in comp_of:
            continue
        comp, stack = set(), [s]
        comp_of[s] = len(comps)
        while stack:
            v = stack.pop()
            comp.add(v)
            for u in pred[v]:
                if u not in comp_of:
                    comp_of[u] = len(comps)
                    stack.append(u)
        comps.append(comp)
    return comps, comp_of


# --------------------------------------------------------------------------------------------
# One solve per program
# --------------------------------------------------------------------------------------------


SOLVED_KEPT = 4  # programs whose solved ``Problem`` is kept (least recently used dropped first)
_SOLVED: collections.OrderedDict = collections.OrderedDict()


def problem_of(part, exact_limit: int = EXACT_LIMIT, fused: bool = False) -> Problem:
    """The budget ``Problem`` of ``part``, with what was already solved for the same program:
    splitting one function at sizes it was split at before (another budget, ``Split.frontier``,
    ``fxtools.compile`` again) traces the same joint graph again, and its frontier, byte table
    and peak candidates are the same. Reused only when ``program_key`` is equal (same ops,
    arguments, dtypes, sizes, strides, checkpoint regions, inputs, outputs and backward), moved
    onto the new graph's nodes by position; anything else is solved anew."""
    key = (program_key(part), exact_limit, fused)
    old = _SOLVED.pop(key, None)
    problem = Problem(part, exact_limit, fused) if old is None else old.moved_to(part)
    _SOLVED[key] = problem
    while len(_SOLVED) > SOLVED_KEPT:
        _SOLVED.popitem(last=False)
    return problem


class _Same:
    """A key part equal only to itself around the same object (held: its id is never reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


_LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def program_key(part) -> tuple:
    """Everything the budget's answers read from ``part``, node by node: each node's op, target,
    arguments (nodes by position, literals with their types), its value's dtype, device, sizes
    and strides (and their bounds), its checkpoint region and phase; and the positions of the
    inputs, outputs, cotangents, gradients, needed values and backward. Equal keys: the same
    problem. An object the key cannot compare by value (a function, a module) is compared by
    identity."""
    pos = {n: i for i, n in enumerate(part.nodes)}
    rows = [_node_key(n, pos) for n in part.nodes]
    where = [
        tuple(_arg_key(v, pos) for v in vs)
        for vs in (part.primals, part.cts, part.fw_outs, part.grads, part.needed, sorted(pos[n] for n in part.bw))
    ]
    return tuple(rows), tuple(where)


def _node_key(n: fx.Node, pos: dict) -> tuple:
    target: object
    if n.op == "get_attr":
        target = (n.target, _attr_key(n))
    else:
        target = n.target if isinstance(n.target, _LITERALS) else _Same(n.target)
    return (
        n.op,
        target,
        _arg_key(n.args, pos),
        _arg_key(n.kwargs, pos),
        _val_key(n.meta.get("val")),
        _arg_key(policies.checkpoint_region(n), pos),
        meta.PHASE.get(n),
    )


def _attr_key(n: fx.Node):
    obj = n.graph.owning_module
    try:
        for name in str(n.target).split("."):
            obj = getattr(obj, name)
    except AttributeError:
        return _Same(n)
    if isinstance(obj, fx.GraphModule):
        inner = {m: i for i, m in enumerate(obj.graph.nodes)}
        return tuple(_node_key(m, inner) for m in obj.graph.nodes)
    return _val_key(obj) if isinstance(obj, torch.Tensor) else _Same(obj)


def _arg_key(a, pos: dict):
    if isinstance(a, fx.Node):
        return ("node", pos[a]) if a in pos else _Same(a)
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, *(_arg_key(x, pos) for x in a))
    if isinstance(a, dict):
        return ("dict", *((_arg_key(k, pos), _arg_key(v, pos)) for k, v in a.items()))
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = a.node.hint  # FLOP counts read it
        return (type(a).__name__, str(a), hint) if type(hint) in _LITERALS else _Same(a)
    if type(a) in _LITERALS:
        return (type(a).__name__, a)
    return _Same(a)


def _val_key(v):
    if isinstance(v, torch.Tensor):
        sizes = tuple((_arg_key(s, {}), upper_bound(s)) for s in v.shape)
        strides = tuple((_arg_key(s, {}), upper_bound(s)) for s in v.stride())
        return ("tensor", v.dtype, v.device, sizes, strides, str(v.storage_offset()))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, *(_val_key(x) for x in v))
    return _arg_key(v, {})


def _moved(x, nodes: dict):
    """``x`` (a ``Problem``'s state) with each node replaced by ``nodes[node]``."""
    if isinstance(x, fx.Node):
        return nodes[x]
    if isinstance(x, Point):
        return Point(x.bytes, x.cost, _moved(x.saved, nodes), _moved(x.recomputed, nodes), _moved(x.forget, nodes))
    if isinstance(x, (tuple, list, set, frozenset)):
        return type(x)(_moved(v, nodes) for v in x)
    if isinstance(x, dict):
        return {_moved(k, nodes): _moved(v, nodes) for k, v in x.items()}
    return x


# --------------------------------------------------------------------------------------------
# Choosing a point
# --------------------------------------------------------------------------------------------


def limit_bytes(spec, save_all_bytes: int) -> int:
    """The budget in bytes: a fraction of ``save_all``'s bytes, or bytes."""
    if isinstance(spec, float):
        return math.floor(spec * save_all_bytes + 1e-9)
    return int(spec)


def choose_bytes(points: list[Point], hull: list[Point] | None, limit: int, save_all_bytes: int) -> tuple[Point, float]:
    """The frontier point with the most bytes within ``limit``, and the Lagrangian lower bound
    on the recompute of any saved set within ``limit`` (from the hull edge ``limit`` falls on)."""
    fits = [p for p in points if p.bytes <= limit]
    if not fits:
        least = points[0].bytes
        frac = least / save_all_bytes if save_all_bytes else float("inf")
        raise FxtoolsError(
            f"fxtools.policies.budget: {limit:,} bytes is below the least any split can save, {least:,} bytes "
            f"({frac:.3f} of save_all's {save_all_bytes:,}) with everything recomputable recomputed "
            "(random ops and side effects are always saved). Raise the budget to at least that."
        )
    if hull is None:  # the frontier is exact
        return fits[-1], float(fits[-1].cost)
    k = max(k for k, p in enumerate(hull) if p.bytes <= limit)
    if k + 1 == len(hull):
        return fits[-1], float(hull[k].cost)
    p, q = hull[k], hull[k + 1]
    return fits[-1], p.cost - (limit - p.bytes) * (p.cost - q.cost) / (q.bytes - p.bytes)


def _cheapest(pool: list[tuple[Point, int]], room: float, top_peak: float, floor: int = 0) -> tuple[Point, int] | None:
    """The least recompute (then fewest bytes) in ``pool`` within ``room`` bytes and ``top_peak``,
    recomputing at least ``floor``."""
    fits = [c for c in pool if c[0].bytes <= room and c[1] <= top_peak and c[0].cost >= floor]
    return min(fits, key=lambda c: (c[0].cost, c[0].bytes, -c[1])) if fits else None


def choose_peak(points: list[Point], peaks: list[int], limit: int) -> Point:
    """The cheapest point whose predicted peak fits ``limit``."""
    fits = [p for p, pk in zip(points, peaks) if pk <= limit]
    if not fits:
        raise FxtoolsError(
            f"fxtools.policies.budget(peak={limit:,}): no split's predicted peak fits; the least is "
            f"{min(peaks):,} bytes (inputs, outputs and gradients included). Raise the peak to at least that."
        )
    return min(fits, key=lambda p: (p.cost, p.bytes))


# --------------------------------------------------------------------------------------------
# Predicted peak memory
# --------------------------------------------------------------------------------------------


class _Lazy(dict):
    """``key -> make(key)``, each made once."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = value = self.make(key)
        return value


class _Memo:
    """Each node's storage root, bytes and inputs, computed once (liveness runs many times on one graph)."""

    def __init__(self):
        self.roots = _Lazy(storage_root)
        self.sizes = _Lazy(lambda n: nbytes(n.meta.get("val")))
        self.values = _Lazy(self._value)  # node -> (storage root, result it is an item of, bytes): ``live_trace``
        self.inputs = InputsOf()
        self.forward: dict = {}  # saved set -> the forward's peak
        self.trials: dict = {}  # (saved, recomputed, forget) -> the backward's peak and recompute (``_trial``)
        self.peaks: dict = {}  # (saved, recomputed) -> ``predicted_peak`` forgetting nothing
        self.base: tuple | None = None  # the last saved, recomputed, backward order, its trace (``_base_trace``)
        self.tried = 0  # backward orders tried (``_trial``, at most ``MAX_TRIALS``)
        self.order_limit: int | None = None  # most nodes a forgetting backward may compute (``_order_limit``)

    def root(self, n: fx.Node) -> fx.Node:
        return self.roots[n]

    def size(self, n: fx.Node) -> int:
        return self.sizes[n]

    def _value(self, n: fx.Node) -> tuple:
        r = self.roots[n]
        whole = n.args[0] if r is n and n.target is operator.getitem else None
        return r, whole, max(self.sizes[r], self.sizes[n])


@dataclass
class Trace:
    """Liveness over an order of nodes: the peak, where it is reached, and what is live there.
    A node computed again (``backward_nodes`` with ``forget``) is a new value: values are keyed
    ``(node, occurrence)`` and so are storages (a view's is its base's current value's)."""

    peak: int
    at: int  # position of the peak in the order (-1: before the first node)
    live: set  # storage keys live at the peak
    storage: dict  # value key -> storage key
    made: dict  # value key -> position it is made at (-1: a start value)
    reads: dict  # value key -> positions that read it, ascending
    taken: dict = field(default_factory=dict)  # an item of a multi-output op's result -> that result


def live_trace(order, start, held, memo: _Memo | None = None, full: bool = True) -> Trace:
    """Liveness of running ``order`` (nodes): ``start`` values exist before, ``held`` values (and
    their storages) are never freed; every other storage is freed after its last use. Without
    ``full``, the peak only (``reads`` left empty, ``live`` what is live at the start: the
    budget's searches simulate thousands of orders for their peaks)."""
    memo = memo or _Memo()
    inputs, values = memo.inputs, memo.values
    current: dict = {}
    count: dict = {}
    storage: dict = {}
    made: dict = {}
    reads: dict = {}
    taken_from: dict = {}  # an item of a multi-output op's result -> that result
    trace = Trace(0, -1, set(), storage, made, reads, taken_from)
    size: dict = {}

    def make(n, at):
        occ = count[n] = count.get(n, -1) + 1
        key = current[n] = (n, occ)
        r, whole, nbytes_ = values[n]
        if r is n:
            s = key
            if whole is not None and whole in current and made[current[whole]] >= 0:
                taken_from[key] = current[whole]
        else:
            s = storage[current.get(r) or make(r, -1)]
        storage[key], made[key], reads[key] = s, at, []
        if size.get(s, -1) < nbytes_:
            size[s] = nbytes_
        return key

    last, made_storage = {}, []
    current_get = current.get
    for v in start:
        last.setdefault(storage[current_get(v) or make(v, -1)], -1)
    for i, n in enumerate(order):
        for a in inputs[n]:
            k = current_get(a) or make(a, -1)
            if full:
                reads[k].append(i)
            last[storage[k]] = i
        r, whole, nbytes_ = values[n]
        if r is n and whole is None:  # ``make(n, i)``: a value of its own storage
            occ = count[n] = count.get(n, -1) + 1
            s = current[n] = (n, occ)
            storage[s], made[s], reads[s], size[s] = s, i, [], nbytes_
        else:
            s = storage[make(n, i)]
        made_storage.append(s)
        last[s] = i
    for k, whole in taken_from.items():  # the result holds every item until its last is taken
        s = trace.storage[k]
        last[s] = max(last[s], last[trace.storage[whole]])
    held_roots = {memo.root(h) for h in held if isinstance(h, fx.Node)}
    frees: dict[int, list] = {}
    for s, i in last.items():
        if s[0] not in held_roots:
            frees.setdefault(i, []).append(s)
    live = {trace.storage[current[v]] for v in start} - set(frees.get(-1, ()))
    trace.live = set(live)
    total = trace.peak = sum(size[s] for s in live)
    for i, s in enumerate(made_storage):
        if s not in live:
            live.add(s)
            total += size[s]
        if total > trace.peak:
            trace.peak, trace.at = total, i
            if full:
                trace.live = set(live)
        for s in frees.get(i, ()):
            if s in live:
                live.discard(s)
                total -= size[s]
    return trace


def liveness_peak(order, start, held, memo: _Memo | None = None) -> int:
    """Peak bytes while running ``order`` (``live_trace``)."""
    return live_trace(order, start, held, memo, full=False).peak


def _backward_ends(part, saved):
    """What exists when the backward starts, and what outlives it."""
    outs = [o for o in part.fw_outs if isinstance(o, fx.Node)]
    grads = [g for g in part.grads if isinstance(g, fx.Node)]
    return [*part.primals, *outs, *saved, *part.cts], [*part.primals, *outs, *grads]


def forward_peak(part, saved, memo: _Memo | None = None) -> int:
    """Peak bytes of running the forward on ``part``, saving ``saved`` (kept in ``memo``)."""
    memo = memo or _Memo()
    key = frozenset(saved)
    if key not in memo.forward:
        primals = list(part.primals)
        outs = [o for o in part.fw_outs if isinstance(o, fx.Node)]
        memo.forward[key] = liveness_peak(forward_nodes(part, saved, memo.inputs), primals, [*primals, *outs, *saved], memo)
    return memo.forward[key]


def predicted_peak(part, saved, recomputed, memo: _Memo | None = None, forget=None) -> int:
    """Peak bytes of running the forward, then the backward (``backward_boxed``), on ``part``."""

    memo = memo or _Memo()
    if forget:
        fw_peak = forward_peak(part, saved, memo)
        bw = backward_nodes(part, saved, recomputed, forget, inputs=memo.inputs)
        start, held = _backward_ends(part, saved)
        return max(fw_peak, liveness_peak(bw, start, held, memo))
    key = (frozenset(saved), frozenset(recomputed))
    if key not in memo.peaks:  # the budget's searches meet the same points many times
        start, held = _backward_ends(part, saved)
        bw = backward_nodes(part, saved, recomputed, inputs=memo.inputs)
        memo.peaks[key] = max(forward_peak(part, saved, memo), liveness_peak(bw, start, held, memo))
    return memo.peaks[key]


def _base_trace(part, saved, recomputed, memo: _Memo) -> tuple[list, Trace]:
    """The backward's order and ``live_trace`` forgetting nothing; the last one is kept
    (``refresh`` of a point in each mode starts from the same).
    Kept for the same set objects only: the trace's dicts follow ``saved``'s iteration order."""
    if memo.base is None or memo.base[0] is not saved or memo.base[1] is not recomputed:
        start, held = _backward_ends(part, saved)
        order = backward_nodes(part, saved, recomputed, inputs=memo.inputs)
        memo.base = saved, recomputed, order, live_trace(order, start, held, memo)
    return memo.base[2], memo.base[3]


def refresh(
    part,
    saved,
    recomputed,
    memo: _Memo | None = None,
    rounds: int = 48,
    singles_first: bool = False,
    trail: bool = False,
    cost: dict | None = None,
    fusible: set | None = None,
) -> list[tuple[dict, list, int]]:
    """Recompute values again rather than keep them: ``(forget, backward order, its peak)`` after
    each round that lowered the peak, the first recomputing least (empty: none did); with
    ``trail``, the backward recomputing once first.

    A backward that recomputes a chain (the whole forward, to get the loss's gradient) keeps the
    chain's early values until their own gradients. At the backward's peak, every recomputed
    storage live there but not read there, whose values are read before and again after, may be
    forgotten after its last read before the peak (``backward_nodes``' ``forget``) and recomputed
    just before its next. Each round tries all of them at once, then each storage alone, largest
    first (forgetting everything at once can move the peak to where the recomputation happens),
    and keeps the first that lowers the peak; at most ``rounds`` rounds. Each round costs more
    recompute for less peak: a budget takes the first round whose peak fits. ``singles_first``
    tries each storage alone before all at once: smaller steps, each recomputing less. With
    ``cost`` (node -> recompute cost), each round tries every one and keeps the one that recomputes
    least per byte of peak it removes: a pointwise chain (a GELU's output, recomputed from the
    matrix product it reads) before the matrix product itself, and tries each storage also with
    the recomputed values it is made of forgotten after each use (``_with_inputs``: else they
    stay to recompute it, and take its place in memory). With ``fusible`` (the ops a fusing
    compiler makes kernels of), each forget is ``effective_forget``'s: what such a compiler would
    compute in the first computation's kernel is not forgotten."""
    memo = memo or _Memo()
    start, held = _backward_ends(part, saved)
    forget: dict = {}
    order, trace = _base_trace(part, saved, recomputed, memo)
    steps = [(forget, order, trace.peak)] if trail else []
    for _ in range(rounds):
        groups = _dead_at_peak(trace, order, recomputed, memo)
        union: dict = {}
        for g in groups:
            union = _merged(union, g)
        trials = ([*groups, union] if singles_first else [union, *groups]) if len(groups) > 1 else groups
        if cost is not None:
            trials = trials + [c for g in groups if (c := _with_inputs(g, recomputed, part.bw)) != g]
        if fusible is not None:
            trials = [t for t in (effective_forget(_merged(forget, more), fusible) for more in trials) if t != forget]
        step = _cheapest_trial(part, saved, recomputed, memo, forget, trials, trace, cost) if cost else None
        for more in trials if cost is None else []:
            trial, kept = _merged(forget, more), []
            if _trial(part, saved, recomputed, memo, trial, kept=kept)[0] < trace.peak:
                if not kept:
                    trial_order = backward_nodes(part, saved, recomputed, trial, inputs=memo.inputs)
                    kept = [trial_order, live_trace(trial_order, start, held, memo)]
                step = trial, kept[0], kept[1]
                break
        if step is None:
            break
        forget, order, trace = step
        steps.append((forget, order, trace.peak))
    return steps


def _cheapest_trial(part, saved, recomputed, memo, forget, trials, trace, cost: dict):
    """Of ``trials`` (storages to forget, ``refresh``), the one that lowers the backward's peak
    below ``trace``'s for the least recompute per byte of peak removed: ``(forget, order,
    trace)``, or None if none lowers it."""
    base, best, best_rate = _trial(part, saved, recomputed, memo, forget, cost)[1], None, math.inf
    best_kept: list = []
    for more in trials:
        trial, kept = _merged(forget, more), []
        peak, recompute = _trial(part, saved, recomputed, memo, trial, cost, kept=kept)
        if peak < trace.peak:
            rate = (recompute - base) / (trace.peak - peak)
            if rate < best_rate:
                best, best_rate, best_kept = trial, rate, kept
    if best is None:
        return None
    if best_kept:
        return best, best_kept[0], best_kept[1]
    start, held = _backward_ends(part, saved)
    order = backward_nodes(part, saved, recomputed, best, inputs=memo.inputs)
    return best, order, live_trace(order, start, held, memo)


def _trial(
    part, saved, recomputed, memo: _Memo, forget: dict, cost: dict | None = None, kept: list | None = None
) -> tuple[float, float]:
    """The backward's peak and recompute (``cost`` summed over what it recomputes, 0 without)
    when it forgets ``forget``, kept in ``memo``: the refresh modes and rounds try many of the
    same sets. Infinite (never chosen) for an order longer than ``_order_limit`` and once
    ``MAX_TRIALS`` orders were tried. An order computed here is put in ``kept`` with its trace
    (``refresh`` takes the one it chooses without computing it again)."""
    key = (frozenset(saved), frozenset(recomputed), frozenset((u, frozenset(vs)) for u, vs in forget.items()), cost is None)
    if key not in memo.trials:
        if memo.tried >= MAX_TRIALS:  # enough tried: the candidates found so far are kept
            return math.inf, math.inf
        memo.tried += 1
        start, held = _backward_ends(part, saved)
        try:
            order = backward_nodes(part, saved, recomputed, forget, inputs=memo.inputs, limit=_order_limit(part, memo))
        except OrderTooLong:  # recomputing a recurrence again and again: never a cheaper peak
            memo.trials[key] = math.inf, math.inf
            return memo.trials[key]
        recompute = sum(cost.get(n, 0) for n in order if n not in part.bw) if cost is not None else 0
        trace = live_trace(order, start, held, memo)
        memo.trials[key] = trace.peak, recompute
        if kept is not None:
            kept[:] = [order, trace]
    return memo.trials[key]


# A backward that forgets values (``refresh``) computes at most this many times the nodes of the
# joint graph: forgetting inside a recurrence (an LSTM's two states each read the step before)
# recomputes it exponentially often, which no peak is worth.
ORDER_GROWTH = 4
# At most this many backward orders are tried per program (``_trial``): each costs a pass over
# the joint graph, and a program of many small values (an RNN unrolled over its steps) has many
# frontier points, each refreshed in every mode, round after round (a two-layer bidirectional
# LSTM of 5 steps tried ~6,000 and took minutes). The tiny GPT of the tests tries 418.
MAX_TRIALS = 1000


def _order_limit(part, memo: _Memo) -> int:
    if memo.order_limit is None:
        memo.order_limit = ORDER_GROWTH * len(part.nodes) + 64
    return memo.order_limit


def _with_inputs(group: dict, recomputed, bw) -> dict:
    """``group`` (``refresh``'s forgets) with the recomputed values its forgotten values are made
    from forgotten too, after each use, back to what is saved: a forgotten value recomputed
    later reads its inputs again, and kept for that they would take its place in memory (an
    embedding sum forgotten keeps the embedding it is made of)."""
    out = dict(group)
    stack = [v for vs in group.values() for v in vs]
    seen = set(stack)
    while stack:
        v = stack.pop()
        inputs = frozenset(a for a in v.all_input_nodes if a in recomputed and a not in bw)
        if inputs:
            out[v] = out.get(v, frozenset()) | inputs
            stack.extend(a for a in inputs if a not in seen)
            seen |= inputs
    return out


def effective_forget(forget: dict, fusible: set) -> dict:
    """``forget`` (``refresh``'s) without the values a compiler fusing by shared reads computes in
    the kernel of their first computation anyway: a forgotten value whose second computation is
    ops of ``fusible`` only, reading what is still in memory (or values themselves computed there
    again), reads the same buffers as its first computation and nothing orders it later, so
    Inductor fuses the two (one kernel writing both: the second is in memory from the first on,
    and costs its writes for nothing). A forgotten value whose recomputation goes through a
    matrix product forgotten too is computed late, after that product, and is kept."""
    forgotten = {v for vs in forget.values() for v in vs}
    if not forgotten:
        return {}
    position = {n: i for i, n in enumerate(next(iter(forgotten)).graph.nodes)}  # inputs first
    early: set = set()
    for v in sorted(forgotten, key=position.__getitem__):
        if v in fusible and not any(a in forgotten and a not in early for a in v.all_input_nodes):
            early.add(v)
    out = {u: vs - early for u, vs in forget.items()}
    return {u: vs for u, vs in out.items() if vs}


def _merged(a: dict, b: dict) -> dict:
    return {u: a.get(u, frozenset()) | b.get(u, frozenset()) for u in {*a, *b}}


def _dead_at_peak(trace: Trace, order, recomputed, memo: _Memo) -> list[dict]:
    """``node -> inputs`` to forget, one dict per storage, largest first: for each storage live at
    the peak whose values (a recomputed value and its views) are not read there, every value is
    forgotten after its last read before the peak (those read only before it too: recomputing a
    later view reads them again); storages with a value first read after the peak are left alone.
    An item of a multi-output op's result is forgotten with the result (which holds it)."""
    t = trace.at
    if t < 0:
        return []
    by_storage: dict = {}
    for k, s in trace.storage.items():
        if s in trace.live:
            by_storage.setdefault(s, []).append(k)
    out: list[tuple[int, dict]] = []
    groups: dict = {}
    for s, keys in by_storage.items():
        if s[0] not in recomputed or any(t in trace.reads[k] or trace.made[k] == t for k in keys):
            continue
        pairs = []
        for k in keys:
            reads = trace.reads[k]
            if trace.made[k] > t or not reads:
                continue  # made after the peak (from the storage's value then), or never read
            before = [r for r in reads if r < t]
            if not before and reads[-1] < t:
                continue
            if not before or k[0] not in recomputed:
                pairs = []
                break
            pairs.append((order[before[-1]], k[0]))
        group: dict = {}
        for u, v in pairs:
            group[u] = group.get(u, frozenset()) | {v}
        if group:
            groups[s] = group
    for s, group in groups.items():
        # An item of a multi-output op's result (a layer norm's output) stays in memory while
        # the result does (``live_trace``): forgetting it alone frees nothing, so the result
        # is forgotten with it (and recomputed, with its other items, where they are next read).
        wholes = {trace.storage[trace.taken[k]] for k in by_storage[s] if k in trace.taken}
        for w in wholes:
            group = _merged(group, groups.get(w, {}))
        out.append((memo.size(s[0]), group))
    out.sort(key=lambda sg: -sg[0])
    return [g for _, g in out]


# --------------------------------------------------------------------------------------------
# Drawing the frontier
# --------------------------------------------------------------------------------------------


def draw_frontier(rows, frontier: list[Point], path, title: str = "") -> None:
    """Draw saved bytes (x) against recompute cost (y): one marker per budget in ``rows``
    (``(budget, bytes, cost)``) and the solver's frontier as a staircase. ``.png`` needs matplotlib (the ``bench``
    extra); ``.svg`` is written by matplotlib when installed, else by hand."""
    path = str(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not path.endswith(".svg"):
            raise FxtoolsError(
                f"drawing {path} needs matplotlib (pip install 'fxtools[bench]'); a .svg path needs nothing"
            ) from None
        with open(path, "w") as f:
            f.write(_svg(rows, frontier, title))
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.step([p.bytes / 2**20 for p in frontier], [p.cost for p in frontier], "-", where="post", color="0.6", label="frontier")
    ax.plot([r[1] / 2**20 for r in rows], [r[2] for r in rows], "o", label="budget(b)")
    ax.set_xlabel("saved MiB")
    ax.set_ylabel("estimated recompute (FLOPs + elements)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _svg(rows, frontier: list[Point], title: str) -> str:
    """A small SVG chart: the frontier as a staircase, budgets as dots, axes labelled with their ranges."""
    w, h, m = 520, 340, 60
    xs = [p.bytes for p in frontier] + [r[1] for r in rows]
    ys = [p.cost for p in frontier] + [r[2] for r in rows]
    x0, x1 = min(xs), max(xs) or 1
    y0, y1 = min(ys), max(ys) or 1

    def px(x, y):
        fx_ = m + (w - 2 * m) * ((x - x0) / (x1 - x0) if x1 > x0 else 0.5)
        fy_ = h - m - (h - 2 * m) * ((y - y0) / (y1 - y0) if y1 > y0 else 0.5)
        return f"{fx_:.1f},{fy_:.1f}"

    steps = [(p.bytes, q.cost) for p, q in zip(frontier, frontier[:1] + frontier[:-1])]
    line = " ".join(px(b, c) for pair in zip(steps, ((p.bytes, p.cost) for p in frontier)) for b, c in pair)
    dots = "".join(
        f'<circle cx="{px(b, c).split(",")[0]}" cy="{px(b, c).split(",")[1]}" r="4" fill="#1f77b4"/>' for _, b, c in rows
    )
    text = 'font-family="sans-serif" font-size="12"'
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
        f'<rect width="{w}" height="{h}" fill="white"/>'
        f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>'
        f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>'
        f'<polyline points="{line}" fill="none" stroke="#999" stroke-width="1.5"/>{dots}'
        f'<text x="{w / 2}" y="{m / 2}" text-anchor="middle" {text}>{title}</text>'
        f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle" {text}>saved MiB ({x0 / 2**20:.2f} to {x1 / 2**20:.2f})</text>'
        f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" text-anchor="middle" {text}>'
        f"recompute ({y0:.3g} to {y1:.3g})</text></svg>\n"
    )


# --------------------------------------------------------------------------------------------
# Measured peak memory (the benchmarks' measure; the tests' measure_peak is built on it)
# --------------------------------------------------------------------------------------------


def allocated_peak(fn) -> int:
    """Peak bytes the CPU allocator holds during ``fn()`` beyond what it held before: every
    allocation and free ``torch.profiler`` records (``profile_memory=True``), summed in the order
    they happened. The profiler's per-op totals (``self_cpu_memory_usage``) would not do: they put
    a free made inside an op but outside its children (Python code in an autograd Function's
    backward deleting a value) at the op's start, hiding the backward's peak."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == _CPU]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


_CPU = torch._C._autograd.DeviceType.CPU
