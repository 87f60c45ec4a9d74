"""Layout the traced program reads: ``x.is_contiguous()``, ``x.stride(0)``, ``x.storage_offset()``.

Tracing runs the program once, on FakeTensors with the example's strides, so a branch on
``x.is_contiguous()`` or arithmetic with ``x.stride(0)`` is decided by the example's layout and
baked into the graph. ``LayoutReads`` (a TorchFunctionMode active while capturing) records each
such read the program makes (from a user line, directly or through torch's Python functions:
torch's own dispatch-level reads are not the program's decisions), on which graph value, and
what it returned. ``facts`` then turns the reads into layout facts about the input leaves
(``signature.runtime.Read``), which the module checks on every call:

- ``is_contiguous`` / ``storage_offset`` read on an input itself: the same answer;
- ``as_strided`` on a value computed from inputs (it addresses their storage directly): each
  input's strides and storage offset, as the example had them;
- any other read (a stride, or a read on a value computed from inputs, whose layout follows
  theirs): the layout of every input it derives from, as the example had it: its strides (static
  sizes), or dense in the example's order of dims (symbolic sizes, whose strides follow the sizes).

A program that reads no layout gets no such fact: its module accepts any layout, as before.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from ..errors import FxtoolsError, decision_line, is_program_file
from ..signature import decisions
from ..signature.runtime import Read, dense_strides

_READS = {"stride", "is_contiguous", "storage_offset"}
# reads of a tensor's values into Python: of a tensor the program closes over, they are constants of the code
_VALUE_READS = {"item", "tolist", "__float__", "__int__", "__index__", "__bool__", "__complex__"}
# ops that address the storage under a tensor directly: their result (and gradient) follows the
# tensor's strides and storage offset, which the program thereby reads
_STORAGE_READS = {"as_strided", "as_strided_", "as_strided_scatter"}


def _by_program() -> bool:
    """Whether the read being made comes from the user's program (the innermost frame outside
    torch is a user file), not from fxtools or torch's own machinery."""
    frame: Any = sys._getframe(2)
    torch_dir = torch.__path__[0]
    while frame is not None and (frame.f_code.co_filename.startswith(torch_dir) or _passes_through(frame.f_code)):
        frame = frame.f_back
    return frame is not None and is_program_file(frame.f_code.co_filename)


def _passes_through(code) -> bool:
    """Whether ``code`` is the handler of one of fxtools' own torch-function modes inside this one
    (``vmap``'s ``BatchedViews``), which hands the program's call on: the read is the caller's."""
    return code.co_name == "__torch_function__" and code.co_filename.startswith(_PACKAGE_DIR)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _node_of(t) -> fx.Node | None:
    """The graph node that holds ``t`` in the running trace, if any."""
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        return None
    try:
        return proxy_tensor.get_proxy_slot(t, mode.tracer).proxy.node
    except Exception:  # noqa: BLE001 - a tensor the trace does not hold (a real constant)
        return None


def _unbatched(t):
    """The tensor under ``t``'s torch.func wrappers (``fxtools.vmap`` traces through them), and
    whether there were any: a read on a batched value is a read of its base's layout."""
    if not isinstance(t, torch.Tensor):
        return None, False
    functorch = torch._C._functorch
    wrapped = False
    while functorch.is_batchedtensor(t) or functorch.is_functorch_wrapped_tensor(t):
        t, wrapped = functorch.get_unwrapped(t), True
    return t, wrapped


class LayoutReads(TorchFunctionMode):
    """While capturing: note every layout read of the program (``reads``: kind, node, format, result, line)."""

    def __init__(self):
        super().__init__()
        self.reads: list = []
        self.values: list = []  # (tensor, its node or None, line): values the program read into Python
        self.any_reads: list = []  # (tensor, its node or None, line): every layout read of the program

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", None)
        if name in _VALUE_READS and args and isinstance(args[0], torch.Tensor) and _by_program():
            self.values.append((args[0], _node_of(args[0]), decision_line()))
        base, batched = _unbatched(args[0]) if name in _READS | _STORAGE_READS and args else (None, False)
        checked = decisions.current() if base is not None else None  # a module traced again: the read it repeats
        if isinstance(base, torch.Tensor) and (_by_program() or (checked is not None and checked.kind == "read")):
            # of a closed-over tensor (real, or a value computed from one): its layout is guarded as a value
            fmt = kwargs.get("memory_format", args[1] if len(args) > 1 and name == "is_contiguous" else None)
            where = checked.where if checked is not None else decision_line()
            self.any_reads.append((base, _node_of(base), where, name, fmt or torch.contiguous_format))
        if isinstance(base, torch._subclasses.FakeTensor) and (_by_program() or (checked is not None and checked.kind == "read")):
            fmt = kwargs.get("memory_format", args[1] if len(args) > 1 and name == "is_contiguous" else None)
            fmt_name = str(fmt or torch.contiguous_format).removeprefix("torch.")
            where = checked.where if checked is not None else decision_line()
            node = _node_of(base)
            kind = "as_strided" if name in _STORAGE_READS else name
            self.reads.append((kind if not batched else "stride", node, fmt_name, out, where))
        return out


def constants_read_as_values(reads: list, gm: fx.GraphModule) -> dict:
    """id -> line for the constant tensors (closed-over ones) whose values the program read into
    Python (``float(t)``, ``t.item()``, ``int(t[0])``), directly or through ops on them; given
    ``LayoutReads.any_reads``, those whose layout it read (``W.is_contiguous()``, ``W.t().stride(0)``)."""
    found: dict = {}
    for t, node, where in reads:
        if node is None:
            found.setdefault(id(t), where)
            continue
        for held in _constants_under(node, gm):
            found.setdefault(id(held), where)
    return found


def constants_layout_read(reads: list, gm: fx.GraphModule) -> dict:
    """id -> (line, facts) for the constant tensors (closed-over ones) whose layout the program read
    (``LayoutReads.any_reads``). The facts: ``("is_contiguous", format)`` for that read of the
    tensor itself, ``("offset",)`` for its storage offset (or ``as_strided``), ``("strides",)`` for a
    stride, or for any read of a value computed from it, whose layout follows its strides."""
    found: dict = {}

    def note(t, where, fact):
        if isinstance(t, torch.Tensor):
            entry = found.setdefault(id(t), (where, set()))
            entry[1].add(fact)

    for t, node, where, name, fmt in reads:
        own = node is None or node.op == "get_attr"
        if own:
            held = t if node is None else getattr(gm, str(node.target), None)
            if name == "is_contiguous":
                note(held, where, ("is_contiguous", fmt))
            else:
                note(held, where, ("strides",))
            if name in _STORAGE_READS or name == "storage_offset":
                note(held, where, ("offset",))
            continue
        for held in _constants_under(node, gm):
            note(held, where, ("strides",))
            if name in _STORAGE_READS:
                note(held, where, ("offset",))
    return {k: (where, tuple(sorted(facts, key=str))) for k, (where, facts) in found.items()}


def _constants_under(node: fx.Node, gm: fx.GraphModule) -> list:
    """The attributes of ``gm`` (closed-over constants) that ``node`` is computed from."""
    return [getattr(gm, str(n.target), None) for n in _ancestors(node) if n.op == "get_attr"]


def _ancestors(node: fx.Node) -> list:
    """``node`` and every node it is computed from, each once."""
    seen, stack, order = set(), [node], []
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            order.append(n)
            stack.extend(n.all_input_nodes)
    return order


def _inputs_of(node: fx.Node | None, placeholders: list) -> list:
    """The placeholders ``node`` derives from (all of them for a value the trace cannot place)."""
    if node is None:
        return list(placeholders)
    return [n for n in _ancestors(node) if n.op == "placeholder"]


def _layout_fact(example: torch.Tensor, symbolic: bool, where: str) -> Read:
    """The example's layout as a fact: its strides, or for symbolic sizes its dense order."""
    strides = tuple(example.stride())
    order = tuple(sorted(range(example.dim()), key=lambda d: (-strides[d], -d)))
    if symbolic and dense_strides(example.shape, order) == strides:
        return Read("dense", order, where)
    return Read("strides", strides, where)


def facts(reads: list, placeholders: list, examples: list) -> dict:
    """Placeholder index -> the layout facts (``Read``s) its module must check, from ``reads``.
    ``examples``: the real example tensor of each placeholder."""
    index = {p: i for i, p in enumerate(placeholders)}
    out: dict = {}
    for name, node, fmt, result, where in reads:
        if name == "storage_offset" and isinstance(result, torch.SymInt):
            raise FxtoolsError(
                f"the program reads a storage offset ({where}) of a tensor with sizes marked dynamic; its "
                "offset is then a symbol no generated code can read back. Mark that argument's sizes static "
                "(leave it out of dynamic_shapes), or compute without storage_offset()."
            )
        for p in _inputs_of(node, placeholders):
            i = index[p]
            symbolic = any(isinstance(s, torch.SymInt) for s in p.meta["val"].shape)
            if node is p and name == "is_contiguous":
                fact = Read("is_contiguous", (fmt, bool(result)), where)
            elif node is p and name == "storage_offset" and isinstance(result, int):
                fact = Read("storage_offset", (result,), where)
            else:
                fact = _layout_fact(examples[i], symbolic, where)
            found = [fact]
            if name == "as_strided":
                found.append(Read("storage_offset", (examples[i].storage_offset(),), where))
            for fact in found:
                if fact not in out.setdefault(i, []):
                    out[i].append(fact)
    return out
