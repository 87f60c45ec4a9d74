"""The one pipeline every transform goes through: a shared front, the transform, a shared back.

::

    f, args ──front──▶ Captured ──transform──▶ flat graph ──back──▶ GraphModule (guarded, readable)

- ``front(f, args, made_by=...)``: capture (``capture/trace.py``: one flat ATen graph, pytree
  signature, names, symbolic sizes, closed-over reads), then make the graph ready for any
  transform: functionalised (no in-place ops), composite ops expanded, control flow given its
  rules, unsupported constructs refused. Returns a ``Captured`` (every field declared).
- the transform: whatever it does to ``cap.gm`` (``reverse``, the transpose of a VJP, a Taylor
  walk, a min-cut), it returns a *flat* graph: one placeholder per tensor leaf of the
  arguments (then its own extra inputs), and a flat list of outputs.
- ``back(flat_gm, cap, build, made_by, Inputs(args, ...))``: the flat graph as the user's module: the pytree
  signature (``codegen/assemble.py``, ``build`` nests the flat results), simplification, public
  PyTorch spellings and names, symbolic size names, guards of the arguments and of what the
  program read from outside them. ``emit`` is its last step alone, for modules whose signature
  a transform builds itself (``split``'s two graphs, ``linearize``'s map).

Every module the back finishes is stamped (``meta.BUILT_BY``: which transform's front prepared
its program, which transform finished it). A transform is a ``Transform`` record, declared once
in its module and passed as ``made_by`` (never its name). ``USERS`` registers each public transform with what
it requires of the front and ensures of the module it returns (in the spirit of torch.fx's
``PassBase``); ``tests/test_pipeline.py`` checks that every public transform is registered and
that what it returns carries the stamp.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import rules  # noqa: F401  (registers fxtools' own rules)
from ..capture.decompose import expand
from ..capture.functionalize import functionalize
from ..capture.nested import out_of_place_views
from ..capture.trace import Captured, capture, check_supported, check_views, detach_parameters_in_no_grad, realize_constants
from ..codegen.assemble import assemble
from ..codegen.render import render
from ..codegen.show import remember_inputs
from ..graph import meta
from ..graph.nodes import is_float
from ..passes.accumulate import accumulate_into_scatters
from ..passes.simplify import simplify
from ..passes.views import collapse_view_chains
from ..registry import TRANSFORMS, Transform
from ..signature import closures, sizes
from ..signature.guards import install
from ..signature.naming import unique
from . import control_flow, tangents
from .calling import transform

__all__ = ["Built", "Inputs", "Transform", "USERS", "uses_pipeline", "front", "differentiated", "back", "emit", "built_by"]

F = TypeVar("F", bound=Callable[..., Any])


# --------------------------------------------------------------------------------------------
# The registry of pipeline users
# --------------------------------------------------------------------------------------------


USERS: dict[str, Transform] = TRANSFORMS  # the registry's table (signature/ reads it for messages)


def uses_pipeline(record: Transform) -> Callable[[F], F]:
    """Declare the public transform ``record`` (its module's one ``Transform``, kept in ``USERS``
    by name) as a user of the front and back, its calls checked first (``calling.transform``).
    The record is the transform's identity: the front, the back and ``emit`` take it as
    ``made_by``; only messages and stamps use its name."""
    USERS[record.name] = record

    def register(fn: F) -> F:
        return cast(F, transform(record.name, loss=record.loss, keywords=record.keywords)(fn))

    return register


@dataclass(frozen=True)
class Built:
    """The stamp the back leaves on a module (``meta.BUILT_BY``)."""

    front: str | None  # the transform whose front prepared the program (None: none did)
    back: str  # the transform that finished the module


def built_by(gm: fx.GraphModule) -> Built | None:
    """The stamp of ``gm``, or None if the shared back did not finish it."""
    return meta.BUILT_BY.get(gm)


# --------------------------------------------------------------------------------------------
# Front: f, args, options -> Captured
# --------------------------------------------------------------------------------------------


def front(
    f,
    args: tuple,
    *,
    made_by: Transform,
    argnums: Sequence[int] = (),
    dynamic_shapes=None,
    has_aux: bool = False,
    batched: bool = False,
    after_capture: Callable[[fx.GraphModule], None] | None = None,
    grad_leaves: Sequence[bool] | None = None,
) -> Captured:
    """Capture ``f(*args)`` and prepare its graph for a transform (see the module docstring).

    ``argnums``: the arguments the transform differentiates (an ``nn.Module`` there is refused:
    fxtools differentiates tensors); ``grad_leaves``: of their tensor leaves, those that get a
    gradient (one bool per tensor leaf; None: all). In-place writes are checked against these
    alone (a buffer argument updated under ``no_grad`` and not differentiated is no gradient's
    concern). ``has_aux``: ``f`` returns ``(out, aux)``; gradients stop at
    ``aux``'s tensors. ``batched``: ``f`` calls torch.func transforms and is traced below them
    (``fxtools.vmap``): the graph holds PyTorch's batched ops, functionalised, and is not
    differentiated further. ``after_capture`` sees the graph as traced (to name its nodes).
    """
    args = tuple(args)
    _refuse_module_arguments(f, args, argnums, made_by)
    cap = capture(f, args, dynamic_shapes=dynamic_shapes, pre_dispatch=not batched)
    if after_capture is not None:
        after_capture(cap.gm)
    if batched:
        detach_parameters_in_no_grad(cap.gm, drop_switches=True)  # vmap's code has no no_grad block
        realize_constants(cap.gm)
        out_of_place_views(cap.gm)
        functionalize(cap.gm)
    else:
        _prepare_for_rules(cap, made_by, has_aux, differentiated(cap, argnums, grad_leaves) if argnums else None)
    cap.front = made_by.name
    return cap


def _prepare_for_rules(cap: Captured, made_by: Transform, has_aux: bool, wrt: list[bool] | None) -> None:
    """The captured graph as the rule-driven transforms take it: sizes as marked, aux stopped,
    functional, composite ops expanded, control flow with rules, the program's own JVPs computed
    (``tangents.resolve``), nothing unsupported."""
    sizes.check(cap.symbolic, cap.gm)  # the program itself specialised a marked size
    if has_aux:
        stop_aux_gradients(cap, made_by)
    functionalize(cap.gm, wrt)
    expand(cap.gm)
    control_flow.prepare(cap.gm)
    tangents.resolve(cap.gm)  # forward mode the program runs itself (torch.func.jvp in a loss)
    check_supported(cap.gm)
    check_views(cap.gm)


def _refuse_module_arguments(f, args: tuple, argnums: Sequence[int], made_by: Transform) -> None:
    from ..signature.naming import arg_names

    for i in argnums:
        if isinstance(args[i], torch.nn.Module):
            name = arg_names(f.forward if isinstance(f, torch.nn.Module) else f, len(args))[i]
            raise ValueError(
                f"{made_by}: argument {name} (argnums {i}) is an nn.Module; fxtools differentiates tensors. "
                f"Differentiate fxtools.functional({name}), which takes its parameters as a dict, or leave it out "
                "of argnums (a module argument is read as the program's state, its parameters at each call)."
            )


def stop_aux_gradients(cap: Captured, made_by: Transform) -> None:
    """For ``has_aux=True``: check that ``f`` returns a pair ``(out, aux)`` and stop gradients at
    ``aux``'s tensors (as torch.func does: aux carries no cotangent), by reading them through
    ``detach`` (which the generated code does not show: it runs without autograd)."""
    spec = cap.out_spec
    if spec.type is not tuple or spec.num_children != 2:
        got = pytree.tree_unflatten([describe_leaf(v) for v in cap.out_leaves], spec)
        raise ValueError(
            f"{made_by}(..., has_aux=True) needs f to return a pair (output, aux), got {got!r}; "
            "return a tuple of two items, the second being the auxiliary data (any pytree)"
        )
    n_main = spec.child(0).num_leaves
    output = next(n for n in cap.gm.graph.nodes if n.op == "output")
    leaves = list(output.args[0])
    for i in range(n_main, len(leaves)):
        node = leaves[i]
        if isinstance(node, fx.Node) and is_float(node.meta.get("val")):
            with cap.gm.graph.inserting_before(output):
                detached = cap.gm.graph.call_function(torch.ops.aten.detach.default, (node,))
            detached.meta.update(node.meta)
            leaves[i] = detached
    output.args = (leaves,)
    cap.gm.recompile()


class _Shown:
    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text


def describe_leaf(v):
    """A tensor leaf as ``float32[3, 4]`` in messages about an output's structure."""
    if isinstance(v, torch.Tensor):
        return _Shown(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}")
    return v


def differentiated(cap: Captured, argnums: Sequence[int], grad_leaves: Sequence[bool] | None = None) -> list[bool]:
    """One bool per tensor leaf (placeholder) of ``cap``: does it belong to an argument in ``argnums``
    (and, where ``grad_leaves`` gives one bool per tensor leaf, is it marked there)?"""
    nums = set(argnums)
    wrt = [cap.arg_of_leaf[i] in nums for i, t in enumerate(cap.tensor_leaf) if t]
    if grad_leaves is None:
        return wrt
    marks = [bool(g) for g in grad_leaves]
    if len(marks) != len(wrt):
        raise ValueError(f"grad_leaves has {len(marks)} entries for {len(wrt)} tensor leaves")
    return [w and g for w, g in zip(wrt, marks)]


# --------------------------------------------------------------------------------------------
# Back: flat graph, Captured -> GraphModule
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """What the module the back finishes is called with: the user's ``args``, then the
    transform's own ``extra`` inputs (``(name, example)``: cotangents, tangents, series).
    ``guard_extra``: what the guards accept for the extra inputs (default: their examples);
    ``roles``: how messages describe them (by argument index); ``names``: the arguments' names
    when ``cap.f`` is a wrapper the transform traced in place of the user's function."""

    args: tuple
    extra: Sequence[tuple[str, Any]] = ()
    guard_extra: Sequence[Any] | None = None
    roles: dict | None = None
    names: list[str] | None = None


def back(
    flat_gm: fx.GraphModule,
    cap: Captured,
    build: Callable[[list], Any],
    made_by: Transform,
    inputs: Inputs,
    *,
    collapse_views: bool = False,
) -> fx.GraphModule:
    """The user's module from a transform's flat graph (see the module docstring).

    ``build`` nests the flat results as the module returns them; ``inputs`` says what the module
    is called with. ``collapse_views``: also collapse chains of reshapes that end where they
    started (batched and forward-mode code), and drop ``_1`` suffixes fusions left.
    """
    args, roles, guard_extra = inputs.args, inputs.roles, inputs.guard_extra
    names = cap.arg_names if inputs.names is None else inputs.names
    extra_args = list(
        zip(unique([n for n, _ in inputs.extra], taken=names), (v for _, v in inputs.extra))
    )  # the user's names stay
    gm = assemble(flat_gm, names, args, cap.tensor_leaf, cap.names, build, extra_args)
    accumulate_into_scatters(gm)
    simplify(gm)
    if collapse_views:
        while collapse_view_chains(gm):
            simplify(gm)
    sizes.check(cap.symbolic, gm)
    if collapse_views:
        tidy_names(gm)
    gm = emit(gm, cap, made_by, remember=False)
    extra = [v for _, v in extra_args] if guard_extra is None else list(guard_extra)
    examples = [*args, *extra]
    gm = install(gm, made_by.name, [*names, *(n for n, _ in extra_args)], sizes.concrete(cap.symbolic, examples), roles=roles)
    sizes.guard_symbolic(gm.guards, cap.traced_sizes(), examples)
    closures.attach(gm, cap.reads, made_by.name)
    return remember_inputs(gm)


def emit(
    gm: fx.GraphModule, cap: Captured | None, made_by: Transform, *, front: str | None = None, remember=True
) -> fx.GraphModule:
    """The back's last step: public spellings and names (``codegen/render.py``), symbolic sizes
    named, the graph checked, its code generated, the module stamped (``meta.BUILT_BY``: ``front``,
    default ``cap.front``) and its example inputs remembered (``fxtools.show``)."""
    render(gm)
    sizes.name_sizes(gm, cap.symbolic if cap is not None else None)
    gm.graph.lint()
    gm.recompile()
    meta.BUILT_BY.set(gm, Built(cap.front if front is None and cap is not None else front, made_by.name))
    return remember_inputs(gm) if remember else gm


def tidy_names(gm: fx.GraphModule) -> None:
    """``tangent_out_1`` -> ``tangent_out`` when the shorter name is free (after fusions)."""
    taken = {n.name for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        m = re.fullmatch(r"((?:tangent|grad|hvp)_\w+?)_\d+", node.name)
        if m and m.group(1) not in taken:
            node.name = m.group(1)  # the graph namespace still lists it; harmless: names are unique
            taken.add(node.name)
