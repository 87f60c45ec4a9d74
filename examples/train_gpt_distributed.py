"""Train a small GPT with fxtools' graphs under FSDP2, then the same run in eager, and compare.

    torchrun --nproc_per_node 2 examples/train_gpt_distributed.py            # CPU: gloo
    torchrun --nproc_per_node 8 examples/train_gpt_distributed.py --steps 50  # GPUs: nccl, unchanged

The model is fxtools' example GPT (``fxtools.cli.examples.GPT``, nanoGPT-style, tied embeddings),
byte-level (256 tokens), trained on this file's own text: every rank reads its own windows. Each
transformer block is sharded with FSDP2 (``fully_shard``), then the root; ``--order`` chooses how
fxtools comes in:

- ``shard-then-compile`` (default): ``fxtools.compile(model)`` on the sharded model. One pair of
  graphs for the whole model; FSDP2's hooks run around them (they gather every block's
  parameters before the forward graph and again before the backward graph, and reduce-scatter
  the gradients after it).
- ``compile-then-shard``: ``fully_shard(fxtools.compile(block, h))`` for each block: FSDP2 gathers
  one block's parameters at a time; embeddings, final norm and loss run in eager.

The device is ``cuda:LOCAL_RANK`` when CUDA is available (backend nccl), otherwise the CPU
(gloo). Each step prints the loss (averaged over ranks) and the tokens per second of all ranks;
at the end, the same run in eager, and the difference of the final losses.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fxtools
from fxtools.cli.examples import GPT, gpt_config
from fxtools.training.backend import CompiledModule


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--order", choices=["shard-then-compile", "compile-then-shard"], default="shard-then-compile")
    p.add_argument("--policy", default="recompute_cheap", help="what fxtools' forward saves (see fxtools.policies)")
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


def setup() -> torch.device:
    """The process group (nccl on GPUs, gloo on the CPU) and this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def batches(args, device, steps):
    """``steps`` batches of (inputs, next-byte targets) from this file, different on every rank."""
    with open(__file__, "rb") as f:
        text = torch.tensor(list(f.read()), dtype=torch.long)
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(text) - args.seq_len - 1, (args.batch,), generator=g)
        chunk = torch.stack([text[s : s + args.seq_len + 1] for s in starts.tolist()])
        out.append((chunk[:, :-1].contiguous().to(device), chunk[:, 1:].contiguous().to(device)))
    return out


def make_model(args, device, mesh, compiled: bool):
    """The GPT, sharded per block and at the root; with ``compiled``, through fxtools (``--order``)."""
    torch.manual_seed(0)  # the same initial parameters on every rank, and in both runs
    config = gpt_config("tiny", vocab_size=256, block_size=args.seq_len, n_layer=4, n_head=4, n_embd=64)
    model = GPT(config).to(device)
    example = batches(args, device, 1)[0]
    blocks = model.transformer.h
    for i, block in enumerate(blocks):
        if compiled and args.order == "compile-then-shard":
            h = torch.randn(args.batch, args.seq_len, config.n_embd, device=device, requires_grad=True)
            block = fxtools.compile(block, h, policy=args.policy)
        blocks[i] = fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if compiled and args.order == "shard-then-compile":
        return model, fxtools.compile(model, *example, policy=args.policy)
    return model, model


def train(name, model, step_fn, data, args, device):
    """Run the steps; print a line per step on rank 0; the last loss (mean over ranks)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    world = dist.get_world_size()
    loss_mean = torch.zeros((), device=device)
    for step, (idx, targets) in enumerate(data):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = step_fn(idx, targets)
        loss.backward()
        opt.step()
        loss_mean = loss.detach().clone()
        dist.all_reduce(loss_mean, op=dist.ReduceOp.SUM)  # also waits for every rank's step
        loss_mean /= world
        seconds = time.perf_counter() - start
        if dist.get_rank() == 0:
            tokens = idx.numel() * world
            print(
                f"[{name}] step {step + 1:3d}/{len(data)}  loss {loss_mean.item():.4f}  {tokens / seconds:9,.0f} tokens/s",
                flush=True,
            )
    return loss_mean.item()


def main():
    args = parse_args()
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    data = batches(args, device, args.steps)
    if rank == 0:
        print(f"{world} ranks on {device.type} ({dist.get_backend()}), fxtools order: {args.order}, policy: {args.policy}")

    model, compiled = make_model(args, device, mesh, compiled=True)
    fx_loss = train("fxtools", model, compiled, data, args, device)
    splits = [m.split for m in compiled.modules() if isinstance(m, CompiledModule)]
    saved = sum(s.saved_bytes for s in splits)
    saved_all = [None] * world
    dist.all_gather_object(saved_all, saved)
    if rank == 0:
        per_rank = ", ".join(f"rank {r}: {b:,} B" for r, b in enumerate(saved_all))
        print(f"activations fxtools' forward graphs save per step ({len(splits)} graph pair(s)): {per_rank}")

    model, _ = make_model(args, device, mesh, compiled=False)
    eager_loss = train("eager", model, model, data, args, device)
    if rank == 0:
        diff = abs(fx_loss - eager_loss)
        tol = 1e-5 + 1.3e-6 * abs(eager_loss)  # torch.testing's float32 tolerance
        verdict = "equal to float32 tolerance" if diff <= tol else "NOT equal to float32 tolerance"
        print(f"final loss: fxtools {fx_loss:.6f}, eager {eager_loss:.6f}, |difference| {diff:.2e} ({verdict}, {tol:.1e})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
