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
        slots = _one_name_per_slot(model, params)
        out = torch.func.functional_call(model, slots, inputs, kwargs, tie_weights=False, strict=False)
        if isinstance(params, dict):  # what the forward rebound, as functional_call writes it back
            params.update({k: slots[k] for k in params if k in slots and slots[k] is not params[k]})
        return out

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


def _one_name_per_slot(model: torch.nn.Module, params) -> dict:
    """``params`` (a mapping, or a sequence of mappings) as one dict naming each tensor slot of
    ``model`` once, with tied names given the value of the name passed.

    ``torch.func.functional_call`` (``tie_weights=True``) swaps every name of a tied tensor: a
    submodule reachable under two names (``self.shared`` also in ``self.blocks``) has one slot
    under both, and its restore then puts the swapped-in tensor back (a FakeTensor while fxtools
    traces), not the module's own. Here each ``(module, attribute)`` slot appears once, so
    ``tie_weights=False`` swaps and restores it once.
    """
    merged: dict = {}
    for mapping in [params] if isinstance(params, Mapping) else params:
        for key, value in mapping.items():
            if key in merged:
                raise ValueError(f"{key!r} appeared in multiple dictionaries; behavior of functional call is ambiguous")
            merged[key] = value
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for name, tensor in named.items():
        aliases.setdefault(id(tensor), []).append(name)
    given: dict[int, str] = {}
    out: dict = {}
    seen: set = set()
    for key, value in merged.items():
        if key not in named:
            out[key] = value  # not the model's: functional_call's own handling (strict=False)
            continue
        group = id(named[key])
        if group in given and merged[given[group]] is not value:
            raise ValueError(
                f"functional call got values for both {given[group]} and {key}, which are tied. Consider using tie_weights=False"
            )
        given[group] = key
        for name in [key, *aliases[group]]:  # the name passed first: it keeps its own slot
            prefix, _, attr = name.rpartition(".")
            slot = (id(model.get_submodule(prefix)), attr)
            if slot not in seen:
                seen.add(slot)
                out[name] = value
    return out
