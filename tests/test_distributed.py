"""Training with fxtools' graphs under torch.distributed (DDP, FSDP2), on two processes.

One launch of two processes (gloo, loopback only) runs every case; each rank writes what it
found to a JSON file and the test reads both. Every case trains a float64 GPT (the test suite's
``examples.gpt("tiny")``) for 5 AdamW steps and compares every parameter's gradient (of the
first step) and every parameter after the 5 steps with the same run in eager DDP or FSDP2, at
1e-10. Sharded gradients and parameters are compared whole (``DTensor.full_tensor()``).

Run ``python tests/test_distributed.py`` to launch the workers by hand and print their results.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

TIMEOUT = 240  # seconds for the whole launch: a hang fails the test instead of blocking CI
STEPS = 5
TOL = dict(rtol=1e-10, atol=1e-10)

# case -> (what it wraps, the eager reference)
CASES = {
    "ddp(fxtools.compile(model))": "ddp",
    "fxtools.compile(ddp(model))": "ddp",
    "ddp(torch.compile(model, backend))": "ddp",
    "torch.compile(ddp(model), backend)": "ddp",
    "fully_shard(fxtools.compile(model))": "fsdp",
    "fully_shard(fxtools.compile(block)) per block": "fsdp",
    "fxtools.compile(fully_shard(model))": "fsdp",
    "fxtools.compile(model with fully_shard blocks)": "fsdp",
    "fully_shard(torch.compile(block, backend)) per block": "fsdp",
    "torch.compile(fully_shard(model), backend)": "fsdp",
}


# --------------------------------------------------------------------------------------------
# the worker (runs in each of the two processes)
# --------------------------------------------------------------------------------------------


def _worker(out_dir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fxtools
    from fxtools.cli import examples

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT // 2))
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
        """(module to train, its original parameters by name)."""
        backend = fxtools.backend()
        if case == "ddp(fxtools.compile(model))":
            return DDP(fxtools.compile(model, *inputs))
        if case == "fxtools.compile(ddp(model))":
            return fxtools.compile(DDP(model), *inputs)
        if case == "ddp(torch.compile(model, backend))":
            return DDP(torch.compile(model, backend=backend))
        if case == "torch.compile(ddp(model), backend)":
            return torch.compile(DDP(model), backend=backend)
        if case == "fully_shard(fxtools.compile(model))":
            return fully_shard(fxtools.compile(model, *inputs))
        if case == "fully_shard(fxtools.compile(block)) per block":
            h = hidden(model, inputs)
            return shard_blocks(model, lambda b: fxtools.compile(b, h))
        if case == "fxtools.compile(fully_shard(model))":
            return fxtools.compile(fully_shard(model), *inputs)
        if case == "fxtools.compile(model with fully_shard blocks)":
            return fxtools.compile(shard_blocks(model), *inputs)
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
    results["reference"] = {"errors": [], "losses": [reference["ddp"][2], reference["fsdp"][2]], "seconds": 0}
    only = os.environ.get("FXTOOLS_DIST_ONLY")
    for case, ref in CASES.items():
        if only and case not in only.split(";"):
            continue
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            model, inputs = model_and_batch()
            trained = build(case, model, inputs)
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
            results[case] = {"errors": errors, "losses": losses, "seconds": round(time.perf_counter() - start, 2)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            import traceback

            results[case] = {"errors": [f"{type(e).__name__}: {e}", traceback.format_exc()[-3000:]], "seconds": None}
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


def launch(out_dir: str, world_size: int = 2, extra_env: dict | None = None) -> list[dict]:
    """Run ``_worker`` in ``world_size`` processes; their results, or an AssertionError with
    their output if one fails or they take longer than TIMEOUT seconds."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world_size),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    procs = []
    for rank in range(world_size):
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
        cmd = [sys.executable, __file__, "--worker", out_dir]
        procs.append((subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=log, stderr=log), log))
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


def test_ddp_and_fsdp2_gradients_and_adamw_steps_equal_eager():
    with tempfile.TemporaryDirectory() as out_dir:
        ranks = launch(out_dir)
    problems = []
    for case in CASES:
        for rank, results in enumerate(ranks):
            got = results.get(case)
            if got is None:
                problems.append(f"{case} (rank {rank}): not run")
            elif got["errors"]:
                problems.append(f"{case} (rank {rank}):\n  " + "\n  ".join(got["errors"][:6]))
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        with tempfile.TemporaryDirectory() as d:
            start = time.perf_counter()
            for rank, res in enumerate(launch(d)):
                for case, r in res.items():
                    print(f"rank {rank} {case}: {r['seconds']} s, {r.get('losses')}, {'ok' if not r['errors'] else r['errors'][:3]}")
            print(f"{time.perf_counter() - start:.1f} s")
