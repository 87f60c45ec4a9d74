"""Arguments a program writes in place with a differentiable value, handled as AOTAutograd
handles mutated inputs.

A write such as ``y[:, 1:].mul_(w[1:])`` into an argument ``y`` changes what the caller holds,
and eager autograd records it: a later use of ``y`` differentiates through the write to ``w``
(and to the old ``y``, for the part the write kept). fxtools' graphs run outside autograd, so
such a write, kept in place on the input, would be made without a record. Instead the program
is rewritten (``WrittenInputs.function``): it runs on a copy of each written argument, so the
new value is computed out of place, and returns the copies after its own result. The split of
that program returns the new values, and its backward takes their cotangents; ``call`` runs the
graphs on copies of the arguments and then writes the new values into them with autograd
recording (``y.copy_(new)``), as eager's in-place op is recorded: ``y``'s version and
``grad_fn`` change, a leaf requiring grad is refused as eager refuses it.

``fxtools.split`` finds such writes (``differentiable_writes``, or the ``InplaceError`` of a
write an output reads) and splits the rewritten program; ``fxtools.compile`` and the
``torch.compile`` backend run its graphs through ``call``. The function transforms
(``fxtools.grad``, ``vjp``, ...) keep such writes in place, as ``torch.func`` does.

A write made under ``no_grad`` or of a detached value (running statistics,
``buf.add_(x.detach())``) is no concern here: autograd records nothing for it, and it stays in
place in the graphs.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..capture.functionalize import InplaceError, kept_input_writes
from ..errors import FxtoolsError, user_line_of
from ..graph.nodes import is_float

__all__ = ["WrittenInputs", "carriers", "differentiable_writes"]

_aten = torch.ops.aten
# ops whose result autograd does not connect to their tensor inputs (``detach``, ``zeros_like(p)``)
_NO_PATH = {_aten.detach, _aten.zeros_like, _aten.ones_like, _aten.empty_like, _aten.full_like, _aten.rand_like}
_NO_PATH |= {_aten.randn_like, _aten.randint_like, _aten.new_zeros, _aten.new_ones, _aten.new_empty, _aten.new_full}


def carriers(gm: fx.GraphModule, differentiable: list[bool] | None = None) -> set[fx.Node]:
    """The nodes of the captured graph ``gm`` a chain of floating-point values computed with grad
    mode on (``detach`` ends one) leads to from a placeholder (those ``differentiable`` marks, one
    bool per placeholder; all if None): those autograd connects to the inputs."""
    carries: set[fx.Node] = set()
    grad_enabled = True
    placeholders = iter(differentiable or ())
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            marked = differentiable is None or next(placeholders, True)
            if marked and is_float(node.meta.get("val")):  # not indices (``idx``)
                carries.add(node)
        elif node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            grad_enabled = bool(node.args[0])
        elif node.op == "call_function" and grad_enabled and getattr(node.target, "overloadpacket", None) not in _NO_PATH:
            floats = any(is_float(v) for v in pytree.tree_leaves(node.meta.get("val")))
            if floats and any(a in carries for a in node.all_input_nodes):
                carries.add(node)
    return carries


def differentiable_writes(gm: fx.GraphModule, differentiable: list[bool] | None = None) -> dict[int, str | None]:
    """The inputs of the captured graph ``gm`` (by placeholder position) that an in-place op kept
    on them writes with a value autograd connects to a ``differentiable`` input (``carriers``),
    each with the user's line of the first such write. No output need read the value: the caller
    does, through the argument."""
    kept = kept_input_writes(gm)
    if not kept:
        return {}
    carried = carriers(gm, differentiable)
    found: dict[int, str | None] = {}
    for node, leaf in kept:
        if node in carried and leaf not in found:
            found[leaf] = user_line_of(node)
    return found


def written_by(err: InplaceError) -> dict[int, str | None] | None:
    """The input an ``InplaceError`` names as written with a differentiable value (kept in place,
    an output reading it), as ``differentiable_writes`` gives it; None for other refusals."""
    return None if err.written_input is None else {err.written_input: err.where}


class WrittenInputs:
    """The tensor arguments (by position among the tensor leaves of the arguments) a program
    writes in place with a differentiable value, with the user's line of each write.

    ``function(fn)``: ``fn`` run on a copy of each, returning ``(result, (new value, ...))``.
    ``call(run, leaves)``: run the graphs of that function on copies and write the new values
    into ``leaves`` with autograd recording; returns ``result``."""

    def __init__(self, lines: dict[int, str | None]):
        self.lines = dict(lines)  # tensor leaf position -> the user's line writing it
        self.positions = sorted(lines)
        self.returned: dict[int, int] = {}  # leaf of the result -> the written position it is (``return y``)
        self.names: list[str] = []  # each tensor leaf's name, as the split names its inputs

    def function(self, fn):
        """``fn`` computing the new values of the written arguments out of place, on copies, and
        returning them after its result: ``(result, (new value, ...))`` in ``positions`` order."""
        positions, returned = self.positions, self.returned
        try:
            arg_names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            arg_names = []

        def call(*args):
            flat, spec = pytree.tree_flatten_with_path(args)
            tensors = [k for k, (_, x) in enumerate(flat) if isinstance(x, torch.Tensor)]
            copies = {i: flat[tensors[i]][1].clone() for i in positions if i < len(tensors)}
            if len(copies) != len(positions):
                raise FxtoolsError("internal error: a written argument is not a tensor leaf of the arguments")
            layouts = {i: (c.shape, c.stride()) for i, c in copies.items()}
            leaves = [x for _, x in flat]
            for i, c in copies.items():
                leaves[tensors[i]] = c
            result = fn(*pytree.tree_unflatten(leaves, spec))
            returned.clear()
            for k, o in enumerate(pytree.tree_leaves(result)):
                for i, c in copies.items():
                    if o is c:
                        returned[k] = i
            for i, c in copies.items():
                if (c.shape, c.stride()) != layouts[i]:
                    name = _path_name(arg_names, flat[tensors[i]][0])
                    raise InplaceError(
                        f"{self.lines.get(i) or 'an in-place op'} changes the shape or strides of `{name}`, a "
                        "tensor argument written in place with a differentiable value; fxtools computes such a "
                        "write out of place and copies it into the argument afterwards, which cannot change its "
                        "shape. Compute the new value out of place."
                    )
            return result, tuple(copies[i] for i in positions)

        call.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        call.__name__ = call.__qualname__ = getattr(fn, "__name__", "fn")
        for attr in ("__fxtools_module__", "__fxtools_input_kinds__"):
            if hasattr(fn, attr):
                setattr(call, attr, getattr(fn, attr))
        return call

    def refuse_aliased(self, leaves, who: str) -> None:
        """Refuse a written argument sharing memory with another tensor argument: the write would
        have to reach the other one too (AOTAutograd's synthetic bases), which fxtools does not do."""
        for i in self.positions:
            x = leaves[i]
            if not isinstance(x, torch.Tensor) or x.numel() == 0:
                continue
            ptr = x.untyped_storage().data_ptr()
            for j, y in enumerate(leaves):
                if j != i and isinstance(y, torch.Tensor) and y.numel() and y.untyped_storage().data_ptr() == ptr:
                    a, b = self._name(i), self._name(j)
                    raise InplaceError(
                        f"{who}: {self.lines.get(i) or 'an in-place op'} writes `{a}` with a differentiable value, "
                        f"and `{b}`, another tensor input, shares its memory; {who} computes the new value out of "
                        f"place and copies it into `{a}` afterwards, and cannot make the write reach `{b}` as eager "
                        "does. Clone one of them, or compute the new value out of place."
                    )

    def _name(self, i: int) -> str:
        return self.names[i] if i < len(self.names) else f"input {i}"

    def call(self, run, leaves: list, who: str):
        """``run(leaves) -> (result, new values)`` on copies of the written leaves, then each new
        value written into its leaf with autograd recording (``x.copy_(new)``). Returns ``result``
        (an output that is a written argument is that argument, as in eager)."""
        self.refuse_aliased(leaves, who)
        recording = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
        if recording:
            for i in self.positions:
                x = leaves[i]
                if isinstance(x, torch.Tensor) and x.is_leaf and x.requires_grad:
                    # eager's own refusal, before anything runs or is written
                    raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
            # the autograd.Function gets a copy of each: it may save it for the backward (or a
            # replay with create_graph=True may read it), and the write below must not reach it
            inputs = [_copy(x) if i in self.lines else x for i, x in enumerate(leaves)]
        else:  # run without autograd (the graphs do not write their inputs): nothing is kept
            inputs = list(leaves)
        result, new = run(inputs)
        if not recording:  # a new value the graphs return as an input itself must not see an earlier write
            written = {leaves[i].untyped_storage().data_ptr() for i in self.positions}
            new = [v.clone() if v.untyped_storage().data_ptr() in written else v for v in new]
        flat, spec = pytree.tree_flatten(result)
        views = {k: self._view_of(o, new, leaves) for k, o in enumerate(flat) if k not in self.returned}
        for i, value in zip(self.positions, new):
            leaves[i].copy_(value)  # with autograd recording, as eager's in-place write
        if self.returned or any(v is not None for v in views.values()):
            for k, o in enumerate(flat):
                if k in self.returned:
                    flat[k] = leaves[self.returned[k]]
                elif views[k] is not None:
                    i, size, stride, offset = views[k]
                    flat[k] = leaves[i].as_strided(size, stride, offset)
            result = pytree.tree_unflatten(flat, spec)
        return result

    def _view_of(self, out, new: list, leaves: list):
        """For an output that is a view of a written argument's new value (``return y[1:]``):
        ``(position, size, stride, offset)`` of the same view of the argument, which eager's
        output is (an in-place update of one shows in the other). None for other outputs, and
        where the new value's layout is not the argument's."""
        if not isinstance(out, torch.Tensor) or out.numel() == 0:
            return None
        for i, value in zip(self.positions, new):
            x = leaves[i]
            if (
                isinstance(value, torch.Tensor)
                and value.numel()
                and out.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
                and value.stride() == x.stride()
                and value.shape == x.shape
            ):
                offset = x.storage_offset() + out.storage_offset() - value.storage_offset()
                return i, out.size(), out.stride(), offset
        return None


def _copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its strides (``clone`` makes a strided view with gaps contiguous: the
    graphs were made for the argument's layout), recorded by autograd as ``clone`` is."""
    c = x.clone()
    if c.stride() == x.stride():
        return c
    try:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
    except RuntimeError:  # overlapping memory (an expanded tensor): the clone's layout
        return c


def _path_name(arg_names: list[str], path) -> str:
    """``y``, ``params['fc.weight']``: an argument leaf's name from its pytree path."""
    if not path:
        return "argument"
    first = path[0]
    idx = getattr(first, "idx", None)
    head = arg_names[idx] if isinstance(idx, int) and idx < len(arg_names) else f"argument {idx}"
    return head + (pytree.keystr(path[1:]) if len(path) > 1 else "")
