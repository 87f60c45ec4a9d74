"""Forward mode inside a captured program: dual numbers as two kinds of marker nodes.

A training loss may take a JVP of the network (consistency models, MeanFlow, physics losses):
``torch.func.jvp``, ``torch.autograd.forward_ad`` or ``fxtools.jvp``, called in the function
fxtools differentiates. PyTorch's forward-mode AD is not run while fxtools captures (its fake
tensors and pre-dispatch trace cannot carry dual tensors, and several ops, attention among
them, have no forward-mode formula on CPU). Instead the capture records what forward mode
means, and ``transforms/tangents.py`` computes it with fxtools' own forward mode, the one
``fxtools.jvp`` uses:

- a primal given a tangent becomes ``dual(primal, tangent, level)``, a node whose value *is*
  the primal (the function runs on it and is recorded like any other code, once);
- an output's tangent becomes ``tangent(out, level)``, a node standing for the JVP of the ops
  between the level's duals and ``out``.

``level`` is an integer naming one ``torch.func.jvp`` call or ``dual_level()`` block (nested
ones get their own). After capture, ``tangents.resolve`` replaces each ``tangent`` node by the
transposed VJP of those ops and each ``dual`` node by its primal; later stages (``grad``,
``split``, ``compile``) then differentiate the tangent's code like any other, so a loss that does
not ``detach`` it gets its exact second-order terms.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx as fx
from torch.fx.experimental import proxy_tensor
from torch.utils import _pytree as pytree

from ..errors import FxtoolsError, current_user_line
from ..graph import meta
from ..registry import Transform
from . import custom

__all__ = ["dual", "tangent", "make_dual", "unpack", "jvp", "JvpCall", "forward_ad_levels", "run_jvp_region", "level_line"]

_COUNTER = itertools.count()
# what custom Functions called in the JVP'd code see: a transform pushing tangents forward (their own
# jvp would go unused, fxtools transposes their backward: refused)
FORWARD_MODE = Transform("torch.func.jvp", forward_mode=True)
_WHERE: dict[int, str] = {}  # level -> the user's line that opened it


def dual(primal, tangent, level):
    """Target of a ``dual`` marker node: the primal (``tangent`` rides along for the resolver)."""
    return primal


def tangent(value, level):
    """Target of a ``tangent`` marker node; ``tangents.resolve`` replaces every one before code runs."""
    raise FxtoolsError("internal error: a tangent of forward mode inside the program was never computed")


def level_line(level: int) -> str:
    """The user's line that opened ``level`` (a jvp call or a dual_level block)."""
    return _WHERE.get(level, "an unknown line")


def _new_level() -> int:
    level = next(_COUNTER)
    _WHERE[level] = current_user_line()
    return level


def _record(target, args: tuple, like: torch.Tensor, name: str) -> torch.Tensor:
    """A node ``target(*args)`` in the graph being captured, holding a fresh value like ``like``."""
    mode = proxy_tensor.get_proxy_mode()
    assert mode is not None, "forward-mode markers are recorded while fxtools captures"
    tracer = mode.tracer
    with proxy_tensor.disable_proxy_modes_tracing():
        value = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
    node_args = tuple(tracer.unwrap_proxy(a) if isinstance(a, torch.Tensor) else a for a in args)
    proxy = tracer.create_proxy("call_function", target, node_args, {}, name=name)
    proxy_tensor.track_tensor_tree(value, proxy, constant=None, tracer=tracer)
    return value


def make_dual(primal: torch.Tensor, tangent_: torch.Tensor, level: int) -> torch.Tensor:
    """``primal`` carrying ``tangent_`` at ``level`` (a ``dual`` node)."""
    if tuple(primal.shape) != tuple(tangent_.shape) or primal.dtype != tangent_.dtype:
        raise ValueError(
            f"a tangent must have its primal's shape and dtype (at {current_user_line()}): primal "
            f"{primal.dtype}{list(primal.shape)}, tangent {tangent_.dtype}{list(tangent_.shape)}"
        )
    return _record(dual, (primal, tangent_, level), primal, "dual")


def _node_of(value) -> fx.Node | None:
    mode = proxy_tensor.get_proxy_mode()
    if mode is None or not isinstance(value, torch.Tensor):
        return None
    slot = proxy_tensor.get_proxy_slot(value, mode.tracer, None)
    return slot.proxy.node if slot is not None else None


def depends_on_level(node: fx.Node, level: int) -> bool:
    """Whether ``node``'s value depends on a ``dual`` of ``level`` (a dual's value is its primal alone)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target is dual:
            if n.args[2] == level:
                return True
            stack.append(cast(fx.Node, n.args[0]))
        else:
            stack.extend(n.all_input_nodes)
    return False


def unpack(value, level: int):
    """The tangent of ``value`` at ``level`` (a ``tangent`` node), or None where it depends on no dual."""
    node = _node_of(value)
    if node is None or not (value.is_floating_point() or value.is_complex()) or not depends_on_level(node, level):
        return None
    return _record(tangent, (value, level), value, "tangent")


def jvp(func, primals, tangents, argnums=None, *, strict=False, has_aux=False):
    """``torch.func.jvp`` (and jacfwd's ``_jvp_with_argnums``) while fxtools captures: the same
    checks and results, computed with ``dual`` / ``tangent`` markers."""
    from torch._functorch.eager_transforms import _replace_args, _slice_argnums

    if not isinstance(primals, tuple):
        raise RuntimeError(
            "jvp(f, primals, tangents): Expected primals to be a tuple. E.g. it should be valid to call f(*primals)."
        )
    diff_args = primals if argnums is None else _slice_argnums(primals, argnums)
    flat_primals, primals_spec = pytree.tree_flatten(diff_args)
    flat_tangents, tangents_spec = pytree.tree_flatten(tangents)
    if primals_spec != tangents_spec:
        raise RuntimeError(
            "jvp(f, primals, tangents): Expected primals and tangents to have the same python structure. "
            f"Got primals with structure {primals_spec} and tangents with structure {tangents_spec}"
        )
    for what, flat in (("primals", flat_primals), ("tangents", flat_tangents)):
        if not flat or not all(isinstance(x, torch.Tensor) for x in flat):
            raise RuntimeError(f"jvp(f, primals, tangents): Expected {what} to be a non-empty tuple of Tensors")
    level = _new_level()
    duals = pytree.tree_unflatten([make_dual(p, t, level) for p, t in zip(flat_primals, flat_tangents)], primals_spec)
    args = duals if argnums is None else _replace_args(primals, duals, argnums)
    with custom.transform(FORWARD_MODE):  # a Function's own jvp would be ignored (its backward is transposed): refuse it
        out = func(*args)
    aux = None
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise RuntimeError(
                "jvp(f, primals, tangents): output of function f should be a tuple: (output, aux) if has_aux is True"
            )
        out, aux = out
    flat_out, spec = pytree.tree_flatten(out)
    if not flat_out or not all(isinstance(o, torch.Tensor) for o in flat_out):
        raise RuntimeError("jvp(f, primals, tangents): expected f(*args) to return only tensors")
    flat_tan = []
    for o in flat_out:
        t = unpack(o, level)
        if t is None:
            if strict:
                raise RuntimeError(
                    "jvp(f, primals, tangents, strict=True): The output of f is independent of the inputs. "
                    "This is not allowed with strict=True."
                )
            t = torch.zeros_like(o)
        flat_tan.append(t)
    _call_results([*flat_out, *flat_tan], flat_tan)
    result = (pytree.tree_unflatten(flat_out, spec), pytree.tree_unflatten(flat_tan, spec))
    return (*result, aux) if has_aux else result


def _call_results(leaves: list, tangents: list) -> None:
    """Stamp the nodes of a jvp's results with their place in them, so that ``u, dudt = jvp(...)``
    names them ``u`` and ``dudt`` (``capture/names.py``), wherever the network computed ``u``."""
    marker = next((_node_of(t) for t in tangents if _node_of(t) is not None), None)
    trace = marker.meta.get("stack_trace") if marker is not None else None
    if trace:
        for k, leaf in enumerate(leaves):
            node = _node_of(leaf)
            if node is not None and not meta.CALL_RESULT.on(node):
                meta.CALL_RESULT.set(node, (trace, k))


class JvpCall:
    """What ``fxtools.jvp(f, *args)`` returns inside a program fxtools captures: called as its module
    would be, ``(*args, *tangents of argnums)``, it records the JVP with markers like ``jvp``."""

    def __init__(self, f, nargs: int, argnums: tuple, has_aux: bool):
        self.f, self.nargs, self.argnums, self.has_aux = f, nargs, argnums, has_aux

    def __call__(self, *args_and_tangents):
        if len(args_and_tangents) != self.nargs + len(self.argnums):
            raise TypeError(
                f"the JVP of {getattr(self.f, '__name__', 'f')} takes {self.nargs} arguments and "
                f"{len(self.argnums)} tangents, got {len(args_and_tangents)} values"
            )
        args, tangents = args_and_tangents[: self.nargs], args_and_tangents[self.nargs :]
        if not torch.compiler.is_dynamo_compiling():
            return jvp(self.f, tuple(args), tuple(tangents), self.argnums, has_aux=self.has_aux)

        def of_argnums(*primals):  # Dynamo traces torch.func.jvp into the graph a backend gets
            full = list(args)
            for a, p in zip(self.argnums, primals):
                full[a] = p
            return self.f(*full)

        primals = tuple(args[a] for a in self.argnums)
        return torch.func.jvp(of_argnums, primals, tuple(tangents), has_aux=self.has_aux)


class _ForwardAdLevels:
    """``torch.autograd.forward_ad``'s levels (``dual_level()``, ``make_dual``, ``unpack_dual``) as
    marker levels: forward_ad numbers its levels 0, 1, ... and reuses them; each entry gets a fresh
    marker level."""

    def __init__(self):
        self.open: list[int] = []
        self.refusing: list = []  # custom.transform blocks, one per open level

    def enter(self) -> int:
        self.open.append(_new_level())
        self.refusing.append(custom.transform(FORWARD_MODE))  # as in ``jvp``
        self.refusing[-1].__enter__()
        return len(self.open) - 1

    def exit(self, *, level=None) -> None:
        self.open.pop()
        self.refusing.pop().__exit__(None, None, None)

    def _marker_level(self, level: int) -> int:
        return self.open[level]

    def make_dual(self, tensor, tangent_, *, level=0):
        return make_dual(tensor, tangent_, self._marker_level(level))

    def unpack_dual(self, tensor, *, level=0):
        return tensor, unpack(tensor, self._marker_level(level))


@contextlib.contextmanager
def forward_ad_levels(active):
    """While active, ``torch.autograd.forward_ad`` records markers (where ``active()`` says fxtools
    captures the program itself, not a transform traced below functorch)."""
    import torch._functorch.predispatch as predispatch

    levels = _ForwardAdLevels()
    names: dict[str, Callable[..., Any]] = {
        "_enter_dual_level": levels.enter,
        "_exit_dual_level": levels.exit,
        "_make_dual": levels.make_dual,
    }
    names["_unpack_dual"] = levels.unpack_dual
    saved = {name: getattr(predispatch, name) for name in names}

    def choose(name):
        def call(*args, **kwargs):
            return (names[name] if active() else saved[name])(*args, **kwargs)

        return call

    for name in names:
        setattr(predispatch, name, choose(name))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(predispatch, name, original)


_REGION_NO_OPS = {
    "_jvp_increment_nesting",
    "_jvp_decrement_nesting",
    "_set_fwd_grad_enabled",
    "_maybe_load_decompositions",
    "lazy_load_decompositions",
}
_REGION_IDENTITIES = {"_unwrap_for_grad", "_wrap_for_grad"}


def is_jvp_region(body: fx.GraphModule) -> bool:
    """A Dynamo region of forward mode alone (``torch.func.jvp`` or ``forward_ad`` spelt out)."""
    names = {getattr(n.target, "__name__", None) for n in body.graph.nodes if n.op == "call_function"}
    functorch = {n for n in names if n and n.startswith(("_vmap_", "_grad_", "_saved_tensors_hooks"))}
    return "_make_dual" in names and not functorch


def run_jvp_region(body: fx.GraphModule, inputs: tuple):
    """A Dynamo graph's forward-mode region run with markers: its functorch bookkeeping dropped,
    ``_make_dual`` / ``_unpack_dual`` recorded as ``dual`` / ``tangent`` nodes."""
    levels = _ForwardAdLevels()

    class Region(fx.Interpreter):
        def call_function(self, target, args, kwargs):
            name = getattr(target, "__name__", None)
            if name in _REGION_NO_OPS:
                return None
            if name in _REGION_IDENTITIES:
                return args[0]
            if name == "_enter_dual_level":
                return levels.enter()
            if name == "_exit_dual_level":
                return levels.exit(**kwargs)
            if name == "_make_dual":
                return levels.make_dual(*args, **kwargs)
            if name == "_unpack_dual":
                primal, tan = levels.unpack_dual(*args, **kwargs)
                return primal, torch.zeros_like(primal) if tan is None else tan
            return super().call_function(target, args, kwargs)

    return Region(body).run(*inputs)
