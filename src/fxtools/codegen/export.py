"""``save(gm, "file.py")``: a GraphModule as a standalone Python module that needs only torch.

The written module defines ``forward(*args)`` with the GraphModule's calling convention (the
pytree arguments are unpacked by indexing in the code itself, results are nested Python
structures), so ``import file; file.forward(params, x, y)`` gives what ``gm(params, x, y)``
gives, in an interpreter without fxtools.

Tensor constants the code reads (``self.bn1_running_mean``, ``self._tensor_constant0``) become
attributes of a module-level namespace: small ones are written as ``torch.tensor([...])``
literals, larger ones are stored with ``torch.save`` beside the module (``file.pt``) and loaded
relative to the module's ``__file__``. Buffers updated in place by the code (BatchNorm's running
statistics) are updated in that namespace, once per call, as the GraphModule updated its own.

The module's docstring documents the signature: argument names, the shape and dtype of every
tensor leaf, the structure of the result, and any fxtools metadata the GraphModule carries in
``gm.meta`` (such as a split into forward and backward and the tensors saved between them).
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import operator
import os
import re
import types
import unicodedata

import torch
import torch.fx as fx

from ..errors import FxtoolsError
from ..passes.inline import InlineError, inline_submodules
from ..signature.naming import identifier, is_plain_identifier, is_taken_name, literal, plain_literal
from ..signature.runtime import Guards
from . import guard_source
from .show import describe

__all__ = ["save", "ExportError", "EMBED_LIMIT"]

EMBED_LIMIT = 64  # constants with at most this many elements are written into the module as literals
GUARDS_MARKER = "# ---- What the functions above accept (fxtools guards: everything their code was specialised to) ----"
_RUNTIME_NAMES = ("InputMismatch", "Sym", "Leaf", "Node", "Guards", "_HOW", "_desc", "_got", "_same", "_equal")


class ExportError(FxtoolsError):
    """The GraphModule refers to something a standalone module cannot reproduce."""


# ---------------------------------------------------------------------------------------------
# Globals the generated code refers to
# ---------------------------------------------------------------------------------------------

_SPECIAL_GLOBALS = {
    "inf": "inf = float('inf')",
    "nan": "nan = float('nan')",
    "NoneType": "NoneType = type(None)",
    "device": "from torch import device",
}


def _import_line(name: str, obj) -> str:
    """The statement that binds ``name`` to ``obj`` in the written module."""
    if name in _SPECIAL_GLOBALS:
        return _SPECIAL_GLOBALS[name]
    if isinstance(obj, types.ModuleType):
        mod = obj.__name__
        _check_importable(mod, name)
        if mod == name:
            return f"import {mod}"
        if "." in mod:
            parent, _, attr = mod.rpartition(".")
            return f"from {parent} import {attr}" + (f" as {name}" if attr != name else "")
        return f"import {mod} as {name}"
    if isinstance(obj, torch.dtype):
        return f"{name} = {obj}"
    if isinstance(obj, (bool, int, float, complex, str)) or obj is None:
        return f"{name} = {_literal(obj)}"
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if (
        isinstance(mod, str)
        and all(map(is_plain_identifier, mod.split(".")))
        and is_plain_identifier(qual)
        and is_plain_identifier(name)
    ):
        _check_importable(mod, name)
        try:
            found = getattr(__import__(mod, fromlist=[qual]), qual)
        except (ImportError, AttributeError):
            found = None
        if found is obj:
            return f"from {mod} import {qual}" + (f" as {name}" if qual != name else "")
    raise ExportError(
        f"the generated code calls {obj!r} (as {name!r}), which is not part of torch or the standard "
        "library, so a standalone module cannot import it"
    )


def _check_importable(module: str, name: str) -> None:
    top = module.split(".")[0]
    if top in ("torch", "math", "operator", "builtins", "functools", "itertools", "collections", "typing"):
        return
    import sys

    if top in getattr(sys, "stdlib_module_names", ()):
        return
    raise ExportError(
        f"the generated code refers to module {module!r} (as {name!r}); a standalone "
        "module may only import torch and the standard library"
    )


def _literal(v) -> str:
    """Python source for a scalar, exact on reload (``float('inf')`` for infinities); a subclass
    of a built-in type is written as its built-in value, never with its own ``repr``."""
    return literal(plain_literal(v, "a constant"))


def _tensor_literal(t: torch.Tensor) -> str:
    t = t.detach()
    if t.numel() == 0:
        return f"torch.empty({list(t.shape)}, dtype={t.dtype})"
    if t.numel() > 1:
        first = t.reshape(-1)[0]
        if bool((t == first).all()):  # a constant fill (never true with NaNs)
            return f"torch.full({list(t.shape)}, {_literal(first.item())}, dtype={t.dtype})"
    data = t.tolist()

    def fmt(x):
        if isinstance(x, list):
            return "[" + ", ".join(fmt(v) for v in x) + "]"
        return _literal(x)

    return f"torch.tensor({fmt(data)}, dtype={t.dtype})"


# ---------------------------------------------------------------------------------------------
# The docstring: signature, shapes, metadata
# ---------------------------------------------------------------------------------------------


def _leaf_descriptions(placeholder: fx.Node) -> list[str]:
    """``params['fc1.weight']: f32[8, 4]`` for every leaf the code extracts from ``placeholder``."""
    own = describe(placeholder.meta.get("val"))
    if own and isinstance(placeholder.meta.get("val"), torch.Tensor):
        return [f"{placeholder.name}: {own}"]
    out = []

    def walk(node, text):
        getters = [
            u
            for u in node.users
            if u.op == "call_function" and u.args and u.args[0] is node and u.target in (operator.getitem, getattr)
        ]
        if not getters:
            desc = describe(node.meta.get("val"))
            if node is not placeholder and desc:
                out.append(f"{text}: {desc}")
            elif node is not placeholder:
                out.append(f"{text}: (not used)")
            return
        for u in getters:
            key = u.args[1]
            walk(u, f"{text}[{key!r}]" if u.target is operator.getitem else f"{text}.{key}")

    walk(placeholder, placeholder.name)
    return out


def _result_description(graph: fx.Graph) -> str:
    out = next(n for n in graph.nodes if n.op == "output")

    def fmt(a):
        if isinstance(a, fx.Node):
            return describe(a.meta.get("val")) or a.name
        if isinstance(a, tuple):
            inner = ", ".join(fmt(v) for v in a)
            return f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, list):
            return "[" + ", ".join(fmt(v) for v in a) + "]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {fmt(v)}" for k, v in a.items()) + "}"
        return repr(a)

    return fmt(out.args[0])


def _meta_lines(meta: dict) -> list[str]:
    """Readable lines for the JSON-like entries of ``gm.meta`` (fxtools' split / saved-tensor notes)."""
    lines = []
    for key in sorted(meta, key=str):
        value = meta[key]
        if not _plain(value):
            continue
        text = repr(value)
        if len(text) > 600:
            text = text[:600] + " ..."
        lines.append(f"    {key}: {text}")
    return lines


def _plain(v, depth=0) -> bool:
    if depth > 6:
        return False
    if type(v) in (type(None), bool, int, float, str):
        return True
    if type(v) in (list, tuple):
        return all(_plain(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(type(k) in (str, int) and _plain(x, depth + 1) for k, x in v.items())
    return False


# ---------------------------------------------------------------------------------------------
# Code: annotate with shapes, keep FX's frees
# ---------------------------------------------------------------------------------------------


def _annotate(src: str, graph: fx.Graph) -> str:
    by_name = {n.name: n for n in graph.nodes}
    lines = []
    for line in src.strip("\n").splitlines():
        m = re.match(r"\s+(\w+) = ", line)
        if m and m.group(1) in by_name:
            desc = describe(by_name[m.group(1)].meta.get("val"))
            if desc:
                line = f"{line}  # {desc}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _fresh_name(base: str, taken: set[str]) -> str:
    """``base`` (an identifier), suffixed until it is not in ``taken`` and shadows nothing."""
    name, i = base, 1
    while name in taken or is_taken_name(name):
        name, i = f"{base}_{i}", i + 1
    return name


def _get_attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _Function:
    """One function of the written module: a renamed copy of a GraphModule's graph and its code."""

    def __init__(self, gm: fx.GraphModule, fname: str, ns: str, values: dict, ids: dict):
        self.gm, self.fname = gm, fname
        # A copy of the graph whose get_attr targets are plain identifiers (``a.b`` becomes ``a_b``),
        # shared with the other functions of the module when they read the same tensor.
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        graph._codegen = gm.graph._codegen  # a pytree codegen (make_fx graphs) writes its own prologue
        try:  # submodules' forwards become ops of this graph
            inlined = inline_submodules(graph, gm)
        except InlineError as exc:
            raise ExportError(str(exc)) from None
        self.subfunctions: list[_Function] = []  # control flow's functions (cond's branches, scan's step)
        for node in graph.nodes:
            if node.op == "get_attr":
                value = inlined[node] if node in inlined else _get_attr(gm, node.target)
                if isinstance(value, fx.GraphModule) and id(value) not in ids:
                    flat = _fresh_name(identifier(node.target), set(values) | set(ids.values()) | {ns, "forward", "backward"})
                    ids[id(value)] = flat
                    self.subfunctions.append(_Function(value, flat, ns, values, ids))
                if id(value) not in ids:
                    base = re.sub(r"\W", "_", unicodedata.normalize("NFKC", node.target))
                    if base.startswith("__") or not base.isidentifier():  # no name mangling in the class body
                        base = "c" + identifier(base)
                    flat = _fresh_name(base, set(values) | {ns})
                    ids[id(value)] = flat
                    values[flat] = value
                node.target = ids[id(value)]
        from .render import check_code_data

        check_code_data(graph)  # no text from user data but identifiers and literals
        self.graph = graph
        code = graph.python_code(root_module=ns)
        # FX always writes ``def forward(self, ...)``; the standalone function has no self.
        src, n_sub = re.subn(r"def forward\(self(, )?", f"def {fname}(", code.src, count=1)
        if n_sub != 1:
            raise ExportError("unexpected code layout: no `def forward(self, ...)` line")
        self.src, self.globals = src, code.globals
        guards = getattr(gm, "guards", None)  # fxtools.signature.guards: written after the code, checked first
        self.guards = guards if isinstance(guards, Guards) else None
        self.accepts = None

    def check_first(self, accepts: str) -> None:
        """Make the function's first line check its arguments against ``accepts`` (its guards)."""
        self.accepts = accepts
        names = self.parameters()  # as the def line spells them: a node's name may differ (``InputMismatch``)
        line = f"    {accepts}.check(({', '.join(names)}{',' if len(names) == 1 else ''}))"
        m = re.search(rf"^def {self.fname}\(.*\):[^\n]*$", self.src, flags=re.M)
        if m is None:
            raise ExportError(f"unexpected code layout: no `def {self.fname}(...)` line")
        self.src = self.src[: m.end()] + "\n" + line + self.src[m.end() :]

    def parameters(self) -> list[str]:
        """The names of the function's parameters, as its ``def`` line spells them."""
        tree = ast.parse(self.src)
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
        args = fn.args
        return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]

    def doc(self) -> list[str]:
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        lines = [
            f"{self.fname}({', '.join(n.name for n in placeholders)})",
            "",
            "Arguments (tensor leaves, as the code indexes them):",
        ]
        for ph in placeholders:
            lines += [f"    {d}" for d in _leaf_descriptions(ph)] or [f"    {ph.name}: (not a tensor)"]
        lines += ["", "Returns:", f"    {_result_description(self.graph)}"]
        meta = _meta_lines(getattr(self.gm, "meta", {}) or {})
        if meta:
            lines += ["", "Metadata:"] + meta
        return lines


def _subfunctions(functions: list[_Function]) -> list[_Function]:
    """The functions of control flow the ``functions`` call, innermost first."""
    found: list[_Function] = []
    for fn in functions:
        found += _subfunctions(fn.subfunctions) + fn.subfunctions
    return found


def _functions_of(obj):
    """``[(name, GraphModule)]`` and extra docstring lines for a GraphModule or an ``fxtools.split``."""
    if isinstance(obj, fx.GraphModule):
        return [("forward", obj)], []
    if all(hasattr(obj, a) for a in ("forward", "backward", "saved", "report")):  # fxtools.Split
        report = str(obj.report())
        notes = ["forward(*inputs) -> (out, saved); backward(*saved, *cotangents) -> grads", "", *report.rstrip().splitlines()]
        return [("forward", obj.forward), ("backward", obj.backward)], notes
    raise TypeError(f"save takes a GraphModule or an fxtools.split result, not {type(obj).__name__}")


def save(gm, path, *, embed_limit: int = EMBED_LIMIT, name: str | None = None) -> str:
    """Write ``gm`` as a standalone module at ``path``; returns the module's source.

    The module imports only torch and the standard library and defines ``forward(*args)``,
    called as ``gm`` is. For the result of ``fxtools.split`` it defines ``forward`` and
    ``backward`` and its docstring lists the saved tensors. Constants with more than
    ``embed_limit`` elements go to a ``.pt`` file next to it (same stem), loaded with
    ``torch.load(..., weights_only=True)`` at import.
    """
    path = os.fspath(path)
    if not path.endswith(".py"):
        raise ValueError(f"save writes a Python module; the path must end in .py, not {path!r}")
    pairs, notes = _functions_of(gm)
    taken = _taken_names(pairs)
    ns = _fresh_name("constants", taken)
    values: dict = {}  # the constants the functions read, filled as they are written
    ids: dict = {}
    functions = [_Function(g, fname, ns, values, ids) for fname, g in pairs]
    for fn in functions:
        if fn.guards is not None:
            accepts = _fresh_name(f"{fn.fname}_accepts", taken | {ns})
            taken.add(accepts)
            fn.check_first(accepts)
    module = _Module(path, name, notes, ns, functions, _subfunctions(functions), values, _stored(values, embed_limit))
    text = module.text()
    compile(text, path, "exec")  # fail here, not at import, if anything is off
    if module.stored:
        torch.save({t: v.detach().clone() for t, v in module.stored.items()}, path[:-3] + ".pt")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return text


def _taken_names(pairs) -> set[str]:
    """Names the module's top level already uses: nodes, parameters, functions, imports, the guards' runtime."""
    return (
        {n.name for _, g in pairs for n in g.graph.nodes}
        | {str(n.target) for _, g in pairs for n in g.graph.nodes if n.op == "placeholder"}  # the def line's names
        | {"torch", "os", "math", "dataclasses"}
        | {f for f, _ in pairs}
        | set(_RUNTIME_NAMES)
    )


def _stored(values: dict, embed_limit: int) -> dict:
    """The constants too big to embed as literals (they go to the ``.pt`` file); every constant
    must be a dense tensor."""
    stored = {}
    for target, value in values.items():
        if isinstance(value, torch.nn.Parameter):
            value = value.detach()
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"attribute {target!r} is a {type(value).__name__}, not a tensor")
        if value.layout != torch.strided or value.is_quantized:
            raise ExportError(f"attribute {target!r} has layout {value.layout}; only dense tensors are supported")
        if value.numel() > embed_limit:
            stored[target] = value
    return stored


@dataclasses.dataclass
class _Module:
    """One standalone module as ``save`` writes it: docstring, imports, the class holding its
    constants, its functions, then the guards' checking code."""

    path: str
    name: str | None
    notes: list
    ns: str  # the name of the constants' class
    functions: list
    subfunctions: list  # control flow's functions
    values: dict  # every constant, by attribute name
    stored: dict  # the constants written to the .pt file

    @property
    def guarded(self) -> list:
        return [fn for fn in self.functions if fn.guards is not None]

    def text(self) -> str:
        parts = [f'"""{self.docstring()}\n"""', "\n".join(self.imports()), ""]
        parts += self.constants()
        for fn in [*self.subfunctions, *self.functions]:
            parts.append("")
            parts.append(_annotate(fn.src, fn.graph))
        if self.subfunctions:  # the code reads control flow's functions as it reads constants
            parts += ["", ""] + [f"{self.ns}.{fn.fname} = {fn.fname}" for fn in self.subfunctions]
        if self.guarded:
            parts += ["", GUARDS_MARKER, "", "", guard_source.runtime_source(), ""]
            for fn in self.guarded:
                parts += ["", f"{fn.accepts} = {guard_source.render(fn.guards)}"]
            parts.append("")
        return "\n".join(parts)

    def imports(self) -> list[str]:
        """torch (and os, dataclasses when needed), then what the functions' code refers to."""
        imports = ["import os", "import torch"] if self.stored else ["import torch"]
        if self.guarded:
            imports.insert(0, "import dataclasses")
        for fn in self.functions:
            for gname, obj in sorted(fn.globals.items()):
                if gname == "torch" or not re.search(rf"(?<![\w.]){re.escape(gname)}\b", fn.src):
                    continue
                line = _import_line(gname, obj)
                if line not in imports:
                    imports.append(line)
        return imports

    def docstring(self) -> str:
        """What the module holds, how its functions are called and what they check, the constants."""
        doc = [f"{self.name or 'Code generated by fxtools'}.", ""]
        if self.notes:
            doc += self.notes + [""]
        for fn in self.functions:
            doc += fn.doc() + [""]
        guarded = self.guarded
        if guarded:
            doc += [
                f"{', '.join(fn.fname for fn in guarded)} first check{'s' if len(guarded) == 1 else ''} "
                "that the arguments are what the code was made for (structure, sizes, dtypes, devices, "
                "Python values: the guards at the end of this file) and raise InputMismatch otherwise.",
                "",
            ]
        if self.values:
            doc += [
                "A snapshot: the tensors the program read from outside its arguments (parameters, closed-over",
                "tensors) are written here as they were; later changes to the originals are not seen.",
                f"Constants ({self.ns}.<name>): " + ", ".join(f"{t} {describe(v)}" for t, v in self.values.items()),
            ]
            if self.stored:
                doc += [f"stored in {os.path.basename(self.path)[:-3]}.pt beside this file (torch.save)"]
            doc += [""]
        doc += [f"Written {datetime.date.today().isoformat()} with torch {torch.__version__}; needs only torch to run."]
        return "\n".join(doc).replace('"""', "'''").replace("\\", "\\\\")

    def constants(self) -> list[str]:
        """The class holding the constants (literals, or loaded from the ``.pt`` file) and control flow's functions."""
        parts = []
        if self.stored:
            pt_name = os.path.basename(self.path)[:-3] + ".pt"
            parts.append(
                f"_stored = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), {pt_name!r}), weights_only=True)"
            )
            parts.append("")
        if self.values or self.subfunctions:
            what = (
                "tensor constants the code reads (buffers are updated in place)" if self.values else "functions of control flow"
            )
            parts += ["", f"class {self.ns}:", f'    """The {what}."""']
            for target, value in self.values.items():
                rhs = f"_stored[{target!r}]" if target in self.stored else _tensor_literal(value)
                parts.append(f"    {target} = {rhs}")
            if self.stored:
                parts.append("\n\ndel _stored")
            parts.append("")
        return parts
