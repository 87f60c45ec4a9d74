"""Run fxtools.vjp on PyTorch's OpInfo samples and compare with torch.autograd (float64).

Shared by the per-rule tests and the full op sweep.
"""
from __future__ import annotations

import functools
import itertools

import torch
from torch.utils import _pytree as pytree

import fxtools
from fxtools.check import check_vjp


@functools.lru_cache(maxsize=None)
def autograd_opinfos():
    from torch.testing._internal.common_methods_invocations import op_db

    return tuple(op for op in op_db if op.supports_autograd and torch.float64 in op.supported_dtypes("cpu"))


def samples(opinfo, n=3):
    """The first n float64 CPU samples (the generator is closed at once: it runs under no_grad)."""
    gen = iter(opinfo.sample_inputs("cpu", torch.float64, requires_grad=True))
    try:
        return list(itertools.islice(gen, n))
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()


def sample_function(opinfo, sample):
    """(f, args): f takes the sample's tensor leaves (detached), in order, and calls the op."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    op = opinfo.op

    def f(*tensors):
        full = list(leaves)
        for i, t in zip(tensor_pos, tensors):
            full[i] = t
        inp, args, kwargs = pytree.tree_unflatten(full, spec)
        return op(inp, *args, **kwargs)

    args = tuple(leaves[i].detach().clone() for i in tensor_pos)
    return f, args


def check_sample(opinfo, sample):
    f, args = sample_function(opinfo, sample)
    torch.manual_seed(0)
    check_vjp(f, *args, rtol=1e-6, atol=1e-8)


def captured_ops(opinfo, sample):
    """The aten overloads that the capture of one sample contains (before decomposition)."""
    from fxtools.capture import capture

    f, args = sample_function(opinfo, sample)
    cap = capture(f, args, record_stack_traces=False)
    return {n.target for n in cap.gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}


@functools.lru_cache(maxsize=None)
def cases_by_op(n_samples=3):
    """aten overload -> [(opinfo, sample), ...] for every OpInfo sample whose capture calls it."""
    table = {}
    for opinfo in autograd_opinfos():
        try:
            for sample in samples(opinfo, n_samples):
                for op in captured_ops(opinfo, sample):
                    table.setdefault(op, []).append((opinfo, sample))
        except Exception:  # noqa: BLE001 - samples fxtools cannot capture are the sweep's business
            continue
    return table


def cases_for_rule(key, limit=6):
    """OpInfo samples that exercise the rule registered under ``key`` (an overload or packet)."""
    found = []
    for op, cases in cases_by_op().items():
        if op == key or op.overloadpacket == key:
            found.extend(cases)
    seen, unique = set(), []
    for opinfo, sample in found:
        k = (opinfo.name, opinfo.variant_test_name, id(sample))
        if k not in seen:
            seen.add(k)
            unique.append((opinfo, sample))
    return unique[:limit]
