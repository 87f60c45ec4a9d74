"""Scatters into a fresh tensor, printed in place: one allocation, no copy.

The graph stays functional (compilers, passes and ``fxtools.split`` see ``index_add(zeros, ...)``),
but an out-of-place scatter copies its first argument before writing into the copy. When that
argument is a tensor the code has just made for it (a fill such as ``torch.zeros_like(weight)``,
or a matmul's result) and nothing else reads it, the copy is wasted: for an embedding's gradient
it is a second pass over a vocabulary-sized table. Such a statement (also a scatter into the
result of another such scatter, ``index_put(index_add(zeros, ...), ...)``) is printed with the in-place
method on that tensor instead::

    grad_wte = torch.zeros_like(wte_weight).index_add_(0, idx, grad_rows)

ATen computes the out-of-place op as exactly this (a clone, then the in-place kernel), so the
printed code computes bit for bit what the graph says.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

import torch
import torch.fx as fx

_COUNTER = re.compile(r"^# COUNTER: (\d+)\n$")
_IN_PLACE: dict[Any, str] = {  # out-of-place scatters whose result has their first argument's shape and dtype
    torch.index_add: "index_add_",
    torch.index_copy: "index_copy_",
    torch.index_fill: "index_fill_",
    torch.index_put: "index_put_",
    torch.scatter: "scatter_",
    torch.scatter_add: "scatter_add_",
    torch.scatter_reduce: "scatter_reduce_",
}
_FRESH = {  # calls whose result is a new tensor that aliases none of their arguments
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
    torch.empty_like,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    operator.matmul,
    torch.matmul,
    torch.mm,
    torch.bmm,
    *_IN_PLACE,  # an out-of-place scatter's result is a copy
}
_FRESH_METHODS = {"new_zeros", "new_ones", "new_full", "new_empty"}


def printed_in_place(node: fx.Node) -> bool:
    """Whether ``node`` is a scatter into a fresh tensor, printed with the in-place method."""
    return node.op == "call_function" and node.target in _IN_PLACE and _into_fresh(node)


def in_place(nodes: list[fx.Node], statements: dict[int, str]) -> dict[int, str]:
    """The statements of ``nodes`` (by index) to print with the in-place method, rewritten."""
    out = {}
    for i, text in statements.items():
        node = nodes[i]
        if printed_in_place(node):
            new = _method_call(node, text)
            if new is not None:
                out[i] = new
    return out


def in_place_body(body: list[str], nodes: list[fx.Node]) -> list[str]:
    """fx's own body lines (``# COUNTER: i`` before node ``i``'s statement) with ``in_place``'s rewrites."""
    statements = {}
    for k, piece in enumerate(body[:-1]):
        m = _COUNTER.match(piece)
        if m:
            statements[int(m.group(1))] = k + 1
    new = in_place(nodes, {i: body[k] for i, k in statements.items()})
    body = list(body)
    for i, text in new.items():
        body[statements[i]] = text
    return body


def _into_fresh(node: fx.Node) -> bool:
    """``node``'s first argument is a fresh tensor of its shape and dtype that only it reads, once."""
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node) or not (
        (src.op == "call_function" and src.target in _FRESH) or (src.op == "call_method" and src.target in _FRESH_METHODS)
    ):
        return False
    if list(src.users) != [node]:
        return False
    flat = fx.node.map_arg((node.args[1:], node.kwargs), lambda a: a)
    if any(a is src for a in _leaves(flat)):
        return False
    a, b = src.meta.get("val"), node.meta.get("val")
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and tuple(a.shape) == tuple(b.shape)
        and a.device == b.device
    )


def _leaves(x):
    if isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    else:
        yield x


def _method_call(node: fx.Node, text: str) -> str | None:
    """``y = torch.index_add(t, 0, i, s)`` -> ``y = t.index_add_(0, i, s)`` (``text`` one statement)."""
    body = text.rstrip("\n")
    end = text[len(body) :]
    if "\n" in body:
        return None
    try:
        stmt = ast.parse(body.strip()).body[0]
    except SyntaxError:
        return None
    call = stmt.value if isinstance(stmt, ast.Assign) else None
    if not isinstance(call, ast.Call) or not call.args or len(call.args) + len(call.keywords) < 2:
        return None
    indent = body[: len(body) - len(body.lstrip())]
    line = body.strip()
    first = call.args[0]
    receiver = ast.get_source_segment(line, first)
    if receiver is None:
        return None
    if not isinstance(first, (ast.Name, ast.Call, ast.Attribute, ast.Subscript)):
        receiver = f"({receiver})"
    rest = line[first.end_col_offset :].lstrip()
    if not rest.startswith(","):
        return None
    targets = line[: call.col_offset]
    return f"{indent}{targets}{receiver}.{_IN_PLACE[node.target]}({rest[1:].lstrip()}{end}"
