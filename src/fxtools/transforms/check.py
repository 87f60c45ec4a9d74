"""Check a generated VJP against PyTorch: ``check_vjp`` (autograd) and ``check_vjp_fd`` (finite differences)."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..errors import FxtoolsError
from ..graph.nodes import is_float
from ..signature.naming import arg_names
from .calling import transform


class VjpMismatch(FxtoolsError, AssertionError):
    """The generated VJP disagrees with the reference."""


def random_cotangent(out, generator=None):
    """A random cotangent shaped like ``out``: normal noise at float leaves, None elsewhere."""
    return pytree.tree_map(lambda o: torch.randn(o.shape, dtype=o.dtype, generator=generator) if is_float(o) else None, out)


def _report(what, pairs, rtol, atol):
    lines = []
    for name, got, want in pairs:
        if got is None and want is None:
            continue
        if got is None or want is None:
            lines.append(
                f"  {name}: got {'None' if got is None else 'a tensor'}, expected {'None' if want is None else 'a tensor'}"
            )
            continue
        if got.shape != want.shape or got.dtype != want.dtype:
            lines.append(f"  {name}: got {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
            continue
        if not torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
            err = (got - want).abs().max().item()
            lines.append(f"  {name}: max abs error {err:.3g} (|expected| max {want.abs().max().item():.3g})")
    if lines:
        raise VjpMismatch(f"{what} mismatch:\n" + "\n".join(lines))


def _autograd_differentiable(f, leaves, spec, seed) -> list[bool]:
    """Which float leaves autograd accepts as differentiable inputs.

    Some ops refuse gradients for some tensor arguments (BatchNorm's running statistics, a loss's
    class weights); autograd raises at forward time when those require grad. Such leaves are left
    out of the comparison.
    """
    float_leaf = [is_float(x) for x in leaves]

    def forward_ok(mask):
        trial = [x.detach().clone().requires_grad_(m) if fl else x for x, fl, m in zip(leaves, float_leaf, mask)]
        torch.manual_seed(seed)
        try:
            f(*pytree.tree_unflatten(trial, spec))
        except RuntimeError as exc:
            if "not implemented" in str(exc) or "differentiable" in str(exc):
                return False
            raise
        return True

    if forward_ok(float_leaf):
        return float_leaf
    return [fl and forward_ok([j == i for j in range(len(leaves))]) for i, fl in enumerate(float_leaf)]


def _cotangent_for(gm, n_args, ct):
    """``ct`` with None where ``gm`` (a guarded fxtools module) takes None: outputs it does not
    differentiate (a ``floor``, the indices of ``max``) get no cotangent input."""
    from ..signature.guards import GuardedGraphModule, Leaf

    guards = getattr(gm, "guards", None) if isinstance(gm, GuardedGraphModule) else None
    if guards is None or len(guards.args) <= n_args:
        return ct

    kinds = []

    def walk(spec):
        if type(spec) is Leaf:
            kinds.append(spec.kind)
        else:
            for c in spec.children:
                walk(c)

    walk(guards.args[n_args])
    leaves, spec = pytree.tree_flatten(ct, is_leaf=lambda v: v is None)
    if len(kinds) != len(leaves):
        return ct
    return pytree.tree_unflatten([None if k == "none" else c for k, c in zip(kinds, leaves)], spec)


@transform("fxtools.check_vjp")
def check_vjp(f, *args, gm=None, rtol=None, atol=None, seed=0):
    """Compare ``fxtools.vjp(f, *args)`` with ``torch.autograd`` on a random cotangent.

    Raises ``VjpMismatch`` naming every output or gradient leaf that differs by its path
    (``out[0]``, ``params['fc1.weight']``); returns the GraphModule checked. The tolerances
    default to the arguments' floating-point dtype (``tolerances``), as the CLI's ``--check``.
    """
    from .vjp import vjp

    tol = tolerances(args)
    rtol, atol = tol["rtol"] if rtol is None else rtol, tol["atol"] if atol is None else atol
    gm = gm if gm is not None else vjp(f, *args)
    names = arg_names(f.forward if isinstance(f, torch.nn.Module) else f, len(args))
    gen = torch.Generator().manual_seed(seed)
    leaves, spec = pytree.tree_flatten(args)
    diff = _autograd_differentiable(f, leaves, spec, seed)
    ref_leaves = [x.detach().clone().requires_grad_(d) if is_float(x) else x for x, d in zip(leaves, diff)]
    ref_args = pytree.tree_unflatten(ref_leaves, spec)
    torch.manual_seed(seed)  # random ops (dropout) draw the same numbers in both runs
    want_out = f(*ref_args)
    # Outputs autograd treats as constants (a norm's saved mean and rstd) get a zero cotangent,
    # so both sides differentiate the same function.
    ct = pytree.tree_map(
        lambda o, c: torch.zeros_like(c) if isinstance(c, torch.Tensor) and not o.requires_grad else c,
        want_out,
        random_cotangent(want_out, gen),
    )
    out_pairs = list(zip(pytree.tree_leaves(want_out), pytree.tree_leaves(ct)))
    diff_out = [(o, c) for o, c in out_pairs if is_float(o) and o.requires_grad]
    inputs = [x for x, d in zip(ref_leaves, diff) if d]
    grads = (
        torch.autograd.grad([o for o, _ in diff_out], inputs, [c for _, c in diff_out], allow_unused=True)
        if diff_out and inputs
        else [None] * len(inputs)
    )
    want = [torch.zeros_like(x) if w is None else w for w, x in zip(grads, inputs)]
    torch.manual_seed(seed)
    got_out, got_grads = gm(*args, _cotangent_for(gm, len(args), ct))
    out_paths = [_path("out", p) for p, _ in pytree.tree_flatten_with_path(want_out)[0]]
    _report(
        "output",
        [
            (path, g, w.detach() if isinstance(w, torch.Tensor) else w)
            for path, g, w in zip(out_paths, pytree.tree_leaves(got_out), pytree.tree_leaves(want_out))
            if isinstance(w, torch.Tensor)
        ],
        rtol,
        atol,
    )
    arg_paths = [names[i] + pytree.keystr(p) for i, a in enumerate(args) for p, _ in pytree.tree_flatten_with_path(a)[0]]
    got = [g for g, d in zip(pytree.tree_leaves(got_grads, is_leaf=lambda v: v is None), diff) if d]
    paths = [f"gradient of {p}" for p, d in zip(arg_paths, diff) if d]
    _report("gradient", list(zip(paths, got, want)), rtol, atol)
    return gm


def _path(root: str, path) -> str:
    return root + pytree.keystr(path)


def tolerances(args) -> dict:
    """Default rtol and atol for comparing derivatives at ``args``, by their floating-point dtypes:
    float64 / complex128 tight, float32 / complex64 looser, float16 / bfloat16 loosest."""
    dtypes = {v.dtype for v in pytree.tree_leaves(args) if is_float(v)}
    if dtypes & {torch.float16, torch.bfloat16}:
        return dict(rtol=2e-2, atol=2e-2)
    if dtypes and dtypes <= {torch.float64, torch.complex128}:
        return dict(rtol=1e-7, atol=1e-9)
    return dict(rtol=1e-4, atol=1e-5)


def _pair(a, b):
    """Re(sum(conj(a) * b)): the real inner product, of complex tensors as pairs of real ones."""
    return torch.real(a.conj() * b).sum() if a.is_complex() or b.is_complex() else (a * b).sum()


@transform("fxtools.check_vjp_fd")
def check_vjp_fd(f, *args, gm=None, eps=1e-6, rtol=1e-5, atol=1e-7, seed=0):
    """Check ``<grads, v>`` against central differences ``<ct, (f(x+eps v) - f(x-eps v)) / 2 eps>``.

    ``v`` and the cotangent are random; use float64 or complex128 arguments. Complex arguments
    are moved along a random complex ``v``, so both their real and imaginary parts are perturbed.
    """
    from .vjp import vjp

    gm = gm if gm is not None else vjp(f, *args)
    gen = torch.Generator().manual_seed(seed)
    leaves, spec = pytree.tree_flatten(args)
    out = f(*args)
    ct = random_cotangent(out, gen)
    v = [torch.randn(x.shape, dtype=x.dtype, generator=gen) if is_float(x) else None for x in leaves]

    def shifted(sign):
        moved = [x + sign * eps * d if d is not None else x for x, d in zip(leaves, v)]
        return f(*pytree.tree_unflatten(moved, spec))

    plus, minus = shifted(1), shifted(-1)
    # The real pairing <a, b> = Re(sum(conj(a) * b)) (the plain dot product for real tensors). The
    # VJP's convention is autograd's: for the real loss L = <ct, f(x)>, the gradient of a complex
    # x = a + ib is dL/da + i dL/db (the conjugate Wirtinger derivative, times 2), so that
    # dL = <grad, dx>: the directional derivative along v is <grad, v>, real and imaginary parts alike.
    fd = sum(
        _pair(c, (p - m) / (2 * eps))
        for p, m, c in zip(pytree.tree_leaves(plus), pytree.tree_leaves(minus), pytree.tree_leaves(ct))
        if is_float(p)
    )
    _, grads = gm(*args, _cotangent_for(gm, len(args), ct))
    g_leaves = pytree.tree_leaves(grads, is_leaf=lambda x: x is None)
    analytic = sum(_pair(g, d) for g, d in zip(g_leaves, v) if g is not None and d is not None)
    fd, analytic = torch.as_tensor(fd, dtype=torch.float64), torch.as_tensor(analytic, dtype=torch.float64)
    if not torch.allclose(analytic, fd, rtol=rtol, atol=atol):
        raise VjpMismatch(
            f"finite-difference mismatch: <grads, v> = {analytic.item():.10g}, <ct, central difference> = {fd.item():.10g}"
        )
    return gm
