"""The table of VJP rules: which forward/backward pair differentiates which op.

A rule is a pair of plain Python functions, as in JAX's ``custom_vjp``:

- ``fwd(*args, **kwargs) -> (value, aux)`` computes the op's value and whatever the
  backward will need (``aux`` may be any Python structure of tensors and constants);
- ``bwd(aux, ct) -> arg cotangents``: one entry per positional argument of the op (a tensor,
  ``None`` for "no contribution", or a list for list arguments such as ``cat``'s). A single
  tensor may be returned for one-argument ops.

Rules run on FakeTensors while fxtools traces the derivative, so they may read ``x.shape``
and ``x.dtype`` freely; the torch calls they make become the generated code.

Keys are ``torch.ops.aten`` overload packets (``torch.ops.aten.sin``, covering every
overload) or single overloads (``torch.ops.aten.sum.dim_IntList``), which take precedence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Rule:
    fwd: Callable[..., tuple[Any, Any]]
    bwd: Callable[[Any, Any], Any]
    source: str = "hand-written"  # or "user", "derived"


_RULES: dict[Any, Rule] = {}


def _key(op):
    """Normalise torch.sin / aten.sin / aten.sin.default to an aten packet or overload."""
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return op
    if isinstance(op, str):
        name, _, overload = op.partition(".")
        packet = getattr(torch.ops.aten, name)
        return getattr(packet, overload) if overload else packet
    name = getattr(op, "__name__", None)
    if name and hasattr(torch.ops.aten, name):
        return getattr(torch.ops.aten, name)
    raise TypeError(
        f"register_vjp needs an ATen op such as torch.ops.aten.sin (got {op!r}); "
        "to give a whole Python function its own backward use fxtools.custom_vjp"
    )


def register_vjp(op, fwd: Callable, bwd: Callable, *, source: str = "user") -> Rule:
    """Add or replace the VJP rule of ``op``.

    ``op`` is an ATen op (``torch.ops.aten.sin``, ``torch.ops.aten.sum.dim_IntList``), its name
    (``"sin"``), or a torch function of the same name (``torch.sin``). Example::

        def sin_fwd(x):
            return torch.sin(x), x            # value, and what the backward needs
        def sin_bwd(x, ct):
            return ct * torch.cos(x)          # cotangent of the one argument
        fxtools.register_vjp(torch.ops.aten.sin, sin_fwd, sin_bwd)
    """
    rule = Rule(fwd, bwd, source)
    _RULES[_key(op)] = rule
    return rule


def vjp_rule(op):
    """Decorator for the common rule shape: the forward is the op itself.

    The decorated function is ``bwd(ct, out, *args, **kwargs) -> arg cotangents`` and sees the
    op's output and arguments; it becomes the pair (call the op and keep its inputs and output,
    this backward). This is how fxtools' own rules are written::

        @vjp_rule(aten.sin)
        def sin(ct, out, x):
            return ct * torch.cos(x)
    """
    def register(bwd_of_inputs):
        def fwd(*args, **kwargs):
            out = op(*args, **kwargs)
            return out, (out, args, kwargs)

        def bwd(aux, ct):
            out, args, kwargs = aux
            return bwd_of_inputs(ct, out, *args, **kwargs)

        fwd.__name__ = bwd.__name__ = bwd_of_inputs.__name__
        fwd.__qualname__ = bwd.__qualname__ = bwd_of_inputs.__qualname__
        _RULES[_key(op)] = Rule(fwd, bwd, "hand-written")
        return bwd_of_inputs

    return register


def lookup(op) -> Rule | None:
    """The rule for an op overload: the overload's own, else its packet's."""
    rule = _RULES.get(op)
    if rule is None and isinstance(op, torch._ops.OpOverload):
        rule = _RULES.get(op.overloadpacket)
    return rule


def registered_ops() -> dict:
    """A copy of the rule table (op -> Rule), for coverage reports."""
    return dict(_RULES)


_NONDIFFERENTIABLE: set = set()


def mark_nondifferentiable(*ops) -> None:
    """Declare ops whose output carries no gradient (``detach``, ``floor``, random fills, ...).

    Like autograd, fxtools then treats their outputs as constants: the gradient through them is
    zero, and no backward code is emitted for them.
    """
    _NONDIFFERENTIABLE.update(_key(op) for op in ops)


def is_nondifferentiable(op) -> bool:
    if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return op in _NONDIFFERENTIABLE
    return op in _NONDIFFERENTIABLE or (
        isinstance(op, torch._ops.OpOverload) and op.overloadpacket in _NONDIFFERENTIABLE
    )
