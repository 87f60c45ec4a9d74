"""``show(gm)``: a GraphModule's code with the shape and dtype of every value as a comment.

The shapes come from ``node.meta["val"]``, which ``torch.save`` does not keep. So that a saved
GraphModule can still be shown with shapes, fxtools' transforms also record its example inputs
as shape-only (``meta``) tensors in the attribute ``gm.fxtools_inputs`` (``remember_inputs``),
which pickling keeps (and in ``gm.meta``, which ``copy.deepcopy`` keeps); ``propagate_shapes`` runs the graph on FakeTensors of those (or of any
example arguments) to fill the metadata in again.
"""

from __future__ import annotations

import operator
import re
import sys

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

INPUTS_ATTR = "fxtools_inputs"

_SHORT = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def describe(val) -> str | None:
    """``f32[8, 16]`` for a tensor, ``(f32[8], i64[8])`` for a tuple of them, None otherwise."""
    if isinstance(val, torch.Tensor):
        from ..signature.sizes import size_text  # symbolic sizes by their Dim's name: f32[batch, 16]

        return f"{_SHORT.get(val.dtype, str(val.dtype).replace('torch.', ''))}[{', '.join(map(size_text, val.shape))}]"
    if isinstance(val, (tuple, list)):
        parts = [describe(v) or "-" for v in val]
        return f"({', '.join(parts)})"
    return None


def annotated_code(gm: fx.GraphModule) -> str:
    """``gm.code`` with ``# f32[8, 16]`` after every assignment (and the inputs' shapes up front)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    lines = []
    for line in gm.code.strip("\n").splitlines():
        if re.match(r"\s+del \w", line):
            continue  # freeing memory early is for running, not reading
        m = re.match(r"\s+\(?(\w+(?:, \w+)*),?\)? = ", line)
        names = m.group(1).split(", ") if m else []
        if names and any(n in by_name for n in names):
            descs = [describe(by_name[n].meta.get("val")) if n in by_name else "-" for n in names]
            if all(descs):
                line = f"{line.split(';  ')[0]}  # {', '.join(d or '-' for d in descs)}"
        elif line.lstrip().startswith("def forward"):
            inputs = [
                f"{n.name}: {describe(n.meta.get('val'))}"
                for n in gm.graph.nodes
                if n.op == "placeholder" and describe(n.meta.get("val"))
            ]
            if inputs:
                lines.append(line)
                line = "    # " + ", ".join(inputs)
        else:
            line = line.split(";  ")[0]
        lines.append(line)
    return "\n".join(lines) + "\n"


def show(gm: fx.GraphModule, file=None) -> None:
    """Print ``gm``'s code with the shape and dtype of each value as a trailing comment.

    The ``x = None`` bookkeeping that FX adds to free memory is left out for reading. The
    functions of control flow (``torch.cond``'s branches, ``scan``'s step: ``self.<name>``)
    follow, each under a ``# self.<name>:`` line.
    """
    print(annotated_code(gm) + _subgraph_code(gm), file=file or sys.stdout)


def _subgraph_code(gm: fx.GraphModule, prefix: str = "self.") -> str:
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    text = ""
    for name, sub in gm.named_children():
        if isinstance(sub, fx.GraphModule) and name in read:
            text += f"\n# {prefix}{name}:\n" + annotated_code(sub) + _subgraph_code(sub, f"{prefix}{name}.")
    return text


# ---------------------------------------------------------------------------------------------
# Shapes that survive torch.save
# ---------------------------------------------------------------------------------------------


def _example_of(node: fx.Node):
    """A shape-only stand-in for the value of ``node``, from its metadata and the items read from it."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    items = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[0] is node]
    if items:  # a dict stands in for any container the code only indexes
        return {u.args[1]: _example_of(u) for u in items}
    return None  # a Python value (specialised in the code) or an unused argument


def remember_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """Record ``gm``'s example arguments as meta tensors in ``gm.fxtools_inputs``.

    torch.save keeps the attribute; copy.deepcopy keeps only ``gm.meta``, so they go there too.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = tuple(_example_of(p) for p in placeholders)
    setattr(gm, INPUTS_ATTR, inputs)
    gm.meta[INPUTS_ATTR] = inputs
    return gm


def recorded_inputs(gm: fx.GraphModule):
    """The example arguments ``remember_inputs`` recorded, or None."""
    found = getattr(gm, INPUTS_ATTR, None)
    return found if found is not None else (getattr(gm, "meta", None) or {}).get(INPUTS_ATTR)


class _ShapeProp(fx.Interpreter):
    """Runs a graph on FakeTensors and stores each value in ``node.meta['val']``."""

    def __init__(self, gm, mode):
        super().__init__(gm)
        self.mode, self.constants = mode, {}

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor):  # a fake copy: in-place buffer updates leave the real one alone
            value = self.constants.setdefault(target, self.mode.from_tensor(value))
        return value

    def run_node(self, node):
        result = super().run_node(node)
        if node.op != "output" and any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(result)):
            node.meta["val"] = result
        return result


def propagate_shapes(gm: fx.GraphModule, *args) -> fx.GraphModule:
    """Fill ``node.meta['val']`` by running ``gm`` on FakeTensors shaped like ``args``.

    Without ``args``, the example inputs recorded in ``gm.fxtools_inputs`` are used. Tensors may
    be real, fake or on the ``meta`` device; nothing is computed.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not args:
        args = recorded_inputs(gm)
        if args is None:
            raise ValueError("the GraphModule records no example inputs (gm.fxtools_inputs); pass example arguments")
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(v):
        if not isinstance(v, torch.Tensor):
            return v
        if v.device.type == "meta":
            with mode:
                return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
        return mode.from_tensor(v)

    fakes = pytree.tree_map(fake, tuple(args))
    with mode:
        _ShapeProp(gm, mode).run(*fakes)
    return gm
