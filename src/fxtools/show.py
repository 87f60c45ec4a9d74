"""``show(gm)``: a GraphModule's code with the shape and dtype of every value as a comment."""
from __future__ import annotations

import re
import sys

import torch
import torch.fx as fx

_SHORT = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128"}


def describe(val) -> str | None:
    """``f32[8, 16]`` for a tensor, ``(f32[8], i64[8])`` for a tuple of them, None otherwise."""
    if isinstance(val, torch.Tensor):
        return f"{_SHORT.get(val.dtype, str(val.dtype).replace('torch.', ''))}[{', '.join(map(str, val.shape))}]"
    if isinstance(val, (tuple, list)):
        parts = [describe(v) or "-" for v in val]
        return f"({', '.join(parts)})"
    return None


def annotated_code(gm: fx.GraphModule) -> str:
    """``gm.code`` with ``# f32[8, 16]`` after every assignment (and the inputs' shapes up front)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    lines = []
    for line in gm.code.strip("\n").splitlines():
        m = re.match(r"\s+(\w+) = ", line)
        if m and m.group(1) in by_name:
            desc = describe(by_name[m.group(1)].meta.get("val"))
            if desc:
                line = f"{line.split(';  ')[0]}  # {desc}"
        elif line.lstrip().startswith("def forward"):
            inputs = [f"{n.name}: {describe(n.meta.get('val'))}" for n in gm.graph.nodes
                      if n.op == "placeholder" and describe(n.meta.get("val"))]
            if inputs:
                lines.append(line)
                line = "    # " + ", ".join(inputs)
        else:
            line = line.split(";  ")[0]
        lines.append(line)
    return "\n".join(lines) + "\n"


def show(gm: fx.GraphModule, file=None) -> None:
    """Print ``gm``'s code with the shape and dtype of each value as a trailing comment.

    The ``x = None`` bookkeeping that FX adds to free memory is left out for reading.
    """
    print(annotated_code(gm), file=file or sys.stdout)
