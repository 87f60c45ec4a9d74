"""Save/recompute policies for ``fxtools.split``: what the forward keeps for the backward.

The joint graph of ``reverse`` computes outputs and gradients together. ``split`` cuts it in
two: every value the backward needs that does not depend on the cotangent is either **saved**
(the forward returns it, the backward takes it as an input) or **recomputed** in the backward
from other saved values. A policy makes that choice:

``"save_all"``
    Save what the ops' backwards read, as ``torch.autograd`` does; values a rule's backward
    derives from them (``cos(x)`` for ``sin``) are computed in the backward, as in autograd, and
    views are recomputed (their storage is saved anyway).
``"recompute_cheap"`` (the default)
    Recompute cheap ops (pointwise math, views and reshapes, constant fills, layer norms) whenever that saves
    memory, and save the rest. The choice is a minimum cut: among all sets of saved values from
    which the backward can recompute what it needs with cheap ops, take one with the fewest
    bytes, and among those the one that recomputes least.
``"dots_saveable"``
    Save only the outputs of matrix products, convolutions and attention (as JAX's
    ``checkpoint_policies.dots_saveable``); recompute everything else.
``budget(b)`` / ``budget(peak=p)``
    The least estimated recompute whose saved bytes fit ``b`` (a float in (0, 1]: that fraction of
    ``save_all``'s saved bytes; an int: bytes), or whose predicted peak memory of forward plus
    backward fits ``p`` bytes; see ``fxtools.training.budget`` for the solver and its guarantees.
a function ``policy(node) -> "save" | "recompute" | "offload"``
    Decides per node of the joint graph (an ATen ``torch.fx.Node`` with ``node.meta['val']``,
    ``node.meta.get('stack_trace')`` and ``node.target``), like JAX checkpoint policies: a value
    marked ``"save"`` is saved if the backward needs it, one marked ``"recompute"`` is computed
    again in the backward from what is saved; ``"offload"`` saves it and marks it
    (``TensorInfo.offload``) for ``fxtools.compile`` to keep in CPU memory until the backward
    (the plain ``Split.forward`` / ``backward`` leave it where it is). Helpers: ``save_only(*ops)``, ``is_cheap``,
    ``is_dot``, ``is_view``.

Whatever the policy, random ops (dropout masks) and ops with side effects are never recomputed
(their values are saved), and the insides of ``torch.utils.checkpoint`` regions are always
recomputed (their outputs, the region's boundary, follow the policy).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import meta
from ..graph.nodes import is_impure

aten = torch.ops.aten

SAVE, RECOMPUTE, OFFLOAD = "save", "recompute", "offload"
BUILTIN = ("save_all", "recompute_cheap", "dots_saveable")

_RESHAPING = {
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.contiguous.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten.type_as.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.expand_as.default,
    aten.view_as.default,
    aten.repeat.default,
    aten.cat.default,
    aten.stack.default,
    aten.constant_pad_nd.default,
}
# memory-bound like pointwise ops: one pass over the data (normalizations over the last dimension)
_NORMALIZATIONS = (
    {
        aten.native_layer_norm.default,
        aten.layer_norm.default,
        aten.rms_norm.default,
        aten._fused_rms_norm.default,
    }
    if hasattr(aten, "_fused_rms_norm")
    else {
        aten.native_layer_norm.default,
        aten.layer_norm.default,
    }
)
_DOTS = {
    aten.mm.default,
    aten.bmm.default,
    aten.matmul.default,
    aten.addmm.default,
    aten.baddbmm.default,
    aten.linear.default,
    aten.einsum.default,
    aten.convolution.default,
    aten.conv1d.default,
    aten.conv2d.default,
    aten.conv3d.default,
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
}


def _op(node: fx.Node):
    return node.target if node.op == "call_function" else None


def _argument(node: fx.Node, name: str):
    """The value ``node`` passes for the schema argument ``name`` (its default if omitted), or None."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[i] if i < len(node.args) else a.default_value
    return None


def _dropout_off(node: fx.Node) -> bool:
    """A seeded op that draws nothing here: attention with ``dropout_p=0``, dropout with ``p=0``
    or ``train=False`` (so it computes the same values every time)."""
    if node.target._schema.is_mutable:
        return False
    p = _argument(node, "dropout_p")
    if p is None and node.target.overloadpacket.__name__ in ("dropout", "native_dropout"):
        p = 0.0 if _argument(node, "train") is False else _argument(node, "p")
    return type(p) in (int, float) and p == 0


def is_random(node: fx.Node) -> bool:
    """An op that draws random numbers (dropout, ``rand``; attention with a nonzero dropout)."""
    t = _op(node)
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags and not _dropout_off(node)


def is_view(node: fx.Node) -> bool:
    """An op whose result shares storage with its first argument (``view``, ``transpose``, ...)."""
    t = _op(node)
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload) or not t._schema.returns:
        return False
    info = t._schema.returns[0].alias_info
    return info is not None and not info.is_write


def is_factory(node: fx.Node) -> bool:
    """An op that makes a tensor from shapes and constants only (``zeros_like``, ``arange``)."""
    t = _op(node)
    if not isinstance(t, torch._ops.OpOverload):
        return False
    name = t.overloadpacket.__name__
    if name in ("zeros_like", "ones_like", "full_like", "empty_like", "scalar_tensor"):
        return True
    return name in ("zeros", "ones", "full", "arange", "empty", "new_zeros", "new_ones", "new_full") and not any(
        isinstance(a, fx.Node) and a.op != "get_attr" for a in node.args[1:]
    )


def is_pointwise(node: fx.Node) -> bool:
    t = _op(node)
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags


def is_cheap(node: fx.Node) -> bool:
    """Pointwise math, views, reshapes, constant fills and layer norms: recomputing them costs
    about one pass over memory."""
    return is_view(node) or is_pointwise(node) or is_factory(node) or _op(node) in _RESHAPING or _op(node) in _NORMALIZATIONS


def is_dot(node: fx.Node) -> bool:
    return _op(node) in _DOTS


def can_recompute(node: fx.Node) -> bool:
    """Whether running ``node`` again in the backward gives the same value without side effects."""
    if node.op == "get_attr":
        return True
    if node.op != "call_function":
        return False
    if is_random(node):
        return False
    return not is_impure(node) or (torch.Tag.nondeterministic_seeded in node.target.tags and _dropout_off(node))


def checkpoint_region(node: fx.Node):
    """The id of the ``torch.utils.checkpoint`` call ``node`` was traced in, or None."""
    return (node.meta.get("custom") or {}).get(meta.CHECKPOINT.name)


def in_backward_phase(node: fx.Node) -> bool:
    """Whether a rule's backward computed this forward value (``cos(x)`` for ``sin``): autograd
    computes such values in the backward from what the forward saved."""
    return meta.PHASE.get(node) == "backward"


def save_all(node: fx.Node) -> str:
    return RECOMPUTE if is_view(node) or in_backward_phase(node) else SAVE


def dots_saveable(node: fx.Node) -> str:
    return SAVE if is_dot(node) else RECOMPUTE


def save_only(*ops):
    """A policy saving only the outputs of the given ATen ops (packets or overloads)."""
    packets = {getattr(op, "overloadpacket", op) for op in ops}

    def policy(node: fx.Node) -> str:
        t = _op(node)
        return SAVE if t in ops or getattr(t, "overloadpacket", None) in packets else RECOMPUTE

    policy.__name__ = "save_only(" + ", ".join(str(o) for o in ops) + ")"
    return policy


class Budget:
    """A memory budget (see ``budget``): ``limit`` in bytes or as a fraction of ``save_all``'s, or ``peak`` bytes."""

    def __init__(self, limit: float | int | None = None, peak: int | None = None, fused: bool = False):
        if (limit is None) == (peak is None):
            raise ValueError("fxtools.policies.budget takes a budget b or peak=bytes (one of them)")
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, (int, float)):
                raise TypeError(f"budget(b): b must be a float in (0, 1] or an int of bytes, not {limit!r}")
            if isinstance(limit, float) and not 0.0 < limit <= 1.0:
                raise ValueError(f"budget(b): a float b is a fraction of save_all's bytes in (0, 1], got {limit}")
            if isinstance(limit, int) and limit < 0:
                raise ValueError(f"budget(b): bytes must be >= 0, got {limit}")
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, int) or peak < 0):
            raise ValueError(f"budget(peak=...): peak must be an int of bytes >= 0, not {peak!r}")
        self.limit, self.peak, self.fused = limit, peak, bool(fused)
        self.__name__ = f"budget({limit!r})" if peak is None else f"budget(peak={peak!r})"
        if self.fused:
            self.__name__ = self.__name__[:-1] + ", fused=True)"

    def __repr__(self):
        return self.__name__

    def __eq__(self, other):
        return isinstance(other, Budget) and (self.limit, self.peak, self.fused) == (other.limit, other.peak, other.fused)

    def __hash__(self):
        return hash((Budget, self.limit, self.peak, self.fused))


def budget(b: float | int | None = None, *, peak: int | None = None, fused: bool = False) -> Budget:
    """A policy: the least estimated recompute whose saved bytes fit ``b`` (a float in (0, 1]: a
    fraction of ``save_all``'s saved bytes; an int: bytes), or, with ``peak=``, whose predicted
    peak memory of forward plus backward fits ``peak`` bytes. Monotone: a smaller budget never
    saves more bytes nor recomputes less. A budget below what any split can reach raises
    ``FxtoolsError`` naming the least possible (see ``fxtools.training.budget``).

    ``fused=True`` plans for a backward compiler that fuses pointwise ops by shared reads
    (Inductor): a value recomputed a second time by pointwise ops only, from what is still in
    memory, is computed in the first computation's kernel there, so it is never recomputed twice
    (``fxtools.training.budget.effective_forget``). ``fxtools.compile`` sets it when its backward
    compiler is Inductor."""
    return Budget(b, peak, fused)


def describe(policy) -> str:
    if isinstance(policy, str):
        return policy
    return getattr(policy, "__name__", repr(policy))


def resolve(policy):
    """``(per_node_fn or None, use_min_cut)`` for a policy given as a name or a function."""
    if policy is None or policy == "recompute_cheap":
        return None, True
    if policy == "save_all":
        return save_all, False
    if policy == "dots_saveable":
        return dots_saveable, False
    if isinstance(policy, Budget):
        return None, False
    if callable(policy):
        return policy, False
    raise ValueError(
        f"policy must be one of {', '.join(map(repr, BUILTIN))} budget(b) or a function node -> 'save' | 'recompute' | 'offload', not {policy!r}"
    )
