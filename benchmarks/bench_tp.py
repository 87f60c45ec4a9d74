"""2-D training (FSDP2 over "dp" x tensor parallel over "tp") through fxtools against eager and
torch.compile: step time and bytes the tensor-parallel collectives move.

Run on 4 processes (a (2, 2) mesh; gloo on CPU, nccl on CUDA):

    torchrun --nproc_per_node 4 benchmarks/bench_tp.py [--steps 10] [--width 256] [--blocks 4] [--code]

The model is ``--blocks`` residual blocks (LayerNorm, ``ColwiseParallel`` up-projection to 4x the
width, ``RowwiseParallel`` down-projection) over "tp", each block and the root ``fully_shard`` over
"dp", float32, a batch of 32 rows per dp rank. Variants, in this one launch, interleaved step by
step: eager, ``torch.compile(backend="aot_eager")``, ``fxtools.compile`` and
``torch.compile(backend=fxtools.backend())``. Step time: median over ``--steps`` steps (forward,
backward, AdamW) after two warm-up steps, rank 0's clock. Bytes: what the functional collectives
(``_c10d_functional``: DTensor's "tp" all-reduces, all-gathers, reduce-scatters) move in one step
on rank 0, counted by a dispatch mode as ``Split.communicated_bytes`` counts them (the larger of
input and output); FSDP2's "dp" collectives run outside every variant's graphs alike and are not
counted. Results are printed and written to ``benchmarks/results_tp.md`` by rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(self.norm(h))))


class Net(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return ((x - y) ** 2).mean()


class CountBytes(TorchDispatchMode):
    """Bytes the functional collectives dispatched while active move (larger of input and output),
    also those DTensor's dispatch runs (an op on DTensors is left to it, with this mode still
    active, as ``CommDebugMode`` does: else the collectives of its custom handlers, such as
    ``loss_parallel()``'s, would run unseen)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] in COLLECTIVES:
            sizes = [t.numel() * t.element_size() for t in (out, args[0]) if isinstance(t, torch.Tensor)]
            self.bytes += max(sizes, default=0)
        return out


def build(variant, mesh, args, batch):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fxtools

    torch.manual_seed(0)
    model = Net(args.width, args.blocks).to(batch[0].device)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    if variant == "eager":
        return model, model
    if variant == "torch.compile (aot_eager)":
        return model, torch.compile(model, backend="aot_eager")
    if variant == "fxtools.compile":
        return model, fxtools.compile(model, *batch)
    return model, torch.compile(model, backend=fxtools.backend())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--code", action="store_true", help="print fxtools.compile's backward graph (rank 0)")
    args = parser.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1 + mesh["dp"].get_local_rank())
    batch = (torch.randn(32, args.width, device=device), torch.randn(32, args.width, device=device))
    variants = ["eager", "torch.compile (aot_eager)", "fxtools.compile", "fxtools backend"]
    runs = {}
    for v in variants:
        _, trained = build(v, mesh, args, batch)
        runs[v] = (trained, torch.optim.AdamW(trained.parameters(), lr=1e-3), [])

    def step(v):
        trained, opt, _ = runs[v]
        opt.zero_grad()
        trained(*batch).backward()
        opt.step()

    moved = {}
    for v in variants:
        for _ in range(2):
            step(v)
        with CountBytes() as counter:
            step(v)
        moved[v] = counter.bytes
    for _ in range(args.steps):
        for v in variants:  # interleaved: the machine's load falls on every variant alike
            dist.barrier()
            start = time.perf_counter()
            step(v)
            dist.barrier()
            runs[v][2].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        report(variants, runs, moved, args, device)
        if args.code:
            print(runs["fxtools.compile"][0].split.backward.code)
    dist.destroy_process_group()


def report(variants, runs, moved, args, device):
    eager = statistics.median(runs["eager"][2])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# 2-D training (FSDP2 x tensor parallel) through fxtools ({now})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, device {device.type}, 4 processes "
        f"on a (2, 2) mesh. Model: {args.blocks} residual blocks of width {args.width} (MLP 4x), float32, 32 rows per dp "
        f"rank; median of {args.steps} interleaved steps (forward, backward, AdamW) after 2 warm-up steps.",
        "",
        "| variant | step ms | x eager | TP collectives' bytes per step (rank 0) |",
        "|---|---:|---:|---:|",
    ]
    for v in variants:
        t = statistics.median(runs[v][2])
        lines.append(f"| {v} | {t * 1e3:.1f} | {t / eager:.2f} | {moved[v]:,} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results_tp.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
