"""policies.budget: the least recompute within a memory budget (float64, against autograd).

Every budget of a sweep must give autograd's gradients, save at most its bytes, and the sweep must
be monotone; the min-cut solver is checked against exhaustive enumeration on small programs, and the
predicted peak against the CPU allocator's.
"""

import io
import itertools
import operator
import random

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from measure import measure_peak
from torch._higher_order_ops.scan import scan

import fxtools
from fxtools.cli import examples
from fxtools.errors import FxtoolsError
from fxtools.graph import meta
from fxtools.training import budget, policies
from fxtools.training.cuts import backward_nodes, forward_nodes

TOL = dict(rtol=1e-9, atol=1e-9)
FRACTIONS = (0.02, 0.3, 1.0)


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


def _mlp(seed, depth, width, batch=4, dtype=torch.float64):
    """A seeded random MLP: each layer a matmul, a bias and one of several activations."""
    rng = random.Random(seed)
    acts = [rng.choice(["tanh", "sin", "gelu", "norm", "sigmoid"]) for _ in range(depth)]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=g, dtype=dtype)
    ws = [torch.randn(width, width, generator=g, dtype=dtype) / width**0.5 for _ in range(depth)]
    bs = [torch.randn(width, generator=g, dtype=dtype) for _ in range(depth)]

    def f(x, ws, bs):
        h = x
        for w, b, act in zip(ws, bs, acts):
            h = h @ w + b
            h = F.layer_norm(h, h.shape[-1:]) if act == "norm" else getattr(torch, act, None)(h) if act != "gelu" else F.gelu(h)
        return (h * h).sum()

    return f, (x, ws, bs)


def _scanned():
    g = torch.Generator().manual_seed(3)
    a0, xs, w = torch.randn(4, 4, generator=g), torch.randn(6, 4, 4, generator=g) * 0.1, torch.randn(4, 4, generator=g)

    def f(a0, xs, w):
        def step(a, x):
            a = torch.cos(torch.sin(a + x) @ w) @ w
            return a, a.sum()

        last, ys = scan(step, a0, xs)
        return torch.tanh(last).sum() + (ys**2).sum()

    return f, (a0, xs, w)


def _checkpointed():
    g = torch.Generator().manual_seed(4)
    a, w1, w2 = torch.randn(5, 6, generator=g), torch.randn(6, 6, generator=g), torch.randn(6, 6, generator=g)

    def region(h, w):
        return torch.sin(h @ w).exp() @ w

    def f(a, w1, w2):
        h = cp.checkpoint(region, a, w1, use_reentrant=False)
        h = torch.tanh(h @ w2)
        h = cp.checkpoint(region, h, w2, use_reentrant=False)
        return (h.sigmoid() * a).sum()

    return f, (a, w1, w2)


MODELS = {
    "mlp3": lambda: _mlp(0, 3, 6),
    "mlp6": lambda: _mlp(1, 6, 10, batch=7),
    "scan": _scanned,
    "checkpoint": _checkpointed,
}


def _autograd(f, args):
    """Autograd's gradients for every floating-point tensor leaf of ``args``."""
    leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in torch.utils._pytree.tree_leaves(args)]
    rebuilt = torch.utils._pytree.tree_unflatten(leaves, torch.utils._pytree.tree_structure(args))
    return torch.autograd.grad(f(*rebuilt), [a for a in leaves if a.requires_grad])


def _check_grads(sp, f, args):
    _, grads = sp.vjp(*args)
    got = [g for g in torch.utils._pytree.tree_leaves(grads) if g is not None]
    for g, r in zip(got, _autograd(f, args), strict=True):
        torch.testing.assert_close(g, r, **TOL)


# --------------------------------------------------------------------------------------------
# gradients, bytes and monotonicity at every budget
# --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("name", list(MODELS))
def test_every_budget_gives_exact_gradients_within_its_bytes(name):
    f, args = MODELS[name]()
    least = None
    last = (-1, float("inf"))
    for b in FRACTIONS if name != "scan" else (0.3,):  # a scan's capture is slow
        try:
            sp = fxtools.split(f, *args, policy=policies.budget(b))
        except FxtoolsError as e:
            assert "below the least any split can save" in str(e)
            continue
        choice = sp.budget_choice
        least = choice.frontier[0].bytes
        assert sp.saved_bytes == choice.point.bytes <= choice.limit
        assert sp.recompute_cost == choice.point.cost
        assert choice.lower_bound <= choice.point.cost
        # monotone: more budget never saves less nor recomputes more
        assert sp.saved_bytes >= last[0] and sp.recompute_cost <= last[1]
        last = (sp.saved_bytes, sp.recompute_cost)
        _check_grads(sp, f, args)
        text = sp.report(file=io.StringIO())
        assert f"chose {sp.saved_bytes:,} B" in text and "predicted peak" in text
    assert least is not None
    if name == "scan":  # a scan's capture is slow: one budget is enough
        return
    sp = fxtools.split(f, *args, policy=policies.budget(least))  # the least is reachable, in bytes
    assert sp.saved_bytes == least
    _check_grads(sp, f, args)
    if least > 0:
        with pytest.raises(FxtoolsError, match=f"the least any split can save, {least:,} bytes"):
            fxtools.split(f, *args, policy=policies.budget(least - 1))


@pytest.mark.usefixtures("float64")
def test_checkpoint_regions_stay_recomputed_at_every_budget():
    f, args = _checkpointed()
    for b in (0.05, 1.0):
        try:
            sp = fxtools.split(f, *args, policy=policies.budget(b))
        except FxtoolsError:
            continue
        regions = {n for n in sp._partition.nodes if policies.checkpoint_region(n) is not None}
        inside = regions - sp._partition.region_outputs
        assert not inside & set(sp._partition.saved)


@pytest.mark.usefixtures("float64")
def test_random_ops_are_saved_never_recomputed():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)

    def f(x, w):
        h = F.dropout(torch.sin(x @ w), p=0.5, training=True)
        return (torch.tanh(h @ w) ** 2).sum()

    for b in (0.01, 0.5, 1.0):
        try:
            sp = fxtools.split(f, x, w, policy=policies.budget(b))
        except FxtoolsError:
            continue
        assert not any(policies.is_random(n) for n in sp.backward.graph.nodes)
        torch.manual_seed(0)
        _, grads = sp.vjp(x, w)
        torch.manual_seed(0)
        for got, want in zip(grads, _autograd(f, (x, w))):
            torch.testing.assert_close(got, want, **TOL)


@pytest.mark.usefixtures("float64")
def test_sweep_is_monotone_and_each_split_is_what_the_frontier_says():
    f, args = examples.example("gpt", n_layer=2, n_embd=16, n_head=2, batch=2)
    sp = fxtools.split(f, *args, policy=policies.budget(1.0))
    rows = sp.frontier([k / 40 for k in range(1, 41)])
    assert len(rows) > 5
    for (b0, s0, c0), (b1, s1, c1) in itertools.pairwise(rows):
        assert b0 < b1 and s0 <= s1 and c0 >= c1
    assert all(s <= b for b, s, _ in rows)
    assert len({s for _, s, _ in rows}) > 3  # the sweep really moves
    for limit, saved, cost in (rows[len(rows) // 4],):
        one = fxtools.split(f, *args, policy=policies.budget(limit))
        assert (one.saved_bytes, one.recompute_cost) == (saved, cost)
        _check_grads(one, f, args)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize(("seed", "depth"), [(10, 2), (11, 2), (14, 3), (17, 2)])
def test_min_cut_frontier_against_enumeration(seed, depth):
    """On programs small enough to enumerate every saved set: the hull's points are optimal
    for their bytes, every budget's choice is at least the true optimum's cost and at most
    the Lagrangian bound's gap above it."""
    f, args = _mlp(seed, depth, 3)
    sp = fxtools.split(f, *args, policy="save_all")
    everything = budget.Problem(sp._partition, exact_limit=16).exact_points()
    cuts = budget.Problem(sp._partition, exact_limit=0)
    assert everything and cuts.frontier() and cuts.method == "hull"
    best = {}
    for p in everything:
        best[p.bytes] = min(best.get(p.bytes, p.cost), p.cost)
    truth = [budget.Point(b, c, frozenset(), frozenset()) for b, c in sorted(best.items())]
    truth = [p for k, p in enumerate(truth) if all(p.cost < q.cost for q in truth[:k])]
    for p in cuts.frontier():  # each point is optimal for its own bytes
        assert p.cost == min(c for b, c in best.items() if b <= p.bytes)
    for limit in sorted({p.bytes for p in truth} | {p.bytes + 7 for p in truth}):
        opt, _ = budget.choose_bytes(truth, None, limit, 1)
        got, bound = budget.choose_bytes(cuts.frontier(), cuts.hull(), limit, 1)
        assert bound - 1e-6 <= opt.cost <= got.cost and got.bytes <= limit
    between = {(q.bytes, q.cost) for q in cuts.between()}  # off the hull: real saved sets, cheaper than its points
    assert all(best[b] <= c < min(p.cost for p in cuts.frontier() if p.bytes <= b) for b, c in between)
    assert {b for b, _ in between} <= {level for level, _, _ in cuts.byte_table()}
    if seed in (11, 17):  # these have some
        assert between


# --------------------------------------------------------------------------------------------
# peak memory
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["save_all", "recompute_cheap", policies.budget(0.3), policies.budget(1.0)])
def test_predicted_peak_matches_the_allocator(policy):
    """Within 2% plus the generated code's slack for small values (``pycode.SLACK_BYTES``)."""
    from fxtools.codegen.pycode import SLACK_BYTES

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512), torch.nn.Linear(512, 256), torch.nn.Tanh()
    )
    x = torch.randn(64, 256)
    sp = fxtools.split(model, x, policy=policy)
    predicted = sp.predicted_peak
    measured = measure_peak(sp, dict(model.named_parameters()), x)
    assert abs(measured - predicted) <= 0.02 * predicted + SLACK_BYTES, (predicted, measured)


@pytest.mark.usefixtures("float64")
def test_peak_budget_fits_and_is_monotone():
    f, args = _mlp(2, 4, 12, batch=16)
    sp = fxtools.split(f, *args, policy="save_all")
    problem = budget.Problem(sp._partition)
    peaks = sorted({peak for _, peak in problem.peak_candidates()})
    last = float("inf")
    for peak in (peaks[0], peaks[-1]):
        one = fxtools.split(f, *args, policy=policies.budget(peak=peak))
        assert one.predicted_peak <= peak and one.recompute_cost <= last
        last = one.recompute_cost
        _check_grads(one, f, args)
    with pytest.raises(FxtoolsError, match="no split's predicted peak fits"):
        fxtools.split(f, *args, policy=policies.budget(peak=peaks[0] - 1))


PEAK_MODELS = {
    "mlp": lambda: _mlp(5, 6, 12, batch=16),
    "gpt": lambda: examples.example("gpt", n_layer=2, n_embd=16, n_head=2, batch=2),
    "cnn": lambda: examples.example("cnn", batch=2, width=4),
}


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("fused", [False, True], ids=["own", "fused"])
@pytest.mark.parametrize("name", list(PEAK_MODELS))
def test_byte_budget_peak_falls_with_the_budget(name, fused):
    """A smaller byte budget never has a higher predicted peak than a larger one (nor saves
    more, nor recomputes less), over a 40-point sweep; the splits at a few budgets are what the
    sweep says and give autograd's gradients exactly, recomputing twice where that is chosen.
    Planned for a fusing compiler (``fused``, Inductor's), the peak is at most
    ``FUSED_PEAK_SLACK`` above every larger budget's, and nothing is recomputed twice that such a
    compiler computes in the first computation's kernel (``effective_forget``)."""
    f, args = PEAK_MODELS[name]()
    part = fxtools.split(f, *args, policy="save_all")._partition
    # fused: the splits below reuse this solve (``problem_of``; shared solves choose as fresh ones,
    # test_splits_of_one_program_share_its_solve_and_choose_as_a_fresh_one), for the test's time
    problem = budget.problem_of(part, fused=True) if fused else budget.Problem(part)
    slack = budget.FUSED_PEAK_SLACK if fused else 0.0
    table = problem.byte_table()
    save_all_bytes = table[-1][0]
    assert [b for b, _, _ in table] == sorted(b for b, _, _ in table)
    assert all(p.bytes <= b for b, p, _ in table)
    for (b0, p0, k0), (_, p1, _) in itertools.pairwise(table):  # levels ascending: everything rises together
        assert p0.bytes <= p1.bytes and p0.cost >= p1.cost
        above = min(k for b, _, k in table if b > b0)  # the slack does not compound: every larger level
        assert k0 <= (1 + slack) * above or b0 in problem.unreached  # unreached: the least peak found (see byte_table)
    assert all(b < 0.1 * save_all_bytes for b in problem.unreached)  # the tiny GPT: 0 of 90,136
    if fused:
        assert all(budget.effective_forget(p.forget, problem.fusible) == p.forget for _, p, _ in table)
    least = problem.frontier()[0]
    once = budget.predicted_peak(problem.part, least.saved, least.recomputed)
    assert table[0][2] <= min(once, table[-1][2])
    last = None
    for b in (0.02, 0.25, 1.0) if fused else (0.02, 0.1, 0.25, 0.5, 1.0):
        try:
            sp = fxtools.split(f, *args, policy=policies.budget(b, fused=fused))
        except FxtoolsError as e:
            assert "below the least any split can save" in str(e)
            continue
        choice = sp.budget_choice
        point, peak = problem.byte_choice(choice.limit)
        assert (sp.saved_bytes, sp.recompute_cost, sp.predicted_peak) == (point.bytes, point.cost, peak)
        assert sp.saved_bytes <= choice.limit and choice.lower_bound <= sp.recompute_cost
        if last is not None:
            assert (1 + slack) * sp.predicted_peak >= last.predicted_peak or last.saved_bytes in problem.unreached
            assert sp.saved_bytes >= last.saved_bytes
            assert sp.recompute_cost <= last.recompute_cost
        last = sp
        _check_grads(sp, f, args)
    assert last is not None


@pytest.mark.usefixtures("float64")
def test_byte_budget_recomputes_twice_where_once_peaks_higher():
    """On the chain, a byte budget takes a split recomputing twice where the frontier's point
    within its bytes, recomputing once, peaks above a larger budget's choice: its predicted and
    measured peaks are at most every larger budget's, its gradients exact."""
    from fxtools.codegen.pycode import SLACK_BYTES

    model, x = _chain(torch.float64, 256)
    problem = budget.Problem(fxtools.split(model, x, policy="save_all")._partition)
    table = problem.byte_table()
    level, point, peak = [row for row in table if row[1].forget][-1]
    below = [p for p in problem.frontier() if p.bytes <= level][-1]
    once = budget.predicted_peak(problem.part, below.saved, below.recomputed)
    larger = min(pk for b, _, pk in table if b > level)
    assert peak <= larger < once  # recomputing once would have broken the monotone peak
    sp = fxtools.split(model, x, policy=policies.budget(level))
    assert sp._partition.forget and sp.predicted_peak == peak and sp.saved_bytes <= level
    measured = measure_peak(sp, dict(model.named_parameters()), x)
    assert abs(measured - peak) <= 0.02 * peak + SLACK_BYTES, (peak, measured)
    _, grads = sp.vjp(dict(model.named_parameters()), x)
    want = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    for got, ref in zip(grads[0].values(), want, strict=True):
        torch.testing.assert_close(got, ref, **TOL)


def _chain(dtype, batch):
    """Four MLP blocks (64 -> 512 -> 64): with nothing saved, the backward's first gradient needs the
    whole chain recomputed, and recomputing each value once keeps every block's hidden values
    until that block's gradient."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64), nn.Tanh())]
    return nn.Sequential(*layers).to(dtype), torch.randn(batch, 64, dtype=dtype)


def test_recomputing_twice_lowers_the_measured_peak():
    """With nothing saved, the backward recomputes the whole chain for the loss's gradient, and
    recomputing each value once keeps every block's hidden values until that block's gradient. A
    byte budget below every block's output recomputes values twice instead (``budget.refresh``):
    at the same saved bytes the allocator's peak is lower than recomputing once's, as predicted,
    for more recompute; the generated backward computes some values twice."""
    from fxtools.codegen.pycode import SLACK_BYTES

    model, x = _chain(torch.float32, 256)
    twice = fxtools.split(model, x, policy=policies.budget(0.01))
    once = fxtools.split(model, x, policy=lambda node: policies.RECOMPUTE)
    assert twice._partition.forget and not once._partition.forget
    assert twice.saved_bytes == once.saved_bytes == 0
    params = dict(model.named_parameters())
    measured = {s: measure_peak(s, params, x) for s in (twice, once)}
    for s in (twice, once):
        assert abs(measured[s] - s.predicted_peak) <= 0.02 * s.predicted_peak + SLACK_BYTES, (s.predicted_peak, measured[s])
    assert measured[twice] < 0.9 * measured[once], measured
    assert twice.recompute_cost > once.recompute_cost and twice.recompute_cost == twice.budget_choice.point.cost
    names = [n.target for n in twice.backward.graph.nodes if meta.PART.get(n) == "recompute"]
    assert len(names) > len(set(names))  # an op recomputed more than once


@pytest.mark.usefixtures("float64")
def test_recomputing_twice_gives_exact_gradients():
    """Nothing saved, values recomputed twice (the least byte budget on the chain): autograd's gradients."""
    model, x = _chain(torch.float64, 128)
    sp = fxtools.split(model, x, policy=policies.budget(0.01))
    assert sp._partition.forget and sp.saved_bytes == 0
    _, grads = sp.vjp(dict(model.named_parameters()), x)
    want = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    for got, ref in zip(grads[0].values(), want, strict=True):
        torch.testing.assert_close(got, ref, **TOL)


def test_cheapest_refresh_removes_peak_for_the_least_recompute():
    """``refresh(cost=)`` (``Problem.refresh_steps(point, "cheapest")``) lowers the peak in rounds
    like the other modes, and its first round removes peak for at most the recompute per byte of
    theirs: they take the first of the same trials that lowers the peak, it the cheapest per byte."""
    model, x = _chain(torch.float32, 256)
    problem = budget.Problem(fxtools.split(model, x, policy="save_all")._partition)
    part, point = problem.part, problem.frontier()[0]  # nothing saved

    def recompute(order):
        return sum(problem.cost.get(n, 0) for n in order if n not in part.bw)

    rates = {}
    for cost, singles in ((problem.cost, False), (None, False), (None, True)):
        steps = budget.refresh(part, point.saved, point.recomputed, trail=True, cost=cost, singles_first=singles)
        peaks, costs = [pk for _, _, pk in steps], [recompute(order) for _, order, _ in steps]
        assert len(steps) >= 2 and peaks == sorted(set(peaks), reverse=True) and costs == sorted(costs)
        rates[cost is not None, singles] = (costs[1] - costs[0]) / (peaks[0] - peaks[1])
    assert rates[True, False] <= min(rates.values()), rates
    cheapest = problem.refresh_steps(point, "cheapest")
    assert cheapest and all(pk < budget.predicted_peak(part, point.saved, point.recomputed) for _, pk in cheapest)


def test_the_searches_shortcuts_agree_with_the_plain_computations():
    """The budget's searches simulate thousands of orders, with shortcuts: peak-only liveness,
    the forward's order from lists computed once, predicted peaks kept per point. On every
    refresh step of every frontier point of the chain (orders holding nodes more than once),
    each gives what the plain computation gives."""
    model, x = _chain(torch.float32, 64)
    problem = budget.Problem(fxtools.split(model, x, policy="save_all")._partition)
    part, memo = problem.part, budget._Memo()
    start_end = budget._backward_ends
    checked = 0
    for point in problem.frontier():
        fw = forward_nodes(part, point.saved)
        assert fw == forward_nodes(part, point.saved, memo.inputs)
        outs = [o for o in part.fw_outs if isinstance(o, fx.Node)]
        start, held = start_end(part, point.saved)
        plain = max(
            budget.live_trace(fw, part.primals, [*part.primals, *outs, *point.saved]).peak,
            budget.live_trace(backward_nodes(part, point.saved, point.recomputed), start, held).peak,
        )
        assert budget.predicted_peak(part, point.saved, point.recomputed, memo) == plain
        assert budget.predicted_peak(part, set(point.saved), set(point.recomputed), memo) == plain
        for mode in budget.REFRESH_MODES:
            for p, _ in problem.refresh_steps(point, mode):
                order = backward_nodes(part, p.saved, p.recomputed, p.forget)
                start, held = start_end(part, p.saved)
                full = budget.live_trace(order, start, held)
                assert budget.liveness_peak(order, start, held, memo) == full.peak
                checked += len(order) > len(set(order))
    assert checked


def test_a_forgotten_value_forgets_what_it_is_made_of():
    """``refresh``'s forgets (``backward_nodes``): the backward's ``a * e``, with ``e = exp(a)``,
    meets ``a = sin(w)`` twice before computing it; forgetting ``w = 3 x`` once ``a`` is computed
    (``_with_inputs`` adds it where ``a`` is forgotten) still happens, and the later ``cos(w)``
    recomputes ``w``: it is in the order twice."""
    import types

    g = torch.fx.Graph()
    x = g.placeholder("x")
    w = g.call_function(torch.mul, (x, 3))
    a = g.call_function(torch.sin, (w,))
    e = g.call_function(torch.exp, (a,))
    ae = g.call_function(torch.mul, (a, e))
    cos = g.call_function(torch.cos, (w,))
    out = g.call_function(torch.mul, (ae, cos))
    part = types.SimpleNamespace(nodes=list(g.nodes), bw={ae, out}, cts=[], grads=[out])
    recomputed = {w, a, e, cos}
    assert budget._with_inputs({e: frozenset({a})}, recomputed, part.bw) == {e: frozenset({a}), a: frozenset({w})}
    order = backward_nodes(part, {x}, recomputed, {a: frozenset({w})})
    assert order.count(w) == 2 and order.count(a) == 1 and order[-1] is out
    assert backward_nodes(part, {x}, recomputed).count(w) == 1


def test_a_fusing_compiler_recomputes_twice_only_after_a_product():
    """``effective_forget``: under a compiler fusing by shared reads, a value recomputed a second
    time by pointwise ops from what is in memory is computed in its first computation's kernel,
    so its forget is dropped (``sin(x)``, and ``exp`` of it; ``cos(x @ w)`` with the product in
    memory); one recomputed after a matrix product forgotten too is computed late (``tanh(x @
    w)``, and the product), and kept."""
    import types

    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    s = g.call_function(torch.sin, (x,))
    e = g.call_function(torch.exp, (s,))
    mm = g.call_function(torch.ops.aten.mm.default, (x, w))
    t = g.call_function(torch.tanh, (mm,))
    kept = g.call_function(torch.cos, (mm,))
    g.output((e, t, kept))
    for n, v in zip([x, w, s, e, mm, t, kept], [torch.randn(3, 3)] * 7, strict=True):
        n.meta["val"] = v
    problem = types.SimpleNamespace(fusible={s, e, t, kept})  # Problem.fusible: no FLOPs
    forget = {t: frozenset({s, e}), kept: frozenset({mm, t})}
    assert budget.effective_forget(forget, problem.fusible) == {kept: frozenset({mm, t})}
    assert budget.effective_forget({t: frozenset({e})}, problem.fusible) == {}
    assert budget.effective_forget({w: frozenset({kept})}, problem.fusible) == {}
    both = {w: frozenset({kept}), t: frozenset({mm})}  # the product recomputed late: ``kept`` after it
    assert budget.effective_forget(both, problem.fusible) == both


def test_problem_knows_which_ops_a_compiler_fuses():
    """``Problem.fusible``: pointwise ops, norms and views, not the matrix products."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1))
    part = fxtools.split(model, torch.randn(4, 8), policy="save_all")._partition
    problem = budget.Problem(part, fused=True)
    products = {n for n in problem.cand if n.op == "call_function" and "linear" in str(n.target)}
    assert products and not products & problem.fusible
    assert any("gelu" in str(n.target) for n in problem.fusible) and any("layer_norm" in str(n.target) for n in problem.fusible)


def test_compile_plans_a_budget_for_inductors_fusion():
    """``fxtools.compile`` with Inductor as the backward's compiler plans a budget for it
    (``budget(b, fused=True)``); another compiler, or none, leaves the budget as given."""
    from torch._inductor.compile_fx import compile_fx_inner

    from fxtools.training.backend import Options

    b = policies.budget(0.3)
    assert Options(bw_compiler="inductor", policy=b).split_policy() == policies.budget(0.3, fused=True)
    assert Options(bw_compiler=compile_fx_inner, policy=b).split_policy().fused
    assert Options(fw_compiler="inductor", policy=b).split_policy() is b  # the forward's does not fuse the backward
    assert Options(bw_compiler=lambda gm: gm, policy=b).split_policy() is b
    assert Options(bw_compiler="inductor", policy="save_all").split_policy() == "save_all"
    assert repr(policies.budget(peak=5, fused=True)) == "budget(peak=5, fused=True)"


@pytest.mark.usefixtures("float64")
def test_a_budget_compiled_by_inductor_is_planned_for_it_and_exact():
    """With Inductor compiling the backward, the budget is planned for it (``fused``): nothing
    recomputed twice that Inductor would compute in one kernel, and the step's gradients are
    eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1))
    x = torch.randn(5, 6)
    compiled = fxtools.compile(model, x, policy=policies.budget(0.3), compiler="inductor")
    part = compiled.split._partition
    assert part.fused and compiled.split.budget_choice.limit <= 0.3 * fxtools.split(model, x, policy="save_all").saved_bytes
    assert budget.effective_forget(part.forget, budget.problem_of(part, fused=True).fusible) == part.forget
    assert compiled.split.saved_bytes <= compiled.split.budget_choice.limit
    compiled(x).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, **TOL)


class _NormMLP(nn.Module):
    """A residual product, then a pre-norm MLP: the layer norm's output is read by ``fc1`` and
    again by ``fc1``'s weight gradient, after the GELU's backward (the backward's peak); its
    input, recomputed by a product, is read by the norm's backward."""

    def __init__(self, d):
        super().__init__()
        self.proj, self.ln = nn.Linear(d, d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = x + self.proj(x)
        return h + self.fc2(F.gelu(self.fc1(self.ln(h))))


@pytest.mark.usefixtures("float64")
def test_recomputing_twice_forgets_a_layer_norms_output_with_its_result():
    """``native_layer_norm``'s output is held by its result until ``mean`` and ``rstd`` are taken
    (for the norm's own backward, after the peak): forgetting the output alone frees nothing.
    ``refresh`` forgets it together with the result: the backward's peak falls by the output's
    bytes for the norm's recompute, where forgetting it with everything it is made of
    recomputes a matrix product too. The byte budgets take such splits: the allocator's peak is
    the predicted one, the gradients autograd's."""
    from fxtools.codegen.pycode import SLACK_BYTES

    torch.manual_seed(0)
    model, x = nn.Sequential(_NormMLP(32), _NormMLP(32)), torch.randn(128, 32)
    problem = budget.Problem(fxtools.split(model, x, policy="save_all")._partition)
    point = problem.frontier()[0]  # nothing saved
    steps = [(point, budget.predicted_peak(problem.part, point.saved, point.recomputed))]
    for step in problem.refresh_steps(point, "cheapest"):
        steps.append(step)
        forgotten = {v for vs in step[0].forget.values() for v in vs}
        items = {v for v in forgotten if v.target is operator.getitem and v.args[0] in forgotten}
        if any(v.args[0].target is torch.ops.aten.native_layer_norm.default for v in items):
            break
    (before, high), (after, low) = steps[-2:]
    assert any(v.args[0].target is torch.ops.aten.native_layer_norm.default for v in items)  # reached
    assert torch.ops.aten.addmm.default not in {v.target for v in forgotten}  # no product recomputed twice
    assert high - low == budget.nbytes(next(iter(items)).meta["val"]) and after.cost - before.cost < 32 * 128 * 4

    def forgets_a_norm_with_its_result(forget):
        forgotten = {v for vs in forget.values() for v in vs}
        return any(v.target is operator.getitem and v.args[0] in forgotten for v in forgotten)

    levels = [(level, peak) for level, p, peak in problem.byte_table() if forgets_a_norm_with_its_result(p.forget)]
    assert levels  # the byte budgets take such splits
    level, peak = levels[-1]
    sp = fxtools.split(model, x, policy=policies.budget(level))
    assert sp.predicted_peak == peak and forgets_a_norm_with_its_result(sp._partition.forget)
    measured = measure_peak(sp, dict(model.named_parameters()), x)
    assert abs(measured - sp.predicted_peak) <= 0.02 * sp.predicted_peak + SLACK_BYTES, (sp.predicted_peak, measured)
    _, grads = sp.vjp(dict(model.named_parameters()), x)
    want = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    for got, ref in zip(grads[0].values(), want, strict=True):
        torch.testing.assert_close(got, ref, **TOL)


def test_recompute_cost_counts_the_flops_of_a_matrix_product():
    """The cost model: a matrix product costs ``2 m k n`` FLOPs (``flop_counter``) plus its ``m n``
    output elements, for any sizes; a sum costs its one output element."""
    for m, k, n in ((8, 16, 32), (3, 40, 5)):
        sp = fxtools.split(lambda a, b: (a @ b).sum(), torch.randn(m, k), torch.randn(k, n), policy="save_all")
        part = sp._partition
        fw = [node for node in part.nodes if node.op == "call_function" and node not in part.bw]
        product = next(node for node in fw if policies.is_dot(node))
        assert budget.recompute_cost(product) == 2 * m * k * n + m * n
        total = next(node for node in fw if node.target is torch.ops.aten.sum.default)
        assert budget.recompute_cost(total) == 1


# --------------------------------------------------------------------------------------------
# offload, the picture, arguments
# --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("float64")
def test_offload_is_a_per_value_choice():
    f, args = _mlp(3, 4, 8)

    def policy(node):
        return policies.OFFLOAD if policies.save_all(node) == policies.SAVE else policies.RECOMPUTE

    sp = fxtools.split(f, *args, policy=policy)
    off = [s for s in sp.saved if s.offload]
    assert off and {s.name for s in off} == {s.name for s in sp.saved if s.kind != "input"}
    assert sp.offloaded_bytes == sum(s.bytes for s in off) > 0
    assert not any(s.offload for s in fxtools.split(f, *args, policy="save_all").saved)
    text = sp.report(file=io.StringIO())
    assert f"({sp.offloaded_bytes:,} offloaded)" in text and text.count("(offload)") == len(off)
    assert "offload" in str(off[0])
    _check_grads(sp, f, args)
    with pytest.raises(ValueError, match=r"'save' or 'recompute' \(or 'offload'\)"):
        fxtools.split(f, *args, policy=lambda n: "keep")


@pytest.mark.usefixtures("float64")
def test_frontier_picture(tmp_path):
    f, args = _mlp(4, 4, 8)
    sp = fxtools.split(f, *args, policy=policies.budget(0.5))
    path = tmp_path / "frontier.svg"
    rows = sp.frontier(path=path)
    svg = path.read_text()
    assert svg.startswith("<svg") or "<svg" in svg[:400]
    assert len(rows) >= 10


def test_budget_arguments():
    for bad in (0.0, 1.5, -1):
        with pytest.raises(ValueError):
            policies.budget(bad)
    with pytest.raises(TypeError):
        policies.budget(True)
    with pytest.raises(ValueError):
        policies.budget()
    with pytest.raises(ValueError):
        policies.budget(0.5, peak=10)
    assert policies.budget(0.5) == policies.budget(0.5) and hash(policies.budget(3)) == hash(policies.budget(3))
    assert policies.describe(policies.budget(peak=5)) == "budget(peak=5)"


@pytest.mark.usefixtures("float64")
def test_compile_trains_with_a_budget():
    """``fxtools.compile`` takes a budget like any policy: gradients as eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    inputs = (torch.randn(5, 6),)
    compiled = fxtools.compile(model, *inputs, policy=policies.budget(0.3))
    compiled(*inputs).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(*inputs).sum().backward()
    for g, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, **TOL)


def test_liveness_keeps_an_item_until_the_multi_output_result_gives_its_last():
    """``native_layer_norm``'s output, used early, stays alive while its result is still to give
    ``rstd`` (the generated code holds the result until its last item is taken): liveness in the
    order where ``rstd`` is taken last counts it at the ``exp``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, b):
        out, _, rstd = torch.ops.aten.native_layer_norm(x, [256], w, b, 1e-5)
        return out.sin().exp() * rstd

    x, w, b = torch.randn(64, 256), torch.randn(256), torch.randn(256)
    gm = make_fx(f)(x, w, b)
    nodes = {n.name: n for n in gm.graph.nodes}
    ln = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.native_layer_norm.default)
    items = {n.args[1]: n for n in ln.users}
    sin, exp, mul = (
        next(n for n in gm.graph.nodes if n.target is t)
        for t in (torch.ops.aten.sin.default, torch.ops.aten.exp.default, torch.ops.aten.mul.Tensor)
    )
    placeholders = [n for n in nodes.values() if n.op == "placeholder"]
    order = [ln, items[0], sin, exp, items[2], mul]
    size = 64 * 256 * 4
    peak = budget.liveness_peak(order, placeholders, [*placeholders, mul])
    assert peak >= sum(budget.nbytes(p.meta["val"]) for p in placeholders) + 3 * size  # out, sin and exp together
    early = budget.liveness_peak([ln, items[0], items[2], sin, exp, mul], placeholders, [*placeholders, mul])
    assert early < peak  # taken early, the item is freed after its last use


# --------------------------------------------------------------------------------------------
# one solve per program
# --------------------------------------------------------------------------------------------


def _choice(sp):
    part = sp._partition
    graph = part.nodes[0].graph
    assert all(n.graph is graph for n in [*part.saved, *part.recomputed, *part.forget])  # moved onto this trace
    forget = sorted((k.name, sorted(v.name for v in vs)) for k, vs in part.forget.items())
    return sorted(n.name for n in part.saved), sorted(n.name for n in part.recomputed), forget, sp.recompute_cost


@pytest.mark.usefixtures("float64")
def test_splits_of_one_program_share_its_solve_and_choose_as_a_fresh_one(monkeypatch):
    """A second budget of the same program (same sizes) reuses the solved problem, moved onto the
    new trace's nodes: one ``Problem`` built for two splits, the second choosing what a fresh
    solve chooses, with exact gradients."""
    f, args = _mlp(3, 4, 6)
    budget._SOLVED.clear()
    built = []
    init = budget.Problem.__init__
    monkeypatch.setattr(budget.Problem, "__init__", lambda self, *a, **k: built.append(1) or init(self, *a, **k))
    shared = [fxtools.split(f, *args, policy=policies.budget(b)) for b in (1.0, 0.02)]
    assert len(built) == 1
    budget._SOLVED.clear()
    fresh = fxtools.split(f, *args, policy=policies.budget(0.02))
    assert _choice(shared[-1]) == _choice(fresh) and len(built) == 2
    _check_grads(shared[-1], f, args)


@pytest.mark.usefixtures("float64")
def test_program_key_tells_programs_apart():
    """Equal keys only for the same program: another size, dtype, constant or op is another key."""

    def key(scale, n=5, dtype=torch.float64, op=torch.tanh):
        def f(x, w):
            return (op(x @ w) * scale).sum()

        x, w = torch.randn(n, 4, dtype=dtype), torch.randn(4, 4, dtype=dtype)
        return budget.program_key(fxtools.split(f, x, w, policy="save_all")._partition)

    base = key(2.0)
    assert key(2.0) == base
    assert key(3.0) != base
    assert key(2) != base  # an int constant is not the float
    assert key(2.0, n=6) != base
    assert key(2.0, dtype=torch.float32) != base
    assert key(2.0, op=torch.sin) != base
