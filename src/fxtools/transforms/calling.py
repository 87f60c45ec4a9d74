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
import gc
import inspect
import types
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

import torch
from torch.utils import _pytree as pytree

from ..capture.nested import capturing_program
from ..errors import FxtoolsError
from ..graph.nodes import op_facts_kept
from ..signature.guards import module_call
from ..signature.naming import arg_names
from .inside import call_inside

P = ParamSpec("P")
R = TypeVar("R")

# torch.func's / JAX's keyword names, with fxtools' (which are torch.func's where they differ from JAX's)
KEYWORD_NAMES = {"argnum": "argnums", "in_axes": "in_dims", "out_axes": "out_dims", "aux": "has_aux"}

# every public transform, by name (``transform`` adds them); the pipeline's users are among them
TRANSFORMS: set[str] = set()


class CallError(FxtoolsError, TypeError):
    """A transform called the torch.func way (or with its arguments swapped): says the fxtools call."""


def transform(name: str, *, loss: bool = False, keywords: bool = False) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate the public transform ``name`` (``"fxtools.grad"``), called ``fn(f, *args, **options)``,
    so that its calls are checked by ``check_call`` first (``loss``, ``keywords``: ``registry.Transform``'s).

    With ``keywords``, a keyword that is not one of ``fn``'s options is ``f``'s, as torch.func.grad
    passes them on (``with_keywords``): an input of the module after ``f``'s positional ones,
    neither differentiated nor batched, called by keyword (``gm(x, grad_out, scale=2.0)``)."""
    TRANSFORMS.add(name)

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        options = inspect.signature(fn).parameters

        @functools.wraps(fn)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            check_call(name, fn, args, kwargs, loss=loss, keywords=keywords)
            own = {k: v for k, v in kwargs.items() if k not in options}
            if capturing_program():  # called inside a program fxtools captures: no module to build
                bound = inspect.signature(fn).bind(*args, **{k: v for k, v in kwargs.items() if k in options})
                bound.apply_defaults()
                form = call_inside(name, dict(bound.arguments))
                if form is not None:
                    return cast(R, form)
            with grad_mode_of_a_transform(), cyclic_gc_paused(), op_facts_kept():
                args, kwargs = pytree.tree_map_only(torch.Tensor, _ordinary, (args, kwargs))
                call_args: tuple = args
                call_options: dict = kwargs
                if own:
                    call_args, call_options = keywords_as_arguments(options, args, kwargs, tuple(own))
                built = fn(*call_args, **call_options)
            module: Any = built
            if isinstance(module, torch.fx.GraphModule) and own:
                module.__dict__["keywords"] = tuple(own)
            if kwargs.get("dynamic_shapes") is not None and isinstance(module, torch.fx.GraphModule):
                module.__dict__["size_one_variant"] = functools.partial(
                    _static_variant, checked, args[0], len(args) - 1, kwargs, tuple(own)
                )
            if isinstance(module, torch.fx.GraphModule):
                module.__dict__["layout_variant"] = functools.partial(
                    _layout_variant, checked, args[0], len(args) - 1, kwargs, tuple(own)
                )
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


@contextlib.contextmanager
def cyclic_gc_paused():
    """Build without Python's cyclic garbage collector (as ``torch.distributed.checkpoint``'s
    ``state_dict`` does while it makes many Python objects), re-enabled on the way out if it was on.

    A build makes hundreds of thousands of Python objects (graph nodes, their metadata,
    FakeTensors) that mostly stay alive, so the collector's passes during it find little and
    each older-generation pass walks every object of the process: about a tenth of a GPT-2-sized
    ``fxtools.split`` (``benchmarks/bench_issue33.py``). The build's own cyclic garbage (tens of
    thousands of objects) is left to the next collection. Nothing a build does depends on when
    garbage is collected; nested builds (``hvp`` building a ``grad``) leave it to the outermost.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _static_variant(transform_fn, f, n_examples: int, options: dict, own: tuple, call_args: tuple):
    """The module ``transform_fn`` builds from the call's own arguments (its first ``n_examples``,
    the function's, then its keywords ``own``; the rest are the transform's inputs), with static
    sizes: what a module made with a dynamic size runs for a call where that size is 1
    (``GuardedGraphModule``)."""
    static = {k: v for k, v in options.items() if k != "dynamic_shapes"}
    static.update(zip(own, call_args[n_examples : n_examples + len(own)]))
    return transform_fn(f, *call_args[:n_examples], **static)


def _layout_variant(transform_fn, f, n_examples: int, options: dict, own: tuple, call_args: tuple):
    """The module ``transform_fn`` builds from the call's own arguments, in their layout: what a
    module runs for a call whose layout its ``.view`` calls cannot view (a ``reshape`` traced on a
    contiguous example is a view; traced on this layout it copies, as eager's does)."""
    opts = dict(options)
    opts.update(zip(own, call_args[n_examples : n_examples + len(own)]))
    return transform_fn(f, *call_args[:n_examples], **opts)


def keywords_as_arguments(options, args: tuple, kwargs: dict, own: tuple) -> tuple[tuple, dict]:
    """The call ``fn(*args, **kwargs)`` of a transform with ``options``, ``f``'s keywords ``own``
    (among ``kwargs``) turned into further positional arguments (``with_keywords``): ``argnums``
    count ``f``'s positional arguments alone (None, all of them), ``in_dims`` and tuple
    ``dynamic_shapes`` get ``None`` for each keyword (not batched, static)."""
    f, examples = args[0], args[1:]
    n, k = len(examples), len(own)
    opts = {key: v for key, v in kwargs.items() if key not in own}
    if "argnums" in options:
        nums = opts.get("argnums", options["argnums"].default)
        opts["argnums"] = tuple(range(n)) if nums is None else _within(nums, n)
    if "in_dims" in options:
        dims = opts.get("in_dims", options["in_dims"].default)
        opts["in_dims"] = (tuple(dims) if isinstance(dims, (tuple, list)) else (dims,) * n) + (None,) * k
    if isinstance(opts.get("dynamic_shapes"), (tuple, list)):
        opts["dynamic_shapes"] = tuple(opts["dynamic_shapes"]) + (None,) * k
    g, examples = with_keywords(f, examples, {key: kwargs[key] for key in own})
    return (g, *examples), opts


def _within(argnums, n: int):
    """``argnums`` with negative indices counted from the end of ``f``'s ``n`` positional arguments."""
    if isinstance(argnums, (tuple, list)):
        return type(argnums)(_within(a, n) for a in argnums)
    return argnums % n if isinstance(argnums, int) and -n <= argnums < 0 else argnums


def with_keywords(f, args: tuple, kwargs: dict):
    """``f`` taking its keyword arguments ``kwargs`` as further positional arguments named by
    their keywords (so the generated module's signature is ``(*args, *keywords, ...)`` and it may
    be called with them by keyword), and the example arguments to match."""
    n, keys = len(args), tuple(kwargs)
    names = arg_names(f.forward if isinstance(f, torch.nn.Module) else f, n)
    clash = sorted(set(keys) & set(names))
    if clash:
        raise TypeError(f"{getattr(f, '__name__', 'f')}() got multiple values for argument {clash[0]!r}")

    def call(*a):
        return f(*a[:n], **dict(zip(keys, a[n:])))

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    call.__signature__ = inspect.Signature([inspect.Parameter(k, kind) for k in (*names, *keys)])  # type: ignore[attr-defined]
    call.__name__ = getattr(f, "__name__", type(f).__name__)
    return call, (*args, *kwargs.values())


def _ordinary(t: torch.Tensor) -> torch.Tensor:
    """An example made under ``torch.inference_mode()`` as an ordinary tensor of the same value
    (PyTorch cannot trace an inference tensor outside inference mode; the module is built from its
    shape, dtype and value, and takes inference tensors when called)."""
    return t.clone() if t.is_inference() else t


def check_call(name: str, fn, args: tuple, kwargs: dict, *, loss: bool = False, keywords: bool = False) -> None:
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
    _check_keywords(name, fn, f, kwargs, keywords)
    _check_argnums(name, kwargs.get("argnums"))
    if not examples and _required_positional(f, kwargs):
        raise CallError(
            f"{name}(f) needs example inputs: fxtools builds the code from them (their shapes, dtypes and "
            f"structure), so call gm = {name}(f, x), then {module_call(name, ['x'])}; "
            "torch.func takes the inputs later, fxtools when it builds the module"
        )
    if examples:
        _check_arity(name, fn, f, examples, kwargs)
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


# where torch.func takes tuples of primals and tangents, fxtools takes the primals as examples
_TANGENTS_LATER = {"fxtools.jvp", "fxtools.hvp", "fxtools.linearize", "fxtools.jet"}


def _check_arity(name: str, fn, f, examples: tuple, kwargs: dict) -> None:
    """The example arguments (and the keywords that go to ``f``) must be ones ``f`` can be called
    with, else the trace would fail inside ``f`` with Python's bare TypeError. Not checked for
    generated modules (their calls are checked by their guards), what cannot be inspected, or
    through a decorator's ``functools.wraps``: a wrapper may take other arguments than the
    function it names (one that supplies an argument itself)."""
    if isinstance(f, torch.fx.GraphModule):
        return
    if isinstance(f, torch.nn.Module) and (f._forward_pre_hooks or torch.nn.modules.module._global_forward_pre_hooks):
        return  # a pre-hook may change the arguments forward receives
    target = f.forward if isinstance(f, torch.nn.Module) else f
    if getattr(target, "__module__", None) and str(target.__module__).startswith("fxtools."):
        return  # fxtools' own wrappers (keywords carried positionally): their callers check them
    try:  # a decorator's wrapper as it is (functools.wraps may name a signature it does not have)
        signature = inspect.signature(target, follow_wrapped=False)
    except (TypeError, ValueError):
        return
    options = inspect.signature(fn).parameters
    own = {k: v for k, v in kwargs.items() if k not in options}
    own.update(kwargs.get("example_kwargs") or {})
    try:
        signature.bind(*examples, **own)
    except TypeError as exc:
        what = getattr(target, "__qualname__", None) or type(f).__name__
        hint = ""
        if name in _TANGENTS_LATER:
            hint = f"; the tangents are the module's inputs, not examples: gm = {name}(f, *primals), then gm(*primals, *tangents)"
            if any(isinstance(a, (tuple, list)) for a in examples):
                hint += f" (torch.func.{name.split('.')[-1]}(f, primals, tangents) takes them together)"
        raise CallError(
            f"{name}: {what}{signature} cannot take the {len(examples)} example argument(s) given ({exc}); "
            f"the examples are f's own arguments, as f would be called: {name}(f, *args){hint}"
        ) from None


def _check_keywords(name: str, fn, f, kwargs: dict, keywords: bool) -> None:
    """A keyword named as torch.func or JAX names it (``argnum``, ``in_axes``) gets fxtools' name,
    unless the transform or ``f`` itself takes a keyword of that name; any other keyword that is
    not an option of the transform is ``f``'s (``keywords``), which ``f`` must take."""
    params = inspect.signature(fn).parameters
    accepted = set(params)
    options = ", ".join(p for p in params if params[p].kind is params[p].KEYWORD_ONLY)
    for key in kwargs:
        if key in KEYWORD_NAMES and key not in accepted and not _takes_keyword(f, key, False):
            better = KEYWORD_NAMES[key]
            has = f" (as in torch.func): {name}(f, *args, {better}=...)" if better in accepted else ""
            raise CallError(f"{name} got an unexpected keyword argument {key!r}; fxtools calls it {better!r}{has}")
        if key in accepted:
            continue
        if not keywords:
            raise CallError(
                f"{name} got the keyword argument {key!r}, which is not one of its options ({options}). "
                f"{name} passes no keyword arguments on to f: its module takes f's arguments, then its "
                f"own inputs, positionally. Bind it to f: {name}(functools.partial(f, {key}=...), *args)"
            )
        if not _takes_keyword(f, key, True):
            raise CallError(
                f"{name} got the keyword argument {key!r}, which is neither one of its options ({options}) "
                f"nor a parameter of the function {getattr(f, '__name__', 'f')}"
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


def _takes_keyword(f, key: str, uninspectable: bool) -> bool:
    """Whether ``f`` takes the keyword ``key`` (``uninspectable`` if its signature cannot be read)."""
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return uninspectable
    return any(p.name == key or p.kind is p.VAR_KEYWORD for p in params)


def _required_positional(f, kwargs: dict) -> bool:
    """Whether ``f`` has a positional parameter without a default that no keyword of the call
    names (a transform may pass its keywords on to ``f``); False if ``f`` cannot be inspected.
    A module's are its ``forward``'s (a generated module's ``__call__`` takes ``*args``)."""
    try:
        params = inspect.signature(f.forward if isinstance(f, torch.nn.Module) else f).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty and p.name not in kwargs for p in params
    )


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"
