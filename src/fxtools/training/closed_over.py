"""Closed-over tensors that require grad, made inputs of ``fxtools.compile``'s graphs.

A loss function that reads a global model's parameters, or a weight ``W`` it closes over, gets
their gradients from eager autograd (``W.grad``). The split graphs differentiate their inputs, so
such tensors are lifted: the program is traced again as ``lifted(*args, ClosedOver({...}))``,
which puts the given tensors where the program reads them (the global, the closure cell, the
module's parameter table; ``capture.closures.setter``) while it runs, and every call passes the
tensors read there *now*. They are then leaves of the autograd.Function, whose ``.grad``
autograd accumulates as in eager; a tensor rebound between calls is the one passed.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.utils import _pytree as pytree

from ..capture.closures import setter
from ..errors import FxtoolsError
from ..graph.nodes import is_float
from ..signature import closures
from ..signature.naming import identifier, unique


def register_dict(cls: type[dict]) -> None:
    """Register ``cls``, a dict subclass marking one argument of a split program, as a pytree
    node whose leaves are named by its keys."""
    pytree.register_pytree_node(
        cls,
        lambda d: (list(d.values()), list(d)),
        lambda values, keys: cls(zip(keys, values)),
        flatten_with_keys_fn=lambda d: ([(pytree.MappingKey(k), v) for k, v in d.items()], list(d)),
        serialized_type_name=f"fxtools.{cls.__name__}",
    )


class ClosedOver(dict):
    """The lifted tensors of one call, by the names the code gives them: an argument of the
    lifted program after its own (a pytree dict, each tensor an input)."""


register_dict(ClosedOver)


class Lifted:
    """The closed-over tensors requiring grad that a split holds as constants (``find``)."""

    def __init__(self, groups: list):
        self.groups = groups  # (name, the getter, the setters of every place it was read from)

    @classmethod
    def find(cls, forward) -> Lifted | None:
        """The tensors requiring grad among what ``forward`` (a split's) read from outside its
        arguments, or None; refuses one read where fxtools cannot put another tensor."""
        by_id: dict[int, list] = {}
        for read in closures.reads_of(forward):
            t = read.expected
            if isinstance(t, torch.Tensor) and t.requires_grad and is_float(t):
                by_id.setdefault(id(t), []).append(read)
        if not by_id:
            return None
        names = unique([identifier(reads[0].name or reads[0].what) for reads in by_id.values()])
        groups = []
        for name, reads in zip(names, by_id.values()):
            sets = [setter(r) for r in reads]
            if any(s is None for s in sets):
                read = reads[sets.index(None)]
                where = f" at {read.where}" if read.where else ""
                raise FxtoolsError(
                    f"fxtools.compile: the program reads {read.what}, a tensor that requires grad, from outside its "
                    f"arguments{where}, where fxtools cannot pass it as an input of the graphs (eager autograd would "
                    "give it a gradient). Pass the tensor as an argument, or compile the nn.Module that owns it."
                )
            groups.append((name, reads[0].get, sets))
        return cls(groups)

    def values(self) -> ClosedOver:
        """The tensors read where the program reads them, now (a rebound one is the new one)."""
        return ClosedOver((name, get()) for name, get, _ in self.groups)

    @contextlib.contextmanager
    def put(self, given: ClosedOver):
        """``given`` in the places the program reads, the originals back afterwards."""
        old = [(sets, get()) for _, get, sets in self.groups]
        try:
            for name, _, sets in self.groups:
                for s in sets:
                    s(given[name])
            yield
        finally:
            for sets, value in old:
                for s in sets:
                    s(value)

    def function(self, fn):
        """``fn`` taking the lifted tensors as one more argument (``ClosedOver``), after its own."""

        def lifted(*args):
            at = next(i for i, a in enumerate(args) if isinstance(a, ClosedOver))  # before a KeywordArguments
            with self.put(args[at]):
                return fn(*args[:at], *args[at + 1 :])

        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = [inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)]
        if not any(p.kind is p.VAR_POSITIONAL for p in params):
            params.append(inspect.Parameter("closed_over", inspect.Parameter.POSITIONAL_OR_KEYWORD))
        lifted.__signature__ = inspect.Signature(params)
        lifted.__name__ = getattr(fn, "__name__", "fn")
        for attr in ("__fxtools_module__", "__fxtools_input_kinds__"):  # for names and descriptors
            if hasattr(fn, attr):
                setattr(lifted, attr, getattr(fn, attr))
        return lifted
