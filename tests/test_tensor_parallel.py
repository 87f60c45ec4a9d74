"""Tensor parallel (DTensor) and 2-D (FSDP2 x tensor parallel) training through fxtools.

Two launches (gloo, loopback only; ``test_distributed.launch``), each running every case of its
world size; each rank writes what it found to a JSON file and the tests read them all:

- 2 processes, a 1-D mesh: an MLP with ``ColwiseParallel`` up-projection and ``RowwiseParallel``
  down-projection, causal SDPA attention without biases (Colwise q/k/v, Rowwise o, two heads
  per rank), a residual block with ``SequenceParallel`` LayerNorm and ``Colwise/RowwiseParallel``
  over a sequence shard, the ``loss_parallel()`` cross-entropy, and an MLP whose output a
  ``PrepareModuleOutput`` plan gathers, each through ``fxtools.compile`` and
  ``torch.compile(backend=fxtools.backend())``; a double backward (``create_graph=True``) through
  the MLP, then the gradient's dot product with a direction differentiated, equal to the unsharded
  model's gradient and Hessian-vector product; what fxtools refuses (a ``Partial("max")``
  placement, ``fxtools.grad`` of a DTensor) with the error naming it.
- 4 processes, a (2, 2) mesh ("dp", "tp"): two residual blocks (LayerNorm, Colwise/Rowwise MLP),
  ``fully_shard`` over "dp" (blocks, then the root), through both paths; blocks compiled then
  sharded; ``policies.budget(0.5)``.

Every case trains 5 AdamW steps in float64 and compares every parameter's gradient (of the first
step, whole: ``DTensor.full_tensor()``) and every parameter after the 5 steps with an unsharded
copy trained in eager on the whole batch, at 1e-10, checks the gradients' placements are exactly
those eager tensor parallel gives (``Partial`` where eager leaves a pending sum), and that
fxtools' forward graphs ran at every step. The MLP's generated forward names its all-reduce after
the mesh dimension (``loss_all_reduce_tp``), and its backward communicates nothing, as eager's;
the ``loss_parallel()`` graphs move eager's bytes too.

Run ``python tests/test_tensor_parallel.py`` to launch the workers by hand and print their results.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn
from test_distributed import TIMEOUT, Probe, launch

STEPS = 5
TOL = dict(rtol=1e-10, atol=1e-10)


class MLP(nn.Module):
    def __init__(self, d=6, h=8):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x, y):
        return ((self.down(torch.relu(self.up(x))) - y) ** 2).mean()


class NoGradScaledMLP(MLP):
    """The MLP's loss divided by a scale computed under ``torch.no_grad()``: a constant of the
    gradient (traced below autograd with DTensors, the block was once differentiated)."""

    def forward(self, x, y):
        h = self.down(torch.relu(self.up(x)))
        with torch.no_grad():
            scale = h.pow(2).mean() + 1
        return ((h - y) ** 2).mean() / scale


class Block(nn.Module):
    def __init__(self, d=6, h=8):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(self.norm(h))))


class Blocks(nn.Module):
    """Residual blocks and a squared error summed over the rank's batch (or sequence) shard and
    divided by the whole batch's size: the ranks' losses add up to the unsharded model's mean."""

    def __init__(self, n=2, total=1):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(n)])
        self.total = total

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return ((x - y) ** 2).sum() / self.total


class Attention(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention``, projections without bias,
    heads viewed from the local width (``-1``: the rank's heads under Colwise/Rowwise)."""

    def __init__(self, d=8, heads=4):
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, y):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return ((self.o(a.transpose(1, 2).reshape(b, s, -1)) - y) ** 2).mean()


def _seeded(make):
    torch.manual_seed(0)
    return make()


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, params, inputs, context=contextlib.nullcontext):
    """Gradients (whole) and their placements after the first step, parameters after STEPS AdamW
    steps; each step's forward and backward inside ``context()``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = placements = None
    for step in range(STEPS):
        opt.zero_grad()
        with context():
            model(*inputs).backward()
        if step == 0:
            grads = {n: _whole(p.grad) for n, p in params.items()}
            placements = {n: [str(q) for q in getattr(p.grad, "placements", ())] for n, p in params.items()}
        opt.step()
    return grads, placements, {n: _whole(p.detach()) for n, p in params.items()}


def _compare(got, want, want_placements, probe) -> list[str]:
    errors = []
    grads, placements, params = got
    for what, g, w in (("gradient", grads, want[0]), ("parameter after 5 steps", params, want[2])):
        for name in w:
            try:
                torch.testing.assert_close(g[name], w[name], **TOL)
            except (AssertionError, KeyError) as e:
                errors.append(f"{what} {name}: {str(e).splitlines()[-1]}")
    if placements != want_placements:
        errors.append(f"gradient placements {placements} != eager's {want_placements}")
    if probe.runs < STEPS:
        errors.append(f"fxtools' forward graphs ran {probe.runs} times in {STEPS} steps")
    return errors


def _run_case(results, name, build, reference, inputs, eager_placements, context=contextlib.nullcontext):
    """Train ``build()`` (a model and its parameters by name) and record its differences with ``reference``."""
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        trained, params = build()
        with Probe() as probe:
            got = _train(trained, params, inputs, context)
        results[name] = {"errors": _compare(got, reference, eager_placements, probe), "runs": probe.runs}
    except Exception as e:  # noqa: BLE001 - reported to the test
        import traceback

        results[name] = {"errors": [f"{type(e).__name__}: {e}", traceback.format_exc()[-3000:]]}
    results[name]["seconds"] = round(time.perf_counter() - start, 2)


def _paths():
    import fxtools

    return {"fxtools.compile": lambda m, inputs: fxtools.compile(m, *inputs), "backend": _backend}


def _backend(model, inputs):
    import fxtools

    return torch.compile(model, backend=fxtools.backend())


def _parallelized(make, mesh, plan):
    """A function making ``make()`` (seeded) parallelized by ``plan`` over ``mesh``, and its parameters by name."""
    from torch.distributed.tensor.parallel import parallelize_module

    def sharded():
        model = parallelize_module(_seeded(make), mesh, plan)
        return model, dict(model.named_parameters())

    return sharded


def _cases(results, label, sharded, unsharded, whole, local, context=contextlib.nullcontext):
    """Train ``sharded()`` (a model and its parameters by name, on this rank's ``local`` inputs)
    through each fxtools path, each step inside ``context()``, against ``unsharded()`` trained in
    eager on the ``whole`` inputs and the placements of ``sharded()``'s gradients in eager; the
    reference and eager's placements, for further cases."""
    ref = unsharded()
    reference = _train(ref, dict(ref.named_parameters()), whole)
    eager_model, eager_params = sharded()
    eager_placements = _train(eager_model, eager_params, local, context)[1]
    for path, make in _paths().items():

        def build(make=make):
            model, params = sharded()
            with context():
                return make(model, local), params

        _run_case(results, f"{label}, {path}", build, reference, local, eager_placements, context)
    return reference, eager_placements


def _tp_cases(rank, mesh) -> dict:
    """The 2-process cases (module docstring)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    results: dict = {}
    torch.manual_seed(1)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    tp_mlp = _parallelized(MLP, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    _cases(results, "Colwise/Rowwise MLP", tp_mlp, lambda: _seeded(MLP), (x, y), (x, y))
    tp_scaled = _parallelized(NoGradScaledMLP, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    _cases(results, "MLP with a no_grad scale", tp_scaled, lambda: _seeded(NoGradScaledMLP), (x, y), (x, y))

    # sequence parallel: each rank holds a shard of the sequence (dimension 1)
    torch.manual_seed(2)
    xs, ys = torch.randn(2, 4, 6), torch.randn(2, 4, 6)
    shard = (xs.chunk(2, dim=1)[rank], ys.chunk(2, dim=1)[rank])
    sp_plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }

    def sp_blocks():
        model = _seeded(lambda: Blocks(n=1, total=xs.numel()))
        for block in model.blocks:
            parallelize_module(block, mesh, sp_plan)
        return model, dict(model.named_parameters())

    _cases(results, "SequenceParallel block", sp_blocks, lambda: _seeded(lambda: Blocks(n=1, total=xs.numel())), (xs, ys), shard)

    # attention: Colwise q/k/v and Rowwise o, two heads per rank; the CPU flash-attention op's
    # decomposition must keep its layout (the Rowwise linear views its transposed output as rows)
    torch.manual_seed(6)
    xa, ya = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    attn_plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    _cases(results, "SDPA attention", _parallelized(Attention, mesh, attn_plan), lambda: _seeded(Attention), (xa, ya), (xa, ya))
    _loss_parallel_cases(results, mesh)
    _prepare_output_cases(results, mesh)
    results["code"] = _code(tp_mlp, (x, y))
    results["refused"] = _refusals(mesh, tp_mlp)
    _double_backward_cases(results, mesh, tp_mlp, (x, y))
    return results


class Head(nn.Module):
    """A projection to logits and their cross-entropy."""

    def __init__(self, d=6, v=8):
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.head = nn.Linear(d, v)

    def forward(self, x, t):
        return nn.functional.cross_entropy(self.head(torch.tanh(self.inner(x))), t)


def _loss_parallel_cases(results, mesh):
    """``loss_parallel()``: the cross-entropy of logits sharded over the vocabulary."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, loss_parallel

    torch.manual_seed(3)
    x, t = torch.randn(4, 6), torch.randint(0, 8, (4,))
    plan = {
        "inner": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=True),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }

    sharded = _parallelized(Head, mesh, plan)
    _cases(results, "loss_parallel cross-entropy", sharded, lambda: _seeded(Head), (x, t), (x, t), loss_parallel)
    results["loss_parallel bytes"] = _code(sharded, (x, t), loss_parallel)["bytes"]


class Inner(nn.Module):
    def __init__(self, d=6, h=8):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Outer(nn.Module):
    """An MLP inside a module whose output a plan prepares (``PrepareModuleOutput``)."""

    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x, y):
        return ((self.inner(x) - y) ** 2).mean()


def _prepare_output_cases(results, mesh):
    """``PrepareModuleOutput``: the down-projection's output left sharded over columns (a
    reduce-scatter of the partial sums), gathered whole by its parent's output plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel

    torch.manual_seed(4)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    plan = {
        "inner.up": ColwiseParallel(),
        "inner.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "inner": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
    }

    _cases(results, "PrepareModuleOutput", _parallelized(Outer, mesh, plan), lambda: _seeded(Outer), (x, y), (x, y))


def _code(sharded, inputs, context=contextlib.nullcontext) -> dict:
    """The generated forward and backward of ``sharded()``'s model, and the bytes their collectives move."""
    import fxtools

    model, _ = sharded()
    with context():
        sp = fxtools.compile(model, *inputs).split
    return {"forward": sp.forward.code, "backward": sp.backward.code, "bytes": sp.communicated_bytes}


def _refusals(mesh, tp_mlp) -> dict:
    from torch.distributed.tensor import DTensor, Partial

    import fxtools

    out = {}

    def partial_max(t):
        return DTensor.from_local(t, mesh, [Partial("max")]).full_tensor().sum()

    for case, run in (
        ("Partial('max')", lambda: fxtools.compile(partial_max, torch.randn(3, requires_grad=True))),
        ("fxtools.grad", lambda: fxtools.grad(lambda w: w.sum(), tp_mlp()[1]["up.weight"])),
    ):
        try:
            run()
            out[case] = "not refused"
        except fxtools.FxtoolsError as e:
            out[case] = str(e)
    return out


def _hvp(model, params, inputs, vs):
    """The gradient (``create_graph=True``) and the Hessian of ``model(*inputs)`` times ``vs`` (by
    parameter name), each whole."""
    names = list(params)
    grads = torch.autograd.grad(model(*inputs), [params[n] for n in names], create_graph=True)
    dot = sum((g * vs[n]).sum() for g, n in zip(grads, names))
    hvps = torch.autograd.grad(dot, [params[n] for n in names])
    return {n: _whole(g) for n, g in zip(names, grads)}, {n: _whole(h) for n, h in zip(names, hvps)}


def _double_backward_cases(results, mesh, tp_mlp, inputs):
    """A backward with ``create_graph=True`` through the Colwise/Rowwise MLP (both paths), then a
    backward of the gradients' dot product with a direction: equal to the unsharded model's
    gradient and Hessian-vector product."""
    from torch.distributed.tensor import distribute_tensor

    ref = _seeded(MLP)
    torch.manual_seed(5)
    vs = {n: torch.randn_like(p) for n, p in ref.named_parameters()}
    want = _hvp(ref, dict(ref.named_parameters()), inputs, vs)
    for path, make in _paths().items():
        errors = []
        try:
            model, params = tp_mlp()
            directions = {n: distribute_tensor(vs[n], mesh, p.placements) for n, p in params.items()}
            got = _hvp(make(model, inputs), params, inputs, directions)
            for what, g, w in zip(("gradient", "Hessian-vector product"), got, want):
                for name in w:
                    try:
                        torch.testing.assert_close(g[name], w[name], **TOL)
                    except AssertionError as e:
                        errors.append(f"{what} {name}: {str(e).splitlines()[-1]}")
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(f"{type(e).__name__}: {e}")
        results[f"double backward, Colwise/Rowwise MLP, {path}"] = {"errors": errors}


def _two_d_cases(rank, mesh) -> dict:
    """The 4-process cases: FSDP2 over "dp" x tensor parallel over "tp"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fxtools

    results: dict = {}
    torch.manual_seed(1)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    dp = mesh["dp"].get_local_rank()
    batch = (x.chunk(2)[dp], y.chunk(2)[dp])

    def two_d(make_block=lambda b: b):  # each dp rank's loss is its batch's mean; FSDP2 averages over "dp"
        model = _seeded(lambda: Blocks(n=2, total=batch[0].numel()))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        for i, block in enumerate(model.blocks):
            model.blocks[i] = fully_shard(make_block(block), mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, {n.replace(".module.", "."): p for n, p in model.named_parameters()}

    unsharded = lambda: _seeded(lambda: Blocks(n=2, total=x.numel()))  # noqa: E731
    reference, eager_placements = _cases(results, "FSDP2 x TP blocks", two_d, unsharded, (x, y), batch)

    def per_block():  # the other wrapping order: each block compiled, then sharded
        return two_d(lambda b: fxtools.compile(b, batch[0]))

    def budget():
        model, params = two_d()
        return fxtools.compile(model, *batch, policy=fxtools.policies.budget(0.5)), params

    _run_case(results, "fully_shard(fxtools.compile(TP block)) per block", per_block, reference, batch, eager_placements)
    _run_case(results, "FSDP2 x TP blocks, fxtools.compile, budget(0.5)", budget, reference, batch, eager_placements)
    return results


def _worker(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT - 60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 2:
        results = _tp_cases(rank, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    else:
        results = _two_d_cases(rank, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@functools.cache
def _run(world_size: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        return launch(out_dir, world_size, script=__file__)


def _problems(ranks: list[dict]) -> list[str]:
    problems = []
    for rank, results in enumerate(ranks):
        for case, got in results.items():
            if isinstance(got, dict) and "errors" in got and got["errors"]:
                problems.append(f"{case} (rank {rank}):\n  " + "\n  ".join(e[:3000] for e in got["errors"][:6]))
    return problems


def test_tensor_parallel_trains_as_unsharded_eager_and_refuses_what_it_cannot():
    """2 processes: Colwise/Rowwise MLP, SDPA attention, a SequenceParallel block, loss_parallel and
    PrepareModuleOutput, through fxtools.compile and the backend, equal to the unsharded model in
    eager with eager's gradient placements; the MLP's and loss_parallel's collectives move eager's
    bytes, the MLP's named after the mesh dimension; a double backward through the MLP equal to
    the unsharded model's Hessian-vector product; a ``Partial("max")`` placement and a DTensor
    argument of ``fxtools.grad`` refused naming them."""
    ranks = _run(2)
    problems = _problems(ranks)
    for rank, results in enumerate(ranks):
        for case in (
            "Colwise/Rowwise MLP, fxtools.compile",
            "SequenceParallel block, backend",
            "SDPA attention, fxtools.compile",
        ):
            if case not in results:
                problems.append(f"{case} (rank {rank}): not run")
        code = results["code"]
        # the forward all-reduces the down-projection's partial sums over "tp", named so; the
        # backward communicates nothing, as eager's (the down-projection's bias gradient is
        # the same on every rank: no all-reduce)
        if "loss_all_reduce_tp = torch.ops._c10d_functional.all_reduce" not in code["forward"]:
            problems.append(f"rank {rank}: no all_reduce named after 'tp' in the forward:\n{code['forward']}")
        if code["bytes"] != {"forward": 4 * 6 * 8, "backward": 0}:
            problems.append(f"rank {rank}: collectives move {code['bytes']} (eager: 192 B forward, 0 backward)")
        # as eager's loss_parallel(): 96 B forward (the logsumexp's maximum and sum, the target's
        # logit: 4 rows each), 192 B backward (the tanh's gradient), counted with bench_tp.CountBytes
        if results["loss_parallel bytes"] != {"forward": 96, "backward": 192}:
            problems.append(f"rank {rank}: loss_parallel() collectives move {results['loss_parallel bytes']}")
        refused = results["refused"]
        message = refused["Partial('max')"]
        if "P(max)" not in message or "DTensor.from_local(t, mesh" not in message:
            problems.append(f"rank {rank}: Partial('max'): {message}")
        for case in ("double backward, Colwise/Rowwise MLP, fxtools.compile", "double backward, Colwise/Rowwise MLP, backend"):
            if case not in results:
                problems.append(f"{case} (rank {rank}): not run")
        if "argument w is a DTensor" not in refused["fxtools.grad"]:
            problems.append(f"rank {rank}: fxtools.grad of a DTensor: {refused['fxtools.grad']}")
    assert not problems, "\n".join(problems)


def test_replicated_values_are_those_computed_alike_on_every_rank():
    """One process: which traced values ``capture/replicated.py`` takes as the same on every rank
    of a group (an all-reduce's result and what is computed from it and constants; an asserted
    value), and which not (an argument, a reduce-scatter's part, a random draw, another group's
    all-reduce, a constant written into in place). Taking a differing value as replicated would be a wrong gradient."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxtools.capture.replicated import assert_replicated, replicated

    c10d = torch.ops._c10d_functional
    seen = {}

    def f(x, y, z):
        r = c10d.wait_tensor(c10d.all_reduce(x, "sum", "g"))
        a = torch.relu(r) * 2 + torch.ones(3)
        assert_replicated(z, ["g"])
        c = z * a
        part = c10d.wait_tensor(c10d.reduce_scatter_tensor(c, "sum", 1, "g"))
        h = c10d.wait_tensor(c10d.all_reduce(y, "sum", "h"))
        written = torch.zeros(3)
        view = written.view(3)  # traced before the write: it reads the zeros' node
        written.add_(y)  # changed after it was made, by a value that differs
        values = {"r": r, "a": a, "a + y": a + y, "c": c, "part": part, "a + rand": torch.rand(3) + a, "x": x, "h": h}
        values["view of written"] = view
        seen.update({k: replicated(v, "g") for k, v in values.items()})
        seen.update({"r over h": replicated(r, "h"), "h over h": replicated(h, "h")})
        return c, part, h

    make_fx(f, tracing_mode="fake")(torch.randn(3), torch.randn(3), torch.randn(3))
    want = {"r": True, "a": True, "a + y": False, "c": True, "part": False, "a + rand": False, "x": False, "h": False}
    want["view of written"] = False
    assert seen == {**want, "r over h": False, "h over h": True}


def test_fsdp2_by_tensor_parallel_on_a_2d_mesh_trains_as_unsharded_eager():
    """4 processes, a (2, 2) mesh: FSDP2 over "dp" x Colwise/Rowwise over "tp", both paths, both
    wrapping orders (shard the TP model then compile; compile each TP block then shard it), and
    a memory budget."""
    ranks = _run(4)
    problems = _problems(ranks)
    for rank, results in enumerate(ranks):
        if len(results) != 4:
            problems.append(f"rank {rank}: cases run: {sorted(results)}")
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        for world in (2, 4):
            start = time.perf_counter()
            for rank, res in enumerate(_run(world)):
                for case, r in res.items():
                    print(f"{world} processes, rank {rank} {case}: {r}")
            print(f"{world} processes: {time.perf_counter() - start:.1f} s")
