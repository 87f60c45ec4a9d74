"""fxtools' transforms called inside a program fxtools is capturing (a loss that calls them).

Outside a capture, ``fxtools.grad(f, x)`` builds a module from example inputs. Inside a function
that fxtools differentiates (``fxtools.grad(loss, ...)``, ``split``, ``compile``), the examples
are the capture's traced values and a module cannot be built from them (the closed-over values of
``f`` are traced too). There each transform is instead the same derivative spelt with
``torch.func``, which the capture traces below functorch and replays as ordinary ATen ops
(``capture/nested.py``), so the outer transform differentiates it like any other code:
``fxtools.grad`` is ``torch.func.grad``, ``fxtools.laplacian`` the trace of ``torch.func.hessian``,
and so on, called with the module's calling convention (``gm(*args)``, ``gm(*args, grad_out)``,
...). ``fxtools.jvp`` has its own form (``capture/dual.py``: fxtools' forward mode in the
program). Transforms without such a spelling (``jet``, ``bilaplacian``, ``linearize``, ``split``,
Hutchinson's estimates) are refused, naming the user's line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import FxtoolsError, current_user_line

__all__ = ["InsideProgramError", "call_inside"]


class InsideProgramError(FxtoolsError):
    """An fxtools transform called inside a differentiated program that has no in-program form."""


def _nums(argnums, n: int) -> tuple[int, ...]:
    if argnums is None:
        return tuple(range(n))
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _float_leaves_fn(f, args: tuple, nums: tuple[int, ...], kwargs: dict):
    """``(g, leaves, rebuild)``: ``g(*leaves)`` is ``f(*args)`` with the floating-point tensor
    leaves of ``args[nums]`` replaced; ``rebuild(grads)`` nests per-leaf results back into one
    structure per argument in ``nums``, ``None`` at the other leaves."""
    flat = [pytree.tree_flatten(args[a]) for a in nums]
    where = [(k, j) for k, (leaves, _) in enumerate(flat) for j, v in enumerate(leaves) if _is_float(v)]

    def g(*new):
        parts = [list(leaves) for leaves, _ in flat]
        for (k, j), v in zip(where, new):
            parts[k][j] = v
        full = list(args)
        for k, a in enumerate(nums):
            full[a] = pytree.tree_unflatten(parts[k], flat[k][1])
        return f(*full, **kwargs)

    def rebuild(per_leaf) -> list:
        parts: list[list] = [[None] * len(leaves) for leaves, _ in flat]
        for (k, j), v in zip(where, per_leaf):
            parts[k][j] = v
        return [pytree.tree_unflatten(parts[k], flat[k][1]) for k in range(len(nums))]

    return g, [flat[k][0][j] for k, j in where], rebuild


def _pick(results: list, argnums):
    return results[0] if isinstance(argnums, int) else tuple(results)


def _grad(o: dict, own: dict, value: bool):
    f, argnums, has_aux = o["f"], o["argnums"], o["has_aux"]

    def call(*args, **kwargs):
        nums = _nums(argnums, len(args))
        g, leaves, rebuild = _float_leaves_fn(f, args, nums, kwargs)
        grads, val = torch.func.grad_and_value(g, argnums=tuple(range(len(leaves))), has_aux=has_aux)(*leaves)
        grads = _pick(rebuild(grads), argnums)
        if value:
            return val, grads
        return (grads, val[1]) if has_aux else grads

    return call


def _vjp(o: dict, own: dict):
    f, argnums, has_aux = o["f"], o["argnums"], o["has_aux"]

    def call(*given, **kwargs):
        args, grad_out = tuple(given[:-1]), given[-1]
        nums = _nums(argnums, len(args))
        g, leaves, rebuild = _float_leaves_fn(f, args, nums, kwargs)
        outs: dict[str, Any] = {}

        def float_outputs(*new):  # the floating-point leaves of the output; the rest as aux
            result = g(*new)
            out, aux = result if has_aux else (result, None)
            flat, spec = pytree.tree_flatten(out)
            outs["spec"], outs["flat"], outs["aux"] = spec, flat, aux
            return tuple(v for v in flat if _is_float(v)), ()

        float_out, vjp_fn, _ = torch.func.vjp(float_outputs, *leaves, has_aux=True)  # type: ignore[misc]
        cts = [c for c, v in zip(outs["spec"].flatten_up_to(grad_out), outs["flat"]) if _is_float(v)]
        cts = [torch.zeros_like(v) if c is None else c for c, v in zip(cts, float_out)]
        grads = vjp_fn(tuple(cts))
        flat = list(outs["flat"])
        it = iter(float_out)
        flat = [next(it) if _is_float(v) else v for v in flat]
        out = pytree.tree_unflatten(flat, outs["spec"])
        per_arg = rebuild(grads)
        grads_out = per_arg[0] if isinstance(argnums, int) else tuple(per_arg)
        return (out, grads_out, outs["aux"]) if has_aux else (out, grads_out)

    return call


def _hvp(o: dict, own: dict):
    f, argnums = o["f"], o["argnums"]

    def call(*given, **kwargs):
        args, v = tuple(given[:-1]), given[-1]
        nums = _nums(argnums, len(args))
        g, leaves, rebuild = _float_leaves_fn(f, args, nums, kwargs)
        per_arg = (v,) if isinstance(argnums, int) else tuple(v)
        t_leaves = _float_leaves_fn(f, tuple(per_arg), tuple(range(len(nums))), kwargs)[1]
        grad_g = torch.func.grad(g, argnums=tuple(range(len(leaves))))
        hv = torch.func.jvp(grad_g, tuple(leaves), tuple(t_leaves))[1]
        return _pick(rebuild(hv), argnums)

    return call


def _hessian(o: dict, own: dict):
    return lambda *args, **kwargs: torch.func.hessian(o["f"], argnums=o["argnums"])(*args, **kwargs)


def _jacrev(o: dict, own: dict):
    jac = torch.func.jacrev(o["f"], argnums=o["argnums"], has_aux=o["has_aux"], chunk_size=o["chunk_size"])
    return lambda *args, **kwargs: jac(*args, **kwargs)


def _jacfwd(o: dict, own: dict):
    jac = torch.func.jacfwd(o["f"], argnums=o["argnums"], has_aux=o["has_aux"], randomness=o["randomness"])
    return lambda *args, **kwargs: jac(*args, **kwargs)


def _vmap(o: dict, own: dict):
    mapped = torch.func.vmap(
        o["f"], in_dims=o["in_dims"], out_dims=o["out_dims"], randomness=o["randomness"], chunk_size=o["chunk_size"]
    )
    return lambda *args, **kwargs: mapped(*args, **kwargs)


def _tensor_argument(name: str, args: tuple, argnums) -> None:
    if not isinstance(argnums, int) or not isinstance(args[argnums], torch.Tensor):
        raise InsideProgramError(
            f"{name} inside a function fxtools differentiates (at {current_user_line()}) takes one tensor "
            "argument (an int argnums) there; build it outside the function, or differentiate with torch.func"
        )


def _laplacian(o: dict, own: dict):
    name = "fxtools.laplacian"
    if o["samples"] is not None:
        raise _no_form(name, "samples= (Hutchinson's estimate)")
    f, argnums, weighted = o["f"], o["argnums"], o["sigma"] is not None

    def call(*given, **kwargs):
        args, sigma = (tuple(given[:-1]), given[-1]) if weighted else (tuple(given), None)
        _tensor_argument(name, args, argnums)
        shape = args[argnums].shape
        d = math.prod(shape)
        out = f(*args, **kwargs)
        hess = torch.func.hessian(f, argnums=argnums)(*args, **kwargs)

        def lap(o_leaf, h):
            if not _is_float(o_leaf):
                return None
            h = h.reshape(*o_leaf.shape, d, d)
            if weighted:
                return torch.einsum("...ij,ir,jr->...", h, sigma, sigma)
            return torch.diagonal(h, dim1=-2, dim2=-1).sum(-1)

        return out, pytree.tree_map(lap, out, hess)

    return call


def _divergence(o: dict, own: dict):
    name = "fxtools.divergence"
    if o["samples"] is not None:
        raise _no_form(name, "samples= (Hutchinson's estimate)")
    f, argnums = o["f"], o["argnums"]

    def call(*args, **kwargs):
        _tensor_argument(name, args, argnums)
        out = f(*args, **kwargs)
        jac = torch.func.jacfwd(f, argnums=argnums)(*args, **kwargs)
        d = args[argnums].numel()
        return out, torch.diagonal(jac.reshape(d, d)).sum()

    return call


def _no_form(name: str, what: str | None = None) -> InsideProgramError:
    what = f"{name} with {what}" if what else name
    return InsideProgramError(
        f"{what} is called inside a function fxtools differentiates (at {current_user_line()}); inside "
        "such a function fxtools writes its transforms as torch.func's (grad, vjp, hvp, hessian, jacrev, "
        "jacfwd, vmap, jvp, laplacian and divergence without samples), and this one has no such form: "
        "build it outside the function (gm = "
        f"{name}(f, *examples)) and call gm inside, or write the derivative with torch.func"
    )


_FORMS: dict[str, Callable[[dict, dict], Callable]] = {
    "fxtools.grad": lambda o, own: _grad(o, own, value=False),
    "fxtools.value_and_grad": lambda o, own: _grad(o, own, value=True),
    "fxtools.vjp": _vjp,
    "fxtools.hvp": _hvp,
    "fxtools.hessian": _hessian,
    "fxtools.jacrev": _jacrev,
    "fxtools.jacfwd": _jacfwd,
    "fxtools.vmap": _vmap,
    "fxtools.laplacian": _laplacian,
    "fxtools.divergence": _divergence,
}

_OWN_FORM = {"fxtools.jvp"}  # forward mode in the program: capture/dual.py


def call_inside(name: str, options: dict) -> Callable | None:
    """The in-program form of transform ``name`` called with bound ``options`` (``f``, the
    examples and its keywords), or None for a transform that handles the case itself."""
    if name in _OWN_FORM:
        return None
    form = _FORMS.get(name)
    if form is None:
        raise _no_form(name)
    return form(options, {})
