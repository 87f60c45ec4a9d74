"""``functional(model)``: an nn.Module as a function of its parameters, for differentiation."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch


def functional(model: torch.nn.Module):
    """Return ``f(params, *inputs, **kwargs)`` computing ``model(*inputs, **kwargs)`` with ``params``.

    ``params`` maps parameter names to tensors, as ``dict(model.named_parameters())`` does;
    parameters left out keep the model's own values, tied parameters stay tied. Buffers stay
    the model's own tensors, so BatchNorm's running statistics are updated in place by the
    generated code exactly as an eager forward updates them. In generated code each parameter
    is named after its path (``params['fc1.weight']`` becomes ``fc1_weight``)::

        f = fxtools.functional(model)
        gm = fxtools.grad(f, dict(model.named_parameters()), x, y)
    """

    def f(params, *inputs, **kwargs):
        check_params(model, params)
        return torch.func.functional_call(model, params, inputs, kwargs, strict=False)

    try:
        forward = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        forward = [inspect.Parameter("inputs", inspect.Parameter.VAR_POSITIONAL)]
    params = inspect.Parameter("params", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    f.__signature__ = inspect.Signature([params, *forward])
    f.__name__ = f.__qualname__ = type(model).__name__
    f.__doc__ = f"{type(model).__name__}.forward as a function of its parameters."
    f.__fxtools_module__ = model
    return f


def check_params(model: torch.nn.Module, params) -> None:
    """Refuse ``params`` that are not a name -> tensor mapping (``model.parameters()``, a list of
    tensors): the names say which parameter each tensor replaces. A sequence of mappings (as
    ``torch.func.functional_call`` takes: parameters, buffers) is accepted."""
    mappings = isinstance(params, (list, tuple)) and bool(params) and all(isinstance(p, Mapping) for p in params)
    if not isinstance(params, Mapping) and not mappings:
        kind = "a generator" if inspect.isgenerator(params) else f"a {type(params).__name__}"
        raise TypeError(
            f"fxtools.functional({type(model).__name__}) takes params as a dict of parameter names to tensors, "
            f"got {kind}: pass dict(model.named_parameters()) (model.parameters() gives the tensors without their names)"
        )
