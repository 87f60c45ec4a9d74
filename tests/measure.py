"""Test helpers that measure what fxtools predicts or compare it with its own fallback."""

from __future__ import annotations

import contextlib

import torch

from fxtools.training.budget import allocated_peak
from fxtools.transforms import replay


def measure_peak(split, *args) -> int:
    """Measured peak bytes of ``split.forward`` then ``split.backward_boxed`` (cotangents of ones)
    on CPU tensors, as ``predicted_peak`` counts them: the inputs' storages plus the peak of what
    the CPU allocator holds during the call (``torch.profiler`` with ``profile_memory=True``:
    every allocation and free, summed in time order). Includes what ops allocate inside
    themselves, which the prediction does not see."""

    flat = split.flatten(*args)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in flat}

    def run():
        out, saved = split.forward(*flat)
        leaves = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        box = [*saved, *(torch.ones_like(leaves[i]) for i in split.ct_index)]
        del saved
        return out, split.backward_boxed(box)

    with torch.no_grad():  # parameters that require grad would make autograd keep every value
        run()  # warm up: first calls allocate caches
        peak = allocated_peak(run)
    return sum(storages.values()) + peak


@contextlib.contextmanager
def replay_disabled():
    """Trace every call for real (to compare with replay, or to rule it out)."""
    token = replay.ENABLED.set(False)
    try:
        yield
    finally:
        replay.ENABLED.reset(token)
