"""``fxtools.compile`` under ``torch.distributed``: DDP and FSDP2 run around fxtools' graphs.

fxtools captures a module as one graph of its forward and backward; the data-parallel wrappers
stay eager and run *around* that graph, exactly where they run in an eager step:

- ``DistributedDataParallel(fxtools.compile(model))`` and ``fully_shard(fxtools.compile(model))``
  need nothing from fxtools: the wrapper calls the compiled module (FSDP2's hooks all-gather the
  parameters before it, DDP's and FSDP2's backward hooks reduce its gradients after it).
- ``fxtools.compile(DistributedDataParallel(model))``, ``fxtools.compile(fully_shard(model))``
  and models whose submodules are sharded (``fully_shard(block)`` for each block, then
  ``fully_shard(model)``) are captured *without* the wrappers: fxtools traces ``ddp.module`` with
  FSDP2's hooks quiet (as they are when activation checkpointing recomputes a forward: only
  mixed-precision casts, which the graph then contains), so the graph takes the unsharded
  parameters as inputs. Each call then goes through the wrappers for real: DDP's forward, then
  every FSDP2 module's forward hooks from the outermost in (all-gathers, the registration of the
  backward hooks that reduce-scatter the gradients; the inner modules' hooks get no inputs),
  and the graph runs where the innermost forward would. All the sharded modules' parameters
  are therefore gathered for the whole graph at once; compile each block and shard it
  (``fully_shard(fxtools.compile(block, h))``) to gather them block by block instead.

Hooks of one's own on these modules would run twice (traced into the graph, and around it),
so they are refused with an error naming the module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..capture.subclasses import LocalView, is_subclass, local, local_view
from ..errors import FxtoolsError
from .saved import differentiated

__all__ = ["SubclassLeaves", "Wrappers", "communicated_bytes", "local_view", "with_subclass_leaves"]


@functools.cache
def _ddp_type() -> type | None:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return None
    return DistributedDataParallel


@functools.cache
def _fsdp_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return None
    return FSDPModule


def unwrapped(model: nn.Module) -> nn.Module:
    """``model`` without its DistributedDataParallel wrappers: the module fxtools captures."""
    ddp = _ddp_type()
    while ddp is not None and isinstance(model, ddp):
        model = model.module  # type: ignore[assignment]
    return model


@functools.cache
def _module_states():
    """torch.distributed's table of the modules holding a composable state (``fully_shard``'s)."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return {}
    return _module_state_mapping


def sharded_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 (``fully_shard``) modules in ``model``, outermost first."""
    fsdp = _fsdp_type()
    return [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp)]


class Wrappers:
    """The DDP and FSDP2 wrappers of ``model`` (see the module docstring).

    ``call(fn, args, kwargs)`` runs ``fn(*args, **kwargs)`` inside them, as ``model(*args,
    **kwargs)`` would run its forward; ``capturing()`` is the context in which ``fn`` may trace the
    unwrapped module.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.inner = unwrapped(model)
        self._swapped: list[nn.Module] = []
        self._sharded: tuple[int, list[nn.Module]] = (0, [])

    def sharded(self) -> list[nn.Module]:
        """``sharded_modules(self.inner)``, walked again only when the number of modules with a
        distributed state changed (a module sharded since): a call costs no walk of the model."""
        count = len(_module_states())
        if count != self._sharded[0]:
            self._sharded = (count, sharded_modules(self.inner) if count else [])
        return self._sharded[1]

    def call(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)`` inside the wrappers, where the unwrapped module's forward runs."""
        sharded = self.sharded()
        if self.inner is self.model and not sharded:
            return fn(*args, **kwargs)
        with self._forwards(self._chain(sharded), fn):
            return self.model(*args, **kwargs)

    def prepare(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)`` where it can trace the unwrapped module, for a call that makes graphs
        without running them: inside FSDP2's hooks only (to see the unsharded parameters), and
        resharded afterwards (as after a training step: an optimizer built next gets the sharded
        parameters)."""
        sharded = self.sharded()
        if self.inner is not self.model:
            self._chain(sharded)  # refuse hooks that would run twice now, not at the first step
        if not sharded:
            return fn(*args, **kwargs)
        with self._forwards(self._chain(sharded), fn):
            out = self.inner(*args, **kwargs)
        for module in sharded:
            module.reshard()  # type: ignore[operator]
        return out

    def _chain(self, sharded: list[nn.Module]) -> list[nn.Module]:
        """The unwrapped module, then the FSDP2 modules in it, outermost first."""
        chain = [self.inner, *(m for m in sharded if m is not self.inner)]
        for module in chain:
            _refuse_own_hooks(module)
        return chain

    @contextlib.contextmanager
    def _forwards(self, chain: list[nn.Module], fn: Callable) -> Iterator[None]:
        """Replace the forwards of ``chain``: the first one's calls the second module (its hooks, with
        no arguments: only the first module's forward takes the inputs), and so on; the last one's
        calls ``fn`` with the inputs the first one received."""
        received: dict = {}

        def first(*args, **kwargs):
            received.update(args=args, kwargs=kwargs)
            return chain[1]() if len(chain) > 1 else fn(*args, **kwargs)

        def last():
            return fn(*received["args"], **received["kwargs"])

        forwards = [first, *(_calling(m) for m in chain[2:]), *([last] if len(chain) > 1 else [])]
        for module in chain:
            if "forward" in module.__dict__:
                raise FxtoolsError(
                    f"{type(module).__name__} has a forward set on the instance (module.forward = ...), and fxtools "
                    "runs the distributed wrappers around its graph by setting that attribute itself: define forward "
                    "in the module's class instead"
                )
        for module, forward in zip(chain, forwards):
            module.__dict__["forward"] = forward
        self._swapped = chain
        try:
            yield
        finally:
            for module in chain:
                module.__dict__.pop("forward", None)
            self._swapped = []

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Inside ``call``: the modules' own forwards back, FSDP2's hooks quiet (only casts)."""
        swapped = {m: m.__dict__.pop("forward") for m in self._swapped if "forward" in m.__dict__}
        states = _quiet_fsdp_states(self.sharded())
        try:
            yield
        finally:
            for state, old in states:
                state._training_state = old
            for module, forward in swapped.items():
                module.__dict__["forward"] = forward


def _calling(module: nn.Module) -> Callable[..., Any]:
    """A forward that calls ``module`` (its hooks and forward), defined here: a module's forward set
    by fxtools is not one the program set (capture/closures.py's hook guard leaves it out)."""
    return lambda *args, **kwargs: module(*args, **kwargs)


def _quiet_fsdp_states(modules: list[nn.Module]) -> list[tuple[Any, Any]]:
    """Put the FSDP2 states of ``modules`` into the state in which their forward hooks only cast
    (``PRE_BACKWARD``: how FSDP2 lets activation checkpointing recompute a forward); returns the
    states with their previous value. The parameters must be unsharded already (``call`` did)."""
    if not modules:
        return []
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    out = []
    for module in modules:
        state = module._get_fsdp_state()  # type: ignore[operator]
        if all(state is not s for s, _ in out):  # fully_shard([a, b]): one state for two modules
            out.append((state, state._training_state))
            state._training_state = TrainingState.PRE_BACKWARD
    return out


def _refuse_own_hooks(module: nn.Module) -> None:
    """Forward hooks other than FSDP2's would run twice: traced into the graph and around it."""
    fsdp_hooks = set()
    fsdp = _fsdp_type()
    if fsdp is not None and isinstance(module, fsdp):
        state = module._get_fsdp_state()  # type: ignore[operator]
        for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
            for h in getattr(handle, "handles", (handle,)):
                fsdp_hooks.add(h.id)
    own = [k for k in (*module._forward_pre_hooks, *module._forward_hooks) if k not in fsdp_hooks]
    if own:
        raise FxtoolsError(
            f"{type(module).__name__} has forward hooks of its own and runs inside a distributed wrapper that "
            "fxtools.compile runs around its graph: the hooks would run twice (traced into the graph, and "
            "around it). Compile the module before wrapping it (DistributedDataParallel(fxtools.compile(m)) "
            "or fully_shard(fxtools.compile(m))), or register the hooks on a submodule."
        )


# --------------------------------------------------------------------------------------------
# Tensor parallel: DTensor arguments and outputs around graphs of their local tensors
# --------------------------------------------------------------------------------------------


def with_subclass_leaves(leaves: list, args) -> list:
    """The tensor leaves a runner takes: ``leaves`` (the local tensors its guards accepted) with the
    DTensors of ``args`` in place of theirs, so that autograd reaches the DTensors themselves."""
    originals = [x for x in pytree.tree_leaves(tuple(args)) if isinstance(x, torch.Tensor)]
    if len(originals) != len(leaves):  # pragma: no cover - the guards return every tensor leaf
        raise AssertionError(f"{len(leaves)} tensor leaves for {len(originals)} tensor arguments")
    return [x if is_subclass(x) else leaf for leaf, x in zip(leaves, originals)]


class SubclassLeaves:
    """How a runner whose program takes DTensors calls its graphs of their local tensors: the
    autograd function gets the DTensors (``locals``), returns DTensor outputs (``outputs``),
    takes their cotangents as the graphs' local cotangents (``cotangents``) and gives DTensor
    gradients with the placements eager gives (``gradients``)."""

    def __init__(self, view: LocalView, capturing: Callable[[], Any] = contextlib.nullcontext):
        self.view = view
        self.capturing = capturing  # the context the program was traced in (FSDP2's hooks quiet)

    def locals(self, leaves) -> list:
        return [local(x) for x in leaves]

    def outputs(self, outs) -> list:
        layouts = self.view.out_layouts
        return [o if lay is None else lay.wrap(o, o.requires_grad) for o, lay in zip(outs, layouts)]

    def cotangents(self, grad_outs) -> list:
        out = []
        for ct, lay in zip(grad_outs, self.view.out_tensor_layouts):
            if lay is not None and is_subclass(ct):
                want = lay.grad_layout().placements
                ct = local(ct if tuple(ct.placements) == want else ct.redistribute(ct.device_mesh, want))
            out.append(ct)
        return out

    def differentiable_backward(self, captured, leaves: list, grad_outs) -> list:
        """The gradients for ``grad_outs`` in a backward with ``create_graph=True``: eager's, of the
        user's program run again on the DTensor arguments ``leaves`` (the tensor leaves of the
        arguments ``captured`` was traced with) with autograd recording, so that they are PyTorch
        functions of the arguments and cotangents, differentiable again as eager's are. (The
        graphs are of the local tensors: autograd does not differentiate their collectives, and
        their derivative is that of each rank's share, not DTensor's of the whole program.)"""

        def run(xs):
            it = iter(xs)
            full = [next(it) if t else x for x, t in zip(captured.leaves, captured.tensor_leaf)]
            outs = pytree.tree_leaves(self.view.fn(*pytree.tree_unflatten(full, captured.in_spec)))
            outs = [o for o in outs if isinstance(o, torch.Tensor)]
            return [(o, ct) for o, ct in zip(outs, grad_outs) if o.requires_grad and ct is not None]

        with self.capturing():
            return differentiated(leaves, run)

    def gradients(self, grads) -> list:
        layouts, partial = self.view.tensor_layouts, self.view.tensor_grad_placements
        return [
            g if lay is None or g is None else lay.grad_layout(p.partial).wrap(g) for g, lay, p in zip(grads, layouts, partial)
        ]


_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def communicated_bytes(gm) -> int:
    """Bytes the collectives of ``gm`` move per call on one rank, each counted as the larger of its
    input and output (the whole tensor an all-reduce sums, an all-gather assembles or a
    reduce-scatter splits). Sizes must be static."""
    total = 0
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional":
            continue
        if target.__name__.split(".")[0] not in _COLLECTIVES:
            continue
        sizes = [v.numel() * v.element_size() for v in (node.meta.get("val"), node.args[0].meta.get("val")) if v is not None]
        total += int(max(sizes, default=0))
    return total
