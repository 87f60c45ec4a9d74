"""The per-call path of ``fxtools.compile``: what a call checks, done once per thing that may change.

Every call of a compiled module or function must check what its graphs were made for (the
argument guards of ``signature/guards.py``: structure, sizes, dtypes, devices, layouts, Python
values; which inputs require grad; ``model.training``; the closed-over state of
``signature/closures.py``) and read the module's parameters. Done naively in Python, that is
most of a millisecond on a small GPT, a percent of its step. Two caches make it a few tens of
microseconds, each keyed on everything its outcome depends on:

- ``Parameters``: ``dict(module.named_parameters())`` is made again only when the walk giving it
  could give another: when a module of the tree changed type, or one of its ``_modules`` or
  ``_parameters`` dicts or its attributes changed (a dict's version, which every change to it
  changes: a parameter rebound, added or removed, a submodule replaced). The parameters' own
  metadata (``p.data = ...``, ``requires_grad_``, ``resize_``, ``set_``) is the guards' business.
- ``Memo``: the outcome of choosing a runner for a call (its guards, its ``requires_grad``
  pattern, its compiled layouts), kept with the call's structure and Python values and the
  metadata of each tensor leaf as PyTorch's own C++ tensor guards check it
  (``torch._C._dynamo.guards.TensorGuards``, what ``torch.compile`` checks: Python type,
  dispatch keys, dtype, device, ``requires_grad``, sizes and strides, all exactly). A call whose
  structure, values and tensors are so the same gets the same runner, as the full check would
  give it (every fact the guards read of a tensor is among those, but its storage offset: a
  runner whose guards read one is not memoised). Any difference falls back to the full check.

Closed-over state is checked on every call (``signature/closures.py`` keeps its own watch of
the dicts it reads).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..signature.closures import dict_versions, watchable
from ..signature.runtime import same_value, shared_groups

__all__ = ["Parameters", "Memo", "tensor_guards"]


class Parameters:
    """``dict(module.named_parameters())`` as it would be now (a new dict each call), made again
    only when a module of the tree changed type or one of its ``_modules``, ``_parameters`` or
    attribute dicts changed (see the module docstring)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._watch: tuple | None = None  # (modules, their types, dicts, their versions, the parameters)

    def __call__(self) -> dict:
        if torch.compiler.is_compiling():  # traced by torch.compile: the walk itself, traceable
            return dict(self.module.named_parameters())
        watch = self._watch
        if watch is not None:
            modules, types, dicts, versions, params = watch
            if list(map(type, modules)) == types and dict_versions(dicts) == versions:
                return dict(params)
        self._watch = None
        modules = list(self.module.modules())  # the walk ``named_parameters`` makes
        dicts = [d for m in modules for d in (vars(m), vars(m).get("_modules"), vars(m).get("_parameters"))]
        versions = dict_versions(dicts) if all(map(watchable, dicts)) else None  # before the walk
        params = dict(self.module.named_parameters())
        if versions is not None:
            self._watch = (modules, list(map(type, modules)), dicts, versions, params)
        return dict(params)


@functools.cache
def _tensor_guards_type():
    """``torch._C._dynamo.guards.TensorGuards`` if it behaves here as ``Memo`` relies on, else None."""
    try:
        from torch._C._dynamo.guards import TensorGuards as found
    except ImportError:  # pragma: no cover - a build without Dynamo
        return None
    TensorGuards: Any = found  # (its stub takes no tensors; it does, positionally)
    try:
        f32: Any = dict(dtype=torch.float32, device="cpu")  # the first call may be under another default dtype
        x = torch.zeros(2, 3, requires_grad=True, **f32)
        guards = TensorGuards(x, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        same = guards.check(torch.ones(2, 3, requires_grad=True, **f32))
        others = [
            torch.zeros(2, 3, **f32),  # requires_grad
            torch.zeros(3, 2, requires_grad=True, **f32),  # sizes
            torch.zeros(3, 2, **f32).t().requires_grad_(),  # strides
            torch.zeros(2, 3, dtype=torch.float64, requires_grad=True),  # dtype
            torch.nn.Parameter(torch.zeros(2, 3, **f32)),  # Python type
        ]
        if not same or any(guards.check(o) for o in others) or guards.check(1.0):
            return None
    except Exception:  # noqa: BLE001 - another torch: the full check only
        return None
    return TensorGuards


def tensor_guards(tensors):
    """PyTorch's C++ check of ``tensors``' metadata (``Memo``), or None where it is unavailable."""
    cls = _tensor_guards_type()
    if cls is None:
        return None
    return cls(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)


_TENSOR, _VALUE, _DICT, _SEQ, _TENSOR_DICT = range(5)
_VALUES = (type(None), bool, int, float, complex, str)


def _plan(value, flat: list):
    """How to check and flatten ``value`` again (appending its tensors to ``flat``), or None for
    a value the memo does not take (an object the guards compare by attributes or ``==``)."""
    kind = type(value)
    if kind in (torch.Tensor, torch.nn.Parameter):
        flat.append(value)
        return (_TENSOR,)
    if kind in _VALUES:
        return (_VALUE, kind, value)
    if _plain_dict(kind):
        keys = tuple(value)
        if all(type(v) in (torch.Tensor, torch.nn.Parameter) for v in value.values()):
            flat.extend(value.values())
            return (_TENSOR_DICT, kind, keys)
        plans = _plans(value.values(), flat)
        return None if plans is None else (_DICT, kind, keys, plans)
    if kind in (tuple, list):
        plans = _plans(value, flat)
        return None if plans is None else (_SEQ, kind, len(value), plans)
    return None


def _plans(values, flat: list) -> tuple | None:
    """``_plan`` of each of ``values`` in order, or None if the memo does not take one of them."""
    plans = []
    for v in values:
        p = _plan(v, flat)
        if p is None:
            return None
        plans.append(p)
    return tuple(plans)


def _plain_dict(kind) -> bool:
    """A dict type whose iteration, ``values()`` and items are dict's own (``dict``, the
    ``KeywordArguments`` of a call): its keys and values in one order, as the guards read them."""
    return kind is dict or (
        issubclass(kind, dict)
        and all(getattr(kind, name) is getattr(dict, name) for name in ("__iter__", "values", "__getitem__", "keys"))
    )


def _follow(value, plan, flat: list) -> bool:
    """Whether ``value`` has ``plan``'s structure and Python values; its tensors appended to ``flat``."""
    kind = plan[0]
    if kind == _TENSOR:
        flat.append(value)  # its type and metadata: the tensor guards'
        return True
    if kind == _TENSOR_DICT:
        if type(value) is not plan[1] or tuple(value) != plan[2]:
            return False
        flat.extend(value.values())
        return True
    if kind == _VALUE:
        return type(value) is plan[1] and same_value(value, plan[2])
    if kind == _DICT:
        if type(value) is not plan[1] or tuple(value) != plan[2]:
            return False
        return all(_follow(v, p, flat) for v, p in zip(value.values(), plan[3]))
    if type(value) is not plan[1] or len(value) != plan[2]:
        return False
    return all(_follow(v, p, flat) for v, p in zip(value, plan[3]))


def _plain(t) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and not torch._C._functorch.is_functorch_wrapped_tensor(t)


class Memo:
    """One call's choice of runner (``_Runners``), given again to a call of the same structure,
    Python values and tensor metadata (see the module docstring)."""

    def __init__(self, key, plans: tuple, guards, runner):
        self.key, self.plans, self.guards, self.runner = key, plans, guards, runner
        # graphs writing in place: which tensor leaves share memory (``Guards.shared``), which
        # the tensor guards do not see, is checked too
        self.shared = getattr(runner.split.guards, "shared", None)
        self.written = getattr(runner.split.guards, "written", ())

    @classmethod
    def make(cls, args: tuple, key, runner, leaves: list, storage_offsets_read: bool):
        """The memo of a call whose guards gave ``runner`` and ``leaves``, or None where the call
        is not one it can check: values it does not take, tensors that are not plain (a
        subclass, a functorch wrapper), leaves it would not give in the guards' order, or guards
        that read a storage offset (``storage_offsets_read``), which PyTorch's tensor guards do
        not check."""
        if storage_offsets_read:
            return None
        flat: list = []
        plans = _plans(args, flat)
        if plans is None:
            return None
        if len(flat) != len(leaves) or any(x is not y for x, y in zip(flat, leaves)) or not all(map(_plain, flat)):
            return None
        guards = tensor_guards(flat)
        return None if guards is None else cls(key, plans, guards, runner)

    def leaves(self, args: tuple, key) -> list | None:
        """The tensor leaves of ``args`` (as the guards give them) if the memo's runner is theirs, else None."""
        if key != self.key or len(args) != len(self.plans):
            return None
        flat: list = []
        for a, p in zip(args, self.plans):
            if p[0] == _TENSOR:
                flat.append(a)
            elif not _follow(a, p, flat):
                return None
        if not self.guards.check(*flat):
            return None
        return flat if self.shared is None or shared_groups(flat, self.written) == self.shared else None
