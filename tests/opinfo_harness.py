"""Run fxtools.vjp on PyTorch's OpInfo samples and compare with torch.autograd (float64, complex128).

Shared by the per-rule tests and the full op sweep.
"""

from __future__ import annotations

import functools

import torch
from torch.utils import _pytree as pytree

import fxtools
from fxtools.cli.coverage import opinfo_samples, sample_function  # noqa: F401 (re-exported)
from fxtools.transforms.check import _cotangent_for, check_vjp


@functools.cache
def autograd_opinfos(dtype=torch.float64):
    """The OpInfos autograd differentiates on the CPU in ``dtype`` (for complex dtypes: those whose
    backward PyTorch declares supported in it)."""
    from torch.testing._internal.common_methods_invocations import op_db

    if dtype.is_complex:
        return tuple(op for op in op_db if op.supports_autograd and dtype in op.supported_backward_dtypes("cpu"))
    return tuple(op for op in op_db if op.supports_autograd and dtype in op.supported_dtypes("cpu"))


def samples(opinfo, n=3, dtype=torch.float64):
    return opinfo_samples(opinfo, n, dtype)


def func_vjp(f, args):
    """``torch.func.vjp`` of ``f`` packaged like a generated module, ``(*args, ct) -> (out, grads)``,
    so ``check_vjp`` can compare it with autograd as it does fxtools (the sweeps' yardstick)."""
    leaves, spec = pytree.tree_flatten(args)
    diff = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())]

    def run(*a):
        *call, ct = a
        flat, _ = pytree.tree_flatten(tuple(call))

        def g(*xs):
            full = list(flat)
            for i, x in zip(diff, xs):
                full[i] = x
            return f(*pytree.tree_unflatten(full, spec))

        out, pullback = torch.func.vjp(g, *[flat[i] for i in diff])
        grads = pullback(ct)
        per_leaf = [None] * len(flat)
        for i, gr in zip(diff, grads):
            per_leaf[i] = gr
        return out, per_leaf

    return run


def is_random(f, args) -> bool:
    """Whether f draws random numbers (dropout, rrelu in training, randn inside)."""
    from fxtools.capture.trace import capture

    cap = capture(f, args, record_stack_traces=False)
    return any(
        isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
        for n in cap.gm.graph.nodes
    )


def check_self_consistent(f, args, seed=0, rtol=1e-6, atol=1e-8):
    """For random functions: the generated gradients are autograd's gradients of the generated
    forward itself, run under the same seed (so the same masks are drawn), and reruns agree."""
    gm = fxtools.vjp(f, *args)
    leaves, spec = pytree.tree_flatten(args)
    xs = [x.detach().clone().requires_grad_(x.is_floating_point() or x.is_complex()) for x in leaves]
    n = len(args)
    torch.manual_seed(seed)
    out0, _ = gm(
        *args, _cotangent_for(gm, n, fxtools.transforms.check.random_cotangent(f(*args), torch.Generator().manual_seed(seed)))
    )
    ct = _cotangent_for(gm, n, fxtools.transforms.check.random_cotangent(out0, torch.Generator().manual_seed(seed)))
    torch.manual_seed(seed)
    out, grads = gm(*pytree.tree_unflatten(xs, spec), ct)
    torch.manual_seed(seed)
    out_again, grads_again = gm(*args, ct)
    pairs = [
        (o, c)
        for o, c in zip(pytree.tree_leaves(out), pytree.tree_leaves(ct, is_leaf=lambda v: v is None))
        if o.requires_grad and c is not None
    ]
    diff = [x for x in xs if x.requires_grad]
    torch.testing.assert_close(pytree.tree_leaves(out_again), [o.detach() for o in pytree.tree_leaves(out)])
    if not diff:  # nothing to differentiate (torch.normal(1.0, 2.0, size)): the reruns agree
        assert not [g for g in pytree.tree_leaves(grads) if g is not None]
        return
    want = torch.autograd.grad([o for o, _ in pairs], diff, [c for _, c in pairs], allow_unused=True)
    got = [g for g, x in zip(pytree.tree_leaves(grads), xs) if x.requires_grad]
    for g, w, x in zip(got, want, diff):
        torch.testing.assert_close(g.detach(), torch.zeros_like(x) if w is None else w, rtol=rtol, atol=atol)
    torch.testing.assert_close(pytree.tree_leaves(grads_again), [g.detach() for g in pytree.tree_leaves(grads)])


def _partial_view(t) -> bool:
    """Whether ``t`` sees only part of its storage (a slice of a larger tensor)."""
    return (
        isinstance(t, torch.Tensor)
        and t.layout == torch.strided
        and (t.storage_offset() != 0 or t.untyped_storage().nbytes() > t.numel() * t.element_size())
    )


def sample_views(opinfo, sample):
    """``sample_function``'s (f, args), except that arguments the sample gives as partial views
    stay views of their storage (detached, not copied): ``as_strided`` reads storage around them."""
    f, args = sample_function(opinfo, sample)
    leaves = [x for x in pytree.tree_leaves((sample.input, sample.args, sample.kwargs)) if isinstance(x, torch.Tensor)]
    return f, tuple(x.detach() if _partial_view(x) else a for x, a in zip(leaves, args))


def check_vjp_on_views(f, args, rtol=1e-6, atol=1e-8, seed=0):
    """``check_vjp`` for arguments that are partial views: autograd differentiates ``f`` at the
    very same views (same storage, strides and offset), where ``check_vjp`` would copy them."""
    gm = fxtools.vjp(f, *args)
    ref = [a.detach().requires_grad_(a.is_floating_point() or a.is_complex()) for a in args]
    torch.manual_seed(seed)
    want = f(*ref)
    ct = fxtools.transforms.check.random_cotangent(want, torch.Generator().manual_seed(seed))
    outs = [(o, c) for o, c in zip(pytree.tree_leaves(want), pytree.tree_leaves(ct)) if o.requires_grad]
    diff = [r for r in ref if r.requires_grad]
    grads = torch.autograd.grad([o for o, _ in outs], diff, [c for _, c in outs], allow_unused=True)
    torch.manual_seed(seed)
    got_out, got_grads = gm(*args, _cotangent_for(gm, len(args), ct))
    torch.testing.assert_close(pytree.tree_leaves(got_out), [o.detach() for o in pytree.tree_leaves(want)], rtol=rtol, atol=atol)
    got = [g for g, r in zip(got_grads, ref) if r.requires_grad]
    want_grads = [torch.zeros_like(r) if g is None else g for g, r in zip(grads, diff)]
    torch.testing.assert_close(got, want_grads, rtol=rtol, atol=atol, equal_nan=True)


def check_sample(opinfo, sample):
    """fxtools.vjp against torch.autograd on one sample, in its dtype. Random ops are compared
    with eager under the same seed: the generated code must draw what eager draws (the OpInfos
    seed inside, through ``torch.manual_seed`` and ``freeze_rng_state``)."""
    f, args = sample_views(opinfo, sample)
    if any(_partial_view(a) for a in args):
        check_vjp_on_views(f, args)
    else:
        check_vjp(f, *args, rtol=1e-6, atol=1e-8)


# (OpInfo name, variant, dtype, sample index) -> None (passed) or the exception check_sample raised
_checked: dict = {}


def check_sample_once(opinfo, index, sample, dtype=torch.float64):
    """``check_sample`` of the ``index``-th of ``samples(opinfo, n, dtype)``, once per process.

    The op sweep and the per-rule tests check the same samples (the per-rule cases are drawn from
    the sweep's first three samples of each OpInfo, and one sample is a case of every rule it
    calls): the same program against the same oracle, a deterministic result (the samples come
    from a fixed seed, the check's cotangent too). A repeat re-raises the first check's exception,
    or passes if it passed. The two files share a pytest-xdist worker (tests/conftest.py).
    """
    key = (opinfo.name, opinfo.variant_test_name, dtype, index)
    if key not in _checked:
        try:
            check_sample(opinfo, sample)
        except Exception as exc:  # noqa: BLE001 - remembered and re-raised to every caller
            _checked[key] = exc
            raise
        _checked[key] = None
    if _checked[key] is not None:
        raise _checked[key]


def captured_ops(opinfo, sample):
    """The aten overloads that the capture of one sample contains (before decomposition)."""
    from fxtools.capture.trace import capture

    f, args = sample_function(opinfo, sample)
    cap = capture(f, args, record_stack_traces=False)
    return {n.target for n in cap.gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}


@functools.cache
def cases_by_op(n_samples=3):
    """aten overload -> [(opinfo, index, sample, ops), ...] for every OpInfo sample whose capture
    calls it (``index``: its place in ``samples(opinfo, n_samples)``)."""
    table = {}
    for opinfo in autograd_opinfos():
        try:
            for index, sample in enumerate(samples(opinfo, n_samples)):
                ops = frozenset(captured_ops(opinfo, sample))
                for op in ops:
                    table.setdefault(op, []).append((opinfo, index, sample, ops))
        except Exception:  # noqa: BLE001 - samples fxtools cannot capture are the sweep's business
            continue
    return table


def cases_for_rule(key, limit=6):
    """OpInfo samples that exercise the rule registered under ``key`` (an overload or packet), as
    ``(opinfo, index, sample)`` (``check_sample_once``'s arguments).

    Samples that isolate the rule come first: those whose other ops all have hand-written rules,
    then those with the fewest ops.
    """
    from fxtools import registry

    def others_without_rule(ops):
        return sum(1 for op in ops if (r := registry.lookup(op)) is None or r.source != "hand-written")

    found = []
    for op, cases in cases_by_op().items():
        if op == key or op.overloadpacket == key:
            found.extend(cases)
    seen, unique = set(), []
    for opinfo, index, sample, ops in sorted(found, key=lambda c: (others_without_rule(c[3]), len(c[3]))):
        k = (opinfo.name, opinfo.variant_test_name, index)
        if k not in seen:
            seen.add(k)
            unique.append((opinfo, index, sample))
    return unique[:limit]
