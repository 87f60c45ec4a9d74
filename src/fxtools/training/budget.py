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
  memory). Views, items of multi-output ops and constants cost nothing.
- **the solver.** For a weight ``w``, minimising ``bytes + w * cost`` is one minimum cut
  (``save`` edges carry bytes, ``recompute`` edges carry cost). Sweeping ``w`` (bisection on the
  slopes) gives every point of the lower convex hull of the bytes/recompute frontier, exactly;
  the cuts are nested, so along the hull saved bytes grow as recompute falls. A byte budget takes
  the hull point with the most bytes that fit. That point is optimal whenever the budget falls on
  a hull point; between two hull points ``(b0, c0)`` and ``(b1, c1)`` with ``b0 <= B < b1`` its
  cost ``c0`` exceeds the optimum by at most ``c0 - c1``, and the optimum is at least the
  Lagrangian bound ``c0 - (B - b0) (c0 - c1) / (b1 - b0)`` (``Choice.lower_bound``, in the report).
- **monotone by construction.** The hull points are ordered (bytes up, cost down) and a budget
  picks the last that fits: a smaller budget never saves more bytes and never recomputes less.
- **infeasible budgets.** Below the hull's first point (every recomputable value recomputed)
  no split fits: ``FxtoolsError`` says the minimum, in bytes and as a fraction.

The predicted peak memory (``predicted_peak``) is liveness over the two graphs: the inputs and
the forward's outputs are held by the caller, every other value lives from the op that makes it
to its last use (views share their base's storage), saved values until their last use in the
backward. ``budget(peak=p)`` takes, among the hull points, the cheapest whose predicted peak fits.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import flop_counter

from ..errors import FxtoolsError
from . import policies


@dataclass(frozen=True)
class Point:
    """One saved set: its saved bytes (beyond the inputs), estimated recompute cost and the nodes."""

    bytes: int
    cost: int
    saved: frozenset = field(compare=False, repr=False)
    recomputed: frozenset = field(compare=False, repr=False)


@dataclass
class Choice:
    """What a budget chose, for ``Split.report``."""

    limit: int | None  # the budget in bytes (None for a peak budget)
    peak_limit: int | None
    point: Point
    lower_bound: float | None  # no saved set within the budget recomputes less than this (byte budgets)
    save_all_bytes: int
    frontier: list[Point]


# --------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------


def _flops(node: fx.Node) -> int:
    """FLOPs ``torch.utils.flop_counter`` counts for running ``node`` once on its fake values."""
    from .partition import fake_mode_of

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    vals = [v for v in fx.node.map_aggregate((args, kwargs), lambda v: v) if isinstance(v, torch.Tensor)]
    target = node.target
    if not vals or not callable(target):
        return 0
    counter = flop_counter.FlopCounterMode(display=False)
    try:
        with fake_mode_of(vals), counter:
            target(*args, **kwargs)
    except Exception:  # an op fake mode cannot run here (a higher-order op's bodies): count its elements only
        return 0
    flops = counter.get_total_flops()
    if not flops and "scaled_dot_product" in str(node.target) and len(args) >= 3:
        flops = flop_counter.sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
    return int(flops)


def _elements(val) -> int:
    vals = val if isinstance(val, (tuple, list)) else [val]
    total = 0
    for v in vals:
        if isinstance(v, torch.Tensor):
            try:
                total += math.prod(int(s) for s in v.shape)
            except (TypeError, ValueError, RuntimeError):  # a data-dependent size
                total += 1
    return total


def recompute_cost(node: fx.Node) -> int:
    """Estimated cost of computing ``node`` again: FLOPs (flop_counter) plus one per output element."""
    if node.op != "call_function" or policies.is_view(node) or policies.is_factory(node):
        return 0
    if node.target is operator.getitem:
        return 0
    return _flops(node) + _elements(node.meta.get("val"))


# --------------------------------------------------------------------------------------------
# The min-cut family
# --------------------------------------------------------------------------------------------


class Problem:
    """The save/recompute choice of a ``_Partition`` as a family of minimum cuts."""

    def __init__(self, part):
        from .partition import _storage_root, nbytes

        self.part = part
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
            view = _storage_root(n) is not n
            self.must_save[n] = forced == policies.SAVE and n.target is not operator.getitem
            self.can_save[n] = n.op == "placeholder" or (tensor and not view and forced != policies.RECOMPUTE)
            self.size[n] = 0 if n.op == "placeholder" else max(nbytes(n.meta.get("val")), 1)
            self.cost[n] = 0 if n.op == "placeholder" else recompute_cost(n)
        self.total_bytes = sum(self.size.values())
        self.total_cost = sum(self.cost.values())

    def solve(self, wb: int, wc: int) -> Point:
        """The saved set minimising ``wb * bytes + wc * cost`` (ties: the least recomputed)."""
        from .partition import _max_flow_min_cut

        inf = (wb * self.total_bytes + wc * self.total_cost + 1) * 4
        source, sink = 2 * len(self.cand), 2 * len(self.cand) + 1
        edges = []
        for n, i in self.index.items():
            edges.append((2 * i, 2 * i + 1, wb * self.size[n] if self.can_save[n] else inf))
            edges.append((source, 2 * i, inf if self.must_save[n] else wc * self.cost[n]))
            for a in n.all_input_nodes:
                if a in self.index:
                    edges.append((2 * self.index[a] + 1, 2 * i, inf))
        for n in self.part.needed:
            if n in self.index:
                edges.append((2 * self.index[n] + 1, sink, inf))
        reach = _max_flow_min_cut(2 * len(self.cand) + 2, edges, source, sink, inf=inf)
        saved = frozenset(n for n, i in self.index.items() if 2 * i not in reach and 2 * i + 1 in reach)
        recomputed = frozenset(n for n, i in self.index.items() if 2 * i in reach)
        return Point(self.saved_bytes(saved), sum(self.cost[n] for n in recomputed), saved, recomputed)

    def saved_bytes(self, saved) -> int:
        """Bytes of the storages ``saved`` holds beyond the inputs (each storage once), as ``Split.saved_bytes``."""
        from .partition import _storage_root, nbytes

        roots = {}
        for s in saved:
            r = _storage_root(s)
            if r.op != "placeholder":
                roots[r] = max(roots.get(r, 0), nbytes(r.meta.get("val")), nbytes(s.meta.get("val")))
        return sum(roots.values())

    def frontier(self) -> list[Point]:
        """Every point of the lower convex hull of (bytes, recompute cost), bytes ascending."""
        if not hasattr(self, "_frontier"):
            least_bytes = self.solve(self.total_cost + 1, 1)
            least_cost = self.solve(1, self.total_bytes + 1)
            inner = self._between(least_bytes, least_cost) if least_cost.bytes > least_bytes.bytes else []
            points = [least_bytes, *inner, least_cost]
            self._frontier = [p for k, p in enumerate(points) if k == 0 or p.bytes > points[k - 1].bytes]
        return self._frontier

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


# --------------------------------------------------------------------------------------------
# Choosing a point
# --------------------------------------------------------------------------------------------


def limit_bytes(spec, save_all_bytes: int) -> int:
    """The budget in bytes: a fraction of ``save_all``'s bytes, or bytes."""
    if isinstance(spec, float):
        return math.floor(spec * save_all_bytes + 1e-9)
    return int(spec)


def choose_bytes(points: list[Point], limit: int, save_all_bytes: int) -> tuple[Point, float]:
    """The hull point with the most bytes within ``limit``, and the Lagrangian lower bound."""
    fits = [k for k, p in enumerate(points) if p.bytes <= limit]
    if not fits:
        least = points[0].bytes
        frac = least / save_all_bytes if save_all_bytes else float("inf")
        raise FxtoolsError(
            f"fxtools.policies.budget: {limit:,} bytes is below the least any split can save, {least:,} bytes "
            f"({frac:.3f} of save_all's {save_all_bytes:,}) with everything recomputable recomputed "
            "(random ops and side effects are always saved). Raise the budget to at least that."
        )
    k = fits[-1]
    p = points[k]
    if k + 1 == len(points):
        return p, float(p.cost)
    q = points[k + 1]
    return p, p.cost - (limit - p.bytes) * (p.cost - q.cost) / (q.bytes - p.bytes)


def choose_peak(points: list[Point], peaks: list[int], limit: int) -> Point:
    """The cheapest hull point whose predicted peak fits ``limit``."""
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


def liveness_peak(order, start, held) -> int:
    """Peak bytes while running ``order`` (nodes): ``start`` values exist before, ``held`` values
    (and their storages) are never freed; every other storage is freed after its last use."""
    from .partition import _storage_root, nbytes

    root = {}
    last = {}
    for i, n in enumerate(order):
        for a in (n, *n.all_input_nodes):
            r = root.setdefault(a, _storage_root(a))
            last[r] = i
    held_roots = {_storage_root(h) for h in held if isinstance(h, fx.Node)}
    live, size = 0, {}

    def touch(v):
        nonlocal live
        r = root.setdefault(v, _storage_root(v))
        if r not in size:
            size[r] = max(nbytes(r.meta.get("val")), nbytes(v.meta.get("val")))
            live += size[r]

    for v in start:
        touch(v)
    for r in list(size):  # start values nothing reads are freed on entry
        if r not in last and r not in held_roots:
            live -= size.pop(r)
    peak = live
    frees: dict[int, list] = {}
    for r, i in last.items():
        if r not in held_roots:
            frees.setdefault(i, []).append(r)
    for i, n in enumerate(order):
        if isinstance(n.meta.get("val"), torch.Tensor):
            touch(n)
        peak = max(peak, live)
        for r in frees.get(i, ()):
            live -= size.pop(r, 0)
    return peak


def predicted_peak(part, saved, recomputed) -> int:
    """Peak bytes of running the forward, then the backward (``backward_boxed``), on ``part``."""
    from .partition import backward_nodes, forward_nodes

    primals = list(part.primals)
    outs = [o for o in part.fw_outs if isinstance(o, fx.Node)]
    fw = forward_nodes(part, saved)
    fw_peak = liveness_peak(fw, primals, [*primals, *outs, *saved])
    bw = backward_nodes(part, saved, recomputed)
    grads = [g for g in part.grads if isinstance(g, fx.Node)]
    bw_peak = liveness_peak(bw, [*primals, *outs, *saved, *part.cts], [*primals, *outs, *grads])
    return max(fw_peak, bw_peak)


# --------------------------------------------------------------------------------------------
# Drawing the frontier
# --------------------------------------------------------------------------------------------


def draw_frontier(rows, hull: list[Point], path, title: str = "") -> None:
    """Draw saved bytes (x) against recompute cost (y): one marker per budget in ``rows``
    (``(budget, bytes, cost)``) and the hull as a line. ``.png`` needs matplotlib (the ``bench``
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
            f.write(_svg(rows, hull, title))
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p.bytes / 2**20 for p in hull], [p.cost for p in hull], "-", color="0.6", label="convex hull")
    ax.plot([r[1] / 2**20 for r in rows], [r[2] for r in rows], "o", label="budget(b)")
    ax.set_xlabel("saved MiB")
    ax.set_ylabel("estimated recompute (FLOPs + elements)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _svg(rows, hull: list[Point], title: str) -> str:
    """A small SVG line chart: hull as a polyline, budgets as dots, axes labelled with their ranges."""
    w, h, m = 520, 340, 60
    xs = [p.bytes for p in hull] + [r[1] for r in rows]
    ys = [p.cost for p in hull] + [r[2] for r in rows]
    x0, x1 = min(xs), max(xs) or 1
    y0, y1 = min(ys), max(ys) or 1

    def px(x, y):
        fx_ = m + (w - 2 * m) * ((x - x0) / (x1 - x0) if x1 > x0 else 0.5)
        fy_ = h - m - (h - 2 * m) * ((y - y0) / (y1 - y0) if y1 > y0 else 0.5)
        return f"{fx_:.1f},{fy_:.1f}"

    line = " ".join(px(p.bytes, p.cost) for p in hull)
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
