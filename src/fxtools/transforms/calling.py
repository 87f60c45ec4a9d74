"""How the public transforms are called, checked in one place before any tracing.

torch.func's transforms take a function and return a function (``torch.func.grad(f)(x)``);
fxtools' take the function *and example inputs* and return a module built from them
(``fxtools.grad(f, x)``, then ``gm(x)``). Habits from torch.func and JAX otherwise end in errors
from deep inside the trace (``'Tensor' object is not callable``). ``transform(name)`` decorates
every entry point (``vjp``, ``grad``, ``jvp``, ``vmap``, ``split``, ...) with one check of the
clear misuses, each answered with the fxtools call that works. Anything else passes through
unchanged: keyword arguments and modules the transform itself accepts are not second-guessed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
from torch.utils import _pytree as pytree

from ..errors import FxtoolsError
from ..signature.guards import module_call

P = ParamSpec("P")
R = TypeVar("R")

# torch.func's / JAX's keyword names, with fxtools' (which are torch.func's where they differ from JAX's)
KEYWORD_NAMES = {"argnum": "argnums", "in_axes": "in_dims", "out_axes": "out_dims", "aux": "has_aux"}

# every public transform, by name (``transform`` adds them); the pipeline's users are among them
TRANSFORMS: set[str] = set()


class CallError(FxtoolsError, TypeError):
    """A transform called the torch.func way (or with its arguments swapped): says the fxtools call."""


def transform(name: str, *, loss: bool = False) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate the public transform ``name`` (``"fxtools.grad"``), called ``fn(f, *args, **options)``,
    so that its calls are checked by ``check_call`` first (``loss``: ``registry.Transform.loss``)."""
    TRANSFORMS.add(name)

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            check_call(name, fn, args, kwargs, loss=loss)
            with grad_mode_of_a_transform():
                args, kwargs = pytree.tree_map_only(torch.Tensor, _ordinary, (args, kwargs))
                built = fn(*args, **kwargs)
            module: Any = built
            if kwargs.get("dynamic_shapes") is not None and isinstance(module, torch.fx.GraphModule):
                module.__dict__["size_one_variant"] = functools.partial(_static_variant, checked, args[0], len(args) - 1, kwargs)
            return built

        return checked

    return wrap


@contextlib.contextmanager
def grad_mode_of_a_transform():
    """Build with grad mode on and inference mode off, whatever the caller's modes are.

    A transform differentiates its function whatever mode it is built in, as torch.func's do
    (``torch.func.grad`` ignores an outer ``torch.no_grad()`` and honours the function's own
    blocks). The walkers read grad mode from the graph's ``_set_grad_enabled`` nodes starting
    from "on": traced under an outer ``no_grad``, the exit of an inner ``no_grad`` block would
    record "off" for the rest of the program (a silent gradient of 0). Under inference mode,
    every tensor made while building would be an inference tensor, which tracing refuses.
    """
    with torch.inference_mode(False), torch.enable_grad():
        yield


def _static_variant(transform_fn, f, n_examples: int, options: dict, call_args: tuple):
    """The module ``transform_fn`` builds from the call's own arguments (its first ``n_examples``,
    the function's; the rest are the transform's inputs), with static sizes: what a module made
    with a dynamic size runs for a call where that size is 1 (``GuardedGraphModule``)."""
    static = {k: v for k, v in options.items() if k != "dynamic_shapes"}
    return transform_fn(f, *call_args[:n_examples], **static)


def _ordinary(t: torch.Tensor) -> torch.Tensor:
    """An example made under ``torch.inference_mode()`` as an ordinary tensor of the same value
    (PyTorch cannot trace an inference tensor outside inference mode; the module is built from its
    shape, dtype and value, and takes inference tensors when called)."""
    return t.clone() if t.is_inference() else t


def check_call(name: str, fn, args: tuple, kwargs: dict, *, loss: bool = False) -> None:
    """Raise ``CallError`` for the torch.func and JAX habits that do not work with fxtools.

    ``loss``: the transform differentiates a scalar loss; given an nn.Module with parameters, a user
    may mean them (as the CLI does); a module without parameters (a generated GraphModule) is a
    function of its inputs alone."""
    usage = f"{name}(f, *example_args)"
    if not args:
        raise CallError(f"{name} needs the function and its example inputs: {usage}")
    f, examples = args[0], args[1:]
    if not callable(f):
        swapped = any(callable(a) and not isinstance(a, torch.Tensor) for a in examples)
        raise CallError(
            f"{name}'s first argument is the function to differentiate, got {_kind(f)}"
            + ("; the arguments look swapped" if swapped else "")
            + f": call {usage}, e.g. {name}(f, x)"
        )
    _check_keywords(name, fn, f, kwargs)
    _check_argnums(name, kwargs.get("argnums"))
    if not examples and _required_positional(f, kwargs):
        raise CallError(
            f"{name}(f) needs example inputs: fxtools builds the code from them (their shapes, dtypes and "
            f"structure), so call gm = {name}(f, x), then {module_call(name, ['x'])}; "
            "torch.func takes the inputs later, fxtools when it builds the module"
        )
    for i, a in enumerate(examples):
        if isinstance(a, (types.GeneratorType, map, filter)):
            raise CallError(
                f"{name}: example argument {i} is a generator (such as model.parameters()); fxtools needs the "
                "tensors themselves, keyed by name to be readable: pass dict(model.named_parameters()) "
                "to fxtools.functional(model)'s params"
            )
    if loss and isinstance(f, torch.nn.Module) and any(True for _ in f.parameters()):
        raise CallError(
            f"{name}({type(f).__name__}(...), ...) is ambiguous: for the gradient with respect to the model's "
            f"parameters (what the fxtools CLI computes), call {name}(fxtools.functional(model), "
            "dict(model.named_parameters()), *inputs); with respect to the inputs, pass model.forward"
        )


def _check_keywords(name: str, fn, f, kwargs: dict) -> None:
    """A keyword named as torch.func or JAX names it (``argnum``, ``in_axes``) gets fxtools' name,
    unless the transform or ``f`` itself takes a keyword of that name."""
    params = inspect.signature(fn).parameters
    accepted = set(params)
    passes_on = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for key in kwargs:
        if key in KEYWORD_NAMES and key not in accepted and not _takes_keyword(f, key):
            better = KEYWORD_NAMES[key]
            has = f" (as in torch.func): {name}(f, *args, {better}=...)" if better in accepted else ""
            raise CallError(f"{name} got an unexpected keyword argument {key!r}; fxtools calls it {better!r}{has}")
        if key not in accepted and not passes_on:
            options = ", ".join(p for p in params if params[p].kind is params[p].KEYWORD_ONLY)
            raise CallError(
                f"{name} got the keyword argument {key!r}, which is not one of its options ({options}). "
                f"{name} passes no keyword arguments on to f: the module it builds takes f's arguments, "
                "then its own inputs (cotangents, tangents, series), positionally. Bind it "
                f"to f: {name}(functools.partial(f, {key}=...), *args), or make it a positional argument; "
                "fxtools.grad and fxtools.value_and_grad pass keyword arguments on, as torch.func.grad does"
            )


def _check_argnums(name: str, argnums) -> None:
    """``argnums`` is None, an int or a non-empty tuple (or list) of ints, as in torch.func."""
    ok = argnums is None or _is_index(argnums)
    if isinstance(argnums, (tuple, list)):
        ok = bool(argnums) and all(_is_index(a) for a in argnums)
    if not ok:
        raise CallError(
            f"{name}: argnums must be an int or a non-empty tuple of ints (the positions of the arguments to "
            f"differentiate), got {argnums!r} ({type(argnums).__name__}); e.g. argnums=0 or argnums=(0, 1)"
        )


def _is_index(value) -> bool:
    return isinstance(value, int)


def _takes_keyword(f, key: str) -> bool:
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == key or p.kind is p.VAR_KEYWORD for p in params)


def _required_positional(f, kwargs: dict) -> bool:
    """Whether ``f`` has a positional parameter without a default that no keyword of the call
    names (a transform may pass its keywords on to ``f``); False if ``f`` cannot be inspected."""
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty and p.name not in kwargs for p in params
    )


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"
