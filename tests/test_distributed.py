"""Training with fxtools' graphs under torch.distributed (DDP, FSDP2), on two processes.

One launch of two processes (gloo, loopback only) runs every case; each rank writes what it
found to a JSON file and the test reads both. Every case trains a float64 GPT (the test suite's
``examples.gpt("tiny")``) for 5 AdamW steps and compares every parameter's gradient (of the
first step) and every parameter after the 5 steps with the same run in eager DDP or FSDP2, at
1e-10, and checks that fxtools' forward graphs ran at every step. Sharded gradients and
parameters are compared whole (``DTensor.full_tensor()``). Each rank also measures the
activations fxtools' graphs save under FSDP2 against one process (two policies, with and without
``torch.utils.checkpoint`` blocks), checks the errors for what fxtools refuses (hooks that
would run twice, an in-place collective in a differentiated program), and trains a MeanFlow loss
(``torch.func.jvp`` of the model inside the loss) under DDP and FSDP2 in both wrapping orders.

Memory budgets (``policy=fxtools.policies.budget(b)``) train the same way under DDP and FSDP2: at
each budget of ``BUDGETS`` and for three wrapping orders, the gradients and parameters equal eager
DDP's / FSDP2's at 1e-10 (float64: recomputation runs the same ops on the same values, so the
answer is the same to the last bit or nearly); the split that ran saved at most the budget, saved
what it declares, chose what one process chooses at that budget, and below 1.0 it recomputes
something and saves less than ``save_all``.

Run ``python tests/test_distributed.py`` to launch the workers by hand and print their results.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn

TIMEOUT = 420  # seconds for the whole launch: a hang fails the test instead of blocking CI
STEPS = 5
TOL = dict(rtol=1e-10, atol=1e-10)

# wrapping order -> the eager run it must equal
CASES = {
    "ddp(fxtools.compile(model))": "ddp",
    "fxtools.compile(ddp(model))": "ddp",
    "ddp(torch.compile(model, backend))": "ddp",
    "torch.compile(ddp(model), backend)": "ddp",
    "fully_shard(fxtools.compile(model))": "fsdp",
    "fully_shard(fxtools.compile(block)) per block": "fsdp",
    "fxtools.compile(fully_shard(model))": "fsdp",
    "fxtools.compile(model with fully_shard blocks)": "fsdp",
    "fully_shard(torch.compile(model, backend))": "fsdp",
    "fully_shard(torch.compile(block, backend)) per block": "fsdp",
    "torch.compile(fully_shard(model), backend)": "fsdp",
}

# memory budgets: the wrapping orders they are run under, and the budgets (fractions of save_all's bytes)
BUDGET_WRAPPINGS = (
    "ddp(fxtools.compile(model))",
    "fully_shard(fxtools.compile(model))",
    "fxtools.compile(model with fully_shard blocks)",
)
BUDGETS = (1.0, 0.2, 0.05)


def budget_case(wrapping: str, b: float) -> str:
    return f"{wrapping}, budget({b})"


CASES.update({budget_case(w, b): CASES[w] for w in BUDGET_WRAPPINGS for b in BUDGETS})


# --------------------------------------------------------------------------------------------
# the worker (runs in each of the two processes)
# --------------------------------------------------------------------------------------------


class Probe:
    """Counts the forward runs of fxtools' graphs (and the graphs run) while active, and measures
    the bytes of the activations the last run saved for the backward (each storage once, the
    inputs' excluded). It watches ``_Runner.run_forward``, which every ``fxtools.compile`` and
    ``fxtools.backend`` graph runs through, so the graphs run as without it (no compiler)."""

    def __init__(self):
        self.runners: set[int] = set()
        self.splits: dict[int, object] = {}  # the splits whose forward ran, by runner
        self.runs = self.saved_bytes = 0

    @property
    def graphs(self) -> int:
        return len(self.runners)

    def __enter__(self):
        from fxtools.training.backend import _Runner

        self._original = original = _Runner.run_forward
        probe = self

        def run_forward(runner, leaves):
            outs, saved = original(runner, leaves)
            probe.runners.add(id(runner))
            probe.splits[id(runner)] = runner.split
            probe.runs += 1
            inputs = {x.untyped_storage().data_ptr() for x in leaves if isinstance(x, torch.Tensor)}
            seen, total = set(), 0
            for t in saved:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs and ptr not in seen:
                    seen.add(ptr)
                    total += t.untyped_storage().nbytes()
            probe.saved_bytes = total
            return outs, saved

        _Runner.run_forward = run_forward
        return self

    def __exit__(self, *exc):
        from fxtools.training.backend import _Runner

        _Runner.run_forward = self._original


class Checkpointed(nn.Module):
    """``block`` run under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        import torch.utils.checkpoint as cp

        return cp.checkpoint(self.block, x, use_reentrant=False)


def _memory_cases(shard_blocks, model_and_batch) -> dict:
    """Saved activation bytes of fxtools' graphs in one process and under FSDP2 (this rank), for
    two policies, with and without checkpointed blocks: declared (``Split.saved_bytes``) and
    measured (what a training step's forward saved)."""
    import fxtools

    out = {}
    for policy in ("save_all", "recompute_cheap"):
        for checkpointed in (False, True):
            row = {}
            for where in ("one process", "fsdp2"):
                model, inputs = model_and_batch()
                if checkpointed:
                    for i, block in enumerate(model.transformer.h):
                        model.transformer.h[i] = Checkpointed(block)
                target = shard_blocks(model, lambda b: b) if where == "fsdp2" else model
                compiled = fxtools.compile(target, *inputs, policy=policy)
                with Probe() as probe:
                    compiled(*inputs).backward()
                row[where] = {"declared": compiled.split.saved_bytes, "measured": probe.saved_bytes}
            out[f"{policy}{', checkpointed blocks' if checkpointed else ''}"] = row
    return out


def _budget_choices(probe: Probe) -> list[dict] | None:
    """What each split that ran under a budget chose: its saved bytes (declared, and measured at
    the last forward when one graph ran), estimated recompute, the budget and save_all's bytes."""
    rows = []
    for sp in probe.splits.values():
        choice = sp.budget_choice
        if choice is None:
            return None
        rows.append(
            {
                "saved": sp.saved_bytes,
                "measured": probe.saved_bytes if probe.graphs == 1 else None,
                "recompute": sp.recompute_cost,
                "limit": choice.limit,
                "save_all": choice.save_all_bytes,
            }
        )
    return rows


JVP_WRAPPINGS = (
    "ddp(fxtools.compile(loss))",
    "fxtools.compile(ddp(loss))",
    "fully_shard(fxtools.compile(loss))",
    "fxtools.compile(fully_shard(loss))",
)


class _MeanFlow(nn.Module):
    """A MeanFlow loss (issue 34): ``torch.func.jvp`` of a small time-conditioned MLP inside the loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))

    def velocity(self, z, r, t):
        return self.net(torch.cat([z, r[:, None], t[:, None]], -1))

    def forward(self, z, r, t, v):
        u, dudt = torch.func.jvp(self.velocity, (z, r, t), (v, torch.zeros_like(r), torch.ones_like(t)))
        target = (v - (t - r)[:, None] * dudt).detach()
        return (u - target).pow(2).mean()


def _jvp_loss_cases(rank: int, train, names_of) -> dict:
    """The MeanFlow loss trained for STEPS AdamW steps under each of ``JVP_WRAPPINGS``, against eager
    DDP / FSDP2 (gradients of the first step, parameters after the steps, at 1e-10)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fxtools

    def model_and_batch():
        torch.manual_seed(0)
        model = _MeanFlow()
        g = torch.Generator().manual_seed(10 + rank)
        r, t = torch.rand(4, generator=g), torch.rand(4, generator=g)
        return model, (torch.randn(4, 4, generator=g), r, t, torch.randn(4, 4, generator=g))

    reference = {}
    for kind, wrap in (("ddp", DDP), ("fsdp", fully_shard)):
        model, inputs = model_and_batch()
        reference[kind] = train(wrap(model), names_of(model), inputs)
    out = {}
    for case in JVP_WRAPPINGS:
        try:
            model, inputs = model_and_batch()
            wrapper = DDP if "ddp" in case else fully_shard
            trained = wrapper(fxtools.compile(model)) if case.startswith(("ddp", "fully")) else fxtools.compile(wrapper(model))
            grads, params, _ = train(trained, names_of(model), inputs)
            want_grads, want_params, _ = reference["ddp" if "ddp" in case else "fsdp"]
            errors = []
            for what, got, want in (("gradient", grads, want_grads), ("parameter", params, want_params)):
                for name in want:
                    try:
                        torch.testing.assert_close(got.get(name), want[name], **TOL)
                    except (AssertionError, TypeError) as e:
                        errors.append(f"{what} {name}: {str(e).splitlines()[-1]}")
            out[case] = errors
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[case] = [f"{type(e).__name__}: {e}"]
    return out


def _worker(out_dir: str) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fxtools
    from fxtools.cli import examples

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT - 60))
    rank = dist.get_rank()
    results: dict = {}

    def model_and_batch():
        model, _ = examples.gpt("tiny", seed=0)  # the same parameters on every rank
        _, inputs = examples.gpt("tiny", seed=10 + rank)  # each rank its own batch
        return model, inputs

    def hidden(model, inputs):
        """An example of what a block takes."""
        b, t = inputs[0].shape
        return torch.randn(b, t, model.config.n_embd, requires_grad=True)

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def train(model, params_of, inputs):
        """Gradients of the first step, parameters after STEPS AdamW steps (whole tensors)."""
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        grads, losses = None, []
        for step in range(STEPS):
            opt.zero_grad()
            loss = model(*inputs)
            loss.backward()
            if step == 0:
                grads = {n: whole(p.grad) for n, p in params_of().items()}
            opt.step()
            losses.append(loss.item())
        return grads, {n: whole(p.detach()) for n, p in params_of().items()}, losses

    def shard_blocks(model, make_block=lambda b: b):
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = fully_shard(make_block(block))
        return fully_shard(model)

    def build(case, model, inputs):
        """The module to train for ``case`` (``"<wrapping>, budget(b)"``: that wrapping, policy ``budget(b)``)."""
        backend = fxtools.backend()
        compile = fxtools.compile
        if ", budget(" in case:
            case, b = case.split(", budget(")
            compile = functools.partial(fxtools.compile, policy=fxtools.policies.budget(float(b.rstrip(")"))))
        if case == "ddp(fxtools.compile(model))":
            return DDP(compile(model, *inputs))
        if case == "fxtools.compile(ddp(model))":
            return compile(DDP(model), *inputs)
        if case == "ddp(torch.compile(model, backend))":
            return DDP(torch.compile(model, backend=backend))
        if case == "torch.compile(ddp(model), backend)":
            return torch.compile(DDP(model), backend=backend)
        if case == "fully_shard(fxtools.compile(model))":
            return fully_shard(compile(model, *inputs))
        if case == "fully_shard(fxtools.compile(block)) per block":
            h = hidden(model, inputs)
            return shard_blocks(model, lambda b: compile(b, h))
        if case == "fxtools.compile(fully_shard(model))":
            return compile(fully_shard(model), *inputs)
        if case == "fxtools.compile(model with fully_shard blocks)":
            return compile(shard_blocks(model), *inputs)
        if case == "fully_shard(torch.compile(model, backend))":
            return fully_shard(torch.compile(model, backend=backend))
        if case == "fully_shard(torch.compile(block, backend)) per block":
            return shard_blocks(model, lambda b: torch.compile(b, backend=backend))
        if case == "torch.compile(fully_shard(model), backend)":
            return torch.compile(shard_blocks(model), backend=backend)
        raise KeyError(case)

    def names_of(model):
        """The parameters by their names in the model itself (without the names of compiled modules' wrappers)."""
        return lambda: {n.replace("._orig_mod.", ".").replace(".module.", "."): p for n, p in model.named_parameters()}

    reference = {}
    model, inputs = model_and_batch()
    reference["ddp"] = train(DDP(model), names_of(model), inputs)
    model, inputs = model_and_batch()
    reference["fsdp"] = train(shard_blocks(model), names_of(model), inputs)
    only = os.environ.get("FXTOOLS_DIST_ONLY")
    for case, ref in CASES.items():
        if only and case not in only.split(";"):
            continue
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            model, inputs = model_and_batch()
            trained = build(case, model, inputs)
            with Probe() as probe:
                grads, params, losses = train(trained, names_of(model), inputs)
            want_grads, want_params, want_losses = reference[ref]
            errors = []
            if sorted(grads) != sorted(want_grads):
                errors.append(f"parameters {sorted(grads)} != {sorted(want_grads)}")
            for what, got, want in (("gradient", grads, want_grads), ("parameter after 5 steps", params, want_params)):
                for name in want:
                    if name not in got or got[name] is None:
                        errors.append(f"{what} {name}: missing")
                        continue
                    try:
                        torch.testing.assert_close(got[name], want[name], **TOL)
                    except AssertionError as e:
                        errors.append(f"{what} {name}: {str(e).splitlines()[-1]}")
            if probe.runs < STEPS:
                errors.append(f"fxtools' forward graphs ran {probe.runs} times in {STEPS} steps")
            results[case] = {
                "errors": errors,
                "losses": losses,
                "graphs": probe.graphs,
                "runs": probe.runs,
                "seconds": round(time.perf_counter() - start, 2),
                "budget": _budget_choices(probe),
            }
        except Exception as e:  # noqa: BLE001 - reported to the test
            import traceback

            results[case] = {"errors": [f"{type(e).__name__}: {e}", traceback.format_exc()[-3000:]], "seconds": None}
    results["memory"] = _memory_cases(shard_blocks, model_and_batch)
    results["jvp loss"] = _jvp_loss_cases(rank, train, names_of)
    results["refused"] = {}
    for case in ("a hook on the model in DDP", "a hook on a sharded block", "an in-place collective in the model"):
        model, inputs = model_and_batch()
        try:
            if case == "a hook on the model in DDP":
                model.register_forward_pre_hook(lambda module, args: None)
                fxtools.compile(DDP(model), *inputs)
            elif case == "an in-place collective in the model":

                def loss(w, x):
                    y = x @ w
                    dist.all_reduce(y)
                    return y.sum()

                fxtools.grad(loss, torch.randn(3, 3), torch.randn(2, 3))
            else:
                model.transformer.h[1].register_forward_hook(lambda module, args, out: None)
                fxtools.compile(shard_blocks(model), *inputs)
            results["refused"][case] = "not refused"
        except fxtools.FxtoolsError as e:
            results["refused"][case] = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# the launch
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out_dir: str, world_size: int = 2, extra_env: dict | None = None, script: str = __file__) -> list[dict]:
    """Run ``script --worker out_dir`` (this file's ``_worker``) in ``world_size`` processes; their
    results, or an AssertionError with their output if one fails or they take longer than TIMEOUT seconds."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world_size),
        "GLOO_SOCKET_IFNAME": "lo0" if sys.platform == "darwin" else "lo",  # loopback only
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    procs = []
    for rank in range(world_size):
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
        cmd = [sys.executable, script, "--worker", out_dir]
        procs.append(
            (subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=log, stderr=log), log)
        )
    deadline = time.monotonic() + TIMEOUT
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    outputs = [open(os.path.join(out_dir, f"rank{r}.log")).read() for r in range(world_size)]
    failed = [(r, p.returncode) for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        raise AssertionError(f"workers failed or timed out after {TIMEOUT} s: {failed}\n" + "\n".join(o[-3000:] for o in outputs))
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world_size)]


@functools.cache
def _run() -> list[dict]:
    """One launch for the whole file (each test reads its part of the results)."""
    with tempfile.TemporaryDirectory() as out_dir:
        return launch(out_dir)


def _case_errors(ranks: list[dict], cases) -> list[str]:
    problems = []
    for case in cases:
        for rank, results in enumerate(ranks):
            got = results.get(case)
            if got is None:
                problems.append(f"{case} (rank {rank}): not run")
            elif got["errors"]:
                problems.append(f"{case} (rank {rank}):\n  " + "\n  ".join(e[:3000] for e in got["errors"][:6]))
    return problems


def test_ddp_and_fsdp2_gradients_adamw_steps_and_saved_activations_equal_eager():
    """Every wrapping order trains as eager DDP / FSDP2 does; under FSDP2 each rank's graphs save
    the activations one process would (policies and checkpointed blocks alike)."""
    ranks = _run()
    problems = _case_errors(ranks, [c for c in CASES if ", budget(" not in c])
    for rank, results in enumerate(ranks):
        for case, message in results["refused"].items():
            if case == "an in-place collective in the model":
                expected = ["c10d::allreduce_", "dist.all_reduce(y)", "functional collectives"]
            else:
                expected = ["hooks of its own", "fully_shard(fxtools.compile(m))"]
            if not all(e in message for e in expected):
                problems.append(f"{case} (rank {rank}): {message}")
        memory = results["memory"]
        for variant, row in memory.items():
            if row["fsdp2"] != row["one process"]:
                problems.append(
                    f"saved activations, {variant} (rank {rank}): FSDP2 {row['fsdp2']} != one process {row['one process']}"
                )
        for policy in ("save_all", "recompute_cheap"):
            plain, ckpt = memory[policy]["one process"], memory[f"{policy}, checkpointed blocks"]["one process"]
            if not ckpt["measured"] < plain["measured"]:
                problems.append(f"{policy} (rank {rank}): checkpointed blocks save {ckpt} bytes, not fewer than {plain}")
    assert not problems, "\n".join(problems)


def test_budgets_under_ddp_and_fsdp2_train_as_eager_within_their_bytes():
    """At every budget, under DDP and FSDP2 (whole model, sharded blocks): eager's gradients and
    parameters after 5 AdamW steps; the split saved at most the budget and what it declares, chose
    what the same budget chooses under the other wrappings, and below 1.0 recomputed something and
    saved less than save_all; a smaller budget never saves more nor recomputes less."""
    ranks = _run()
    problems = _case_errors(ranks, [budget_case(w, b) for w in BUDGET_WRAPPINGS for b in BUDGETS])
    if problems:
        raise AssertionError("\n".join(problems))
    for rank, results in enumerate(ranks):
        chosen: dict = {}
        for wrapping in BUDGET_WRAPPINGS:
            last = None
            for b in BUDGETS:  # descending
                rows = results[budget_case(wrapping, b)]["budget"]
                where = f"{wrapping}, budget({b}), rank {rank}"
                assert rows and len(rows) == 1, f"{where}: splits that ran: {rows}"
                (row,) = rows
                assert row["saved"] == row["measured"] <= row["limit"], f"{where}: {row}"
                assert 0 <= b * row["save_all"] - row["limit"] < 1, f"{where}: {row}"
                if b < 1.0:
                    assert row["recompute"] > 0 and row["saved"] < row["save_all"], f"{where}: nothing recomputed: {row}"
                if last is not None:
                    assert row["saved"] <= last["saved"] and row["recompute"] >= last["recompute"], f"{where}: {row} after {last}"
                last = row
                chosen.setdefault(b, {})[wrapping] = (row["saved"], row["recompute"])
        for b, by_wrapping in chosen.items():
            assert len(set(by_wrapping.values())) == 1, f"budget({b}), rank {rank}: choices differ: {by_wrapping}"


def test_meanflow_jvp_loss_under_ddp_and_fsdp2_trains_as_eager():
    """A loss taking torch.func.jvp of the model (MeanFlow) under DDP and FSDP2, both wrapping
    orders: eager's gradients and parameters after 5 AdamW steps (float64, 1e-10)."""
    problems = [
        f"{case} (rank {rank}): {errors}" for rank, res in enumerate(_run()) for case, errors in res["jvp loss"].items() if errors
    ]
    assert len(_run()[0]["jvp loss"]) == len(JVP_WRAPPINGS)
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        start = time.perf_counter()
        for rank, res in enumerate(_run()):
            for case, r in res.items():
                if case in ("refused", "jvp loss"):
                    print(f"rank {rank} {case}: {r}")
                elif case == "memory":
                    for variant, row in r.items():
                        print(f"rank {rank} saved activations, {variant}: {row}")
                else:
                    status = "ok" if not r["errors"] else r["errors"][:3]
                    print(f"rank {rank} {case}: {r['seconds']} s, {r.get('graphs')} graphs run {r.get('runs')} times, {status}")
        print(f"{time.perf_counter() - start:.1f} s")
