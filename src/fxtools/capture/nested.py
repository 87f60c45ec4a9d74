"""Refuse ``torch.func`` transforms (vmap, grad, jvp, jacrev, ...) inside differentiated code.

fxtools captures at PyTorch's pre-dispatch level, above functorch. A transform nested in the
function fails there with an obscure functorch error (vmap) or, worse, traces to a wrong graph
(``torch.func.grad`` comes out as zeros). While capturing, entering any functorch level raises
``NestedTransformError`` naming the user's line instead, before functorch changes any state.
``fxtools.vmap`` traces below functorch on purpose and does not use this guard.
"""

from __future__ import annotations

import contextlib

from ..errors import FxtoolsError, current_user_line

__all__ = ["NestedTransformError", "no_nested_transforms"]


class NestedTransformError(FxtoolsError):
    """A ``torch.func`` transform inside a function fxtools differentiates."""


def _refuse(transform: str):
    @contextlib.contextmanager
    def enter(*args, **kwargs):
        raise NestedTransformError(
            f"a torch.func {transform} transform (at {current_user_line()}) is nested inside the function fxtools "
            "is differentiating, which fxtools cannot trace. Write the batched computation directly "
            "(batched ops, torch.einsum), or compose fxtools' own transforms instead, e.g. "
            "fxtools.vmap(fxtools.grad(f, ...), ...) or fxtools.hvp."
        )
        yield  # pragma: no cover

    return enter


@contextlib.contextmanager
def no_nested_transforms():
    """While active, functorch's vmap / grad (vjp, jacrev) / jvp (jacfwd) levels raise instead."""
    import torch._functorch.eager_transforms as eager
    import torch._functorch.vmap as vmap

    patches = [
        (vmap, "vmap_increment_nesting", "vmap"),
        (eager, "grad_increment_nesting", "grad/vjp"),
        (eager, "jvp_increment_nesting", "jvp"),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, transform in patches:
        setattr(module, name, _refuse(transform))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
