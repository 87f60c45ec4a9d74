"""How a graph prints as Python: what ``gm.code`` looks like.

torch.fx's code generator is kept, with five changes made to the lines it writes:

- keyword arguments as PEP 8 writes them: ``stride=[1, 1]``, not ``stride = [1, 1]``;
- one statement per multi-output op, ``ln_1, mean, rstd = torch.native_layer_norm(...)``, with
  ``_`` for parts nothing reads, rather than a tuple variable and one ``x[i]`` line per part;
- frees where they matter. fx ends almost every line with ``;  x = None`` so that each tensor is
  freed right after its last use. Here the smallest values, together at most ``SLACK_BYTES``
  (from the shapes recorded on the graph; views share their base's storage; arguments and
  constants are held by the caller anyway), and values whose storage lives to the end anyway (an
  output's) are simply left alone, as a person writing the code would; every other value is freed
  after its last use with a ``del`` line. Only small programs (values peaking under
  ``SMALL_PROGRAM_BYTES``: examples, tests) keep small values so, and their peak memory can grow
  by at most ``SLACK_BYTES``; larger ones free every value fx frees except those whose storage
  lives to the end anyway, so their peak memory is exactly fx's;
- single-use cheap values named only by their op are written inside their user's expression
  (``fold.py``): the same ATen calls in the same order, the same frees, fewer lines;
- a scatter into a fresh tensor nothing else reads is written with the in-place method
  (``inplace.py``): ``torch.zeros_like(w).index_add_(0, i, rows)``, one allocation, no copy.
"""

from __future__ import annotations

import math
import operator
import re

import torch
import torch.fx as fx

from .fold import fold, folding
from .inplace import in_place

SLACK_BYTES = 64 * 1024  # at most this many bytes are kept alive longer than fx's frees would keep them
SMALL_PROGRAM_BYTES = 4 * 1024 * 1024  # ... and only by programs whose values peak below this
_COUNTER = re.compile(r"^# COUNTER: (\d+)\n$")
_FREE = re.compile(r"^;  (.*) = None\n$")


class ReadableCodeGen(fx.graph.CodeGen):
    """fx's code generator with PEP 8 keywords, unpacked multi-output ops, frees only where they
    matter and single-use cheap values folded into their users (``fold.py``; not in verbose code,
    ``print_readable``'s, which annotates every value, nor inside ``fold.flat()``)."""

    def __init__(self, frees: bool = True, fold: bool = True):
        super().__init__()
        self.frees, self.fold = frees, fold

    def _gen_python_code(self, nodes, root_module, namespace, **kwargs):
        node_list = list(nodes)
        folds = self.fold and folding() and not kwargs.get("verbose") and not kwargs.get("record_func")
        self._body_transformer = lambda body: _transform(body, node_list, self.frees, folds)
        try:
            return super()._gen_python_code(nodes, root_module, namespace, **kwargs)
        finally:
            self._body_transformer = None


def use_readable_code(graph: fx.Graph) -> None:
    """Print ``graph`` with ``ReadableCodeGen`` (unless it has a calling convention of its own)."""
    if type(graph._codegen) is fx.graph.CodeGen:
        graph.set_codegen(ReadableCodeGen())


def _transform(body: list[str], nodes: list[fx.Node], frees: bool, folds: bool) -> list[str]:
    """fx's body lines (``# COUNTER: i`` starts node ``i``'s) rewritten as the module docstring says."""
    chunks: list[tuple[int | None, list[str]]] = [(None, [])]
    for piece in body:
        m = _COUNTER.match(piece)
        if m:
            chunks.append((int(m.group(1)), [piece]))
        else:
            chunks[-1][1].append(piece)
    unpacked = _multi_output_nodes(nodes)
    parts_of = {g for parts in unpacked.values() for g in parts.values()}  # written by their op's statement
    freed: dict[int, list[str]] = {}
    for i, pieces in chunks:
        if i is None or nodes[i].op == "placeholder" or len(pieces) < 2:
            continue
        m = _FREE.match(pieces[-1])
        if m:
            freed[i] = [n for n in m.group(1).split(" = ") if n]
            pieces[-1] = "\n"
    by_name = {n.name: n for n in nodes}
    for names in freed.values():
        names[:] = [n for n in names if not (n in by_name and by_name[n] in unpacked)]  # the tuple variable is gone
    keep = _needed_frees(nodes, freed, by_name) if frees else {}
    statements = {
        i: _statement(nodes[i], pieces, unpacked)
        for i, pieces in chunks
        if i is not None and len(pieces) > 2 and nodes[i] not in parts_of
    }
    gone: set[int] = set()
    if folds:
        rewritten, gone = fold(nodes, statements, keep)
        statements.update(rewritten)
        names_gone = {nodes[i].name for i in gone}
        keep = {i: [n for n in names if n not in names_gone] for i, names in keep.items()}
    statements.update(in_place(nodes, statements))
    out = []
    for i, pieces in chunks:
        if i is None:
            out.extend(pieces)
        elif i in gone or nodes[i] in parts_of:
            out.append(pieces[0])  # written as part of another statement
        elif i in statements:
            out += [pieces[0], statements[i], pieces[-1]]
        else:
            out.extend(pieces)
        if i is not None and keep.get(i):
            out.append(f"del {', '.join(keep[i])}\n")
    return out


def _statement(node: fx.Node, pieces: list[str], unpacked: dict) -> str:
    """Node's statement as fx wrote it (``pieces``: its counter, its text, its end), with the
    parts of a multi-output op unpacked and keywords as PEP 8 writes them."""
    text = "".join(pieces[1:-1])
    if node in unpacked and text.startswith(f"{node.name} = "):
        parts = unpacked[node]
        size = max(parts) + 1 if parts else 0
        size = max(size, len(node.meta["val"]))
        targets = ", ".join(parts[k].name if k in parts else "_" for k in range(size))
        if size == 1:  # a one-element tuple (a cond with one output, a split into one chunk)
            targets = f"({targets},)"
        text = f"{targets} = " + text[len(node.name) + 3 :]
    if node.op in ("call_function", "call_method", "call_module"):
        text = _pep8_keywords(text)
    if node.target is operator.getitem and isinstance(node.args[1], tuple):
        text = _subscript_slices(text)
    if node.target is torch.ops.aten.index.Tensor:
        text = _INDEX.sub(_index_as_subscript, text)
    return text


_INDEX = re.compile(r"torch\.ops\.aten\.index\.Tensor\((\w+), \[(\w+(?:, \w+)*)\]\)$")


def _index_as_subscript(m: re.Match) -> str:
    """``torch.ops.aten.index.Tensor(x, [None, t])`` as ``x[:, t]``: the same values (PyTorch's
    ``x[:, t]`` with a 0-dim ``t`` selects a view where ``aten.index`` copies; the code never writes
    into it). The graph keeps ``aten.index``, which never reads ``t`` as a number."""
    entries = [":" if e == "None" else e for e in m.group(2).split(", ")]
    return f"{m.group(1)}[{', '.join(entries)}]"


_FULL_SLICE = "slice(None, None, None)"
_BOUND = r"(None|-?\d+)"
_SLICE = re.compile(rf"slice\({_BOUND}, {_BOUND}, {_BOUND}\)")
_COLONS = re.compile(r"-?\d*:-?\d*(:-?\d+)?")


def _slice_as_colons(m: re.Match) -> str:
    """``slice(0, None, 2)`` -> ``0::2`` (a step of 1 or None left out)."""
    start, end, step = ("" if v == "None" else v for v in m.groups())
    return f"{start}:{end}" + ("" if step in ("", "1") else f":{step}")


def _subscript_slices(text: str) -> str:
    """fx's ``x[(slice(None, None, None), t)]`` as Python writes it, ``x[:, t]`` (entries that are
    full slices or names only; anything else is left as fx wrote it)."""
    body = text.rstrip()
    start = body.find("[(")
    if start < 0 or not body.endswith(")]"):
        return text
    inside = _SLICE.sub(_slice_as_colons, body[start + 2 : -2].replace(_FULL_SLICE, ":"))
    entries = [e.strip() for e in inside.split(",")]
    entries = [e for e in entries if e]
    if not all(e == ":" or e.isidentifier() or _COLONS.fullmatch(e) for e in entries):
        return text
    return body[:start] + "[" + ", ".join(entries) + "]" + text[len(body) :]


def _multi_output_nodes(nodes) -> dict[fx.Node, dict[int, fx.Node]]:
    """Ops returning several tensors whose every use is one ``x[i]`` per part: ``{op: {i: part}}``."""
    found: dict[fx.Node, dict[int, fx.Node]] = {}
    for node in nodes:
        if node.op not in ("call_function", "call_method") or not isinstance(node.meta.get("val"), (tuple, list)):
            continue
        users = list(node.users)
        if not users or any(u.op != "call_function" or u.target is not operator.getitem or u.kwargs for u in users):
            continue
        parts: dict[int, fx.Node] = {}
        for u in users:
            k = u.args[1]
            if not isinstance(k, int) or k < 0 or k in parts:
                parts = {}
                break
            parts[k] = u
        if parts and max(parts) < len(node.meta["val"]):
            found[node] = parts
    return found


def _pep8_keywords(text: str) -> str:
    """``f(x, dim = 1)`` -> ``f(x, dim=1)``: the ``=`` of keyword arguments, those inside brackets
    and outside string literals (``_keyword_equals``)."""
    if " = " not in text or "\n" in text.rstrip("\n"):
        return text
    first = text.find(" = ")
    if text.find(" = ", first + 3) < 0 and not any(b in text[:first] for b in "([{"):
        return text  # the one " = " is the assignment's
    for col in reversed(_keyword_equals(text)):
        text = text[: col - 1] + "=" + text[col + 2 :]
    return text


def _keyword_equals(line: str) -> list[int]:
    """Columns of the `` = `` signs of one line of code that are inside brackets, outside string
    literals (a scan of the line: Python's ``tokenize`` took 1% of a GPT's build)."""
    found, depth, i, quote = [], 0, 0, ""
    while i < len(line):
        ch = line[i]
        if quote:  # inside a string literal: a backslash escapes the next character
            if ch == "\\":
                i += 2
                continue
            if line.startswith(quote, i):
                i, quote = i + len(quote), ""
                continue
        elif ch in "'\"":
            quote = line[i : i + 3] if line[i : i + 3] in ("'''", '"""') else ch
            i += len(quote)
            continue
        elif ch == "#":
            break  # a comment
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "=" and depth > 0 and line[i - 1 : i] == " " and line[i + 1 : i + 2] == " ":
            found.append(i)
        i += 1
    return found


def _bytes(val) -> int:
    """Bytes of ``val``, read without guarding on a symbolic size (``int(numel)`` would specialise a
    size marked dynamic to its example): its largest value, or, unbounded, a size large enough that
    the value is freed as fx frees it."""
    return math.prod(_largest(s) for s in val.shape) * val.element_size()


def _largest(size) -> int:
    if not isinstance(size, torch.SymInt):
        return int(size)
    try:
        return int(size.node.shape_env.bound_sympy(size.node.expr).upper)
    except Exception:  # noqa: BLE001 - unbounded, or an expression the shape environment cannot bound
        return SMALL_PROGRAM_BYTES


def _storages(nodes) -> dict:
    """node -> the node whose storage its value lives in: a view's is its input's (from the graph's
    structure and each value's ``_is_view()``, so equal graphs give equal answers)."""
    base: dict = {}
    for n in nodes:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        inputs = [a for a in n.all_input_nodes if a in base or isinstance(a.meta.get("val"), (tuple, list))]
        is_view = n.target is operator.getitem or n.op == "get_attr" or (_is_view(val) and inputs)
        base[n] = base.get(inputs[0], inputs[0]) if is_view and inputs else n
    return base


def _is_view(val) -> bool:
    try:
        return bool(val._is_view())
    except Exception:  # noqa: BLE001
        return False


def _needed_frees(nodes, freed: dict[int, list[str]], by_name) -> dict[int, list[str]]:
    """Of the frees fx would write (``freed``: node index -> names freed after it), those the code
    keeps: all but those of storages alive to the end anyway and, in small programs, of the
    smallest storages, together at most ``SLACK_BYTES``."""
    end = len(nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    storage_of = _storages(nodes)
    held = {n for n in storage_of.values() if n.op in ("placeholder", "get_attr") or n.target is getattr}
    for n, b in storage_of.items():  # arguments unpacked from a pytree: the caller keeps them
        if n.op == "call_function" and n.target is operator.getitem and any(a.op == "placeholder" for a in n.all_input_nodes):
            held.add(b)
    size: dict = {}
    for n, b in storage_of.items():
        size[b] = max(size.get(b, 0), _bytes(n.meta["val"]))
    free_at: dict[str, int] = {name: i for i, names in freed.items() for name in names}
    first: dict[object, int] = {}
    last: dict[object, int] = {}
    for n, key in storage_of.items():
        if key in held:
            continue
        first[key] = min(first.get(key, end), pos[n])
        last[key] = max(last.get(key, 0), free_at.get(n.name, end))
    events = sorted([(a, size[k]) for k, a in first.items()] + [(last[k] + 1, -size[k]) for k in first])
    live = peak = 0
    for _, b in events:
        live += b
        peak = max(peak, live)
    budget = SLACK_BYTES if peak <= SMALL_PROGRAM_BYTES else 0
    keep_storages = set()
    for key in sorted(first, key=lambda k: (size[k], pos[k])):
        if last[key] >= end:
            continue  # alive to the end anyway (an output's storage): its frees free nothing
        if size[key] <= budget:
            budget -= size[key]
        else:
            keep_storages.add(key)
    out = {}
    for i, names in freed.items():
        kept = [nm for nm in names if nm in by_name and storage_of.get(by_name[nm]) in keep_storages]
        if kept:
            out[i] = kept
    return out
